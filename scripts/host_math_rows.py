"""What a target forward of 1..24 rows costs with MLX's attention softmax and SwiGLU and with the
host's (`mlxspec.targets.host_math`), in one process switching between them, at one or more
contexts; and a prompt's prefill both ways (docs/cli.md, "The softmax and SwiGLU on the host"):

    LD_PRELOAD="$(python -m mlxspec.blas)" python scripts/host_math_rows.py --contexts 300,1000 [--json FILE]

Milliseconds: the median over --rounds rounds of 3 forwards each way, the two settings
alternating forward by forward (so the host's drift falls on both alike); prefill: the best of 3. The logits are
compared too: any difference is printed and makes the exit status 1."""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--rows", default="1,2,3,5,9,13,17,24")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import mlxspec  # noqa: F401  (OpenBLAS and the small GEMM before MLX)
    from mlxspec import api
    from mlxspec.targets import host_math
    from mlxspec.targets.model import trim_cache

    import mlx.core as mx
    import numpy as np

    if not host_math.check():
        raise SystemExit(f"host_math_rows: {host_math.status()}")
    target, _, _ = api.load(draft="none")
    rows = [int(x) for x in a.rows.split(",")]
    out = {"command": "scripts/host_math_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "status": host_math.status(), "contexts": {}}
    same = True
    for ctx in (int(x) for x in a.contexts.split(",")):
        prompt = mx.array([[100 + (i * 37) % 20000 for i in range(ctx)]])
        pre = {}
        for on in (False, True):
            host_math._STATE["ok"] = on
            ts, lg = [], None
            for _ in range(3):
                cache = target.make_cache()
                t = time.perf_counter()
                lg, _ = target(prompt, cache, logits="last")
                mx.eval(lg)
                ts.append(time.perf_counter() - t)
            pre[on] = (round(1e3 * min(ts)), np.array(lg))
        same &= bool(np.array_equal(pre[False][1], pre[True][1]))
        ms = {on: {L: [] for L in rows} for on in (False, True)}
        logits = {}
        for r in range(a.rounds):
            for L in rows:
                for i in range(6):  # the two settings alternate forward by forward
                    on = (i + r) % 2 == 1
                    host_math._STATE["ok"] = on
                    t = time.perf_counter()
                    lg, _ = target(mx.array([[5 + L] * L]), cache, logits="all")
                    mx.eval(lg)
                    ms[on][L].append(time.perf_counter() - t)
                    trim_cache(cache, L)
                    logits[(on, L)] = np.array(lg)
        same &= all(np.array_equal(logits[(False, L)], logits[(True, L)]) for L in rows)
        med = {("host" if on else "mlx"): {L: round(1e3 * float(np.median(v)), 1) for L, v in ms[on].items()}
               for on in (False, True)}
        out["contexts"][ctx] = {"forward_ms": med, "prefill_ms": {"mlx": pre[False][0], "host": pre[True][0]}}
        print(ctx, json.dumps(out["contexts"][ctx]), file=sys.stderr, flush=True)
    host_math._STATE["ok"] = True
    out["logits_equal"] = same
    text = json.dumps(out, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    if not same:
        print("host_math_rows: the logits differ between the two settings", file=sys.stderr)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
