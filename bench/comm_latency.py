"""Latency of one small exchange between two local CPU processes: gloo raw against our wrappers.

What is measured (median microseconds per call, slowest rank; configurations interleaved so a
load change on a shared machine hits them alike):

* raw ``dist.send``/``dist.recv`` ping-pong (one round trip), 4 B and 64 KiB;
* raw ``batch_isend_irecv`` exchange (each rank sends to and receives from the other at once:
  what a halo exchange does), 4 B and 64 KiB; the same on the domain axis group with halo tags,
  and through ``AxisPeers.start_p2p`` (gloo: ``ProcessGroup.send``/``recv`` directly);
* raw ``dist.all_reduce``, 4 B and 64 KiB;
* our ``all_reduce_sum``, ``halo_cat`` (64 KiB halo per side), ``gather_layouts``, each through
  the same-host transport (``comm/local_transport.py``, the default) and through gloo
  (``SHARDED_NN_TRANSPORT=gloo``, rows marked ``[gloo]``), interleaved;
* the transport's own neighbour exchange (``start_p2p``), 4 B and 64 KiB, against gloo's;
* the floors: a plain TCP socket ping-pong between the same two processes, and a shared-memory
  ping-pong (spinning on a flag in an anonymous shared mapping).

``--large``: one ring hop of two 1.5 MiB float32 tensors each way (ring attention's key and value
blocks of vit_tiny at 1024^2, P=2) through the transport's direct reads (the receiver copies out
of the sender's tensor), its shared-memory arena (``SHARDED_NN_TRANSPORT_DIRECT=0``) and gloo
(``SHARDED_NN_TRANSPORT=gloo``), in alternating blocks, and the pages of the arena left resident.

Run it from the repository root: ``python bench/comm_latency.py [--iters 300] [--large]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sharded_nn as snn  # noqa: E402
from sharded_nn.comm import HaloSpec, all_reduce_sum, axis_peers, gather_layouts, halo_cat  # noqa: E402


def via_gloo(fn):
    """``fn`` with the same-host transport turned off (``SHARDED_NN_TRANSPORT`` is read at every
    call), for A/B rows against gloo in one run."""

    def f():
        os.environ["SHARDED_NN_TRANSPORT"] = "gloo"
        try:
            fn()
        finally:
            os.environ.pop("SHARDED_NN_TRANSPORT", None)

    return f


def _time(fns: dict, iters: int, warmup: int) -> dict[str, tuple[float, float, float, float]]:
    """Per call: (median wall s, mean caller-thread CPU s, mean process CPU s, mean voluntary
    context switches), slowest rank. CPU times and switch counts barely move with the load of a
    shared machine; wall time does."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu = {k: [0.0, 0.0, 0.0] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            dist.barrier()
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            fn()
            t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
            r1 = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            wall[k].append(t1 - t0)
            cpu[k][0] += c1 - c0
            cpu[k][1] += p1 - p0
            cpu[k][2] += r1 - r0
    res = torch.tensor([[statistics.median(wall[k])] + [v / iters for v in cpu[k]] for k in fns], dtype=torch.float64)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)
    return {k: tuple(row) for k, row in zip(fns, res.tolist())}


def _measure(iters: int, warmup: int) -> dict[str, float]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    peer = 1 - rank
    mesh = snn.init_mesh(domain=2, device_type="cpu")
    ring = axis_peers(mesh, "domain") if "domain" in (mesh.mesh_dim_names or ()) else None
    if ring is None:
        ring = axis_peers(mesh, mesh.mesh_dim_names[-1])
    small, big = torch.zeros(1, dtype=torch.float32), torch.zeros(16384, dtype=torch.float32)
    rs, rb = torch.zeros_like(small), torch.zeros_like(big)

    def pingpong(t, r):
        def f():
            if rank == 0:
                dist.send(t, 1)
                dist.recv(r, 1)
            else:
                dist.recv(r, 0)
                dist.send(t, 0)
        return f

    def exchange(t, r):
        def f():
            ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, r, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return f

    def exchange_on(t, r, group, tagged):
        # The raw exchange on the group and with the tags that halo_cat uses.
        gpeer = dist.get_global_rank(group, 1 - dist.get_rank(group))
        def f():
            tag = ring.next_tags(4) if tagged else 0
            ops = [dist.P2POp(dist.isend, t, gpeer, group=group, tag=tag), dist.P2POp(dist.irecv, r, gpeer, group=group, tag=tag)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return f

    def exchange_direct(t, r):
        # The same tagged exchange through ``AxisPeers.start_p2p`` (what halo_cat uses): on gloo
        # straight to ProcessGroup.send/recv, without torch's per-op wrappers.
        def f():
            tag = ring.next_tags(4)
            for w in ring.start_p2p([(t, 1 - ring.index, True, tag), (r, 1 - ring.index, False, tag)]):
                w.wait()
        return f

    def exchange_poll(t, r, spin_s=2e-3):
        # The same exchange, but the caller polls ``is_completed`` (yielding the core between
        # polls) for up to ``spin_s`` before blocking: saves the wake-up of a sleeping thread.
        def f():
            ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, r, peer)]
            works = dist.batch_isend_irecv(ops)
            end = time.perf_counter() + spin_s
            for w in works:
                while not w.is_completed() and time.perf_counter() < end:
                    os.sched_yield()
                w.wait()
        return f

    def isend_irecv(t, r):
        def f():
            a = dist.isend(t, peer)
            b = dist.irecv(r, peer)
            a.wait()
            b.wait()
        return f

    # TCP socket floor between the same two processes (rendezvous through the store).
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        store.set("bench_port", str(srv.getsockname()[1]))
        sock, _ = srv.accept()
    else:
        sock = socket.create_connection(("127.0.0.1", int(store.get("bench_port"))))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp():
        if rank == 0:
            sock.sendall(b"x")
            sock.recv(1)
        else:
            sock.recv(1)
            sock.sendall(b"x")

    # Shared-memory floor: a file-backed mapping in /dev/shm, rank 0 writes flag 1, rank 1 answers 2.
    path = f"/dev/shm/snn_bench_{os.getppid()}"
    if rank == 0:
        with open(path, "wb") as fh:
            fh.write(b"\0" * 4096)
    dist.barrier()
    fd = os.open(path, os.O_RDWR)
    shm = mmap.mmap(fd, 4096)
    flag = torch.frombuffer(shm, dtype=torch.int64, count=1)
    state = [0]

    def shm_pingpong():
        state[0] += 2
        want = state[0]
        if rank == 0:
            flag[0] = want - 1
            while int(flag[0]) != want:
                pass
        else:
            while int(flag[0]) != want - 1:
                pass
            flag[0] = want

    spec = HaloSpec(0, (0, 1), (1, 0))
    xb = torch.randn(2, 16384)
    xs = torch.randn(2, 1)
    out = {}
    out |= _time({"pingpong 4B": pingpong(small, rs), "pingpong 64K": pingpong(big, rb),
                  "tcp socket 1B": tcp, "shm spin": shm_pingpong}, iters, warmup)
    out |= _time({"exchange 4B": exchange(small, rs), "exch 4B axis group": exchange_on(small, rs, ring.group, False),
                  "exch 4B axis tagged": exchange_on(small, rs, ring.group, True),
                  "exch 4B start_p2p": via_gloo(exchange_direct(small, rs)),
                  "exch 4B transport": exchange_direct(small, rs)}, iters, warmup)
    out |= _time({"exch 64K start_p2p": via_gloo(exchange_direct(big, rb)),
                  "exch 64K transport": exchange_direct(big, rb)}, iters, warmup)
    out |= _time({"exchange 4B": exchange(small, rs), "exchange 4B poll": exchange_poll(small, rs),
                  "exchange 64K": exchange(big, rb), "exchange 64K poll": exchange_poll(big, rb),
                  "isend+irecv 4B": isend_irecv(small, rs)}, iters, warmup)
    out |= _time({"all_reduce 4B": lambda: dist.all_reduce(small), "all_reduce 64K": lambda: dist.all_reduce(big),
                  "all_reduce_sum 4B": lambda: all_reduce_sum(small, dist.group.WORLD),
                  "all_reduce_sum 4B [gloo]": via_gloo(lambda: all_reduce_sum(small, dist.group.WORLD)),
                  "all_reduce_sum 64K": lambda: all_reduce_sum(big, dist.group.WORLD),
                  "all_reduce_sum 64K [gloo]": via_gloo(lambda: all_reduce_sum(big, dist.group.WORLD))}, iters, warmup)
    gl = lambda: gather_layouts(xb.shape, mesh, (0,), what="bench")  # noqa: E731
    hs, hb = (lambda: halo_cat(xs, spec, ring)), (lambda: halo_cat(xb, spec, ring))
    out |= _time({"halo_cat 4B": hs, "halo_cat 4B [gloo]": via_gloo(hs),
                  "halo_cat 64K": hb, "halo_cat 64K [gloo]": via_gloo(hb),
                  "gather_layouts": gl, "gather_layouts [gloo]": via_gloo(gl)}, iters, warmup)
    dist.barrier()
    sock.close()
    shm.close()
    os.close(fd)
    if rank == 0:
        os.unlink(path)
    return out


def _shmem_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _measure_large(iters: int, rounds: int) -> dict[str, tuple[float, float, float, float]]:
    from sharded_nn.comm import local_transport as lt
    from sharded_nn.comm.ring_pass import ring_pass

    mesh = snn.init_mesh(domain=2)
    ring = axis_peers(mesh, "domain")
    k, v = (torch.randn(1, 3, 2048, 64) for _ in range(2))  # 1.5 MiB each
    shapes = [tuple(k.shape), tuple(v.shape)]
    modes = {"direct": {}, "arena": {"SHARDED_NN_TRANSPORT_DIRECT": "0"}, "gloo": {"SHARDED_NN_TRANSPORT": "gloo"}}
    rows: dict[str, list] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, env in modes.items():
            for key in ("SHARDED_NN_TRANSPORT_DIRECT", "SHARDED_NN_TRANSPORT"):
                os.environ.pop(key, None)
            os.environ.update(env)
            dist.barrier()
            lt.reset_connections()  # a new announcement, so that the path follows the setting
            dist.barrier()
            res = _time({mode: lambda: ring_pass(ring, [k, v], shapes).wait()}, iters, 5)
            rows[mode].append(res[mode] + (_shmem_mib(),))
    return {m: tuple(statistics.median(r[i] for r in rs) for i in range(5)) for m, rs in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--large", action="store_true", help="ring hops of 2 x 1.5 MiB: direct reads, arena, gloo")
    args = ap.parse_args()
    if args.large:
        r = snn.launch(_measure_large, 2, args.iters, 3, device_type="cpu", threads=1)
        print(f"ring hop, 2 x 1.5 MiB each way, 2 local processes, {args.iters} hops x 3 blocks per path, slowest rank")
        print(f"{'':>8} {'wall us':>9} {'caller CPU us':>14} {'process CPU us':>15} {'vol. ctx sw':>12} {'RssShmem MiB':>13}")
        for k, (w, c, p, n, shm) in r.items():
            print(f"{k:>8} {w * 1e6:9.1f} {c * 1e6:14.1f} {p * 1e6:15.1f} {n:12.1f} {shm:13.1f}")
        return
    r = snn.launch(_measure, 2, args.iters, args.warmup, device_type="cpu", threads=1)
    print(f"2 local processes, gloo, 1 thread each, {args.iters} calls, slowest rank")
    print(f"{'':>26} {'wall us':>9} {'caller CPU us':>14} {'process CPU us':>15} {'vol. ctx sw':>12}")
    for k, (w, c, p, n) in r.items():
        print(f"{k:>26} {w * 1e6:9.1f} {c * 1e6:14.1f} {p * 1e6:15.1f} {n:12.1f}")


if __name__ == "__main__":
    main()
