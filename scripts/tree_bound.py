#!/usr/bin/env python
"""What trees can buy over chains on this machine, before any policy: chains of every length and
trees of every node count, each verified at that size on every step (`--verify-policy fixed`),
on the held-out prompts, greedy (every configuration's output must be the target's).

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/tree_bound.py --categories code --prompts 6 \\
        --max-tokens 96 --json docs/bench/tree-bound.json

For each configuration: tau, verify rows per step, drafting ms per step (the drafter's forwards,
measured in the run), and two speeds:
- modeled x AR = tau * t(1) / (t(rows) + draft): t from the verify-cost profile the adaptive
  policy uses (`mlxspec.engine.profile.verify_profile`), the drafting as measured; deterministic
  but for the drafting, so configurations compare without the host's drift;
- modeled on a flat verify curve (every row count at t(1), as on an accelerator where 16-64
  rows cost about one step), the drafting as measured here;
- measured x AR: tokens/s over autoregressive decoding's, timed in the same process (AR runs
  before and after, their mean is the base).
The best tree over the best chain, modeled, is what a policy choosing one fixed size could get
from trees here; the adaptive policy chooses per step, for chains and trees alike (`--adaptive`
adds its rows: the default's chains and `--tree auto`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(ROOT / "mlxspec/weights/smollm2-135m-eagle3"))
    ap.add_argument("--categories", default="code")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts per category (1-8)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--chains", default="1,2,3,4,5,6,7", help="chain lengths (drafts)")
    ap.add_argument("--trees", default="2,3,4,6,8,12,16", help="tree sizes (nodes)")
    ap.add_argument("--ngram", action="store_true", help="prompt lookup's continuations merged into the trees "
                    "(a fixed chain is the drafter's own either way)")
    ap.add_argument("--adaptive", action="store_true", help="also the adaptive policy's chains and trees (`--tree auto`), "
                    "with prompt lookup beside the drafter where --ngram")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cats = [c.strip() for c in a.categories.split(",") if c.strip()]
    try:
        chains = [int(x) for x in a.chains.split(",") if x.strip()]
        trees = [int(x) for x in a.trees.split(",") if x.strip()]
    except ValueError:
        ap.error("--chains / --trees: comma-separated integers")
    if not 1 <= a.prompts <= 8 or not 2 <= a.max_tokens <= 1024 or set(cats) - {"code", "prose", "chat"} or not cats:
        ap.error("--prompts 1-8, --max-tokens 2-1024, --categories from code,prose,chat")
    if any(not 1 <= x <= 7 for x in chains) or any(not 1 <= x <= 24 for x in trees):
        ap.error("--chains 1-7 drafts, --trees 1-24 nodes")
    if not Path(a.draft).exists():
        ap.error(f"--draft {a.draft}: no drafter there")

    from tqdm import tqdm

    from mlxspec import api
    from mlxspec.engine.loop import SpecStats
    from mlxspec.engine.profile import verify_profile
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, _ = api.load(None, "none")
    eos = set(tok.eos_token_ids)
    texts = load_prompts()
    prompts = [encode_prompt(tok, c, t) for c in cats for t in texts[c][: a.prompts]]
    sps = verify_profile(target, max(max(trees, default=1), max(chains, default=1)) + 1)
    t = {k: 1.0 / v for k, v in sps.items()}  # seconds per verify of k rows
    configs = [("AR", api.SpecConfig(draft="none"))]
    configs += [(f"chain {n}", api.SpecConfig(draft=a.draft, policy="fixed", num_draft_tokens=n, ngram=False))
                for n in chains]
    configs += [(f"tree {n}", api.SpecConfig(draft=a.draft, policy="fixed", tree=str(n), ngram=a.ngram)) for n in trees]
    if a.adaptive:
        configs += [("adaptive chains", api.SpecConfig(draft=a.draft, ngram=a.ngram)),
                    ("adaptive trees", api.SpecConfig(draft=a.draft, ngram=a.ngram, tree="auto"))]
    configs.append(("AR again", api.SpecConfig(draft="none")))
    rows, outputs = {}, {}
    bar = tqdm(total=len(configs) * len(prompts), unit="answer", desc="tree bound")
    for name, cfg in configs:
        spec = api.Speculator.build(cfg, target)
        c = {"tokens": 0, "forwards": 0, "rows": 0, "draft": 0.0, "gen": 0, "secs": 0.0}
        for i, ids in enumerate(prompts):
            st = SpecStats()
            t0 = time.perf_counter()
            out = [x for s in spec.session(target, ids, max_tokens=a.max_tokens, eos_ids=eos, stats=st) for x in s]
            c["secs"] += time.perf_counter() - t0
            c["gen"] += len(out)
            c["tokens"] += st.generated - 1  # the prefill's token is not a step's
            c["forwards"] += st.target_forwards
            c["rows"] += sum(st.verify_lengths)
            c["draft"] += st.draft_time
            outputs.setdefault(i, set()).add(tuple(out))
            bar.update(1)
        fw = max(c["forwards"], 1)
        rows[name] = {"tau": c["tokens"] / fw, "rows": c["rows"] / fw, "draft_ms": 1000 * c["draft"] / fw,
                      "tok_s": c["gen"] / c["secs"]}
    bar.close()
    ar = (rows["AR"]["tok_s"] + rows["AR again"]["tok_s"]) / 2
    for name, r in rows.items():
        if name.startswith("AR"):
            r.update(tau=1.0, modeled_x_ar=1.0, modeled_flat_x_ar=1.0, x_ar=r["tok_s"] / ar)
            continue
        k = max(1, min(round(r["rows"]), max(t)))
        r["modeled_x_ar"] = r["tau"] * t[1] / (t[k] + r["draft_ms"] / 1000)
        r["modeled_flat_x_ar"] = r["tau"] * t[1] / (t[1] + r["draft_ms"] / 1000)
        r["x_ar"] = r["tok_s"] / ar
    best = {kind: max((n for n in rows if n.startswith(kind)), key=lambda n: rows[n]["modeled_x_ar"]) for kind in ("chain", "tree")}
    # (the adaptive rows' verify lengths vary by step: their modeled speed reads the mean's cost)
    out = {"command": " ".join(sys.argv), "categories": cats, "prompts": a.prompts, "max_tokens": a.max_tokens,
           "verify_steps_per_s": sps, "identical_outputs": all(len(v) == 1 for v in outputs.values()), "rows": rows,
           "best": best, "best_tree_over_best_chain_modeled": rows[best["tree"]]["modeled_x_ar"] / rows[best["chain"]]["modeled_x_ar"],
           "best_tree_over_best_chain_measured": rows[best["tree"]]["x_ar"] / rows[best["chain"]]["x_ar"]}
    print(f"{'configuration':16s} {'tau':>6s} {'rows':>5s} {'draft ms':>8s} {'modeled':>8s} {'flat':>8s} {'measured':>8s}")
    for name, r in rows.items():
        print(f"{name:16s} {r['tau']:6.2f} {r['rows']:5.1f} {r['draft_ms']:8.1f} {r['modeled_x_ar']:7.2f}x "
              f"{r['modeled_flat_x_ar']:7.2f}x {r['x_ar']:7.2f}x")
    print(f"best chain: {best['chain']}, best tree: {best['tree']}; tree over chain, modeled "
          f"{out['best_tree_over_best_chain_modeled']:.3f}, measured {out['best_tree_over_best_chain_measured']:.3f}")
    print(f"identical outputs: {out['identical_outputs']}")
    from mlxspec.bench.report import write_json

    write_json(a.json, out)
    if not out["identical_outputs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
