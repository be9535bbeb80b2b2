"""Functional forms of the sharded layers: attention over a sequence sharded on the domain axis.

``ring_attention`` (key/value blocks travel around the ring, partial results merged by their
log-sum-exp) and ``ulysses_attention`` (all-to-all from sequence to head sharding and back) take
``(B, H, L_local, D)`` tensors like ``F.scaled_dot_product_attention`` whose sequence dim 2 is
sharded over the domain ranks, and return this rank's ``(B, H, L_local, D)`` slab of the exact
result. A domain of several mesh axes is flattened row-major into one sequence axis.

Token layouts (``layout=``): ``"contiguous"`` slabs (rank r holds one run of tokens, any lengths)
or ``"zigzag"``, the load-balanced layout for causal attention: the sequence is cut into 2P
balanced chunks and rank r holds chunks r and 2P-1-r, so that every rank does the same causal
work. ``zigzag_shard`` / ``zigzag_unshard`` move tokens into and out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .comm.all_to_all import heads_to_seq, seq_to_heads
from .comm.collectives import all_gather_uneven
from .comm.ring import AxisRing
from .comm.ring_pass import domain_ring, gather_ints, ring_pass
from .errors import ShardingError, ShardingNotImplementedError
from .layout import Layout

__all__ = ["ring_attention", "ulysses_attention", "zigzag_shard", "zigzag_unshard"]

_LAYOUTS = ("contiguous", "zigzag")
#: Query rows per tile in the blocked math path: bounds its score matrix to tile x block.
_Q_TILE = 1024
# Message tags: key/value blocks and gradient accumulators are in flight at the same time.
_TAG_KV, _TAG_DKV = 0, 8


# --------------------------------------------------------------------------- zigzag layout


def _zigzag_chunks(length: int, parts: int) -> Layout:
    return Layout.balanced(length, 2 * parts)


def zigzag_shard(x: torch.Tensor, mesh: DeviceMesh, dim: int = 2) -> torch.Tensor:
    """This rank's zigzag slab of the full tensor ``x`` along ``dim``: chunks r and 2P-1-r.

    The global length is cut into 2P balanced chunks (``Layout.balanced``); every rank passes
    the full tensor.
    """
    ring = domain_ring(mesh)
    chunks = _zigzag_chunks(x.shape[dim], ring.size)
    r, p = ring.index, ring.size
    return torch.cat([x[_along(x, dim, chunks.slice(c))] for c in (r, 2 * p - 1 - r)], dim).clone()


def zigzag_unshard(x_local: torch.Tensor, mesh: DeviceMesh, dim: int = 2) -> torch.Tensor:
    """The full tensor in natural token order, on every rank, from zigzag slabs (no gradient)."""
    ring = domain_ring(mesh)
    dim = dim % x_local.dim()
    shapes = [tuple(s) for s in gather_ints(x_local.shape, ring)]
    parts = all_gather_uneven(x_local, ring.group, shapes) if ring.size > 1 else [x_local.detach()]
    p = ring.size
    chunks = _zigzag_chunks(sum(s[dim] for s in shapes), p)
    pieces: list[torch.Tensor | None] = [None] * (2 * p)
    for r, part in enumerate(parts):
        a = chunks.sizes[r]
        pieces[r] = part.narrow(dim, 0, a)
        pieces[2 * p - 1 - r] = part.narrow(dim, a, part.shape[dim] - a)
    return torch.cat(pieces, dim)


def _along(x: torch.Tensor, dim: int, s: slice) -> tuple[slice, ...]:
    idx = [slice(None)] * x.dim()
    idx[dim] = s
    return tuple(idx)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Segment:
    """A run of consecutive tokens: global start, offset in the local slab, length."""

    start: int
    offset: int
    length: int


@dataclass(frozen=True)
class _Plan:
    ring: AxisRing
    scale: float
    causal: bool
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    q_segs: tuple[tuple[_Segment, ...], ...]  # per rank
    k_segs: tuple[tuple[_Segment, ...], ...]
    has_mask: bool


def _segments(lens: tuple[int, ...], layout: str, what: str) -> tuple[tuple[_Segment, ...], ...]:
    p = len(lens)
    if layout == "contiguous":
        starts = Layout(lens).starts
        return tuple((_Segment(starts[r], 0, lens[r]),) for r in range(p))
    chunks = _zigzag_chunks(sum(lens), p)
    want = tuple(chunks.sizes[r] + chunks.sizes[2 * p - 1 - r] for r in range(p))
    if want != lens:
        raise ShardingError(
            f"{what}: layout='zigzag' expects per-rank lengths {want} (chunks r and 2P-1-r of "
            f"{chunks.sizes}) for a sequence of {sum(lens)} tokens, but the ranks hold {lens}. "
            "Put the tokens into the layout with sharded_nn.functional.zigzag_shard."
        )
    out = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        out.append((
            _Segment(chunks.starts[c0], 0, chunks.sizes[c0]),
            _Segment(chunks.starts[c1], chunks.sizes[c0], chunks.sizes[c1]),
        ))
    return tuple(out)


def _plan(q, k, v, mask, mesh, is_causal, scale, layout, what) -> _Plan:
    if layout not in _LAYOUTS:
        raise ValueError(f"{what}: layout must be one of {_LAYOUTS}, got {layout!r}.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ShardingError(f"{what}: {name} must be (B, H, L_local, D), got shape {tuple(t.shape)}.")
    ring = domain_ring(mesh)
    mask_shape = tuple(mask.shape) if mask is not None else None
    # A bad mask on one rank only must still raise on every rank: its validity is a gathered fact.
    mask_ok = mask is None or (mask_shape == (q.shape[0], k.shape[2]) and mask.dtype == torch.bool)
    facts = (*q.shape, *k.shape, *v.shape, mask is not None, mask_ok)
    rows = gather_ints(facts, ring)
    # Unsharded facts must agree on every rank; all ranks see the same rows and raise together.
    keep = [i for i in range(len(facts) - 1) if i not in (2, 6, 10)]
    if len({tuple(r[i] for i in keep) for r in rows}) != 1:
        raise ShardingError(
            f"{what}: ranks disagree on batch, heads, head dims or mask presence. Local "
            f"(q, k, v) shapes per rank: {[(r[0:4], r[4:8], r[8:12]) for r in rows]}."
        )
    b, hq, _, d = q.shape
    bk, hk, _, dk = k.shape
    bv, hv, _, dv = v.shape
    if not (b == bk == bv and hk == hv and d == dk):
        raise ShardingError(
            f"{what}: expected q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if hq % hk:
        raise ShardingError(f"{what}: query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA.")
    q_lens = tuple(r[2] for r in rows)
    k_lens = tuple(r[6] for r in rows)
    if any(r[10] != r[6] for r in rows):
        raise ShardingError(f"{what}: k and v hold different lengths: {k_lens} vs {tuple(r[10] for r in rows)}.")
    if min(q_lens + k_lens) == 0:
        raise ShardingError(f"{what}: every rank needs a non-empty slab, got q {q_lens}, k {k_lens}.")
    if not all(r[13] for r in rows):
        bad = [i for i, r in enumerate(rows) if not r[13]]
        mine = f"{mask.dtype} {mask_shape}" if mask is not None else "None"
        raise ShardingError(
            f"{what}: key_padding_mask must be a bool (B, Lk_local) tensor on every rank; ranks {bad} "
            f"pass something else (this rank: {mine}, expected {(b, k.shape[2])})."
        )
    if is_causal and q_lens != k_lens:
        raise ShardingError(
            f"{what}: causal attention needs queries and keys with the same layout, got q lengths "
            f"{q_lens} and k lengths {k_lens}."
        )
    q_segs = _segments(q_lens, layout, what)
    k_segs = _segments(k_lens, layout, what)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _Plan(ring, scale, bool(is_causal), q_lens, k_lens, q_segs, k_segs, mask is not None)


def _pairs(plan: _Plan, src: int):
    """(query segment, key segment, diagonal) pairs of this rank against the block of ``src``.

    Causal attention skips blocks wholly in the future and masks only the diagonal: in both
    layouts a key run that overlaps a query run is the same run of tokens, so it is causal
    top-left aligned.
    """
    me = plan.ring.index
    if not plan.causal:
        yield _Segment(0, 0, plan.q_lens[me]), _Segment(0, 0, plan.k_lens[src]), False
        return
    for qs in plan.q_segs[me]:
        for ks in plan.k_segs[src]:
            if ks.start >= qs.start + qs.length:
                continue
            if ks.start + ks.length <= qs.start:
                yield qs, ks, False
            else:
                yield qs, ks, True


# --------------------------------------------------------------------------- block kernels


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _additive(pad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(B, Lk) padding flags (nonzero = ignore) -> (B, 1, 1, Lk) additive mask."""
    if pad is None:
        return None
    bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device)
    return bias.masked_fill_(pad.bool(), float("-inf"))[:, None, None, :]


def _use_cpu_flash(q: torch.Tensor, v: torch.Tensor) -> bool:
    # The CPU flash kernel returns the log-sum-exp we merge with; it needs equal q/v head sizes.
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and q.dtype in dtypes


def _block_forward(q, k, v, pad, scale, diag):
    """Attention of a query run over one key block: (out in acc dtype, lse in acc dtype).

    Rows whose keys are all padded get lse = -inf and out = 0, so that merging ignores them.
    """
    acc = _acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    bias = _additive(pad, q.dtype)
    if _use_cpu_flash(q, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, diag, attn_mask=bias, scale=scale
        )
        out, lse = out.to(acc), lse.to(acc)
    else:
        out, lse = _math_forward(q, k, v, bias, scale, diag)
    if pad is not None:
        # The CPU kernel reports lse = 0 for a row with no visible key; mark it empty instead.
        # On a diagonal block row i sees keys 0..i only, so it is empty when they all are padding.
        flags = pad.bool()
        empty = (flags.cumprod(-1).bool() if diag else flags.all(-1, keepdim=True))[:, None, :]
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def _scores(q, k, bias, scale, diag, row0, acc):
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    if diag:
        rows = torch.arange(row0, row0 + q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _math_forward(q, k, v, bias, scale, diag):
    acc = _acc_dtype(q.dtype)
    outs, lses = [], []
    for i in range(0, q.shape[2], _Q_TILE):
        s = _scores(q[:, :, i : i + _Q_TILE], k, bias, scale, diag, i, acc)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append(torch.matmul(p, v.to(acc)))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _block_backward(dout, q, k, v, out, lse, pad, scale, diag):
    """Gradients of one block pair from the final output and lse (flash-style recomputation)."""
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    bias = _additive(pad, q.dtype)
    if _use_cpu_flash(q, v):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, diag, attn_mask=bias, scale=scale
        )
    else:
        dq, dk, dv = _math_backward(dout, q, ke, ve, out, lse, bias, scale, diag)
    return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


def _math_backward(dout, q, k, v, out, lse, bias, scale, diag):
    acc = _acc_dtype(q.dtype)
    kf, vf = k.to(acc), v.to(acc)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for i in range(0, q.shape[2], _Q_TILE):
        sl = slice(i, i + _Q_TILE)
        qt, dot = q[:, :, sl].to(acc), dout[:, :, sl].to(acc)
        s = _scores(qt, kf, bias, scale, diag, i, acc)
        p = torch.exp(s - lse[:, :, sl, None].to(acc))
        delta = (dot * out[:, :, sl].to(acc)).sum(-1, keepdim=True)
        dv += torch.matmul(p.transpose(-1, -2), dot)
        ds = p * (torch.matmul(dot, vf.transpose(-1, -2)) - delta) * scale
        dq[:, :, sl] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(-1, -2), qt)
    return dq, dk, dv


def _merge(out_acc, lse_acc, out_b, lse_b):
    """Log-sum-exp merge of a block result into the running (out, lse), in place.

    ``out_b`` is a fresh block result and is overwritten.
    """
    new = torch.logaddexp(lse_acc, lse_b)
    # Rows that have seen no visible key yet keep lse = -inf; exp(-inf - -inf) would be NaN.
    safe = torch.where(torch.isinf(new), 0.0, new)
    w_old = torch.exp(lse_acc - safe)[..., None]
    w_new = torch.exp(lse_b - safe)[..., None]
    out_acc.mul_(w_old).add_(out_b.mul_(w_new))
    lse_acc.copy_(new)


def _whole(seg: _Segment, n: int) -> bool:
    return seg.offset == 0 and seg.length == n


def _accumulate(acc: torch.Tensor | None, seg: _Segment, val: torch.Tensor, shape, dtype) -> torch.Tensor:
    """``acc[:, :, seg] += val``; the first value of a whole-slab accumulator is taken as is.

    Taking the kernel's fresh result instead of adding it into zeros saves a slab-sized buffer
    per accumulator, which matters because the ring already holds block pairs in flight.
    """
    if acc is None:
        if _whole(seg, shape[2]):
            return val.to(dtype)
        acc = torch.zeros(shape, dtype=dtype, device=val.device)
    _sl(acc, seg).add_(val)
    return acc


# --------------------------------------------------------------------------- ring attention


def _sl(t, seg: _Segment):
    return t[:, :, seg.offset : seg.offset + seg.length]


def _sl_mask(m, seg: _Segment):
    return None if m is None else m[:, seg.offset : seg.offset + seg.length]


def _block_shapes(plan: _Plan, src: int, k, v, pad):
    n = plan.k_lens[src]
    shapes = [(*k.shape[:2], n, k.shape[3]), (*v.shape[:2], n, v.shape[3])]
    if pad is not None:
        shapes.append((pad.shape[0], n))
    return shapes


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pad, plan: _Plan):  # noqa: D102
        ring, me, p = plan.ring, plan.ring.index, plan.ring.size
        acc = _acc_dtype(q.dtype)
        b, h, n, _ = q.shape
        out = lse = None
        block = [k.contiguous(), v.contiguous()] + ([pad] if pad is not None else [])
        for step in range(p):
            src = (me - step) % p
            handle = None
            if step < p - 1:
                # Double buffering: the next block travels while this one is computed on.
                handle = ring_pass(ring, block, _block_shapes(plan, (src - 1) % p, k, v, pad), tag=_TAG_KV)
            kb, vb = block[0], block[1]
            mb = block[2] if pad is not None else None
            for qs, ks, diag in _pairs(plan, src):
                o_b, l_b = _block_forward(_sl(q, qs), _sl(kb, ks), _sl(vb, ks), _sl_mask(mb, ks), plan.scale, diag)
                if out is None and _whole(qs, n):
                    out, lse = o_b, l_b.contiguous()
                    continue
                if out is None:
                    out = torch.zeros((b, h, n, v.shape[3]), dtype=acc, device=q.device)
                    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
                _merge(_sl(out, qs), lse[:, :, qs.offset : qs.offset + qs.length], o_b, l_b)
                del o_b, l_b
            # Drop the names of this step's block so that it is freed as soon as it is replaced
            # (per-rank memory is the slab plus one block pair in flight).
            del kb, vb, mb
            if handle is not None:
                block = handle.wait()
        out_q = out.to(q.dtype)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, pad if pad is not None else torch.empty(0), out_q, lse)
        return out_q, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # noqa: D102
        plan = ctx.plan
        q, k, v, pad, out, lse = ctx.saved_tensors
        pad = pad if plan.has_mask else None
        ring, me, p = plan.ring, plan.ring.index, plan.ring.size
        acc = _acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = None
        block = [k.contiguous(), v.contiguous()] + ([pad] if pad is not None else [])
        dkv_handle = None
        for step in range(p):
            src = (me - step) % p
            kv_handle = None
            if step < p - 1:
                kv_handle = ring_pass(ring, block, _block_shapes(plan, (src - 1) % p, k, v, pad), tag=_TAG_KV)
            kb, vb = block[0], block[1]
            mb = block[2] if pad is not None else None
            dk = dv = None
            for qs, ks, diag in _pairs(plan, src):
                dq_b, dk_b, dv_b = _block_backward(
                    _sl(dout, qs).contiguous(), _sl(q, qs), _sl(kb, ks), _sl(vb, ks),
                    _sl(out, qs).contiguous(), lse[:, :, qs.offset : qs.offset + qs.length].contiguous(),
                    _sl_mask(mb, ks), plan.scale, diag,
                )
                dq = _accumulate(dq, qs, dq_b, q.shape, acc)
                dk = _accumulate(dk, ks, dk_b, kb.shape, acc)
                dv = _accumulate(dv, ks, dv_b, vb.shape, acc)
                del dq_b, dk_b, dv_b
            if dk is None:  # a block wholly in this rank's causal future
                dk = torch.zeros(kb.shape, dtype=acc, device=q.device)
                dv = torch.zeros(vb.shape, dtype=acc, device=q.device)
            if dkv_handle is not None:
                # The accumulator of this block, from the ranks that held it before; it travelled
                # while this rank computed its own share.
                dk_in, dv_in = dkv_handle.wait()
                dk += dk_in
                dv += dv_in
                del dk_in, dv_in
            # After the last step the accumulator makes one more hop, back to the block's owner.
            nxt = (src - 1) % p
            dkv_handle = ring_pass(ring, [dk, dv], _block_shapes(plan, nxt, dk, dv, None), tag=_TAG_DKV)
            del kb, vb, mb, dk, dv
            if kv_handle is not None:
                block = kv_handle.wait()
        dk, dv = dkv_handle.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
):
    """Exact attention over a sequence sharded on the domain axis, by passing K/V around a ring.

    Sharding contract: q ``(B, H, Lq_local, D)``, k ``(B, Hkv, Lk_local, D)``, v
    ``(B, Hkv, Lk_local, Dv)`` hold this rank's tokens (dim 2 sharded, any lengths, ``layout``
    says which tokens); the result is this rank's ``(B, H, Lq_local, Dv)`` slab of
    ``F.scaled_dot_product_attention`` on the full sequence. Forward: one tiny all-gather of the
    local shapes, then P-1 point-to-point hops of the K/V block (double-buffered, overlapped with
    the block computation). Backward: K/V circulate again together with their dK/dV
    accumulators, which end on their owners. Per-rank memory is O(L_local x D) plus one block
    pair in flight; no rank ever holds the full K/V or an L x L matrix. Partial results are
    merged in float32 (float64 for float64 inputs) by their log-sum-exp.

    Args:
        q, k, v: local slabs. ``H`` must be a multiple of ``Hkv`` (grouped-query attention).
        mesh: mesh with domain axes; several domain axes are flattened row-major.
        is_causal: causal mask on global token positions (needs identical q and k layouts).
        scale: score scale; default ``1 / sqrt(D)``.
        key_padding_mask: bool ``(B, Lk_local)``, True where a key is padding and must be
            ignored (``nn.MultiheadAttention``'s convention). A query whose keys are all padding
            gets zeros.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
        return_lse: also return the ``(B, H, Lq_local)`` log-sum-exp of the scores.

    Raises:
        ShardingError: inconsistent shapes across ranks, a zigzag layout with the wrong lengths,
            or causal attention with different q and k layouts (on every rank alike).
    """
    plan = _plan(q, k, v, key_padding_mask, mesh, is_causal, scale, layout, "ring_attention")
    pad = key_padding_mask.to(torch.uint8).contiguous() if key_padding_mask is not None else None
    out, lse = _RingAttention.apply(q, k, v, pad, plan)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- Ulysses


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    layout: str = "contiguous",
) -> torch.Tensor:
    """Exact attention over a sharded sequence by all-to-all to head sharding and back.

    Sharding contract: as ``ring_attention``. Forward: an all-to-all turns the local slabs of
    all heads into the full sequence of H/P heads, local ``F.scaled_dot_product_attention``
    runs on it, and a second all-to-all returns the sequence slabs; backward mirrors them. Memory
    per rank is O(L x H/P x D) plus what the local attention kernel needs. The key padding mask
    is all-gathered (B x L flags).

    Raises:
        ShardingError: when the query or key/value heads are not divisible by the number of
            domain ranks (on every rank alike), or as ``ring_attention``.
    """
    plan = _plan(q, k, v, key_padding_mask, mesh, is_causal, scale, layout, "ulysses_attention")
    p = plan.ring.size
    hq, hk = q.shape[1], k.shape[1]
    if hq % p or hk % p:
        raise ShardingError(
            f"ulysses_attention: {hq} query heads and {hk} key/value heads must both be divisible by "
            f"the {p} domain ranks, because each rank attends over whole heads. Use ring_attention "
            "(attention='ring'), or a number of ranks that divides the heads."
        )
    ring = plan.ring
    qh = seq_to_heads(q, ring, plan.q_lens)
    kh = seq_to_heads(k, ring, plan.k_lens)
    vh = seq_to_heads(v, ring, plan.k_lens)
    mask = None
    if key_padding_mask is not None:
        shapes = [(q.shape[0], n) for n in plan.k_lens]
        pads = all_gather_uneven(key_padding_mask.to(torch.uint8), ring.group, shapes) if p > 1 else [key_padding_mask]
        mask = ~torch.cat(pads, 1).bool()[:, None, None, :]
    order = None
    if is_causal and layout == "zigzag" and p > 1:
        # Tokens arrive in rank order; causal masking needs global order.
        order = torch.cat([
            torch.arange(s.start, s.start + s.length, device=q.device) for segs in plan.q_segs for s in segs
        ])
        natural = torch.argsort(order)
        qh, kh, vh = qh[:, :, natural], kh[:, :, natural], vh[:, :, natural]
        mask = mask[..., natural] if mask is not None else None
    causal_flag = is_causal
    if is_causal and mask is not None:
        # Padding and causality combined need an explicit (L, L) mask; without padding the
        # kernel's own causal path is used.
        n = qh.shape[2]
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        causal_flag = False
    oh = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal_flag, scale=scale, enable_gqa=hq != hk
    )
    if order is not None:
        oh = oh[:, :, order]
    return heads_to_seq(oh.contiguous(), ring, plan.q_lens)
