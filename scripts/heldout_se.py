#!/usr/bin/env python
"""Held-out tau with its standard error over the prompts, for drafter exports, and each
drafter's paired difference against the first one named.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/heldout_se.py \
        shipped=mlxspec/weights/smollm2-135m-dspark dense2=runs/dspark-dense2/hf --json docs/bench/heldout-se.json

The same held-out store `mlxspec train --heldout-every` reads (the target's greedy answers to
the held-out prompts, built once and cached) and the same replay (`train.heldout.heldout_tau`);
`tau_se` resamples the prompts (`train.heldout.bootstrap_se`). `--prompts 16 --max-tokens 128`
reads every held-out prompt of `mlxspec/data/prompts.json` (16 code, 16 prose, 8 chat) for
twice as long, from a store of its own (the training histories stay comparable with the default
8 x 64). The paired difference (`train.heldout.paired_difference`) resamples the prompts
jointly for both drafters, which is what a ship decision between two drafters needs.
"""

import argparse
import io
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="+", help="LABEL=PATH (a drafter export: HF directory or .gguf); the first is the baseline")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category (at most 16 code, 16 prose, 8 chat)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per held-out answer (1-1024)")
    ap.add_argument("--model", default=None, help="the target (a name such as gemma3-270m, a .gguf or an MLX directory); default SmolLM2-135M")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    for spec in a.drafters:
        path = spec.rpartition("=")[2]
        if not Path(path).exists():
            ap.error(f"{spec}: no drafter export at {path} (pass LABEL=PATH with an HF directory or a .gguf file)")
    if not 1 <= a.prompts <= 16 or not 1 <= a.max_tokens <= 1024:
        ap.error(f"--prompts {a.prompts} --max-tokens {a.max_tokens}: prompts must be 1-16, max tokens 1-1024")

    from mlxspec.errors import MlxspecError
    try:
        run(a)
    except MlxspecError as e:
        print(f"heldout_se.py: {e}", file=sys.stderr)
        sys.exit(2)


def run(a) -> None:
    import mlx.core as mx

    from mlxspec.drafters.load import load_drafter
    from mlxspec.targets.load import load_target
    from mlxspec.train.heldout import build_heldout, default_heldout_dir, frozen_for, heldout_tau, paired_difference

    target, tok = load_target(a.model)
    out, base = {"model": a.model or "smollm2-135m", "prompts": a.prompts, "max_tokens": a.max_tokens,
                 "drafters": {}}, None
    for spec in a.drafters:
        label, _, path = spec.rpartition("=")
        label = label or path
        m, cfg = load_drafter(path, target.info, log=io.StringIO())
        taps = cfg.target_layer_ids
        d = default_heldout_dir(target, taps, a.prompts, a.max_tokens)
        store = build_heldout(target, tok, taps, d, n_per_category=a.prompts, max_tokens=a.max_tokens)
        if cfg.lineage == "eagle3":  # a chain drafter: its TTT pass gives the accepted lengths
            from mlxspec.train.eagle3 import frozen_for_eagle3, heldout_lengths

            m.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)  # as the engine runs it
            fz = frozen_for_eagle3(target, m)
            r = heldout_tau(m, fz, store, lengths=heldout_lengths(m, fz, cfg.max_drafts), n_drafts=cfg.max_drafts)
        else:
            r = heldout_tau(m, frozen_for(target, m), store)
        row = {c: {"tau": v["tau"], "tau_se": v["tau_se"], "prompts": v["prompts"],
                   "row1": v["per_position_acceptance"][0]} for c, v in r.items()}
        line = "  ".join(f"{c} {v['tau']:.3f} ± {v['tau_se']:.3f} (row 1 {v['per_position_acceptance'][0]:.3f})"
                         for c, v in r.items())
        if base is None:
            base = (label, r)
        else:
            for c, v in r.items():
                row[c]["vs_" + base[0]] = pd = paired_difference(v["per_prompt"], base[1][c]["per_prompt"])
                line += f"\n    {c} vs {base[0]}: {pd['diff']:+.3f} ± {pd['se']:.3f} (ahead in {pd['p_ahead']:.0%} of draws)"
        out["drafters"][label] = row
        print(label, line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
