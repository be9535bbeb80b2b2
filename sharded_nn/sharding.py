"""Moving whole tensors in and out of the sharded world: ``shard``, ``gather``, ``local_slices``, ``batch_slice``.

Grid tensors ``(N, C, S0, S1, ...)`` are sharded along ``dims``, the k-th dim by the k-th domain
axis of the mesh, following the balanced aligned rule of ``Layout.balanced``. ``dims`` defaults
to ``default_dims(mesh)``: one tensor dim per domain axis, the first spatial dims, exactly what
every grid layer shards. One rule for the whole library, so that ``shard`` -> layers ->
``gather`` with default arguments agree on every mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_gather_grid, comm_device, gather_layouts, metadata_group, scatter_uneven
from .comm.sizes import SHARD_DIMS, SHARD_SOURCE, check_cut
from .errors import ShardingError
from .layout import Layout
from .mesh import axis_index, axis_size, data_axis, default_dims, domain_axes, domain_group, group_over, stated_layout
from .weights import value_digest


def normalize_dims(dims: int | Sequence[int], ndim: int, what: str) -> tuple[int, ...]:
    """Non-negative, distinct, in-range tensor dims."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    out = []
    for d in dims:
        if not -ndim <= d < ndim:
            raise ShardingError(f"{what}: dim {d} is out of range for a tensor with {ndim} dims.")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ShardingError(f"{what}: dims {dims} repeat a dim.")
    return tuple(out)


def resolve_layout(
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None,
    align: int | Sequence[int] | None,
    shape: Sequence[int],
    what: str,
) -> tuple[tuple[int, ...], int | tuple[int, ...]]:
    """``(dims, align)`` with the defaults of the layout stated for ``mesh`` (``set_layout``).

    ``dims=None``: the stated dims (else ``default_dims(mesh)``); ``align=None``: the stated
    alignment when the dims are the stated ones, else 1. A tensor of too few dims for the
    stated layout raises a ``ShardingError`` that names it.
    """
    stated = stated_layout(mesh)
    if dims is None:
        dims = default_dims(mesh)
        if stated is not None and any(d >= len(shape) for d in dims):
            raise ShardingError(
                f"{what}: the layout stated for this mesh (snn.set_layout / init_mesh(dims=...)) shards dims "
                f"{stated.dims}, but the tensor has {len(shape)} dims (shape {tuple(shape)}). Pass the tensor in "
                "the stated layout, or dims=... for a tensor of another layout."
            )
    dims = normalize_dims(dims, len(shape), what)
    if align is None:
        align = stated.align if stated is not None and stated.dims == dims else 1
    return dims, align


def _per_dim(value: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    vals = (value,) * n if isinstance(value, int) else tuple(value)
    if len(vals) != n:
        raise ShardingError(f"{name} needs one value per sharded dim ({n}), got {value!r}.")
    return vals


def global_layouts(
    global_shape: Sequence[int], mesh: DeviceMesh, dims: Sequence[int], align: int | Sequence[int] = 1
) -> tuple[Layout, ...]:
    """The balanced layouts of ``global_shape`` along ``dims`` on ``mesh``'s domain axes."""
    axes = domain_axes(mesh)
    if len(dims) > len(axes):
        raise ShardingError(
            f"cannot shard {len(dims)} dims {tuple(dims)} on a mesh with {len(axes)} domain axes {axes}."
        )
    aligns = _per_dim(align, len(dims), "align")
    return tuple(
        Layout.balanced(global_shape[d], axis_size(mesh, a), al) for d, a, al in zip(dims, axes, aligns)
    )


def batch_slice(mesh: DeviceMesh, batch_size: int) -> slice:
    """This data replica's slice of a global batch of ``batch_size`` samples.

    On a mesh with a ``"data"`` axis the global batch is cut into equal contiguous parts, one per
    data replica (every domain rank of a replica gets the same part); without one it is the
    whole batch. Equal parts, because ``parallelize`` averages the gradients over the data
    replicas and the loss helpers average over each replica's own samples: their mean is the
    global batch's mean only when every replica holds as many samples.

    Pure arithmetic, no communication: a data loader reads ``dataset[batch_slice(mesh, B)]``.

    Raises:
        ValueError: when ``batch_size`` is not a positive multiple of the data axis size (the
            same facts on every rank, so every rank raises alike).
    """
    axis = data_axis(mesh)
    replicas = 1 if axis is None else axis_size(mesh, axis)
    if batch_size < 1 or batch_size % replicas:
        raise ValueError(
            f"batch_slice: the global batch of {batch_size} samples must be a positive multiple of the "
            f"{replicas} data replicas, so that every replica holds as many samples (the gradients are "
            "averaged over replicas). Pick a multiple, or drop the last incomplete batch."
        )
    per = batch_size // replicas
    start = 0 if axis is None else axis_index(mesh, axis) * per
    return slice(start, start + per)


def local_slices(
    global_shape: Sequence[int] | torch.Tensor,
    mesh: DeviceMesh,
    *,
    dims: int | Sequence[int] | None = None,
    align: int | Sequence[int] | None = None,
    batch_dim: int | None = None,
) -> tuple[slice, ...]:
    """Index slices of this rank's slab: ``x[local_slices(x.shape, mesh)] == shard(x, mesh)``.

    Given a shape: pure arithmetic, no communication, so a data loader can read just its slab
    from disk. ``dims`` and ``align`` as for ``shard`` (default dims: ``default_dims(mesh)``).
    ``batch_dim`` (e.g. 0): also cut that dim of a global batch by the data axis, as
    ``batch_slice`` does (on a data x domain mesh each rank then gets its replica's samples and
    its domain slab of each); default ``None``, the dim is left whole.

    Given a *slab* (a tensor, e.g. a model output whose layout drifted from the balanced one):
    the global slices this rank's slab covers, from its actual layout (one tiny all-gather of
    the local shapes: call it on every rank; ``align`` and ``batch_dim`` do not apply). Cut the
    matching target with ``target_full[local_slices(y_local, mesh, dims=dims)]``, or rebalance
    the slab with ``snn.reshard``.
    """
    if isinstance(global_shape, torch.Tensor):
        return _slab_slices(global_shape, mesh, dims, batch_dim)
    dims, align = resolve_layout(mesh, dims, align, global_shape, "local_slices")
    layouts = global_layouts(global_shape, mesh, dims, align)
    idx = [slice(None)] * len(global_shape)
    for d, a, lay in zip(dims, domain_axes(mesh), layouts):
        idx[d] = lay.slice(axis_index(mesh, a))
    if batch_dim is not None:
        (b,) = normalize_dims(batch_dim, len(global_shape), "local_slices")
        if b in dims:
            raise ShardingError(f"local_slices: batch_dim={batch_dim} is also a sharded dim of dims={dims}.")
        idx[b] = batch_slice(mesh, global_shape[b])
    return tuple(idx)


def _slab_slices(x: torch.Tensor, mesh: DeviceMesh, dims, batch_dim) -> tuple[slice, ...]:
    if batch_dim is not None:
        raise ValueError(
            "local_slices: batch_dim applies to a global shape; a slab's slices follow from its layout alone."
        )
    dims, _ = resolve_layout(mesh, dims, 1, x.shape, "local_slices")
    layouts = gather_layouts(x.shape, mesh, dims, what="local_slices", allow_empty=True)
    idx = [slice(None)] * x.dim()
    for d, a, lay in zip(dims, domain_axes(mesh), layouts):
        idx[d] = lay.slice(axis_index(mesh, a))
    return tuple(idx)


def shard(
    x: torch.Tensor | None,
    mesh: DeviceMesh,
    *,
    dims: int | Sequence[int] | None = None,
    align: int | Sequence[int] | None = None,
    src: int | None = None,
    batch_dim: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """This rank's slab of ``x``.

    Args:
        x: the full tensor. With ``src=None`` every rank passes it; with ``src=r`` only domain
            rank ``r`` (its index in the domain group) passes it and the others pass ``None``,
            so no other rank ever holds the whole tensor.
        mesh: mesh with domain axes; ``dims[k]`` is sharded by the k-th domain axis.
        dims: tensor dims to shard; default ``default_dims(mesh)``, the first spatial dims (one
            per domain axis), as the grid layers shard them.
        align: every slab starts at a multiple of this (int or one per dim): the product of the
            model's strides, or the ViT patch size. Default: the alignment stated with
            ``set_layout`` for these dims, else 1.
        src: domain rank that holds ``x``, or ``None`` when every rank holds it. The slabs are
            sent from the device the domain group communicates on (CUDA for NCCL, CPU for gloo),
            a fact every rank shares: a CPU ``x`` on an NCCL mesh is moved there on ``src``.
        batch_dim: also cut this dim of a global batch by the data axis (``batch_slice``); with
            ``src=None`` only, since ``src`` scatters over the domain ranks of one replica.
        device: put the slab there (``"cuda"``): only the slab is copied, and it keeps the marks
            a converted model checks (``mark_sharded``), which ``.to(device)`` on the result
            would drop. With ``src=None`` only (``src`` sends to the group's device).

    Returns:
        A contiguous tensor that owns its memory (it does not keep ``x`` alive). With ``src=r``
        it lives on the communication device of the domain group on every rank.
    """
    if src is None:
        if x is None:
            raise ValueError("shard: x is None but src is None; pass the tensor on every rank or name a src rank.")
        sl = local_slices(x.shape, mesh, dims=dims, align=align, batch_dim=batch_dim)
        part = x[sl]
        if device is not None and torch.device(device) != part.device:
            out = part.to(device, memory_format=torch.contiguous_format)  # (a copy: another device)
        else:
            out = part.clone(memory_format=torch.contiguous_format)
        return mark_sharded(out, resolve_layout(mesh, dims, align, x.shape, "shard")[0], source_digest(x))
    if device is not None:
        raise ValueError(f"shard: device={device!r} needs src=None; with src={src} the slabs arrive on the domain "
                         "group's device (CUDA under NCCL).")
    if batch_dim is not None:
        raise ValueError(
            f"shard: batch_dim={batch_dim} needs src=None (every rank passes the global batch); with src={src}, "
            "pass each replica's samples (x[batch_slice(mesh, B)]) on the src rank instead."
        )
    return _scatter(x, mesh, dims, align, src)


def mark_sharded(slab: torch.Tensor, dims: Sequence[int], source: int = 0) -> torch.Tensor:
    """Mark ``slab`` (in place; returned) as cut along ``dims`` by the domain axes, from a full
    tensor of digest ``source`` (``source_digest``; 0: not compared).

    A converted model compares the dims with those it takes that input along, and the sources
    across its domain ranks, at its entry (``comm.sizes.entry_facts``): a slab cut along W fed
    to a model sharded along H, or slabs cut from different tensors (a random crop drawn on each
    rank, a data loader shuffled per rank), ran without error and were silently wrong before
    session 61. The mark is a Python attribute: ``clone``, ``.to(other device)`` and arithmetic
    drop it (the model then takes the input as it always did).
    """
    setattr(slab, SHARD_DIMS, tuple(dims))  # (``comm.sizes.SHARD_DIMS``: read at the model's entry)
    setattr(slab, SHARD_SOURCE, int(source))
    return slab


#: Elements of the full tensor that ``source_digest`` reads (evenly spaced, in logical order).
_SOURCE_SAMPLES = 4096


def source_digest(x: torch.Tensor) -> int:
    """A digest of ``x``'s shape and of up to 4,096 of its elements, evenly spaced: equal tensors
    give equal digests on every rank; tensors drawn or loaded apart on each rank almost surely not.
    Costs microseconds (``torch.take`` reads the elements without copying ``x``)."""
    n = x.numel()
    if n == 0 or x.is_meta:
        return hash(tuple(x.shape)) or 1
    idx = torch.linspace(0, n - 1, min(n, _SOURCE_SAMPLES), device=x.device).long()
    sample = torch.take(x.detach(), idx)
    return (hash(tuple(x.shape)) * 1_000_003 + value_digest([sample])) % (1 << 61) or 1


def _scatter(x, mesh, dims, align, src) -> torch.Tensor:
    group = domain_group(mesh)
    me = dist.get_rank(group)
    meta = [None]
    if me == src and x is not None:
        meta = [(tuple(x.shape), x.dtype)]
    # Every rank must learn the global shape before it can compute its slab; a src rank without
    # a tensor still broadcasts, so that all ranks raise together instead of waiting.
    # Over the CPU metadata group: on NCCL a pickled-object broadcast on the domain group itself
    # would stage through the GPU and synchronise the stream.
    dist.broadcast_object_list(meta, src=dist.get_global_rank(group, src), group=metadata_group(mesh))
    if meta[0] is None:
        raise ValueError(f"shard: domain rank src={src} passed x=None; the src rank must pass the full tensor.")
    shape, dtype = meta[0]
    dims, align = resolve_layout(mesh, dims, align, shape, "shard")
    axes = domain_axes(mesh)
    layouts = global_layouts(shape, mesh, dims, align)
    device = comm_device(group)
    # Group rank r's coordinates; the flat domain group orders ranks row-major over the axes.
    coords = _group_coords(mesh, axes)
    shapes = []
    for c in coords:
        s = list(shape)
        for k, d in enumerate(dims):
            s[d] = layouts[k].sizes[c[k]]
        shapes.append(s)
    parts = None
    if me == src:
        parts = []
        for c in coords:
            idx = [slice(None)] * len(shape)
            for k, d in enumerate(dims):
                idx[d] = layouts[k].slice(c[k])
            # Moved to the communication device here, on src only: every rank derives that
            # device from the group (a shared fact), never from its own (or a missing) x.
            parts.append(x[tuple(idx)].to(device))
    return mark_sharded(scatter_uneven(parts, shapes[me], dtype, device, group, src, shapes), dims)


def _group_coords(mesh: DeviceMesh, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Coordinates along ``axes`` of each rank of ``group_over(mesh, axes)``, in group-rank order."""
    group = group_over(mesh, axes)
    sub = mesh if tuple(mesh.mesh_dim_names or ()) == tuple(axes) else mesh[tuple(axes)]
    grid = sub.mesh
    coords = {}
    for flat, rank in enumerate(grid.flatten().tolist()):
        c, rest = [], flat
        for s in reversed(grid.shape):
            rest, ci = divmod(rest, s)
            c.append(ci)
        coords[rank] = tuple(reversed(c))
    return [coords[dist.get_global_rank(group, i)] for i in range(dist.get_world_size(group))]


def gather(x_local: torch.Tensor, mesh: DeviceMesh, *, dims: int | Sequence[int] | None = None) -> torch.Tensor:
    """The full tensor on every rank, assembled from every rank's slab (uneven slabs allowed).

    Args:
        x_local: this rank's slab.
        mesh: mesh with domain axes; ``dims[k]`` is sharded by the k-th domain axis.
        dims: the sharded tensor dims; default ``default_dims(mesh)`` (one per domain axis, as
            ``shard`` and the grid layers). With fewer dims than domain axes, ``x_local`` is
            taken as replicated over the remaining axes.

    Autograd, under the gradient convention (the global loss is the sum of the per-rank losses;
    DESIGN.md section 3): the result is replicated, so each rank's gradient of it is partial; the
    backward sums those over the ranks of the gathered axes and returns this rank's slab of the
    sum. Build losses from the result with ``losses.share(loss, mesh)`` and call ``backward()``
    on every rank. If you call ``y.backward(g)`` by hand on a gathered ``y`` with the full
    gradient ``g`` on every rank, pass ``g / P`` (P = ``domain_size(mesh)``), or the input
    gradient comes out P times too big.
    """
    if dims is None:
        dims, _ = resolve_layout(mesh, None, 1, x_local.shape, "gather")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    # Shapes first: they are validated on every rank alike, before any local check could make
    # one rank raise alone.
    # Empty slabs are fine: a deep stage can leave a rank without rows (issue 10 item 6).
    layouts = gather_layouts(x_local.shape, mesh, dims, what="gather", allow_empty=True)
    dims = normalize_dims(dims, x_local.dim(), "gather")
    check_cut(x_local, dims, "gather")
    # Only the axes that shard a gathered dim take part: over the other domain axes the slab is
    # a replica, whose gradient must stay this replica's share (summing over those axes too
    # would count every replica's share once per replica).
    axes = domain_axes(mesh)[: len(dims)]
    group = group_over(mesh, axes)
    coords = _group_coords(mesh, axes)
    sizes = [lay.sizes for lay in layouts]
    return all_gather_grid(x_local, group, dims, coords, sizes, dist.get_rank(group))
