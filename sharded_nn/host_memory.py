"""Host (CPU) memory tuning for the processes of a run: glibc's mmap threshold, huge pages.

Since session 22 the buffers that matter (tensors of 256 KiB and more) bypass glibc in the
processes of ``launch`` and of ``init_mesh`` on CPU: ``sharded_nn.host_cache`` serves them, reused
by size without page faults. The threshold below still governs everything else (smaller tensors,
non-tensor buffers) and processes where the cache is off or could not be built.

Not part of the top-level API. ``import sharded_nn`` turns torch's transparent-huge-page
allocation on for its own process (:func:`apply_process_defaults`; opt out with
``SHARDED_NN_HOST_TUNING=0``). ``sharded_nn.launch`` fixes glibc's mmap threshold at 1 MiB
(``DEFAULT_MMAP_THRESHOLD``) in the processes it starts where the host cache is off or could not
be built (``mmap_threshold="auto"``, its default; :func:`resolve_mmap_threshold`); under torchrun,
:func:`tune_host_allocator` does the same. The import does not: the threshold applies to every
allocation of the process, and 1 MiB made plain torch code in the same process up to 1.5x slower
on this VM (page faults of buffers glibc would otherwise reuse).

Where the host cache serves torch's buffers, the fixed threshold no longer bounds any tensor,
and it cost page faults on every step: oneDNN allocates its own temporaries with ``malloc``
(reordered activations as large as the activation: 20 MiB in a ``convnext_atto`` 1024x512 1x1
convolution's backward), and above the threshold each is a fresh mapping faulted in on every
call. Measured (session 44, ``bench/host_alloc.py --policies cache lib+cache --warmup 3``, fwd+bwd,
glibc's own threshold against 1 MiB, both with the cache): page faults per step, P=1 / P=2,
``convnext_atto`` 1024x512 0 / 35 against 28176 / 14105 (step 0.67 / 0.40 s against 0.75 / 0.43),
``regnetx_002`` 184 / 371 against 6717 / 3149 (0.37 / 0.21 s against 0.40 / 0.25),
``mobilenetv3_large_100`` 0 / 227 against 16238 / 7621, zoo ``unet2d`` 512x896 14337 / 0 against
31365 / 15685 (1.64 / 0.87 s against 1.78 / 0.99); resident peaks within 3% (``unet2d`` P=1
984 against 958 MiB, the largest difference; P=2 over P=1 0.51-0.58x either way), ``vit_small``
and ``unet3d`` unchanged.
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

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1

#: The library's mmap threshold (1 MiB): every CPU buffer of 1 MiB or more (an activation of a
#: big sample, a ring attention piece) is its own mapping and goes back to the OS when freed;
#: smaller ones (halos, strips, statistics, per-head pieces) are reused from glibc's heap without
#: page faults. Why: a rank's resident memory then follows its live tensors, which halve at P=2,
#: whatever the model and the size of its activations. glibc's own threshold rises to the largest
#: mapped block freed so far (up to 32 MiB), and any fixed one above an activation's size keeps it
#: in the heap: there, activations saved for backward and temporaries that die at once
#: interleave, the holes are neither reused nor returned, and resident memory drifts far above
#: the tensors. Measured (``bench/host_alloc.py``, fwd+bwd, peak resident size above the start,
#: P=2 per rank over P=1 under the same policy; the tensors alone, ``mallinfo2``, are 0.50-0.51x
#: in every case), glibc / 16 MiB / 2 MiB / 1 MiB: vit_small 1024^2 (4 blocks) 0.53 / 0.62 /
#: 0.57 / 0.54x, vit_small 1024^2 (12 blocks) 0.55x at 2 MiB, 0.52x at 1 MiB, vit_tiny 1024^2
#: 0.61x and 0.53x, 3-D UNet 96^3 0.67 / 0.55 / 0.55 / 0.54x, 2-D UNet 512x896 0.65 / 0.74 /
#: 0.53 / 0.53x. The price: buffers of 1 MiB and more are faulted in afresh on every step (glibc
#: maps every one above 32 MiB afresh anyway), 4 KiB at a time below torch's 2 MiB huge pages;
#: a forward-only (inference) run, whose heap does not fragment, is cheaper with a higher
#: threshold. See the README's torchrun paragraph for fault counts and CPU times.
DEFAULT_MMAP_THRESHOLD = 1 << 20

#: ``launch(mmap_threshold=AUTO)``: ``DEFAULT_MMAP_THRESHOLD`` in a process without the host cache,
#: glibc's own threshold in one with it (see the module docstring for the measurements).
AUTO = "auto"


def resolve_mmap_threshold(mmap_threshold: int | str | None, host_cache_installed: bool) -> int | None:
    """The threshold a process gets for ``launch``'s ``mmap_threshold`` (None: glibc's own).

    Raises:
        ValueError: for a value that is neither bytes, None nor ``"auto"``.
    """
    if mmap_threshold == AUTO:
        return None if host_cache_installed else DEFAULT_MMAP_THRESHOLD
    if mmap_threshold is None or (
        isinstance(mmap_threshold, int) and not isinstance(mmap_threshold, bool) and mmap_threshold > 0
    ):
        return mmap_threshold
    raise ValueError(
        f"mmap_threshold: expected a positive number of bytes, None (glibc's own) or {AUTO!r}, got {mmap_threshold!r}."
    )


def parse_mmap_threshold(text: str) -> int | str | None:
    """A command line's ``--mmap-threshold``: bytes, ``glibc`` (None: glibc's own) or ``auto``."""
    if text in ("glibc", AUTO):
        return None if text == "glibc" else AUTO
    return int(text)


def tune_host_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold so that freed large CPU tensors go back to the OS at once.

    glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB); after
    that, activations below it are served from heap arenas, which keep freed memory and
    fragment, so resident memory drifts above what the live tensors need. A fixed threshold (as
    ``MALLOC_MMAP_THRESHOLD_`` would set) keeps a rank's resident memory close to its live
    tensors; buffers at or above it are faulted in afresh on every step. ``launch`` calls this in
    its ranks with ``DEFAULT_MMAP_THRESHOLD`` (1 MiB; see that constant for the measurements)
    where the host cache is not installed; under torchrun without the cache, call it at
    start-up. Calling it again later is safe: it applies to the allocations that follow.

    Args:
        mmap_threshold: allocations of at least this many bytes are served by ``mmap``.

    Returns:
        False where glibc's ``mallopt`` is unavailable (not Linux/glibc) or refused the value.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        threshold = int(mmap_threshold)
        if not libc.mallopt(_M_MMAP_THRESHOLD, threshold):
            return False
        keep = 2 * threshold
        # Freed heap memory is kept up to twice the threshold at the heap's top (glibc's own
        # rule when it moves its threshold, which a fixed one stops): a buffer below the
        # threshold is then reused without faults instead of being trimmed and refaulted.
        libc.mallopt(_M_TRIM_THRESHOLD, keep)
        # The threshold decides only how the heap grows: a request that free heap memory can
        # serve is served from it. What the process freed before this call (the heap grows
        # under glibc's raised threshold while torch is imported: up to ~100 MiB free at its
        # top in some launched ranks) would serve large buffers for good, so it goes back now,
        # but for the trim threshold's worth at the top (what smaller buffers reuse anyway).
        libc.malloc_trim(keep)
        return True
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
    """Apply the library's host-allocator policy to this process, unless told otherwise.

    Because users run under torchrun with the default environment, not with allocator variables
    exported:

    * ``THP_MEM_ALLOC_ENABLE=1``: torch puts CPU buffers of 2 MiB and more on transparent huge
      pages, faulted in 2 MiB at a time instead of 4 KiB (a 1x16x128^3 Conv3d stack spent about
      10% of its time in page faults without it). torch reads the variable once, at the first CPU
      allocation of the process, so this only takes effect when ``sharded_nn`` is imported before
      the first tensor is created, as in the usual ``import torch, sharded_nn`` preamble;
      otherwise export it. A value the user set (``0`` included) is kept. The variable is
      inherited by processes this one starts.
    glibc's mmap threshold is left alone here (``launch`` sets it in its ranks, and a torchrun
    script calls ``tune_host_allocator()``): it would apply to the user's own plain torch code in
    this process too, which session 21 measured up to 1.5x slower with the 1 MiB threshold (the
    quiet vit_tiny 1024^2 fwd+bwd at P=1: 16.2 s against 10.7 s with 16 MiB).

    ``SHARDED_NN_HOST_TUNING=0`` leaves the environment alone.

    Returns:
        True when this call changed a setting.
    """
    if os.environ.get(OPT_OUT_ENV, "1") == "0":
        return False
    if THP_ENV in os.environ:
        return False
    os.environ[THP_ENV] = "1"
    return True
