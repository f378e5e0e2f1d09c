#!/usr/bin/env python
"""The target's forward with RoPE and RMSNorm as single ops (`mlxspec.targets.host_rope`) against
MLX's fallbacks, in one process: ms per forward (graph building and evaluation apart), alternating
the two forward by forward, median of --repeats, at --context, for the row counts of decoding and
verifying. The logits and taps of both must be the same bits (checked; exit 1 if not).

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_rope.py --json docs/bench/rope-forward.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", default="1,3,5,9,17", help="forward lengths, comma-separated")
    ap.add_argument("--context", type=int, default=171)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        rows = [int(x) for x in a.rows.split(",")]
    except ValueError:
        sys.exit(f"bench_rope: --rows {a.rows!r}: pass lengths like 1,5,9")
    if not rows or min(rows) < 1 or max(rows) > 64 or not 1 <= a.context <= 8192 or not 3 <= a.repeats <= 500:
        sys.exit("bench_rope: --rows 1-64, --context 1-8192, --repeats 3-500")

    import mlx.core as mx
    import numpy as np

    from mlxspec.targets import host_rope
    from mlxspec.targets.load import load_target

    target, _ = load_target(a.model)
    if not host_rope.check():
        sys.exit(f"bench_rope: {host_rope.status()}")
    taps = (1, target.info.num_layers // 2, target.info.num_layers - 2)
    cache = target.make_cache()
    mx.eval(target(mx.array([[(7 * i) % 1000 + 10 for i in range(a.context)]]), cache, logits="last")[0])

    def forward(L: int, on: bool):
        host_rope._STATE["ok"] = on
        x = mx.array([[(13 * i) % 1000 + 20 for i in range(L)]])
        t0 = time.perf_counter()
        lg, tp = target(x, cache, taps=taps)
        t1 = time.perf_counter()
        mx.eval(lg, tp)
        t2 = time.perf_counter()
        target.rollback(cache, L)
        return t1 - t0, t2 - t1, np.array(lg).view(np.uint32), np.array(tp).view(np.uint32)

    out = {"model": target.info.source or "SmolLM2-135M-Instruct", "context": a.context, "repeats": a.repeats,
           "mlx": mx.__version__, "rows": {}}
    same = True
    for L in rows:
        t = {True: [], False: []}
        forward(L, True), forward(L, False)  # warm-up (traces, tables)
        for _ in range(a.repeats):
            res = {on: forward(L, on) for on in (False, True)}
            for on in (False, True):
                t[on].append(res[on][:2])
            same &= all(np.array_equal(x, y) for x, y in zip(res[False][2:], res[True][2:]))
        r = {}
        for on, name in ((False, "mlx"), (True, "single_ops")):
            build = statistics.median(x[0] for x in t[on]) * 1e3
            total = statistics.median(x[0] + x[1] for x in t[on]) * 1e3
            r[name] = {"build_ms": round(build, 3), "forward_ms": round(total, 3)}
        r["speedup"] = round(r["mlx"]["forward_ms"] / r["single_ops"]["forward_ms"], 3)
        out["rows"][L] = r
        print(f"{L:3d} rows  MLX's fallbacks {r['mlx']['forward_ms']:7.2f} ms (build {r['mlx']['build_ms']:.2f})"
              f"  single ops {r['single_ops']['forward_ms']:7.2f} ms (build {r['single_ops']['build_ms']:.2f})"
              f"  {r['speedup']:.2f}x", flush=True)
    host_rope._STATE["ok"] = True
    out["same_bits"] = bool(same)
    print(f"same logits and taps, bit for bit: {same}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
