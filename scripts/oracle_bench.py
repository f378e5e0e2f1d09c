#!/usr/bin/env python
"""How close the engine gets to its bound at high acceptance: an oracle drafter (benchmark
only, never shipped) proposes the target's own greedy continuation, each token wrong with a
chosen probability, for chains and trees. A wrong row's right token is its second choice, so a
tree (two children per node) recovers where a chain stops.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/oracle_bench.py --json docs/bench/oracle.json

For each error rate and mode it reports tau, the mean verify rows, the achieved speed over
autoregressive decoding (median of --repeats, the AR run timed in the same round), and the bound
tau * t(1) / t(rows), where t(L) is the measured cost of a plain target forward over L tokens at
the run's context (`measure_verify_sps`, measured again before every repeat, so that a host whose
speed drifts bounds each repeat by its own costs): the median over repeats of achieved / bound is
the share of the ideal speed the engine keeps (what drafting, acceptance, tree masks, cache
compaction and Python cost).
"""

import argparse
import statistics
import sys
import time

import numpy as np


class OracleDrafter:
    """Drafts full[pos+1 : pos+1+n]; row j is wrong where err[pos + j] (its argmax another token,
    the right one second)."""

    name, taps, ctx_len = "oracle", (), None
    proposes_model_drafts, has_lookup = True, False

    def __init__(self, full, err, vocab, n):
        self.full, self.err, self.vocab, self.max_drafts, self.pos = full, err, vocab, n, 0

    def begin(self, ids, taps):
        self.pos = len(ids)

    def accept(self, tokens, taps):
        self.pos += len(tokens)

    def draft(self, anchor, n, sp, rng):
        import mlx.core as mx

        from mlxspec.engine.drafting import DraftOutput

        right = self.full[self.pos + 1 : self.pos + 1 + n]
        z = np.full((len(right), self.vocab), -4.0, np.float32)
        toks = []
        for j, t in enumerate(right):
            z[j, t] = 2.0
            if self.err[self.pos + j]:
                z[j, (t + 1) % self.vocab] = 3.0
            toks.append(int(np.argmax(z[j])))
        return DraftOutput(toks, None, None, mx.array(z))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--errors", default="0.5,0.2,0.08,0", help="per-token error rates (comma-separated)")
    ap.add_argument("--drafts", type=int, default=7, help="chain drafts = tree nodes (equal verify rows)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    errors = [float(x) for x in a.errors.split(",")]
    if any(not 0 <= e < 1 for e in errors) or not 1 <= a.drafts <= 16 or a.max_tokens < 8 or a.repeats < 1:
        ap.error("error rates in [0, 1), --drafts 1-16, --max-tokens >= 8, --repeats >= 1")

    from mlxspec import api
    from mlxspec.engine.loop import SpecStats, generate_steps
    from mlxspec.engine.policy import FixedLength
    from mlxspec.engine.profile import measure_verify_sps
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, _ = api.load(None, "none")
    ids = encode_prompt(tok, "code", load_prompts()["code"][3])
    V = target.info.vocab_size

    def run(drafter=None, tree="off"):
        st = SpecStats()
        t0 = time.perf_counter()
        out = [x for s in generate_steps(target, ids, drafter=drafter, max_tokens=a.max_tokens, stats=st,
                                         policy=FixedLength(), tree=tree) for x in s]
        return out, st, time.perf_counter() - t0 - st.prompt_time

    ar, _, _ = run()
    full = ids + ar
    ctx = len(ids) + a.max_tokens // 2

    def costs() -> dict[int, float]:  # t(L), seconds: measured again in every round, beside the runs it bounds
        return {L: 1.0 / v for L, v in measure_verify_sps(target, a.drafts + 2, context=ctx, repeats=3).items()}

    def bound_of(st, t) -> float:
        mean_rows = sum(st.verify_lengths) / len(st.verify_lengths)
        lo, hi = int(mean_rows), min(int(mean_rows) + 1, max(t))
        return st.tau * t[1] / (t[lo] + (t[hi] - t[lo]) * (mean_rows - lo))

    rows, t = [], {}
    for e in errors:
        err = np.random.default_rng(0).random(len(full) + 64) < e
        for mode in ("chain", "tree"):
            ratios, bounds, st = [], [], None
            for _ in range(a.repeats):
                t = costs()
                _, _, t_ar = run()
                out, st, t_sp = run(OracleDrafter(full, err, V, a.drafts), a.drafts if mode == "tree" else "off")
                if out != ar:
                    raise SystemExit(f"oracle_bench.py: the {mode} output differs from autoregressive (error rate {e})")
                ratios.append(t_ar / t_sp)
                bounds.append(bound_of(st, t))
            mean_rows = sum(st.verify_lengths) / len(st.verify_lengths)
            bound, speed = statistics.median(bounds), statistics.median(ratios)
            share = statistics.median(r / b for r, b in zip(ratios, bounds))
            rows.append({"error": e, "mode": mode, "tau": st.tau, "rows": mean_rows, "x_ar": speed, "bound": bound,
                         "share_of_bound": share, "x_ar_repeats": ratios, "bound_repeats": bounds})
            print(f"error {e:4.2f} {mode:5s} tau {st.tau:5.2f} rows {mean_rows:4.1f}  x AR {speed:5.2f}  bound {bound:5.2f}"
                  f"  share {share:5.1%}", flush=True)
    from mlxspec.bench.report import write_json

    write_json(a.json, {"rows": rows, "verify_ms": {L: 1000 * v for L, v in t.items()}, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
