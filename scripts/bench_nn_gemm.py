"""Attention's P @ V product (B not transposed) by OpenBLAS and by mlxspec's small GEMM, one thread.

    python scripts/bench_nn_gemm.py [--json PATH]

Times cblas_sgemm(RowMajor, NoTrans, NoTrans) at a decode step's and a verify's shapes (M query
rows, K keys, N = head dim), median of 7 rounds of 200 calls, OpenBLAS and ours loaded side by
side in this process (ctypes), and checks ours against OpenBLAS (1e-3) and each of its rows
against the 1-row product bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from mlxspec import cpu_gemm
from mlxspec.bench.report import write_json
from mlxspec.device import find_openblas

F = ctypes.POINTER(ctypes.c_float)
SHAPES = [(1, 300, 64), (9, 309, 64), (17, 1017, 64), (1, 1000, 64), (9, 309, 128)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ob = ctypes.CDLL(find_openblas())
    ob.openblas_set_num_threads(1)
    ours = ctypes.CDLL(str(cpu_gemm.build()))
    ours.mlxspec_small_gemm_init(ctypes.cast(ob.cblas_sgemm, ctypes.c_void_p), None, cpu_gemm.MAX_ROWS)
    for lib in (ob, ours):
        lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, F, ctypes.c_int, F, ctypes.c_int,
                                                         ctypes.c_float, F, ctypes.c_int]
    p = lambda a: a.ctypes.data_as(F)  # noqa: E731
    rng = np.random.default_rng(0)
    rows = []
    print("M K N   us a product: OpenBLAS  ours")
    for M, K, N in SHAPES:
        A = rng.standard_normal((M, K), dtype=np.float32)
        B = rng.standard_normal((K, N), dtype=np.float32)
        out, res = {}, {}
        for name, lib in (("openblas", ob), ("ours", ours)):
            C = np.zeros((M, N), np.float32)
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(200):
                    lib.cblas_sgemm(101, 111, 111, M, N, K, 1.0, p(A), K, p(B), N, 0.0, p(C), N)
                ts.append((time.perf_counter() - t) / 200 * 1e6)
            out[name], res[name] = float(np.median(ts)), C.copy()
        assert np.abs(res["ours"] - res["openblas"]).max() < 1e-3
        for m in range(M):
            one = np.zeros((1, N), np.float32)
            ours.cblas_sgemm(101, 111, 111, 1, N, K, 1.0, p(np.ascontiguousarray(A[m:m + 1])), K, p(B), N, 0.0, p(one), N)
            assert np.array_equal(one[0], res["ours"][m])
        print(f"{M} {K} {N}   {out['openblas']:.1f}  {out['ours']:.1f}")
        rows.append({"M": M, "K": K, "N": N, "openblas_us": out["openblas"], "ours_us": out["ours"]})
    if args.json:
        write_json(args.json, {"command": "python scripts/bench_nn_gemm.py", "cpu": cpu_gemm.status(), "rows": rows})


if __name__ == "__main__":
    main()
