#!/usr/bin/env python3
"""Benchmark the CUDA kernels of mlxspec against MLX built-ins and the memory-bandwidth floor.

    python scripts/bench_cuda.py [--quick] [--only lowbit|markov] [--out results.json]

Prints a markdown table; exits 2 with a message when MLX has no CUDA backend here.
See mlxspec/kernels/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from mlxspec.kernels.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("cuda"))
