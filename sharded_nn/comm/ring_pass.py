"""Ring pass: send tensors to the right neighbour, receive as many from the left, asynchronously.

Ring attention circulates key/value blocks (and, in backward, their gradient accumulators)
around the ranks of the domain group. ``ring_pass`` starts one hop and returns a handle at once,
so the caller computes on the block it holds while the next block travels (double buffering:
the block in hand and the one being received). Receive buffers are sized by the caller from a
layout every rank shares, which is what lets slabs of uneven length travel.

A domain of several mesh axes is flattened row-major into one ring (``domain_peers``), the same
order in which ``shard`` deals out slabs of the flat domain group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .collectives import all_gather_stacked
from .peers import AxisPeers, domain_peers, domain_ring  # noqa: F401 - domain_ring: deprecated alias


def gather_ints(values: Sequence[int], ring: AxisPeers) -> list[tuple[int, ...]]:
    """Every ring rank's ``values`` (same count on every rank), indexed by ring coordinate.

    One tiny all-gather; layers validate shapes from its result so that all ranks agree. It
    travels on the CPU over gloo (``ring.meta_group``, or ``ring.group`` when that is gloo), so
    that it never synchronises a GPU; only a ring without a gloo group (an NCCL ``AxisPeers``
    built by hand) gathers on the device.
    """
    if ring.size == 1:
        return [tuple(values)]
    group = ring.meta_group
    if group is None:
        group = ring.group
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else ring.device
    # Each row starts with the sender's ring coordinate: the metadata group may order its ranks
    # differently from the ring.
    mine = torch.tensor([ring.index, *values], dtype=torch.int64, device=device)
    rows = all_gather_stacked(mine, group).tolist()
    out: list[tuple[int, ...]] = [()] * ring.size
    for r in rows:
        out[r[0]] = tuple(r[1:])
    return out


class RingHandle:
    """One hop in flight, started by ``ring_pass``; ``wait()`` returns the received tensors.

    ``wait_received()`` completes only the receives: the caller can compute on what arrived
    while the right neighbour is still copying what this rank sent (a send completes when the
    peer has read it, and the peer reads when it is ready to, which may be a whole block's
    computation later). The sent tensors must stay alive and unchanged until ``wait()``.
    """

    def __init__(self, works: list, received: list[torch.Tensor], sent: list[torch.Tensor],
                 sends: int | None = None, recvs: int | None = None) -> None:
        # The sent tensors are kept alive until the hop completes. ``sends``, ``recvs``: the
        # messages started (empty tensors travel as none; default: all of them).
        self._works, self._received, self._sent = works, received, sent
        self._sends = len(sent) if sends is None else sends
        self._recvs = len(received) if recvs is None else recvs

    def wait_received(self) -> list[torch.Tensor]:
        """Complete the receives (the sends may still be in flight) and return what arrived."""
        # ``ring_pass`` issues the sends first, one work per message; a backend that returns
        # one work for the whole batch (NCCL's coalesced batch) completes everything here.
        n = self._sends
        if len(self._works) == n + self._recvs:
            recvs, self._works = self._works[n:], self._works[:n]
        else:
            recvs, self._works = self._works, []
        for w in recvs:
            w.wait()
        return self._received

    def wait(self) -> list[torch.Tensor]:
        """Complete the whole hop (sends and receives) and return what arrived."""
        for w in self._works:
            w.wait()
        self._works, self._sent = [], []
        return self._received


def ring_pass(
    ring: AxisPeers,
    send: Sequence[torch.Tensor],
    recv_shapes: Sequence[Sequence[int]],
    *,
    tag: int | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> RingHandle:
    """Start sending ``send`` to the right neighbour and receiving tensors from the left one.

    Args:
        ring: the ranks (``axis_peers`` or ``domain_peers``); the ring is periodic.
        send: tensors to send, in order; each is sent as one message.
        recv_shapes: shapes of the tensors the left neighbour sends (same dtypes and devices as
            ``send``, in the same order).
        tag: first of ``len(send)`` message tags, reserved with ``ring.next_tags``; ``None``
            reserves a fresh block now. A caller that reuses one block for successive hops must
            wait for each hop before starting the next one with the same tags.
        out: contiguous tensors to receive into (shapes ``recv_shapes``) instead of new ones, so
            that a result can land in its final buffer without a copy.

    Returns:
        A handle; ``wait()`` gives the received tensors. With one rank the sent tensors come
        back as they are (a rank is its own neighbour).
    """
    if len(send) != len(recv_shapes):
        raise ValueError(f"ring_pass: {len(send)} tensors to send but {len(recv_shapes)} receive shapes.")
    if tag is None:
        # Reserved on every rank, also with one rank, so that the group's counters stay in step.
        tag = ring.next_tags(len(send))
    if ring.size == 1:
        if out is not None:
            return RingHandle([], [r.copy_(t) for r, t in zip(out, send)], [])
        return RingHandle([], list(send), [])
    if out is None:
        received = [torch.empty(tuple(s), dtype=t.dtype, device=t.device) for t, s in zip(send, recv_shapes)]
    else:
        received = list(out)
        for r, s in zip(received, recv_shapes):
            if tuple(r.shape) != tuple(s) or not r.is_contiguous():
                raise ValueError(f"ring_pass: out must be contiguous with shape {tuple(s)}, got {tuple(r.shape)}.")
    sent = [t.contiguous() for t in send]
    # Every rank issues its sends before its receives, in the same order; NCCL matches by issue
    # order and gloo (and the same-host transport) by tag, so both pair the messages correctly
    # even when left == right (see peers.py for what overlapping hops need on each backend).
    rp, lp = ring.right(True), ring.left(True)
    # Empty tensors (an empty slab's block) travel as no message: both ends know the shapes.
    sends = [(t, rp, True, tag + i) for i, t in enumerate(sent) if t.numel()]
    recvs = [(r, lp, False, tag + i) for i, r in enumerate(received) if r.numel()]
    return RingHandle(ring.start_p2p(sends + recvs), received, sent, len(sends), len(recvs))
