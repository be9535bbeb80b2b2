"""timm's ViT ``Attention`` over a token slab: the attention core runs as ring or Ulysses attention.

Sharding contract: tokens ``(B, L_local, C)`` hold this rank's slab of the sequence; the output
has the same layout; parameters are replicated (their gradients are this rank's part, summed
over the domain). Loaded when a model needs it (``convert``, ``snn.ShardedTimmAttention``), not
by ``import sharded_nn``: importing timm costs seconds (it imports torchvision, which imports
torch's compiler), paid by every rank of every launch otherwise.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import Attention as _TimmAttention

from ..errors import ShardingError, ShardingNotImplementedError
from ..registry import register
from .attention import _AttentionMixin, _requires_grad, _shape_fact
from .base import dtype_code, gather_facts

__all__ = ["ShardedTimmAttention"]


@register(_TimmAttention)
class ShardedTimmAttention(_AttentionMixin, _TimmAttention):
    """timm's ViT ``Attention`` over token slabs ``(B, L_local, C)``; same state_dict keys.

    Mirrors ``timm.models.vision_transformer.Attention.forward`` (qkv projection, q/k norm,
    optional gate and scale norm, output projection) with the attention core replaced by
    ring or Ulysses attention. ``is_causal`` is supported; an explicit ``attn_mask`` is not.
    Attention dropout in training (``attn_drop.p``) uses the position-keyed mask law, as
    ``ShardedMultiheadAttention`` (``dropout_seed`` records the last mask's seed). Build with
    ``from_module`` or ``convert`` (options ``attention``, ``layout``).
    """

    def forward(  # noqa: D102
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        name = type(self).__name__
        drop_same, seed = self._dropout_facts(self.attn_drop.p)
        same = {
            **drop_same,
            **self._values_fact(),
            "dtype": (dtype_code(x.dtype),),
            "requires_grad": (_requires_grad(self, x),),
            "attn_mask given": (int(attn_mask is not None),),
            "is_causal": (int(is_causal),),
        }
        rows = gather_facts(self.mesh, name, same=same, local=(*_shape_fact(x, 3), seed))
        if attn_mask is not None:
            raise ShardingNotImplementedError(
                f"{name}: an explicit attn_mask is not supported on a sharded sequence; use is_causal."
            )
        dim = self.qkv.in_features
        if any(r[0] != 3 or r[3] != dim or r[1] != rows[0][1] for r in rows):
            raise ShardingError(
                f"{name}: expected (B, L_local, {dim}) tokens with one batch size on every rank; local shapes "
                f"by rank: {[r[1:] for r in rows]}."
            )
        dropout_p = self._set_dropout_seed(rows, self.attn_drop.p)
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = self._attend(q, k, v, is_causal, None, self.scale, dropout_p=dropout_p)
        x = x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        return self.proj_drop(x)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, {self.sharding_repr()}"
