"""The same-host transport for small CPU messages (``sharded_nn/comm/local_transport.py``).

* point-to-point: tags matched like gloo (out-of-order receives), messages in both directions
  larger than the socket buffers (no deadlock), above-threshold messages left to gloo;
* large point-to-point messages read straight from the sender's tensor (``process_vm_readv``)
  or through the shared-memory arena, at P = 2, 3, with receives posted before and after the
  messages arrive; through the arena when the kernel refuses direct reads; inline over the socket
  when the arena is full or the peer cannot map it; the arena's space and the lent tensors all
  come back;
* collectives through it equal gloo's, bitwise the same on every rank (P = 2, 3, 4);
* failures: a peer that closes its connection, or raises instead of joining a collective, gives
  every other rank a ``TransportError`` naming it, within the group's timeout;
* a waiting rank polls without sleeping for at most its spin budget, then sleeps in ``poll`` (its
  CPU time stays far below a long wait); the budget's default follows the host's cores;
* ``SHARDED_NN_TRANSPORT=gloo`` turns it off, and ``count_traffic`` counts the same calls and bytes
  either way.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import sharded_nn as snn
from sharded_nn.comm import HaloSpec, all_reduce_max, all_reduce_sum, axis_peers, halo_cat, local_transport as lt
from sharded_nn.comm.collectives import all_gather_stacked
from sharded_nn.comm.pending import all_reduce_sum_start
from sharded_nn.comm.ring_pass import gather_ints, ring_pass
from sharded_nn.comm.traffic import count_traffic

from .harness import mesh, world_of

D = torch.float64


class _Env:
    """Set environment variables in a worker for the duration of a block."""

    def __init__(self, **kv: str | None) -> None:
        self.kv, self.saved = kv, {}

    def __enter__(self):
        for k, v in self.kv.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _transport_on(fn):
    """Run ``fn`` with the transport on whatever the environment of the test run says."""

    def wrapped(*args):
        with _Env(SHARDED_NN_TRANSPORT="local"):
            return fn(*args)

    wrapped.__name__ = wrapped.__qualname__ = fn.__name__
    return wrapped


@_transport_on
def _p2p_out_of_order():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    peer = 1 - rank
    assert lt.p2p_route(group, peer, 64)
    tags = [11, 12, 13, 14]
    sends = [torch.full((5,), float(10 * rank + i), dtype=D) for i in range(len(tags))]
    got = [torch.empty(5, dtype=D) for _ in tags]
    # Rank 0 sends in tag order and receives in reverse; rank 1 receives first, out of order.
    works = []
    if rank == 0:
        works += [lt.start_send(t, group, peer, tag) for t, tag in zip(sends, tags)]
        works += [lt.start_recv(g, group, peer, tag) for g, tag in reversed(list(zip(got, tags)))]
    else:
        order = [(got[2], 13), (got[0], 11), (got[3], 14), (got[1], 12)]
        works += [lt.start_recv(g, group, peer, tag) for g, tag in order]
        works += [lt.start_send(t, group, peer, tag) for t, tag in reversed(list(zip(sends, tags)))]
    for w in works:
        w.wait()
    return [g[0].item() for g in got], world


def test_p2p_matches_tags_out_of_order(run):
    out = run(2, _p2p_out_of_order)
    for rank, (got, _) in enumerate(out):
        assert got == [10.0 * (1 - rank) + i for i in range(4)], (rank, got)


@_transport_on
def _both_directions_big(n_msgs: int, numel: int):
    rank = dist.get_rank()
    group = dist.group.WORLD
    peer = 1 - rank
    assert numel * 8 <= lt.max_bytes() and lt.p2p_route(group, peer, numel * 8)
    sends = [torch.arange(numel, dtype=D) + 1000 * rank + i for i in range(n_msgs)]
    got = [torch.empty(numel, dtype=D) for _ in range(n_msgs)]
    # All sends first on both ranks: far more than the socket buffers hold, so both ranks queue,
    # and each one's waits must keep draining the other's messages.
    sw = [lt.start_send(t, group, peer, 100 + i) for i, t in enumerate(sends)]
    rw = [lt.start_recv(g, group, peer, 100 + i) for i, g in enumerate(got)]
    for w in sw + rw:
        w.wait()
    want = [torch.arange(numel, dtype=D) + 1000 * peer + i for i in range(n_msgs)]
    return all(torch.equal(a, b) for a, b in zip(got, want))


def test_p2p_both_directions_beyond_socket_buffers(run):
    # 8 messages of 240 KiB each way (just under the 256 KiB threshold): about 2 MB in flight.
    assert run(2, _both_directions_big, 8, 240 * 128) == [True, True]


@_transport_on
def _start_p2p_paths(numel: int):
    m = mesh(2)
    ring = axis_peers(m, "domain")
    peer = 1 - ring.index
    x = torch.arange(numel, dtype=D) + ring.index
    r = torch.empty(numel, dtype=D)
    tag = ring.next_tags(1)
    works = ring.start_p2p([(x, peer, True, tag), (r, peer, False, tag)])
    kinds = [type(w).__module__.startswith("sharded_nn") for w in works]
    for w in works:
        w.wait()
    return kinds, torch.equal(r, torch.arange(numel, dtype=D) + peer)


def _start_p2p_paths_shm_limit(numel: int, shm_max: int):
    with _Env(SHARDED_NN_TRANSPORT_SHM_MAX_BYTES=str(shm_max)):
        return _start_p2p_paths(numel)


def test_start_p2p_routes_by_size(run):
    small = run(2, _start_p2p_paths, 16)
    assert small == [([True, True], True)] * 2
    # Above the socket threshold (256 KiB): shared memory, still the transport's works.
    mid = run(2, _start_p2p_paths, lt.max_bytes() // 8 + 1)
    assert mid == [([True, True], True)] * 2
    # Above the shared-memory limit: gloo's own works.
    big = run(2, _start_p2p_paths_shm_limit, (1 << 20) // 8 + 1, 1 << 20)
    assert big == [([False, False], True)] * 2
    # Shared memory off: everything above the socket threshold goes to gloo.
    off = run(2, _start_p2p_paths_shm_limit, lt.max_bytes() // 8 + 1, 0)
    assert off == [([False, False], True)] * 2


def _fresh_arena(shm_max: int, direct: bool = False):
    """Drop this process's connections and arena, so that the next large send makes an arena
    sized for ``shm_max`` and announces the large-message paths afresh (every rank calls it at
    the same point); ``direct``: direct reads allowed."""
    dist.barrier()
    lt.reset_connections()
    os.environ["SHARDED_NN_TRANSPORT_SHM_MAX_BYTES"] = str(shm_max)
    os.environ["SHARDED_NN_TRANSPORT_DIRECT"] = "1" if direct else "0"
    dist.barrier()


def _arena_back_to_default():
    dist.barrier()
    lt.reset_connections()
    os.environ.pop("SHARDED_NN_TRANSPORT_SHM_MAX_BYTES", None)
    os.environ.pop("SHARDED_NN_TRANSPORT_DIRECT", None)
    dist.barrier()


@_transport_on
def _large_p2p(
    world: int, numel: int, n_msgs: int, shm_max: int, late: bool, break_map: bool | str, direct: bool | str = False
):
    """Every rank sends ``n_msgs`` messages of ``numel`` doubles to its right neighbour and
    receives as many from its left one, tags out of order, in two rounds after a setup round;
    ``late``: the receiver posts its receives after the messages arrived (they wait in the
    arena); "sends first": every rank waits for its sends before posting its receives; ``break_map``: ranks cannot map their peers' arenas (payloads go inline); "token":
    the file a peer opens is not the announced arena (its token differs: inline too);
    ``direct``: direct reads allowed ("refused": allowed, but the kernel refuses them).

    Returns (data ok, messages sent through the arena, messages read directly, large messages
    sent inline, arena bytes still held at the end, tensors still lent to a peer at the end) for
    the two measured rounds."""
    _fresh_arena(shm_max, bool(direct))
    real_map, real_probe = lt._map_peer_arena, lt._probe_peer
    if direct == "refused":
        lt._probe_peer = lambda *args: False  # as under Yama's ptrace_scope or a seccomp profile
    if break_map == "token":
        def wrong_file(pid, fd, size, token):
            return real_map(pid, fd, size, bytes(16))  # as if /proc/<pid> named another process
        lt._map_peer_arena = wrong_file
    elif break_map:
        def refuse(*args):
            raise OSError("mapping refused (test)")
        lt._map_peer_arena = refuse
    try:
        rank = dist.get_rank()
        group = dist.group.WORLD
        right, left = (rank + 1) % world, (rank - 1) % world

        def exchange(rnd: int, count: int, late: bool) -> bool:
            sends = [torch.arange(numel, dtype=D) * (rnd + 1) + 1000 * rank + i for i in range(count)]
            bufs = [torch.full((numel,), -1.0, dtype=D) for _ in range(count)]
            tags = [500 + 10 * rnd + i for i in range(count)]
            sw = [lt.start_send(t, group, right, tag) for t, tag in zip(sends, tags)]
            if late == "sends first":
                for w in sw:  # completes before any receive is posted (the peer does the same)
                    w.wait()
            elif late:
                time.sleep(0.3)  # the left neighbour's messages are all in by now
            rw = [lt.start_recv(b, group, left, tag) for b, tag in reversed(list(zip(bufs, tags)))]
            for w in sw + rw:
                w.wait()
            want = [torch.arange(numel, dtype=D) * (rnd + 1) + 1000 * left + i for i in range(count)]
            # Stream order: the peer's arena answer and frees precede its part of this sum.
            all_reduce_sum(torch.ones(1, dtype=D), group)
            return all(torch.equal(x, y) for x, y in zip(bufs, want))

        ok = exchange(0, 1, False)  # setup: the arena is announced and mapped
        before = dict(lt.STATS)
        ok = exchange(1, n_msgs, late) and exchange(2, n_msgs, late) and ok
        all_reduce_sum(torch.ones(1, dtype=D), group)  # the peers' last "read" answers are in
        tr = lt._transport()
        held = None if not isinstance(tr.arena, lt._Arena) else sum(tr.arena.used.values())
        lent = sum(len(c.lent) for c in tr.conns.values())
        sent = {k: lt.STATS[k] - before[k] for k in ("shm", "direct", "inline large")}
        return ok, sent["shm"], sent["direct"], sent["inline large"], held, lent
    finally:
        lt._map_peer_arena, lt._probe_peer = real_map, real_probe
        _arena_back_to_default()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("late", [False, True, "sends first"])
def test_large_p2p_through_shared_memory(run, world, late):
    numel = (600 << 10) // 8  # 600 KiB: above the socket threshold
    assert run(world, _large_p2p, world, numel, 3, 8 << 20, late, False) == [(True, 6, 0, 0, 0, 0)] * world


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("late", [False, True, "sends first"])
def test_large_p2p_read_directly_from_the_sender(run, world, late):
    # Late receives: the payload is copied out at once (into the stash), so the sender's send
    # completes before the receive is posted; no arena space is used, no tensor stays lent.
    numel = (600 << 10) // 8
    assert run(world, _large_p2p, world, numel, 3, 8 << 20, late, False, True) == [(True, 0, 6, 0, 0, 0)] * world


@pytest.mark.parametrize("break_map", [False, True])
def test_large_p2p_through_the_arena_or_inline_when_direct_reads_are_refused(run, break_map):
    want = (True, 0, 0, 6, 0, 0) if break_map else (True, 6, 0, 0, 0, 0)
    assert run(2, _large_p2p, 2, (600 << 10) // 8, 3, 8 << 20, False, break_map, "refused") == [want] * 2


def test_large_p2p_falls_back_inline_when_the_arena_is_full(run):
    # An arena of 4 x 1 MiB less its token's 64 bytes; six 1 MiB messages each way before any
    # receive is posted: three through the arena, three inline, per round.
    assert run(2, _large_p2p, 2, (1 << 20) // 8, 6, 1 << 20, True, False) == [(True, 6, 0, 6, 0, 0)] * 2


@pytest.mark.parametrize("why", [True, "token"])
def test_large_p2p_inline_when_the_peer_cannot_map_the_arena(run, why):
    assert run(2, _large_p2p, 2, (600 << 10) // 8, 3, 8 << 20, False, why) == [(True, 0, 0, 6, 0, 0)] * 2


@_transport_on
def _collectives_match_gloo(domain: int):
    m = mesh(domain)
    group = snn.domain_group(m)
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(7, 3, generator=g, dtype=D)
    xi = torch.randint(-50, 50, (4,), generator=g)
    with _Env(SHARDED_NN_TRANSPORT="gloo"):
        ref = (all_reduce_sum(x, group), all_reduce_max(x, group), all_gather_stacked(x, group),
               all_reduce_sum(xi, group), all_reduce_sum_start(x, group).wait())
    assert lt.collective_route(group, x) is not None
    mine = (all_reduce_sum(x, group), all_reduce_max(x, group), all_gather_stacked(x, group),
            all_reduce_sum(xi, group), all_reduce_sum_start(x, group).wait())
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-15)
    # Integers, max and gathers are exact; the float sums are the same bits on every rank.
    for k in (1, 2, 3):
        assert torch.equal(mine[k], ref[k])
    return [t.tolist() for t in mine]


@pytest.mark.parametrize("domain", [2, 3, 4])
def test_collectives_equal_gloo_and_identical_on_all_ranks(run, domain):
    out = run(domain, _collectives_match_gloo, domain)
    assert all(o == out[0] for o in out)  # bitwise identical (float lists compare exactly)


def _halo_and_ring(domain: int, transport: str):
    with _Env(SHARDED_NN_TRANSPORT=transport):
        m = mesh(domain)
        ring = axis_peers(m, "domain")
        r = ring.index
        x = (torch.arange(6 * (3 + r), dtype=D).reshape(1, 1, 3 + r, 6) + 100 * r).requires_grad_()
        with count_traffic() as t:
            y = halo_cat(x, HaloSpec(2, (1,) * domain, (2,) * domain, periodic=True), ring)
            y.pow(2).sum().backward()
            rows = gather_ints([r, 3 + r], ring)
            (nxt,) = ring_pass(ring, [x.detach()], [(1, 1, 3 + ring.left(True), 6)]).wait()
            s = all_reduce_sum(x.detach()[..., :2, :], ring.group) + all_reduce_sum_start(y[..., :1, :], ring.group).wait()
        return y.detach().tolist(), x.grad.tolist(), rows, nxt.tolist(), s.tolist(), dict(t.calls), dict(t.sent)


@pytest.mark.parametrize("domain", [2, 3])
def test_halo_ring_and_counts_same_with_and_without_transport(run, domain):
    local = run(domain, _halo_and_ring, domain, "local")
    gloo = run(domain, _halo_and_ring, domain, "gloo")
    assert local == gloo
    calls = local[0][5]
    assert calls["halo"] >= 2 and calls["metadata"] == 1 and calls["ring"] == 1 and calls["reduction"] == 2, calls


def _ring_attention_big(domain: int, transport: str):
    """Ring attention whose key/value blocks (about 1 MiB) travel through shared memory (or
    gloo), forward and backward; returns the results and how many messages used the arena."""
    from sharded_nn.functional import ring_attention

    with _Env(SHARDED_NN_TRANSPORT=transport):
        m = mesh(domain)
        r = axis_peers(m, "domain").index
        g = torch.Generator().manual_seed(7 + r)
        n = 1000 + 37 * r  # uneven slabs
        q, k, v = (torch.randn(1, 2, n, 64, dtype=D, generator=g).requires_grad_() for _ in range(3))
        before = lt.STATS["shm"] + lt.STATS["direct"]
        out = ring_attention(q, k, v, m)
        out.backward(torch.randn(out.shape, dtype=D, generator=g))
        return [t.tolist() for t in (out, q.grad, k.grad, v.grad)], lt.STATS["shm"] + lt.STATS["direct"] - before


@pytest.mark.parametrize("domain", [2, 3])
def test_ring_attention_same_bits_through_shared_memory_and_gloo(run, domain):
    local = run(domain, _ring_attention_big, domain, "local")
    gloo = run(domain, _ring_attention_big, domain, "gloo")
    assert [a for a, _ in local] == [a for a, _ in gloo]
    assert all(n > 0 for _, n in local) and all(n == 0 for _, n in gloo), ([n for _, n in local], [n for _, n in gloo])


def _bad_env():
    with _Env(SHARDED_NN_TRANSPORT="nccl-ish"):
        try:
            lt.enabled()
        except ValueError as e:
            return str(e)
    return "no error"


def test_env_switch_rejects_unknown_values(run):
    out = run(2, _bad_env)
    assert all("SHARDED_NN_TRANSPORT='nccl-ish'" in o and "'gloo'" in o for o in out), out


@_transport_on
def _env_switch_off():
    group = dist.group.WORLD
    x = torch.ones(3, dtype=D)
    with _Env(SHARDED_NN_TRANSPORT="gloo"):
        off = (lt.collective_route(group, x) is None, lt.p2p_route(group, 1 - dist.get_rank(), 8))
    on = (lt.collective_route(group, x) is None, lt.p2p_route(group, 1 - dist.get_rank(), 8))
    return off, on


def test_env_switch_turns_transport_off(run):
    assert run(2, _env_switch_off) == [((True, False), (False, True))] * 2


@_transport_on
def _peer_closes(world: int):
    rank = dist.get_rank()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=20))
    x = torch.ones(4, dtype=D)
    all_reduce_sum(x, group)  # connects every pair
    err = "none"
    if rank == world - 1:
        for p in range(world - 1):
            lt.close_connection_to(p)  # what a crash does to the sockets
    else:
        try:
            all_reduce_sum(x, group)
        except lt.TransportError as e:
            err = str(e)
    dist.barrier()  # gloo's own connections are fine
    lt.reset_connections()
    dist.barrier()
    return err


@pytest.mark.parametrize("world", [2, 3])
def test_peer_that_closes_gives_clear_error_on_every_other_rank(run, world):
    out = run(world, _peer_closes, world)
    for rank, err in enumerate(out[:-1]):
        assert f"rank {world - 1} closed the connection" in err and "restart the job" in err, (rank, err)
    assert out[-1] == "none"


@_transport_on
def _peer_raises(world: int):
    rank = dist.get_rank()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=3))
    x = torch.ones(4, dtype=D)
    all_reduce_sum(x, group)
    try:
        if rank == 1:
            raise ValueError("bad input on rank 1")
        all_reduce_sum(x, group)
        return "no error"
    except (ValueError, lt.TransportError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.barrier()
        lt.reset_connections()
        dist.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_peer_that_raises_times_out_with_clear_error(run, world):
    out = run(world, _peer_raises, world)
    assert out[1] == "ValueError: bad input on rank 1"
    for rank, err in enumerate(out):
        if rank != 1:
            assert err.startswith("TransportError") and "waited 3 s" in err and "rank 1" in err, (rank, err)


@_transport_on
def _wait_sleeps(spin_us: int | None = None):
    rank = dist.get_rank()
    group = dist.group.WORLD
    if spin_us is not None:
        # The budget is decided when the transport is made; this worker's may be older.
        with _Env(SHARDED_NN_TRANSPORT_SPIN_US=str(spin_us)):
            lt._transport().spin = lt.spin_seconds()
    t = torch.zeros(4, dtype=D)
    # Connect first (rank 1 -> 0), so that only the wait below is timed.
    if rank == 1:
        lt.start_send(t, group, 0, 7).wait()
    else:
        lt.start_recv(t, group, 1, 7).wait()
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)  # the peer waits meanwhile
        lt.start_send(t + 1, group, 0, 8).wait()
        return 0.0
    c0, w0, s0 = time.thread_time(), time.perf_counter(), lt._transport().spun
    lt.start_recv(t, group, 1, 8).wait()
    out = (time.thread_time() - c0, time.perf_counter() - w0, t.tolist(), lt._transport().spun - s0)
    if spin_us is not None:
        with _Env(SHARDED_NN_TRANSPORT_SPIN_US=None):
            lt._transport().spin = lt.spin_seconds()
    return out


def test_waiting_rank_sleeps_after_its_spin_budget(run):
    cpu, wall, got, _ = run(2, _wait_sleeps)[0]  # the default budget (at most 1 ms)
    assert got == [1.0] * 4 and wall >= 0.9
    assert cpu < 0.1 * wall, (cpu, wall)  # blocked in poll, not spinning


def test_waiting_rank_spins_for_its_budget_then_sleeps(run):
    cpu, wall, got, spun = run(2, _wait_sleeps, 60_000)[0]  # 60 ms of polling, then poll() sleeps
    assert got == [1.0] * 4 and wall >= 0.9
    # Polled without sleeping for its budget: counted, not timed (on a loaded host the spinning
    # thread, yielding after each poll, gets little CPU: 0.4 ms of 60 ms in one CI run), then
    # blocked in poll for the rest of the second.
    assert spun >= 3 and cpu < 0.1 * wall + 0.06, (spun, cpu, wall)


def test_spin_budget_follows_the_cores_and_the_environment(monkeypatch):
    cores = lt.usable_cores()
    monkeypatch.delenv(lt.ENV_SPIN_US, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))  # a core per rank: spin
    assert lt.spin_seconds() == pytest.approx(lt._DEFAULT_SPIN_US * 1e-6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))  # ranks share cores: never spin
    assert lt.spin_seconds() == 0.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores + 1)  # the rank's threads fill the host
    assert lt.spin_seconds() == 0.0
    monkeypatch.setenv(lt.ENV_SPIN_US, "250")  # the user's budget wins
    assert lt.spin_seconds() == pytest.approx(250e-6)
    monkeypatch.setenv(lt.ENV_SPIN_US, "0")
    assert lt.spin_seconds() == 0.0
    monkeypatch.setenv(lt.ENV_SPIN_US, "fast")
    with pytest.raises(ValueError, match="SHARDED_NN_TRANSPORT_SPIN_US='fast': expected microseconds"):
        lt.spin_seconds()


@_transport_on
def _mixed_sizes_one_exchange():
    m = mesh(2)
    ring = axis_peers(m, "domain")
    me, peer = ring.index, 1 - ring.index
    big_n = lt.p2p_limit() // 8 + 5
    small, big = torch.full((3,), float(me), dtype=D), torch.arange(big_n, dtype=D) + me
    rs, rb = torch.empty(3, dtype=D), torch.empty(big_n, dtype=D)
    tag = ring.next_tags(2)
    # One exchange whose messages take both paths; the ranks list them in different orders.
    ops = [(small, peer, True, tag), (big, peer, True, tag + 1), (rs, peer, False, tag), (rb, peer, False, tag + 1)]
    works = ring.start_p2p(ops if me == 0 else ops[::-1])
    for w in works:
        w.wait()
    return torch.equal(rs, torch.full((3,), float(peer), dtype=D)), torch.equal(rb, torch.arange(big_n, dtype=D) + peer)


def _mixed_sizes_small_shm_limit():
    with _Env(SHARDED_NN_TRANSPORT_SHM_MAX_BYTES=str(1 << 20)):
        return _mixed_sizes_one_exchange()


def test_one_exchange_mixing_transport_and_gloo_messages(run):
    assert run(2, _mixed_sizes_small_shm_limit) == [(True, True)] * 2
