"""The ranks along one mesh axis, seen from this rank, and the message tags of their exchanges.

``AxisPeers`` serves every point-to-point pattern of sharded_nn: open halo chains (the first and
last rank have one neighbour each), periodic rings (circular padding, ring attention) and the
all-pairs exchange of Ulysses attention.

Message tags. Several exchanges may be in flight on one process group at a time (an async halo
exchange of one layer while another layer communicates; key/value blocks and their gradient
accumulators in ring attention). Tags come from one place: ``AxisPeers.next_tags(n)`` hands out
a fresh block of ``n`` tags from a counter kept per process group. Every rank of the group
advances the counter identically because every rank makes the same exchanges in the same program
order (SPMD). Each exchange reserves the tags of its backward at forward time, so the backward
messages match on gloo even when autograd issues them in another order on another rank; tags are
reused only after ``_TAG_SPAN`` reservations (millions of exchanges), long after those messages
completed.

Backends: gloo matches messages by (peer, tag), so distinct tags make overlapping exchanges
safe whatever order they are issued in. NCCL ignores tags and matches the point-to-point
operations of a pair of ranks by issue order: there, overlapping exchanges stay correct only
while every rank issues them in the same order, which holds for forward (program order) and for
backward when autograd runs the same graph in the same order on every rank (the same model, one
device per rank). sharded_nn's own layers satisfy both.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import axis_global_ranks, axis_group, axis_index, domain_axes, domain_group, mesh_cached
from . import local_transport
from .sizes import metadata_group
from .traffic import record_sends

#: Tags handed out by ``next_tags`` lie in ``[_TAG_BASE, _TAG_BASE + _TAG_SPAN)``: clear of the
#: small tags a user's own point-to-point code may use on the same group, and within gloo's
#: (32-bit) tag range.
_TAG_BASE = 1 << 20
_TAG_SPAN = 1 << 24


class _TagCounter:
    """Tags reserved so far on one process group (thread-safe; one per group)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> int:
        with self._lock:
            start = self._next
            # A block never straddles the wrap-around, so its n tags are consecutive.
            if start + n > _TAG_SPAN:
                start = 0
            self._next = start + n
        return _TAG_BASE + start


#: One counter per process group object (the key is weak, so a destroyed group's counter goes
#: with it; a group built after ``destroy_process_group`` starts a new counter on every rank).
_COUNTERS: weakref.WeakKeyDictionary[dist.ProcessGroup, _TagCounter] = weakref.WeakKeyDictionary()
_COUNTERS_LOCK = threading.Lock()


def _counter(group: dist.ProcessGroup) -> _TagCounter:
    with _COUNTERS_LOCK:
        c = _COUNTERS.get(group)
        if c is None:
            c = _COUNTERS[group] = _TagCounter()
        return c


@dataclass(frozen=True)
class AxisPeers:
    """This rank's place on one mesh axis: its neighbours for halo chains and rings.

    Attributes:
        group: the process group of the axis through this rank.
        index: this rank's coordinate on the axis.
        ranks: global ranks along the axis, indexed by coordinate.
        meta_group: a gloo group over the same ranks for CPU metadata (``gather_ints``), or
            None where ``group`` itself is used.
    """

    group: dist.ProcessGroup
    index: int
    ranks: tuple[int, ...]
    meta_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    _tags: _TagCounter = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    #: Per peer coordinate: whether the same-host transport can reach it (a fact of the group and
    #: the hosts, fixed for the group's life; asked once, not per message).
    _local: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self._tags is None:
            object.__setattr__(self, "_tags", _counter(self.group))

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
        """Coordinate of the left neighbour, or None at the open end of a non-periodic chain."""
        if self.index > 0:
            return self.index - 1
        return self.size - 1 if periodic else None

    def right(self, periodic: bool) -> int | None:
        """Coordinate of the right neighbour, or None at the open end of a non-periodic chain."""
        if self.index < self.size - 1:
            return self.index + 1
        return 0 if periodic else None

    @property
    def device(self) -> torch.device:
        return comm_device(self.group)

    @functools.cached_property
    def matches_by_tag(self) -> bool:
        """Whether the backend pairs point-to-point messages by (peer, tag) (gloo), so that an
        exchange may be issued at different points of the program on different ranks; NCCL
        pairs them by issue order. A fact of the group, the same on every rank."""
        return dist.get_backend(self.group) == "gloo"

    @functools.cached_property
    def group_ranks(self) -> tuple[int, ...]:
        """Each coordinate's rank within ``group`` (what ``ProcessGroup.send``/``recv`` take)."""
        return tuple(dist.get_group_rank(self.group, r) for r in self.ranks)

    @functools.cached_property
    def _direct_p2p(self) -> bool:
        """Whether ``start_p2p`` may call the process group itself: on a backend that does not
        coalesce point-to-point operations (gloo), ``dist.batch_isend_irecv`` issues them one
        by one through ``isend``/``irecv`` anyway; NCCL coalesces them, so it keeps torch's path."""
        if dist.get_backend(self.group) != "gloo":
            return False
        backend = self.group._get_backend(torch.device("cpu"))
        return not getattr(backend, "supports_coalescing", False)

    def start_p2p(self, ops: list[tuple[torch.Tensor, int, bool, int]]) -> list:
        """Start point-to-point operations ``(tensor, peer coordinate, is_send, tag)``, in order.

        The same messages, in the same order, as ``dist.batch_isend_irecv`` of the matching
        ``P2POp`` list; on gloo they go straight to ``ProcessGroup.send``/``recv``, skipping
        torch's per-op argument checks and rank translation (P=2, 16x64 floats each way: about
        70 us less caller CPU per exchange, 15-35% of a round trip, ``bench/comm_latency.py``'s
        host). Messages of at most ``local_transport.max_bytes()`` to a peer on this host travel
        through ``comm/local_transport.py`` instead (no gloo thread hand-offs; off with
        ``SHARDED_NN_TRANSPORT=gloo``). ``comm.traffic.count_traffic`` counts them as one
        ``batch_isend_irecv`` call.

        Returns:
            The works to wait on (empty when ``ops`` is): ``dist.Work`` or the transport's
            works, both with ``wait()``.
        """
        if not ops:
            return []
        # Under torch.compile the process group is an opaque script object whose methods dynamo
        # cannot call: torch's own P2P path is traceable.
        if torch.compiler.is_compiling() or not self._direct_p2p:
            return dist.batch_isend_irecv(
                [dist.P2POp(dist.isend if send else dist.irecv, t, self.ranks[peer], group=self.group, tag=tag)
                 for t, peer, send, tag in ops]
            )
        record_sends([t for t, _, send, _ in ops if send])
        group, granks, ranks = self.group, self.group_ranks, self.ranks
        limit = local_transport.p2p_limit()  # -1 with the transport off or under compile
        works: list = []
        routed: list = []  # (index in works, transport op)
        for t, peer, send, tag in ops:
            if t.is_complex():
                t = torch.view_as_real(t.resolve_conj())  # a conjugate view to send has no real view
            # Small messages to a peer on this host: the caller-thread transport (the same
            # decision on both ends: a receive buffer has the size of the message).
            nbytes = t.numel() * t.element_size()
            if nbytes <= limit and t.device.type == "cpu" and t.is_contiguous() and self._is_local(peer):
                routed.append((len(works), (t, ranks[peer], send, tag)))
                works.append(None)
            else:
                works.append(group.send([t], granks[peer], tag) if send else group.recv([t], granks[peer], tag))
        if routed:
            # Issued after gloo's: the two channels match messages independently (each by its own
            # tags), and each keeps its own order.
            for (i, _), w in zip(routed, local_transport.start_p2p(group, [op for _, op in routed])):
                works[i] = w
        return works

    def _is_local(self, peer: int) -> bool:
        ok = self._local.get(peer)
        if ok is None:
            ok = self._local[peer] = local_transport.peer_is_local(self.group, self.ranks[peer])
        return ok

    def next_tags(self, n: int) -> int:
        """Reserve ``n`` consecutive message tags on this group; returns the first.

        Every rank of the group must reserve the same blocks in the same order (call this from
        code that runs identically on every rank, at the same point of the program), and do it
        even when it has nothing to send, so that the counters stay in step.
        """
        return self._tags.take(n)


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Device that the group's backend communicates from (NCCL needs CUDA tensors)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def axis_peers(mesh: DeviceMesh, axis: str) -> AxisPeers:
    """The ``AxisPeers`` of ``axis``; stored on this mesh object (no collective, same on every rank)."""
    return mesh_cached(
        mesh, ("axis_peers", axis),
        lambda: AxisPeers(axis_group(mesh, axis), axis_index(mesh, axis), axis_global_ranks(mesh, axis)),
    )


def domain_peers(mesh: DeviceMesh) -> AxisPeers:
    """The ring over all domain ranks of ``mesh``; several domain axes are flattened row-major.

    Flattening creates a process group the first time (a collective that every rank reaches in
    the same order, see ``mesh_cached``). The result carries the gloo metadata group of the
    domain (``metadata_group``), so that ``gather_ints`` never synchronises a GPU.
    """

    def make() -> AxisPeers:
        group = domain_group(mesh)
        ranks = tuple(dist.get_global_rank(group, i) for i in range(dist.get_world_size(group)))
        return AxisPeers(group, dist.get_rank(group), ranks, metadata_group(mesh))

    return mesh_cached(mesh, ("domain_peers",), make)


#: Deprecated names (the class serves open halo chains as well as rings): use ``AxisPeers``,
#: ``axis_peers`` and ``domain_peers``.
AxisRing = AxisPeers
axis_ring = axis_peers
domain_ring = domain_peers
