"""Sharded layers. Importing this package registers them with ``convert``."""

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

__all__ = ["ShardedConv1d", "ShardedConv2d", "ShardedConv3d"]
__all__ += [
    "ShardedBatchNorm1d",
    "ShardedBatchNorm2d",
    "ShardedBatchNorm3d",
    "ShardedGroupNorm",
    "ShardedInstanceNorm1d",
    "ShardedInstanceNorm2d",
    "ShardedInstanceNorm3d",
    "ShardedLayerNorm",
]
__all__ += ["ShardedConvTranspose1d", "ShardedConvTranspose2d", "ShardedConvTranspose3d"]
from .attention import RingAttention, ShardedMultiheadAttention, UlyssesAttention

__all__ += ["RingAttention", "ShardedMultiheadAttention", "UlyssesAttention"]
try:
    from .attention import ShardedTimmAttention

    __all__ += ["ShardedTimmAttention"]
except ImportError:  # timm is optional
    pass
from . import pool as _pool
from .pool import *  # noqa: F403

__all__ += _pool.__all__
from .upsample import ShardedUpsample, ShardedUpsamplingBilinear2d, ShardedUpsamplingNearest2d

__all__ += ["ShardedUpsample", "ShardedUpsamplingBilinear2d", "ShardedUpsamplingNearest2d"]
from . import padding as _padding
from .padding import *  # noqa: F403 - the padding layers; the list lives in padding.py

__all__ += [n for n in _padding.__all__ if n.startswith("Sharded")]  # the layers; F.pad stays in .padding
