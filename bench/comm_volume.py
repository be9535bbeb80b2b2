"""Communication volume per training step, by kind, against the minimum the algorithm needs.

Counted by ``sharded_nn.comm.traffic.count_traffic`` on every rank during one forward+backward
step (after a warm-up step) at P=2 (``--nproc``); the table shows the busiest rank's bytes sent.
Minimum (where the algorithm has a closed form), per rank:

* conv stack (4 x ``Conv3d(16, 16, 3, padding=1)``, input gradient wanted): each layer needs one
  plane of its input from each neighbour in forward, and returns one plane of halo gradient in
  backward, so ``layers x 2 x neighbours x plane bytes``.
* ring attention (``B x H x L x D``, P ranks, contiguous layout): forward moves every other
  rank's K and V through this rank once, ``(P-1) x 2 x local K bytes``; the memory-bounded
  backward moves K/V again and the dK/dV accumulators of the other ranks' shares (P-1 hops: the
  owner keeps its own share), twice that.
* zoo models (a small ViT and UNet): measured by kind, no closed form given.

Run from the repository root: ``python bench/comm_volume.py [--nproc 2]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sharded_nn as snn  # noqa: E402
from sharded_nn.comm.traffic import count_traffic  # noqa: E402

KINDS = ("halo", "ring", "all_to_all", "reduction", "metadata", "other")


def _measure(step) -> dict[str, int]:
    step()  # warm-up: layouts, caches
    with count_traffic() as t:
        step()
    sent = torch.tensor([t.sent.get(k, 0) for k in KINDS], dtype=torch.float64)
    totals = [torch.zeros_like(sent) for _ in range(dist.get_world_size())]
    dist.all_gather(totals, sent)
    busiest = max(totals, key=lambda s: s.sum().item())
    return {k: int(v) for k, v in zip(KINDS, busiest.tolist())}


def _conv_case(mesh, side: int) -> tuple[dict, int]:
    p = dist.get_world_size()
    torch.manual_seed(0)
    model = snn.convert(nn.Sequential(*[nn.Conv3d(16, 16, 3, padding=1) for _ in range(4)]), mesh)
    shape = (1, 16, side, side, side)
    x = torch.randn(shape)[snn.local_slices(shape, mesh, dims=(2,))].clone().requires_grad_()

    def step():
        model(x).sum().backward()

    neighbours = min(2, p - 1)
    plane = 16 * side * side * 4
    return _measure(step), 4 * 2 * neighbours * plane


def _ring_case(mesh, length: int) -> tuple[dict, int]:
    p = dist.get_world_size()
    b, h, d = 1, 6, 64
    local = len(range(length)[snn.local_slices((length,), mesh, dims=(0,))[0]])
    q, k, v = (torch.randn(b, h, local, d, requires_grad=True) for _ in range(3))

    def step():
        snn.functional.ring_attention(q, k, v, mesh).sum().backward()

    kv = 2 * b * h * local * d * 4
    return _measure(step), (p - 1) * kv * 3  # forward: K/V; backward: K/V and dK/dV


def _zoo_case(mesh, name: str) -> tuple[dict, None]:
    from sharded_nn import demo

    cfg = demo.DemoConfig(model=name, size=256, depth=2 if name == "vit" else None)
    model = demo.build_model(cfg, mesh).train()
    _, shape = demo.describe(cfg)
    x = demo.global_input(cfg)[snn.local_slices(shape, mesh, dims=(2,), align=demo._align(cfg, model))].clone()

    def step():
        demo._loss(cfg, model(x), mesh).backward()

    return _measure(step), None


def rank_main(side: int, length: int) -> list[tuple[str, dict, int | None]]:
    mesh = snn.init_mesh(domain=dist.get_world_size())
    rows = [(f"conv stack 4 x Conv3d(16,16,3), 1x16x{side}^3", *_conv_case(mesh, side)),
            (f"ring attention 1x6x{length}x64", *_ring_case(mesh, length)),
            ("vit_tiny (2 blocks) at 256^2", *_zoo_case(mesh, "vit")),
            ("UNet 2-D (16, 32, 64) at 256^2", *_zoo_case(mesh, "unet"))]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args(argv)
    rows = snn.launch(rank_main, args.nproc, args.side, args.length, threads=1)
    print(f"Communication per forward+backward step, busiest rank, P={args.nproc} (KiB sent)\n")
    print("| case | " + " | ".join(KINDS) + " | total | minimum | total / minimum |")
    print("| --- " * (len(KINDS) + 4) + "|")
    for name, sent, minimum in rows:
        total = sum(v for k, v in sent.items() if k != "metadata")
        cells = " | ".join(f"{sent[k] / 1024:.1f}" for k in KINDS)
        ratio = "n/a" if minimum is None else f"{total / minimum:.3f}"
        mins = "n/a" if minimum is None else f"{minimum / 1024:.1f}"
        print(f"| {name} | {cells} | {sum(sent.values()) / 1024:.1f} | {mins} | {ratio} |")
    print("\ntotal / minimum excludes metadata (layout agreement: a few integers per call).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
