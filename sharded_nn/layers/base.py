"""What every sharded layer shares: mesh options, ``from_module``, ``extra_repr``."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ShardingError
from ..mesh import domain_axes


class ShardedMixin:
    """Mixin for ``Sharded<TorchName>(TorchName)`` classes.

    Subclasses set ``_spatial_dims`` (spatial dims the torch layer has, e.g. 3 for Conv3d) and
    call ``_init_sharding`` from ``__init__``. The default sharded tensor dims are the first
    spatial dims, one per domain axis of the mesh: ``(2,)`` for a 1-D domain, ``(2, 3)`` for 2-D.
    """

    _spatial_dims: int = 1

    def _init_sharding(self, mesh: DeviceMesh, dims: Sequence[int] | int | None) -> None:
        name = type(self).__name__
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"{name}: mesh must be a torch DeviceMesh, got {type(mesh).__name__}.")
        axes = domain_axes(mesh)
        if dims is None:
            dims = tuple(range(2, 2 + len(axes)))
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        if len(dims) > len(axes):
            raise ShardingError(
                f"{name}: dims={dims} shards {len(dims)} dims but the mesh has {len(axes)} domain axes {axes}."
            )
        bad = [d for d in dims if not 2 <= d < 2 + self._spatial_dims]
        if bad:
            raise ShardingError(
                f"{name}: dims={dims} includes {bad}, which are not spatial dims of a "
                f"{self._spatial_dims}-d layer on (N, C, ...) input (valid: 2..{1 + self._spatial_dims}). "
                f"Pass dims=... naming spatial dims, or use a mesh with fewer domain axes."
            )
        self.mesh = mesh
        self.dims = dims
        self.mesh_axes = axes[: len(dims)]

    @classmethod
    def from_module(cls, module: nn.Module, mesh: DeviceMesh, **options):
        """A sharded copy of ``module`` that shares its parameters, buffers and hooks."""
        new = cls.__new__(cls)
        # Shallow copies of the module's registries: same Parameter objects (so state_dict keys
        # and values are unchanged), independent containers.
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
        new._init_sharding(mesh, **options)
        return new

    def sharding_repr(self) -> str:
        return f"mesh_axes={self.mesh_axes}, dims={self.dims}"
