"""Device meshes: torch's ``DeviceMesh`` with a "domain" axis (or "domain0", "domain1", ...).

The domain axes shard the spatial dims of one sample, in order: one domain axis shards S0, two
shard S0 and S1, and so on. An optional "data" axis holds data-parallel replicas. Every API of
sharded_nn takes any ``DeviceMesh`` that uses these axis names; ``init_mesh`` is a convenience.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import gloo_exit, host_cache

DATA_AXIS = "data"
DOMAIN_AXIS = "domain"
#: Collectives that wait longer than this raise instead of hanging (see DESIGN.md section 4).
DEFAULT_TIMEOUT = timedelta(minutes=5)


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    """NCCL for CUDA meshes, gloo for CPU meshes."""
    return "nccl" if device_type == "cuda" else "gloo"


def ensure_process_group(device_type: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialise the default process group from torchrun's environment when none exists."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_mesh: no process group exists and the environment lacks {missing}. "
            "Start the script with torchrun, or run it through sharded_nn.launch(fn, nprocs)."
        )
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend_for(device_type), timeout=timeout)


def init_mesh(
    domain: int | Sequence[int] | None = None,
    data: int = 1,
    *,
    device_type: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    dims: int | Sequence[int] | None = None,
    align: int | Sequence[int] = 1,
) -> DeviceMesh:
    """Create a mesh with a data axis and one or more domain axes.

    Args:
        domain: ranks that share one sample. An int gives one axis named ``"domain"``; a tuple
            such as ``(2, 2)`` gives axes ``"domain0", "domain1"``, one per sharded spatial dim.
            ``None`` uses every rank not taken by ``data``.
        data: data-parallel replicas. The mesh has a leading ``"data"`` axis when ``data > 1``.
        device_type: ``"cuda"`` or ``"cpu"``; defaults to CUDA when available.
        timeout: collective timeout, so that a failed rank ends the job with an error.
        dims, align: state the layout once (``set_layout``): every call taking ``dims=None`` /
            ``align=None`` then defaults to them. Without either, nothing is stated.

    Returns:
        A ``DeviceMesh`` of shape ``(data, *domain)`` (``data`` omitted when 1).
    """
    device_type = device_type or default_device_type()
    ensure_process_group(device_type, timeout)
    if device_type == "cpu":
        # Reuse large activation buffers instead of faulting them in on every step (torchrun has
        # no launch to do it); SHARDED_NN_HOST_CACHE=0 keeps torch's allocator.
        host_cache.install_default()
        gloo_exit.arm()  # gloo's workers get a moment at exit (see there: else a rare SIGABRT)
    world = dist.get_world_size()
    if data < 1:
        raise ValueError(f"init_mesh: data must be >= 1, got {data}. Pass data=1 (no data-parallel axis) or more.")
    if domain is None:
        if world % data:
            raise ValueError(
                f"init_mesh: world size {world} is not divisible by data={data}. Pass a data size that divides "
                "the world size, or domain= explicitly."
            )
        domain = world // data
    domain_shape = (domain,) if isinstance(domain, int) else tuple(int(d) for d in domain)
    if not domain_shape or any(d < 1 for d in domain_shape):
        raise ValueError(f"init_mesh: domain sizes must be >= 1, got {domain!r}. Pass positive ints.")
    if data * math.prod(domain_shape) != world:
        raise ValueError(
            f"init_mesh: data={data} x domain={domain_shape} needs {data * math.prod(domain_shape)} "
            f"ranks, but the process group has {world}. Pass sizes whose product is the world size."
        )
    names = (DOMAIN_AXIS,) if len(domain_shape) == 1 else tuple(f"{DOMAIN_AXIS}{i}" for i in range(len(domain_shape)))
    shape = domain_shape
    if data > 1:
        names, shape = (DATA_AXIS, *names), (data, *domain_shape)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if dims is not None or align != 1:
        set_layout(mesh, dims=dims, align=align)
    return mesh


def domain_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """Names of the mesh's domain axes, in the order of the spatial dims they shard."""
    names = mesh.mesh_dim_names or ()
    if DOMAIN_AXIS in names:
        return (DOMAIN_AXIS,)
    numbered = sorted(
        (n for n in names if n.startswith(DOMAIN_AXIS) and n[len(DOMAIN_AXIS):].isdigit()),
        key=lambda n: int(n[len(DOMAIN_AXIS):]),
    )
    if not numbered:
        raise ValueError(
            f"sharded_nn needs a mesh with a 'domain' axis (or 'domain0', 'domain1', ...); got a mesh "
            f"with axes {names}. Build it with sharded_nn.init_mesh(domain=P) or name the axes."
        )
    return tuple(numbered)


def data_axis(mesh: DeviceMesh) -> str | None:
    """The data-parallel axis name, or None when the mesh has none."""
    return DATA_AXIS if DATA_AXIS in (mesh.mesh_dim_names or ()) else None


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """The number of ranks along ``axis`` (remembered per mesh: torch's lookup by name is several
    calls, and layers and collectives ask on every call)."""
    return mesh_cached(mesh, ("axis_size", axis), lambda: mesh.size(mesh._get_mesh_dim_by_name(axis)))


#: Device types by code: the type of a rank's tensors travels in agreements as a small integer
#: (``len(_DEVICES)``: another one).
_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "meta")


def device_code(device: torch.device) -> int:
    """A small integer naming the type of ``device``, the same on every rank."""
    return _DEVICES.index(device.type) if device.type in _DEVICES else len(_DEVICES)


def device_name(code: int) -> str:
    return _DEVICES[code] if 0 <= code < len(_DEVICES) else "another device"


def one_rank(mesh: DeviceMesh) -> bool:
    """Whether the domain of ``mesh`` is one rank (every domain axis of size 1): tensors are whole."""
    return mesh_cached(mesh, ("one_rank",), lambda: all(axis_size(mesh, a) == 1 for a in domain_axes(mesh)))


def axis_index(mesh: DeviceMesh, axis: str) -> int:
    """This rank's coordinate along ``axis`` (remembered per mesh: ``DeviceMesh.get_local_rank``
    costs tens of microseconds, and layers ask for it on every call)."""
    return mesh_cached(mesh, ("axis_index", axis), lambda: mesh.get_local_rank(axis))


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    """The process group along ``axis`` through this rank (remembered per mesh:
    ``DeviceMesh.get_group`` costs about thirty Python calls, and every routed reduction asks)."""
    return mesh_cached(mesh, ("axis_group", axis), lambda: mesh.get_group(axis))


def axis_global_ranks(mesh: DeviceMesh, axis: str) -> tuple[int, ...]:
    """Global ranks along ``axis`` through this rank, indexed by the axis coordinate."""
    group = axis_group(mesh, axis)
    return tuple(dist.get_global_rank(group, i) for i in range(dist.get_world_size(group)))


def domain_size(mesh: DeviceMesh) -> int:
    """Number of ranks that share one sample (product of the domain axis sizes)."""
    return math.prod(axis_size(mesh, a) for a in domain_axes(mesh))


def domain_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over all domain axes of this rank's sample."""
    return group_over(mesh, domain_axes(mesh))


def group_over(mesh: DeviceMesh, axes: Sequence[str]) -> dist.ProcessGroup:
    """One process group over several mesh axes (through this rank).

    Several axes are flattened into one group the first time they are asked for on this mesh
    object (a collective: every rank of the mesh must make the same calls in the same order,
    which SPMD code does); later calls return the stored group.
    """
    axes = tuple(axes)
    if len(axes) == 1:
        return axis_group(mesh, axes[0])
    return mesh_cached(mesh, ("group_over", axes), lambda: _flat_mesh(mesh, axes).get_group())


def _flat_mesh(mesh: DeviceMesh, axes: tuple[str, ...], *, backend: str | None = None) -> DeviceMesh:
    # torch stores flattened meshes by name on the root mesh (``_flatten_mapping``), so asking
    # twice returns the same mesh and process group. Flattening creates a process group, which
    # every rank must do in the same order; the name is built from facts every rank shares.
    sub = mesh if axes == tuple(mesh.mesh_dim_names) else mesh[axes]
    name = "_".join(axes) + ("_flat" if backend is None else f"_flat_{backend}")
    if backend is None:
        return sub._flatten(name)
    return sub._flatten(name, backend_override=backend)


# --------------------------------------------------------------------------- per-mesh store

_T = TypeVar("_T")
#: Objects derived from a mesh (groups, axis peers), stored per mesh *object*: ``id(mesh)`` ->
#: (weak reference to the mesh, its dict). Not keyed by ``DeviceMesh`` equality, which ignores
#: the process groups: a mesh built after ``destroy_process_group`` equals the old one but must
#: not get the old (destroyed) groups. Entries die with their mesh, so nothing keeps groups alive.
_STORE: dict[int, tuple[weakref.ref, dict[Any, Any]]] = {}


def mesh_cached(mesh: DeviceMesh, key: Any, make: Callable[[], _T]) -> _T:
    """``make()`` computed once per mesh object and ``key``, and dropped when the mesh dies.

    Rank symmetry (DESIGN.md section 4): a hit or miss depends only on which mesh object is
    asked and on ``key``; SPMD code builds its meshes and asks for the same keys in the same
    order on every rank, so all ranks hit or miss together and ``make`` may run a collective.
    Keys must therefore be facts every rank shares (axis names, module configuration), never
    local shapes.
    """
    store = _mesh_store(mesh)
    try:
        return store[key]
    except KeyError:
        value = store[key] = make()
        return value


def _mesh_store(mesh: DeviceMesh) -> dict[Any, Any]:
    """The per-mesh-object dict of ``mesh_cached`` and ``set_layout``."""
    mid = id(mesh)
    entry = _STORE.get(mid)
    if entry is None or entry[0]() is not mesh:
        entry = (weakref.ref(mesh, lambda ref, mid=mid: _forget(mid, ref)), {})
        _STORE[mid] = entry
    return entry[1]


def _forget(mid: int, ref: weakref.ref) -> None:
    entry = _STORE.get(mid)
    if entry is not None and entry[0] is ref:
        del _STORE[mid]


def default_dims(mesh: DeviceMesh) -> tuple[int, ...]:
    """The tensor dims the domain axes shard by default.

    The dims stated with ``set_layout`` (or ``init_mesh(dims=...)``) for this mesh when stated;
    otherwise the first spatial dims of ``(N, C, S0, ...)``, one per domain axis, in order:
    ``(2,)`` for a 1-D domain, ``(2, 3)`` for a 2-D domain. ``shard``, ``local_slices``,
    ``gather``, ``reshard``, the reductions, ``convert`` and every grid layer use this rule when
    ``dims`` is not given. Token tensors ``(B, L, C)`` and point tensors ``(B, N, C)`` shard
    dim 1: state ``dims=(1,)`` once, or pass it per call.
    """
    stated = stated_layout(mesh)
    if stated is not None:
        return stated.dims
    return tuple(range(2, 2 + len(domain_axes(mesh))))


@dataclass(frozen=True)
class StatedLayout:
    """The layout a program states once for a mesh (``set_layout``).

    Attributes:
        dims: the tensor dims the domain axes shard, ``dims[k]`` by the k-th domain axis.
        align: every slab starts at a multiple of this, one value per dim.
    """

    dims: tuple[int, ...]
    align: tuple[int, ...]


def set_layout(
    mesh: DeviceMesh, *, dims: int | Sequence[int] | None = None, align: int | Sequence[int] = 1
) -> StatedLayout:
    """State once which tensor dims ``mesh``'s domain axes shard, and the alignment of the slabs.

    Every call that takes ``dims=None`` (``shard``, ``local_slices``, ``gather``, ``reshard``,
    ``convert``, the reductions, every grid layer made afterwards) then defaults to these dims,
    and ``shard``/``local_slices``/``reshard`` with ``align=None`` to this alignment, so a
    program cannot shard on one axis and gather on another by forgetting an argument. A tensor
    whose number of dims cannot carry the stated dims raises a ``ShardingError`` naming the
    stated layout. Stored on the mesh object (dropped with it); call it alike on every rank.

    Args:
        mesh: the mesh (``init_mesh(..., dims=..., align=...)`` calls this for you).
        dims: one tensor dim per domain axis at most (non-negative: counted from the front, as
            for ``(N, C, S0, ...)`` grids; ``(1,)`` for tokens or points). Default: the first
            spatial dims.
        align: an int, or one value per dim (e.g. ``snn.alignment(model, dims)``).

    Returns:
        The stated layout.
    """
    axes = domain_axes(mesh)
    dims_t = tuple(range(2, 2 + len(axes))) if dims is None else ((dims,) if isinstance(dims, int) else tuple(dims))
    if not dims_t or len(dims_t) > len(axes) or any(d < 0 for d in dims_t) or len(set(dims_t)) != len(dims_t):
        raise ValueError(
            f"set_layout: dims must be 1..{len(axes)} distinct non-negative tensor dims (one per domain axis "
            f"{axes}), got {dims!r}."
        )
    align_t = (align,) * len(dims_t) if isinstance(align, int) else tuple(int(a) for a in align)
    if len(align_t) != len(dims_t) or any(a < 1 for a in align_t):
        raise ValueError(f"set_layout: align must be >= 1, an int or one value per dim of {dims_t}; got {align!r}.")
    stated = StatedLayout(dims_t, align_t)
    _mesh_store(mesh)[_LAYOUT_KEY] = stated
    return stated


def stated_layout(mesh: DeviceMesh) -> StatedLayout | None:
    """The layout stated for ``mesh`` with ``set_layout``, or ``None``."""
    entry = _STORE.get(id(mesh))
    if entry is None or entry[0]() is not mesh:
        return None
    return entry[1].get(_LAYOUT_KEY)


_LAYOUT_KEY = ("stated_layout",)
