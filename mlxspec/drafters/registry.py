"""`--draft auto`: the known published drafter for a target, from mlxspec/data/registry.json
(a small, versioned table: z-lab's DFlash repos and mlxspec's shipped drafters).

The target is matched on its model name: a hub id or path without the owner/parent and
without a quantization or format suffix ("mlx-community/Qwen3-8B-4bit" -> "qwen3-8b").
The drafter found is loaded like any --draft (hub ids through `loading.hub`) and validated
against the target before use (hidden size, taps, vocabulary: `loading.drafter`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REGISTRY = Path(__file__).parent.parent / "data" / "registry.json"
_SUFFIX = re.compile(r"([-_.](\d+bit|bf16|fp16|f16|f32|fp8|mxfp4|nvfp4|dwq|mlx|awq|gptq|q\d(_k)?(_[msl])?|gguf))+$",
                     re.IGNORECASE)


def table() -> dict:
    return json.loads(REGISTRY.read_text())


def model_name(target: str) -> str:
    """'mlx-community/Qwen3-8B-4bit' -> 'qwen3-8b'; a local snapshot path keeps its repo name."""
    s = str(target).rstrip("/")
    m = re.search(r"models--[^/]+--([^/]+)/snapshots/", s)  # a resolved hub snapshot directory
    name = m.group(1) if m else s.split("@", 1)[0].rsplit("/", 1)[-1]
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    prev = None
    while prev != name:
        prev, name = name, _SUFFIX.sub("", name)
    return name.lower()


def lookup(target: str) -> dict | None:
    """The registry entry for `target` (hub id or path), with 'path' set to what --draft takes."""
    name = model_name(target)
    for e in table()["entries"]:
        if e["target"].lower() == name:
            e = dict(e)
            d = e["drafter"]
            if d.startswith("shipped:"):
                e["path"] = str(Path(__file__).parent.parent / "weights" / d.split(":", 1)[1])
            else:
                e["path"] = d
            return e
    return None


def describe(target: str) -> str:
    e = lookup(target)
    v = table()["version"]
    if e is None:
        return f"no known drafter for '{model_name(target)}' (registry v{v}); --draft auto runs autoregressive"
    return f"{e['drafter']} ({e['lineage']}, {e['source']}; registry v{v})"
