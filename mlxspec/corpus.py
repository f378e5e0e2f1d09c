"""The text corpora drafters train on and prompts are cut from, with a fixed split.

A file belongs to the held-out set iff crc32(relative path) % 20 == 0 (5%), a fixed rule, so
prompts built from held-out files never overlap training text.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from dataclasses import dataclass

DEFAULT_SOURCES = {
    "code": [sysconfig.get_paths()["stdlib"] + "/**/*.py"],
    "prose": ["/usr/share/doc/python3.11/html/_sources/**/*.rst.txt"],
    "fortunes": ["/usr/share/games/fortunes/*"],
}


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % 20 == 0


@dataclass
class CorpusFile:
    path: str
    rel: str
    category: str


def corpus_files(sources: dict[str, list[str]] | None = None, split: str = "train") -> list[CorpusFile]:
    sources = sources or DEFAULT_SOURCES
    out = []
    for cat, pats in sources.items():
        for pat in pats:
            if os.path.isdir(pat):
                pat = os.path.join(pat, "**", "*")
            root = pat.split("*")[0]
            for p in sorted(glob.glob(pat, recursive=True)):
                sub = p[len(root):]
                if not os.path.isfile(p) or p.endswith((".dat", ".u8", ".pyc")) or any(
                    s in sub for s in ("site-packages", "/test", "test/", "idle_test", "lib2to3/tests")
                ):
                    continue
                rel = f"{cat}/{os.path.relpath(p, root)}"
                if (split == "heldout") == is_heldout(rel):
                    out.append(CorpusFile(p, rel, cat))
    return out


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")
