"""Strong scaling of sharded convolution stacks on CPU: P=1 against P=2, one thread per rank.

What is measured (DESIGN.md section 7):

* Two cases, each a stack of 4 convolutions (16 -> 16 channels, kernel 3, padding 1) with a ReLU
  between consecutive convolutions, built from plain torch layers and turned into sharded layers
  by ``sharded_nn.convert(model, sharded_nn.init_mesh(domain=P))``:

  - ``conv3d``: ``nn.Conv3d`` on one sample of shape ``1 x 16 x 128^3``;
  - ``conv2d``: ``nn.Conv2d`` on one sample of shape ``1 x 16 x 2048^2``.

* The same global problem runs on P=1 and on P=2 processes, both through ``sharded_nn.launch``
  (the same code path; at P=1 the sharded layers simply have no neighbour), with one thread per
  rank (``OMP_NUM_THREADS=1`` in the environment before torch is imported, and
  ``torch.set_num_threads(1)``). The sample is sharded along its first spatial dim; every rank
  generates only its own slab, so no rank ever holds the whole sample in the sharded run.
* Time: forward + backward of a sum-of-outputs loss (each rank's loss is the sum of its output
  slab; the global loss is the sum over ranks). One warm-up iteration, then ``--iters`` timed
  iterations with a barrier before and after each; an iteration's time is the slowest rank's
  and the reported time is the median over iterations. Gradient reduction across ranks (DDP) is
  not part of the timed region: the stacks have ~28k parameters, so it would be negligible.
  Reported: speedup ``T1 / T2`` and parallel efficiency ``T1 / (2 * T2)``.
* Memory: peak resident set size of each rank (``VmHWM``, reset by ``sharded_nn.demo.PeakRSS``)
  during one untimed steady-state step after the timed ones, above the resident size just before
  it; the maximum over ranks is reported, and the ratio P=2 / P=1. ``PeakRSS`` first returns the
  host cache's blocks to the OS, so the step maps its buffers afresh and its whole working set
  counts. Until session 42 the baseline was taken right after mesh creation, which also counted
  the modules that ``convert``'s shape-only probe (meta tensors) makes torch import: about 200 MiB
  of code and data (sympy among them) at P=1 and P=2 alike, which pulled the ratio towards 1
  (conv3d 0.59x on session 42's host, 0.51x without them; how much depends on what the process
  imported before). (``ru_maxrss`` would start at the launching parent's mark, which spawned
  processes inherit.)
* Consistency: the global loss and the domain-summed weight gradients of P=2 are compared with
  P=1 (the input is generated plane by plane from per-plane seeds, so both runs see the same
  global sample), to make sure that the timings are of a correct computation.

* Also measured (skip with ``--quick``): the plain torch stack at P=1, i.e. what a user runs
  without sharded_nn, and P=2 with ``overlap=False`` (halos exchanged synchronously into an
  extended copy of the slab, then one convolution), to show what the overlapped, copy-free path
  buys in time and memory.
* ``launch`` starts the ranks with ``THP_MEM_ALLOC_ENABLE=1`` (large tensors on transparent huge
  pages) for every configuration alike, plain torch included.

Targets: speedup >= 1.8x and memory ratio <= 0.55x; the table marks each PASS or MISS. The exit
code is 0 whether or not the targets are met: this is a benchmark, not a test.

Run it from the repository root::

    python bench/conv.py                                  # both cases at full size (about 7 minutes)
    python bench/conv.py --case conv3d --size 32 --iters 2   # a quick smoke run
    python bench/conv.py --profile                        # also: where the time goes, by kind of op

Absolute times drift on shared machines; the ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import sharded_nn as snn
from sharded_nn.demo import PeakRSS
from sharded_nn.host_memory import AUTO, parse_mmap_threshold

SPEEDUP_TARGET = 1.8
MEM_RATIO_TARGET = 0.55
CHANNELS = 16
LAYERS = 4
SEED = 1234
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a conv stack of ``spatial_dims`` dims on a cube of side ``size``."""

    name: str
    spatial_dims: int
    size: int

    @property
    def global_shape(self) -> tuple[int, ...]:
        """``(N, C, S, S[, S])`` with batch size 1."""
        return (1, CHANNELS) + (self.size,) * self.spatial_dims


@dataclass
class RunResult:
    """What rank 0 reports for one launch (times are max over ranks, memory max over ranks)."""

    nprocs: int
    times: list[float]
    cpu_times: list[float]
    mem_mib: list[float]
    loss: float
    grads: list[float]
    profile: tuple[dict[str, float], str] | None = None

    @property
    def median(self) -> float:
        """Median iteration time in seconds."""
        return statistics.median(self.times)


def build_stack(spatial_dims: int, dtype: torch.dtype) -> nn.Sequential:
    """The single-device model: ``LAYERS`` convs with ReLUs between them, seeded weights."""
    conv = {2: nn.Conv2d, 3: nn.Conv3d}[spatial_dims]
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        if i:
            layers.append(nn.ReLU())
        layers.append(conv(CHANNELS, CHANNELS, 3, padding=1))
    return nn.Sequential(*layers).to(dtype)


def local_input(case: Case, mesh: DeviceMesh, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slab of the global sample, generated directly (the sample is never built).

    Each plane along the sharded dim comes from its own seed, so the global sample is the same
    whatever the number of ranks, and P=1 and P=2 can be checked against each other.

    Args:
        case: the benchmark case, which fixes the global shape.
        mesh: the domain mesh; dim 2 of the sample is sharded along its domain axis.
        dtype: dtype of the slab (drawn in float32 and cast, so every dtype sees the same values).

    Returns:
        This rank's slab, of the shape that ``sharded_nn.local_slices`` assigns to it.
    """
    # align=1: the stacks have stride 1, so any slab boundary is valid.
    sl = snn.local_slices(case.global_shape, mesh, dims=(2,), align=1)
    start, stop, _ = sl[2].indices(case.global_shape[2])
    shape = list(case.global_shape)
    shape[2] = stop - start
    x = torch.empty(shape, dtype=dtype)
    plane = shape[:2] + shape[3:]
    g = torch.Generator()
    for i, pos in enumerate(range(start, stop)):
        g.manual_seed(SEED + pos)
        x[:, :, i] = torch.randn(plane, generator=g, dtype=torch.float32).to(dtype)
    return x


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    loss.backward()
    return loss.detach()


# Buckets for ``--profile``: which ops are the convolution itself, halo/collective traffic, data
# movement that sharding adds (cat, pad, copies), and the ReLUs.
_PROFILE_BUCKETS = (
    ("conv", ("conv",)),
    ("comm", ("c10d::", "gloo", "halo", "allgather", "all_gather", "barrier", "send", "recv")),
    ("copy/cat/pad", ("cat", "copy", "pad", "fill", "zero", "narrow", "clone", "empty", "contiguous")),
    ("relu", ("relu", "clamp", "threshold")),
)


def _profile_step(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, float], str]:
    """One extra profiled iteration on this rank: self CPU seconds per bucket, and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, x)
    dist.barrier()
    events = prof.key_averages()
    buckets = {name: 0.0 for name, _ in _PROFILE_BUCKETS} | {"other": 0.0}
    for ev in events:
        key = ev.key.lower()
        name = next((n for n, words in _PROFILE_BUCKETS if any(w in key for w in words)), "other")
        buckets[name] += ev.self_cpu_time_total / 1e6
    return buckets, events.table(sort_by="self_cpu_time_total", row_limit=10)


#: What a launch runs: the converted model (the benchmark), the converted model with
#: ``overlap=False`` (halos exchanged synchronously into an extended copy), or the plain torch
#: model (P=1 only: what a user runs without sharded_nn).
VARIANTS = ("sharded", "no-overlap", "torch")


def build_model(case: Case, dtype: torch.dtype, mesh: DeviceMesh, variant: str) -> nn.Module:
    """The stack of ``case`` as ``variant`` says (see ``VARIANTS``)."""
    model = build_stack(case.spatial_dims, dtype)
    if variant == "torch":
        return model
    plan = {"*": {"overlap": False}} if variant == "no-overlap" else None
    return snn.convert(model, mesh, plan=plan, strict=True)


def rank_main(case: Case, dtype_name: str, iters: int, want_profile: bool, variant: str = "sharded") -> RunResult:
    """Body of every rank: build the sharded stack and its slab, time it, measure its memory.

    Args:
        case: the benchmark case.
        dtype_name: a key of ``_DTYPES``.
        iters: timed iterations (after one warm-up).
        want_profile: also profile one more iteration (after the timing and memory readings).
        variant: one of ``VARIANTS``.

    Returns:
        Per-iteration wall and CPU times (max over ranks), per-rank memory above baseline, the global loss and
        the domain-summed parameter gradients; only rank 0's copy reaches ``launch``'s caller.
    """
    mesh = snn.init_mesh(domain=dist.get_world_size(), device_type="cpu")
    if torch.get_num_threads() != 1:
        raise RuntimeError(f"bench: expected 1 torch thread per rank, got {torch.get_num_threads()}.")
    dtype = _DTYPES[dtype_name]
    group = snn.domain_group(mesh)
    model = build_model(case, dtype, mesh, variant)
    x = local_input(case, mesh, dtype)

    _step(model, x)  # warm-up: first-touch allocations, layout planning, oneDNN primitive caches
    times, cpu_times = [], []
    for _ in range(iters):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = _step(model, x)
        # CPU seconds of this rank alone, read before the closing barrier: unlike wall time, they
        # barely change when other processes share the cores, which helps to read a noisy run.
        cpu_times.append(time.process_time() - c0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    # The working set of one steady-state step (activations, gradients, slab, halos): the
    # modules and first-touch pages of the first calls are resident by now, as in any longer run.
    peak = PeakRSS()  # also resets VmHWM: spawn children inherit the parent's ru_maxrss
    dist.barrier()
    _step(model, x)
    mem_mib = peak.mib()

    # Collectives below are outside the timed region and after the memory reading.
    t = torch.tensor([times, cpu_times], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    mems = [None] * dist.get_world_size(group)
    dist.all_gather_object(mems, mem_mib, group=group)
    loss64 = loss.to(torch.float64)
    dist.all_reduce(loss64, group=group)
    # Weight gradients are partial sums over the domain ranks; their sum is the single-device one.
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(torch.float64)
    dist.all_reduce(grads, group=group)
    prof = _profile_step(model, x) if want_profile else None
    return RunResult(dist.get_world_size(), t[0].tolist(), t[1].tolist(), mems, loss64.item(), grads.tolist(), prof)


def run_case(
    case: Case, dtype_name: str, iters: int, timeout: float, want_profile: bool, extra: bool,
    mmap_threshold: int | str | None = AUTO,
) -> dict[str, RunResult]:
    """P=1 then P=2 (and, with ``extra``, plain torch at P=1 and P=2 without overlap).

    Each configuration runs in its own launch, so that each high-water mark is its own.
    """
    runs = [("P=1", 1, "sharded"), ("P=2", 2, "sharded")]
    if extra:
        runs += [("torch P=1", 1, "torch"), ("P=2 no-overlap", 2, "no-overlap")]
    out = {}
    for label, p, variant in runs:
        t0 = time.perf_counter()
        prof = want_profile and variant == "sharded"
        res = snn.launch(
            rank_main, p, case, dtype_name, iters, prof, variant, timeout=timeout, threads=1,
            mmap_threshold=mmap_threshold,
        )
        print(
            f"  {case.name} {label}: median {res.median:.3f} s over {iters} iters "
            f"(all {', '.join(f'{v:.3f}' for v in res.times)}; CPU s/rank, max over ranks, median "
            f"{statistics.median(res.cpu_times):.3f}), mem/rank MiB "
            f"{', '.join(f'{m:.0f}' for m in res.mem_mib)}, launch {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        out[label] = res
    return out


def busy_cores(interval: float = 1.0) -> float:
    """How many cores other processes keep busy while this one sleeps (Linux ``/proc/stat``)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + vals[4]  # idle + iowait
        return sum(vals[:8]) - idle, sum(vals[:8])

    try:
        busy0, total0 = sample()
        time.sleep(interval)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return math.nan
    return (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def _mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(rows: list[tuple[Case, dict[str, RunResult]]], dtype_name: str) -> None:
    """Print the results table, the targets and the P=1 / P=2 consistency check."""
    head = (
        f"{'case':<8} {'shape':<18} {'T1 s':>8} {'T2 s':>8} {'speedup':>9} {'effic.':>7} "
        f"{'mem1 MiB':>9} {'mem2 MiB':>9} {'mem ratio':>10}"
    )
    print()
    print(f"sharded_nn conv benchmark: P=1 vs P=2, 1 thread/rank, {dtype_name}, forward+backward")
    print(head)
    print("-" * len(head))
    for case, runs in rows:
        r1, r2 = runs["P=1"], runs["P=2"]
        t1, t2 = r1.median, r2.median
        m1, m2 = max(r1.mem_mib), max(r2.mem_mib)
        speedup = t1 / t2
        ratio = m2 / m1 if m1 > 0 else math.nan
        shape = "x".join(map(str, case.global_shape))
        print(
            f"{case.name:<8} {shape:<18} {t1:>8.3f} {t2:>8.3f} {speedup:>8.2f}x {speedup / 2:>6.0%} "
            f"{m1:>9.0f} {m2:>9.0f} {ratio:>9.2f}x"
        )
    print()
    print(f"targets: speedup >= {SPEEDUP_TARGET}x, mem ratio <= {MEM_RATIO_TARGET}x")
    for case, runs in rows:
        r1, r2 = runs["P=1"], runs["P=2"]
        speedup = r1.median / r2.median
        ratio = max(r2.mem_mib) / max(r1.mem_mib)
        loss_err = abs(r2.loss - r1.loss) / max(abs(r1.loss), 1e-30)
        g1 = torch.tensor(r1.grads, dtype=torch.float64)
        g2 = torch.tensor(r2.grads, dtype=torch.float64)
        grad_err = ((g2 - g1).norm() / g1.norm().clamp_min(1e-30)).item()
        print(
            f"  {case.name:<8} speedup {speedup:.2f}x {_mark(speedup >= SPEEDUP_TARGET)}   "
            f"mem ratio {ratio:.2f}x {_mark(ratio <= MEM_RATIO_TARGET)}   "
            f"(P=2 vs P=1: loss rel. diff {loss_err:.1e}, grad rel. diff {grad_err:.1e})"
        )
        cpu_ratio = statistics.median(r1.cpu_times) / statistics.median(r2.cpu_times)
        print(f"  {'':<8} CPU-time ratio T1/T2 (busiest rank, robust to other load) {cpu_ratio:.2f}x")
        if "torch P=1" in runs:
            tt = runs["torch P=1"]
            print(
                f"  {'':<8} plain torch at P=1: {tt.median:.3f} s, {max(tt.mem_mib):.0f} MiB "
                f"(sharded P=1 / torch: time {r1.median / tt.median:.2f}x, memory "
                f"{max(r1.mem_mib) / max(tt.mem_mib):.2f}x; speedup of P=2 over plain torch "
                f"{tt.median / r2.median:.2f}x)"
            )
        if "P=2 no-overlap" in runs:
            no = runs["P=2 no-overlap"]
            print(
                f"  {'':<8} P=2 with overlap=False: {no.median:.3f} s, {max(no.mem_mib):.0f} MiB "
                f"(overlap saves {1 - r2.median / no.median:+.0%} time, {1 - max(r2.mem_mib) / max(no.mem_mib):+.0%} memory)"
            )
    for case, runs in rows:
        r1, r2 = runs["P=1"], runs["P=2"]
        if r1.profile and r2.profile:
            print(f"\nprofile of one more iteration, {case.name}, rank 0: self CPU seconds by kind of op")
            for name in r1.profile[0]:
                print(f"  {name:<13} P=1 {r1.profile[0][name]:8.3f}   P=2 {r2.profile[0][name]:8.3f}")
            print(f"top ops at P=2:\n{r2.profile[1]}")


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run the cases, print the table; returns 0 whatever the outcome."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("conv3d", "conv2d", "all"), default="all")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations after one warm-up (default 3)")
    parser.add_argument(
        "--size", type=int, default=None, help="spatial size of every dim (default: 128 for conv3d, 2048 for conv2d)"
    )
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    parser.add_argument("--mmap-threshold", type=parse_mmap_threshold, default=AUTO, help="glibc mmap threshold in the ranks: bytes, 'glibc' for glibc's own dynamic one, or 'auto' (default: sharded_nn.launch's; see host_memory.resolve_mmap_threshold)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch (default 1800)")
    parser.add_argument(
        "--profile", action="store_true", help="profile one more iteration per run; print where the time goes"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only P=1 and P=2; skip the plain-torch baseline and the overlap=False run",
    )
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    if args.size is not None and args.size < 2:
        parser.error("--size must be >= 2 so that each of the 2 ranks holds a slab")

    # One thread per rank. The ranks are spawned, fresh interpreters that inherit this environment
    # and import torch only then: OpenMP reads the variable once, at start-up.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    cases = [Case("conv3d", 3, args.size or 128), Case("conv2d", 2, args.size or 2048)]
    if args.case != "all":
        cases = [c for c in cases if c.name == args.case]
    busy_before = busy_cores()
    rows = []
    for case in cases:
        rows.append((case, run_case(case, args.dtype, args.iters, args.timeout, args.profile, not args.quick, args.mmap_threshold)))
    report(rows, args.dtype)
    busy_after = busy_cores()
    print(f"\ncores busy with other work (1 s sample) before: {busy_before:.2f}, after: {busy_after:.2f}", end="")
    # The P=2 ranks need both cores; anything else running skews T2 far more than T1.
    print(
        " -- other processes competed for the cores; rerun on a quiet machine"
        if max(busy_before, busy_after) > 0.2
        else ""
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
