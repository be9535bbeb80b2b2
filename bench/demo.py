"""The old demo entry point, now a thin wrapper: ``python bench/demo.py`` = ``sharded-nn demo --model cnn``.

The demo job lives in ``sharded_nn/demo.py`` (installed with the package, so that the
``sharded-nn`` console script works from any directory); extra arguments are passed through,
e.g. ``python bench/demo.py --size 32``.
"""

from __future__ import annotations

import sys

from sharded_nn.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", "--model", "cnn", *sys.argv[1:]]))
