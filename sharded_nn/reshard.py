"""``reshard``: rebalance a slab layout that drifted inside a model to the balanced layout.

Some layer sequences are exact on slabs but move rows between ranks: an explicit pad module
followed by a convolution without padding on a sharded dim lets the first rank own the rows its
left padding added, so each such block shifts the split (32/32 -> 33/31 -> 35/29). The output
then no longer matches targets cut with ``local_slices``, and a later strided layer may see
misaligned slabs. ``reshard`` moves rows between ranks so that the slabs follow
``Layout.balanced`` again (what ``shard``/``local_slices`` cut).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import axis_peers, gather_layouts
from .comm.rebalance import move_rows
from .layout import Layout
from .mesh import domain_axes
from .sharding import _per_dim, resolve_layout

__all__ = ["reshard"]


def reshard(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    align: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """This rank's slab of the same global tensor, in the balanced layout ``local_slices`` cuts.

    Args:
        x: this rank's slab, in any contiguous layout along ``dims`` (sizes may differ from the
            balanced ones; slabs may be empty).
        mesh: mesh with domain axes; ``dims[k]`` is sharded by the k-th domain axis.
        dims: the sharded dims; default ``default_dims(mesh)``.
        align: the alignment of the new layout (int or one per dim), as for ``shard`` (default: the
            alignment stated with ``set_layout`` for these dims, else 1).

    Returns:
        ``x_full[local_slices(x_full.shape, mesh, dims=dims, align=align)]``; ``x`` itself when the
        layout is already balanced.

    Communication: one tiny all-gather of the local shapes, then point-to-point moves of the rows
    that change owner (between neighbours for a small drift), one sharded dim after another. The
    backward moves the gradients back, so input gradients are exact. Call it on every rank.

    Raises:
        ShardingError: (on every rank alike) when the ranks' shapes do not form a slab layout, or
            the balanced layout would leave a rank empty.
    """
    dims, align = resolve_layout(mesh, dims, align, x.shape, "reshard")
    aligns = _per_dim(align, len(dims), "align")
    layouts = gather_layouts(x.shape, mesh, dims, what="reshard", allow_empty=True)
    axes = domain_axes(mesh)
    for d, axis, lay, al in zip(dims, axes, layouts, aligns):
        target = Layout.balanced(lay.size, lay.parts, al)
        if target.sizes != lay.sizes:
            x = move_rows(x, d, lay.sizes, target.sizes, axis_peers(mesh, axis))
    return x
