"""All-to-all between sequence sharding and head sharding (Ulysses attention), uneven lengths.

``seq_to_heads`` turns this rank's ``(B, H, L_local, D)`` slab of every head into the full
sequence ``(B, H / P, L, D)`` of this rank's head group; ``heads_to_seq`` is its inverse. Each is
the other's backward. The exchange is point-to-point between every pair of ranks (batched
``isend``/``irecv``), so slabs of different lengths need no padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .ring import AxisRing


def _exchange(ring: AxisRing, sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], like: torch.Tensor):
    """Send ``sends[j]`` to ring rank j and receive a tensor of ``recv_shapes[j]`` from it."""
    me = ring.index
    recvs: list[torch.Tensor] = []
    ops = []
    for j in range(ring.size):
        if j == me:
            recvs.append(sends[j])
            continue
        buf = torch.empty(recv_shapes[j], dtype=like.dtype, device=like.device)
        recvs.append(buf)
        ops.append(dist.P2POp(dist.isend, sends[j].contiguous(), ring.ranks[j], group=ring.group))
        ops.append(dist.P2POp(dist.irecv, buf, ring.ranks[j], group=ring.group))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    return recvs


def _seq_to_heads(x: torch.Tensor, ring: AxisRing, lengths: Sequence[int]) -> torch.Tensor:
    b, h, _, d = x.shape
    hp = h // ring.size
    sends = list(x.split(hp, dim=1))
    recvs = _exchange(ring, sends, [(b, hp, n, d) for n in lengths], x)
    return torch.cat(recvs, dim=2)


def _heads_to_seq(x: torch.Tensor, ring: AxisRing, lengths: Sequence[int]) -> torch.Tensor:
    b, hp, _, d = x.shape
    sends = list(x.split(list(lengths), dim=2))
    n = lengths[ring.index]
    recvs = _exchange(ring, sends, [(b, hp, n, d)] * ring.size, x)
    return torch.cat(recvs, dim=1)


def seq_to_heads(x: torch.Tensor, ring: AxisRing, lengths: Sequence[int]) -> torch.Tensor:
    """``(B, H, L_local, D)`` sequence slabs -> ``(B, H / P, L, D)`` head groups; autograd-aware.

    Args:
        x: this rank's slab; H must be divisible by the ring size (callers check, on every rank).
        ring: the ranks; rank j receives heads ``[j * H / P, (j + 1) * H / P)``.
        lengths: every rank's ``L_local``, indexed by ring coordinate (from a gathered layout).
    """
    return _SeqToHeads.apply(x, ring, tuple(lengths))


def heads_to_seq(x: torch.Tensor, ring: AxisRing, lengths: Sequence[int]) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``(B, H / P, L, D)`` -> ``(B, H, L_local, D)``."""
    return _HeadsToSeq.apply(x, ring, tuple(lengths))


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring, lengths):  # noqa: D102
        ctx.ring, ctx.lengths = ring, lengths
        return _seq_to_heads(x, ring, lengths)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        # The adjoint is the inverse all-to-all; applying its Function keeps double backward exact.
        return _HeadsToSeq.apply(g.contiguous(), ctx.ring, ctx.lengths), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring, lengths):  # noqa: D102
        ctx.ring, ctx.lengths = ring, lengths
        return _heads_to_seq(x, ring, lengths)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _SeqToHeads.apply(g.contiguous(), ctx.ring, ctx.lengths), None, None
