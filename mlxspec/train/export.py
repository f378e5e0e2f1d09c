"""Export a trained drafter: an HF directory and a GGUF file, both with the layout
written explicitly (`sample_from_anchor`), tap ids in each format's convention."""

from __future__ import annotations

from pathlib import Path

HF_FORMAT = "speculators"  # carries sample_from_anchor, markov/confidence fields and d2t


def export_all(model, cfg, out: str | Path) -> list[Path]:
    from ..loading.drafter import save_drafter

    out = Path(out)
    hf = out / "hf"
    gg = out / "drafter.gguf"
    save_drafter(model, cfg, hf, HF_FORMAT)
    save_drafter(model, cfg, gg, "gguf")
    return [hf, gg]
