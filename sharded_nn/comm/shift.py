"""Periodic shift along a sharded dim: ``torch.roll`` of the global tensor, from slabs.

Rolling the global tensor by ``s`` along a sharded dim is, for each rank, a periodic halo of
``s`` positions from its left neighbour (or ``G - s`` from its right one, whichever is shorter)
followed by a crop back to the slab's size: point-to-point between neighbours only, autograd-
aware through ``halo_cat`` (the gradient of the halo returns to its owner). A shift longer than
a neighbour's slab (``fftshift``'s half of the domain on more than two ranks, or on uneven
slabs) fetches each rank's new rows from whichever ranks hold them (``halo_gather``, multi-hop;
the traffic is the rows that change rank).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..layout import Layout
from .halo import HaloGather, HaloSpec, halo_cat, halo_gather
from .peers import axis_peers
from .sizes import gather_layouts

__all__ = ["periodic_shift"]


def periodic_shift(
    x: torch.Tensor,
    shift: int,
    dim: int,
    mesh: DeviceMesh,
    dims: tuple[int, ...],
    *,
    what: str = "periodic_shift",
    layout: Layout | None = None,
) -> torch.Tensor:
    """This rank's slab of ``torch.roll(x_full, shift, dim)``, where ``dim`` is sharded.

    Args:
        x: this rank's slab.
        shift: the roll along ``dim`` (any integer, as ``torch.roll``; the same on every rank).
        dim: the sharded dim to roll along; must be in ``dims``.
        mesh: mesh with domain axes.
        dims: the sharded dims of ``x``, ``dims[k]`` sharded by the k-th domain axis.
        what: the caller's name, for messages.
        layout: the layout of ``dim``, when the caller has agreed on it already (the same on every
            rank); saves the all-gather of the slab shapes.

    Raises:
        ShardingError: (on every rank alike) when the layouts disagree (``gather_layouts``).
    """
    from ..mesh import domain_axes

    dim = dim % x.dim()
    k = list(dims).index(dim)
    if layout is None:
        # Empty slabs (a deep stage on many ranks) take part: their rows are none, and the
        # multi-hop path below reads past them.
        layout = gather_layouts(x.shape, mesh, dims, what=what, allow_empty=True)[k]
    ring = axis_peers(mesh, domain_axes(mesh)[k])
    if layout.size == 0:
        return x  # nothing to roll on any rank
    s = shift % layout.size
    if s == 0:
        return x
    if ring.size == 1:
        return torch.roll(x, s, dim)
    p = layout.parts
    n = x.shape[dim]
    if s <= layout.size - s:
        # out[i] = in[i - s]: the last s positions of the left neighbour, then our first n - s.
        spec = HaloSpec(dim, (s,) * p, (0,) * p, periodic=True)
        if spec.fits(layout.sizes):
            return halo_cat(x, spec, ring).narrow(dim, 0, n)
    else:
        w = layout.size - s
        # out[i] = in[i + w]: our last n - w positions, then the first w of the right neighbour.
        spec = HaloSpec(dim, (0,) * p, (w,) * p, periodic=True)
        if spec.fits(layout.sizes):
            return halo_cat(x, spec, ring).narrow(dim, w, n)
    # Multi-hop: rank r's rows are the global rows [start_r - s, start_r - s + n_r), wrapped.
    g = layout.size
    rows = tuple(tuple((a - s + i) % g for i in range(m)) for a, m in zip(layout.starts, layout.sizes))
    gather = HaloGather(dim, tuple(layout.sizes), rows, ((0, 0),) * p, ((),) * p)
    return halo_gather(x, gather, ring)
