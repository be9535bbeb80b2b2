"""Multi-process test harness: long-lived gloo worker pools, one per world size.

``pools.run(world_size, fn, *args)`` runs the module-level function ``fn(*args)`` on every rank
of a pool and returns the list of per-rank results. It fails fast: the first rank that raises
ends the call with that rank's traceback (the pool is then torn down, since its other ranks may
be stuck in a collective, and a fresh one is started for the next test); a call that exceeds its
timeout kills the pool and raises, so a test never hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from functools import cache
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from sharded_nn.launch import RemoteTraceback, die_with_parent, init_worker, rendezvous_store

#: Collective timeout inside workers: a rank waiting for a dead peer errors out instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _serve(rank: int, world: int, store_port: int, parent_pid: int, jobs: list, results) -> None:
    die_with_parent(parent_pid)  # a killed pytest leaves no workers behind
    torch.set_num_threads(1)
    try:
        init_worker(rank, world, store_port, COLLECTIVE_TIMEOUT, "cpu")
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        fn, args = jobs[rank].get()
        try:
            results.put((rank, "ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            results.put((rank, "error", traceback.format_exc()))


class Pool:
    """``world`` worker processes that share one gloo process group."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        # The rendezvous store is bound here (port 0) and lives as long as the pool: no port race.
        self.store = rendezvous_store(COLLECTIVE_TIMEOUT)
        self.procs = torch_mp.start_processes(
            _serve, (world, self.store.port, os.getpid(), self.jobs, self.results), nprocs=world, join=False,
            daemon=True, start_method="spawn",
        ).processes

    def run(self, fn, args, timeout: float) -> list[Any]:
        for q in self.jobs:
            q.put((fn, args))
        out: list[Any] = [None] * self.world
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout
        while pending:
            try:
                rank, status, payload = self.results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r in pending if not self.procs[r].is_alive()]
                if dead:
                    raise RankFailure(f"rank {dead[0]} died (exit code {self.procs[dead[0]].exitcode}).")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(pending)} of {self.world} did not finish within {timeout}s.")
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {self.world} failed") from RemoteTraceback(payload)
            out[rank] = payload
            pending.discard(rank)
        return out

    def close(self) -> None:
        # Workers hold nothing worth a graceful shutdown; killing them is fast and never hangs.
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()


class RankFailure(AssertionError):
    """A rank raised (its traceback is the ``__cause__``) or died."""


class Pools:
    """Lazily started pools keyed by world size; a failed pool is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[int, Pool] = {}

    def run(self, world: int, fn, *args, timeout: float = 120.0) -> list[Any]:
        pool = self._pools.get(world)
        if pool is None:
            pool = self._pools[world] = Pool(world)
        try:
            return pool.run(fn, args, timeout)
        except BaseException:
            pool.close()
            del self._pools[world]
            raise

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@cache
def mesh(domain: int | tuple[int, ...], data: int = 1):
    """A mesh cached per worker; every rank creates meshes in the same order, so caching is safe."""
    import sharded_nn as snn

    return snn.init_mesh(domain=domain, data=data, device_type="cpu")


def world_of(domain: int | tuple[int, ...], data: int = 1) -> int:
    n = data
    for d in (domain,) if isinstance(domain, int) else domain:
        n *= d
    return n


def assert_compiled_cleanly(graphs: bool = True) -> None:
    """After a ``torch.compile``d run: Dynamo compiled something (unless ``graphs`` is False: a
    model with nothing between its sharded layers), and none of our code raised while it traced
    (Dynamo falls back to eager for such a frame, which would hide a bug in a compile-only
    branch: a shadowed variable there raised AttributeError and a test still passed)."""
    from torch._dynamo.utils import counters

    raised = [k.split("Developer debug context:")[-1][:200] for k in counters["unimplemented"] if "raised exception" in k]
    assert not raised, raised
    if graphs:
        assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
