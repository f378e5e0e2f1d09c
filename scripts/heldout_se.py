#!/usr/bin/env python
"""Held-out tau with its standard error over the prompts, for drafter exports.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/heldout_se.py \
        shipped=mlxspec/weights/smollm2-135m-dspark dense2=runs/dspark-dense2/hf --json docs/bench/heldout-se.json

The same held-out store `mlxspec train --heldout-every` reads (the target's greedy answers to
the held-out prompts, built once and cached) and the same replay (`train.heldout.heldout_tau`);
`tau_se` resamples the prompts (`train.heldout.bootstrap_se`).
"""

import argparse
import io
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="+", help="LABEL=PATH (a drafter export: HF directory or .gguf)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from mlxspec.drafters.load import load_drafter
    from mlxspec.targets.load import load_target
    from mlxspec.train.heldout import build_heldout, default_heldout_dir, frozen_for, heldout_tau

    target, tok = load_target(None)
    out = {}
    for spec in a.drafters:
        label, _, path = spec.rpartition("=")
        m, cfg = load_drafter(path, target.info, log=io.StringIO())
        taps = cfg.target_layer_ids
        store = build_heldout(target, tok, taps, default_heldout_dir(target, taps))
        r = heldout_tau(m, frozen_for(target, m), store)
        out[label or path] = {c: {"tau": v["tau"], "tau_se": v["tau_se"], "prompts": v["prompts"]} for c, v in r.items()}
        print(label or path, "  ".join(f"{c} {v['tau']:.3f} ± {v['tau_se']:.3f}" for c, v in r.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
