"""The ranks along one mesh axis, seen from this rank: the facts point-to-point code needs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import axis_global_ranks, axis_group, axis_index


@dataclass(frozen=True)
class AxisRing:
    """This rank's place on one mesh axis.

    Attributes:
        group: the process group of the axis through this rank.
        index: this rank's coordinate on the axis.
        ranks: global ranks along the axis, indexed by coordinate.
    """

    group: dist.ProcessGroup
    index: int
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def left(self, periodic: bool) -> int | None:
        """Coordinate of the left neighbour, or None at a non-periodic edge."""
        if self.index > 0:
            return self.index - 1
        return self.size - 1 if periodic else None

    def right(self, periodic: bool) -> int | None:
        """Coordinate of the right neighbour, or None at a non-periodic edge."""
        if self.index < self.size - 1:
            return self.index + 1
        return 0 if periodic else None

    @property
    def device(self) -> torch.device:
        return comm_device(self.group)


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Device that the group's backend communicates from (NCCL needs CUDA tensors)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@cache
def axis_ring(mesh: DeviceMesh, axis: str) -> AxisRing:
    """The ``AxisRing`` of ``axis``; cached per mesh (no collective, same on every rank)."""
    return AxisRing(axis_group(mesh, axis), axis_index(mesh, axis), axis_global_ranks(mesh, axis))
