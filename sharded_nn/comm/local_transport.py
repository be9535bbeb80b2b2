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
``poll`` loop, so two ranks that send to each other never deadlock, and a waiting rank sleeps in
``poll`` (never spins: the cores are shared). Larger messages, NCCL/CUDA tensors, peers on other
hosts and code under ``torch.compile`` keep using torch.distributed.

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

import ctypes
import errno
import hashlib
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

__all__ = [
    "TransportError",
    "collective_route",
    "enabled",
    "max_bytes",
    "p2p_route",
    "start_all_gather",
    "start_all_reduce",
    "start_recv",
    "start_send",
]

#: ``SHARDED_NN_TRANSPORT``: ``local`` (default) routes small same-host CPU messages through this
#: module, ``gloo`` sends everything through torch.distributed.
ENV = "SHARDED_NN_TRANSPORT"
#: ``SHARDED_NN_TRANSPORT_MAX_BYTES``: largest payload routed here (must agree across ranks).
ENV_MAX_BYTES = "SHARDED_NN_TRANSPORT_MAX_BYTES"
_DEFAULT_MAX_BYTES = 256 * 1024
#: Socket buffers: several small messages in flight each way without queueing in user space.
_SOCK_BUF = 4 << 20
#: Header of every message: group id, tag (collectives: negative), payload bytes.
_HDR = struct.Struct("<QqQ")
#: First bytes on a new connection: magic, the connecting rank, reserved.
_HELLO = struct.Struct("<QqQ")
_MAGIC = 0x534E4E5452414E53  # "SNNTRANS"
_POLLIN = select.POLLIN | select.POLLERR | select.POLLHUP


class TransportError(RuntimeError):
    """A peer of the same-host transport closed its connection, or a message did not arrive in time."""


def enabled() -> bool:
    """Whether the same-host transport may be used now (``SHARDED_NN_TRANSPORT``, platform, compile)."""
    mode = os.environ.get(ENV, "local")
    if mode == "gloo":
        return False
    if mode not in ("local", ""):
        raise ValueError(f"{ENV}={mode!r}: expected 'local' (the default) or 'gloo' (turn the transport off).")
    # Abstract-namespace Unix sockets are Linux's; dynamo cannot trace socket calls.
    return sys.platform.startswith("linux") and not torch.compiler.is_compiling()


def max_bytes() -> int:
    """Largest payload (bytes) that travels through this transport; larger ones use gloo."""
    raw = os.environ.get(ENV_MAX_BYTES)
    if not raw:
        return _DEFAULT_MAX_BYTES
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_MAX_BYTES}={raw!r}: expected a number of bytes (the same on every rank).") from None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, _Group] = weakref.WeakKeyDictionary()


def _group(group: dist.ProcessGroup | None) -> _Group:
    if group is None:
        group = dist.group.WORLD
    g = _GROUPS.get(group)
    if g is None:
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
        g = _GROUPS[group] = _Group(gid, ranks, ranks.index(dist.get_rank()), timeout, gloo)
    return g


# --------------------------------------------------------------------------------------------
# Works: what the call sites wait on (the subset of ``dist.Work`` they use).


class _Work:
    """A transport operation in flight; ``wait()`` drives the transport until it completes."""

    __slots__ = ("done", "timeout", "what", "peer")

    def __init__(self, timeout: float, what: str, peer: int) -> None:
        self.done, self.timeout, self.what, self.peer = False, timeout, what, peer

    def is_completed(self) -> bool:
        if not self.done:
            _transport().progress(lambda: self.done, 0.0, self, raise_on_timeout=False)
        return self.done

    def wait(self, timeout=None) -> bool:  # noqa: D102 - as dist.Work.wait
        if not self.done:
            _transport().progress(lambda: self.done, self.timeout, self)
        return True


class _Recv(_Work):
    __slots__ = ("dst", "key", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple, timeout: float, what: str, peer: int) -> None:
        super().__init__(timeout, what, peer)
        self.tensor, self.dst, self.key = tensor, _bytes_of(tensor), key

    def fill(self, body: memoryview) -> None:
        if len(body) != len(self.dst):
            raise TransportError(
                f"sharded_nn transport: a message of {len(body)} bytes from rank {self.peer} ({self.what}) "
                f"arrived for a receive buffer of {len(self.dst)} bytes. The ranks disagree on the tensor's "
                f"shape or dtype, or on {ENV_MAX_BYTES}; make them agree (or set {ENV}=gloo)."
            )
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
    __slots__ = ("peer", "sock", "fd", "rbuf", "rmv", "rstart", "rend", "out", "error")

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
        self.out: deque[list] = deque()  # [views, work, keepalive]
        self.error: str | None = None


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
        self.stash: dict[tuple, deque[bytes]] = {}
        self.poller = select.poll()
        self.poller.register(self.listener.fileno(), select.POLLIN)
        self.lock = threading.RLock()
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

    def send(self, peer: int, gid: int, tag: int, t: torch.Tensor, work: _Work) -> None:
        c = self.conn(peer, work.timeout)
        if c.error is not None:
            return  # ``work.wait()`` raises; meanwhile the caller still serves its other peers
        body = _bytes_of(t)
        hdr = _HDR.pack(gid, tag, len(body))
        views = [memoryview(hdr), body]
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
                work.done = True
                return
        c.out.append([views, work, t])
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
            entry[1].done = True
            c.out.popleft()
        self.poller.modify(c.fd, _POLLIN)

    # ----- receiving

    def post_recv(self, r: _Recv) -> None:
        c = self.conn(r.peer, r.timeout)
        q = self.stash.get(r.key)
        if q:
            r.fill(memoryview(q.popleft()))
            if not q:
                del self.stash[r.key]
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
            need = _HDR.size + nb
            if c.rend - c.rstart < need:
                if len(c.rbuf) - c.rstart < need:
                    self._make_room(c, max(len(c.rbuf), need))
                break
            body = c.rmv[c.rstart + _HDR.size : c.rstart + need]
            key = (gid, c.peer, tag)
            q = self.posted.get(key)
            if q:
                r = q.popleft()
                if not q:
                    del self.posted[key]
                r.fill(body)
            else:
                self.stash.setdefault(key, deque()).append(bytes(body))
            c.rstart += need
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
            raise TransportError(f"{c.error} [{work.what}]")

    # ----- the progress loop

    def progress(self, done: Callable[[], bool], timeout: float, work: _Work, raise_on_timeout: bool = True) -> None:
        """Flush queued sends and read incoming messages until ``done()``, at most ``timeout`` s."""
        with self.lock:
            deadline = time.monotonic() + timeout
            first = True
            while True:
                c = self.conns.get(work.peer)
                if c is not None and c.error is not None and not done():
                    self._check(c, work)
                left = deadline - time.monotonic()
                if not first and left <= 0:
                    if not raise_on_timeout:
                        return
                    self._timed_out(work, timeout)
                first = False
                for fd, ev in self.poller.poll(max(left, 0.0) * 1000.0):
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

    def _timed_out(self, work: _Work, timeout: float) -> None:
        if isinstance(work, _Recv):
            q = self.posted.get(work.key)
            if q and work in q:
                q.remove(work)  # a late message must not land in a buffer its owner gave up
                if not q:
                    del self.posted[work.key]
        raise TransportError(
            f"sharded_nn transport: rank {self.rank} waited {timeout:.0f} s (the process group's timeout) "
            f"for {work.what} with rank {work.peer}. Rank {work.peer} is stuck, failed, or runs a different "
            f"sequence of exchanges/collectives (all ranks must make the same calls in the same order); "
            f"check its log, or set {ENV}=gloo to bypass the transport."
        )

    def close(self) -> None:
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
_STATE_LOCK = threading.Lock()


def _transport() -> _Transport:
    """This process's transport for the current default group (a new one after re-initialisation)."""
    t = _STATE["transport"]
    default = dist.distributed_c10d._get_default_group()
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
    """The largest point-to-point payload routed through the transport now (-1: none)."""
    return max_bytes() if enabled() else -1


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
    g = _group(group)
    w = _Work(g.timeout, f"send of tag {tag}", peer)
    tr = _transport()
    with tr.lock:
        tr.send(peer, g.gid, tag, t, w)
    return w


def start_recv(t: torch.Tensor, group: dist.ProcessGroup, peer: int, tag: int) -> _Work:
    """Receive into contiguous CPU tensor ``t`` the message of ``tag`` from global rank ``peer``."""
    g = _group(group)
    tr = _transport()
    r = _Recv(t, (g.gid, peer, tag), g.timeout, f"the receive of tag {tag}", peer)
    with tr.lock:
        tr.post_recv(r)
    return r


def _exchange_all(g: _Group, x: torch.Tensor, bufs: Sequence[torch.Tensor | None], what: str) -> list[_Work]:
    """Send ``x`` to every other member and receive each member's tensor into ``bufs[i]``."""
    tag = -1 - g.seq
    g.seq = (g.seq + 1) & ((1 << 62) - 1)
    tr = _transport()
    parts: list[_Work] = []
    with tr.lock:
        me = g.index
        n = len(g.ranks)
        # Send in ring order starting with the right neighbour, so that no rank is everyone's
        # first destination.
        for k in range(1, n):
            peer = g.ranks[(me + k) % n]
            w = _Work(g.timeout, f"{what} (call {-tag})", peer)
            tr.send(peer, g.gid, tag, x, w)
            parts.append(w)
        for i, peer in enumerate(g.ranks):
            if i != me:
                r = _Recv(bufs[i], (g.gid, peer, tag), g.timeout, f"{what} (call {-tag})", peer)
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
    parts = _exchange_all(g, y, bufs, f"an all_reduce ({op}) of {_nbytes(y)} bytes")
    fn = torch.add if op == "sum" else torch.maximum

    def finish() -> None:
        fn(bufs[0], bufs[1], out=y)  # a + b == b + a bitwise, so every rank's first step agrees
        for b in bufs[2:]:
            fn(y, b, out=y)

    return _Collective(parts, finish)


def start_all_gather(out: torch.Tensor, x: torch.Tensor, g: _Group) -> _Collective:
    """Gather contiguous CPU ``x`` of every member into ``out`` (``len(group) * x.numel()``
    elements, in group-rank order)."""
    chunks = list(out.view(len(g.ranks), -1).unbind(0)) if x.numel() else [out[:0]] * len(g.ranks)
    chunks[g.index].copy_(x.reshape(-1))
    parts = _exchange_all(g, chunks[g.index], chunks, f"an all_gather of {_nbytes(x)} bytes")
    return _Collective(parts, lambda: None)
