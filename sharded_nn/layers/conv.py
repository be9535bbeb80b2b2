"""Sharded convolutions: ``ShardedConv1d``, ``ShardedConv2d``, ``ShardedConv3d``.

Sharding contract:
    input: ``(N, C_in, S0, S1, ...)`` (or unbatched ``(C_in, S0, ...)``); ``dims`` (default: the
        first spatial dims, one per domain axis) are sharded by the domain axes in order, in
        contiguous slabs that start at multiples of the stride (``shard(..., align=...)``).
    output: ``(N, C_out, ...)`` sharded along the same dims; rank r's output slab holds the
        outputs whose windows start in its input slab, so output slabs are contiguous and
        aligned to ``align / stride``. The last rank also holds the extra outputs that right
        padding creates.
    forward: one all-gather of local shapes (a few integers) to agree on the layout, then a
        halo exchange with the two neighbours of each sharded dim (circular padding wraps
        around the ring). Global padding is applied only at the domain's edges.
    backward: halo gradients are sent back to the neighbours that own those positions; the
        input gradient of every rank is exact. Weight and bias gradients are partial sums over
        the domain ranks (reduce them with ``sharded_nn.parallelize``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..comm import axis_peers
from ..comm.sizes import scope_declare
from ..compile_boundary import eager_under_compile
from ..errors import ShardingError
from ..layout import Layout
from ..mesh import mesh_cached
from ..registry import register
from .base import BoundedCache, ShardedMixin, batched
from .window import (
    Window,
    WindowPlan,
    apply_linear,
    apply_overlapped,
    crop_empty,
    extend,
    pad_unsharded,
    plan_window,
    select_along,
)

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
#: Halo plans kept per module (one per recent input layout).
_PLAN_CACHE_SIZE = 8


def _conv(n: int, x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """``F.conv{n}d``, with a faster weight gradient for depth-padded CPU ``conv3d`` where needed.

    On CPUs without AVX-512, oneDNN computes the weight gradient of a ``conv3d`` whose input is
    zero-padded along depth (the first spatial dim) about 3x slower than for the same input padded
    explicitly (torch 2.14, one thread, 16 channels on 64 x 128 x 128: 578 ms against 196 ms with
    oneDNN held to AVX2 by ``ONEDNN_MAX_CPU_ISA=AVX2``), and sharded convolutions pad along depth
    whenever the volume is sharded there. ``_DepthPadConv3d`` keeps the fast forward and input
    gradient and computes the weight gradient from a transient, explicitly padded copy of the
    input. With AVX-512 both weight gradients take the same time (148 ms against 144 ms) and the
    padded copy is pure cost (a 3-D UNet training step at P=2 was 3-4% slower with it), so
    there the plain ``F.conv3d`` runs (:func:`_explicit_depth_padding`).
    """
    if n == 3 and _on_reference_kernel(x, weight, stride, padding, dilation, groups):
        y = _conv3d_on_onednn(x, weight, bias, stride, padding, dilation, groups)
        if y is not None:
            return y
    if (
        n == 3
        and padding[0] > 0
        and x.device.type == "cpu"
        and torch.is_grad_enabled()
        and weight.requires_grad
        and _explicit_depth_padding()
    ):
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # As autocast does for F.conv3d: the convolution runs in the autocast dtype, input,
            # weight and bias cast to it, so that the saved tensors and the gradient agree in
            # backward (which runs outside autocast).
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(device, enabled=False):
                return _DepthPadConv3d.apply(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)
        return _DepthPadConv3d.apply(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)
    return _CONV_FN[n](x, weight, bias, stride, padding, dilation, groups)


#: Which local conv3d geometries torch would run on its reference kernel (see
#: ``_on_reference_kernel``); a local decision (no collective), so local shapes may key it.
_REFERENCE_KERNEL = BoundedCache(256)
_SELECT_BACKEND = getattr(torch._C, "_select_conv_backend", None)


def _on_reference_kernel(x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, groups) -> bool:
    """Whether torch would run this float32 CPU ``conv3d`` on ``slow_conv3d``, its reference kernel.

    torch sends a one-sample float32 convolution to oneDNN only when ``N * C * S0 * S1`` exceeds
    20480 (or the batch, the groups or the kernel's last two sizes are large): a heuristic for
    small 2-d images, which for a volume ignores the last dim. A slab thinner than the whole
    volume falls below it where the unsharded volume did not (the 3-D UNet's bottleneck at P=2,
    1 x 32 x 16 x 32 x 32: 52 ms on ``slow_conv3d`` against 12 ms on oneDNN, one thread), and
    for a volume the reference kernel is 3-14x slower at every size measured (the 2-d reference
    kernel is not, and 2-d convolutions keep torch's choice). Asks torch's own backend selector,
    so a torch that changes the heuristic changes this with it. Kernels of one tap in every dim
    keep torch's choice (it prefers its own kernel for them on one thread, deliberately), so does
    a process that switched oneDNN off (``torch.backends.mkldnn.flags(enabled=False)``), and the
    answer is cached per geometry and thread count (which enters torch's choice).
    """
    if (
        _SELECT_BACKEND is None
        or not torch.backends.mkldnn.enabled
        or not torch.backends.mkldnn.is_available()
        or all(k == 1 for k in weight.shape[2:])
        or type(x) is not torch.Tensor
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or torch.is_autocast_enabled("cpu")
    ):
        return False
    key = (
        tuple(x.shape), tuple(weight.shape), tuple(stride), tuple(padding), tuple(dilation), groups,
        torch.get_num_threads(),
    )
    return _REFERENCE_KERNEL.get(key, _selects_reference, x, weight, stride, padding, dilation, groups)


def _selects_reference(x, weight, stride, padding, dilation, groups) -> bool:
    try:
        backend = _SELECT_BACKEND(
            x, weight, None, list(stride), list(padding), list(dilation), False, [0] * 3, groups, None
        )
    except (TypeError, RuntimeError):  # a private API: a torch that changed it keeps its own choice
        return False
    return str(backend).endswith("Slow3d")


def _records_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` records an autograd graph (grad mode on, one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _conv3d_on_onednn(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor | None:
    """``F.conv3d`` of a geometry torch would send to its reference kernel, on oneDNN instead.

    Without autograd, oneDNN's convolution is called directly. With it, torch's backward would
    choose the reference kernel again, so the one sample is cut into two along the spatial dim
    with the most outputs (each half with the input planes its outputs read, explicitly
    zero-padded), convolved as a batch of two (which torch sends to oneDNN, backward included) and
    the halves joined: differentiable ops only, so double backward works too. The cut copies the
    input once and the convolution saves that copy for backward (torch's heuristic bounds
    ``C * S0 * S1``, not the last dim, so this is usually a few megabytes). None where
    neither applies (a single-channel input in training, where both kernels take the same time,
    or no dim with two outputs): the caller keeps torch's convolution.
    """
    training = _records_graph(x, weight, bias)
    if not training:
        return torch.ops.aten.mkldnn_convolution(x, weight, bias, list(padding), list(stride), list(dilation), groups)
    if x.shape[0] != 1 or x.shape[1] == 1:
        return None
    outs = [
        (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (weight.shape[2 + i] - 1) - 1) // stride[i] + 1
        for i in range(3)
    ]
    i = max(range(3), key=lambda j: outs[j])
    if outs[i] < 2:
        return None
    d, s, p = 2 + i, stride[i], padding[i]
    span = dilation[i] * (weight.shape[d] - 1) + 1
    n_out, half = outs[i], (outs[i] + 1) // 2

    def pad_along(t: torch.Tensor, left: int, right: int) -> torch.Tensor:
        return F.pad(t, (0, 0) * (4 - d) + (left, right))

    xp = pad_along(x, p, p) if p else x
    length = (half - 1) * s + span  # the input planes the first half's outputs read
    first = xp.narrow(d, 0, length)
    second = xp.narrow(d, half * s, min(length, xp.shape[d] - half * s))
    if second.shape[d] < length:  # the second half is shorter: zero planes, outputs dropped below
        second = pad_along(second, 0, length - second.shape[d])
    pads = list(padding)
    pads[i] = 0
    y2 = F.conv3d(torch.cat([first, second]), weight, bias, stride, pads, dilation, groups)
    return torch.cat([y2.narrow(0, 0, 1), y2.narrow(0, 1, 1).narrow(d, 0, n_out - half)], d)


#: Whether ``_DepthPadConv3d`` runs (None: not decided yet). Tests set it to exercise both paths.
_EXPLICIT_DEPTH_PAD: bool | None = None

#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA`` values) under which it has its AVX-512 kernels.
_AVX512_ISAS = ("AVX512", "AVX10", "ALL")


def _explicit_depth_padding() -> bool:
    """Whether depth-padded CPU ``conv3d`` weight gradients take the explicitly padded path.

    Decided once per process from the CPU features ATen dispatches on and oneDNN's ISA cap: the
    slow depth-padded weight gradient is oneDNN's pre-AVX-512 kernel (see :func:`_conv`).
    """
    global _EXPLICIT_DEPTH_PAD
    if _EXPLICIT_DEPTH_PAD is None:
        cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512") and cap.startswith(_AVX512_ISAS)
        _EXPLICIT_DEPTH_PAD = not avx512
    return _EXPLICIT_DEPTH_PAD


class _DepthPadConv3d(torch.autograd.Function):
    """``F.conv3d`` whose backward computes the weight gradient with explicit depth padding."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):  # noqa: D102
        ctx.conf = (stride, padding, dilation, groups)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return F.conv3d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        # Built from differentiable ops, so that double backward (gradient penalties, physics
        # losses on input derivatives) works as with F.conv3d.
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conf
        bwd = torch.ops.aten.convolution_backward
        gx = gw = gb = None
        # The weight gradient first, so that the padded copy is freed before the input gradient
        # is allocated: the transient peak is one input-sized buffer, not two.
        if ctx.needs_input_grad[1]:
            pd = padding[0]
            if torch.is_grad_enabled():  # create_graph: record the padding too
                xp = F.pad(x, (0, 0, 0, 0, pd, pd))
            else:
                # Zero only the padding planes (F.pad fills the whole buffer, then copies over it).
                xp = x.new_empty((*x.shape[:2], x.shape[2] + 2 * pd, *x.shape[3:]))
                xp.narrow(2, 0, pd).zero_()
                xp.narrow(2, pd + x.shape[2], pd).zero_()
                xp.narrow(2, pd, x.shape[2]).copy_(x)
            inner = [0, padding[1], padding[2]]
            gw = bwd(g, xp, weight, None, stride, inner, dilation, False, [0, 0, 0], groups, [False, True, False])[1]
            del xp
        if ctx.needs_input_grad[0]:
            gx = bwd(g, x, weight, None, stride, padding, dilation, False, [0, 0, 0], groups, [True, False, False])[0]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum((0, 2, 3, 4))
        return gx, gw, gb, None, None, None, None


def _low_precision(x: torch.Tensor) -> bool:
    """Whether a convolution of ``x`` runs in fp16/bf16 (its own dtype, or autocast's)."""
    half = (torch.float16, torch.bfloat16)
    device = x.device.type
    return x.dtype in half or (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in half)


def _tap_conv(n: int, planes, weight, dim: int, taps, stride, padding, dilation, groups) -> torch.Tensor:
    """One output row along ``dim`` from the input ``planes`` under kernel ``taps`` only.

    Sharded convolutions correct their first and last output rows with the few taps that read
    the halos (``window.apply_linear``). A convolution over a volume one or two planes thick runs
    on torch's slow reference kernel (about 7x slower per output than a slab for ``conv3d`` on
    CPU), so for 1-d and 3-d the taps are folded into the channels instead: an ``(n-1)``-d
    convolution with ``C_in * len(taps)`` input channels, on the fast kernels. 2-d convolutions
    convolve the planes directly (a thin ``conv2d`` is on oneDNN's fast path). Equals the sum
    over ``taps`` of the tap's weights applied to its plane, with no bias; the result has size 1
    along ``dim``.
    """
    i, t = dim - 2, len(taps)
    if n == 2:
        # 2-D: a convolution over the T planes themselves, T rows thick, whose kernel keeps only
        # the rows ``taps`` (stride 1, no padding and no dilation along ``dim``: the planes are
        # already the ones the taps read). oneDNN runs this thin conv2d on its fast kernels; for
        # depthwise weights with several taps it is 2-4x faster than the folded conv1d below,
        # whose grouped 1-d kernels are slow there (measured, one thread, efficientnet_b0's
        # depthwise halo rows: 1152 channels x 8 columns, 2 taps of a 5x5 kernel: 729 us folded,
        # 165-200 us thin; one-tap rows of dense or grouped weights within the noise of each
        # other, 0.02-0.4 ms either way: bench/cnn_profile.py --taps). Grouped weights with
        # several channels per group: an unfolded matrix product (``_grouped_rows``), faster again.
        wt = select_along(weight, dim, taps)
        if dim == 2 and t == 1 and _depthwise_row_ok(planes, weight, groups):
            return _depthwise_row(planes, wt, stride[1], padding[1], dilation[1])
        st, pd, dl = list(stride), list(padding), list(dilation)
        st[i], pd[i], dl[i] = 1, 0, 1
        if _grouped_rows_ok(planes, weight, groups):
            return _grouped_rows(planes, wt, dim, st, pd, dl, groups)
        return F.conv2d(planes, wt, None, st, pd, dl, groups)
    # (N, C, T, ...) -> (N, C*T, ...): channel index c*T + tap, a view for one contiguous plane.
    u = planes.movedim(dim, 2)
    u = u.reshape(u.shape[0], u.shape[1] * t, *u.shape[3:])
    # (C_out, C_in/g, k_dim, ...) -> (C_out, C_in/g * T, other taps), the same channel order
    # within each group.
    wt = select_along(weight.movedim(dim, 2), 2, taps)
    wt = wt.reshape(wt.shape[0], wt.shape[1] * t, *wt.shape[3:])
    if n == 1:
        # No spatial dim is left: a length-1 conv1d keeps the grouping arithmetic.
        return F.conv1d(u.unsqueeze(-1), wt.unsqueeze(-1), None, 1, 0, 1, groups)
    keep = [j for j in range(n) if j != i]
    y = _CONV_FN[n - 1](
        u, wt, None, [stride[j] for j in keep], [padding[j] for j in keep], [dilation[j] for j in keep], groups
    )
    return y.unsqueeze(dim)


#: Widest kernel row a depthwise one-row correction computes as shifted multiply-adds.
_DEPTHWISE_ROW_MAX_TAPS = 5


def _depthwise_row_ok(planes: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether a one-plane correction of this 2-d convolution runs as ``_depthwise_row``.

    Depthwise weights (one input and one output channel per group) with a kernel row of at most
    ``_DEPTHWISE_ROW_MAX_TAPS`` taps: there a thin grouped convolution costs about 55 us of
    oneDNN's fixed cost per call whatever its size, the multiply-adds 26-49 us (forward) and
    135-290 against 220-350 us with the backward (one thread; 32-960 channels, 8-128 columns,
    3 and 5 taps). Wider rows and several planes are faster as one convolution (two planes of a
    5x5 kernel: 110 against 58 us), and so are dense or grouped weights.
    """
    return (
        groups > 1
        and weight.shape[0] == groups
        and weight.shape[1] == 1
        and planes.shape[1] == groups
        and weight.shape[3] <= _DEPTHWISE_ROW_MAX_TAPS
    )


def _depthwise_row(planes: torch.Tensor, wt: torch.Tensor, stride: int, padding: int, dilation: int) -> torch.Tensor:
    """The depthwise convolution of one plane ``(N, C, 1, W)`` by ``wt`` ``(C, 1, 1, k)`` along W.

    Equals ``F.conv2d(planes, wt, None, (1, stride), (0, padding), (1, dilation), C)``: the sum
    over the k taps of the zero-padded plane shifted by each tap, times that tap's per-channel
    weight, in k elementwise calls.
    """
    k = wt.shape[3]
    xp = F.pad(planes, (padding, padding)) if padding else planes
    n_out = (planes.shape[3] + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    w = wt.reshape(1, wt.shape[0], 1, k)
    acc = None
    for j in range(k):
        col = xp.narrow(3, j * dilation, (n_out - 1) * stride + 1)
        if stride > 1:
            col = col[..., ::stride]
        wj = w.narrow(3, j, 1)
        acc = col * wj if acc is None else torch.addcmul(acc, col, wj)
    return acc


#: A convolution whose weights take at least this many times the bytes of the largest slab runs
#: synchronously on the extended slab (see ``_sync_cheaper``).
_SYNC_WEIGHT_RATIO = 2

#: A grouped 2-d CPU convolution (several input channels per group) whose largest slab holds at
#: most this many bytes runs synchronously on the extended slab (see ``_sync_cheaper``).
_GROUPED_SYNC_MAX_BYTES = 1 << 20

#: A 2-d convolution run without autograd (inference) whose slabs along the last sharded dim are
#: at most this many rows thick runs synchronously on the extended slab (see ``_sync_cheaper``).
_FORWARD_SYNC_MAX_ROWS = 32


def _sync_cheaper(
    weight: torch.Tensor, groups: int, global_shape, dims, layouts, x: torch.Tensor, forward_only: bool = False
) -> bool:
    """Whether this convolution is cheaper on one extended copy of the slab than overlapped.

    The overlapped paths (``apply_linear``, ``apply_overlapped``) save the copy of the slab into
    an extended buffer and hide the halo's latency, and pay for it with calls of their own for
    the edge rows. Two kinds of convolution pay more than they save:

    - Heavy weights (at least ``_SYNC_WEIGHT_RATIO`` times the bytes of the largest slab): each
      edge call's weight gradient is a full-size tensor (zero-filled, written, then added to the
      weight's gradient) and its weights a sliced copy: costs that follow the weights' size, not
      the halo's. Deep dense stages have large weights and small slabs (ResNet-50's 3x3
      convolutions of 512 channels: 9 MiB of weights on a 128 KiB slab at 512x256, P=2). Two
      sharded 3x3 convolutions, one thread per rank, thread CPU per step, overlapped against
      synchronous: 512 channels on 8x8 slabs 27.9 against 20.4 ms forward and 89 against 58 ms
      with the backward, 256 on 16x16 17.5 against 15.1 and 49 against 42, 128 on 16x32 8.9
      against 8.5 and 27 against 25, 64 on 64x128 (weights 0.07x the slab) 23.9 against 25.4
      and 73.5 against 73.4; in ResNet-50 at 2048x1024 (512 channels on 32x32 slabs, weights
      4.5x the slab) within the noise either way.
    - Grouped 2-d weights with several channels per group (RegNet's, ResNeXt's) on slabs of at
      most ``_GROUPED_SYNC_MAX_BYTES``: their edge rows have no fast kernel (``_grouped_rows``,
      110-160 us per call whatever its size), which costs more than copying a slab of up to a
      megabyte. Chains of ten 3x3 convolutions in groups of 8 channels, P=2, one thread per
      rank, per layer, overlapped against synchronous (session 43): eval 845 against 699 us
      (256 channels on 16x32 slabs), 673 against 684 (512 on 8x16), 1143 against 1097 and 1255
      against 1126 (1 MiB slabs), 1870 against 1881 (2 MiB); training 1614 against 1309 (128 on
      16x32), 1851 against 1408 (512 on 8x16), 3375 against 3294 and 3668 against 3374 (1 MiB),
      5842 against 6107 (2 MiB). regnetx_002 at 512x256, P=2: eval forward 20.3 against 20.9 ms,
      training step 76.0 against 79.6 ms.
    - Any 2-d weights in a forward without autograd (``forward_only``: inference) on slabs at
      most ``_FORWARD_SYNC_MAX_ROWS`` rows thick along the last sharded dim: the copy costs the
      slab's few rows, the edge rows cost calls of their own with fixed costs (a band
      convolution, multiply-adds, the in-place add). Chains of ten depthwise convolutions, P=2,
      one thread per rank, eval, per layer, overlapped against synchronous (session 43): 3x3,
      200 channels on 16x16 slabs 420-454 against 372-389 us, 480 on 16x16 621-634 against 556;
      5x5, 960 on 8x8 665-677 against 510-561; 7x7, 160 on 16x16 580-608 against 420-425, 320 on
      8x8 500-524 against 381-389. At 32 rows (session 45, the limit raised from 16: slabs
      32x32) the synchronous path wins or ties: 3x3, 72 channels 531 against 467 us, 240
      channels 805-851 against 793-834; 5x5, 120 channels 819 against 636, 480 channels 1770
      against 1500; 7x7, 80 channels 733 against 554, 160 channels 959-1022 against 800
      (ConvNeXt-atto's third stage at 1024x512); grouped and dense 3x3 within 1%. Thicker slabs
      keep the overlapped path: at 64 rows the two tie (3x3, 72 channels on 64x64 1028-1044
      against 1035 us; 5x5, 120 channels 1607-1625 against 1634; 7x7, 80 channels 2011 against
      2043), and earlier runs favoured it (3x3, 72 channels on 64x64 939-974 against 1231-1261 us;
      5x5, 120 on 64x64 1623-1646 against 1966-2032; 7x7, 40 on 128x128 2222-2341 against
      2489-2588). Whole models, eval forward at P=2 with the 16-row rule against without it,
      alternated in one launch (median of rounds): 512x256 mobilenetv3_large_100 31.8 against 32.1 ms,
      efficientnet_b0 47.0 / 48.1, convnext_atto 29.7 / 31.3; 1024x512 73.3 / 75.2, 126.6 /
      130.4, 88.5 / 93.8. Raising the limit from 16 to 32 rows (session 45, alternated in one
      launch, eval forward at P=2): 1024x512 convnext_atto 90.0 -> 87.5 ms, regnetx_002 50.2 ->
      48.8, efficientnet_b0 138.7 -> 135.9, mobilenetv3_large_100 80.5 -> 81.7 and 78.8 -> 79.3;
      512x256 31.9 -> 31.7, 22.6 -> 22.7, 48.7 -> 48.3, 32.9 -> 32.6; 64 rows gained nothing
      more (convnext_atto 1024x512 87.9 against 88.4 ms). With autograd the same chains and
      models were within this host's noise either way (training steps 0-5% apart, both signs),
      so training keeps the overlapped path; again in session 45, regnetx_002 1024x512 training
      step at P=2, alternated in one launch: 199.7 ms as is, 202.5 / 205.8 ms with this rule
      applied with autograd too at 16 / 32 rows, 206.0 ms with the grouped rule at 2 MiB.

    Decided on the largest slab of the agreed layout (the same on every rank, so the ranks take
    the same path); ``forward_only`` follows grad mode and ``requires_grad``, agreed facts too.
    """
    shape = list(global_shape)
    for lay, d in zip(layouts, dims):
        shape[d] = max(lay.sizes)
    slab_bytes = math.prod(shape) * x.element_size()
    if weight.numel() * weight.element_size() >= _SYNC_WEIGHT_RATIO * slab_bytes:
        return True
    grouped = weight.dim() == 4 and groups > 1 and weight.shape[1] > 1 and x.device.type == "cpu"
    if grouped and slab_bytes <= _GROUPED_SYNC_MAX_BYTES:
        return True
    return forward_only and weight.dim() == 4 and max(layouts[-1].sizes) <= _FORWARD_SYNC_MAX_ROWS


def _grouped_rows_ok(planes: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether a halo correction of this 2-d convolution runs as ``_grouped_rows``.

    Grouped weights with several input channels per group (RegNet's, ResNeXt's), on the CPU:
    there oneDNN spends about 200 us on a thin grouped convolution whatever its size, and the
    unfolded matrix product takes 110-160 against 160-255 us forward and 390-660 against 700-1000
    us with the backward (one thread; 24-368 channels in groups of 3-8, 8-128 columns, one tap
    row of a 3x3 kernel; two runs of ``bench/cnn_profile.py --taps``). Dense weights (one group) are faster as one
    convolution, and depthwise ones have their own paths.
    """
    return groups > 1 and weight.shape[1] > 1 and planes.device.type == "cpu"


def _grouped_rows(planes: torch.Tensor, wt: torch.Tensor, dim: int, stride, padding, dilation, groups: int) -> torch.Tensor:
    """``F.conv2d(planes, wt, None, stride, padding, dilation, groups)`` as one unfold and one
    matrix product batched over the groups, for the thin planes of a halo correction (size 1
    along ``dim`` in the result).

    ``F.unfold`` lays out each output position's window as ``(channel, kernel row, kernel
    column)``, the order of a group's weights, so group ``g``'s windows are rows
    ``[g * C_in/g * kh * kw, (g + 1) * ...)``: the product of the ``(groups, C_out/g, K)``
    weights with the ``(N, groups, K, L)`` windows is the grouped convolution.
    """
    n, o = planes.shape[0], wt.shape[0]
    kernel = tuple(wt.shape[2:])
    cols = F.unfold(planes, kernel, dilation=tuple(dilation), padding=tuple(padding), stride=tuple(stride))
    k, length = wt.shape[1] * kernel[0] * kernel[1], cols.shape[-1]
    y = torch.matmul(wt.reshape(groups, o // groups, k), cols.view(n, groups, k, length))
    return y.reshape(n, o, 1, length) if dim == 2 else y.reshape(n, o, length, 1)


class _ShardedConvNd(ShardedMixin):
    """Shared forward of the sharded convolutions (mixed into the torch classes)."""

    _sharding_options = ("dims", "overlap")
    _allow_empty = True
    _scoped_agree = True  # the output layout is declared (scope_declare) once planned

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, overlap: bool = True) -> None:
        """See the module docstring; ``overlap`` computes the interior while halos travel."""
        super()._init_sharding(mesh, dims)
        self.overlap = overlap
        # Keyed by the gathered layouts: a few recent input geometries (e.g. train and eval sizes).
        self._plans = BoundedCache(_PLAN_CACHE_SIZE)

    #: Whether the padding depends on the input's global size (TF-style "SAME", timm's
    #: ``Conv2dSame``): then ``_input_pads`` gives it per call, after the layout is agreed.
    _pads_from_input = False

    def _input_pads(self, spatial: Sequence[int]) -> list[tuple[int, int]]:
        """Global (left, right) padding of each spatial dim for an input of global ``spatial`` sizes."""
        raise NotImplementedError

    def _pads(self, spatial: Sequence[int] | None = None) -> list[tuple[int, int]]:
        """Global (left, right) padding of each spatial dim (for global input sizes ``spatial``
        where the layer pads by the input's size)."""
        if self._pads_from_input:
            return self._input_pads(spatial)
        if self.padding == "valid":
            return [(0, 0)] * self._spatial_dims
        if self.padding == "same":
            out = []
            for k, d in zip(self.kernel_size, self.dilation):
                total = d * (k - 1)
                out.append((total // 2, total - total // 2))
            return out
        return [(p, p) for p in self.padding]

    def _window(self, i: int, pads: Sequence[tuple[int, int]]) -> Window:
        pl, pr = pads[i]
        return Window(self.kernel_size[i], self.stride[i], self.dilation[i], pl, pr)

    def _plan(self, layouts: tuple[Layout, ...], conf: _ConvConf) -> tuple[WindowPlan, ...]:
        # Keyed by the gathered (global) layouts, which every rank shares, and the layer's
        # configuration: a hit or miss here is the same on every rank.
        return self._plans.get((layouts, conf.key), self._make_plans, layouts, conf)

    def _conf(self, spatial: Sequence[int] | None = None) -> _ConvConf:
        """What the sharded forward derives from the layer's configuration alone, worked out once.

        Every call of a sharded convolution needs its padding split (unsharded dims padded by the
        convolution itself or beforehand), its windows and whether it is pointwise; deriving them
        afresh cost tens of microseconds of Python per call, a visible share of a small layer
        (issue 16). Kept per module and made again when the configuration changes (the key is
        the torch attributes it is derived from, compared on every call).
        """
        key = (self.kernel_size, self.stride, self.padding, self.dilation, self.padding_mode, self.dims)
        if self._pads_from_input:
            key += (tuple(spatial),)  # the padding follows the global input size
        conf = self.__dict__.get("_snn_conv_conf")
        if conf is None or conf.key != key:
            conf = self.__dict__["_snn_conv_conf"] = _ConvConf.of(self, key, self._pads(spatial))
        return conf

    def _make_plans(self, layouts: tuple[Layout, ...], conf: _ConvConf) -> tuple[WindowPlan, ...]:
        return tuple(
            plan_window(lay, conf.windows[d - 2], d, mode=self.padding_mode, what=type(self).__name__)
            for lay, d in zip(layouts, self.dims)
        )

    def _pointwise(self, pads: Sequence[tuple[int, int]]) -> bool:
        """Whether every output position reads its own input position only (1x1, stride 1, no padding).

        Such a convolution (the 1x1 convolutions of bottlenecks, inverted residuals and conv
        MLPs) needs no halo, no layout and no alignment: each rank convolves its slab as the
        torch layer does, with no communication, like any other pointwise layer (a Linear over
        channels). A decision on the module's configuration alone, the same on every rank.
        """
        # Every spatial dim, not only the sharded ones: the empty-slab form below is a channel
        # contraction.
        return all(k == 1 for k in self.kernel_size) and all(s == 1 for s in self.stride) and all(
            p == (0, 0) for p in pads
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.forward_with(x, self.weight, self.bias)

    def forward_with(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's forward with the given ``weight`` and ``bias`` in place of its own.

        What ``sharded_nn.functional.conv`` runs (a layer's geometry, weights computed by the
        caller: weight-standardised or fixed-filter convolutions); ``forward`` passes the
        layer's parameters. ``weight`` must have the layer's shape.
        """
        if self._local_only:
            # P=1: the torch layer itself (its own padding modes included); nothing to agree on.
            return self._local_forward(x, weight, bias)
        if self._pads_from_input:
            return self._sharded_forward(x, None, (weight, bias))  # configured once the sizes are agreed
        conf = self._conf()
        if conf.pointwise:
            return self._pointwise_forward(x, weight, bias)
        return self._sharded_forward(x, conf, (weight, bias))

    def _local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The unsharded layer's forward with these weights (a one-rank mesh)."""
        return self._conv_forward(x, weight, bias)

    def _pointwise_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[1 if x.dim() == self._spatial_dims + 2 else 0] != self.in_channels:
            # Checked here (torch's message names no layer): dim 1 is unsharded, so an input with
            # the wrong channels has them on every rank and every rank raises.
            raise ShardingError(
                f"{type(self).__name__}: expected {self.in_channels} input channels (dim 1), got local input "
                f"shape {tuple(x.shape)}."
            )
        if x.numel() == 0 and x.dim() == self._spatial_dims + 2:
            # An empty slab (a rank left without rows by a deep stage): torch's convolution
            # refuses a zero-sized spatial dim, so contract the channels directly; the output and
            # the (zero) weight gradient keep the layer's shapes on this rank too.
            # (C_out, C_in/g, 1...) -> the dense (C_out, C_in) block-diagonal matrix of the groups.
            w = torch.block_diag(*weight.reshape(self.groups, -1, self.in_channels // self.groups))
            y = torch.einsum("nc...,oc->no...", x, w)
            return y if bias is None else y + bias.reshape(1, -1, *([1] * self._spatial_dims))
        return self._conv_forward(x, weight, bias)

    @batched
    def _sharded_forward(
        self, x: torch.Tensor, conf: _ConvConf | None, params: tuple[torch.Tensor, torch.Tensor | None]
    ) -> torch.Tensor:
        # (weight, bias) as one tuple: ``batched`` gives every tensor argument a batch dim.
        weight, bias = params
        n = self._spatial_dims
        agreed = self._agree(x)
        layouts = agreed.layouts
        if x.shape[1] != self.in_channels:  # dim 1 is unsharded: the same on every rank
            raise ShardingError(
                f"{type(self).__name__}: expected {self.in_channels} input channels (dim 1), got global input "
                f"shape {agreed.global_shape(self.dims)}."
            )
        if conf is None:  # the padding follows the global input size (_pads_from_input)
            conf = self._conf(agreed.global_shape(self.dims)[2:])
        plans = self._plan(layouts, conf)
        # The output's layout, derived from the agreed input's: the next layer need not agree.
        scope_declare(self.mesh, self.dims, x.dim(), [p.out for p in plans])
        mode = self.padding_mode
        rings = [axis_peers(self.mesh, axis) for axis in self.mesh_axes]
        pads, conv_padding = conf.pads, conf.conv_padding

        def conv(t: torch.Tensor, pad: int = 0, with_bias: bool = True) -> torch.Tensor:
            t = pad_unsharded(t, pads, mode)
            padding = list(conv_padding)
            padding[last_dim - 2] = pad
            return _conv(n, t, weight, bias if with_bias else None, self.stride, padding, self.dilation, self.groups)

        def band(planes: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
            planes = pad_unsharded(planes, pads, mode)
            return _tap_conv(n, planes, weight, last_dim, taps, self.stride, conv_padding, self.dilation, self.groups)

        # Earlier sharded dims are extended first (this also fills the corners); the last one is
        # handled without an extended copy of the slab (apply_linear) where the geometry allows,
        # else overlapped with the interior convolution, else synchronously.
        last = len(plans) - 1
        last_dim = self.dims[last]
        for k in range(last):
            x = extend(x, plans[k], rings[k], mode)
        if any(p.gather is not None for p in plans):
            # A thin, empty or edge-clipped stage (multi-hop halos): synchronous, and ranks left
            # without outputs crop their placeholder row.
            return crop_empty(conv(extend(x, plans[last], rings[last], mode)), plans, rings)
        if self.overlap and not _sync_cheaper(
            weight, self.groups, agreed.global_shape(self.dims), self.dims, layouts, x,
            forward_only=not _records_graph(x, weight, bias),
        ):
            window = conf.windows[last_dim - 2]
            # apply_linear adds halo corrections to rows that are already rounded: in fp16/bf16
            # that is up to three roundings where one device rounds once, so low-precision convs
            # compute every output row in one convolution (apply_overlapped) instead.
            if not _low_precision(x):
                # 2-D: rows that read one halo corrected in one call (measured; see apply_linear).
                # 1-d and 3-d keep one call per row: their folded tap rows avoid thin-volume kernels.
                rows = (lambda t: conv(t, 0, with_bias=False)) if n == 2 else None
                out = apply_linear(x, plans[last], rings[last], mode, window, conv, band, rows)
                if out is not None:
                    return out
            return apply_overlapped(x, plans[last], rings[last], mode, window, conv)
        return conv(extend(x, plans[last], rings[last], mode))

    def sharding_repr(self) -> str:  # noqa: D102
        return f"{super().sharding_repr()}, overlap={self.overlap}"


@eager_under_compile
def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: str | int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    *,
    mesh: DeviceMesh,
    dims: int | Sequence[int] | None = None,
    padding_mode: str = "zeros",
) -> torch.Tensor:
    """``F.conv1d/2d/3d(x_full, weight, bias, stride, padding, dilation, groups)`` on this rank's slab.

    The functional form of the sharded convolutions, for weights a model computes in its own
    ``forward`` (weight-standardised convolutions such as timm's ``StdConv2d`` and
    ``ScaledStdConv2d`` in NFNets and BiT ResNets, fixed filters); the forward guard routes such
    ``F.conv*d`` calls here. The number of spatial dims is
    ``weight.dim() - 2``; the arguments are ``F.conv*d``'s, and the sharding contract, halo
    exchange and gradients are those of ``ShardedConv{n}d`` (module docstring): the input gradient
    is exact, the gradients reaching ``weight`` and ``bias`` are this rank's partial sums over the
    domain ranks (reduce them as for any sharded layer's parameters, e.g. with
    ``sharded_nn.parallelize``). ``dims`` defaults to the first spatial dims, one per domain axis.

    One geometry-only layer (its parameters on the meta device, no memory) is kept per mesh and
    configuration, so its halo plans are reused from call to call as a module's are.

    ``padding_mode`` (an option beyond ``F.conv*d``'s, as ``nn.Conv*d``'s): ``"zeros"``,
    ``"reflect"``, ``"replicate"`` or ``"circular"`` padding of the full input, read from the
    domain's edge slabs (e.g. timm's ``BlurPool2d``: a reflect pad, then a strided convolution).
    """
    n = weight.dim() - 2
    cls = _FUNCTIONAL_CLASSES.get(n)
    if cls is None or x.dim() not in (n + 1, n + 2):
        raise ShardingError(
            f"sharded_nn.functional.conv: expected a 3-d, 4-d or 5-d weight (C_out, C_in/groups, k...) and an "
            f"input with one or two more dims than its spatial dims, got weight shape {tuple(weight.shape)} and "
            f"local input shape {tuple(x.shape)}."
        )

    def norm(v):
        return v if isinstance(v, (int, str)) else tuple(int(e) for e in v)

    dims_key = dims if dims is None or isinstance(dims, int) else tuple(dims)
    key = ("functional_conv", n, tuple(weight.shape), bias is not None, norm(stride), norm(padding), norm(dilation),
           int(groups), dims_key, padding_mode)

    def make() -> _ShardedConvNd:
        return cls(
            weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]), stride=stride, padding=padding,
            dilation=dilation, groups=groups, bias=bias is not None, padding_mode=padding_mode, device="meta",
            mesh=mesh, dims=dims,
        )

    return mesh_cached(mesh, key, make).forward_with(x, weight, bias)


@dataclass(frozen=True)
class _ConvConf:
    """A sharded convolution's configuration as its forward uses it (``_ShardedConvNd._conf``).

    Attributes:
        key: the torch attributes it is derived from (kernel, stride, padding, dilation, padding
            mode), the sharded dims and, for a layer that pads by its input's size
            (``_pads_from_input``), the global spatial sizes.
        pointwise: see ``_ShardedConvNd._pointwise``.
        windows: the window of each spatial dim.
        pads: global padding of the unsharded dims applied before the convolution, by tensor dim
            (read only).
        conv_padding: the padding passed to the convolution itself (zero padding of unsharded
            dims, cheapest inside it; the sharded dims' entries are set per call).
    """

    key: tuple
    pointwise: bool
    windows: tuple[Window, ...]
    pads: dict
    conv_padding: tuple[int, ...]

    @staticmethod
    def of(layer: _ShardedConvNd, key: tuple, all_pads: Sequence[tuple[int, int]]) -> _ConvConf:
        n = layer._spatial_dims
        pads = {2 + i: p for i, p in enumerate(all_pads) if 2 + i not in layer.dims}
        conv_padding = [0] * n
        if layer.padding_mode == "zeros":
            for d, (pl, pr) in list(pads.items()):
                if pl == pr:
                    conv_padding[d - 2] = pl
                    del pads[d]
        return _ConvConf(
            key, layer._pointwise(all_pads), tuple(layer._window(i, all_pads) for i in range(n)), pads, tuple(conv_padding)
        )


@register(nn.Conv1d)
class ShardedConv1d(_ShardedConvNd, nn.Conv1d):
    """``nn.Conv1d`` over a length sharded on the domain axis; see the module docstring."""

    _spatial_dims = 1


@register(nn.Conv2d)
class ShardedConv2d(_ShardedConvNd, nn.Conv2d):
    """``nn.Conv2d`` over an image sharded along H (1-D domain) or H and W (2-D domain)."""

    _spatial_dims = 2


@register(nn.Conv3d)
class ShardedConv3d(_ShardedConvNd, nn.Conv3d):
    """``nn.Conv3d`` over a volume sharded along D (and H, W with 2-D/3-D domain meshes)."""

    _spatial_dims = 3


_FUNCTIONAL_CLASSES = {1: ShardedConv1d, 2: ShardedConv2d, 3: ShardedConv3d}
