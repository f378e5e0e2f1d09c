#!/usr/bin/env python
"""What drawing one sampled draft costs on the host, EAGLE-3's way (numpy's softmax, a draw, the
scatter to the target's vocabulary) against the MLX way it replaced (`probs_from_logits`, a
sync, `scatter_draft`): median of --repeats, the two interleaved, on random logits of the
shipped SmolLM2 drafter's sizes (8,192 draft ids of 49,152).

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_sampled_draft.py --json docs/bench/sampled-draft-2026-12-05.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.repeats < 1 or not 1 <= a.draft_vocab <= a.vocab:
        ap.error("--repeats must be >= 1 and --draft-vocab 1..--vocab")

    import mlxspec  # noqa: F401  (OpenBLAS before MLX)
    import mlx.core as mx

    from mlxspec.engine.drafting import scatter_draft, scatter_draft_host
    from mlxspec.engine.verify import SamplingParams, probs_from_logits, sample_token, target_probs

    rng = np.random.default_rng(0)
    d2t_np = np.sort(rng.choice(a.vocab, a.draft_vocab, replace=False)).astype(np.int32)
    d2t = mx.array(d2t_np)
    sp = SamplingParams(temperature=1.0)
    zs = [mx.array(rng.standard_normal((1, a.draft_vocab)).astype(np.float32) * 3) for _ in range(4)]
    mx.eval(*zs)

    def mlx_way(n):
        qs = []
        for k in range(n):
            q = probs_from_logits(zs[k], sp)
            mx.array([sample_token(np.asarray(q[0]), rng)])
            qs.append(q)
        return np.asarray(scatter_draft(mx.concatenate(qs), d2t, a.vocab))

    def numpy_way(n):
        qs = []
        for k in range(n):
            q = target_probs(zs[k], sp)
            mx.array([sample_token(q[0], rng)])
            qs.append(q)
        return scatter_draft_host(np.concatenate(qs), d2t_np, a.vocab)

    rows = {}
    for n in (1, 2, 4):
        t = {"mlx": [], "numpy": []}
        for _ in range(a.repeats):
            for name, f in (("mlx", mlx_way), ("numpy", numpy_way)):
                t0 = time.perf_counter()
                f(n)
                t[name].append(time.perf_counter() - t0)
        rows[n] = {k: round(float(np.median(v)) * 1e3, 4) for k, v in t.items()}
        print(f"{n} drafts: MLX {rows[n]['mlx']:.3f} ms, numpy {rows[n]['numpy']:.3f} ms", file=sys.stderr)
    rep = {"command": "scripts/bench_sampled_draft.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": time.strftime("%Y-%m-%d %H:%M"), "ms_by_drafts": rows}
    text = json.dumps(rep, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
