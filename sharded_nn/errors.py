"""Exceptions raised by sharded_nn.

Every sharded layer validates its input from facts that all ranks share (module configuration
and the gathered slab sizes), so that all ranks raise the same error together instead of one
rank raising while the others wait in a collective.
"""

from __future__ import annotations


class ShardingError(ValueError):
    """Bad sharded input: a misaligned or empty slab, a halo wider than a neighbour's slab, ..."""


class ShardingNotImplementedError(NotImplementedError):
    """A valid torch configuration that sharded_nn cannot shard (yet)."""


class ShardingWarning(UserWarning):
    """A layer left unconverted that may compute a wrong answer on slabs."""
