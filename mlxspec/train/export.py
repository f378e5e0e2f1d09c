"""Export a trained drafter: an HF directory and a GGUF file, both with the layout
written explicitly (`sample_from_anchor`), tap ids in each format's convention.

Weights are stored in float16 (the Markov head is computed in float32 at run time).
A reduced draft vocabulary is stored as `d2t`. The GGUF borrows the LM head from the target
(its rows at the d2t ids); the speculators directory carries those rows as `lm_head.weight`
(float32, the exact rows), because speculators' own loader never borrows the verifier's head.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlxspec.drafters.load import save_drafter

HF_FORMAT = "speculators"  # carries sample_from_anchor, markov/confidence fields and d2t


def to_float16(model):
    model.apply(lambda a: a.astype(mx.float16) if a.dtype == mx.float32 else a)
    mx.eval(model.parameters())
    return model


def export_all(model, cfg, out: str | Path, target=None) -> list[Path]:
    """target: the Target trained against (the speculators export records it as the
    verifier and, with a reduced vocabulary, writes its head rows as lm_head.weight)."""
    out = Path(out)
    to_float16(model)
    hf = out / "hf"
    gg = out / "drafter.gguf"
    save_drafter(model, cfg, hf, HF_FORMAT, target=target)
    save_drafter(model, cfg, gg, "gguf", target=target)
    return [hf, gg]
