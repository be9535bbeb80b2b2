"""``convert(model, mesh)``: swap every registered layer of a module tree for its sharded class.

Plain local tensors flow between layers; only layers that mix values across a sharded dim need
replacing. Pointwise layers (activations, Linear over channels, Dropout, channel LayerNorm) stay.
Layers that mix positions but have no sharded class are named in a warning (an error with
``strict=True``), because on slabs they compute a silently wrong answer.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .errors import ShardingNotImplementedError, ShardingWarning
from .mesh import domain_axes
from .registry import registered, sharded_classes

# Layers that act on each position independently (or only across channels): safe on slabs.
_POINTWISE: tuple[type, ...] = (
    nn.Identity,
    nn.Linear,
    nn.Bilinear,
    nn.Dropout,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.RReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardshrink,
    nn.Softshrink,
    nn.Tanhshrink,
    nn.Softplus,
    nn.Softsign,
    nn.Sigmoid,
    nn.LogSigmoid,
    nn.Tanh,
    nn.Threshold,
    nn.GLU,
    nn.Embedding,
    nn.ChannelShuffle,
)
# Channel dropout draws one mask per (sample, channel); on slabs every rank would draw its own.
_CHANNEL_DROPOUT = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _is_pointwise(m: nn.Module) -> bool:
    if isinstance(m, _POINTWISE):
        return True
    if isinstance(m, _CHANNEL_DROPOUT):
        return not m.training or m.p == 0
    # A LayerNorm over the last dim only normalizes channels of (B, L, C) tokens.
    if isinstance(m, nn.LayerNorm) or type(m).__name__ in ("RMSNorm",):
        return len(getattr(m, "normalized_shape", (0, 0))) == 1
    return False


def _plan_entry(name: str, plan: Mapping[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """(matched, options) for module ``name``; first matching glob wins, ``None`` means skip."""
    if plan:
        for pattern, options in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                return True, (None if options is None else dict(options))
    return False, {}


def convert(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, Mapping[str, Any] | None] | None = None,
    strict: bool = False,
) -> nn.Module:
    """Swap every registered layer of ``model`` (in place) for its sharded class; return the model.

    Args:
        model: any module tree. The root itself is swapped too (use the return value).
        mesh: mesh with a domain axis (see ``init_mesh``).
        plan: maps module-name globs (``fnmatch``, matched against ``named_modules`` names, root
            ``""``) to keyword options for the sharded class's ``from_module`` (e.g.
            ``{"stem.*": {"dims": (2,)}}``) or to ``None`` to leave the module as it is. The
            first matching glob wins. A ``None`` entry also silences the warning for that module.
        strict: raise instead of warning when some layer would compute a wrong answer on slabs.

    Returns:
        The converted model. State-dict keys are unchanged; converting twice changes nothing.

    Raises:
        ShardingNotImplementedError: with ``strict=True``, listing the layers that mix positions
            across sharded dims and have no sharded class.
    """
    domain_axes(mesh)  # a clear error now for a mesh without a domain axis
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected an nn.Module, got {type(model).__name__}.")
    done = sharded_classes()
    hazards: list[str] = []
    replaced: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(name.startswith(r + ".") or (r == "" and name) for r in replaced):
            continue  # inside a module that was just replaced: its own class handles its children
        matched, options = _plan_entry(name, plan)
        if matched and options is None:
            continue
        sharded_cls = registered(type(module))
        if sharded_cls is not None:
            replaced[name] = sharded_cls.from_module(module, mesh, **options)
        elif not module._modules and type(module) not in done and not _is_pointwise(module):
            # Leaf layers only: a composite's children are checked one by one. (Functional calls
            # inside a custom forward cannot be seen from here.)
            hazards.append(f"{name or '<root>'} ({type(module).__name__})")
    for name, new in replaced.items():
        if name == "":
            model = new
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    if hazards:
        msg = (
            f"convert: {len(hazards)} layer(s) have no sharded version and may mix positions across "
            f"the sharded dims, which gives a silently wrong answer on slabs: {', '.join(hazards)}. "
            "Register a sharded class for them (sharded_nn.register), or, if they only act on "
            "channels or on a replicated tensor (e.g. after a global pool), mark them reviewed with "
            "plan={'<name>': None}."
        )
        if strict:
            raise ShardingNotImplementedError(msg)
        warnings.warn(msg, ShardingWarning, stacklevel=2)
    return model
