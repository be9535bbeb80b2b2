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

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..comm import axis_ring, gather_layouts
from ..registry import register
from ..layout import Layout
from .base import ShardedMixin
from .window import Window, WindowPlan, apply_linear, apply_overlapped, extend, pad_unsharded, plan_window

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class _ShardedConvNd(ShardedMixin):
    """Shared forward of the sharded convolutions (mixed into the torch classes)."""

    def __init__(
        self, *args, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, overlap: bool = True, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self._init_sharding(mesh, dims, overlap)

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None = None, overlap: bool = True) -> None:
        """See the module docstring; ``overlap`` computes the interior while halos travel."""
        super()._init_sharding(mesh, dims)
        self.overlap = overlap
        self._plans: dict[tuple[Layout, ...], tuple[WindowPlan, ...]] = {}

    def _pads(self) -> list[tuple[int, int]]:
        """Global (left, right) padding of each spatial dim."""
        if self.padding == "valid":
            return [(0, 0)] * self._spatial_dims
        if self.padding == "same":
            out = []
            for k, d in zip(self.kernel_size, self.dilation):
                total = d * (k - 1)
                out.append((total // 2, total - total // 2))
            return out
        return [(p, p) for p in self.padding]

    def _window(self, i: int) -> Window:
        pl, pr = self._pads()[i]
        return Window(self.kernel_size[i], self.stride[i], self.dilation[i], pl, pr)

    def _plan(self, layouts: tuple[Layout, ...]) -> tuple[WindowPlan, ...]:
        # Keyed by the gathered (global) layouts, which every rank shares: a hit or miss here is
        # the same on every rank.
        if layouts not in self._plans:
            self._plans[layouts] = tuple(
                plan_window(lay, self._window(d - 2), d, mode=self.padding_mode, what=type(self).__name__)
                for lay, d in zip(layouts, self.dims)
            )
        return self._plans[layouts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        n = self._spatial_dims
        if x.dim() == n + 1:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if x.dim() != n + 2:
            raise ValueError(
                f"{type(self).__name__}: expected a {n + 2}-d (N, C, ...) or {n + 1}-d unbatched input, "
                f"got shape {tuple(x.shape)}."
            )
        layouts = gather_layouts(x.shape, self.mesh, self.dims, what=type(self).__name__)
        plans = self._plan(layouts)
        mode = self.padding_mode
        rings = [axis_ring(self.mesh, axis) for axis in self.mesh_axes]
        pads = {2 + i: p for i, p in enumerate(self._pads()) if 2 + i not in self.dims}
        conv_padding = [0] * n
        if mode == "zeros":
            # Zero padding of unsharded dims is cheapest inside the convolution itself.
            for d, (pl, pr) in list(pads.items()):
                if pl == pr:
                    conv_padding[d - 2] = pl
                    del pads[d]

        def conv(t: torch.Tensor, pad: int = 0, bias: bool = True) -> torch.Tensor:
            t = pad_unsharded(t, pads, mode)
            padding = list(conv_padding)
            padding[last_dim - 2] = pad
            b = self.bias if bias else None
            return _CONV_FN[n](t, self.weight, b, self.stride, padding, self.dilation, self.groups)

        # Earlier sharded dims are extended first (this also fills the corners); the last one is
        # handled without an extended copy of the slab (apply_linear) where the geometry allows,
        # else overlapped with the interior convolution, else synchronously.
        last = len(plans) - 1
        last_dim = self.dims[last]
        for k in range(last):
            x = extend(x, plans[k], rings[k], mode)
        if self.overlap:
            window = self._window(last_dim - 2)
            out = apply_linear(x, plans[last], rings[last], mode, window, conv, lambda t: conv(t, bias=False))
            if out is not None:
                return out
            return apply_overlapped(x, plans[last], rings[last], mode, window, conv)
        return conv(extend(x, plans[last], rings[last], mode))

    def extra_repr(self) -> str:  # noqa: D102
        return f"{super().extra_repr()}, {self.sharding_repr()}, overlap={self.overlap}"


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
