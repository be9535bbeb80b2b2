"""Strong scaling of timm ViTs at high resolution: plain timm at P=1 against sharded at P=2.

What is measured (DESIGN.md section 7):

* ``vit_small_patch16_224`` and ``vit_tiny_patch16_224`` built at ``--sizes`` (default 1024^2 and
  2048^2: 4096 and 16384 patch tokens) by ``sharded_nn.zoo.create_model``, float32, batch 1,
  eval mode. ``forward``: ``torch.no_grad()`` logits. ``fwd+bwd``: logits, the sum of the logits
  weighted by a fixed pattern, backward into the parameters and the image.
* P=1 runs timm's own model (``mesh=None``: timm's fused attention); P=2 runs the converted model
  (ring attention) on two processes, each given only its patch-aligned slab of rows. Both are
  launched with ``sharded_nn.launch(fn, P, threads=1)`` (``OMP_NUM_THREADS=1``) and build the
  same weights from the same seed.
* Time: one warm-up iteration, then ``--iters`` timed iterations between barriers; an
  iteration's time is the slowest rank's; the median is reported. Speedup ``T1 / T2``.
* Memory: each rank's peak resident size (``VmHWM``, reset by
  ``sharded_nn.demo.PeakRSS``) after a mode's iterations minus its value
  after the model and the input were built (weights are replicated and not counted), maximum
  over ranks; ratio P=2 / P=1. ``forward`` is measured before ``fwd+bwd`` in each launch.
* Consistency: the P=2 logits (replicated) and the global sum of the image gradient must match
  P=1 (relative 1e-3: float32 with different summation orders).

Targets at 1024^2: speedup >= 1.8x and memory ratio <= 0.55x (PASS / MISS; exit code 0).

    python bench/vit.py                 # full run (tens of minutes on 2 cores)
    python bench/vit.py --quick         # 256^2, tiny model, 1 iteration: a smoke run
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the spawned ranks

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sharded_nn as snn  # noqa: E402
from sharded_nn.demo import PeakRSS  # noqa: E402
from sharded_nn import zoo  # noqa: E402

SPEEDUP_TARGET = 1.8
MEM_RATIO_TARGET = 0.55
SEED = 1234
PATCH = 16


def _rows(start: int, stop: int, size: int) -> torch.Tensor:
    """Image rows ``[start, stop)`` of the global (1, 3, size, size) input, the same for every P."""
    parts = []
    for r in range(start // PATCH, -(-stop // PATCH)):
        g = torch.Generator().manual_seed(SEED + r)
        parts.append(torch.randn(1, 3, PATCH, size, generator=g))
    return torch.cat(parts, 2)[:, :, start - (start // PATCH) * PATCH :][:, :, : stop - start].contiguous()


def _worker(name: str, size: int, iters: int, depth: int | None) -> dict:
    p = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = snn.init_mesh(device_type="cpu") if p > 1 else None
    kwargs = {} if depth is None else {"depth": depth}
    torch.manual_seed(0)
    model = zoo.create_model(name, mesh=mesh, img_size=size, **kwargs).eval()
    if mesh is None:
        group, lo, hi = None, 0, size
    else:
        group = snn.domain_group(mesh)
        sl = snn.local_slices((1, 3, size, size), mesh, dims=(2,), align=PATCH)[2]
        lo, hi = sl.start, sl.stop
    x = _rows(lo, hi, size)
    weight = torch.randn(1, model.num_classes, generator=torch.Generator().manual_seed(SEED - 1))

    def barrier():
        if group is not None:
            dist.barrier(group)

    def fwd():
        with torch.no_grad():
            return model(x)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out = model(xi)
        loss = (out * weight).sum()
        # Logits are replicated: each rank back-propagates its 1/P share (DESIGN.md section 3).
        (snn.losses.share(loss, mesh) if mesh is not None else loss).backward()
        return out.detach(), xi.grad

    result = {}
    peak = PeakRSS()  # VmHWM reset here: spawn children inherit the parent's ru_maxrss
    for mode, step in (("forward", fwd), ("fwd+bwd", fwd_bwd)):
        step()
        times = []
        for _ in range(iters):
            barrier()
            t0 = time.perf_counter()
            out = step()
            barrier()
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)
        mem = torch.tensor([peak.mib()], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=group)
        entry = {"time": statistics.median(t.tolist()), "mem": mem.item()}
        if mode == "forward":
            entry["logits"] = out
        else:
            gsum = torch.tensor([out[1].double().sum().item()], dtype=torch.float64)
            if group is not None:
                dist.all_reduce(gsum, group=group)
            entry["logits"], entry["gsum"] = out[0], gsum.item()
        result[mode] = entry
    return result


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs().max() <= 1e-3 * (1 + b.abs().max())).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "vit_tiny_patch16_224"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--depth", type=int, default=None, help="override the depth (smoke runs)")
    parser.add_argument("--quick", action="store_true", help="256^2, vit_tiny, depth 2, 1 iteration")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes, args.iters, args.depth = ["vit_tiny_patch16_224"], [256], 1, 2
    rows = []
    for name in args.models:
        for size in args.sizes:
            r1 = snn.launch(_worker, 1, name, size, args.iters, args.depth, threads=1, device_type="cpu", timeout=7200)
            r2 = snn.launch(_worker, 2, name, size, args.iters, args.depth, threads=1, device_type="cpu", timeout=7200)
            for mode in ("forward", "fwd+bwd"):
                a, b = r1[mode], r2[mode]
                ok = _close(b["logits"], a["logits"])
                if mode == "fwd+bwd":
                    ok = ok and abs(a["gsum"] - b["gsum"]) <= 1e-3 * (1 + abs(a["gsum"]))
                rows.append((name, size, mode, a, b, a["time"] / b["time"], b["mem"] / max(a["mem"], 1e-9), ok))
    print("timm ViT, batch 1, float32, eval, 1 thread per rank: plain timm at P=1 vs sharded (ring) at P=2")
    print("| model | size | mode | T1 (s) | T2 (s) | speedup | mem P=1 (MiB) | mem P=2 (MiB) | mem ratio | P1 == P2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, size, mode, a, b, speedup, ratio, ok in rows:
        sp = "PASS" if speedup >= SPEEDUP_TARGET else "MISS"
        mr = "PASS" if ratio <= MEM_RATIO_TARGET else "MISS"
        print(
            f"| {name} | {size}^2 | {mode} | {a['time']:.3f} | {b['time']:.3f} | {speedup:.2f}x {sp} | "
            f"{a['mem']:.0f} | {b['mem']:.0f} | {ratio:.2f}x {mr} | {'yes' if ok else 'NO'} |"
        )


if __name__ == "__main__":
    main()
