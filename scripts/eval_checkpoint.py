#!/usr/bin/env python
"""Held-out acceptance and tau of a training checkpoint (`<run>/ckpt`), greedy.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/eval_checkpoint.py runs/dflash-corpus/ckpt runs/dflash-ckpt500 --json out.json

Used for the data/label comparison in mlxspec/weights/README.md: same prompts, same
token budget as the evaluation `mlxspec train` runs at its end.
"""

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--categories", default="code,prose")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from mlxspec.evaluate import run_prompts
    from mlxspec.targets.load import load_target
    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.drafters.model import DFlashModel
    from mlxspec.prompts import encode_prompt, load_prompts
    from mlxspec.engine.drafting import BlockDrafter

    target, tok = load_target(None)
    prompts = load_prompts()
    out = {}
    for ck in a.ckpts:
        st = json.load(open(f"{ck}/state.json"))
        cfg = DrafterConfig(**st["drafter_config"])
        model = DFlashModel(cfg)
        model.load_weights(f"{ck}/model.safetensors", strict=True)
        res = {"step": st["step"], "lineage": cfg.lineage}
        for cat in a.categories.split(","):
            ids = [encode_prompt(tok, cat, p) for p in prompts[cat][: a.prompts]]
            s, _ = run_prompts(target, tok, lambda t: BlockDrafter(model, t), ids, a.max_tokens)
            res[cat] = {"acceptance_rate": s.acceptance_rate, "accepted": s.accepted, "drafted": s.drafted,
                        "tau": s.tau, "per_position_acceptance": s.per_position_acceptance}
            print(f"{ck} step {st['step']} {cat}: acceptance {s.acceptance_rate:.1%} "
                  f"({s.accepted}/{s.drafted}) tau {s.tau:.2f}", flush=True)
        out[ck] = res
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
