"""Autograd-aware collectives over a process group, following the gradient convention.

Convention (DESIGN.md section 3): the global loss is the sum of the per-rank losses. A tensor
replicated on every rank therefore carries a partial gradient on each rank, and the collective
that made it replicated sums those partial gradients in its backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import local_transport
from .traffic import record_call


def _size(group: dist.ProcessGroup | None) -> int:
    """The group's size without ``dist.get_world_size``'s checks (it runs once per collective)."""
    return group.size() if group is not None else dist.get_world_size()


def _pad_to(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    pads: list[int] = []
    for have, want in zip(reversed(x.shape), reversed(shape)):
        pads += [0, want - have]
    return F.pad(x, pads) if any(pads) else x.contiguous()


def _all_reduce(y: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum") -> None:
    """All-reduce ``y`` in place (``op``: ``sum`` or ``max``): small CPU tensors of same-host gloo
    groups through ``local_transport`` (summed in group-rank order, the same bits on every rank),
    everything else through ``dist.all_reduce``."""
    g = local_transport.collective_route(group, y)
    if g is None:
        dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
        return
    record_call(y.numel() * y.element_size())
    buf = y if y.is_contiguous() else y.contiguous()
    local_transport.start_all_reduce(buf, g, op).wait()
    if buf is not y:
        y.copy_(buf)


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``torch.stack`` of every rank's ``x`` (same shape on every rank); no gradient."""
    world = _size(group)
    if not x.is_contiguous():
        x = x.contiguous()
    if world == 1:
        return x.detach().clone().unsqueeze(0)  # nothing to gather (a gloo call still costs a thread hand-off)
    # Allocated in its final shape (few torch calls: a BatchNorm's statistics go through here
    # twice per layer and step, where each call costs more than the bytes).
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    g = local_transport.collective_route(group, x)
    if g is not None:
        record_call(x.numel() * x.element_size())
        local_transport.start_all_gather(out, x, g).wait()
        return out
    # torch 2.14 renamed all_gather_into_tensor; keep working on older releases too. Looked up at
    # call time, so that ``comm.traffic.count_traffic`` sees the call.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out.view(-1), x.detach().reshape(-1), group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup, *, owned: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``group``; the backward sums the (partial) gradients over the group too.

    ``owned=True``: ``x`` is a temporary of the caller's (a partial sum it just computed), which
    may receive the result in place where no graph is recorded: one copy and one allocation
    less (a squeeze-excite's pooled sums under ``no_grad``, sixteen per efficientnet_b0 forward).
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        # No graph to record: skip the autograd Function's per-call cost (statistics of a
        # forward under no_grad, the backward's own all-reduces).
        y = x.detach() if owned else x.detach().clone()
        if _size(group) > 1:
            _all_reduce(y, group)
        return y
    return _AllReduceSum.apply(x, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):  # noqa: D102
        ctx.group = group
        y = x.clone()
        if _size(group) > 1:
            _all_reduce(y, group)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: D102
        # Self-adjoint: applying the Function itself keeps double backward exact.
        return _AllReduceSum.apply(g, ctx.group), None


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Element-wise max over ``group`` (no gradient)."""
    y = x.detach().clone()
    if _size(group) > 1:
        _all_reduce(y, group, "max")
    return y


def broadcast_from_first(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int = 1 << 26
) -> None:
    """Overwrite ``tensors`` (in place, no gradient) with the group's first rank's.

    Every rank passes the same list (same shapes, dtypes, devices, order); tensors of one dtype
    and device travel together in buckets of about ``bucket_bytes`` (few collectives for a model
    of hundreds of parameters).
    """
    if _size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*same, None]:
            if t is not None and (not bucket or size + t.numel() * t.element_size() <= bucket_bytes):
                bucket.append(t)
                size += t.numel() * t.element_size()
                continue
            flat = torch.cat([b.detach().reshape(-1) for b in bucket])
            dist.broadcast(flat, src=src, group=group)
            for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                with torch.no_grad():
                    b.copy_(part.view_as(b))
            bucket, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)


def all_gather_uneven(x: torch.Tensor, group: dist.ProcessGroup, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Gather tensors whose shapes differ per rank (``shapes[r]`` is rank r's); no gradient.

    Pads to the largest shape so that the same code runs on gloo and NCCL.
    """
    big = [max(s[i] for s in shapes) for i in range(x.dim())]
    out = all_gather_stacked(_pad_to(x.detach(), big), group)
    return [out[r][tuple(slice(0, n) for n in s)] for r, s in enumerate(shapes)]


def all_gather_grid(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    dims: Sequence[int],
    coords: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    index: int,
) -> torch.Tensor:
    """Assemble the full tensor from every rank's slab of a tensor-product decomposition.

    Args:
        x: this rank's slab.
        group: the ranks holding the slabs.
        dims: sharded tensor dims.
        coords: ``coords[r][k]`` is group rank r's coordinate along ``dims[k]``.
        sizes: ``sizes[k][c]`` is the slab size at coordinate c along ``dims[k]``.
        index: this rank's index in ``group``.

    The backward sums the gradients of all ranks and returns this rank's slab of the sum.
    """
    return _AllGatherGrid.apply(x, group, tuple(dims), tuple(map(tuple, coords)), tuple(map(tuple, sizes)), index)


def _slab_index(dims, coord, sizes, ndim) -> tuple[slice, ...]:
    idx = [slice(None)] * ndim
    for k, d in enumerate(dims):
        start = sum(sizes[k][: coord[k]])
        idx[d] = slice(start, start + sizes[k][coord[k]])
    return tuple(idx)


class _AllGatherGrid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dims, coords, sizes, index):  # noqa: D102
        shapes = []
        for c in coords:
            s = list(x.shape)
            for k, d in enumerate(dims):
                s[d] = sizes[k][c[k]]
            shapes.append(s)
        parts = all_gather_uneven(x, group, shapes)
        full_shape = list(x.shape)
        for k, d in enumerate(dims):
            full_shape[d] = sum(sizes[k])
        out = x.new_empty(full_shape)
        for c, part in zip(coords, parts):
            out[_slab_index(dims, c, sizes, x.dim())] = part
        ctx.group, ctx.dims, ctx.sizes, ctx.coord = group, dims, sizes, coords[index]
        return out

    # Its communication is not recorded for a second derivative, which would silently miss the
    # neighbours' terms: double backward raises instead.
    @staticmethod
    @once_differentiable
    def backward(ctx, g):  # noqa: D102
        g = g.contiguous().clone()
        _all_reduce(g, ctx.group)
        return g[_slab_index(ctx.dims, ctx.coord, ctx.sizes, g.dim())].contiguous(), None, None, None, None, None


def scatter_uneven(
    parts: Sequence[torch.Tensor] | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup,
    src: int,
    shapes: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Scatter ``parts[r]`` (held by group rank ``src`` only) to group rank r; no gradient."""
    big = [max(s[i] for s in shapes) for i in range(len(shape))]
    out = torch.empty(big, dtype=dtype, device=device)
    src_global = dist.get_global_rank(group, src)
    scatter_list = [_pad_to(p, big) for p in parts] if parts is not None else None
    dist.scatter(out, scatter_list, src=src_global, group=group)
    return out[tuple(slice(0, n) for n in shape)].contiguous()
