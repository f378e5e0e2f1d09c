"""What every drafter format reader and writer shares: the reader's result (`RawDrafter`),
strict boolean parsing, strict tensor claiming against the spec, dtype normalisation, and
the writers' view of a model's parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxspec.drafters.config import DrafterSpec
from mlxspec.drafters.build import make_model
from mlxspec.drafters.model import DFlashModel
from mlxspec.errors import MlxspecError

# Tensors a file may omit: a bias-free confidence head is a zero bias (llama.cpp marks
# conf_proj.bias optional; bias-free DeepSpec ports exist).
OPTIONAL_ZERO = ("confidence_head.proj.bias",)


@dataclass
class RawDrafter:
    """What a format reader hands back: no layout yet (the loader resolves it)."""

    spec: DrafterSpec
    weights: dict  # DFlashModel parameter name -> mx.array
    fmt: str
    layout_key: str  # where this format keeps sample_from_anchor
    layout_value: bool | None  # its value in the file; None when absent
    path: str = ""


_TRUE = ("true", "yes", "1", "on", "t", "y")
_FALSE = ("false", "no", "0", "off", "f", "n")


def parse_flag(value, key: str, path: str) -> bool:
    """A boolean config/metadata value in any spelling people write: true/false, 1/0 (int or
    string), "yes"/"no", "on"/"off", "t"/"f", "y"/"n" (any case). Anything else is refused:
    read as false it would silently flip a layout (PR #122's failure)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(int(value))
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise MlxspecError(f"{path}: {key} = {value!r} is not a boolean; write true or false")


# ----------------------------------------------------------------------------- tensors

def feature_of(model_name: str) -> str:
    """Human name of the feature a DFlashModel parameter belongs to."""
    if model_name.startswith(("markov_head.gate_proj", "markov_head.joint_proj")):
        return "gated/rnn Markov head"
    if model_name.startswith("markov_head."):
        return "Markov head"
    if model_name.startswith("confidence_head."):
        return "confidence head"
    if model_name.startswith("log_snr_fc"):
        return "log-SNR conditioning"
    if model_name.startswith("embed_tokens."):
        return "drafter's own embeddings"
    if model_name.startswith("lm_head."):
        return "drafter's own LM head"
    if model_name in ("d2t", "t2d"):
        return "reduced draft vocabulary"
    if model_name.startswith("candidate_selector."):
        return "DFlash 2 path selector"
    if re.fullmatch(r"layers\.\d+\.(attention|mlp)_conv\..*", model_name):
        return "DFlash 2 convolutions"
    if re.fullmatch(r"layers\.\d+\.self_attn\.[qkvo]_proj\.bias", model_name):
        return "attention biases (unsupported)"
    if re.fullmatch(r"layers\.\d+\..*", model_name) or model_name.split(".")[0] in ("fc", "hidden_norm", "norm"):
        return "backbone"
    return guess_feature(model_name)


def guess_feature(file_name: str) -> str:
    """Feature of a tensor name no format map knows."""
    n = file_name.lower()
    if "selector" in n or "codebook" in n:
        return "DFlash 2 path selector"
    if "conv" in n:
        return "DFlash 2 convolutions"
    if "hc_" in n or "exps" in n or "shexp" in n or "attn_sinks" in n:
        return "DeepSeek-V4 backbone (unsupported)"
    if "log_snr" in n:
        return "log-SNR conditioning"
    if "markov" in n:
        return "Markov head"
    if "conf" in n:
        return "confidence head"
    return "not part of a DFlash/DSpark drafter"


def expected_shapes(cfg: DrafterSpec) -> dict:
    """DFlashModel parameter name -> shape for this config (lazy: nothing is allocated)."""
    return {k: tuple(v.shape) for k, v in tree_flatten(make_model(cfg).parameters())}


def _name_order(name: str):
    """Natural order, weight before bias (files list tensors in no reliable order)."""
    base, _, suffix = name.rpartition(".")
    parts = [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", base or suffix)]
    return parts, {"weight": 0, "bias": 1}.get(suffix, 2), suffix


def _group(names: Iterable[str], feature: Callable[[str], str], notes: dict) -> str:
    groups: dict[str, list] = {}
    for n in sorted(names, key=_name_order):
        groups.setdefault(feature(n), []).append(n)
    parts = []
    for feat, ns in groups.items():
        note = notes.get(feat)
        parts.append(f"{', '.join(ns)}: {feat}" + (f" ({note})" if note else ""))
    return "; ".join(parts)


def _fmt_shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


def claim_tensors(
    path: str,
    cfg: DrafterSpec,
    found: dict,
    to_model: Callable[[str], str | None],
    to_file: Callable[[str], str],
    notes: dict | None = None,
    extra_claimed: dict | None = None,
) -> dict:
    """Strict claiming: every file tensor is claimed, every required one is present, shapes match.

    found: file tensor name -> shape (numpy order), in file order. to_model / to_file: the
    format's name map in both directions. notes: feature -> what the metadata says about
    it (quoted in errors). extra_claimed: file name -> expected shape, for tensors a format
    claims outside DFlashModel (e.g. speculators' t2d, GGUF's fc.scale).
    Returns file name -> model name for the tensors to load.
    """
    notes = notes or {}
    extra_claimed = extra_claimed or {}
    want = expected_shapes(cfg)
    file_of = {m: to_file(m) for m in want}
    model_of = {f: m for m, f in file_of.items()}
    unclaimed, shape_errs = [], []
    for fname, shape in found.items():
        if fname in extra_claimed:
            exp = extra_claimed[fname]
            if exp is not None and tuple(shape) != tuple(exp):
                shape_errs.append((fname, shape, exp))
            continue
        if fname not in model_of:
            unclaimed.append(fname)
            continue
        exp = want[model_of[fname]]
        if tuple(shape) != exp:
            shape_errs.append((fname, shape, exp))
    missing = [f for m, f in file_of.items() if f not in found and m not in OPTIONAL_ZERO]

    def feat_file(fname: str) -> str:
        m = to_model(fname)
        return feature_of(m) if m is not None else guess_feature(fname)

    msgs = []
    if unclaimed:
        msgs.append(
            f"{len(unclaimed)} tensor{'s' if len(unclaimed) > 1 else ''} not claimed by the drafter its "
            f"metadata describes: {_group(unclaimed, feat_file, notes)}"
        )
    if missing:
        msgs.append(f"missing tensor{'s' if len(missing) > 1 else ''}: {_group(missing, feat_file, notes)}")
    if msgs:
        raise MlxspecError(
            f"{path}: " + "; and ".join(msgs) + "; the file's tensors and metadata disagree: re-export the "
            "drafter or fix its metadata"
        )
    if shape_errs:
        shape_errs.sort(key=lambda e: _name_order(e[0]))
        listed = [f"{f} has shape {_fmt_shape(s)}, expected {_fmt_shape(x)}" for f, s, x in shape_errs[:8]]
        if len(shape_errs) > 8:
            listed.append(f"and {len(shape_errs) - 8} more")
        raise MlxspecError(
            f"{path}: tensor shape mismatch: " + "; ".join(listed)
            + "; the file does not match its own metadata: re-export the drafter"
        )
    return {f: m for f, m in model_of.items() if f in found}


def to_mx(model_name: str, a) -> mx.array:
    """Tensor as loaded -> the dtype DFlashModel keeps (heads in float32, d2t int32)."""
    if isinstance(a, np.ndarray):
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        a = mx.array(a)
    if model_name == "d2t":
        return a.astype(mx.int32)
    if model_name.startswith(("markov_head.", "confidence_head.")):
        return a.astype(mx.float32)
    if not mx.issubdtype(a.dtype, mx.floating):
        raise MlxspecError(f"tensor {model_name} has integer type {a.dtype}; expected a float tensor")
    return a


def model_tensors(model: DFlashModel) -> dict:
    """DFlashModel parameter name -> mx.array, in module order (for writers)."""
    return dict(tree_flatten(model.parameters()))
