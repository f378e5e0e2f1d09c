"""`--draft auto`: the known published drafter for a target, from mlxspec/data/registry.json
(a small, versioned table: DeepSpec's DSpark repos, z-lab's DFlash repos and mlxspec's
shipped drafters, in order of preference per target).

The target is matched on its model name: a hub id or path without the owner/parent and
without a quantization or format suffix ("mlx-community/Qwen3-8B-4bit" -> "qwen3-8b"); a
packaged short name ("gemma3-270m") by its upstream repo id. The drafter found is loaded
like any --draft (hub ids through `mlxspec.hub`) and validated against the target before
use (hidden size, taps, vocabulary: `drafters.load`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mlxspec.cache import PACKAGED_MODELS, verifier_name

REGISTRY = Path(__file__).parent.parent / "data" / "registry.json"
_SUFFIX = re.compile(r"([-_.](\d+bit|bf16|fp16|f16|f32|fp8|mxfp4|nvfp4|dwq|mlx|awq|gptq|q\d(_k)?(_[msl])?|gguf))+$",
                     re.IGNORECASE)


def table() -> dict:
    return json.loads(REGISTRY.read_text())


def model_name(target: str) -> str:
    """'mlx-community/Qwen3-8B-4bit' -> 'qwen3-8b'; a local snapshot path keeps its repo name."""
    s = str(target).rstrip("/")
    if s in PACKAGED_MODELS:  # "gemma3-270m" -> "google/gemma-3-270m"
        s = verifier_name(PACKAGED_MODELS[s].filename)
    m = re.search(r"models--[^/]+--([^/]+)/snapshots/", s)  # a resolved hub snapshot directory
    name = m.group(1) if m else s.split("@", 1)[0].rsplit("/", 1)[-1]
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    prev = None
    while prev != name:
        prev, name = name, _SUFFIX.sub("", name)
    return name.lower()


def candidates(target: str) -> list[dict]:
    """Every registry entry for `target` (hub id, path or packaged name), most preferred
    first, each with 'path' set to what --draft takes."""
    name = model_name(target)
    out = []
    for e in table()["entries"]:
        if e["target"].lower() == name:
            e = dict(e)
            d = e["drafter"]
            e["path"] = str(Path(__file__).parent.parent / "weights" / d.split(":", 1)[1]) \
                if d.startswith("shipped:") else d
            out.append(e)
    return out


def lookup(target: str) -> dict | None:
    """The drafter --draft auto uses for `target`: its most preferred registry entry, or None."""
    found = candidates(target)
    return found[0] if found else None


def describe(target: str, *, alternatives: bool = False, ngram: bool = True) -> str:
    found = candidates(target)
    v = table()["version"]
    if not found:
        then = ("prompt lookup (ngram, model-free) under the adaptive verify policy" if ngram
                else "autoregressive (--no-ngram)")
        return (f"no known drafter for '{model_name(target)}' (registry v{v}); {then}; "
                "--draft PATH for a block drafter, --draft none for plain decoding")
    e = found[0]
    text = f"{e['drafter']} ({e['lineage']}, {e['source']}; registry v{v})"
    if alternatives and len(found) > 1:
        text += "; also published: " + ", ".join(f"{x['drafter']} ({x['lineage']})" for x in found[1:])
    return text
