"""Reading checkpoints safely and checking them against a model.

``load_checkpoint`` reads ``.safetensors`` (``safetensors.torch.load_file``) and ``.pth`` /
``.pt`` / ``.bin`` / ``.ckpt`` files (``torch.load(weights_only=True)``): no pickled code is ever
executed. ``check_state_dict`` compares a state_dict with a model and raises one error that lists
every missing, unexpected and mis-shaped key at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn

__all__ = ["CheckpointMismatchError", "check_state_dict", "load_checkpoint"]

_TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
# Wrappers that training scripts put around the weights, in the order timm's own loader looks.
_WRAPPER_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")
# Prefixes left by DDP and torch.compile.
_PREFIXES = ("_orig_mod.", "module.")


class CheckpointMismatchError(ValueError):
    """A state_dict does not fit a model; the message lists every offending key."""


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, unwrapped from ``{"model": ...}``-style containers.

    Args:
        path: a ``.safetensors`` file, or a torch file (``.pth``, ``.pt``, ``.bin``, ``.ckpt``).
        map_location: device to load the tensors to.

    Returns:
        A flat ``{key: tensor}`` dict; the ``module.`` / ``_orig_mod.`` prefixes of DDP and
        ``torch.compile`` are removed, as timm's loader does.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an unknown suffix, or a file that holds no tensor dict.
        pickle.UnpicklingError: a torch file that needs arbitrary code to load (``weights_only``
            refuses it; convert it to safetensors with the tool that wrote it).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint file at {path!r}.")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        obj: object = load_file(path, device=str(map_location))
    elif path.endswith(_TORCH_SUFFIXES):
        # weights_only: the unpickler accepts tensors and plain containers only, never code.
        obj = torch.load(path, map_location=map_location, weights_only=True)
    else:
        raise ValueError(
            f"load_checkpoint: {path!r} has an unknown suffix; expected .safetensors or one of {_TORCH_SUFFIXES}."
        )
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        kind = type(obj).__name__
        raise ValueError(
            f"load_checkpoint: {path!r} holds a {kind} that is not a flat dict of tensors (after unwrapping "
            f"{_WRAPPER_KEYS}). Save model.state_dict() instead."
        )
    out = {}
    for k, v in obj.items():
        for prefix in _PREFIXES:
            if k.startswith(prefix):
                k = k[len(prefix) :]
        out[k] = v
    return out


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    model: nn.Module,
    *,
    allow_missing: Iterable[str] = (),
    what: str = "checkpoint",
) -> None:
    """Raise one ``CheckpointMismatchError`` listing every key that does not fit ``model``.

    Args:
        state_dict: the tensors to load.
        model: the target; its ``state_dict()`` gives the expected keys and shapes.
        allow_missing: keys the model may keep as initialised (e.g. a new classifier).
        what: how the message names the state_dict (e.g. the file name).
    """
    expected = model.state_dict()
    allowed = set(allow_missing)
    missing = sorted(k for k in expected if k not in state_dict and k not in allowed)
    unexpected = sorted(k for k in state_dict if k not in expected)
    misshaped = sorted(
        f"{k}: {tuple(state_dict[k].shape)} in the {what}, {tuple(expected[k].shape)} in the model"
        for k in state_dict
        if k in expected and tuple(state_dict[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        if misshaped:
            parts.append(f"mis-shaped keys {misshaped}")
        raise CheckpointMismatchError(
            f"{type(model).__name__}: the {what} does not fit the model: {'; '.join(parts)}. Check that the "
            "checkpoint belongs to this architecture (name and kwargs such as embed_dim, depth, reg_tokens)."
        )
