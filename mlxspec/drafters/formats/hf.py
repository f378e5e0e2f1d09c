"""Hugging Face drafter directories (config.json + *.safetensors): what the zlab, deepspec
and speculators formats share. Each format's own keys live in its module.

All three store the tensors under DFlashModel's own names (z-lab / DeepSpec names, no
`model.` prefix), so `hf_name` is the whole name map. Missing Qwen3 dimensions take
transformers' Qwen3Config defaults (speculators serialises only the keys that differ
from them). Rope: top-level `rope_theta` or transformers-v5 `rope_parameters`.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Callable

import mlx.core as mx
import numpy as np

from mlxspec import validate as V
from mlxspec.cache import verifier_name
from mlxspec.drafters.common import (
    RawDrafter,
    claim_tensors,
    model_tensors,
    parse_flag,
    to_mx,
)
from mlxspec.drafters.config import DrafterConfig, DrafterSpec
from mlxspec.drafters.features import FeatureRules, infer_features
from mlxspec.errors import MlxspecError

FIX = "fix the drafter's config.json or download the drafter again"

# transformers Qwen3Config defaults (what a config without these keys means)
QWEN3_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def hf_name(model_name: str) -> str:
    """DFlashModel name -> tensor name in z-lab / DeepSpec / speculators files (identical)."""
    return model_name


def sanitize(file_name: str) -> str:
    """Tensor name in the file -> DFlashModel name (drops a `model.` wrapper if present)."""
    return file_name[len("model."):] if file_name.startswith("model.") else file_name




def read_tensors(path: str) -> dict:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (only PyTorch .bin found: convert it to safetensors)" if bins else ""
        raise MlxspecError(f"{path}: no *.safetensors weights{hint}")
    out: dict = {}
    for fp in files:
        V.check_safetensors(fp)  # header, offsets, sizes: mx.load trusts them
        try:
            loaded = mx.load(fp)
        except (RuntimeError, ValueError, OSError) as e:
            raise MlxspecError(f"{fp}: cannot read the safetensors file ({str(e).splitlines()[0][:100]}); "
                               "download the drafter again") from None
        for name, arr in loaded.items():
            key = sanitize(name)
            if key in out:
                raise MlxspecError(f"{fp}: tensor {name} appears twice in the directory; remove the stale shard")
            out[key] = arr
    return out


def rope_theta(c: dict, path: str, default: float | None) -> float:
    """Top-level `rope_theta` or transformers-v5 `rope_parameters` (flat or per layer type)."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        rp = rp.get("full_attention") or next(iter(rp.values()))
    rope_type = None
    if isinstance(rp, dict):
        rope_type = rp.get("rope_type") or rp.get("type")
    scaling = c.get("rope_scaling")
    if isinstance(scaling, dict):
        rope_type = rope_type or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise MlxspecError(
            f"{path}: rope type {rope_type!r} is not supported for drafters (only default RoPE); "
            "use a drafter trained with plain RoPE"
        )
    if "rope_theta" in c:
        return V.get_float(c, "rope_theta", path, 0, 1e12, lo_open=True, fix=FIX)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return V.get_float(rp, "rope_theta", path, 0, 1e12, lo_open=True, fix=FIX)
    if default is None:
        raise MlxspecError(f"{path}: config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(default)


def need(c: dict, key: str, where: str, path: str):
    if key not in c or c[key] is None:
        raise MlxspecError(f"{path}: config.json has no {where}{key}; the drafter config is incomplete")
    return c[key]


def backbone(c: dict, path: str, dflash2: bool = False) -> dict:
    """Qwen3 dimensions from a (possibly diff-serialised) config dict. dflash2: sliding layers
    and causal blocks are allowed (the DFlash 2 reader reads them)."""
    if not isinstance(c, dict):
        raise MlxspecError(f"{path}: transformer_layer_config is {type(c).__name__}, expected an object; {FIX}")
    layer_types = c.get("layer_types") or []
    if "sliding_attention" in layer_types and not dflash2:
        raise MlxspecError(
            f"{path}: sliding-window draft attention (layer_types {sorted(set(layer_types))}) is not "
            "supported; use a drafter with full attention"
        )
    if c.get("is_causal") and not dflash2:
        raise MlxspecError(f"{path}: causal block attention (is_causal: true) is not supported; DFlash blocks are non-causal")
    merged = {**{k: v for k, v in QWEN3_DEFAULTS.items() if v is not None}, **{k: v for k, v in c.items() if v is not None}}

    def g(k, hi=V.MAX_DIM):
        return V.get_int(merged, k, path, 1, hi, integral_float=True, fix=FIX)

    hidden, heads = g("hidden_size"), g("num_attention_heads")
    return dict(
        hidden_size=hidden,
        intermediate_size=g("intermediate_size"),
        num_hidden_layers=g("num_hidden_layers", V.MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=V.get_int(merged, "num_key_value_heads", path, 1, V.MAX_DIM, default=heads,
                                      integral_float=True, fix=FIX),
        head_dim=V.get_int(merged, "head_dim", path, 1, V.MAX_DIM, default=max(hidden // heads, 1),
                           integral_float=True, fix=FIX),
        rms_norm_eps=V.get_float(merged, "rms_norm_eps", path, 0, 1, lo_open=True, fix=FIX),
        vocab_size=g("vocab_size", V.MAX_VOCAB),
    )

# ----------------------------------------------------------------------------- reading

def taps_mask_block(taps, mask, block, path: str) -> dict:
    """Spec fields from the raw taps ("output of layer k" ids), mask id and block size."""
    return dict(
        target_layer_ids=V.as_int_list(taps, "target_layer_ids", path, -1, V.MAX_LAYERS, unique=True, min_len=1,
                                       integral_float=True, fix=FIX),
        mask_token_id=V.as_int(mask, "mask_token_id", path, 0, V.MAX_VOCAB, integral_float=True, fix=FIX),
        block_size=V.as_int(block, "block_size", path, 1, V.MAX_BLOCK, integral_float=True, fix=FIX),
    )


def load_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise MlxspecError(f"{path}: no config.json; pass a drafter directory (z-lab, DeepSpec or speculators)")
    return V.read_json_object(cfg_path, "drafter config.json")


def architectures(config: dict) -> list[str]:
    return [str(a) for a in (config.get("architectures") or [])]


def not_a_drafter(config: dict, path: str) -> MlxspecError:
    archs = architectures(config)
    return MlxspecError(
        f"{path}: config.json is not a DFlash/DSpark drafter (architectures {archs or 'missing'}, no "
        "dflash_config or speculators_model_type)"
    )


def hf_rules(fmt: str, from_tensors: bool, reduced_vocab: bool) -> FeatureRules:
    """config.json spells the features alike in every HF format; absent keys mean "off"
    for z-lab / DeepSpec and "as the tensors say" for speculators, whose class defaults
    changed between releases."""
    absent = ({"Markov head": "inferred from markov_head.markov_w1", "confidence head": "inferred from the tensors"}
              if from_tensors else
              {"Markov head": "config has no markov_rank", "confidence head": "config has no enable_confidence_head"})
    return FeatureRules(
        confidence_keys=("enable_confidence_head",), from_tensors=from_tensors, note_prefix="config ",
        absent={**absent, "log-SNR conditioning": "config log_snr_conditioning=false or absent"},
        no_reduced_vocab=None if reduced_vocab else f"the {fmt} format has no reduced vocabulary",
        int_opts={"integral_float": True, "fix": FIX},
    )


def read_dir(path: str, config: dict, fmt: str, header: Callable, rules: FeatureRules,
             extra_claimed: Callable | None = None, header_shapes: bool = False) -> RawDrafter:
    """The shared HF reader. header(config, path) -> (spec fields: dims, rope, block, taps,
    mask; layout key; its value or None; extra), called as header(config, path, shapes) with
    header_shapes; extra_claimed(fields, shapes) -> tensors the format claims outside DFlashModel."""
    tensors = read_tensors(path)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    fields, layout_key, layout_value, extra = header(config, path, shapes) if header_shapes else header(config, path)
    features, notes = infer_features(lambda k: (k, config[k]) if k in config else None, shapes,
                                     fields["hidden_size"], rules, path)
    min_snr = V.get_float(config, "min_log_snr", path, default=-9.0, fix=FIX)
    max_snr = V.get_float(config, "max_log_snr", path, default=9.0, fix=FIX)
    if features["log_snr"] and not max_snr > min_snr:
        raise MlxspecError(f"{path}: max_log_snr {max_snr} must be greater than min_log_snr {min_snr}")
    extra["draft_vocab_size_config"] = config.get("draft_vocab_size")
    spec = DrafterSpec(**fields, **features, min_log_snr=min_snr, max_log_snr=max_snr, source_format=fmt,
                       extra=extra)
    if layout_value is not None:
        layout_value = parse_flag(layout_value, layout_key, path)
    claimed = claim_tensors(path, spec, shapes, to_model=lambda f: f, to_file=hf_name, notes=notes,
                            extra_claimed=extra_claimed(fields, shapes) if extra_claimed else None)
    weights = {m: to_mx(m, tensors[f]) for f, m in claimed.items()}
    return RawDrafter(spec, weights, fmt, layout_key, layout_value, path=path)



# ----------------------------------------------------------------------------- writing

def no_options(options: dict, fmt: str) -> None:
    if options:
        raise MlxspecError(f"save_drafter: options {sorted(options)} do not apply to format {fmt}")


def refuse(path: str, fmt: str, what: str, use: str) -> None:
    raise MlxspecError(f"{path}: the {fmt} format cannot hold {what}; write it as {use}")


def refuse_log_snr(cfg: DrafterConfig, path: str, fmt: str) -> None:
    if cfg.log_snr:
        refuse(path, fmt, "log-SNR conditioning (no public loader of it reads those tensors)", "gguf")


def dflash2_markers(shapes) -> list[str]:
    """The tensors only a DFlash 2 drafter has: path selector and dynamic convolutions."""
    return [n for n in shapes
            if n.startswith("candidate_selector.") or re.fullmatch(r"layers\.\d+\.(attention|mlp)_conv\..+", n)]


def refuse_dflash2_markers(path: str, shapes, declared: bool, described: str) -> None:
    """A file with DFlash 2's tensors whose config describes another drafter is refused with
    each such tensor named: read as that drafter it would draft without them, silently."""
    markers = dflash2_markers(shapes)
    if markers and not declared:
        from mlxspec.drafters.common import _group, feature_of

        raise MlxspecError(
            f"{path}: {len(markers)} tensors are DFlash 2's, not claimed by the drafter its config.json describes "
            f"({described}): {_group(markers, feature_of, {})}; read as DFlash it would draft without them: use "
            "the drafter's DFlash 2 config.json"
        )


def backbone_config(cfg: DrafterConfig) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }


# target model_type -> its HF class, for speculators' `verifier.architectures`
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "mistral": "MistralForCausalLM"}
DEFAULT_MAX_POSITIONS = 32768  # as for GGUF targets without context_length


def target_facts(cfg: DrafterConfig, target, path: str, fmt: str) -> dict:
    """What the HF writers record about the target: num_target_layers, max_position_embeddings,
    verifier (speculators). From `target` (a Target or TargetInfo), else from what the drafter
    was read with (cfg.extra); refused when a peer's loader needs it and nothing says it."""
    info = getattr(target, "info", target)
    tcfg = getattr(target, "config", None) or {}
    n_layers = info.num_layers if info is not None else cfg.extra.get("num_target_layers")
    mpe = tcfg.get("max_position_embeddings") or cfg.extra.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS
    if info is not None:
        arch = tcfg.get("architectures") or [HF_ARCHITECTURES.get(info.model_type, info.model_type)]
        verifier = {"name_or_path": verifier_name(info.source) if info.source else info.model_type,
                    "architectures": list(arch)}
    else:
        verifier = cfg.extra.get("verifier")
    if n_layers is None and fmt == "zlab":
        raise MlxspecError(f"{path}: the zlab format needs num_target_layers; pass target= to save_drafter")
    if verifier is None and fmt == "speculators":
        raise MlxspecError(f"{path}: the speculators format needs speculators_config.verifier; "
                           "pass target= to save_drafter")
    return {"num_target_layers": None if n_layers is None else int(n_layers),
            "max_position_embeddings": int(mpe), "verifier": verifier}


def weights_dtype(model) -> str:
    dt = model.fc.weight.dtype
    return {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dt, "float32")


def write_dir(model, cfg: DrafterConfig, path: str, config: dict, tensors: dict | None = None) -> None:
    """config.json + model.safetensors (after `tensors`, the model's own; d2t with its t2d)."""
    tensors = dict(tensors or {})
    for name, arr in model_tensors(model).items():
        if name == "d2t":
            tensors.update(vocab_maps(arr, cfg.vocab_size))
        else:
            tensors[hf_name(name)] = arr
    save_dir(path, config, tensors)


def vocab_maps(d2t, vocab_size: int) -> dict:
    """A reduced vocabulary as written: d2t (int64 offsets) and t2d (bool, the kept target ids)."""
    d2t = np.asarray(d2t).astype(np.int64)
    t2d = np.zeros(vocab_size, dtype=np.bool_)
    t2d[np.arange(d2t.shape[0]) + d2t] = True
    return {"d2t": mx.array(d2t), "t2d": mx.array(t2d)}


def save_dir(path: str, config: dict, tensors: dict) -> None:
    """config.json + model.safetensors."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "pt"})
