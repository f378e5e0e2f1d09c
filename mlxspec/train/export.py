"""Export a trained drafter: an HF directory and a GGUF file, both with the layout
written explicitly (`sample_from_anchor`), tap ids in each format's convention.

Weights are stored in float16 (the Markov head is computed in float32 at run time).
A reduced draft vocabulary is stored as `d2t` only: the LM head stays borrowed from the
target (its rows at the d2t ids), so the file holds no copy of the target's weights.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

HF_FORMAT = "speculators"  # carries sample_from_anchor, markov/confidence fields and d2t


def to_float16(model):
    model.apply(lambda a: a.astype(mx.float16) if a.dtype == mx.float32 else a)
    mx.eval(model.parameters())
    return model


def export_all(model, cfg, out: str | Path) -> list[Path]:
    from ..loading.drafter import save_drafter

    out = Path(out)
    to_float16(model)
    hf = out / "hf"
    gg = out / "drafter.gguf"
    save_drafter(model, cfg, hf, HF_FORMAT)
    save_drafter(model, cfg, gg, "gguf")
    return [hf, gg]
