"""``launch(fn, nprocs, *args)``: run ``fn`` on local processes that share a process group.

For the demo, notebooks and tests; use torchrun on clusters.

Processes are started by torch's launcher, ``torch.multiprocessing.start_processes`` (spawn),
and watched by its ``ProcessContext.join``: the first process that exits with an error ends the
run, the others get ``GRACE_S`` seconds to end by themselves (gloo peers of a dead rank do, on
the closed connection), then SIGTERM, then SIGKILL after another ``GRACE_S``.

Rendezvous: the parent binds a ``TCPStore`` server on port 0, so the OS picks a free port and
the socket stays bound for the whole run; the ranks join the process group as clients of that
store (``init_process_group(store=...)``). Probing a free port and handing its number to the
ranks, as this module did before, is a race: another process can take the port between the
probe and rank 0's bind. torch's ``elastic_launch`` with a c10d rendezvous on port 0 would also
avoid the race, but it adds an agent process, restarts and log redirection that a local run does
not need, and it reports a rank's failure as text, where ``launch`` re-raises the exception
object itself.

Failures: a rank that raises writes its exception, traceback and time to a file of a private
temporary directory and exits at once (no ``destroy_process_group``, which can block on peers
stuck in a collective). The parent re-raises the earliest exception with the remote traceback as
``__cause__`` and names the other ranks that failed; a rank that died without a Python exception
(killed by the OS) is reported with its exit code. Rank 0's result travels the same way (a file
written by ``torch.save``), so tensors of any size survive the process. The processes are stopped whatever
ends the parent's wait (an error, the timeout, Ctrl-C); each rank also asks the kernel to kill it
when the parent dies (``PR_SET_PDEATHSIG``), so that even a parent killed outright leaves no
orphans.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import io
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from . import gloo_exit
from . import host_cache as _host_cache
from . import moments as _moments
from .host_memory import AUTO, huge_pages_for_children, resolve_mmap_threshold, tune_host_allocator
from .mesh import backend_for, default_device_type

#: Seconds the other ranks get to end by themselves after a failure, and again after SIGTERM.
GRACE_S = 1.0

_HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class RemoteTraceback(Exception):
    """Carries the formatted traceback of the rank that failed (set as ``__cause__``)."""

    def __str__(self) -> str:
        return self.args[0]


def rendezvous_store(timeout: timedelta) -> dist.TCPStore:
    """The parent's side of a local rendezvous: a ``TCPStore`` server on a port the OS picks.

    Keep the returned store alive until the ranks are done: it is their rendezvous, and while it
    lives its port (``store.port``, for :func:`init_worker`) cannot be taken by anyone else.
    """
    return dist.TCPStore(_HOST, 0, is_master=True, timeout=timeout, wait_for_workers=False)


def init_worker(
    rank: int, world_size: int, store_port: int, timeout: timedelta, device_type: str | None = None
) -> None:
    """Join the process group of a local launch (gloo on CPU, NCCL on CUDA, one GPU per rank).

    Args:
        rank: this process's rank.
        world_size: number of ranks.
        store_port: port of the parent's :func:`rendezvous_store`.
        timeout: timeout of the rendezvous and of every collective.
        device_type: ``"cuda"`` or ``"cpu"``; default: CUDA when a GPU is visible. With fewer
            GPUs than ranks the group falls back to CPU (gloo), so that the launch still runs.
    """
    device_type = device_type or default_device_type()
    if device_type == "cuda":
        if torch.cuda.device_count() < world_size:
            device_type = "cpu"
        else:
            torch.cuda.set_device(rank)
    # What torchrun would set, for code that reads it; the group itself is built from the store.
    os.environ.update(
        MASTER_ADDR=_HOST, MASTER_PORT=str(store_port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    store = dist.TCPStore(_HOST, store_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend_for(device_type), store=store, rank=rank, world_size=world_size, timeout=timeout
    )


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    torch's launcher asks for SIGINT, which a rank blocked inside a collective only handles when
    the collective returns; SIGKILL ends it at once. The signal fires when the parent *thread*
    that started this process exits: ``launch`` waits in that thread until the ranks are done.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl: no signal will come
        os._exit(1)


def _error_file(outdir: str, rank: int) -> Path:
    return Path(outdir) / f"error-{rank}.pickle"


def _result_file(outdir: str) -> Path:
    return Path(outdir) / "result.pt"  # torch.save (_dump_result)


def _write_atomic(path: Path, data: bytes) -> None:
    # Written whole or not at all: a rank can be stopped by SIGTERM at any point.
    tmp = path.with_suffix(".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _worker(
    rank: int,
    world_size: int,
    store_port: int,
    timeout: timedelta,
    device_type: str | None,
    threads: int | None,
    mmap_threshold: int | str | None,
    host_cache: bool,
    parent_pid: int,
    outdir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    die_with_parent(parent_pid)
    try:
        # The threshold before anything else allocates (freed small buffers were refaulted up to
        # 5 times as often when it came after a few allocations), unless it depends on whether
        # the host cache can be installed.
        early = mmap_threshold != AUTO or not host_cache
        threshold = resolve_mmap_threshold(mmap_threshold, False) if early else None
        if threshold is not None:
            tune_host_allocator(threshold)
        if host_cache:
            _host_cache.install_default()
        else:
            # Also for init_mesh inside fn, which installs the cache on CPU meshes by default.
            os.environ[_host_cache.OPT_OUT_ENV] = "0"
        if not early:
            threshold = resolve_mmap_threshold(mmap_threshold, _host_cache.installed())
            if threshold is not None:
                tune_host_allocator(threshold)
        if threads is not None:
            torch.set_num_threads(threads)
        init_worker(rank, world_size, store_port, timeout, device_type)
        out = fn(*args)
        if rank == 0:
            # Bytes in a file: a tensor sent through a multiprocessing queue would be a handle to
            # this process's shared memory, which dies with it.
            _write_atomic(_result_file(outdir), _dump_result(out))
        if dist.is_initialized():  # fn may have destroyed it itself
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure, Ctrl-C included, must reach the parent
        failed_at = time.monotonic()  # CLOCK_MONOTONIC: comparable between local processes
        tb = traceback.format_exc()
        try:
            data = pickle.dumps((exc, tb, failed_at))
        except Exception:  # noqa: BLE001 - the exception itself may not pickle
            data = pickle.dumps((RuntimeError(repr(exc)), tb, failed_at))
        try:
            _write_atomic(_error_file(outdir, rank), data)
        finally:
            # Exit now: destroy_process_group or interpreter shutdown could block on peers that
            # are stuck in a collective, and the parent notices the failure by this exit.
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(1)
    _exit_without_finalizing()


def _dump_result(out: Any) -> bytes:
    """``out`` as bytes for the parent: ``torch.save``, which writes each tensor storage once.

    Plain ``pickle`` writes a tensor's whole storage once per tensor, so views of one buffer travel
    once per view: the demo's parameter gradients, split from one flat gathered buffer (150 views
    of 23 MB), pickled to 3.4 GB in 10 s and took 12 s more to load. ``torch.save`` also keeps
    the views sharing their storage in the parent, and pickles every other object as ``pickle``
    would.
    """
    buf = io.BytesIO()
    torch.save(out, buf, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    return buf.getvalue()


def _load_result(data: bytes) -> Any:
    # Written by this launch's own rank 0 (``_dump_result``): any picklable object may come back.
    return torch.load(io.BytesIO(data), weights_only=False)


def _exit_without_finalizing() -> None:
    """End a rank whose ``fn`` returned: exit handlers and flushed streams, then ``os._exit(0)``.

    Not a normal interpreter shutdown: gloo's worker threads release a collective's tensors a
    little after its ``wait`` returns, and where that falls into the teardown the process aborts
    with SIGABRT after its work and result were complete (``sharded_nn.gloo_exit`` tells how;
    1 in 3-4 P=2 launches of ``bench/cnn.py`` before this). The ``atexit`` handlers still run
    (multiprocessing's own cleanup of child processes is one); only the teardown is skipped, so
    ``gloo_exit``'s wait for it is dropped.
    """
    gloo_exit.disarm()
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 300.0,
    device_type: str | None = None,
    threads: int | None = None,
    huge_pages: bool = True,
    mmap_threshold: int | str | None = AUTO,
    host_cache: bool = True,
) -> Any:
    """Run ``fn(*args)`` on ``nprocs`` local processes with a process group; return rank 0's result.

    Fails fast: the first rank that raises (or dies) ends the run within about ``GRACE_S``
    seconds, every process is stopped, and that rank's exception is re-raised here. No process
    outlives the call, also on Ctrl-C or a timeout.

    Args:
        fn: a picklable (module-level) function. Inside it, ``sharded_nn.init_mesh`` finds the
            process group.
        nprocs: number of processes.
        timeout: seconds for the whole run and for each collective; past it the run fails.
        device_type: ``"cuda"`` (one GPU per rank, NCCL) or ``"cpu"`` (gloo); default: CUDA when
            there are enough GPUs.
        threads: torch threads per process (``None`` leaves torch's default).
        huge_pages: start the processes with ``THP_MEM_ALLOC_ENABLE=1`` (unless the variable is
            already set), so that torch puts large CPU tensors on transparent huge pages; see
            ``sharded_nn.host_memory``. Under torchrun, export the variable yourself.
        mmap_threshold: glibc's mmap threshold in bytes, fixed in every process, or None for
            glibc's own dynamic one (it rises to 32 MiB: freed buffers below it stay in a heap that
            fragments). ``"auto"`` (default): glibc's own where the host cache is installed (the
            cache serves every tensor buffer of 256 KiB or more, and a fixed threshold only made
            oneDNN's activation-sized temporaries fresh mappings, faulted in on every step:
            ``convnext_atto`` 1024x512 fwd+bwd 28k page faults per step and 10% slower at P=1),
            else ``host_memory.DEFAULT_MMAP_THRESHOLD`` (1 MiB: activations above it go back to
            the OS when freed, so a rank's resident memory follows its live tensors, at the price
            of page faults on every step; under torchrun without the cache call
            ``host_memory.tune_host_allocator()`` for the same). ``65536``: every freed buffer
            above 64 KiB goes back to the OS at once, at the cost of page faults and kernel time
            on every step (a timm RegNet at 1024x512 spent as much time in the kernel as in torch).
        host_cache: make ``sharded_nn.host_cache`` torch's CPU allocator in every process (unless
            ``SHARDED_NN_HOST_CACHE=0``): large buffers are reused by size instead of faulted in
            afresh on every step, and what it holds stays within the peak of the live tensors.
            False keeps torch's own allocator (a plain-torch baseline), also where ``fn`` calls
            ``init_mesh``.

    Raises:
        The first failing rank's exception, with its remote traceback as ``__cause__``;
        ``RuntimeError`` when a rank died without a Python exception (killed by the OS);
        ``TimeoutError`` when the run exceeds ``timeout``.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        # "spawn" starts each rank by importing the main module (as ``__mp_main__``): a call at
        # its top level runs again in every rank, which cannot start processes while it is being
        # started. Said first, in the ranks' stderr (Python's own message comes after a port
        # bound and a build, buried in every rank's traceback).
        raise RuntimeError(
            "launch: called while a rank was importing the script that calls it. Ranks start by importing "
            "the main module, so its top level runs in every rank; put the call under "
            '`if __name__ == "__main__":` (as in the README\'s Usage).'
        )
    if nprocs < 1:
        raise ValueError(f"launch: nprocs must be >= 1, got {nprocs}.")
    resolve_mmap_threshold(mmap_threshold, True)  # a bad value fails here, not in every rank
    collective_timeout = timedelta(seconds=timeout)
    store = rendezvous_store(collective_timeout)
    with tempfile.TemporaryDirectory(prefix="sharded_nn-launch-") as outdir:
        worker_args = (
            nprocs, store.port, collective_timeout, device_type, threads, mmap_threshold, host_cache, os.getpid(),
            outdir, fn, args,
        )
        # Compile the native libraries once here rather than in every rank (they would queue on
        # the build lock); a failure is the ranks' to report (or to fall back from).
        if host_cache and _host_cache.wanted():
            with contextlib.suppress(RuntimeError, OSError):
                _host_cache.build()
        if _moments.wanted():
            with contextlib.suppress(RuntimeError, OSError):
                _moments.build()
        context = _start(worker_args, nprocs, huge_pages)
        try:
            _wait(context, timeout)
        except (torch_mp.ProcessRaisedException, torch_mp.ProcessExitedException) as exc:
            _raise_failure(context.processes, outdir, exc)
        finally:
            _stop(context.processes)
        result = _result_file(outdir)
        if not result.exists():
            raise RuntimeError("launch: every rank finished, but rank 0 left no result; this is a bug.")
        return _load_result(result.read_bytes())


def _start(worker_args: tuple[Any, ...], nprocs: int, huge_pages: bool) -> torch_mp.ProcessContext:
    before = set(mp.active_children())
    try:
        with huge_pages_for_children(huge_pages):
            # Not daemonic: a rank may start processes of its own (DataLoader workers); the
            # parent stops the ranks itself, and they die with it (die_with_parent).
            return torch_mp.start_processes(
                _worker, worker_args, nprocs=nprocs, join=False, daemon=False, start_method="spawn"
            )
    except BaseException:
        # Interrupted between two starts (Ctrl-C): stop the ranks already running.
        _stop([p for p in mp.active_children() if p not in before])
        raise


def _wait(context: torch_mp.ProcessContext, timeout: float) -> None:
    """Return when every rank exited cleanly; raise torch's ``Process*Exception`` on the first failure."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=GRACE_S):
        if time.monotonic() >= deadline:
            pending = [r for r, p in enumerate(context.processes) if p.is_alive()]
            raise TimeoutError(f"launch: ranks {pending} did not finish within {timeout}s.")


def _stop(processes: Sequence[mp.process.BaseProcess]) -> None:
    """SIGTERM, then SIGKILL after ``GRACE_S``, to every process still alive; reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def _load_error(path: Path) -> tuple[BaseException, str, float] | None:
    if not path.exists():
        return None
    try:
        return pickle.loads(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - e.g. an exception class this process cannot import
        return RuntimeError(f"(the rank's exception could not be unpickled here: {exc!r})"), "", float("inf")


def _raise_failure(
    processes: Sequence[mp.process.BaseProcess],
    outdir: str,
    seen: torch_mp.ProcessRaisedException | torch_mp.ProcessExitedException,
) -> None:
    """Re-raise the root failure of a run whose processes have all ended.

    ``seen`` names the first rank the launcher saw exit with an error. A rank that died without
    a Python exception is the root cause (its peers' errors follow from its closed connections);
    otherwise the earliest exception is, which is not always that of the first rank to exit.
    """
    first_exit = seen.error_index
    errors = {r: e for r in range(len(processes)) if (e := _load_error(_error_file(outdir, r))) is not None}
    root = first_exit if first_exit not in errors else min(errors, key=lambda r: errors[r][2])
    others = []
    for r, p in enumerate(processes):
        if r == root:
            continue
        if r in errors:
            exc, _, at = errors[r]
            # When it raised, relative to the root failure: how long a knock-on error took.
            dt = at - errors[root][2] if root in errors else math.nan
            when = f" {dt:+.2f} s after rank {root}" if math.isfinite(dt) else ""
            others.append(f"rank {r} raised {type(exc).__name__}{when}: {exc}")
        elif p.exitcode not in (0, None):
            others.append(f"rank {r} ended with {_exit_status(p.exitcode)}")
    # The root error may be a knock-on one (a peer's connection closing): name every other
    # failure so that the cause is not lost.
    other_text = ("\n--- other ranks ---\n" + "\n".join(others)) if others else ""
    if root not in errors:
        code = processes[root].exitcode
        if isinstance(seen, torch_mp.ProcessRaisedException):
            # Raised outside fn (torch's launcher caught it): its traceback is all there is.
            hint = f"; the launcher caught:{seen.msg}"
        elif code is not None and code < 0:
            hint = " (killed by a signal: out of memory is a common cause)"
        else:
            hint = (
                " (os._exit, or a crash before fn ran: see the rank's stderr; common causes: a script that calls "
                'launch outside `if __name__ == "__main__":`, and a function the ranks cannot import, such as one '
                "defined in an interactive session)"
            )
        raise RuntimeError(
            f"launch: rank {root} died with {_exit_status(code)} and no traceback{hint}{other_text}"
        ) from None
    exc, tb, _ = errors[root]
    raise exc from RemoteTraceback(f"\n--- rank {root} traceback ---\n{tb}{other_text}")
