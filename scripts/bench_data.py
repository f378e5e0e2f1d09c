#!/usr/bin/env python
"""Throughput of producing drafter training data (target taps + top-k next-token labels).

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_data.py --json runs/bench_data.json

Methods, each timed on the same random token windows (median of --repeats, after a warm-up):
- prefill (corpus windows): one batched causal forward over [batch, window] gives every
  position's taps and labels; top-k by the two-level search (`train.data.next_token_topk`);
- prefill with the old top-k (softmax + argpartition over the whole vocabulary);
- greedy continuation: the target decodes `batch` sequences step by step (what
  `--data-mode generated` does), taps and labels from each step's forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np


def old_topk(logits, k=8):
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    ids = mx.argpartition(-probs, k, axis=-1)[..., :k]
    pk = mx.take_along_axis(probs, ids, axis=-1)
    order = mx.argsort(-pk, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(pk, order, axis=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from mlxspec.targets.load import load_target
    from mlxspec.train.data import next_token_topk

    target, _ = load_target(None)
    taps = [1, 8, 15, 22, 28]
    rng = np.random.default_rng(0)

    def prefill(B, L, topk):
        x = mx.array(rng.integers(100, 40000, (B, L)).astype(np.int32))

        def run():
            hid, tp = target.forward_hidden(x, taps)
            ids, pk = topk(target.lm_head(hid))
            tp = tp.astype(mx.float16)
            mx.eval(tp, ids, pk)
            np.asarray(tp)
            return B * L
        return run

    def generate(B, prefix, steps):
        x = mx.array(rng.integers(100, 40000, (B, prefix)).astype(np.int32))

        def run():
            cache = target.make_cache()
            logits, tp = target(x, cache, taps=taps, logits="all")
            for _ in range(steps):
                ids, pk = next_token_topk(logits[:, -1:])
                nxt = ids[:, :, 0]
                mx.eval(tp, ids, pk, nxt)
                logits, tp = target(nxt, cache, taps=taps, logits="all")
            mx.eval(logits, tp)
            return B * steps
        return run

    methods = {
        "prefill B16 x 256, two-level top-k (default)": prefill(16, 256, next_token_topk),
        "prefill B8 x 256, two-level top-k": prefill(8, 256, next_token_topk),
        "prefill B16 x 256, softmax + argpartition top-k (before)": prefill(16, 256, old_topk),
        "greedy continuation B32, 32 steps": generate(32, 64, 32),
        "greedy continuation B128, 16 steps": generate(128, 64, 16),
    }
    out = {}
    for name, run in methods.items():
        run()  # warm-up
        rates = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            n = run()
            rates.append(n / (time.perf_counter() - t))
        out[name] = {"tokens_per_s": statistics.median(rates), "runs": rates}
        print(f"{name}: {statistics.median(rates):.0f} tokens/s (median of {a.repeats})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
