"""Strong scaling of the zoo MeshGraphNet on CPU: the plain model at P=1 against the sharded one at P=2.

What is measured:

* ``create_model("meshgraphnet", node_in=4, edge_in=3, out=2, hidden=64, steps=6)`` on a
  triangulated ``n x n`` grid (each vertex joined both ways to its right, lower and lower-right
  neighbours, positions jittered; ``--side 160``: 25,600 nodes, 152,322 edges), float32. Node
  features random, edge features (dx, dy, |d|).
* P=1 runs the plain model on the whole graph; P=2 the converted one on two processes, the
  nodes split by ``PointCloudPartition`` (recursive coordinate bisection of the positions), each
  rank holding its in-edges and fetching its halo nodes before every step (``part.graph``). One
  thread per rank, both under ``snn.launch``.
* Time: forward alone (``torch.no_grad``) and forward + backward of a sum-of-outputs loss; one
  warm-up, then ``--iters`` timed iterations between barriers, the slowest rank's time, the
  median reported. Memory: peak resident set size above the post-start-up baseline, max over
  ranks. Consistency: P=2's restored output against P=1's.

Run from the repository root::

    python bench/meshgraphnet.py            # 160 x 160 (about a minute on 2 cores)
    python bench/meshgraphnet.py --quick    # 32 x 32, one iteration
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
from bench.unet import _timed  # noqa: E402
from sharded_nn.demo import PeakRSS, mesh_graph  # noqa: E402
from sharded_nn.points import PointCloudPartition  # noqa: E402
from sharded_nn.zoo import create_model  # noqa: E402

OPTIONS = {"node_in": 4, "edge_in": 3, "out": 2, "hidden": 64, "steps": 6}
SEED = 1234


def rank_main(side: int, iters: int):
    p = dist.get_world_size()
    mesh = snn.init_mesh(domain=p, device_type="cpu") if p > 1 else None
    pos, x, edge_attr, edge_index = mesh_graph(side, OPTIONS["node_in"], SEED)
    x, edge_attr = x.float(), edge_attr.float()
    peak = PeakRSS()
    torch.manual_seed(SEED)
    model = create_model("meshgraphnet", mesh=mesh, **OPTIONS)
    if mesh is None:
        args, part = (x, edge_attr, edge_index), None
    else:
        part = PointCloudPartition(mesh)
        _, x_l = part(pos, x)
        g = part.graph(edge_index)
        args = (x_l, edge_attr[g.edge_ids], g)

    def fwd():
        with torch.no_grad():
            return model(*args)

    def train():
        model.zero_grad(set_to_none=True)
        model(*args).sum().backward()

    t_fwd = _timed(fwd, iters)
    mem_fwd = peak.mib()
    t_train = _timed(train, iters)
    mem_train = peak.mib()
    out = fwd()
    times = torch.tensor([t_fwd, t_train], dtype=torch.float64)
    mems = [(mem_fwd, mem_train)]
    halo = 0
    if part is not None:
        out = part.restore(out)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        mems = [None] * p
        dist.all_gather_object(mems, (mem_fwd, mem_train))
        halo = g.n_halo
    return times.tolist(), mems, out, halo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=160, help="grid side (nodes = side^2)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="32 x 32, one iteration")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    side, iters = (32, 1) if args.quick else (args.side, args.iters)
    (t1, m1, out1, _) = snn.launch(rank_main, 1, side, iters, timeout=args.timeout, threads=1)
    (t2, m2, out2, halo) = snn.launch(rank_main, 2, side, iters, timeout=args.timeout, threads=1)
    n_edges = 2 * (2 * side * (side - 1) + (side - 1) ** 2)  # right, down and diagonal pairs, both ways
    print(f"\nzoo MeshGraphNet {OPTIONS} on a {side}x{side} triangulated grid ({side * side} nodes, "
          f"{n_edges} edges): plain model P=1 vs sharded P=2, 1 thread/rank, float32; halo of rank 0: {halo} nodes")
    head = f"{'pass':<8} {'T1 s':>8} {'T2 s':>8} {'speedup':>8} {'mem1 MiB':>9} {'mem2 MiB':>9} {'ratio':>7}"
    print(head)
    print("-" * len(head))
    for k, label in enumerate(("forward", "fwd+bwd")):
        a, b = statistics.median(t1[k]), statistics.median(t2[k])
        mem1, mem2 = max(m[k] for m in m1), max(m[k] for m in m2)
        print(f"{label:<8} {a:8.3f} {b:8.3f} {a / b:7.2f}x {mem1:9.0f} {mem2:9.0f} {mem2 / max(mem1, 1e-9):6.2f}x")
    err = ((out2 - out1).abs().max() / out1.abs().max()).item()
    print(f"P=2 vs P=1: output max rel. diff {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
