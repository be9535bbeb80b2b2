"""Move rows of a sharded dim between ranks: one slab layout to another (``snn.reshard``).

Each rank's old slab ``[a, b)`` overlaps some ranks' new slabs: it sends those rows to them and
receives, from every rank whose old slab overlaps its new one, the rows it will own. Point-to-
point only, one message per ordered pair of ranks with an overlap (a drift of a few rows moves
them between neighbours). The backward moves the gradient rows back along the same routes, so
each rank's input gradient is exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from .peers import AxisPeers

__all__ = ["move_rows"]


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    starts = list(itertools.accumulate(sizes, initial=0))
    return [(starts[r], starts[r + 1]) for r in range(len(sizes))]


def _move(x: torch.Tensor, dim: int, old: Sequence[int], new: Sequence[int], ring: AxisPeers, tag: int) -> torch.Tensor:
    me = ring.index
    ob, nb = _bounds(old), _bounds(new)
    a, b = ob[me]
    pieces: dict[int, torch.Tensor] = {}
    ops = []
    # Peer order on every rank keeps NCCL's issue-order matching; one message per ordered pair
    # lets a single tag tell them apart on gloo.
    for q in range(ring.size):
        lo, hi = max(a, nb[q][0]), min(b, nb[q][1])
        if hi > lo and q != me:
            ops.append((x.narrow(dim, lo - a, hi - lo).contiguous(), q, True, tag))
    c, d = nb[me]
    for q in range(ring.size):
        lo, hi = max(c, ob[q][0]), min(d, ob[q][1])
        if hi <= lo:
            continue
        if q == me:
            pieces[q] = x.narrow(dim, lo - a, hi - lo)
        else:
            shape = list(x.shape)
            shape[dim] = hi - lo
            buf = x.new_empty(shape)
            pieces[q] = buf
            ops.append((buf, q, False, tag))
    for w in ring.start_p2p(ops):
        w.wait()
    if not pieces:
        shape = list(x.shape)
        shape[dim] = 0
        return x.new_empty(shape)
    # Old slabs are in global order, so the pieces of my new slab are too.
    return torch.cat([pieces[q] for q in sorted(pieces)], dim).contiguous()


def move_rows(x: torch.Tensor, dim: int, old: Sequence[int], new: Sequence[int], ring: AxisPeers) -> torch.Tensor:
    """This rank's slab along ``dim`` in the layout ``new``, from its slab in the layout ``old``.

    Args:
        x: this rank's slab (``x.shape[dim] == old[ring.index]``).
        dim: the sharded dim, sharded by the axis of ``ring``.
        old: every rank's slab size along ``dim`` now (the same on every rank).
        new: every rank's slab size in the wanted layout (same total).
        ring: this rank's place on the mesh axis that shards ``dim``.

    Autograd: the backward moves the gradient rows back from ``new`` to ``old``.
    Call it on every rank of the axis alike (it reserves message tags).
    """
    tag = ring.next_tags(2)  # forward and backward
    return _MoveRows.apply(x, dim % x.dim(), tuple(old), tuple(new), ring, tag)


class _MoveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, old, new, ring, tag):  # noqa: D102
        ctx.args = (dim, old, new, ring, tag)
        return _move(x, dim, old, new, ring, tag)

    # The communication is not recorded for a second derivative: double backward raises.
    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        dim, old, new, ring, tag = ctx.args
        return _move(g.contiguous(), dim, new, old, ring, tag + 1), None, None, None, None, None
