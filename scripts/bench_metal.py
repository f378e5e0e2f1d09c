#!/usr/bin/env python3
"""Benchmark the Metal kernels of mlxspec against MLX built-ins and the memory-bandwidth floor.

    python scripts/bench_metal.py [--quick] [--only lowbit|markov] [--out results.json]

The same as `scripts/bench_kernels.py --backend metal`; exits 2 with a message when MLX has
no Metal backend here. See mlxspec/kernels/README.md.
"""

import sys

from bench_kernels import main

if __name__ == "__main__":
    sys.exit(main(["--backend", "metal", *sys.argv[1:]]))
