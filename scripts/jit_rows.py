"""What a SmolLM2 forward of 1..24 rows costs with MLX's compiled kernels built generically and
built for this CPU (`mlxspec.cpu_jit`), in child processes that alternate between the two (the
setting is per process), and whether the logits are the same bits (docs/cli.md):

    LD_PRELOAD="$(python -m mlxspec.blas)" python scripts/jit_rows.py --pairs 4 [--json FILE]

Each child loads the default target, prefills --context tokens and times --rounds rounds of one
forward per row count; the table is the median over all children of a setting, in ms. The
generic children compile their kernels into a folder of their own (MLX's default build)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import hashlib, json, sys, time
import mlxspec
from mlxspec import api, cpu_jit
from mlxspec.targets.model import trim_cache
import mlx.core as mx, numpy as np
rows, ctx, rounds = {rows!r}, {ctx}, {rounds}
target, _, _ = api.load(draft="none")
cache = target.make_cache()
lg, _ = target(mx.array([[100 + (i * 37) % 20000 for i in range(ctx)]]), cache, logits="last")
mx.eval(lg)
ms, h = {{L: [] for L in rows}}, hashlib.sha256()
for r in range(rounds):
    for L in rows:
        t = time.perf_counter()
        lg, _ = target(mx.array([[5 + L] * L]), cache, logits="all")
        mx.eval(lg)
        ms[L].append(1e3 * (time.perf_counter() - t))
        trim_cache(cache, L)
        if r == 0:
            h.update(np.array(lg).tobytes())
print(json.dumps({{"ms": ms, "sha": h.hexdigest(), "status": cpu_jit.status()}}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,3,5,9,13,17,24")
    ap.add_argument("--context", type=int, default=180)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3, help="children per setting, alternating")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from mlxspec import cpu_jit

    rows = [int(x) for x in a.rows.split(",")]
    code = CHILD.format(rows=rows, ctx=a.context, rounds=a.rounds)
    times = {"generic": {L: [] for L in rows}, "native": {L: [] for L in rows}}
    shas, statuses = {}, {}
    with tempfile.TemporaryDirectory() as generic_tmp:
        envs = {"native": dict(os.environ),
                "generic": {**os.environ, cpu_jit.ENV: "0", "TMPDIR": generic_tmp,
                            "PATH": cpu_jit._strip_ours(os.environ.get("PATH", ""))}}
        for i in range(2 * a.pairs):
            name = ("generic", "native")[(i + i // 2) % 2]  # g n n g g n ...: neither always first
            r = subprocess.run([sys.executable, "-c", code], env=envs[name], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"jit_rows: a {name} child failed: {r.stderr.strip().splitlines()[-1:]}")
            out = json.loads(r.stdout.strip().splitlines()[-1])
            for L in rows:
                times[name][L] += out["ms"][str(L)]
            shas.setdefault(name, set()).add(out["sha"])
            statuses[name] = out["status"]
            print(name, {L: round(sorted(v)[len(v) // 2], 1) for L, v in out["ms"].items()}, file=sys.stderr, flush=True)
    import numpy as np

    med = {n: {L: round(float(np.median(v)), 1) for L, v in t.items()} for n, t in times.items()}
    same = len(shas["generic"] | shas["native"]) == 1
    res = {"command": "scripts/jit_rows.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "context": a.context, "forward_ms": med, "logits_equal": same, "status": statuses}
    text = json.dumps(res, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
