#!/usr/bin/env python
"""The target's forward over 1..N tokens with and without MLXSPEC_SMALL_GEMM=1 (`mlxspec.cpu_gemm`),
measured in separate processes that alternate round by round (a busy host slows both alike).

    python scripts/bench_small_gemm.py --rounds 3 --json docs/bench/small_gemm.json

Each child loads the default target (SmolLM2-135M, dense float32), pins OpenBLAS to one thread
(the small GEMM computes only then) and measures `engine.profile.measure_verify_sps` at context
152: the best of 5 rounds per length. Reported: the median over rounds of each length's forward
time per mode, the speed-up per length, and the verify/decode ratio t(L)/t(1) per mode (what the
adaptive policy weighs: a faster decode makes speculation relatively dearer).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys
import mlxspec, mlxspec.blas
from mlxspec import cpu_gemm
from mlxspec.engine.profile import measure_verify_sps
from mlxspec.targets.load import load_target
mlxspec.blas.set_blas_threads(1)
t, _ = load_target(None)
sps = measure_verify_sps(t, int(sys.argv[1]), context=152, repeats=5)
print(json.dumps({"ms": {L: 1000.0 / v for L, v in sps.items()}, "status": cpu_gemm.status()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.rounds <= 50 or not 1 <= a.max_len <= 64:
        ap.error("--rounds 1-50, --max-len 1-64")
    runs = {"openblas": [], "small_gemm": []}
    status = {}
    for r in range(a.rounds):
        for mode in (("openblas", "small_gemm") if r % 2 == 0 else ("small_gemm", "openblas")):
            env = {**os.environ, "MLXSPEC_SMALL_GEMM": "1" if mode == "small_gemm" else "0", "HF_HUB_OFFLINE": "1"}
            out = subprocess.run([sys.executable, "-c", CHILD, str(a.max_len)], env=env, capture_output=True,
                                 text=True, check=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            runs[mode].append({int(k): v for k, v in got["ms"].items()})
            status[mode] = got["status"]
            print(f"round {r + 1} {mode}: " + " ".join(f"{L}:{v:.1f}" for L, v in sorted(runs[mode][-1].items())),
                  flush=True)
    med = {m: {L: statistics.median(x[L] for x in v) for L in v[0]} for m, v in runs.items()}
    res = {"command": " ".join(sys.argv), "status": status, "ms": med,
           "speedup": {L: med["openblas"][L] / med["small_gemm"][L] for L in med["openblas"]},
           "verify_over_decode": {m: {L: v[L] / v[1] for L in v} for m, v in med.items()}, "rounds": runs}
    for L in sorted(med["openblas"]):
        print(f"L={L}: openblas {med['openblas'][L]:.1f} ms  small {med['small_gemm'][L]:.1f} ms  "
              f"x{res['speedup'][L]:.2f}  t(L)/t(1) {res['verify_over_decode']['openblas'][L]:.2f} -> "
              f"{res['verify_over_decode']['small_gemm'][L]:.2f}")
    from mlxspec.bench.report import write_json

    write_json(a.json, res)


if __name__ == "__main__":
    main()
