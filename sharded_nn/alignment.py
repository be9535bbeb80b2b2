"""``alignment(model, dims)``: the slab alignment a model needs along each sharded dim.

A strided layer (stride ``s`` along a dim) needs every slab of its input to start at a multiple
of ``s``. Its input has been downsampled by some factor ``f`` relative to the model input, so at
the model input the slabs must start at multiples of ``f * s``. The model's alignment is the
least common multiple of ``f * s`` over its strided layers: ``2 ** depth`` for a UNet, 32 for a
ResNet, the patch size for a ViT. Layers with other needs state them in an
``alignment_multiple`` attribute (one value per spatial dim, read like a stride); a layer whose
input keeps its spatial dims elsewhere than at the end (channels-last tokens ``(N, H, W, C)``,
as in a Swin block, whose windows must not span two slabs) also names them in
``alignment_dims`` (the input's dims holding the model input's spatial dims, in order).

Window attention written with views in a model's own code (timm's DaViT, TinyViT, Twins-SVT:
``x.view(b, h // ws, ws, w // ws, ws, c)``) needs slabs of whole windows: ``f * ws`` rows where
the windows are cut at ``1/f`` of the input. No module states that, so ``alignment`` finds such
views in shape-only passes (``_window_needs``): a view that splits a dim growing with the sharded
input dim into an outer factor that grows with it and inner factors that stay constant when any
input dim grows (a window, not the unflattening of tokens into rows of the current width).

``f`` depends on the model's graph, not only on its modules: a ResNet's strided shortcut runs
beside its strided conv, not after it, so multiplying every stride of the module tree would
overcount. ``alignment`` therefore follows one forward pass on the meta device (shapes only: no
data is allocated and nothing is computed, the parameters are not copied) and reads the input
size of every strided layer from a forward pre-hook. Converted models run the forwards of their
torch base classes for this pass, so no collective is called and the answer is the same as for
the plain model.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from fractions import Fraction

import torch
import torch.nn as nn

from .registry import registered

__all__ = ["alignment"]

#: Spatial size of the probe input along each dim: large enough for deep models, and a power of
#: two so that no model pads or crops on the way down.
DEFAULT_PROBE_SIZE = 1024


def _declared(module: nn.Module, name: str):
    """``module``'s own ``name`` attribute, or the one its registered sharded class declares.

    A plain model (not converted yet) holds torch or timm modules; their sharded classes state
    the needs (a Swin block's windows), read here for the plain module.
    """
    value = getattr(module, name, None)
    if value is None:
        sharded = registered(type(module))
        value = getattr(sharded, name, None) if sharded is not None else None
        if isinstance(value, property):
            value = value.fget(module)
    return value


def _strides(module: nn.Module) -> tuple[int, ...] | None:
    """Per-spatial-dim strides (or alignment needs) of ``module``; ``None`` when it has none."""
    need = _declared(module, "alignment_multiple")
    if need is not None:
        return tuple(int(s) for s in need)
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        return tuple(module.stride)
    if isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._LPPoolNd)):
        n = len(module.kernel_size) if isinstance(module.kernel_size, tuple) else None
        stride = module.stride if module.stride is not None else module.kernel_size
        if isinstance(stride, int):
            return (stride,) * (n or 3)  # pools accept ints for every dim
        return tuple(stride)
    return None


_MODULE_REGISTRIES = ("_parameters", "_buffers", "_modules")


@contextmanager
def _on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer on the meta device for the block, restored by module after it.

    Swapped module by module (not by name, as ``torch.func.functional_call`` does): a module
    registered under two parents (MONAI's DynUNet shares its up-sampling blocks) is then
    restored like any other, and tied tensors stay tied (one meta tensor per original).
    """
    memo: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in memo:
            m = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
        return memo[id(t)]

    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        for m, params, buffers in saved:
            m._parameters.update({k: meta(v) for k, v in params.items()})
            m._buffers.update({k: meta(v) for k, v in buffers.items()})
        yield
    finally:
        for m, params, buffers in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)


@contextmanager
def _attributes_restored(model: nn.Module) -> Iterator[None]:
    """Undo what a forward writes into the modules' own attributes (not parameters or buffers).

    Some models keep tensors of the last forward in attributes (MONAI's DynUNet fills a list of
    deep-supervision heads that its skip layers share); after the shape-only probe those would
    be meta tensors and break the next real forward. Lists and dicts are restored in place, so
    objects that several modules share stay shared.
    """
    saved = []
    for m in model.modules():
        attrs = {k: v for k, v in vars(m).items() if k not in _MODULE_REGISTRIES}
        contents = {k: (list(v) if isinstance(v, list) else dict(v)) for k, v in attrs.items()
                    if isinstance(v, (list, dict)) and not k.startswith("_")}  # fmt: skip
        saved.append((m, attrs, contents))
    try:
        yield
    finally:
        for m, attrs, contents in saved:
            for k in [k for k in vars(m) if k not in _MODULE_REGISTRIES and k not in attrs]:
                delattr(m, k)
            for k, v in attrs.items():
                m.__dict__[k] = v
            for k, items in contents.items():
                obj = attrs[k]
                if isinstance(obj, list):
                    obj[:] = items
                else:
                    obj.clear()
                    obj.update(items)


@contextmanager
def _torch_forwards(model: nn.Module) -> Iterator[None]:
    """Run every sharded module with the forward of the torch class it was converted from."""
    swapped = []
    for module in model.modules():
        cls = type(module)
        base = next((b for b in cls.__mro__[1:] if registered(b) is cls), None)
        if base is not None and "forward" not in module.__dict__:
            module.forward = types.MethodType(base.forward, module)
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            del module.forward


def _runs_sharded_code(model: nn.Module) -> bool:
    """Whether a shape-only forward of ``model`` runs a sharded module's own forward (one that
    ``_torch_forwards`` does not swap: the zoo's sharded ViT attention, Transolver, ...)."""
    for module in model.modules():
        cls = type(module)
        if cls.__name__.startswith("Sharded") and cls.__module__.split(".")[0] in ("sharded_nn", "zoo"):
            if next((b for b in cls.__mro__[1:] if registered(b) is cls), None) is None:
                return True
    return False


def _probe_shape(model: nn.Module, dims: tuple[int, ...]) -> tuple[int, ...]:
    """``(1, C_in, S, S, ...)`` from the first convolution (in registration order)."""
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            n = len(module.kernel_size)
            if max(dims) >= 2 + n:
                break
            return (1, module.in_channels, *(DEFAULT_PROBE_SIZE,) * n)
    raise ValueError(
        f"alignment: cannot guess the input shape of {type(model).__name__} (its first layer is not a "
        f"convolution over dims {dims}); pass input_shape=(N, C, S0, ...)."
    )


def alignment(
    model: nn.Module,
    dims: int | Sequence[int] = (2,),
    *,
    input_shape: Sequence[int] | None = None,
) -> int | tuple[int, ...]:
    """The slab alignment ``model`` needs along each of ``dims``: pass it to ``shard(align=...)``.

    Works on plain and converted models alike; nothing is allocated or communicated (see the
    module docstring for how it is derived).

    Args:
        model: any module whose ``forward`` takes one grid tensor ``(N, C, S0, S1, ...)``.
        dims: the sharded tensor dims (``(2,)``: S0). An int gives an int back.
        input_shape: the shape of a probe input. Default: ``(1, C, 1024, ...)`` with ``C`` and the
            number of spatial dims from the model's first convolution. A real input shape gives
            the same answer when its sizes are multiples of the alignment.

    Returns:
        One alignment per dim of ``dims`` (a tuple, or an int for ``dims`` given as an int).

    Raises:
        ValueError: when no input shape can be guessed, or when the probe forward fails (for
            example a forward that needs real data); the message says what to pass.
    """
    from .convert import _load_model_families

    _load_model_families()  # the sharded classes that declare needs for the model's layers
    single = isinstance(dims, int)
    dims = (dims,) if single else tuple(int(d) for d in dims)
    if not dims or min(dims) < 2:
        raise ValueError(f"alignment: dims must name spatial dims (>= 2) of (N, C, S0, ...) inputs, got {dims}.")
    shape = tuple(input_shape) if input_shape is not None else _probe_shape(model, dims)
    if max(dims) >= len(shape):
        raise ValueError(f"alignment: dims {dims} are out of range for input shape {shape}.")
    needs = dict.fromkeys(dims, 1)

    def pre_hook(module: nn.Module, args) -> None:
        strides = _strides(module)
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if strides is None or x is None or x.dim() != len(shape):
            return
        n = len(strides)
        where = _declared(module, "alignment_dims")
        for d in dims:
            if where is None:
                i, td = d - (x.dim() - n), d  # strides cover the trailing (spatial) dims
            else:
                i = d - (len(shape) - n)  # the k-th need is the model input's k-th spatial dim
                td = where[i] if 0 <= i < len(where) else -1
            if 0 <= i < n and strides[i] > 1 and x.shape[td] > 0:
                factor = Fraction(shape[d], x.shape[td]) * strides[i]
                needs[d] = math.lcm(needs[d], math.ceil(factor))

    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.get_default_dtype()
    x = torch.empty(shape, dtype=dtype, device="meta")
    handles = [m.register_forward_pre_hook(pre_hook) for m in model.modules()]
    views = _ViewLog()
    try:
        with torch.no_grad(), _torch_forwards(model), _attributes_restored(model), _on_meta(model), views:
            model(x)
    except Exception as e:  # noqa: BLE001 - any failure of the probe pass means "tell us the shape"
        raise ValueError(
            f"alignment: the shape-only forward of {type(model).__name__} on a meta tensor of shape {shape} "
            f"failed ({type(e).__name__}: {e}). Pass input_shape= with a valid input shape, or compute the "
            "alignment by hand (the product of the strides along the deepest path)."
        ) from e
    finally:
        for h in handles:
            h.remove()
    if (input_shape is None and any(_splits(in_shape, out_shape) for in_shape, out_shape in views.calls)
            and not _runs_sharded_code(model)):
        # (Only where the probe made a view that splits a dim: most CNNs make none, and convert
        # asks for the alignment of every model it converts. Not through sharded modules that
        # keep their own forward in the probe, such as the ViT zoo's ring attention: its Python
        # loops over tiles grow with the probe's many rows.)
        found = _window_needs(model, shape, dims, dtype)
        if not found and len(dims) > 1:
            # Every sharded dim grown at once can make a tensor too large even for meta shapes
            # (MobileViT's attention over all tokens: its storage size overflows): one dim at a time.
            for d in dims:
                found.update(_window_needs(model, shape, (d,), dtype))
        for d, need in found.items():
            needs[d] = math.lcm(needs[d], need)
    out = tuple(needs[d] for d in dims)
    return out[0] if single else out


#: The shape-only passes that find window views grow the probe's spatial size by this odd factor
#: (times 1024: rows 1024 * 315 and twice that), so that windows of 3, 5, 7, 9, their multiples
#: by powers of two (14, 28...) and products (15, 21, 35...) divide every stage and the model
#: pads nothing: the downsampling at a view is then the exact ratio of sizes.
_WINDOW_PROBE_FACTOR = 3 * 3 * 5 * 7

_VIEW_CALLS = frozenset({"view", "reshape", "unflatten"})
_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace",
                        "logspace", "eye"})


class _ViewLog(torch.overrides.TorchFunctionMode):
    """Records the input and output shapes of every view, reshape and unflatten."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _FACTORIES and kwargs.get("device") is None:
            # A tensor the model creates from its input's size (EdgeNeXt's position mask of the
            # whole grid) would be allocated for real at the probe's huge sizes: on meta too.
            kwargs = {**kwargs, "device": "meta"}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") in _VIEW_CALLS and args and isinstance(args[0], torch.Tensor) and isinstance(
            out, torch.Tensor
        ):
            self.calls.append((tuple(args[0].shape), tuple(out.shape)))
        return out


def _splits(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """The groups of a view that make two or more output factors other than 1: one input dim
    split (``x.view(b, h // ws, ws, ...)``), or split with its outer part merged into the dims
    before it (MobileViT's ``x.reshape(b * c * (h // ph), ph, ...)``)."""
    from .forward_guard import _groups

    return [(gi, go) for gi, go in _groups(in_shape, out_shape) if sum(1 for o in go if out_shape[o] != 1) >= 2]


def _view_log(model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> list | None:
    """The views of one shape-only forward on an input of ``shape``, or None where it fails."""
    log = _ViewLog()
    try:
        with torch.no_grad(), _torch_forwards(model), _attributes_restored(model), _on_meta(model), log:
            model(torch.empty(shape, dtype=dtype, device="meta"))
    except Exception:  # noqa: BLE001 - a model that cannot run at these sizes: no windows found
        return None
    return log.calls


def _window_needs(model: nn.Module, shape: tuple[int, ...], dims: tuple[int, ...], dtype: torch.dtype) -> dict[int, int]:
    """Per dim of ``dims``: the rows a slab must be a whole number of for the windows the model's
    own views cut (``f * ws``, lcm over views; 1 where none). One shape-only pass at rows
    ``1024 * 315`` along ``dims``, then one per spatial input dim with that dim doubled: a view's
    input dim belongs to sharded dim ``d`` where it grows with ``d`` alone; its inner factors
    are a window where they stay constant in every pass. Nothing is found (no need added) where
    a pass fails or the passes make different views (a model that branches on its input size)."""
    spatial = range(2, len(shape))
    base = tuple(n * _WINDOW_PROBE_FACTOR if d in dims else n for d, n in enumerate(shape))
    logs = [_view_log(model, base, dtype)]
    for e in spatial:
        logs.append(_view_log(model, tuple(n * 2 if d == e else n for d, n in enumerate(base)), dtype))
    if any(log is None or len(log) != len(logs[0]) for log in logs):
        return {}
    needs: dict[int, int] = {}
    for i, (in0, out0) in enumerate(logs[0]):
        if any(len(log[i][0]) != len(in0) or len(log[i][1]) != len(out0) for log in logs):
            return {}
        for gi, go in _splits(in0, out0):
            # The one input dim of the group that grows with a spatial dim (the rows it holds):
            # its outer part goes to the group's first output factor, with the dims before it.
            growing = [(j, [e for e, log in zip(spatial, logs[1:]) if log[i][0][j] != in0[j]]) for j in gi]
            growing = [(j, g) for j, g in growing if g]
            if len(growing) != 1 or len(growing[0][1]) != 1 or growing[0][1][0] not in dims:
                continue
            (k, (d,)), = growing
            first = next(o for o in go if out0[o] != 1)
            inner = [o for o in go if o > first and out0[o] != 1]
            after = math.prod(in0[j] for j in gi if j > k)  # dims after k that the inner factors also hold
            window = math.prod(out0[o] for o in inner)
            if window % after or window // after == 1 or any(log[i][1][o] != out0[o] for log in logs for o in inner):
                continue
            window //= after
            f = Fraction(base[d], in0[k])
            if f.denominator != 1:
                continue  # upsampled, or padded after all: not a window of whole input rows
            needs[d] = math.lcm(needs.get(d, 1), int(f) * window)
    return needs
