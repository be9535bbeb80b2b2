"""``sharded-nn demo``: the console entry runs end to end at a tiny size; bad options fail in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sharded_nn import cli


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "sharded_nn", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    "model,size,repeat", [("vit", "32", "1"), ("cnn", "16", "2"), ("fno", "32", "1"), ("meshgraphnet", "16", "1")],
    ids=["vit", "cnn-repeat2", "fno", "meshgraphnet"],
)
def test_demo_tiny_matches_single_process(tmp_path: Path, model: str, size: str, repeat: str):
    out = tmp_path / "demo"
    proc = _run(
        "demo", "--model", model, "--size", size, "--depth", "1", "--repeat", repeat, "--out", str(out), "--no-progress"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((out / f"demo_{model}.json").read_text())
    assert record["ok"] is True and record["model"] == model
    assert [r["nproc"] for r in record["runs"]] == [1, 2]
    assert len(record["runs"][1]["mem_mib"]) == 2  # one peak per rank
    assert set(record["max_abs_diff"]) == {"output", "input grad", "param grads"}
    assert max(record["max_abs_diff"].values()) <= record["tolerance"] <= 1e-1
    assert set(record["tolerances"]) == set(record["max_abs_diff"])
    assert all(record["max_abs_diff"][k] <= record["tolerances"][k] for k in record["tolerances"])
    assert max(record["max_abs_diff"]["output"], record["max_abs_diff"]["input grad"]) < 1e-4
    png = out / f"demo_{model}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "OK: sharded == single process" in proc.stdout and "| P |" in proc.stdout


def test_compare_checks_each_quantity_against_its_own_scale():
    """An output off by 1% fails even where the parameter gradients (of a summed loss) are 1000x
    larger than the output: one tolerance for all three quantities would let it pass."""
    import torch

    from sharded_nn import demo

    cfg = demo.DemoConfig(model="cnn", size=16)
    ref = {"out": torch.ones(4), "dx": torch.ones(4), "params": [torch.full((3,), 1000.0)]}
    good = {"out": ref["out"] + 1e-5, "dx": ref["dx"].clone(), "params": [ref["params"][0] + 0.1]}
    bad = dict(good, out=ref["out"] * 1.01)
    diffs, tols, ok = demo.compare(cfg, ref, good)
    assert ok and tols == pytest.approx({"output": 1e-3, "input grad": 1e-3, "param grads": 1.0})
    diffs, tols, ok = demo.compare(cfg, ref, bad)
    assert not ok and diffs["output"] == pytest.approx(1e-2) and diffs["output"] < max(tols.values())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--size", "7"], "expected a multiple of 16 of at least 32, got 7"),
        (["demo", "--model", "cnn", "--nproc", "0"], "--nproc must be >= 1, got 0"),
        (["demo", "--size", "32", "--nproc", "4"], "only 2 aligned slab(s) for --nproc 4"),
        (["demo", "--depth", "0"], "--depth must be >= 1"),
        (["demo", "--repeat", "0"], "--repeat must be >= 1, got 0"),
        (["demo", "--model", "resnet"], "invalid choice: 'resnet'"),
        (["demo", "--size", "big"], "invalid int value: 'big'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_options_one_line_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_bad_option_in_a_subprocess_has_no_traceback():
    proc = _run("demo", "--model", "transolver", "--size", "1", timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sharded-nn demo: error: --size for --model transolver")


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("sharded-nn")
    if not script.exists():
        script = shutil.which("sharded-nn")
    assert script is not None and Path(script).exists(), "reinstall: pip install -e . (pyproject [project.scripts])"
    proc = subprocess.run([str(script), "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--model" in proc.stdout and "--nproc" in proc.stdout


def test_suite_collects_the_speedups_benchmarks_print():
    from bench.run import parse_speedups

    markdown = "| seq | T1 (s) | speedup | mem ratio |\n| --- | --- | --- | --- |\n| 1024 | 0.16 | 1.23x MISS | 0.64x |\n"
    fixed = (
        "case     shape    T1 s   speedup  mem ratio\n-----\n"
        "conv3d   1x16x32x32x32  0.5  1.91x  0.51x\n\nCPU-time ratio T1/T2 1.95x\n"
    )
    assert parse_speedups(markdown) == [1.23]
    assert parse_speedups(fixed) == [1.91]
    assert parse_speedups("P plain sharded ratio\n1 fwd 986 979 0.99\n") == []


def test_step_peak_is_measured_above_the_current_rss_not_an_earlier_mark():
    """A step below an earlier high-water mark (the launching parent's, inherited through spawn,
    or a freed temporary) still shows its own peak; ``ru_maxrss`` growth showed 0 here."""
    import mmap

    from sharded_nn.demo import PeakRSS, maxrss_mib

    def touched(mib: int) -> mmap.mmap:
        # Fresh anonymous pages, every one written: resident whatever the allocators hold (a
        # torch tensor could reuse heap or host-cache pages that earlier tests in this process
        # left resident, and then measured 0 in one CI run).
        buf, chunk = mmap.mmap(-1, mib * 2**20), b"\x01" * 2**20
        for _ in range(mib):
            buf.write(chunk)
        return buf

    touched(96).close()  # 96 MiB: raises the high-water mark, then is freed
    before = maxrss_mib()  # the old measure's baseline: the mark, not the resident memory
    peak = PeakRSS()
    assert peak.exact, "Linux: /proc/self/clear_refs resets the high-water mark"
    step = touched(48)  # 48 MiB touched by the step
    measured = peak.mib()
    step.close()
    assert 44 <= measured <= 60, measured
    assert maxrss_mib() - before < 10  # the old measure (growth of ru_maxrss) misses it
