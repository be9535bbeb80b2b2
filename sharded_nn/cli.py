"""The ``sharded-nn`` console script (also ``python -m sharded_nn``).

    sharded-nn demo                       # sharded ViT at 1024^2 on 2 processes vs 1
    sharded-nn demo --model unet --size 256 --nproc 2 --out results/
    torchrun --nproc-per-node 4 -m sharded_nn demo   # inside a torchrun world (NCCL on GPUs)

Bad options end with a one-line message and exit code 2 (argparse's convention), never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from . import demo as _demo


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sharded-nn", description="sharded_nn: domain parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "demo",
        help="one sample split over P local processes equals the single-process model; memory and time",
        description=(
            "Forward and backward of a zoo model at P=1 and P=--nproc, checked against each other; prints a "
            "table, writes a JSON record and a PNG plot into --out."
        ),
    )
    sizes = "; ".join(f"{m}: {what} (default {s})" for m, (s, what) in _demo.MODELS.items())
    d.add_argument("--model", choices=list(_demo.MODELS), default="vit", help="which model (default vit)")
    d.add_argument("--nproc", type=int, default=2, help="processes for the sharded run (default 2)")
    d.add_argument("--size", type=int, default=None, help=f"problem size; {sizes}")
    d.add_argument("--depth", type=int, default=None, help="ViT blocks / Transolver layers (smaller: faster)")
    d.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    d.add_argument("--out", default="sharded_nn_demo", help="output folder (default ./sharded_nn_demo)")
    d.add_argument("--repeat", type=int, default=1, help="steps per run; the fastest is reported (default 1)")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        cfg = _demo.DemoConfig(
            model=args.model, nproc=args.nproc, size=args.size, depth=args.depth, dtype=args.dtype, out=args.out,
            repeat=args.repeat,
        )
        try:
            _demo.validate(cfg)
        except ValueError as e:
            parser.exit(2, f"sharded-nn demo: error: {e}\n")
        return _demo.main(cfg, progress=not args.no_progress)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
