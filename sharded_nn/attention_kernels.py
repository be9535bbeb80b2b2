"""Block kernels of ring attention: one query run against one key/value block.

Ring attention (``sharded_nn.functional.ring_attention``) splits exact attention into blocks and
needs, for each block, the output *and* the log-sum-exp (lse) of its scores in forward, and in
backward the gradients of the block from the *final* output and lse (flash-style
recomputation). Three implementations, chosen per call:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (equal q/v head
  sizes, float32/float64/bfloat16).
* CUDA: ``aten._scaled_dot_product_efficient_attention`` and its backward (the memory-efficient
  kernel: additive bias for key padding, causal, any scale). Its lse is padded along L to a
  multiple of 32 and is cut back / padded again here. Because these private ops may change
  their signature between torch releases, every (device, dtype, head sizes, mask kind) is first
  checked once against the math path on a tiny random problem; if the kernel raises or
  disagrees, a ``ShardingWarning`` says so and the math path is used from then on, so a changed
  op can never give a silently wrong answer.
* Everywhere else (other head sizes, dtypes, devices): blocked math in float32 (float64 for
  float64 inputs), ``_Q_TILE`` query rows at a time, so that the score matrix is at most
  ``_Q_TILE x block``.

All kernels take ``(B, H, Lq, D)`` queries and ``(B, Hkv, Lk, D)`` keys/values (GQA: H is a
multiple of Hkv), a ``(B, Lk)`` uint8 padding mask (nonzero = ignore) or None, and ``diag``:
the block is the causal diagonal (the query run and the key run are the same tokens, so the
causal mask is top-left aligned).

Attention dropout (``drop``, a ``BlockDropout``) is position-keyed: whether the probability of
(batch b, query head h, query i, key j) is dropped is a hash of a seed and the *global*
``(b, h, i, j)`` (``dropout_keep``), so every rank computes the same mask for the same pair
without communication, and backward regenerates it instead of storing it. Kept probabilities
are scaled by ``1 / (1 - p)``, as ``F.scaled_dot_product_attention(dropout_p=p)`` does; the
log-sum-exp is that of the undropped scores, so block results merge exactly as without dropout.
Blocks with dropout always take the blocked math path (the fused kernels draw their own bits).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import ShardingWarning

__all__ = ["BlockDropout", "acc_dtype", "block_backward", "block_forward", "dropout_keep", "merge"]

#: The aten namespace, looked up through this name so that tests can stand in for the CUDA ops.
_aten = torch.ops.aten
#: Query rows per tile in the blocked math path: bounds its score matrix to tile x block.
_Q_TILE = 1024
#: With dropout, a tile's mask is built from int64 hashes: at most this many elements per tile.
_DROP_TILE_NUMEL = 1 << 22


# --------------------------------------------------------------------------- dropout mask law

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor | int):
    """A bijection of 32-bit values held in int64 (xorshift-multiply rounds, as in lowbias32).

    The multipliers are below 2**31, so every product of a 32-bit value stays below 2**63:
    no signed overflow, the same bits on every device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & _M32
    return x ^ (x >> 15)


def dropout_keep(
    seed: int,
    p: float,
    batch: torch.Tensor,
    heads: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
) -> torch.Tensor:
    """The attention-dropout mask law: ``(B, H, Lq, Lk)`` bool, True where a probability is kept.

    Entry ``(b, h, i, j)`` depends only on ``seed`` and the global indices ``batch[b]``,
    ``heads[h]`` (query head), ``q_pos[i]`` and ``k_pos[j]`` (global token positions, below
    2**32): a 32-bit hash ``u`` of them, dropped when ``u < round(p * 2**32)``, i.e. with
    probability p (to 2**-32). Different (b, h, i, j) give independent-looking bits; the same
    ones give the same bit on every rank and in backward.

    Args:
        seed: any integer (the low 64 bits are used); one seed per attention call and step.
        p: drop probability in [0, 1).
        batch, heads, q_pos, k_pos: 1-d int64 index tensors, on the device of the result.
    """
    seed = int(seed) & ((1 << 64) - 1)
    s0, s1 = seed & _M32, seed >> 32
    thresh = round(p * (1 << 32))
    key_bh = _mix32(_mix32(_mix32(s0 ^ 0x6A09E667) ^ (batch & _M32))[:, None] ^ (heads & _M32)[None, :])
    rows = _mix32(key_bh[:, :, None] ^ (q_pos & _M32)[None, None, :])
    cols = _mix32(((k_pos & _M32) ^ s1) ^ 0x3C6EF372)
    return _mix32(rows[..., None] ^ cols) >= thresh


@dataclass(frozen=True)
class BlockDropout:
    """Attention dropout of one block: probability ``p``, ``seed`` and the global indices of the
    block's batch items, query heads, query rows and keys (see ``dropout_keep``)."""

    p: float
    seed: int
    batch: torch.Tensor
    heads: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor

    def scale(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """``(B, H, r1 - r0, Lk)`` multipliers of query rows ``r0:r1``: 0 or ``1 / (1 - p)``."""
        keep = dropout_keep(self.seed, self.p, self.batch, self.heads, self.q_pos[r0:r1], self.k_pos)
        return keep.to(dtype) * (1.0 / (1.0 - self.p))


def _tile_rows(q: torch.Tensor, n_keys: int, drop: BlockDropout | None) -> int:
    if drop is None:
        return _Q_TILE
    return max(1, min(_Q_TILE, _DROP_TILE_NUMEL // max(1, q.shape[0] * q.shape[1] * n_keys)))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which partial results are merged: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _additive(pad: torch.Tensor | None, dtype: torch.dtype, align: int = 1) -> torch.Tensor | None:
    """(B, Lk) padding flags (nonzero = ignore) -> (B, 1, 1, Lk) additive mask.

    ``align``: the storage's last dim is padded to a multiple of it (the CUDA kernel wants
    16-element aligned rows) and the view cut back to Lk.
    """
    if pad is None:
        return None
    b, n = pad.shape
    bias = torch.zeros((b, -(-n // align) * align), dtype=dtype, device=pad.device)[:, :n]
    return bias.masked_fill_(pad.bool(), float("-inf"))[:, None, None, :]


def _empty_rows(pad: torch.Tensor, diag: bool) -> torch.Tensor:
    """(B, 1, Lq or 1) True where a query row sees no key of the block."""
    flags = pad.bool()
    # On a diagonal block row i sees keys 0..i only, so it is empty when they all are padding.
    return (flags.cumprod(-1).bool() if diag else flags.all(-1, keepdim=True))[:, None, :]


# --------------------------------------------------------------------------- math path


def _scores(q, k, bias, scale, diag, row0, acc):
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    if diag:
        rows = torch.arange(row0, row0 + q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _math_forward(q, k, v, bias, scale, diag, drop: BlockDropout | None = None):
    acc = acc_dtype(q.dtype)
    n = q.shape[2]
    out = torch.empty((*q.shape[:3], v.shape[3]), dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    tile = _tile_rows(q, k.shape[2], drop)
    for i in range(0, n, tile):
        s = _scores(q[:, :, i : i + tile], k, bias, scale, diag, i, acc)
        tile_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(tile_lse), 0.0, tile_lse)[..., None])
        if drop is not None:
            # Dropout acts on the normalised probabilities; the lse stays that of all scores.
            p = p * drop.scale(i, i + p.shape[2], acc)
        out[:, :, i : i + tile] = torch.matmul(p, v.to(acc))
        lse[:, :, i : i + tile] = tile_lse
    return out, lse


def _math_backward(dout, q, k, v, out, lse, bias, scale, diag, drop: BlockDropout | None = None):
    acc = acc_dtype(q.dtype)
    kf, vf = k.to(acc), v.to(acc)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    tile = _tile_rows(q, k.shape[2], drop)
    for i in range(0, q.shape[2], tile):
        sl = slice(i, i + tile)
        qt, dot = q[:, :, sl].to(acc), dout[:, :, sl].to(acc)
        s = _scores(qt, kf, bias, scale, diag, i, acc)
        p = torch.exp(s - lse[:, :, sl, None].to(acc))
        # delta_i = sum_j P_ij dP_ij = dout_i . out_i also with dropout, because ``out`` is the
        # final (dropped) output: out_i = sum_j P_ij Z_ij v_j and dP_ij = Z_ij dout_i . v_j.
        delta = (dot * out[:, :, sl].to(acc)).sum(-1, keepdim=True)
        dp = torch.matmul(dot, vf.transpose(-1, -2))
        if drop is not None:
            z = drop.scale(i, i + p.shape[2], acc)
            dv += torch.matmul((p * z).transpose(-1, -2), dot)
            dp = dp * z
            del z
        else:
            dv += torch.matmul(p.transpose(-1, -2), dot)
        ds = p * (dp - delta) * scale
        dq[:, :, sl] = torch.matmul(ds, kf)
        dk += torch.matmul(ds.transpose(-1, -2), qt)
    return dq, dk, dv


# --------------------------------------------------------------------------- CPU flash kernel


def _use_cpu_flash(q: torch.Tensor, v: torch.Tensor) -> bool:
    # The CPU flash kernel returns the lse we merge with; it needs equal q/v head sizes.
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and q.dtype in dtypes


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride along its last dim (a copy only where it has another).

    Why: the CPU flash kernel reads each row of head-dim values as contiguous memory and takes
    only the other dims' strides; given a view whose last dim is strided (``x.transpose(1, 2)``
    of a channels-first map), it silently reads the wrong elements. torch's own
    ``scaled_dot_product_attention`` makes such inputs contiguous before calling it; so must we.
    """
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _cpu_forward(q, k, v, pad, scale, diag):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _rows(q), _rows(k), _rows(v), 0.0, diag, attn_mask=_additive(pad, q.dtype), scale=scale
    )
    return out, lse


def _cpu_backward(dout, q, k, v, out, lse, pad, scale, diag):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _rows(dout), _rows(q), _rows(k), _rows(v), _rows(out), lse, 0.0, diag, attn_mask=_additive(pad, q.dtype),
        scale=scale,
    )


# --------------------------------------------------------------------------- CUDA efficient kernel


def _bmhk(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a ``(B, H, M, K)`` view) stored as a contiguous ``(B, M, H, K)`` tensor (a copy only
    where it is not).

    Why: the memory-efficient backward computes ``delta = rowsum(dout * out)`` inside the kernel
    for float16/bfloat16 and reads ``out`` with the stride it has as the forward's own output,
    ``H * K`` between rows (xformers' ``o_strideM`` is derived, not passed). Given a ``(B, H, M,
    K)``-contiguous ``out`` (or a chunk of a few heads), the half-precision dq and dk came out
    wrong by O(1) on an H200 (torch 2.11); float32 computes delta outside the kernel.
    """
    bmhk = t.transpose(1, 2)
    return t if bmhk.is_contiguous() else bmhk.contiguous().transpose(1, 2)


def _efficient_forward(q, k, v, pad, scale, diag):
    # The kernel takes any strides but needs unit-stride head rows (as torch's own sdpa gives
    # it): views of a fused qkv projection and of query runs go in without a copy.
    q, k, v = _rows(q), _rows(k), _rows(v)
    bias = _additive(pad, q.dtype, align=16)
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out, lse, _seed, _offset = _aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, diag, scale=scale
    )
    # The lse comes padded along L to a multiple of 32.
    return out, lse[:, :, : q.shape[2]]


def _efficient_backward(dout, q, k, v, out, lse, pad, scale, diag):
    q, k, v = _rows(q), _rows(k), _rows(v)
    bias = _additive(pad, q.dtype, align=16)
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    n = q.shape[2]
    lse_padded = torch.zeros((*lse.shape[:2], -(-n // 32) * 32), dtype=lse.dtype, device=lse.device)
    lse_padded[:, :, :n] = lse
    # Without dropout the kernel does not read the random state; it still wants the tensors.
    seed = torch.zeros((), dtype=torch.int64)
    offset = torch.zeros((), dtype=torch.int64)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        _rows(dout), q, k, v, bias, _bmhk(out.to(q.dtype)), lse_padded, seed, offset,
        0.0, [True, True, True, False], diag, scale=scale,
    )
    return dq, dk, dv


#: Fused kernels that must pass the one-time self-check before use, by device type:
#: (forward, backward, dtypes they accept, fewest query rows worth a launch).
#:
#: Why a fewest: the CUDA kernel spreads its work over (64-query tile, head, sample) thread
#: blocks, so a run of a few queries (a ViT's class and register tokens riding the ring as
#: replicated queries) gets B * H blocks on a GPU of 132 multiprocessors, each walking every
#: key alone: on an H200, 1 query over 4097 keys took 0.42 ms against 0.57 ms for all 4096
#: queries. The math path does such a run in a few small batched products.
_CHECKED_KERNELS: dict[str, tuple[Callable, Callable, tuple[torch.dtype, ...], int]] = {
    "cuda": (_efficient_forward, _efficient_backward, (torch.float16, torch.bfloat16, torch.float32), 16),
}
#: Outcome of the self-check per (device, dtype, D, Dv, mask kind).
_CHECKED: dict[tuple, bool] = {}


def _check_tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype in (torch.float16, torch.bfloat16) else 2e-3


def _self_check(key: tuple, fwd: Callable, bwd: Callable) -> bool:
    """Compare a fused kernel with the math path on a tiny random problem; warn on failure."""
    device, dtype, d, dv, masked, diag = key
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, n = 2, 2, 37  # a length that is not a multiple of the kernels' tile sizes

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # The layouts of real calls: q, k, v as views of one fused projection (B, N, 3, H, D), the
    # output gradient and the output (B, H, N, D)-contiguous as ring attention holds them.
    qkv = rand(b, n, 3, h, max(d, dv)).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0, ..., :d], qkv[1, ..., :d], qkv[2, ..., :dv]
    dout = rand(b, h, n, dv)
    pad = None
    if masked:
        pad = (torch.rand(b, n, generator=g) < 0.3).to(torch.uint8)
        pad[:, 0] = 0
        pad = pad.to(device)
    scale = 0.3
    try:
        out, lse = fwd(q, k, v, pad, scale, diag)
        grads = bwd(dout, q, k, v, out.contiguous(), lse, pad, scale, diag)
        ref_out, ref_lse = _math_forward(q, k, v, _additive(pad, q.dtype), scale, diag)
        ref_grads = _math_backward(dout, q, k, v, ref_out, ref_lse, _additive(pad, q.dtype), scale, diag)
        tol = _check_tolerance(dtype)
        pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)]
        for got, want in pairs:
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this kernel
        warnings.warn(
            f"ring_attention: the fused {device.type} attention kernel ({fwd.__name__}) failed its self-check "
            f"for dtype={dtype}, head dims ({d}, {dv}), key padding mask={masked}, causal block={diag} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); using the slower "
            "blocked math path instead. Results stay exact; please report this with your torch version.",
            ShardingWarning,
            stacklevel=4,
        )
        return False
    return True


def _fused(q: torch.Tensor, v: torch.Tensor, pad, diag: bool) -> tuple[Callable, Callable] | None:
    """The checked fused kernel pair for this block, or None for the other paths."""
    entry = _CHECKED_KERNELS.get(q.device.type)
    if entry is None or q.dtype not in entry[2] or q.shape[2] < entry[3]:
        return None
    key = (q.device, q.dtype, q.shape[-1], v.shape[-1], pad is not None, bool(diag))
    ok = _CHECKED.get(key)
    if ok is None:
        ok = _CHECKED[key] = _self_check(key, entry[0], entry[1])
    return (entry[0], entry[1]) if ok else None


# --------------------------------------------------------------------------- dispatch


def block_forward(q, k, v, pad, scale: float, diag: bool, drop: BlockDropout | None = None):
    """Attention of a query run over one key block: ``(out, lse)`` in the accumulation dtype.

    Rows whose keys are all padded get lse = -inf and out = 0, so that merging ignores them.
    ``drop``: position-keyed attention dropout of this block (None: none); ``lse`` is that of
    the undropped scores.
    """
    acc = acc_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    fused = None if drop is not None else _fused(q, v, pad, diag)
    if drop is not None:
        out, lse = _math_forward(q, k, v, _additive(pad, q.dtype), scale, diag, drop)
    elif fused is not None:
        out, lse = fused[0](q, k, v, pad, scale, diag)
    elif _use_cpu_flash(q, v):
        out, lse = _cpu_forward(q, k, v, pad, scale, diag)
    else:
        out, lse = _math_forward(q, k, v, _additive(pad, q.dtype), scale, diag)
    # Float32 inputs: these are no-ops, not copies.
    out, lse = out.to(acc), lse.to(acc)
    if pad is not None:
        # Kernels report lse = 0 (or NaN) for a row with no visible key; mark it empty instead.
        empty = _empty_rows(pad, diag)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def block_backward(dout, q, k, v, out, lse, pad, scale: float, diag: bool, drop: BlockDropout | None = None):
    """Gradients ``(dq, dk, dv)`` of one block pair from the final output and lse.

    ``drop``: the block's dropout, as in forward (its mask is regenerated, not stored).
    """
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    fused = None if drop is not None else _fused(q, v, pad, diag)
    if drop is not None:
        dq, dk, dv = _math_backward(dout, q, ke, ve, out, lse, _additive(pad, q.dtype), scale, diag, drop)
    elif fused is not None:
        dq, dk, dv = fused[1](dout, q, ke, ve, out, lse, pad, scale, diag)
    elif _use_cpu_flash(q, v):
        dq, dk, dv = _cpu_backward(dout, q, ke, ve, out, lse, pad, scale, diag)
    else:
        dq, dk, dv = _math_backward(dout, q, ke, ve, out, lse, _additive(pad, q.dtype), scale, diag)
    return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


def merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Log-sum-exp merge of a block result into the running ``(out, lse)``, in place.

    ``out_b`` is a fresh block result and is overwritten.
    """
    new = torch.logaddexp(lse_acc, lse_b)
    # Rows that have seen no visible key yet keep lse = -inf; exp(-inf - -inf) would be NaN.
    safe = torch.where(torch.isinf(new), 0.0, new)
    w_old = torch.exp(lse_acc - safe)[..., None]
    w_new = torch.exp(lse_b - safe)[..., None]
    out_acc.mul_(w_old).add_(out_b.mul_(w_new))
    lse_acc.copy_(new)
