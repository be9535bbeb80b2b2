"""What every sharded layer shares: constructor, mesh options, ``from_module``, ``extra_repr``, agreement.

``agree`` is how a layer learns the layout of its input. It gathers, in one small all-gather,
every domain rank's local shape together with the facts a shape does not show (dtype, whether
the input takes part in backward, call arguments such as ``output_size``), and validates them
in the same order on every rank. Every later check of a layer is then decided on facts that
all ranks share, so a bad input on one rank raises the same error on every rank instead of
leaving its peers waiting in a collective (DESIGN.md section 4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from ..comm import domain_peers, gather_ints, layouts_from_shapes
from ..comm.sizes import (
    ENTRY_HINT, SHARD_FACT, SOURCE_FACT, raise_if_misplaced, scope_active, scope_coords, scope_declare, scope_forget,
    scope_lookup, scope_take_entry, warn_if_other_sources,
)
from ..compile_boundary import eager_under_compile, run_eagerly
from ..errors import ShardingError
from ..layout import Layout
from ..mesh import axis_index, axis_size, default_dims, device_code, device_name, domain_axes
from ..weights import VALUES_FACT, VALUES_HINT, rearm_checked, take_digest, values_shown
from ..weights import arm as arm_values_check

#: Tensors with more dims than this are refused (the gathered rows have a fixed width).
MAX_NDIM = 12
#: dtypes by code; the code of a dtype travels in the agreement (``len(_DTYPES)``: another one).
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype``, the same on every rank."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "another dtype"



class BoundedCache:
    """A small least-recently-used map (plain dicts: no ``functools`` wrapper for Dynamo to warn on).

    A cache whose miss runs a collective must be keyed by facts every rank shares (gathered
    layouts, module configuration), never by a local shape: one rank would hit while another
    missed, and the ranks would diverge (DESIGN.md section 4).
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: dict = {}

    def get(self, key, make: Callable[..., object], *args):
        """The value for ``key``, made by ``make(*args)`` on a miss; the oldest entry goes when full.

        Under ``torch.compile`` the value is made afresh and baked into the traced graph (as
        Dynamo does with ``functools`` caches), so that no traced graph depends on the cache's
        state. (``make`` takes arguments rather than being a closure: Dynamo mishandled a closure
        over a loop variable across a graph break, and the halo corrections came out wrong.)
        """
        if torch.compiler.is_compiling():
            return make(*args)
        if key in self._data:
            value = self._data.pop(key)  # re-inserted below: the most recently used is last
        else:
            value = make(*args)
            if len(self._data) >= self.maxsize:
                del self._data[next(iter(self._data))]
        self._data[key] = value
        return value

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()


def check_mesh(mesh: object, what: str) -> None:
    """The type check every layer makes on its ``mesh`` argument."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a torch DeviceMesh, got {type(mesh).__name__}.")


def size_fact(size: Sequence[int] | None, n: int) -> tuple[int, ...]:
    """A fixed-width encoding of an optional size argument: ``(len, last n entries, -1 padded)``."""
    if size is None:
        return (-1,) * (n + 1)
    size = tuple(int(s) for s in size)
    tail = size[-n:]
    return (len(size), *tail, *(-1,) * (n - len(tail)))


@dataclass(frozen=True)
class Agreement:
    """What ``agree`` returns: facts every domain rank holds identically.

    Attributes:
        layouts: the layout of each sharded dim.
        shapes: every domain rank's local shape (in gathered order).
        local: every domain rank's ``local`` facts (in gathered order).
    """

    layouts: tuple[Layout, ...]
    shapes: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]

    def global_shape(self, dims: Sequence[int]) -> tuple[int, ...]:
        """The global shape: a local shape with every sharded dim at its global size."""
        shape = list(self.shapes[0])
        for lay, d in zip(self.layouts, dims):
            shape[d] = lay.size
        return tuple(shape)

    def ranks_where(self, pred: Callable[[tuple[int, ...]], bool]) -> list[int]:
        """Domain ranks (gathered order) whose ``local`` facts satisfy ``pred``."""
        return [r for r, facts in enumerate(self.local) if pred(facts)]


def gather_facts(
    mesh: DeviceMesh,
    what: str,
    *,
    same: Mapping[str, Sequence[int]] | None = None,
    local: Sequence[int] = (),
) -> tuple[tuple[int, ...], ...]:
    """Gather per-rank facts over the domain ranks; every ``same`` fact must agree everywhere.

    Args:
        mesh: the mesh whose domain ranks take part.
        what: the caller's name, for messages.
        same: named facts (fixed-width int tuples) that every rank must pass identically: call
            arguments and flags of a single-program call. A mismatch raises on every rank.
        local: facts that may differ by rank (shapes, validity flags); returned for the caller
            to validate from the same rows on every rank. Must have the same length everywhere.

    Returns:
        Every domain rank's ``local`` facts, in gathered order.
    """
    same = dict(same or {})
    flat = [v for vals in same.values() for v in vals]
    rows = gather_ints([*flat, *local], domain_peers(mesh))
    _check_same(rows, 0, same, what)
    return tuple(tuple(r[len(flat) :]) for r in rows)


def agree(
    x: torch.Tensor,
    mesh: DeviceMesh,
    dims: Sequence[int],
    *,
    what: str,
    ndims: Collection[int] | None = None,
    expected: str = "",
    same: Mapping[str, Sequence[int]] | None = None,
    local: Sequence[int] = (),
    requires_grad: bool | None = None,
    allow_empty: bool = False,
    scoped: bool = False,
) -> Agreement:
    """Agree with the other domain ranks on the input: layouts, dtype, arguments; one all-gather.

    ``dims[k]`` is sharded by the k-th domain axis of ``mesh``. Validated in this order, from
    gathered facts only, so every rank raises the same error: the number of dims, the ``same``
    facts (``dtype`` of ``x`` and ``requires_grad``, whether ``x`` takes part in backward,
    included), ``ndims``, then the layouts (unsharded dims must agree, no empty slab).

    Args:
        x: this rank's slab.
        mesh: the mesh; ``dims`` are sharded by its domain axes in order.
        dims: sharded tensor dims.
        what: the caller's name, for messages.
        ndims: accepted numbers of dims (None: any); ``expected`` describes them in the message.
        same: further named facts every rank must pass identically (see ``gather_facts``).
        local: per-rank facts returned in ``Agreement.local``.
        requires_grad: whether this rank runs the layer's backward communication; default
            ``x.requires_grad`` while grad mode is on.
        allow_empty: accept empty slabs (layers that carry an empty slab through, e.g. after a
            pooling that leaves a rank without outputs); otherwise they raise.
        scoped: inside a ``comm.sizes.layout_scope`` (one model forward), answer from the
            layouts agreed or declared earlier in it when they name ``x``'s layout unambiguously
            (no collective; the number of dims and empty slabs are still checked, from those
            layouts), and remember the agreed layouts otherwise. Only for callers with no
            ``same`` or ``local`` facts, whose output layout is either ``x``'s or declared with
            ``scope_declare``. Callers that do not opt in make the scope forget its layouts.

    Raises:
        ShardingError: ranks disagree on the number of dims, a ``same`` fact or an unsharded
            size; the number of dims is not one of ``ndims``; a slab is empty; more than
            ``MAX_NDIM`` dims.
    """
    shape = tuple(x.shape)
    scoped = scoped and not same and not local
    if scoped:
        hit = scope_lookup(mesh, dims, shape)
        if hit is not None:
            return _scoped_agreement(hit, shape, mesh, dims, what, ndims, expected, allow_empty)
    axes = domain_axes(mesh)
    if requires_grad is None:
        requires_grad = x.requires_grad
    grad = int(bool(requires_grad) and torch.is_grad_enabled())
    # The device type too: with NCCL a CPU slab on one rank would fail there alone, mid-exchange.
    facts = {"dtype": (dtype_code(x.dtype),), "device": (device_code(x.device),), "requires_grad": (grad,),
             **(same or {})}
    # The first agreement of a layout scope also checks the model's entry facts, from which the
    # per-call facts of the layers that derive their layouts later follow (``entry_facts``).
    facts.update({f"the model's {k} at its entry": v for k, v in scope_take_entry().items()})
    # Each row carries the rank's domain coordinates, so no assumption is made about how the
    # group orders its ranks; shapes are padded to a fixed width.
    coords = [axis_index(mesh, a) for a in axes]
    padded = [*shape[:MAX_NDIM], *(-1,) * (MAX_NDIM - min(len(shape), MAX_NDIM))]
    flat = [v for vals in facts.values() for v in vals]
    rows = gather_facts(mesh, what, local=[len(shape), *coords, *padded, *flat, *local])
    ndim_all = [r[0] for r in rows]
    shapes = tuple(tuple(r[1 + len(axes) : 1 + len(axes) + min(n, MAX_NDIM)]) for r, n in zip(rows, ndim_all))
    if len(set(ndim_all)) != 1 or ndim_all[0] > MAX_NDIM:
        if any(VALUES_FACT in n for n in facts):
            rearm_checked()  # the facts below are not checked: the weights neither
    if len(set(ndim_all)) != 1:
        raise ShardingError(
            f"{what}: the domain ranks hold inputs with different numbers of dims: local shapes {list(shapes)}."
        )
    if ndim_all[0] > MAX_NDIM:
        raise ShardingError(f"{what}: inputs of more than {MAX_NDIM} dims are not supported, got {ndim_all[0]}.")
    # The `same` facts travel in the rows too, checked after the number of dims (one gather).
    _check_same(rows, 1 + len(axes) + MAX_NDIM, facts, what)
    if ndims is not None and ndim_all[0] not in ndims:
        raise ShardingError(f"{what}: expected {expected} input, got local shapes {list(shapes)}.")
    coord_rows = [tuple(r[1 : 1 + len(axes)]) for r in rows]
    layouts = layouts_from_shapes(
        shapes, coord_rows, [axis_size(mesh, a) for a in axes], dims, what=what, allow_empty=allow_empty
    )
    start = 1 + len(axes) + MAX_NDIM + len(flat)
    if scoped:
        scope_declare(mesh, dims, len(shape), layouts)
    else:
        scope_forget()  # this caller declares no output layout: later layers must agree again
    return Agreement(layouts, shapes, tuple(tuple(r[start:]) for r in rows))


def _scoped_agreement(
    layouts: tuple[Layout, ...],
    shape: tuple[int, ...],
    mesh: DeviceMesh,
    dims: Sequence[int],
    what: str,
    ndims: Collection[int] | None,
    expected: str,
    allow_empty: bool,
) -> Agreement:
    """The ``Agreement`` of an input whose layouts the scope remembers: the checks ``agree`` makes
    that the layouts decide, on every rank alike. The dtype and ``requires_grad`` of a tensor made
    by earlier layers of the same forward are the same on every rank (the same program ran)."""
    if ndims is not None and len(shape) not in ndims:
        raise ShardingError(f"{what}: expected {expected} input, got local shape {shape}.")
    if not allow_empty:
        for lay, d in zip(layouts, dims):
            if 0 in lay.sizes:  # (the message is built only when it is needed)
                lay.require_nonempty(f"{what} along dim {d}")
    shapes = []
    for c in scope_coords(mesh, len(dims)):
        s = list(shape)
        for lay, d, i in zip(layouts, dims, c):
            s[d] = lay.sizes[i]
        shapes.append(tuple(s))
    return Agreement(layouts, tuple(shapes), tuple(() for _ in shapes))


def _check_same(rows, offset: int, facts: Mapping[str, Sequence[int]], what: str) -> None:
    i = offset
    for name, vals in facts.items():
        got = [tuple(r[i : i + len(vals)]) for r in rows]
        if SHARD_FACT in name:  # (the entry's count of inputs cut along other dims: 0 everywhere)
            raise_if_misplaced(got, what, any(VALUES_FACT in n for n in facts))
        if SOURCE_FACT in name:  # (the full tensors the inputs were cut from: a warning where they differ)
            warn_if_other_sources(got, what)
        elif len(set(got)) != 1:
            if name == "dtype":
                shown = [dtype_name(g[0]) for g in got]
            elif name == "device":
                shown = [device_name(g[0]) for g in got]
            else:
                shown = [g if len(g) > 1 else g[0] for g in got]
            if any(VALUES_FACT in n for n in facts):
                rearm_checked()  # the values were not checked, or differ: check them next call
            if VALUES_FACT in name:
                raise ShardingError(f"{what}: the domain ranks hold different {VALUES_FACT}: {values_shown(got)}. "
                                    f"{VALUES_HINT}")
            if name == "requires_grad":
                hint = " Every rank must run the same backward: set requires_grad alike on every rank."
            elif name.startswith("the model's"):
                hint = " " + ENTRY_HINT
            else:
                hint = " Every rank must call the layer alike."
            raise ShardingError(f"{what}: the domain ranks disagree on {name}: {shown} (by rank).{hint}")
        i += len(vals)


def batched(forward: Callable) -> Callable:
    """Run a layer's ``forward`` on an unbatched ``(C, S...)`` input by adding and removing N.

    Tensor arguments (e.g. unpooling indices) get the batch dim too. Inputs of any other number
    of dims pass through unchanged: ``agree`` rejects them on every rank alike.
    """

    @functools.wraps(forward)
    def wrapper(self, x: torch.Tensor, *args, **kwargs):
        if x.dim() != self._spatial_dims + 1:
            return forward(self, x, *args, **kwargs)
        args = tuple(a.unsqueeze(0) if torch.is_tensor(a) else a for a in args)
        kwargs = {k: v.unsqueeze(0) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        out = forward(self, x.unsqueeze(0), *args, **kwargs)
        return tuple(o.squeeze(0) for o in out) if isinstance(out, tuple) else out.squeeze(0)

    return wrapper


def backward_communicates(backward: Callable) -> Callable:
    """Mark a custom ``backward`` whose communication autograd does not record.

    A second derivative through it would silently miss the neighbours' terms, so double
    backward raises instead (``torch.autograd.function.once_differentiable``). Apply it under
    ``@staticmethod``.
    """
    return once_differentiable(backward)


#: What ``ShardedMixin._agree`` accepts by default, per number of spatial dims (built once: this
#: runs for every sharded layer call).
_BATCHED_NDIMS = {n: (n + 2,) for n in range(1, MAX_NDIM)}
_BATCHED_EXPECTED = {n: f"a {n + 2}-d (N, C, ...) or {n + 1}-d unbatched" for n in range(1, MAX_NDIM)}


class ShardedMixin:
    """Mixin for ``Sharded<TorchName>(TorchName)`` classes: what every sharded layer shares.

    A subclass lists the mixin first (``class ShardedConv3d(_ShardedConvNd, nn.Conv3d)``) and
    sets ``_spatial_dims`` (spatial dims of the torch layer, e.g. 3 for Conv3d). It gets:

    - the constructor: the torch constructor's arguments plus keyword-only ``mesh`` and the
      sharding options named in ``_sharding_options`` (default ``dims``), which go to
      ``_init_sharding`` (also called by ``from_module``);
    - ``dims`` validation with a default of one tensor dim per domain axis, the first spatial
      dims: ``(2,)`` for a 1-D domain, ``(2, 3)`` for 2-D (``_default_dims``, ``_check_dims``);
    - ``extra_repr``: torch's, followed by ``sharding_repr()``;
    - ``_agree``: the input agreement of ``agree`` on this layer's mesh and dims.
    """

    _spatial_dims: int = 1
    #: Whether the layer carries empty slabs through (a rank left without rows by a deep stage
    #: computes an empty output and still serves its neighbours' halos); else they raise.
    _allow_empty: bool = False
    #: Keyword-only constructor options that configure the sharding (``_init_sharding``'s).
    _sharding_options: tuple[str, ...] = ("dims",)
    #: Whether ``_agree`` may answer from a ``layout_scope`` (see ``agree``'s ``scoped``): for
    #: layers whose output keeps the input's layout or is declared with ``scope_declare``.
    _scoped_agree: bool = False

    def __init__(self, *args, mesh: DeviceMesh, **kwargs) -> None:
        options = {k: kwargs.pop(k) for k in self._sharding_options if k in kwargs}
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, **options)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # A compiled forward that calls ``layer.forward(x)`` itself runs it eagerly too, as it
        # runs ``layer(x)`` (``sharded_nn/compile_boundary.py``).
        if "forward" in cls.__dict__:
            cls.forward = eager_under_compile(cls.__dict__["forward"])

    def __call__(self, *args, **kwargs):
        # Inside a model converted with the forward guard, the guard's bookkeeping for this layer
        # (input layout check, mode suspension, output layout) runs here, in one frame, rather
        # than as module hooks: hooks send every call down ``nn.Module``'s generic hook path, and
        # a timm CNN makes about a hundred such calls per forward. ``install`` sets the attribute.
        if torch.compiler.is_compiling():
            # Eagerly, with one graph break (``sharded_nn/compile_boundary.py`` says why).
            return run_eagerly(ShardedMixin.__call__, self, *args, **kwargs)
        around = self.__dict__.get("_snn_guard_call")
        if around is None:
            return super().__call__(*args, **kwargs)
        return around.call(super().__call__, self, args, kwargs)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        name = type(self).__name__
        check_mesh(mesh, name)
        axes = domain_axes(mesh)
        if dims is None:
            dims = self._default_dims(mesh)
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        if len(dims) > len(axes):
            raise ShardingError(
                f"{name}: dims={dims} shards {len(dims)} dims but the mesh has {len(axes)} domain axes {axes}."
            )
        self._check_dims(dims, axes)
        self.mesh = mesh
        self.dims = dims
        self.mesh_axes = axes[: len(dims)]
        # One rank along every sharded dim (P=1): nothing to exchange or agree on. Decided from
        # the mesh, which every rank shares, so the ranks of a mesh with other axes (data) take
        # the same branch. Layers whose every collective runs over these axes use it to call the
        # torch layer itself.
        self._local_only = all(axis_size(mesh, a) == 1 for a in self.mesh_axes)
        arm_values_check(self)

    def _values_fact(self) -> dict[str, tuple[int, ...]]:
        """The layer's weights to check in its agreement when it runs outside a converted model's
        layout scope (a layer used on its own): a value digest after it was made and after each
        ``load_state_dict``, else 0 (``sharded_nn.weights``). Inside a scope the model's entry
        facts check every weight of the model; with one domain rank nothing is compared. Both are
        facts every rank shares, so every rank sends the same number of facts."""
        if self._local_only or scope_active() or torch.compiler.is_compiling():
            return {}  # (compiled code: every rank traces alike; its eager calls check)
        return {VALUES_FACT: (take_digest(self),)}

    def _default_dims(self, mesh: DeviceMesh) -> tuple[int, ...]:
        """One tensor dim per domain axis: the first spatial dims (``mesh.default_dims``), no more
        than the layer has (a ``BatchNorm1d`` in a 2-D model on a 2x2 mesh, EfficientViT-M's
        head: its one spatial dim by the first axis; it was refused at convert)."""
        dims = tuple(default_dims(mesh))
        n = getattr(self, "_spatial_dims", None)
        return dims[:n] if isinstance(n, int) and 0 < n < len(dims) else dims

    def _check_dims(self, dims: tuple[int, ...], axes: tuple[str, ...]) -> None:
        bad = [d for d in dims if not 2 <= d < 2 + self._spatial_dims]
        if bad:
            raise ShardingError(
                f"{type(self).__name__}: dims={dims} includes {bad}, which are not spatial dims of a "
                f"{self._spatial_dims}-d layer on (N, C, ...) input (valid: 2..{1 + self._spatial_dims}). "
                f"Pass dims=... naming spatial dims, or use a mesh with fewer domain axes."
            )

    def extra_repr(self) -> str:
        base = super().extra_repr()
        return f"{base}, {self.sharding_repr()}" if base else self.sharding_repr()

    def _agree(self, x: torch.Tensor, **kwargs) -> Agreement:
        """``agree`` on this layer's mesh and dims; by default a batched ``(N, C, S...)`` input."""
        n = self._spatial_dims
        if "ndims" not in kwargs:
            kwargs["ndims"] = _BATCHED_NDIMS[n]
            kwargs.setdefault("expected", _BATCHED_EXPECTED[n])
        kwargs.setdefault("allow_empty", self._allow_empty)
        kwargs.setdefault("scoped", self._scoped_agree)
        values = self._values_fact()
        if values:
            kwargs["same"] = {**(kwargs.get("same") or {}), **values}
        return agree(x, self.mesh, kwargs.pop("dims", self.dims), what=type(self).__name__, **kwargs)

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, **options):
        """A sharded copy of ``module`` that shares its parameters, buffers and hooks."""
        new = cls.__new__(cls)
        # Shallow copies of the module's registries: same Parameter objects (so state_dict keys
        # and values are unchanged), independent containers.
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new._init_sharding(mesh, **options)
        return new

    def sharding_repr(self) -> str:
        return f"mesh_axes={self.mesh_axes}, dims={self.dims}"
