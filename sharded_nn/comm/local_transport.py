"""Same-host transport for the small CPU messages of gloo groups, run on the caller's thread.

Why: a gloo exchange of a few bytes between two processes of one host costs about three thread
hand-offs (the caller queues the operation, gloo's loop thread wakes on epoll, reads, and wakes
the caller): 460-600 us at P=2 on a shared 2-vCPU host, against 173-226 us for a plain blocking
socket round trip between the same processes (``bench/comm_latency.py``). A converted CNN makes
about 130 such round trips per training step at P=2 (norm statistics, squeeze-excite sums, halo
exchanges, one layout all-gather), so at moderate resolutions they dominate.

What: messages of at most ``max_bytes()`` bytes (``SHARDED_NN_TRANSPORT_MAX_BYTES``, 256 KiB by
default) between CPU tensors of gloo groups whose peers run on this host travel over Unix domain
stream sockets instead: one connection per pair of processes (abstract namespace, a random name
per process published in the default group's store), shared by all groups. Everything runs on
the calling thread: sends write without blocking and queue what the socket does not take; every
later transport call and every ``wait`` flushes queued sends and reads incoming messages in one
``poll`` loop, so two ranks that send to each other never deadlock. A waiting rank first polls
without sleeping for up to ``spin_seconds()`` and then sleeps in ``poll`` (see there: waking a
sleeping process costs a virtual machine tens of microseconds per message; spinning happens only
where every rank has a core of its own). Larger messages, NCCL/CUDA tensors, peers on other
hosts and code under ``torch.compile`` keep using torch.distributed.

Large messages (ring attention's key/value blocks, the 1 MiB halo planes of a 3-D UNet): above
``max_bytes()`` and up to ``shm_max_bytes()`` (``SHARDED_NN_TRANSPORT_SHM_MAX_BYTES``, 64 MiB by
default, 0 turns both paths below off; the same on every rank) a point-to-point payload skips the
socket. Where the kernel lets a rank read its peer's memory (``process_vm_readv``: the same user,
and no Yama ``ptrace_scope`` or seccomp rule against it; probed once per pair by reading a random
token the peer announces), the sender sends only a 24-byte descriptor (address, size, sequence
number) and keeps its tensor; the receiver copies the payload straight into its receive buffer
(at once when the receive is posted, else into a buffer of its own as the descriptor arrives, so
that the sender never waits for a receive to be posted) and answers ``done``, which completes the
send. One copy in all, and no memory besides the two tensors: a ring hop of two 1.5 MiB tensors
each way at P=2 costs each rank 1.1 ms of wall and CPU time, against 1.7 ms through the arena
and 3.5 ms (2.9 ms of process CPU) through gloo (``bench/comm_latency.py --large``). The send's
tensor must stay unchanged until its ``wait`` (as on gloo; every caller waits for its sends).
``SHARDED_NN_TRANSPORT_DIRECT=0`` turns direct reads off.

Otherwise the payload travels through shared memory: the sender copies it into its *arena* (one
``memfd`` per process, mapped by each peer through ``/proc/<pid>/fd`` and checked by a random
token at its start; a few times the largest message in virtual size, allocated first fit from
the lowest offsets, so only the pages of the bytes in flight at once are ever touched) and sends
a 16-byte descriptor over the socket; the receiver copies the payload into the receive buffer (at
once when the receive is posted, else when it is) and gives the space back with a ``free``
message. One memcpy per side, on the callers' threads, instead of gloo's socket copies and thread
hand-offs; the price is the arena's resident pages (about twice the bytes in flight at once,
counted in both processes: 12 MiB per rank for vit_tiny at 1024^2, P=2). A send never waits for
arena space: until the peer has answered the announcement (the first messages to it), when the
arena is full, or when the peer can neither read our memory nor map the arena (no ``/proc``, a
hardened kernel, another pid namespace), the payload goes inline over the socket, queued like any
other send.

Matching. Each message carries ``(group id, tag, nbytes)``; the group id hashes the group's name
and global ranks (the same on every rank). Point-to-point messages match by (group, peer, tag)
as on gloo: a message that arrives before its receive is posted is stashed until asked for, so
exchanges issued in different orders on different ranks (backward) still pair correctly.
Collectives use a per-group sequence number as a tag in their own (negative) tag space: every
rank sends its tensor to every other member and reduces the tensors in group-rank order, so every
rank gets the bitwise same result (gloo's ring sums in another order: results agree with gloo up
to rounding, exactly for integers).

Why 256 KiB: larger messages are faster here too (1 MiB: 1.2 against 4.2 ms per exchange), but
nothing moves a queued send while its process computes or blocks in a gloo call; only the
process's next transport call does. A message that fits an empty socket buffer (about 416 KiB
with Linux's stock limits) is in the kernel as soon as it is sent, so below that limit a send
never waits on its own process.

The size rule is decidable identically on both ends: a receive buffer has the size of the message
sent into it, and collectives have the same shapes on every rank, so a message never waits on the
wrong path. ``SHARDED_NN_TRANSPORT_MAX_BYTES`` must therefore be the same on every rank.

Turning it off: ``SHARDED_NN_TRANSPORT=gloo`` (read at every call) sends everything through gloo.

Failures: every wait is bounded by the group's timeout (the ``timeout`` given to
``init_process_group``/``new_group``); a peer whose connection closes (exit, crash) raises a
``TransportError`` naming it at once, on every rank that talks to it.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import mmap
import os
import select
import socket
import struct
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import gloo_exit
from ..env import getenv

__all__ = [
    "TransportError",
    "collective_route",
    "enabled",
    "max_bytes",
    "p2p_route",
    "shm_max_bytes",
    "spin_seconds",
    "start_all_gather",
    "start_all_reduce",
    "start_p2p",
    "start_recv",
    "start_send",
]

#: ``SHARDED_NN_TRANSPORT``: ``local`` (default) routes small same-host CPU messages through this
#: module, ``gloo`` sends everything through torch.distributed.
ENV = "SHARDED_NN_TRANSPORT"
#: ``SHARDED_NN_TRANSPORT_MAX_BYTES``: largest payload routed here (must agree across ranks).
ENV_MAX_BYTES = "SHARDED_NN_TRANSPORT_MAX_BYTES"
_DEFAULT_MAX_BYTES = 256 * 1024
#: ``SHARDED_NN_TRANSPORT_SHM_MAX_BYTES``: largest point-to-point payload routed here through
#: shared memory (0: none; must agree across ranks). Larger ones use gloo.
ENV_SHM_MAX_BYTES = "SHARDED_NN_TRANSPORT_SHM_MAX_BYTES"
_DEFAULT_SHM_MAX_BYTES = 64 << 20
#: ``SHARDED_NN_TRANSPORT_DIRECT``: ``1`` (default) lets a receiver copy a large payload straight
#: out of the sender's tensor (``process_vm_readv``) where the kernel allows it; ``0`` keeps such
#: payloads on the arena.
ENV_DIRECT = "SHARDED_NN_TRANSPORT_DIRECT"
#: ``SHARDED_NN_TRANSPORT_SPIN_US``: how long a waiting rank polls without sleeping before it
#: sleeps in ``poll`` (microseconds; 0: never spin). Unset: ``_DEFAULT_SPIN_US`` where the ranks
#: of this host and their threads fit its cores, else 0.
ENV_SPIN_US = "SHARDED_NN_TRANSPORT_SPIN_US"
_DEFAULT_SPIN_US = 1000
#: Virtual size of a process's arena in multiples of the largest shared-memory message: room for
#: several messages in flight (a ring hop's key and value, both directions of a halo) before a
#: send falls back to the socket.
_ARENA_FACTOR = 4
#: Arena allocations start on cache-line boundaries.
_ARENA_ALIGN = 64
#: Socket buffers: several small messages in flight each way without queueing in user space.
_SOCK_BUF = 4 << 20
#: Header of every message: group id, tag (collectives: negative), payload bytes.
_HDR = struct.Struct("<QqQ")
#: First bytes on a new connection: magic, the connecting rank, reserved.
_HELLO = struct.Struct("<QqQ")
_MAGIC = 0x534E4E5452414E53  # "SNNTRANS"
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP
#: Header flag (in the byte count) of a shared-memory descriptor: the body is ``_DESC``.
_SHM_FLAG = 1 << 63
_DESC = struct.Struct("<QQ")  # arena offset, payload bytes
#: Header flag of a direct-read descriptor: the body is ``_DIRECT``.
_DIRECT_FLAG = 1 << 62
_DIRECT = struct.Struct("<QQQ")  # address in the sender, payload bytes, the sender's sequence number
#: Control messages (group id 0; the tag says which): the announcement of the large-message
#: paths, the peer's answer to it, the return of arena space, and the end of a direct read.
_CTL_ANNOUNCE, _CTL_REPLY, _CTL_FREE, _CTL_DONE = 1, 2, 3, 4
#: pid, arena fd (-1: none), arena bytes, the arena's token, address and bytes of the probe.
_ANNOUNCE = struct.Struct("<qqQ16sQ16s")
#: Bits of the answer: the peer mapped the arena; the peer read the probe (direct reads work).
_REPLY_ARENA, _REPLY_DIRECT = 1, 2
#: Bytes at the start of an arena that hold its random token (never allocated).
_TOKEN_BYTES = 64
_U64 = struct.Struct("<Q")


class TransportError(RuntimeError):
    """A peer of the same-host transport closed its connection, or a message did not arrive in time."""


def enabled() -> bool:
    """Whether the same-host transport may be used now (``SHARDED_NN_TRANSPORT``, platform, compile)."""
    mode = getenv(ENV, "local")
    if mode == "gloo":
        return False
    if mode not in ("local", ""):
        raise ValueError(f"{ENV}={mode!r}: expected 'local' (the default) or 'gloo' (turn the transport off).")
    # Abstract-namespace Unix sockets are Linux's; dynamo cannot trace socket calls.
    return _LINUX and not torch.compiler.is_compiling()


_LINUX = sys.platform.startswith("linux")


def max_bytes() -> int:
    """Largest payload (bytes) that travels through this transport; larger ones use gloo."""
    raw = getenv(ENV_MAX_BYTES)
    if not raw:
        return _DEFAULT_MAX_BYTES
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_MAX_BYTES}={raw!r}: expected a number of bytes (the same on every rank).") from None


def shm_max_bytes() -> int:
    """Largest point-to-point payload (bytes) that travels through shared memory (0: none)."""
    raw = getenv(ENV_SHM_MAX_BYTES)
    if not raw:
        return _DEFAULT_SHM_MAX_BYTES
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(
            f"{ENV_SHM_MAX_BYTES}={raw!r}: expected a number of bytes (0 turns shared memory off; the same on "
            "every rank)."
        ) from None


def spin_seconds() -> float:
    """How long a waiting rank polls its sockets without sleeping before it sleeps in ``poll``.

    Why: a process asleep in ``poll`` is woken by the peer's message through the kernel's
    scheduler, which on a virtual machine costs tens of microseconds (a vCPU that halted must be
    resumed): a one-byte socket round trip between two processes took 40-59 us sleeping against
    3.5-3.9 us polling on the 2-vCPU CI host. A converted CNN waits on a neighbour or a
    collective tens of times per forward, most waits far shorter than a millisecond. Spinning
    costs nothing where every rank has a core of its own (the core would idle), but where ranks
    share cores it takes the time of the rank being waited for, so by default a rank spins only
    when this host's ranks (``LOCAL_WORLD_SIZE``, as torchrun and ``snn.launch`` set it, else the
    world size) times their threads fit the cores this process may run on; a wait longer than
    the budget then sleeps, as before. ``SHARDED_NN_TRANSPORT_SPIN_US`` sets the budget (0: never).
    """
    raw = os.environ.get(ENV_SPIN_US)
    if raw:
        try:
            us = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_SPIN_US}={raw!r}: expected microseconds (0: never spin).") from None
        return max(us, 0) * 1e-6
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or dist.get_world_size())
    except (ValueError, RuntimeError):
        return 0.0
    return _DEFAULT_SPIN_US * 1e-6 if local * torch.get_num_threads() <= usable_cores() else 0.0


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


#: Counters of the messages sent by this process, by path (tests and benchmarks read them).
STATS = {"socket": 0, "shm": 0, "direct": 0, "inline large": 0}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def direct_enabled() -> bool:
    """Whether large payloads may be read straight from the sender's memory (``ENV_DIRECT``)."""
    raw = getenv(ENV_DIRECT, "1")
    if raw not in ("0", "1", ""):
        raise ValueError(f"{ENV_DIRECT}={raw!r}: expected 1 (direct reads where allowed, the default) or 0 (never).")
    return raw != "0"


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_VM_READV: list = []  # [process_vm_readv or None], looked up once


def _vm_readv():
    if not _VM_READV:
        fn = None
        try:
            fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        except (OSError, AttributeError):
            fn = None
        _VM_READV.append(fn)
    return _VM_READV[0]


def _read_peer(pid: int, remote: int, local: int, n: int) -> None:
    """Copy ``n`` bytes at address ``remote`` of process ``pid`` to address ``local`` of this one
    (``process_vm_readv``: one copy, no buffer in between); OSError when the kernel refuses."""
    fn = _vm_readv()
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    done = 0
    while done < n:
        lv, rv = _IoVec(local + done, n - done), _IoVec(remote + done, n - done)
        got = fn(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EIO
            raise OSError(err, os.strerror(err))
        done += got


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (kept valid by holding ``t``)."""
    n = _nbytes(t)
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


# --------------------------------------------------------------------------------------------
# Per-group facts (local, no communication).


@dataclass
class _Group:
    gid: int
    ranks: tuple[int, ...]  # global ranks in group-rank order
    index: int  # this rank's group rank
    timeout: float  # seconds
    gloo: bool
    seq: int = 0
    all_local: bool | None = None  # every member on this host (decided at the first collective)


#: id(group) -> (weak reference to the group, its facts). Probed on every routed message: a plain
#: dict and an identity test, not a ``WeakKeyDictionary`` (a Python-level ``get`` per probe). A
#: dead group's entry stays; a new group that reuses its id fails the test and replaces it.
_GROUPS: dict[int, tuple[weakref.ref, _Group]] = {}


def _group(group: dist.ProcessGroup | None) -> _Group:
    if group is None:
        group = dist.group.WORLD
    e = _GROUPS.get(id(group))
    if e is not None and e[0]() is group:
        return e[1]
    ranks = tuple(dist.get_process_group_ranks(group))
    gloo = dist.get_backend(group) == "gloo"
    timeout = 1800.0
    if gloo:
        try:
            timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            pass
    name = f"{group.group_name}|{ranks}".encode()
    gid = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")
    g = _Group(gid, ranks, ranks.index(dist.get_rank()), timeout, gloo)
    _GROUPS[id(group)] = (weakref.ref(group), g)
    return g


# --------------------------------------------------------------------------------------------
# Shared-memory arenas.


class _Arena:
    """This process's send arena: a ``memfd`` mapped here and by each peer, first-fit allocated.

    First fit from the lowest offsets: the same few MiB serve message after message, so the
    pages touched (the memory the arena really costs) stay those of the bytes in flight at once.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("sharded_nn-transport", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        # A random token at the start, which a peer checks after mapping: a pid seen from
        # another pid namespace (containers sharing the network namespace) could name some
        # other process's file, whose bytes must never be read as messages.
        self.token = uuid.uuid4().bytes
        self.mm[: len(self.token)] = self.token
        self.free: list[list[int]] = [[_TOKEN_BYTES, size]]  # sorted, disjoint [start, end)
        self.used: dict[int, int] = {}  # offset -> bytes held

    def alloc(self, n: int) -> int | None:
        need = -(-n // _ARENA_ALIGN) * _ARENA_ALIGN
        for i, (a, b) in enumerate(self.free):
            if b - a >= need:
                if b - a == need:
                    del self.free[i]
                else:
                    self.free[i][0] = a + need
                self.used[a] = need
                return a
        return None

    def release(self, off: int) -> None:
        need = self.used.pop(off, None)
        if need is None:
            return  # a stale free (a connection reset meanwhile)
        a, b = off, off + need
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < a:
            i += 1
        if i > 0 and free[i - 1][1] == a:
            i -= 1
            free[i][1] = b
        else:
            free.insert(i, [a, b])
        if i + 1 < len(free) and free[i + 1][0] == free[i][1]:
            free[i][1] = free[i + 1][1]
            del free[i + 1]


class _PeerArena:
    """A peer's arena mapped here (read side)."""

    def __init__(self, pid: int, fd: int, size: int, token: bytes) -> None:
        # The peer's memfd through procfs: a new open of the same memory (same user, no ptrace).
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
        try:
            # Mapping past the end of a file would fault on access (SIGBUS): check the size first.
            if os.fstat(f).st_size != size:
                raise OSError(f"/proc/{pid}/fd/{fd} is not the announced arena (size differs)")
            self.mm = mmap.mmap(f, size, prot=mmap.PROT_READ)
        finally:
            os.close(f)
        if self.mm[: len(token)] != token:
            self.mm.close()
            raise OSError(f"/proc/{pid}/fd/{fd} is not the announced arena (token differs)")
        self.size = size
        self.view = memoryview(self.mm)

    def body(self, off: int, n: int) -> memoryview:
        if off + n > self.size:
            raise TransportError(f"sharded_nn transport: a descriptor points past the peer's arena ({off} + {n}).")
        return self.view[off : off + n]


def _map_peer_arena(pid: int, fd: int, size: int, token: bytes) -> _PeerArena:
    return _PeerArena(pid, fd, size, token)


def _probe_peer(pid: int, addr: int, token: bytes) -> bool:
    """Whether this process may read process ``pid``'s memory: the peer's probe bytes at ``addr``
    read back as ``token`` (the kernel's ptrace rules decide: same user and, under Yama's
    ``ptrace_scope`` 1, only an ancestor; containers' seccomp profiles may refuse the call)."""
    if not direct_enabled():
        return False
    got = ctypes.create_string_buffer(len(token))
    try:
        _read_peer(pid, addr, ctypes.addressof(got), len(token))
    except OSError:
        return False
    return got.raw == token


# --------------------------------------------------------------------------------------------
# Works: what the call sites wait on (the subset of ``dist.Work`` they use).


def _label(what: str | tuple) -> str:
    """A work's description for messages. Hot paths pass ``(format, *args)``, formatted only
    here (an f-string per message is a measurable share of a small exchange's Python)."""
    return what if isinstance(what, str) else what[0].format(*what[1:])


class _Work:
    """A transport operation in flight; ``wait()`` drives the transport until it completes."""

    __slots__ = ("done", "timeout", "what", "peer", "tr")

    def __init__(self, timeout: float, what: str | tuple, peer: int, tr: _Transport | None = None) -> None:
        self.done, self.timeout, self.what, self.peer = False, timeout, what, peer
        # The transport that carries it (looked up again where not given).
        self.tr = tr

    def _progress(self, timeout: float, raise_on_timeout: bool) -> None:
        (self.tr or _transport()).progress(lambda: self.done, timeout, self, raise_on_timeout)

    def is_completed(self) -> bool:
        if not self.done:
            self._progress(0.0, False)
        return self.done

    def wait(self, timeout=None) -> bool:  # noqa: D102 - as dist.Work.wait
        if not self.done:
            self._progress(self.timeout, True)
        return True


class _Recv(_Work):
    __slots__ = ("dst", "key", "tensor", "keep")

    def __init__(
        self,
        tensor: torch.Tensor | None,
        key: tuple,
        timeout: float,
        what: str | tuple,
        peer: int,
        tr: _Transport | None = None,
        dst: memoryview | None = None,
        keep: object = None,
    ) -> None:
        # ``dst`` instead of ``tensor``: bytes of a buffer owned by ``keep``, held here while the
        # receive is posted (collectives, whose messages always travel inline, never read
        # ``tensor``).
        self.done, self.timeout, self.what, self.peer, self.tr = False, timeout, what, peer, tr
        self.tensor, self.dst, self.key, self.keep = tensor, _bytes_of(tensor) if dst is None else dst, key, keep

    def check(self, n: int) -> None:
        if n != len(self.dst):
            raise TransportError(
                f"sharded_nn transport: a message of {n} bytes from rank {self.peer} ({_label(self.what)}) "
                f"arrived for a receive buffer of {len(self.dst)} bytes. The ranks disagree on the tensor's "
                f"shape or dtype, or on {ENV_MAX_BYTES} / {ENV_SHM_MAX_BYTES}; make them agree (or set {ENV}=gloo)."
            )

    def fill(self, body: memoryview) -> None:
        self.check(len(body))
        self.dst[:] = body
        self.done = True


class _Collective:
    """A collective in flight: its sends and receives, then a local reduction in group-rank order."""

    __slots__ = ("_parts", "_finish")

    def __init__(self, parts: list[_Work], finish: Callable[[], None]) -> None:
        self._parts, self._finish = parts, finish

    def is_completed(self) -> bool:
        return all(p.is_completed() for p in self._parts)

    def wait(self, timeout=None) -> bool:  # noqa: D102 - as dist.Work.wait
        if self._finish is not None:
            for p in self._parts:
                p.wait()
            finish, self._finish, self._parts = self._finish, None, []
            finish()
        return True


# --------------------------------------------------------------------------------------------
# Connections and the progress loop.


class _Conn:
    __slots__ = (
        "peer", "sock", "fd", "rbuf", "rmv", "rstart", "rend", "out", "error", "shm_ok", "peer_arena",
        "direct", "peer_pid", "lent",
    )  # fmt: skip

    def __init__(self, peer: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
            except OSError:
                pass
        self.peer, self.sock, self.fd = peer, sock, sock.fileno()
        self.rbuf = bytearray(1 << 16)
        self.rmv = memoryview(self.rbuf)
        self.rstart = self.rend = 0
        self.out: deque[list] = deque()  # [views, work or None, keepalive]
        self.error: str | None = None
        # Sending through our arena to this peer: None (not announced), "asked", True, False.
        self.shm_ok: bool | str | None = None
        self.peer_arena: _PeerArena | None = None  # the peer's arena, once it announced it
        # Whether the peer reads our large payloads straight from our tensors (its answer to our
        # announcement), and the pid to read the peer's from (once it announced: we could).
        self.direct = False
        self.peer_pid: int | None = None
        self.lent: dict[int, tuple[torch.Tensor, _Work]] = {}  # sequence -> payload the peer reads


class _Transport:
    """This process's end of the transport: listener, connections, posted receives, stash."""

    def __init__(self, default_group: dist.ProcessGroup) -> None:
        self.rank = dist.get_rank()
        self.default_group = weakref.ref(default_group)
        self.store = dist.distributed_c10d._get_default_store()
        # One key per rank, overwritten by a process group made after ``destroy_process_group``
        # (usually on a fresh store); a connector that finds a stale entry retries (``conn``).
        self.prefix = "sharded_nn/transport/"
        self.name = f"sharded_nn-{uuid.uuid4().hex}"
        self.host = socket.gethostname()
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                self.boot = f.read().strip()
        except OSError:
            self.boot = ""
        try:
            # Abstract socket names are per network namespace: containers on one host that do
            # not share it cannot reach each other's listeners, so they count as other hosts.
            self.boot += "|" + os.readlink("/proc/self/ns/net")
        except OSError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.name)
        self.listener.listen(256)
        self.listener.setblocking(False)
        self.conns: dict[int, _Conn] = {}
        self.by_fd: dict[int, _Conn] = {}
        self.local: dict[int, bool] = {}
        self.posted: dict[tuple, deque[_Recv]] = {}
        self.stash: dict[tuple, deque[bytes | tuple[_Conn, int, int]]] = {}
        self.arena: _Arena | None | bool = None  # False: this process cannot make one
        # What a peer reads to learn whether it can read this process's memory (direct reads).
        self.probe_token = uuid.uuid4().bytes
        self.probe = ctypes.create_string_buffer(self.probe_token, len(self.probe_token))
        self.lent_seq = 0
        self.poller = select.poll()
        self.poller.register(self.listener.fileno(), select.POLLIN)
        self.lock = threading.RLock()
        self.spin = spin_seconds()  # decided once: the thread count is set before the first message
        self.spun = 0  # polls made without sleeping, for the tests (CPU time depends on the host's load)
        gloo_exit.arm()  # this process talks over a gloo group (a mesh from torch's own init)
        self.store.set(f"{self.prefix}{self.rank}", f"{self.host}\n{self.boot}\n{self.name}")

    # ----- peers

    def _peer_entry(self, peer: int) -> tuple[str, str, str]:
        # Blocks until the peer has made its transport (its first routed call, which is the same
        # exchange or collective as ours), bounded by the store's timeout.
        host, boot, name = self.store.get(f"{self.prefix}{peer}").decode().split("\n")
        return host, boot, name

    def is_local(self, peer: int) -> bool:
        """Whether ``peer`` runs on this host (same hostname, boot id and network namespace);
        symmetric, so both ends of a message decide its path alike."""
        ok = self.local.get(peer)
        if ok is None:
            host, boot, _ = self._peer_entry(peer)
            ok = self.local[peer] = host == self.host and boot == self.boot
        return ok

    def conn(self, peer: int, timeout: float) -> _Conn:
        c = self.conns.get(peer)
        if c is not None:
            return c
        if peer > self.rank:
            # The lower rank connects; a listening socket accepts into its backlog at once, so
            # this never waits for the peer to reach any particular point.
            deadline = time.monotonic() + timeout
            while True:
                _, _, name = self._peer_entry(peer)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect("\0" + name)
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    # The entry of the peer's previous process group (its listener is closed):
                    # wait for the peer to publish its new one.
                    sock.close()
                    if time.monotonic() > deadline:
                        raise TransportError(
                            f"sharded_nn transport: rank {self.rank} could not connect to rank {peer} within "
                            f"{timeout:.0f} s (its published address refuses connections). Check rank {peer}'s "
                            f"log, or set {ENV}=gloo to bypass the transport."
                        ) from None
                    time.sleep(0.01)
            sock.sendall(_HELLO.pack(_MAGIC, self.rank, 0))
            self._add(peer, sock)
        else:
            # The peer connects to us; accept in the progress loop, which keeps flushing and
            # reading the other connections meanwhile.
            self.progress(lambda: peer in self.conns, timeout, _Work(timeout, "setting up the connection", peer))
        return self.conns[peer]

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        # The connecting rank sends its hello right after connecting.
        sock.settimeout(10.0)
        hello = b""
        try:
            while len(hello) < _HELLO.size:
                chunk = sock.recv(_HELLO.size - len(hello))
                if not chunk:
                    break
                hello += chunk
        except OSError:
            pass
        if len(hello) < _HELLO.size:
            sock.close()
            return
        magic, who, _ = _HELLO.unpack(hello)
        if magic != _MAGIC:
            sock.close()  # not one of this run's ranks
            return
        old = self.conns.pop(who, None)
        if old is not None:  # the peer reconnected (``reset_connections``): the new one wins
            self.by_fd.pop(old.fd, None)
            try:
                self.poller.unregister(old.fd)
            except (KeyError, ValueError):
                pass
            old.sock.close()
        self._add(who, sock)

    def _add(self, peer: int, sock: socket.socket) -> None:
        c = _Conn(peer, sock)
        self.conns[peer] = c
        self.by_fd[c.fd] = c
        self.poller.register(c.fd, _POLLIN)

    # ----- sending

    def send(self, peer: int, gid: int, tag: int, t: torch.Tensor, work: _Work, limit: int | None = None) -> None:
        """Send ``t``; ``limit``: ``max_bytes()`` when the caller has read it already."""
        c = self.conn(peer, work.timeout)
        if c.error is not None:
            return  # ``work.wait()`` raises; meanwhile the caller still serves its other peers
        n = _nbytes(t)
        if n > (max_bytes() if limit is None else limit):
            off = self._arena_space(c, n)  # (also announces both large-message paths; None when direct)
            if c.direct and direct_enabled():
                # The peer copies the payload out of ``t`` itself (one copy, no arena pages):
                # ``t`` stays referenced, and the send is done when the peer says it has read.
                self.lent_seq += 1
                c.lent[self.lent_seq] = (t, work)
                desc = _DIRECT.pack(t.data_ptr(), n, self.lent_seq)
                self._send_views(c, [memoryview(_HDR.pack(gid, tag, _DIRECT_FLAG | _DIRECT.size) + desc)])
                STATS["direct"] += 1
                return
            if off is not None:
                ctypes.memmove(self.arena.base + off, t.data_ptr(), n)  # type: ignore[union-attr]
                self._send_views(c, [memoryview(_HDR.pack(gid, tag, _SHM_FLAG | _DESC.size) + _DESC.pack(off, n))])
                STATS["shm"] += 1
                work.done = True  # the payload is out of the caller's tensor
                return
            self.send_inline(c, gid, tag, _bytes_of(t), work, t, "inline large")
            return
        self.send_inline(c, gid, tag, _bytes_of(t), work, t)

    def send_inline(self, c: _Conn, gid: int, tag: int, body: memoryview, work: _Work, keep, path="socket") -> None:
        """Send ``body`` (owned by ``keep``, held until written) inline over the socket, counted
        in ``STATS[path]``."""
        STATS[path] += 1
        self._send_views(c, [memoryview(_HDR.pack(gid, tag, len(body))), body], work, keep)

    def _send_views(self, c: _Conn, views: list[memoryview], work: _Work | None = None, keep=None) -> None:
        """Write ``views`` now as far as the socket takes them; queue the rest (``work`` is done
        when all is written; None for control messages)."""
        if c.error is not None:
            return
        if not c.out:
            try:
                n = c.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._fail(c, e)  # ``work.wait()`` raises
                return
            views = _advance(views, n)
            if not views:
                if work is not None:
                    work.done = True
                return
        c.out.append([views, work, keep])
        self.poller.modify(c.fd, _POLLIN | select.POLLOUT)
        self._flush(c)

    def _flush(self, c: _Conn) -> None:
        while c.out:
            entry = c.out[0]
            try:
                n = c.sock.sendmsg(entry[0])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fail(c, e)
                return
            entry[0] = _advance(entry[0], n)
            if entry[0]:
                return
            if entry[1] is not None:
                entry[1].done = True
            c.out.popleft()
        self.poller.modify(c.fd, _POLLIN)

    def _arena_space(self, c: _Conn, n: int) -> int | None:
        """An arena offset for ``n`` bytes to ``c.peer``, or None: send inline (the peer has not
        mapped the arena yet, cannot map it, or the arena is full). Never waits."""
        if c.shm_ok == "asked":
            # The peer's answer may be in already: read what has arrived, without waiting.
            self.progress(lambda: c.shm_ok != "asked", 0.0, _Work(0.0, "reading", c.peer), raise_on_timeout=False)
        if c.shm_ok is True:
            return None if c.direct and direct_enabled() else self.arena.alloc(n)  # type: ignore[union-attr]
        if c.shm_ok is None and n <= shm_max_bytes():
            if self.arena is None:
                try:
                    self.arena = _Arena(_ARENA_FACTOR * shm_max_bytes())
                except (OSError, AttributeError, ValueError):
                    self.arena = False  # no memfd here: large messages go direct or inline
            # One announcement for both large-message paths: the arena (if this process has
            # one) and the probe a peer reads to learn whether it can read our memory.
            c.shm_ok = "asked"
            arena = self.arena if isinstance(self.arena, _Arena) else None
            body = _ANNOUNCE.pack(
                os.getpid(), arena.fd if arena else -1, arena.size if arena else 0, arena.token if arena else bytes(16),
                ctypes.addressof(self.probe), self.probe_token,
            )
            self._send_views(c, [memoryview(_HDR.pack(0, _CTL_ANNOUNCE, len(body)) + body)])
        return None

    def _control(self, c: _Conn, kind: int, body: memoryview) -> None:
        """A control message from ``c.peer``."""
        if kind == _CTL_ANNOUNCE:
            pid, fd, size, token, probe, probe_token = _ANNOUNCE.unpack(body)
            ok = 0
            c.peer_arena = None
            if fd >= 0:
                try:
                    c.peer_arena = _map_peer_arena(pid, fd, size, token)
                    ok |= _REPLY_ARENA
                except (OSError, ValueError):
                    pass
            if _probe_peer(pid, probe, probe_token):
                c.peer_pid = pid
                ok |= _REPLY_DIRECT
            self._send_views(c, [memoryview(_HDR.pack(0, _CTL_REPLY, _U64.size) + _U64.pack(ok))])
        elif kind == _CTL_REPLY:
            bits = _U64.unpack(body)[0]
            c.shm_ok = bool(bits & _REPLY_ARENA) and isinstance(self.arena, _Arena)
            c.direct = bool(bits & _REPLY_DIRECT)
        elif kind == _CTL_FREE:
            if isinstance(self.arena, _Arena):
                self.arena.release(_U64.unpack(body)[0])
        elif kind == _CTL_DONE:
            entry = c.lent.pop(_U64.unpack(body)[0], None)
            if entry is not None:  # (None: a stale answer after a connection reset)
                entry[1].done = True

    def _fill_shm(self, r: _Recv, c: _Conn, off: int, n: int) -> None:
        """Copy a payload out of ``c.peer``'s arena into ``r`` and give the space back."""
        if c.peer_arena is None:
            raise TransportError(f"sharded_nn transport: rank {c.peer} sent through an arena it never announced.")
        try:
            r.fill(c.peer_arena.body(off, n))
        finally:
            self._send_views(c, [memoryview(_HDR.pack(0, _CTL_FREE, _U64.size) + _U64.pack(off))])

    def _read_direct(self, c: _Conn, addr: int, n: int, seq: int, local: int) -> None:
        """Copy a payload out of ``c.peer``'s memory to ``local`` and tell the peer it is read."""
        if c.peer_pid is None:
            raise TransportError(f"sharded_nn transport: rank {c.peer} sent a direct read it never announced.")
        try:
            _read_peer(c.peer_pid, addr, local, n)
        except OSError as e:
            raise TransportError(
                f"sharded_nn transport: reading a {n}-byte message from rank {c.peer}'s memory failed ({e}); "
                f"rank {c.peer} may have exited. Set {ENV_DIRECT}=0 to send large messages through shared memory."
            ) from None
        finally:
            self._send_views(c, [memoryview(_HDR.pack(0, _CTL_DONE, _U64.size) + _U64.pack(seq))])

    # ----- receiving

    def post_recv(self, r: _Recv) -> None:
        c = self.conn(r.peer, r.timeout)
        q = self.stash.get(r.key)
        if q:
            item = q.popleft()
            if not q:
                del self.stash[r.key]
            if isinstance(item, tuple):  # still in the sender's arena
                self._fill_shm(r, *item)
            else:
                r.fill(memoryview(item))
            return
        self.posted.setdefault(r.key, deque()).append(r)  # on a failed connection ``wait()`` raises

    def _read(self, c: _Conn) -> None:
        while True:
            if c.rend == len(c.rbuf):
                self._make_room(c, len(c.rbuf) * 2 if c.rstart == 0 else len(c.rbuf))
            try:
                n = c.sock.recv_into(c.rmv[c.rend:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fail(c, e)
                return
            if n == 0:
                self._fail(c, None)
                return
            c.rend += n
            self._parse(c)
            if c.rend < len(c.rbuf):
                return  # a short read: the socket is drained

    def _make_room(self, c: _Conn, cap: int) -> None:
        live = bytes(c.rmv[c.rstart:c.rend])
        if cap != len(c.rbuf):
            c.rmv.release()
            c.rbuf = bytearray(cap)
            c.rmv = memoryview(c.rbuf)
        c.rmv[: len(live)] = live
        c.rstart, c.rend = 0, len(live)

    def _parse(self, c: _Conn) -> None:
        while c.rend - c.rstart >= _HDR.size:
            gid, tag, nb = _HDR.unpack_from(c.rbuf, c.rstart)
            shm = nb & _SHM_FLAG
            direct = nb & _DIRECT_FLAG
            nb &= ~(_SHM_FLAG | _DIRECT_FLAG)
            need = _HDR.size + nb
            if c.rend - c.rstart < need:
                if len(c.rbuf) - c.rstart < need:
                    self._make_room(c, max(len(c.rbuf), need))
                break
            body = c.rmv[c.rstart + _HDR.size : c.rstart + need]
            c.rstart += need
            if gid == 0:
                self._control(c, tag, body)
                continue
            key = (gid, c.peer, tag)
            q = self.posted.get(key)
            if q:
                r = q.popleft()
                if not q:
                    del self.posted[key]
                if direct:
                    addr, n, seq = _DIRECT.unpack(body)
                    r.check(n)
                    self._read_direct(c, addr, n, seq, r.tensor.data_ptr())
                    r.done = True
                elif shm:
                    self._fill_shm(r, c, *_DESC.unpack(body))
                else:
                    r.fill(body)
            else:
                # A payload in the arena stays there (no copy) until its receive is posted. One
                # to read from the sender's memory is copied now, so that the sender's send
                # completes whether or not this process ever posts the receive before waiting
                # on its own sends (as on the other paths).
                if direct:
                    addr, n, seq = _DIRECT.unpack(body)
                    item = bytearray(n)  # n > max_bytes() > 0
                    self._read_direct(c, addr, n, seq, ctypes.addressof((ctypes.c_char * n).from_buffer(item)))
                else:
                    item = (c, *_DESC.unpack(body)) if shm else bytes(body)
                self.stash.setdefault(key, deque()).append(item)
        if c.rstart == c.rend:
            c.rstart = c.rend = 0

    # ----- failures

    def _fail(self, c: _Conn, exc: OSError | None) -> None:
        why = "closed the connection" if exc is None or exc.errno in (errno.ECONNRESET, errno.EPIPE) else str(exc)
        c.error = (
            f"sharded_nn transport: rank {c.peer} {why} (it exited, crashed or was killed) while rank "
            f"{self.rank} was exchanging messages with it. See rank {c.peer}'s log for the cause; this "
            f"process group cannot be used any more (restart the job)."
        )
        try:
            self.poller.unregister(c.fd)
        except (KeyError, ValueError):
            pass

    def _check(self, c: _Conn, work: _Work) -> None:
        if c.error is not None:
            raise TransportError(f"{c.error} [{_label(work.what)}]")

    # ----- the progress loop

    def progress(self, done: Callable[[], bool], timeout: float, work: _Work, raise_on_timeout: bool = True) -> None:
        """Flush queued sends and read incoming messages until ``done()``, at most ``timeout`` s."""
        with self.lock:
            start = time.monotonic()
            deadline = start + timeout
            spin_end = start + self.spin  # poll without sleeping until then (``spin_seconds``)
            first = True
            while True:
                c = self.conns.get(work.peer)
                if c is not None and c.error is not None and not done():
                    self._check(c, work)
                now = time.monotonic()
                left = deadline - now
                if not first and left <= 0:
                    if not raise_on_timeout:
                        return
                    self._timed_out(work, timeout)
                first = False
                spinning = now < spin_end
                for fd, ev in self.poller.poll(0.0 if spinning else max(left, 0.0) * 1000.0):
                    c = self.by_fd.get(fd)
                    if c is None:
                        self._accept()
                        continue
                    if ev & select.POLLOUT:
                        self._flush(c)
                    if ev & _POLLIN and c.error is None:
                        self._read(c)
                if done():
                    return
                if spinning:
                    self.spun += 1
                    # Let a runnable thread of this core go first (gloo's workers, this rank's
                    # own included, which the peer may be waiting on): a busy poll loop would
                    # otherwise hold the core for the scheduler's whole time slice.
                    os.sched_yield()

    def _timed_out(self, work: _Work, timeout: float) -> None:
        if isinstance(work, _Recv):
            q = self.posted.get(work.key)
            if q and work in q:
                q.remove(work)  # a late message must not land in a buffer its owner gave up
                if not q:
                    del self.posted[work.key]
        raise TransportError(
            f"sharded_nn transport: rank {self.rank} waited {timeout:.0f} s (the process group's timeout) "
            f"for {_label(work.what)} with rank {work.peer}. Rank {work.peer} is stuck, failed, or runs a different "
            f"sequence of exchanges/collectives (all ranks must make the same calls in the same order); "
            f"check its log, or set {ENV}=gloo to bypass the transport."
        )

    def close(self) -> None:
        if isinstance(self.arena, _Arena):
            os.close(self.arena.fd)  # peers that mapped it keep their mappings
        for c in self.conns.values():
            c.sock.close()
        self.conns.clear()
        self.by_fd.clear()
        self.listener.close()


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The views left to send after ``n`` bytes of ``views`` went out."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:] if n else v)
        n = 0
    return out


_STATE: dict[str, object] = {"transport": None}
#: torch.distributed's module-level state (one object for the life of the process).
_C10D_WORLD = getattr(dist.distributed_c10d, "_world", None)
_STATE_LOCK = threading.Lock()


def _transport() -> _Transport:
    """This process's transport for the current default group (a new one after re-initialisation)."""
    t = _STATE["transport"]
    # torch's own record of the default group, read directly: ``_get_default_group()`` costs
    # five Python calls, and this runs several times per message (None: not initialised, which
    # ``_get_default_group`` reports).
    default = getattr(_C10D_WORLD, "default_pg", None) or dist.distributed_c10d._get_default_group()
    if t is not None and t.default_group() is default:  # type: ignore[union-attr]
        return t  # type: ignore[return-value]
    with _STATE_LOCK:
        t = _STATE["transport"]
        if t is not None and t.default_group() is default:  # type: ignore[union-attr]
            return t  # type: ignore[return-value]
        if t is not None:
            t.close()  # type: ignore[union-attr]
        t = _STATE["transport"] = _Transport(default)
        return t


@atexit.register
def _close_at_exit() -> None:
    """Close the sockets at interpreter exit: their finalisers would otherwise warn
    (``ResourceWarning: unclosed socket``) under ``-W default`` in every rank of every launch."""
    t = _STATE["transport"]
    if t is not None:
        try:
            t.close()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def reset_connections() -> None:
    """Drop every connection of this process (for tests that simulate a failed peer); the next
    routed call reconnects. Every rank that talked to another must call it at the same point."""
    t = _STATE["transport"]
    if t is None:
        return
    with t.lock:  # type: ignore[union-attr]
        for c in list(t.conns.values()):  # type: ignore[union-attr]
            try:
                t.poller.unregister(c.fd)  # type: ignore[union-attr]
            except (KeyError, ValueError):
                pass
            c.sock.close()
        t.conns.clear()  # type: ignore[union-attr]
        t.by_fd.clear()  # type: ignore[union-attr]
        t.posted.clear()  # type: ignore[union-attr]
        t.stash.clear()  # type: ignore[union-attr]
        # Space held by messages of the dropped connections is never freed: start a new arena.
        t.arena = None  # type: ignore[union-attr]


def close_connection_to(peer: int) -> None:
    """Close this process's connection to global rank ``peer`` as a crash would (tests only)."""
    t = _transport()
    c = t.conns.get(peer)
    if c is not None:
        c.sock.shutdown(socket.SHUT_RDWR)


# --------------------------------------------------------------------------------------------
# Routing decisions and operations (what comm/ calls).


def p2p_route(group: dist.ProcessGroup, peer: int, nbytes: int) -> bool:
    """Whether a point-to-point message of ``nbytes`` to or from global rank ``peer`` on ``group``
    goes through the transport: the same answer on both ends."""
    return nbytes <= p2p_limit() and peer_is_local(group, peer)


def p2p_limit() -> int:
    """The largest point-to-point payload routed through the transport now (-1: none): the
    socket's ``max_bytes()`` or, above it, shared memory's ``shm_max_bytes()``."""
    return max(max_bytes(), shm_max_bytes()) if enabled() else -1


def peer_is_local(group: dist.ProcessGroup, peer: int) -> bool:
    """Whether ``group`` is a gloo group and global rank ``peer`` (not this one) is on this host."""
    if not _group(group).gloo:
        return False
    t = _transport()
    return peer != t.rank and t.is_local(peer)


def collective_route(group: dist.ProcessGroup | None, x: torch.Tensor) -> _Group | None:
    """The group's facts when a collective on ``x`` (the same shape on every rank) goes through
    the transport, else None. Every rank of the group decides alike."""
    if x.device.type != "cpu" or _nbytes(x) > max_bytes() or not enabled():
        return None
    g = _group(group)
    if not g.gloo or len(g.ranks) < 2:
        return None
    if g.all_local is None:
        t = _transport()
        g.all_local = all(t.is_local(r) for r in g.ranks if r != t.rank)
    return g if g.all_local else None


def start_send(t: torch.Tensor, group: dist.ProcessGroup, peer: int, tag: int) -> _Work:
    """Send contiguous CPU tensor ``t`` to global rank ``peer`` (keep ``t`` unchanged until ``wait``)."""
    return start_p2p(group, [(t, peer, True, tag)])[0]


def start_recv(t: torch.Tensor, group: dist.ProcessGroup, peer: int, tag: int) -> _Work:
    """Receive into contiguous CPU tensor ``t`` the message of ``tag`` from global rank ``peer``."""
    return start_p2p(group, [(t, peer, False, tag)])[0]


def start_p2p(group: dist.ProcessGroup, ops: Sequence[tuple[torch.Tensor, int, bool, int]]) -> list[_Work]:
    """``start_send`` / ``start_recv`` of each ``(tensor, global peer, is_send, tag)``, in order.

    One group and transport lookup and one lock for the lot (a halo exchange issues up to four).
    """
    g = _group(group)
    tr = _transport()
    works: list[_Work] = []
    limit = max_bytes()
    with tr.lock:
        for t, peer, send, tag in ops:
            if send:
                w = _Work(g.timeout, ("send of tag {}", tag), peer, tr)
                tr.send(peer, g.gid, tag, t, w, limit)
            else:
                w = _Recv(t, (g.gid, peer, tag), g.timeout, ("the receive of tag {}", tag), peer, tr)
                tr.post_recv(w)
            works.append(w)
    return works


def _exchange_all(
    g: _Group, send: memoryview, recv: Sequence[memoryview | None], what: tuple, keep: object
) -> list[_Work]:
    """Send the bytes ``send`` to every other member and receive each member's into ``recv[i]``.

    Collectives only: their messages are at most ``max_bytes()`` (``collective_route``), so they
    always travel inline over the socket. ``keep`` owns the memory of every view; the sends and
    receives hold it until they are done (a collective dropped before its ``wait`` must not
    leave a message to land in freed memory).
    Written for the per-call cost: a BatchNorm's statistics are exchanged twice per layer and
    step, where each Python or torch call costs more than the bytes.
    """
    tag = -1 - g.seq
    g.seq = (g.seq + 1) & ((1 << 62) - 1)
    tr = _transport()
    parts: list[_Work] = []
    label = (what[0] + " (call {})", *what[1:], -tag)
    with tr.lock:
        me = g.index
        n = len(g.ranks)
        # Send in ring order starting with the right neighbour, so that no rank is everyone's
        # first destination.
        for k in range(1, n):
            peer = g.ranks[(me + k) % n]
            w = _Work(g.timeout, label, peer, tr)
            # (A failed connection sends nothing: ``w.wait()`` raises.)
            tr.send_inline(tr.conn(peer, g.timeout), g.gid, tag, send, w, keep)
            parts.append(w)
        for i, peer in enumerate(g.ranks):
            if i != me:
                r = _Recv(None, (g.gid, peer, tag), g.timeout, label, peer, tr, dst=recv[i], keep=keep)
                tr.post_recv(r)
                parts.append(r)
    return parts


def start_all_reduce(y: torch.Tensor, g: _Group, op: str = "sum") -> _Collective:
    """Reduce contiguous CPU ``y`` in place over the group (``op``: ``sum`` or ``max``), in
    group-rank order on every rank (bitwise the same result everywhere)."""
    n, me = len(g.ranks), g.index
    # ``y`` is sent as it is and receives the result. Group ranks 0 and 1 fold their own value
    # in at the first step (the element-wise ``out=y`` reads it before writing); the others need
    # it later, so they keep a copy.
    mine = y if me < 2 else y.clone()
    bufs = [mine if i == me else torch.empty_like(y) for i in range(n)]
    recv = [None if i == me else _bytes_of(b) for i, b in enumerate(bufs)]
    parts = _exchange_all(g, _bytes_of(y), recv, ("an all_reduce ({}) of {} bytes", op, _nbytes(y)), (y, bufs))
    fn = torch.add if op == "sum" else torch.maximum

    def finish() -> None:
        fn(bufs[0], bufs[1], out=y)  # a + b == b + a bitwise, so every rank's first step agrees
        for b in bufs[2:]:
            fn(y, b, out=y)

    return _Collective(parts, finish)


def start_all_gather(out: torch.Tensor, x: torch.Tensor, g: _Group) -> _Collective:
    """Gather contiguous CPU ``x`` of every member into contiguous ``out`` (``len(group) *
    x.numel()`` elements, in group-rank order)."""
    nb = _nbytes(x)
    whole = _bytes_of(out)
    chunks = [whole[i * nb : (i + 1) * nb] for i in range(len(g.ranks))]
    if nb:
        ctypes.memmove(out.data_ptr() + g.index * nb, x.data_ptr(), nb)
    parts = _exchange_all(g, chunks[g.index], chunks, ("an all_gather of {} bytes", nb), out)
    return _Collective(parts, lambda: None)
