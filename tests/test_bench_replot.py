"""``python -m bench --replot DIR``: the report rebuilt from small synthetic stored outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import run as suite

CONV = """$ python bench/conv.py --quick
case     shape    T1 s   speedup  mem ratio
-----
conv3d   1x16x32x32x32  0.5  1.91x  0.51x

CPU-time ratio T1/T2 1.95x
"""
COMM = """Communication per forward+backward step, busiest rank, P=2 (KiB sent)

| case | halo | ring | all_to_all | reduction | metadata | other | total | minimum | total / minimum |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 4 x Conv3d(16, 16, 3), 1x16x64^3 | 2048.0 | 0 | 0 | 0 | 0.5 | 0 | 2048.5 | 2048.0 | 1.000 |
| vit_tiny (2 blocks) at 256^2 | 0 | 1545.0 | 0 | 4.6 | 0.4 | 0 | 1550.0 | n/a | n/a |
"""
OVERHEAD = " P             plain   sharded  ratio    scoped  ratio\n 1      fwd       986       979   0.99\n"


def _zoo(model: str, size: int, mem1: float) -> dict:
    return {"model": model, "size": size, "description": f"{model} case", "t1": 2.0, "t2": 1.05, "speedup": 1.9,
            "mem1": mem1, "mem2": mem1 / 2, "pred1": mem1 * 1.02, "pred2": mem1 * 0.5, "ok": True,
            "max_abs_diff": {"output": 1e-7}, "record": {}}  # fmt: skip


def test_replot_rebuilds_report_and_plots_from_stored_outputs(tmp_path: Path):
    stored = tmp_path / "stored"
    stored.mkdir()
    (stored / "conv.txt").write_text(CONV)
    (stored / "comm_volume.txt").write_text(COMM)
    (stored / "layer_overhead.txt").write_text(OVERHEAD)  # no "$ command" line: the default command
    for size, mem in ((512, 150.0), (1024, 598.0)):
        (stored / f"zoo_vit_{size}.json").write_text(json.dumps(_zoo("vit", size, mem)))
    out = tmp_path / "report"
    assert suite.main(["--replot", str(stored), "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    assert "| vit | 512 |" in md and "| vit | 1024 |" in md and "| 598 | 299 |" in md
    assert "## `python bench/conv.py --quick` (stored output)" in md
    assert "## `python bench/layer_overhead.py` (stored output)" in md and "986" in md
    sections = [md.index(f"## `python bench/{n}.py") for n in ("conv", "layer_overhead", "comm_volume")]
    assert sections == sorted(sections)  # the suite's order, not the alphabet
    assert "comm.png" in md
    data = json.loads((out / "results.json").read_text())
    assert [b["name"] for b in data["benchmarks"]] == ["conv", "layer_overhead", "comm_volume"]
    assert data["benchmarks"][0]["speedups"] == [1.91] and len(data["zoo"]) == 2
    for png in ("scaling.png", "memory.png", "comm.png"):
        raw = (out / png).read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) < 100_000, (png, len(raw))


def test_parse_comm_volume_reads_totals_and_minimums():
    assert suite.parse_comm_volume(COMM) == [
        ("4 x Conv3d(16, 16, 3), 1x16x64^3", 2048.5, 2048.0), ("vit_tiny (2 blocks) at 256^2", 1550.0, None)
    ]


def test_replot_of_an_empty_folder_is_a_one_line_error(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exc:
        suite.main(["--replot", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no zoo_<model>_<size>.json" in err[0]
