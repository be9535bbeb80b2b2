"""Squeeze-excite family: timm's ``SEModule``/``EffectiveSEModule``/``SqueezeExcite``/``EcaModule``/
``CecaModule`` and torchvision's ``SqueezeExcitation``, registered with ``convert``.

These blocks pool the whole slab to one value per channel (``x.mean((2, 3))`` or an adaptive
pool), run a small network on the pooled (replicated) features, and scale the slab by the result.
Their sharded form keeps the block's own ``forward`` and leaves its children *unconverted*: the
convolutions (ECA's ``Conv1d`` runs along channels, not positions) act on replicated features,
where a sharded layer would wrongly treat the channel axis or a 1x1 map as a slab. The pooling
call is computed exactly by the forward guard (``sharded_nn.forward_guard``), which routes the
mean over the sharded dims through ``sharded_nn.reductions`` (an all-reduce; the gradient
follows the library's convention). So these classes run only under the guard: called without
it (``convert(..., guard=False)``) they raise instead of computing a per-slab mean.

Sharding contract:
    input: ``(N, C, S0, S1)`` sharded along the model's sharded dims; output: the same layout.
    forward: one all-reduce of ``(N, C)`` sums; backward: one all-reduce (the guard's routed mean).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ShardingError
from ..forward_guard import guard_active
from ..mesh import one_rank
from ..registry import register

__all__ = ["GuardedAsIs", "register_guarded", "register_loaded"]


class GuardedAsIs:
    """Mixin: the module's own forward, children unconverted, run under the forward guard."""

    #: Tells the guard to keep checking (and routing) the calls inside this module.
    _guard_inside = True

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, **options):
        """A copy of ``module`` (same parameters) whose children stay unconverted."""
        if options:
            raise TypeError(f"{cls.__name__}.from_module takes no options, got {sorted(options)}.")
        new = cls.__new__(cls)
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new.mesh = mesh
        return new

    def forward(self, *args, **kwargs):  # noqa: D102
        # A one-rank domain holds whole tensors: pooling the slab is pooling the sample, with
        # or without the guard (which then has nothing to do and installs no entry methods).
        if not guard_active() and not one_rank(self.mesh):
            raise ShardingError(
                f"{type(self).__name__}: this block pools the whole slab in its own forward and is exact only under "
                "the forward guard that convert installs on the converted root model. Call the converted root "
                "model (not the block on its own), and do not pass guard=False to convert."
            )
        return super().forward(*args, **kwargs)

    def sharding_repr(self) -> str:
        return "children unconverted; pooled under the forward guard"


def register_guarded(torch_cls: type[nn.Module]) -> type[nn.Module]:
    """Register ``Sharded<Name>``: ``torch_cls`` run as is under the guard, children unconverted."""
    cls = type(f"Sharded{torch_cls.__name__}", (GuardedAsIs, torch_cls), {"__module__": __name__})
    register(torch_cls)(cls)
    return cls


_TARGETS = (
    ("timm.layers.squeeze_excite", ("SEModule", "EffectiveSEModule", "SqueezeExcite")),
    ("timm.models._efficientnet_blocks", ("SqueezeExcite",)),
    ("timm.layers.eca", ("EcaModule", "CecaModule")),
    ("torchvision.ops.misc", ("SqueezeExcitation",)),
)



def register_loaded() -> None:
    """Register the blocks of ``_TARGETS`` whose libraries are loaded (a model can only hold them then).

    Called by ``convert``; importing nothing keeps ``import sharded_nn`` cheap.
    """
    import sys

    from ..registry import registered

    for mod_name, names in _TARGETS:
        mod = sys.modules.get(mod_name)
        for name in names if mod else ():
            cls = getattr(mod, name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module) and registered(cls) is None:
                register_guarded(cls)
