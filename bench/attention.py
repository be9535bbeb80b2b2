"""Strong scaling of ring attention on CPU: P=1 against P=2, one thread per rank.

What is measured (DESIGN.md section 7):

* ``sharded_nn.functional.ring_attention`` on one sample of ``8`` heads of size ``64``, sequence
  lengths ``--seq`` (default 16384 and 32768), float32, forward + backward (loss: the sum of
  the output slab weighted by a fixed pattern). ``--causal`` runs causal attention in the
  load-balanced zigzag layout instead.
* The same global problem runs on P=1 and on P=2 processes through
  ``sharded_nn.launch(fn, P, threads=1)`` with ``OMP_NUM_THREADS=1`` set before torch is
  imported. Every rank generates only its own tokens (per-block seeds), so the global q/k/v are
  identical for both P and no rank holds the whole sequence in the sharded run.
* Time: one warm-up iteration, then ``--iters`` timed iterations between barriers; an
  iteration's time is the slowest rank's; the median is reported. Speedup ``T1 / T2`` and
  parallel efficiency ``T1 / (2 T2)``.
* Memory: each rank's peak resident size (``VmHWM``, reset by ``sharded_nn.demo.PeakRSS`` right
  after imports, process group and mesh creation) above its resident size then; the maximum
  over ranks; ratio P=2 / P=1. P=1 and P=2 run in separate launches.
* Consistency: the global sums of the output and of dq must agree between P=1 and P=2.

Where the memory goes, in local slabs (one slab: B x H x L/P x D float32), at the backward peak:
this script holds q, k, v, the loss weight and the previous iteration's output (5); ring
attention holds its output (saved for backward), dout and the three gradients (5); that floor of
10 slabs is the same at every P. P=1 adds nothing else (about 10.5 slabs measured). At P>1 the
ring adds one piece of the travelling K/V, the kernel's three block gradients and the dK/dV
accumulator hop (sent and received): 9 pieces of 1/8 slab (``_RING_CHUNKS``), so P=2 holds about
11.1 half-size slabs and the ratio is about 11.1 / (2 x 10.5) = 0.53; the floor alone is 0.48.

Targets: speedup >= 1.8x and memory ratio <= 0.55x (marked PASS or MISS; the exit code is 0
either way: this is a benchmark, not a test).

Run it from the repository root on a quiet machine::

    python bench/attention.py                      # 16k and 32k tokens (minutes)
    python bench/attention.py --seq 2048 --iters 2   # quick smoke run
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the spawned ranks

import argparse  # noqa: E402
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
from sharded_nn import functional as snf  # noqa: E402

SPEEDUP_TARGET = 1.8
MEM_RATIO_TARGET = 0.55
HEADS, HEAD_DIM, BATCH = 8, 64, 1
BLOCK = 128  # tokens per seeded block of the generated input
SEED = 1234


def _tokens(start: int, stop: int, salt: int) -> torch.Tensor:
    """Tokens ``[start, stop)`` of one global (B, H, L, D) tensor, the same for every P."""
    parts = []
    for b in range(start // BLOCK, -(-stop // BLOCK)):
        g = torch.Generator().manual_seed(SEED + 1_000_003 * salt + b)
        parts.append(torch.randn(BATCH, HEADS, BLOCK, HEAD_DIM, generator=g))
    x = torch.cat(parts, 2)
    off = (start // BLOCK) * BLOCK
    return x[:, :, start - off : stop - off].contiguous()


def _local(seq: int, mesh, causal: bool, salt: int) -> torch.Tensor:
    ring = snn.comm.domain_peers(mesh)
    if causal:
        chunks = snn.Layout.balanced(seq, 2 * ring.size)
        r = ring.index
        slices = [chunks.slice(c) for c in (r, 2 * ring.size - 1 - r)]
        return torch.cat([_tokens(s.start, s.stop, salt) for s in slices], 2)
    sl = snn.Layout.balanced(seq, ring.size).slice(ring.index)
    return _tokens(sl.start, sl.stop, salt)


def _worker(seq: int, iters: int, causal: bool) -> dict:
    mesh = snn.init_mesh(device_type="cpu")
    group = snn.domain_group(mesh)
    peak = PeakRSS()  # VmHWM reset here: spawn children inherit the parent's ru_maxrss
    layout = "zigzag" if causal else "contiguous"
    q, k, v = (_local(seq, mesh, causal, s).requires_grad_() for s in range(3))
    weight = _local(seq, mesh, causal, 3)

    def step() -> torch.Tensor:
        for t in (q, k, v):
            t.grad = None
        out = snf.ring_attention(q, k, v, mesh, causal, layout=layout)
        (out * weight).sum().backward()
        return out.detach()

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
    mem = torch.tensor([peak.mib()], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=group)
    sums = torch.tensor([out.double().sum().item(), q.grad.double().sum().item()], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    out_sum, dq_sum = sums.tolist()
    return {"time": statistics.median(t.tolist()), "mem": mem.item(), "out_sum": out_sum, "dq_sum": dq_sum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768], help="global sequence lengths")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--causal", action="store_true", help="causal attention in the zigzag layout")
    parser.add_argument(
        "--env", choices=("launch", "user"), default="launch",
        help="launch: P=1 and P=2 under snn.launch (the split alone); user: P=1 plain torch in a fresh default "
        "process, P=2 under torchrun in the default environment (bench/user_env.py)",
    )
    args = parser.parse_args()
    launch = launcher(args.env)
    rows = []
    for seq in args.seq:
        r1 = launch(_worker, 1, seq, args.iters, args.causal, threads=1, device_type="cpu", timeout=3600)
        r2 = launch(_worker, 2, seq, args.iters, args.causal, threads=1, device_type="cpu", timeout=3600)
        ok = abs(r1["out_sum"] - r2["out_sum"]) <= 1e-3 * (1 + abs(r1["out_sum"])) and abs(
            r1["dq_sum"] - r2["dq_sum"]
        ) <= 1e-3 * (1 + abs(r1["dq_sum"]))
        speedup, ratio = r1["time"] / r2["time"], r2["mem"] / max(r1["mem"], 1e-9)
        rows.append((seq, r1, r2, speedup, ratio, ok))
    kind = "causal zigzag" if args.causal else "non-causal"
    print(f"ring attention ({kind}), B={BATCH}, H={HEADS}, D={HEAD_DIM}, float32, fwd+bwd, 1 thread per rank")
    print("| seq | T1 (s) | T2 (s) | speedup | efficiency | mem P=1 (MiB) | mem P=2 (MiB) | mem ratio | P1 == P2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for seq, r1, r2, speedup, ratio, ok in rows:
        sp = "PASS" if speedup >= SPEEDUP_TARGET else "MISS"
        mr = "PASS" if ratio <= MEM_RATIO_TARGET else "MISS"
        print(
            f"| {seq} | {r1['time']:.3f} | {r2['time']:.3f} | {speedup:.2f}x {sp} | {speedup / 2:.0%} | "
            f"{r1['mem']:.0f} | {r2['mem']:.0f} | {ratio:.2f}x {mr} | {'yes' if ok else 'NO'} |"
        )


if __name__ == "__main__":
    main()
