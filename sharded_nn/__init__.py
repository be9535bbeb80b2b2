"""sharded_nn: domain parallelism for PyTorch.

Split one huge sample across processes; explicit sharded layers exchange halos, reduce
statistics and pass attention blocks so that the result equals the single-device model.
"""

from . import comm, losses
from .convert import convert
from .errors import ShardingError, ShardingNotImplementedError, ShardingWarning
from .launch import launch
from .layers import ShardedConv1d, ShardedConv2d, ShardedConv3d
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
    "local_slices",
    "losses",
    "parallelize",
    "register",
    "shard",
]
