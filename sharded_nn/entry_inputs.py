"""Which dims each tensor input of a converted model is sharded along (``convert(..., input_dims=...)``).

By default every tensor input of a converted root with more dims than the model's sharded
``dims`` is a slab along those dims (a field ``(N, C, H, W)`` along ``H``). Inputs of another
rank need their own: a segmentation target of class indices ``(N, H, W)`` (sharded along dim
1, where the scores ``(N, C, H, W)`` are sharded along dim 2), a land-sea mask, per-token
labels, or a whole (replicated) tensor of as many dims as a slab. ``input_dims`` names them by
the forward's parameter name (or position): ``{"target": (1,)}``, ``{"static": None}``. The
forward guard, the entry facts and the entry layouts all read the inputs through ``InputDims``,
so they take each input alike on every rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn as nn

__all__ = ["InputDims"]


class InputDims:
    """The sharded dims of a root's tensor inputs: ``input_dims`` for the named ones, ``dims`` for the rest.

    Args:
        model: the converted root (its ``forward``'s signature names the inputs).
        dims: the model's sharded dims (one per domain axis).
        input_dims: forward parameter name (or position, from 0 after ``self``) -> the dims that
            input is sharded along (one per domain axis, as ``dims``; an int for one axis), or
            ``None`` for a whole (replicated) tensor.
    """

    def __init__(self, model: nn.Module, dims: Sequence[int], input_dims: Mapping) -> None:
        self.dims = tuple(dims)
        params = [
            p for p in list(inspect.signature(type(model).forward).parameters.values())[1:]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        names = [p.name for p in params]
        self.positional = [p.name for p in params if p.kind != p.KEYWORD_ONLY]
        self.by_name: dict[str, tuple[int, ...] | None] = {}
        for key, value in input_dims.items():
            name = self.positional[key] if isinstance(key, int) and 0 <= key < len(self.positional) else key
            if name not in names:
                raise ValueError(
                    f"convert: input_dims names {key!r}, which is not a tensor input of {type(model).__name__}.forward "
                    f"(its inputs: {', '.join(names) or 'none'}). Name an input of forward, or its position."
                )
            self.by_name[name] = self._checked(key, value)

    def _checked(self, key, value) -> tuple[int, ...] | None:
        if value is None:
            return None
        dims = (value,) if isinstance(value, int) else tuple(value)
        if (len(dims) != len(self.dims) or len(set(dims)) != len(dims)
                or any(not isinstance(d, int) or d < 0 for d in dims)):
            raise ValueError(
                f"convert: input_dims[{key!r}] must be None (a whole tensor) or {len(self.dims)} distinct "
                f"non-negative dim(s), one per sharded dim of the model {self.dims}; got {value!r}."
            )
        return dims

    def tensors(self, args: tuple, kwargs: dict) -> Iterator[tuple[torch.Tensor, tuple[int, ...] | None, bool]]:
        """Each tensor input (in ``(*args, *kwargs.values())`` order) with its dims and whether
        ``input_dims`` named it (else the caller applies the model's ``dims`` as it does)."""
        for i, t in enumerate(args):
            if isinstance(t, torch.Tensor):
                name = self.positional[i] if i < len(self.positional) else None
                yield (t, self.by_name[name], True) if name in self.by_name else (t, self.dims, False)
        for name, t in kwargs.items():
            if isinstance(t, torch.Tensor):
                yield (t, self.by_name[name], True) if name in self.by_name else (t, self.dims, False)
