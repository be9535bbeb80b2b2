"""``bench/cnn.py --env user``: plain timm in a fresh process against ours under torchrun, at a tiny size.

The user's-environment measurement of issue 16 runs the converted model under
``torch.distributed.run`` (not ``snn.launch``) and plain timm in a process of its own; this
checks that both run and that P=2's logits and stem gradient match plain timm's.
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
