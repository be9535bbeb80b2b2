"""All-to-all between sequence sharding and head sharding (Ulysses attention), uneven lengths.

``seq_to_heads`` turns this rank's ``(B, H, L_local, D)`` slab of every head into the full
sequence ``(B, H / P, L, D)`` of this rank's head group; ``heads_to_seq`` is its inverse. Each is
the other's backward. The exchange is point-to-point between every pair of ranks (batched
``isend``/``irecv``), so slabs of different lengths need no padding. Each call reserves one message
tag for its forward and one for its backward (``AxisPeers.next_tags``, see peers.py); a pair of
ranks exchanges one message each way per call, so one tag per exchange is enough.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .peers import AxisPeers


def _exchange(
    ring: AxisPeers, sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], like: torch.Tensor, tag: int
):
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
        ops.append((sends[j].contiguous(), j, True, tag))
        ops.append((buf, j, False, tag))
    for w in ring.start_p2p(ops):
        w.wait()
    return recvs


def _seq_to_heads(x: torch.Tensor, ring: AxisPeers, lengths: Sequence[int], tag: int) -> torch.Tensor:
    b, h, _, d = x.shape
    hp = h // ring.size
    sends = list(x.split(hp, dim=1))
    recvs = _exchange(ring, sends, [(b, hp, n, d) for n in lengths], x, tag)
    return torch.cat(recvs, dim=2)


def _heads_to_seq(x: torch.Tensor, ring: AxisPeers, lengths: Sequence[int], tag: int) -> torch.Tensor:
    b, hp, _, d = x.shape
    sends = list(x.split(list(lengths), dim=2))
    n = lengths[ring.index]
    recvs = _exchange(ring, sends, [(b, hp, n, d)] * ring.size, x, tag)
    return torch.cat(recvs, dim=1)


def seq_to_heads(x: torch.Tensor, ring: AxisPeers, lengths: Sequence[int]) -> torch.Tensor:
    """``(B, H, L_local, D)`` sequence slabs -> ``(B, H / P, L, D)`` head groups; autograd-aware.

    Args:
        x: this rank's slab; H must be divisible by the ring size (callers check, on every rank).
        ring: the ranks; rank j receives heads ``[j * H / P, (j + 1) * H / P)``.
        lengths: every rank's ``L_local``, indexed by ring coordinate (from a gathered layout).
    """
    return _SeqToHeads.apply(x, ring, tuple(lengths), _tags(ring))


def heads_to_seq(x: torch.Tensor, ring: AxisPeers, lengths: Sequence[int]) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``(B, H / P, L, D)`` -> ``(B, H, L_local, D)``."""
    return _HeadsToSeq.apply(x, ring, tuple(lengths), _tags(ring))


def _tags(ring: AxisPeers) -> tuple[int, int]:
    """(forward tag, backward tag), reserved in program order when the forward is called."""
    t = ring.next_tags(2)
    return t, t + 1


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring, lengths, tags):  # noqa: D102
        ctx.ring, ctx.lengths, ctx.bwd_tag = ring, lengths, tags[1]
        return _seq_to_heads(x, ring, lengths, tags[0])

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        # The adjoint is the inverse all-to-all; applying its Function keeps double backward exact
        # (a second derivative reserves its tags when that backward builds its graph).
        tags = (ctx.bwd_tag, ctx.ring.next_tags(1))
        return _HeadsToSeq.apply(g.contiguous(), ctx.ring, ctx.lengths, tags), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring, lengths, tags):  # noqa: D102
        ctx.ring, ctx.lengths, ctx.bwd_tag = ring, lengths, tags[1]
        return _heads_to_seq(x, ring, lengths, tags[0])

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        tags = (ctx.bwd_tag, ctx.ring.next_tags(1))
        return _SeqToHeads.apply(g.contiguous(), ctx.ring, ctx.lengths, tags), None, None, None
