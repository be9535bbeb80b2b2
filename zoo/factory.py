"""``create_model``: one entry point for every zoo model, sharded or plain.

Each model family registers a builder under one or more names (``@register_model("unet2d")``)
from its own module; names that no family registered are handed to the timm family (timm's own
model names, e.g. ``"vit_small_patch16_224"``), which registers itself with
``register_model(None)`` as the fallback. Builders take ``mesh`` (``None``: the plain
single-device model) and the family's keyword arguments, and return the model, converted for
``mesh`` when one is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["create_model", "list_models", "register_model"]

_BUILDERS: dict[str, Callable[..., nn.Module]] = {}
_FALLBACK: list[Callable[..., nn.Module]] = []


def register_model(*names: str | None) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register ``builder(name, *, mesh, **kwargs)`` under ``names``.

    ``None`` among the names makes the builder the fallback for names nobody registered (the
    timm family). A name registered twice raises, so two families never shadow each other.
    """

    def deco(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        for name in names:
            if name is None:
                _FALLBACK[:] = [builder]
                continue
            if name in _BUILDERS and _BUILDERS[name] is not builder:
                raise ValueError(f"register_model: {name!r} is already registered by {_BUILDERS[name].__module__}.")
            _BUILDERS[name] = builder
        return builder

    return deco


def list_models() -> list[str]:
    """Names registered by the zoo's own families (timm names are accepted as well)."""
    return sorted(_BUILDERS)


def _known_to_timm(name: str) -> bool:
    """Whether timm can build ``name`` (the fallback builder is timm's ``create_model``)."""
    try:
        import timm
    except ImportError:
        return False
    # A pretrained tag ("vit_base_patch16_224.augreg_in21k") names the same architecture.
    return timm.is_model(name.split(".")[0])


def create_model(name: str, *, mesh: Any = None, **kwargs: Any) -> nn.Module:
    """Build zoo model ``name``; converted for ``mesh`` (``None``: the plain model).

    Args:
        name: a zoo name (``"unet2d"``, ``"unet3d"``, ``"transolver"``, ``"fno2d"``, see ``list_models()``)
            or a timm model name (``"vit_small_patch16_224"``).
        mesh: a ``DeviceMesh`` with domain axes, or ``None`` for the single-device model.
        **kwargs: the family's options (timm kwargs such as ``img_size``, UNet or Transolver
            constructor arguments, ``pretrained_file``).

    With a ``mesh`` and no ``pretrained_file``, every rank of the mesh gets the first rank's
    random initial weights (``sharded_nn.sync_weights``): the same model everywhere, as domain
    parallelism needs; seed torch alike on every rank (``torch.manual_seed``) to make it the
    model that ``create_model(name)`` builds on one device after the same seed.
    """
    if not isinstance(name, str):
        raise TypeError(f"create_model: name must be a str, got {type(name).__name__}.")
    builder = _BUILDERS.get(name)
    if builder is None:
        if not _FALLBACK or not _known_to_timm(name):
            raise ValueError(
                f"create_model: unknown model {name!r}; expected a zoo model ({', '.join(list_models())}) "
                "or a timm model name (see timm.list_models(), e.g. 'vit_small_patch16_224'): check the spelling."
            )
        builder = _FALLBACK[0]
    model = builder(name, mesh=mesh, **kwargs)
    if mesh is not None and not kwargs.get("pretrained_file") and not kwargs.get("pretrained"):
        # Random initial weights: this torch seeds each process differently, and every domain
        # rank must hold the same weights (``sharded_nn.weights``): take the first rank's.
        from sharded_nn.weights import sync_weights

        sync_weights(model, mesh)
    return model
