"""Ring pass: send tensors to the right neighbour, receive as many from the left, asynchronously.

Ring attention circulates key/value blocks (and, in backward, their gradient accumulators)
around the ranks of the domain group. ``ring_pass`` starts one hop and returns a handle at once,
so the caller computes on the block it holds while the next block travels (double buffering:
the block in hand and the one being received). Receive buffers are sized by the caller from a
layout every rank shares, which is what lets slabs of uneven length travel.

A domain of several mesh axes is flattened row-major into one ring (``domain_ring``), the same
order in which ``shard`` deals out slabs of the flat domain group.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import domain_axes, domain_group
from .collectives import all_gather_stacked
from .ring import AxisRing, axis_ring


@cache
def domain_ring(mesh: DeviceMesh) -> AxisRing:
    """The ring over all domain ranks of ``mesh``; several domain axes are flattened row-major."""
    axes = domain_axes(mesh)
    if len(axes) == 1:
        return axis_ring(mesh, axes[0])
    group = domain_group(mesh)
    ranks = tuple(dist.get_global_rank(group, i) for i in range(dist.get_world_size(group)))
    return AxisRing(group, dist.get_rank(group), ranks)


def gather_ints(values: Sequence[int], ring: AxisRing) -> list[tuple[int, ...]]:
    """Every ring rank's ``values`` (same count on every rank), indexed by ring coordinate.

    One tiny all-gather; layers validate shapes from its result so that all ranks agree.
    """
    mine = torch.tensor(list(values), dtype=torch.int64, device=ring.device)
    if ring.size == 1:
        return [tuple(values)]
    rows = all_gather_stacked(mine, ring.group).tolist()
    return [tuple(r) for r in rows]


class RingHandle:
    """One hop in flight, started by ``ring_pass``; ``wait()`` returns the received tensors."""

    def __init__(self, works: list[dist.Work], received: list[torch.Tensor], sent: list[torch.Tensor]) -> None:
        # The sent tensors are kept alive until the hop completes.
        self._works, self._received, self._sent = works, received, sent

    def wait(self) -> list[torch.Tensor]:
        for w in self._works:
            w.wait()
        self._works, self._sent = [], []
        return self._received


def ring_pass(
    ring: AxisRing,
    send: Sequence[torch.Tensor],
    recv_shapes: Sequence[Sequence[int]],
    *,
    tag: int = 0,
    out: Sequence[torch.Tensor] | None = None,
) -> RingHandle:
    """Start sending ``send`` to the right neighbour and receiving tensors from the left one.

    Args:
        ring: the ranks (``axis_ring`` or ``domain_ring``); the ring is periodic.
        send: tensors to send, in order; each is sent as one message.
        recv_shapes: shapes of the tensors the left neighbour sends (same dtypes and devices as
            ``send``, in the same order).
        tag: base message tag. Two hops in flight at the same time (key/value blocks and their
            gradient accumulators) need base tags at least ``len(send)`` apart, because gloo
            matches messages by (peer, tag).
        out: contiguous tensors to receive into (shapes ``recv_shapes``) instead of new ones, so
            that a result can land in its final buffer without a copy.

    Returns:
        A handle; ``wait()`` gives the received tensors. With one rank the sent tensors come
        back as they are (a rank is its own neighbour).
    """
    if len(send) != len(recv_shapes):
        raise ValueError(f"ring_pass: {len(send)} tensors to send but {len(recv_shapes)} receive shapes.")
    if ring.size == 1:
        if out is not None:
            return RingHandle([], [r.copy_(t) for r, t in zip(out, send)], [])
        return RingHandle([], list(send), [])
    right, left = ring.ranks[ring.right(True)], ring.ranks[ring.left(True)]
    if out is None:
        received = [torch.empty(tuple(s), dtype=t.dtype, device=t.device) for t, s in zip(send, recv_shapes)]
    else:
        received = list(out)
        for r, s in zip(received, recv_shapes):
            if tuple(r.shape) != tuple(s) or not r.is_contiguous():
                raise ValueError(f"ring_pass: out must be contiguous with shape {tuple(s)}, got {tuple(r.shape)}.")
    sent = [t.contiguous() for t in send]
    ops = []
    # Every rank issues its sends before its receives, in the same order; NCCL matches by issue
    # order and gloo by tag, so both pair the messages correctly even when left == right.
    for i, t in enumerate(sent):
        ops.append(dist.P2POp(dist.isend, t, right, group=ring.group, tag=tag + i))
    for i, r in enumerate(received):
        ops.append(dist.P2POp(dist.irecv, r, left, group=ring.group, tag=tag + i))
    return RingHandle(dist.batch_isend_irecv(ops), received, sent)
