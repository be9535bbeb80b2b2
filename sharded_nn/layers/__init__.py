"""Sharded layers. Importing this package registers them with ``convert``."""

from .conv import ShardedConv1d, ShardedConv2d, ShardedConv3d

__all__ = ["ShardedConv1d", "ShardedConv2d", "ShardedConv3d"]
