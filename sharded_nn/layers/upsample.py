"""Sharded resampling: ``interpolate`` (``F.interpolate`` on slabs) and ``ShardedUpsample``.

Every output position ``j`` along a dim reads a few source positions computed by torch's own
index arithmetic (``aten/src/ATen/native/UpSample.h``), reproduced here in the same precision:
nearest (``floorf(j * scale)``, float32), nearest-exact (``floorf((j + 0.5) * scale)``), linear
(2 taps, ``area_pixel_compute_source_index`` and ``guard_index_and_lambda``) and cubic (4 taps,
``A = -0.75``, clamped at the edges). ``area`` is adaptive average pooling
(``ShardedAdaptiveAvgPool``). The interpolation is separable, so dims are resampled one after
another with ``index_select`` and per-position weights. Weighted taps of fp16/bf16 inputs are
summed in float32 and rounded once, as torch's kernels do.

Sharding contract:
    input: ``(N, C, S0, ...)`` sharded along ``dims`` by the domain axes, any contiguous slabs.
    output: sharded along the same dims. A rank whose input slab is ``[a, b)`` of ``L`` holds
        the outputs ``[round(a*O/L), round(b*O/L))`` of ``O``: for an integer scale factor ``s``
        that is ``[a*s, b*s)``, so output slabs stay aligned (to ``s * align``).
    forward: one all-gather of local shapes; then, per sharded dim, a halo exchange of exactly the
        source positions this rank's outputs read beyond its slab (none for nearest with an
        integer factor, one for linear, two for cubic). Every rank derives every rank's halo
        widths from the shared layout, so they agree and validate alike.
    backward: halo gradients return to their owners; the input gradient is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import HaloSpec, axis_peers, halo_cat
from ..comm.halo import halo_gather, memory_format_of
from ..compile_boundary import eager_under_compile
from ..errors import ShardingError, ShardingNotImplementedError
from ..mesh import domain_axes
from ..registry import register
from .adaptive_pool import ShardedAdaptiveAvgPool1d, ShardedAdaptiveAvgPool2d, ShardedAdaptiveAvgPool3d
from .base import ShardedMixin, agree
from .window import gather_plan

_AREA = {1: ShardedAdaptiveAvgPool1d, 2: ShardedAdaptiveAvgPool2d, 3: ShardedAdaptiveAvgPool3d}

_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "bicubic", "area")
_LINEAR = {"linear": 3, "bilinear": 4, "trilinear": 5, "bicubic": 4}
_A = -0.75  # torch's cubic convolution coefficient


def _taps(mode: str, length: int, out: int, scale: float | None, align_corners: bool, opmath: torch.dtype):
    """Source indices (list of int64 ``(O,)`` tensors) and weights (list, or None) for all outputs."""
    j = torch.arange(out, dtype=torch.int64)
    if mode in ("nearest", "nearest-exact"):
        # compute_scales_value<float>: float32, like torch.
        s = torch.tensor(1.0 / scale, dtype=torch.float32) if scale else torch.tensor(length, dtype=torch.float32) / out
        if mode == "nearest":
            if out == length:
                return [j], None
            if out == 2 * length:
                return [j >> 1], None
            src = torch.floor(j.to(torch.float32) * s)
        else:
            src = torch.floor(((j.to(torch.float64) + 0.5) * s.double()).to(torch.float32))
        return [src.to(torch.int64).clamp(max=length - 1)], None
    cubic = mode == "bicubic"
    if not cubic and out == length:
        # torch's linear kernels copy a dim whose size is kept, whatever the scale factor says
        # (``compute_source_index_and_lambda`` in ATen's UpSample.h): ``scale_factor=1.3`` on
        # 3 rows gives 3 rows, copied. Computed with the scale, they were silently different
        # (found by tests/test_fuzz_interpolate.py).
        return [j], None
    if align_corners:
        s = torch.tensor(length - 1, dtype=opmath) / (out - 1) if out > 1 else torch.tensor(0.0, dtype=opmath)
    elif scale:
        s = torch.tensor(1.0 / scale, dtype=opmath)
    else:
        s = torch.tensor(length, dtype=opmath) / out
    if align_corners:
        real = s * j.to(opmath)
    else:
        real = s * (j.to(opmath) + 0.5) - 0.5
        if not cubic:
            real = real.clamp(min=0)
    # floorf: the source index is rounded to float32 before flooring, as in torch.
    idx = torch.floor(real.to(torch.float32)).to(torch.int64)
    if not cubic:
        idx = idx.clamp(max=length - 1)
        lam = (real - idx.to(opmath)).clamp(0, 1)
        nxt = idx + (idx < length - 1).to(torch.int64)
        return [idx, nxt], [1 - lam, lam]
    t = real - idx.to(opmath)

    def conv1(x):
        return ((_A + 2) * x - (_A + 3)) * x * x + 1

    def conv2(x):
        return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A

    weights = [conv2(t + 1.0), conv1(t), conv1(1.0 - t), conv2((1.0 - t) + 1.0)]
    return [(idx - 1 + k).clamp(0, length - 1) for k in range(4)], weights


def _out_range(start: int, length: int, out: int) -> int:
    """First output that a slab starting at ``start`` holds: ``start * O / L`` rounded half up."""
    return (2 * start * out + length) // (2 * length)


def _resample(x: torch.Tensor, dim: int, taps, weights, offset: int) -> torch.Tensor:
    shape = [1] * x.dim()
    shape[dim] = -1
    out = None
    for k, idx in enumerate(taps):
        part = x.index_select(dim, (idx - offset).to(x.device))
        if weights is not None:
            part = part * weights[k].to(dtype=x.dtype, device=x.device).view(shape)
        out = part if out is None else out + part
    return out


@eager_under_compile
def interpolate(
    x: torch.Tensor,
    mesh: DeviceMesh,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
    *,
    dims: Sequence[int] | int | None = None,
    what: str = "interpolate",
) -> torch.Tensor:
    """``F.interpolate`` of the sharded tensor whose local slab is ``x``; see the module docstring.

    Args:
        x: this rank's slab of ``(N, C, S0, ...)``.
        mesh: the device mesh; ``dims`` (default: the first spatial dims, one per domain axis)
            are sharded by its domain axes in order.
        size, scale_factor, mode, align_corners, recompute_scale_factor: as ``F.interpolate``,
            for the *global* tensor (``size`` is the global output size).
        antialias: must be False (not sharded).

    Returns:
        This rank's slab of the interpolated tensor.
    """
    if mode not in _MODES:
        raise ShardingNotImplementedError(f"{what}: mode={mode!r} is not sharded; supported modes: {_MODES}.")
    if antialias:
        raise ShardingNotImplementedError(f"{what}: antialias=True is not sharded; use antialias=False.")
    if mode.startswith("nearest") and align_corners is not None:
        raise ValueError(f"{what}: align_corners only applies to linear and cubic modes, got mode={mode!r}.")
    if (size is None) == (scale_factor is None):
        raise ValueError(
            f"{what}: give exactly one of size and scale_factor, got size={size}, scale_factor={scale_factor}."
        )
    axes = domain_axes(mesh)
    # Defaults from the local number of dims: ``agree`` first checks that every rank shares it.
    n = x.dim() - 2
    if dims is None:
        dims = tuple(range(2, 2 + min(len(axes), max(n, 0))))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    ndims = (_LINEAR[mode],) if mode in _LINEAR else (3, 4, 5)
    expected = f"a {ndims[0]}-d" if mode in _LINEAR else "a 3-d, 4-d or 5-d"
    agreed = agree(
        x, mesh, dims, what=what, ndims=ndims, expected=f"(mode {mode!r}) {expected} (N, C, ...)", allow_empty=True
    )
    if any(not 2 <= d < x.dim() for d in dims):
        raise ShardingError(f"{what}: dims={dims} must name spatial dims of a {x.dim()}-d input.")
    layouts = agreed.layouts
    lengths = list(agreed.global_shape(dims)[2:])
    if size is not None:
        outs = [size] * n if isinstance(size, int) else list(size)
        scales: list[float | None] = [None] * n
    else:
        factors = [scale_factor] * n if isinstance(scale_factor, (int, float)) else list(scale_factor)
        outs = [math.floor(float(L) * f) for L, f in zip(lengths, factors)]
        scales = [None if recompute_scale_factor else float(f) for f in factors]
    if len(outs) != n:
        raise ValueError(f"{what}: size/scale_factor needs {n} values for a {x.dim()}-d input.")
    if mode == "area":
        # torch's "area" is adaptive average pooling to the output size.
        return _AREA[n](tuple(outs), mesh=mesh, dims=dims)(x)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    out_dtype = x.dtype
    # The taps gather along one dim at a time (NCHW results); torch's upsampling keeps a
    # channels-last input channels-last, and so does the result here.
    fmt = memory_format_of(x)
    if mode not in ("nearest", "nearest-exact") and x.dtype in (torch.float16, torch.bfloat16):
        # Weighted taps of fp16/bf16 inputs are summed in float32 and rounded once at the end,
        # as torch's upsampling kernels do (rounding after every tap and dim would not match).
        x = x.to(opmath)
    corners = bool(align_corners)
    for i in range(n):
        d = 2 + i
        taps, weights = _taps(mode, lengths[i], outs[i], scales[i], corners, opmath)
        if d not in dims:
            x = _resample(x, d, taps, weights, 0)
            continue
        k = dims.index(d)
        lay, ring = layouts[k], axis_peers(mesh, axes[k])
        # A rank may get no outputs (an empty input slab, or fewer outputs than ranks): it
        # carries an empty slab and still serves its neighbours' halos.
        bounds = [_out_range(a, lay.size, outs[i]) for a in lay.starts] + [outs[i]]
        lo_src = torch.stack(taps).min(0).values
        hi_src = torch.stack(taps).max(0).values
        left, right = [], []
        for r, (a, m) in enumerate(zip(lay.starts, lay.sizes)):
            lo, hi = bounds[r], bounds[r + 1]
            left.append(max(a - int(lo_src[lo:hi].min()), 0) if hi > lo else 0)
            right.append(max(int(hi_src[lo:hi].max()) + 1 - (a + m), 0) if hi > lo else 0)
        spec = HaloSpec(d, tuple(left), tuple(right))
        r = ring.index
        if not spec.fits(lay.sizes):
            # A halo spans several slabs (thin or empty ones): read each row from its owner.
            ranges = [(a - lf, a + m + rt) for a, m, lf, rt in zip(lay.starts, lay.sizes, left, right)]
            x = halo_gather(x, gather_plan(d, lay, ranges, "zeros"), ring)
        elif ring.size > 1:
            x = halo_cat(x, spec, ring)
        lo, hi = bounds[r], bounds[r + 1]
        x = _resample(
            x, d, [t[lo:hi] for t in taps], None if weights is None else [w[lo:hi] for w in weights],
            lay.starts[r] - left[r],
        )
    x = x.to(out_dtype)
    return x if fmt == torch.contiguous_format else x.contiguous(memory_format=fmt)


@register(nn.Upsample)
class ShardedUpsample(ShardedMixin, nn.Upsample):
    """``nn.Upsample`` on a sharded tensor; see the module docstring of ``sharded_nn.layers.upsample``."""

    _spatial_dims = 3  # Upsample takes 1-d to 3-d inputs; dims are checked against the input too

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None) -> None:
        """See the module docstring."""
        super()._init_sharding(mesh, dims)
        if getattr(self, "antialias", False):
            raise ShardingNotImplementedError(f"{type(self).__name__}: antialias=True is not sharded.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return interpolate(
            x, self.mesh, self.size, self.scale_factor, self.mode, self.align_corners,
            self.recompute_scale_factor, dims=self.dims, what=type(self).__name__,
        )


@register(nn.UpsamplingNearest2d)
class ShardedUpsamplingNearest2d(ShardedUpsample, nn.UpsamplingNearest2d):
    """``nn.UpsamplingNearest2d`` on a sharded tensor."""

    _spatial_dims = 2


@register(nn.UpsamplingBilinear2d)
class ShardedUpsamplingBilinear2d(ShardedUpsample, nn.UpsamplingBilinear2d):
    """``nn.UpsamplingBilinear2d`` (align_corners=True) on a sharded tensor."""

    _spatial_dims = 2


__all__ = ["ShardedUpsample", "ShardedUpsamplingBilinear2d", "ShardedUpsamplingNearest2d", "interpolate"]
