"""torch's Transformer containers without their fused fast paths, over a sharded sequence.

In eval, when no gradient is needed, ``nn.TransformerEncoderLayer.forward`` calls the fused
``torch._transformer_encoder_layer_fwd`` and ``nn.TransformerEncoder.forward`` packs a padded
batch into a nested tensor. Both read ``self_attn``'s weights themselves and never call
``self_attn.forward``: on a sharded sequence each rank would attend to its own slab only, a
silently wrong answer (issue 15). ``convert`` therefore swaps these two containers for the
subclasses below, which always take torch's reference path (the one torch takes in training) and
swap their attention children for the registered sharded class (``ShardedMultiheadAttention``).

``nn.TransformerDecoderLayer``, ``nn.TransformerDecoder`` and ``nn.Transformer`` have no fast path
of their own (``Transformer`` reaches the encoder's through its ``encoder``), so ``convert`` walks
into them as into any composite and swaps their attention modules; ``nn.MultiheadAttention``'s
own fast path lives in its ``forward``, which ``ShardedMultiheadAttention`` replaces.

Sharding contract (both classes): tokens are this rank's slab of the sequence, ``(B, L_local, E)``
with ``batch_first=True`` or ``(L_local, B, E)`` otherwise, and so is the output; key padding masks
are bool ``(B, L_local)`` slabs (True = padding), sharded like the tokens. Parameters are
replicated; the attention modules run the collectives (see ``attention.py``). The only attention
mask supported is a causal one, passed with ``is_causal=True``. state_dict keys are torch's.

Because a swapped container builds its own children, ``convert``'s ``plan`` options reach the
attention modules inside it only through the container's entry: ``plan={"encoder": {"attention":
"ulysses"}}`` (a glob naming ``...self_attn`` inside a swapped container is reported as unused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ShardingNotImplementedError
from ..mesh import domain_axes
from ..registry import register, registered, sharded_classes
from .base import check_mesh

#: Keyword options of the containers, handed on to their attention modules.
_ATTENTION_OPTIONS = ("attention", "layout")


def _shallow_copy(cls: type, module: nn.Module) -> nn.Module:
    """An instance of ``cls`` sharing ``module``'s parameters, buffers, children and hooks."""
    new = cls.__new__(cls)
    # Copies of the registries (so swapping a child of the copy leaves ``module`` as it was), same
    # Parameter objects (so state_dict keys and values are unchanged).
    new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
    return new


def _sharded_attention(module: nn.Module, mesh: DeviceMesh, options: Mapping[str, Any], where: str) -> nn.Module:
    """``module`` swapped for its registered sharded class (itself if it is sharded already)."""
    if type(module) in sharded_classes():
        return module
    cls = registered(type(module))
    if cls is None:
        raise ShardingNotImplementedError(
            f"{where}: the attention module {type(module).__name__} has no sharded class; register one with "
            "sharded_nn.register, or use nn.MultiheadAttention."
        )
    return cls.from_module(module, mesh, **options)


def _refuse_nested(x: torch.Tensor, what: str) -> None:
    if x.is_nested:
        raise ShardingNotImplementedError(
            f"{what}: nested tensors are not supported on a sharded sequence; pass padded token slabs with a "
            "key padding mask."
        )


class _ShardedContainer:
    """What both containers share: mesh options, sharding facts, ``from_module``, ``extra_repr``."""

    def _init_sharding(self, mesh: DeviceMesh, options: Mapping[str, Any]) -> None:
        name = type(self).__name__
        check_mesh(mesh, name)
        unknown = sorted(set(options) - set(_ATTENTION_OPTIONS))
        if unknown:
            raise TypeError(
                f"{name}: unknown sharding options {unknown}; expected any of {_ATTENTION_OPTIONS} (handed on to "
                "the attention modules)."
            )
        self.mesh = mesh
        self.mesh_axes = domain_axes(mesh)
        self.sharding_options = dict(options)
        self._shard_children()
        # The sequence dim, for convert's check of the other layers against the sharded dims.
        self.dims = (1 if self._batch_first() else 0,)

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, **options: Any) -> nn.Module:
        """A sharded copy of ``module`` sharing its parameters; ``attention``/``layout`` go to its attention."""
        new = _shallow_copy(cls, module)
        new._init_sharding(mesh, options)
        return new

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        opts = ", ".join(f"{k}={v!r}" for k, v in self.sharding_options.items())
        mine = f"mesh_axes={self.mesh_axes}, dims={self.dims}" + (f", {opts}" if opts else "")
        return f"{base}, {mine}" if base else mine


@register(nn.TransformerEncoderLayer)
class ShardedTransformerEncoderLayer(_ShardedContainer, nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` over token slabs, exact in every mode (no fused fast path).

    Same constructor plus keyword-only ``mesh`` and the attention options ``attention``
    (``"ring"`` or ``"ulysses"``) and ``layout`` (``"contiguous"`` or ``"zigzag"``); or
    ``from_module`` / ``convert``. ``self_attn`` is a ``ShardedMultiheadAttention``. The forward is
    torch's reference path (norm_first or not) in train, eval, ``no_grad`` and ``inference_mode``
    alike, with the bool ``src_key_padding_mask`` slab passed to the attention as it is (torch
    would turn it into a float mask first, which the sharded attention does not take).
    """

    def __init__(self, *args: Any, mesh: DeviceMesh, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in _ATTENTION_OPTIONS if k in kwargs}
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, options)

    def _batch_first(self) -> bool:
        return self.self_attn.batch_first

    def _shard_children(self) -> None:
        self.self_attn = _sharded_attention(self.self_attn, self.mesh, self.sharding_options, type(self).__name__)

    def forward(  # noqa: D102
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        _refuse_nested(src, type(self).__name__)
        # torch's mask normalisation, for the attention mask only (a bool causal mask becomes the
        # float one, as torch passes it on); the key padding stays bool.
        src_mask = F._canonical_mask(
            mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype,
            check_other=False,
        )
        # torch's reference path (see nn.TransformerEncoderLayer.forward after the fast path).
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x


@register(nn.TransformerEncoder)
class ShardedTransformerEncoder(_ShardedContainer, nn.TransformerEncoder):
    """``nn.TransformerEncoder`` over token slabs, exact in every mode (no nested-tensor path).

    Same constructor plus keyword-only ``mesh``, ``attention`` and ``layout`` (handed on to every
    layer); or ``from_module`` / ``convert``. Every layer becomes a
    ``ShardedTransformerEncoderLayer`` (same state_dict keys). torch's encoder packs a padded
    batch into a nested tensor in eval; here the padded slabs and the bool key padding mask go
    through the layers as in training, so the output at padded positions is the reference
    path's value (torch's nested path returns zeros there).
    """

    def __init__(self, *args: Any, mesh: DeviceMesh, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in _ATTENTION_OPTIONS if k in kwargs}
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, options)

    def _batch_first(self) -> bool:
        return self.layers[0].self_attn.batch_first

    def _shard_children(self) -> None:
        # A new ModuleList (same keys "layers.<i>"), so the module this was copied from keeps its own.
        layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ShardedTransformerEncoderLayer):
                layers.append(layer)
            elif type(layer) is nn.TransformerEncoderLayer:
                layers.append(ShardedTransformerEncoderLayer.from_module(layer, self.mesh, **self.sharding_options))
            else:
                raise ShardingNotImplementedError(
                    f"{type(self).__name__}: layers[{i}] is a {type(layer).__name__}, not an "
                    "nn.TransformerEncoderLayer; register a sharded class for it and build the stack yourself."
                )
        self.layers = nn.ModuleList(layers)
        # Never pack into a nested tensor (read by torch's forward, kept for anyone who calls it).
        self.use_nested_tensor = False

    def forward(  # noqa: D102
        self,
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        _refuse_nested(src, type(self).__name__)
        mask = F._canonical_mask(
            mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype, check_other=False
        )
        # torch's causal-mask detection, on the local length as torch does on its input's: a
        # global (L, L) causal mask needs is_causal=True (otherwise the attention refuses it).
        seq_len = src.shape[1 if self._batch_first() else 0] if src.dim() == 3 else src.shape[0]
        is_causal = nn.modules.transformer._detect_is_causal_mask(mask, is_causal, seq_len)
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
        if self.norm is not None:
            output = self.norm(output)
        return output


__all__ = ["ShardedTransformerEncoder", "ShardedTransformerEncoderLayer"]
