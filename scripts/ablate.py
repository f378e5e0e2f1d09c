#!/usr/bin/env python
"""Drafter recipe ablations at an equal budget: one change at a time, held-out tau.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/ablate.py --data runs/data-1m3 \
        --out runs/ablate --steps 200 --max-windows 192 --prompts 4

Every configuration trains from scratch on the same data prefix for the same number of
steps, then drafts greedily (full blocks, fixed verify length) on the fixed held-out prompts
(`mlxspec/data/prompts.json`, code and prose). Results go to <out>/ablate.json after each
configuration (a rerun skips the finished ones) and as a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

# name -> changes against the baseline (TrainConfig fields)
CONFIGS = {
    "baseline (DSpark, CE, random init, 16 anchors x 4 seqs)": {},
    "+ warm start from the target": {"warm_start": True},
    "+ KL to the target's top-k": {"loss": "kl"},
    "+ warm start + KL": {"warm_start": True, "loss": "kl"},
    "32 anchors per window": {"anchors_per_seq": 32},
    "2 drafter layers": {"layers": 2},
    "DFlash lineage (no Markov/confidence head)": {"lineage": "dflash"},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per category")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--only", default=None, help="comma-separated config indices to run")
    ap.add_argument("--configs", default=None, help="JSON file {name: {field: value}} instead of the built-in set")
    a = ap.parse_args()

    from mlxspec.evaluate import run_prompts
    from mlxspec.targets.load import load_target
    from mlxspec.prompts import encode_prompt, load_prompts
    from mlxspec.engine.drafting import BlockDrafter
    from mlxspec.train.trainer import TrainConfig, train

    configs = json.loads(Path(a.configs).read_text()) if a.configs else CONFIGS
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "ablate.json"
    results = json.loads(res_path.read_text()) if res_path.exists() else {}
    target, tok = load_target(None)
    meta = json.loads((Path(a.data) / "meta.json").read_text())
    prompts = load_prompts()
    base = TrainConfig(steps=a.steps, taps=meta["taps"], max_windows=a.max_windows, checkpoint_every=10**9)
    names = list(configs)
    if a.only:
        names = [names[int(i)] for i in a.only.split(",")]
    for name in names:
        key = f"{name} | steps={a.steps} windows={a.max_windows}"
        if key in results:
            continue
        tc = replace(base, **configs[name])
        t0 = time.time()
        run_dir = out / f"run{list(configs).index(name)}-w{a.max_windows}-s{a.steps}"
        model, cfg, info = train(target, a.data, str(run_dir), tc, resume=False, force=True)
        train_s = time.time() - t0
        row = {"config": name, "changes": configs[name], "steps": a.steps, "max_windows": a.max_windows,
               "train_seconds": train_s, "final_loss": info["history"][-1]["loss"],
               "final_acc": info["history"][-1]["acc"]}
        for cat in ("code", "prose"):
            ids = [encode_prompt(tok, cat, p) for p in prompts[cat][: a.prompts]]
            s, _ = run_prompts(target, tok, lambda t: BlockDrafter(model, t), ids, a.max_tokens)
            row[cat] = {"acceptance": s.acceptance_rate, "tau": s.tau,
                        "per_position": [round(x, 3) for x in s.per_position_acceptance]}
        results[key] = row
        res_path.write_text(json.dumps(results, indent=1))
        print(f"{name}: code tau {row['code']['tau']:.2f} prose tau {row['prose']['tau']:.2f} "
              f"({train_s:.0f} s)", flush=True)
    print("\n| configuration | steps | windows | code tau | code 1st-row | prose tau | prose 1st-row | train s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results.values():
        print(f"| {r['config']} | {r['steps']} | {r['max_windows']} | {r['code']['tau']:.2f} | "
              f"{r['code']['per_position'][0]:.2f} | {r['prose']['tau']:.2f} | {r['prose']['per_position'][0]:.2f} | "
              f"{r['train_seconds']:.0f} |")


if __name__ == "__main__":
    main()
