"""timm's Vision Transformers, domain-parallel: ``VisionTransformer`` and ``Eva``, converted.

The models are timm's own classes (built by ``timm.create_model``), so every timm option and
checkpoint keeps working; ``snn.convert(model, mesh)`` swaps the model for its sharded subclass
(``ShardedVisionTransformer`` / ``ShardedEva``, registered like any layer), which shares the
parameters, keeps timm's state_dict keys and overrides only the forward passes that see tokens of
the whole image. ``create_model`` builds, loads a checkpoint at another resolution and converts.

Sharding contract
-----------------
- Input: this rank's slab of the image ``(B, C, H, W)``: H sharded by a 1-D domain mesh, H and
  W by a 2-D one (``"domain0"`` shards H, ``"domain1"`` W). Every slab starts at a multiple of
  the patch size and, except the last along each axis, spans whole patches, so the patch
  embedding (a convolution with stride = kernel = patch) runs on the slab with no halo::

      x_local = x[snn.local_slices(x.shape, mesh, dims=(2,), align=patch)]        # 1-D
      x_local = x[snn.local_slices(x.shape, mesh, dims=(2, 3), align=patch)]      # 2 x 2 ...

  The last slab may end in a partial patch only for ``dynamic_img_pad=True`` models (it is
  padded there, as timm pads the whole image). One tiny all-gather of the slab shapes per
  forward tells each rank the global grid and its offset.
- Token order: this rank's patch tokens are its block of the global patch grid,
  ``(h_local, w_local)`` patches starting at patch ``(h0, w0)``, flattened row-major. Local token
  ``t = i * w_local + j`` is global patch ``(h0 + i, w0 + j)``, i.e. timm's token
  ``num_prefix_tokens + (h0 + i) * W_patches + (w0 + j)``. With a 1-D mesh the ranks' tokens are
  consecutive runs of timm's sequence; with a 2-D mesh they are blocks, and the global sequence
  is the ranks' tokens in domain-rank order (attention does not depend on the order).
- Prefix tokens (class and register tokens): held by every rank, in front of its patch tokens,
  with identical values on every rank. In attention they are keys and values once: the prefix
  K/V travel with the slab of domain rank 0 only. Patch queries attend over the ring (all patch
  keys plus the prefix keys once). Prefix queries attend to all tokens too: with ring attention
  they ride along the ring (every rank scores them against each K/V block as it passes and merges
  the per-block results in rank order: no collective of their own); with Ulysses each rank scores
  them against its own keys and the per-rank partial results (output and log-sum-exp) are
  all-gathered and merged in rank order. Either way every rank computes bit-identical prefix
  tokens. Holds for
  ``no_embed_class`` True (position embeddings on patches only) and False (the prefix slice of
  ``pos_embed`` added on every rank).
- Position embeddings: each rank adds its own rows of the position embedding (for
  ``dynamic_img_size`` models, of timm's ``resample_abs_pos_embed`` of it to the global grid,
  the very call timm makes); Eva's rotary embedding is indexed by global token positions.
- Outputs: ``forward_features`` returns this rank's tokens ``(B, num_prefix + h_local * w_local,
  C)`` (the prefix tokens first); ``forward_intermediates`` returns this rank's slab of each
  requested block, ``(B, C, h_local, w_local)`` (NCHW, the feature map sharded like the image)
  or ``(B, h_local * w_local, C)`` (NLC). Pooled features and logits (``token``, ``avg``,
  ``avgmax``, ``max``, ``map``, ``prr`` pooling, ``fc_norm``) are replicated, identical on every
  rank.
- Blocks: timm's ``Block``, ``ResPostBlock`` and ``ParallelThingsBlock`` keep their class, their
  ``Attention`` modules are swapped for ``ShardedViTAttention``; ``ParallelScalingBlock`` and
  ``DiffParallelScalingBlock`` compute attention inline and are converted whole
  (``ShardedParallelScalingBlock``, ``ShardedDiffParallelScalingBlock``). Everything else in a
  block is per token.
- Gradients (DESIGN.md section 3): the per-rank losses sum to the global loss; replicated values
  (prefix tokens, pooled features, logits) carry a partial gradient on each rank, and the
  collectives that made them replicated (all-reduce of pooled sums, all-gather of partial
  attention results and maxima) sum gradients in backward. Input gradients are exact per slab;
  parameter gradients summed over the domain ranks equal the single-device ones.
- Randomness in training: drop-path draws one keep/drop decision per sample, the same on every
  rank (a generator shared by the domain ranks), with timm's probability and ``1/keep`` scaling.
  Element-wise dropout (``pos_drop``, projection and MLP dropout) draws the patch tokens' masks
  from a per-rank generator (independent across ranks, as the elements of one tensor are) and the
  prefix tokens' and pooled features' masks from the shared one, so replicated values stay
  identical. "Same" therefore means the same distribution as timm, not the same random numbers
  as a single-device run. The generators are seeded from ``seed`` (default: domain rank 0's
  ``torch.initial_seed()``, plus the data-parallel index). Attention dropout is position-keyed:
  each training forward of each attention layer draws one seed from the shared generator, and
  the probability of (sample b, head h, query token i, key token j) is dropped when a hash of
  that seed and (b, h, i, j) falls below p (``sharded_nn.attention_kernels.dropout_keep``), i
  and j being timm's token indices (prefix tokens first, then patches row-major over the global
  grid). Every rank thus computes its part of one mask, backward regenerates it, and the result
  is exactly single-device attention under that mask: the law of timm's
  ``F.scaled_dot_product_attention(dropout_p=p)`` (independent Bernoulli drops, kept values
  scaled by ``1 / (1 - p)``), not its random bits. Patch dropout and rotary-coordinate
  augmentation in training are refused (``ShardingNotImplementedError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import timm.layers as _timm_layers
import timm.models.vision_transformer as _tv
from timm.layers import AttentionPoolLatent, AttentionRope, DropPath, HybridEmbed, PatchEmbed, resample_abs_pos_embed
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint, checkpoint_seq
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.vision_transformer import (
    Attention,
    Block,
    ParallelScalingBlock,
    ParallelThingsBlock,
    ResPostBlock,
    VisionTransformer,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sharded_nn.attention_kernels import BlockDropout
from sharded_nn.comm import all_gather_grid, all_reduce_sum, domain_peers, gather_ints, gather_layouts
from sharded_nn.errors import ShardingError, ShardingNotImplementedError
from sharded_nn.functional import ring_attention, ulysses_attention
from sharded_nn.mesh import axis_index, data_axis, domain_axes, domain_group
from sharded_nn.registry import register

from .factory import register_model

__all__ = ["ShardedEva", "ShardedVisionTransformer", "ShardedVisionTransformerDistilled", "TokenGrid", "create_vit"]

_ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}

# Newer timm parts, absent from older releases (then nothing of theirs needs sharding).
_DiffParallelScalingBlock = getattr(_tv, "DiffParallelScalingBlock", None)
_AttentionPoolPrr = getattr(_timm_layers, "AttentionPoolPrr", None)


# --------------------------------------------------------------------------- token layout


@dataclass(frozen=True)
class TokenGrid:
    """Where this rank's patch tokens sit in the global patch grid (identical facts on all ranks).

    Attributes:
        grid: global patch grid ``(H_patches, W_patches)``.
        start: this rank's first patch ``(h0, w0)``.
        size: this rank's patches ``(h_local, w_local)``.
        counts: every domain rank's number of patch tokens, by ring coordinate (the domain axes
            flattened row-major, as the attention ring runs); empty when not known.
    """

    grid: tuple[int, int]
    start: tuple[int, int]
    size: tuple[int, int]
    counts: tuple[int, ...] = ()

    @property
    def num_local(self) -> int:
        return self.size[0] * self.size[1]

    @property
    def num_global(self) -> int:
        return self.grid[0] * self.grid[1]

    def token_index(self, device: torch.device) -> torch.Tensor:
        """Row-major global patch index of each local token, in local token order."""
        rows = torch.arange(self.start[0], self.start[0] + self.size[0], device=device)
        cols = torch.arange(self.start[1], self.start[1] + self.size[1], device=device)
        return (rows[:, None] * self.grid[1] + cols[None, :]).reshape(-1)

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The local tokens' rows of ``t``, whose ``dim`` runs over the global grid row-major."""
        dim = dim % t.dim()
        if self.size[1] == self.grid[1]:  # whole rows: one contiguous run
            return t.narrow(dim, self.start[0] * self.grid[1], self.num_local)
        g = t.unflatten(dim, self.grid)
        g = g.narrow(dim, self.start[0], self.size[0]).narrow(dim + 1, self.start[1], self.size[1])
        return g.flatten(dim, dim + 1)


# --------------------------------------------------------------------------- randomness


class _Streams:
    """The random streams of one converted model.

    ``shared``: the same on every domain rank (drop-path, prefix tokens, replicated features);
    ``local``: different on every domain rank (patch-token dropout). Generators are made lazily
    per device; a deep copy starts the streams afresh from the seed.
    """

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = int(seed), int(rank)
        self._gens: dict[tuple[str, str], torch.Generator] = {}
        #: timm token indices of this rank's tokens in the current forward (set by the model for
        #: the attention-dropout mask law; None outside a model forward).
        self.positions: torch.Tensor | None = None
        #: Every domain rank's patch-token count while the model runs its blocks (None otherwise):
        #: the attention layers pass it on as gathered lengths instead of gathering per layer.
        self.token_counts: tuple[int, ...] | None = None

    def _gen(self, kind: str, device: torch.device) -> torch.Generator:
        key = (kind, str(device))
        gen = self._gens.get(key)
        if gen is None:
            offset = 0 if kind == "shared" else 0x9E3779B97F4A7C15 * (self.rank + 1)
            gen = torch.Generator(device=device)
            gen.manual_seed((self.seed + offset) % (1 << 63))
            self._gens[key] = gen
        return gen

    def shared(self, device: torch.device) -> torch.Generator:
        return self._gen("shared", device)

    def local(self, device: torch.device) -> torch.Generator:
        return self._gen("local", device)

    def dropout_seed(self) -> int:
        """A fresh seed for one attention-dropout mask, the same on every domain rank."""
        return int(torch.randint(0, 1 << 62, (1,), generator=self.shared(torch.device("cpu"))).item())

    def __deepcopy__(self, memo) -> _Streams:
        return _Streams(self.seed, self.rank)

    def __getstate__(self):
        return {"seed": self.seed, "rank": self.rank}

    def __setstate__(self, state) -> None:
        self.__init__(state["seed"], state["rank"])


def _keep_mask(shape, p: float, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    keep = 1.0 - p
    mask = torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(keep, generator=gen)
    return mask.div_(keep) if keep > 0 else mask


class SharedDropPath(DropPath):
    """timm's ``DropPath`` (one keep/drop per sample, scaled by 1/keep) with the mask drawn from
    the generator shared by the domain ranks, so every rank drops the same samples."""

    def __init__(self, drop_prob: float, scale_by_keep: bool, streams: _Streams) -> None:
        super().__init__(drop_prob, scale_by_keep)
        self.streams = streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep, generator=self.streams.shared(x.device))
        if keep > 0.0 and self.scale_by_keep:
            mask.div_(keep)
        return x * mask


class TokenDropout(nn.Dropout):
    """``nn.Dropout`` on ``(B, L, ...)`` tokens whose first ``num_prefix_tokens`` are replicated.

    The prefix rows' mask comes from the shared generator (identical on every rank), the patch
    rows' from this rank's own generator.
    """

    def __init__(self, p: float, num_prefix_tokens: int, streams: _Streams) -> None:
        super().__init__(p)
        self.num_prefix_tokens, self.streams = num_prefix_tokens, streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if not self.training or self.p == 0.0:
            return x
        n = self.num_prefix_tokens
        masks = []
        if n:
            masks.append(_keep_mask((x.shape[0], n, *x.shape[2:]), self.p, x, self.streams.shared(x.device)))
        masks.append(_keep_mask((x.shape[0], x.shape[1] - n, *x.shape[2:]), self.p, x, self.streams.local(x.device)))
        return x * torch.cat(masks, 1)


class SharedDropout(nn.Dropout):
    """``nn.Dropout`` on a replicated tensor: the mask comes from the shared generator."""

    def __init__(self, p: float, streams: _Streams) -> None:
        super().__init__(p)
        self.streams = streams

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if not self.training or self.p == 0.0:
            return x
        return x * _keep_mask(x.shape, self.p, x, self.streams.shared(x.device))


def _agree_seed(mesh: DeviceMesh, seed: int | None) -> tuple[int, int]:
    """(seed, domain rank): domain rank 0's seed, offset by the data-parallel index."""
    ring = domain_peers(mesh)
    if seed is None:
        # initial_seed does not advance the user's RNG; one tiny all-gather makes it common.
        seed = gather_ints([torch.initial_seed() % (1 << 62)], ring)[0][0]
    data = data_axis(mesh)
    if data is not None:
        seed = seed + 1_000_003 * axis_index(mesh, data)
    return int(seed), ring.index


# --------------------------------------------------------------------------- attention


def _partial_attention(q, k, v, scale: float, drop: BlockDropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over the keys ``k`` and its log-sum-exp (float32 for halves)."""
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    h, hk = q.shape[1], k.shape[1]
    # Grouped-query attention (fewer K/V heads): query head i reads K/V head i // (h // hk), as
    # timm's ``repeat_interleave`` does, without repeating K/V: (B, Hkv, G, L, D) against (B, Hkv, 1, L, D).
    qg = q.to(acc).unflatten(1, (hk, h // hk))
    s = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1)
    probs = torch.exp(s - lse[..., None])
    if drop is not None:
        # Dropout on the normalised probabilities; the lse (and so the merge) is unchanged.
        probs = probs * drop.scale(0, q.shape[2], acc).unflatten(1, (hk, h // hk))
    return torch.matmul(probs, v.to(acc).unsqueeze(2)).flatten(1, 2), lse.flatten(1, 2)


def replicated_query_attention(
    q, k, v, mesh: DeviceMesh, scale: float, *, drop: BlockDropout | None = None
) -> torch.Tensor:
    """Attention of replicated queries over the keys of all domain ranks; bit-identical on every rank.

    Args:
        q: ``(B, H, Lq, D)``, the same on every rank (prefix tokens, attention-pool latents).
        k, v: ``(B, Hkv, Lk_local, D)``, this rank's keys and values (each key on one rank only;
            ``Hkv`` divides ``H``: grouped-query heads, query head i reading K/V head i // (H / Hkv)).
        mesh: mesh with domain axes.
        scale: score scale.
        drop: attention dropout of these queries over this rank's keys (position-keyed, so the
            same mask on every rank); None for none.

    Each rank attends over its own keys; the partial outputs and log-sum-exps are all-gathered
    (one collective, whose backward sums the gradients over the ranks) and merged in domain-rank
    order, so every rank computes the same bits.
    """
    out, lse = _partial_attention(q, k, v, scale, drop)
    group = domain_group(mesh)
    p = dist.get_world_size(group)
    if p == 1:
        return out.to(v.dtype)
    packed = torch.cat([out, lse[..., None]], -1).unsqueeze(0)
    parts = all_gather_grid(packed, group, (0,), [(r,) for r in range(p)], ((1,) * p,), dist.get_rank(group))
    outs, lses = parts[..., :-1], parts[..., -1]
    weights = torch.exp(lses - torch.logsumexp(lses, 0))
    return (weights[..., None] * outs).sum(0).to(v.dtype)


def prefix_self_attention(
    q,
    k,
    v,
    num_prefix: int,
    mesh: DeviceMesh,
    attention: str,
    scale: float,
    *,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    positions: torch.Tensor | None = None,
    seq_lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """Exact self-attention of ``[prefix, local patches]`` token slabs (the prefix replicated).

    The prefix keys/values count once (they join domain rank 0's slab); patch queries go through
    ring or Ulysses attention. Prefix queries: with ring attention they ride along the ring as
    replicated queries (``ring_attention(replicated_q=...)``: no collective of their own); with
    Ulysses through ``replicated_query_attention`` (one all-gather). The result is a
    ``(B, H, n, D)`` view of a ``(B, n, H, D)`` tensor, so that the caller's
    ``transpose(1, 2).reshape`` to tokens needs no copy. With
    ``dropout_p > 0`` the mask is keyed on ``dropout_seed`` and ``positions`` (the global token
    indices of this rank's ``[prefix, patches]`` tokens, required then). ``seq_lens``: every
    rank's (patch query, key) lengths, already gathered (see ``ring_attention``).
    """
    fn = _ATTENTION[attention]
    drop = {"seq_lens": seq_lens}
    if dropout_p > 0:
        drop.update(dropout_p=dropout_p, dropout_seed=dropout_seed)
    if num_prefix == 0:
        if dropout_p > 0:
            drop.update(q_positions=positions, k_positions=positions)
        return fn(q, k, v, mesh, False, scale, **drop)
    first = dist.get_rank(domain_group(mesh)) == 0
    k_pos = positions
    if not first:
        k, v = k[:, :, num_prefix:], v[:, :, num_prefix:]
        k_pos = None if positions is None else positions[num_prefix:]
    if dropout_p > 0:
        drop.update(q_positions=positions[num_prefix:], k_positions=k_pos)
    # One split, not two slices: its backward concatenates the two query gradients, where each
    # slice's backward zero-fills a gradient the size of ``q`` and the two are added.
    q_prefix, q_patch = q.split([num_prefix, q.shape[2] - num_prefix], 2)
    if attention == "ring":
        if dropout_p > 0:
            drop.update(replicated_positions=positions[:num_prefix])
        return ring_attention(
            q_patch, k, v, mesh, False, scale, replicated_q=q_prefix, concat_replicated=True, **drop,
        )
    out_patch = fn(q_patch, k, v, mesh, False, scale, **drop)
    prefix_drop = None
    if dropout_p > 0:
        dev = q.device
        prefix_drop = BlockDropout(
            dropout_p, dropout_seed, torch.arange(q.shape[0], device=dev), torch.arange(q.shape[1], device=dev),
            positions[:num_prefix].to(dev), k_pos.to(dev),
        )
    out_prefix = replicated_query_attention(q_prefix, k, v, mesh, scale, drop=prefix_drop)
    return _tokens_major(out_prefix, out_patch)


def _tokens_major(prefix: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
    """``cat([prefix, patches], 2)`` of ``(B, H, L, D)`` tensors, stored token-major (as
    ``(B, L, H, D)``), the layout the attention's output projection reads."""
    both = torch.cat([prefix.to(patches.dtype).transpose(1, 2), patches.transpose(1, 2)], 1)
    return both.transpose(1, 2)


def _fallback_positions(n_local: int, num_prefix: int, mesh: DeviceMesh) -> torch.Tensor:
    """Token positions of an attention layer called outside a model forward: the prefix, then
    the patch tokens of the ranks in domain order (one tiny all-gather of the lengths)."""
    ring = domain_peers(mesh)
    lens = [r[0] for r in gather_ints([n_local - num_prefix], ring)]
    start = num_prefix + sum(lens[: ring.index])
    return torch.cat([torch.arange(num_prefix), torch.arange(start, start + n_local - num_prefix)])


class _AttentionOptions:
    """Sharding options shared by the sharded attention classes below."""

    #: The model's random streams (set by the model; dropout seeds and token positions).
    streams: _Streams | None = None
    #: The seed of the attention-dropout mask of the last training forward (None: no dropout), so
    #: that a run can reproduce its masks (``attention_kernels.dropout_keep``).
    dropout_seed: int | None = None

    def _set_sharding(self, mesh: DeviceMesh, num_prefix_tokens: int, attention: str) -> None:
        self.mesh, self.num_prefix_tokens, self.attention = mesh, num_prefix_tokens, attention

    @classmethod
    def _adopt(cls, module: nn.Module, mesh: DeviceMesh, num_prefix_tokens: int, attention: str):
        """An instance of ``cls`` holding ``module``'s parameters and submodules (state_dict keys
        unchanged; its own registries, so that converting never edits ``module``)."""
        new = cls.__new__(cls)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new._set_sharding(mesh, num_prefix_tokens, attention)
        return new

    def _attend(self, q, k, v) -> torch.Tensor:
        """``prefix_self_attention`` with this layer's dropout in training (a fresh mask seed)."""
        p = self.attn_drop.p if self.training else 0.0
        seq_lens = self._seq_lens()
        if p == 0.0:
            self.dropout_seed = None
            return prefix_self_attention(
                q, k, v, self.num_prefix_tokens, self.mesh, self.attention, self.scale, seq_lens=seq_lens
            )
        if self.streams is None:
            raise ShardingNotImplementedError(
                f"{type(self).__name__}: attention dropout in training needs the random streams of a converted "
                "model (snn.convert(model, mesh) or zoo.create_model); call .eval() or set attn_drop.p = 0."
            )
        self.dropout_seed = self.streams.dropout_seed()
        positions = self.streams.positions
        if positions is None or positions.shape[0] != q.shape[2]:
            positions = _fallback_positions(q.shape[2], self.num_prefix_tokens, self.mesh)
        return prefix_self_attention(
            q, k, v, self.num_prefix_tokens, self.mesh, self.attention, self.scale,
            dropout_p=p, dropout_seed=self.dropout_seed, positions=positions.to(q.device), seq_lens=seq_lens,
        )

    def _seq_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(query, key) lengths of every rank for the patch-query attention, from the layout the
        model gathered for this forward (None outside the model's block loop: then gathered)."""
        counts = None if self.streams is None else self.streams.token_counts
        if counts is None:
            return None
        npt = self.num_prefix_tokens
        # The prefix keys travel with domain rank 0's slab.
        return tuple(counts), (counts[0] + npt, *counts[1:])

    def _rotate_patches(self, q, k, v, rope):
        """timm's rotary embedding of the patch tokens' q and k (``rope``: this rank's rows; the
        prefix tokens are not rotated), as timm's Eva attentions apply it."""
        from timm.layers import apply_rot_embed_cat

        npt = self.num_prefix_tokens
        half = getattr(self, "rotate_half", False)
        q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], dim=2).type_as(v)
        k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], dim=2).type_as(v)
        return q, k

    @staticmethod
    def _check_masks(name: str, attn_mask, is_causal) -> None:
        if attn_mask is not None or is_causal:
            raise ShardingNotImplementedError(
                f"{name}: attn_mask / is_causal are not supported on a sharded image; ViTs attend bidirectionally."
            )

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, attention={self.attention!r}, num_prefix_tokens={self.num_prefix_tokens}"


class ShardedViTAttention(_AttentionOptions, Attention):
    """timm's ViT ``Attention`` on ``[prefix, local patches]`` slabs; see ``prefix_self_attention``."""

    @classmethod
    def from_module(cls, module: Attention, mesh: DeviceMesh, *, num_prefix_tokens: int, attention: str = "ring"):
        return cls._adopt(module, mesh, num_prefix_tokens, attention)

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:  # noqa: D102
        self._check_masks(type(self).__name__, attn_mask, is_causal)
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        q, k, v = self._project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        x = self._attend(q, k, v)
        x = x.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` of ``x`` as ``(B, H, N, D)`` views, each of its own token-major tensor.

        Why not timm's one ``qkv`` projection: its q, k, v are views with a token stride of
        ``3 * H * D``, so ring attention copies k and v to send them (in forward and again in
        backward), and backward stacks the three gradients into one tensor and copies that to the
        projection's layout (vit_tiny 1024^2 at P=2: about 2 ms per layer on a 2-core host). The
        same weights in three projections give three dense tensors that travel as they are,
        whose gradients go straight into three matrix products. Another ``qkv`` module than
        ``nn.Linear`` (a user's adapter) keeps timm's way.
        """
        b, n, _ = x.shape
        heads = (b, n, self.num_heads, self.head_dim)
        if type(self.qkv) is not nn.Linear:
            return self.qkv(x).reshape(b, n, 3, *heads[2:]).permute(2, 0, 3, 1, 4).unbind(0)
        weights = self.qkv.weight.unflatten(0, (3, -1)).unbind(0)
        biases = (None,) * 3 if self.qkv.bias is None else self.qkv.bias.unflatten(0, (3, -1)).unbind(0)
        return tuple(F.linear(x, w, bias).view(heads).transpose(1, 2) for w, bias in zip(weights, biases))


class ShardedEvaAttention(_AttentionOptions, EvaAttention):
    """timm's ``EvaAttention`` on ``[prefix, local patches]`` slabs; ``rope`` holds the rows of
    this rank's patch tokens (global positions)."""

    @classmethod
    def from_module(cls, module: EvaAttention, mesh: DeviceMesh, *, attention: str = "ring"):
        return cls._adopt(module, mesh, module.num_prefix_tokens, attention)

    def forward(self, x, rope=None, attn_mask=None, is_causal: bool = False):  # noqa: D102
        self._check_masks(type(self).__name__, attn_mask, is_causal)
        b, n, c = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            else:
                qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
                if self.qkv_bias_separate:
                    qkv = self.qkv(x)
                    qkv += qkv_bias
                else:
                    qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
            q, k, v = qkv.reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
            k = self.k_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
            v = self.v_proj(x).reshape(b, n, self.num_heads, -1).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = self._rotate_patches(q, k, v, rope)
        x = self._attend(q, k, v)
        x = x.transpose(1, 2).reshape(b, n, c)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class ShardedAttentionRope(_AttentionOptions, AttentionRope):
    """timm's ``AttentionRope`` (``Eva(attn_type="rope")``, PE-core: rotary attention with
    grouped-query K/V heads) on ``[prefix, local patches]`` slabs; ``rope`` holds the rows of this
    rank's patch tokens. Grouped K/V heads travel as they are (the attention maps query head i to
    K/V head i // groups, as timm's ``repeat_interleave``), not repeated."""

    @classmethod
    def from_module(cls, module: AttentionRope, mesh: DeviceMesh, *, attention: str = "ring"):
        return cls._adopt(module, mesh, module.num_prefix_tokens, attention)

    def forward(self, x, rope=None, attn_mask=None, is_causal: bool = False):  # noqa: D102
        self._check_masks(type(self).__name__, attn_mask, is_causal)
        b, n, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if self.qkv is not None:
            q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = self._rotate_patches(q, k, v, rope)
        x = self._attend(q, k, v).transpose(1, 2).reshape(b, n, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


class _InlineAttentionBlock(_AttentionOptions):
    """What timm's parallel-scaling blocks share: one fused input projection (MLP input and q, k,
    v), an attention computed inline, and the output projection(s) with the residual. Only the
    attention sees other tokens; it is ``prefix_self_attention`` (as ``ShardedViTAttention``)."""

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, *, num_prefix_tokens: int, attention: str = "ring"):
        return cls._adopt(module, mesh, num_prefix_tokens, attention)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(MLP input, q, k, v) of the fused input projection, as timm splits them."""
        x_mlp, q, k, v = torch.split(self.in_proj(self.in_norm(x)), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            x_mlp = x_mlp + self.mlp_bias
        return x_mlp, q, k, v

    def _output(self, x: torch.Tensor, x_attn: torch.Tensor, x_mlp: torch.Tensor) -> torch.Tensor:
        """The output projection(s) of the attention and MLP results, and the residual."""
        x_mlp = self.mlp_drop(self.mlp_act(x_mlp))
        if self.out_proj is not None:
            y = self.out_proj(torch.cat((x_attn, x_mlp), dim=-1))
        else:
            y = self.attn_out_proj(x_attn) + self.mlp_out_proj(x_mlp)
        return x + self.drop_path(self.ls(y))


class ShardedParallelScalingBlock(_InlineAttentionBlock, ParallelScalingBlock):
    """timm's ``ParallelScalingBlock`` (ViT-22B: attention and MLP side by side from one fused
    input projection) on ``[prefix, local patches]`` slabs. The block computes its attention
    inline (no ``Attention`` module to swap), so the block itself is converted."""

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:  # noqa: D102
        self._check_masks(type(self).__name__, attn_mask, is_causal)
        b, n, c = x.shape
        x_mlp, q, k, v = self._inputs(x)
        heads = (b, n, self.num_heads, self.head_dim)
        q = self.q_norm(q.view(heads)).transpose(1, 2)
        k = self.k_norm(k.view(heads)).transpose(1, 2)
        x_attn = self._attend(q, k, v.view(heads).transpose(1, 2))
        return self._output(x, x_attn.transpose(1, 2).reshape(b, n, c), x_mlp)


if _DiffParallelScalingBlock is not None:

    class ShardedDiffParallelScalingBlock(_InlineAttentionBlock, _DiffParallelScalingBlock):
        """timm's ``DiffParallelScalingBlock`` (differential attention: the difference of two
        softmax attentions over one value, beside the MLP) on ``[prefix, local patches]`` slabs.
        Both attentions are ``prefix_self_attention`` calls, each with its own dropout seed in
        training, as timm's two ``scaled_dot_product_attention`` calls draw two masks."""

        def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:  # noqa: D102
            self._check_masks(type(self).__name__, attn_mask, is_causal)
            b, n, c = x.shape
            x_mlp, q, k, v = self._inputs(x)
            h, d = self.num_heads, self.head_dim
            q = q.reshape(b, n, 2 * h, d).transpose(1, 2)
            k = k.reshape(b, n, 2 * h, d).transpose(1, 2)
            v = v.reshape(b, n, h, 2 * d).transpose(1, 2)
            q, k = self.q_norm(q), self.k_norm(k)
            lam = self._compute_lambda().type_as(q)
            # timm pairs heads (2i, 2i + 1) as the two attentions of head i.
            q1, q2 = q.unflatten(1, (h, 2)).unbind(2)
            k1, k2 = k.unflatten(1, (h, 2)).unbind(2)
            first = self._attend(q1, k1, v)
            seed = self.dropout_seed
            x_attn = first - lam * self._attend(q2, k2, v)
            #: Both attentions' mask seeds (``dropout_seed`` holds the second's); None: no dropout.
            self.dropout_seeds = None if seed is None else (seed, self.dropout_seed)
            x_attn = self.sub_norm(x_attn) * (1 - self.lambda_init)
            return self._output(x, x_attn.transpose(1, 2).reshape(b, n, c), x_mlp)

else:  # pragma: no cover - older timm
    ShardedDiffParallelScalingBlock = None


def _block_attentions(blk: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the attention modules a block calls: ``attn``, or one per branch of a
    ``ParallelThingsBlock`` (its other parts are per token: norms, MLPs, layer scales, sums)."""
    if isinstance(blk, ParallelThingsBlock):
        return [(f"attns.{i}.attn", branch.attn) for i, branch in enumerate(blk.attns)]
    return [("attn", blk.attn)]


# --------------------------------------------------------------------------- shared model logic


def _model_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    arch = cfg.get("architecture")
    return f"{arch} ({type(model).__name__})" if arch else type(model).__name__


def _set_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


class _ShardedViTMixin:
    """What ``ShardedVisionTransformer`` and ``ShardedEva`` share: layout, embedding, pooling."""

    #: Blocks whose attention modules (``_block_attentions``) are swapped for sharded ones.
    _block_types: tuple[type, ...] = ()
    _attn_types: tuple[type, ...] = ()
    #: Blocks that compute attention inline, converted whole: block type -> sharded class.
    _inline_blocks: dict[type, type] = {}

    # ---- conversion

    def _problems(self) -> list[str]:
        problems = []
        pe = self.patch_embed
        if type(pe) not in (PatchEmbed, HybridEmbed):
            problems.append(f"patch_embed is a {type(pe).__name__}; timm's PatchEmbed and HybridEmbed are sharded")
        else:
            proj = pe.proj
            if type(pe) is HybridEmbed and isinstance(proj, nn.Identity):
                pass  # the backbone's features are the tokens
            elif not (
                isinstance(proj, nn.Conv2d)
                and tuple(proj.kernel_size) == tuple(pe.patch_size) == tuple(proj.stride)
                and tuple(proj.padding) == (0, 0)
                and tuple(proj.dilation) == (1, 1)
            ):
                problems.append("patch_embed.proj must be a Conv2d with kernel = stride = patch size and no padding")
            if type(pe) is HybridEmbed:
                if pe.dynamic_img_pad:
                    problems.append("patch_embed (HybridEmbed) pads its features dynamically (dynamic_img_pad=True)")
                if not pe.flatten or pe.output_fmt != "NCHW":
                    problems.append("patch_embed (HybridEmbed) must flatten its features to tokens (flatten=True)")
        for i, blk in enumerate(self.blocks):
            if type(blk) in self._inline_blocks:
                continue
            if type(blk) not in self._block_types:
                names = [t.__name__ for t in (*self._block_types, *self._inline_blocks)]
                problems.append(f"blocks.{i} is a {type(blk).__name__} (sharded blocks: {names})")
                continue
            for path, attn in _block_attentions(blk):
                if type(attn) not in self._attn_types:
                    names = [t.__name__ for t in self._attn_types]
                    problems.append(f"blocks.{i}.{path} is a {type(attn).__name__} (sharded: {names})")
        pool = getattr(self, "attn_pool", None)
        if pool is not None:
            if type(pool) not in (AttentionPoolLatent, _AttentionPoolPrr):
                problems.append(f"attn_pool is a {type(pool).__name__} (global_pool={self.global_pool!r}); "
                                "only 'map' (AttentionPoolLatent) and 'prr' (AttentionPoolPrr) attention pooling "
                                "are sharded")
            elif getattr(pool, "pos_embed", None) is not None:
                problems.append("attn_pool has its own position embedding (pos_embed='abs')")
        return problems

    def _convert_children(self, mesh: DeviceMesh, attention: str, seed: int | None) -> None:
        name = _model_name(self)
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{name}: mesh must be a torch DeviceMesh, got {type(mesh).__name__}.")
        axes = domain_axes(mesh)
        if attention not in _ATTENTION:
            raise ValueError(f"{name}: attention must be one of {tuple(_ATTENTION)}, got {attention!r}.")
        problems = self._problems()
        if len(axes) > 2:
            problems.append(f"a mesh with {len(axes)} domain axes {axes} (images shard H, or H and W)")
        if problems:
            raise ShardingNotImplementedError(
                f"{name} cannot be sharded: {'; '.join(problems)}. Supported: timm VisionTransformer (and DeiT's "
                "VisionTransformerDistilled) with Block/ResPostBlock/ParallelThingsBlock/ParallelScalingBlock/"
                "DiffParallelScalingBlock and Eva with EvaBlock/EvaBlockPostNorm, PatchEmbed, "
                "token/avg/avgmax/max/map/prr pooling, on meshes with 1 or 2 domain axes."
            )
        self.mesh, self.attention, self.mesh_axes = mesh, attention, axes
        if type(self.patch_embed) is HybridEmbed:
            self._convert_backbone(mesh)
        self.streams = _Streams(*_agree_seed(mesh, seed))
        npt = self.num_prefix_tokens
        for i, blk in enumerate(self.blocks):
            whole = self._inline_blocks.get(type(blk))
            if whole is not None:
                self.blocks[i] = whole.from_module(blk, mesh, num_prefix_tokens=npt, attention=attention)
                continue
            for path, attn in _block_attentions(blk):
                _set_child(blk, path, self._sharded_attention(attn, mesh, attention))
        for m in self.modules():
            if isinstance(m, _AttentionOptions):
                m.streams = self.streams
        replicated = ("attn_pool", "head_drop", "fc_norm", "head")
        for mname, m in list(self.named_modules()):
            if not mname:
                continue
            parent = self.get_submodule(mname.rpartition(".")[0]) if "." in mname else self
            if mname.endswith(".attn_drop") and isinstance(parent, _AttentionOptions):
                continue  # attention dropout is position-keyed inside the attention (see the module doc)
            in_head = mname.split(".")[0] in replicated
            if type(m) is DropPath:
                _set_child(self, mname, SharedDropPath(m.drop_prob, m.scale_by_keep, self.streams))
            elif type(m) is nn.Dropout and m.p > 0:
                new = SharedDropout(m.p, self.streams) if in_head else TokenDropout(m.p, npt, self.streams)
                _set_child(self, mname, new)

    def _convert_backbone(self, mesh: DeviceMesh) -> None:
        """A hybrid ViT's CNN stem (``HybridEmbed.backbone``: BiT's ResNetV2, ...) converted as a
        model of its own, with its own forward guard (its weight-standardised convolutions call
        ``F.conv2d`` in their forward) and layout scope, sharded along the image dims the
        tokens come from. Its output slab is this rank's rows of the feature map, which
        ``_token_grid`` checks against the total stride (backbone reduction times patch)."""
        from sharded_nn.convert import convert_as_model

        pe = self.patch_embed
        dims = (2,) if len(self.mesh_axes) == 1 else (2, 3)
        pe.backbone = convert_as_model(pe.backbone, mesh, dims=dims)

    def _rebind(self, mesh: DeviceMesh, attention: str | None, seed: int | None) -> None:
        attention = attention or self.attention
        if attention not in _ATTENTION:
            raise ValueError(f"{_model_name(self)}: attention must be one of {tuple(_ATTENTION)}, got {attention!r}.")
        if len(domain_axes(mesh)) != len(self.mesh_axes):
            raise ShardingError(
                f"{_model_name(self)}: already converted for domain axes {self.mesh_axes}; cannot re-convert for "
                f"{domain_axes(mesh)}. Convert the plain timm model instead."
            )
        new_mesh = mesh is not self.mesh
        self.mesh, self.attention, self.mesh_axes = mesh, attention, domain_axes(mesh)
        if new_mesh and type(self.patch_embed) is HybridEmbed:
            self._convert_backbone(mesh)
        for m in self.modules():
            if isinstance(m, _AttentionOptions):
                m._set_sharding(mesh, m.num_prefix_tokens, attention)
        if seed is not None or new_mesh:
            self.streams.__init__(*_agree_seed(mesh, seed))

    def sharding_repr(self) -> str:
        return f"mesh_axes={self.mesh_axes}, attention={self.attention!r}, num_prefix_tokens={self.num_prefix_tokens}"

    # ---- layout and embedding

    def _token_grid(self, x: torch.Tensor) -> TokenGrid:
        name = _model_name(self)
        if x.dim() != 4:
            raise ShardingError(f"{name}: expected an image slab (B, C, H, W), got shape {tuple(x.shape)}.")
        axes = self.mesh_axes
        dims = (2,) if len(axes) == 1 else (2, 3)
        layouts = gather_layouts(x.shape, self.mesh, dims, what=name)
        pe = self.patch_embed
        # Image pixels per token: the patch, times the backbone's reduction for a hybrid.
        patch = tuple(pe.feat_ratio(as_scalar=False)) if type(pe) is HybridEmbed else tuple(pe.patch_size)
        pad = bool(pe.dynamic_img_pad)
        sizes = [lay.size for lay in layouts] + ([x.shape[3]] if len(dims) == 1 else [])
        for k, lay in enumerate(layouts):
            p = patch[k]
            inner = lay.sizes[:-1]
            if any(s % p for s in inner) or (not pad and lay.sizes[-1] % p):
                what = "every slab" if not pad else "every slab but the last"
                raise ShardingError(
                    f"{name}: along image dim {dims[k]} the slabs {lay.sizes} must span whole patches of {p} "
                    f"pixels ({what}). Shard with snn.shard(x, mesh, dims={dims}, align={p}) on an image whose "
                    f"size is a multiple of {p}."
                )
        if len(dims) == 1 and not pad and sizes[1] % patch[1]:
            raise ShardingError(f"{name}: image width {sizes[1]} must be a multiple of the patch size {patch[1]}.")
        if pe.strict_img_size and pe.img_size is not None and tuple(sizes) != tuple(pe.img_size):
            raise ShardingError(
                f"{name}: the global image is {tuple(sizes)}, the model expects {tuple(pe.img_size)} (build it "
                "with img_size=..., or dynamic_img_size=True)."
            )
        grid = tuple(pe.dynamic_feat_size(tuple(sizes)))
        start, size = [], []
        for k, (lay, a) in enumerate(zip(layouts, axes)):
            c = axis_index(self.mesh, a)
            s0 = lay.starts[c] // patch[k]
            start.append(s0)
            size.append(-(-lay.sizes[c] // patch[k]) if pad else lay.sizes[c] // patch[k])
        if len(dims) == 1:
            start.append(0)
            size.append(grid[1])
        # Every rank's patch count (gathered facts), so that the attention layers need not
        # gather their shapes again: one synchronisation per forward instead of one per layer.
        per_axis = [[-(-n // patch[k]) if pad else n // patch[k] for n in lay.sizes] for k, lay in enumerate(layouts)]
        if len(dims) == 1:
            counts = tuple(h * grid[1] for h in per_axis[0])
        else:
            counts = tuple(h * w for h in per_axis[0] for w in per_axis[1])
        return TokenGrid(grid, tuple(start), tuple(size), counts)

    def _patch_tokens(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """``(B, h_local, w_local, C)`` patch embeddings of this rank's slab."""
        pe = self.patch_embed
        if pe.dynamic_img_pad:
            # Only the last slab along an axis can end in a partial patch: padding it pads the image.
            ph, pw = pe.patch_size
            x = F.pad(x, (0, (pw - x.shape[3] % pw) % pw, 0, (ph - x.shape[2] % ph) % ph))
        if type(pe) is HybridEmbed:
            x = pe.backbone(x)  # (the converted stem: this rank's rows of the feature map)
            if isinstance(x, (list, tuple)):
                x = x[-1]  # timm's HybridEmbed: the last feature of a multi-output backbone
            return pe.proj(x).permute(0, 2, 3, 1)
        y = pe.proj(x).permute(0, 2, 3, 1)
        return pe.norm(y)

    def _local_pos_embed(self, grid: TokenGrid) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prefix rows, this rank's patch rows) of the position embedding at the global grid."""
        if self.pos_embed is None:
            return None, None
        npt = 0 if self.no_embed_class else self.num_prefix_tokens
        pos = self.pos_embed
        if self.dynamic_img_size:
            pos = resample_abs_pos_embed(
                pos, new_size=grid.grid, old_size=self.patch_embed.grid_size, num_prefix_tokens=npt
            )
        elif pos.shape[1] != grid.num_global + npt:
            raise ShardingError(
                f"{_model_name(self)}: pos_embed holds {pos.shape[1] - npt} patch positions, the image has "
                f"{grid.num_global} patches ({grid.grid})."
            )
        return (pos[:, :npt] if npt else None), grid.take(pos[:, npt:], 1)

    def _prefix(self, batch: int) -> list[torch.Tensor]:
        to_cat = []
        if self.cls_token is not None:
            to_cat.append(self.cls_token.expand(batch, -1, -1))
        if self.reg_token is not None:
            to_cat.append(self.reg_token.expand(batch, -1, -1))
        return to_cat

    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, TokenGrid]:
        """``[prefix, local patches]`` tokens with position embeddings, as timm's ``_pos_embed``."""
        grid = self._token_grid(x)
        npt = self.num_prefix_tokens
        # timm's token indices of this rank's tokens: the key of the attention-dropout mask law.
        self.streams.positions = torch.cat(
            [torch.arange(npt, device=x.device), npt + grid.token_index(x.device)]
        )
        self.streams.token_counts = grid.counts or None
        y = self._patch_tokens(x, grid)
        y = y.reshape(y.shape[0], -1, y.shape[-1])
        pos_prefix, pos = self._local_pos_embed(grid)
        to_cat = self._prefix(y.shape[0])
        if pos is None:
            y = torch.cat(to_cat + [y], 1) if to_cat else y
        elif self.no_embed_class:
            y = y + pos
            y = torch.cat(to_cat + [y], 1) if to_cat else y
        else:
            if to_cat:
                y = torch.cat(to_cat + [y], 1)
            y = y + (torch.cat([pos_prefix, pos], 1) if pos_prefix is not None else pos)
        return self.pos_drop(y), grid

    def _check_training(self) -> None:
        if not self.training:
            return
        name = _model_name(self)
        pd = getattr(self, "patch_drop", None)
        if pd is not None and getattr(pd, "prob", 0) > 0:
            raise ShardingNotImplementedError(
                f"{name}: patch dropout (patch_drop_rate={pd.prob}) in training is not supported on a sharded image; "
                "build the model with patch_drop_rate=0 or call .eval()."
            )
        if self.grad_checkpointing and any(
            isinstance(m, (SharedDropPath, TokenDropout, SharedDropout))
            or (isinstance(m, _AttentionOptions) and m.attn_drop.p > 0)
            for m in self.modules()
        ):
            raise ShardingNotImplementedError(
                f"{name}: gradient checkpointing with drop-path or dropout (attention dropout too) in training "
                "would redraw different masks in the recomputation. Disable one of them."
            )

    # ---- pooling (replicated results)

    def _domain_sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, domain_group(self.mesh))

    def _domain_max(self, t: torch.Tensor) -> torch.Tensor:
        group = domain_group(self.mesh)
        p = dist.get_world_size(group)
        if p == 1:
            return t
        parts = all_gather_grid(t.unsqueeze(0), group, (0,), [(r,) for r in range(p)], ((1,) * p,), dist.get_rank(group))
        return parts.amax(0)

    def _sharded_global_pool(
        self, x: torch.Tensor, pool_type: str, include_prefix: bool, num_prefix: int | None = None
    ) -> torch.Tensor:
        """timm's ``global_pool_nlc`` over the tokens of all ranks (the prefix counted once).
        ``num_prefix``: the replicated tokens in front of ``x``'s patch tokens (default: the model's)."""
        npt = self.num_prefix_tokens if num_prefix is None else num_prefix
        if not pool_type:
            return x
        if pool_type == "token":
            return x[:, 0]
        if pool_type not in ("avg", "avgmax", "max"):
            raise ValueError(f"{_model_name(self)}: unknown pool type {pool_type!r}.")
        patches, prefix = x[:, npt:], x[:, :npt]
        out = None
        if pool_type in ("avg", "avgmax"):
            acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
            count = torch.full((x.shape[0], 1), float(patches.shape[1]), dtype=acc, device=x.device)
            total = self._domain_sum(torch.cat([patches.to(acc).sum(1), count], 1))
            s, n = total[:, :-1], total[:, -1:]
            if include_prefix and npt:
                s, n = s + prefix.to(acc).sum(1), n + npt
            out = (s / n).to(x.dtype)
        if pool_type in ("max", "avgmax"):
            m = self._domain_max(patches.amax(1))
            if include_prefix and npt:
                m = torch.maximum(m, prefix.amax(1))
            out = m if out is None else 0.5 * (m + out)
        return out

    def _sharded_attn_pool(self, x: torch.Tensor, include_prefix: bool) -> torch.Tensor:
        """timm's ``AttentionPoolLatent`` with the latent queries over the keys of all ranks."""
        pool = self.attn_pool
        npt = self.num_prefix_tokens
        first = dist.get_rank(domain_group(self.mesh)) == 0
        keys = x if (include_prefix and first) else x[:, npt:]
        b, n, c = keys.shape
        q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, pool.latent_len, pool.num_heads, pool.head_dim)
        q = q.transpose(1, 2)
        k, v = pool.kv(keys).reshape(b, n, 2, pool.num_heads, pool.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = pool.q_norm(q), pool.k_norm(k)
        y = replicated_query_attention(q, k, v, self.mesh, pool.scale)
        y = y.transpose(1, 2).reshape(b, pool.latent_len, c)
        y = pool.proj_drop(pool.proj(y))
        if pool.mlp is not None:
            y = y + pool.mlp(pool.norm(y))
        if pool.pool == "token":
            y = y[:, 0]
        elif pool.pool == "avg":
            y = y.mean(1)
        return y

    def _sharded_prr_pool(self, x: torch.Tensor, include_prefix: bool) -> torch.Tensor:
        """timm's ``AttentionPoolPrr``: parameter-free self-attention of the tokens (q = k = v,
        the normalised tokens split into heads) over all ranks, then its class token or mean."""
        pool = self.attn_pool
        npt = self.num_prefix_tokens if include_prefix else 0
        tokens = x if include_prefix else x[:, self.num_prefix_tokens :]
        if pool.pool == "token" and npt == 0:
            raise ShardingNotImplementedError(
                f"{_model_name(self)}: 'prr' token pooling with pool_include_prefix=False pools the first patch "
                "token, which only the first rank holds; set pool_include_prefix=True (timm's default for 'prr')."
            )
        y = pool.pre_norm(tokens)
        b, n, c = y.shape
        qkv = y.reshape(b, n, pool.num_heads, pool.head_dim).transpose(1, 2)
        # The head runs after the blocks: the attention gathers the slab lengths itself.
        y = prefix_self_attention(qkv, qkv, qkv, npt, self.mesh, self.attention, pool.scale)
        y = pool.post_norm(y.transpose(1, 2).reshape(b, n, c))
        if pool.pool == "token":
            return y[:, 0]
        return self._sharded_global_pool(y, "avg", True, num_prefix=npt)

    # ---- intermediates

    def _format_intermediates(self, inter, grid: TokenGrid, output_fmt: str):
        npt = self.num_prefix_tokens
        prefix = [y[:, :npt] for y in inter] if npt else None
        inter = [y[:, npt:] for y in inter]
        if output_fmt == "NCHW":
            h, w = grid.size
            inter = [y.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for y in inter]
        return inter, prefix


def _from_module(cls, module: nn.Module, mesh: DeviceMesh, attention: str | None, seed: int | None):
    if isinstance(module, _ShardedViTMixin):
        # Converting again (e.g. ``parallelize`` on a model from ``create_model(mesh=...)``): the
        # model stays as it is, with the options that were given anew.
        module._rebind(mesh, attention, seed)
        return module
    new = cls.__new__(cls)
    # Same parameters and buffers (state_dict keys and values unchanged), independent registries.
    new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
    new._convert_children(mesh, attention or "ring", seed)
    return new


# --------------------------------------------------------------------------- ViT


@register(VisionTransformer)
class ShardedVisionTransformer(_ShardedViTMixin, VisionTransformer):
    """timm's ``VisionTransformer`` on an image sharded over the domain ranks (see the module doc).

    Build with ``snn.convert(model, mesh)`` or ``sharded_nn.zoo.create_model``; keyword options
    (``convert(..., plan={"": {...}})``): ``attention`` (``"ring"`` or ``"ulysses"``), ``seed``
    (of the drop-path / dropout streams).
    """

    _block_types = (Block, ResPostBlock, ParallelThingsBlock)
    _attn_types = (Attention,)
    _inline_blocks = {ParallelScalingBlock: ShardedParallelScalingBlock}
    if _DiffParallelScalingBlock is not None:
        _inline_blocks[_DiffParallelScalingBlock] = ShardedDiffParallelScalingBlock

    @classmethod
    def from_module(
        cls, module: VisionTransformer, mesh: DeviceMesh, *, attention: str | None = None, seed: int | None = None
    ):
        """A sharded view of ``module`` that shares its parameters (its children are converted in place)."""
        return _from_module(cls, module, mesh, attention, seed)

    def _sharded_attention(self, attn: nn.Module, mesh: DeviceMesh, attention: str) -> nn.Module:
        return ShardedViTAttention.from_module(attn, mesh, num_prefix_tokens=self.num_prefix_tokens, attention=attention)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, TokenGrid]:
        self._check_training()
        x, grid = self._embed(x)
        x = self.patch_drop(x)
        return self.norm_pre(x), grid

    def forward_features(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        """This rank's tokens ``(B, num_prefix + h_local * w_local, C)`` after the final norm."""
        _AttentionOptions._check_masks(type(self).__name__, attn_mask, is_causal)
        x, _ = self._tokens(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        self.streams.token_counts = None  # a recomputation in backward gathers its shapes again
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask=None,
        is_causal: bool = False,
    ):
        """timm's ``forward_intermediates`` with this rank's slab of each feature map (see module doc)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"{type(self).__name__}: output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}.")
        _AttentionOptions._check_masks(type(self).__name__, attn_mask, is_causal)
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, grid = self._tokens(x)
        blocks = self.blocks if not stop_early else self.blocks[: max_index + 1]
        inter = []
        for i, blk in enumerate(blocks):
            x = checkpoint(blk, x) if self.grad_checkpointing else blk(x)
            if i in take_indices:
                inter.append(self.norm(x) if norm else x)
        self.streams.token_counts = None
        inter, prefix = self._format_intermediates(inter, grid, output_fmt)
        if output_dict:
            out = {"image_intermediates": inter}
            if prefix is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if not intermediates_only:
                out["image_features"] = self.norm(x)
            return out
        if return_prefix_tokens and prefix is not None:
            inter = list(zip(inter, prefix))
        if intermediates_only:
            return inter
        return self.norm(x), inter

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        """Pooled features of all ranks' tokens, replicated."""
        if self.attn_pool is not None:
            if _AttentionPoolPrr is not None and type(self.attn_pool) is _AttentionPoolPrr:
                return self._sharded_prr_pool(x, self.pool_include_prefix)
            return self._sharded_attn_pool(x, self.pool_include_prefix)
        pool_type = self.global_pool if pool_type is None else pool_type
        return self._sharded_global_pool(x, pool_type, self.pool_include_prefix)

    def extra_repr(self) -> str:
        return self.sharding_repr()


@register(VisionTransformerDistilled)
class ShardedVisionTransformerDistilled(ShardedVisionTransformer, VisionTransformerDistilled):
    """timm's ``VisionTransformerDistilled`` (DeiT with a distillation token), sharded.

    As ``ShardedVisionTransformer``, with two prefix tokens (class, then distillation), held by
    every rank like any prefix token. timm's own ``forward_head`` reads them (the mean of the two
    heads, or both in distilled training), so the logits are replicated.
    """

    def _prefix(self, batch: int) -> list[torch.Tensor]:
        # timm's order (``VisionTransformerDistilled._pos_embed``): class token, distillation token.
        return [self.cls_token.expand(batch, -1, -1), self.dist_token.expand(batch, -1, -1)]


# --------------------------------------------------------------------------- Eva


@register(Eva)
class ShardedEva(_ShardedViTMixin, Eva):
    """timm's ``Eva`` (EVA, EVA-02, rotary ViTs) on an image sharded over the domain ranks.

    As ``ShardedVisionTransformer``; the rotary embedding of each rank holds the rows of its
    tokens' global positions.
    """

    _block_types = (EvaBlock, EvaBlockPostNorm)
    _attn_types = (EvaAttention, AttentionRope)

    @classmethod
    def from_module(cls, module: Eva, mesh: DeviceMesh, *, attention: str | None = None, seed: int | None = None):
        """A sharded view of ``module`` that shares its parameters (its children are converted in place)."""
        return _from_module(cls, module, mesh, attention, seed)

    def _sharded_attention(self, attn: nn.Module, mesh: DeviceMesh, attention: str) -> nn.Module:
        cls = ShardedAttentionRope if isinstance(attn, AttentionRope) else ShardedEvaAttention
        return cls.from_module(attn, mesh, attention=attention)

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.rope is not None and not hasattr(self.rope, "get_embed"):
            problems.append(f"rope is a {type(self.rope).__name__} without get_embed")
        return problems

    def _check_training(self) -> None:
        super()._check_training()
        if self.training and self.rope is not None and getattr(self.rope, "aug_active", False):
            raise ShardingNotImplementedError(
                f"{_model_name(self)}: rotary coordinate augmentation (rope shift/jitter/rescale) in training is not "
                "supported on a sharded image; build the model without rope_*_coords or call .eval()."
            )
        if self.training and self.patch_drop is not None:
            raise ShardingNotImplementedError(
                f"{_model_name(self)}: patch dropout in training is not supported on a sharded image; build the "
                "model with patch_drop_rate=0 or call .eval()."
            )

    def _local_rope(self, grid: TokenGrid) -> torch.Tensor | None:
        if self.rope is None:
            return None
        if self.dynamic_img_size:
            rot = self.rope.get_embed(shape=grid.grid)
        elif hasattr(self.rope, "feat_shape"):
            rot = self.rope.get_embed()
        else:
            rot = self.rope.get_embed(shape=self.patch_embed.grid_size)
        # Rows run over the global patch grid (dim -2 for every rope type timm builds).
        return grid.take(rot, -2)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, TokenGrid]:
        self._check_training()
        x, grid = self._embed(x)
        return self.norm_pre(x), self._local_rope(grid), grid

    def _run_blocks(self, x, rot, blocks, take_indices=None, norm=False):
        inter = []
        mixed = getattr(self, "rope_mixed", False) and rot is not None
        for i, blk in enumerate(blocks):
            r = rot[i] if mixed else rot
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, rope=r)
            else:
                x = blk(x, rope=r)
            if take_indices is not None and i in take_indices:
                inter.append(self.norm(x) if norm else x)
        self.streams.token_counts = None  # a recomputation in backward gathers its shapes again
        return x, inter

    def forward_features(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        """This rank's tokens ``(B, num_prefix + h_local * w_local, C)`` after the final norm."""
        _AttentionOptions._check_masks(type(self).__name__, attn_mask, is_causal)
        x, rot, _ = self._tokens(x)
        x, _ = self._run_blocks(x, rot, self.blocks)
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        attn_mask=None,
        is_causal: bool = False,
    ):
        """timm's ``forward_intermediates`` with this rank's slab of each feature map (see module doc)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"{type(self).__name__}: output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}.")
        _AttentionOptions._check_masks(type(self).__name__, attn_mask, is_causal)
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, rot, grid = self._tokens(x)
        blocks = self.blocks if not stop_early else self.blocks[: max_index + 1]
        x, inter = self._run_blocks(x, rot, blocks, take_indices, norm)
        inter, prefix = self._format_intermediates(inter, grid, output_fmt)
        if return_prefix_tokens and prefix is not None:
            inter = list(zip(inter, prefix))
        if intermediates_only:
            return inter
        return self.norm(x), inter

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        """Pooled features of all ranks' tokens, replicated (Eva's attention pool sees the prefix)."""
        if self.attn_pool is not None:
            return self._sharded_attn_pool(x, include_prefix=True)
        pool_type = self.global_pool if pool_type is None else pool_type
        return self._sharded_global_pool(x, pool_type, include_prefix=False)

    def extra_repr(self) -> str:
        return self.sharding_repr()


# Converting a converted model again keeps it (``from_module`` returns it): registering the
# sharded classes for themselves stops ``convert`` from descending into their children.
register(ShardedVisionTransformer)(ShardedVisionTransformer)
register(ShardedVisionTransformerDistilled)(ShardedVisionTransformerDistilled)
register(ShardedEva)(ShardedEva)


# --------------------------------------------------------------------------- create_model


@register_model(None)
def create_vit(
    name: str,
    *,
    mesh: DeviceMesh | None = None,
    img_size: int | Sequence[int] | None = None,
    pretrained_file: str | None = None,
    attention: str = "ring",
    seed: int | None = None,
    **timm_kwargs: Any,
) -> nn.Module:
    """timm model ``name`` at ``img_size``, with ``pretrained_file`` loaded, converted for ``mesh``.

    Args:
        name: a timm model name (``"vit_small_patch16_224"``, ``"eva02_tiny_patch14_224"``, ...).
        mesh: mesh with 1 or 2 domain axes; ``None`` returns the plain timm model.
        img_size: the resolution to build at (timm's default when ``None``).
        pretrained_file: a local ``.safetensors`` / ``.pth`` / ``.bin`` checkpoint at any resolution
            and patch size; adapted with timm's own filter (``sharded_nn.converters``).
        attention: ``"ring"`` (default) or ``"ulysses"``.
        seed: seed of the drop-path / dropout streams (see the module doc).
        **timm_kwargs: passed to ``timm.create_model`` (``embed_dim``, ``dynamic_img_size``, ...).

    Raises:
        ShardingNotImplementedError: ``name`` is not a VisionTransformer / Eva model, or uses a part
            that has no sharded version (the message names the model and the part).
    """
    import timm

    from sharded_nn.converters import load_pretrained

    if "pretrained" in timm_kwargs:
        raise ValueError(
            "create_model: pass pretrained_file=<local checkpoint> instead of pretrained=...; nothing is downloaded."
        )
    if img_size is not None:
        timm_kwargs["img_size"] = img_size
    model = timm.create_model(name, pretrained=False, **timm_kwargs)
    sharded = {VisionTransformer: ShardedVisionTransformer, VisionTransformerDistilled: ShardedVisionTransformerDistilled,
               Eva: ShardedEva}
    if mesh is not None and type(model) not in sharded:
        raise ShardingNotImplementedError(
            f"create_model: {name!r} builds a timm {type(model).__name__}; only VisionTransformer, "
            "VisionTransformerDistilled and Eva models (ViT, DeiT, DeiT-3, register ViTs, DINOv2, EVA-02, rotary "
            "ViTs) have a sharded version."
        )
    if pretrained_file is not None:
        load_pretrained(model, pretrained_file)
    if mesh is None:
        return model
    return sharded[type(model)].from_module(model, mesh, attention=attention, seed=seed)
