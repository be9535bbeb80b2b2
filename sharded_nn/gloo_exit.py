"""Process exit after gloo collectives: a moment for gloo's worker threads before teardown.

Why: torch's gloo process group finishes a collective on one of its worker threads, wakes the
caller, and only then releases the work object and with it the collective's tensors. Where the
caller's own reference to such a tensor is gone by then (the last ``all_reduce`` of a script,
whose result was read), the worker drops the tensor's last reference, which needs the GIL to
free its Python object. If the worker lost its core in that moment and the process meanwhile
reached interpreter teardown, the thread cannot take the GIL any more, the interpreter ends it,
and C++ aborts the process: "terminate called without an active exception", SIGABRT, after the
rank's work was complete (gdb: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``; torch 2.14). torchrun then reports the
job failed. Measured on the 2-vCPU CI host: 1 in 6 runs of ``bench/torchrun_env.py``'s small case,
1 in 3-4 P=2 launches of ``bench/cnn.py`` (before ``launch`` ended its ranks with ``os._exit``).

What: once a process has used a gloo group through sharded_nn (``init_mesh`` on CPU, the
same-host transport), an ``atexit`` handler sleeps ``GRACE_S`` at exit. Exit handlers run before
teardown and the sleep releases the GIL, so a worker still holding a tensor finishes with it
then. Nothing else is changed; a process that never used gloo pays nothing. ``launch``'s ranks
skip both the teardown and the wait (``disarm``, then ``os._exit`` after their exit handlers).
"""

from __future__ import annotations

import atexit
import time

#: Seconds the exit handler leaves gloo's worker threads (a preempted thread gets its core back
#: within a scheduler tick, a few milliseconds).
GRACE_S = 0.05

_ARMED = [False]


def arm() -> None:
    """Register the exit handler (once per process); called where sharded_nn meets a gloo group."""
    if not _ARMED[0]:
        _ARMED[0] = True
        atexit.register(_grace)


def disarm() -> None:
    """Drop the exit handler: for a process that ends with ``os._exit`` (no teardown to wait for)."""
    atexit.unregister(_grace)
    _ARMED[0] = False


def armed() -> bool:
    """Whether this process will leave gloo's workers ``GRACE_S`` at exit."""
    return _ARMED[0]


def _grace() -> None:
    time.sleep(GRACE_S)
