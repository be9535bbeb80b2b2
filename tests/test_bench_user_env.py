"""The benchmarks' ``--env user`` mode (``bench/user_env.py``, ``bench/cnn.py --env user``).

The user's-environment measurements (issue 12 item 4, issue 16) run the converted model under
``torch.distributed.run`` (not ``snn.launch``) and plain torch in a process of its own: these
check that the ranks get what a user's would, and that a converted timm CNN run that way
matches plain timm.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("timm")

_ROOT = Path(__file__).resolve().parents[1]


def test_user_environment_run_matches_plain_timm():
    cmd = [sys.executable, str(_ROOT / "bench" / "cnn.py"), "--env", "user", "--models", "regnetx_002",
           "--sizes", "64x32", "--iters", "1", "--min-seconds", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=_ROOT, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| regnetx_002 | 64x32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    fwd1, fwd2, step1, step2 = (float(cells[i]) for i in (2, 3, 5, 6))
    assert min(fwd1, fwd2, step1, step2) > 0
    err = cells[8]  # "P=2 <logits>/<grad>": relative errors against plain timm at P=1
    logits, grad = (float(v) for v in err.split()[1].split("/"))
    assert logits < 1e-5 and grad < 1e-3, err


def test_user_environment_ranks_get_what_a_user_gets(monkeypatch):
    # P=1: a plain process (no host cache, no allocator variables, one thread); P=2 under
    # torchrun: what init_mesh sets up for itself (the host cache) and nothing exported by us.
    monkeypatch.syspath_prepend(str(_ROOT))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "12345")  # dropped: not the user's default
    from bench.user_env import launch_as_user, probe

    one = launch_as_user(probe, 1, timeout=300)
    two = launch_as_user(probe, 2, timeout=300)
    assert one["world"] == 1 and not one["host_cache"] and one["threads"] == 1 and one["mmap"] is None and one["thp"] is None, one
    assert two["world"] == 2 and two["threads"] == 1 and two["mmap"] is None, two
    # The ranks have the cache, or say why they could not build it (no C++ compiler, not Linux).
    assert two["host_cache"] or two["why_not"], two
    # ``plain``: every rank as P=1 (the host's ceiling: plain processes running at once).
    both = launch_as_user(probe, 2, timeout=300, plain=True)
    assert both["world"] == 2 and not both["host_cache"] and both["threads"] == 1 and both["mmap"] is None, both
