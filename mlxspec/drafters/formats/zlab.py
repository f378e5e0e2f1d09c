"""z-lab DFlash and DFlash 2 directories: `dflash_config` (or a DFlash architecture) in config.json.

Taps, mask and block size in `dflash_config` (older files: top level); the layout key, if
any, is `dflash_config.sample_from_anchor` (absent: bonus-anchor, see `resolve_layout`).
Bonus-anchor only: no DSpark heads, log-SNR or reduced vocabulary.

DFlash 2 (`DFlash2DraftModel`): `dflash_config` adds conv_kernel_size, conv_group_size,
selector_rank, selector_top_k, output_multiplier and final_logit_softcapping; top level
`layer_types`, `sliding_window`, `is_causal` (absent: z-lab's port makes sliding layers causal)
and transformers-5 `rope_parameters`. The lineage is read from the tensors: the selector
codebooks and convs are DFlash 2's, and a file carrying them under a DFlash config is refused
with every such tensor named (read as DFlash it would draft without them, silently).
"""

from __future__ import annotations

from mlxspec import validate as V
from mlxspec.drafters.common import RawDrafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.formats import hf
from mlxspec.errors import MlxspecError

RULES = hf.hf_rules("zlab", from_tensors=False, reduced_vocab=False)


def detect(config: dict, path: str) -> bool:
    return ("speculators_model_type" not in config
            and not any("dspark" in a.lower() for a in hf.architectures(config))
            and ("dflash_config" in config or any("dflash" in a.lower() for a in hf.architectures(config))))


DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def declares_dflash2(config: dict) -> bool:
    dc = config.get("dflash_config") or {}
    return (any("dflash2" in a.lower() for a in hf.architectures(config))
            or any(k in dc for k in DFLASH2_KEYS))


def dflash2_fields(config: dict, path: str) -> dict:
    dc = config.get("dflash_config") or {}
    opts = {"integral_float": True, "fix": hf.FIX}
    f = {k: V.get_int(dc, k, f"{path}: dflash_config", 1, V.MAX_VOCAB, **opts) for k in DFLASH2_KEYS}
    cap = dc.get("final_logit_softcapping", config.get("final_logit_softcapping"))
    f["final_logit_softcapping"] = None if cap is None or cap == 0 else V.as_float(
        cap, "dflash_config.final_logit_softcapping", path, 0, 1e6, lo_open=True, fix=hf.FIX)
    f["output_multiplier"] = V.get_float(dc, "output_multiplier", f"{path}: dflash_config", 0, 1e6, default=1.0,
                                         lo_open=True, fix=hf.FIX)
    scale = V.get_float(dc, "input_embedding_scale", f"{path}: dflash_config", default=1.0, fix=hf.FIX)
    if scale != 1.0:
        raise MlxspecError(f"{path}: dflash_config.input_embedding_scale {scale} is not supported (only 1.0)")
    lt = config.get("layer_types")
    if lt is not None:
        if not isinstance(lt, list) or any(t not in ("full_attention", "sliding_attention") for t in lt):
            raise MlxspecError(f"{path}: layer_types {lt!r} must list full_attention / sliding_attention; {hf.FIX}")
        f["layer_types"] = tuple(lt)
    if "sliding_attention" in (lt or ()):
        f["sliding_window"] = V.get_int(config, "sliding_window", path, 1, 1 << 30, integral_float=True, fix=hf.FIX)
    causal = config.get("is_causal")
    f["block_causal"] = None if causal is None else hf.parse_flag(causal, "is_causal", path)
    return f


def header(config: dict, path: str, shapes: dict | None = None):
    v2 = declares_dflash2(config)
    hf.refuse_dflash2_markers(path, shapes or {}, v2, f"architectures {hf.architectures(config)}, no "
                              "dflash_config.selector_top_k")
    dims = hf.backbone(config, path, dflash2=v2)
    theta = hf.rope_theta(config, path, hf.QWEN3_DEFAULTS["rope_theta"])
    dc = config.get("dflash_config") or {}
    taps = dc.get("target_layer_ids", config.get("target_layer_ids"))
    if taps is None:
        hf.need(dc, "target_layer_ids", "dflash_config.", path)
    mask = dc.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        hf.need(dc, "mask_token_id", "dflash_config.", path)
    b_top, b_dc = config.get("block_size"), dc.get("block_size")
    if b_top is not None and b_dc is not None and int(b_top) != int(b_dc):
        raise MlxspecError(f"{path}: block_size {b_top} and dflash_config.block_size {b_dc} disagree; fix config.json")
    block = b_dc if b_dc is not None else b_top
    if block is None:
        hf.need(dc, "block_size", "dflash_config.", path)
    if "sample_from_anchor" in dc:
        layout_key, layout_value = "dflash_config.sample_from_anchor", dc["sample_from_anchor"]
    else:
        layout_key, layout_value = "sample_from_anchor", config.get("sample_from_anchor")
    extra = {"num_target_layers": config.get("num_target_layers"),
             "max_position_embeddings": config.get("max_position_embeddings")}
    fields = dict(**dims, rope_theta=theta, **hf.taps_mask_block(taps, mask, block, path))
    if v2:
        fields.update(dflash2_fields(config, path))
    return fields, layout_key, layout_value, extra


def read(path: str, config: dict, target_vocab: int | None = None) -> RawDrafter:
    return hf.read_dir(path, config, "zlab", header, RULES, header_shapes=True)


def write(model, cfg: DrafterConfig, path: str, target=None, **options) -> None:
    """An anchor-first drafter is refused rather than written with a `sample_from_anchor`
    key: z-lab's own loaders (and vLLM's dflash path) ignore that key and would read it
    one row late."""
    hf.no_options(options, "zlab")
    hf.refuse_log_snr(cfg, path, "zlab")
    if cfg.markov_rank or cfg.confidence_head:
        hf.refuse(path, "zlab", "a Markov or confidence head", "deepspec, speculators or gguf")
    if cfg.sample_from_anchor:
        hf.refuse(path, "zlab", "an anchor-first (sample_from_anchor=true) drafter: z-lab loaders read "
                  "bonus-anchor and would draft one row late", "speculators or gguf")
    if cfg.draft_vocab_size:
        hf.refuse(path, "zlab", "a reduced draft vocabulary (d2t)", "speculators or gguf")
    facts = hf.target_facts(cfg, target, path, "zlab")
    if cfg.lineage == "dflash2":
        hf.write_dir(model, cfg, path, dflash2_config(model, cfg, facts))
        return
    # every key z-lab's published configs carry (Qwen3-8B-DFlash-b16 and siblings) except
    # auto_map (remote code not shipped) and the target's bos/eos ids
    config = {
        "architectures": ["DFlashDraftModel"],
        **hf.backbone_config(cfg),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": facts["max_position_embeddings"],
        "max_window_layers": cfg.num_hidden_layers,
        "num_target_layers": facts["num_target_layers"],
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "use_cache": True,
        "dtype": hf.weights_dtype(model),
        "block_size": cfg.block_size,
        "dflash_config": {
            "block_size": cfg.block_size,
            "target_layer_ids": [int(t) for t in cfg.target_layer_ids],
            "mask_token_id": cfg.mask_token_id,
        },
    }
    hf.write_dir(model, cfg, path, config)


def dflash2_config(model, cfg: DrafterConfig, facts: dict) -> dict:
    """config.json as z-lab publishes DFlash 2 drafters (tests/data/zlab-dflash2/config.json)."""
    lt = list(cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers)
    config = {
        "architectures": ["DFlash2DraftModel"],
        **hf.backbone_config(cfg),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": facts["max_position_embeddings"],
        "max_window_layers": cfg.num_hidden_layers,
        "num_target_layers": facts["num_target_layers"],
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "layer_types": lt,
        "sliding_window": cfg.sliding_window if "sliding_attention" in lt else None,
        "use_sliding_window": "sliding_attention" in lt,
        "use_cache": False,
        "dtype": hf.weights_dtype(model),
        "dflash_config": {
            "block_size": cfg.block_size,
            "target_layer_ids": [int(t) for t in cfg.target_layer_ids],
            "mask_token_id": cfg.mask_token_id,
            "conv_kernel_size": cfg.conv_kernel_size,
            "conv_group_size": cfg.conv_group_size,
            "selector_rank": cfg.selector_rank,
            "selector_top_k": cfg.selector_top_k,
            "output_multiplier": cfg.output_multiplier,
            "final_logit_softcapping": cfg.final_logit_softcapping,
        },
    }
    if cfg.block_causal is not None:
        config["is_causal"] = bool(cfg.block_causal)
    return config
