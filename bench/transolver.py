"""Strong scaling of the sharded Transolver on CPU: P=1 against P=2, one thread per rank.

What is measured (DESIGN.md section 7):

* ``sharded_nn.zoo.Transolver`` (unstructured, PhysicsNeMo layout): ``--points`` points
  (default 1,048,576), hidden 128, 4 layers, 8 heads, 32 slices, ``--mlp-ratio`` (default 2),
  functional input 3, embedding 3 (xyz), output 1, batch 1, float32.
* Forward (inference: ``eval()``, ``torch.no_grad()``) and forward + backward (loss: the output
  weighted by a fixed per-point pattern), on the plain model at P=1 and on the converted model
  at P=2 (points sharded, one fused all-reduce per block). Each rank generates only its own
  points (per-block seeds), so the global input is the same for both P and no rank of the
  sharded run holds the whole cloud.
* Time: one warm-up, then ``--iters`` timed iterations between barriers; an iteration's time is
  the slowest rank's; the median is reported. Speedup ``T1 / T2``, efficiency ``T1 / (2 T2)``.
* Memory: each rank's ``ru_maxrss`` after the forward phase and after the forward + backward
  phase, minus its value after imports, mesh and model creation; the maximum over ranks; ratio
  P=2 / P=1.
* Outputs checked: the global sums of the output and of the input gradient agree between P=1 and
  P=2 (relative 1e-4, float32 summation order differs).

Targets: speedup >= 1.8x and per-rank peak memory <= 0.55x (PASS / MISS; exit code 0 either way).

Run from the repository root on a quiet machine (the full size needs about 2 x the P=1 peak
memory printed by a ``--quick`` run scaled by 16, see the README)::

    python bench/transolver.py            # 1,048,576 points (long)
    python bench/transolver.py --quick    # 65,536 points, 2 iterations
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the spawned ranks

import argparse  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sharded_nn as snn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.*
from bench.user_env import launcher  # noqa: E402
from sharded_nn.zoo.transolver import Transolver  # noqa: E402
from sharded_nn.demo import PeakRSS  # noqa: E402

SPEEDUP_TARGET = 1.8
MEM_RATIO_TARGET = 0.55
BLOCK = 4096  # points per seeded block of the generated input
SEED = 1234


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux (kept for callers)


def _points(start: int, stop: int, salt: int, channels: int) -> torch.Tensor:
    """Points ``[start, stop)`` of one global (1, N, channels) input, the same for every P."""
    parts = []
    for b in range(start // BLOCK, -(-stop // BLOCK)):
        g = torch.Generator().manual_seed(SEED + 1_000_003 * salt + b)
        parts.append(torch.randn(1, BLOCK, channels, generator=g))
    x = torch.cat(parts, 1)
    off = (start // BLOCK) * BLOCK
    return x[:, start - off : stop - off].contiguous()


def _worker(points: int, iters: int, mlp_ratio: int) -> dict:
    mesh = snn.init_mesh(device_type="cpu")
    group = snn.domain_group(mesh)
    ring = snn.comm.domain_peers(mesh)
    torch.manual_seed(0)
    model = Transolver(functional_dim=3, out_dim=1, embedding_dim=3, n_layers=4, n_hidden=128, n_head=8,
                       slice_num=32, mlp_ratio=mlp_ratio)  # fmt: skip
    if ring.size > 1:
        model = snn.convert(model, mesh, strict=True)
    sl = snn.Layout.balanced(points, ring.size).slice(ring.index)
    emb, fx, weight = (_points(sl.start, sl.stop, s, c) for s, c in ((0, 3), (1, 3), (2, 1)))
    fx.requires_grad_()
    # Peak above the resident memory now (the high-water mark reset; ru_maxrss growth would start
    # at the mark inherited from the launching parent and undercount).
    peak = PeakRSS()

    def timed(step) -> tuple[float, torch.Tensor]:
        step()
        times = []
        for _ in range(iters):
            dist.barrier(group)
            t0 = time.perf_counter()
            out = step()
            dist.barrier(group)
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return statistics.median(t.tolist()), out

    def forward() -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            return model(fx, embedding=emb)

    def train_step() -> torch.Tensor:
        model.train()
        fx.grad = None
        model.zero_grad(set_to_none=True)
        out = model(fx, embedding=emb)
        (out * weight).sum().backward()
        return out.detach()

    t_fwd, out_fwd = timed(forward)
    mem_fwd = peak.mib()
    del out_fwd
    t_bwd, out = timed(train_step)
    mem_bwd = peak.mib()
    mem = torch.tensor([mem_fwd, mem_bwd], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=group)
    sums = torch.tensor([out.double().sum().item(), fx.grad.double().sum().item()], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    return {"fwd": t_fwd, "bwd": t_bwd, "mem_fwd": mem[0].item(), "mem_bwd": mem[1].item(),
            "out_sum": sums[0].item(), "dx_sum": sums[1].item()}  # fmt: skip


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * (abs(a) + abs(b) + 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=1_048_576)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--mlp-ratio", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="65,536 points, 2 iterations")
    parser.add_argument(
        "--env", choices=("launch", "user"), default="launch",
        help="launch: P=1 and P=2 under snn.launch (the split alone); user: P=1 plain torch in a fresh default "
        "process, P=2 under torchrun in the default environment (bench/user_env.py)",
    )
    args = parser.parse_args()
    launch = launcher(args.env)
    if args.quick:
        args.points, args.iters = 65_536, 2
    r1 = launch(_worker, 1, args.points, args.iters, args.mlp_ratio, threads=1, device_type="cpu", timeout=7200)
    r2 = launch(_worker, 2, args.points, args.iters, args.mlp_ratio, threads=1, device_type="cpu", timeout=7200)
    ok = _same(r1["out_sum"], r2["out_sum"]) and _same(r1["dx_sum"], r2["dx_sum"])
    print(f"Transolver, {args.points} points, hidden 128, 4 layers, 8 heads, 32 slices, mlp_ratio {args.mlp_ratio}, "
          "float32, 1 thread per rank")  # fmt: skip
    print("| pass | T1 (s) | T2 (s) | speedup | efficiency | mem P=1 (MiB) | mem P=2 (MiB) | mem ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, t, m in (("forward", "fwd", "mem_fwd"), ("fwd+bwd", "bwd", "mem_bwd")):
        speedup, ratio = r1[t] / r2[t], r2[m] / max(r1[m], 1e-9)
        sp = "PASS" if speedup >= SPEEDUP_TARGET else "MISS"
        mr = "PASS" if ratio <= MEM_RATIO_TARGET else "MISS"
        print(f"| {name} | {r1[t]:.3f} | {r2[t]:.3f} | {speedup:.2f}x {sp} | {speedup / 2:.0%} | {r1[m]:.0f} | "
              f"{r2[m]:.0f} | {ratio:.2f}x {mr} |")  # fmt: skip
    print(f"outputs P=1 == P=2: {'yes' if ok else 'NO'} (sum out {r1['out_sum']:.6e} / {r2['out_sum']:.6e}, "
          f"sum d fx {r1['dx_sum']:.6e} / {r2['dx_sum']:.6e})")  # fmt: skip


if __name__ == "__main__":
    main()
