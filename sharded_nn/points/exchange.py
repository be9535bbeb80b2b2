"""Moving rows of point tensors between the domain ranks, built on ``comm.ring_pass``.

``exchange`` is an all-to-all of uneven row blocks done as a store-and-forward ring: at hop
``s`` every rank passes to its right neighbour the blocks that rank ``r - s + 1`` sent and that
have not arrived yet, and keeps the block addressed to it. It moves about ``(P - 1) / 2`` times
more bytes than a direct all-to-all, never holds more than its own part plus one travelling
chunk, and works on gloo and NCCL alike through the ring primitive. The backward is the same
exchange with the transposed counts.

``gather_rows`` fetches given rows of a point tensor that is distributed over the ranks
(the neighbour gather of ``knn``): every rank's block travels once around the ring and each rank
copies the rows it asked for; the backward sends a gradient accumulator around with each block. Each backward applies the
adjoint's autograd Function, so second derivatives (``create_graph``) are exact too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import AxisPeers, gather_ints, ring_pass

__all__ = ["exchange", "gather_rows", "ring_offsets"]


def ring_offsets(n_local: int, ring: AxisPeers) -> list[int]:
    """Every rank's row count (one all-gather of one integer), indexed by ring coordinate."""
    return [r[0] for r in gather_ints([n_local], ring)]


def _exchange(blocks: Sequence[torch.Tensor], counts: list[list[int]], ring: AxisPeers) -> list[torch.Tensor]:
    """Rank r's ``blocks[d]`` (``counts[r][d]`` rows on dim 0) go to rank d; returns the blocks
    received from every source, indexed by source (``blocks[r]`` comes back as its own)."""
    p, r = ring.size, ring.index
    received: list[torch.Tensor | None] = [None] * p
    received[r] = blocks[r]
    if p == 1:
        return received  # type: ignore[return-value]
    trail, dtype, device = blocks[0].shape[1:], blocks[0].dtype, blocks[0].device
    # In transit on this rank before hop s: the blocks of source r - s + 1 addressed to
    # destinations at ring distance >= s from it, in order of distance.
    transit = [blocks[(r + d) % p] for d in range(1, p)]
    for s in range(1, p):
        src = (r - s) % p  # the source whose blocks arrive from the left at this hop
        want = [counts[src][(src + d) % p] for d in range(s, p)]
        send = torch.cat(transit, 0) if transit else torch.empty(0, *trail, dtype=dtype, device=device)
        (got,) = ring_pass(ring, [send], [(sum(want), *trail)], tag=7000 + s).wait()
        parts = list(torch.split(got, want, 0))
        received[src] = parts[0]  # distance s from src: addressed to this rank
        transit = parts[1:]
    return received  # type: ignore[return-value]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dest_counts: list[list[int]], ring: AxisPeers):  # noqa: D102
        ctx.counts, ctx.ring = dest_counts, ring
        blocks = list(torch.split(x, dest_counts[ring.index], 0))
        return torch.cat(_exchange(blocks, dest_counts, ring), 0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        # The adjoint is the exchange with the transposed counts; applying the Function (not
        # ``_exchange``) records it, so that a second derivative is exact.
        counts, p = ctx.counts, ctx.ring.size
        back = [[counts[d][s] for d in range(p)] for s in range(p)]  # transposed
        return _Exchange.apply(g.contiguous(), back, ctx.ring), None, None


def exchange(x: torch.Tensor, dest_counts: list[list[int]], ring: AxisPeers) -> torch.Tensor:
    """All-to-all of row blocks with autograd.

    Args:
        x: ``(n, ...)`` rows grouped by destination rank in ascending order.
        dest_counts: ``dest_counts[src][dst]`` rows, known to every rank.
        ring: the domain ring.

    Returns:
        The rows this rank receives, grouped by source rank in ascending order.
    """
    return _Exchange.apply(x, dest_counts, ring)


def _gather(x: torch.Tensor, idx: torch.Tensor, sizes: list[int], ring: AxisPeers) -> torch.Tensor:
    """``full[idx]`` for a row-distributed ``full`` whose rank-r block is ``x`` on rank r: every
    block travels once around the ring and each rank copies the rows it asked for."""
    # x: (n_local, F); idx: (M,) global rows (concatenation of the blocks in rank order),
    # -1 for "no row" (gives zeros).
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    out = x.new_zeros(idx.shape[0], *x.shape[1:])
    block, owner = x.contiguous(), ring.index
    for step in range(ring.size):
        handle = None
        if step < ring.size - 1:
            nxt = (owner - 1) % ring.size
            handle = ring_pass(ring, [block], [(sizes[nxt], *x.shape[1:])], tag=7100)
        sel = (idx >= offsets[owner]) & (idx < offsets[owner] + sizes[owner])
        if sel.any():
            out[sel] = block[idx[sel] - offsets[owner]]
        if handle is not None:
            (block,) = handle.wait()
            owner = nxt
    return out


def _scatter_add(g: torch.Tensor, idx: torch.Tensor, sizes: list[int], ring: AxisPeers) -> torch.Tensor:
    """The adjoint of ``_gather``: the rows of ``g`` added into the rows ``idx`` of the
    row-distributed tensor, this rank's ``(sizes[rank], ...)`` block returned."""
    p = ring.size
    offsets = [sum(sizes[:k]) for k in range(p)]
    g = g.contiguous()
    # An accumulator for each block travels the ring the way the block did, collecting the
    # rows of every rank; after P hops it is back with its owner.
    owner = ring.index
    acc = g.new_zeros(sizes[owner], *g.shape[1:])
    for step in range(p):
        sel = (idx >= offsets[owner]) & (idx < offsets[owner] + sizes[owner])
        if sel.any():
            acc.index_add_(0, idx[sel] - offsets[owner], g[sel])
        if p > 1:
            nxt = (owner - 1) % p
            (acc,) = ring_pass(ring, [acc], [(sizes[nxt], *g.shape[1:])], tag=7200).wait()
            owner = nxt
    return acc


# Each backward applies the other Function, so that a second derivative (``create_graph``:
# gradient penalties, losses on input derivatives) records the communication and is exact;
# computed by the plain functions above, it would be a constant there: the halo rows' terms of
# the second derivative silently missing.
class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, idx: torch.Tensor, sizes: list[int], ring: AxisPeers):  # noqa: D102
        ctx.sizes, ctx.ring = sizes, ring
        ctx.save_for_backward(idx)
        return _gather(x, idx, sizes, ring)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        (idx,) = ctx.saved_tensors
        return _ScatterRows.apply(g, idx, ctx.sizes, ctx.ring), None, None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, idx: torch.Tensor, sizes: list[int], ring: AxisPeers):  # noqa: D102
        ctx.sizes, ctx.ring = sizes, ring
        ctx.save_for_backward(idx)
        return _scatter_add(g, idx, sizes, ring)

    @staticmethod
    def backward(ctx, gg: torch.Tensor):  # noqa: D102
        (idx,) = ctx.saved_tensors
        return _GatherRows.apply(gg, idx, ctx.sizes, ctx.ring), None, None, None


def gather_rows(x: torch.Tensor, idx: torch.Tensor, sizes: list[int], ring: AxisPeers) -> torch.Tensor:
    """Rows ``idx`` (global, blocks concatenated in rank order; ``-1``: zeros) of a distributed tensor.

    ``x`` is this rank's ``(sizes[rank], ...)`` block. Differentiable: the gradient of every
    gathered row flows back to the rank that owns it.
    """
    return _GatherRows.apply(x, idx, list(sizes), ring)
