"""z-lab DFlash directories: `dflash_config` (or a DFlash architecture) in config.json.

Taps, mask and block size in `dflash_config` (older files: top level); the layout key, if
any, is `dflash_config.sample_from_anchor` (absent: bonus-anchor, see `resolve_layout`).
Bonus-anchor DFlash only: no DSpark heads, log-SNR or reduced vocabulary.
"""

from __future__ import annotations

from mlxspec.drafters.common import RawDrafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.formats import hf
from mlxspec.errors import MlxspecError

RULES = hf.hf_rules("zlab", from_tensors=False, reduced_vocab=False)


def detect(config: dict, path: str) -> bool:
    return ("speculators_model_type" not in config
            and not any("dspark" in a.lower() for a in hf.architectures(config))
            and ("dflash_config" in config or any("dflash" in a.lower() for a in hf.architectures(config))))


def header(config: dict, path: str):
    dims = hf.backbone(config, path)
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
    return dict(**dims, rope_theta=theta, **hf.taps_mask_block(taps, mask, block, path)), layout_key, layout_value, extra


def read(path: str, config: dict, target_vocab: int | None = None) -> RawDrafter:
    return hf.read_dir(path, config, "zlab", header, RULES)


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
