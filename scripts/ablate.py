#!/usr/bin/env python
"""Drafter recipe ablations at equal compute, one change at a time, on held-out prompts.

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=$(python -m mlxspec.blas) python scripts/ablate.py \
        --data runs/corpus1-smollm2:1,runs/regen-smollm2:1 --corpus-only runs/corpus1-smollm2 \
        --out docs/bench/ablate --rows 400000 --init-from mlxspec/weights/smollm2-135m-dspark

Compute is counted in drafter rows (windows x anchors x block rows, forward + backward):
every configuration gets the same --rows, so a configuration with 16 anchors per window
takes proportionally more steps than one with every anchor, and block 4 supervises twice
as many blocks as block 8. Held-out tau comes from `mlxspec.train.heldout` (the engine's
full-block greedy evaluation on mlxspec/data/prompts.json, replayed exactly). Results are
written to <out>/ablate.json after each configuration (a rerun skips finished ones) and as a
markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

# name -> changes against the baseline (TrainConfig fields; "data": "corpus" = corpus store only)
CONFIGS = {
    "baseline: every anchor, block 8, corpus + regen, answer-only": {},
    "16 anchors per window": {"anchors_per_seq": 16},
    "64 anchors per window": {"anchors_per_seq": 64},
    "alternative lr (--lr-alt)": {"lr": "alt"},
    "block 4": {"block_size": 4},
    "corpus only": {"data": "corpus"},
    "prompt positions supervised too": {"response_only": False},
    "DFlash lineage (no Markov / confidence head)": {"lineage": "dflash"},
    "DFlash 2 lineage (convs + path selector, bonus-anchor, full vocabulary)":
        {"lineage": "dflash2", "sample_from_anchor": False, "markov_rank": 0},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="store mix, DIR:W,DIR:W (as mlxspec train --data)")
    ap.add_argument("--corpus-only", required=True, help="the corpus store alone, for the 'corpus only' row")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=400_000, help="drafter rows per configuration (equal compute)")
    ap.add_argument("--seqs", type=int, default=4, help="windows per step")
    ap.add_argument("--init-from", default=None, help="start every configuration from this drafter")
    ap.add_argument("--lr", type=float, default=6e-4, help="the baseline's peak lr (6e-4 from scratch, as the references)")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up steps (a continuation needs few)")
    ap.add_argument("--lr-alt", type=float, default=1e-3, help="the lr of the 'alternative lr' row")
    ap.add_argument("--only", default=None, help="comma-separated config indices to run")
    a = ap.parse_args()

    from mlxspec.targets.load import load_target
    from mlxspec.train.heldout import build_heldout, frozen_for, heldout_tau
    from mlxspec.train.batches import parse_data_mix
    from mlxspec.train.config import TrainConfig
    from mlxspec.train.trainer import train

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "ablate.json"
    results = json.loads(res_path.read_text()) if res_path.exists() else {}
    target, tok = load_target(None)
    mix = parse_data_mix(a.data)
    taps = json.loads((Path(mix[0][0]) / "meta.json").read_text())["taps"]
    heldout = build_heldout(target, tok, taps, Path("runs") / f"heldout-t{'_'.join(map(str, taps))}")
    L = 256
    names = list(CONFIGS)
    pick = [names[int(i)] for i in a.only.split(",")] if a.only else names
    for name in pick:
        ch = dict(CONFIGS[name])
        if ch.get("lr") == "alt":
            ch["lr"] = a.lr_alt
        label = name.replace("(--lr-alt)", f"{a.lr_alt:g} (baseline {a.lr:g})")
        key = f"{label} | rows={a.rows} init={a.init_from}" + ("" if a.lr == 6e-4 else f" lr={a.lr:g}")
        if key in results:
            continue
        changes = dict(ch)
        data = a.corpus_only if ch.pop("data", None) == "corpus" else mix
        base = TrainConfig(taps=taps, lr=a.lr, warmup=a.warmup, seqs_per_step=a.seqs, anchors_per_seq=0,
                           checkpoint_every=10**9, init_from=a.init_from)
        tc = replace(base, **ch)
        K = tc.anchors_per_seq or L - tc.block_size - 2
        tc.steps = max(2, a.rows // (tc.seqs_per_step * K * tc.block_size))
        run_dir = Path("runs") / "ablate" / out.name / f"run{names.index(name)}"  # checkpoints stay out of docs/
        t0 = time.time()
        model, cfg, info = train(target, data, str(run_dir), tc, resume=False, force=True, log=lambda *x: None)
        secs = time.time() - t0
        ho = heldout_tau(model, frozen_for(target, model), heldout)
        h = [x for x in info["history"] if "supervised_blocks" in x and "loss" in x][-1]
        results[key] = {"config": label, "changes": changes, "baseline_lr": a.lr, "steps": tc.steps, "rows": a.rows,
                        "supervised_blocks": h["supervised_blocks"], "train_seconds": secs,
                        "final_train_acc": h.get("acc"), "init_from": a.init_from,
                        **{c: ho[c] for c in ho}}
        res_path.write_text(json.dumps(results, indent=1))
        print(f"{label}: " + ", ".join(f"{c} tau {ho[c]['tau']:.3f} row1 {ho[c]['per_position_acceptance'][0]:.3f}"
                                        for c in ho), flush=True)
    print("\n| configuration | steps | supervised blocks | code tau (row 1) | prose tau (row 1) | chat tau (row 1) |")
    print("|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['config']} | {r['steps']} | {r['supervised_blocks']:.0f} | "
              + " | ".join(f"{r[c]['tau']:.3f} ({r[c]['per_position_acceptance'][0]:.2f})" for c in ("code", "prose", "chat"))
              + " |")


if __name__ == "__main__":
    main()
