"""Agreeing on the layout of a sharded tensor: one small all-gather of the local shapes.

Layers see only their local slab. To validate a layout identically on every rank (so that all
ranks raise the same error together) and to plan halos for uneven slabs, they gather the local
shapes of the domain group once per call. This is the only collective that is not point-to-point
in a convolution's forward; it moves a few integers.

It never synchronises a GPU: the integers travel as CPU tensors over gloo. On a gloo mesh that
is the domain group itself; on an NCCL mesh it is a gloo *side group* over the same ranks,
created once per mesh object (the first ``gather_layouts`` on that mesh, which every rank
reaches in the same order). No device tensor is made or read, so the call neither stalls the
CUDA stream nor blocks CUDA-graph capture of the layers' device work.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..env import getenv
from ..errors import ShardingError, ShardingWarning
from ..layout import Layout
from ..mesh import _flat_mesh, axis_size, domain_axes, domain_group, mesh_cached
from ..weights import VALUES_FACT, VALUES_HINT, arm, rearm_checked, take_digest, values_shown

from .collectives import all_gather_stacked

#: The entry fact counting the root's inputs that ``sharding.shard`` cut along other dims than
#: the model takes them (must be 0 on every rank), the attribute its mark is, and this rank's
#: descriptions of them for the message.
SHARD_FACT = "inputs cut along the dims the model takes"
SHARD_DIMS = "_snn_shard_dims"
_MISPLACED: list[list[str]] = [[]]
#: The entry fact digesting the full tensors ``sharding.shard`` cut the inputs from (the same on
#: every domain rank, or the slabs are of different samples), and the attribute it reads.
SOURCE_FACT = "full tensors the inputs were cut from (sharded_nn.shard)"
SHARD_SOURCE = "_snn_shard_source"
SOURCE_HINT = (
    "Every domain rank must pass the same full tensor to sharded_nn.shard: each slab here was cut from "
    "another one, so the model would compute a mosaic of different samples (a silently wrong answer). "
    "A random augmentation or crop drawn on each rank, a data loader shuffled per rank (seed it alike, "
    "torch.manual_seed(s) and a generator for the DataLoader), or a DistributedSampler spread over the domain "
    "ranks (sample per data replica: sharded_nn.batch_slice) do this. Or load on one rank and scatter: "
    "sharded_nn.shard(x, mesh, src=0). (A run where the values do not matter, timing random inputs, may "
    "ignore this warning.)"
)

_MAX_NDIM = 12


@dataclass(frozen=True)
class _LayoutMeta:
    """Facts about a mesh that ``gather_layouts`` needs on every call, derived once per mesh."""

    group: dist.ProcessGroup  # a gloo group over the domain ranks
    axes: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    coords: tuple[int, ...]  # this rank's coordinate on each domain axis
    #: ``scope_coords`` per number of axes, worked out once.
    grids: dict = field(default_factory=dict, compare=False, repr=False)


def metadata_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A gloo process group over the domain ranks of ``mesh``, for CPU metadata (shapes, flags).

    The domain group itself when its backend is gloo; otherwise a gloo side group over the same
    ranks, made once per mesh object by flattening the domain axes with a gloo backend (a
    collective over the mesh: every rank must reach the first call in the same order).
    """
    return _layout_meta(mesh).group


def _layout_meta(mesh: DeviceMesh) -> _LayoutMeta:
    def make() -> _LayoutMeta:
        axes = domain_axes(mesh)
        group = domain_group(mesh)
        if _needs_side_group(group):
            group = _flat_mesh(mesh, axes, backend="gloo").get_group()
        return _LayoutMeta(
            group, axes, tuple(axis_size(mesh, a) for a in axes), tuple(mesh.get_local_rank(a) for a in axes)
        )

    return mesh_cached(mesh, ("layout_meta",), make)


def _needs_side_group(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) != "gloo"


def gather_layouts(
    shape: Sequence[int],
    mesh: DeviceMesh,
    dims: Sequence[int],
    *,
    what: str = "sharded tensor",
    allow_empty: bool = False,
    scoped: bool = False,
    axes: Sequence[str] | None = None,
) -> tuple[Layout, ...]:
    """Gather every domain rank's local ``shape`` and return the layout of each sharded dim.

    ``allow_empty=True`` accepts empty slabs (layers that carry them through a deep stage).
    ``scoped=True``: inside a ``layout_scope``, answer from the layouts agreed or declared earlier
    in it when they name this one unambiguously (no collective), and remember the gathered
    layouts otherwise; only for callers whose result keeps this layout or is declared with
    ``scope_declare`` (as ``agree``'s ``scoped``). Other callers make the scope forget.

    ``dims[k]`` is sharded by the k-th domain axis of ``mesh``, or by ``axes[k]`` where given (a
    tensor that a later axis shards while it is replicated over an earlier one: the columns of a
    2x2 mesh after a sum over the rows; no scope then). Every rank receives the same
    shapes and runs the same checks, so an inconsistent input raises the same ``ShardingError``
    on every rank. The integers travel on a gloo group (see the module docstring): no device
    synchronisation, also on NCCL meshes.

    Raises:
        ShardingError: when ranks disagree on unsharded dims or on the decomposition, when a slab
            is empty, or when there are more sharded dims than domain axes.
    """
    entry: dict[str, tuple[int, ...]] = {}
    axis_index = None
    if axes is not None:
        axis_index = tuple(_layout_meta(mesh).axes.index(a) for a in axes)
        if axis_index == tuple(range(len(axis_index))):
            axis_index = None  # the first axes: the usual case
        else:
            scoped = False  # (the scope remembers layouts of the leading axes only)
    if scoped:
        hit = scope_lookup(mesh, dims, shape)
        if hit is not None:
            if not allow_empty:
                for lay, d in zip(hit, dims):
                    lay.require_nonempty(f"{what} along dim {d}")
            return hit
        # The scope's first agreement checks the model's entry facts (as ``agree`` does), so that
        # later scoped calls can answer from it: a model whose first sharded layers are all
        # pointwise (no agreement of their own) reaches its first reduction with the facts
        # unchecked, and every scoped reduction of its forward gathered the layout again.
        entry = scope_take_entry()
    else:
        scope_forget()  # the caller declares no layout it derives from this one: forget the scope
    meta = _layout_meta(mesh)
    axes = meta.axes
    if (len(dims) > len(axes) or len(shape) > _MAX_NDIM) and VALUES_FACT in entry:
        rearm_checked()  # raised below before the entry facts are checked: the weights next time
    if len(dims) > len(axes):
        raise ShardingError(
            f"{what}: {len(dims)} sharded dims {tuple(dims)} but the mesh has only {len(axes)} "
            f"domain axes {axes}. Shard at most one dim per domain axis."
        )
    if len(shape) > _MAX_NDIM:
        raise ShardingError(f"{what}: tensors of more than {_MAX_NDIM} dims are not supported, got {len(shape)}.")
    # Each row carries the rank's domain coordinates, so no assumption is made about how the
    # group orders its ranks. Rows have a fixed width so that ranks holding tensors of different
    # ndims still gather (and then all raise the same error).
    n_axes = len(axes)
    # The entry facts (the same names on every rank: the same code made them) after the shape.
    facts = [v for vals in entry.values() for v in vals]
    width = 1 + n_axes + _MAX_NDIM + len(facts)
    row = (len(shape), *meta.coords, *shape)
    if dist.get_world_size(meta.group) == 1:
        rows: tuple[tuple[int, ...], ...] = (row,)
    else:
        mine = torch.tensor(row + (-1,) * (width - len(facts) - len(row)) + tuple(facts), dtype=torch.int64)
        # One Python list of every rank's row; the (small) tensor is on the CPU, so reading it
        # is no device sync.
        flat = all_gather_stacked(mine, meta.group).view(-1).tolist()
        starts = range(0, len(flat), width)
        rows = tuple(tuple(flat[a : a + 1 + n_axes + flat[a]]) for a in starts)
        if facts:
            _check_entry([flat[a + width - len(facts) : a + width] for a in starts], entry, what)
    out = _layouts(rows, n_axes, meta.axis_sizes, tuple(dims), what, allow_empty, axis_index)
    if scoped:
        scope_declare(mesh, dims, len(shape), out)
    return out


#: What a rank whose model entry facts differ is told (here and at a layer's agreement).
ENTRY_HINT = (
    "Every rank must call the converted model alike: the same grad mode and autocast, inputs of the same "
    "dtypes, and the same parameters (dtype, requires_grad) and train/eval modes."
)


def check_cut(x: torch.Tensor, dims: Sequence[int | None], what: str) -> None:
    """Raise where ``x`` is marked as cut along other dims than ``dims`` (``SHARD_DIMS``: by
    ``sharding.shard``, or as a converted model's slab output).

    A slab gathered or reduced along other dims than its own is assembled wrongly without an
    error where the slabs happen to have equal sizes (``gather(model(x), mesh)`` of tokens sharded
    along dim 1). The mark is the same on every rank (one ``shard`` call, or the model's agreed
    layouts), so every rank raises alike, before any collective.
    """
    cut = getattr(x, SHARD_DIMS, None)
    if cut is None:
        return
    asked = tuple(d % x.dim() if d is not None else None for d in dims)
    if tuple(cut) != asked:
        raise ShardingError(
            f"{what}: this slab was cut along dims {tuple(cut)} (by sharded_nn.shard, or as a converted model's "
            f"output), but dims {asked} were asked: the slabs would be assembled along another dim, a silently "
            f"wrong answer. Pass dims={tuple(cut)}."
        )


def warn_if_other_sources(by_rank: Sequence[tuple[int, ...]], what: str) -> None:
    """Warn (on every rank alike) where the ranks' ``SOURCE_FACT`` differ: their input slabs were
    cut from different tensors. A warning, not an error: a timing or memory run feeds random
    inputs drawn on each rank on purpose, where the values do not matter."""
    if len(set(by_rank)) != 1:
        warnings.warn(f"{what}: the domain ranks' input slabs were cut from different tensors. {SOURCE_HINT}",
                      ShardingWarning, stacklevel=3)


def raise_if_misplaced(by_rank: Sequence[tuple[int, ...]], what: str, rearm: bool) -> None:
    """Raise on every rank where some rank's ``SHARD_FACT`` (by rank) counts misplaced inputs;
    ``rearm``: the agreement also carried the weights' digest, not compared then."""
    if all(v == (0,) for v in by_rank):
        return
    if rearm:
        rearm_checked()
    shown = "; ".join(_MISPLACED[0]) or f"ranks {[r for r, v in enumerate(by_rank) if v != (0,)]} say so"
    raise ShardingError(
        f"{what}: {shown}. Each rank would compute its slab as rows of another dim, a silently wrong answer. "
        "Shard the input along the dims the model takes (sharded_nn.shard(x, mesh, dims=...) with convert's dims), "
        "or convert the model with the dims you shard (convert(..., dims=...), or input_dims={name: dims} for an "
        "input of its own)."
    )


def _check_entry(got: list[list[int]], entry: dict[str, tuple[int, ...]], what: str) -> None:
    """Raise on every rank where the ranks' entry facts (``got``, by rank) differ, or where
    some rank's inputs were cut along other dims than the model takes them (``SHARD_FACT``)."""
    i = 0
    for name, vals in entry.items():
        by_rank = [tuple(g[i : i + len(vals)]) for g in got]
        if name == SHARD_FACT:
            raise_if_misplaced(by_rank, what, VALUES_FACT in entry)
        if name == SOURCE_FACT:
            warn_if_other_sources(by_rank, what)
        elif len(set(by_rank)) != 1:
            shown = [v if len(v) > 1 else v[0] for v in by_rank]
            if VALUES_FACT in entry:
                rearm_checked()  # the values were not checked, or differ: check them next forward
            if name == VALUES_FACT:
                raise ShardingError(
                    f"{what}: the domain ranks hold different {name}: {values_shown(by_rank)}. {VALUES_HINT}"
                )
            raise ShardingError(
                f"{what}: the domain ranks disagree on the model's {name} at its entry: {shown} (by rank). "
                + ENTRY_HINT
            )
        i += len(vals)


def agree_entry_inputs(shapes: Sequence[Sequence[int]], mesh: DeviceMesh, dims) -> bool:
    """Agree at a model's entry on the layouts of its slab inputs of local ``shapes``, in one all-gather.

    For a forward with several slab inputs (a field and its coordinates or conditioning):
    their local shapes travel together with the scope's unchecked entry facts (which must agree,
    else a ``ShardingError`` on every rank, as at a layer's agreement), and each input's layout
    is remembered in the scope, so that the layers derive theirs as they do from one input.
    Returns False, and remembers nothing, when some input has no layout along ``dims`` (its
    unsharded sizes differ between ranks: a tensor input that is not a slab); the caller then
    lets every layer agree. Every rank decides from the same gathered rows. ``dims``: the
    sharded dims of every input, or a list of them, one per input (``convert(input_dims=)``).
    """
    entry = scope_take_entry()
    meta = _layout_meta(mesh)
    n_axes = len(meta.axes)
    each = [tuple(d) for d in dims] if dims and not isinstance(dims[0], int) else [tuple(dims)] * len(shapes)
    if any(len(d) > n_axes for d in each) or any(len(s) > _MAX_NDIM for s in shapes):
        return False
    facts = [v for vals in entry.values() for v in vals]
    part = 1 + _MAX_NDIM  # per input: its ndim, its shape padded with -1
    row = [*facts, *meta.coords]
    for shape in shapes:
        row += [len(shape), *shape, *(-1,) * (_MAX_NDIM - len(shape))]
    if dist.get_world_size(meta.group) == 1:
        flat = row
    else:
        flat = all_gather_stacked(torch.tensor(row, dtype=torch.int64), meta.group).view(-1).tolist()
    width = len(row)
    starts = range(0, len(flat), width)
    what = "the model's inputs at its entry"
    if facts:
        _check_entry([flat[a : a + len(facts)] for a in starts], entry, what)
    base = len(facts) + n_axes
    layouts = []
    for k in range(len(shapes)):
        at = base + k * part
        rows = tuple(
            (flat[a + at], *flat[a + len(facts) : a + base], *flat[a + at + 1 : a + at + 1 + flat[a + at]])
            for a in starts
        )
        try:
            layouts.append(_layouts(rows, n_axes, meta.axis_sizes, each[k], what, allow_empty=True))
        except ShardingError:
            return False
    for shape, d, lays in zip(shapes, each, layouts):
        scope_declare(mesh, d, len(shape), lays)
    return True


#: Layouts by gathered rows (bounded: shapes change from call to call in some models). A plain
#: dict, not ``functools.lru_cache``: Dynamo warns on (and cannot trace into) ``lru_cache``
#: wrappers, and under ``torch.compile`` the cache is bypassed (see ``_layouts``).
_LAYOUTS: dict[tuple, tuple[Layout, ...]] = {}
_LAYOUTS_MAX = 1024


def _layouts(
    rows: tuple[tuple[int, ...], ...],
    n_axes: int,
    axis_sizes: tuple[int, ...],
    dims: tuple[int, ...],
    what: str,
    allow_empty: bool = False,
    axis_index: tuple[int, ...] | None = None,
) -> tuple[Layout, ...]:
    # Keyed by the gathered rows, which are the same on every rank, so all ranks hit or miss
    # together; a miss runs no collective anyway. Errors are raised again on every call (an
    # error is never stored). While compiling, computed afresh so no traced graph depends on the
    # cache's state.
    key = (rows, n_axes, axis_sizes, dims, what, allow_empty, axis_index)
    if not torch.compiler.is_compiling():
        hit = _LAYOUTS.get(key)
        if hit is not None:
            return hit
    coords = [r[1 : 1 + n_axes] for r in rows]
    shapes = [r[1 + n_axes :] for r in rows]
    out = layouts_from_shapes(shapes, coords, axis_sizes, dims, what=what, allow_empty=allow_empty,
                              axis_index=axis_index)
    if not torch.compiler.is_compiling():
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            del _LAYOUTS[next(iter(_LAYOUTS))]  # the oldest entry
        _LAYOUTS[key] = out
    return out


def layouts_from_shapes(
    shapes: Sequence[tuple[int, ...]],
    coords: Sequence[tuple[int, ...]],
    axis_sizes: Sequence[int],
    dims: Sequence[int],
    *,
    what: str = "sharded tensor",
    allow_empty: bool = False,
    axis_index: Sequence[int] | None = None,
) -> tuple[Layout, ...]:
    """Layouts from the local shapes of all domain ranks and their domain coordinates.

    Pure function of facts every rank shares; see ``gather_layouts``. ``allow_empty``: accept
    empty slabs (otherwise a ``ShardingError``). ``axis_index[k]``: the domain axis (by index)
    that shards ``dims[k]`` (default ``k``).
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
        a = k if axis_index is None else axis_index[k]
        sizes: list[int | None] = [None] * axis_sizes[a]
        for c, s in zip(coords, shapes):
            coord = c[a]
            if sizes[coord] is None:
                sizes[coord] = s[d]
            elif sizes[coord] != s[d]:
                raise ShardingError(
                    f"{what}: ranks at coordinate {coord} of domain axis {a} hold different sizes "
                    f"along dim {d}; a multi-axis decomposition must be a tensor product of slabs. "
                    f"Local shapes: {list(shapes)}."
                )
        layout = Layout(tuple(sizes))  # type: ignore[arg-type]
        if not allow_empty:
            layout.require_nonempty(f"{what} along dim {d}")
        layouts.append(layout)
    return tuple(layouts)



# --------------------------------------------------------------------------------------------
# Layout scope: layouts agreed at most once per forward, derived from layer to layer.
#
# Inside ``layout_scope()`` (entered around a whole model's forward, e.g. by
# ``enable_layout_scope``), every layout that was agreed (a layer's input) or derived from an
# agreed one (a layer's declared output) is remembered by the layer's mesh and the number of
# mesh axes that shard it, not by which tensor dims they shard nor how many dims the tensor has:
# a permute, an unsqueeze or a move to channels-last keeps a slab's layout, so a layout agreed
# for one arrangement is the layout of the others (keyed by dims and ndim until session 65, a
# layout agreed in channels-last and looked up after a permute was one the scope had never seen
# under that key). A later layer whose input has a remembered layout finds it from its own
# local sizes, without a collective.
#
# SPMD safety (DESIGN.md section 4). Whether a lookup hits must be the same on every rank. A
# layout is answered only when it is *unambiguous*: no other remembered layout (same mesh, dims
# and ndim) has the same local sizes at ANY coordinate. That is decided from the layouts
# themselves, which every rank holds identically, so for an input whose layout is remembered
# every rank finds exactly it, or every rank finds it ambiguous and agrees. An input whose layout
# is *not* remembered would be unsafe (one rank's sizes could match a remembered layout while
# another's do not), so every producer of a new layout on a sharded dim inside the scope either
# declares it (``scope_declare``: convolutions, pools) or forgets the scope (``scope_forget``:
# every agreement or ``gather_layouts`` that does not opt in). Plain code that changes a sharded
# dim between layers runs under the forward guard, which forgets (crops, pads, ``cat`` along it,
# strided slices) or derives (``scope_scaled``: a view that splits a sharded dim into blocks or
# merges others into it, a pixel shuffle) for the same reason.


class _Scope:
    """The layouts of one forward: per (mesh, number of sharding axes), the remembered and the
    answerable ones."""

    #: Remembered layouts per key; past this the scope forgets (a decision on shared facts).
    MAX_LAYOUTS = 64

    def __init__(self) -> None:
        self.depth = 0
        self.layouts: dict[tuple, list[tuple[Layout, ...]]] = {}
        # Per key: the slab sizes of the remembered layouts (a quick test for a known one).
        self.sizes: dict[tuple, set[tuple[tuple[int, ...], ...]]] = {}
        # Per key: this rank's local sizes along the dims -> the unambiguous layout they name.
        self.answers: dict[tuple, dict[tuple[int, ...], tuple[Layout, ...]]] = {}
        # Per key: (coordinate, local sizes there) -> the first remembered layout with them (the
        # test for layouts that some rank cannot tell apart, see ``scope_declare``).
        self.owners: dict[tuple, dict[tuple, tuple[Layout, ...]]] = {}
        # The model-entry facts (``entry_facts``) not yet checked across ranks: they travel with
        # the next agreement (``scope_take_entry``); until then the scope answers nothing.
        self.entry: dict[str, tuple[int, ...]] | None = None
        # A forward whose layouts cannot all be derived (several slab inputs): remember nothing.
        self.off = False
        # How many times ``scope_forget`` ran (ever): the forward guard gives a slab made by a
        # call during which it ran a layout token of its own (``guard_tokens``).
        self.forgets = 0
        # Calls of sharded layers that run eagerly for a compiled forward (``compiled_caller``).
        self.compiled = 0

    def clear(self) -> None:
        self.layouts.clear()
        self.sizes.clear()
        self.answers.clear()
        self.owners.clear()


_SCOPE = _Scope()


class layout_scope:  # noqa: N801 - used like a function: ``with layout_scope():``
    """Context in which agreed layouts are remembered and derived from layer to layer.

    Re-entrant: nested scopes share the outermost one; it starts and ends empty. Outside any
    scope (a layer used on its own) every layer agrees on its input as before.

    Args:
        entry: facts every rank must share for the layers' per-call facts to be derivable (see
            ``entry_facts``); checked across ranks by the first agreement of the scope, which
            raises on every rank when they differ. None: nothing to check (the caller vouches).
        derive: False makes the scope remember nothing (every layer agrees, as outside).
    """

    def __init__(self, entry: dict[str, tuple[int, ...]] | None = None, derive: bool = True) -> None:
        self._entry, self._derive = entry, derive

    def __enter__(self) -> layout_scope:
        if _SCOPE.depth == 0:
            _SCOPE.clear()
            _SCOPE.entry = dict(self._entry) if self._entry else None
            _SCOPE.off = not self._derive
        _SCOPE.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        _SCOPE.depth -= 1
        if _SCOPE.depth == 0:
            _SCOPE.clear()
            _SCOPE.entry, _SCOPE.off = None, False


#: A code per dtype, the same in every process (sorted names); unknown dtypes share one code.
_DTYPE_CODES: dict[torch.dtype, int] = {
    d: i for i, d in enumerate(sorted((v for v in vars(torch).values() if isinstance(v, torch.dtype)), key=str))
}


def _code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, -1)


def _digest(ints: list) -> int:
    # ``hash`` of a tuple of ints and bools is the same in every process (only str hashes are
    # salted); a collision would only let a misuse through to the per-layer checks' absence.
    return hash(tuple(ints))


def entry_facts(
    model: torch.nn.Module, args: tuple, kwargs: dict, dims: Sequence[int], input_dims=None
) -> tuple[dict, list]:
    """The facts at a model's entry from which every layer's per-call facts follow.

    Inside a scope a layer that finds its input's layout does not gather the facts it would
    agree on per call: its input's dtype, whether it takes part in backward, its unsharded
    sizes. Running the same program on every rank (SPMD, DESIGN.md section 4), those are
    functions of: grad mode and autocast state; every root tensor input's dtype,
    ``requires_grad``, number of dims and unsharded leading sizes (the dims before the first
    sharded one); every parameter's dtype, ``requires_grad`` and device kind, every buffer's
    dtype and every module's ``training`` flag. These are what this returns (digests of the
    per-tensor lists), to be agreed once (``layout_scope(entry=...)``). Costs one walk over the
    modules (about 0.3 ms for a 300-module timm CNN).

    ``input_dims``: an ``entry_inputs.InputDims`` (``convert(..., input_dims=)``): the inputs it
    names are slabs along their own dims (their sizes before the first are facts), or whole
    tensors (every size a fact).

    Returns:
        ``(facts, slabs)``: the named facts, and the root tensor inputs that may be slabs (more
        than ``min(dims)`` dims, or named with dims), each with its sharded dims.
    """
    first = min(dims) if dims and min(dims) >= 0 else 0
    if input_dims is None:
        each = [(t, tuple(dims), False) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    else:
        each = list(input_dims.tensors(args, kwargs))
    inputs: list = []
    slabs: list = []
    misplaced = _MISPLACED[0] = []
    main = each[0][0].dim() if each else 0
    for i, (t, d, named) in enumerate(each):
        until = (min(d) if d else t.dim()) if named else first
        inputs += (_code(t.dtype), t.requires_grad, t.dim(), *t.shape[:until])
        if (d and named) or (not named and t.dim() > first):
            slabs.append((t, d))
        cut = getattr(t, SHARD_DIMS, None)  # (``sharding.shard``'s mark: the dims it cut)
        # The model's dims describe its first input and inputs of that rank; an input of another
        # rank not named in input_dims means what the layer that takes it says (a sharded
        # attention's key-padding mask (B, S) is cut along S), so it is not compared.
        if cut is not None and (named or t.dim() == main):
            # How the model takes it (the forward guard's rule): along its dims, or whole.
            taken = tuple(d) if d and (named or t.dim() > max(d)) else None
            if cut != taken:
                misplaced.append(f"input {i} was cut by sharded_nn.shard along dims {cut}, but the model takes it "
                                 + (f"along dims {taken}" if taken else "whole"))
    state: list = []
    add = state.append
    codes = _DTYPE_CODES
    # Our own walk over ``_modules`` (each module once, in the same order on every rank):
    # ``model.modules()`` builds a qualified name per module, half the cost of this function.
    stack, seen = [model], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        add(m.training)
        for p in m._parameters.values():
            if p is not None:
                add((codes.get(p.dtype, -1), p.requires_grad, p.is_cuda))
        for b in m._buffers.values():
            if b is not None:
                add(codes.get(b.dtype, -1))
        for c in reversed(m._modules.values()):
            if c is not None:
                stack.append(c)
    autocast = tuple(
        v for dev in ("cpu", "cuda") for v in (int(torch.is_autocast_enabled(dev)), _code(torch.get_autocast_dtype(dev)))
    )
    facts = {
        "grad mode": (int(torch.is_grad_enabled()),),
        "autocast": autocast,
        "model inputs (dtype, requires_grad, ndim, unsharded sizes)": (_digest(inputs),),
        "module state (parameter dtypes and requires_grad, buffer dtypes, training flags)": (_digest(state),),
        # Slabs that ``sharding.shard`` cut along other dims than the model takes them: each rank
        # would compute its slab as rows of another dim (a silently wrong answer).
        SHARD_FACT: (len(misplaced),),
        SOURCE_FACT: (_digest([getattr(t, SHARD_SOURCE, 0) for t, _, _ in each]),),
        # The values themselves once after convert and after each load_state_dict (0 otherwise):
        # weights that differ by rank would compute each slab with other weights.
        VALUES_FACT: (take_digest(model),),
    }
    return facts, slabs


class ScopeHooks:
    """The root hooks that run a model's forward in a ``layout_scope`` (see ``enable_layout_scope``).

    ``enter`` is a forward pre-hook (``with_kwargs=True``), ``leave`` a forward hook
    (``with_kwargs=True, always_call=True``, so that the scope ends also when the forward
    raises). The forward guard calls them from its own root hooks when both are installed.

    Args:
        dims: the sharded dims of the model's tensor inputs.
        mesh: the model's mesh. With it, a forward with several slab inputs agrees on all their
            layouts at its entry in one all-gather (``agree_entry_inputs``) and then derives as
            with one; without it (or where an input has no layout) such a forward derives
            nothing and every layer agrees.
    """

    def __init__(self, dims: Sequence[int] | None = None, mesh: DeviceMesh | None = None, input_dims=None) -> None:
        self.dims = tuple(dims) if dims else (2,)
        self.mesh = mesh
        self.input_dims = input_dims  # an ``entry_inputs.InputDims``: inputs with dims of their own

    def enter(self, module: torch.nn.Module, args, kwargs) -> None:
        if torch.compiler.is_compiling():
            return
        if _SCOPE.depth > 0:
            layout_scope({}).__enter__()
            return
        facts, slabs = entry_facts(module, args, kwargs, self.dims, self.input_dims)
        if len(slabs) <= 1 and all(d == self.dims for _, d in slabs):
            layout_scope(facts).__enter__()
            return
        if self.mesh is None or min(self.dims) < 0 or any(t.dim() <= max(d) for t, d in slabs):
            layout_scope(facts, derive=False).__enter__()
            return
        layout_scope(facts).__enter__()
        if not agree_entry_inputs([tuple(t.shape) for t, _ in slabs], self.mesh, [d for _, d in slabs]):
            _SCOPE.off = True  # (remembered nothing: every layer agrees, as without the mesh)

    def leave(self, module: torch.nn.Module, args, kwargs, output) -> None:
        if not torch.compiler.is_compiling() and _SCOPE.depth > 0:
            layout_scope().__exit__(None, None, None)


def enable_layout_scope(
    model: torch.nn.Module, dims: Sequence[int] | None = None, *, mesh: DeviceMesh | None = None, input_dims=None
) -> torch.nn.Module:
    """Run every forward of ``model`` inside a ``layout_scope`` (hooks on the root module).

    The first sharded layer agrees on the model's input together with the model's entry facts
    (``entry_facts``: an input, parameter or mode that differs between ranks raises on every
    rank, as before, in that one all-gather); later layers derive their layouts. A forward with
    more than one tensor input that may be a slab agrees on all their layouts at its entry, in
    one all-gather with the entry facts, when ``mesh`` (the model's) is given; without it such a
    forward derives nothing (every layer agrees). ``dims``: the sharded dims of the model's
    input (default ``(2,)``). ``convert`` installs the same hooks (``layout_scope=True``, inside
    the forward guard's root hooks when the guard is on). ``input_dims``: an
    ``entry_inputs.InputDims`` (inputs sharded along dims of their own). Returns ``model``. Idempotent.
    """
    guard = model.__dict__.get("_snn_guard")
    if model.__dict__.get("_snn_layout_scope_handles") or getattr(guard, "scope", None) is not None:
        return model  # installed already (by convert: inside the forward guard's root hooks)
    hooks = ScopeHooks(dims, mesh, input_dims)
    arm(model)  # the first forward's entry facts check the weights (``sharded_nn.weights``)
    # prepend: the entry facts are read before other root hooks (a forward guard's mode) run.
    model.__dict__["_snn_layout_scope_handles"] = (
        model.register_forward_pre_hook(hooks.enter, with_kwargs=True, prepend=True),
        model.register_forward_hook(hooks.leave, with_kwargs=True, always_call=True),
    )
    return model


def disable_layout_scope(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``enable_layout_scope``: every layer of ``model`` agrees on its input per call."""
    for h in model.__dict__.pop("_snn_layout_scope_handles", ()):
        h.remove()
    return model


def scope_take_entry() -> dict[str, tuple[int, ...]]:
    """The scope's unchecked entry facts, handed once to the agreement that will check them."""
    if not _scope_active() or _SCOPE.entry is None:
        return {}
    entry, _SCOPE.entry = _SCOPE.entry, None
    return entry


def scope_coords(mesh: DeviceMesh, n: int) -> tuple[tuple[int, ...], ...]:
    """Every coordinate of the first ``n`` domain axes, row-major (the order of ``Agreement.shapes`` on a hit)."""
    meta = _layout_meta(mesh)
    grid = meta.grids.get(n)
    if grid is None:
        grid = meta.grids[n] = tuple(itertools.product(*(range(k) for k in meta.axis_sizes[:n])))
    return grid


def _scope_active() -> bool:
    return _SCOPE.depth > 0 and not _SCOPE.compiled and not torch.compiler.is_compiling()


class compiled_caller:  # noqa: N801 - used like a function: ``with compiled_caller():``
    """Context of a sharded layer that a compiled forward calls (it runs eagerly,
    ``sharded_nn/compile_boundary.py``): the scope answers and remembers nothing inside it, and
    forgets for the rest of the forward (a compiled submodule of an eager model), since the
    compiled code ran unseen by the forward guard: a view that halved a slab there would go
    unnoticed. (Every rank runs the same compiled code, so every rank forgets.)"""

    def __enter__(self) -> None:
        if _SCOPE.depth > 0 and not _SCOPE.compiled:
            scope_forget()
        _SCOPE.compiled += 1

    def __exit__(self, *exc) -> None:
        _SCOPE.compiled -= 1


def scope_active() -> bool:
    """Whether a model forward's layout scope is running (its entry facts cover the model's layers)."""
    return _scope_active()


def _scope_key(mesh: DeviceMesh, dims: Sequence[int], ndim: int) -> tuple:
    # (Not the dims nor ndim: a slab keeps its layout through permutes and unsqueezes; see the
    # comment above ``_Scope``. ``dims[k]`` is sharded by the k-th domain axis.)
    return (id(mesh), len(dims))


def scope_lookup(mesh: DeviceMesh, dims: Sequence[int], shape: Sequence[int]) -> tuple[Layout, ...] | None:
    """The remembered layouts of a tensor of local ``shape`` sharded along ``dims``; None: agree.

    Sound only while the scope remembers the layout of every slab a lookup can be asked about:
    a rank answers from its own local sizes, so a tensor whose layout the scope never saw could
    match a remembered one on some ranks only (they skip the agreement, the others make it: a
    hang, or a collective paired with another). Hence ``scope_forget`` ends the answers for the
    rest of the forward. ``SHARDED_NN_CHECK_SCOPE=1`` checks every lookup against an agreement
    (``_verify_lookup``: one more all-gather per lookup, for tests).
    """
    if not _scope_active() or _SCOPE.entry is not None or _SCOPE.off:
        return None
    answers = _SCOPE.answers.get(_scope_key(mesh, dims, len(shape)))
    hit = answers.get(tuple(shape[d] for d in dims)) if answers else None
    if getenv("SHARDED_NN_CHECK_SCOPE") == "1":
        _verify_lookup(mesh, dims, shape, hit)
    return hit


def _verify_lookup(mesh: DeviceMesh, dims: Sequence[int], shape: Sequence[int], hit) -> None:
    """Raise on every rank where the scope's answer for this lookup is not the agreed layout, or
    where some ranks answer and others would agree (the hazard ``scope_lookup`` describes)."""
    meta = _layout_meta(mesh)
    if dist.get_world_size(meta.group) == 1:
        return
    n = len(meta.axes)
    row = [int(hit is not None), *meta.coords, len(shape), *(shape[d] for d in dims)]
    flat = all_gather_stacked(torch.tensor(row, dtype=torch.int64), meta.group).view(-1).tolist()
    rows = [flat[a : a + len(row)] for a in range(0, len(flat), len(row))]
    hits = [r[0] for r in rows]
    wrong = len(set(hits)) > 1
    if hit is not None and not wrong:
        for r in rows:
            c = r[1 : 1 + n]
            wrong = wrong or tuple(r[2 + n :]) != tuple(lay.sizes[i] for lay, i in zip(hit, c))
    if wrong:
        raise RuntimeError(
            f"sharded_nn layout scope: a lookup of a tensor sharded along dims {tuple(dims)} (local shape "
            f"{tuple(shape)}) was answered on ranks {[i for i, h in enumerate(hits) if h]} of {len(hits)} with "
            f"{None if hit is None else [lay.sizes for lay in hit]}; the ranks' (coords, ndim, sizes) are "
            f"{[tuple(r[1:]) for r in rows]}. A layout the scope never saw: the op that made it must declare it "
            "(scope_declare) or forget (scope_forget). Please report this."
        )


def scope_declare(mesh: DeviceMesh, dims: Sequence[int], ndim: int, layouts: Sequence[Layout]) -> None:
    """Remember ``layouts`` (agreed, or derived from agreed ones) for tensors sharded along ``dims``.

    Every rank must call it with the same arguments at the same point (they are agreed facts).
    """
    if not _scope_active() or _SCOPE.off:
        return
    key = _scope_key(mesh, dims, ndim)
    # Only the sizes matter (what ``layouts_from_shapes`` returns on an agreement). Most calls
    # re-declare a layout the scope knows (a stage of layers keeps its layout): that is decided
    # on the sizes alone, before any Layout is built.
    sizes = tuple(lay.sizes for lay in layouts)
    seen = _SCOPE.sizes.setdefault(key, set())
    if sizes in seen:
        return
    layouts = tuple(Layout(s) for s in sizes)
    known = _SCOPE.layouts.setdefault(key, [])
    if len(known) >= _SCOPE.MAX_LAYOUTS:
        # Not remembering it is not enough: a tensor of this layout, looked up later by its local
        # sizes, could match a remembered layout on some ranks only.
        scope_forget()
        return
    seen.add(sizes)
    known.append(layouts)
    meta = _layout_meta(mesh)
    # dims[k] is sharded by the k-th domain axis: local sizes at every coordinate of those axes.
    mine = meta.coords[: len(dims)]
    # A layout is answered only where no other remembered one gives the same local sizes at any
    # coordinate: the rank there could not tell them apart, and every rank must hit or miss
    # alike. Kept up to date one declaration at a time (each new layout is looked up at every
    # coordinate; rebuilding the answers from all pairs cost a converted CNN about 1,300 Python
    # calls per forward).
    owners = _SCOPE.owners.setdefault(key, {})
    answers = _SCOPE.answers.setdefault(key, {})
    clash = False
    for c in scope_coords(mesh, len(dims)):
        first = owners.setdefault((c, tuple(s[i] for s, i in zip(sizes, c))), layouts)
        if first is not layouts:
            clash = True
            theirs = tuple(lay.sizes[i] for lay, i in zip(first, mine))
            if answers.get(theirs) is first:
                del answers[theirs]
    if not clash:
        answers[tuple(s[i] for s, i in zip(sizes, mine))] = layouts


def scope_scaled(
    mesh: DeviceMesh,
    dims: Sequence[int],
    shape: Sequence[int],
    out_dims: Sequence[int],
    out_ndim: int,
    ratios: Sequence[Fraction],
) -> None:
    """A call scaled the slab length along each sharded dim by ``ratios`` (the same on every rank).

    A view that splits a sharded dim into blocks (``x.view(b, c, h // 2, 2, w)``, space-to-depth)
    or merges unsharded dims into it (``x.flatten(2)`` of a slab along ``h``), a pixel
    (un)shuffle: the output's slabs are the input's scaled, a layout the scope has not seen. Where
    the scope names the input's layout (``shape``, sharded along ``dims``), the scaled one is
    declared for the output (sharded along ``out_dims`` of ``out_ndim`` dims); otherwise the scope
    forgets. Left alone, a later layer could find the scaled layout's local sizes in a remembered
    layout on some ranks only (slabs of 3, 3, 3 rows, a remembered 3, 3, 2): those ranks skip the
    agreement the others make (a hang or mispaired collectives). Every rank calls it alike: the
    ratios are read from unsharded sizes and the call, and the lookup hits alike on every rank.
    """
    if not _scope_active() or _SCOPE.off or all(r == 1 for r in ratios):
        return
    hit = scope_lookup(mesh, dims, shape)
    if hit is not None and all((s * r).denominator == 1 for lay, r in zip(hit, ratios) for s in lay.sizes):
        scope_declare(mesh, out_dims, out_ndim, [Layout(tuple(int(s * r) for s in lay.sizes))
                                                 for lay, r in zip(hit, ratios)])
    else:
        scope_forget()


def scope_forget() -> None:
    """A layer whose output layout is not declared has run: answer nothing for the rest of the forward.

    Clearing what was remembered is not enough: a tensor made before this point (a skip
    connection, the input of a second branch) keeps its layout, which a later agreement on the
    new layout does not bring back; looked up by its local sizes it could then match the new
    layout on the ranks whose slabs the change left alone, and on those only (a crop of the last
    rows, a pad at the far edge). Every later layer agrees instead (one small all-gather each).
    """
    _SCOPE.forgets += 1
    if _scope_active():
        _SCOPE.clear()
        _SCOPE.off = True
