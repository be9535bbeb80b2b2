"""What ``import sharded_nn`` sets for its own process: torch's huge-page switch, and nothing else.

Each case runs in a fresh interpreter, because torch reads the variable once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")

_PROBE = (
    "import os, torch, sharded_nn\n"
    "x = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)\n"  # 64 MiB, faulted in
    "huge = sum(int(l.split()[1]) for l in open('/proc/self/smaps') if l.startswith('AnonHugePages'))\n"
    "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), huge)\n"
)


def _probe(**env: str) -> tuple[str, int]:
    full = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "SHARDED_NN_HOST_TUNING")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, check=True)
    value, huge = out.stdout.split()
    return value, int(huge)


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_import_turns_huge_pages_on():
    value, huge = _probe()
    assert value == "1"
    if _thp_available():
        # The switch reached torch's allocator, not just the environment.
        assert huge > 0


def test_user_value_is_kept():
    value, huge = _probe(THP_MEM_ALLOC_ENABLE="0")
    assert value == "0"
    assert huge == 0 or not _thp_available()


def test_opt_out_leaves_environment_alone():
    value, _ = _probe(SHARDED_NN_HOST_TUNING="0")
    assert value == "None"


def _retained_mib() -> float:
    """Resident MiB kept after freeing a 20 MiB buffer that followed a freed 30 MiB one."""
    import torch

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    # glibc's own threshold rises to 30 MiB when the first (mapped) buffer is freed, so the
    # second comes from the heap and stays resident after it is freed.
    torch.empty(30 << 20, dtype=torch.uint8).fill_(1)
    base = rss_kib()
    torch.empty(20 << 20, dtype=torch.uint8).fill_(1)
    return (rss_kib() - base) / 1024


def test_launch_unmaps_freed_slabs_by_default():
    import sharded_nn as snn

    glibc = snn.launch(_retained_mib, 1, mmap_threshold=None)
    fixed = snn.launch(_retained_mib, 1)  # DEFAULT_MMAP_THRESHOLD: 16 MiB
    assert glibc >= 16, glibc
    assert fixed < 4, fixed
