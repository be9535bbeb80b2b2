"""timm ViT / Eva checkpoints to a model at another resolution (and patch size).

Pure ``state_dict -> state_dict`` transforms on full tensors, built from timm's own adapters, so
the result is what ``timm.create_model(name, pretrained=True, img_size=...)`` loads:

- ``adapt_state_dict(state_dict, model)``: timm's ``checkpoint_filter_fn`` of the model's module
  (ViT or Eva; the same variant options timm uses, e.g. bilinear for FlexiViT), which resamples
  the position embedding (``resample_abs_pos_embed``) and the patch embedding
  (``resample_patch_embed``) to the model's grid and patch, and converts foreign layouts
  (DINOv2, OpenCLIP, ...); then the classifier is dropped when the model has another number of
  classes, as timm's ``load_pretrained`` does.
- ``resample_vit_state_dict``: the same resampling without a model, from explicit grid sizes.
- ``load_pretrained(model, file)``: read a file (``converters.io``), adapt, check (one error
  listing every missing, unexpected or mis-shaped key) and load.

The model may be plain or already converted for a mesh: the state_dict keys are timm's either
way, and every tensor here is full (parameters are replicated over the domain ranks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from functools import partial

import torch
from torch import nn

from .io import check_state_dict, load_checkpoint

__all__ = ["adapt_state_dict", "load_pretrained", "resample_vit_state_dict", "timm_filter_fn"]


def _timm_class(model: nn.Module) -> type:
    """The timm model class of ``model`` (the sharded classes subclass it)."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("timm.models."):
            return cls
    raise TypeError(
        f"converters: {type(model).__name__} is not a timm model (no timm.models class in its MRO); "
        "build it with timm.create_model or sharded_nn.zoo.create_model."
    )


def _entry_module(variant: str) -> str:
    """The timm module whose entry point builds ``variant`` ("" when it is not a timm model name)."""
    import timm.models

    if not variant or not timm.models.is_model(variant):
        return ""
    return timm.models.model_entrypoint(variant).__module__


def timm_filter_fn(model: nn.Module) -> Callable[[dict, nn.Module], dict]:
    """timm's ``checkpoint_filter_fn`` for ``model``'s family, with the options timm uses for it.

    ViTs: FlexiViT variants resample bilinearly without antialias and RADIO variants with their
    own corner alignment, exactly as ``timm.models.vision_transformer._create_vision_transformer``.
    """
    cls = _timm_class(model)
    module = sys.modules[cls.__module__]
    fn = getattr(module, "checkpoint_filter_fn", None)
    if fn is None:
        raise TypeError(f"converters: timm module {module.__name__} has no checkpoint_filter_fn.")
    variant = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", "") or ""
    if _entry_module(variant) == "timm.models.deit":
        # DeiT and DeiT-3 are built by timm.models.deit (DeiT-3 as a plain VisionTransformer), whose
        # loader remaps the original checkpoints' layer scales (``gamma_1`` -> ``ls1.gamma``).
        return partial(fn, adapt_layer_scale=True)
    if module.__name__ == "timm.models.vision_transformer":
        if "flexi" in variant:
            return partial(fn, interpolation="bilinear", antialias=False)
        if "radio" in variant:
            corners = any(n in variant for n in getattr(module, "_RADIO_ALIGN_CORNERS", ()))
            return partial(fn, interpolation="bilinear", antialias=False, align_corners=corners)
    return fn


def adapt_state_dict(state_dict: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict`` (any resolution / patch size / known layout) adapted to ``model``.

    Pure: the input mapping is not modified. Returns the tensors ``model.load_state_dict`` takes.
    When ``model.num_classes`` differs from its pretrained config's, the classifier weights are
    dropped (the model keeps its fresh head), as timm does.
    """
    out = timm_filter_fn(model)(dict(state_dict), model)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    classifiers = cfg.get("classifier")
    if classifiers is not None and "num_classes" in cfg:
        classifiers = (classifiers,) if isinstance(classifiers, str) else tuple(classifiers)
        if getattr(model, "num_classes", cfg["num_classes"]) != cfg["num_classes"]:
            for name in classifiers:
                out.pop(f"{name}.weight", None)
                out.pop(f"{name}.bias", None)
        elif cfg.get("label_offset", 0) > 0:
            off = cfg["label_offset"]
            for name in classifiers:
                out[f"{name}.weight"] = out[f"{name}.weight"][off:]
                out[f"{name}.bias"] = out[f"{name}.bias"][off:]
    return out


def _classifier_keys(model: nn.Module) -> list[str]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    classifiers = cfg.get("classifier")
    if classifiers is None or getattr(model, "num_classes", cfg.get("num_classes")) == cfg.get("num_classes"):
        return []
    classifiers = (classifiers,) if isinstance(classifiers, str) else tuple(classifiers)
    return [f"{n}.{p}" for n in classifiers for p in ("weight", "bias")]


def load_pretrained(
    model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, torch.Tensor]
) -> nn.Module:
    """Load a checkpoint file (or state_dict) into ``model`` at the model's resolution; returns it.

    Raises:
        CheckpointMismatchError: listing every missing, unexpected and mis-shaped key after the
            adaptation (nothing is loaded then).
    """
    what = "checkpoint"
    if not isinstance(checkpoint, Mapping):
        what = f"checkpoint {os.fspath(checkpoint)!r}"
        checkpoint = load_checkpoint(checkpoint)
    state_dict = adapt_state_dict(checkpoint, model)
    allowed = _classifier_keys(model)
    check_state_dict(state_dict, model, allow_missing=allowed, what=what)
    model.load_state_dict(state_dict, strict=not allowed)
    return model


def resample_vit_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int] | None = None,
    new_patch: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> dict[str, torch.Tensor]:
    """Resample ``pos_embed`` to ``new_grid`` and ``patch_embed.proj.weight`` to ``new_patch``.

    Model-free form of the adaptation, with timm's ``resample_abs_pos_embed`` and
    ``resample_patch_embed``. ``num_prefix_tokens`` counts the prefix tokens that carry a
    position embedding (0 for ``no_embed_class`` models); ``old_grid`` defaults to the square
    grid the embedding holds. Other tensors pass through unchanged.
    """
    from timm.layers import resample_abs_pos_embed, resample_patch_embed

    out = dict(state_dict)
    if "pos_embed" in out:
        out["pos_embed"] = resample_abs_pos_embed(
            out["pos_embed"],
            new_size=list(new_grid),
            old_size=None if old_grid is None else list(old_grid),
            num_prefix_tokens=num_prefix_tokens,
            interpolation=interpolation,
            antialias=antialias,
        )
    key = "patch_embed.proj.weight"
    if new_patch is not None and key in out and tuple(out[key].shape[-2:]) != tuple(new_patch):
        out[key] = resample_patch_embed(out[key], list(new_patch), interpolation=interpolation, antialias=antialias)
    return out
