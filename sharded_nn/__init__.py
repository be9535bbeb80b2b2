"""sharded_nn: domain parallelism for PyTorch.

Split one huge sample across processes; explicit sharded layers exchange halos, reduce
statistics and pass attention blocks so that the result equals the single-device model.
"""

# Before anything can allocate a tensor: torch reads its huge-page switch at the first allocation.
from .host_memory import apply_process_defaults as _apply_process_defaults

_apply_process_defaults()

from . import comm, fft, fft_modes, functional, losses, points, reductions
from . import layers as _layers
from .alignment import alignment
from .convert import convert
from .errors import ShardingError, ShardingNotImplementedError, ShardingWarning
from .launch import launch
from .layers.upsample import interpolate
from .layout import Layout
from .mesh import data_axis, domain_axes, domain_group, domain_size, init_mesh, set_layout, stated_layout
from .parallel import parallelize
from .planner import plan_memory
from .points import PointCloudPartition
from .recompute import activation_checkpoint
from .registry import register
from .reshard import reshard
from .sharding import batch_slice, default_dims, gather, local_slices, shard
from .weights import sync_weights

__version__ = "0.1.0"

# Every sharded layer, re-exported (the list lives in layers/__init__.py); timm's layers through
# ``__getattr__`` below, so that ``import sharded_nn`` does not import timm.
globals().update({_n: getattr(_layers, _n) for _n in _layers.__all__ if _n not in _layers._TIMM_LAYERS})

__all__ = [
    "Layout",
    "activation_checkpoint",
    "PointCloudPartition",
    "alignment",
    "batch_slice",
    "ShardingError",
    "ShardingNotImplementedError",
    "ShardingWarning",
    "comm",
    "convert",
    "data_axis",
    "default_dims",
    "domain_axes",
    "domain_group",
    "domain_size",
    "fft",
    "fft_modes",
    "functional",
    "gather",
    "init_mesh",
    "interpolate",
    "launch",
    "local_slices",
    "losses",
    "parallelize",
    "plan_memory",
    "points",
    "reductions",
    "register",
    "reshard",
    "set_layout",
    "shard",
    "stated_layout",
    "sync_weights",
    *_layers.__all__,
]


# Submodules whose import pulls in model code (timm, torch_geometric) load on first use, so that
# ``import sharded_nn`` stays cheap: ``snn.zoo``, ``snn.converters``.
_LAZY = {"zoo": "sharded_nn.zoo", "converters": "sharded_nn.converters"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(_LAZY[name])
    if name in _layers._TIMM_LAYERS:
        return getattr(_layers, name)
    raise AttributeError(f"module 'sharded_nn' has no attribute {name!r}")
