#!/usr/bin/env python
"""The same as `mlxspec bench` (the code is the mlxspec/bench/ package); see `--help`.

    python scripts/bench.py --quick
    python scripts/bench.py --out runs/bench
"""

import sys

from mlxspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
