"""Sharded layers under ``torch.compile``: they run eagerly; the code around them compiles.

A sharded layer is a few tensor ops around collectives and halo exchanges, and a lot of Python
that plans them (agreements, halo plans, the layout scope). Dynamo cannot put the collectives
in a graph (gloo point-to-point, metadata all-gathers read back as Python ints), so each one
broke the graph, and each break deep inside a layer (ten frames below the model's ``forward``)
made Dynamo trace every frame above it again: three converted convolutions took 26 s per rank
to compile on a 2-core host (35 graphs of a few ops each). Traced internals also needed
compile-only branches (plans made afresh and baked into the graph; halo corrections added
functionally, since AOTAutograd gave wrong input gradients for the in-place form in one
arrangement), which the eager code never ran.

So when a compiled forward calls a sharded layer (``ShardedMixin``: its ``__call__`` and every
``forward`` its classes define), a grid function of ``sharded_nn.functional`` (``conv``,
``group_norm``, ``interpolate``, ``pad``) or its sequence attention (``ring_attention``,
``ulysses_attention``: a ViT's projections and MLPs compile around it), the call runs eagerly:
one graph break, Dynamo never traces the internals, and they run the code they run in eager
mode, plan caches included. The graphs hold the user's code between them (activations,
residual sums, plain torch layers, a ViT's token-wise blocks), which is where compilation
pays; a layer's own work is a convolution, norm or attention kernel, which compiled code calls
as it is anyway. The same three convolutions now compile and run their first step in 2.8 s.

A converted model's layout scope answers nothing inside such a call, and forgets for the rest
of the forward (``comm.sizes.compiled_caller``): the compiled code between the layers ran
unseen by the forward guard, whose views and crops the scope must see. Each such layer agrees
on its input (one small all-gather), as it did while traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .comm.sizes import compiled_caller

#: ``torch._dynamo.disable(_run_eagerly)``, made on first use (``torch._dynamo`` is a heavy import).
_DISABLED: list[Callable] = []


def _run_eagerly(fn: Callable, args: tuple, kwargs: dict):
    with compiled_caller():
        return fn(*args, **kwargs)


def run_eagerly(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` outside Dynamo's tracing (one graph break), for a traced caller."""
    if not _DISABLED:
        import torch._dynamo

        _DISABLED.append(torch._dynamo.disable(_run_eagerly))
    return _DISABLED[0](fn, args, kwargs)


def eager_under_compile(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs through ``run_eagerly`` when a compiled forward calls it (else as it is)."""
    if getattr(fn, "_snn_eager_under_compile", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return run_eagerly(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    wrapper._snn_eager_under_compile = True
    return wrapper
