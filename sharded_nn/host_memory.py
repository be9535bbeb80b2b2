"""Host (CPU) memory tuning for the processes of a run: glibc's mmap threshold, huge pages.

Not part of the top-level API. ``import sharded_nn`` turns huge pages on for its own process
(:func:`apply_process_defaults`; opt out with ``SHARDED_NN_HOST_TUNING=0``), so that a run under
torchrun gets them without exporting anything. ``sharded_nn.launch`` fixes glibc's mmap threshold
in the processes it starts (``DEFAULT_MMAP_THRESHOLD``, 16 MiB; ``mmap_threshold=None`` leaves
glibc's own, ``65536`` keeps resident memory closest to the live tensors at the price of page
faults on every step).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

#: Read once by torch's CPU allocator, at its first allocation: with ``1``, large CPU tensors go
#: on transparent huge pages.
THP_ENV = "THP_MEM_ALLOC_ENABLE"

#: Set to ``0`` to keep ``import sharded_nn`` from touching the process's allocator settings.
OPT_OUT_ENV = "SHARDED_NN_HOST_TUNING"

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)

#: ``launch``'s default mmap threshold (16 MiB). glibc's own threshold rises to the size of the
#: largest mapped block freed so far, up to 32 MiB; after that, freed 16-32 MiB activations stay
#: in the heap, fragmented and resident. At P=2 the slabs of a big model fall in exactly that
#: range where P=1's full tensors (above 32 MiB) are always unmapped: the fwd+bwd peak of the
#: sharded 3-D UNet at 96^3 was 999-1058 MiB per rank (0.62-0.65x of P=1's 1624) with glibc's
#: threshold and 889-920 MiB (0.55-0.57x) with 16 MiB, at the same CPU time; smaller buffers
#: (halos, strips, statistics) are still reused from the heap without page faults, unlike with
#: 64 KiB (see ``tune_host_allocator``).
DEFAULT_MMAP_THRESHOLD = 16 << 20


def tune_host_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold so that freed large CPU tensors go back to the OS at once.

    glibc raises its mmap threshold each time a mapped block is freed; after that, mid-sized
    buffers (halos, boundary strips) are served from heap arenas, which keep freed memory and
    fragment, so resident memory drifts above what the live tensors need. A fixed threshold (as
    ``MALLOC_MMAP_THRESHOLD_`` would set) keeps a rank's resident memory close to its live
    tensors, but every step then faults its buffers in again (kernel time).
    ``launch`` calls this in every worker (``DEFAULT_MMAP_THRESHOLD``, 16 MiB, unless told
    otherwise); under torchrun, call it at start-up (or export ``MALLOC_MMAP_THRESHOLD_``).
    16 MiB keeps the buffers a step reuses most (halos, strips, statistics) in the heap and
    unmaps only the big activations; 64 KiB follows the live tensors closest but refaults
    every buffer on every step.

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


def apply_process_defaults() -> bool:
    """Turn torch's transparent-huge-page allocations on for this process, unless told otherwise.

    Why the library does it itself: every fresh activation buffer of a big sample is otherwise
    faulted in 4 KiB at a time, which cost a sharded Conv3d stack at 1x16x128^3 about 10% of its
    time (1.73x instead of 1.91x at P=2), and users run under torchrun with the default
    environment, not with allocator variables exported.

    torch reads ``THP_MEM_ALLOC_ENABLE`` once, at the first CPU allocation of the process (any
    size), so this only takes effect when ``sharded_nn`` is imported before the first tensor is
    created, as in the usual ``import torch, sharded_nn`` preamble; otherwise export the variable.
    A value the user set (``0`` included) is kept, and ``SHARDED_NN_HOST_TUNING=0`` leaves the
    environment untouched. The variable is inherited by processes this one starts.

    Returns:
        True when the variable was set by this call.
    """
    if os.environ.get(OPT_OUT_ENV, "1") == "0" or THP_ENV in os.environ:
        return False
    os.environ[THP_ENV] = "1"
    return True
