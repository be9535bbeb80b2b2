"""timm's TF-style "SAME" convolution over slabs: padding from the whole sample's size.

timm's ``Conv2dSame`` (``tf_efficientnet_*``, ``tf_mixnet_*``, ``tf_efficientnetv2_*`` and other
ports of TensorFlow weights) pads its input in ``forward`` by amounts computed from the input's
size (``timm.layers.padding.pad_same``): on a slab that size is the local one, and the padding,
the output size and every value near the padding would be wrong (the forward guard refuses the
local-size ``F.pad``). Here the padding is computed by timm's own ``pad_same_arg`` from the
global size, agreed with the layout, and the convolution is the sharded one with that padding at
the domain's edges only: no padded copy, halos as for any ``ShardedConv2d``.

Sharding contract: ``ShardedConv2d``'s (``(N, C, H, W)`` sharded along H, or H and W on a 2-D
domain mesh; slabs starting at multiples of the stride); the output is this rank's slab of the
unsharded layer's output. The state_dict keys are timm's. Only loaded when timm is installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from ..registry import register
from .conv import ShardedConv2d

__all__: list[str] = []

try:
    # The module by its path: ``timm.layers.conv2d_same`` is also the name of a function there.
    _timm_conv2d_same = importlib.import_module("timm.layers.conv2d_same")
    from timm.layers.padding import pad_same_arg as _pad_same_arg
except ImportError:  # timm is optional
    _timm_conv2d_same = None


if _timm_conv2d_same is not None:

    @register(_timm_conv2d_same.Conv2dSame)
    class ShardedConv2dSame(ShardedConv2d, _timm_conv2d_same.Conv2dSame):
        """timm ``Conv2dSame``: TF "SAME" padding from the global input size; see the module docstring."""

        _pads_from_input = True

        def _input_pads(self, spatial: Sequence[int]) -> list[tuple[int, int]]:
            # timm's own arithmetic, on the global sizes: [w_left, w_right, h_left, h_right].
            wl, wr, hl, hr = (int(p) for p in _pad_same_arg(list(spatial), self.kernel_size, self.stride, self.dilation))
            return [(hl, hr), (wl, wr)]

        def _local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            # One rank: timm's own forward (pad, then convolve).
            return _timm_conv2d_same.conv2d_same(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    __all__ += ["ShardedConv2dSame"]
