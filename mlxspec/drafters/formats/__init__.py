"""The drafter formats: name -> how to recognise, read and write it.

A format is recognised from its header, the parsed config.json of a Hugging Face
directory or the parsed GGUF file, by exactly one `detect`; `read(path, header,
target_vocab)` returns a `RawDrafter` (no layout: `load.resolve_layout` decides it);
`write(model, cfg, path, target=None, **options)` refuses what the format cannot hold.
EAGLE-3 formats return a `formats.eagle3.RawEagle3` instead (taps, vocabulary maps, no layout).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from mlxspec.drafters.common import RawDrafter
from mlxspec.drafters.formats import deepspec, eagle3, gguf, gguf_eagle3, hf, speculators, zlab
from mlxspec.errors import MlxspecError
from mlxspec.gguf.file import read_gguf
from mlxspec.validate import require_regular_file


@dataclass(frozen=True)
class DrafterFormat:
    container: str  # "dir" (Hugging Face directory) or "gguf"
    detect: Callable  # (header, path) -> bool
    read: Callable  # (path, header, target_vocab) -> RawDrafter
    write: Callable  # (model, cfg, path, target=None, **options) -> None


FORMATS = {
    "zlab": DrafterFormat("dir", zlab.detect, zlab.read, zlab.write),
    "deepspec": DrafterFormat("dir", deepspec.detect, deepspec.read, deepspec.write),
    "speculators": DrafterFormat("dir", speculators.detect, speculators.read, speculators.write),
    # EAGLE-3 chain drafters (`mlxspec.drafters.eagle3`): their readers return a RawEagle3
    "speculators-eagle3": DrafterFormat("dir", eagle3.detect_speculators, eagle3.read_speculators,
                                        eagle3.write_speculators),
    "specforge": DrafterFormat("dir", eagle3.detect_specforge, eagle3.read_specforge, eagle3.write_specforge),
    "gguf": DrafterFormat("gguf", gguf.detect_dflash, gguf.read_gguf_drafter, gguf.write_dflash),
    "gguf-dspark-legacy": DrafterFormat("gguf", gguf.detect_legacy, gguf.read_gguf_drafter, gguf.write_legacy),
    # llama.cpp's EAGLE-3 GGUF (`general.architecture = eagle3`): a RawEagle3 too
    "gguf-eagle3": DrafterFormat("gguf", gguf_eagle3.detect, gguf_eagle3.read, gguf_eagle3.write),
}


def _detect(container: str, header, path: str) -> str | None:
    return next((name for name, f in FORMATS.items() if f.container == container and f.detect(header, path)), None)


def dir_format(config: dict, path: str) -> str:
    """The format of a Hugging Face directory's config.json; MlxspecError if it is no drafter."""
    name = _detect("dir", config, path)
    if name is None:
        raise hf.not_a_drafter(config, path)
    return name


def read_drafter(path, target_vocab: int | None = None) -> RawDrafter:
    """Dispatch on the path: a directory (HF formats) or a .gguf file. target_vocab: the
    target's vocabulary size, for GGUF drafters that name none (they borrow the target's)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        config = hf.load_config(path)
        return FORMATS[dir_format(config, path)].read(path, config, target_vocab)
    if not os.path.exists(path):
        raise MlxspecError(f"{path}: no such file or directory; pass a drafter directory or .gguf file")
    require_regular_file(path, "drafter file")  # a FIFO would block forever
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise MlxspecError(f"{path}: not a drafter: expected a Hugging Face directory or a .gguf file")
    g = read_gguf(path)
    name = _detect("gguf", g, path)
    if name is None:
        raise gguf.not_a_drafter(g, path)
    return FORMATS[name].read(path, g, target_vocab)
