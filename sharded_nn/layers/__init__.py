"""Sharded layers, one family per file. Importing this package registers them with ``convert``.

- ``conv.py``, ``conv_transpose.py``: convolutions (``window.py`` plans their halos)
- ``pool.py``: window pools; ``adaptive_pool.py``: adaptive pools; ``unpool.py``: max unpooling
- ``norm.py``: Group/Instance/Batch/LayerNorm
- ``padding.py``: the ``*Pad*d`` layers and the functional ``pad``
- ``upsample.py``: ``Upsample`` and the functional ``interpolate``
- ``unfold.py``: ``Unfold`` / ``Fold`` (sliding blocks, im2col and col2im)
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
    ShardedSyncBatchNorm,
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
from .unfold import ShardedFold, ShardedUnfold
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
    "ShardedSyncBatchNorm",
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
    "ShardedFold",
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
    "ShardedUnfold",
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

import importlib.util  # noqa: E402

# timm's layers load on first use (``convert`` loads them, as does reading one of these names):
# importing timm takes seconds (torchvision, then torch's compiler), which every rank of every
# launch would pay in ``import sharded_nn`` otherwise. The names stay public and listed here.
_TIMM_LAYERS = {
    "ShardedTimmAttention": "timm_attention",
    "ShardedBatchNormAct2d": "timm_norm_act",
    "ShardedGroupNormAct": "timm_norm_act",
    "ShardedGroupNorm1Act": "timm_norm_act",
    "ShardedTimmGroupNorm": "timm_norm_act",
    "ShardedTimmGroupNorm1": "timm_norm_act",
    "ShardedConv2dSame": "timm_conv",
    "ShardedStdConv2dSame": "timm_conv",
    "ShardedScaledStdConv2dSame": "timm_conv",
    "ShardedBlurPool2d": "timm_conv",
}
if importlib.util.find_spec("timm") is not None:  # found without importing it
    __all__ += list(_TIMM_LAYERS)


def load_timm_layers() -> bool:
    """Import (and so register with ``convert``) the sharded classes of timm's layers.

    Returns False where timm is not installed (then no timm module can be in a model either).
    """
    import importlib

    try:
        for mod in sorted(set(_TIMM_LAYERS.values())):
            importlib.import_module(f"{__name__}.{mod}")
    except ImportError:
        return False
    return True


def __getattr__(name: str):
    if name in _TIMM_LAYERS:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_TIMM_LAYERS[name]}"), name, None)
        if value is not None:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
