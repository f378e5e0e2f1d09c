"""Drafter files -> (DFlashModel, DrafterConfig): format dispatch, lineage and block
layout, strict tensor claiming, validation against the target, and the init log line.

Formats (one reader/writer and one name map each):
- `zlab`, `deepspec`, `speculators`: Hugging Face directories (`drafter_hf.py`);
- `gguf` (`general.architecture = dflash`) and `gguf-dspark-legacy` (`dspark`), in
  `drafter_gguf.py`.
Readers return a `RawDrafter`: the normalised config (everything but the layout), the
tensors under DFlashModel's names, and what the file says about `sample_from_anchor`.
This module then decides the lineage (DSpark iff a Markov head is present) and the
layout (`resolve_layout`), honours or overrides the requested type, validates against
the target and prints exactly one init line.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxspec.errors import MlxspecError
from mlxspec.drafters.model import DFlashModel, DrafterConfig
from mlxspec.targets.model import TargetInfo

REQUESTED = ("auto", "draft-dflash", "draft-dspark")
FORMATS = ("zlab", "deepspec", "speculators", "gguf", "gguf-dspark-legacy")

# Tensors a file may omit: a bias-free confidence head is a zero bias (llama.cpp marks
# conf_proj.bias optional; bias-free DeepSpec ports exist).
OPTIONAL_ZERO = ("confidence_head.proj.bias",)


@dataclass
class RawDrafter:
    """What a format reader hands back (layout still undecided)."""

    cfg: DrafterConfig
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


# ----------------------------------------------------------------------------- layout

def resolve_layout(fmt: str, lineage: str, file_value: bool | None, key: str = "sample_from_anchor"):
    """The block layout of a drafter file: (sample_from_anchor, layout_from, layout_reason).

    The only place that decides it. The file's own key wins whenever present; otherwise
    the convention of the file's FORMAT (never the type the user asked for):

    | format              | key absent means                                             |
    |---------------------|--------------------------------------------------------------|
    | zlab                | false: z-lab `dflash_config` drafters are bonus-anchor       |
    | deepspec            | true: DeepSpec `Qwen3DSparkModel` drafts anchor-first, also  |
    |                     | its plain-DFlash baselines saved with markov_rank 0          |
    | speculators dspark  | true: DSparkSpeculatorConfig's default (DeepSpec convention) |
    | speculators dflash  | false: DFlash default (bonus anchor)                         |
    | gguf (dflash arch)  | dspark lineage -> true, dflash lineage -> false (below)      |
    | gguf-dspark-legacy  | true: PrismML's legacy dspark drafter is anchor-first only   |

    GGUF `dflash.sample_from_anchor` absent. In the public code read: llama.cpp mainline
    `common/speculative.cpp` initialises `sample_from_anchor = true`, overrides it only
    when the key is present, and consults it only on the DSpark path
    (`is_dspark && sample_from_anchor`): its DFlash path is always bonus-anchor. PrismML
    prism-v7 `src/models/dflash.cpp` reads the key only in build_dspark_markov_head, the
    Markov-head graph, where absent means true. A third-party analysis of another build
    states "absent -> false". So in the builds whose code we read, absent means
    anchor-first for a file WITH a Markov head and bonus-anchor for one without: that is
    what we assume. Files we write always carry the key.
    """
    if file_value is not None:
        return bool(file_value), f"key:{key}", f"{key}={'true' if file_value else 'false'} in the file"
    if fmt == "zlab":
        return False, "convention:zlab", "no sample_from_anchor key; z-lab dflash_config drafters are bonus-anchor"
    if fmt == "deepspec":
        return True, "convention:deepspec", (
            "no sample_from_anchor key; DeepSpec Qwen3DSparkModel drafters are anchor-first "
            "(also its plain-DFlash baselines with markov_rank 0)"
        )
    if fmt == "speculators-dspark":
        return True, "convention:speculators-dspark", "no sample_from_anchor key; speculators dspark default is true"
    if fmt == "speculators-dflash":
        return False, "convention:speculators-dflash", "no sample_from_anchor key; speculators dflash default is false"
    if fmt == "gguf":
        if lineage == "dspark":
            return True, "convention:gguf-dspark", (
                "no dflash.sample_from_anchor; llama.cpp mainline and PrismML read an absent key "
                "as true on the DSpark (Markov head) path"
            )
        return False, "convention:gguf-dflash", (
            "no dflash.sample_from_anchor; llama.cpp's DFlash path (no Markov head) is always bonus-anchor"
        )
    if fmt == "gguf-dspark-legacy":
        return True, "convention:gguf-dspark-legacy", (
            "no dspark.sample_from_anchor; PrismML's legacy dspark drafter is anchor-first"
        )
    raise ValueError(f"unknown drafter format {fmt!r}")


def _layout_name(sample_from_anchor: bool) -> str:
    return "anchor-first" if sample_from_anchor else "bonus-anchor"


def mismatch_warning(path: str, cfg: DrafterConfig, requested: str) -> str | None:
    """The warning for a requested type that disagrees with the file's lineage, or None."""
    if requested == "auto" or requested == f"draft-{cfg.lineage}":
        return None
    sfa = "true" if cfg.sample_from_anchor else "false"
    if cfg.lineage == "dspark":
        what = f"a DSpark drafter (Markov head, rank {cfg.markov_rank})"
        drop = "the dflash path would drop the Markov head and confidence truncation"
    else:
        what = "a DFlash drafter (no Markov head)"
        drop = "the dspark path would look for a Markov head and confidence head the file does not have"
    # the requested type's own convention: dflash path bonus-anchor, dspark path anchor-first
    wrong_sfa = requested == "draft-dspark"
    if wrong_sfa != cfg.sample_from_anchor:
        late = "late" if cfg.sample_from_anchor else "early"
        drop += (
            f", and this file is {_layout_name(cfg.sample_from_anchor)} (sample_from_anchor={sfa}), so the "
            f"{requested} layout would draft one row {late} and acceptance collapses"
        )
    return (
        f"mlxspec: warning: requested {requested} but {path} is {what}; using draft-{cfg.lineage} with "
        f"sample_from_anchor={sfa} from the file: {drop}"
    )


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
    if re.fullmatch(r"layers\.\d+\.self_attn\.[qkvo]_proj\.bias", model_name):
        return "attention biases (unsupported)"
    if re.fullmatch(r"layers\.\d+\..*", model_name) or model_name.split(".")[0] in ("fc", "hidden_norm", "norm"):
        return "backbone"
    return guess_feature(model_name)


def guess_feature(file_name: str) -> str:
    """Feature of a tensor name no format map knows."""
    n = file_name.lower()
    if "selector" in n or "codebook" in n or "conv" in n:
        return "DFlash2 selector (unsupported)"
    if "hc_" in n or "exps" in n or "shexp" in n or "attn_sinks" in n:
        return "DeepSeek-V4 backbone (unsupported)"
    if "log_snr" in n:
        return "log-SNR conditioning"
    if "markov" in n:
        return "Markov head"
    if "conf" in n:
        return "confidence head"
    return "not part of a DFlash/DSpark drafter"


def expected_shapes(cfg: DrafterConfig) -> dict:
    """DFlashModel parameter name -> shape for this config (lazy: nothing is allocated)."""
    return {k: tuple(v.shape) for k, v in tree_flatten(DFlashModel(cfg).parameters())}


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
    cfg: DrafterConfig,
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


def build_model(raw: RawDrafter) -> DFlashModel:
    model = DFlashModel(raw.cfg)
    want = expected_shapes(raw.cfg)
    weights = dict(raw.weights)
    for name in OPTIONAL_ZERO:
        if name in want and name not in weights:
            weights[name] = mx.zeros(want[name], dtype=mx.float32)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


# ----------------------------------------------------------------------------- target checks

def validate_against_target(cfg: DrafterConfig, info: TargetInfo, path: str) -> None:
    """One clear line per incompatibility, raised as MlxspecError, before any generation."""
    tgt = info.source or "the target"
    if cfg.hidden_size != info.hidden_size:
        raise MlxspecError(
            f"{path}: drafter hidden size {cfg.hidden_size} (fc takes {len(cfg.target_layer_ids)} taps x "
            f"{cfg.hidden_size}) does not match {tgt} hidden size {info.hidden_size}; use the drafter trained "
            "for this target"
        )
    n = info.num_layers
    trained_for = cfg.extra.get("num_target_layers")
    if trained_for and int(trained_for) != n:
        raise MlxspecError(
            f"{path}: drafter was trained for a {int(trained_for)}-layer target (num_target_layers) but {tgt} has "
            f"{n} layers; use the drafter trained for this target"
        )
    for k in cfg.target_layer_ids:
        if k == -1:
            raise MlxspecError(
                f"{path}: tap -1 (the embedding output) is not supported by mlxspec's target taps; use a "
                "drafter whose taps are decoder layers"
            )
        if k < -1 or k >= n:
            raise MlxspecError(
                f"{path}: tap layer {k} is outside {tgt}, which has {n} layers (valid taps 0..{n - 2}); "
                "use the drafter trained for this target"
            )
        if k == n - 1:
            raise MlxspecError(
                f"{path}: tap layer {k} is the last layer of {tgt} ({n} layers); drafters tap intermediate "
                "layers, not the final one: the drafter was made for a deeper target (or its tap ids are "
                "off by one); use the drafter trained for this target"
            )
    if cfg.vocab_size != info.vocab_size:
        raise MlxspecError(
            f"{path}: drafter vocabulary {cfg.vocab_size} does not match {tgt} vocabulary {info.vocab_size}; "
            "use the drafter trained for this target's tokenizer"
        )
    if not 0 <= cfg.mask_token_id < info.vocab_size:
        raise MlxspecError(
            f"{path}: mask token id {cfg.mask_token_id} is outside {tgt} vocabulary (0..{info.vocab_size - 1}); "
            "the file's mask_token_id is wrong for this target"
        )


def check_drafter(raw: RawDrafter) -> None:
    """Ranges every format must satisfy, checked once after reading (the readers type-check
    each value where it enters): block size, distinct taps, positive rope base and eps,
    head counts, finite weights, reduced-vocabulary ids inside the vocabulary."""
    import math

    from mlxspec.validate import MAX_BLOCK, check_finite_weights

    cfg, path = raw.cfg, raw.path
    lo = 1 if cfg.sample_from_anchor else 2
    if not lo <= cfg.block_size <= MAX_BLOCK:
        raise MlxspecError(f"{path}: block_size {cfg.block_size} is outside [{lo}, {MAX_BLOCK}] for this layout; "
                           "the drafter config is corrupt")
    if len(set(cfg.target_layer_ids)) != len(cfg.target_layer_ids) or not cfg.target_layer_ids:
        raise MlxspecError(f"{path}: tap ids {list(cfg.target_layer_ids)} must be distinct and non-empty; "
                           "the drafter config is corrupt")
    for name in ("rope_theta", "rms_norm_eps"):
        v = getattr(cfg, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise MlxspecError(f"{path}: {name} {v!r} must be a finite number > 0; the drafter config is corrupt")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise MlxspecError(f"{path}: {cfg.num_attention_heads} attention heads are not a multiple of "
                           f"{cfg.num_key_value_heads} key/value heads; the drafter config is corrupt")
    check_finite_weights({k: v for k, v in raw.weights.items() if k != "d2t"}, path)
    d2t = raw.weights.get("d2t")
    if d2t is not None:
        ids = np.arange(d2t.shape[0]) + np.asarray(d2t).astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise MlxspecError(f"{path}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, outside "
                               f"the vocabulary [0, {cfg.vocab_size}); the drafter weights are corrupt")


# ----------------------------------------------------------------------------- entry points

def init_line(cfg: DrafterConfig, layout_from: str) -> str:
    markov = f"{cfg.markov_head_type}/r{cfg.markov_rank}" if cfg.markov_rank else "none"
    return (
        f"mlxspec: drafter lineage={cfg.lineage} sample_from_anchor={'true' if cfg.sample_from_anchor else 'false'} "
        f"block_size={cfg.block_size} taps={','.join(str(t) for t in cfg.target_layer_ids)} "
        f"mask={cfg.mask_token_id} markov={markov} confidence={'yes' if cfg.confidence_head else 'no'} "
        f"log_snr={'yes' if cfg.log_snr else 'no'} format={cfg.source_format} layout_from={layout_from}"
    )


def read_drafter(path, target_vocab: int | None = None) -> RawDrafter:
    """Dispatch on the path: a directory (HF formats) or a .gguf file. target_vocab: the
    target's vocabulary size, for GGUF drafters that name none (they borrow the target's)."""
    import os

    from mlxspec.drafters.formats import gguf as drafter_gguf, hf as drafter_hf

    path = os.fspath(path)
    if os.path.isdir(path):
        return drafter_hf.read_hf_drafter(path)
    if not os.path.exists(path):
        raise MlxspecError(f"{path}: no such file or directory; pass a drafter directory or .gguf file")
    from mlxspec.validate import require_regular_file

    require_regular_file(path, "drafter file")  # a FIFO would block forever
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return drafter_gguf.read_gguf_drafter(path, target_vocab)
    raise MlxspecError(f"{path}: not a drafter: expected a Hugging Face directory or a .gguf file")


def load_drafter(path, target_info: TargetInfo | None = None, requested: str = "auto", log=None):
    """Load a DFlash/DSpark drafter: (DFlashModel, DrafterConfig).

    The file decides lineage (DSpark iff a Markov head) and layout (`resolve_layout`);
    a disagreeing `requested` type only produces a warning. With `target_info` the
    drafter is validated against the target first. Prints one init line to `log`
    (stderr by default).
    """
    if requested not in REQUESTED:
        raise MlxspecError(f"unknown drafter type {requested!r}; use one of: {', '.join(REQUESTED)}")
    log = sys.stderr if log is None else log
    from mlxspec.hub import resolve  # a Hugging Face repo id -> its local snapshot, like mlx_lm

    path = resolve(str(path), "drafter")
    raw = read_drafter(path, None if target_info is None else target_info.vocab_size)
    cfg = raw.cfg
    layout_fmt = raw.fmt
    if raw.fmt == "speculators":
        layout_fmt = f"speculators-{cfg.extra.get('speculators_model_type', 'dspark')}"
    cfg.sample_from_anchor, layout_from, cfg.layout_reason = resolve_layout(
        layout_fmt, cfg.lineage, raw.layout_value, raw.layout_key
    )
    cfg.source_format = raw.fmt
    cfg.extra["layout_from"] = layout_from
    check_drafter(raw)
    if target_info is not None:
        validate_against_target(cfg, target_info, raw.path)
    model = build_model(raw)
    warning = mismatch_warning(raw.path, cfg, requested)
    if warning:
        print(warning, file=log)
    print(init_line(cfg, layout_from), file=log)
    return model, cfg


def save_drafter(model: DFlashModel, cfg: DrafterConfig, path, fmt: str, target=None, **options) -> None:
    """Write a drafter in one of FORMATS. Refuses (MlxspecError) what the format cannot
    express, e.g. a bonus-anchor drafter as deepspec or an anchor-first one as zlab.
    target: the `Target` (or its `TargetInfo`) the drafter serves. The HF formats record it
    as their peers' loaders need: zlab `num_target_layers` / `max_position_embeddings`,
    speculators `speculators_config.verifier` and, with a reduced vocabulary (d2t), an
    `lm_head.weight` of the target's head rows at the d2t ids (needs a `Target`).
    options: `doubled_prefix=True` for gguf-dspark-legacy (`dspark.dspark.*` keys)."""
    import os

    from mlxspec.drafters.formats import gguf as drafter_gguf, hf as drafter_hf

    path = os.fspath(path)
    if fmt in ("zlab", "deepspec", "speculators"):
        if options:
            raise MlxspecError(f"save_drafter: options {sorted(options)} do not apply to format {fmt}")
        drafter_hf.write_hf_drafter(model, cfg, path, fmt, target=target)
    elif fmt in ("gguf", "gguf-dspark-legacy"):
        drafter_gguf.write_gguf_drafter(model, cfg, path, fmt, **options)
    else:
        raise MlxspecError(f"unknown drafter format {fmt!r}; use one of: {', '.join(FORMATS)}")


def model_tensors(model: DFlashModel) -> dict:
    """DFlashModel parameter name -> mx.array, in module order (for writers)."""
    return dict(tree_flatten(model.parameters()))
