#!/usr/bin/env python
"""Which share of the target's held-out answer tokens an EAGLE-3 drafter's draft vocabulary holds
(a token outside it can never be drafted), per category, from the held-out store `mlxspec train
--heldout-every` keeps (the target's greedy answers):

    python scripts/draft_vocab_coverage.py mlxspec/weights/smollm2-135m-eagle3 \\
        ~/.cache/mlxspec/heldout/SmolLM2-135M-Instruct.Q4_1-t1_14_26-n16-m128-f32
"""

import argparse
import sys
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter", help="an EAGLE-3 export (config.json + model.safetensors with d2t)")
    ap.add_argument("heldout", help="a held-out store directory (<category>.npz)")
    a = ap.parse_args()
    import numpy as np
    from safetensors.numpy import load_file

    f = Path(a.drafter) / "model.safetensors"
    stores = sorted(Path(a.heldout).glob("*.npz"))
    if not f.is_file() or not stores:
        print(f"draft_vocab_coverage.py: need {f} and <category>.npz files in {a.heldout}; pass an EAGLE-3 export "
              "and a held-out store", file=sys.stderr)
        sys.exit(2)
    try:
        w = load_file(str(f))
    except Exception as e:  # safetensors raises its own error type for a truncated or foreign file
        print(f"draft_vocab_coverage.py: {f} is not a readable safetensors file ({e}); export the drafter again",
              file=sys.stderr)
        sys.exit(2)
    if "d2t" not in w:
        print(f"draft_vocab_coverage.py: {f} has no d2t: its draft vocabulary is the whole target's", file=sys.stderr)
        sys.exit(2)
    ids = np.arange(len(w["d2t"])) + w["d2t"]
    for s in stores:
        z = np.load(s)
        toks = np.concatenate([t[b:e] for t, b, e in zip(z["tokens"], z["start"], z["end"])])
        print(f"{s.stem}: {np.isin(toks, ids).mean():.4f} of {len(toks)} answer tokens in the {len(ids)} draft ids")


if __name__ == "__main__":
    main()
