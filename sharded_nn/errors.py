"""Exceptions raised by sharded_nn.

Every sharded layer validates its input from facts that all ranks share (module configuration
and the gathered slab sizes), so that all ranks raise the same error together instead of one
rank raising while the others wait in a collective.

Inside a converted model, a ``ShardingError`` names where it happened: ``convert`` records on
every sharded layer its qualified name in the model, the root's class and the alignment the model
input needs (``CONTEXT_ATTR``). When the error is created, the frames of the raising call are
walked up to the nearest ``self`` carrying that record (only on error: nothing runs in the
steady state), and the message gets the module and the model-level fix. Every recorded fact is
the same on every rank, so the message stays identical on every rank.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

#: Attribute ``convert`` sets on each sharded layer of a converted model: a ``ModuleContext``.
CONTEXT_ATTR = "_snn_context"
#: How far up the stack a raising call is searched for a recorded module.
_MAX_FRAMES = 40
_MARK = " [in module '"
# The stride advice of a layer (layers/window.py) speaks of the layer's own input, which inside a
# model is an inner tensor: the model-level advice replaces it.
_LAYER_ADVICE = re.compile(r"Shard the\s+input with align a multiple of (\d+)(?: \([^)]*\))?\.")


class ModuleContext(NamedTuple):
    """Where a sharded layer sits in a converted model (recorded by ``convert``)."""

    name: str  #: qualified name in the model ("" for the root)
    layer: str  #: the layer's class name
    root: str  #: the root model's class name
    dims: tuple[int, ...]  #: the dims the model input is sharded along
    align: tuple[int, ...] | None  #: what the model input needs (snn.alignment), None: unknown


def _find_context(frame) -> ModuleContext | None:
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        obj = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        ctx = getattr(obj, "__dict__", {}).get(CONTEXT_ATTR) if obj is not None else None
        if isinstance(ctx, ModuleContext):
            return ctx
        frame = frame.f_back
    return None


def with_context(msg: str, ctx: ModuleContext) -> str:
    """``msg`` with the module of ``ctx`` and the model-level fix (see the module docstring)."""
    name, layer, root, dims, align = ctx
    where = f"{_MARK}{name or '<root>'}' ({layer}) of {root}"
    if align is None:
        return f"{msg}{where}; the alignment the model input needs could not be derived at convert time: see snn.alignment(model, dims).]"
    a = align[0] if len(align) == 1 else align
    fix = (
        f"; the model input needs align={a} along dims {dims} (snn.alignment(model, dims={dims})): shard it with "
        f"snn.local_slices(shape, mesh, dims={dims}, align={a})"
    )
    m = _LAYER_ADVICE.search(msg)
    if m is not None:
        k = int(m.group(1))
        msg = _LAYER_ADVICE.sub(f"This layer's input (inside the model) needs slabs starting at multiples of {k}.", msg)
        if all(x % k == 0 for x in align):
            fix += (
                f". If it already was, the slab layout drifted inside the model before '{name}' (a layer upstream "
                "changed the slab sizes unevenly, e.g. a convolution without padding on a sharded dim): rebalance "
                f"its input with snn.reshard(x, mesh, dims={dims}, align={k}), or pad inside the convolution"
            )
    return f"{msg}{where}{fix}.]"


class ShardingError(ValueError):
    """Bad sharded input: a misaligned or empty slab, a halo wider than a neighbour's slab, ...

    Raised inside a converted model, the message also names the module (its qualified name in the
    model) and the alignment the model input needs (see the module docstring).
    """

    def __init__(self, *args) -> None:
        if len(args) == 1 and isinstance(args[0], str) and _MARK not in args[0]:
            ctx = _find_context(sys._getframe(1))
            if ctx is not None:
                args = (with_context(args[0], ctx),)
        super().__init__(*args)


class ShardingNotImplementedError(NotImplementedError):
    """A valid torch configuration that sharded_nn cannot shard (yet)."""


class ShardingWarning(UserWarning):
    """A layer left unconverted that may compute a wrong answer on slabs."""
