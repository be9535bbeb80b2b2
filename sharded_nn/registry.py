"""The registry of sharded layers: torch layer class -> sharded class.

Kept apart from ``convert`` so that layer modules can register themselves without importing the
tree walk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

_REGISTRY: dict[type[nn.Module], type[nn.Module]] = {}


def register(torch_cls: type[nn.Module]) -> Callable[[type], type]:
    """Class decorator: ``@register(nn.Conv3d)`` makes ``convert`` swap ``nn.Conv3d`` for it.

    Matching is by exact type (a subclass of ``nn.Conv3d`` is not swapped unless registered
    itself). The decorated class needs a ``from_module(module, mesh, **options)`` classmethod.
    Registering a class for an already registered torch class replaces the earlier entry, so
    users can override the built-in layers.
    """
    if not (isinstance(torch_cls, type) and issubclass(torch_cls, nn.Module)):
        raise TypeError(f"register: expected an nn.Module subclass, got {torch_cls!r}.")

    def deco(sharded_cls: type) -> type:
        if not callable(getattr(sharded_cls, "from_module", None)):
            raise TypeError(
                f"register({torch_cls.__name__}): {sharded_cls.__name__} needs a "
                "from_module(module, mesh, **options) classmethod."
            )
        _REGISTRY[torch_cls] = sharded_cls
        return sharded_cls

    return deco


def registered(torch_cls: type) -> type[nn.Module] | None:
    """The sharded class registered for exactly ``torch_cls``, if any."""
    return _REGISTRY.get(torch_cls)


def sharded_classes() -> frozenset[type]:
    return frozenset(_REGISTRY.values())
