"""What a target forward of 1..24 rows costs with OpenBLAS's threads and with the small-M GEMM
(`mlxspec.cpu_gemm`), in one process switching between them (docs/cli.md, the small-M GEMM):

    LD_PRELOAD="$(python -m mlxspec.blas)" python scripts/gemm_rows.py [--json FILE]

Rows: OpenBLAS at every core for everything; ours up to 24 rows on one core beside OpenBLAS's
threads; ours split over two cores (the default while OpenBLAS may run two threads); one thread
in all. Milliseconds, the median of 8 forwards after one warm-up, at a context of 300."""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import mlxspec  # noqa: F401  (OpenBLAS, and the small GEMM, before MLX)
    import mlxspec.blas
    from mlxspec import api, cpu_gemm

    import mlx.core as mx
    import numpy as np

    from mlxspec.targets.model import trim_cache

    lib = cpu_gemm._STATE.get("lib")
    if lib is None:
        raise SystemExit(f"gemm_rows: {cpu_gemm.status()}; run it with LD_PRELOAD=\"$(python -m mlxspec.blas)\"")
    target, _, _ = api.load(draft="none")
    cache = target.make_cache()
    mx.eval(target(mx.array([list(range(100, 400))]), cache, logits="last")[0])

    def ms(L):
        ts = []
        for _ in range(9):
            t = time.perf_counter()
            lg, _ = target(mx.array([[5] * L]), cache, logits="all")
            mx.eval(lg)
            ts.append(time.perf_counter() - t)
            trim_cache(cache, L)
        return round(1e3 * float(np.median(ts[1:])), 1)

    cores = mlxspec.blas.blas_threads()
    rows = {}
    for name, threads, ours, split in (("openblas", cores, 0, 1), ("ours_one_core", cores, 24, 0),
                                       ("ours_two_cores", cores, 24, 1), ("one_thread", 1, 24, 1)):
        mlxspec.blas.set_blas_threads(threads)
        lib.mlxspec_small_gemm_set_threaded_rows(ours)
        lib.mlxspec_small_gemm_set_split(split)
        rows[name] = {L: ms(L) for L in (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 13, 16, 17, 20, 24)}
        print(name, rows[name], file=sys.stderr, flush=True)
    lib.mlxspec_small_gemm_set_threaded_rows(24)
    lib.mlxspec_small_gemm_set_split(1)
    out = {"command": "scripts/gemm_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "threads": cores, "status": cpu_gemm.status(), "ms": rows}
    text = json.dumps(out, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
