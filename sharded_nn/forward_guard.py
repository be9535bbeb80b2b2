"""The forward guard: position-mixing calls inside a converted model's own ``forward``.

``convert`` swaps modules, but models also mix positions in their own code
(``F.interpolate(x, size=skip.shape[2:])``, squeeze-excite ``x.mean((2, 3))``, ``torch.roll``,
window partitions by ``view``). On a slab such a call runs without error and gives a wrong
answer. The guard closes that hole: while the root of a converted model runs, a
``torch.overrides.TorchFunctionMode`` sees every torch call made *outside* the sharded layers and
knows which tensors are slabs, and along which dims:

- the tensor inputs of the root are slabs along the model's sharded dims; the output of a
  sharded layer is a slab along the layer's ``dims`` (replicated after a global pool);
- layouts follow the data: pointwise ops and broadcasting, ``permute``/``transpose``/
  ``flatten``/``view``/``reshape`` where the sharded dim maps onto one output dim (a merged group
  whose outermost dim is the sharded one; a split whose outer factor carries it), indexing,
  ``cat``/``stack``/``split`` along other dims, reductions over other dims; anything else marks
  the tensor *unknown*;
- sizes read from a slab (``x.shape``, ``x.size(d)``) along a sharded dim come back as
  ``LocalLength`` ints (plain ints that remember they are local), and arithmetic on them gives
  ``LocalDerived`` ints (``LocalFloat`` for ``/`` and ``**``), so that a size computed from a local
  shape is recognised where it is used (``F.interpolate(size=...)``, ``F.pad``,
  ``torch.zeros``/``arange``); where such a number is used as a value (a scalar of a pointwise
  call, a fill value, ``torch.tensor``), it is evaluated on the global lengths (``_globalise``).

A call that mixes positions along a sharded dim is then computed exactly by its sharded form
(``interpolate``, ``pad``, ``conv``, ``group_norm`` and the pools of ``sharded_nn.layers``;
``mean``/``sum``/``amax``/``amin``/``cumsum`` and the statistics through ``sharded_nn.reductions``,
replicated and with the library's gradient convention; ``torch.roll`` as a periodic halo
exchange; attention over sharded tokens as ring attention), or raises a ``ShardingError`` naming the
call, the module's qualified name and the source line. A call the guard does not know, on a
slab or an unknown tensor, raises too: a model that cannot be checked says so. Calls on plain
tensors (replicated features after a global pool, parameters) run untouched.

Every rank runs the same code on tensors of the same layouts, so every rank takes the same
decision and raises the same error. Branches on sizes (``if x.shape[2] % 2:``, ``if x.shape !=
skip.shape``) are decided on the global sizes, as one device decides them, so ranks whose slabs
differ still take the same branch (``_branch_mode``), and so are the ordering comparisons of
``max``/``min``/``sorted`` called from the model's code; ``math.ceil``/``floor``/``trunc`` and
``round`` keep the tag. Routed calls gather every rank's arguments and raise on every rank when
they differ. A guarded root nested inside a sharded layer of another guarded model (a hybrid
ViT's CNN stem) runs its own guard while the outer one is suspended.

Cost: one Python call per torch call made outside the sharded layers (the mode is popped while
a sharded layer runs). See the README ("Inside forward") for the measured overhead.
"""

from __future__ import annotations

import copy
import dis
import functools
import linecache
import math
import operator
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from . import reductions
from .comm.sizes import _SCOPE, SHARD_DIMS
from .errors import ShardingError
from .guard_fft import FftCalls
from .guard_losses import LOSS_NAMES, LossCalls
from .guard_folds import _FOLD_HANDLERS, Fold, FoldCalls, _flatten_request, fold_of_reshape
from .guard_merged import Merged, MergedCalls, merged_of_reshape
from .guard_distances import DistanceCalls
from .guard_pick import PickCalls
from .guard_tokens import LayoutTokens, keeps_layout
from .guard_sample import SampleCalls
from .layout import Layout, overlap_lengths, slab_overlap
from .mesh import axis_index, axis_size, domain_axes, one_rank

__all__ = [
    "ForwardGuard", "LocalDerived", "LocalFloat", "LocalLength", "guard_active", "install", "mark_guarded",
    "mark_reviewed",
]  # fmt: skip

#: A tensor whose layout the guard could not follow (a reshape it cannot map, a call it routes
#: but whose result it cannot describe). Pointwise work on it is fine; mixing raises.
UNKNOWN = "unknown"

_ACTIVE = threading.local()
_SKIP = object()
#: What ``_ACTIVE.guard`` holds during the forward of a model converted on a one-rank domain: a
#: slab is then the whole tensor, so there is nothing to check or route and no mode is entered
#: (``guard_active()`` still says True, for blocks that are exact only under a guard).
_SINGLE = object()


def guard_active() -> bool:
    """Whether a forward guard covers the current forward (on this thread).

    True also on a one-rank domain, where the guard has nothing to check (every tensor is whole).
    """
    return getattr(_ACTIVE, "guard", None) is not None


def keep_layout(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Record that ``out`` is laid out as ``src`` (for library code run inside a guarded block).

    The guard passes sharded_nn's own torch calls through without following their layouts; a
    block that runs under the guard (``_guard_inside``) and computes part of its forward with
    library code (the Swin blocks' shifted-window attention) hands its result back with this,
    so that the model's code after it sees a slab, not an untracked tensor. Returns ``out``.
    """
    mode = getattr(_ACTIVE, "guard", None)
    if mode is not None and mode is not _SINGLE:
        st = mode.states.get(src)
        if st is None:
            mode.states.pop(out, None)
        else:
            mode.states[out] = st
    return out


def mark_layout(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """Record that ``t`` is a slab sharded along ``dims`` (``dims[k]`` by the k-th domain axis).

    For library code inside a guarded block that hands a tensor of another layout than its input
    to the model's own code (MONAI's Swin stage moves channels last before its blocks). Returns ``t``.
    """
    mode = getattr(_ACTIVE, "guard", None)
    if mode is not None and mode is not _SINGLE:
        mode.states[t] = tuple(dims)
    return t


def run_local(fn: Callable, *args, draws_on: torch.device | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on this rank's own part of a slab, the guard standing aside.

    For library code inside a guarded block that hands model code a tensor the guard does not
    follow but which is this rank's share of the data (a Swin block's windows, each on one
    rank): the calls inside run untouched (nothing of theirs mixes ranks), and, with
    ``draws_on`` (the device of the random draws, where ``fn`` draws: dropout in training),
    from this rank's own stream of the guard's random streams, independent of the other ranks'
    (the law of element-wise dropout on one device). Outside a guarded forward: ``fn`` as is.
    """
    mode = getattr(_ACTIVE, "guard", None)
    if mode is None or mode is _SINGLE or mode.suspended:
        return fn(*args, **kwargs)

    def aside(*a, **k):
        mode.suspend()
        try:
            return fn(*a, **k)
        finally:
            mode.resume()

    if draws_on is None:
        return aside(*args, **kwargs)
    every_axis = tuple(range(len(mode.guard.axes)))  # a stream of its own on every domain rank
    return mode._draw(aside, args, kwargs, every_axis, draws_on)


# ------------------------------------------------------------------------------- tagged sizes


class _WholeDomainOperand(Exception):
    """Internal: a pointwise call's plain operand varies along a sharded dim (``_broadcast``)."""


class LocalDerived(int):
    """An int computed from local slab sizes: arithmetic on it stays tagged.

    It also remembers *how* it was computed: ``_leaves`` (the ``LocalLength`` sizes it came from)
    and ``_fn`` (the same arithmetic on any values of those leaves), so that where it is used as
    a *value* (``y * x.shape[2]``, ``s / (h * w)``: the single device would use the global
    number), the guard can evaluate it on the global lengths instead (``_GuardMode._globalise``).
    ``_leaves`` is None where the expression is not known (then such a use is refused).
    """

    _leaves: tuple | None = None
    _fn: Callable | None = None
    #: Computed through a floor division, a remainder or a rounding (``h // ws``): a view by it
    #: fits a slab only where the slab is a whole number of blocks (``_GuardMode._h_reshape``).
    _lossy: bool = False

    def __repr__(self) -> str:
        return int.__repr__(self)


class LocalFloat(float):
    """A float computed from local slab sizes (``1 / h``, ``n ** -0.5``); tagged like ``LocalDerived``."""

    _leaves: tuple | None = None
    _fn: Callable | None = None
    _lossy: bool = False

    def __repr__(self) -> str:
        return float.__repr__(self)


def _derive(v, a, b, op, lossy: bool = False):
    """``v = op(a, b)`` where ``a`` is tagged, as a tagged number that remembers the expression
    (``lossy``: ``op`` rounds, as ``//`` does)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    out = LocalDerived(v) if isinstance(v, int) else LocalFloat(v)
    if lossy or a._lossy or getattr(b, "_lossy", False):
        out._lossy = True
    la = a._leaves
    if la is None:
        return out
    fa = a._fn
    if isinstance(b, (LocalDerived, LocalFloat)):
        lb, fb = b._leaves, b._fn
        if lb is None:
            return out
        n = len(la)
        out._leaves, out._fn = la + lb, lambda vals: op(fa(vals[:n]), fb(vals[n:]))
    else:
        out._leaves, out._fn = la, lambda vals: op(fa(vals), b)
    return out


def _tagged_binary(base: type, name: str):
    own = getattr(base, name)
    plain = name.replace("__r", "__", 1) if name.startswith("__r") else name
    fwd = getattr(operator, plain.strip("_"))
    # ``op(self_value, other)`` in the operand order of the original expression.
    op = (lambda a, b: fwd(b, a)) if name != plain else fwd
    lossy = plain in ("__floordiv__", "__mod__")

    def method(self, o):
        v = own(self, o)
        if v is NotImplemented:
            if base is int and isinstance(o, float):  # ``h * 0.5``: Python would fall back to float's own
                v = op(float(self), o)
            else:
                return v
        return _derive(v, self, o, op, lossy)

    method.__name__ = name
    return method


# Arithmetic on a tagged size stays tagged and remembers its expression (the type's own operator,
# result re-wrapped). A Python float on the left of an int size (``0.5 * h``) is float's own
# operator and loses the tag, as do ``float()``, ``int()`` and ``math`` functions (README).
_ARITH = ("add", "sub", "mul", "floordiv", "mod", "truediv", "pow")
for _cls in (LocalDerived, LocalFloat):
    for _op in _ARITH:
        for _name in (f"__{_op}__", f"__r{_op}__"):
            setattr(_cls, _name, _tagged_binary(_cls.__mro__[1], _name))
del _op, _name


def _tagged_compare(base: type, name: str):
    own = getattr(base, name)
    op = getattr(operator, name.strip("_"))
    ordering = name not in ("__eq__", "__ne__")

    def method(self, o):
        v = own(self, o)
        if v is NotImplemented:
            if base is int and isinstance(o, float):
                v = op(float(self), o)
            else:
                return v
        mode = _branch_mode(ordering)
        return v if mode is None else mode.global_compare(op, self, o)

    method.__name__ = name
    return method


def _tagged_bool(self) -> bool:
    mode = _branch_mode()
    v = (float if isinstance(self, float) else int)(self) != 0
    return v if mode is None else mode.global_compare(operator.ne, self, 0)


#: Instructions of a comparison or truth test written in the caller's code (``==``, ``<``, ``if``,
#: ``and``/``or``, ``not``; names of Python 3.11-3.13). A dict or cache lookup (einops' recipe
#: cache keyed by shapes) or ``in`` compare the slab's own sizes instead.
_BRANCH_OPS = frozenset(
    i for i, n in enumerate(dis.opname) if n.startswith(("COMPARE_OP", "POP_JUMP", "JUMP_IF_", "TO_BOOL", "UNARY_NOT"))
)
#: Call instructions: an ordering comparison (``<``, ``>``, ...) made from a call in the model's
#: code is the builtin ``max``/``min``/``sorted`` of sizes (timm's TF-"same" padding
#: ``max((math.ceil(h / s) - 1) * s + k - h, 0)``); cache lookups compare with ``==`` only.
_CALL_OPS = frozenset(i for i, n in enumerate(dis.opname) if n in ("CALL", "PRECALL", "CALL_FUNCTION_EX", "CALL_KW"))


def _branch_mode(ordering: bool = False):
    """The guard mode that decides a comparison of a tagged size on the global sizes, or None.

    Only a comparison or truth test written as such in a model's own code while its guarded
    forward runs (not in a sharded layer, a reviewed module, a guard handler or sharded_nn's
    code): every rank runs that code alike, so the small all-gather it costs pairs up.
    ``ordering``: an ordering comparison, which ``max``/``min``/``sorted`` called from that code
    make too (since session 52: a rank whose slab's local pad amount won ``max(pad, 0)`` kept a
    tagged amount while another kept the plain 0, and they padded differently).
    """
    mode = getattr(_ACTIVE, "guard", None)
    if mode is None or mode is _SINGLE or mode.suspended:
        return None
    f = sys._getframe(2)  # the frame whose instruction called the comparison method
    op = f.f_code.co_code[f.f_lasti]
    if not (op in _BRANCH_OPS or (ordering and op in _CALL_OPS)) or not mode.on_stack() or _called_from_library(3):
        return None
    if f.f_globals.get("__name__", "").split(".")[0] in _LOCAL_SHAPE_LIBRARIES:
        return None
    return mode


#: Libraries whose code works out a call from the slab's own shape and caches the result by that
#: shape (einops' recipes, ``functools.lru_cache`` on the shape): their comparisons run only when
#: a rank misses its cache, and ranks with other slab sizes miss at other calls, so deciding them
#: on the global sizes (a collective) would pair up with nothing on the other ranks. They check
#: and reshape the slab itself, so its own sizes are the right ones there.
_LOCAL_SHAPE_LIBRARIES = frozenset({"einops"})


# Branches on a tagged size (``if x.shape[2] % 2:``, ``if skip.shape != x.shape:``) are decided on
# the global sizes, as on one device, in a model's own code: ranks whose slabs differ would
# otherwise take different branches (a routed call on some ranks only hangs).
for _cls in (LocalDerived, LocalFloat):
    for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
        setattr(_cls, _name, _tagged_compare(_cls.__mro__[1], _name))
    _cls.__hash__ = _cls.__mro__[1].__hash__  # type: ignore[method-assign]
    _cls.__bool__ = _tagged_bool  # type: ignore[method-assign]
del _cls, _name
LocalDerived.__neg__ = lambda self: _derive(-int(self), self, 0, lambda a, _: -a)  # type: ignore[method-assign]
LocalFloat.__neg__ = lambda self: _derive(-float(self), self, 0, lambda a, _: -a)  # type: ignore[method-assign]


def _tagged_rounding(name: str):
    """``math.ceil/floor/trunc`` and ``round`` of a tagged number, tagged (``math`` calls the
    operand's ``__ceil__`` etc. for anything but an exact float): ``math.ceil(h / s)`` in a
    TF-"same" pad is then the single device's number where it is used as a value. (``int()``,
    ``float()`` and ``math.sqrt`` still drop the tag.)"""
    fn = {"__ceil__": math.ceil, "__floor__": math.floor, "__trunc__": math.trunc}.get(name)

    def method(self, *nd):
        plain = (float if isinstance(self, float) else int)(self)
        if fn is None:  # __round__(ndigits=None)
            return _derive(round(plain, *nd), self, nd[0] if nd else None,
                           lambda a, n: round(a) if n is None else round(a, n), lossy=True)
        return _derive(fn(plain), self, None, lambda a, _: fn(a), lossy=True)

    method.__name__ = name
    return method


for _cls in (LocalDerived, LocalFloat):
    for _name in ("__ceil__", "__floor__", "__trunc__", "__round__"):
        setattr(_cls, _name, _tagged_rounding(_name))
del _cls, _name


def _value_mode(frame):
    """The guard mode that evaluates ``int()``/``float()`` of a tagged number on the global sizes,
    or None: only where the conversion is written in a model's own code while its guarded forward
    runs (not in torch, sharded_nn or a library that caches by the slab's shape), which every
    rank runs alike, so the small all-gather it costs pairs up."""
    mode = getattr(_ACTIVE, "guard", None)
    if mode is None or mode is _SINGLE or mode.suspended or not mode.on_stack():
        return None
    name = frame.f_code.co_filename
    if name.startswith(_TORCH_DIR) or (name.startswith(_LIB_DIR) and name not in _MODEL_RUNNERS):
        return None
    if frame.f_globals.get("__name__", "").split(".")[0] in _LOCAL_SHAPE_LIBRARIES:
        return None
    return mode


def _tagged_conversion(target: type):
    """``int()``/``float()`` of a tagged number (and ``math.sqrt`` etc., which call ``__float__``):
    Python makes a plain number of it, which a tag cannot survive. In a model's own code it is
    the single device's number, evaluated on the global sizes, as every plain number there is
    read (constant sizes are the whole sample's): FourCastNet's ``int(total_modes * fraction)``
    mode count, NesT's ``int(math.sqrt(T))`` grid side. Before session 56 it was this slab's
    number, used then as a global one: silently wrong."""
    slot = f"__{target.__name__}__"

    def method(self):
        plain = getattr(float if isinstance(self, float) else int, slot)(self)
        mode = _value_mode(sys._getframe(1))
        if mode is None or self._leaves is None:
            return plain
        return target(mode._global_values([self], f"`{target.__name__}()` of a size read from a slab")[id(self)])

    method.__name__ = slot
    return method


for _cls in (LocalDerived, LocalFloat):
    _cls.__int__ = _tagged_conversion(int)  # type: ignore[method-assign]
    _cls.__float__ = _tagged_conversion(float)  # type: ignore[method-assign]
del _cls


class LocalLength(LocalDerived):
    """The local length of a slab along the dim that mesh axis ``axis`` shards."""

    axis: int

    def __new__(cls, value: int, axis: int):
        obj = super().__new__(cls, value)
        obj.axis = axis
        return obj

    @property
    def _leaves(self) -> tuple:  # type: ignore[override]
        return (self,)

    @staticmethod
    def _fn(vals):  # type: ignore[override]
        return vals[0]


class FoldLength(LocalLength):
    """The local length of a dim that folds windows of several samples (``B_ = windows.shape[0]``,
    ``guard_folds.Fold``): tagged with the fold's mesh axis (the sum over the axis is the global
    length), so that a view by it names the folded dim; a tensor created with it as a size, or
    positions counted by it, are refused (its rows are not one block of the single device's)."""


class MergedLength(FoldLength):
    """The local length of a dim merging the slabs of several mesh axes (``guard_merged.Merged``:
    ``n = x.shape[1]`` of tokens on a 2-D domain mesh), tagged with all of them (``axes``): a view
    by it names the merged dim, its value as a number is the sum over those axes' ranks, and a
    tensor created with it as a size is refused, as for a fold."""

    axes: tuple

    def __new__(cls, value: int, axes):
        obj = super().__new__(cls, value, axes[0])
        obj.axes = tuple(axes)
        return obj


#: The layouts whose calls ``guard_folds.FoldCalls`` (and, merged, ``guard_merged.MergedCalls``) take.
FOLDED = frozenset([Fold, Merged])


def _is_tagged(v) -> bool:
    return isinstance(v, (LocalDerived, LocalFloat))


# ------------------------------------------------------------------------------- op tables

_POINTWISE_EXTRA = frozenset(
    """relu relu6 silu gelu hardswish hardsigmoid hardtanh sigmoid tanh mish elu selu celu leaky_relu prelu
    rrelu softplus softsign tanhshrink softshrink hardshrink logsigmoid threshold glu_pointwise
    clone contiguous detach detach_ to type float double half bfloat16 long int short byte char bool cfloat cdouble
    chalf cpu cuda requires_grad_ type_as
    zeros_like ones_like empty_like full_like fill_ zero_ where masked_fill clamp clip
    clamp_min clamp_max nan_to_num pin_memory data alias retain_grad square float_power
    __and__ __or__ __xor__ __invert__ logical_and logical_or logical_not logical_xor
    real imag conj conj_physical resolve_conj resolve_neg angle polar complex""".split()
)
# Metadata reads and calls that return no slab data.
_PASSIVE = frozenset(
    """dim ndim ndimension dtype device is_cuda is_cpu is_floating_point is_complex is_contiguous stride
    element_size data_ptr requires_grad grad_fn is_leaf layout names storage_offset nbytes itemsize
    register_hook backward __repr__ __format__ __hash__ __reduce_ex__ __deepcopy__ __setstate__
    get_device is_sparse is_quantized is_meta untyped_storage _is_view __dlpack__ __dlpack_device__
    has_names is_inference _version grad _base output_nr is_nested""".split()
)
_VIEW_SAME = frozenset(["view_as", "reshape_as"])
_ROUTED_REDUCE = frozenset(["sum", "mean", "amax", "amin", "max", "min", "nansum", "nanmean"])
# Statistics routed to ``sharded_nn.reductions`` where they reduce a sharded dim (their own parser).
_ROUTED_STATS = frozenset(["norm", "linalg_vector_norm", "linalg_norm", "var", "std", "var_mean", "std_mean"])
_REDUCE = frozenset(
    """std var std_mean var_mean prod norm logsumexp argmax argmin all any count_nonzero median nanmedian
    mode cumsum cumprod cummax cummin logcumsumexp sort argsort topk kthvalue quantile nanquantile
    softmax log_softmax softmin normalize aminmax unique_consecutive diff""".split()
)
# Positional ops: they read or write positions by index along the dims they act on.
_POSITIONAL = frozenset(
    """flip fliplr flipud rot90 tril triu diagonal diag diag_embed index_select gather scatter scatter_add
    scatter_reduce index_add index_copy index_fill index_put take take_along_dim masked_select nonzero
    masked_scatter unfold fold affine_grid pixel_shuffle_any embedding_bag
    conv_tbc histc bincount searchsorted bucketize cross""".split()
)
_CREATE_SIZED = frozenset(["zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full"])
# Random draws: routed to a stream that matches what the drawn tensor is (``_h_random``).
_RANDOM = frozenset(
    """bernoulli rand randn randint rand_like randn_like randint_like normal uniform exponential geometric cauchy
    log_normal random poisson multinomial randperm dropout alpha_dropout feature_alpha_dropout dropout1d
    dropout2d dropout3d feature_dropout""".split()
)
_RANDOM_CREATE = frozenset(["rand", "randn", "randint", "normal"])
# Channel dropout: the rank of a batched input (one mask entry per sample and channel; an
# unbatched input has one per channel). ``None``: any rank, always batched.
_FEATURE_DROPOUT = {"dropout1d": (3,), "dropout2d": None, "dropout3d": (5,), "feature_alpha_dropout": None,
                    "feature_dropout": None}
_CREATE_POSITIONS = frozenset(["arange", "range", "linspace", "logspace", "eye", "tril_indices",
                               "triu_indices", "meshgrid", "cartesian_prod", "ones_like_positions"])
_POOL_NAMES = {
    "max_pool1d": 1, "max_pool2d": 2, "max_pool3d": 3, "max_pool1d_with_indices": 1, "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3, "avg_pool1d": 1, "avg_pool2d": 2, "avg_pool3d": 3, "adaptive_avg_pool1d": 1,
    "adaptive_avg_pool2d": 2, "adaptive_avg_pool3d": 3, "adaptive_max_pool1d": 1, "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3, "adaptive_max_pool1d_with_indices": 1, "adaptive_max_pool2d_with_indices": 2,
    "adaptive_max_pool3d_with_indices": 3, "lp_pool1d": 1, "lp_pool2d": 2, "lp_pool3d": 3,
    "fractional_max_pool2d": 2, "fractional_max_pool3d": 3,
}  # fmt: skip
_DUNDER_ARITH = frozenset("add sub mul truediv div floordiv mod pow and or xor lshift rshift".split())
_DUNDER_UNARY = frozenset("neg pos abs invert".split())
_DUNDER_CMP = frozenset("eq ne lt le gt ge".split())


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


def _aten_pointwise(name: str) -> bool:
    pkt = getattr(torch.ops.aten, name, None)
    if pkt is None:
        return False
    try:
        overloads = pkt.overloads()
    except Exception:  # noqa: BLE001 - not an op packet
        return False
    return any(torch.Tag.pointwise in getattr(pkt, ov).tags for ov in overloads)


def _classify(func) -> tuple[str, str, bool]:
    """(kind, base name, in place) for a torch function; cached per function object."""
    name = _func_name(func)
    inplace = False
    base = name
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        core = name[2:-2]
        if core == "getitem":
            return "getitem", core, False
        if core == "setitem":
            return "setitem", core, True
        if core in ("matmul", "rmatmul", "imatmul"):
            return "matmul", core, False
        if core in ("len",):
            return "len", core, False
        if core in ("bool", "int", "float", "index", "complex", "array", "iter", "contains"):
            return "data", core, False
        if core[:1] in ("i", "r") and core[1:] in _DUNDER_ARITH:
            inplace = core[0] == "i"
            core = core[1:]
        if core in _DUNDER_ARITH or core in _DUNDER_UNARY or core in _DUNDER_CMP:
            return "pointwise", core, inplace
        if name in _PASSIVE:
            return "passive", name, False
        return "other", name, False
    if name.endswith("_") and not name.startswith("_") and name not in ("requires_grad_", "detach_"):
        base, inplace = name[:-1], True
    if base in _PASSIVE:
        return "passive", base, False
    if base in ("shape", "size"):
        return "shape", base, False
    if base == "numel":
        return "numel", base, False
    if base in ("item", "tolist", "numpy"):
        return "data", base, False
    if base in _VIEW_SAME:
        return "view_as", base, False
    simple = {
        "permute": "permute", "transpose": "transpose", "swapaxes": "transpose", "swapdims": "transpose",
        "t": "transpose", "T": "transpose", "mT": "transpose", "movedim": "movedim", "moveaxis": "movedim",
        "unsqueeze": "unsqueeze", "squeeze": "squeeze", "flatten": "reshape", "unflatten": "reshape",
        "view": "reshape", "reshape": "reshape", "expand": "expand", "expand_as": "expand", "broadcast_to": "expand",
        "repeat": "repeat", "repeat_interleave": "repeat_interleave", "narrow": "narrow", "select": "select", "split": "split", "chunk": "split",
        "unbind": "split", "tensor_split": "split", "split_with_sizes": "split", "cat": "cat", "concat": "cat",
        "concatenate": "cat", "stack": "stack", "roll": "roll", "linear": "linear", "bilinear": "other",
        "matmul": "matmul", "mm": "matmul", "bmm": "matmul", "einsum": "einsum",
        "scaled_dot_product_attention": "sdpa", "interpolate": "interpolate", "upsample": "interpolate",
        "upsample_nearest": "interpolate", "upsample_bilinear": "interpolate", "pad": "pad",
        "conv1d": "conv", "conv2d": "conv", "conv3d": "conv", "conv_transpose1d": "conv",
        "conv_transpose2d": "conv", "conv_transpose3d": "conv", "batch_norm": "batch_norm",
        "layer_norm": "trailing_norm", "rms_norm": "trailing_norm", "group_norm": "spatial_norm",
        "instance_norm": "spatial_norm", "local_response_norm": "channel_op", "channel_shuffle": "channel_op",
        "pixel_shuffle": "pixel_shuffle", "pixel_unshuffle": "pixel_shuffle", "copy": "copy",
        "embedding": "embedding", "grid_sample": "grid_sample", "cosine_similarity": "similarity",
        "pairwise_distance": "similarity", "dist": "similarity", "one_hot": "one_hot", "gradient": "gradient", "tensor": "literal", "as_tensor": "literal", "scalar_tensor": "literal",
        "new_tensor": "literal", "view_as_real": "complex_view", "view_as_complex": "complex_view",
        "fold": "col2im",
    }  # fmt: skip
    if base in simple:
        return simple[base], base, inplace and base not in ("copy",)
    if base.startswith("fft_"):  # torch.fft's functions (``guard_fft``)
        return "fft", base, False
    if base in LOSS_NAMES:  # (``guard_losses``)
        return "loss", base, False
    if base in _RANDOM:
        return "random", base, inplace
    if base in _POOL_NAMES:
        return "pool", base, False
    if base in _ROUTED_REDUCE or base in _REDUCE or base in _ROUTED_STATS:
        return "reduce", base, False
    if base in _POSITIONAL:
        return "positional", base, inplace
    if base in _CREATE_SIZED:
        return "create", base, False
    if base in _CREATE_POSITIONS:
        return "positions", base, False
    if base in _POINTWISE_EXTRA or _aten_pointwise(base):
        return "pointwise", base, inplace
    return "other", base, inplace


# ------------------------------------------------------------------------------- argument walk


#: Exact types that are never a tensor nor a tagged size (``LocalDerived`` subclasses int, so its
#: type is not ``int``): the walk skips them without a call, e.g. a conv's stride and padding.
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None)})


def _walk(obj, out: list, depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor) or _is_tagged(obj):
        out.append(obj)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            if type(o) not in _PLAIN_TYPES:
                _walk(o, out, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for o in obj.values():
            _walk(o, out, depth + 1)


def _arg(args, kwargs, i: int, name: str, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _plain_int(i) -> bool:
    """Whether an index item is an integer position (not a bool: torch reads ``True`` as a mask)."""
    return isinstance(i, int) and not isinstance(i, bool)


def _difference_block(start: int, n: int, total: int, edge_order: int) -> tuple[int, int]:
    """The rows ``[lo, hi]`` of a dim of ``total`` rows whose ``torch.gradient`` gives the slab
    ``[start, start + n)`` its own values: one row beyond each end, and at the sample's ends the
    ``edge_order + 1`` rows its one-sided differences read."""
    lo, hi = max(start - 1, 0), min(start + n, total - 1)
    if lo == 0:
        hi = max(hi, min(edge_order, total - 1))
    if hi == total - 1:
        lo = min(lo, max(total - 1 - edge_order, 0))
    return (lo, hi) if n else (start, start - 1)  # (an empty slab reads nothing)


def _norm_dims(dim, nd: int) -> tuple[int, ...] | None:
    if dim is None:
        return None
    if isinstance(dim, int):
        return (dim % nd,) if nd else (0,)
    return tuple(d % nd for d in dim)


# ------------------------------------------------------------------------------- the guard


class ShardedFunctionCache:
    """Sharded pool modules built for functional pool calls, keyed by the call's configuration.

    The key is made of call arguments every rank passes alike (not of local shapes), so a
    cache hit on one rank is a hit on every rank (DESIGN.md section 4).
    """

    def __init__(self) -> None:
        self._data: dict = {}

    def get(self, key, make: Callable[[], nn.Module]) -> nn.Module:
        if key not in self._data:
            if len(self._data) > 64:
                self._data.clear()
            self._data[key] = make()
        return self._data[key]


class ForwardGuard:
    """What ``convert`` installs on the root of a converted model (see the module docstring).

    Args:
        model: the converted root module.
        mesh: the mesh its sharded layers use.
        dims: the tensor dims the root's tensor inputs are sharded along (one per domain axis).
        reviewed: qualified names of modules the user marked reviewed (``plan={name: None}``):
            their forward runs unchecked, and their output keeps their input's layout.
    """

    def __init__(
        self, model: nn.Module, mesh: DeviceMesh, dims: Sequence[int], reviewed: Sequence[str] = (), scope=None,
        input_dims=None, strict: bool = False,
    ):
        # ``comm.sizes.ScopeHooks`` run from the root hooks below (one pair of root hooks for both).
        self.scope = scope
        # ``entry_inputs.InputDims``: root inputs sharded along dims of their own (or whole).
        self.input_dims = input_dims
        # ``convert(..., strict=True)``: an unshared replicated output's backward raises (else warns).
        self.strict = strict
        self.mesh = mesh
        self.axes = domain_axes(mesh)
        self.dims = tuple(dims)
        self.names: dict[int, str] = {}
        self.pools = ShardedFunctionCache()
        self.reviewed = tuple(reviewed)
        # A fact of the mesh, the same on every rank: with one rank per domain axis every tensor
        # is whole, nothing can be mixed wrongly, and the guard skips its mode and layer hooks.
        self.single = one_rank(mesh)
        self.refresh(model)

    def refresh(self, model: nn.Module) -> None:
        """Re-read the module names (for error messages; a deep copy has new module ids)."""
        self.names = {id(m): n or "<root>" for n, m in model.named_modules()}
        self._root_id = id(model)

    # -- hooks ---------------------------------------------------------------------------------

    def root_pre(self, module: nn.Module, args, kwargs):
        if self.scope is not None:
            # First, before the guard's mode sees any tensor access; paired with root_post.
            self.scope.enter(module, args, kwargs)
        outer = getattr(_ACTIVE, "guard", None)
        # A guarded forward already runs, unless it is suspended inside a sharded layer that
        # holds this model as a part of its own (a hybrid ViT's CNN stem, converted as a model
        # of its own): then this root's guard runs, and the outer one resumes after it.
        if torch.compiler.is_compiling() or (outer is not None and (outer is _SINGLE or not outer.suspended)):
            return None
        module.__dict__["_snn_guard_outer"] = outer
        if self.single:
            _ACTIVE.guard = _SINGLE
            module.__dict__["_snn_guard_mode"] = _SINGLE
            return None
        if self._root_id != id(module):
            self.refresh(module)
        if not _EINOPS_TAGGED[0] and "einops.einops" in sys.modules:
            _tag_einops_recipes()
        mode = _GuardMode(self)
        states = mode.states
        if self.input_dims is None:
            for t in [*args, *kwargs.values()]:
                if isinstance(t, torch.Tensor) and t.dim() > max(self.dims, default=-1):
                    states[t] = tuple(self.dims)
        else:
            for t, d, named in self.input_dims.tensors(args, kwargs):
                if not named:
                    if t.dim() > max(self.dims, default=-1):
                        states[t] = d
                elif d is not None:
                    if t.dim() <= max(d):
                        # (root_post still runs, always_call: it ends the scope entered above.)
                        raise ShardingError(
                            f"{type(module).__name__}: convert's input_dims shards an input of {t.dim()} dims along "
                            f"dims {d}; expected a tensor with more than {max(d)} dims. Give that input's own "
                            "sharded dims in input_dims (or None for a whole tensor)."
                        )
                    states[t] = d
        mode.__enter__()
        _ACTIVE.guard = mode
        module.__dict__["_snn_guard_mode"] = mode
        return None

    def root_post(self, module: nn.Module, args, kwargs, output):
        if self.scope is not None:
            self.scope.leave(module, args, kwargs, output)
        mode = module.__dict__.pop("_snn_guard_mode", None)
        if mode is None:
            return None
        outer = _ACTIVE.guard = module.__dict__.pop("_snn_guard_outer", None)
        if mode is _SINGLE:
            return None
        mode.__exit__(None, None, None)
        tensors = _flat_tensors(output)
        bad = [t for t in tensors if mode.states.get(t) is UNKNOWN or type(mode.states.get(t)) in FOLDED]
        if bad and sys.exc_info()[0] is None:
            raise ShardingError(
                f"forward guard: the output of {type(module).__name__} is a tensor whose layout the guard "
                "could not follow (a reshape or call that moves a sharded dim where it cannot map it), so "
                "sharded_nn.gather would assemble it wrongly. Keep the sharded dim as one dim of the output, "
                "or register a sharded class for the module that produces it (sharded_nn.register)."
            )
        if outer is not None:
            # (A root nested in another guarded model's layer hands its outputs on to that model,
            # whose own outputs are marked and checked.)
            return None
        for t in tensors:
            # Slabs sharded by every domain axis carry their dims (as ``snn.shard``'s slabs do):
            # ``gather``, the reductions and a next converted model compare them with the dims
            # they are given (``comm.sizes.check_cut``).
            st = mode.states.get(t)
            if type(st) is tuple and None not in st:
                setattr(t, SHARD_DIMS, st)
        return self._checked_outputs(module, mode, output, tensors)

    #: Outputs up to this many elements are checked (losses, logits): a check reads the gradient.
    SEED_CHECKED_NUMEL = 4096

    def _checked_outputs(self, module: nn.Module, mode, output, tensors: list):
        """``output`` (``tensors``: its tensors) with each small replicated output that needs a
        gradient behind ``losses.check_seeded`` (a ``backward()`` on it without ``share`` warns, or
        raises with ``strict``, instead of giving P times the gradient silently), or None where
        there is none (the output stays as it is)."""
        if not torch.is_grad_enabled():
            return None
        picked: dict[int, tuple] = {}
        for t in tensors:
            if t.grad_fn is None or not t.is_floating_point() or not 0 < t.numel() <= self.SEED_CHECKED_NUMEL:
                continue
            st = mode.states.get(t)
            if st is UNKNOWN or type(st) in FOLDED:
                continue
            axes = [a for k, a in enumerate(self.axes) if st is None or st[k] is None]
            if axes:
                picked[id(t)] = tuple(axes)
        if not picked:
            return None
        from torch.utils._pytree import tree_map_only

        from .losses import check_seeded
        from .mesh import group_over

        what = f"the output of {type(module).__name__}"

        def checked(t):
            axes = picked.get(id(t))
            if axes is None:
                return t
            ranks = math.prod(axis_size(self.mesh, a) for a in axes)
            return check_seeded(t, group_over(self.mesh, axes), ranks, what, self.strict)

        return tree_map_only(torch.Tensor, checked, output)


def _flat_tensors(obj) -> list[torch.Tensor]:
    out: list = []
    _walk(obj, out)
    return [t for t in out if isinstance(t, torch.Tensor)]


def _global_layer_arguments(mode, module: nn.Module, args, kwargs):
    """A sharded layer's size arguments computed from slab sizes, as the global ones.

    A sharded layer takes its size arguments for the whole sample (``output_size`` of a max
    unpooling or a transposed convolution), as the single device does; a model passes them
    read from its tensors (SegNet's ``unpool(y, idx, output_size=x.size())``, a decoder's
    ``up(y, output_size=skip.shape[2:])``), which on a slab are this rank's. Such numbers are
    values, evaluated on the global sizes (one small all-gather), as everywhere in the guard;
    before session 59 each rank passed its own and the layer refused them.
    """
    found: list = []
    _walk((args[1:], kwargs), found)
    if not any(_is_tagged(v) for v in found):
        return args, kwargs

    def plain(v):  # a torch.Size keeps its elements as they are; the guard substitutes in tuples
        return tuple(v) if isinstance(v, torch.Size) else v

    args = (args[0], *(plain(a) for a in args[1:])) if args else args
    kwargs = {k: plain(v) for k, v in kwargs.items()}
    return mode._globalise(f"`{type(module).__name__}`", args, kwargs)


class _LayerHooks:
    """The guard's work around one call of a sharded layer (or a reviewed module) in a guarded model.

    Before the call: check the layer's input layout (a sharded layer) and suspend the mode (the
    module's own torch calls are its business); after: resume it and give the output its layout.
    What depends only on the module's class is decided once here: whether the input is checked
    and whether the output layout needs ``_layer_output_state`` (adaptive pools) or is the
    input's. Blocks that run the guard inside themselves (``_guard_inside``) get none of it.

    A ``ShardedMixin`` layer runs it from its own ``__call__`` (``call``, one frame: installed as
    the instance attribute ``_snn_guard_call``); other modules (reviewed ones, sharded classes a
    user registered) through a forward pre-hook and an always-called forward hook (``pre`` and
    ``post``), whose generic path costs several microseconds more per call. Both only act while
    a guarded forward is running on this thread.
    """

    def __init__(self, kind: str, module: nn.Module | None = None) -> None:
        self.kind = kind  # "sharded" or "reviewed"
        # Class attributes (``getattr`` on an nn.Module instance that lacks the name goes through
        # ``nn.Module.__getattr__`` and an AttributeError: microseconds per hook call).
        self.check = kind == "sharded"
        self.same_state = kind == "reviewed" or not type(module).__name__.startswith(_NEW_LAYOUT_LAYERS)
        self.needs_ndim = isinstance(module, nn.LayerNorm)  # read by ``_ndim_hint``

    # -- the shared halves

    def _enter(self, mode: _GuardMode, module: nn.Module, args, per_sample: bool = False):
        """Check the input, suspend the mode; returns the input's layout state for ``_leave``
        and whether the layer runs its torch counterpart's forward (``per_sample``: the caller
        can run it; see ``_check_layer_input``)."""
        x = None
        for a in args:
            if isinstance(a, torch.Tensor):
                x = a
                break
        state = mode.states.get(x) if x is not None else None
        plain = False
        if self.check:
            if self.needs_ndim:  # (under the mode ``x.dim()`` is itself a guarded call: only where used)
                module.__dict__["_snn_guard_ndim"] = x.dim() if x is not None else 0
            plain = _check_layer_input(mode, module, state, per_sample)
        mode.suspend()
        return state, plain

    def _leave(self, mode: _GuardMode, module: nn.Module, state, output, same: bool = False) -> None:
        """Resume the mode and record the output's layout (after ``_enter`` suspended it);
        ``same``: the input's, whatever the layer."""
        mode.resume()
        out_state = state if self.same_state or same else _layer_output_state(module, state)
        states = mode.states
        tensors = (output,) if isinstance(output, torch.Tensor) else _flat_tensors(output)
        per_output = getattr(module, "_guard_output_states", None)
        # A layer whose outputs are laid out unlike one another (attention's output and weights)
        # names each one's layout.
        each = per_output(output, out_state) if per_output is not None and type(out_state) is tuple else None
        for i, t in enumerate(tensors):
            st = each[i] if each is not None else out_state
            if st is None:
                states.pop(t, None)
            else:
                states[t] = st

    # -- from the layer's own ``__call__``

    def call(self, call, module: nn.Module, args, kwargs):
        """Run ``call(*args, **kwargs)`` (the layer's ``nn.Module.__call__``) with the guard's work around it.

        ``_enter`` and ``_leave`` written out for the common case (one tensor in, one out, the
        input sharded as the layer expects): a timm CNN makes about a hundred of these calls per
        forward, and each Python call costs a few microseconds amid a forward's work.
        """
        mode = getattr(_ACTIVE, "guard", None)
        if mode is None or mode is _SINGLE or mode.suspended:
            # No guarded forward, or inside a sharded layer or a reviewed module: its own business.
            return call(*args, **kwargs)
        if kwargs or len(args) > 1:  # (a single tensor, the common call, has no size arguments)
            args, kwargs = _global_layer_arguments(mode, module, args, kwargs)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        forgets = _SCOPE.forgets
        dims = module.__dict__.get("dims") if self.check else None
        plain = False
        if x is None or self.needs_ndim or type(dims) is not tuple or not dims:
            state, plain = self._enter(mode, module, args, per_sample=True)
        else:
            entries = mode.states._d
            e = entries.get(id(x))
            state = e[1] if e is not None and e[0]() is x else None
            n = len(dims)
            # ``_check_layer_input``'s accepting case: the input sharded along the layer's dims
            # (then unsharded); anything else takes the full check, which raises or accepts.
            if (state is None or state is UNKNOWN or type(state) in FOLDED or state[:n] != dims
                    or any(d is not None for d in state[n:])):
                plain = _check_layer_input(mode, module, state, per_sample=True)
            mode.suspend()
        try:
            if plain is True:
                output = _with_torch_forward(module, call, args, kwargs)
            elif plain:
                output = _with_twin(module, plain, call, args, kwargs)
            else:
                output = call(*args, **kwargs)
        except BaseException:
            mode.resume()
            raise
        if plain:
            self._leave(mode, module, state, output, same=True)
        elif not self.same_state or not isinstance(output, torch.Tensor):
            self._leave(mode, module, state, output)
        else:
            mode.resume()
            if state is None:
                mode.states.pop(output, None)
            else:
                mode.states._d[id(output)] = (weakref.ref(output), state)
        if mode.tokens._d or _SCOPE.forgets != forgets:
            _layer_tokens(mode, module, x, output, _SCOPE.forgets != forgets)
        return output

    # -- as module hooks

    def pre(self, module: nn.Module, args):
        mode = getattr(_ACTIVE, "guard", None)
        if mode is None or mode is _SINGLE:
            return None
        stack = module.__dict__.get("_snn_guard_stack")
        if stack is None:
            stack = module.__dict__["_snn_guard_stack"] = []
        if mode.suspended:
            stack.append(_SKIP)  # inside a sharded layer or a reviewed module: its own business
            return None
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        stack.append((self._enter(mode, module, args)[0], x, _SCOPE.forgets))
        return None

    def post(self, module: nn.Module, args, output):
        mode = getattr(_ACTIVE, "guard", None)
        stack = module.__dict__.get("_snn_guard_stack")
        if mode is None or mode is _SINGLE or not stack:
            return None
        entry = stack.pop()
        if entry is not _SKIP:
            state, x, forgets = entry
            self._leave(mode, module, state, output)
            if mode.tokens._d or _SCOPE.forgets != forgets:
                _layer_tokens(mode, module, x, output, _SCOPE.forgets != forgets)
        return None


def _layer_tokens(mode: _GuardMode, module: nn.Module, x, output, forgot: bool) -> None:
    """The layout token of a layer's sharded outputs (``guard_tokens``): its input's where the
    layer keeps lengths (``keeps_layout``), a fresh one where it may change them and its input
    had one, or where the layout scope forgot during the call."""
    tok = mode._token(x) if x is not None else None
    if forgot or (tok is not None and not keeps_layout(module)):
        tok = mode._fresh_token(type(module).__name__)
    for t in (output,) if isinstance(output, torch.Tensor) else _flat_tensors(output):
        if type(mode.states.get(t)) is tuple:
            mode._set_token(t, tok)


def _layer_dims(module: nn.Module) -> tuple[int, ...] | None:
    dims = getattr(module, "dims", None)
    if dims is None:
        return None
    return (dims,) if isinstance(dims, int) else tuple(dims)


def _pointwise_on_dims(module: nn.Module) -> bool:
    """A sharded layer that computes the same on a replicated input (no halo, no statistics)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.conv import _ConvNd

    if isinstance(module, _ConvNd):
        return all(k == 1 for k in module.kernel_size) and all(s == 1 for s in module.stride) and (
            module.padding == "valid" or all(p == 0 for p in module.padding)
        )
    return isinstance(module, (_BatchNorm, nn.LayerNorm))


def _running_stats_batch_norm(module: nn.Module) -> bool:
    """A batch norm that normalises with its running statistics (the decision its forward makes)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return (isinstance(module, _BatchNorm) and not module.training and module.running_mean is not None
            and module.running_var is not None)


def _per_sample_layer(module: nn.Module) -> bool:
    """A layer that computes every sample (dim 0) on its own: convolutions, pools, upsampling,
    and norms whose statistics are each sample's (group, layer, instance norm without running
    statistics in training; batch norm with its running statistics is handled before)."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.conv import _ConvNd
    from torch.nn.modules.instancenorm import _InstanceNorm
    from torch.nn.modules.pooling import (
        _AdaptiveAvgPoolNd,
        _AdaptiveMaxPoolNd,
        _AvgPoolNd,
        _LPPoolNd,
        _MaxPoolNd,
    )

    if isinstance(module, _InstanceNorm):
        return not (module.training and module.track_running_stats)
    if isinstance(module, _BatchNorm):
        return False  # batch statistics (running ones: ``_running_stats_batch_norm``)
    return isinstance(module, (_ConvNd, _MaxPoolNd, _AvgPoolNd, _LPPoolNd, _AdaptiveAvgPoolNd, _AdaptiveMaxPoolNd,
                               nn.GroupNorm, nn.LayerNorm, nn.Upsample))  # fmt: skip


_TORCH_FORWARD: dict[type, Callable] = {}


def _torch_forward(cls: type) -> Callable:
    """The ``forward`` of the class a sharded layer class shards: the first class after the
    sharded ones in its MRO that defines one (``nn.Conv2d``; timm's ``StdConv2d``)."""
    fwd = _TORCH_FORWARD.get(cls)
    if fwd is None:
        fwd = next(c.__dict__["forward"] for c in cls.__mro__
                   if not c.__module__.startswith("sharded_nn") and "forward" in c.__dict__)  # fmt: skip
        _TORCH_FORWARD[cls] = fwd
    return fwd


def _with_torch_forward(module: nn.Module, call: Callable, args, kwargs):
    """``call(*args, **kwargs)`` (the layer's ``nn.Module.__call__``, its hooks included) with the
    torch counterpart's ``forward`` in place of the sharded one for this call."""
    module.__dict__["forward"] = types.MethodType(_torch_forward(type(module)), module)
    try:
        return call(*args, **kwargs)
    finally:
        del module.__dict__["forward"]


def _other_spatial_dims(module: nn.Module, state, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    """The spatial dims an input of layout ``state`` is sharded along, where a layer sharding
    other spatial ``dims`` computes the same with its dims set to them (``_with_twin``): a
    convolution (not transposed) or a batch, group or instance norm, whose sharded forms take
    any spatial dims, by the same mesh axes; None otherwise."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.conv import _ConvNd
    from torch.nn.modules.instancenorm import _InstanceNorm

    if not isinstance(module, (_ConvNd, _BatchNorm, _InstanceNorm, nn.GroupNorm)) or getattr(module, "transposed", False):
        return None
    n = len(dims)
    new = tuple(state[:n])
    if any(d is None for d in new) or any(d is not None for d in state[n:]) or len(set(new)) != n:
        return None
    spatial = getattr(module, "_spatial_dims", 0)
    return new if all(2 <= d < 2 + spatial for d in new) else None


def _with_twin(module: nn.Module, dims: tuple[int, ...], call: Callable, args, kwargs):
    """``call(*args, **kwargs)`` (the layer's ``nn.Module.__call__``, its hooks included) with the
    sharded forward of a twin that shards ``dims`` in place of the layer's own for this call.

    The twin is a shallow copy made once per dims (kept on the layer, outside its modules and
    state): it shares the layer's parameter and buffer dicts (the same tensors, so gradients and
    running statistics land on the layer), with its sharding set up afresh for ``dims`` (its own
    plan caches: a plan for other dims is never reused). MobileViT-v2 norms and projects its
    patches, sharded along its token dim 3, with layers converted for dim 2."""
    twins = module.__dict__.setdefault("_snn_twins", {})
    twin = twins.get(dims)
    if twin is None:
        twin = copy.copy(module)
        twin.__dict__.pop("_snn_twins", None)
        before = dict(twin.__dict__)
        options = {o: getattr(module, o) for o in getattr(module, "_sharding_options", ()) if o != "dims" and hasattr(module, o)}
        twin._init_sharding(module.mesh, dims, **options)
        # What the twin's sharding set up is its own; the rest follows the layer on every call.
        twin.__dict__["_snn_twin_own"] = frozenset(k for k, v in twin.__dict__.items() if k not in before or before[k] is not v)
        twins[dims] = twin
    own = twin.__dict__["_snn_twin_own"]
    for k, v in module.__dict__.items():
        # (``training`` after ``model.eval()``, a changed ``momentum`` or ``eps``: the layer's.)
        if k not in own and k != "forward" and not k.startswith("_snn_"):
            twin.__dict__[k] = v
    module.__dict__["forward"] = twin.forward
    try:
        return call(*args, **kwargs)
    finally:
        del module.__dict__["forward"]


def _check_layer_input(mode: _GuardMode, module: nn.Module, state, per_sample: bool = False):
    """Refuse a sharded layer's input whose layout the layer cannot take (on every rank: the
    layout is a fact every rank shares). Returns whether the layer runs its torch counterpart's
    forward instead of its sharded one (``per_sample``: the caller can; else such an input is
    refused): the input is sharded only along dim 0, samples the layer computes each on its own
    (window attention folds its windows into the batch, timm EfficientViT-M's convolutions on
    windows), so each rank's samples are whole; parameter gradients are then this rank's partial
    sums, as everywhere. Or (``per_sample`` callers too) the spatial dims a layer sharding other
    ones runs as a twin sharding them (``_other_spatial_dims``)."""
    dims = _layer_dims(module)
    if dims is None:
        return False
    if state is None:
        if _pointwise_on_dims(module):
            return False
        mode.fail(
            type(module).__name__,
            f"the sharded layer received a replicated (non-slab) tensor, which it would treat as a slab "
            f"along dims {dims}",
            "apply it before the global pool, or leave the layer unconverted with plan={'<name>': None}",
            module=module,
        )
    if state is UNKNOWN:
        mode.fail(type(module).__name__, "the sharded layer received a tensor whose layout the guard lost", "", module=module)
    if type(state) in FOLDED:
        # Windows of several samples folded into one dim: exact where the layer keeps the rows of
        # that dim apart (the batch dim of a per-sample layer; not the channels of a batch norm
        # with running statistics, nor the trailing dims of a channel LayerNorm).
        if _running_stats_batch_norm(module) and state.dim != 1:
            return False
        if per_sample and state.dim == 0 and _per_sample_layer(module):
            return True
        if not dims and isinstance(module, nn.LayerNorm) and state.dim < _ndim_hint(module) - len(module.normalized_shape):
            return False
        mode.fail(type(module).__name__, f"the sharded layer received a tensor sharded along {mode.describe(state)}",
                  "Unfold the windows before the layer, or run with a batch of one per domain group", module=module)
    if _running_stats_batch_norm(module):
        # Eval mode with running statistics: a per-channel affine map (the layer's own
        # pointwise path, no agreement), exact on any layout that keeps the channels (dim 1)
        # whole, e.g. LeViT's BatchNorm1d of tokens flattened into the batch (``x.flatten(0, 1)``).
        if 1 in state:
            mode.fail(type(module).__name__, f"its channels (dim 1) are sharded ({mode.describe(state)})", "",
                      module=module)
        return False
    if per_sample and 0 in state and all(d in (None, 0) for d in state) and _per_sample_layer(module):
        return True
    if not dims and isinstance(module, nn.LayerNorm):
        # Nothing sharded among its normalised dims: plain LayerNorm over trailing (channel) dims.
        k = len(module.normalized_shape)
        if any(d is not None and d >= _ndim_hint(module) - k for d in state):
            mode.fail(type(module).__name__, f"it normalises over trailing dims that include a sharded dim "
                      f"({mode.describe(state)})", "pass dims=... to shard the LayerNorm", module=module)
        return False
    expected = tuple(dims) + (None,) * (len(state) - len(dims))
    if tuple(state) != expected and isinstance(module, nn.LayerNorm):
        # A LayerNorm given grid dims (convert's ``dims=(3,)`` reaches every layer that takes dims)
        # on a tensor sharded elsewhere: channels-last maps after a permute (a 3-D Swin's blocks,
        # ``(B, Z, H, W, C)`` sharded along H = dim 2). Where no sharded dim is among the
        # normalised (trailing) dims it normalises each position on its own, whatever the layout:
        # torch's LayerNorm, the output laid out as the input.
        # (A caller that cannot run torch's forward runs the sharded one, which takes statistics
        # across ranks along any of its dims among the normalised ones: refused then, below.)
        k = len(module.normalized_shape)
        nd = _ndim_hint(module)
        if nd and all(d is None or d < nd - k for d in state) and (per_sample or all(d < nd - k for d in dims)):
            return per_sample
    if tuple(state) != expected:
        other = _other_spatial_dims(module, state, tuple(dims)) if per_sample else None
        if other is not None:
            return other  # (run as a twin sharding the input's dims: ``_with_twin``)
        mode.fail(
            type(module).__name__,
            f"the sharded layer shards dims {dims} but its input is sharded along {mode.describe(state)}",
            "pass dims=... (convert's dims or a plan entry) matching the tensor's layout",
            module=module,
        )
    return False


def _ndim_hint(module: nn.Module) -> int:
    return module.__dict__.get("_snn_guard_ndim", 0)


#: Sharded layers whose output is laid out unlike their input (``_layer_output_state``).
_NEW_LAYOUT_LAYERS = ("ShardedAdaptive", "ShardedUnfold", "ShardedFold")


def _layer_output_state(module: nn.Module, state):
    if state is None or state is UNKNOWN or type(state) in FOLDED:
        return state
    name = type(module).__name__
    if name in ("ShardedUnfold", "ShardedFold"):
        # Blocks of whole image rows (a slab of the blocks' dim 2, rows outermost) and back, on
        # a 1-D mesh; a 2-D mesh's blocks are not one run of that dim: lost (refused where used).
        return state if tuple(d for d in state if d is not None) == (2,) and state[0] == 2 else UNKNOWN
    dims = _layer_dims(module)
    if dims is None:
        return state
    out = getattr(module, "output_size", None)
    if out is not None and type(module).__name__.startswith("ShardedAdaptive"):
        n = getattr(module, "_spatial_dims", 1)
        sizes = (out,) * n if isinstance(out, int) or out is None else tuple(out)
        keep = tuple(d if d is not None and sizes[d - 2] != 1 else None for d in state)
        return None if all(d is None for d in keep) else keep
    return state


def _dim_map(remap):
    """A guard handler for a call that only moves dims (transpose, view, squeeze, ...).

    The handler runs the call, then gives the output the input's sharded dims as ``remap(self, x,
    out, st, base, args, kwargs)`` maps them (``UNKNOWN`` where they cannot be followed); an
    untracked or unknown input passes its state on unchanged.
    """

    def handler(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        call = getattr(remap, "call", None)
        out = func(*args, **kwargs) if call is None or st in (None, UNKNOWN) else call(x, st, args, kwargs)
        self._set(out, st if st in (None, UNKNOWN) else remap(self, x, out, st, base, args, kwargs))
        return out

    handler.__name__ = remap.__name__
    handler.remap = remap  # (``guard_folds`` maps a fold's dim with it)
    return handler


class _States:
    """Tensor -> layout state for one guarded forward, keyed by identity.

    A dict keyed by ``id`` holding a plain weak reference next to each state: a lookup is one
    dict probe and one identity test, about 8x cheaper than ``torch.utils.weak``'s
    ``WeakIdKeyDictionary`` (a Python-level reference object per probe), and the guard makes
    thousands of them per forward of a timm CNN. The weak reference is only compared with the
    tensor in hand, never handed out, so the resurrection fix-up ``WeakIdRef`` does is not
    needed. A dead tensor's entry stays until the forward ends (the mode lives for one forward);
    a new tensor that reuses its ``id`` fails the identity test, so it never inherits the state.
    """

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t, default=None):
        e = self._d.get(id(t))
        return e[1] if e is not None and e[0]() is t else default

    def __contains__(self, t) -> bool:
        e = self._d.get(id(t))
        return e is not None and e[0]() is t

    def __getitem__(self, t):
        e = self._d.get(id(t))
        if e is None or e[0]() is not t:
            raise KeyError("tensor not tracked")
        return e[1]

    def __setitem__(self, t, state) -> None:
        self._d[id(t)] = (weakref.ref(t), state)

    def pop(self, t, default=None):
        e = self._d.get(id(t))
        if e is None or e[0]() is not t:
            return default
        del self._d[id(t)]
        return e[1]


def _interpolated_lengths(in_lengths: Sequence[int], out: int) -> tuple[int, ...]:
    """Every rank's slab length of a sharded interpolation to ``out`` positions from slabs of
    ``in_lengths``: the rule of ``layers/upsample.interpolate`` (each rank holds the outputs from
    the one its input slab's start maps to)."""
    from .layers.upsample import _out_range

    total = sum(in_lengths)
    starts = [sum(in_lengths[:r]) for r in range(len(in_lengths))]
    bounds = [_out_range(a, total, out) for a in starts] + [out]
    return tuple(hi - lo for lo, hi in zip(bounds, bounds[1:]))


def kept_boundaries(source: Sequence[int], total: int) -> tuple[int, ...]:
    """The slab lengths of a tensor of global length ``total`` that keeps the slab boundaries of
    ``source`` (every rank's slab length along the axis): rank r holds ``[a_r, a_{r+1})`` cut to
    ``[0, total)``, the last rank everything from its start on. The rule of the guard's crops and
    ``cat`` along a sharded dim and of the sharded pad (``layers/padding.py``)."""
    starts = [sum(source[:r]) for r in range(len(source))]
    ends = starts[1:] + [max(total, starts[-1])]
    return tuple(min(e, total) - min(a, total) for a, e in zip(starts, ends))


class _GuardMode(
    FftCalls, LossCalls, SampleCalls, DistanceCalls, PickCalls, MergedCalls, FoldCalls, LayoutTokens,
    TorchFunctionMode,
):
    """The mode itself: one per guarded forward."""

    def __init__(self, guard: ForwardGuard) -> None:
        super().__init__()
        self.guard = guard
        self.states = _States()
        self.suspended = 0
        self._popped: list = []
        self.streams = None  # ``RandomStreams`` of this forward, made at its first random draw
        self.regions = 0  # depth of ``activation_checkpoint`` regions (their recompute is guarded)
        # Layout tokens (``guard_tokens``): tensor -> token, and the counter of fresh ones
        # (advanced alike on every rank).
        self.tokens = _States()
        self.fresh_tokens = 0

    # -- suspension inside sharded layers: the mode leaves the stack, so their ops cost nothing.

    def suspend(self) -> None:
        self.suspended += 1
        if torch._C._len_torch_function_stack() and torch._C._get_function_stack_at(
            torch._C._len_torch_function_stack() - 1
        ) is self:
            self._popped.append(torch._C._pop_torch_function_stack())
        else:
            self._popped.append(None)

    def resume(self) -> None:
        self.suspended -= 1
        mode = self._popped.pop() if self._popped else None
        if mode is not None:
            torch._C._push_on_torch_function_stack(mode)

    # -- messages --------------------------------------------------------------------------------

    def describe(self, state) -> str:
        if state is UNKNOWN:
            return "an unknown layout"
        if type(state) in FOLDED:
            return state.describe(self.guard.axes)
        parts = [f"dim {d} (mesh axis {self.guard.axes[k]!r})" for k, d in enumerate(state) if d is not None]
        return ", ".join(parts) or "no dim (replicated)"

    def where(self, module: nn.Module | None = None) -> tuple[str, str]:
        """(qualified module name and class, source location) of the current call."""
        names = self.guard.names
        mod_label, src = "", ""
        frame = sys._getframe(1)
        torch_dir = os.path.dirname(torch.__file__) + os.sep
        here = os.path.dirname(__file__) + os.sep
        while frame is not None:
            fname = frame.f_code.co_filename
            if not src and not fname.startswith(torch_dir) and not fname.startswith(here):
                line = linecache.getline(fname, frame.f_lineno).strip()
                src = f"{fname}:{frame.f_lineno}: `{line}`"
            slf = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if not mod_label and isinstance(slf, nn.Module) and id(slf) in names:
                mod_label = f"'{names[id(slf)]}' ({type(slf).__name__})"
            if mod_label and src:
                break
            frame = frame.f_back
        if module is not None and id(module) in names:
            mod_label = f"'{names[id(module)]}' ({type(module).__name__})"
        return mod_label or "<unknown module>", src or "<unknown source>"

    def fail(self, call: str, why: str, todo: str, *, module: nn.Module | None = None):
        mod, src = self.where(module)
        raise ShardingError(
            f"forward guard: {call} in module {mod} at {src}: {why}. On a slab this would give a silently "
            f"wrong answer, so it is refused. {todo + '. ' if todo else ''}Otherwise compute it with the "
            "sharded functions (sharded_nn.functional, sharded_nn.reductions), or register a sharded class "
            "for the module (sharded_nn.register); see the README, 'Inside forward'."
        )

    # -- dispatch --------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        # This runs for every torch call between sharded layers (tens of microseconds each on a
        # small model, where it adds up): the flat arguments are collected without calls (dims
        # and sizes skipped by type, nested containers through ``_walk``), then the tensors among
        # them are probed in the layout map (``_States.__contains__`` inlined).
        found: list = []
        for a in (*args, *kwargs.values()) if kwargs else args:
            if type(a) in _PLAIN_TYPES:  # dims, sizes, flags: most arguments of a permute or a view
                continue
            if isinstance(a, (torch.Tensor, LocalDerived, LocalFloat)):
                found.append(a)
            elif isinstance(a, (list, tuple, dict)):
                _walk(a, found, 1)
        entries = self.states._d
        stateful: list = []
        tagged = folded = False
        for t in found:
            if isinstance(t, torch.Tensor):
                e = entries.get(id(t))
                if e is not None and e[0]() is t:
                    stateful.append(t)
                    if type(e[1]) in FOLDED:
                        folded = True
            else:
                tagged = True
        if not stateful and not tagged and _classify_cached(func)[0] not in _ALWAYS_HANDLED:
            return func(*args, **kwargs)
        if _called_from_library():
            # sharded_nn's own functions (reductions, functional, gather) called in a model's
            # forward take slabs by contract; their internals must not be rerouted.
            return func(*args, **kwargs)
        kind, base, inplace = _classify_cached(func)
        states = self.states
        forgets = _SCOPE.forgets
        if tagged and kind == "pointwise" and not folded:
            # Every scalar of a pointwise call is a value: a size read from a slab stands for the
            # global one there (``y * x.shape[2]``, ``s / (h * w)``), as on a single device.
            args, kwargs = self._globalise(f"`{base}`", args, kwargs)
        if folded:
            # Windows of several samples folded into one dim (``guard_folds``): calls of their own.
            out = self._fold_call(kind, func, base, args, kwargs, stateful)
        elif kind == "pointwise":
            if len(stateful) > 1 and self.tokens._d:
                # Slabs of different layout tokens are brought to one layout first (``guard_tokens``).
                args, kwargs, found = self._align_tokens(base, args, kwargs, found)
            try:
                out = func(*args, **kwargs)
            except RuntimeError:
                # A slab met a tensor sized for the whole domain (a fixed-size position embedding,
                # a per-pixel bias): this rank takes its rows of it, or the error stands.
                rows = self._whole_domain_rows(base, found)
                if rows is None:
                    raise
                args, kwargs, found = self._with_rows(rows, args, kwargs, found)
                out = func(*args, **kwargs)
            if len(found) == 1 and stateful and isinstance(out, torch.Tensor) and out.dim() == found[0].dim():
                # The commonest call between sharded layers (an activation, a scale, a dtype
                # cast): the slab is the call's only tensor, so an output of its rank keeps its
                # layout (what ``_broadcast`` concludes).
                states[out] = states.get(found[0])
            else:
                try:
                    st = self._broadcast(base, args, kwargs, out, found, rows_of_whole=True)
                except _WholeDomainOperand:
                    # The call broadcast on this rank (its slab holds every row, or one row): the
                    # other ranks came the exception's way; all take the same gather here.
                    rows = self._whole_domain_rows(base, found)
                    changed = any(rows[id(t)].shape != t.shape for t in found if id(t) in rows)
                    args, kwargs, found = self._with_rows(rows, args, kwargs, found)
                    if changed:
                        out = func(*args, **kwargs)
                    st = self._broadcast(base, args, kwargs, out, found)
                self._set(out, st)
        else:
            if kind in _ALIGNED and len(stateful) > 1 and self.tokens._d:
                # A loss or distance between slabs of different layout tokens (``guard_tokens``).
                args, kwargs, found = self._align_tokens(base, args, kwargs, found)
                stateful = [t for t in found if isinstance(t, torch.Tensor) and t in states]
            handler = _HANDLERS.get(kind)
            if handler is None:
                self.fail(f"`{base}`", f"the guard does not know this call, and it receives {self._what(stateful, tagged)}",
                          "")
            out = handler(self, func, base, args, kwargs, stateful)
        if self.tokens._d or _SCOPE.forgets != forgets:
            self._pass_tokens(kind, out, found, _SCOPE.forgets != forgets)
        if inplace and args and isinstance(args[0], torch.Tensor) and not (out is None and kind == "setitem"):
            # (An index assignment returns None: its handler accepted the target's layout, which
            # it keeps; dropping it made ``out[:, :h] = y`` a non-slab for the next layer.)
            st = states.get(out) if isinstance(out, torch.Tensor) else None
            if st is None:
                states.pop(args[0], None)
            else:
                states[args[0]] = st
        return out

    def _whole_domain_rows(self, base: str, found: list) -> dict[int, torch.Tensor] | None:
        """This rank's rows of each tensor among ``found`` that is sized for the whole domain.

        A tensor not made from the input slab (a parameter, a buffer, a constant: the same on
        every rank) that varies along a dim the call's slabs are sharded along holds every global
        position there: a fixed-size position embedding, a per-pixel bias or land-sea mask, static
        fields concatenated as channels. Where its size along that dim is the global size, each
        rank takes its own rows (``narrow`` at its slab's global start): exactly what the single
        device pairs with those positions. The gradient of a parameter used so is this rank's
        part of it, summed over the domain like every other parameter gradient. Any other size
        is refused. Whether a call comes here depends only on what every rank has alike (the
        plain tensor's shape, the layouts), so every rank makes the one small all-gather of the
        local lengths. Returns ``{id(tensor): its rows}`` (unchanged tensors map to themselves),
        or None where no plain tensor varies along a sharded dim.
        """
        tensors = [t for t in found if isinstance(t, torch.Tensor)]
        if not tensors:
            return None
        nd = max(t.dim() for t in tensors)
        layout: list = [None] * len(self.guard.axes)
        length: dict[int, int] = {}
        for t in tensors:
            st = self.states.get(t)
            if st is None:
                continue
            if st is UNKNOWN:
                return None
            for k, d in enumerate(st):
                if d is None:
                    continue
                dd = d + nd - t.dim()
                if layout[k] not in (None, dd):
                    return None
                layout[k] = dd
                length[dd] = t.shape[d]
        sharded = [(k, dd) for k, dd in enumerate(layout) if dd is not None]
        plain = [t for t in tensors if t not in self.states]
        wide = [
            u for u in plain
            if any(0 <= dd - (nd - u.dim()) and u.shape[dd - (nd - u.dim())] > 1 for _, dd in sharded)
        ]
        if not wide:
            return None
        self._routing(f"`{base}`")
        spans = self._spans([(k, length[dd]) for k, dd in sharded], f"rows of a whole-domain operand of `{base}`")
        span = {dd: (s0, total) for (_, dd), (s0, _, total) in zip(sharded, spans)}
        out: dict[int, torch.Tensor] = {id(t): t for t in tensors}
        slab = next((t for t in tensors if type(self.states.get(t)) is tuple), None)
        for u in wide:
            v = u
            state: list = [None] * len(self.guard.axes)
            for k, dd in sharded:
                i = dd - (nd - u.dim())
                if i < 0 or u.shape[i] == 1:
                    continue
                start, total = span[dd]
                if u.shape[i] != total:
                    self.fail(
                        f"`{base}`",
                        f"it combines a slab, sharded along dim {dd} (mesh axis {self.guard.axes[k]!r}, {total} positions "
                        f"in all), with a tensor not made from the input slab (a parameter, a buffer, a constant) that "
                        f"has {u.shape[i]} positions there: neither one position (broadcast) nor the whole domain "
                        "(each rank would take its rows)",
                        "size it for the whole domain or build it from the slab; for a model built for a fixed size, "
                        "give it the size of the whole sample",
                    )
                # A view even where the slab holds every row: the rows are a slab of ``u`` now.
                v = v.narrow(i, start, length[dd])
                state[k] = i
            self.states[v] = tuple(state)
            self._set_token(v, self._token(slab) if slab is not None else None)  # its rows line up with the slab's
            out[id(u)] = v
        return out

    def _with_rows(self, rows: dict, args, kwargs, found: list):
        """``args``, ``kwargs`` and ``found`` with each tensor replaced by its rows (``_whole_domain_rows``)."""

        def sub(obj, depth=0):
            if isinstance(obj, torch.Tensor):
                return rows.get(id(obj), obj)
            if depth < 2 and isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
                return type(obj)(sub(o, depth + 1) for o in obj)
            if depth < 1 and isinstance(obj, dict):
                return {k: sub(o, depth + 1) for k, o in obj.items()}
            return obj

        return sub(args), sub(kwargs), [sub(t) for t in found]

    def _what(self, stateful, tagged) -> str:
        if stateful:
            return f"a tensor sharded along {self.describe(self.states[stateful[0]])}"
        return "a size read from a slab's local shape"

    def _set(self, out, state) -> None:
        for t in _flat_tensors(out) if not isinstance(out, torch.Tensor) else [out]:
            if state is None:
                self.states.pop(t, None)
            else:
                self.states[t] = state

    def _st(self, t):
        return self.states.get(t) if isinstance(t, torch.Tensor) else None

    def _sharded_dims(self, state) -> set[int]:
        return {d for d in state if d is not None} if state not in (None, UNKNOWN) else set()

    def _require_known(self, base: str, stateful) -> None:
        for t in stateful:
            if self.states.get(t) is UNKNOWN:
                self.fail(f"`{base}`", "it receives a tensor whose layout the guard lost (an unmappable reshape)", "")

    # -- handlers ------------------------------------------------------------------------------

    def _h_passive(self, func, base, args, kwargs, stateful):
        return func(*args, **kwargs)

    def _h_shape(self, func, base, args, kwargs, stateful):
        out = func(*args, **kwargs)
        x = args[0]
        state = self._st(x)
        if state is None or state is UNKNOWN:
            return out
        pos = {d: k for k, d in enumerate(state) if d is not None}
        if pos:
            _lint_float_sizes(set(pos), x.dim())
        if isinstance(out, torch.Size):
            return torch.Size([LocalLength(v, pos[i]) if i in pos else v for i, v in enumerate(out)])
        dim = _arg(args, kwargs, 1, "dim")
        if isinstance(out, int) and dim is not None:
            d = dim % x.dim()
            return LocalLength(out, pos[d]) if d in pos else out
        return out

    def _h_len(self, func, base, args, kwargs, stateful):
        out = func(*args, **kwargs)
        state = self._st(args[0])
        if state not in (None, UNKNOWN) and 0 in state:
            return LocalLength(out, state.index(0))
        return out

    def _h_numel(self, func, base, args, kwargs, stateful):
        out = func(*args, **kwargs)
        st = self._st(args[0])
        if st is None:
            return out
        if st is UNKNOWN:
            return LocalDerived(out)  # expression unknown: refused where it is used as a value
        # The product of the sizes with the local lengths tagged: the slab's count, which stands
        # for the global count where it is used as a value (``y / y.numel()``).
        pos = {d: k for k, d in enumerate(st) if d is not None}
        if pos:
            _lint_float_sizes(set(pos), args[0].dim())
        n = 1
        for i, v in enumerate(args[0].shape):
            n = (LocalLength(v, pos[i]) if i in pos else v) * n
        return n

    def _h_data(self, func, base, args, kwargs, stateful):
        self.fail(
            f"`{base}`", f"it reads the values of {self._what(stateful, False)} into Python, where they differ by rank",
            "compute the value from replicated tensors (e.g. after a sharded reduction)",
        )

    def _h_pointwise(self, func, base, args, kwargs, stateful):
        out = func(*args, **kwargs)
        self._set(out, self._broadcast(base, args, kwargs, out))
        return out

    def _broadcast(self, base, args, kwargs, out, found: list | None = None, rows_of_whole: bool = False):
        """The layout of a pointwise call's output; ``found``: the call's arguments as walked already.

        ``rows_of_whole``: the caller can give each rank its rows of a tensor sized for the whole
        domain (``_whole_domain_rows``), so a plain tensor that varies along a sharded dim raises
        ``_WholeDomainOperand`` for it instead of being refused here.
        """
        outs = [out] if isinstance(out, torch.Tensor) else _flat_tensors(out)
        if not outs:
            return None
        nd = outs[0].dim()
        if found is None:
            found = []
            _walk(args, found)
            _walk(kwargs, found)
        tensors = [t for t in found if isinstance(t, torch.Tensor)]
        result = None
        partial = False
        for t in tensors:
            st = self.states.get(t)
            if st is None:
                continue
            if st is UNKNOWN:
                return UNKNOWN
            shifted = tuple(None if d is None else d + nd - t.dim() for d in st)
            if result is None:
                result = shifted
            elif result != shifted:
                # On a 2-D mesh a slab along some axes only (a row grid: sharded by the first
                # axis) broadcasts against a slab along all of them where it has extent 1 along
                # the others' dims (checked below); other disagreements lose the layout.
                if any(a is not None and b is not None and a != b for a, b in zip(result, shifted)):
                    return UNKNOWN
                result = tuple(a if a is not None else b for a, b in zip(result, shifted))
                partial = True
        if result is None:
            return None
        # A tensor that varies along a dim it is not sharded along, where the result is, is not
        # a slab of anything (a plain tensor the same on every rank): refuse.
        for t in tensors:
            st = self.states.get(t)
            if st is not None and not partial:
                continue
            for k, d in enumerate(result):
                if d is None or (st is not None and st[k] is not None):
                    continue
                i = d - (nd - t.dim())
                if 0 <= i < t.dim() and t.shape[i] > 1:
                    if st is None and rows_of_whole:
                        raise _WholeDomainOperand
                    self.fail(
                        f"`{base}`",
                        f"a tensor that is not sharded along dim {d} (shape {tuple(t.shape)}) is combined with a "
                        f"slab along it; it holds the whole dim on every rank, so its positions do not line up "
                        "with the slab's",
                        "build it from the slab (e.g. torch.zeros(x.shape)) or shard it too",
                    )
        return result

    def _h_view_as(self, func, base, args, kwargs, stateful):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        ost = self._st(other)
        if type(ost) is tuple and type(self._st(args[0])) is tuple:
            # ``y.view_as(x)`` of a slab is ``y.view(x.shape)`` with the sizes read from ``x`` (local
            # where ``x`` is sharded), which the guard maps; without them the output dim of the
            # sharded factor is unknown (``probs.view_as(x)`` after a softmax over flattened rows
            # left the model's output unfollowed before session 62).
            pos = {d: k for k, d in enumerate(ost) if d is not None}
            request = [LocalLength(v, pos[i]) if i in pos else v for i, v in enumerate(other.shape)]
            view = torch.Tensor.view if base == "view_as" else torch.Tensor.reshape
            return self._h_reshape(view, base[: -len("_as")], (args[0], *request), {}, stateful)
        return self._h_reshape(func, base, args, kwargs, stateful)

    def _h_copy(self, func, base, args, kwargs, stateful):
        out = func(*args, **kwargs)
        self._set(args[0], self._st(args[1]) if len(args) > 1 else None)
        return out

    @_dim_map
    def _h_transpose(self, x, out, st, base, args, kwargs):
        nd = x.dim()
        if base in ("T", "t"):
            perm = list(range(nd))[::-1]
        elif base == "mT":
            perm = list(range(nd))
            perm[-1], perm[-2] = perm[-2], perm[-1]
        else:
            a, b = _arg(args, kwargs, 1, "dim0"), _arg(args, kwargs, 2, "dim1")
            perm = list(range(nd))
            a, b = a % nd, b % nd
            perm[a], perm[b] = perm[b], perm[a]
        return tuple(None if d is None else perm.index(d) for d in st)

    @_dim_map
    def _h_permute(self, x, out, st, base, args, kwargs):
        perm = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else _arg(args, kwargs, 1, "dims")
        perm = [p % x.dim() for p in perm]
        return tuple(None if d is None else perm.index(d) for d in st)

    @_dim_map
    def _h_movedim(self, x, out, st, base, args, kwargs):
        src = _arg(args, kwargs, 1, "source")
        dst = _arg(args, kwargs, 2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        nd = x.dim()
        src, dst = [s % nd for s in src], [d % nd for d in dst]
        order = [None] * nd
        for s, d in zip(src, dst):
            order[d] = s
        rest = iter(i for i in range(nd) if i not in src)
        order = [o if o is not None else next(rest) for o in order]
        return tuple(None if d is None else order.index(d) for d in st)

    @_dim_map
    def _h_unsqueeze(self, x, out, st, base, args, kwargs):
        d0 = _arg(args, kwargs, 1, "dim") % out.dim()
        return tuple(None if d is None else d + (d >= d0) for d in st)

    @_dim_map
    def _h_complex_view(self, x, out, st, base, args, kwargs):
        # ``view_as_real`` adds the (re, im) pair as a last dim, ``view_as_complex`` takes it
        # away: the other dims keep their places. (Broadcasting rules would align them from the
        # right, one dim off.)
        if base == "view_as_complex" and x.dim() - 1 in st:
            self.fail("`view_as_complex`", f"its last dim (the (re, im) pair) is sharded dim {x.dim() - 1}", "")
        return st

    @_dim_map
    def _h_squeeze(self, x, out, st, base, args, kwargs):
        removed = _squeezed(x, st, args, kwargs)
        return tuple(None if d is None else d - sum(r < d for r in removed) for d in st)

    _h_squeeze.remap.call = lambda x, st, args, kwargs: x.squeeze(_squeezed(x, st, args, kwargs))

    def _h_reshape(self, func, base, args, kwargs, stateful):
        out = self._reshape(func, base, args, kwargs, stateful)
        self._scope_resized(args[0], out)
        return out

    def _scope_resized(self, x, out, ratios=None) -> None:
        """Tell the layout scope about a call that may scale a sharded dim's slab lengths (a view
        that splits it into blocks or merges unsharded dims into it, a pixel shuffle): it derives
        the output's layout from the input's, or forgets (``comm.sizes.scope_scaled``). A layer
        could otherwise find the new layout's local sizes among the remembered ones on some ranks
        only. ``ratios``: per mesh axis, the call's scale, or one for all (default: read from the
        lengths; the guard's maps give every rank the same one, and an empty slab leaves the
        layout unknown). Windows folded into the batch (``guard_folds``) and axes merged into one
        dim are not layers' inputs: the scope learns nothing there, and forgets where a view
        makes a slab of them again."""
        from .comm.sizes import scope_active, scope_forget, scope_scaled

        st = self._st(x)
        if type(st) is not tuple or not scope_active() or all(d is None for d in st):
            return
        ost = self._st(out) if isinstance(out, torch.Tensor) else None
        if type(ost) in FOLDED or ost is UNKNOWN:
            # (A tensor whose layout the guard lost is refused where a sharded layer or a routed
            # call takes it: no lookup meets it.)
            return
        if type(ost) is not tuple or len(ost) != len(st) or any((d is None) != (o is None) for d, o in zip(st, ost)):
            scope_forget()  # an axis dropped: not a slab of a derivable layout
            return
        pairs = [(d, o) for d, o in zip(st, ost) if d is not None]
        if ratios is None and len(pairs) == 1:
            # The unsharded sizes' ratio: the same on every rank, also where a slab is empty.
            (d, o), = pairs
            a = math.prod(v for i, v in enumerate(x.shape) if i != d)
            b = math.prod(v for i, v in enumerate(out.shape) if i != o)
            ratios = [Fraction(a, b) if a and b else None]  # (None: an empty batch, no ratio)
        elif ratios is None:
            ratios = [Fraction(out.shape[o], x.shape[d]) if x.shape[d] else None for d, o in pairs]
        elif not isinstance(ratios, (list, tuple)):
            ratios = [ratios] * len(pairs)
        if all(r == 1 for r in ratios):
            return
        if None in ratios or any(d is None for d in st[: len(pairs)]):
            # (An empty slab on a 2-D mesh, an empty batch; a tensor sharded by the second mesh
            # axis only, which the scope does not describe.)
            scope_forget()
            return
        scope_scaled(self.guard.mesh, st[: len(pairs)], tuple(x.shape), ost[: len(pairs)], out.dim(), ratios)

    def _reshape(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        if base in ("view", "reshape") and type(st) is tuple and x.numel() == 0:
            resolved = _empty_slab_minus_one(tuple(x.shape), st, _reshape_request(args, kwargs))
            if resolved is not None:
                # torch refuses a -1 for a tensor of no elements (on this rank alone): the call
                # gets the resolved sizes, while the guard decides and maps by the request as
                # every other rank does.
                func = functools.wraps(func)(functools.partial(_call_resolved, func, resolved))
        if base in ("view", "reshape") and st not in (None, UNKNOWN):
            request = _reshape_request(args, kwargs)
            if (request is not None and not any(_is_tagged(v) for v in request)
                    and any(d is not None for d in st)
                    and (-1 not in request or not _minus_one_takes_sharded(x, st, request))
                    and not _called_from_local_shape_library()):
                return self._reshape_global(func, x, st, request, args, kwargs)
            # (Not from einops: its recipes cache sizes by the slab's shape, so that a rank whose
            # cache answers passes plain numbers where another passes tagged ones; the agreement
            # would then pair up with nothing.)
            if (request is not None and any(d is not None for d in st)
                    and any(_is_tagged(v) and v._lossy for v in request)
                    and not _called_from_local_shape_library()):
                return self._reshape_rounded(func, base, args, kwargs, stateful, st, request)
        try:
            return self._h_reshape_moved(func, base, args, kwargs, stateful)
        except RuntimeError as e:
            if st in (None, UNKNOWN) or "invalid for input of size" not in str(e):
                raise
            # torch's message names sizes but not why they do not fit: constants of the whole
            # sample's shape next to a -1 (``x.view(-1, 256, c)``), which a slab cannot meet.
            # (The message names no local size, so that every rank raises the same one; torch's
            # own, with this rank's sizes, stays attached as the context.)
            self.fail(f"`{base}`", f"the requested shape does not fit the slabs of a tensor sharded along "
                      f"{self.describe(st)}; a constant in it is probably a size of the whole sample",
                      "take the sizes along the sharded dims from the tensor's shape (x.shape[d]), which the guard "
                      "maps, or give every size as a constant (read as the whole sample's shape)")

    def _reshape_rounded(self, func, base, args, kwargs, stateful, st, request):
        """A view by sizes computed from slab lengths through ``//``, ``%`` or rounding: window
        partitions (``x.view(b, h // ws, ws, w // ws, ws, c)``, timm DaViT, TinyViT, Twins,
        EfficientViT-M). It fits a slab only where the slab is a whole number of windows, which
        differs by rank: the ranks whose slab does not fit would refuse alone while the others
        went on to their next collective (a hang). Every rank says whether its view fits (one
        small all-gather) and, where one does not, all refuse alike."""
        out, misfits = self._fits_everywhere(lambda: self._h_reshape_moved(func, base, args, kwargs, stateful), base)
        if misfits:
            self.fail(f"`{base}`", f"the requested shape, computed from slab lengths by floor division or rounding "
                      f"(a window partition), does not fit the slabs of domain ranks {misfits} of a tensor sharded "
                      f"along {self.describe(st)}: their slabs are not whole numbers of the view's blocks",
                      "shard the input with an alignment that makes every slab but the last a whole number of "
                      "windows (snn.shard(x, mesh, align=...): the window size times the model's downsampling "
                      "at that stage, e.g. 7 x 32 = 224 rows for windows of 7 tokens at 1/32)")
        return out

    def _fits_everywhere(self, view: Callable, base: str, request=None, resolve: Callable | None = None):
        """``(view(), the domain ranks where it did not fit)``: a view by sizes computed from slab
        lengths through ``//``, ``%`` or rounding fits some slabs only; every rank says whether
        its own fits (one small all-gather of two numbers), so that all refuse together where one
        does not (``_reshape_rounded`` on slabs, ``FoldCalls._f_reshape`` on folds).

        An empty rank (a deep stage with fewer rows than ranks) whose sizes hold a zero beside the
        request's -1 cannot infer it (torch raises: any value fits no elements): with ``resolve``
        (the view by explicit sizes) it takes the -1 the ranks with data resolved, where they all
        resolved the same one (the -1 holds no slab length then: the zero holds it); else every
        rank refuses alike. Before session 67 it raised on that rank alone (a hang)."""
        m = None
        if request is not None and resolve is not None and list(request).count(-1) == 1:
            m = list(request).index(-1)
        try:
            out, fits = view(), 1
        except RuntimeError as e:
            if m is not None and "ambiguous" in str(e):
                out, fits = None, 2
            elif "invalid for input of size" not in str(e):
                raise
            else:
                out, fits = None, 0
        value = int(out.shape[m]) if (fits == 1 and m is not None and len(out.shape) > m) else -1
        rows = self._gather_with_coords([fits, value], f"forward guard: `{base}` by sizes computed from slab lengths")
        misfits = [i for i, r in enumerate(rows) if r[-2] == 0]
        if any(r[-2] == 2 for r in rows):
            # (Decided from the gathered rows: alike on every rank.)
            values = {r[-1] for r in rows if r[-2] == 1}
            if len(values) != 1:
                misfits = sorted(set(misfits) | {i for i, r in enumerate(rows) if r[-2] == 2})
            elif fits == 2 and not misfits:
                out = resolve([values.pop() if i == m else int(v) for i, v in enumerate(request)])
        return out, misfits

    def _reshape_global(self, func, x, st, request, args, kwargs):
        """``x.view(sizes)`` with every size a constant, on a slab: the sizes are the single
        device's, i.e. the whole domain's (UNETR's ``proj_feat`` folds its tokens back into the
        fixed feature grid). The global input shape (one small all-gather of the local lengths)
        is regrouped to the request; the sharded dim's group must keep it outermost, and this
        rank's slab becomes a whole number of the group's inner blocks: the request with the
        outer factor scaled to the slab."""
        call = f"`{getattr(func, '__name__', 'view')}`"
        self._routing(call)
        sharded = [(k, d) for k, d in enumerate(st) if d is not None]
        glob = list(x.shape)
        local = list(request)
        out_state: list = [None] * len(st)
        # Every rank's lengths (not only this rank's span): the checks below then decide alike.
        gathered = self._lengths([(k, int(x.shape[d])) for k, d in sharded], f"forward guard: {call} to constant sizes")
        lengths = {d: lens for (_, d), lens in zip(sharded, gathered)}
        for d, lens in lengths.items():
            glob[d] = sum(lens)
        if -1 in request:
            # The single device's -1: what the whole sample leaves for it (decided on global sizes,
            # so alike on every rank).
            rest = math.prod(v for v in request if v != -1)
            if request.count(-1) > 1 or rest == 0 or math.prod(glob) % rest:
                self.fail(call, f"the requested shape {tuple(request)} does not fit the whole sample's shape "
                          f"{tuple(glob)} (a tensor sharded along {self.describe(st)})", "")
            request = [math.prod(glob) // rest if v == -1 else v for v in request]
            local = list(request)
        if math.prod(glob) != math.prod(request):
            # Decided on the gathered global shape, so alike on every rank: torch's own error
            # would come only from the ranks whose slab does not happen to fit the request (a
            # hang, and a silently wrong view on the others; timm NesT's ``deblockify``).
            self.fail(call, f"the requested shape {tuple(request)} does not fit the whole sample's shape {tuple(glob)} "
                      f"(a tensor sharded along {self.describe(st)}); constant sizes are read as the whole sample's, "
                      "and a size computed from a slab's own size through int(), float() or math (math.sqrt) is a "
                      "constant of this slab", "compute such sizes with arithmetic on x.shape (the guard maps it to "
                      "the whole sample's sizes), or from the model's configuration")
        groups = _groups(tuple(glob), tuple(request))
        for k, d in sharded:
            gi, go = next((gi, go) for gi, go in groups if d in gi)
            if any(glob[i] != 1 for i in gi if i < d):
                self.fail(call, f"it folds sharded dim {d} into a constant shape {tuple(request)} where it is not the "
                          "outermost of its merged dims", "")
            outs = [o for o in go if request[o] != 1] or go[:1]
            o = outs[0]
            inner = math.prod(request[i] for i in go if i > o)
            merged = math.prod(glob[i] for i in gi if i > d)
            if any((n * merged) % inner for n in lengths[d]):
                self.fail(call, f"it folds sharded dim {d} into the constant shape {tuple(request)}: slabs of "
                          f"{lengths[d]} of {glob[d]} positions are not whole numbers of the {inner}-position blocks "
                          f"of output dim {o}", "shard the input with an alignment that makes slabs whole blocks")
            local[o] = x.shape[d] * merged // inner
            out_state[k] = o
        out = x.reshape(local) if getattr(func, "__name__", "") == "reshape" else x.view(local)
        self._set(out, tuple(out_state))
        return out

    @_dim_map
    def _h_reshape_moved(self, x, out, st, base, args, kwargs):
        request = None
        if base in ("view", "reshape"):
            request = args[1:] if len(args) > 2 or (len(args) == 2 and not isinstance(args[1], (list, tuple, torch.Size))) else _arg(args, kwargs, 1, "shape")
            if isinstance(request, torch.dtype):
                return UNKNOWN
        elif base in ("unflatten",):
            dim = _arg(args, kwargs, 1, "dim") % x.dim()
            sizes = list(_arg(args, kwargs, 2, "sizes"))
            # x.shape here holds plain ints for dims outside the split: they are untouched.
            request = [*[0] * dim, *sizes, *[0] * (x.dim() - dim - 1)]
        mapped = _map_reshape(tuple(x.shape), tuple(out.shape), st, request)
        if mapped is UNKNOWN and base in ("view", "reshape", "flatten", "unflatten"):
            # The sharded dim merged behind unsharded ones (windows of a batch over one sample
            # folded into one dim): followed as a ``Fold`` where the request names the dim.
            if base not in ("view", "reshape"):
                request = _flatten_request(base, args, kwargs, tuple(x.shape))
            mapped = fold_of_reshape(tuple(x.shape), tuple(out.shape), st, list(request))
            if mapped is UNKNOWN:
                # Slabs of several mesh axes merged into one dim (tokens of a 2-D domain mesh):
                # followed as ``Merged`` where the request names the dim.
                mapped = merged_of_reshape(tuple(x.shape), tuple(out.shape), st, list(request))
        return mapped

    def _h_expand(self, func, base, args, kwargs, stateful):
        x = args[0]
        out = func(*args, **kwargs)
        st = self._st(x)
        if st is UNKNOWN:
            self._set(out, UNKNOWN)
            return out
        nd = out.dim()
        if st is not None:
            self._set(out, tuple(None if d is None else d + nd - x.dim() for d in st))
            return out
        # A plain tensor expanded to a local size of a sharded dim is a slab of a uniform tensor.
        sizes = [a for a in args[1:] if not isinstance(a, torch.Tensor)]
        if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
            sizes = list(sizes[0])
        if base == "expand_as":
            st2 = self._st(args[1])
            self._set(out, st2)
            return out
        self._set(out, self._sized_state(sizes, f"`{base}`"))
        return out

    def _sized_state(self, sizes, call: str):
        """The layout of a tensor created with ``sizes``: slab where a size is a local length."""
        state = [None] * len(self.guard.axes)
        any_tag = False
        for i, v in enumerate(sizes):
            if isinstance(v, FoldLength) or (_is_tagged(v) and any(isinstance(f, FoldLength) for f in v._leaves or ())):
                self.fail(call, f"size {i} is read from a dim that folds windows of several samples or merges "
                          "the slabs of several mesh axes, whose rows are not one block of the single device's",
                          "build the tensor from the folded one (torch.zeros_like), or after unfolding the windows "
                          "or reshaping the tokens back into the grid")
            if isinstance(v, LocalLength):
                state[v.axis] = i
                any_tag = True
            elif _is_tagged(v):
                self.fail(call, f"size {i} ({v}) is computed from a slab's local size, so the tensor's extent "
                          "along the sharded dim means something different on each rank",
                          "use the slab's size itself (x.shape[d]) or build the tensor from the slab")
        return tuple(state) if any_tag else None

    def _h_repeat(self, func, base, args, kwargs, stateful):
        x = args[0]
        out = func(*args, **kwargs)
        st = self._st(x)
        reps = list(args[1:]) if len(args) > 2 or isinstance(args[1], int) else list(args[1])
        nd = out.dim()
        if st is UNKNOWN:
            self._set(out, UNKNOWN)
        else:
            # A tensor tiled to a slab's local length along a dim where it has one position is a
            # slab of a tensor uniform along it, as for ``expand`` (XCiT's position grid
            # ``arange(1, W + 1).repeat(1, H, 1)``; on a 2-D mesh the columns' slab tiled by the
            # rows' local length is sharded along both).
            shape = (1,) * (nd - x.dim()) + tuple(x.shape)
            for i, r in enumerate(reps):
                if _is_tagged(r) and shape[i] != 1:
                    self.fail("`repeat`", f"it tiles a tensor of {shape[i]} positions along dim {i} by a number "
                              "computed from a slab's local size", "expand a tensor of one position there instead")
            tiled = self._sized_state(reps, "`repeat`")
            if st is None:
                self._set(out, tiled)
                return out
            shifted = tuple(None if d is None else d + nd - x.dim() for d in st)
            if any(d is not None and reps[d] != 1 for d in shifted):
                self.fail("`repeat`", "it tiles a slab along its sharded dim", "")
            if tiled is not None:
                if any(a is not None and b is not None for a, b in zip(shifted, tiled)):
                    self.fail("`repeat`", f"it tiles a tensor sharded along {self.describe(st)} by the local length "
                              "of the same mesh axis", "")
                shifted = tuple(a if a is not None else b for a, b in zip(shifted, tiled))
            self._set(out, shifted)
        return out

    def _h_repeat_interleave(self, func, base, args, kwargs, stateful):
        """``repeat_interleave(x, k, dim)``: each row repeated ``k`` times in place. Along a
        sharded dim with one count for every row, the global result's rows of a slab are the
        slab's rows repeated (as nearest upsampling by ``k``): local, exact; the slab grows by
        ``k``. Per-row counts, the flattening form (no ``dim``) and ``output_size`` there are
        refused."""
        x = args[0]
        st = self._st(x) if isinstance(x, torch.Tensor) else None
        repeats, dim = _arg(args, kwargs, 1, "repeats"), _arg(args, kwargs, 2, "dim")
        self._require_known(base, stateful)
        if st is None:
            if isinstance(repeats, torch.Tensor) and repeats in self.states:
                self.fail("`repeat_interleave`", "its repeat counts are a slab (they differ by rank)", "")
            return func(*args, **kwargs)
        if dim is None:
            self.fail("`repeat_interleave`", "without `dim` it flattens a slab", "pass the dim to repeat along")
        dim %= x.dim()
        if dim in st:
            one = isinstance(repeats, int) and not _is_tagged(repeats)
            one = one or (isinstance(repeats, torch.Tensor) and repeats.numel() == 1 and repeats not in self.states)
            if not one or kwargs.get("output_size") is not None:
                self.fail(
                    "`repeat_interleave`",
                    f"along sharded dim {dim} it takes one constant count for every row (no per-row counts, "
                    "no output_size)",
                    "",
                )
        out = func(*args, **kwargs)
        self._set(out, st)
        if dim in st:
            # The slabs grow by the count (alike on every rank): the layout scope derives.
            self._scope_resized(x, out, [Fraction(int(repeats)) if d == dim else Fraction(1) for d in st if d is not None])
        return out

    def _h_narrow(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        dim = _arg(args, kwargs, 1, "dim") % x.dim()
        start, length = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "length")
        self._require_known(base, stateful)
        if st is not None and dim in st:
            # Constant positions are the whole domain's, as for slices (``_crop_global``); so are
            # lengths read from slabs (``x.narrow(1, 0, h)``, ``h`` read before a pad), which
            # keep a whole slab on some ranks only: decided on the global bounds, alike on every rank.
            if isinstance(start, torch.Tensor) or isinstance(length, torch.Tensor):
                self.fail("`narrow`", f"its start or length along sharded dim {dim} is a tensor", "")
            crop = [(0, dim, slice(start, start + length))]
            (bound,) = self._global_bounds(x, st, crop)
            a, b = bound[:2]
            if b - a == 1:  # one position of the whole domain: as ``x[:, a:a + 1]`` (``_h_getitem``)
                y = self._select_global(x, st, dim, a, span=bound[2:5])
                st_y = self.states.get(y)
                out = y.unsqueeze(dim)
                if st_y is not None:
                    self._set(out, tuple(None if e is None else e + (e >= dim) for e in st_y))
                return out
            (sl,) = self._crop_global(x, st, crop, [None], [bound])
            out = x.narrow(dim, sl.start, sl.stop - sl.start)
            self._set(out, st)
            return self._keep_crop_boundaries(out, st, crop, [bound], [dim], self._token(x))
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_select(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        dim = _arg(args, kwargs, 1, "dim") % x.dim()
        self._require_known(base, stateful)
        if st is not None and dim in st:
            return self._select_global(x, st, dim, int(_arg(args, kwargs, 2, "index")))
        out = func(*args, **kwargs)
        self._set(out, None if st is None else tuple(None if d is None else d - (d > dim) for d in st))
        return out

    def _plain_by_slab(self, x, idx):
        """The layout of ``x[idx]`` for a plain (whole, replicated) ``x`` indexed by a slab of
        integers: ``None`` if ``idx`` holds no slab. A table looked up at positions computed on
        the slab (MViT-v2's ``rel_pos_h[dist_h.long()]``): each rank's index holds the single
        device's values at its own positions, and the table is whole everywhere, so the result
        is the slab of the single device's, sharded where the index is. One integer tensor among
        full slices (or ``...``) only; a mask or several index tensors are refused."""
        items = idx if isinstance(idx, tuple) else (idx,)
        tracked = [i for i in items if isinstance(i, torch.Tensor) and i in self.states]
        if not tracked:
            return None
        tensor_items = [p for p, i in enumerate(items) if isinstance(i, (torch.Tensor, list))]
        index = tracked[0]
        st = self.states[index]
        others = [i for p, i in enumerate(items) if p not in tensor_items]
        plain_slices = all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in others)
        integers = not (index.dtype in (torch.bool, torch.uint8) or index.is_floating_point() or index.is_complex())
        if len(tensor_items) != 1 or not plain_slices or type(st) is not tuple or not integers:
            self.fail(
                "indexing", "it indexes a tensor with a slab (index values differ by rank)",
                "Index a whole tensor with one integer slab among full slices (`table[idx]`, `table[:, idx]`)",
            )  # fmt: skip
        (p,) = tensor_items
        if any(i is Ellipsis for i in items[:p]):  # the index dims go where the ellipsis ends
            p = x.dim() - 1 - (len(items) - 1 - p)
        return tuple(None if e is None else e + p for e in st)

    def _h_getitem(self, func, base, args, kwargs, stateful):
        x, idx = args[0], args[1]
        st = self._st(x)
        if st is None:
            index_st = self._plain_by_slab(x, idx)
            out = func(*args, **kwargs)
            if index_st is not None:
                self._set(out, index_st)
            return out
        self._require_known("indexing", [x])
        items = idx if isinstance(idx, tuple) else (idx,)
        picked = self._pick_along_unsharded(x, st, items)
        if picked is not None:
            out = func(*args, **kwargs)
            self._set(out, st)
            self._set_token(out, self._token(x))
            return out
        if any(isinstance(i, (torch.Tensor, list)) or i is True or i is False for i in items):
            out = self._pick_global(x, st, items)  # positions by plain index tensors (``guard_pick``)
            if out is not None:
                return out
            self.fail("indexing with a tensor/list", "the guard cannot map this advanced indexing of a slab",
                      "index sharded dims by plain integer tensors or lists (each other item a whole slice or `...`), "
                      "or mask with torch.where and reduce")
        n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
        expanded: list = []
        for i in items:
            if i is Ellipsis:
                expanded += [slice(None)] * (x.dim() - n_real)
            else:
                expanded.append(i)
        src = 0
        out_dim = 0
        mapping: dict[int, int | None] = {}
        phases: list[tuple[int, int, int]] = []  # (sharded dim, step, start) of ``start::step`` slices
        crops: list[tuple[int, int, slice]] = []  # (position in ``expanded``, sharded dim, slice)
        for p, i in enumerate(expanded):
            if i is None:
                out_dim += 1
                continue
            if isinstance(i, int):
                mapping[src] = None
                if src in st:
                    # One position of the whole domain (a class token ``x[:, 0]``): its owner's
                    # row, replicated; then the rest of the index on the result.
                    y = self._select_global(x, st, src, i)
                    rest = tuple(expanded[:p] + expanded[p + 1 :])
                    return self._h_getitem(func, base, (y, rest), kwargs, [y])
            else:
                mapping[src] = out_dim
                if src in st and not _full_slice(i):
                    if _phase_slice(i):
                        phases.append((src, i.step, i.start or 0))
                    elif i.step in (None, 1):
                        crops.append((p, src, i))
                    else:
                        self.fail(
                            "slicing",
                            f"slice {i.start}:{i.stop}:{i.step} along sharded dim {src}: a step other than 1 is "
                            "mapped only as a `start::step` phase (0 <= start < step) of slabs that start on "
                            "multiples of step",
                            "slice along the other dims, or crop before sharding / after gathering",
                        )
                out_dim += 1
            src += 1
        token = self._check_phases(x, st, phases) if phases else self._token(x)
        if crops:
            bounds = self._global_bounds(x, st, crops)
            for (p, d, _sl), (a, b, *span, _lens) in zip(crops, bounds):
                if b - a == 1:
                    # One position of the whole domain kept as a dim of extent 1 (``x[:, :1]``, a
                    # class token; ``x[:, :, -1:]``, the last row): taken as ``x[:, a]`` is (its
                    # owner's row, replicated) with the dim put back, so that it broadcasts against
                    # slabs and joins them in ``cat`` as on one device. Kept a slab, it would be one
                    # row on its owner and none elsewhere: ``x - x[:, :1]`` failed there. (On a 2-D
                    # mesh it stays sharded along the other dim; ``cat`` takes it as a plain part.)
                    y = self._select_global(x, st, d, a, span=span)
                    rest = (*expanded[:p], None, *expanded[p + 1 :])
                    return self._h_getitem(func, base, (y, rest), kwargs, [y])
            expanded = self._crop_global(x, st, crops, expanded, bounds)
            args = (x, tuple(expanded), *args[2:])
        for s in range(src, x.dim()):
            mapping[s] = out_dim
            out_dim += 1
        out = func(*args, **kwargs)
        self._set(out, tuple(None if d is None else mapping[d] for d in st))
        self._set_token(out, token)  # (the sharded dims' lengths kept, or the phases' named)
        if crops:
            out = self._keep_crop_boundaries(out, st, crops, bounds, [mapping[d] for _, d, _ in crops], token)
        return out

    def _pick_along_unsharded(self, x, st, items) -> bool | None:
        """True where ``items`` pick positions along one unsharded dim by a list or a plain 1-D
        tensor, every other item a whole slice (``grid[..., [1, 0]]``: VoxelMorph reorders its
        coordinates so): local, the dims where they are (refused as advanced indexing before
        session 62). None otherwise."""
        adv = [p for p, i in enumerate(items) if isinstance(i, (torch.Tensor, list))]
        if len(adv) != 1 or type(st) is not tuple or sum(1 for i in items if i is Ellipsis) > 1:
            return None
        pick = items[adv[0]]
        if isinstance(pick, torch.Tensor):
            if pick.dim() != 1 or self.states.get(pick) is not None or pick.is_floating_point():
                return None
        elif not all(_plain_int(v) and type(v) is int for v in pick):
            return None
        if not all(i is Ellipsis or (isinstance(i, slice) and _full_slice(i)) for p, i in enumerate(items) if p != adv[0]):
            return None
        # (An Ellipsis in front: the dim counts from the end.)
        dim = x.dim() - len(items) + adv[0] if any(i is Ellipsis for i in items[: adv[0]]) else adv[0]
        return True if 0 <= dim < x.dim() and dim not in st else None

    def _axis_span(self, x, st, dims: list[int], what: str) -> list[tuple[int, int, int]]:
        """Per sharded dim of ``dims``: (this slab's global start, its length, the global length)."""
        return self._spans([(st.index(d), int(x.shape[d])) for d in dims], what)

    def _spans(self, local: list[tuple[int, int]], what: str) -> list[tuple[int, int, int]]:
        """Per (mesh axis, this rank's local length) of ``local``: (global start, length, global
        length) along that axis, from one small all-gather of the lengths (alike on every rank)."""
        out = []
        for (k, n), lengths in zip(local, self._lengths(local, f"forward guard: {what}")):
            mine = axis_index(self.guard.mesh, self.guard.axes[k])
            out.append((sum(lengths[:mine]), n, sum(lengths)))
        return out

    def _lengths(self, local: list[tuple[int, int]], what: str) -> list[list[int]]:
        """Per (mesh axis, this rank's local length) of ``local``: the local lengths of the ranks
        along that axis that share this rank's other coordinates, in axis order (one all-gather
        for all of them)."""
        rows = self._gather_with_coords([n for _, n in local], what)
        return [[r[j] for r in self._along_axis(rows, k)] for j, (k, _) in enumerate(local)]

    def _relayout(self, out: torch.Tensor, dim: int, k: int, lens, source, token) -> torch.Tensor:
        """``out``, whose slabs along sharded dim ``dim`` (mesh axis ``k``) have every rank's
        lengths ``lens``, moved to the layout that keeps the slab boundaries of ``source`` (every
        rank's lengths of the slab it was cut or assembled from): ``kept_boundaries``. Crops,
        ``cat`` along a sharded dim and the sharded pad all follow that rule, as windows without
        padding do (their outputs sit where their windows start), so two tensors of one global
        length derived from one slab line up in pointwise calls as on one device:
        ``x[:, :, 1:] - x[:, :, :-1]``, ``F.pad(x, ...)[..., 2:-2, 1:-1] + x``,
        ``torch.cat([x[:, :, :1], x[:, :, :-1]], 2) + x``. (Each kept its own rows before, which
        put the first rank's share of the cut on it: the pointwise call failed on the ranks whose
        lengths differed while the others went on, a hang.) The rows that change owner move
        between neighbours (``move_rows``); no communication where nothing moves. ``token``: the
        layout token of the tensor whose lengths ``source`` are; the result's token names it and
        the global length (``guard_tokens``: another tensor of that length need not line up)."""
        from .comm import axis_peers
        from .comm.rebalance import move_rows

        target = kept_boundaries(source, sum(lens))
        if tuple(lens) != target:
            st = self.states.get(out)
            out = move_rows(out, dim, tuple(lens), target, axis_peers(self.guard.mesh, self.guard.axes[k]))
            self._set(out, st)
        # (A crop of the whole range keeps the token: nothing was cut, nothing moved.)
        self._set_token(out, token if tuple(lens) == tuple(source) else self._kept_token(token, k, target))
        return out

    def _crop_global(self, x, st, crops, expanded: list, bounds=None) -> list:
        """``x[..., a:b, ...]`` along sharded dims by **global** positions, as on one device:
        each slab keeps its part of ``[a, b)`` (``x[:, 1:]`` drops a class token, held by the
        first rank; ``x[:, :-1]`` the last row, held by the last). Bounds computed from slab
        sizes are evaluated on the global sizes. The slabs' lengths change: the layout scope
        forgets what it remembered (alike on every rank)."""
        from .comm.sizes import scope_forget

        scope_forget()
        out = list(expanded)
        for (p, _d, _sl), (a, b, s0, n, *_rest) in zip(crops, bounds or self._global_bounds(x, st, crops)):
            out[p] = slice(*slab_overlap(a, b, s0, n))
        return out

    def _keep_crop_boundaries(self, out, st, crops, bounds, out_dims, token) -> torch.Tensor:
        """``out``, cropped by ``_crop_global`` (each slab kept its part of the global range), moved
        to the layout that keeps the source's slab boundaries (``_relayout``), one cropped dim after
        another; ``out_dims[i]``: the output dim of crop i's sharded dim; ``token``: the source's
        layout token."""
        for (_p, d, _sl), (a, b, _s0, _n, _total, lens), od in zip(crops, bounds, out_dims):
            out = self._relayout(out, od, st.index(d), overlap_lengths(a, b, lens), lens, token)
            token = self._token(out)
        return out

    def _global_bounds(self, x, st, crops) -> list[tuple]:
        """Per ``(position, sharded dim, slice)`` of ``crops``: (global start, global stop, this
        slab's global start, its length, the global length, every rank's length along the axis),
        the slice's bounds evaluated on the global length (and bounds computed from slab sizes on
        the global sizes), alike on every rank."""
        self._routing("slicing")
        local = [(st.index(d), int(x.shape[d])) for _, d, _ in crops]
        out = []
        every = self._lengths(local, "forward guard: slicing by global positions")
        for (_p, _d, sl), (k, n), lens in zip(crops, local, every):
            total = sum(lens)
            s0 = sum(lens[: axis_index(self.guard.mesh, self.guard.axes[k])])
            tagged = [v for v in (sl.start, sl.stop) if _is_tagged(v)]
            glob = self._global_values(tagged, "slicing") if tagged else {}
            start, stop = (glob.get(id(v), v) if _is_tagged(v) else v for v in (sl.start, sl.stop))
            a, b, _ = slice(start, stop).indices(total)
            out.append((a, b, s0, n, total, tuple(lens)))
        return out

    def _select_global(self, x, st, d: int, i: int, span=None):
        """``x.select(d, i)`` by global position ``i`` along sharded dim ``d``: the owner's row,
        summed over the axis with zeros from the other ranks (exact), so replicated along it; the
        gradient reaches the owner's row (the library's convention for replicated results).
        ``span``: (this slab's global start, its length, the global length) where the caller
        gathered them already."""
        from .comm import all_reduce_sum
        from .mesh import group_over

        self._routing("indexing")
        k = st.index(d)
        ((s0, n, total),) = [span] if span is not None else self._axis_span(x, st, [d], "an index by global position")
        g = i + total if i < 0 else i
        if not 0 <= g < total:
            self.fail("indexing", f"index {i} is out of range for sharded dim {d} of {total} positions", "")
        # Every rank runs the same calls (the owner sums its one row, the others none: zeros), so
        # that the backward graphs match and every rank runs the sum's all-reduce at the same point
        # of its backward (autograd orders ready nodes by the graph; a rank with other nodes could
        # reach its collectives in another order).
        own = s0 <= g < s0 + n
        y = x.narrow(d, g - s0 if own else 0, 1 if own else 0).sum(d)
        y = all_reduce_sum(y, group_over(self.guard.mesh, [self.guard.axes[k]]))
        state = tuple(None if (e is None or j == k) else e - (e > d) for j, e in enumerate(st))
        self._set(y, None if all(e is None for e in state) else state)
        return y

    def _check_phases(self, x, st, phases):
        """``x[..., a::s, ...]`` along sharded dims: exact when every slab starts on a multiple of ``s``.

        Global position ``g = start + l`` of a slab that starts on a multiple of ``s`` has
        ``g % s == l % s``, so the local slice picks exactly the slab's share of the global one
        (space-to-depth, patch merging, ``x[:, 0::2]`` / ``x[:, 1::2]`` pairs). Decided from
        every rank's local lengths (one small all-gather), so all ranks raise alike. ``phases``:
        (sharded dim, step, start) per phase slice. Returns the result's layout token (its slab
        lengths, known from the gathered ones: the phases of one tensor with the same lengths,
        ``x[:, 0::2] + x[:, 1::2]`` of an even length, share it; ``guard_tokens``).
        """
        from .comm.sizes import scope_forget

        leaves = [x.shape[d] for d, _, _ in phases]
        rows = self._gather_with_coords([int(v) for v in leaves], "forward guard: strided slicing")
        # The result has a layout the layout scope has not seen and this call does not declare:
        # forget the scope (alike on every rank), or a later layer could find a remembered layout
        # on some ranks only (a last slab of one row keeps its length) and skip its agreement there.
        scope_forget()
        token = self._token(x)
        for j, (d, step, start) in enumerate(phases):
            k = st.index(d)
            lengths = [r[j] for r in self._along_axis(rows, k)]
            token = self._kept_token(token, k, tuple(len(range(start, n, step)) for n in lengths))
            starts = [sum(lengths[:r]) for r in range(len(lengths))]
            if any(a % step for a in starts):
                self.fail(
                    "slicing",
                    f"a slice with step {step} along sharded dim {d} needs every slab to start on a multiple of "
                    f"{step}, and the slabs start at {starts}",
                    f"shard the input with an alignment that makes this dim's slabs multiples of {step}",
                )
        return token

    def _h_setitem(self, func, base, args, kwargs, stateful):
        x, idx = args[0], args[1]
        st = self._st(x)
        if st is None:
            if isinstance(idx, torch.Tensor) and idx in self.states:
                self.fail("index assignment", "it indexes with a slab (index values differ by rank)", "")
            return func(*args, **kwargs)
        items = idx if isinstance(idx, tuple) else (idx,)
        ok = all(isinstance(i, slice) or i is Ellipsis or _plain_int(i) for i in items) and len(
            [i for i in items if i is Ellipsis]) <= 1
        if ok:
            n_real = sum(1 for i in items if i is not Ellipsis)
            exp: list = []
            for i in items:
                exp += [slice(None)] * (x.dim() - n_real) if i is Ellipsis else [i]
            ok = st is not UNKNOWN and not isinstance(st, tuple(FOLDED)) and len(exp) <= x.dim()
            # Trailing dims written out (``x[:, :, :8] = 0`` on a 2-D mesh has no item for dim 3:
            # read as past the index, it failed with an IndexError).
            exp += [slice(None)] * (x.dim() - len(exp))
            if ok and any(_plain_int(exp[d]) for d in st if d is not None and d < len(exp)):
                # An integer position along a sharded dim (a boundary condition, ``u[:, :, 0] = 0``,
                # ``u[..., -1, :] = wall``): the length-1 slice at that global position, the value
                # given that dim, so the owner of the row writes it (refused before session 62).
                exp, value = self._int_rows_as_slices(x, st, exp, args[2])
                args = (x, tuple(exp), value, *args[3:])
            if ok and not self._keeps_slabs(x, st, exp):
                return self._setitem_global(func, x, st, exp, args[2], kwargs)
            if ok and any(d is not None and d < len(exp) and not _full_slice(exp[d]) for d in st):
                # Every slab whole by global bounds (``o[:, n - k:n + k] = v`` with k >= n): bounds
                # read from slab sizes would cut the slab by its local numbers.
                exp = [slice(None) if d in st else i for d, i in enumerate(exp)]
                return func(x, tuple(exp), *args[2:], **kwargs)
        if not ok:
            self.fail("index assignment", f"it writes local positions of a tensor sharded along {self.describe(st)}",
                      "build position masks on the full tensor before sharding, or register a sharded class")
        return func(*args, **kwargs)

    def _int_rows_as_slices(self, x, st, index: list, value):
        """``index`` with each integer along a sharded dim written as the length-1 slice at that
        position (negative positions count from the whole sample's end, as the slices' bounds do),
        and ``value`` given a dim of extent 1 there where it reaches that far (it broadcasts
        against the assigned positions from the right, as torch aligns it)."""
        index = list(index)
        for d in sorted(d for d in st if d is not None and d < len(index) and _plain_int(index[d])):
            i = index[d]  # (a position computed from a slab's size keeps its tag: the global number)
            index[d] = slice(i, None if type(i) is int and i == -1 else i + 1)
            if isinstance(value, torch.Tensor):
                after = sum(1 for q in range(d + 1, x.dim()) if not (q < len(index) and _plain_int(index[q])))
                if value.dim() > after:
                    vst = self.states.get(value)
                    if vst is not None and type(vst) is not tuple:
                        self.fail("index assignment", f"it writes a tensor sharded along {self.describe(vst)} into "
                                  f"one position along sharded dim {d}", "")
                    at = value.dim() - after
                    value = value.unsqueeze(at)
                    if vst is not None:  # a slab along another dim (a profile along a sharded W)
                        self._set(value, tuple(None if v is None else v + (v >= at) for v in vst))
        return index, value

    def _setitem_global(self, func, x, st, index: list, value, kwargs):
        """``x[..., a:b, ...] = value`` along sharded dims by **global** positions, as on one device
        (a spectral layer writing its kept modes, ``out_ft[:, :, :m1, :m2] = ...``): each slab
        writes its part of ``[a, b)``. A plain value of the crop's global extent gives each rank
        its rows; a slab value (a crop of another slab, laid out by ``kept_boundaries``) has its
        rows moved to the ranks that hold their target (``move_rows``: no messages where nothing
        moves); a value of extent 1 along the dim broadcasts. Decided alike on every rank from
        global bounds and gathered lengths."""
        from .comm import axis_peers
        from .comm.rebalance import move_rows

        crops = []
        for d in st:
            if d is None or _full_slice(index[d]):
                continue
            if not (isinstance(index[d], slice) and index[d].step in (None, 1)):
                self.fail("index assignment", f"slice {index[d]} along sharded dim {d} has a step other than 1", "")
            crops.append((d, d, index[d]))
        out_index = list(index)
        for (p, d, _sl), (a, b, s0, n, _total, lens) in zip(crops, self._global_bounds(x, st, crops)):
            k = st.index(d)
            lo, hi = slab_overlap(a, b, s0, n)
            out_index[p] = slice(lo, hi)
            if not isinstance(value, torch.Tensor):
                continue
            # (The value aligns from the right with the assigned positions: integer positions
            # along other dims drop theirs.)
            vd = value.dim() - 1 - sum(1 for q in range(d + 1, x.dim()) if not (q < len(index) and _plain_int(index[q])))
            vst = self.states.get(value)
            if vd < 0 or (value.shape[vd] == 1 and (vst is None or vd not in vst)):
                continue  # broadcast along this dim
            if vst is None:
                if value.shape[vd] != b - a:
                    self.fail("index assignment", f"the value has {value.shape[vd]} rows along dim {d}, and the "
                              f"assigned range holds {b - a}", "")
                value = value.narrow(vd, s0 + lo - a, hi - lo)
                continue
            if vst is UNKNOWN or type(vst) in FOLDED or (vst[k] if k < len(vst) else None) != vd:
                self.fail("index assignment", f"the value's layout ({self.describe(vst)}) does not put its rows "
                          f"along dim {d} on mesh axis {self.guard.axes[k]!r}", "assign a value derived from the "
                          "same slabs (a crop of them), or a plain tensor of the range's global size")
            (have,) = self._lengths([(k, int(value.shape[vd]))], "forward guard: index assignment")
            if sum(have) != b - a:
                self.fail("index assignment", f"the value has {sum(have)} rows along dim {d} in all, and the "
                          f"assigned range holds {b - a}", "")
            want = overlap_lengths(a, b, lens)
            value = move_rows(value, vd, tuple(have), want, axis_peers(self.guard.mesh, self.guard.axes[k]))
            self._set(value, vst)  # (still a slab: a later cropped dim of a 2-D mesh reads its layout)
        return func(x, tuple(out_index), value, **kwargs)

    def _keeps_slabs(self, x, st, index: list) -> bool:
        """Whether the slices of ``index`` keep every slab whole along every sharded dim (as
        ``x[:, :h] = y`` does where ``h`` is the whole sample's length), decided alike on every
        rank: bounds read from slab sizes are evaluated on the global sizes."""
        crops = []
        for d in st:
            if d is None or d >= len(index) or _full_slice(index[d]):
                continue
            i = index[d]
            if not (isinstance(i, slice) and i.step in (None, 1)):
                return False
            crops.append((d, d, i))
        if not crops:
            return True
        return all(a == 0 and b == total for a, b, _s0, _n, total, _lens in self._global_bounds(x, st, crops))

    def _h_split(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        dim = _arg(args, kwargs, 2 if base in ("split", "chunk", "tensor_split", "split_with_sizes") else 1, "dim", 0)
        dim = dim % x.dim()
        if st is not None and dim in st:
            how = args[1] if len(args) > 1 else next(
                (kwargs[n] for n in ("split_size_or_sections", "split_size", "split_sizes", "chunks", "sections",
                                     "indices", "indices_or_sections") if n in kwargs), None)
            return self._split_global(base, x, st, dim, how)
        out = func(*args, **kwargs)
        if base == "unbind":
            self._set(out, None if st is None else tuple(None if d is None else d - (d > dim) for d in st))
        else:
            self._set(out, st)
        return out

    def _split_global(self, base: str, x, st, dim: int, how) -> tuple:
        """``split``, ``chunk``, ``tensor_split`` along sharded dim ``dim``: the pieces the single
        device makes, by **global** positions (since session 64; refused before), each one a crop
        (``x[:, :, a:b]``: the crop rules, layouts and tokens; a piece of one row is that row,
        replicated, as ``x[:, :, a:a + 1]``). The global length comes from one small all-gather;
        sizes read from a slab (``x.split(x.shape[2] // 2, 2)``) are the global ones. ``unbind``
        along a sharded dim (one replicated row per position) is refused."""
        if base == "unbind":
            self.fail("`unbind`", f"it takes every position of sharded dim {dim} as a tensor of its own",
                      "index the positions you need (x[:, :, i]), or unbind after gathering")
        self._routing(f"`{base}`")  # (before its first collective: refused alike inside torch's checkpoint)
        k = st.index(dim)
        (lens,) = self._lengths([(k, int(x.shape[dim]))], f"forward guard: `{base}` (slab lengths)")
        total = sum(lens)
        items = list(how) if isinstance(how, (list, tuple)) else [how]
        tagged = [v for v in items if _is_tagged(v)]
        if tagged:
            glob = self._global_values(tagged, f"`{base}`")
            items = [glob[id(v)] if _is_tagged(v) else v for v in items]
        if not all(isinstance(v, int) for v in items) or (isinstance(how, (list, tuple)) and base == "chunk"):
            self.fail(f"`{base}`", f"it splits sharded dim {dim} by sizes that are not integers", "")
        if not isinstance(how, (list, tuple)) and items[0] <= 0:
            raise RuntimeError(f"`{base}` expects a positive number of chunks or split size, got {items[0]}")
        if base == "chunk":
            step = -(-total // items[0]) if total else 0
            cuts = list(range(0, total, step)) + [total] if step else [0, 0]
        elif base == "tensor_split" and not isinstance(how, (list, tuple)):
            q, r = divmod(total, items[0])
            cuts = [0]
            for i in range(items[0]):
                cuts.append(cuts[-1] + q + (i < r))
        elif base == "tensor_split":  # indices
            cuts = [0, *(min(max(i if i >= 0 else i + total, 0), total) for i in items), total]
        elif isinstance(how, (list, tuple)):  # split with sections
            if sum(items) != total:
                raise RuntimeError(
                    f"split_with_sizes expects split_sizes to sum exactly to {total} (input tensor's size at "
                    f"dimension {dim}), but got split_sizes={items}"
                )
            cuts = [0]
            for v in items:
                cuts.append(cuts[-1] + v)
        else:
            cuts = list(range(0, total, items[0])) + [total] if items[0] > 0 and total else [0, 0]
        # Each piece is the crop ``x[..., a:b, ...]``, from the lengths gathered above (the crop's
        # own gather of them is not repeated); a piece of one row takes the crop's own path.
        from .comm.sizes import scope_forget

        scope_forget()  # (the pieces' lengths change: as every crop, alike on every rank)
        lead = (slice(None),) * dim
        s0 = sum(lens[: axis_index(self.guard.mesh, self.guard.axes[k])])
        pieces = []
        for a, b in zip(cuts, cuts[1:]):
            if b - a == 1:
                pieces.append(self._h_getitem(torch.Tensor.__getitem__, "getitem", (x, (*lead, slice(a, b))), {}, [x]))
                continue
            lo, hi = slab_overlap(a, max(a, b), s0, int(x.shape[dim]))
            out = x.narrow(dim, lo, hi - lo)
            self._set(out, st)
            pieces.append(self._relayout(out, dim, k, overlap_lengths(a, max(a, b), lens), lens, self._token(x)))
        return tuple(pieces)

    def _h_cat(self, func, base, args, kwargs, stateful):
        tensors = list(_arg(args, kwargs, 0, "tensors"))
        dim = _arg(args, kwargs, 1, "dim", 0)
        self._require_known(base, stateful)
        nd = max(t.dim() for t in tensors)
        dim = dim % nd
        sts = {self._st(t) for t in tensors if t.dim() == nd} - {None}
        full = [s for s in sts if dim in s]
        if len(sts) > 1 and len(full) == 1 and all(_same_but_axis(s, full[0], dim) for s in sts):
            # On a 2-D mesh: slabs along the cat dim and parts replicated along it (one row of the
            # whole domain, ``x[:, :, :1]``) but sharded like the slabs along the other dim: those
            # parts go to the first / last rank along the axis, as plain tensors do.
            sts = set(full)
        if len(sts) > 1:
            self.fail(f"`{base}`", "its inputs are sharded along different dims", "")
        st = next(iter(sts), None)
        if st is not None and dim in st:
            slabs = [j for j, t in enumerate(tensors) if self._st(t) == st]
            if len(slabs) == 1:
                return self._cat_ends(func, args, kwargs, tensors, slabs[0], dim, st)
            return self._cat_slabs(base, func, args, kwargs, tensors, slabs, dim, st)
        if st is not None and self.tokens._d:
            args, kwargs, tensors = self._align_tokens(base, args, kwargs, tensors)
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            # Static fields sized for the whole domain, concatenated to a slab as channels: this
            # rank takes its rows of them (``_whole_domain_rows``), or the error stands.
            rows = self._whole_domain_rows(base, tensors) if st is not None else None
            if rows is None:
                raise
            args, kwargs, tensors = self._with_rows(rows, args, kwargs, tensors)
            out = func(*args, **kwargs)
        if st is not None:
            # Plain parts must not vary along the sharded dims (checked as for broadcasting).
            try:
                self._broadcast(base, (tensors,), {}, out, rows_of_whole=True)
            except _WholeDomainOperand:
                # This rank's slab holds every row (no error above); the others gather here too.
                rows = self._whole_domain_rows(base, tensors)
                if any(rows[id(t)].shape != t.shape for t in tensors if id(t) in rows):
                    args, kwargs, tensors = self._with_rows(rows, args, kwargs, tensors)
                    out = func(*args, **kwargs)
                self._broadcast(base, (tensors,), {}, out)
        self._set(out, st)
        return out

    def _cat_slabs(self, base, func, args, kwargs, tensors, slabs, dim, st):
        """``cat`` of several slabs (and plain tensors) along their sharded dim, in any order:
        CoaT cuts its class token off a sequence (``x[:, :1]``) and puts it back in front of the
        image tokens; ``torch.cat([x[:, :, 2:], x[:, :, :2]], 2)`` rolls the rows by hand;
        ``torch.cat([x[..., :3], x[..., 3:]], 2)`` puts pieces back together.

        The result takes the layout that keeps the slab boundaries of the first slab operand
        (``kept_boundaries``, the rule of crops and pads). Each operand is first brought to the
        rows of it that fall in this rank's part of the result: a slab's rows move between
        ranks (``move_rows``, only where they change owner), a plain tensor (the same on every
        rank) is cut to this rank's part. Each rank's concatenation of its parts is then its slab
        of the single device's result. One small all-gather of the slabs' lengths, alike on
        every rank. (Before session 64, operands whose rows interleave across the ranks, two
        full slabs, were refused.)"""
        from .comm import axis_peers
        from .comm.rebalance import move_rows
        from .comm.sizes import scope_forget

        self._routing(f"`{base}`")
        k = st.index(dim)
        line = self._along_axis(
            self._gather_with_coords([int(tensors[j].shape[dim]) for j in slabs], "forward guard: `cat` of slabs"), k
        )
        held = {j: tuple(r[i] for r in line) for i, j in enumerate(slabs)}
        sizes = [sum(held[j]) if j in held else int(t.shape[dim]) for j, t in enumerate(tensors)]
        target = kept_boundaries(held[slabs[0]], sum(sizes))
        coord = axis_index(self.guard.mesh, self.guard.axes[k])
        mine = sum(target[:coord])  # this rank's first row of the result
        parts, at = [], 0
        for j, t in enumerate(tensors):
            share = overlap_lengths(at, at + sizes[j], target)  # every rank's rows of this operand
            if j in held:
                if share != held[j]:
                    t = move_rows(t, dim, held[j], share, axis_peers(self.guard.mesh, self.guard.axes[k]))
                    self._set(t, st)
            else:
                t = t.narrow(dim, min(max(mine - at, 0), sizes[j]), share[coord])
            parts.append(t)
            at += sizes[j]
        scope_forget()
        out = func(parts, *args[1:], **kwargs) if args else func(**{**kwargs, "tensors": parts})
        self._set(out, st)
        self._set_token(out, self._kept_token(self._token(tensors[slabs[0]]), k, target))
        return out

    def _cat_ends(self, func, args, kwargs, tensors, j, dim, st):
        """``cat([*before, slab, *after], dim)`` along the slab's sharded dim, with plain tensors
        (the same on every rank: a class token, register tokens, a row of padding) around it:
        the whole domain is ``before + all slabs + after``, so the first rank along the axis holds
        ``before`` and the last ``after``. The slabs' lengths change: the layout scope forgets."""
        from .comm.sizes import scope_forget

        self._routing("`cat`")
        axis = self.guard.axes[st.index(dim)]
        coord, n = axis_index(self.guard.mesh, axis), axis_size(self.guard.mesh, axis)
        # The other ranks concatenate empty slices of the ends: the same calls, and so the same
        # backward graph on every rank (the order of the backward's collectives follows it).
        parts = [t if (i < j and coord == 0) or (i > j and coord == n - 1) or i == j else t.narrow(dim, 0, 0)
                 for i, t in enumerate(tensors)]
        scope_forget()
        out = func(parts, *args[1:], **kwargs) if args else func(**{**kwargs, "tensors": parts})
        self._set(out, st)
        # The result keeps the slab's boundaries (``_relayout``): every rank's slab length, from
        # one small all-gather (alike on every rank), and the ends' rows on the first and last.
        k = st.index(dim)
        rows = self._gather_with_coords([int(tensors[j].shape[dim])], "forward guard: `cat`")
        source = tuple(r[0] for r in self._along_axis(rows, k))
        before = sum(int(t.shape[dim]) for t in tensors[:j])
        after = sum(int(t.shape[dim]) for t in tensors[j + 1 :])
        lens = tuple(m + (before if c == 0 else 0) + (after if c == n - 1 else 0) for c, m in enumerate(source))
        return self._relayout(out, dim, k, lens, source, self._token(tensors[j]))

    def _h_stack(self, func, base, args, kwargs, stateful):
        tensors = list(_arg(args, kwargs, 0, "tensors"))
        dim = _arg(args, kwargs, 1, "dim", 0)
        self._require_known(base, stateful)
        sts = {self._st(t) for t in tensors}
        if len(sts) == 2 and None in sts and UNKNOWN not in sts:
            # Slabs stacked with plain tensors: those sized for the whole domain give this rank's
            # rows (``_whole_domain_rows``); any other plain tensor is refused there.
            rows = self._whole_domain_rows("stack", tensors)
            if rows is not None:
                args, kwargs, tensors = self._with_rows(rows, args, kwargs, tensors)
                sts = {self._st(t) for t in tensors}
        if len(sts) > 1:
            self.fail("`stack`", "its inputs are not all slabs of the same layout", "")
        st = sts.pop()
        if st is not None and self.tokens._d:
            args, kwargs, tensors = self._align_tokens("stack", args, kwargs, tensors)
        out = func(*args, **kwargs)
        dim = dim % out.dim()
        self._set(out, None if st is None else tuple(None if d is None else d + (d >= dim) for d in st))
        return out

    def _h_reduce(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        if not isinstance(x, torch.Tensor) or st is None:
            if base in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
                return self._h_pointwise(func, base, args, kwargs, stateful)
            return self._plain_or_fail(func, base, args, kwargs, stateful)
        if base in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return self._h_pointwise(func, base, args, kwargs, stateful)
        self._require_known(base, stateful)
        nd = x.dim()
        dim = _arg(args, kwargs, 1, "dim")
        if base in ("softmax", "log_softmax", "softmin", "normalize", "cumsum", "cumprod", "logcumsumexp",
                    "cummax", "cummin", "sort", "argsort", "diff"):
            dim = _arg(args, kwargs, 1, "dim", 1 if base == "normalize" else (-1 if base in ("sort", "argsort") else None))
            if base == "normalize":
                dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
            elif base == "diff":
                # torch.diff(input, n=1, dim=-1, ...): the dim is the third argument (read as the
                # second before session 62, ``torch.diff(x, 1, 2)`` ran locally along sharded dim
                # 2: the differences across slab boundaries missing, silently).
                dim = _arg(args, kwargs, 2, "dim", -1)
            dims = _norm_dims(dim, nd) if dim is not None else tuple(range(nd))
            if base == "normalize" and any(d in st for d in dims):
                return self._route_normalize(x, args, kwargs, dims, st)
            if base in ("softmax", "log_softmax", "softmin") and dim is not None and any(d in st for d in dims):
                return self._route_softmax(base, x, args, kwargs, dims[0], st)
            if base == "cumsum" and dim is not None and any(d in st for d in dims):
                self._routing(base)
                out = reductions.cumsum(x, self.guard.mesh, dims[0], dtype=kwargs.get("dtype"),
                                        sharded_dims=self._leading_dims(base, st))
                self._set(out, st)
                return out
            if base == "diff" and any(d in st for d in dims):
                return self._route_diff(x, args, kwargs, dims[0], st)
            if any(d in st for d in dims):
                self.fail(f"`{base}`", f"it acts along sharded dim(s) {sorted(set(dims) & set(st))}", "")
            out = func(*args, **kwargs)
            self._set(out, st)
            return out
        if base in _ROUTED_STATS:
            return self._route_stats(func, base, x, args, kwargs, st)
        if base in ("topk", "kthvalue"):
            dim = _arg(args, kwargs, 2, "dim", -1)
        elif base in ("quantile", "nanquantile"):
            dim = _arg(args, kwargs, 2, "dim")
        dims = tuple(range(nd)) if dim is None else _norm_dims(dim, nd)
        keepdim = bool(_arg(args, kwargs, 3 if base in ("quantile", "nanquantile") else 2, "keepdim", False))
        if base in ("topk", "kthvalue"):
            keepdim = True
        hit = [d for d in dims if d in st]
        if not hit:
            return self._unrouted(func, args, kwargs, dims, keepdim, st)
        if base in _ROUTED_REDUCE and not (base in ("max", "min") and dim is not None) and not kwargs.get("dtype"):
            return self._route_reduce(base, x, dims, keepdim, st)
        if base in ("max", "min") and isinstance(dim, int):
            # (values, indices) along one sharded dim: the first extreme's global index, and its
            # value's gradient to that element only, as torch's.
            self._routing(base)
            values, idx = reductions.max_dim(x, self.guard.mesh, dim, keepdim=keepdim, largest=base == "max",
                                             sharded_dims=self._leading_dims(base, st))
            self._set_reduced(values, dims, keepdim, st)
            self._set_reduced(idx, dims, keepdim, st)
            return (torch.return_types.max if base == "max" else torch.return_types.min)((values, idx))
        if base == "logsumexp":
            self._routing(base)
            kw = {"sharded_dims": self._leading_dims(base, st)}
            out = reductions.logsumexp(x, self.guard.mesh, dims, keepdim, **kw)
            self._set_reduced(out, dims, keepdim, st)
            return out
        if base in ("any", "all", "count_nonzero", "argmax", "argmin", "aminmax"):
            return self._route_selection(base, x, dim, dims, keepdim, st)
        self.fail(
            f"`{base}`", f"it reduces over sharded dim(s) {hit}",
            "use sharded_nn.reductions (sum, mean, max, argmax) or amax/amin, which the guard routes",
        )

    def _route_selection(self, base, x, dim, dims, keepdim: bool, st):
        """``any``/``all`` (a max or min of the truth values), ``count_nonzero`` (a sum),
        ``argmax``/``argmin`` (global indices; ``dim=None``: the global flat index) and ``aminmax``
        over sharded dims, through ``sharded_nn.reductions``: a routine NaN check
        (``torch.isnan(x).any()``) or a peak's position in a model's forward."""
        if base == "aminmax":
            return torch.return_types.aminmax(
                (self._route_reduce("amin", x, dims, keepdim, st), self._route_reduce("amax", x, dims, keepdim, st))
            )
        self._routing(base)
        mesh, kw = self.guard.mesh, {"sharded_dims": self._leading_dims(base, st)}
        if base in ("argmax", "argmin"):
            fn = reductions.argmax if base == "argmax" else reductions.argmin
            out = fn(x, mesh, dim, keepdim=keepdim, **kw)
            if dim is None:
                self._set(out, None)
            else:
                self._set_reduced(out, dims, keepdim, st)
            return out
        if base == "count_nonzero":
            out = reductions.sum((x != 0).to(torch.int64), mesh, dims, **kw)
            self._set_reduced(out, dims, False, st)
            return out
        truth = (x != 0).to(torch.uint8)
        if base == "any":
            out = reductions.max(truth, mesh, dims, keepdim=keepdim, **kw)
        else:
            out = 1 - reductions.max(1 - truth, mesh, dims, keepdim=keepdim, **kw)
        out = out if x.dtype == torch.uint8 else out.bool()  # (torch keeps uint8, else bool)
        self._set_reduced(out, dims, keepdim, st)
        return out

    def _leading_dims(self, base: str, st) -> tuple[int | None, ...]:
        """The sharded dims of state ``st`` as ``sharded_nn.reductions`` takes them: one per mesh
        axis, ``None`` for an axis that shards none where a later one does (the columns of a 2x2
        mesh after a reduction over the rows; refused before session 60), else the leading ones."""
        active = tuple(d for d in st if d is not None)
        if len(active) != len(st) and st[: len(active)] != active:
            return tuple(st)
        return active

    def _unrouted(self, func, args, kwargs, dims, keepdim: bool, st):
        """A reduction over unsharded dims only: torch's own call, the layout shifted past them."""
        out = func(*args, **kwargs)
        shift = (lambda d: d) if keepdim else (lambda d: d - sum(r < d for r in dims))
        self._set(out, tuple(None if d is None else shift(d) for d in st))
        return out

    def _set_reduced(self, out, dims, keepdim: bool, st) -> None:
        """The layout of a reduction over ``dims`` that include sharded ones: replicated where
        every sharded dim is reduced, else the remaining sharded dims (shifted past dropped ones)."""
        remaining = tuple(None if (d is None or d in dims) else (d if keepdim else d - sum(r < d for r in dims)) for d in st)
        self._set(out, None if all(d is None for d in remaining) else remaining)

    def _route_softmax(self, base, x, args, kwargs, dim, st):
        """``softmax`` / ``log_softmax`` / ``softmin`` along a sharded dim (attention weights over
        sharded tokens, a LambdaNet's key softmax): ``reductions.softmax``; the output keeps the layout."""
        self._routing(base)

        active = self._leading_dims(base, st)
        # dtype: a keyword, or positional after dim (torch.softmax(x, dim, dtype); F.softmax has
        # _stacklevel before it).
        dtype = kwargs.get("dtype") or next((a for a in args[2:] if isinstance(a, torch.dtype)), None)
        x = x.to(dtype) if dtype is not None else x
        fn = reductions.log_softmax if base == "log_softmax" else reductions.softmax
        out = fn(-x if base == "softmin" else x, self.guard.mesh, dim, sharded_dims=active)
        self._set(out, st)
        return out

    def _route_diff(self, x, args, kwargs, dim: int, st):
        """``torch.diff`` along a sharded dim (finite differences in a physics loss, a total
        variation): ``n`` times the crop ``[1:]`` minus the crop ``[:-1]`` along it, by global
        positions; both crops keep the slab boundaries (``kept_boundaries``), so they line up on
        every rank as on one device (refused before session 62)."""
        if _arg(args, kwargs, 3, "prepend") is not None or _arg(args, kwargs, 4, "append") is not None:
            self.fail("`diff`", f"it joins prepend/append tensors along sharded dim {dim}",
                      "concatenate them with torch.cat first, then take the difference")
        y = x
        for _ in range(int(_arg(args, kwargs, 1, "n", 1))):
            later = tuple(slice(1, None) if d == dim else slice(None) for d in range(x.dim()))
            earlier = tuple(slice(None, -1) if d == dim else slice(None) for d in range(x.dim()))
            hi = self._h_getitem(torch.Tensor.__getitem__, "__getitem__", (y, later), {}, [y])
            lo = self._h_getitem(torch.Tensor.__getitem__, "__getitem__", (y, earlier), {}, [y])
            y = hi - lo if y.dtype != torch.bool else hi ^ lo  # (torch's diff of booleans: logical xor)
            self._set(y, self._st(hi))
        return y

    def _h_gradient(self, func, base, args, kwargs, stateful):
        """``torch.gradient`` (central differences, one-sided at the ends: a physics loss's
        derivatives). Along a sharded dim each rank fetches one row beyond each end of its slab
        (the block its differences read, ``comm.halo_gather``; more at the sample's ends for
        ``edge_order=2``), takes torch's own call on the block, where the sample's ends are the
        block's, and keeps its own rows: one small all-gather of the lengths and point-to-point
        rows, the single device's arithmetic. Along other dims torch's own call. A coordinate
        spacing along a sharded dim must be a plain vector of the whole length (refused before
        session 62)."""
        from .comm import axis_peers
        from .comm.halo import HaloGather, halo_gather

        x = args[0]
        st = self._st(x)
        if type(st) is not tuple or len(stateful) != 1:
            return self._h_positional(func, base, args, kwargs, stateful)
        nd = x.dim()
        dim, spacing, order = kwargs.get("dim"), kwargs.get("spacing", 1), kwargs.get("edge_order", 1)
        dims = tuple(range(nd)) if dim is None else _norm_dims([dim] if isinstance(dim, int) else list(dim), nd)
        steps = list(spacing) if isinstance(spacing, (list, tuple)) else [spacing] * len(dims)
        outs = []
        for d, h in zip(dims, steps):
            if d not in st:
                out = torch.gradient(x, spacing=h, dim=d, edge_order=order)[0]
            else:
                self._routing("`gradient`")
                k = st.index(d)
                (lens,) = self._lengths([(k, int(x.shape[d]))], "forward guard: `gradient` (slab lengths)")
                total = sum(lens)
                starts = [sum(lens[:r]) for r in range(len(lens))]
                blocks = [_difference_block(a, n, total, order) for a, n in zip(starts, lens)]
                me = axis_index(self.guard.mesh, self.guard.axes[k])
                (lo, hi), a, n = blocks[me], starts[me], lens[me]
                if isinstance(h, torch.Tensor):
                    if self._st(h) is not None or h.dim() != 1 or h.shape[0] != total:
                        self.fail("`gradient`", f"its coordinates along sharded dim {d} are not a plain vector of "
                                  f"the whole length ({total})", "")
                    h = h[lo : hi + 1]
                block = halo_gather(x, HaloGather.of_blocks(d, lens, blocks),
                                    axis_peers(self.guard.mesh, self.guard.axes[k]))
                grad = torch.gradient(block, spacing=(h,), dim=d, edge_order=order)[0] if n else block
                out = grad.narrow(d, a - lo, n)
            self._set(out, st)
            outs.append(out)
        return tuple(outs)

    def _route_normalize(self, x, args, kwargs, dims, st):
        """``F.normalize`` along a sharded dim: the routed vector norm, then torch's own formula."""
        self._routing("normalize")

        p = _arg(args, kwargs, 1, "p", 2.0)
        eps = _arg(args, kwargs, 3, "eps", 1e-12)
        if _arg(args, kwargs, 4, "out") is not None:
            self.fail("`normalize`", "its out= form is not routed over a sharded dim", "")
        active = self._leading_dims("normalize", st)
        norm = reductions.norm(x, self.guard.mesh, dims, p, keepdim=True, sharded_dims=active)
        out = x / norm.clamp_min(eps).expand_as(x)
        self._set(out, st)
        return out

    def _route_stats(self, func, base, x, args, kwargs, st):
        """Vector norms, variances and standard deviations: routed where they reduce a sharded dim."""

        nd = x.dim()
        if base in ("norm", "linalg_vector_norm", "linalg_norm"):
            # torch.norm(x, p="fro", dim, keepdim, out, dtype); linalg.vector_norm(x, ord=2, dim,
            # keepdim, *, dtype); linalg.norm(x, ord=None, dim, keepdim, *, dtype).
            linalg = base.startswith("linalg")
            p = _arg(args, kwargs, 1, "ord" if linalg else "p", 2 if base == "linalg_vector_norm" else None)
            dim = _arg(args, kwargs, 2, "dim")
            keepdim = bool(_arg(args, kwargs, 3, "keepdim", False))
            dtype = kwargs.get("dtype") if linalg else _arg(args, kwargs, 5, "dtype")
            dims = tuple(range(nd)) if dim is None else _norm_dims(dim, nd)
            hit = [d for d in dims if d in st]
            # linalg.norm with an ord over two dims is a matrix norm (without dim, torch takes one
            # of a 2-d input and refuses higher ranks): refused here when a sharded dim is hit.
            matrix = base == "linalg_norm" and p is not None and (len(dims) == 2 or dim is None)
            p = 2 if p in (None, "fro") and not matrix else p
            if hit and (matrix or isinstance(p, str) or _arg(args, kwargs, 4, "out") is not None and not linalg):
                self.fail(f"`{base}`", f"it takes a matrix norm or an out= form (p={p!r}) over sharded dim(s) {hit}",
                          "use a vector norm (torch.linalg.vector_norm), which the guard routes")
            if hit and dtype is not None:
                x = x.to(dtype)
        else:  # var, std, var_mean, std_mean: (x, dim, unbiased, keepdim), (x, unbiased) or keywords
            dim = _arg(args, kwargs, 1, "dim")
            rest = list(args[2:])
            unbiased = kwargs.get("unbiased")
            if isinstance(dim, bool):  # torch.var(x, unbiased)
                unbiased, dim = dim, kwargs.get("dim")
            elif rest:
                unbiased = rest[0]
            keepdim = bool(rest[1] if len(rest) > 1 else kwargs.get("keepdim", False))
            correction = kwargs.get("correction")
            if correction is None:
                correction = 0 if unbiased is False else 1
            dims = tuple(range(nd)) if dim is None else _norm_dims(dim, nd)
            hit = [d for d in dims if d in st]
        if not hit:
            return self._unrouted(func, args, kwargs, dims, keepdim, st)
        self._routing(base)
        kw = {"keepdim": keepdim, "sharded_dims": self._leading_dims(base, st)}
        mesh = self.guard.mesh
        if base in ("norm", "linalg_vector_norm", "linalg_norm"):
            out = reductions.norm(x, mesh, dims, p, **kw)
        else:
            out = getattr(reductions, base)(x, mesh, dims, correction=correction, **kw)
        self._set_reduced(out, dims, keepdim, st)
        return out

    def _route_reduce(self, base, x, dims, keepdim, st):
        self._routing(base)

        mesh = self.guard.mesh
        kw = {"keepdim": keepdim, "sharded_dims": self._leading_dims(base, st)}
        if base in ("sum", "nansum"):
            # nansum: NaNs count as zeros, with a zero gradient, as torch's (``nan_to_num`` would
            # also turn an infinity into the largest finite number: a finite sum where torch's
            # is infinite, silently, before session 62).
            x = torch.where(torch.isnan(x), 0, x) if base == "nansum" else x
            out = reductions.sum(x, mesh, dims, **kw)
        elif base == "nanmean":
            # torch's own formula: the sum of the numbers over their (integer) count.
            kept = ~torch.isnan(x)
            out = reductions.sum(torch.where(kept, x, 0), mesh, dims, **kw) / reductions.sum(kept.long(), mesh, dims, **kw)
        elif base == "mean":
            out = reductions.mean(x, mesh, dims, **kw)
        elif base in ("amax", "max"):
            out = reductions.max(x, mesh, dims, **kw)
        else:
            out = -reductions.max(-x, mesh, dims, **kw)
        self._set_reduced(out, dims, keepdim, st)
        return out

    def _plain_or_fail(self, func, base, args, kwargs, stateful):
        if stateful:
            self.fail(f"`{base}`", f"it receives {self._what(stateful, False)} in an argument the guard cannot map", "")
        found: list = []
        _walk((args, kwargs), found)
        if any(_is_tagged(v) for v in found):
            self.fail(f"`{base}`", "it receives a size read from a slab's local shape", "")
        return func(*args, **kwargs)

    def _h_positional(self, func, base, args, kwargs, stateful):
        if base in ("flip", "fliplr", "flipud") and len(stateful) == 1 and stateful[0] is args[0] and type(
                self._st(args[0])) is tuple:
            return self._flip(func, base, args, kwargs)
        alone = len(stateful) == 1 and stateful[0] is args[0] and type(self._st(args[0])) is tuple
        if base == "unfold" and func is torch.nn.functional.unfold and alone:
            return self._im2col(args, kwargs)
        if base == "unfold" and func is torch.Tensor.unfold and alone:
            return self._sliding_windows(func, args, kwargs)
        if base == "index_select" and alone:
            x, dim, index = args[0], _arg(args, kwargs, 1, "dim"), _arg(args, kwargs, 2, "index")
            if isinstance(dim, int) and isinstance(index, torch.Tensor) and index.dim() == 1 and not kwargs.get("out"):
                dim %= x.dim()
                st = self._st(x)
                if dim in st:
                    out = self._pick_global(x, st, (slice(None),) * dim + (index,))
                    if out is None:
                        self.fail("`index_select`", f"its index along sharded dim {dim} is not an integer tensor", "")
                    return out
                if self.states.get(index) is not None:
                    self.fail("`index_select`", "its index is a slab (it differs by rank)", "")
                out = func(*args, **kwargs)
                self._set(out, st)
                return out
        if stateful:
            self.fail(f"`{base}`", f"it reads or writes positions by index on {self._what(stateful, False)}", "")
        return self._plain_or_fail(func, base, args, kwargs, stateful)

    def _im2col(self, args, kwargs):
        """``F.unfold(x, k, dilation, padding, stride)`` (``nn.Unfold``, VOLO's outlook attention):
        ``ShardedUnfold``'s blocks of the slab (halo exchange, multi-hop where slabs are thin or
        empty), then their flatten as a view the guard maps: on a 1-D mesh a slab of the blocks'
        dim (whole block rows, in rank order), on a 2-D mesh both axes merged into it."""
        from .layers.unfold import ShardedUnfold

        x = args[0]
        st = self._st(x)
        names = ("kernel_size", "dilation", "padding", "stride")
        opts = [_arg(args, kwargs, i + 1, nm, df) for i, (nm, df) in enumerate(zip(names, (None, 1, 0, 1)))]
        if any(_is_tagged(v) for o in opts for v in (o if isinstance(o, (list, tuple)) else (o,))):
            self.fail("`unfold`", "its block size, dilation, padding or stride is computed from a slab's local size",
                      "compute them from global sizes")
        dims = self._grid_dims("unfold", x, st, 2)
        if not dims or x.dim() != 4:
            self.fail("`unfold`", f"it cuts blocks of a {x.dim()}-d tensor sharded along {self.describe(st)}",
                      "pass a batched image (N, C, H, W) sharded along its spatial dims")
        self._routing("`unfold`")
        blocks = ShardedUnfold(*opts, mesh=self.guard.mesh, dims=dims).blocks(x)
        self._set(blocks, st)
        return self._h_reshape(torch.flatten, "flatten", (blocks, x.dim() - 2), {}, [blocks])

    def _h_col2im(self, func, base, args, kwargs, stateful):
        """``F.fold(cols, output_size, k, dilation, padding, stride)``: ``ShardedFold`` of blocks
        laid out as ``F.unfold`` leaves them on a 1-D mesh (whole block rows per rank); the image
        comes back sharded along its rows. ``output_size`` read from a slab is the global one."""
        from .layers.unfold import ShardedFold

        cols = args[0]
        st = self._st(cols)
        self._require_known(base, stateful)
        if st is None:
            args, kwargs = self._globalise("`fold`", args, kwargs)
            return func(*args, **kwargs)
        args, kwargs = self._globalise("`fold`", args, kwargs)
        names = ("output_size", "kernel_size", "dilation", "padding", "stride")
        opts = [_arg(args, kwargs, i + 1, nm, df) for i, (nm, df) in enumerate(zip(names, (None, None, 1, 0, 1)))]
        seq = cols.dim() - 1
        if len(st) != 1 or st[0] != seq or len(stateful) != 1:
            self.fail("`fold`", f"its blocks are sharded along {self.describe(st)}; it folds blocks sharded along "
                      "their sequence dim (whole rows of blocks, as F.unfold leaves them) on a 1-D domain mesh",
                      "fold on a 1-D mesh, or gather the blocks first")
        self._routing("`fold`")
        out = ShardedFold(*opts, mesh=self.guard.mesh, dims=(2,))(cols)
        self._set(out, (out.dim() - 2,))
        return out

    def _sliding_windows(self, func, args, kwargs):
        """``x.unfold(d, size, step)``: the windows of ``size`` rows every ``step`` rows along dim
        ``d`` (patches ``x.unfold(2, p, p).unfold(3, p, p)``, HaloNet's overlapping key blocks),
        refused along a sharded dim before session 63. Every slab must start on a window (a
        multiple of ``step``, as for a strided convolution; else refused alike on every rank).
        Each window sits on the rank that holds its first row (where a window without padding
        puts its output); a
        rank fetches the rows its windows reach past its slab from their owners
        (``comm.halo_gather``; nothing moves where every window lies in one slab) and takes
        torch's own ``unfold`` of that block. The windows' dim stays sharded, the window's rows
        are the new last dim."""
        from .comm import axis_peers
        from .comm.halo import HaloGather, halo_gather
        from .comm.sizes import scope_forget

        x = args[0]
        st = self._st(x)
        d, size, step = (_arg(args, kwargs, i, n) for i, n in ((1, "dimension"), (2, "size"), (3, "step")))
        if not all(isinstance(v, int) and not _is_tagged(v) for v in (d, size, step)):
            self.fail("`unfold`", "its dim, size or step is not a plain integer", "")
        d %= max(x.dim(), 1)
        if d not in st:
            out = func(*args, **kwargs)
            self._set(out, st)
            return out
        self._routing("`unfold`")
        k = st.index(d)
        (lens,) = self._lengths([(k, int(x.shape[d]))], "forward guard: `unfold` (slab lengths)")
        total = sum(lens)
        if size > total or size < 0 or step <= 0:
            func(x.new_empty((total,)), 0, size, step)  # torch's own error, alike on every rank
        starts = [sum(lens[:r]) for r in range(len(lens))]
        if any(a % step for a, n in zip(starts, lens) if n):
            # As a strided convolution or pool: windows every ``step`` rows line up with the
            # tensors around them (a ``repeat_interleave`` back, a pointwise call with the
            # source) only where every slab starts on a window.
            self.fail("`unfold`", f"windows every {step} rows along sharded dim {d} need every slab to start at a "
                      f"multiple of {step}, but the slabs start at {tuple(starts)} (sizes {tuple(lens)})",
                      f"shard the input with align a multiple of {step} (sharded_nn.alignment)")
        windows = (total - size) // step + 1
        blocks, start = [], 0
        for n in lens:
            first, last = -(-start // step), min((start + n - 1) // step, windows - 1)
            blocks.append((first * step, last * step + size - 1) if n and first <= last else (0, -1))
            start += n
        mine = axis_index(self.guard.mesh, self.guard.axes[k])
        lo, hi = blocks[mine]
        y = halo_gather(x, HaloGather.of_blocks(d, lens, blocks), axis_peers(self.guard.mesh, self.guard.axes[k]))
        if hi < lo:  # no window starts here: none, still through ``x``'s graph
            out = (y.narrow(d, 0, 0).unsqueeze(-1) * 0).expand(*y.shape[:d], 0, *y.shape[d + 1:], size)
        else:
            out = y.unfold(d, size, step)
        scope_forget()  # the windows' layout is new (alike on every rank)
        self._set(out, st)
        return out

    def _flip(self, func, base, args, kwargs):
        """``flip`` of a slab (test-time augmentation, a mirrored branch; refused before session
        62): along unsharded dims local; along a sharded dim each rank takes the rows that the
        flipped whole sample puts in its slab (the mirror of its range, fetched from their owners
        by ``comm.halo_gather``, gradients back) and flips them, so the layout stays the input's."""
        from .comm import axis_peers
        from .comm.halo import HaloGather, halo_gather

        x = args[0]
        st = self._st(x)
        if base == "flip":  # torch.flip(x, dims), or x.flip(d0, d1, ...)
            dims = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else _arg(
                args, kwargs, 1, "dims")
            dims = _norm_dims([dims] if isinstance(dims, int) else list(dims), x.dim())
        else:
            dims = (1,) if base == "fliplr" else (0,)
        y = x
        for d in [d for d in dims if d in st]:
            self._routing(f"`{base}`")
            k = st.index(d)
            (lens,) = self._lengths([(k, int(y.shape[d]))], f"forward guard: `{base}` (slab lengths)")
            total, starts = sum(lens), [sum(lens[:r]) for r in range(len(lens))]
            mirrored = [(total - a - n, total - a - 1) for a, n in zip(starts, lens)]
            y = halo_gather(y, HaloGather.of_blocks(d, lens, mirrored), axis_peers(self.guard.mesh, self.guard.axes[k]))
        out = y.flip(dims)
        self._set(out, st)
        return out

    def _h_positions(self, func, base, args, kwargs, stateful):
        found: list = []
        _walk((args, kwargs), found)
        if not stateful and base in ("arange", "linspace", "logspace"):
            out = self._positions_of_rows(func, base, args, kwargs)
            if out is not None:
                return out
        if base == "meshgrid" and stateful and not any(_is_tagged(v) for v in found):
            return self._meshgrid(func, args, kwargs)
        if stateful or any(_is_tagged(v) for v in found):
            self.fail(
                f"`{base}`", "it builds a grid of positions from a slab's local size (local positions, not global ones)",
                "build position grids for the full domain before sharding and shard them with the input",
            )
        return func(*args, **kwargs)

    def _meshgrid(self, func, args, kwargs):
        """``torch.meshgrid`` of coordinate vectors, some of them slabs (``torch.linspace(-1, 1,
        x.shape[2])``: this rank's rows of the whole sample's coordinates): each output dim holds
        one input's positions, so the grids are slabs along the dims of the sharded inputs
        (``indexing="xy"`` swaps the first two), local and exact (refused before session 62: a
        coordinate grid for a CoordConv or a neural operator's position channels)."""
        tensors = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        dims = list(range(len(tensors)))
        if kwargs.get("indexing") == "xy" and len(dims) > 1:
            dims[0], dims[1] = 1, 0
        state: list = [None] * len(self.guard.axes)
        for i, t in enumerate(tensors):
            st = self._st(t)
            if st is None:
                continue
            if type(st) is not tuple or t.dim() != 1:
                self.fail("`meshgrid`", f"its input {i} is sharded along {self.describe(st)}, not a vector of "
                          "positions along one sharded dim", "")
            for k, d in enumerate(st):
                if d is not None:
                    if state[k] is not None:
                        self.fail("`meshgrid`", f"two of its inputs are sharded along mesh axis {self.guard.axes[k]!r}",
                                  "")
                    state[k] = dims[i]
        out = func(*args, **kwargs)
        self._set(out, tuple(state))
        return out

    def _positions_of_rows(self, func, base, args, kwargs):
        """``torch.arange(n)`` and ``torch.linspace/logspace(a, b, n)`` whose count ``n`` is a slab's
        local length: this rank's rows of the same call on the global length (a slab along
        dim 0), computed in full and cut, so the values are bitwise one device's. None where the
        call has another form (then it is refused as before)."""
        if base == "arange":
            return self._arange_rows(func, args, kwargs)
        else:
            at = 2 if len(args) > 2 else None
            n = args[2] if at is not None else kwargs.get("steps")
        if not isinstance(n, LocalLength) or isinstance(n, FoldLength):
            return None
        self._routing(f"`{base}`")
        k = n.axis
        (lengths,) = self._axis_lengths([n], f"forward guard: {base}")
        mine = axis_index(self.guard.mesh, self.guard.axes[k])
        total = sum(lengths)
        if at is None:
            kwargs = {**kwargs, "steps": total}
        else:
            args = (*args[:at], total, *args[at + 1 :])
        out = func(*args, **kwargs).narrow(0, sum(lengths[:mine]), int(n))
        state = [None] * len(self.guard.axes)
        state[k] = 0
        self._set(out, tuple(state))
        return out

    def _arange_rows(self, func, args, kwargs):
        """``torch.arange(start, end, step)`` with bounds computed from a slab's local length
        (``arange(n)``, ``arange(1, h + 1)``, ``arange(0, 2 * h, 2)``: XCiT's Fourier position
        encoding): where the call on the global lengths counts the global length and the call on
        this slab counts its local length, this rank's rows of the global call (one all-gather of
        the lengths; the values are bitwise one device's). None where it has another form."""
        if len(args) > 3 or any(k in kwargs for k in ("start", "end", "step")[: len(args)]):
            return None
        pos = dict(zip(("end",) if len(args) == 1 else ("start", "end", "step"), args))
        bounds = {"start": 0, "step": 1, **pos, **{k: kwargs[k] for k in ("start", "end", "step") if k in kwargs}}
        if "end" not in bounds:
            return None
        tagged = [v for v in bounds.values() if _is_tagged(v)]
        if not tagged or any(v._leaves is None for v in tagged):
            return None
        leaves = {id(leaf): leaf for v in tagged for leaf in v._leaves}
        if len({leaf.axis for leaf in leaves.values()}) != 1 or any(isinstance(f, FoldLength) for f in leaves.values()):
            return None
        order = list(leaves.values())
        self._routing("`arange`")
        lengths = self._axis_lengths(order, "forward guard: arange")
        if any(col != lengths[0] for col in lengths):
            return None  # sizes of slabs laid out differently: no one row layout to follow

        def bounds_at(value_of: dict) -> dict:  # the bounds with every leaf given a value
            return {k: (v._fn([value_of[id(leaf)] for leaf in v._leaves]) if _is_tagged(v) else v)
                    for k, v in bounds.items()}

        def count(b: dict) -> int:
            return max(0, math.ceil((float(b["end"]) - float(b["start"])) / float(b["step"])))

        rows = lengths[0]
        # Every rank's count from the gathered lengths (not only this rank's), so that all decide alike.
        counts = [count(bounds_at({id(leaf): col[j] for leaf, col in zip(order, lengths)})) for j in range(len(rows))]
        glob = bounds_at({id(leaf): sum(col) for leaf, col in zip(order, lengths)})
        if counts != list(rows) or count(glob) != sum(rows):
            return None  # not one position per row of the slab (e.g. arange(h // 2)): refused
        rest = {k: v for k, v in kwargs.items() if k not in ("start", "end", "step")}
        full = func(glob["start"], glob["end"], glob["step"], **rest)
        if full.shape[0] != sum(rows):  # (float bounds: torch's own count, the same on every rank)
            return None
        k = order[0].axis
        mine = axis_index(self.guard.mesh, self.guard.axes[k])
        out = full.narrow(0, sum(rows[:mine]), rows[mine])
        state = [None] * len(self.guard.axes)
        state[k] = 0
        self._set(out, tuple(state))
        return out

    def _h_create(self, func, base, args, kwargs, stateful):
        if base in ("full", "new_full"):
            i = 2 if base == "new_full" else 1
            fill = _arg(args, kwargs, i, "fill_value")
            if _is_tagged(fill):  # a value: the global number (``torch.full(shape, x.shape[2])``)
                fill = self._global_values([fill], f"`{base}`")[id(fill)]
                if "fill_value" in kwargs:
                    kwargs = {**kwargs, "fill_value": fill}
                else:
                    args = (*args[:i], fill, *args[i + 1 :])
        out = func(*args, **kwargs)
        self._set(out, self._sized_state(_created_sizes(base, args, kwargs), f"`{base}`"))
        return out

    def _h_random(self, func, base, args, kwargs, stateful):
        """A random draw, from the stream that matches what the drawn tensor is (``random_streams``).

        The layout of the drawn values decides: a tensor with no sharded dim (a drop-path
        decision per sample, a channel-dropout mask, dropout of pooled features) is drawn alike
        on every domain rank; a slab's values are drawn independently by the ranks holding
        different parts of it. The draw itself is torch's own call, run with the device's
        default generator seeded from that stream (and restored afterwards). A caller's own
        ``generator=`` is left alone.
        """
        if kwargs.get("generator") is not None:
            if base in _RANDOM_CREATE and not any(isinstance(a, torch.Tensor) for a in args):
                return self._h_create(func, base, args, kwargs, stateful)
            return self._h_pointwise(func, base, args, kwargs, stateful)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if base in ("dropout", "alpha_dropout") or base in _FEATURE_DROPOUT:
            p = float(_arg(args, kwargs, 1, "p", 0.5))
            if not _arg(args, kwargs, 2, "training", True) or p == 0.0:
                out = func(*args, **kwargs)
                self._set(out, self._st(x))
                return out
        if base in _RANDOM_CREATE and x is None and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            st = self._sized_state(_created_sizes(base, args, kwargs), f"`{base}`")
            device = _created_device(kwargs)
            out = self._draw(func, args, kwargs, st, device)
            self._set(out, st)
            return out
        if base == "randperm":
            if stateful or any(_is_tagged(a) for a in args):
                self.fail("`randperm`", "its length is read from a slab's local size", "use a global length")
            device = _created_device(kwargs)
            return self._draw(func, args, kwargs, None, device)
        tensors = _flat_tensors((args, kwargs))
        like = max(tensors, key=lambda t: t.dim())  # the output's rank (a pointwise draw)
        st = self._broadcast(base, args, kwargs, like)
        if st is UNKNOWN:
            self.fail(f"`{base}`", "it draws random values for a tensor whose layout the guard lost", "")
        if base == "multinomial" and st is not None:
            self.fail("`multinomial`", f"it samples rows of a slab ({self.describe(st)})",
                      "sample from replicated probabilities")
        noise = st
        if st is not None and base in _FEATURE_DROPOUT:
            # One mask entry per (sample, channel): the mask varies along dims 0 and 1 only.
            ranks = _FEATURE_DROPOUT[base]
            varying = (0, 1) if ranks is None or x.dim() in ranks else (0,)
            noise = tuple(d if d in varying else None for d in st)
        out = self._draw(func, args, kwargs, noise, like.device)
        self._set(out, None if base == "multinomial" else st)
        return out

    def _draw(self, func, args, kwargs, noise_state, device: torch.device):
        """Run the random call ``func`` on the stream of a tensor sharded like ``noise_state``."""
        from .random_streams import RandomStreams, run_seeded

        self._routing(f"a random draw (`{getattr(func, '__name__', func)}`)")
        if self.streams is None:
            # Once per forward that draws: domain rank 0's draw from its default generator (so
            # torch.manual_seed makes runs repeatable), offset by the data-parallel index.
            from .mesh import axis_index, data_axis

            seed = int(torch.randint(0, (1 << 62) - 1, (1,)).item())
            rows = self._gather_with_coords([seed], "forward guard: random seed")
            seed = min(rows)[-1]
            data = data_axis(self.guard.mesh)
            if data is not None:
                seed += 1_000_003 * axis_index(self.guard.mesh, data)
            self.streams = RandomStreams(seed, [axis_index(self.guard.mesh, a) for a in self.guard.axes])
        sharded = [False] * len(self.guard.axes) if noise_state is None else [d is not None for d in noise_state]
        return run_seeded(func, args, kwargs, self.streams.next_seed(self.streams.key(sharded)), device)

    def _h_roll(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        shifts = _arg(args, kwargs, 1, "shifts")
        dims = _arg(args, kwargs, 2, "dims")
        if st is None:
            return self._plain_or_fail(func, base, args, kwargs, [])
        if dims is None or (isinstance(dims, (tuple, list)) and len(dims) == 0):
            self.fail("`roll`", "it rolls the flattened slab", "pass dims=...")
        # A shift computed from a slab's size (``torch.roll(x, x.shape[2] // 2, 2)``, a centred
        # spectrum written by hand) is a value: the single device's number, from the global
        # sizes (it was refused before session 59).
        (shifts,), _ = self._globalise("`roll`", (shifts,), {})
        shifts = [shifts] if isinstance(shifts, int) else list(shifts)
        dims = [dims] if isinstance(dims, int) else list(dims)
        out = x
        local_s, local_d = [], []
        for s, d in zip(shifts, dims):
            d = d % x.dim()
            if d in st:
                from .comm.shift import periodic_shift

                self._routing("roll")
                active = tuple(a for a in st if a is not None)
                if tuple(st[: len(active)]) != active:
                    self.fail("`roll`", "the tensor is sharded by a later mesh axis only", "")
                out = periodic_shift(out, int(s), d, self.guard.mesh, active, what="torch.roll (forward guard)")
            else:
                local_s.append(int(s))
                local_d.append(d)
        if local_s:
            out = torch.roll(out, local_s, local_d)
        self._set(out, st)
        return out

    def _h_linear(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        if any(self._st(a) is not None for a in args[1:] if isinstance(a, torch.Tensor)):
            self.fail("`linear`", "its weight is a slab", "")
        if st is not None and (x.dim() - 1) in st:
            self.fail("`linear`", f"it contracts the last dim, which is sharded ({self.describe(st)})",
                      "permute the sharded dim away from the last position first")
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_matmul(self, func, base, args, kwargs, stateful):
        a, b = args[0], args[1]
        if base == "rmatmul":
            a, b = b, a
        self._require_known(base, stateful)
        sa, sb = self._st(a), self._st(b)
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2 or b.dim() < 2:
            if sa is not None or sb is not None:
                self.fail("`matmul`", "a vector operand of a slab is not mapped", "")
            return func(*args, **kwargs)
        if sa is not None and sb is not None and (a.dim() - 1) in sa and (b.dim() - 2) in sb:
            return self._contract_tokens(func, args, kwargs, a, b, sa, sb)
        # Attention written out (``q @ k.transpose(-2, -1)``, then ``probs @ v``): where one
        # operand shards a dim the product needs whole (the contracted dim, or a free dim of the
        # second operand whose mesh axis already shards the first operand's rows), that operand
        # is gathered along it (``_gather_dim``): each rank then computes its own rows of the
        # single device's product, with the keys and values of every rank.
        nd = max(a.dim(), b.dim())
        if sa is not None and (a.dim() - 1) in sa:
            a = self._gather_dim(a, a.dim() - 1, sa.index(a.dim() - 1), "matmul")
            sa = self._st(a)
        if sb is not None and (b.dim() - 2) in sb:
            b = self._gather_dim(b, b.dim() - 2, sb.index(b.dim() - 2), "matmul")
            sb = self._st(b)
        if sa is not None and sb is not None:
            for k, (da, db) in enumerate(zip(sa, sb)):
                if da is None or db is None:
                    continue
                oa = nd - 2 if da == a.dim() - 2 else da + nd - a.dim()
                ob = nd - 1 if db == b.dim() - 1 else db + nd - b.dim()
                if oa != ob and ob == nd - 1:
                    b = self._gather_dim(b, db, k, "matmul")
                    sb = self._st(b)
        args = (b, a, *args[2:]) if base == "rmatmul" else (a, b, *args[2:])
        out = func(*args, **kwargs)
        nd = out.dim()
        res = None
        for t, s, kind in ((a, sa, "a"), (b, sb, "b")):
            if s is None:
                continue
            mapped = []
            for d in s:
                if d is None:
                    mapped.append(None)
                elif kind == "a" and d == t.dim() - 2:
                    mapped.append(nd - 2)
                elif kind == "b" and d == t.dim() - 1:
                    mapped.append(nd - 1)
                else:
                    mapped.append(d + nd - t.dim())
            mapped = tuple(mapped)
            if res is None:
                res = mapped
            elif res != mapped:
                self.fail("`matmul`", "both operands are sharded along different output dims", "")
        if (sa is None) != (sb is None):
            # The plain operand must not vary along the batch dims that the slab shards.
            t = a if sa is None else b
            for d in res:
                if d is not None and d < nd - 2:
                    i = d - (nd - t.dim())
                    if 0 <= i < t.dim() and t.shape[i] > 1:
                        self.fail("`matmul`", "a plain operand varies along a sharded batch dim", "")
        self._set(out, res)
        return out

    def _ring_dropout(self, dropout_p: float) -> dict:
        """``ring_attention``'s dropout options: one mask law on every rank
        (attention_kernels.dropout_keep), domain rank 0's draw from its default generator, as
        nn.Dropout draws from it (same law, not the same bits); {} without dropout."""
        if dropout_p <= 0:
            return {}
        seed = int(torch.randint(0, 1 << 62, (1,)).item())
        rows = self._gather_with_coords([seed], "forward guard: attention dropout seed")
        return {"dropout_p": dropout_p, "dropout_seed": min(rows)[-1]}

    def _sdpa_whole_keys(self, q, k, v, attn_mask, dropout_p, is_causal, scale, gqa):
        """Attention with an ``attn_mask`` (a relative-position bias, a padding or window mask) over
        keys sharded along their tokens: every rank gathers the whole keys and values and attends
        with its own query rows of the mask (a mask sized for the whole sequence along the query
        dim gives each rank its rows, ``_whole_domain_rows``; one query position broadcasts).
        Exact, at the single device's memory for K and V; the probabilities are this rank's rows
        only."""
        name = "`scaled_dot_product_attention`"
        if dropout_p > 0:
            self.fail(name, "attention dropout with an attn_mask over keys sharded along their tokens is not routed",
                      "set the attention's dropout to 0 (or eval mode) for this call")
        if is_causal:
            self.fail(name, "is_causal together with an attn_mask", "")
        tok = q.dim() - 2
        axis = self._st(k).index(tok)
        kf = self._gather_dim(k, tok, axis, "scaled_dot_product_attention")
        vf = self._gather_dim(v, tok, axis, "scaled_dot_product_attention")
        sm, sq = self._st(attn_mask), self._st(q)
        if sm is not None:
            rows_only = sm is not UNKNOWN and all(d is None for d in sm[:axis] + sm[axis + 1:])
            if not rows_only or sm[axis] != attn_mask.dim() - 2 or sq is None:
                self.fail(name, f"its attn_mask is a slab sharded along {self.describe(sm)}: only the query rows "
                          "of this rank's queries are mapped", "")
        else:
            rows = self._whole_domain_rows("scaled_dot_product_attention", [q, attn_mask])
            if rows is not None:
                attn_mask = rows[id(attn_mask)]
        out = F.scaled_dot_product_attention(q, kf, vf, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
        self._set(out, sq)
        return out

    def _gather_dim(self, t: torch.Tensor, d: int, k: int, call: str) -> torch.Tensor:
        """The whole of slab ``t`` along its dim ``d`` (sharded by mesh axis ``k``), from every
        rank along that axis; differentiable (its backward sums the ranks' gradients and keeps
        this rank's rows). The result is not sharded by axis ``k``. One small all-gather of the
        local lengths (checked alike on every rank) and one of the data."""
        from .comm import all_gather_grid
        from .mesh import group_over

        self._routing(call)
        rows = self._gather_with_coords([int(t.shape[d])], f"forward guard: {call} (whole operand)")
        lengths = [r[0] for r in self._along_axis(rows, k)]
        axis = self.guard.axes[k]
        out = all_gather_grid(t, group_over(self.guard.mesh, [axis]), (d,), [(r,) for r in range(len(lengths))],
                              [lengths], axis_index(self.guard.mesh, axis))
        st = list(self.states.get(t))
        st[k] = None
        self._set(out, None if all(v is None for v in st) else tuple(st))
        return out

    def _contract_tokens(self, func, args, kwargs, a, b, sa, sb):
        """``a @ b`` contracting a dim both operands shard along one mesh axis (linear attention's
        ``k^T v``): the local product summed over that axis, a value replicated over it."""
        from .comm import all_reduce_sum
        from .mesh import group_over

        self._routing("matmul")
        ka, kb = sa.index(a.dim() - 1), sb.index(b.dim() - 2)
        others = [d for i, d in enumerate(sa) if i != ka and d is not None] + [
            d for i, d in enumerate(sb) if i != kb and d is not None]
        if ka != kb or others:
            self.fail("`matmul`", "it contracts dims sharded by different mesh axes, or its operands are sharded "
                      "along more than the contracted dim", "")
        # Both operands must hold the same positions along the contracted dim on every rank;
        # equal local lengths everywhere are checked on every rank alike (a tiny all-gather), so
        # that a mismatch raises everywhere instead of leaving the others in the sum.
        rows = self._gather_with_coords([int(a.shape[-1]), int(b.shape[-2])], "forward guard: matmul")
        bad = [tuple(r[len(self.guard.axes):]) for r in rows if r[-1] != r[-2]]
        if bad:
            self.fail("`matmul`", f"its operands' local lengths along the contracted sharded dim differ ({bad}): "
                      "they are not slabs of one layout", "")
        axis = self.guard.axes[ka]
        out = all_reduce_sum(func(*args, **kwargs), group_over(self.guard.mesh, [axis]))
        self._set(out, None)
        return out

    def _h_einsum(self, func, base, args, kwargs, stateful):
        """``torch.einsum`` over slabs, mapped by subscript letter, one mesh axis at a time.

        A letter sharded by an axis in one operand is either kept (the first operand's) or, where
        another operand shards a different letter by the same axis (``bhxd,bhyd->bhxy``: query
        rows and key columns), that operand is gathered whole along it (``_gather_dim``: the
        keys, the values of ``bhxy,bhyd->bhxd``). An operand that holds the kept letter whole (a
        parameter, a bias) gives this rank's rows of it. The kept letter is then sharded in the
        output, or, contracted, the local einsum is summed over the axis (local lengths checked
        alike on every rank). Explicit subscripts only.
        """
        eq = args[0] if args else kwargs.get("equation")
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
        if not isinstance(eq, str) or not ops or any(not isinstance(t, torch.Tensor) for t in ops):
            self.fail("`einsum`", "only string equations (not the sublist form) are mapped, and it receives "
                      f"{self._what(stateful, False)}", "write it with a subscript string, or with matmul / permute")
        self._require_known(base, stateful)
        if "..." in eq:
            eq = _explicit_einsum(eq, ops)
            if eq is None:
                return func(*args, **kwargs)  # torch's own error
        lhs, arrow, rhs = eq.replace(" ", "").partition("->")
        subs = lhs.split(",")
        if not arrow:  # implicit output: the letters used once, in alphabetical order
            rhs = "".join(sorted(c for c in set(lhs) if c.isalpha() and lhs.count(c) == 1))
        if len(subs) != len(ops) or any(len(sub) != t.dim() for sub, t in zip(subs, ops)):
            return func(*args, **kwargs)  # torch's own error
        self._routing("einsum")
        out_state: list = [None] * len(self.guard.axes)
        summed: list[int] = []
        for k in range(len(self.guard.axes)):
            held = [(i, subs[i][st[k]]) for i, st in ((i, self._st(t)) for i, t in enumerate(ops))
                    if st is not None and st[k] is not None]
            if not held:
                continue
            letter = held[0][1]
            for i, other in held[1:]:
                if other != letter:
                    ops[i] = self._gather_dim(ops[i], subs[i].index(other), k, "einsum")
            holders = [i for i, sub in enumerate(subs) if letter in sub]
            sharded = [i for i in holders if (self._st(ops[i]) or (None,) * (k + 1))[k] is not None]
            lengths = [int(ops[i].shape[subs[i].index(letter)]) for i in sharded]
            rows = self._gather_with_coords(lengths, "forward guard: einsum")
            along = self._along_axis(rows, k)
            if any(len(set(r)) != 1 for r in along):
                self.fail("`einsum`", f"its operands' local lengths along letter {letter!r}, sharded by mesh axis "
                          f"{self.guard.axes[k]!r}, differ ({along}): they are not slabs of one layout", "")
            lens = [r[0] for r in along]
            mine = axis_index(self.guard.mesh, self.guard.axes[k])
            start, total = sum(lens[:mine]), sum(lens)
            for i in holders:
                if i in sharded:
                    continue
                d = subs[i].index(letter)
                if ops[i].shape[d] != total:
                    self.fail("`einsum`", f"operand {i} holds letter {letter!r} with {ops[i].shape[d]} positions, where "
                              f"another operand is a slab along it ({total} positions in all)", "")
                ops[i] = ops[i].narrow(d, start, lens[mine])
            if letter in rhs:
                out_state[k] = rhs.index(letter)
            else:
                summed.append(k)
        out = torch.einsum(eq, *ops)
        if summed:
            from .comm import all_reduce_sum
            from .mesh import group_over

            out = all_reduce_sum(out, group_over(self.guard.mesh, [self.guard.axes[k] for k in summed]))
        self._set(out, None if all(d is None for d in out_state) else tuple(out_state))
        return out

    def _h_sdpa(self, func, base, args, kwargs, stateful):
        q, k, v = args[0], args[1], args[2]
        self._require_known(base, stateful)
        if any(s is not None and (t.dim() - 2) in s for t, s in ((k, self._st(k)), (v, self._st(v)))):
            return self._route_sdpa(q, k, v, args, kwargs)
        sq = self._st(q)
        if sq is not None and (q.dim() - 1) in sq:
            self.fail("`scaled_dot_product_attention`", "its head dim is sharded", "")
        out = func(*args, **kwargs)
        self._set(out, sq if sq is not None else (self._st(k) or self._st(v)))
        return out

    def _route_sdpa(self, q, k, v, args, kwargs):
        """Attention over keys/values sharded along their token dim: ``functional.ring_attention``.

        Queries sharded along their token dim (the same mesh axis) get this rank's rows of the
        output; replicated queries (a pooling latent, a class token) attend over every rank's
        keys and get the replicated output. Tokens are in the guard's contiguous layout (slab
        order along the axis), as a flattened slab of a 1-D domain gives them.
        """
        from .comm.peers import domain_peers
        from .functional import _replicated_query_attention, ring_attention

        name = "`scaled_dot_product_attention`"
        self._routing(name)
        sq, sk, sv = self._st(q), self._st(k), self._st(v)
        attn_mask = _arg(args, kwargs, 3, "attn_mask")
        dropout_p = float(_arg(args, kwargs, 4, "dropout_p", 0.0))
        is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
        scale = _arg(args, kwargs, 6, "scale")
        gqa = bool(_arg(args, kwargs, 7, "enable_gqa", False))
        if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
            self.fail(name, f"keys/values sharded along their tokens need (N, L, E) or (N, H, L, E) operands, got "
                      f"{q.dim()}-d / {k.dim()}-d / {v.dim()}-d", "")
        tok = q.dim() - 2
        if sk != sv or tok not in sk or any(d is not None and d != tok for d in sk):
            self.fail(name, "its keys and values are not sharded alike along their token dim only", "")
        if sq is not None and (sq != sk):
            self.fail(name, "its queries are sharded other than along their token dim by the keys' mesh axis", "")
        if attn_mask is not None:
            return self._sdpa_whole_keys(q, k, v, attn_mask, dropout_p, is_causal, scale, gqa)
        if sq is None and is_causal:
            self.fail(name, "causal attention of replicated queries over sharded keys has no global positions", "")
        if len(self.guard.axes) != 1:
            self.fail(name, "keys sharded along their tokens on a domain mesh of more than one axis", "")
        if sq is None and dropout_p > 0:
            self.fail(name, "attention dropout of replicated queries over sharded keys is not routed",
                      "set the attention's dropout to 0 (or eval mode) for this call")
        q4, k4, v4 = (t.unsqueeze(1) for t in (q, k, v)) if q.dim() == 3 else (q, k, v)
        if q4.shape[0] != k4.shape[0] or k4.shape[:2] != v4.shape[:2]:
            self.fail(name, f"batch or head sizes of q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                      "differ (broadcast batch dims are not routed)", "")
        if q4.shape[1] != k4.shape[1] and not (gqa and q4.shape[1] % k4.shape[1] == 0):
            self.fail(name, f"{q4.shape[1]} query heads against {k4.shape[1]} key/value heads without enable_gqa", "")
        drop = self._ring_dropout(dropout_p)
        mesh = self.guard.mesh
        if sq is not None:
            out = ring_attention(q4, k4, v4, mesh, is_causal, scale, **drop)
            state = sq
        else:
            # Keys and values must hold the same tokens on every rank (ring attention's own plan
            # checks that; this path has no plan): checked on every rank alike.
            rows = self._gather_with_coords([int(k4.shape[2]), int(v4.shape[2])], "forward guard: attention")
            if any(r[-1] != r[-2] for r in rows):
                self.fail(name, f"its keys and values hold different numbers of tokens on some rank "
                          f"({[tuple(r[-2:]) for r in rows]})", "")
            out = _replicated_query_attention(q4, k4, v4, domain_peers(mesh), scale)
            state = None
        out = out.squeeze(1) if q.dim() == 3 else out
        self._set(out, state)
        return out

    def _spatial_hit(self, st, x) -> list[int]:
        return [d for d in st if d is not None and d >= 2 and d < x.dim()] if st not in (None, UNKNOWN) else []

    def _h_conv(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        w = _arg(args, kwargs, 1, "weight")
        if self._st(w) is not None:
            self.fail(f"`{base}`", "its weight is a slab", "")
        hit = self._spatial_hit(st, x)
        if hit:
            stride = _arg(args, kwargs, 3, "stride", 1)
            padding = _arg(args, kwargs, 4, "padding", 0)
            ks = tuple(w.shape[2:])
            ones = all(k == 1 for k in ks) and all(s == 1 for s in ((stride,) if isinstance(stride, int) else stride))
            nopad = padding in ("valid", "same") or all(p == 0 for p in ((padding,) if isinstance(padding, int) else padding))
            if not (ones and nopad and "transpose" not in base):
                if "transpose" in base:
                    self.fail(f"`{base}`", f"a {ks} transposed convolution mixes positions along sharded dim(s) {hit}",
                              "use an nn.ConvTranspose module (convert swaps it for its sharded class)")
                if x.dim() != w.dim():
                    self.fail(f"`{base}`", f"a {ks} convolution of an unbatched input mixes positions along sharded "
                              f"dim(s) {hit}", "use an nn.Conv module (convert swaps it for its sharded class)")
                # A convolution by weights the model computes itself (weight standardisation, fixed
                # filters): the sharded convolution of those weights, halo exchange included.
                from .layers.conv import conv as sharded_conv

                self._routing(base)

                dims = self._grid_dims(base, x, st)
                names = ("bias", "stride", "padding", "dilation", "groups")
                call = [_arg(args, kwargs, i + 2, nm, df) for i, (nm, df) in enumerate(zip(names, (None, 1, 0, 1, 1)))]
                geometry = [v for c in call[1:] for v in (c if isinstance(c, (list, tuple)) else (c,))]
                if any(_is_tagged(v) for v in geometry):
                    self.fail(f"`{base}`", "its stride, padding, dilation or groups are computed from a slab's local "
                              "size (they would be different for the full tensor)", "compute them from global sizes")
                out = sharded_conv(x, w, *call, mesh=self.guard.mesh, dims=dims)
                self._set(out, st)
                return out
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_batch_norm(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        training = _arg(args, kwargs, 5, "training", False)
        running = _arg(args, kwargs, 1, "running_mean")
        if st is not None and any(d != 1 for d in st if d is not None) and (training or running is None):
            self.fail("`batch_norm`", "batch statistics are taken over the sharded dims (training mode)",
                      "use nn.BatchNorm (convert swaps it for ShardedBatchNorm), or eval mode")
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_trailing_norm(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        shape = _arg(args, kwargs, 1, "normalized_shape")
        k = 1 if isinstance(shape, int) else len(shape)
        if st is not None and any(d is not None and d >= x.dim() - k for d in st):
            self.fail(f"`{base}`", "it normalises over a sharded dim", "")
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_spatial_norm(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        if self._spatial_hit(st, x):
            if base == "group_norm":
                # A group norm the model calls itself (timm's GroupNorm1 subclasses, e.g.
                # MetaFormer's GroupNorm1NoBias): the sharded group norm of the weights it passes.
                names, defaults = ("num_groups", "weight", "bias", "eps"), (None, None, None, 1e-5)
                call = [_arg(args, kwargs, i + 1, nm, df) for i, (nm, df) in enumerate(zip(names, defaults))]
                return self._route_group_norm(base, x, st, *call)
            # instance_norm(x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
            names = ("running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")
            defaults = (None, None, None, None, True, 0.1, 1e-5)
            rm, rv, w, b, use_input_stats, _, eps = (_arg(args, kwargs, i + 1, nm, df)
                                                     for i, (nm, df) in enumerate(zip(names, defaults)))
            if use_input_stats:
                if rm is not None or rv is not None:
                    self.fail(f"`{base}`", "it takes statistics over the sharded dims and updates running statistics",
                              "use nn.InstanceNorm modules (convert swaps them)")
                # Statistics per (sample, channel) over every position: a group norm of one
                # channel per group, routed as above.
                return self._route_group_norm(base, x, st, x.shape[1], w, b, eps)
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _route_group_norm(self, base, x, st, num_groups, weight, bias, eps):
        from .layers.norm import group_norm

        if any(_is_tagged(v) for v in (num_groups, eps)):
            self.fail(f"`{base}`", "its groups or eps are computed from a slab's local size", "compute them from global sizes")
        if self._st(weight) is not None or self._st(bias) is not None:
            self.fail(f"`{base}`", "its weight or bias is a slab", "")
        self._routing(base)
        dims = self._grid_dims(base, x, st)
        out = group_norm(x, int(num_groups), weight, bias, float(eps), mesh=self.guard.mesh, dims=dims)
        self._set(out, st)
        return out

    def _h_channel_op(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        if st is not None and 1 in st:
            self.fail(f"`{base}`", "it acts along dim 1, which is sharded", "")
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_pixel_shuffle(self, func, base, args, kwargs, stateful):
        # Slab starts are sums of slab sizes, all multiples of the factor (else torch raises), so
        # the (un)shuffle of a slab is the slab of the (un)shuffle.
        x = args[0]
        st = self._st(x)
        self._require_known(base, stateful)
        r = Fraction(_arg(args, kwargs, 1, "upscale_factor" if base == "pixel_shuffle" else "downscale_factor"))
        if x.numel() == 0 and x.dim() >= 3 and r.denominator == 1:
            # torch (2.14) returns an empty input's shape unchanged from ``pixel_unshuffle`` (and
            # so from ``pixel_shuffle``'s backward, which unshuffles the gradient: a shape error
            # in backward); an empty slab (a deep stage with fewer rows than ranks) needs the
            # shape the other ranks' slabs get: their channels, and its own zero rows. There are
            # no values to move: a reshape, whose backward is exact.
            *lead, c, h, w = x.shape
            k = int(r)
            if (c % (k * k) if base == "pixel_shuffle" else h % k or w % k):
                # (What torch raises on the ranks whose slabs are not empty: raised here too.)
                raise RuntimeError(f"{base}: the input's shape {tuple(x.shape)} does not divide by the factor {k}")
            shape = (*lead, c // (k * k), h * k, w * k) if base == "pixel_shuffle" else (*lead, c * k * k, h // k, w // k)
            out = x.reshape(shape)
        else:
            out = func(*args, **kwargs)
        self._set(out, st)
        # Every sharded dim is a spatial one, scaled by the factor (the channel dim is not sharded).
        self._scope_resized(x, out, r if base == "pixel_shuffle" else 1 / r)
        return out

    def _h_embedding(self, func, base, args, kwargs, stateful):
        """``F.embedding(idx, weight)``: a whole table looked up by a slab of integers is the slab
        of the single device's lookup, sharded where ``idx`` is (``_plain_by_slab``)."""
        idx, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
        if not isinstance(idx, torch.Tensor) or idx not in self.states or weight in self.states:
            return self._plain_or_fail(func, base, args, kwargs, stateful)
        if _arg(args, kwargs, 3, "max_norm") is not None:  # renormalises the rows it reads, in place
            self.fail("`embedding`", "with max_norm it rescales the table rows each rank's slab reads, so the "
                      "ranks' tables would differ", "Renormalise the table before the forward")  # fmt: skip
        if _arg(args, kwargs, 5, "scale_grad_by_freq", False):  # counts each index on this slab only
            self.fail("`embedding`", "with scale_grad_by_freq its gradient divides by how often each index "
                      "occurs in the slab, not in the whole input", "Use scale_grad_by_freq=False")  # fmt: skip
        state = self._plain_by_slab(weight, idx)  # the weight's rows: dim 0, index dims first
        out = func(*args, **kwargs)
        self._set(out, state)
        return out

    def _h_literal(self, func, base, args, kwargs, stateful):
        """``torch.tensor(v)`` and kin: a number computed from slab sizes stands for the global one."""
        if stateful:
            return self._h_other(func, base, args, kwargs, stateful)
        args, kwargs = self._globalise(f"`{base}`", args, kwargs)
        return func(*args, **kwargs)

    def _h_other(self, func, base, args, kwargs, stateful):
        self.fail(f"`{base}`", f"the guard does not know this call, and it receives {self._what(stateful, bool(not stateful))}",
                  "")

    # -- routed grid ops ---------------------------------------------------------------------------

    def _grid_dims(self, base, x, st, n_spatial: int | None = None) -> tuple[int, ...]:
        """Sharded dims of ``x`` that a grid op acts on; checks they follow the mesh's axes."""
        if st is UNKNOWN:
            self.fail(f"`{base}`", "it receives a tensor whose layout the guard lost", "")
        hit = self._spatial_hit(st, x)
        if not hit:
            return ()
        active = tuple(d for d in st if d is not None)
        if tuple(st[: len(active)]) != active or set(active) != set(hit):
            self.fail(f"`{base}`", f"the tensor is sharded along {self.describe(st)}, which is not a grid layout "
                      "(N, C, S0, ...) sharded along spatial dims", "")
        return active

    def _h_interpolate(self, func, base, args, kwargs, stateful):
        from .layers.upsample import interpolate

        x = args[0]
        st = self._st(x)
        dims = self._grid_dims(base, x, st)
        if not dims:
            return self._passthrough_plain_sizes(func, base, args, kwargs, st)
        self._routing("interpolate")
        names = ["size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias"]
        call = {n: _arg(args, kwargs, i + 1, n) for i, n in enumerate(names)}
        if base == "upsample_bilinear":
            call["mode"], call["align_corners"] = "bilinear", True
        call["mode"] = call["mode"] or "nearest"
        call["antialias"] = bool(call["antialias"])
        n = x.dim() - 2
        size = call["size"]
        if size is not None:
            sizes = [size] * n if isinstance(size, int) else list(size)
            # Per sharded dim: (tagged local length?, requested, local input length).
            facts = []
            for d in dims:
                v = sizes[d - 2]
                facts += [int(isinstance(v, LocalLength)), int(v), int(x.shape[d])]
            rows = self._gather_with_coords(facts, "forward guard: interpolate")
            glob = list(sizes)
            moves = []  # (dim, axis, output lengths by rank, wanted lengths by rank)
            for k, d in enumerate(dims):
                col = [(r[3 * k], r[3 * k + 1], r[3 * k + 2]) for r in self._along_axis(rows, k)]
                glob[d - 2] = self._global_size(col, d, sizes[d - 2])
                if col[0][0]:
                    moves.append((d, k, _interpolated_lengths([c[2] for c in col], glob[d - 2]),
                                  tuple(c[1] for c in col)))
            size = [int(v) for v in glob]
        return_state = st
        out = interpolate(
            x, self.guard.mesh, size, call["scale_factor"], call["mode"], call["align_corners"],
            call["recompute_scale_factor"], call["antialias"], dims=dims, what="F.interpolate (forward guard)",
        )
        if size is not None:
            # A size read from a tensor (``size=skip.shape[2:]``, GhostNet-v3's gate
            # ``size=out.shape[-2:]``): the output is laid out as that tensor, which the model then
            # adds to it or concatenates with it, as on one device. The interpolation's own layout
            # follows its input's slabs (each rank the outputs its input rows start), which differs
            # where a pool floored an odd length: the rows move to the size's slabs (before session
            # 52 the sum raised on the ranks whose lengths differed and ran on the others, a hang).
            from .comm import axis_peers
            from .comm.rebalance import move_rows

            for d, k, have, want in moves:
                if have != want:
                    out = move_rows(out, d, have, want, axis_peers(self.guard.mesh, self.guard.axes[k]))
        self._set(out, return_state)
        return out

    def _global_size(self, col, d: int, v) -> int:
        """The global output size along sharded ``d`` from the axis ranks' (tagged, size, input size)."""
        if any(c[0] for c in col) and not all(c[0] for c in col):
            self.fail("`interpolate`", "ranks disagree on where the size comes from", "")
        if col[0][0]:
            # A local length of a slab: the global size is the sum over the axis.
            return sum(c[1] for c in col)
        values = {c[1] for c in col}
        total_local = sum(c[1] for c in col)
        as_local = _interpolated_lengths([c[2] for c in col], total_local) == tuple(c[1] for c in col)
        as_global = len(values) == 1 and not _is_tagged(v)
        if as_local and not as_global:
            return total_local
        if as_global and not as_local:
            return col[0][1]
        if as_global and as_local:
            self.fail("`interpolate`", f"its size {col[0][1]} along sharded dim {d} could be a global size or this "
                      "slab's local size", "pass scale_factor=..., or take the size from a tensor's shape "
                      "(size=skip.shape[2:]), which the guard tracks")
        self.fail("`interpolate`", f"its sizes along sharded dim {d} ({[c[1] for c in col]} by rank) are neither one "
                  "global size nor the local sizes of slabs of one tensor", "pass scale_factor=... or a global size")

    def _routing(self, call: str) -> None:
        """Called where the guard computes a call with its sharded form (or draws from its streams).

        Inside ``torch.utils.checkpoint`` (timm's ``set_grad_checkpointing``), the region's forward
        runs again in backward, where no guard runs: this call would then be computed on the slab
        alone (or drawn from another stream) and the gradients would be silently wrong. So it is
        refused there, except in a region made by ``sharded_nn.activation_checkpoint``, whose
        recomputation runs under the guard.
        """
        if self.regions == 0 and _inside_torch_checkpoint():
            self.fail(
                call if call.startswith(("`", "a ")) else f"`{call}`",
                "it runs inside torch.utils.checkpoint (activation checkpointing, e.g. timm's set_grad_checkpointing), "
                "whose recomputation in backward runs without the forward guard, so the gradients would be computed "
                "from this slab alone",
                "checkpoint such regions with sharded_nn.activation_checkpoint(fn, *args) (recomputed under the guard), "
                "or turn activation checkpointing off for them",
            )

    def _globalise(self, call: str, args, kwargs):
        """``args`` and ``kwargs`` with every number computed from slab sizes (``LocalDerived``,
        ``LocalFloat``) replaced by the same arithmetic on the global sizes: a size read from a
        slab is this rank's part of the global one, and where it is used as a *value* the single
        device would use the global number. One small all-gather of the local lengths."""
        found: list = []
        _walk((args, kwargs), found)
        tagged = [v for v in found if _is_tagged(v)]
        if not tagged:
            return args, kwargs
        glob = self._global_values(tagged, call)

        def sub(obj, depth=0):
            if _is_tagged(obj):
                return glob[id(obj)]
            if depth < 3 and isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
                return type(obj)(sub(o, depth + 1) for o in obj)
            if depth < 2 and isinstance(obj, dict):
                return {k: sub(o, depth + 1) for k, o in obj.items()}
            return obj

        return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}

    def _global_values(self, tagged: list, call: str) -> dict[int, int | float]:
        """``id(v) -> v`` evaluated on the global lengths, for tagged numbers ``tagged``."""
        if any(v._leaves is None for v in tagged):
            self.fail(call, "it uses as a value a number computed from the size of a tensor whose layout the guard lost",
                      "compute the number from global sizes")
        self._routing(call)
        leaves: dict[int, LocalLength] = {}
        for v in tagged:
            for leaf in v._leaves:
                leaves.setdefault(id(leaf), leaf)
        order = list(leaves.values())
        lengths = self._axis_lengths(order, f"forward guard: global sizes for {call}")
        total = {id(leaf): sum(col) for leaf, col in zip(order, lengths)}
        return {id(v): v._fn([total[id(leaf)] for leaf in v._leaves]) for v in tagged}

    def _axis_lengths(self, leaves: list, what: str) -> list[list[int]]:
        """Per ``LocalLength`` in ``leaves``: the local lengths of the ranks along its mesh axis that
        share this rank's other coordinates, in axis order (one all-gather for all of them); for a
        ``MergedLength``, of the ranks along all its axes."""
        rows = self._gather_with_coords([int(leaf) for leaf in leaves], what)
        n = len(self.guard.axes)
        mine = [axis_index(self.guard.mesh, a) for a in self.guard.axes]
        out = []
        for j, leaf in enumerate(leaves):
            axes = getattr(leaf, "axes", (leaf.axis,))
            sel = sorted((r for r in rows if all(r[i] == mine[i] for i in range(n) if i not in axes)),
                         key=lambda r: [r[i] for i in axes])
            out.append([r[n + j] for r in sel])
        return out

    def global_compare(self, op, a, b) -> bool:
        """``op(a, b)`` for a tagged ``a`` (and maybe ``b``) on the global sizes: a branch of the
        model's own code decided as one device decides it, alike on every rank."""
        tagged = [v for v in (a, b) if _is_tagged(v)]
        call = f"a comparison of sizes read from slabs (`{op.__name__}`)"
        glob = self._global_values(tagged, call)
        return bool(op(glob[id(a)], glob[id(b)] if _is_tagged(b) else b))

    def on_stack(self) -> bool:
        """Whether this mode is on torch's function-mode stack (not popped to run one of its own
        handlers, or suspended for a sharded layer)."""
        n = torch._C._len_torch_function_stack()
        return any(torch._C._get_function_stack_at(i) is self for i in range(n))

    def _gather_with_coords(self, facts, what: str):
        from .layers.base import gather_facts

        coords = [axis_index(self.guard.mesh, a) for a in self.guard.axes]
        return gather_facts(self.guard.mesh, what, local=[*coords, *facts])

    def _along_axis(self, rows, k: int):
        """Facts of the ranks along mesh axis ``k`` that share this rank's other coordinates, in axis order."""
        n = len(self.guard.axes)
        mine = [axis_index(self.guard.mesh, a) for a in self.guard.axes]
        sel = [r for r in rows if all(r[i] == mine[i] for i in range(n) if i != k)]
        return [tuple(r[n:]) for r in sorted(sel, key=lambda r: r[k])]

    def _passthrough_plain_sizes(self, func, base, args, kwargs, st):
        found: list = []
        _walk((args[1:], kwargs), found)
        x = args[0]
        size = _arg(args, kwargs, 1, "size") if base != "pad" else None
        if st is None and base != "pad" and isinstance(size, (list, tuple)) and len(size) == x.dim() - 2:
            # A map of one position per sharded dim (ASPP's pooled branch) resized to a slab's
            # local size is uniform along it: the slab of the same map resized to the global size.
            tags = {i: v for i, v in enumerate(size) if isinstance(v, LocalLength)}
            if tags and all(x.shape[2 + i] == 1 for i in tags) and not any(
                _is_tagged(v) for i, v in enumerate(size) if i not in tags
            ):
                out = func(*args, **kwargs)
                state = [None] * len(self.guard.axes)
                for i, v in tags.items():
                    state[v.axis] = 2 + i
                self._set(out, tuple(state))
                return out
        if any(isinstance(v, LocalLength) for v in found) and st is None:
            self.fail(f"`{base}`", "it resizes a tensor that is not a slab to a slab's local size (e.g. a position "
                      "embedding), which means different global positions on each rank", "")
        out = func(*args, **kwargs)
        self._set(out, st)
        return out

    def _h_pad(self, func, base, args, kwargs, stateful):
        from .comm.sizes import scope_forget
        from .layers.padding import pad as sharded_pad

        x = args[0]
        st = self._st(x)
        if st is None or st is UNKNOWN:
            if st is UNKNOWN:
                self.fail("`pad`", "it pads a tensor whose layout the guard lost", "")
            return self._passthrough_plain_sizes(func, base, args, kwargs, st)
        pad = list(_arg(args, kwargs, 1, "pad"))
        mode = _arg(args, kwargs, 2, "mode", "constant")
        value = _arg(args, kwargs, 3, "value")
        nd = x.dim()
        per_dim = {nd - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
        active = tuple(d for d in st if d is not None)
        touched = [d for d in active if d in per_dim]
        if not touched:
            out = func(*args, **kwargs)
            self._set(out, st)
            self._set_token(out, self._token(x))
            return out
        if tuple(st[: len(active)]) != active:
            self.fail("`pad`", "the tensor is sharded by a later mesh axis only", "")
        tagged = [v for d in touched for v in per_dim[d] if _is_tagged(v)]
        if tagged:
            # Amounts computed from sizes read from slabs are the single device's: evaluated on
            # the global sizes, alike on every rank (timm's Swin ``PatchMerging`` pads
            # ``H % 2`` rows: one row at the end of the whole image when its height is odd, which
            # the last rank adds; each slab's own parity differed by rank and was refused).
            glob = self._global_values(tagged, "`pad`")
            for d in touched:
                per_dim[d] = tuple(glob[id(v)] if _is_tagged(v) else v for v in per_dim[d])
            for d, (lo, hi) in per_dim.items():
                i = nd - 1 - d
                pad[2 * i : 2 * i + 2] = [lo, hi]
        facts = []
        for d in touched:
            facts += [int(per_dim[d][0]), int(per_dim[d][1])]
        # The slabs' lengths travel with the amounts: the sharded pad takes the layouts from here
        # (no agreement of its own), and the result's layout token names them (``guard_tokens``).
        n_axes = len(self.guard.axes)
        every = self._gather_with_coords([*facts, *(int(x.shape[d]) for d in active)], "forward guard: pad")
        rows = [tuple(r[n_axes : n_axes + len(facts)]) for r in every]
        if len(set(rows)) != 1:
            self.fail("`pad`", f"ranks pad the sharded dim(s) {touched} by different amounts "
                      f"({[tuple(r) for r in rows]} by rank)", "pad every slab by the same amounts")
        lens = {d: tuple(r[len(facts) + i] for r in self._along_axis(every, st.index(d))) for i, d in enumerate(active)}
        self._routing("pad")
        out = sharded_pad(x, [int(p) for p in pad], self.guard.mesh, mode, value, dims=active,
                          layouts=tuple(Layout(lens[d]) for d in active))
        self._set(out, st)
        # The result's layouts: the pad keeps the slab boundaries (``layers/padding.py``). They
        # name its layout token. The layout scope forgets, as the sharded pad's own agreement made
        # it do before (declaring them instead let the scope answer a later lookup by local sizes
        # that matched one of them on some ranks only: a tensor permuted from channels-last, whose
        # layout the scope had seen under other dims; found by tests/test_fuzz_swin.py).
        padded = {d: kept_boundaries(lens[d], sum(lens[d]) + sum(per_dim[d])) if d in touched else lens[d]
                  for d in active}
        scope_forget()
        token = self._token(x)
        for d in touched:
            if per_dim[d] != (0, 0):
                token = self._kept_token(token, st.index(d), padded[d])
        self._set_token(out, token)
        return out

    def _h_pool(self, func, base, args, kwargs, stateful):
        x = args[0]
        st = self._st(x)
        if st is None:
            return self._plain_or_fail(func, base, args, kwargs, stateful)
        n = _POOL_NAMES[base]
        unbatched = x.dim() == n + 1
        dims = self._grid_dims(base, x if not unbatched else x.unsqueeze(0), st if not unbatched else
                               tuple(None if d is None else d + 1 for d in st))
        if not dims:
            out = func(*args, **kwargs)
            self._set(out, st)
            return out
        if unbatched or base.startswith("fractional"):
            self.fail(f"`{base}`", "it pools along a sharded dim", "use an nn pooling module (convert swaps it)")
        self._routing(base)
        from . import layers as L

        mesh = self.guard.mesh
        if base.startswith("lp_"):
            return self._lp_pool(L, n, x, args, kwargs, dims, st)
        if base.startswith("adaptive"):
            out_size = _arg(args, kwargs, 1, "output_size")
            ret = bool(_arg(args, kwargs, 2, "return_indices", False)) or base.endswith("with_indices")
            if ret:
                self.fail(f"`{base}`", "return_indices is not sharded for adaptive pools", "")
            cls = getattr(L, f"ShardedAdaptive{'Max' if 'max' in base else 'Avg'}Pool{n}d")
            osz = tuple(out_size) if isinstance(out_size, (list, tuple)) else out_size
            mod = self.guard.pools.get((cls, osz, dims), lambda: cls(osz, mesh=mesh, dims=dims))
        elif "max" in base:
            names = ["kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"]
            defaults = [None, None, 0, 1, False, False]
            c = [_arg(args, kwargs, i + 1, nm, df) for i, (nm, df) in enumerate(zip(names, defaults))]
            c[5] = bool(c[5]) or base.endswith("with_indices")
            c = [tuple(v) if isinstance(v, list) else v for v in c]
            cls = getattr(L, f"ShardedMaxPool{n}d")
            stride = c[1] if c[1] not in (None, (), []) else None
            mod = self.guard.pools.get(
                (cls, *c, dims), lambda: cls(c[0], stride, c[2], c[3], return_indices=c[5], ceil_mode=c[4], mesh=mesh, dims=dims)
            )
        else:
            names = ["kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"]
            defaults = [None, None, 0, False, True, None]
            c = [_arg(args, kwargs, i + 1, nm, df) for i, (nm, df) in enumerate(zip(names, defaults))]
            c = [tuple(v) if isinstance(v, list) else v for v in c]
            cls = getattr(L, f"ShardedAvgPool{n}d")
            stride = c[1] if c[1] not in (None, (), []) else None
            kw = {"divisor_override": c[5]} if n > 1 else {}
            mod = self.guard.pools.get(
                (cls, *c, dims), lambda: cls(c[0], stride, c[2], ceil_mode=c[3], count_include_pad=c[4], mesh=mesh, dims=dims, **kw)
            )
        out = mod(x)
        self._set(out, _layer_output_state(mod, st) if base.startswith("adaptive") else st)
        return out

    def _lp_pool(self, L, n: int, x, args, kwargs, dims, st):
        """``F.lp_pool{n}d`` on a slab: torch's own formula (the p-th power averaged over each
        window, times the window's size, to the power 1/p) with the sharded average pool."""
        p = _arg(args, kwargs, 1, "norm_type")
        kernel = _arg(args, kwargs, 2, "kernel_size")
        stride = _arg(args, kwargs, 3, "stride")
        ceil = bool(_arg(args, kwargs, 4, "ceil_mode", False))
        kernel = tuple(kernel) if isinstance(kernel, (list, tuple)) else (kernel,) * n
        stride = tuple(stride) if isinstance(stride, (list, tuple)) else stride
        cls = getattr(L, f"ShardedAvgPool{n}d")
        mod = self.guard.pools.get(
            (cls, kernel, stride, "lp", ceil, dims),
            lambda: cls(kernel, stride if stride not in (None, ()) else None, 0, ceil_mode=ceil, mesh=self.guard.mesh,
                        dims=dims),
        )
        avg = mod(x.pow(p))
        out = (torch.sign(avg) * F.relu(torch.abs(avg))).mul(math.prod(kernel)).pow(1.0 / p)
        self._set(out, st)
        return out


_LIB_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


#: sharded_nn files that *run models* (the demo, the command line, launch's workers, checkpoints,
#: ``activation_checkpoint``'s regions, the planner's ``trace_peak``): a model called from them is
#: user code like any other, not a library function. (A torch module's forward, ``nn.Sequential``
#: or ``nn.GELU``, is skipped as torch's own code, so the first frame above it decides: when it was
#: one of these, the region's calls ran unfollowed, on the slab alone, and the next sharded layer
#: refused the untracked tensor they returned.)
_MODEL_RUNNERS = frozenset(
    _LIB_DIR + name
    for name in ("demo.py", "cli.py", "__main__.py", "launch.py", "checkpoint.py", "parallel.py", "recompute.py",
                 "planner.py")
)  # fmt: skip


def _squeezed(x: torch.Tensor, st, args, kwargs) -> tuple[int, ...]:
    """The dims ``squeeze`` removes from ``x`` (layout ``st``): those of size 1 it names (all of
    them for a bare ``squeeze()``), never a sharded one. A slab with one position along a
    sharded dim would lose that dim on this rank only, while the whole domain (two or more
    positions there: every rank's slab is non-empty) keeps it on one device and on the other
    ranks; the rank then went its own way (refused alone, a hang)."""
    dim = _arg(args, kwargs, 1, "dim")
    nd = x.dim()
    cand = range(nd) if dim is None else _norm_dims(dim, nd)
    keep = {d for d in st if d is not None}
    return tuple(i for i in cand if x.shape[i] == 1 and i not in keep)


#: (code object, line) of the model code whose sharded size reads were checked (``_lint_float_sizes``).
_LINTED: set = set()


def _lint_float_sizes(positions: set, ndim: int) -> None:
    """``guard_float_sizes``' check of the model code that just read sharded sizes (the first
    frame outside torch and the guard's entry; not the library's own reads), once per site: a
    set lookup on later reads (a size is read at many places per forward)."""
    frame = sys._getframe(3)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code in _PASS_THROUGH_CODES):
        frame = frame.f_back
    if frame is None:
        return
    site = (frame.f_code, frame.f_lineno)
    if site in _LINTED:
        return
    if len(_LINTED) < 65536:
        _LINTED.add(site)
    name = frame.f_code.co_filename
    if name.startswith(_LIB_DIR) and name not in _MODEL_RUNNERS:
        return
    from .guard_float_sizes import warn_float_left_of_sizes

    warn_float_left_of_sizes(frame, positions, ndim)


def _called_from_library(depth: int = 2) -> bool:
    """Whether the torch call was made by sharded_nn's own code (not the model's); ``depth``:
    the caller's frame, counted from this function's.

    torch's own frames are skipped (a torch module's forward calling ``F.gelu``), so the first
    other frame decides; the files that run models do not count as library code, or a plain
    torch model called by the demo would pass through unchecked.
    """
    frame = sys._getframe(depth)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code in _PASS_THROUGH_CODES):
        frame = frame.f_back
    if frame is None:
        return False
    name = frame.f_code.co_filename
    return name.startswith(_LIB_DIR) and name not in _MODEL_RUNNERS


def _same_but_axis(st, full, dim: int) -> bool:
    """Whether layout ``st`` is ``full`` but not sharded along ``dim`` (its mesh axis's entry None)."""
    return st == full or all(a == b or (b == dim and a is None) for a, b in zip(st, full))


_EINOPS_TAGGED = [False]


def _tag_einops_recipes() -> None:
    """einops caches each recipe's sizes by the input's shape (``functools.lru_cache``): a slab's
    shape, whose sizes are ``LocalLength`` under the guard, hashes like the plain ints of an
    earlier call (a whole tensor, or a slab outside the guard), and the cached sizes come back
    plain. A plain request says neither which sizes are local nor which mesh axes they come
    from, and where a slab has one position along a sharded dim the view is ambiguous by sizes
    alone (``(b, h, 1, c) -> (b, h, c)``: ``w`` merged with ``h``, or with ``c``?). So while a
    guard runs, a shape with tagged sizes is worked out anew (einops' own uncached function,
    microseconds of Python), and its requests carry the tags; other calls use the cache."""
    import einops.einops as ee

    cached, uncached = ee._reconstruct_from_shape, getattr(ee, "_reconstruct_from_shape_uncached", None)
    if uncached is None or getattr(cached, "_snn_tagged", False):
        _EINOPS_TAGGED[0] = True
        return

    def reconstruct(recipe, shape, axes_lengths):
        if any(_is_tagged(v) for v in shape) or any(_is_tagged(v) for _, v in axes_lengths):
            return uncached(recipe, shape, axes_lengths)
        return cached(recipe, shape, axes_lengths)

    reconstruct._snn_tagged = True
    reconstruct.cache_info, reconstruct.cache_clear = cached.cache_info, cached.cache_clear
    ee._reconstruct_from_shape = reconstruct
    _EINOPS_TAGGED[0] = True


def _called_from_local_shape_library() -> bool:
    """Whether the torch call being handled was made by a library of ``_LOCAL_SHAPE_LIBRARIES``
    (the first frame outside torch and sharded_nn): einops reshapes a slab to sizes it worked
    out from the slab's own shape, or took from its cache of an earlier call with that shape,
    where they may be plain ints (a call outside the guard, or on a whole tensor of that shape):
    they are this slab's sizes, never the whole sample's."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_TORCH_DIR, _LIB_DIR)):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LOCAL_SHAPE_LIBRARIES


_CHECKPOINT_FILE = os.path.join(_TORCH_DIR, "utils", "checkpoint.py")


def _inside_torch_checkpoint() -> bool:
    """Whether a ``torch.utils.checkpoint`` call is on the stack, around a forward whose region
    will be recomputed in backward (grad enabled, or a reentrant checkpoint of inputs that
    require grad)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            if torch.is_grad_enabled():
                return True
            args = frame.f_locals.get("args")  # CheckpointFunction.forward runs under no_grad
            if frame.f_code.co_name == "forward" and isinstance(args, tuple):
                return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        frame = frame.f_back
    return False


def _created_device(kwargs) -> torch.device:
    """The device a creation call puts its tensor on."""
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.get_default_device()


def _created_sizes(base: str, args, kwargs) -> list:
    """The size argument of a creation call (``zeros(2, 3)``, ``new_full((2, 3), v)``, ``randint(0, 5, (2,))``, ...)."""
    if base == "new_full":
        sizes = _arg(args, kwargs, 1, "size", ())
    elif base.startswith("new_"):
        sizes = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else _arg(args, kwargs, 1, "size", ())
    elif base == "full":
        sizes = _arg(args, kwargs, 0, "size", ())
    elif base == "randint":
        sizes = _arg(args, kwargs, len(args) - 1 if args and isinstance(args[-1], (tuple, list)) else 2, "size", ())
    elif base == "normal":
        sizes = _arg(args, kwargs, 2, "size", ())
    else:
        sizes = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
        sizes = kwargs.get("size", sizes)
    return list(sizes) if isinstance(sizes, (list, tuple, torch.Size)) else [sizes]


def _explicit_einsum(eq: str, ops) -> str | None:
    """``eq`` with its ellipsis written out in letters it does not use (``...bi,bio->...bo`` on a
    4-d and a 3-d operand: ``ABCbi,bio->ABCbo``), the dims it stands for aligned from the right
    as torch aligns them; ``None`` where the equation does not fit the operands (torch raises)."""
    import string

    lhs, arrow, rhs = eq.replace(" ", "").partition("->")
    subs = lhs.split(",")
    if len(subs) != len(ops):
        return None
    counts = [t.dim() - (len(sub) - 3) if "..." in sub else 0 for sub, t in zip(subs, ops)]
    free = [c for c in string.ascii_letters if c not in eq]
    n = max(counts)
    if min(counts) < 0 or n > len(free):
        return None
    fill = "".join(free[:n])
    subs = [sub.replace("...", fill[n - c:]) for sub, c in zip(subs, counts)]
    if arrow:
        rhs = rhs.replace("...", fill)
    else:  # implicit output: the ellipsis dims, then the letters used once, in alphabetical order
        named = ",".join(subs).replace(",", "")
        rhs = fill + "".join(sorted(c for c in set(lhs) if c.isalpha() and named.count(c) == 1 and c not in fill))
    return ",".join(subs) + "->" + rhs


#: Call kinds (besides pointwise calls, ``cat`` and ``stack``) that pair slabs position by
#: position: slabs of different layout tokens are brought to one layout first (``guard_tokens``).
_ALIGNED = frozenset({"loss", "similarity"})


def _phase_slice(i) -> bool:
    """``start::step`` with ``0 <= start < step`` (``step > 1``): one phase of a strided split."""
    if not isinstance(i, slice) or i.stop is not None or not isinstance(i.step, int) or i.step < 2:
        return False
    start = 0 if i.start is None else i.start
    return isinstance(start, int) and 0 <= start < i.step


def _full_slice(i) -> bool:
    """A slice that keeps the whole slab whatever its global position: ``x[:, :]``, ``x[:, 0:]``.
    A constant stop is a global position; so is a stop read from slab sizes (``x[:, :h]``, with
    ``h`` read before a pad): it keeps the whole slab on some ranks and crops the padded one on
    others, which only the global bounds decide alike on every rank (``_global_bounds``)."""
    if not isinstance(i, slice):
        return False
    return i.start in (None, 0) and i.step in (None, 1) and i.stop is None


_CLASSIFIED: dict = {}
#: Kinds handled even without a slab among the arguments: draws (the guard's streams) and
#: losses (``F.l1_loss``'s weights, which torch's dispatch drops: ``guard_losses``).
_ALWAYS_HANDLED = ("random", "loss")


def _classify_cached(func):
    try:
        return _CLASSIFIED[func]
    except KeyError:
        pass
    except TypeError:
        return _classify(func)
    kind = _classify(func)
    _CLASSIFIED[func] = kind
    return kind


#: ``kind -> _GuardMode._h_<kind>``, looked up once rather than by name on every call.
_HANDLERS = {name[3:]: fn for cls in (FftCalls, LossCalls, SampleCalls, DistanceCalls, _GuardMode)
             for name, fn in vars(cls).items() if name.startswith("_h_") and callable(fn)}


def _minus_one_takes_sharded(x: torch.Tensor, st, request) -> bool:
    """Whether a request of constants and one -1 reads as "the -1 takes the sharded dims": the
    constants before the -1 are products of leading unsharded dims of ``x``, those after it of
    trailing unsharded dims, and every sharded dim lies between (``x.view(b, -1, c)``,
    ``windows.view(-1, ws, ws, c)``); a slab of any length then fits it alike on every rank.
    Otherwise a constant spans a sharded dim: it is a size of the whole sample (CoaT's
    ``reshape(b, h, w, -1)`` of its tokens with its fixed grid), which a slab would fit on some
    ranks only, or wrongly, and the request is read on the global shape. Decided on the request
    and the unsharded sizes, which every rank has alike."""
    if request.count(-1) != 1:
        return False
    shape = [int(n) for n in x.shape]
    sharded = {d for d in st if d is not None}
    cut = request.index(-1)

    def consume(consts, dims) -> int | None:
        """How many of ``dims`` (in order) the ``consts`` take, each a product of unsharded dims or
        of parts of one (HaloNet's ``q.reshape(-1, bs, bs, d)`` of ``(b * heads, blocks, bs * bs,
        d)`` splits the window's tokens; read as sizes of the whole sample before session 67,
        and refused: the blocks' dim is not outermost there). Splitting an unsharded dim keeps
        the memory order, as ``guard_folds._refined`` does."""
        used, rem = 0, 1
        for c in consts:
            need = int(c)
            while need > 1:
                if rem == 1:
                    if used >= len(dims) or dims[used] in sharded:
                        return None
                    rem = shape[dims[used]]
                    used += 1
                if rem and rem % need == 0:
                    rem, need = rem // need, 1
                elif rem and need % rem == 0:
                    need, rem = need // rem, 1
                else:
                    return None
        return used

    left = consume(request[:cut], list(range(len(shape))))
    right = consume(list(reversed(request[cut + 1 :])), list(range(len(shape) - 1, -1, -1)))
    return left is not None and right is not None and all(left <= d < len(shape) - right for d in sharded)


def _reshape_request(args, kwargs):
    """The sizes a ``view`` / ``reshape`` call asks for, or None (a dtype view)."""
    if len(args) > 2 or (len(args) == 2 and not isinstance(args[1], (list, tuple, torch.Size))):
        request = args[1:]
    else:
        request = _arg(args, kwargs, 1, "shape")
    return None if request is None or isinstance(request, torch.dtype) else list(request)


def _groups(in_shape, out_shape):
    """Minimal groups (in dims, out dims) whose sizes multiply to the same product."""
    groups = []
    i = j = 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, go = [], []
        pi = pj = 1
        if i < ni:
            gi.append(i)
            pi *= in_shape[i]
            i += 1
        if j < no:
            go.append(j)
            pj *= out_shape[j]
            j += 1
        while pi != pj or (i < ni and in_shape[i] == 1 and pi == pj and j >= no):
            if pi < pj and i < ni or (pi == pj and i < ni):
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif j < no:
                go.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                break
        groups.append((gi, go))
    return groups


def _tagged_by_axis(v, axis: int) -> bool:
    """Whether ``v`` was computed from a slab length along mesh axis ``axis`` (and only such)."""
    leaves = getattr(v, "_leaves", None) if _is_tagged(v) else None
    return bool(leaves) and all(isinstance(leaf, LocalLength) and leaf.axis == axis
                                and not isinstance(leaf, MergedLength) for leaf in leaves)


def _sharded_request_dim(request, axis: int) -> int | None:
    """The output dim of a view request that takes the sharded dim of mesh axis ``axis``: the one
    size read from that axis' slab lengths, or else (no size read from slabs) the one -1."""
    tagged = [o for o, v in enumerate(request) if _tagged_by_axis(v, axis)]
    if len(tagged) == 1:
        return tagged[0]
    if not tagged and not any(_is_tagged(v) for v in request) and list(request).count(-1) == 1:
        return list(request).index(-1)
    return None


def _merges_axes(request, st) -> bool:
    """Whether a size of the view request was computed from the slab lengths of two or more
    mesh axes that shard dims of the input (``h * w``): the view merges them into one dim."""
    sharded = {k for k, d in enumerate(st) if d is not None}
    if len(sharded) < 2:
        return False
    for v in request:
        if _is_tagged(v) and v._leaves:
            axes = set()
            for leaf in v._leaves:
                axes.update(getattr(leaf, "axes", (leaf.axis,)))
            if len(axes & sharded) > 1:
                return True
    return False


#: A factor no real size shares: ``_map_reshape`` stands it in for a sharded dim of local size 1.
_PROBE_FACTOR = 1_000_003


def _empty_axis(in_shape, st) -> tuple[int, int] | None:
    """``(dim, mesh axis)`` of a slab empty along one sharded dim and no other dim, else None."""
    zeros = [j for j, v in enumerate(in_shape) if v == 0]
    axes = [k for k, d in enumerate(st) if d is not None and d in zeros]
    if len(zeros) != 1 or len(axes) != 1:
        return None
    return zeros[0], axes[0]


def _empty_slab_probe(in_shape, out_shape, st) -> tuple[tuple, tuple] | None:
    """For a view of an empty slab: the shapes with its sharded dim's zero, and the output's one
    zero (where the view put it), replaced by lengths in the ratio the view gives every slab; or
    None (several empty dims, an empty batch).

    The other ranks map the view by lengths that no other size shares; an empty slab's zeros
    group with anything, and mapped UNKNOWN it was refused on its rank alone while the others
    went on to their next collective (a hang; session 66). The lengths: ``L`` in, ``L'`` out with
    ``L * a == L' * b`` for ``a``, ``b`` the products of the other dims (the same on every rank),
    each a multiple of the probe factor no real size shares."""
    empty = _empty_axis(in_shape, st)
    zeros = [j for j, v in enumerate(out_shape) if v == 0]
    if empty is None or len(zeros) != 1:
        return None
    d, o = empty[0], zeros[0]
    a = math.prod(v for j, v in enumerate(in_shape) if j != d)
    b = math.prod(v for j, v in enumerate(out_shape) if j != o)
    g = math.gcd(a, b)
    if g == 0:
        return None
    scaled_in, scaled_out = list(in_shape), list(out_shape)
    scaled_in[d], scaled_out[o] = b // g * _PROBE_FACTOR, a // g * _PROBE_FACTOR
    return tuple(scaled_in), tuple(scaled_out)


def _call_resolved(func, sizes, x, *args, **kwargs):
    return func(x, *sizes)


def _empty_slab_minus_one(in_shape, st, request) -> list | None:
    """A view request with its -1 resolved as the other ranks resolve it, for an empty slab
    (torch raises on a -1 for a tensor of no elements, which would leave this rank alone with an
    error while the others go on to their next collective), or None where there is nothing to
    resolve or it cannot be.

    The -1 names the sharded dim (``x.reshape(n, -1, c)`` of tokens): this rank's part of it is
    empty, 0. Else the size read from this axis' slab lengths names it (``x.view(n, c, h // 2,
    2, -1)``): the -1 is then what the other dims leave, evaluated with the slab's length set to
    two probe lengths (the expression of the tagged size is known, ``LocalDerived``); where the
    two disagree, the -1 depends on the slab length and is left to torch."""
    if request is None or list(request).count(-1) != 1:
        return None
    empty = _empty_axis(in_shape, st)
    if empty is None:
        return None
    d, k = empty
    o, m = _sharded_request_dim(request, k), list(request).index(-1)
    if o is None:
        return None
    if o == m:
        return [0 if i == m else v for i, v in enumerate(request)]
    tagged = request[o]
    leaves, fn = getattr(tagged, "_leaves", None), getattr(tagged, "_fn", None)
    if leaves is None or fn is None or len(leaves) != 1:
        return None
    rest = math.prod(v for j, v in enumerate(in_shape) if j != d)
    others = math.prod(v for i, v in enumerate(request) if i not in (o, m))
    values = set()
    for length in (_PROBE_FACTOR * 720720, _PROBE_FACTOR * 720720 * 2):
        den = others * int(fn([length]))
        if den == 0 or (rest * length) % den:
            return None
        values.add(rest * length // den)
    if len(values) != 1:
        return None
    return [values.pop() if i == m else v for i, v in enumerate(request)]


def _map_reshape(in_shape, out_shape, st, request, probed: bool = False) -> tuple | str:
    """The layout after a reshape (see the module docstring), or ``UNKNOWN``."""
    if 0 in in_shape:
        scaled = _empty_slab_probe(in_shape, out_shape, st)
        if scaled is None:
            return UNKNOWN
        in_shape, out_shape = scaled
    if request is not None and _merges_axes(request, st):
        return UNKNOWN  # two sharded dims merged into one (``guard_merged``), not a slab
    if not probed and request is not None and len(request) == len(out_shape):
        # Torch's sizes alone group a slab's dim with neighbours by this rank's length: a local
        # size of 1 groups with either neighbour (``windows.view(-1, ws, ws, c)`` of ``(b, 1, 1,
        # ws, ws, c)`` put it with the window rows, while the next rank, two windows, put it with
        # the -1), and a length equal to a neighbour's size pairs with it (MobileViT's
        # ``x.reshape(b * c * (h // 2), 2, w // 2, 2)`` of a slab of 2 rows paired them with the
        # patch's 2 rows; a slab of 4 rows merged them with the channels). The request says which
        # output dim takes the sharded dim on every rank: the one size read from this axis' slab
        # lengths, or else the -1. Mapped on the shapes with both scaled by a probe factor no
        # real size shares, where every rank groups alike.
        scaled_in, scaled_out, named = list(in_shape), list(out_shape), {}
        for k, d in enumerate(st):
            o = None if d is None else _sharded_request_dim(request, k)
            if o is not None and o in named.values():
                # Two mesh axes name one output dim (both by the -1: ``x.reshape(b, -1, c)`` of
                # ``(b, h, w, c)``): their dims merge, which no slab state says. (Mapped by sizes
                # alone, a rank whose ``w`` is 1 put ``w`` with the channels.)
                return UNKNOWN
            if o is not None:
                scaled_in[d] *= _PROBE_FACTOR
                scaled_out[o] *= _PROBE_FACTOR
                named[k] = o
        if named:
            probe = _map_reshape(tuple(scaled_in), tuple(scaled_out), st, request, probed=True)
            if probe is UNKNOWN or all(probe[k] == o for k, o in named.items()):
                return probe
    groups = _groups(in_shape, out_shape)
    # A sharded dim counts as a real factor even where this rank's slab has one position along
    # it: the other ranks' slabs have more, and every rank must map alike.
    sharded = {d for d in st if d is not None}
    result = []
    for k, d in enumerate(st):
        if d is None:
            result.append(None)
            continue
        g = next(((gi, go) for gi, go in groups if d in gi), None)
        if g is None:
            return UNKNOWN
        gi, go = g
        before = [j for j in gi if j < d and (in_shape[j] != 1 or j in sharded)]
        if before:
            return UNKNOWN  # the sharded dim is not the outermost of a merged group
        real = sum(1 for j in gi if in_shape[j] != 1 or j in sharded)
        if real > 1 and len([o for o in go if out_shape[o] != 1]) > 1:
            return UNKNOWN  # many-to-many regroup
        nontriv = [o for o in go if out_shape[o] != 1] or go[:1]
        outer = nontriv[0]
        if request is not None and len(request) == len(out_shape):
            # A slab of one row makes its output factor 1 here and not on the other ranks: the
            # requested size read from the slab (tagged) names the sharded factor on every rank
            # alike (``t.reshape(b, c, hh, ww)`` with ``hh = x.shape[2]`` on a one-row slab);
            # of several, the one read from this axis' slab lengths.
            tagged = [o for o in go if _tagged_by_axis(request[o], k)] or [o for o in go if _is_tagged(request[o])]
            if len(tagged) == 1:
                outer = tagged[0]
        inner = [o for o in go if o > outer]
        if inner and request is not None and len(request) == len(out_shape):
            if any(_is_tagged(request[o]) or request[o] == -1 for o in inner):
                return UNKNOWN  # the inner factors depend on the local size
        elif inner and request is None:
            return UNKNOWN
        result.append(outer)
    if len({o for o in result if o is not None}) < len([o for o in result if o is not None]):
        return UNKNOWN  # two mesh axes folded into one dim (windows of a 2-D mesh in the batch)
    return tuple(result)


# ------------------------------------------------------------------------------- install

#: Module classes whose own forward is reviewed by their authors (exact on slabs in every
#: decomposition, with their own tests): the guard does not look inside them, and their output
#: keeps their input's layout. ``mark_reviewed`` adds to it.
REVIEWED: set[type] = set()


def mark_reviewed(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: the guard trusts ``cls.forward`` (like ``plan={name: None}`` for every instance)."""
    REVIEWED.add(cls)
    return cls


def mark_guarded(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: ``cls.forward`` is plain torch code that the guard follows, computing its
    position-mixing calls with their sharded forms or refusing them on every rank (a spectral
    convolution's ``torch.fft`` calls), so ``convert`` does not report it as a layer without a
    sharded version, as it does not report timm's ``GlobalResponseNorm``. The opposite of
    ``mark_reviewed``, which trusts the forward unchecked. With ``convert(..., guard=False)`` the
    class is reported as mixing positions. Applies to ``cls`` itself, not to its subclasses."""
    cls._sharded_nn_guarded = cls
    return cls



def install(
    model: nn.Module, mesh: DeviceMesh, dims: Sequence[int], sharded: set[type], reviewed: Sequence[str], scope=None,
    input_dims=None, strict: bool = False,
) -> None:
    """Install the guard on ``model`` (the converted root): hooks on the root, sharded layers, reviewed modules.

    ``scope``: a ``comm.sizes.ScopeHooks`` that the root hooks run too (convert's layout scope).
    Re-installing replaces the earlier hooks (convert is idempotent).
    """
    uninstall(model)
    from .layers.base import ShardedMixin  # (the layers import this module)

    guard = ForwardGuard(model, mesh, dims, reviewed, scope, input_dims, strict)
    handles = [
        model.register_forward_pre_hook(guard.root_pre, with_kwargs=True),
        model.register_forward_hook(guard.root_post, with_kwargs=True, always_call=True),
    ]
    layers: list = []
    reviewed_set = set(reviewed)
    for name, m in model.named_modules():
        if m is model or guard.single:
            # One-rank domain: no per-layer hooks (their work would be to follow layouts that
            # cannot be wrong); a converted layer then costs what the torch layer costs.
            continue
        kind = "sharded" if type(m) in sharded else ("reviewed" if name in reviewed_set or type(m) in REVIEWED else None)
        if kind is None or (kind == "sharded" and getattr(type(m), "_guard_inside", False)):
            continue  # (a block that runs the guard inside itself, e.g. squeeze-excite: nothing to do around it)
        hooks = _LayerHooks(kind, m)
        if kind == "sharded" and isinstance(m, ShardedMixin):
            m.__dict__["_snn_guard_call"] = hooks  # run by ``ShardedMixin.__call__``
            # How many guarded roots hold the layer: a layer shared by two converted models
            # keeps its guard work until neither is guarded (see ``uninstall``).
            m.__dict__["_snn_guard_owners"] = m.__dict__.get("_snn_guard_owners", 0) + 1
            layers.append(m)
        else:
            handles.append(m.register_forward_pre_hook(hooks.pre))
            handles.append(m.register_forward_hook(hooks.post, always_call=True))
    model.__dict__["_snn_guard_handles"] = handles
    model.__dict__["_snn_guard_layers"] = layers
    model.__dict__["_snn_guard"] = guard
    if not guard.single:
        eager = not _compiles_as_is(model, sharded, reviewed_set)
        for name in (["forward"] if eager else []) + _entry_methods(type(model)):
            model.__dict__[name] = _GuardedEntry(model, name, eager)


def uninstall(model: nn.Module) -> None:
    for h in model.__dict__.pop("_snn_guard_handles", ()) or ():
        h.remove()
    for m in model.__dict__.pop("_snn_guard_layers", ()) or ():
        # Taken off only when no other guarded root holds the layer: under a guard, a layer
        # without its guard work leaves its output untracked, i.e. taken for a replicated tensor,
        # and a later reduction of it would run unrouted on the slab.
        owners = m.__dict__.get("_snn_guard_owners", 1) - 1
        if owners > 0:
            m.__dict__["_snn_guard_owners"] = owners
        else:
            m.__dict__.pop("_snn_guard_owners", None)
            m.__dict__.pop("_snn_guard_call", None)
    model.__dict__.pop("_snn_guard", None)
    for name, value in list(model.__dict__.items()):
        if isinstance(value, _GuardedEntry):
            del model.__dict__[name]


def _entry_methods(cls: type) -> list[str]:
    """The model's other forward entry points: methods named ``forward_*`` (timm's
    ``forward_features``, ``forward_head``, ``forward_intermediates``, ...)."""
    import inspect
    import types

    return [
        name for name in dir(cls)
        if name.startswith("forward_") and not hasattr(nn.Module, name)
        and isinstance(inspect.getattr_static(cls, name, None), types.FunctionType)
    ]


class _GuardedEntry:
    """An entry method of the guarded root (an instance attribute set by ``install``): its
    ``forward_*`` methods, and ``forward`` itself where the model has calls to guard.

    The guard's root hooks run around ``model(x)`` only: ``model.forward_features(x)``,
    ``model.forward_intermediates(x)`` or ``model.forward(x)`` called directly would run the
    model's own calls on the slab alone. Called from outside a guarded forward, the method runs as
    ``model(x)`` does: inputs taken as slabs along the model's dims, under the guard; from inside
    one (timm's ``forward`` calls ``self.forward_features``) it is the plain method.

    Under ``torch.compile`` the guard cannot run (its mode is Python that Dynamo does not trace):
    where the model has calls to guard (``eager``, from ``_compiles_as_is``), the method runs
    eagerly under the guard (``torch._dynamo.disable``), with the sharded layers it calls; models
    of sharded layers and reviewed modules in containers, and ``guard=False`` models, compile as
    usual. (Before session 35 both paths ran unguarded: silently wrong answers.)
    """

    def __init__(self, module: nn.Module, name: str, eager: bool) -> None:
        self.module, self.name, self.eager = module, name, eager
        if eager and not _EAGER:  # made on first use: torch._dynamo is a heavy import
            _EAGER.append(torch._dynamo.disable(_eager_guarded_forward_impl))

    def __call__(self, *args, **kwargs):
        method = getattr(type(self.module), self.name)
        if torch.compiler.is_compiling():
            if self.eager:
                return _EAGER[0](self.module, method, *args, **kwargs)
            return method(self.module, *args, **kwargs)
        if guard_active():
            return method(self.module, *args, **kwargs)
        return _eager_guarded_forward_impl(self.module, method, *args, **kwargs)


#: Leaf modules whose forward is one elementwise torch call (nothing for the guard to route).
_ELEMENTWISE_LEAVES = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.Threshold, nn.LogSigmoid, nn.Hardshrink, nn.Softshrink,
)  # fmt: skip


def _compiles_as_is(model: nn.Module, sharded: set[type], reviewed: set[str]) -> bool:
    """Whether no forward in ``model`` has torch calls of its own that the guard would route.

    True when every module is a sharded layer or a reviewed module (their forwards are exact on
    slabs by themselves), a container (``nn.Sequential``), or an elementwise activation: then a
    compiled forward computes what the guarded one does, and ``torch.compile`` may trace it.
    """
    done: list[str] = []
    for name, m in model.named_modules():
        if any(name.startswith(p) for p in done):
            continue
        t = type(m)
        if t in REVIEWED or (m is not model and (t in sharded or name in reviewed)):
            done.append(f"{name}." if name else "")
            continue
        if t.forward is nn.Sequential.forward or isinstance(m, (nn.ModuleList, nn.ModuleDict, _ELEMENTWISE_LEAVES)):
            continue
        if isinstance(m, nn.Dropout) and m.p == 0:
            continue
        return False
    return True


def _eager_guarded_forward_impl(module: nn.Module, method, *args, **kwargs):
    # The root hooks' work around ``method``: for a direct method call they did not run, and
    # under compile they ran as no-ops while Dynamo traced the call.
    guard = module.__dict__["_snn_guard"]
    guard.root_pre(module, args, kwargs)
    try:
        out = method(module, *args, **kwargs)
    except BaseException:
        guard.root_post(module, args, kwargs, None)
        raise
    checked = guard.root_post(module, args, kwargs, out)
    return out if checked is None else checked


#: ``torch._dynamo.disable(_eager_guarded_forward_impl)``, made by the first eager ``_GuardedEntry``.
_EAGER: list = []
#: Frames of ours that only pass a model's forward on: not library code for ``_called_from_library``
#: (the calls a torch module makes when the root calls it come from the model, not from us).
_PASS_THROUGH_CODES = frozenset({_GuardedEntry.__call__.__code__, _eager_guarded_forward_impl.__code__})

#: The merged layout's calls: the fold's (rows kept apart), with those along the merged dim.
MERGED_HANDLERS = {**_FOLD_HANDLERS, "pointwise": MergedCalls._m_pointwise, "reduce": MergedCalls._m_reduce,
                   "matmul": MergedCalls._m_matmul, "einsum": MergedCalls._m_einsum, "sdpa": MergedCalls._m_sdpa,
                   "cat": MergedCalls._m_cat, "getitem": MergedCalls._m_getitem}
