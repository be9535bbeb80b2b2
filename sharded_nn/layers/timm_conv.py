"""timm's TF-style "SAME" convolutions over slabs: padding from the whole sample's size.

timm's ``Conv2dSame`` (``tf_efficientnet_*``, ``tf_mixnet_*``, ``tf_efficientnetv2_*`` and other
ports of TensorFlow weights) pads its input in ``forward`` by amounts computed from the input's
size (``timm.layers.padding.pad_same``): on a slab that size is the local one, and the padding,
the output size and every value near the padding would be wrong (the forward guard refuses the
local-size ``F.pad``). Here the padding is computed by timm's own ``pad_same_arg`` from the
global size, agreed with the layout, and the convolution is the sharded one with that padding at
the domain's edges only: no padded copy, halos as for any ``ShardedConv2d``.

timm's weight-standardised ``StdConv2dSame`` (BiT / ViT-hybrid stems) and
``ScaledStdConv2dSame`` (DeepMind's NFNets, ``dm_nfnet_*``) pad the same way before convolving
with weights standardised per output channel (mean 0, variance 1 over each filter's fan-in, eps
added to the variance; the scaled form multiplies by ``gain * gamma / sqrt(fan_in)``). Their
sharded classes standardise the weights exactly as the timm layers do (a ``batch_norm`` over
the filter, in training mode, without running statistics; tested against timm's modules) and
convolve with the same global padding. With a static padding (``same_pad`` False: stride 1, or a
size-independent padding) they are plain sharded convolutions of the standardised weights.

timm's ``BlurPool2d`` (anti-aliased downsampling: ``resnetblur*``, TResNet) pads its input (reflect
by default) and convolves it with a fixed binomial filter at a stride. Run as two calls on slabs,
the padded slabs would start off the stride (the forward guard refuses that); its sharded class
is the one sharded convolution of that filter with the padding folded in (``padding_mode`` from
the layer's ``pad_mode``), read from the domain's edge slabs.

Sharding contract: ``ShardedConv2d``'s (``(N, C, H, W)`` sharded along H, or H and W on a 2-D
domain mesh; slabs starting at multiples of the stride); the output is this rank's slab of the
unsharded layer's output. The state_dict keys are timm's. Only loaded when timm is installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from ..errors import ShardingError
from ..registry import register
from .base import ShardedMixin
from .conv import ShardedConv2d
from .conv import conv as sharded_conv

__all__: list[str] = []

try:
    # The module by its path: ``timm.layers.conv2d_same`` is also the name of a function there.
    _timm_conv2d_same = importlib.import_module("timm.layers.conv2d_same")
    _timm_std_conv = importlib.import_module("timm.layers.std_conv")
    _timm_blur_pool = importlib.import_module("timm.layers.blur_pool")
    from timm.layers.padding import pad_same_arg as _pad_same_arg
except ImportError:  # timm is optional
    _timm_conv2d_same = _timm_std_conv = _timm_blur_pool = None


class _TfSamePads:
    """TF "SAME" padding of a timm conv from the global input size (timm's own arithmetic)."""

    def _input_pads(self, spatial: Sequence[int]) -> list[tuple[int, int]]:
        # timm's ``pad_same_arg`` on the global sizes: [w_left, w_right, h_left, h_right].
        wl, wr, hl, hr = (int(p) for p in _pad_same_arg(list(spatial), self.kernel_size, self.stride, self.dilation))
        return [(hl, hr), (wl, wr)]

    def _local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # One rank: timm's own arithmetic (pad by the input's size, then convolve).
        if not self._pads_from_input:
            return self._conv_forward(x, weight, bias)
        return _timm_conv2d_same.conv2d_same(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class _Standardised(_TfSamePads):
    """Weight standardisation of timm's ``StdConv2dSame`` / ``ScaledStdConv2dSame``."""

    @property
    def _pads_from_input(self) -> bool:  # type: ignore[override]
        return bool(self.same_pad)

    def _gain(self) -> torch.Tensor | None:
        return None

    def standardised_weight(self) -> torch.Tensor:
        """The weight the timm layer convolves with: each output channel's filter normalised to
        mean 0 and variance 1 (biased, eps added) over its fan-in, times the gain if any."""
        flat = self.weight.reshape(1, self.out_channels, -1)
        out = torch.nn.functional.batch_norm(flat, None, None, weight=self._gain(), training=True, momentum=0.0,
                                             eps=self.eps)
        return out.reshape_as(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.forward_with(x, self.standardised_weight(), self.bias)


if _timm_conv2d_same is not None:

    @register(_timm_conv2d_same.Conv2dSame)
    class ShardedConv2dSame(_TfSamePads, ShardedConv2d, _timm_conv2d_same.Conv2dSame):
        """timm ``Conv2dSame``: TF "SAME" padding from the global input size; see the module docstring."""

        _pads_from_input = True

    @register(_timm_std_conv.StdConv2dSame)
    class ShardedStdConv2dSame(_Standardised, ShardedConv2d, _timm_std_conv.StdConv2dSame):
        """timm ``StdConv2dSame``: standardised weights, TF "SAME" padding from the global size."""

    @register(_timm_std_conv.ScaledStdConv2dSame)
    class ShardedScaledStdConv2dSame(_Standardised, ShardedConv2d, _timm_std_conv.ScaledStdConv2dSame):
        """timm ``ScaledStdConv2dSame`` (NFNets): scaled standardised weights, TF "SAME" padding."""

        def _gain(self) -> torch.Tensor:
            return (self.gain * self.scale).view(-1)

    @register(_timm_blur_pool.BlurPool2d)
    class ShardedBlurPool2d(ShardedMixin, _timm_blur_pool.BlurPool2d):
        """timm ``BlurPool2d``: pad and strided blur as one sharded depthwise convolution.

        Sharding contract: ``(N, C, H, W)`` sharded along H (or H and W on a 2-D domain mesh),
        slabs starting at multiples of the stride; the output is this rank's slab of the unsharded
        layer's output. The filter is a non-persistent buffer (no state_dict keys, as timm's).
        """

        _spatial_dims = 2

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
            channels = x.shape[1] if self.channels is None else self.channels
            k = self.filt_size
            weight = self.filt.expand(channels, 1, k, k) if self.channels is None else self.filt
            left, right, top, bottom = self.padding
            if left != right or top != bottom:
                raise ShardingError(
                    f"ShardedBlurPool2d: expected the same padding on both sides of each dim (timm builds it so), got "
                    f"{self.padding} (left, right, top, bottom); set layer.padding to symmetric values."
                )
            mode = {"constant": "zeros"}.get(self.pad_mode, self.pad_mode)
            return sharded_conv(x, weight, None, self.stride, (top, left), 1, int(channels),
                                mesh=self.mesh, dims=self.dims, padding_mode=mode)

        def sharding_repr(self) -> str:
            return f"{super().sharding_repr()}, one sharded {self.pad_mode}-padded depthwise convolution"

    __all__ += ["ShardedConv2dSame", "ShardedStdConv2dSame", "ShardedScaledStdConv2dSame", "ShardedBlurPool2d"]
