"""timm's fused norm(+drop+activation) layers over slabs: statistics over the whole sample.

timm models use their own subclasses of the torch norms (``BatchNormAct2d`` in EfficientNet,
MobileNetV3, RegNet, ...; ``GroupNormAct`` / ``GroupNorm1Act`` and the plain ``GroupNorm`` /
``GroupNorm1`` in NFNets, ResNetV2, PoolFormer, ...). ``convert`` swaps classes by exact type,
so each gets its sharded class here: the statistics come from the sharded norm of the torch
base class (one all-gather of the per-slab moments over the domain ranks, and the data ranks
for BatchNorm), then timm's own ``drop`` and ``act`` children run on the slab (both pointwise).

Sharding contract (every class here): the same as the torch base class's sharded version
(``ShardedBatchNorm2d``: ``(N, C, H, W)`` sharded along H (and W); ``ShardedGroupNorm``:
``(N, C, *spatial)`` sharded along its spatial dims); the output is this rank's slab. The
state_dict keys are timm's. Only loaded when timm is installed.
"""

from __future__ import annotations

import torch

from ..registry import register
from .norm import ShardedBatchNorm2d, ShardedGroupNorm

__all__: list[str] = []

try:
    from timm.layers import norm as _timm_norm
    from timm.layers import norm_act as _timm_norm_act
except ImportError:  # timm is optional
    _timm_norm = _timm_norm_act = None


if _timm_norm_act is not None:

    @register(_timm_norm_act.BatchNormAct2d)
    class ShardedBatchNormAct2d(ShardedBatchNorm2d, _timm_norm_act.BatchNormAct2d):
        """timm ``BatchNormAct2d``: sharded batch norm (global batch statistics), then drop, act."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
            return self.act(self.drop(ShardedBatchNorm2d.forward(self, x)))

    @register(_timm_norm_act.GroupNormAct)
    class ShardedGroupNormAct(ShardedGroupNorm, _timm_norm_act.GroupNormAct):
        """timm ``GroupNormAct``: sharded group norm (statistics over the whole sample), drop, act."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
            return self.act(self.drop(ShardedGroupNorm.forward(self, x)))

    @register(_timm_norm_act.GroupNorm1Act)
    class ShardedGroupNorm1Act(ShardedGroupNorm, _timm_norm_act.GroupNorm1Act):
        """timm ``GroupNorm1Act`` (one group): sharded group norm, then drop, act."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
            return self.act(self.drop(ShardedGroupNorm.forward(self, x)))

    @register(_timm_norm.GroupNorm)
    class ShardedTimmGroupNorm(ShardedGroupNorm, _timm_norm.GroupNorm):
        """timm ``GroupNorm`` (its fast-norm switch aside, torch's): sharded group norm."""

        forward = ShardedGroupNorm.forward

    @register(_timm_norm.GroupNorm1)
    class ShardedTimmGroupNorm1(ShardedGroupNorm, _timm_norm.GroupNorm1):
        """timm ``GroupNorm1`` (one group over C and every position): sharded group norm."""

        forward = ShardedGroupNorm.forward

    __all__ += [
        "ShardedBatchNormAct2d",
        "ShardedGroupNorm1Act",
        "ShardedGroupNormAct",
        "ShardedTimmGroupNorm",
        "ShardedTimmGroupNorm1",
    ]
