"""``launch(fn, nprocs, *args)``: run ``fn`` on local processes that share a process group.

For the demo, notebooks and tests; use torchrun on clusters. Fails fast: the first rank that
raises ends the run, every process is stopped, and the rank's exception is re-raised here with
its traceback.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .mesh import backend_for, default_device_type


class RemoteTraceback(Exception):
    """Carries the formatted traceback of the rank that failed (set as ``__cause__``)."""

    def __str__(self) -> str:
        return self.args[0]


def free_port() -> int:
    """A free TCP port on localhost for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tune_host_allocator(mmap_threshold: int = 1 << 16) -> bool:
    """Fix glibc's mmap threshold so that freed large CPU tensors go back to the OS at once.

    glibc raises its mmap threshold each time a mapped block is freed; after that, mid-sized
    buffers (halos, boundary strips) are served from heap arenas, which keep freed memory and
    fragment, so resident memory drifts above what the live tensors need. A fixed threshold (as
    ``MALLOC_MMAP_THRESHOLD_`` would set) keeps a rank's resident memory close to its live
    tensors, which is what per-rank memory figures should measure. ``launch`` calls this in
    every worker; under torchrun, call it at start-up (or export
    ``MALLOC_MMAP_THRESHOLD_=65536``). Returns False where glibc's ``mallopt`` is unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    except (OSError, AttributeError):
        return False


_M_MMAP_THRESHOLD = -3
_THP_ENV = "THP_MEM_ALLOC_ENABLE"


def init_worker(rank: int, world_size: int, port: int, timeout: timedelta, device_type: str | None = None) -> None:
    """Join the process group of a local launch (gloo on CPU, NCCL on CUDA)."""
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        if torch.cuda.device_count() < world_size:
            # More ranks than GPUs: fall back to CPU so that the launch still runs.
            device_type = "cpu"
        else:
            torch.cuda.set_device(rank)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=world_size, timeout=timeout)


def _worker(rank, world_size, port, timeout, device_type, threads, fn, args, results) -> None:
    try:
        tune_host_allocator()
        if threads is not None:
            torch.set_num_threads(threads)
        init_worker(rank, world_size, port, timeout, device_type)
        out = fn(*args)
        # Plain pickle bytes, not the object: multiprocessing would send a tensor as a handle to
        # this process's shared memory, which dies with it before the parent can read it.
        results.put((rank, "ok", pickle.dumps(out) if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            results.put((rank, "error", (exc, tb)))
        except Exception:  # the exception itself may not pickle
            results.put((rank, "error", (RuntimeError(repr(exc)), tb)))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 300.0,
    device_type: str | None = None,
    threads: int | None = None,
    huge_pages: bool = True,
) -> Any:
    """Run ``fn(*args)`` on ``nprocs`` local processes with a process group; return rank 0's result.

    Args:
        fn: a picklable (module-level) function. Inside it, ``sharded_nn.init_mesh`` finds the
            process group.
        nprocs: number of processes.
        timeout: seconds for the whole run and for each collective; past it the run fails.
        device_type: ``"cuda"`` (one GPU per rank, NCCL) or ``"cpu"`` (gloo); default: CUDA when
            there are enough GPUs.
        threads: torch threads per process (``None`` leaves torch's default).
        huge_pages: start the processes with ``THP_MEM_ALLOC_ENABLE=1`` (unless the variable is
            already set), so that torch puts large CPU tensors on transparent huge pages. Every
            fresh activation buffer of a big sample is otherwise page-faulted in 4 KiB at a time:
            on a 128^3 Conv3d stack this was a third of the run time. Under torchrun, export the
            variable yourself.

    Raises:
        The first failing rank's exception, with its remote traceback as ``__cause__``;
        ``TimeoutError`` when the run exceeds ``timeout``.
    """
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}.")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nprocs, port, timedelta(seconds=timeout), device_type, threads, fn, args, results),
            daemon=True,
        )
        for r in range(nprocs)
    ]
    saved_env = os.environ.get(_THP_ENV)
    if huge_pages and saved_env is None:
        # Read once by torch's CPU allocator at its first allocation, so it must be in the
        # environment the processes start with; the parent's own environment is restored below.
        os.environ[_THP_ENV] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if saved_env is None:
            os.environ.pop(_THP_ENV, None)
    try:
        return _collect(procs, results, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs, results, timeout: float) -> Any:
    import time

    deadline = time.monotonic() + timeout
    pending, out = set(range(len(procs))), None
    while pending:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r in pending if not procs[r].is_alive() and procs[r].exitcode not in (None, 0)]
            if dead:
                r = dead[0]
                raise RuntimeError(f"launch: rank {r} died with exit code {procs[r].exitcode} and no traceback.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"launch: ranks {sorted(pending)} did not finish within {timeout}s.")
            continue
        if status == "error":
            exc, tb = payload
            others = _other_failures(procs, results, rank)
            text = f"\n--- rank {rank} traceback ---\n{tb}"
            if others:
                # The first report may be a knock-on error (a peer's connection closing); name
                # the other ranks that failed so that the root cause is not lost.
                text += "\n--- other ranks ---\n" + "\n".join(others)
            raise exc from RemoteTraceback(text)
        pending.discard(rank)
        if rank == 0:
            out = pickle.loads(payload)
    return out


def _other_failures(procs, results, first: int, grace: float = 0.5) -> list[str]:
    """Failures of ranks other than ``first`` seen within ``grace`` seconds."""
    import time

    out: list[str] = []
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if status == "error":
            out.append(f"rank {rank} raised {type(payload[0]).__name__}: {payload[0]}")
    for r, p in enumerate(procs):
        if r != first and p.exitcode not in (None, 0):
            out.append(f"rank {r} exited with code {p.exitcode}")
    return out
