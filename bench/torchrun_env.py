"""Scaling in the environment a user has: plain torch in one process against ours under torchrun.

Issue 12 item 4 asks for >= 1.9x at P=2 "without tuning by the user". ``bench/conv.py`` runs
every configuration through ``sharded_nn.launch`` with the same allocator settings for all; this
script measures the way a user would instead:

* **P=1, plain torch**: a fresh ``python`` process running the single-device stack with one
  thread (``OMP_NUM_THREADS=1``), with no allocator variables and with sharded_nn's own process
  tuning switched off (``SHARDED_NN_HOST_TUNING=0``: the process must behave as one that never
  imported sharded_nn).
* **P=2, ours**: ``python -m torch.distributed.run --standalone --nproc_per_node 2`` on the same
  script, the default environment (no variables exported), so what the library sets for itself
  at ``import sharded_nn`` and ``init_mesh`` (``sharded_nn.host_memory``, ``sharded_nn.host_cache``)
  is all it gets.
* **P=1, plain torch with huge pages** (``THP_MEM_ALLOC_ENABLE=1`` exported): what the P=1 user
  could get by tuning; printed so that the library's own gain and the allocator's gain can be
  told apart.

Each run times forward + backward of the 4-conv stack of ``bench/conv.py`` (one warm-up, then
``--iters`` iterations, median of the slowest rank), and checks the global loss of P=2 against
P=1. Run from the repository root::

    python bench/torchrun_env.py                 # conv3d 1x16x128^3 and conv2d 1x16x1024^2
    python bench/torchrun_env.py --size-scale 0.5 --iters 2   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 1.9
_ROOT = Path(__file__).resolve().parents[1]

#: name -> (spatial dims, side)
CASES = {"conv3d": (3, 128), "conv2d": (2, 1024)}


def _worker(case_name: str, side: int, iters: int, plain: bool) -> None:
    """Body of one process (plain torch at P=1, or one rank of ours under torchrun)."""
    sys.path.insert(0, str(_ROOT))
    import torch
    import torch.distributed as dist

    from bench import conv as cb  # imports sharded_nn (its tuning is off for the plain run)

    torch.set_num_threads(1)
    case = cb.Case(case_name, CASES[case_name][0], side)
    if plain:
        model = cb.build_stack(case.spatial_dims, torch.float32)
        # The whole sample, generated plane by plane exactly as the slabs are (same seeds).
        mesh = None
        x = _full_input(cb, case)
    else:
        import sharded_nn as snn

        mesh = snn.init_mesh(domain=int(os.environ["WORLD_SIZE"]))
        model = snn.convert(cb.build_stack(case.spatial_dims, torch.float32), mesh, strict=True)
        x = cb.local_input(case, mesh, torch.float32)
    cb._step(model, x)
    times = []
    for _ in range(iters):
        if mesh is not None:
            dist.barrier()
        t0 = time.perf_counter()
        loss = cb._step(model, x)
        if mesh is not None:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    loss = loss.to(torch.float64)
    if mesh is not None:
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
        dist.all_reduce(loss)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return
    print("RESULT " + json.dumps({"median": statistics.median(times), "loss": loss.item(),
                                  "thp": os.environ.get("THP_MEM_ALLOC_ENABLE")}))


def _full_input(cb, case):
    import torch

    shape = list(case.global_shape)
    x = torch.empty(shape)
    g = torch.Generator()
    for pos in range(shape[2]):
        g.manual_seed(cb.SEED + pos)
        x[:, :, pos] = torch.randn(shape[:2] + shape[3:], generator=g)
    return x


def user_env() -> dict[str, str]:
    """The user's default environment: nothing of ours, no allocator variables, one thread.

    Plain torch runs in it with ``SHARDED_NN_HOST_TUNING=0`` added (a process that never imported
    sharded_nn), ours under torchrun as it is (what the library sets for itself is all it gets).
    """
    drop = ("THP_MEM_ALLOC_ENABLE", "SHARDED_NN_HOST_TUNING", "SHARDED_NN_HOST_CACHE", "MALLOC_MMAP_THRESHOLD_")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=_ROOT)
    if out.returncode:
        raise RuntimeError(f"bench: {' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: all")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--size-scale", type=float, default=1.0, help="scale the side of every case")
    parser.add_argument("--worker", choices=("plain", "sharded"), help=argparse.SUPPRESS)
    parser.add_argument("--side", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.case[0], args.side, args.iters, args.worker == "plain")
        return 0

    base = user_env()
    script = str(Path(__file__).resolve())
    rows = []
    for name in args.case or sorted(CASES):
        side = max(8, int(CASES[name][1] * args.size_scale))
        common = [script, "--case", name, "--side", str(side), "--iters", str(args.iters)]
        plain = _run([sys.executable, *common, "--worker", "plain"], base | {"SHARDED_NN_HOST_TUNING": "0"})
        tuned = _run([sys.executable, *common, "--worker", "plain"],
                     base | {"SHARDED_NN_HOST_TUNING": "0", "THP_MEM_ALLOC_ENABLE": "1"})
        ours = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     *common, "--worker", "sharded"], base)
        diff = abs(ours["loss"] - plain["loss"]) / max(abs(plain["loss"]), 1e-30)
        rows.append((name, side, plain, tuned, ours, diff))
    print("| case | plain P=1 | plain P=1 + THP | ours P=2 (torchrun) | speedup | vs tuned P=1 | THP in ours | loss rel. diff | target |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, side, plain, tuned, ours, diff in rows:
        s = plain["median"] / ours["median"]
        print(f"| {name} {side} | {plain['median']:.3f} s | {tuned['median']:.3f} s | {ours['median']:.3f} s | "
              f"{s:.2f}x | {tuned['median'] / ours['median']:.2f}x | {ours['thp']} | {diff:.1e} | "
              f"{'PASS' if s >= TARGET else 'MISS'} ({TARGET}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
