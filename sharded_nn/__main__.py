"""``python -m sharded_nn demo``: the same as the ``sharded-nn`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
