#!/usr/bin/env python
"""What an EAGLE-3 draft costs on this machine: the drafter's plain forward (`Eagle3Model`) against
its inference forward (`mlxspec.drafters.eagle3_fast.FastForward`), in one process.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_eagle3_draft.py \\
        --json docs/bench/eagle3-draft-cost.json

After a held-out code prompt is prefilled and its pairs committed (the drafter's cache as a
generation has it), it times, median over --repeats rounds of --iters each, alternating plain and
fast in every round:
- `chain`: a greedy chain of --drafts drafts as `Eagle3Drafter.draft` runs it with the policy's
  stop callback (each confidence read back before the next row), ms per draft;
- `commit`: running k committed pairs into the cache (what each step's accepted tokens cost the
  drafter), ms per call for k = 1, 3, 6;
- `chain after a verify`: the chain again, each call right after a target forward of 3 rows
  (untimed), as the engine drafts: the target's weights have streamed through the caches since
  the drafter last ran (median of every call).
Both forwards must draft the same tokens (checked; exit 1 if not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(ROOT / "mlxspec/weights/smollm2-135m-eagle3"))
    ap.add_argument("--drafts", type=int, default=4, help="drafts per chain (1-7)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (the median is reported)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.drafts <= 7 or not 1 <= a.iters <= 1000 or not 1 <= a.repeats <= 50:
        ap.error("--drafts 1-7, --iters 1-1000, --repeats 1-50")
    if not Path(a.draft).exists():
        ap.error(f"--draft {a.draft}: no drafter there")

    import mlx.core as mx
    import numpy as np

    from mlxspec import api
    from mlxspec.engine.verify import SamplingParams
    from mlxspec.prompts import encode_prompt, load_prompts
    from mlxspec.targets.model import trim_cache

    target, tok, _ = api.load(None, "none")
    spec = api.Speculator.build(api.SpecConfig(draft=a.draft, ngram=False), target)
    d = spec.make_drafter(target)
    d = getattr(d, "block", d)
    fast = d._fast
    if fast is None:
        sys.exit(f"{a.draft}: not a one-layer EAGLE-3 drafter (no fast forward to compare)")
    ids = encode_prompt(tok, "code", load_prompts()["code"][0])
    cache = target.make_cache()
    _, taps = target(mx.array([ids]), cache, taps=d.taps, logits="last")
    d.begin(ids, taps)
    d.draft(int(ids[-1]), 1, SamplingParams(), np.random.default_rng(0))  # the anchor's pair committed
    base = d.committed
    sp, rng = SamplingParams(), np.random.default_rng(0)

    def chain():
        out = d.draft(int(ids[-1]), a.drafts, sp, rng, more=lambda conf: True)
        for c in d.cache:
            c.truncate(base)
        d._anchor_used = True
        return out.tokens

    def commit(k):
        h = d._run_pairs(mx.repeat(taps[:, -1:], k, axis=1), [int(ids[-1])] * k)
        mx.eval(h)
        for c in d.cache:
            c.truncate(base)

    cases = {"chain": chain, **{f"commit{k}": (lambda k=k: commit(k)) for k in (1, 3, 6)}}
    tokens, res = {}, {name: {"plain": [], "fast": []} for name in cases}
    for r in range(a.repeats):
        for mode in (("plain", "fast") if r % 2 == 0 else ("fast", "plain")):
            d._fast = fast if mode == "fast" else None
            for name, f in cases.items():
                tokens.setdefault(mode, f()) if name == "chain" else f()  # warm (and the fast path traced)
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    f()
                per = (time.perf_counter() - t0) / a.iters * 1000
                res[name][mode].append(per / a.drafts if name == "chain" else per)
    # the same chain right after a target forward (a verify of 3 rows, untimed), as the engine
    # drafts: the target's weights stream through the caches and evict the drafter's
    cold = {"plain": [], "fast": []}
    for r in range(a.repeats):
        for mode in (("plain", "fast") if r % 2 == 0 else ("fast", "plain")):
            d._fast = fast if mode == "fast" else None
            for _ in range(a.iters):
                lg, tp = target(mx.array([[int(ids[-1])] * 3]), cache, taps=d.taps, logits="all")
                mx.eval(lg, tp)
                trim_cache(cache, 3)
                t0 = time.perf_counter()
                chain()
                cold[mode].append((time.perf_counter() - t0) * 1000 / a.drafts)
    res["chain after a verify"] = {m: [statistics.median(v)] for m, v in cold.items()}
    d._fast = fast
    out = {"command": " ".join(sys.argv), "context": base, "drafts": a.drafts, "same_drafts": tokens["plain"] == tokens["fast"],
           "ms": {name: {m: statistics.median(v) for m, v in x.items()} for name, x in res.items()}}
    for name, x in out["ms"].items():
        unit = "ms per draft" if name.startswith("chain") else "ms per call"
        print(f"{name:20s} plain {x['plain']:6.3f}  fast {x['fast']:6.3f}  {unit}  ({x['plain'] / x['fast']:.2f}x)")
    print(f"same drafts: {out['same_drafts']} (context {base} pairs)")
    from mlxspec.bench.report import write_json

    write_json(a.json, out)
    if not out["same_drafts"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
