"""Activation checkpointing of regions of a converted model: recomputed under the forward guard.

``torch.utils.checkpoint`` drops a region's activations in the forward and runs the region again
in backward. In a converted model the forward guard computes the model's own position-mixing
calls (a squeeze-excite mean, a pad, ``torch.roll``, a random drop-path decision) with their
sharded forms, but only while the root's forward runs: the recomputation in backward would run
them on the slab alone, and the gradients would be silently wrong. The guard therefore refuses
such calls inside ``torch.utils.checkpoint``, and ``activation_checkpoint`` is the checkpoint
that works: its recomputation runs under a guard mode that starts from the layouts the region's
inputs had in the forward and from the same random streams, so it recomputes exactly what the
forward computed (and makes the same collectives on every rank, in the same order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import forward_guard as _fg

__all__ = ["activation_checkpoint"]


def activation_checkpoint(function: Callable[..., Any], *args, **kwargs) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` for
    regions of a converted model: exact gradients where the region has calls the guard routes.

    Use it inside a converted model's forward (e.g. around each block) where activations do not
    fit; outside a guarded forward it is plain non-reentrant checkpointing. Keyword arguments go
    to ``torch.utils.checkpoint.checkpoint`` (``preserve_rng_state``, ``determinism_check``, ...),
    except ``use_reentrant`` (only ``False`` is supported: the reentrant variant recomputes on
    detached copies whose layouts the guard cannot follow) and ``context_fn``, which this
    function supplies.

    Returns:
        ``function(*args, **kwargs)`` with its activations recomputed in backward.

    Raises:
        ValueError: for ``use_reentrant=True`` or a ``context_fn``.
    """
    # Imported here: ``import sharded_nn`` stays light (the guard and torch.utils.checkpoint are
    # loaded by the first convert / checkpoint; an import's churn also reshapes the heap that
    # ``launch`` tunes, tests/test_host_memory.py).
    import torch.utils.checkpoint

    from . import forward_guard as _fg

    if kwargs.pop("use_reentrant", False):
        raise ValueError(
            "activation_checkpoint: use_reentrant=True is not supported (the reentrant checkpoint "
            "recomputes on detached copies of the inputs, whose layouts the forward guard cannot follow); "
            "leave use_reentrant unset."
        )
    if "context_fn" in kwargs:
        raise ValueError("activation_checkpoint: context_fn is supplied by activation_checkpoint itself; remove it.")
    mode = getattr(_fg._ACTIVE, "guard", None)
    if not isinstance(mode, _fg._GuardMode) or mode.suspended:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    # What the recomputation must start from: the layouts of the region's tensor inputs (the same
    # tensor objects come back in the recomputation) and the random streams as they are now.
    inputs = [(t, mode.states.get(t)) for t in _fg._flat_tensors((args, kwargs))]
    streams = mode.streams.snapshot() if mode.streams is not None else None

    def context_fn():
        return _Region(mode), _Recompute(mode.guard, inputs, streams)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


class _Region(contextlib.AbstractContextManager):
    """The region's forward: the guard's routes run (no refusal) under the current mode."""

    def __init__(self, mode: _fg._GuardMode) -> None:
        self.mode = mode

    def __enter__(self):
        self.mode.regions += 1
        return self

    def __exit__(self, *exc) -> None:
        self.mode.regions -= 1


class _Recompute(contextlib.AbstractContextManager):
    """The recomputation in backward: a fresh guard mode with the region inputs' layouts."""

    def __init__(self, guard: _fg.ForwardGuard, inputs, streams) -> None:
        self.guard, self.inputs, self.streams = guard, inputs, streams
        self.mode: _fg._GuardMode | None = None
        self.previous = None

    def __enter__(self):
        from . import forward_guard as _fg

        mode = _fg._GuardMode(self.guard)
        for t, state in self.inputs:
            if state is not None:
                mode.states[t] = state
        # A snapshot of the snapshot: a second backward through the same graph (retain_graph)
        # recomputes from the same point again.
        mode.streams = self.streams.snapshot() if self.streams is not None else None
        mode.regions = 1
        self.previous = getattr(_fg._ACTIVE, "guard", None)
        mode.__enter__()
        _fg._ACTIVE.guard = mode
        self.mode = mode
        return self

    def __exit__(self, *exc) -> None:
        from . import forward_guard as _fg

        self.mode.__exit__(*exc)
        _fg._ACTIVE.guard = self.previous
        self.mode = None
