"""Attention over a token sequence sharded on the domain axis.

Sharding contract (every class here): token tensors hold this rank's slab of the sequence
(``(B, H, L_local, D)`` for the attention cores, ``(B, L_local, C)`` or ``(L_local, B, C)`` for
the drop-in modules); outputs have the same layout as the queries. Parameters are replicated.
Two algorithms (``attention=``):

- ``"ring"`` (``RingAttention``): K/V blocks travel around the ranks by double-buffered
  point-to-point messages, overlapped with the block computation; partial results are merged by
  their log-sum-exp. Any head count, uneven slabs, causal (``layout="zigzag"`` balances it),
  key padding, grouped-query attention. Memory O(L_local x D) per rank.
- ``"ulysses"`` (``UlyssesAttention``): an all-to-all turns sequence slabs into head groups, a
  local attention kernel runs over the full sequence, a second all-to-all turns it back. Needs
  the heads divisible by the number of domain ranks.

A mesh with several domain axes is flattened row-major into one sequence axis.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ShardingError, ShardingNotImplementedError
from ..functional import ring_attention, ulysses_attention
from ..mesh import axis_index, axis_size, data_axis, domain_axes
from ..registry import register
from ..weights import arm as arm_values_check
from ..comm import all_gather_grid, all_gather_uneven, domain_peers
from .base import ShardedMixin, check_mesh, dtype_code, gather_facts

_ALGORITHMS = {"ring": ring_attention, "ulysses": ulysses_attention}


def _algorithm(name: str, what: str):
    if name not in _ALGORITHMS:
        raise ValueError(f"{what}: attention must be one of {tuple(_ALGORITHMS)}, got {name!r}.")
    return _ALGORITHMS[name]


class RingAttention(nn.Module):
    """``F.scaled_dot_product_attention`` over a sharded sequence, by ring passing of K/V blocks.

    Call as ``attn(q, k, v, key_padding_mask=None)`` with ``(B, H, L_local, D)`` slabs; see
    ``sharded_nn.functional.ring_attention`` for the contract and the options.

    Args:
        mesh: mesh with domain axes.
        is_causal: causal mask on global token positions.
        scale: score scale; default ``1 / sqrt(D)``.
        layout: ``"contiguous"`` or ``"zigzag"`` (load-balanced causal layout).
    """

    _fn = staticmethod(ring_attention)

    def __init__(
        self, mesh: DeviceMesh, is_causal: bool = False, *, scale: float | None = None, layout: str = "contiguous"
    ) -> None:
        super().__init__()
        check_mesh(mesh, type(self).__name__)
        domain_axes(mesh)
        self.mesh, self.is_causal, self.scale, self.layout = mesh, is_causal, scale, layout

    def forward(self, q, k, v, *, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        return self._fn(
            q, k, v, self.mesh, self.is_causal, self.scale, key_padding_mask=key_padding_mask, layout=self.layout
        )

    def extra_repr(self) -> str:
        axes = domain_axes(self.mesh)
        return f"is_causal={self.is_causal}, scale={self.scale}, layout={self.layout!r}, mesh_axes={axes}"


class UlyssesAttention(RingAttention):
    """``F.scaled_dot_product_attention`` over a sharded sequence, by all-to-all to head sharding.

    Same call signature and options as ``RingAttention``; the query and key/value heads must be
    divisible by the number of domain ranks (a ``ShardingError`` on every rank otherwise). See
    ``sharded_nn.functional.ulysses_attention``.
    """

    _fn = staticmethod(ulysses_attention)


def _shape_fact(t: torch.Tensor | None, width: int) -> tuple[int, ...]:
    """``(ndim, first width sizes)`` padded with -1 to a fixed width; all -1 for None."""
    if t is None:
        return (-1,) * (width + 1)
    sizes = tuple(t.shape[:width])
    return (t.dim(), *sizes, *(-1,) * (width - len(sizes)))


def _requires_grad(module: nn.Module, *tensors: torch.Tensor) -> int:
    """Whether the attention core runs backward here (it does if any input or weight needs it)."""
    if not torch.is_grad_enabled():
        return 0
    return int(any(t.requires_grad for t in tensors) or any(p.requires_grad for p in module.parameters()))


class _AttentionMixin(ShardedMixin):
    """Mesh options shared by the drop-in modules: the algorithm and the token layout."""

    _seq_dim = 1
    _sharding_options = ("attention", "layout")

    def _init_sharding(self, mesh: DeviceMesh, *, attention: str = "ring", layout: str = "contiguous") -> None:
        name = type(self).__name__
        check_mesh(mesh, name)
        _algorithm(attention, name)
        if layout not in ("contiguous", "zigzag"):
            raise ValueError(f"{name}: layout must be 'contiguous' or 'zigzag', got {layout!r}.")
        self.mesh, self.attention, self.layout = mesh, attention, layout
        self.mesh_axes = domain_axes(mesh)
        self.dims = (self._seq_dim,)
        # One domain rank: nothing to compare (as ShardedMixin's; a fact of the mesh).
        self._local_only = all(axis_size(mesh, a) == 1 for a in self.mesh_axes)
        arm_values_check(self)

    #: The seed of the attention-dropout mask of the last training forward (None: no dropout),
    #: so that a run can reproduce its masks (``attention_kernels.dropout_keep``).
    dropout_seed: int | None = None

    def _attend(self, q, k, v, is_causal, key_padding_mask, scale=None, dropout_p: float = 0.0):
        fn = _algorithm(self.attention, type(self).__name__)
        drop = {}
        if dropout_p > 0:
            drop = {"dropout_p": dropout_p, "dropout_seed": self.dropout_seed}
        return fn(q, k, v, self.mesh, is_causal, scale, key_padding_mask=key_padding_mask, layout=self.layout, **drop)

    def _dropout_facts(self, p: float) -> tuple[dict[str, tuple[int, ...]], int]:
        """Attention dropout in this call: the ``same`` fact (on, p) and this rank's seed candidate.

        The mask is position-keyed (``sharded_nn.attention_kernels.dropout_keep``): every rank
        computes its part of one mask from one seed and the global (batch, head, query, key)
        indices, and backward regenerates it. The seed is drawn from each rank's default torch
        generator (as ``nn.Dropout`` draws from it) and domain rank 0's draw is used, taken
        from the facts this call gathers anyway: no extra collective.
        """
        on = self.training and p > 0
        seed = int(torch.randint(0, 1 << 62, (1,)).item()) if on else 0
        return {"attention dropout (on, p * 2**32)": (int(on), round(p * (1 << 32)) if on else 0)}, seed

    def _set_dropout_seed(self, rows, p: float) -> float:
        """Domain rank 0's seed (the last local fact), offset by the data-parallel index so that
        data-parallel replicas draw different masks; returns the dropout probability to apply."""
        if not (self.training and p > 0):
            self.dropout_seed = None
            return 0.0
        seed = rows[0][-1]
        data = data_axis(self.mesh)
        if data is not None:
            seed += 1_000_003 * axis_index(self.mesh, data)
        self.dropout_seed = int(seed) % (1 << 63)
        return float(p)

    def sharding_repr(self) -> str:
        return f"{super().sharding_repr()}, attention={self.attention!r}, layout={self.layout!r}"


@register(nn.MultiheadAttention)
class ShardedMultiheadAttention(_AttentionMixin, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` over token slabs.

    Sharding contract: query/key/value are this rank's slabs, ``(B, L_local, E)`` with
    ``batch_first=True`` or ``(L_local, B, E)`` otherwise; the output is the query's slab.
    ``key_padding_mask`` is the bool ``(B, L_local)`` slab of the keys' padding flags.
    ``is_causal=True`` applies the causal mask on global positions (an ``attn_mask`` passed with
    it is taken as that causal mask, as torch's hint says). Attention dropout in training
    (``dropout``) uses the position-keyed mask law of ``ring_attention`` (see
    ``_AttentionMixin._dropout_facts``; ``dropout_seed`` records the last mask's seed): the law
    of torch's dropout on the attention weights, not its random bits. Since session 60,
    ``need_weights=True`` (torch's default) and an explicit ``attn_mask`` (bool or float, ``(L, S)``
    or ``(B * heads, L, S)`` over the whole sequences, the same tensor on every rank) take an
    explicit path, as torch's own module does: the keys and values are gathered, each rank
    computes its queries' rows of the weights (``(B, L_local, S)``, or per head ``(B, heads,
    L_local, S)``: this rank's query rows of torch's weights, sharded along the queries) and the
    output from them (memory: this rank's share of what one device holds). Not supported there:
    attention dropout in training and the zigzag layout. Not supported: ``add_bias_kv``,
    ``add_zero_attn``. Same state_dict keys as ``nn.MultiheadAttention``.

    Keyword-only options: ``mesh``; ``attention`` (``"ring"`` or ``"ulysses"``); ``layout``
    (``"contiguous"`` or ``"zigzag"``).
    """

    @property
    def _seq_dim(self) -> int:  # type: ignore[override]
        return 1 if self.batch_first else 0

    def _check_inputs(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
    ) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
        """Validate the call from facts gathered from every domain rank (one small all-gather).

        Every argument that can make a rank raise travels, so a bad input on one rank raises the
        same error on every rank instead of leaving the others waiting in the ring. Returns the
        attention-dropout probability of this call (its seed set on ``dropout_seed``) and every
        domain rank's query and key lengths (for the explicit path's rows and gathers).
        """
        name = type(self).__name__
        mask = key_padding_mask
        drop_same, seed = self._dropout_facts(self.dropout)
        same = {
            **drop_same,
            **self._values_fact(),
            "dtype": (dtype_code(query.dtype),),
            "requires_grad": (_requires_grad(self, query, key, value),),
            "need_weights": (int(need_weights),),
            "attn_mask given": (int(attn_mask is not None),),
            "is_causal": (int(is_causal),),
            "key_padding_mask given": (int(mask is not None),),
        }
        mask_bool = int(mask is None or mask.dtype == torch.bool)
        explicit = need_weights or (attn_mask is not None and not is_causal)
        # (Always sent, fixed width: a mask given on some ranks only must raise, not desync.)
        mask_kind = -1 if attn_mask is None else int(attn_mask.dtype == torch.bool)
        # With is_causal the mask is only torch's hint (each rank may pass its own slab's): no shape.
        same["attn_mask (ndim, sizes, bool)"] = (*_shape_fact(None if is_causal else attn_mask, 3), mask_kind)
        local = (
            *_shape_fact(query, 3), *_shape_fact(key, 3), *_shape_fact(value, 3), *_shape_fact(mask, 2), mask_bool, seed
        )  # fmt: skip
        rows = gather_facts(self.mesh, name, same=same, local=local)
        q, k, v = ([r[i : i + 4] for r in rows] for i in (0, 4, 8))
        shapes = [(a[1:], b[1:], c[1:]) for a, b, c in zip(q, k, v)]
        layout = "(B, L_local, E)" if self.batch_first else "(L_local, B, E)"
        if any(t[0] != 3 for t in (*q, *k, *v)):
            raise ShardingError(
                f"{name}: query, key and value must be 3-d {layout} (or 2-d unbatched) on every rank; local "
                f"(query, key, value) shapes by rank: {shapes}."
            )
        bd = 1 if self.batch_first else 2  # position of B in the facts (after the ndim)
        batch = {t[bd] for t in (*q, *k, *v)}
        dims = ({t[3] for t in q}, {t[3] for t in k}, {t[3] for t in v})
        if len(batch) != 1 or dims != ({self.embed_dim}, {self.kdim}, {self.vdim}):
            raise ShardingError(
                f"{name}: expected one batch size on every rank and feature sizes (query {self.embed_dim}, key "
                f"{self.kdim}, value {self.vdim}); local {layout} shapes by rank: {shapes}."
            )
        sd = 2 if self.batch_first else 1  # position of L_local in the facts
        if any(a[sd] != b[sd] for a, b in zip(k, v)):
            raise ShardingError(f"{name}: key and value must hold the same tokens; local shapes by rank: {shapes}.")
        if mask is not None:
            want = [(2, t[bd], t[sd]) for t in k]
            bad = [r for r, row in enumerate(rows) if tuple(row[12:15]) != want[r] or not row[15]]
            if bad:
                raise ShardingError(
                    f"{name}: key_padding_mask must be a bool (B, L_local) tensor of the keys' padding flags on every "
                    f"rank; domain ranks {bad} pass another dtype or shape (expected shapes by rank: "
                    f"{[w[1:] for w in want]})."
                )
        q_lens, k_lens = tuple(t[sd] for t in q), tuple(t[sd] for t in k)
        dropout_p = self._set_dropout_seed(rows, self.dropout)
        if explicit:
            self._check_explicit(attn_mask, q_lens, k_lens, q[0][bd], dropout_p, need_weights)
        return dropout_p, q_lens, k_lens

    def _check_explicit(self, attn_mask, q_lens, k_lens, batch: int, dropout_p: float, need_weights: bool) -> None:
        """The explicit path's own limits, from facts every rank shares (the mask's shape agreed)."""
        name = type(self).__name__
        why = "need_weights=True" if need_weights else "an explicit attn_mask"
        if dropout_p > 0:
            raise ShardingNotImplementedError(
                f"{name}: {why} with attention dropout in training is not supported on a sharded sequence (the "
                "weights would carry torch's dropout draws); call it with need_weights=False and is_causal or "
                "key_padding_mask, or in eval."
            )
        if self.layout != "contiguous":
            raise ShardingNotImplementedError(f"{name}: {why} needs layout='contiguous', got {self.layout!r}.")
        if attn_mask is not None:
            lq, lk = sum(q_lens), sum(k_lens)
            shape = tuple(attn_mask.shape)
            if shape not in ((lq, lk), (batch * self.num_heads, lq, lk)):
                raise ShardingError(
                    f"{name}: attn_mask must cover the whole sequences, (L, S) = ({lq}, {lk}) or (B * heads, L, S) = "
                    f"({batch * self.num_heads}, {lq}, {lk}), the same tensor on every rank; got {shape}."
                )

    def forward(  # noqa: D102
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        name = type(self).__name__
        if self.bias_k is not None or self.add_zero_attn:
            raise ShardingNotImplementedError(f"{name}: add_bias_kv and add_zero_attn are not supported.")
        if query.dim() == 2:
            # Unbatched (L, E) input, as torch accepts: add the batch dim and remove it after.
            b = 0 if self.batch_first else 1
            out, weights = self.forward(
                query.unsqueeze(b), key.unsqueeze(b), value.unsqueeze(b),
                None if key_padding_mask is None else key_padding_mask.unsqueeze(0),
                need_weights, attn_mask, average_attn_weights, is_causal,
            )
            return out.squeeze(b), None if weights is None else weights.squeeze(0)
        dropout_p, q_lens, k_lens = self._check_inputs(
            query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
        )
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        heads = self.num_heads
        q, k, v = (
            F.linear(t, w, bias).unflatten(-1, (heads, -1)).transpose(1, 2)
            for t, w, bias in ((query, w_q, b_q), (key, w_k, b_k), (value, w_v, b_v))
        )
        weights = None
        if need_weights or (attn_mask is not None and not is_causal):
            out, weights = self._explicit(q, k, v, key_padding_mask, attn_mask, is_causal, q_lens, k_lens)
            weights = (weights.mean(1) if average_attn_weights else weights) if need_weights else None
        else:
            out = self._attend(q, k, v, is_causal, key_padding_mask, dropout_p=dropout_p)
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _explicit(self, q, k, v, key_padding_mask, attn_mask, is_causal: bool, q_lens, k_lens):
        """Attention written out as torch's module computes it with weights: this rank's query rows
        against the gathered keys and values. Returns (output (B, H, L_local, D), weights (B, H,
        L_local, S)); a query row with every key masked gives NaN, as torch's."""
        peers = domain_peers(self.mesh)
        me, parts = peers.index, peers.size
        if parts > 1:
            coords = [(r,) for r in range(parts)]
            k = all_gather_grid(k, peers.group, (2,), coords, [k_lens], me)
            v = all_gather_grid(v, peers.group, (2,), coords, [k_lens], me)
        b, h, lq, d = q.shape
        s_len = k.shape[2]
        q0 = sum(q_lens[:me])
        scores = (q * d**-0.5) @ k.transpose(-2, -1)  # (B, H, L_local, S)
        if is_causal:
            # (An attn_mask passed with is_causal is taken as the causal mask, as torch's hint says.)
            rows = torch.arange(q0, q0 + lq, device=q.device)[:, None]
            masked = torch.arange(s_len, device=q.device)[None, :] > rows
            scores = scores.masked_fill(masked, float("-inf"))
        elif attn_mask is not None:
            m = attn_mask.narrow(-2, q0, lq)
            if m.dim() == 3:
                m = m.reshape(b, h, lq, s_len)
            scores = scores.masked_fill(m, float("-inf")) if m.dtype == torch.bool else scores + m.to(scores.dtype)
        if key_padding_mask is not None:
            pad = key_padding_mask
            if parts > 1:
                got = all_gather_uneven(pad.to(torch.uint8), peers.group, [(b, n) for n in k_lens])
                pad = torch.cat(got, 1).bool()
            scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return weights @ v, weights

    def _guard_output_states(self, output, state):
        """The forward guard's layouts of ``(out, weights)``: the output keeps the query's; the
        weights are sharded along their query rows (dim 1 averaged, dim 2 per head)."""
        _out, weights = output
        states = [state]
        if weights is not None:
            q_dim = 1 if weights.dim() == 3 else 2
            states.append(tuple(None if d is None else q_dim for d in state))
        return states

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, "
            f"{self.sharding_repr()}"
        )


__all__ = ["RingAttention", "ShardedMultiheadAttention", "UlyssesAttention"]
