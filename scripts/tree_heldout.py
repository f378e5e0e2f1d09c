#!/usr/bin/env python
"""Chains against trees on the held-out prompts, through the engine (greedy): tau, verify rows
per step, accepted tokens per verify row, tokens/s, and whether every configuration's output is
the same (they must all be the target's greedy output).

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/tree_heldout.py --prompts 16 --max-tokens 128 \\
        --json docs/bench/tree-heldout.json

Configurations, for each drafter given (default: the shipped DSpark and EAGLE-3 drafters):
- `fixed`: the drafter's full chain every step, against a tree of as many nodes (equal verify
  rows: what the tree buys at the same cost per step), with prompt lookup beside the drafter
  (the tree merges lookup's continuations in; the fixed chain is the drafter's own);
- `adaptive`: the default (drafter + lookup, adaptive policy) with chains and with `--tree auto`.
Prompts: `mlxspec/data/prompts.json` (16 code, 16 prose, 8 chat held-out prompts).
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"dspark": ROOT / "mlxspec/weights/smollm2-135m-dspark", "eagle3": ROOT / "mlxspec/weights/smollm2-135m-eagle3"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="*", help="LABEL=PATH drafter exports (default: the shipped dspark and eagle3)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per category (at most 16 code, 16 prose, 8 chat)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", default="fixed,adaptive", help="fixed (equal rows) and/or adaptive (the default)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.prompts <= 16 or not 2 <= a.max_tokens <= 1024:
        ap.error("--prompts must be 1-16 and --max-tokens 2-1024")
    drafters = dict(s.split("=", 1) for s in a.drafters) if a.drafters else {k: str(v) for k, v in SHIPPED.items()}
    for k, v in drafters.items():
        if not Path(v).exists():
            ap.error(f"{k}={v}: no drafter export there")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"fixed", "adaptive"}:
        ap.error("--modes: fixed and/or adaptive")
    run(a, drafters, modes)


def run(a, drafters: dict, modes: list) -> None:
    from tqdm import tqdm

    from mlxspec import api
    from mlxspec.engine.loop import SpecStats
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, _ = api.load(None, "none")
    texts = load_prompts()
    prompts = [(c, encode_prompt(tok, c, t)) for c in ("code", "prose", "chat") for t in texts[c][: a.prompts]]
    eos = set(tok.eos_token_ids)
    configs = []
    for label, path in drafters.items():
        for mode in modes:
            policy = "fixed" if mode == "fixed" else "adaptive"
            for tree in ("off", "auto"):
                configs.append((f"{label} {mode} {'tree' if tree != 'off' else 'chain'}", path, policy, tree, label, mode))
    out = {"prompts": a.prompts, "max_tokens": a.max_tokens, "rows": {}, "same_output": {}}
    outputs = {}
    bar = tqdm(total=len(configs) * len(prompts), unit="answer", desc="held-out")
    for name, path, policy, tree, label, mode in configs:
        spec = api.Speculator.build(api.SpecConfig(draft=path, policy=policy, tree="off"), target)
        if tree != "off":  # equal rows: as many nodes as the chain has drafts
            n = spec.make_drafter(target).max_drafts
            spec.tree = api.TreeSettings.parse(str(n) if mode == "fixed" else "auto")
        per = {}
        for i, (cat, ids) in enumerate(prompts):
            st = SpecStats()
            t0 = time.perf_counter()
            toks = [x for s in spec.session(target, ids, max_tokens=a.max_tokens, eos_ids=eos, stats=st) for x in s]
            dt = time.perf_counter() - t0
            outputs.setdefault((label, i), {})[name] = toks
            c = per.setdefault(cat, {"tokens": 0, "forwards": 0, "rows": 0, "accepted": 0, "seconds": 0.0})
            c["tokens"] += st.generated - 1
            c["forwards"] += st.target_forwards
            c["rows"] += sum(st.verify_lengths)
            c["accepted"] += st.accepted
            c["seconds"] += dt
            bar.update(1)
        for c in per.values():
            c["tau"] = c["tokens"] / max(c["forwards"], 1)
            c["rows_per_verify"] = c["rows"] / max(c["forwards"], 1)
            c["accepted_per_row"] = c["accepted"] / max(c["rows"], 1)
        out["rows"][name] = per
    bar.close()
    for (label, i), outs in outputs.items():
        out["same_output"].setdefault(label, True)
        if len({tuple(v) for v in outs.values()}) != 1:
            out["same_output"][label] = False
    print(f"{'configuration':32s} " + " ".join(f"{c:>22s}" for c in ("code", "prose", "chat")))
    print(f"{'':32s} " + " ".join(f"{'tau rows tok/s':>22s}" for _ in range(3)))
    for name, per in out["rows"].items():
        cells = [f"{per[c]['tau']:6.3f} {per[c]['rows_per_verify']:4.1f} {per[c]['tokens'] / per[c]['seconds']:6.1f}"
                 if c in per else "" for c in ("code", "prose", "chat")]
        print(f"{name:32s} " + " ".join(f"{x:>22s}" for x in cells))
    for label in drafters:
        for mode in modes:
            ch, tr = out["rows"][f"{label} {mode} chain"], out["rows"][f"{label} {mode} tree"]
            ratio = {c: tr[c]["tau"] / ch[c]["tau"] for c in ch}
            out.setdefault("tree_over_chain_tau", {})[f"{label} {mode}"] = ratio
            print(f"tree / chain tau, {label} {mode}: " + ", ".join(f"{c} {r:.3f}" for c, r in ratio.items()))
    print("identical outputs across configurations: " + ", ".join(f"{k} {v}" for k, v in out["same_output"].items()))
    from mlxspec.bench.report import write_json

    write_json(a.json, {**out, "command": " ".join(sys.argv)})


if __name__ == "__main__":
    main()
