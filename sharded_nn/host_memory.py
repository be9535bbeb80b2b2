"""Host (CPU) memory tuning for the processes of a run: glibc's mmap threshold, huge pages.

Not part of the top-level API: ``sharded_nn.launch`` applies both settings to the processes it
starts; under torchrun, call :func:`tune_host_allocator` at start-up and export
``THP_MEM_ALLOC_ENABLE=1`` (or ``MALLOC_MMAP_THRESHOLD_=65536``) yourself.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

#: Read once by torch's CPU allocator, at its first allocation: with ``1``, large CPU tensors go
#: on transparent huge pages.
THP_ENV = "THP_MEM_ALLOC_ENABLE"

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def tune_host_allocator(mmap_threshold: int = 1 << 16) -> bool:
    """Fix glibc's mmap threshold so that freed large CPU tensors go back to the OS at once.

    glibc raises its mmap threshold each time a mapped block is freed; after that, mid-sized
    buffers (halos, boundary strips) are served from heap arenas, which keep freed memory and
    fragment, so resident memory drifts above what the live tensors need. A fixed threshold (as
    ``MALLOC_MMAP_THRESHOLD_`` would set) keeps a rank's resident memory close to its live
    tensors, which is what per-rank memory figures should measure. ``launch`` calls this in
    every worker; under torchrun, call it at start-up (or export
    ``MALLOC_MMAP_THRESHOLD_=65536``).

    Args:
        mmap_threshold: allocations of at least this many bytes are served by ``mmap``.

    Returns:
        False where glibc's ``mallopt`` is unavailable (not Linux/glibc) or refused the value.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    except (OSError, AttributeError):
        return False


@contextmanager
def huge_pages_for_children(enabled: bool = True) -> Iterator[None]:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` while child processes are started; restore it afterwards.

    torch reads the variable at the first CPU allocation of a process, so it must be in the
    environment the children start with; the parent's own environment is left as it was. A
    value the user already set (``0`` included) is kept.

    Every fresh activation buffer of a big sample is otherwise page-faulted in 4 KiB at a time:
    on a 128^3 Conv3d stack this was a third of the run time.

    Args:
        enabled: False leaves the environment untouched.
    """
    if not enabled or THP_ENV in os.environ:
        yield
        return
    os.environ[THP_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(THP_ENV, None)
