#!/usr/bin/env python3
"""Benchmark the CUDA kernels of mlxspec against MLX built-ins and the memory-bandwidth floor.

    python scripts/bench_cuda.py [--quick] [--only lowbit|markov] [--out results.json]

The same as `scripts/bench_kernels.py --backend cuda`; exits 2 with a message when MLX has
no CUDA backend here. See mlxspec/kernels/README.md.
"""

import sys

from bench_kernels import main

if __name__ == "__main__":
    sys.exit(main(["--backend", "cuda", *sys.argv[1:]]))
