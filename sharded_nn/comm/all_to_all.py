"""All-to-all transposes of a sharded dim: which dim a ring's ranks split, uneven lengths.

``transpose_shards`` turns this rank's slab along one dim (whole along another) into the whole
of that dim and a slab of the other: Ulysses attention moves the sharding from the sequence to
the heads and back (``seq_to_heads``, ``heads_to_seq``), the distributed FFT (``sharded_nn.fft``)
makes a sharded dim whole to transform it. Each transpose is the other's backward. The exchange
is point-to-point between every pair of ranks (batched ``isend``/``irecv``), so slabs of
different lengths need no padding, and an empty piece (a partner dim shorter than the ring)
travels as no message at all. Complex tensors travel as their real view (the pair as a last
dim). Each call reserves one message tag for its forward and one for its backward
(``AxisPeers.next_tags``, see peers.py); a pair of ranks exchanges one message each way per
call, so one tag per exchange is enough.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .peers import AxisPeers


def _exchange(
    ring: AxisPeers, sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], like: torch.Tensor, tag: int
):
    """Send ``sends[j]`` to ring rank j and receive a tensor of ``recv_shapes[j]`` from it.

    Empty pieces are not sent: both ends know their shapes (the lengths are the same on every rank).
    """
    me = ring.index
    recvs: list[torch.Tensor] = []
    ops = []
    for j in range(ring.size):
        if j == me:
            recvs.append(sends[j])
            continue
        buf = torch.empty(recv_shapes[j], dtype=like.dtype, device=like.device)
        recvs.append(buf)
        if sends[j].numel():
            ops.append((sends[j].contiguous(), j, True, tag))
        if buf.numel():
            ops.append((buf, j, False, tag))
    for w in ring.start_p2p(ops):
        w.wait()
    return recvs


def _transpose(
    x: torch.Tensor,
    ring: AxisPeers,
    src: int,
    dst: int,
    src_lengths: Sequence[int],
    dst_lengths: Sequence[int],
    tag: int,
) -> torch.Tensor:
    complex_ = x.is_complex()
    if complex_:  # p2p carries real dtypes on every backend; the (re, im) pair becomes a last dim
        x = torch.view_as_real(x.resolve_conj())  # a conjugate view (torch.fft.ifft of a real input) has no real view
    sends = list(x.split(list(dst_lengths), dim=dst))
    shapes = []
    for n in src_lengths:
        s = list(x.shape)
        s[src], s[dst] = n, dst_lengths[ring.index]
        shapes.append(tuple(s))
    out = torch.cat(_exchange(ring, sends, shapes, x, tag), dim=src)
    return torch.view_as_complex(out) if complex_ else out


def transpose_shards(
    x: torch.Tensor, ring: AxisPeers, src: int, dst: int, src_lengths: Sequence[int], dst_lengths: Sequence[int]
) -> torch.Tensor:
    """This rank's slab along ``src`` (whole along ``dst``) -> the whole ``src``, a slab of ``dst``.

    Args:
        x: this rank's slab: ``x.shape[src] == src_lengths[ring.index]`` and ``x.shape[dst] ==
            sum(dst_lengths)``; real or complex.
        ring: the ranks that share the two dims; rank j receives rows
            ``[sum(dst_lengths[:j]), sum(dst_lengths[:j + 1]))`` of ``dst``.
        src, dst: two different dims of ``x``.
        src_lengths, dst_lengths: every rank's length along ``src`` now and along ``dst`` after,
            indexed by ring coordinate, the same on every rank (from a gathered layout); zeros
            allowed.

    Autograd: the backward is the inverse transpose (double backward too). Call it on every rank
    of the ring alike (it reserves message tags).
    """
    src, dst = src % x.dim(), dst % x.dim()
    return _Transpose.apply(x, ring, src, dst, tuple(src_lengths), tuple(dst_lengths), _tags(ring))


def seq_to_heads(x: torch.Tensor, ring: AxisPeers, lengths: Sequence[int]) -> torch.Tensor:
    """``(B, H, L_local, D)`` sequence slabs -> ``(B, H / P, L, D)`` head groups; autograd-aware.

    Args:
        x: this rank's slab; H must be divisible by the ring size (callers check, on every rank).
        ring: the ranks; rank j receives heads ``[j * H / P, (j + 1) * H / P)``.
        lengths: every rank's ``L_local``, indexed by ring coordinate (from a gathered layout).
    """
    heads = (x.shape[1] // ring.size,) * ring.size
    return transpose_shards(x, ring, 2, 1, lengths, heads)


def heads_to_seq(x: torch.Tensor, ring: AxisPeers, lengths: Sequence[int]) -> torch.Tensor:
    """Inverse of ``seq_to_heads``: ``(B, H / P, L, D)`` -> ``(B, H, L_local, D)``."""
    return transpose_shards(x, ring, 1, 2, (x.shape[1],) * ring.size, lengths)


def _tags(ring: AxisPeers) -> tuple[int, int]:
    """(forward tag, backward tag), reserved in program order when the forward is called."""
    t = ring.next_tags(2)
    return t, t + 1


class _Transpose(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring, src, dst, src_lengths, dst_lengths, tags):  # noqa: D102
        ctx.args = (ring, src, dst, src_lengths, dst_lengths)
        ctx.bwd_tag = tags[1]
        return _transpose(x, ring, src, dst, src_lengths, dst_lengths, tags[0])

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        # The adjoint is the inverse transpose; applying its Function keeps double backward exact
        # (a second derivative reserves its tags when that backward builds its graph).
        ring, src, dst, src_lengths, dst_lengths = ctx.args
        tags = (ctx.bwd_tag, ring.next_tags(1))
        return _Transpose.apply(g.contiguous(), ring, dst, src, dst_lengths, src_lengths, tags), *(None,) * 6
