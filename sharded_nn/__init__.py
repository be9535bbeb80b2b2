"""sharded_nn: domain parallelism for PyTorch.

Split one huge sample across processes; explicit sharded layers exchange halos, reduce
statistics and pass attention blocks so that the result equals the single-device model.
"""

from . import comm, losses, reductions
from .convert import convert
from .errors import ShardingError, ShardingNotImplementedError, ShardingWarning
from .launch import launch, tune_host_allocator
from .layers import ShardedConv1d, ShardedConv2d, ShardedConv3d
from .layers.norm import (
    ShardedBatchNorm1d,
    ShardedBatchNorm2d,
    ShardedBatchNorm3d,
    ShardedGroupNorm,
    ShardedInstanceNorm1d,
    ShardedInstanceNorm2d,
    ShardedInstanceNorm3d,
    ShardedLayerNorm,
)
from .layout import Layout
from .mesh import data_axis, domain_axes, domain_group, domain_size, init_mesh
from .parallel import parallelize
from .registry import register
from .sharding import gather, local_slices, shard

__version__ = "0.1.0"

__all__ = [
    "Layout",
    "ShardedConv1d",
    "ShardedConv2d",
    "ShardedConv3d",
    "ShardingError",
    "ShardingNotImplementedError",
    "ShardingWarning",
    "comm",
    "convert",
    "data_axis",
    "domain_axes",
    "domain_group",
    "domain_size",
    "gather",
    "init_mesh",
    "launch",
    "tune_host_allocator",
    "local_slices",
    "losses",
    "parallelize",
    "register",
    "shard",
]
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

from .layers.conv_transpose import ShardedConvTranspose1d, ShardedConvTranspose2d, ShardedConvTranspose3d  # noqa: E402

__all__ += ["ShardedConvTranspose1d", "ShardedConvTranspose2d", "ShardedConvTranspose3d"]

from . import functional  # noqa: E402
from .layers.attention import RingAttention, ShardedMultiheadAttention, UlyssesAttention  # noqa: E402

__all__ += ["RingAttention", "ShardedMultiheadAttention", "UlyssesAttention", "functional"]
try:
    from .layers.attention import ShardedTimmAttention  # noqa: E402

    __all__ += ["ShardedTimmAttention"]
except ImportError:  # timm is optional
    pass

from .layers import pool as _pool  # noqa: E402
from .layers.pool import *  # noqa: E402, F403

__all__ += _pool.__all__
__all__ += ["reductions"]

from .layers.upsample import ShardedUpsample, ShardedUpsamplingBilinear2d, ShardedUpsamplingNearest2d  # noqa: E402
from .layers.upsample import interpolate  # noqa: E402

__all__ += ["ShardedUpsample", "ShardedUpsamplingBilinear2d", "ShardedUpsamplingNearest2d", "interpolate"]

from .layers.padding import (  # noqa: E402
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

__all__ += [
    "ShardedCircularPad1d",
    "ShardedCircularPad2d",
    "ShardedCircularPad3d",
    "ShardedConstantPad1d",
    "ShardedConstantPad2d",
    "ShardedConstantPad3d",
    "ShardedReflectionPad1d",
    "ShardedReflectionPad2d",
    "ShardedReflectionPad3d",
    "ShardedReplicationPad1d",
    "ShardedReplicationPad2d",
    "ShardedReplicationPad3d",
    "ShardedZeroPad1d",
    "ShardedZeroPad2d",
    "ShardedZeroPad3d",
]
