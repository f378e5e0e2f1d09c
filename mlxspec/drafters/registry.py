"""`--draft auto`: the known published drafter for a target, from mlxspec/data/registry.json
(a small, versioned table: DeepSpec's DSpark repos, z-lab's DFlash repos and mlxspec's
shipped drafters, in order of preference per target).

The target is recognised by what it is, not what it is called (`identify`), in this order:
  1. a packaged GGUF by its bytes (size and sha256: `cache.packaged_repo`), whatever its name;
  2. a GGUF's `general.name`, or `general.basename` + `size_label` + `finetune`;
  3. a directory's config.json `_name_or_path` (HF checkpoints and `mlxspec convert` write it);
  4. the hub id, path or file name: without the owner/parent and without a quantization or
     format suffix ("mlx-community/Qwen3-8B-4bit" -> "qwen3-8b"); a packaged short name
     ("gemma3-270m") by its upstream repo id;
  5. the architecture and vocabulary (family, vocabulary size, hidden size, layers) of the
     targets mlxspec ships a drafter for (`SHAPES`).
A name counts only when the registry has an entry for it. The drafter found is loaded like
any --draft (hub ids through `mlxspec.hub`) and validated against the target before use
(hidden size, taps, vocabulary: `mlxspec.drafters.load`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mlxspec.cache import PACKAGED_MODELS, packaged_repo, verifier_name
from mlxspec.errors import MlxspecError

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


# The targets mlxspec ships drafters for, by shape: (family, vocabulary, hidden size, layers).
SHAPES = {
    ("llama", 49152, 576, 30): "SmolLM2-135M-Instruct",
    ("gemma3", 262144, 640, 18): "gemma-3-270m",
}
_FAMILY = {"gemma3_text": "gemma3"}


@dataclass(frozen=True)
class Identity:
    name: str  # as model_name() spells it: "smollm2-135m-instruct"
    basis: str  # how it was recognised, for `inspect` and the --draft auto line
    by_content: bool = True  # False: by shape only, which the file's own name overrides


def _known(name: str) -> bool:
    return any(e["target"].lower() == name for e in table()["entries"])


def _by_shape(family, vocab, hidden, layers, where: str) -> Identity | None:
    key = (_FAMILY.get(family, family), vocab, hidden, layers)
    if key not in SHAPES:
        return None
    return Identity(model_name(SHAPES[key]), f"{where}: architecture {key[0]}, vocabulary {vocab} tokens, hidden "
                                              f"{hidden}, {layers} layers (the shape of {SHAPES[key]})", False)


def _identify_gguf(p: Path) -> Identity | None:
    from mlxspec.gguf.file import read_gguf

    repo = packaged_repo(p)
    if repo:
        return Identity(model_name(repo), f"sha256 of the packaged {repo} GGUF")
    try:
        g = read_gguf(p)
    except MlxspecError:
        return None  # loading the target says what is wrong with the file
    md = g.metadata
    parts = [md.get(f"general.{k}") for k in ("basename", "size_label", "finetune")]
    for key, v in (("general.name", md.get("general.name")),
                   ("general.basename + size_label + finetune", "-".join(str(x) for x in parts if x)),
                   ("general.basename + size_label", "-".join(str(x) for x in parts[:2] if x))):
        if isinstance(v, str) and v and _known(model_name(v.replace(" ", "-"))):
            return Identity(model_name(v.replace(" ", "-")), f"GGUF {key} '{v}'")
    arch = g.architecture
    tokens = md.get("tokenizer.ggml.tokens")
    return _by_shape(arch, len(tokens) if tokens is not None else None, md.get(f"{arch}.embedding_length"),
                     md.get(f"{arch}.block_count"), "GGUF metadata")


def _identify_dir(p: Path) -> Identity | None:
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    v = cfg.get("_name_or_path")
    if isinstance(v, str) and v and _known(model_name(v)):
        return Identity(model_name(v), f"config.json _name_or_path '{v}'")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return _by_shape(cfg.get("model_type"), text.get("vocab_size"), text.get("hidden_size"),
                     text.get("num_hidden_layers"), "config.json")


def identify(target: str) -> Identity:
    """What model `target` (a path, hub id or packaged short name) is; see the module docstring."""
    p = Path(str(target))
    found = _identify_gguf(p) if p.is_file() else _identify_dir(p) if p.is_dir() else None
    named = model_name(target)
    if found is not None and (found.by_content or not _known(named)):
        return found
    return Identity(named, f"its name '{named}'")


def candidates(target: str, ident: Identity | None = None) -> list[dict]:
    """Every registry entry for `target` (hub id, path or packaged name), most preferred
    first, each with 'path' set to what --draft takes."""
    name = (ident or identify(target)).name
    out = []
    for e in table()["entries"]:
        if e["target"].lower() == name:
            e = dict(e)
            d = e["drafter"]
            e["path"] = str(Path(__file__).parent.parent / "weights" / d.split(":", 1)[1]) \
                if d.startswith("shipped:") else d
            out.append(e)
    return out


def lookup(target: str, ident: Identity | None = None) -> dict | None:
    """The drafter --draft auto uses for `target`: its most preferred registry entry, or None."""
    found = candidates(target, ident)
    return found[0] if found else None


def describe(target: str, *, alternatives: bool = False, ngram: bool = True, ident: Identity | None = None) -> str:
    ident = ident or identify(target)
    found = candidates(target, ident)
    v = table()["version"]
    if not found:
        then = ("prompt lookup (ngram, model-free) under the adaptive verify policy" if ngram
                else "autoregressive (--no-ngram)")
        return (f"no known drafter for '{ident.name}' (registry v{v}); {then}; "
                "--draft PATH for a block drafter, --draft none for plain decoding")
    e = found[0]
    text = f"{e['drafter']} ({e['lineage']}, {e['source']}; registry v{v})"
    if alternatives and len(found) > 1:
        text += "; also published: " + ", ".join(f"{x['drafter']} ({x['lineage']})" for x in found[1:])
    return text + f"; the target is {e['target']}, recognised by {ident.basis}"
