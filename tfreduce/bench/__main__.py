"""``python -m tfreduce.bench``: the ``tfreduce-bench`` command (train mode's children use it)."""

import sys

from tfreduce.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
