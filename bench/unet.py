"""Strong scaling of the zoo UNet on CPU: the plain model at P=1 against the sharded one at P=2.

What is measured (DESIGN.md section 7):

* Two cases, ``sharded_nn.zoo.UNet`` with ``channels=(16, 32, 64)`` (two halvings, GroupNorm,
  strided-conv down, transposed-conv up, one residual block per level), float32, batch 1:

  - ``unet3d``: ``UNet(3, 1, 1)`` on ``1 x 1 x 128^3``;
  - ``unet2d``: ``UNet(2, 1, 1)`` on ``1 x 1 x 1024 x 1792`` (the 3 km CONUS grid).

* P=1 runs the plain single-device model (what a user runs without sharded_nn); P=2 runs
  ``create_model(..., mesh=mesh)`` on two processes, the sample sharded along its first spatial
  dim with ``align=alignment(model)``. Both through ``sharded_nn.launch`` with one thread per
  rank; every rank generates only its own slab (plane by plane from per-plane seeds, so both
  runs see the same global sample).
* Time: forward alone (``torch.no_grad``) and forward + backward of a sum-of-outputs loss; one
  warm-up, then ``--iters`` timed iterations between barriers; an iteration's time is the
  slowest rank's, the reported time the median. Speedup ``T1 / T2``.
* Memory: peak resident set size above the post-start-up baseline, max over ranks, read after
  the forward-only iterations and again after the forward + backward ones (a high-water mark:
  the second reading is the training peak). Ratio P=2 / P=1.
* Consistency: P=2's gathered output (forward), global loss and domain-summed parameter gradients
  are compared with P=1's, after the timed region.

Targets: speedup >= 1.8x, per-rank memory <= 0.55x (forward + backward). Exit code 0 either way.

Run from the repository root::

    python bench/unet.py            # both cases at full size (minutes; needs a quiet machine)
    python bench/unet.py --quick    # 1 x 1 x 32^3 and 1 x 1 x 128 x 224, one iteration

Absolute times drift on shared machines; the ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import sharded_nn as snn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.*
from bench.user_env import launcher  # noqa: E402
from sharded_nn.demo import PeakRSS
from sharded_nn.host_memory import AUTO, parse_mmap_threshold
from sharded_nn.alignment import alignment
from sharded_nn.zoo import create_model

SPEEDUP_TARGET = 1.8
MEM_RATIO_TARGET = 0.55
CHANNELS = (16, 32, 64)
SEED = 1234


@dataclass(frozen=True)
class Case:
    name: str
    spatial: tuple[int, ...]

    @property
    def global_shape(self) -> tuple[int, ...]:
        return (1, 1, *self.spatial)


@dataclass
class RunResult:
    fwd: list[float]
    train: list[float]
    mem_fwd: list[float]
    mem_train: list[float]
    out: torch.Tensor
    loss: float
    grads: torch.Tensor


def build(case: Case, mesh):
    """The plain UNet (``mesh=None``) or the converted one, with the same seeded weights."""
    torch.manual_seed(SEED)
    name = "unet3d" if len(case.spatial) == 3 else "unet2d"
    return create_model(name, mesh=mesh, in_channels=1, out_channels=1, channels=CHANNELS)


def local_input(case: Case, mesh, align: int) -> torch.Tensor:
    """This rank's slab (the whole sample without a mesh), plane by plane from per-plane seeds."""
    shape = case.global_shape
    start, stop = 0, shape[2]
    if mesh is not None:
        start, stop, _ = snn.local_slices(shape, mesh, dims=(2,), align=align)[2].indices(shape[2])
    x = torch.empty(shape[:2] + (stop - start,) + shape[3:])
    g = torch.Generator()
    for i, pos in enumerate(range(start, stop)):
        g.manual_seed(SEED + pos)
        x[:, :, i] = torch.randn(shape[:2] + shape[3:], generator=g)
    return x


def _timed(fn, iters: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def rank_main(case: Case, iters: int) -> RunResult:
    p = dist.get_world_size()
    mesh = snn.init_mesh(domain=p, device_type="cpu") if p > 1 else None
    peak = PeakRSS()  # VmHWM reset here: spawn children inherit the parent's ru_maxrss
    model = build(case, mesh)
    align = alignment(model, 2)
    x = local_input(case, mesh, align)
    return measure(model, x, mesh, iters, peak)


def measure(model, x: torch.Tensor, mesh, iters: int, peak: PeakRSS) -> RunResult:
    """Time and memory of ``model`` on this rank's ``x`` (forward, then forward + backward), and
    the consistency data (gathered along dim 2, domain-summed gradients); every rank alike."""
    p = dist.get_world_size()

    def fwd():
        with torch.no_grad():
            return model(x)

    def train():
        model.zero_grad(set_to_none=True)
        loss = model(x).sum()
        loss.backward()
        return loss.detach()

    t_fwd = _timed(fwd, iters)
    mem_fwd = peak.mib()
    t_train = _timed(train, iters)
    mem_train = peak.mib()
    # Outside the timed region and after the memory readings: the consistency data.
    out = fwd()
    loss = train().to(torch.float64)
    grads = torch.cat([q.grad.reshape(-1) for q in model.parameters()]).to(torch.float64)
    mems = [(mem_fwd, mem_train)]
    times = torch.tensor([t_fwd, t_train], dtype=torch.float64)
    if mesh is not None:
        group = snn.domain_group(mesh)
        out = snn.gather(out, mesh, dims=(2,))
        dist.all_reduce(loss, group=group)
        dist.all_reduce(grads, group=group)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        mems = [None] * p
        dist.all_gather_object(mems, (mem_fwd, mem_train), group=group)
    return RunResult(
        times[0].tolist(), times[1].tolist(), [m[0] for m in mems], [m[1] for m in mems], out, loss.item(), grads
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("unet3d", "unet2d", "all"), default="all")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes (32^3, 128 x 224), one iteration")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--mmap-threshold", type=parse_mmap_threshold, default=AUTO, help="glibc mmap threshold in the ranks: bytes, 'glibc' for glibc's own dynamic one, or 'auto' (default: sharded_nn.launch's; see host_memory.resolve_mmap_threshold)")
    parser.add_argument(
        "--env", choices=("launch", "user"), default="launch",
        help="launch: P=1 and P=2 under snn.launch (the split alone); user: P=1 plain torch in a fresh default "
        "process, P=2 under torchrun in the default environment (bench/user_env.py)",
    )
    args = parser.parse_args(argv)
    launch = launcher(args.env)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    if args.quick:
        cases, iters = [Case("unet3d", (32, 32, 32)), Case("unet2d", (128, 224))], 1
    else:
        cases, iters = [Case("unet3d", (128, 128, 128)), Case("unet2d", (1024, 1792))], args.iters
    cases = [c for c in cases if args.case in ("all", c.name)]
    lines = []
    for case in cases:
        r1 = launch(rank_main, 1, case, iters, timeout=args.timeout, threads=1, mmap_threshold=args.mmap_threshold)
        r2 = launch(rank_main, 2, case, iters, timeout=args.timeout, threads=1, mmap_threshold=args.mmap_threshold)
        shape = "x".join(map(str, case.global_shape))
        out_err = ((r2.out - r1.out).abs().max() / r1.out.abs().max()).item()
        grad_err = ((r2.grads - r1.grads).norm() / r1.grads.norm()).item()
        loss_err = abs(r2.loss - r1.loss) / abs(r1.loss)
        for label, t1, t2, m1, m2 in (
            ("forward", r1.fwd, r2.fwd, r1.mem_fwd, r2.mem_fwd),
            ("fwd+bwd", r1.train, r2.train, r1.mem_train, r2.mem_train),
        ):
            s = statistics.median(t1) / statistics.median(t2)
            ratio = max(m2) / max(m1)
            lines.append(
                f"{case.name:<7} {shape:<16} {label:<8} {statistics.median(t1):8.3f} {statistics.median(t2):8.3f} "
                f"{s:7.2f}x {max(m1):9.0f} {max(m2):9.0f} {ratio:6.2f}x   "
                f"{'PASS' if s >= SPEEDUP_TARGET else 'MISS'}/{'PASS' if ratio <= MEM_RATIO_TARGET else 'MISS'}"
            )
        lines.append(
            f"{'':<7} P=2 vs P=1: output max rel. diff {out_err:.1e}, loss {loss_err:.1e}, grads {grad_err:.1e}"
        )
        print(lines[-1], flush=True)
    head = (
        f"{'case':<7} {'shape':<16} {'pass':<8} {'T1 s':>8} {'T2 s':>8} {'speedup':>8} "
        f"{'mem1 MiB':>9} {'mem2 MiB':>9} {'ratio':>7}"
    )
    print(f"\nzoo UNet channels={CHANNELS}: plain model P=1 vs sharded P=2, 1 thread/rank, float32")
    print(head + "   speed/mem")
    print("-" * (len(head) + 12))
    print("\n".join(lines))
    print(f"targets: speedup >= {SPEEDUP_TARGET}x, memory ratio <= {MEM_RATIO_TARGET}x (fwd+bwd peak is the target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
