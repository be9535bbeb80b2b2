"""The benchmark suite: ``python -m bench [--quick] [--out DIR]``.

Two parts, written into one output folder (``bench_results/`` by default):

1. **Zoo scaling and memory** (this file): each zoo model (ViT, UNet, Transolver, the 3-D CNN) at
   two sizes, forward and backward at P=1 and P=2 with ``sharded_nn.demo.run_local`` (separate
   launches, one thread per rank, P=2 checked against P=1), and ``sharded_nn.plan_memory``'s
   prediction for the same case. Measured memory is the growth of each rank's resident
   high-water mark above its value after the model and the input were built (weights excluded);
   the prediction compared with it is the planner's peak less parameters and input.
2. **Per-model benchmarks** (``bench/conv.py``, ``attention.py``, ``vit.py``, ``unet.py``,
   ``transolver.py``, ``fno.py``, ``meshgraphnet.py``, ``layer_overhead.py``) run as
   subprocesses with small arguments under ``--quick``; their full output is kept
   (``<name>.txt``) and copied into the report, and the speedups they print (``1.83x``) are
   collected for the scaling plot.

Outputs: ``results.md`` (one Markdown report), ``results.json``, ``scaling.png`` (speedup and
efficiency against P), ``memory.png`` (peak memory per rank against resolution, P=1 and P=2,
measured and planned), ``comm.png`` (bytes sent per step against the minimum, from
``bench/comm_volume.py``), and the stored outputs the report is built from: ``<name>.txt`` per
benchmark and ``zoo_<model>_<size>.json`` per zoo case. ``python -m bench --replot DIR`` runs
nothing and rebuilds the report from the stored outputs in DIR, so that quiet runs of single
benchmarks (``python bench/cnn.py > bench/results/cnn.txt``) can replace noisy ones and the
committed plots be regenerated (``python -m bench --replot bench/results``).

``--quick`` is a smoke run of a couple of minutes on 2 cores: tiny sizes, the slow per-model
benchmarks skipped. The full run takes hours on a laptop; numbers depend on the machine's load.

The communication volume per step (bytes moved by halos, rings and reductions, counted by
``sharded_nn.comm.traffic``) against the minimum the algorithm needs is ``bench/comm_volume.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent

#: (model, sizes, depth) of part 1; quick and full.
ZOO_QUICK = [("vit", [64, 128], 2), ("unet", [64, 128], None), ("cnn", [24, 32], None)]
ZOO_FULL = [("vit", [512, 1024], None), ("unet", [512, 1024], None), ("cnn", [64, 96], None),
            ("transolver", [65536, 131072], None)]  # fmt: skip

#: (name, arguments) of part 2; quick and full.
BENCH_QUICK = [("attention", ["--seq", "1024", "--iters", "1"]), ("layer_overhead", ["--iters", "20", "--warmup", "5"]),
               ("comm_volume", ["--side", "32", "--length", "1024"])]  # fmt: skip
BENCH_FULL = [
    ("conv", []), ("cnn", []), ("attention", []), ("vit", []), ("unet", []), ("transolver", []),
    ("layer_overhead", []), ("comm_volume", []), ("fno", []), ("meshgraphnet", []),
]  # fmt: skip

_SPEEDUP = re.compile(r"(?<![\w.])(\d+\.\d+)x(?!\w)")


def predicted_mib(model_name: str, size: int, depth: int | None) -> list[float] | None:
    """The planner's peak per rank at P=1 and P=2, less parameters and input (the measured quantity)."""
    import sharded_nn as snn
    from sharded_nn import demo

    cfg = demo.DemoConfig(model=model_name, size=size, depth=depth)
    model = demo.build_model(cfg, None)
    _, shape = demo.describe(cfg)
    if model_name == "transolver":  # points along dim 1; the coordinates are a second input
        plan = snn.plan_memory(model, shape, max_ranks=2, dims=1, input_kwargs={"embedding": shape})
    else:
        plan = snn.plan_memory(model, shape, max_ranks=2, dims=2)
    return [(plan.peak(p) - plan.param_bytes - plan.input_bytes[p - 1]) / 2**20 for p in (1, 2)]


def run_zoo(cases, progress: bool) -> list[dict]:
    from tqdm import tqdm

    from sharded_nn import demo

    rows = []
    todo = [(m, s, d) for m, sizes, d in cases for s in sizes]
    for model_name, size, depth in tqdm(todo, desc="zoo cases", disable=not progress, file=sys.stdout):
        cfg = demo.DemoConfig(model=model_name, size=size, depth=depth, nproc=2, repeat=2)
        demo.validate(cfg)
        rec = demo.run_local(cfg, progress=False)
        pred = predicted_mib(model_name, size, depth)
        r1, r2 = rec.runs
        rows.append({
            "model": model_name, "size": size, "description": rec.description,
            "t1": r1.seconds, "t2": r2.seconds, "speedup": r1.seconds / r2.seconds,
            "mem1": max(r1.mem_mib), "mem2": max(r2.mem_mib),
            "pred1": None if pred is None else pred[0], "pred2": None if pred is None else pred[1],
            "ok": rec.ok, "max_abs_diff": rec.max_abs_diff, "record": asdict(rec),
        })  # fmt: skip
    return rows


def parse_speedups(text: str) -> list[float]:
    """The speedups (``1.83x``) a benchmark printed: the first ``<float>x`` of each table row.

    A table starts at a header line containing "speedup" and ends at a blank line; Markdown rows
    (``|`` first) count anywhere. Shapes such as ``1x16x128`` are not floats and do not match.
    """
    in_table, speedups = False, []
    for line in text.splitlines():
        if "speedup" in line:
            in_table = True
            continue
        if in_table and not line.strip():
            in_table = False
        if in_table or line.startswith("|"):
            m = _SPEEDUP.search(line)
            if m:
                speedups.append(float(m.group(1)))
    return speedups


def run_bench(name: str, args: list[str], out: Path, timeout: float) -> dict:
    """One per-model benchmark as a subprocess; its output is kept and its speedups collected."""
    cmd = [sys.executable, str(ROOT / "bench" / f"{name}.py"), *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        text, rc = proc.stdout + ("\n" + proc.stderr[-2000:] if proc.returncode else ""), proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"{e.stdout or ''}\n(timed out after {timeout:.0f} s)", 124
    command = " ".join(["python", f"bench/{name}.py", *args])
    (out / f"{name}.txt").write_text(f"$ {command}\n{text}")
    speedups = parse_speedups(text)
    return {"name": name, "command": command, "rc": rc,
            "seconds": time.perf_counter() - t0, "speedups": speedups, "output": text}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Stored outputs: ``--replot DIR`` rebuilds the report from what a run (or a quiet run of one
# benchmark, ``python bench/cnn.py > bench/results/cnn.txt``) left in DIR.


def load_bench_text(path: Path) -> dict:
    """A stored benchmark output (``<name>.txt``) as the record ``run_bench`` returns.

    A first line ``$ <command>`` (what ``run_bench`` writes) names the command; otherwise it is
    ``python bench/<name>.py``. The exit status and duration are unknown (``rc`` 0, ``seconds`` None).
    """
    text = path.read_text()
    command = f"python bench/{path.stem}.py"
    if text.startswith("$ "):
        first, _, text = text.partition("\n")
        command = first[2:].strip()
    return {"name": path.stem, "command": command, "rc": 0, "seconds": None, "speedups": parse_speedups(text),
            "output": text}  # fmt: skip


def load_stored(folder: Path) -> tuple[list[dict], list[dict]]:
    """Zoo rows (``zoo_<model>_<size>.json``) and benchmark outputs (``<name>.txt``) stored in ``folder``."""
    if not folder.is_dir():
        raise FileNotFoundError(f"--replot: expected a folder of stored outputs, got {folder} (not a folder).")
    zoo = sorted((json.loads(p.read_text()) for p in folder.glob("zoo_*.json")), key=lambda r: (r["model"], r["size"]))
    order = {name: i for i, (name, _) in enumerate(BENCH_FULL)}
    texts = sorted(folder.glob("*.txt"), key=lambda p: (order.get(p.stem, len(order)), p.stem))
    benches = [load_bench_text(p) for p in texts]
    if not zoo and not benches:
        raise FileNotFoundError(
            f"--replot: {folder} holds no zoo_<model>_<size>.json and no <name>.txt (what python -m bench --out writes)."
        )
    return zoo, benches


def parse_comm_volume(text: str) -> list[tuple[str, float, float | None]]:
    """``(case, KiB sent, minimum KiB or None)`` from ``bench/comm_volume.py``'s Markdown table."""
    rows, header = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3:
            continue
        if cells[0] == "case":
            header = cells
            continue
        if header is None or set(line) <= set("|- "):
            continue
        row = dict(zip(header, cells, strict=False))
        try:
            total = float(row["total"])
        except (KeyError, ValueError):
            continue
        try:
            minimum = float(row.get("minimum", ""))
        except ValueError:
            minimum = None
        rows.append((row["case"], total, minimum))
    return rows


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def write_markdown(zoo: list[dict], benches: list[dict], path: Path, quick: bool) -> None:
    lines = [f"# sharded_nn benchmark suite{' (--quick)' if quick else ''}", ""]
    lines += ["## Zoo models: P=1 against P=2, forward+backward, 1 thread per rank", ""]
    lines += ["| model | size | T1 (s) | T2 (s) | speedup | efficiency | mem P=1 (MiB) | mem P=2 (MiB) | "
              "planned P=1 | planned P=2 | P=2 == P=1 |", "| --- " * 11 + "|"]  # fmt: skip
    for r in zoo:
        lines.append(
            f"| {r['model']} | {r['size']} | {r['t1']:.3f} | {r['t2']:.3f} | {r['speedup']:.2f}x | "
            f"{r['speedup'] / 2:.0%} | {r['mem1']:.0f} | {r['mem2']:.0f} | {_fmt(r['pred1'])} | {_fmt(r['pred2'])} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    lines += ["", "Cases: " + "; ".join(sorted({f"{r['model']}: {r['description']}" for r in zoo})), ""]
    lines += ["Time: the faster of 2 steps, slowest rank. Memory: the step's peak resident memory above the resident "
              "memory after the model and input were built (`sharded_nn.demo.PeakRSS`). Planned: `snn.plan_memory` "
              "peak less parameters and input (what the measured column counts).", ""]
    comm = next((b for b in benches if b["name"] == "comm_volume"), None)
    if comm is not None and parse_comm_volume(comm["output"]):
        lines += ["Communication volume per step (`comm.png`): bytes sent by the busiest rank against the minimum the "
                  "algorithm needs, from `bench/comm_volume.py` below.", ""]  # fmt: skip
    for b in benches:
        took = "stored output" if b["seconds"] is None else f"exit {b['rc']}, {b['seconds']:.0f} s"
        lines += [f"## `{b['command']}` ({took})", "", "```", b["output"].rstrip(), "```", ""]
    path.write_text("\n".join(lines))


def plot(zoo: list[dict], benches: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(11, 3.8))
    # One colour and one legend entry per benchmark (a benchmark prints many rows: one line each).
    series = [(f"zoo {r['model']}", r["speedup"]) for r in zoo]
    series += [(f"bench/{b['name']}", s) for b in benches for s in b["speedups"]]
    colours = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(dict.fromkeys(lb for lb, _ in series))}
    seen = set()
    for label, s in series:
        first = label not in seen
        seen.add(label)
        ax_s.plot([1, 2], [1.0, s], "o-", color=colours[label], lw=0.8, ms=3, label=label if first else None)
        ax_e.plot([1, 2], [1.0, s / 2], "o-", color=colours[label], lw=0.8, ms=3)
    for ax in (ax_s, ax_e):
        ax.plot([1, 2], [1, 2] if ax is ax_s else [1, 1], "k--", lw=0.8, label="ideal" if ax is ax_s else None)
        ax.set_xticks([1, 2])
        ax.set_xlabel("processes P")
    top = max([1.2] + [s / 2 * 1.05 for _, s in series])
    ax_s.set(ylabel="speedup T1/TP", title="strong scaling")
    ax_e.set(ylabel="efficiency", title="efficiency", ylim=(0, top))
    fig.legend(*ax_s.get_legend_handles_labels(), fontsize=6, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    paths.append(out / "scaling.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for i, model_name in enumerate(sorted({r["model"] for r in zoo})):
        rs = sorted((r for r in zoo if r["model"] == model_name), key=lambda r: r["size"])
        sizes = [r["size"] for r in rs]
        ax.plot(sizes, [r["mem1"] for r in rs], "o-", color=f"C{i}", label=f"{model_name} P=1")
        ax.plot(sizes, [r["mem2"] for r in rs], "s--", color=f"C{i}", label=f"{model_name} P=2")
        for key, mark in (("pred1", "+"), ("pred2", "x")):
            if all(r.get(key) is not None for r in rs):
                ax.plot(sizes, [r[key] for r in rs], mark, color=f"C{i}", ms=8)
    if zoo:
        ax.plot([], [], "k+", label="planned P=1")
        ax.plot([], [], "kx", label="planned P=2")
        ax.set(xscale="log", yscale="log")
        ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, "no zoo records", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="size (pixels per side / points)", ylabel="peak memory per rank (MiB)", title="memory per rank")
    fig.tight_layout()
    paths.append(out / "memory.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    comm = next((b for b in benches if b["name"] == "comm_volume"), None)
    rows = parse_comm_volume(comm["output"]) if comm is not None else []
    if rows:
        fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * len(rows)))
        ys = range(len(rows))
        ax.barh([y + 0.2 for y in ys], [t for _, t, _ in rows], height=0.4, color="C0", label="sent")
        ax.barh([y - 0.2 for y in ys], [m or 0 for _, _, m in rows], height=0.4, color="C2", label="minimum")
        for y, (_, t, m) in zip(ys, rows, strict=True):
            ax.text(t, y + 0.2, f" {t / m:.2f}x" if m else " (no closed-form minimum)", va="center", fontsize=7)
        ax.set_yticks(list(ys), [c for c, _, _ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set(xlabel="KiB sent per forward+backward step (busiest rank)", title="communication volume")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        paths.append(out / "comm.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def report(zoo: list[dict], benches: list[dict], out: Path, quick: bool) -> list[Path]:
    """Write ``results.md``, ``results.json`` and the PNGs into ``out``; return the PNG paths."""
    out.mkdir(parents=True, exist_ok=True)
    write_markdown(zoo, benches, out / "results.md", quick)
    (out / "results.json").write_text(json.dumps({"quick": quick, "zoo": zoo, "benchmarks": benches}, indent=2,
                                                 default=str))  # fmt: skip
    return plot(zoo, benches, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, slow benchmarks skipped (a few minutes)")
    parser.add_argument("--out", default=None, help="output folder (default bench_results/)")
    parser.add_argument("--skip-zoo", action="store_true", help="only the per-model benchmarks")
    parser.add_argument("--only", nargs="+", default=None, help="per-model benchmarks to run (default: all)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default 600 quick, 7200)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--replot", metavar="DIR", default=None,
                        help="run nothing: rebuild the report from the zoo_*.json and <name>.txt stored in DIR "
                             "(written into --out, default DIR itself)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.replot is not None:
        try:
            zoo, benches = load_stored(Path(args.replot))
        except FileNotFoundError as e:
            parser.exit(2, f"python -m bench: error: {e}\n")
        out = Path(args.replot if args.out is None else args.out)
        pngs = report(zoo, benches, out, quick=False)
        print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {', '.join(map(str, pngs))}")
        return 0
    out = Path(args.out or "bench_results")
    out.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (600.0 if args.quick else 7200.0)
    zoo = [] if args.skip_zoo else run_zoo(ZOO_QUICK if args.quick else ZOO_FULL, not args.no_progress)
    for r in zoo:  # one stored record per case, for --replot
        (out / f"zoo_{r['model']}_{r['size']}.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    benches = []
    for name, bargs in BENCH_QUICK if args.quick else BENCH_FULL:
        if args.only is None or name in args.only:
            print(f"bench/{name}.py {' '.join(bargs)} ...", flush=True)
            benches.append(run_bench(name, bargs, out, timeout))
    pngs = report(zoo, benches, out, args.quick)
    print((out / "results.md").read_text().split("\n## `")[0])
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}, {', '.join(map(str, pngs))}")
    failed = [r["model"] for r in zoo if not r["ok"]] + [b["name"] for b in benches if b["rc"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
