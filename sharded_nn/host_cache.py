"""A caching CPU allocator for torch: large buffers are reused by size instead of faulted afresh.

Not part of the top-level API; ``sharded_nn.launch`` installs it in its ranks and
``init_mesh(device_type="cpu")`` in the process that calls it (torchrun), unless
``SHARDED_NN_HOST_CACHE=0``.

Why. A step of a model allocates the same activation sizes every time. glibc serves a large
buffer either from a fresh mapping (every page faulted in again on every step: on this VM the
faults of a 1024x512 ``resnet50`` forward cost a quarter of its time) or from heap arenas that
fragment and keep resident memory above the live tensors (``host_memory`` has the measurements).
The cache (``csrc/host_cache.cpp``, installed with ``c10::SetCPUAllocator``) keeps each freed
buffer of ``MIN_BYTES`` or more as a whole mapping and hands it to the next request of nearly the
same size (at most an eighth larger); among blocks of the fitting size, up to 4 MiB the most
recently freed first, whose lines are the likeliest still in the core's caches (the longest-idle
first cost P=2 eval forwards 2-6%), larger ones the longest-idle first (README, Getting
started). What it holds is bounded: before mapping a new block it
releases the longest-unused cached ones until the mapped total is within the peak of the live
large buffers (this one counted) plus a sixteenth, so resident memory follows the live tensors as
with a low mmap threshold. The slack is also at most an eighth of the bytes that come and go (the
peak above the lowest live total of the last thousand or so releases): what stays live, such as
a model's weights, does not widen it (a ViT's 88 MiB of weights beside 36 MiB of activations). At
that bound a request resizes a cached block (cuts a larger one's tail, or grows a smaller one in
place with ``mremap``) rather than releasing blocks and faulting in a new one (mobilenetv3 1024x512 training: misses per step 84 -> 26 at P=1, 73 -> 21 at P=2). Buffers of 2 MiB and more go on transparent huge pages where the
process asked for them (``THP_MEM_ALLOC_ENABLE=1``, which ``import sharded_nn`` sets).

Results are unchanged: the cache only decides where a tensor's bytes live. Tensors allocated
before the install keep their own deleter. :func:`empty_cache` returns what the cache holds to the
OS (as ``torch.cuda.empty_cache`` does for the GPU); the memory profiler of ``torch.profiler`` does
not see the cache's blocks.

The allocator is C++ compiled on first use with the machine's C++ compiler against the installed
torch's headers (``sharded_nn.native``: about two seconds, once per torch version; the library
lands in ``$SHARDED_NN_CACHE_DIR``, default ``~/.cache/sharded_nn``). Without a compiler,
:func:`install` returns False, :func:`why_not` says why, and torch's own allocator stays.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from pathlib import Path

from . import native

#: ``0`` keeps ``launch`` and ``init_mesh`` from installing the cache.
OPT_OUT_ENV = "SHARDED_NN_HOST_CACHE"
#: Where the compiled library is kept (default ``~/.cache/sharded_nn``; ``sharded_nn.native``).
CACHE_DIR_ENV = native.CACHE_DIR_ENV

#: Buffers below this go to torch's own allocator (glibc's heap reuses them without faults).
MIN_BYTES = 256 << 10

_STAT_NAMES = (
    "hits", "misses", "live_bytes", "cached_bytes", "peak_live_bytes", "evictions", "peak_mapped_bytes", "reshapes",
    "trough_live_bytes", "segments",
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_warned = False


def wanted() -> bool:
    """False when ``SHARDED_NN_HOST_CACHE=0`` asks to keep torch's own CPU allocator."""
    return os.environ.get(OPT_OUT_ENV, "1") != "0"


def installed() -> bool:
    """Whether this process's CPU tensors come from the cache."""
    return _lib is not None


def why_not() -> str | None:
    """Why the last :func:`install` failed (no compiler, a compile error), or None."""
    return _why_not


def build() -> Path:
    """Compile the allocator (once; concurrent ranks wait on a file lock) and return its path.

    Raises:
        RuntimeError: no C++ compiler, or the compile failed (its output is in the message).
    """
    hint = f" or set {OPT_OUT_ENV}=0 to keep torch's own CPU allocator"
    return native.build("host_cache", link_torch=True, opt_out_hint=hint)


def install(min_bytes: int = MIN_BYTES, *, huge_pages: bool | None = None, warn: bool = False) -> bool:
    """Make the cache torch's CPU allocator for the rest of this process (idempotent).

    Args:
        min_bytes: buffers of at least this many bytes are cached; smaller ones stay with torch's
            allocator.
        huge_pages: offer blocks of 2 MiB and more transparent huge pages; default: as torch
            does, when ``THP_MEM_ALLOC_ENABLE=1`` is set.
        warn: on failure, warn once per process (with the reason and how to silence it).

    Returns:
        True when the cache is installed (now or before); False when it could not be built or
        loaded, with the reason in :func:`why_not`.
    """
    global _lib, _why_not, _warned
    with _lock:
        if _lib is not None:
            return True
        if not sys.platform.startswith("linux"):
            _why_not = f"the host cache needs Linux (mmap, madvise); this is {sys.platform}"
            return False
        if huge_pages is None:
            huge_pages = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        try:
            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError) as exc:
            _why_not = str(exc)
            if warn and not _warned:
                _warned = True
                warnings.warn(
                    f"sharded_nn: torch's own CPU allocator stays (large buffers are page-faulted "
                    f"afresh on every step): {exc}. Set {OPT_OUT_ENV}=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return False
        lib.snn_host_cache_install.argtypes = (ctypes.c_uint64, ctypes.c_int)
        lib.snn_host_cache_install.restype = ctypes.c_int
        lib.snn_host_cache_stats.argtypes = (ctypes.POINTER(ctypes.c_uint64),)
        lib.snn_host_cache_stats.restype = None
        lib.snn_host_cache_empty.restype = None
        lib.snn_host_cache_install(int(min_bytes), int(bool(huge_pages)))
        _lib, _why_not = lib, None
        return True


def install_default() -> bool:
    """What ``launch`` and ``init_mesh`` call: :func:`install` unless opted out, warning on failure."""
    return wanted() and install(warn=True)


def stats() -> dict[str, int]:
    """Counters of the cache: ``hits``/``misses`` (requests served from a cached block or by a new
    mapping), ``live_bytes``/``cached_bytes`` (in tensors / held for reuse), their peaks
    ``peak_live_bytes`` and ``peak_mapped_bytes`` (live + cached), ``evictions`` (blocks returned
    to the OS to stay within the bound), ``reshapes`` (requests served, at the bound, by cutting
    a larger cached block or joining the pages of smaller ones in place of a new mapping),
    ``trough_live_bytes`` (the lowest live total over the recent releases, which the slack is
    measured from; the largest integer before the first release), ``segments`` (the pieces all
    blocks are made of: one per block mapped whole, more for joined ones; each is at most one
    kernel mapping). All zero when the cache is not installed."""
    if _lib is None:
        return dict.fromkeys(_STAT_NAMES, 0)
    out = (ctypes.c_uint64 * len(_STAT_NAMES))()
    _lib.snn_host_cache_stats(out)
    return dict(zip(_STAT_NAMES, (int(v) for v in out)))


def empty_cache() -> None:
    """Return every cached (unused) block to the OS; live tensors are untouched."""
    if _lib is not None:
        _lib.snn_host_cache_empty()
