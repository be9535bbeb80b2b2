"""Halo reduction: the adjoint of a halo exchange.

A layer that *scatters* each input position into a window of outputs (a transposed convolution,
an unpooling) produces, on every rank, a few outputs that belong to its neighbours. ``halo_add``
sends those strips to the neighbours that own them and adds what it receives into the edges of
its own slab. It is the exact adjoint of ``halo_cat`` with the same ``HaloSpec``: where
``halo_cat`` reads ``left[r]`` positions from the left neighbour's tail and ``right[r]`` from the
right neighbour's head, ``halo_add`` writes them back there (adding). Its backward is therefore
an ordinary halo exchange of the gradient, and vice versa.

The message ordering and tags are those of ``halo.py`` (``_exchange``, ``HALO_TAGS`` reserved per
call for the forward and the backward exchange), so the two can be mixed on one ring without
confusing gloo's tag matching or NCCL's issue-order matching.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .halo import HALO_TAGS, HaloSpec, _cat_halos, _check_ring, _edge, _empty, _exchange
from .peers import AxisPeers


def halo_add(x: torch.Tensor, spec: HaloSpec, ring: AxisPeers, *, tag: int | None = None) -> torch.Tensor:
    """Reduce the strips of ``x`` that belong to the neighbours into their slabs.

    Args:
        x: ``[L | core | R]`` along ``spec.dim``, where ``L`` (``spec.left[r]`` positions) belongs
            to the tail of the left neighbour's core and ``R`` (``spec.right[r]`` positions) to
            the head of the right neighbour's core.
        spec: widths for every rank of the axis; validate it with ``spec.check(core_sizes, ...)``.
        ring: the axis, from ``axis_peers(mesh, axis)``.
        tag: first of ``HALO_TAGS`` tags reserved with ``ring.next_tags``; ``None`` reserves them.

    Returns:
        ``core`` with the neighbours' strips added into its edges (autograd-aware; the backward
        is ``halo_cat`` of the gradient).
    """
    _check_ring(spec, ring)
    if not any(spec.left) and not any(spec.right):
        # No rank holds a strip of a neighbour's (a transposed conv whose kernel equals its
        # stride, a UNet's usual up-sampling): nothing moves, and ``x`` is already the core. The
        # widths are every rank's, so all ranks take this branch alike (no tag is reserved by
        # any). The Function would copy the slab once in forward and once in backward.
        return x
    return _HaloAdd.apply(x, spec, ring, ring.next_tags(HALO_TAGS) if tag is None else tag)


class _HaloAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: HaloSpec, ring: AxisPeers, tag: int):  # noqa: D102
        d, r = spec.dim, ring.index
        lw, rw = spec.left[r], spec.right[r]
        n = x.shape[d] - lw - rw
        # What the neighbours send here is what halo_cat would have sent there: the widths of
        # halo_cat's sends are this rank's receives.
        from_left, from_right = spec.send_widths(r)
        core = x.narrow(d, lw, n).clone()
        head, tail = _empty(core, d, from_left), _empty(core, d, from_right)
        send_left, send_right = _edge(x, d, lw, True), _edge(x, d, rw, False)
        for w in _exchange(ring, spec.periodic, send_left, send_right, head, tail, tag):
            w.wait()
        if head is not None:
            core.narrow(d, 0, from_left).add_(head)
        if tail is not None:
            core.narrow(d, n - from_right, from_right).add_(tail)
        ctx.spec, ctx.ring, ctx.tag = spec, ring, tag
        return core

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        # The adjoint of "send and add" is "read back": each strip's gradient is the gradient of
        # the positions it was added into, which is exactly a halo exchange of g.
        return _cat_halos(g.contiguous(), ctx.spec, ctx.ring, ctx.tag + 2), None, None, None
