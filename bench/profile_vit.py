"""Per-rank profile of one sharded ViT step (and plain timm at P=1): where the time goes.

    python bench/profile_vit.py --model vit_small_patch16_224 --size 1024 --depth 4
    python bench/profile_vit.py --size 1024 --depth 2 --bwd --cpu-ops   # thread-CPU per aten op

Default: per rank, torch.profiler's top operators by self time (wall time inside each op, so
on a busy machine every op grows alike). ``--cpu-ops``: per rank, the thread CPU time of every
aten op (``time.thread_time`` around each op, in a dispatch mode that also sees the backward),
P=1 and rank 0 of P=2 side by side with their ratio, and the step's time split into main-thread
CPU, other threads' CPU (gloo's) and wall time spent waiting in ring hops. CPU times stay
meaningful when other jobs share the cores; wall times do not. One thread per rank, as in
``bench/vit.py``; forward in ``torch.no_grad()``, ``--bwd`` adds the backward.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import collections  # noqa: E402
import importlib  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import sharded_nn as snn  # noqa: E402
from sharded_nn import zoo  # noqa: E402


class _OpCPU(TorchDispatchMode):
    """Thread CPU seconds and calls per aten op while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = time.thread_time()
        out = func(*args, **(kwargs or {}))
        e = self.ops[str(func)]
        e[0] += time.thread_time() - c
        e[1] += 1
        return out


def _worker(name: str, size: int, depth: int, iters: int, bwd: bool, top: int, cpu_ops: bool) -> list:
    p = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = snn.init_mesh(device_type="cpu") if p > 1 else None
    torch.manual_seed(0)
    model = zoo.create_model(name, mesh=mesh, img_size=size, depth=depth).eval()
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    if mesh is not None:
        x = x[snn.local_slices(x.shape, mesh, dims=(2,), align=16)].contiguous()
    group = None if mesh is None else snn.domain_group(mesh)

    def step():
        if bwd:
            model.zero_grad(set_to_none=True)
            loss = model(x.detach().requires_grad_()).sum()
            # (Replicated logits: each rank back-propagates its 1/P share, as the convention asks.)
            (loss if mesh is None else snn.losses.share(loss, mesh)).backward()
        else:
            with torch.no_grad():
                model(x)

    step()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group)
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    if group is not None:
        dist.barrier(group)
    if cpu_ops:
        # Wall time spent waiting for ring hops (the rest of the step is computation).
        ring_pass = importlib.import_module("sharded_nn.comm.ring_pass")
        handle_wait, waited = ring_pass.RingHandle.wait, [0.0]

        def wait(self):
            t = time.perf_counter()
            try:
                return handle_wait(self)
            finally:
                waited[0] += time.perf_counter() - t

        ring_pass.RingHandle.wait = wait
        mode = _OpCPU()
        c0, pc0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        with mode:
            step()
        split = {
            "main-thread CPU": time.thread_time() - c0,
            "other threads' CPU": (time.process_time() - pc0) - (time.thread_time() - c0),
            "wall": time.perf_counter() - t0,
            "wall waiting in ring hops": waited[0],
        }
        ring_pass.RingHandle.wait = handle_wait
        table = (split, {k: tuple(v) for k, v in mode.ops.items()})
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    rank = 0 if group is None else dist.get_rank()
    res = [(rank, times, table)]
    if group is not None:
        out = [None] * p
        dist.all_gather_object(out, res[0])
        return out
    return res


def _print_cpu_ops(results: dict[int, list], top: int) -> None:
    base = results[min(results)][0][2][1]
    print(f"thread CPU per aten op (s), one step; ratio = P={min(results)} / rank")
    for p, res in results.items():
        for rank, _times, (split, _ops) in res:
            print(f"  P={p} rank {rank}: " + ", ".join(f"{k} {v:.3f} s" for k, v in split.items()))
    cols = [(p, rank, ops) for p, res in results.items() for rank, _t, (_s, ops) in res if rank == 0]
    keys = sorted({k for _p, _r, ops in cols for k in ops}, key=lambda k: -max(ops.get(k, (0.0, 0))[0] for *_, ops in cols))
    print(f"  {'op':62s}" + "".join(f" | P={p} r{r} s (calls)" for p, r, _ in cols) + " | ratio")
    for k in keys[:top]:
        cells = [ops.get(k, (0.0, 0)) for *_, ops in cols]
        last = cells[-1][0]
        ratio = f"{base.get(k, (0.0, 0))[0] / last:.2f}" if last > 0 else "-"
        print(f"  {k[:62]:62s}" + "".join(f" | {s:9.4f} ({n:4d})" for s, n in cells) + f" | {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cpu-ops", action="store_true", help="thread-CPU per aten op instead of torch.profiler")
    args = ap.parse_args()
    results = {}
    for p in args.nproc:
        res = snn.launch(_worker, p, args.model, args.size, args.depth, args.iters, args.bwd, args.top, args.cpu_ops,
                         threads=1, device_type="cpu", timeout=3600)
        results[p] = res
        for rank, times, table in res:
            print(f"=== P={p} rank {rank}: (wall, cpu) per iteration {[(round(a, 3), round(b, 3)) for a, b in times]}")
            if not args.cpu_ops:
                print(table)
    if args.cpu_ops:
        _print_cpu_ops(results, args.top)


if __name__ == "__main__":
    main()
