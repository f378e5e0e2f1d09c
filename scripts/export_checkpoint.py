#!/usr/bin/env python
"""Export a training checkpoint (`<run>/ckpt`) as `mlxspec train` exports at its end:
<out>/hf (speculators format; z-lab style for DFlash 2) and <out>/drafter.gguf.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/export_checkpoint.py runs/ablate/lineages/run8 [--out DIR]

Used for the runs of scripts/ablate.py, which train and evaluate but do not export.
"""

import argparse
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default=None, help="default: the run directory itself")
    a = ap.parse_args()

    from mlxspec.drafters.build import make_model
    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.targets.load import load_target
    from mlxspec.train.export import export_all

    target, _ = load_target(None)
    for run in a.runs:
        ck = Path(run) / "ckpt"
        st = json.loads((ck / "state.json").read_text())
        c = dict(st["drafter_config"])
        c["target_layer_ids"] = list(c["target_layer_ids"])
        if c.get("layer_types") is not None:
            c["layer_types"] = tuple(c["layer_types"])
        cfg = DrafterConfig(**c)
        model = make_model(cfg)
        model.load_weights(str(ck / "model.safetensors"), strict=True)
        paths = export_all(model, cfg, Path(a.out or run), target=target)
        print(f"{run} (step {st['step']}, {cfg.lineage}): wrote {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
