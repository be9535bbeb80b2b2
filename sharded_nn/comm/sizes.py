"""Agreeing on the layout of a sharded tensor: one small all-gather of the local shapes.

Layers see only their local slab. To validate a layout identically on every rank (so that all
ranks raise the same error together) and to plan halos for uneven slabs, they gather the local
shapes of the domain group once per call. This is the only collective that is not point-to-point
in a convolution's forward; it moves a few integers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ShardingError
from ..layout import Layout
from .collectives import all_gather_stacked
from .ring import comm_device
from ..mesh import axis_size, domain_axes, domain_group

_MAX_NDIM = 12


def gather_layouts(
    shape: Sequence[int],
    mesh: DeviceMesh,
    dims: Sequence[int],
    *,
    what: str = "sharded tensor",
) -> tuple[Layout, ...]:
    """Gather every domain rank's local ``shape`` and return the layout of each sharded dim.

    ``dims[k]`` is sharded by the k-th domain axis of ``mesh``. Every rank receives the same
    shapes and runs the same checks, so an inconsistent input raises the same ``ShardingError``
    on every rank.

    Raises:
        ShardingError: when ranks disagree on unsharded dims or on the decomposition, when a slab
            is empty, or when there are more sharded dims than domain axes.
    """
    axes = domain_axes(mesh)
    if len(dims) > len(axes):
        raise ShardingError(
            f"{what}: {len(dims)} sharded dims {tuple(dims)} but the mesh has only {len(axes)} "
            f"domain axes {axes}. Shard at most one dim per domain axis."
        )
    if len(shape) > _MAX_NDIM:
        raise ShardingError(f"{what}: tensors of more than {_MAX_NDIM} dims are not supported, got {len(shape)}.")
    group = domain_group(mesh)
    device = comm_device(group)
    # Each row carries the rank's domain coordinates, so no assumption is made about how the
    # group orders its ranks.
    n_axes = len(axes)
    width = 1 + n_axes + _MAX_NDIM
    row = [len(shape), *(mesh.get_local_rank(a) for a in axes), *shape]
    mine = torch.tensor(row + [-1] * (width - len(row)), dtype=torch.int64, device=device)
    rows = all_gather_stacked(mine, group).tolist()
    coords = [tuple(r[1 : 1 + n_axes]) for r in rows]
    shapes = [tuple(r[1 + n_axes : 1 + n_axes + r[0]]) for r in rows]
    return layouts_from_shapes(shapes, coords, [axis_size(mesh, a) for a in axes], dims, what=what)


def layouts_from_shapes(
    shapes: Sequence[tuple[int, ...]],
    coords: Sequence[tuple[int, ...]],
    axis_sizes: Sequence[int],
    dims: Sequence[int],
    *,
    what: str = "sharded tensor",
) -> tuple[Layout, ...]:
    """Layouts from the local shapes of all domain ranks and their domain coordinates.

    Pure function of facts every rank shares; see ``gather_layouts``.
    """
    if len({len(s) for s in shapes}) != 1:
        raise ShardingError(f"{what}: ranks hold tensors of different ranks (ndims): {shapes}.")
    ndim = len(shapes[0])
    if any(not -ndim <= d < ndim for d in dims):
        raise ShardingError(f"{what}: dims {tuple(dims)} are out of range for tensors with {ndim} dims.")
    dims = tuple(d % ndim for d in dims)
    layouts = []
    for d in range(ndim):
        if d not in dims:
            if len({s[d] for s in shapes}) != 1:
                raise ShardingError(
                    f"{what}: dim {d} is not sharded but its size differs across ranks: "
                    f"{[s[d] for s in shapes]}. All ranks must hold the same extent of unsharded dims."
                )
    for k, d in enumerate(dims):
        sizes: list[int | None] = [None] * axis_sizes[k]
        for c, s in zip(coords, shapes):
            coord = c[k]
            if sizes[coord] is None:
                sizes[coord] = s[d]
            elif sizes[coord] != s[d]:
                raise ShardingError(
                    f"{what}: ranks at coordinate {coord} of domain axis {k} hold different sizes "
                    f"along dim {d}; a multi-axis decomposition must be a tensor product of slabs. "
                    f"Local shapes: {list(shapes)}."
                )
        layout = Layout(tuple(sizes))  # type: ignore[arg-type]
        layout.require_nonempty(f"{what} along dim {d}")
        layouts.append(layout)
    return tuple(layouts)

