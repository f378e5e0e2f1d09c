#!/usr/bin/env python
"""Is an EAGLE-3 drafter's confidence (its probability of the token it drafts) the chance that
the target accepts that draft? Greedy chains of the full length on held-out prompts; every
draft the target judged (drafts 1..k were accepted, or k was the first rejected) is binned by its
confidence, per position in the chain, against the share the target accepted.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/confidence_calibration.py --prompts 4 \\
        --json docs/bench/eagle3-confidence-calibration.json

Fixed policy (the whole chain verified every step, prompt lookup off), so which drafts are
judged does not depend on their confidences.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BINS = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default=str(ROOT / "mlxspec/weights/smollm2-135m-eagle3"))
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per category (1-8)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.prompts <= 8 or not 2 <= a.max_tokens <= 1024:
        ap.error("--prompts 1-8, --max-tokens 2-1024")
    if not Path(a.draft).exists():
        ap.error(f"--draft {a.draft}: no drafter there")

    from tqdm import tqdm

    from mlxspec import api
    from mlxspec.engine import loop
    from mlxspec.engine.loop import SpecStats
    from mlxspec.prompts import encode_prompt, load_prompts

    judged = []  # (category, position, confidence, accepted)
    cat = None
    real = loop.record

    def record(stats, policy, pr, accepted, seconds):
        if pr.conf:
            for i in range(min(len(pr.drafts), accepted + 1)):
                judged.append((cat, i, float(pr.conf[i]), i < accepted))
        return real(stats, policy, pr, accepted, seconds)

    loop.record = record
    target, tok, _ = api.load(None, "none")
    spec = api.Speculator.build(api.SpecConfig(draft=a.draft, policy="fixed", ngram=False), target)
    eos, texts = set(tok.eos_token_ids), load_prompts()
    for cat in tqdm(("code", "prose", "chat"), desc="categories"):
        for t in texts[cat][: a.prompts]:
            for _ in spec.session(target, encode_prompt(tok, cat, t), max_tokens=a.max_tokens, eos_ids=eos,
                                  stats=SpecStats()):
                pass
    loop.record = real
    out = {"command": " ".join(sys.argv), "bins": BINS[:-1], "table": {}}
    for c in ("code", "prose", "chat", "all"):
        rows = [j for j in judged if c in (j[0], "all")]
        for pos in range(4):
            at = [j for j in rows if min(j[1], 3) == pos]
            cells = []
            for lo, hi in zip(BINS[:-1], BINS[1:]):
                x = [j for j in at if lo <= j[2] < hi]
                cells.append({"n": len(x), "mean_confidence": float(np.mean([j[2] for j in x])) if x else None,
                              "accepted": float(np.mean([j[3] for j in x])) if x else None})
            out["table"].setdefault(c, {})[f"position {pos + 1}{'+' if pos == 3 else ''}"] = cells
    print("confidence bin:        " + "  ".join(f"[{b:.1f}, ..)" for b in BINS[:-1]))
    for pos, cells in out["table"]["all"].items():
        print(f"{pos:12s} accepted  " + "  ".join(f"{c['accepted']:.2f} ({c['n']:3d})" if c["n"] else "  –       "
                                                    for c in cells))
        print(f"{'':12s} mean conf " + "  ".join(f"{c['mean_confidence']:.2f}      " if c["n"] else "  –       "
                                                    for c in cells))
    from mlxspec.bench.report import write_json

    write_json(a.json, out)


if __name__ == "__main__":
    main()
