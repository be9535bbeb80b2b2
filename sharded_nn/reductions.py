"""Global reductions over sharded dims: ``sum``, ``mean``, ``max``, ``argmax``.

For heads (global pooling, then a Linear on the replicated features) and for losses. ``x`` is
this rank's slab of a tensor sharded along ``sharded_dims`` (default: the first spatial dims, one
per domain axis, as for every grid layer); ``dims`` are the dims to reduce. Reducing a sharded
dim all-reduces over the domain axis that shards it, so the result is *replicated* over those
ranks; dims that are sharded but not reduced stay sharded.

Autograd follows the gradient convention (DESIGN.md section 3): the result is replicated, each
rank's gradient of it is partial, and the backward of ``comm.all_reduce_sum`` sums those partial
gradients, so every rank's input gradient is exact. ``max`` splits the gradient evenly among all
elements equal to the maximum, on every rank that holds one, like ``torch.amax``. ``argmax``
returns *global* indices (the first maximal position, like ``torch.argmax``); it has no gradient.

Every rank first agrees on the layout (``gather_layouts``), so bad input raises the same error
on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_reduce_max, all_reduce_sum, gather_layouts
from .errors import ShardingError
from .layout import Layout
from .mesh import domain_axes, group_over

__all__ = ["argmax", "max", "mean", "sum"]


def _plan(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None,
    sharded_dims: int | Sequence[int] | None,
    what: str,
) -> tuple[tuple[int, ...], list[str], dict[int, tuple[str, Layout]]]:
    """(reduced dims, mesh axes to reduce over, {sharded dim: (axis, layout)})."""
    axes = domain_axes(mesh)
    if sharded_dims is None:
        sharded_dims = tuple(range(2, 2 + len(axes)))
    sharded_dims = (sharded_dims,) if isinstance(sharded_dims, int) else tuple(sharded_dims)
    layouts = gather_layouts(x.shape, mesh, sharded_dims, what=what)
    nd = x.dim()
    if dims is None:
        dims = tuple(range(nd))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if any(not -nd <= d < nd for d in dims) or len({d % nd for d in dims}) != len(dims):
        raise ShardingError(f"{what}: dims {dims} must be distinct dims of a {nd}-d tensor (shape {tuple(x.shape)}).")
    dims = tuple(sorted(d % nd for d in dims))
    sharded = {d % nd: (a, lay) for d, a, lay in zip(sharded_dims, axes, layouts)}
    reduce_axes = [a for a in axes if any(sharded.get(d, (None,))[0] == a for d in dims)]
    return dims, reduce_axes, sharded


def _reduce_sum(t: torch.Tensor, mesh: DeviceMesh, axes: list[str]) -> torch.Tensor:
    return all_reduce_sum(t, group_over(mesh, axes)) if axes else t


def sum(  # noqa: A001 - mirrors torch.sum
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.sum(x_full, dims, keepdim)`` from slabs; replicated over the reducing ranks.

    Args:
        x: this rank's slab.
        mesh: mesh with domain axes.
        dims: dims to reduce (default: all).
        keepdim: keep reduced dims with size 1.
        sharded_dims: dims of ``x`` sharded by the domain axes (default: the first spatial dims).
    """
    dims, axes, _ = _plan(x, mesh, dims, sharded_dims, "reductions.sum")
    return _reduce_sum(x.sum(dims, keepdim=keepdim), mesh, axes)


def mean(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.mean(x_full, dims, keepdim)`` from slabs (exact on uneven slabs); see ``sum``."""
    dims, axes, sharded = _plan(x, mesh, dims, sharded_dims, "reductions.mean")
    count = math.prod(sharded[d][1].size if d in sharded else x.shape[d] for d in dims)
    return _reduce_sum(x.sum(dims, keepdim=keepdim), mesh, axes) / count


def max(  # noqa: A001 - mirrors torch.amax
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.amax(x_full, dims, keepdim)`` from slabs; see ``sum``.

    The gradient is split evenly among all elements equal to the maximum (on every rank that
    holds one), exactly like ``torch.amax``. NaNs are not supported.
    """
    dims, axes, _ = _plan(x, mesh, dims, sharded_dims, "reductions.max")
    if not axes:
        return x.amax(dims, keepdim=keepdim)
    group = group_over(mesh, axes)
    top = all_reduce_max(x.detach().amax(dims, keepdim=True), group)
    hit = x.detach() == top
    ties = all_reduce_sum(hit.sum(dims, keepdim=True).to(x.dtype), group)
    # (x - top) is exactly zero where x is maximal, so the value is exactly ``top``; its gradient
    # is hit / ties, summed over the ranks by all_reduce_sum's backward.
    out = top + all_reduce_sum(torch.where(hit, x - top, 0).sum(dims, keepdim=True), group) / ties
    return out if keepdim else out.squeeze(dims)


def argmax(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dim: int,
    *,
    keepdim: bool = False,
    sharded_dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.argmax(x_full, dim, keepdim)`` from slabs: *global* indices along ``dim``.

    Ties resolve to the first (lowest global index) maximum, like ``torch.argmax``. One dim only
    (``dim=None``, the flattened index, is not supported). No gradient.
    """
    if not isinstance(dim, int):
        raise ShardingError(f"reductions.argmax: dim must be one int, got {dim!r}.")
    dims, axes, sharded = _plan(x, mesh, dim, sharded_dims, "reductions.argmax")
    (d,) = dims
    x = x.detach()
    idx = x.argmax(d, keepdim=True)
    if not axes:
        return idx if keepdim else idx.squeeze(d)
    axis, layout = sharded[d]
    idx = idx + layout.starts[mesh.get_local_rank(axis)]
    group = group_over(mesh, axes)
    local_top = x.amax(d, keepdim=True)
    top = all_reduce_max(local_top, group)
    # Lowest global index among the ranks that hold the maximum: max of -index.
    big = layout.size
    cand = torch.where(local_top == top, -idx, -big)
    out = -all_reduce_max(cand, group)
    return out if keepdim else out.squeeze(d)
