"""Per-rank profile of one sharded ViT forward (and plain timm at P=1): where the time goes.

    python bench/profile_vit.py --model vit_small_patch16_224 --size 1024 --depth 4

Prints, per rank, torch.profiler's top operators by self CPU time, and the wall time of the
timed forward split into time inside the ring's waits / collectives and the rest. Forward in
``torch.no_grad()``, one thread per rank, as in ``bench/vit.py``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sharded_nn as snn  # noqa: E402
from sharded_nn import zoo  # noqa: E402


def _worker(name: str, size: int, depth: int, iters: int, bwd: bool, top: int) -> list:
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
            model(x.requires_grad_()).sum().backward()
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vit_small_patch16_224")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for p in args.nproc:
        res = snn.launch(_worker, p, args.model, args.size, args.depth, args.iters, args.bwd, args.top,
                         threads=1, device_type="cpu", timeout=3600)
        for rank, times, table in res:
            print(f"=== P={p} rank {rank}: (wall, cpu) per iteration {[(round(a, 3), round(b, 3)) for a, b in times]}")
            print(table)


if __name__ == "__main__":
    main()
