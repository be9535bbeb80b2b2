"""Sharded layers, one family per file. Importing this package registers them with ``convert``.

- ``conv.py``, ``conv_transpose.py``: convolutions (``window.py`` plans their halos)
- ``pool.py``: window pools; ``adaptive_pool.py``: adaptive pools; ``unpool.py``: max unpooling
- ``norm.py``: Group/Instance/Batch/LayerNorm
- ``padding.py``: the ``*Pad*d`` layers and the functional ``pad``
- ``upsample.py``: ``Upsample`` and the functional ``interpolate``
- ``attention.py``: ``RingAttention``, ``UlyssesAttention`` and the drop-in attention modules
- ``base.py``: what every layer shares (constructor, mesh options, input agreement, caches)
"""

from .adaptive_pool import (
    ShardedAdaptiveAvgPool1d,
    ShardedAdaptiveAvgPool2d,
    ShardedAdaptiveAvgPool3d,
    ShardedAdaptiveMaxPool1d,
    ShardedAdaptiveMaxPool2d,
    ShardedAdaptiveMaxPool3d,
)
from .attention import RingAttention, ShardedMultiheadAttention, UlyssesAttention
from .conv import ShardedConv1d, ShardedConv2d, ShardedConv3d
from .conv_transpose import ShardedConvTranspose1d, ShardedConvTranspose2d, ShardedConvTranspose3d
from .norm import (
    ShardedBatchNorm1d,
    ShardedBatchNorm2d,
    ShardedBatchNorm3d,
    ShardedGroupNorm,
    ShardedInstanceNorm1d,
    ShardedInstanceNorm2d,
    ShardedInstanceNorm3d,
    ShardedLayerNorm,
)
from .padding import (
    ShardedCircularPad1d,
    ShardedCircularPad2d,
    ShardedCircularPad3d,
    ShardedConstantPad1d,
    ShardedConstantPad2d,
    ShardedConstantPad3d,
    ShardedReflectionPad1d,
    ShardedReflectionPad2d,
    ShardedReflectionPad3d,
    ShardedReplicationPad1d,
    ShardedReplicationPad2d,
    ShardedReplicationPad3d,
    ShardedZeroPad1d,
    ShardedZeroPad2d,
    ShardedZeroPad3d,
)
from .pool import (
    ShardedAvgPool1d,
    ShardedAvgPool2d,
    ShardedAvgPool3d,
    ShardedMaxPool1d,
    ShardedMaxPool2d,
    ShardedMaxPool3d,
)
from .transformer import ShardedTransformerEncoder, ShardedTransformerEncoderLayer
from .unpool import ShardedMaxUnpool1d, ShardedMaxUnpool2d, ShardedMaxUnpool3d
from .upsample import ShardedUpsample, ShardedUpsamplingBilinear2d, ShardedUpsamplingNearest2d

__all__ = [
    "RingAttention",
    "ShardedAdaptiveAvgPool1d",
    "ShardedAdaptiveAvgPool2d",
    "ShardedAdaptiveAvgPool3d",
    "ShardedAdaptiveMaxPool1d",
    "ShardedAdaptiveMaxPool2d",
    "ShardedAdaptiveMaxPool3d",
    "ShardedAvgPool1d",
    "ShardedAvgPool2d",
    "ShardedAvgPool3d",
    "ShardedBatchNorm1d",
    "ShardedBatchNorm2d",
    "ShardedBatchNorm3d",
    "ShardedCircularPad1d",
    "ShardedCircularPad2d",
    "ShardedCircularPad3d",
    "ShardedConstantPad1d",
    "ShardedConstantPad2d",
    "ShardedConstantPad3d",
    "ShardedConv1d",
    "ShardedConv2d",
    "ShardedConv3d",
    "ShardedConvTranspose1d",
    "ShardedConvTranspose2d",
    "ShardedConvTranspose3d",
    "ShardedGroupNorm",
    "ShardedInstanceNorm1d",
    "ShardedInstanceNorm2d",
    "ShardedInstanceNorm3d",
    "ShardedLayerNorm",
    "ShardedMaxPool1d",
    "ShardedMaxPool2d",
    "ShardedMaxPool3d",
    "ShardedMaxUnpool1d",
    "ShardedMaxUnpool2d",
    "ShardedMaxUnpool3d",
    "ShardedMultiheadAttention",
    "ShardedReflectionPad1d",
    "ShardedReflectionPad2d",
    "ShardedReflectionPad3d",
    "ShardedReplicationPad1d",
    "ShardedReplicationPad2d",
    "ShardedReplicationPad3d",
    "ShardedUpsample",
    "ShardedUpsamplingBilinear2d",
    "ShardedUpsamplingNearest2d",
    "ShardedZeroPad1d",
    "ShardedZeroPad2d",
    "ShardedZeroPad3d",
    "ShardedTransformerEncoder",
    "ShardedTransformerEncoderLayer",
    "UlyssesAttention",
]

try:  # timm is optional
    from .attention import ShardedTimmAttention
except ImportError:
    pass
else:
    __all__ += ["ShardedTimmAttention"]

from .timm_norm_act import *  # noqa: E402,F403 - timm's norm(+act) layers, when timm is installed
from .timm_conv import *  # noqa: E402,F403 - timm's TF-style 'SAME' convolution, when timm is installed
from .timm_norm_act import __all__ as _timm_norm_act_all  # noqa: E402
from .timm_conv import __all__ as _timm_conv_all  # noqa: E402

__all__ += _timm_norm_act_all + _timm_conv_all
