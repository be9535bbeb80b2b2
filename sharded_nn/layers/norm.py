"""Sharded normalization: GroupNorm, InstanceNorm1/2/3d, BatchNorm1/2/3d and LayerNorm.

Sharding contract:
    input: ``(N, C, S0, S1, ...)`` sharded along ``dims`` (default: the first spatial dims, one
        per domain axis), any slab sizes (uneven slabs are exact: counts are summed, not
        assumed). Output: same shape and layout as the input.
    statistics: numerically stable, never ``E[x^2] - E[x]^2``. BatchNorm and GroupNorm
        (``merged_moments``): each rank's count, mean and squared deviations from its own mean
        in one all-gather, merged with Chan's formula; forward and backward on torch's
        batch-norm kernels for float32/float64, one all-reduce of gradient sums in backward.
        InstanceNorm and LayerNorm (``global_moments``): two passes, the sums with the count,
        then the squared deviations from the global mean.
        GroupNorm, InstanceNorm and LayerNorm reduce over the domain ranks; BatchNorm reduces
        over the domain ranks *and* the data ranks when the mesh has a ``"data"`` axis, so its
        statistics are those of the global batch (what ``nn.SyncBatchNorm`` computes).
    backward: through ``comm.all_reduce_sum`` (gradient convention): input gradients are exact,
        weight and bias gradients are partial sums over the domain ranks (``parallelize`` sums
        them).
    running statistics (BatchNorm, InstanceNorm with ``track_running_stats``): updated from
        the global statistics exactly as the single-device layer does (unbiased variance over
        the global count, ``momentum``, ``num_batches_tracked``, ``momentum=None`` cumulative
        average; InstanceNorm's per-instance statistics averaged over the global batch, the
        other data replicas' samples included), so they are identical on every rank. Eval mode
        with running statistics is local: no communication; BatchNorm then makes no agreement
        either (it is pointwise, as torch's kernel computes it).

Every layer starts with ``agree`` (a few integers: shapes, dtype), so a malformed input raises
the same error on every rank before any statistic is exchanged.

Memory layouts: torch 2.14's CPU batch-norm backward (training and eval, and the reduction pass
of ``native_batch_norm_backward``) returns wrong gradients when its input and output gradient
have different strides and one of them is not a standard layout (e.g. channels-last with a batch
of one whose batch stride is not the sample size). ``F.instance_norm`` runs batch norm on a
``(1, N*C, ...)`` view, so it meets this for a gradient in ``(H, W, N, C)`` order, which
``x.flatten(2).transpose(1, 2)`` into ``nn.MultiheadAttention(batch_first=True)`` hands back.
The layers here give torch's kernels matching layouts (``matched_layouts``, and on their P=1
torch paths ``grad_in_layout_of``), so they stay exact where the plain torch layer is not
(``tests/test_norm_grad_layouts.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..comm import all_reduce_sum
from ..comm.collectives import all_gather_stacked
from ..comm.halo import memory_format_of
from ..comm.pending import all_reduce_sum_start
from ..compile_boundary import eager_under_compile
from ..errors import ShardingError
from ..mesh import axis_index, axis_size, data_axis, default_dims, group_over, mesh_cached
from ..moments import (
    bn_backward_applies,
    bn_grad_sums,
    bn_input_grad,
    local_moments,
    merge_packed,
    packed_local_moments,
    row_affine2,
    row_affine2_applies,
)
from ..registry import register
from .base import MAX_NDIM, Agreement, ShardedMixin, batched


def _standard_strides(shape: Sequence[int], channels_last: bool) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` (or its channels-last form) has."""
    order = (0, *range(2, len(shape)), 1) if channels_last else tuple(range(len(shape)))
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def _is_standard(t: torch.Tensor) -> bool:
    s = t.stride()
    return s == _standard_strides(t.shape, False) or (t.dim() in (4, 5) and s == _standard_strides(t.shape, True))


def standard_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its strides are neither the standard contiguous nor the
    standard channels-last ones (a permuted, sliced or oddly strided batch-of-one tensor)."""
    return t if _is_standard(t) else t.clone(memory_format=torch.contiguous_format)


def matched_layouts(g: torch.Tensor, x: torch.Tensor, *, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, x)`` laid out so that torch's CPU batch-norm backward reads them right (see the module
    docstring): unchanged when their strides are equal or (``exact=False``) both standard, which
    torch's kernels take in any mix; else ``x`` in a standard layout and ``g`` copied to its strides."""
    if g.stride() == x.stride() or (not exact and _is_standard(g) and _is_standard(x)):
        return g, x
    x = standard_layout(x)
    if g.stride() != x.stride():
        g = torch.empty_strided(x.shape, x.stride(), dtype=g.dtype, device=g.device).copy_(g)
    return g, x


def grad_in_layout_of(y: torch.Tensor, x: torch.Tensor, *, exact: bool) -> torch.Tensor:
    """``y`` (the output of torch's own norm on ``x``, which went through ``standard_layout``)
    with a hook that lays out the gradient reaching it as ``matched_layouts(g, x, exact=exact)``,
    so that torch's norm backward reads matching layouts (see the module docstring).
    ``exact=True`` for instance norm, which normalizes a contiguous ``(1, N*C, ...)`` view: a
    batch-of-one channels-last gradient viewed so is itself an odd layout."""
    if y.requires_grad:
        strides = x.stride()
        y.register_hook(lambda g: g if g.stride() == strides else matched_layouts(g, x, exact=exact)[0])
    return y


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics accumulate in: float32 for fp16/bf16 (as torch's norms), else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def global_moments(
    x: torch.Tensor, reduce_dims: Sequence[int], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean and biased variance of ``x`` over ``reduce_dims`` of every rank of ``group``.

    Two passes (sum and count, then squared deviations from the global mean), both through the
    autograd-aware ``all_reduce_sum``. ``group=None`` computes the local statistics. Sums,
    deviations and variances accumulate in ``acc_dtype(x.dtype)`` (float32 for fp16/bf16: a
    half-precision sum overflows or rounds, as torch's own norms avoid too); the sums travel
    with the count in float64, so the count stays exact however many elements it covers.

    Returns:
        ``(mean, var, count)``: mean and var (in ``acc_dtype``) keep the reduced dims (size 1);
        count is a 0-d float64 tensor, the global number of elements per statistic.
    """
    reduce_dims = tuple(reduce_dims)
    acc = acc_dtype(x.dtype)
    n_local = math.prod(x.shape[d] for d in reduce_dims)
    s = x.sum(reduce_dims, keepdim=True, dtype=acc)
    # The count travels with the sums: uneven slabs (and uneven data batches) need no assumption.
    reduce = (lambda t: t) if group is None else (lambda t: all_reduce_sum(t, group))
    packed = reduce(torch.cat([s.reshape(-1).double(), s.new_full((1,), float(n_local), dtype=torch.float64)]))
    count = packed[-1].detach()
    mean = (packed[:-1] / count).to(acc).reshape(s.shape)
    dev = x.to(acc) - mean
    var = reduce(dev.square().sum(reduce_dims, keepdim=True)) / count.to(acc)
    return mean, var, count


_MOMENT_BLOCK = 1 << 18  # elements per block of the second pass: 1 MiB of float32, cache-resident


def _blocked_moments(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-``K`` mean and (biased) variance of an ``(A, K, B)`` tensor over ``A`` and ``B``.

    The textbook two-pass form: the mean from one summing pass (torch's cascade sum, no
    temporary), then the squared deviations from it, block by block, so the deviation temporary
    stays in cache (at most ``_MOMENT_BLOCK`` elements) and the slab is read twice in all. On CPU
    this is 2-4x faster than ``batch_norm_update_stats`` (whose per-channel kernel made a sharded
    GroupNorm's statistics alone cost several times torch's whole fused ``group_norm``) and as
    stable: no ``E[x^2] - E[x]^2`` cancellation. No Chan merge is needed between blocks: every
    block subtracts the same, final mean.
    """
    native = local_moments(x3)
    if native is not None:
        # One read of the slab instead of two (sharded_nn/moments.py: contiguous float32/float64
        # on one CPU thread); the same statistics to rounding.
        return native
    a, k, b = x3.shape
    n = a * b
    mean = x3.sum((0, 2), keepdim=True) / n
    if n * k <= _MOMENT_BLOCK:
        # One block (the deep, small layers of a CNN): the loop below with a single iteration,
        # the same operations and values (0 + v == v), without its accumulators, slicing and
        # in-place adds: half the tiny torch calls, which dominate at this size (issue 16).
        dev = x3 - mean
        shift = dev.sum((0, 2), keepdim=True) / n
        m2 = dev.mul_(dev).sum((0, 2), keepdim=True)
        return (mean + shift).reshape(k), (m2 / n - shift * shift).clamp_min_(0).reshape(k)
    # The rounding of the first mean (a few ulps of |mean|) matters where |mean| >> std: the
    # deviations' own sum corrects it ("corrected two-pass", Chan, Golub & LeVeque 1983).
    s1 = torch.zeros_like(mean)
    m2 = torch.zeros_like(mean)
    if n <= _MOMENT_BLOCK:
        k_step, b_step = max(1, _MOMENT_BLOCK // n), b
    else:
        k_step, b_step = 1, max(1, _MOMENT_BLOCK // a)
    for k0 in range(0, k, k_step):
        ks = slice(k0, min(k, k0 + k_step))
        for b0 in range(0, b, b_step):
            dev = x3[:, ks, b0 : b0 + b_step] - mean[:, ks]
            s1[:, ks] += dev.sum((0, 2), keepdim=True)
            m2[:, ks] += dev.mul_(dev).sum((0, 2), keepdim=True)
    shift = s1 / n
    return (mean + shift).reshape(k), (m2 / n - shift * shift).clamp_min_(0).reshape(k)


def merged_moments(
    x: torch.Tensor,
    reduce_dims: Sequence[int],
    group: dist.ProcessGroup | None,
    running: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``global_moments`` in one collective and without autograd (for fused autograd Functions).

    Each rank computes the mean and the sum of squared deviations from its *own* mean (two-pass,
    ``_blocked_moments``, or torch's stable ``var_mean`` for other reductions); one all-gather exchanges ``(count, mean, M2)`` of every
    rank, and every rank combines them with Chan's pairwise formula
    ``M2 = sum_r M2_r + n_r * (mean_r - mean)^2`` in float64. As stable as the two-pass form (no
    ``E[x^2] - E[x]^2``: every term is a sum of squares of deviations), with one collective per
    layer instead of two. Empty slabs contribute ``n_r = 0``. Where the native kernels apply
    (``sharded_nn/moments.py``) the merge is one native call: a deep CNN stage's statistics are a
    few hundred numbers, where each of the dozen tiny torch calls of the merge cost more than the
    arithmetic (about 0.15 ms per BatchNorm on a 2-vCPU host).

    ``running``: ``(running_mean, running_var, momentum)`` of a batch norm, updated in place as
    torch's batch norm updates them (the unbiased variance) when the global count exceeds 1.

    Returns:
        ``(mean, var, count)`` as ``global_moments`` returns them, detached.
    """
    reduce_dims = tuple(reduce_dims)
    acc = acc_dtype(x.dtype)
    with torch.no_grad():
        n_local = math.prod(x.shape[d] for d in reduce_dims)
        keep = [1 if d in reduce_dims else x.shape[d] for d in range(x.dim())]
        packed = None
        rows = _as_rows(x, reduce_dims) if group is not None and n_local and x.is_contiguous() else None
        if rows is not None:
            # The message straight from the native kernel (float64, no torch call in between).
            packed = packed_local_moments(rows)
        if packed is None:
            mean_l, var_l = _local_moments(x, reduce_dims, n_local, keep, acc)
            if group is None:
                _update_running(running, mean_l, var_l, float(n_local))
                return mean_l, var_l, torch.tensor(float(n_local), dtype=torch.float64)
            packed = torch.cat(
                [
                    mean_l.new_full((1,), float(n_local), dtype=torch.float64),
                    mean_l.reshape(-1).double(),
                    (var_l.reshape(-1).double() * n_local),
                ]
            )
        rows = all_gather_stacked(packed, group)  # (ranks, 1 + 2k)
        merged = merge_packed(rows, acc, running)
        if merged is not None:
            mean, var, n = merged
            return mean.view(keep), var.view(keep), torch.tensor(n, dtype=torch.float64)
        k = (packed.numel() - 1) // 2
        counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + k], rows[:, 1 + k :]
        count = counts.sum()
        mean = (counts * means).sum(0) / count
        m2 = m2s.addcmul(counts, (means - mean).square_()).sum(0)
        var = m2 / count
        mean, var = mean.to(acc), var.to(acc)
        if running is not None:
            # The layer reads the count too: read it once (a device sync on GPUs) and hand it back
            # as a CPU number.
            n = count.item()
            _update_running(running, mean, var, n)
            count = torch.tensor(n, dtype=torch.float64)
        return mean.reshape(keep), var.reshape(keep), count


def _update_running(running: tuple[torch.Tensor, torch.Tensor, float] | None, mean, var, n: float) -> None:
    """A batch norm's running-statistics update (torch's formula) from the global ``mean``/``var``."""
    if running is None or n <= 1:
        return  # (with one value per channel the layer raises)
    rm, rv, factor = running
    rm.mul_(1 - factor).add_(mean.reshape(-1), alpha=factor)
    rv.mul_(1 - factor).add_(var.reshape(-1) * (n / (n - 1)), alpha=factor)


def _as_rows(x: torch.Tensor, reduce_dims: tuple[int, ...]) -> torch.Tensor | None:
    """An ``(A, K, B)`` view of ``x`` whose ``K`` are the statistics, or None for other reductions:
    per channel (BatchNorm's, reduced over N and the spatial dims) or over the last dim
    (GroupNorm's ``(N, G, -1)`` view: rows of a ``(1, N*G, M)`` view)."""
    if reduce_dims == (0, *range(2, x.dim())):
        return x.reshape(x.shape[0], x.shape[1], -1)
    if reduce_dims == (x.dim() - 1,):
        return x.reshape(1, -1, x.shape[-1])
    return None


def _local_moments(x: torch.Tensor, reduce_dims: tuple[int, ...], n_local: int, keep: list[int], acc: torch.dtype):
    """This slab's mean and biased variance over ``reduce_dims`` (in ``acc``, keeping the dims)."""
    if n_local and x.dtype in (torch.float32, torch.float64):
        if not x.is_contiguous() and reduce_dims == (0, *range(2, x.dim())):
            # Per-channel statistics of channels_last and other layouts: torch's batch-norm
            # statistics kernel reads them in place (a reshape would copy the slab).
            mean_l, var_l = torch.ops.aten.batch_norm_update_stats(x, None, None, 0.0)
            return mean_l.reshape(keep), var_l.reshape(keep)
        rows = _as_rows(x, reduce_dims)
        if rows is not None:
            mean_l, var_l = _blocked_moments(rows)
            return mean_l.reshape(keep), var_l.reshape(keep)
    if n_local:
        var_l, mean_l = torch.var_mean(x.to(acc), reduce_dims, correction=0, keepdim=True)
        return mean_l, var_l
    zeros = x.new_zeros(keep, dtype=acc)
    return zeros, zeros


def _opmath(x: torch.Tensor) -> torch.Tensor:
    """``x`` in ``acc_dtype``: one cast, so that every use of the input (statistics and the
    normalization) sums its gradient in float32 and the gradient is rounded to x's dtype once.
    Separate casts would round each large, mutually cancelling gradient term on its own."""
    return x.to(acc_dtype(x.dtype))


def _out_dtype(x: torch.Tensor, op: str) -> torch.dtype:
    """The dtype torch's own norm returns for ``x``: its dtype, but float32 under CUDA autocast
    for ``group_norm`` and ``layer_norm`` (CUDA autocast runs them in float32; CPU autocast leaves
    norms alone)."""
    if op in ("group_norm", "layer_norm") and x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return x.dtype


def _channel_view(p: torch.Tensor | None, ndim: int) -> torch.Tensor | None:
    """A per-channel parameter shaped to broadcast against ``(N, C, ...)``."""
    return None if p is None else p.reshape(1, -1, *([1] * (ndim - 2)))


def _affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _unbiased(var: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return var * (count / (count - 1))


class _ShardedNorm(ShardedMixin):
    """Shared pieces: keyword-only mesh options, the sharded-dims check, the reduction group."""

    # Empty slabs (a deep stage that left a rank without rows) add nothing to the statistics;
    # the global count is summed, so they are exact.
    _allow_empty = True
    _scoped_agree = True  # the output keeps the input's layout

    def _check_channels(self, x: torch.Tensor, expected: int, agreed: Agreement, dims: Sequence[int]) -> None:
        # Dim 1 is unsharded, so after the agreement it is the same on every rank.
        if x.shape[1] != expected:
            raise ShardingError(
                f"{type(self).__name__}: expected {expected} channels (dim 1), got global input shape "
                f"{agreed.global_shape(dims)}."
            )

    def _domain_group(self) -> dist.ProcessGroup:
        return group_over(self.mesh, self.mesh_axes)


# --------------------------------------------------------------------------------------------
# GroupNorm


@register(nn.GroupNorm)
class ShardedGroupNorm(_ShardedNorm, nn.GroupNorm):
    """``nn.GroupNorm`` on ``(N, C, S0, ...)`` sharded along spatial dims; see the module docstring."""

    _spatial_dims = 8  # GroupNorm takes any number of spatial dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.forward_with(x, self.weight, self.bias)

    def forward_with(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's forward with the given affine ``weight`` and ``bias`` (either may be None)
        in place of its own: what ``group_norm`` (the functional form) runs."""
        if self._local_only:
            # P=1: torch's group norm itself (every statistic is local).
            return F.group_norm(x, self.num_groups, weight, bias, self.eps)
        agreed = self._agree(x, ndims=range(2, MAX_NDIM + 1), expected="an (N, C, ...)")
        self._check_channels(x, self.num_channels, agreed, self.dims)
        fmt = memory_format_of(x)
        if fmt != torch.contiguous_format:
            # The statistics and the fused kernel read (N, G, -1) views: one contiguous copy
            # here instead of one per reshape, and the output in the input's format, as
            # torch's own group_norm gives it (the next layer then runs the same kernel as on
            # one device). In training the copy is what backward keeps.
            x = x.contiguous()
        y = _GroupNormFn.apply(
            x, weight, bias, self.num_groups, self.eps, self._domain_group(), _out_dtype(x, "group_norm")
        )
        return y if fmt == torch.contiguous_format else y.contiguous(memory_format=fmt)


@eager_under_compile
def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """``F.group_norm(x_full, num_groups, weight, bias, eps)`` on this rank's slab.

    The functional form of ``ShardedGroupNorm`` (same sharding contract: ``(N, C, S0, ...)``
    sharded along ``dims``, default the first spatial dims; statistics over the whole sample,
    exact input gradient, ``weight``/``bias`` gradients partial sums over the domain ranks). For
    group norms a model writes as ``F.group_norm`` in its own ``forward`` (timm's ``GroupNorm1``
    subclasses such as MetaFormer's ``GroupNorm1NoBias``): the forward guard routes such calls
    here. One parameter-free layer is kept per mesh and configuration.
    """
    if x.dim() < 3:
        raise ShardingError(
            f"sharded_nn.functional.group_norm: expected an (N, C, S0, ...) input with a spatial dim to shard, got "
            f"local shape {tuple(x.shape)}."
        )
    channels = x.shape[1]  # dim 1 is never sharded: the same on every rank
    dims_key = dims if dims is None or isinstance(dims, int) else tuple(dims)
    key = ("functional_group_norm", int(num_groups), int(channels), float(eps), dims_key)

    def make() -> ShardedGroupNorm:
        return ShardedGroupNorm(num_groups, channels, eps=eps, affine=False, mesh=mesh, dims=dims)

    return mesh_cached(mesh, key, make).forward_with(x, weight, bias)


class _GroupNormFn(torch.autograd.Function):
    """Group normalization over slabs that keeps only its input and the statistics for backward.

    Written with elementwise autograd ops, the layer kept three slab-sized tensors for backward
    (``x - mean``, the normalized input and its scaled copy) where torch's fused ``group_norm``
    keeps one, its input: a UNet's fwd+bwd peak at P=2 was 0.8x of P=1 instead of 0.5x. The
    backward recomputes the normalized input from the saved input and the (small) statistics and
    needs one all-reduce of two per-group sums:
    ``dx = rstd * (g - sum(g) / n - xhat * sum(g * xhat) / n)`` with ``g = dy * weight`` and the
    sums over the whole group on every rank. Statistics and gradients accumulate in
    ``acc_dtype`` and are rounded once. With ``create_graph`` (double backward) the statistics are
    recomputed with autograd-aware ops, so second derivatives stay exact.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, num_groups, eps, group, out_dtype):  # noqa: D102
        xg = _opmath(x).reshape(x.shape[0], num_groups, -1)
        mean, var, count = merged_moments(xg, (2,), group)
        rstd = torch.rsqrt(var + eps)
        if _fusable(x):
            # Each (sample, channel) is a batch-norm channel of a (1, N*C, -1) view with its
            # group's statistics: torch's inference batch-norm kernel applies
            # (x - mean) * rstd * weight + bias in one pass.
            n, c = x.shape[:2]
            m_nc, v_nc = _per_channel(mean, c), _per_channel(var, c)
            w_nc = None if weight is None else weight.repeat(n)
            b_nc = None if bias is None else bias.repeat(n)
            y = F.batch_norm(x.reshape(1, n * c, -1), m_nc, v_nc, w_nc, b_nc, False, 0.0, eps)
            # Not a view of the kernel's output: a Function's output that is a view cannot be
            # modified in place (timm's in-place activations after the norm).
            y = torch.ops.aten._unsafe_view(y, x.shape).to(out_dtype)
        else:
            y = ((xg - mean) * rstd).reshape(x.shape)
            y = _affine(y, _channel_view(weight, x.dim()), _channel_view(bias, x.dim())).to(out_dtype)
        ctx.var = var
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.num_groups, ctx.eps, ctx.group, ctx.count = num_groups, eps, group, count
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: D102
        x, weight, bias, mean, rstd = ctx.saved_tensors
        n, groups = x.shape[0], ctx.num_groups
        xa = _opmath(x)
        if torch.is_grad_enabled():
            # create_graph: statistics that depend on x through recorded ops.
            mean, var, _ = global_moments(xa.reshape(n, groups, -1), (2,), ctx.group)
            rstd = torch.rsqrt(var + ctx.eps)
        elif _fusable(x):
            return _group_norm_backward_fused(ctx, gy, x, weight, bias, mean, rstd)
        acc = mean.dtype
        xhat = (xa.reshape(n, groups, -1) - mean) * rstd
        gya = gy.to(acc)
        gw = gya * _channel_view(weight, x.dim()).to(acc) if weight is not None else gya
        gw = gw.reshape(n, groups, -1)
        sums = torch.stack([gw.sum(2), (gw * xhat).sum(2)])
        if ctx.group is not None:
            sums = all_reduce_sum(sums, ctx.group)
        count = ctx.count.to(acc)
        dx = rstd * (gw - sums[0].unsqueeze(-1) / count - xhat * (sums[1].unsqueeze(-1) / count))
        dx = dx.reshape(x.shape).to(x.dtype)
        reduce_dims = (0, *range(2, x.dim()))
        dw = db = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = (gya * xhat.reshape(x.shape)).sum(reduce_dims).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = gya.sum(reduce_dims).to(bias.dtype)
        return dx, dw, db, None, None, None, None


#: The aten namespace, looked up through this name so that tests can check the kernels' contract.
_aten = torch.ops.aten


def _grad_sums(g, x, weight, mean, var, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``sum(g * xhat)`` and ``sum(g)`` of ``(N, C, ...)`` tensors with the given
    statistics, from torch's inference-form batch-norm backward kernel (its reduction pass only).

    The saved statistics go in as empty tensors, not None: the CUDA kernel asserts that
    ``save_mean`` is defined and takes the running statistics when it is empty (cuDNN's eval path
    calls it so); the CPU kernel reads neither when ``train`` is False. With None every sharded
    GroupNorm and BatchNorm backward raised torch's internal assert on CUDA (found on an H200 in
    session 40).

    The per-channel vectors go in contiguous: torch 2.14's CPU kernel reads them as dense arrays
    on its path for one position per channel (``(1, C, 1)``: a GroupNorm of one group on a slab
    of one row and column), so a stride-0 ``expand`` of a group's statistic gave garbage
    gradients (found by tests/test_fuzz_unet.py on MONAI's BasicUNet).
    """
    unsaved = x.new_empty(0)
    weight, mean, var = (None if t is None else t.contiguous() for t in (weight, mean, var))
    _, s_gx, s_g = _aten.native_batch_norm_backward(
        g, x, weight, mean, var, unsaved, unsaved, False, eps, [False, True, True]
    )
    return s_gx, s_g


def _fusable(x: torch.Tensor) -> bool:
    """Whether torch's CPU/CUDA batch-norm kernels can take ``x`` with statistics of its dtype
    (float32/float64, not empty); fp16/bf16 keep the elementwise forms, which accumulate in float32."""
    return x.dtype in (torch.float32, torch.float64) and x.numel() > 0


def _per_channel(stat: torch.Tensor, channels: int) -> torch.Tensor:
    """A per-(sample, group) statistic ``(N, G, 1)`` repeated for each channel of its group: ``(N*C,)``."""
    n, g = stat.shape[:2]
    # Contiguous: the reshape stays a stride-0 view for one (sample, group), which torch's kernels
    # misread on some paths (see _grad_sums).
    return stat.reshape(n, g, 1).expand(n, g, channels // g).reshape(-1).contiguous()


def _group_norm_backward_fused(ctx, gy, x, weight, bias, mean, rstd):
    """``_GroupNormFn.backward`` on torch's inference batch-norm backward kernel (see its docstring).

    The kernel's reduction pass gives, per (sample, channel), ``sum(g)`` and ``sum(g * xhat)``;
    the group sums of ``weight * sum(g)`` and ``weight * sum(g * xhat)`` are all-reduced, and
    ``dx = (weight * rstd) * g + a * x + b`` with per-(sample, channel) ``a`` and ``b``. Where the
    native kernel applies (``sharded_nn/moments.py``, one torch thread on CPU) that is one pass
    over the slab; otherwise ``g * weight * rstd`` is computed while the sums travel, then an
    ``addcmul_`` and an ``add_``.
    """
    n, c = x.shape[:2]
    groups, eps = ctx.num_groups, ctx.eps
    xf = x.reshape(1, n * c, -1)
    w_nc = weight.repeat(n) if weight is not None else torch.ones(n * c, dtype=x.dtype, device=x.device)
    m_nc, v_nc = _per_channel(mean, c), _per_channel(ctx.var, c)
    gf = gy.reshape(1, n * c, -1)
    # The sums first (a reduction pass), so that their all-reduce is in flight while the local
    # part of dx, g * weight * rstd, is computed (as in _BatchNormFn.backward).
    s_gx, s_g = _grad_sums(gf, xf, w_nc, m_nc, v_nc, eps)
    pending = all_reduce_sum_start(
        torch.stack([(w_nc * s_g).reshape(n, groups, -1).sum(2), (w_nc * s_gx).reshape(n, groups, -1).sum(2)]),
        ctx.group,
    )
    scale = w_nc * _per_channel(rstd, c)
    g2, x2 = gf.reshape(n * c, -1), xf.reshape(n * c, -1)
    one_pass = row_affine2_applies(g2, x2)
    dx = None if one_pass else gf * scale.reshape(1, -1, 1)  # while the sums travel
    sums = pending.wait()
    count = ctx.count.to(x.dtype)
    r = rstd.reshape(n, groups)
    a = -r * r * sums[1] / count
    b = -r * sums[0] / count - a * mean.reshape(n, groups)
    a_nc, b_nc = _per_channel(a, c), _per_channel(b, c)
    if one_pass:
        dx = row_affine2(g2, x2, scale, a_nc, b_nc).reshape(x.shape)
    else:
        dx = dx.addcmul_(xf, a_nc.reshape(1, -1, 1)).add_(b_nc.reshape(1, -1, 1)).reshape(x.shape)
    dw = s_gx.reshape(n, c).sum(0) if weight is not None and ctx.needs_input_grad[1] else None
    db = s_g.reshape(n, c).sum(0) if bias is not None and ctx.needs_input_grad[2] else None
    return dx, dw, db, None, None, None, None


# --------------------------------------------------------------------------------------------
# InstanceNorm


class _ShardedInstanceNorm(_ShardedNorm):
    def _replica_group(self) -> dist.ProcessGroup | None:
        """The data replicas, where the mesh has several: their samples make one global batch,
        whose per-instance statistics the running statistics average (as one device would on
        the whole batch), identical on every rank. None without a data axis of several ranks."""
        mesh, data = self.mesh, data_axis(self.mesh)
        if data is None or axis_size(mesh, data) == 1:
            return None
        return mesh_cached(mesh, ("instance_norm_replicas",), lambda: group_over(mesh, (data,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        updates = self.training and self.running_mean is not None and self.momentum is not None
        if self._local_only and not (updates and self._replica_group() is not None):
            # P=1: torch's instance norm itself (every statistic is local; unbatched input too),
            # given matching layouts (module docstring): torch normalizes a contiguous copy.
            x = standard_layout(x.contiguous())
            return grad_in_layout_of(nn.modules.instancenorm._InstanceNorm.forward(self, x), x, exact=True)
        return self._sharded_forward(x)

    @batched
    def _sharded_forward(self, x: torch.Tensor) -> torch.Tensor:
        agreed = self._agree(x)
        if self.affine or self.track_running_stats:  # per-channel parameters or statistics
            self._check_channels(x, self.num_features, agreed, self.dims)
        # torch's instance_norm returns a contiguous (NCHW) tensor whatever the input's memory
        # format: compute on a contiguous slab, so that every result below is laid out so.
        x = x.contiguous()
        use_input_stats = self.training or not self.track_running_stats
        w, b = _channel_view(self.weight, x.dim()), _channel_view(self.bias, x.dim())
        if not use_input_stats:
            # Running statistics are replicated: eval mode is local.
            rm, rv = _channel_view(self.running_mean, x.dim()), _channel_view(self.running_var, x.dim())
            return _affine((_opmath(x) - rm) * torch.rsqrt(rv + self.eps), w, b).to(x.dtype)
        xf = _opmath(x)
        mean, var, count = global_moments(xf, tuple(range(2, x.dim())), self._domain_group())
        if self.training and self.running_mean is not None and self.momentum is not None:
            # torch's instance_norm averages the per-instance statistics over the batch: here the
            # global batch, this replica's samples and the other data replicas' (equal counts,
            # ``batch_slice``); before session 59 each replica kept its own average, so the
            # replicas' running statistics drifted apart (found by tests/test_fuzz_data_axis.py).
            with torch.no_grad():
                stats = torch.stack([mean.reshape(x.shape[0], -1).sum(0),
                                     _unbiased(var, count).reshape(x.shape[0], -1).sum(0)])  # fmt: skip
                group, samples = self._replica_group(), x.shape[0]
                if group is not None:
                    stats = all_reduce_sum(stats, group)
                    samples *= group.size()
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(stats[0] / samples, alpha=m)
                self.running_var.mul_(1 - m).add_(stats[1] / samples, alpha=m)
        return _affine((xf - mean) * torch.rsqrt(var + self.eps), w, b).to(x.dtype)


@register(nn.InstanceNorm1d)
class ShardedInstanceNorm1d(_ShardedInstanceNorm, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` on ``(N, C, L)`` sharded along L."""

    _spatial_dims = 1


@register(nn.InstanceNorm2d)
class ShardedInstanceNorm2d(_ShardedInstanceNorm, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` on ``(N, C, H, W)`` sharded along H (and W)."""

    _spatial_dims = 2


@register(nn.InstanceNorm3d)
class ShardedInstanceNorm3d(_ShardedInstanceNorm, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` on ``(N, C, D, H, W)`` sharded along D (and H, W)."""

    _spatial_dims = 3


# --------------------------------------------------------------------------------------------
# BatchNorm


class _ShardedBatchNorm(_ShardedNorm):
    _allowed_ndims: tuple[int, ...] = ()

    def _stats_group(self, dims: tuple[int, ...]) -> dist.ProcessGroup | None:
        """Domain ranks sharding ``dims`` and data ranks: the statistics of the global batch."""
        mesh, sharding = self.mesh, self.mesh_axes[: len(dims)]

        def make() -> dist.ProcessGroup | None:
            wanted = set(sharding) | ({data_axis(mesh)} - {None})
            axes = tuple(a for a in mesh.mesh_dim_names if a in wanted)
            # No axis: the input is replicated over the domain ranks (e.g. (N, C) after a global
            # pool) and there is no data axis, so the local statistics are the global ones.
            return group_over(mesh, axes) if axes else None

        # Kept per mesh (not on the module, which must stay deep-copyable): the mesh lookups
        # cost more than a small layer's arithmetic.
        return mesh_cached(mesh, ("batch_norm_stats_group", sharding), make)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        # (The same signature as the base's: convert reads it to pass its ``dims=`` default.)
        super()._init_sharding(mesh, dims)
        # Whether this rank's statistics are the global ones: one rank on every axis they span
        # (the domain axes and the data axis). A fact of the mesh, like ``_local_only``.
        data = data_axis(mesh)
        self._stats_local = self._local_only and (data is None or axis_size(mesh, data) == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if not self.training and self.running_mean is not None and self.running_var is not None:
            # Eval with running statistics: a per-channel affine map, pointwise like an
            # activation, so no agreement and no communication (a decision on module state,
            # the same on every rank): torch's own kernel, exactly what one device computes.
            return self._eval_forward(x)
        if self._stats_local:
            # One rank along the domain and data axes (P=1): torch's batch norm itself, its
            # statistics and running-stat updates, at torch's cost (a decision on the mesh, the
            # same on every rank). Named explicitly: in a subclass of a timm norm+act layer the
            # next ``forward`` in the MRO is timm's, which would apply the activation twice.
            # Given matching layouts (module docstring).
            x = standard_layout(x)
            return grad_in_layout_of(nn.modules.batchnorm._BatchNorm.forward(self, x), x, exact=False)
        name = type(self).__name__
        # (N, C) input to BatchNorm1d has no spatial dim: nothing is sharded, shapes still agree.
        # (Computed from the local number of dims: ``agree`` checks first that all ranks share it.)
        dims = tuple(d for d in self.dims if d < x.dim())
        expected = " or ".join(f"{d}-d" for d in self._allowed_ndims)
        agreed = self._agree(x, dims=dims, ndims=self._allowed_ndims, expected=f"a {expected}")
        self._check_channels(x, self.num_features, agreed, dims)

        # Mirrors torch's _BatchNorm.forward.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not batch_stats:
            w, b = _channel_view(self.weight, x.dim()), _channel_view(self.bias, x.dim())
            rm, rv = _channel_view(self.running_mean, x.dim()), _channel_view(self.running_var, x.dim())
            return _affine((_opmath(x) - rm) * torch.rsqrt(rv + self.eps), w, b).to(x.dtype)

        reduce_dims = (0, *range(2, x.dim()))
        group = self._stats_group(dims)
        # float32/float64: torch's fused kernels with the global statistics, one collective in
        # forward and one in backward (_BatchNormFn). fp16/bf16 keep the elementwise form, which
        # accumulates in float32 (torch's CPU kernels do not take fp32 statistics for them).
        fused = x.dtype in (torch.float32, torch.float64)
        update = self.training and self.running_mean is not None
        if fused:
            xf = x
            # The running statistics are updated with the merge (one native call where it applies).
            running = (self.running_mean, self.running_var, factor) if update else None
            mean, var, count = merged_moments(x, reduce_dims, group, running)
        else:
            xf = _opmath(x)
            mean, var, count = global_moments(xf, reduce_dims, group)
        n = count.item()
        if n <= 1:
            # count is all-reduced, so every rank raises together (torch raises ValueError too).
            raise ShardingError(
                f"{name}: expected more than 1 value per channel when training over the whole "
                f"(global) batch, got {int(n)} (global input shape {agreed.global_shape(dims)})."
            )
        mean, var = mean.reshape(-1), var.reshape(-1)
        if update and not fused:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(var * (n / (n - 1)), alpha=factor)
        if fused:
            return _BatchNormFn.apply(x, self.weight, self.bias, mean, var, n, self.eps, group)
        shape = (1, -1, *([1] * (x.dim() - 2)))
        w, b = _channel_view(self.weight, x.dim()), _channel_view(self.bias, x.dim())
        return _affine((xf - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps), w, b).to(x.dtype)

    def _eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() not in self._allowed_ndims or x.shape[1] != self.num_features:
            # Checked here with the layer's name (torch's messages name none); the number of dims
            # and the channels are unsharded facts, so a bad input raises on every rank.
            expected = " or ".join(f"{d}-d" for d in self._allowed_ndims)
            raise ShardingError(
                f"{type(self).__name__}: expected a {expected} input with {self.num_features} channels (dim 1), "
                f"got local shape {tuple(x.shape)}."
            )
        x = standard_layout(x)  # with the hook below: matching layouts (module docstring)
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return grad_in_layout_of(y, x, exact=False)


class _BatchNormFn(torch.autograd.Function):
    """Batch normalization with given global statistics, on torch's fused kernels.

    Written with elementwise autograd ops, the layer ran about ten elementwise kernels forward
    and backward per BatchNorm (subtract, multiply, square, negate, their backwards) and two
    all-reduces each way: at P=2 a timm CNN's fwd+bwd spent more in BatchNorm than in its
    convolutions. Here the forward is ``F.batch_norm`` in inference form with the global
    ``mean``/``var`` (``merged_moments``: one all-gather); the backward is torch's inference
    backward kernel's reduction pass, which yields the per-channel sums ``sum(g)`` and
    ``sum(g * xhat)``, one all-reduce of those two sums, started without blocking so that it is
    in flight while the local ``g * weight * rstd`` is computed, and the global correction
    ``dx -= weight * rstd * (sum(g) + xhat * sum(g * xhat)) / count``. Weight and bias gradients
    are this rank's partial sums (gradient convention). Saves only the input. With
    ``create_graph`` (double backward) the backward recomputes the statistics with
    autograd-aware ops, so second derivatives stay exact.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, count, eps, group):  # noqa: D102
        ctx.save_for_backward(x, weight, mean, var)
        ctx.count, ctx.eps, ctx.group, ctx.has_bias = count, eps, group, bias is not None
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, weight, mean, var = ctx.saved_tensors
        eps, group = ctx.eps, ctx.group
        reduce_dims = (0, *range(2, x.dim()))
        shape = (1, -1, *([1] * (x.dim() - 2)))
        count = ctx.count  # a Python float: the global number of values per channel
        if torch.is_grad_enabled() or x.numel() == 0:
            # create_graph (or an empty slab): the same formula from differentiable ops, with
            # statistics that depend on x through recorded ops.
            if torch.is_grad_enabled():
                m, v, _ = global_moments(x, reduce_dims, group)
            else:
                m, v = mean.reshape(shape), var.reshape(shape)
            rstd = torch.rsqrt(v + eps)
            xhat = (x - m) * rstd
            gw = g * weight.reshape(shape) if weight is not None else g
            sums = torch.stack([gw.sum(reduce_dims), (gw * xhat).sum(reduce_dims)])
            if group is not None:
                sums = all_reduce_sum(sums, group)
            dx = rstd * (gw - sums[0].reshape(shape) / count - xhat * (sums[1].reshape(shape) / count))
            dw = (g * xhat).sum(reduce_dims) if weight is not None and ctx.needs_input_grad[1] else None
            db = g.sum(reduce_dims) if ctx.has_bias and ctx.needs_input_grad[2] else None
            return dx, dw, db, None, None, None, None, None
        g, x = matched_layouts(g, x)  # torch's kernels misread some mixed layouts (module docstring)
        native = _batch_norm_backward_native(ctx, g, x, weight, mean, var)
        if native is not None:
            return native
        w = weight if weight is not None else torch.ones_like(mean)
        # The per-channel sums sum(g * xhat) and sum(g) first (one reduction pass, torch's
        # inference-form kernel), so that their all-reduce is in flight while this rank computes
        # the local part of dx, g * w * rstd: the round trip overlaps a pass over the slab
        # instead of following it.
        s_gx, s_g = _grad_sums(g, x, w, mean, var, eps)
        pending = all_reduce_sum_start(torch.stack([s_g, s_gx]), group)
        dw = s_gx if weight is not None and ctx.needs_input_grad[1] else None
        db = s_g if ctx.has_bias and ctx.needs_input_grad[2] else None
        rstd = torch.rsqrt(var + eps)
        wr = w * rstd
        dx = g * wr.reshape(shape)
        sums = pending.wait()
        # dx -= w * rstd * (S_g + xhat * S_gx) / count, xhat = (x - mean) * rstd: a per-channel
        # affine map of x, a * x + b. (-w) * rstd == -(w * rstd) exactly, so reusing w * rstd
        # saves tiny per-channel calls and changes no bit.
        nwr = -wr
        a = nwr * rstd * sums[1] / count
        b = nwr * sums[0] / count - a * mean
        dx.addcmul_(x, a.reshape(shape)).add_(b.reshape(shape))
        return dx, dw, db, None, None, None, None, None


def _batch_norm_backward_native(ctx, g, x, weight, mean, var):
    """``_BatchNormFn.backward`` on the native kernels (``sharded_nn/moments.py``), or None where
    they do not apply (the caller keeps torch's kernels).

    One pass for the per-channel sums ``sum(g)`` and ``sum(g * (x - mean))``, written straight
    into the float64 message that is all-reduced, and one pass for
    ``dx = w * rstd * g + a * x + b`` with per-channel coefficients from the global sums in double:
    two passes over the slab instead of four, and none of the dozen tiny per-channel torch calls
    that cost more than a deep layer's arithmetic. The weight and bias gradients are this rank's
    partial sums, as on the torch path.
    """
    if x.dim() < 2 or not x.is_contiguous() or not g.is_contiguous():
        return None
    x3, g3 = x.view(x.shape[0], x.shape[1], -1), g.view(x.shape[0], x.shape[1], -1)
    if not bn_backward_applies(g3, x3, weight, mean, var):
        return None  # (decided before anything is sent: the torch path sends the same message)
    local, dw, db = bn_grad_sums(
        g3, x3, mean, var, ctx.eps, weight is not None and ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    )
    pending = all_reduce_sum_start(local, ctx.group)
    dx = bn_input_grad(g3, x3, weight, mean, var, ctx.eps, pending.wait(), ctx.count)
    return dx.view(x.shape), dw, db, None, None, None, None, None


@register(nn.BatchNorm1d)
class ShardedBatchNorm1d(_ShardedBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` on ``(N, C, L)`` sharded along L, or ``(N, C)`` (nothing sharded)."""

    _spatial_dims = 1
    _allowed_ndims = (2, 3)


@register(nn.BatchNorm2d)
class ShardedBatchNorm2d(_ShardedBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` on ``(N, C, H, W)`` sharded along H (and W)."""

    _spatial_dims = 2
    _allowed_ndims = (4,)


@register(nn.BatchNorm3d)
class ShardedBatchNorm3d(_ShardedBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` on ``(N, C, D, H, W)`` sharded along D (and H, W)."""

    _spatial_dims = 3
    _allowed_ndims = (5,)


@register(nn.SyncBatchNorm)
class ShardedSyncBatchNorm(_ShardedBatchNorm, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` on ``(N, C, S...)`` (1-3 spatial dims, or ``(N, C)``) sharded along S.

    Sharding contract: the statistics of the whole global batch, over the domain ranks and the
    data replicas of the mesh: what ``SyncBatchNorm`` computes over its data-parallel process
    group, and what the ``ShardedBatchNorm*d`` compute already. Its ``process_group`` is not
    used (the mesh's groups are). Runs on CPU too (torch's own layer trains on GPUs only); in
    eval with running statistics it is torch's per-channel map. Same state_dict keys.
    """

    _spatial_dims = 3
    _allowed_ndims = (2, 3, 4, 5)


# --------------------------------------------------------------------------------------------
# LayerNorm


@register(nn.LayerNorm)
class ShardedLayerNorm(ShardedMixin, nn.LayerNorm):
    """``nn.LayerNorm`` whose ``normalized_shape`` may cover sharded dims.

    E.g. ``LayerNorm([C, H, W])`` on ``(N, C, H, W)`` sharded along H: the statistics are
    all-reduced over the domain axes that shard a normalized dim, and each rank applies its own
    slice of ``weight`` / ``bias`` (their gradients are partial sums, zero outside the slice).

    When no sharded dim lies among the normalized (trailing) dims, the layer is exactly
    ``nn.LayerNorm``: no communication at all. ``dims`` defaults to the first spatial dims (as
    for every grid layer) when ``normalized_shape`` has several dims, and to ``()`` (nothing
    sharded) when it has one: a one-dim LayerNorm normalizes channels (the last dim of tokens
    ``(B, L, C)`` or of channels-last grids), which ``convert`` treats as pointwise. Pass
    ``dims`` explicitly for token tensors (e.g. ``dims=(1,)`` for ``LayerNorm([L, C])``).
    """

    _scoped_agree = True  # the output keeps the input's layout

    def _default_dims(self, mesh: DeviceMesh) -> tuple[int, ...]:
        # Every domain axis's default dim: ``LayerNorm([C, H, W])`` on a 2x2 mesh normalises
        # over H and W, both sharded. (The grid layers' rule, which keeps no more dims than a
        # layer's spatial ones, gave it H only, and its input was refused before session 59.)
        return () if len(self.normalized_shape) == 1 else tuple(default_dims(mesh))

    def _check_dims(self, dims: tuple[int, ...], axes: tuple[str, ...]) -> None:
        if any(d < 1 for d in dims):
            raise ShardingError(
                f"{type(self).__name__}: dims={dims} must name at most {len(axes)} non-batch tensor dims (>= 1), "
                f"one per domain axis {axes}."
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if not self.dims or self._local_only:
            # Nothing sharded (the default for a channel LayerNorm), or P=1: plain torch.
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        name = type(self).__name__
        k = len(self.normalized_shape)
        # Agreed even when no sharded dim is normalized, so that whether this layer communicates
        # is decided on a shared fact (the number of dims), never on one rank's input alone.
        agreed = self._agree(x, ndims=range(max(k, max(self.dims) + 1), MAX_NDIM + 1), expected=(
            f"at least a {max(k, max(self.dims) + 1)}-d"
        ))
        layouts = agreed.layouts
        first = x.dim() - k
        global_shape = agreed.global_shape(self.dims)
        if tuple(global_shape[first:]) != tuple(self.normalized_shape):
            raise ShardingError(
                f"{name}: normalized_shape {tuple(self.normalized_shape)} must match the trailing dims "
                f"of the global input shape {tuple(global_shape)}."
            )
        covered = [(i, d) for i, d in enumerate(self.dims) if first <= d < x.dim()]
        if not covered:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        axes = [self.mesh_axes[i] for i, _ in covered]
        xf = _opmath(x)
        mean, var, _ = global_moments(xf, tuple(range(first, x.dim())), group_over(self.mesh, axes))
        y = (xf - mean) * torch.rsqrt(var + self.eps)
        w, b = self.weight, self.bias
        for i, d in covered:
            # This rank's slice of the elementwise affine parameters along the sharded dim.
            lay = layouts[i]
            start = lay.starts[axis_index(self.mesh, self.mesh_axes[i])]
            w = None if w is None else w.narrow(d - first, start, x.shape[d])
            b = None if b is None else b.narrow(d - first, start, x.shape[d])
        return _affine(y, w, b).to(_out_dtype(x, "layer_norm"))
