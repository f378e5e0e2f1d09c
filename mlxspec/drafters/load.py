"""Drafter files -> (DFlashModel, DrafterConfig): lineage and block layout, validation
against the target, and the init log line.

The format readers (`mlxspec.drafters.formats`) return a `RawDrafter`: a `DrafterSpec`
(everything but the layout), the tensors under DFlashModel's names, and what the file
says about `sample_from_anchor`. This module decides the layout (`resolve_layout`, the
only place that does) and builds the `DrafterConfig`; the lineage is DSpark iff a Markov
head is present, DFlash 2 iff a path selector (codebooks) and convs; a requested type
that disagrees only produces a warning.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, replace

import mlx.core as mx
import numpy as np

from mlxspec.drafters.common import OPTIONAL_ZERO, RawDrafter, expected_shapes
from mlxspec.drafters.config import DrafterConfig, Layout
from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model, default_taps
from mlxspec.drafters.formats import FORMATS, read_drafter
from mlxspec.drafters.formats.eagle3 import RawEagle3
from mlxspec.drafters.build import make_model
from mlxspec.drafters.model import DFlashModel
from mlxspec.errors import MlxspecError
from mlxspec.hub import resolve
from mlxspec.logger import say
from mlxspec.targets.model import TargetInfo
from mlxspec.validate import MAX_BLOCK, check_finite_weights, check_output_dir, check_output_file, writing

REQUESTED = ("auto", "draft-dflash", "draft-dspark", "draft-dflash2", "draft-eagle3")


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
    | speculators dflash  | false: DFlash default (bonus anchor); also dflash2           |
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
    if fmt in ("speculators-dflash", "speculators-dflash2"):
        return False, f"convention:{fmt}", f"no sample_from_anchor key; {fmt.replace('-', ' ')} default is false"
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
    return Layout(sample_from_anchor, 1).name


def mismatch_warning(path: str, cfg: DrafterConfig, requested: str) -> str | None:
    """The warning for a requested type that disagrees with the file's lineage, or None."""
    if requested == "auto" or requested == f"draft-{cfg.lineage}":
        return None
    sfa = "true" if cfg.sample_from_anchor else "false"
    if cfg.lineage == "dflash2":
        what = (f"a DFlash 2 drafter (path selector top-{cfg.selector_top_k}, rank {cfg.selector_rank}; "
                "dynamic convolutions)")
        drop = f"the {requested} path would drop the convolutions and the path selector"
    elif requested == "draft-dflash2":
        what = ("a DSpark drafter (Markov head, rank {})".format(cfg.markov_rank) if cfg.lineage == "dspark"
                else "a DFlash drafter (no Markov head)")
        drop = "the dflash2 path would look for convolutions and a path selector the file does not have"
    elif cfg.lineage == "dspark":
        what = f"a DSpark drafter (Markov head, rank {cfg.markov_rank})"
        drop = "the dflash path would drop the Markov head and confidence truncation"
    else:
        what = "a DFlash drafter (no Markov head)"
        drop = "the dspark path would look for a Markov head and confidence head the file does not have"
    # the requested type's own convention: dflash / dflash2 paths bonus-anchor, dspark path anchor-first
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


def build_model(raw: RawDrafter, cfg: DrafterConfig) -> DFlashModel:
    model = make_model(cfg)
    want = expected_shapes(cfg)
    weights = dict(raw.weights)
    for name in OPTIONAL_ZERO:
        if name in want and name not in weights:
            weights[name] = mx.zeros(want[name], dtype=mx.float32)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


# ----------------------------------------------------------------------------- checks

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


def check_drafter(raw: RawDrafter, cfg: DrafterConfig) -> None:
    """Ranges every format must satisfy, checked once after reading (the readers type-check
    each value where it enters): block size, distinct taps, positive rope base and eps,
    head counts, finite weights, reduced-vocabulary ids inside the vocabulary."""
    path = raw.path
    lo = cfg.layout.min_block
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
    check_heads(cfg, path)
    if cfg.lineage == "dflash2":
        check_dflash2(cfg, path)
    check_weights(raw.weights, cfg.vocab_size, path)


def check_heads(cfg, path: str) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise MlxspecError(f"{path}: {cfg.num_attention_heads} attention heads are not a multiple of "
                           f"{cfg.num_key_value_heads} key/value heads; the drafter config is corrupt")


def check_weights(weights: dict, vocab_size: int, path: str) -> None:
    """Every float tensor finite; a reduced vocabulary's d2t maps inside the target's vocabulary."""
    check_finite_weights({k: v for k, v in weights.items() if k != "d2t"}, path)
    d2t = weights.get("d2t")
    if d2t is not None:
        ids = np.arange(d2t.shape[0]) + np.asarray(d2t).astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise MlxspecError(f"{path}: d2t maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, outside "
                               f"the vocabulary [0, {vocab_size}); the drafter weights are corrupt")


def check_dflash2(cfg: DrafterConfig, path: str) -> None:
    """What a DFlash 2 drafter needs beyond the backbone (every format)."""
    def bad(what):
        raise MlxspecError(f"{path}: DFlash 2 {what}; the drafter config is corrupt")
    if cfg.markov_rank or cfg.confidence_head or cfg.log_snr or cfg.draft_vocab_size:
        bad("drafters carry no Markov head, confidence head, log-SNR or reduced vocabulary, but this one does")
    if cfg.sample_from_anchor:
        bad("drafters are bonus-anchor (sample_from_anchor=false)")
    if not 1 <= cfg.selector_top_k <= cfg.vocab_size:
        bad(f"selector_top_k {cfg.selector_top_k} must be in 1..{cfg.vocab_size} (the vocabulary)")
    if cfg.conv_kernel_size < 1 or cfg.conv_group_size < 1 or cfg.hidden_size % cfg.conv_group_size:
        bad(f"conv_kernel_size {cfg.conv_kernel_size} and conv_group_size {cfg.conv_group_size} must be positive, "
            f"the group size dividing hidden_size {cfg.hidden_size}")
    lt = cfg.layer_types or ()
    if lt and len(lt) != cfg.num_hidden_layers:
        bad(f"layer_types has {len(lt)} entries for {cfg.num_hidden_layers} layers")
    if "sliding_attention" in lt and not (cfg.sliding_window or 0) >= 1:
        bad(f"sliding_attention layers need a sliding_window >= 1, got {cfg.sliding_window!r}")
    if cfg.final_logit_softcapping is not None and not cfg.final_logit_softcapping > 0:
        bad(f"final_logit_softcapping {cfg.final_logit_softcapping} must be > 0")
    if not (math.isfinite(cfg.output_multiplier) and cfg.output_multiplier > 0):
        bad(f"output_multiplier {cfg.output_multiplier} must be a finite number > 0")


# ----------------------------------------------------------------------------- entry points

def init_line(cfg: DrafterConfig, layout_from: str) -> str:
    markov = f"{cfg.markov_head_type}/r{cfg.markov_rank}" if cfg.markov_rank else "none"
    if cfg.lineage == "dflash2":
        window = cfg.sliding_window if "sliding_attention" in (cfg.layer_types or ()) else "none"
        markov += (f" selector=top{cfg.selector_top_k}/r{cfg.selector_rank} "
                   f"conv={cfg.conv_kernel_size}x{cfg.conv_group_size} window={window}")
    return (
        f"mlxspec: drafter lineage={cfg.lineage} sample_from_anchor={'true' if cfg.sample_from_anchor else 'false'} "
        f"block_size={cfg.block_size} taps={','.join(str(t) for t in cfg.target_layer_ids)} "
        f"mask={cfg.mask_token_id} markov={markov} confidence={'yes' if cfg.confidence_head else 'no'} "
        f"log_snr={'yes' if cfg.log_snr else 'no'} format={cfg.source_format} layout_from={layout_from}"
    )


def load_drafter(path, target_info: TargetInfo | None = None, requested: str = "auto", log=None):
    """Load a DFlash/DSpark drafter: (DFlashModel, DrafterConfig).

    The file decides lineage (DSpark iff a Markov head) and layout (`resolve_layout`);
    a disagreeing `requested` type only produces a warning. With `target_info` the
    drafter is validated against the target first. Reports one init line (and the warning
    when `requested` disagrees) through `mlxspec.logger.say`: to `log` when given, else to
    the `mlxspec` logger.
    """
    if requested not in REQUESTED:
        raise MlxspecError(f"unknown drafter type {requested!r}; use one of: {', '.join(REQUESTED)}")
    path = resolve(str(path), "drafter")  # a Hugging Face repo id -> its local snapshot, like mlx_lm
    raw = read_drafter(path, None if target_info is None else target_info.vocab_size)
    if isinstance(raw, RawEagle3):
        return load_eagle3(raw, target_info, requested, log)
    spec = raw.spec
    layout_fmt = raw.fmt
    if raw.fmt == "speculators":
        layout_fmt = f"speculators-{spec.extra.get('speculators_model_type', 'dspark')}"
    sample_from_anchor, layout_from, reason = resolve_layout(layout_fmt, spec.lineage, raw.layout_value,
                                                             raw.layout_key)
    cfg = DrafterConfig(**{**asdict(spec), "source_format": raw.fmt, "extra": {**spec.extra, "layout_from": layout_from}},
                        sample_from_anchor=sample_from_anchor, layout_reason=reason)
    check_drafter(raw, cfg)
    if target_info is not None:
        validate_against_target(cfg, target_info, raw.path)
    model = build_model(raw, cfg)
    warning = mismatch_warning(raw.path, cfg, requested)
    if warning:
        say(warning, log, logging.WARNING)
    say(init_line(cfg, layout_from), log)
    return model, cfg


def save_drafter(model: DFlashModel, cfg: DrafterConfig, path, fmt: str, target=None, **options) -> None:
    """Write a drafter in one of FORMATS. Refuses (MlxspecError) what the format cannot
    express, e.g. a bonus-anchor drafter as deepspec or an anchor-first one as zlab.
    target: the `Target` (or its `TargetInfo`) the drafter serves. The HF formats record it
    as their peers' loaders need: zlab `num_target_layers` / `max_position_embeddings`,
    speculators `speculators_config.verifier` and, with a reduced vocabulary (d2t), an
    `lm_head.weight` of the target's head rows at the d2t ids (needs a `Target`).
    options: `doubled_prefix=True` for gguf-dspark-legacy (`dspark.dspark.*` keys)."""
    if fmt not in FORMATS:
        raise MlxspecError(f"unknown drafter format {fmt!r}; use one of: {', '.join(FORMATS)}")
    path = os.fspath(path)
    gguf_file = FORMATS[fmt].container == "gguf"
    (check_output_file if gguf_file else check_output_dir)("drafter output", path)
    with writing("drafter output", path):  # no space left, read-only, ...: one line
        os.makedirs((os.path.dirname(path) or ".") if gguf_file else path, exist_ok=True)
        FORMATS[fmt].write(model, cfg, path, target=target, **options)


# ----------------------------------------------------------------------------- EAGLE-3

def eagle3_taps(cfg: Eagle3Config, info: TargetInfo | None, path: str) -> tuple[Eagle3Config, str]:
    """Resolve and check the taps of an EAGLE-3 file against the target -> (config, where from).

    A file without tap ids gets the default computed from the TARGET's depth (never from the
    drafter's). Taps past the target, on its last layer, a fused width that is not
    n_taps x the target's hidden size, or a vocabulary that differs: one line each."""
    if info is None:
        if not cfg.target_layer_ids:
            raise MlxspecError(f"{path}: the EAGLE-3 file names no tap ids; its default taps depend on the target's "
                               "depth: load it with a target")
        return cfg, "file"
    tgt, n = info.source or "the target", info.num_layers
    taps, source = cfg.target_layer_ids, f"file ({cfg.tap_convention} ids)"
    if not taps:
        taps, source = tuple(default_taps(n)), f"default for a {n}-layer target (inputs of layers 2, N//2, N-3)"
        if len(set(taps)) < len(taps) or min(taps) < 0:  # below 7 layers they repeat (the target taps each once)
            raise MlxspecError(
                f"{path}: the file names no tap ids, and the default taps for a {n}-layer target (outputs of layers "
                f"{', '.join(map(str, taps))}) repeat or leave the target: the defaults need at least 7 layers; use a "
                "drafter whose config.json names its taps (eagle_aux_hidden_state_layer_ids)")
        cfg = replace(cfg, target_layer_ids=taps)
    if len(taps) != cfg.n_taps:
        raise MlxspecError(f"{path}: fc.weight fuses {cfg.n_taps} taps but {len(taps)} tap ids apply; {FIX_E3}")
    for k in taps:
        if k >= n - 1 or k < 0:
            shown = _file_id(cfg, k)
            raise MlxspecError(
                f"{path}: tap {shown} ({cfg.tap_convention} convention) is the output of layer {k}, but {tgt} has "
                f"{n} layers (taps 0..{n - 2}, the last layer excluded): the drafter was made for a deeper target; "
                "use the drafter trained for this target")
    if cfg.target_hidden_size != info.hidden_size:
        raise MlxspecError(f"{path}: drafter target_hidden_size {cfg.target_hidden_size} (fc takes {cfg.n_taps} x "
                           f"{cfg.target_hidden_size}) does not match {tgt} hidden size {info.hidden_size}; use the "
                           "drafter trained for this target")
    if cfg.vocab_size != info.vocab_size:
        raise MlxspecError(f"{path}: drafter vocabulary {cfg.vocab_size} does not match {tgt} vocabulary "
                           f"{info.vocab_size}; use the drafter trained for this target's tokenizer")
    return cfg, source


FIX_E3 = "fix the drafter's config.json or download the drafter again"


def _file_id(cfg: Eagle3Config, k: int) -> int:
    return k + 1 if cfg.tap_convention in ("speculators", "llama.cpp") else k  # layer-input ids


def eagle3_init_line(cfg: Eagle3Config, taps_from: str) -> str:
    ids = ",".join(str(t) for t in cfg.file_layer_ids) if cfg.file_layer_ids else "none"
    return (f"mlxspec: drafter lineage=eagle3 taps={','.join(str(t) for t in cfg.target_layer_ids)} (output of layer) "
            f"file_ids={ids} ({cfg.tap_convention}) taps_from={taps_from} layers={cfg.num_hidden_layers} "
            f"draft_vocab={cfg.draft_vocab_size}/{cfg.vocab_size} max_drafts={cfg.max_drafts} "
            f"norm_before_residual={'true' if cfg.norm_before_residual else 'false'} format={cfg.source_format}")


def load_eagle3(raw: RawEagle3, info: TargetInfo | None, requested: str = "auto", log=None):
    """-> (Eagle3Model, Eagle3Config): taps resolved against the target, strict weights."""
    cfg, taps_from = eagle3_taps(raw.cfg, info, raw.path)
    cfg = replace(cfg, extra={**cfg.extra, "taps_from": taps_from})
    check_weights(raw.weights, cfg.vocab_size, raw.path)
    check_heads(cfg, raw.path)
    model = Eagle3Model(cfg)
    model.load_weights(list(raw.weights.items()), strict=True)
    mx.eval(model.parameters())
    if requested not in ("auto", "draft-eagle3"):
        say(f"mlxspec: warning: requested {requested} but {raw.path} is an EAGLE-3 drafter (fc over "
            f"{cfg.n_taps} taps, {cfg.num_hidden_layers} chain layer(s)); using draft-eagle3 from the file: a block "
            "drafter's path would find no block layout in it", log, logging.WARNING)
    say(eagle3_init_line(cfg, taps_from), log)
    return model, cfg
