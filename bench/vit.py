"""Strong scaling of timm ViTs at high resolution: plain timm at P=1 against sharded at P=2.

What is measured (DESIGN.md section 7):

* ``vit_small_patch16_224`` and ``vit_tiny_patch16_224`` built at ``--sizes`` (default 1024^2 and
  2048^2: 4096 and 16384 patch tokens) by ``sharded_nn.zoo.create_model``, float32, batch 1,
  eval mode. ``forward``: ``torch.no_grad()`` logits. ``fwd+bwd``: logits, the sum of the logits
  weighted by a fixed pattern, backward into the parameters and the image.
* P=1 runs timm's own model (``mesh=None``: timm's fused attention); P=2 runs the converted model
  (ring attention) on two processes, each given only its patch-aligned slab of rows. Both are
  launched with ``sharded_nn.launch(fn, P, threads=1)`` (``OMP_NUM_THREADS=1``) and build the
  same weights from the same seed. Both therefore run on the same allocator (``launch``'s host
  cache, huge pages and mmap threshold): the ratio is the domain split's alone.
  ``bench/torchrun_env.py`` measures against plain torch in a user's default environment.
* Time: ``--warmup`` untimed iterations (default 1), then ``--iters`` timed iterations between
  barriers; an iteration's time is the slowest rank's; the median is reported. Speedup
  ``T1 / T2``. ``--repeat R`` launches P=1 and P=2 alternately R times (the medians are then over
  all R x iters iterations, and the spread of the per-launch ratios is printed), so that a slow
  phase of the machine does not land on one side only.
* Memory: each rank's peak resident size (``VmHWM``, reset by ``sharded_nn.demo.PeakRSS``)
  during one untimed steady-state step after the timed ones, minus its value just before that step
  (weights are replicated and not counted; the host cache is emptied first, so the step maps its
  buffers afresh), maximum over ranks; ratio P=2 / P=1. Until session 23 the baseline was taken
  before the first call, which added the library code that call pages in (about 13 MiB of
  file-backed pages at every P, shared between the ranks' processes) to the small forward peaks.
  ``alloc``: the peak of the bytes held by malloc (glibc ``mallinfo2``) and by the host cache
  (``sharded_nn.host_cache``, which serves tensors of 256 KiB and more in ``launch``'s ranks),
  sampled after every aten op during the first warm-up iteration, above their value at its start, maximum over
  ranks. It counts the tensors a step holds, and not what resident size adds to them (library
  code paged in by a first call, allocator slack), which is a fixed few tens of MiB per process
  and dominates the small forward-only peaks.
* Host ceiling (``--ceiling``): one more launch per repeat runs P=1's plain timm step on two
  processes at once, each on the whole image and without communication (with ``--env user`` both
  in P=1's environment). ``host ceiling`` = 2 T1 / T1(two at once): the speedup a P=2 run that
  split the work perfectly and paid nothing for it would reach on this host, where two busy
  processes slow each other down (shared caches, memory bandwidth, clock); ``of ceiling`` =
  speedup / host ceiling. (Session 48: two plain vit_tiny 1024^2 training steps at once took
  about 5% longer each than one alone, so the ceiling there is about 1.9x.)
* Consistency: the P=2 logits (replicated) and the global sum of the image gradient must match
  P=1 (relative 1e-3: float32 with different summation orders).

Targets at 1024^2: speedup >= 1.8x and memory ratio <= 0.55x (PASS / MISS; exit code 0).

    python bench/vit.py --sizes 1024    # about 10 minutes on 2 idle cores
    python bench/vit.py --sizes 2048 --iters 1 --warmup 1   # about an hour (see the README)
    python bench/vit.py --quick         # 256^2, tiny model, 1 iteration: a smoke run
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the spawned ranks

import argparse  # noqa: E402
import ctypes  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sharded_nn as snn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.*
from bench.user_env import launcher  # noqa: E402
from sharded_nn.demo import PeakRSS  # noqa: E402
from sharded_nn.host_memory import AUTO, parse_mmap_threshold  # noqa: E402
from sharded_nn import zoo  # noqa: E402
from sharded_nn import host_cache  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

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


class _MallinfoPeak(TorchDispatchMode):
    """Peak of the bytes held by malloc (``mallinfo2``: heap in use plus mmapped blocks), sampled
    after every aten op while active, above the value at entry; None where glibc lacks it."""

    class _Info(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    def __init__(self) -> None:
        super().__init__()
        try:
            self._fn = ctypes.CDLL("libc.so.6").mallinfo2
            self._fn.restype = self._Info
        except (OSError, AttributeError):
            self._fn = None
        self.base = self.peak = self._used()

    def _used(self) -> int:
        # Tensors of 256 KiB and more bypass malloc under the host cache: count its live bytes.
        cached = host_cache.stats()["live_bytes"]  # zero when the cache is not installed
        if self._fn is None:
            return cached
        m = self._fn()
        return m.uordblks + m.hblkhd + cached

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self._used())
        return out

    def mib(self) -> float | None:
        return None if self._fn is None else (self.peak - self.base) / 2**20


def _worker(name: str, size: int, iters: int, depth: int | None, warmup: int = 1, independent: bool = False) -> dict:
    """One launch's measurements. ``independent``: every rank runs plain timm on the whole image
    at the same time as the others, without talking to them (the host's ceiling, ``--ceiling``)."""
    p = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = snn.init_mesh(device_type="cpu") if p > 1 and not independent else None
    kwargs = {} if depth is None else {"depth": depth}
    torch.manual_seed(0)
    model = zoo.create_model(name, mesh=mesh, img_size=size, **kwargs).eval()
    if mesh is None:
        group, lo, hi = (dist.group.WORLD if p > 1 else None), 0, size
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
        # (Independent ranks hold whole models: ``mesh`` is None and nothing is shared.)
        (snn.losses.share(loss, mesh) if mesh is not None else loss).backward()
        return out.detach(), xi.grad

    result = {}
    for mode, step in (("forward", fwd), ("fwd+bwd", fwd_bwd)):
        alloc = None
        for i in range(warmup):
            if i == 0:
                with _MallinfoPeak() as track:
                    step()
                alloc = track.mib()
            else:
                step()
        times = []
        for _ in range(iters):
            barrier()
            t0 = time.perf_counter()
            out = step()
            barrier()
            times.append(time.perf_counter() - t0)
        # The memory of a steady-state step, on its own untimed step after the timed ones: the
        # library code a first call pages in (about 13 MiB of file-backed pages, the same at
        # every P, shared between ranks) is resident by then, as in any run longer than one
        # step. PeakRSS returns the host cache's blocks to the OS first, so this step maps its
        # buffers afresh and its whole peak counts. After the timed steps, not before (until
        # session 47): steps right after the cache is emptied ran about 1.5% slower at P=2
        # (vit_tiny 1024^2 fwd+bwd 2.74-2.78 against 2.70 s), which no training loop pays.
        peak = PeakRSS()  # also resets VmHWM: spawn children inherit the parent's ru_maxrss
        barrier()
        step()
        peak_mib = peak.mib()
        t = torch.tensor(times, dtype=torch.float64)
        mem = torch.tensor([peak_mib, -1.0 if alloc is None else alloc], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=group)
        entry = {"times": t.tolist(), "mem": mem[0].item(), "alloc": None if mem[1] < 0 else mem[1].item()}
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


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{b / max(a, 1e-9):.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit_small_patch16_224", "vit_tiny_patch16_224"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--iters", "--steps", type=int, default=3, help="timed iterations per mode and launch")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per mode and launch (>= 1 for alloc)")
    parser.add_argument("--repeat", type=int, default=1, help="launch P=1 and P=2 alternately this many times")
    parser.add_argument("--depth", type=int, default=None, help="override the depth (smoke runs)")
    parser.add_argument("--quick", action="store_true", help="256^2, vit_tiny, depth 2, 1 iteration")
    parser.add_argument("--mmap-threshold", type=parse_mmap_threshold, default=AUTO, help="glibc mmap threshold in the ranks: bytes, 'glibc' for glibc's own dynamic one, or 'auto' (default: sharded_nn.launch's; see host_memory.resolve_mmap_threshold)")
    parser.add_argument(
        "--ceiling", action="store_true",
        help="also launch P=1's plain timm on 2 processes at once, each on the whole image (no communication): "
        "the host's ceiling for P=2, 2 T1 / T1(2 at once)",
    )
    parser.add_argument(
        "--env", choices=("launch", "user"), default="launch",
        help="launch: P=1 and P=2 under snn.launch (the split alone); user: P=1 plain torch in a fresh default "
        "process, P=2 under torchrun in the default environment (bench/user_env.py)",
    )
    args = parser.parse_args()
    launch = launcher(args.env)
    if args.quick:
        args.models, args.sizes, args.iters, args.depth = ["vit_tiny_patch16_224"], [256], 1, 2
    rows = []
    for name in args.models:
        for size in args.sizes:
            runs: dict[int | str, list[dict]] = {1: [], 2: [], "ceiling": []}
            kinds = (1, 2, "ceiling") if args.ceiling else (1, 2)
            for rep in range(args.repeat):
                for kind in kinds:
                    t0 = time.perf_counter()
                    # The ceiling's ranks run as P=1 does (plain torch, in the user's environment
                    # the allocator of a process that never imported sharded_nn).
                    p, extra = (2, {"plain": True}) if kind == "ceiling" else (kind, {})
                    if args.env == "launch":
                        extra = {}  # launch's ranks all run in one environment anyway
                    runs[kind].append(launch(
                        _worker, p, name, size, args.iters, args.depth, args.warmup, kind == "ceiling",
                        threads=1, device_type="cpu", timeout=7200, mmap_threshold=args.mmap_threshold, **extra,
                    ))
                    print(f"[{name} {size}^2 {kind if kind == 'ceiling' else f'P={kind}'} launch {rep + 1}/{args.repeat}: "
                          f"{time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
            for mode in ("forward", "fwd+bwd"):
                one, two = [r[mode] for r in runs[1]], [r[mode] for r in runs[2]]
                a = one[0]
                ok = all(_close(y["logits"], a["logits"]) for y in two)
                if mode == "fwd+bwd":
                    ok = ok and all(abs(a["gsum"] - y["gsum"]) <= 1e-3 * (1 + abs(a["gsum"])) for y in two)
                t1 = statistics.median(t for r in one for t in r["times"])
                t2 = statistics.median(t for r in two for t in r["times"])
                per_launch = [statistics.median(x["times"]) / statistics.median(y["times"]) for x, y in zip(one, two)]
                mem1, mem2 = max(r["mem"] for r in one), max(r["mem"] for r in two)
                al1 = None if any(r["alloc"] is None for r in one) else max(r["alloc"] for r in one)
                al2 = None if any(r["alloc"] is None for r in two) else max(r["alloc"] for r in two)
                both = [t for r in runs["ceiling"] for t in r[mode]["times"]]
                ceiling = 2 * t1 / statistics.median(both) if both else None
                rows.append((name, size, mode, t1, t2, per_launch, mem1, mem2, al1, al2, ok, ceiling))
    print("timm ViT, batch 1, float32, eval, 1 thread per rank: plain timm at P=1 vs sharded (ring) at P=2")
    ceil_head, ceil_rule = (" host ceiling | of ceiling |", " --- | --- |") if args.ceiling else ("", "")
    print(
        "| model | size | mode | T1 (s) | T2 (s) | speedup |" + ceil_head + " mem P=1 (MiB) | mem P=2 (MiB) | "
        "mem ratio | alloc P=1 (MiB) | alloc P=2 (MiB) | alloc ratio | P1 == P2 |"
    )
    print("| --- | --- | --- | --- | --- | --- |" + ceil_rule + " --- | --- | --- | --- | --- | --- | --- |")
    for name, size, mode, t1, t2, per_launch, mem1, mem2, al1, al2, ok, ceiling in rows:
        speedup = t1 / t2
        sp = "PASS" if speedup >= SPEEDUP_TARGET else "MISS"
        # P=1's resident growth can be (about) nothing where its allocator kept the step's memory
        # resident from before the step (``--env user``: glibc), and a ratio to it means nothing.
        mem_cell = "n/a"
        if mem1 >= 1:
            ratio = mem2 / mem1
            mem_cell = f"{ratio:.2f}x {'PASS' if ratio <= MEM_RATIO_TARGET else 'MISS'}"
        spread = "" if len(per_launch) < 2 else f" ({min(per_launch):.2f}-{max(per_launch):.2f})"
        al = "n/a" if al1 is None else f"{al1:.0f}"
        bl = "n/a" if al2 is None else f"{al2:.0f}"
        # Not written as "N.NNx": the report's parser takes a row's first such number as its speedup.
        ceil = "" if ceiling is None else f" {ceiling:.2f} | {100 * speedup / ceiling:.0f}% |"
        print(
            f"| {name} | {size}^2 | {mode} | {t1:.3f} | {t2:.3f} | {speedup:.2f}x{spread} {sp} |{ceil} "
            f"{mem1:.0f} | {mem2:.0f} | {mem_cell} | {al} | {bl} | {_ratio(al1, al2)} | {'yes' if ok else 'NO'} |"
        )


if __name__ == "__main__":
    main()
