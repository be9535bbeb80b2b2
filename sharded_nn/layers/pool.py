"""Sharded window pooling: ``ShardedMaxPool1d/2d/3d`` and ``ShardedAvgPool1d/2d/3d``.

Sharding contract (``ShardedMaxPool*``, ``ShardedAvgPool*``):
    input: ``(N, C, S0, ...)`` (or unbatched), sharded along ``dims`` by the domain axes in
        contiguous slabs that start at multiples of the stride.
    output: sharded along the same dims; as for a convolution, rank r holds the outputs whose
        windows start in its slab (the last rank also those that padding and ``ceil_mode`` add),
        so output slabs start at ``start / stride``.
    forward: one all-gather of local shapes, then a halo exchange with the two neighbours of each
        sharded dim (``window.extend``). Global padding is applied at the domain's edges only:
        ``-inf`` for max pooling (padding never wins) and zeros for average pooling, whose
        divisor is computed from the global position of every output exactly as torch does
        (``count_include_pad``, ``divisor_override``, ``ceil_mode`` windows clipped at the end).
        ``ceil_mode`` only changes the last rank, which gets the extra output.
        ``return_indices=True`` returns *global* indices, flattened over the full spatial extent,
        exactly those torch returns on the full tensor.
    backward: halo gradients go back to their owners; the input gradient is exact.

Adaptive pooling lives in ``adaptive_pool.py``, max unpooling in ``unpool.py``; their names are
re-exported here for code that imports them from ``sharded_nn.layers.pool``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _ntuple

from ..comm import axis_peers
from ..comm.sizes import scope_declare
from ..registry import register
from .base import ShardedMixin, batched
from .window import Window, crop_empty, extend, pad_unsharded, plan_window

_MAX_FN = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_FN = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pool_out_size(length: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's ``pooling_output_shape``: a ceil-mode window must start inside input or left pad."""
    e = d * (k - 1) + 1
    out = (length + 2 * p - e + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= length + p:
        out -= 1
    return out


class _ShardedPoolNd(ShardedMixin):
    """Window bookkeeping shared by the sharded max and average pools."""

    _allow_empty = True
    _scoped_agree = True  # the output layout is declared (scope_declare) once planned

    def _opts(self) -> tuple[tuple[int, ...], ...]:
        n = _ntuple(self._spatial_dims)
        stride = self.stride if self.stride is not None else self.kernel_size
        dilation = getattr(self, "dilation", 1)
        return n(self.kernel_size), n(stride), n(self.padding), n(dilation)

    def forward(self, x: torch.Tensor):  # noqa: D102
        if self._local_only:
            # P=1: the torch layer itself; nothing to exchange or agree on.
            return super(ShardedMixin, self).forward(x)
        return self._sharded_forward(x)

    def _windows(self, sizes: Sequence[int]) -> list[Window]:
        """Per spatial dim; the right padding also covers the extra ``ceil_mode`` output."""
        out = []
        for length, k, s, p, d in zip(sizes, *self._opts()):
            e = d * (k - 1) + 1
            if 2 * p > e:
                # torch checks this on the full tensor; windows inside the extended slab never would.
                raise ValueError(
                    f"{type(self).__name__}: padding {p} should be at most half of the effective kernel size {e}."
                )
            n_out = _pool_out_size(length, k, s, p, d, self.ceil_mode)
            out.append(Window(k, s, d, p, max(p, (n_out - 1) * s + e - length - p)))
        return out

    def _extend(self, x: torch.Tensor, value: float, implicit: bool = False):
        """The halo-extended, edge-padded slab; also global sizes, windows, output starts, plans and
        the padding left to the pooling kernel.

        ``implicit``: symmetric padding of unsharded dims is not applied here but returned, for a
        kernel that pads with ``value`` itself (max pooling: ``-inf``), which saves a padded copy
        of the whole slab (ResNet's stem max pool: 18 ms of a 1.9 s forward at 2048x1024, P=2).
        """
        name = type(self).__name__
        agreed = self._agree(x)
        layouts = agreed.layouts
        sizes = list(agreed.global_shape(self.dims)[2:])
        windows = self._windows(sizes)
        # Every plan (and its validation) before any communication.
        plans = [plan_window(lay, windows[d - 2], d, mode="zeros", what=name) for lay, d in zip(layouts, self.dims)]
        scope_declare(self.mesh, self.dims, x.dim(), [p.out for p in plans])
        starts = [0] * self._spatial_dims  # global position of the first local output
        offsets = [-w.pad_left for w in windows]  # global position of the extended slab's first element
        for lay, plan, d, axis in zip(layouts, plans, self.dims, self.mesh_axes):
            w = windows[d - 2]
            ring = axis_peers(self.mesh, axis)
            start = lay.starts[ring.index]
            starts[d - 2] = start // w.stride
            # One-hop and general plans alike start the extended slab pad_left before the slab.
            offsets[d - 2] = start - w.pad_left
            x = extend(x, plan, ring, "zeros", value)
        pads = {2 + i: (w.pad_left, w.pad_right) for i, w in enumerate(windows) if 2 + i not in self.dims}
        kernel_pad = [0] * self._spatial_dims
        if implicit:
            for d, (left, right) in list(pads.items()):
                if left == right:  # not a ceil_mode window clipped at the end
                    kernel_pad[d - 2] = left
                    offsets[d - 2] = 0  # the kernel's indices count from the slab's own first element
                    del pads[d]
        x = pad_unsharded(x, pads, "zeros", value)
        return x, sizes, windows, starts, offsets, plans, kernel_pad


class _ShardedMaxPoolNd(_ShardedPoolNd):
    @batched
    def _sharded_forward(self, x: torch.Tensor):
        n = self._spatial_dims
        ext, sizes, _, _, offsets, plans, kernel_pad = self._extend(x, float("-inf"), implicit=True)
        k, s, _, d = self._opts()
        y, idx = _MAX_FN[n](ext, k, s, kernel_pad, d, ceil_mode=False, return_indices=True)
        rings = [axis_peers(self.mesh, a) for a in self.mesh_axes]
        y, idx = crop_empty(y, plans, rings), crop_empty(idx, plans, rings)
        if not self.return_indices:
            return y
        # Local indices are flat over the extended slab; shift each coordinate to the global
        # tensor and flatten over the global extent, as torch does on the full tensor.
        ext_sizes = ext.shape[2:]
        coords = []
        rest = idx
        for size in reversed(ext_sizes):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        flat = torch.zeros_like(idx)
        for c, off, size in zip(coords, offsets, sizes):
            flat = flat * size + (c + off)
        return y, flat


class _ShardedAvgPoolNd(_ShardedPoolNd):
    @batched
    def _sharded_forward(self, x: torch.Tensor):
        n = self._spatial_dims
        ext, sizes, _, starts, _, plans, _ = self._extend(x, 0.0)
        k, s, p, _ = self._opts()
        y = _AVG_FN[n](ext, k, s, 0)  # divides by prod(k): every window lies inside ext
        y = crop_empty(y, plans, [axis_peers(self.mesh, a) for a in self.mesh_axes])
        # Rescale each output from prod(k) to torch's divisor for its global position.
        override = getattr(self, "divisor_override", None)
        if override:
            factor = torch.tensor(math.prod(k) / override, dtype=torch.float64)
        else:
            factor = torch.ones((), dtype=torch.float64)
            for i in range(n):
                j = torch.arange(starts[i], starts[i] + y.shape[2 + i], dtype=torch.int64)
                lo = j * s[i] - p[i]
                hi = torch.clamp(lo + k[i], max=sizes[i] + p[i])
                div = hi - lo if self.count_include_pad else hi.clamp(max=sizes[i]) - lo.clamp(min=0)
                shape = [1] * n
                shape[i] = -1
                factor = factor * (k[i] / div.to(torch.float64)).view(shape)
        if bool((factor != 1).any()):
            y = y * factor.to(dtype=y.dtype, device=y.device)
        return y


@register(nn.MaxPool1d)
class ShardedMaxPool1d(_ShardedMaxPoolNd, nn.MaxPool1d):
    """``nn.MaxPool1d`` with its input sharded along ``dims``; see the module docstring."""

    _spatial_dims = 1


@register(nn.MaxPool2d)
class ShardedMaxPool2d(_ShardedMaxPoolNd, nn.MaxPool2d):
    """``nn.MaxPool2d`` with its input sharded along ``dims``; see the module docstring."""

    _spatial_dims = 2


@register(nn.MaxPool3d)
class ShardedMaxPool3d(_ShardedMaxPoolNd, nn.MaxPool3d):
    """``nn.MaxPool3d`` with its input sharded along ``dims``; see the module docstring."""

    _spatial_dims = 3


@register(nn.AvgPool1d)
class ShardedAvgPool1d(_ShardedAvgPoolNd, nn.AvgPool1d):
    """``nn.AvgPool1d`` with its input sharded along ``dims``; see the module docstring."""

    _spatial_dims = 1


@register(nn.AvgPool2d)
class ShardedAvgPool2d(_ShardedAvgPoolNd, nn.AvgPool2d):
    """``nn.AvgPool2d`` with its input sharded along ``dims``; see the module docstring."""

    _spatial_dims = 2


@register(nn.AvgPool3d)
class ShardedAvgPool3d(_ShardedAvgPoolNd, nn.AvgPool3d):
    """``nn.AvgPool3d`` with its input sharded along ``dims``; see the module docstring."""

    _spatial_dims = 3


# Re-exported (they lived in this module before it was split).
from .adaptive_pool import (  # noqa: E402
    ShardedAdaptiveAvgPool1d,
    ShardedAdaptiveAvgPool2d,
    ShardedAdaptiveAvgPool3d,
    ShardedAdaptiveMaxPool1d,
    ShardedAdaptiveMaxPool2d,
    ShardedAdaptiveMaxPool3d,
)
from .unpool import ShardedMaxUnpool1d, ShardedMaxUnpool2d, ShardedMaxUnpool3d  # noqa: E402

__all__ = [
    "ShardedAdaptiveAvgPool1d",
    "ShardedAdaptiveAvgPool2d",
    "ShardedAdaptiveAvgPool3d",
    "ShardedAdaptiveMaxPool1d",
    "ShardedAdaptiveMaxPool2d",
    "ShardedAdaptiveMaxPool3d",
    "ShardedAvgPool1d",
    "ShardedAvgPool2d",
    "ShardedAvgPool3d",
    "ShardedMaxPool1d",
    "ShardedMaxPool2d",
    "ShardedMaxPool3d",
    "ShardedMaxUnpool1d",
    "ShardedMaxUnpool2d",
    "ShardedMaxUnpool3d",
]
