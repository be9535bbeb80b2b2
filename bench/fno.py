"""Strong scaling of the zoo FNO on CPU: the plain model at P=1 against the sharded one at P=2.

What is measured (as ``bench/unet.py``, whose input and timing helpers this reuses):

* ``create_model("fno2d", in_channels=3, out_channels=1, width=32, modes=16, depth=4)`` on
  ``1 x 3 x 1024 x 1024`` (``--quick``: 128 x 128), float32, batch 1; P=2 shards H, uneven
  slabs allowed, alignment 1.
* P=1 runs the plain single-device model; P=2 the converted one on two processes
  (``ShardedSpectralConv``: each rank transforms its rows for the kept modes only, one small
  all-reduce of the modes per layer, no all-to-all). The converted model also runs on a
  one-rank mesh, to tell what the algorithm gains (along the sharded dim only the kept columns
  are transformed) from what the split gains. One thread per rank; ``--env user`` runs P=1 in
  a fresh default process and P=2 under torchrun (``bench/user_env.py``), ``--env launch``
  (default) both under ``snn.launch``.
* Precision: float32 throughout; P=2's gradients differ from P=1's by about 3e-4 (relative
  norm), within float32's own error here (plain torch's float32 gradients differ from float64
  by about 1e-3 on this case: sums over a million positions).
* Time: forward alone (``torch.no_grad``) and forward + backward of a sum-of-outputs loss; one
  warm-up, then ``--iters`` timed iterations between barriers, the slowest rank's time, the
  median reported. Speedup ``T1 / T2``.
* Memory: peak resident set size above the post-start-up baseline, max over ranks, after the
  forward-only iterations and after the forward + backward ones. Ratio P=2 / P=1.
* Consistency: P=2's gathered output, global loss and domain-summed parameter gradients against
  P=1's, after the timed region.

Run from the repository root::

    python bench/fno.py            # 1024 x 1024 (about a minute on 2 cores)
    python bench/fno.py --quick    # 128 x 128, one iteration
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import sharded_nn as snn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.*
from bench.unet import Case, RunResult, local_input, measure  # noqa: E402
from bench.user_env import launcher  # noqa: E402
from sharded_nn.demo import PeakRSS  # noqa: E402
from sharded_nn.zoo import create_model  # noqa: E402

SPEEDUP_TARGET = 1.8
MEM_RATIO_TARGET = 0.55
SEED = 1234
OPTIONS = {"in_channels": 3, "out_channels": 1, "width": 32, "modes": 16, "depth": 4}


def rank_main(case: Case, iters: int, sharded: bool = False) -> RunResult:
    """``sharded``: the converted model even at P=1 (a one-rank mesh), to tell the algorithm's
    gain (only the kept modes are transformed along the sharded dim) from the split's."""
    p = dist.get_world_size()
    mesh = snn.init_mesh(domain=p, device_type="cpu") if p > 1 or sharded else None
    peak = PeakRSS()  # VmHWM reset here: spawn children inherit the parent's ru_maxrss
    torch.manual_seed(SEED)
    model = create_model("fno2d", mesh=mesh, **OPTIONS)
    x = local_input(case, mesh, 1).expand(1, OPTIONS["in_channels"], -1, -1).contiguous()
    return measure(model, x, mesh, iters, peak)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=1024, help="grid side (H = W)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="128 x 128, one iteration")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--env", choices=("launch", "user"), default="launch",
                        help="launch: both under snn.launch; user: P=1 plain torch, P=2 under torchrun")
    args = parser.parse_args(argv)
    launch = launcher(args.env)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    side, iters = (128, 1) if args.quick else (args.side, args.iters)
    case = Case("fno2d", (side, side))
    r1 = launch(rank_main, 1, case, iters, timeout=args.timeout, threads=1)
    r2 = launch(rank_main, 2, case, iters, timeout=args.timeout, threads=1)
    r1s = launch(rank_main, 1, case, iters, True, timeout=args.timeout, threads=1)
    out_err = ((r2.out - r1.out).abs().max() / r1.out.abs().max()).item()
    grad_err = ((r2.grads - r1.grads).norm() / r1.grads.norm()).item()
    loss_err = abs(r2.loss - r1.loss) / abs(r1.loss)
    head = f"{'pass':<8} {'T1 s':>8} {'T2 s':>8} {'speedup':>8} {'mem1 MiB':>9} {'mem2 MiB':>9} {'ratio':>7}"
    print(f"\nzoo FNO {OPTIONS} on 1x3x{side}x{side}: plain model P=1 vs sharded P=2, 1 thread/rank, float32")
    print(head + "   speed/mem")
    print("-" * (len(head) + 12))
    for label, t1, t2, m1, m2 in (
        ("forward", r1.fwd, r2.fwd, r1.mem_fwd, r2.mem_fwd),
        ("fwd+bwd", r1.train, r2.train, r1.mem_train, r2.mem_train),
    ):
        s = statistics.median(t1) / statistics.median(t2)
        ratio = max(m2) / max(m1)
        print(f"{label:<8} {statistics.median(t1):8.3f} {statistics.median(t2):8.3f} {s:7.2f}x {max(m1):9.0f} "
              f"{max(m2):9.0f} {ratio:6.2f}x   {'PASS' if s >= SPEEDUP_TARGET else 'MISS'}/"
              f"{'PASS' if ratio <= MEM_RATIO_TARGET else 'MISS'}")
    f1, t1 = statistics.median(r1s.fwd), statistics.median(r1s.train)
    print(f"sharded model at P=1 (one-rank mesh): forward {f1:.3f} s, fwd+bwd {t1:.3f} s; the split alone (its P=1 "
          f"over P=2): {f1 / statistics.median(r2.fwd):.2f}x, {t1 / statistics.median(r2.train):.2f}x")
    print(f"P=2 vs P=1: output max rel. diff {out_err:.1e}, loss {loss_err:.1e}, grads {grad_err:.1e}")
    print(f"targets: speedup >= {SPEEDUP_TARGET}x, memory ratio <= {MEM_RATIO_TARGET}x (fwd+bwd peak is the target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
