"""DeepSpec DSpark directories: an architecture containing "DSpark" (`Qwen3DSparkModel`).

Taps, mask and block size at the top level; DeepSpec code never reads a layout key, so
these drafters are anchor-first (also its plain-DFlash baselines with markov_rank 0).
No log-SNR, no reduced vocabulary.
"""

from __future__ import annotations

from mlxspec.drafters.common import RawDrafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.formats import hf

RULES = hf.hf_rules("deepspec", from_tensors=False, reduced_vocab=False)


def detect(config: dict, path: str) -> bool:
    return ("speculators_model_type" not in config
            and any("dspark" in a.lower() for a in hf.architectures(config)))


def header(config: dict, path: str):
    dims = hf.backbone(config, path)
    theta = hf.rope_theta(config, path, hf.QWEN3_DEFAULTS["rope_theta"])
    taps = hf.need(config, "target_layer_ids", "", path)
    mask = hf.need(config, "mask_token_id", "", path)
    block = hf.need(config, "block_size", "", path)
    extra = {"num_target_layers": config.get("num_target_layers"), "num_anchors": config.get("num_anchors")}
    return (dict(**dims, rope_theta=theta, **hf.taps_mask_block(taps, mask, block, path)), "sample_from_anchor",
            config.get("sample_from_anchor"), extra)


def read(path: str, config: dict, target_vocab: int | None = None) -> RawDrafter:
    return hf.read_dir(path, config, "deepspec", header, RULES)


def write(model, cfg: DrafterConfig, path: str, target=None, **options) -> None:
    hf.no_options(options, "deepspec")
    hf.refuse_log_snr(cfg, path, "deepspec")
    if not cfg.sample_from_anchor:
        hf.refuse(path, "deepspec", "a bonus-anchor (sample_from_anchor=false) drafter: DeepSpec drafters are "
                  "read anchor-first and would draft one row early", "zlab, speculators or gguf")
    if cfg.draft_vocab_size:
        hf.refuse(path, "deepspec", "a reduced draft vocabulary (d2t)", "speculators or gguf")
    facts = hf.target_facts(cfg, target, path, "deepspec")
    config = {
        "architectures": ["Qwen3DSparkModel"],
        **hf.backbone_config(cfg),
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "block_size": cfg.block_size,
        "target_layer_ids": [int(t) for t in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "num_anchors": int(cfg.extra.get("num_anchors") or 512),
        "markov_rank": cfg.markov_rank,
        "enable_confidence_head": cfg.confidence_head,
    }
    if cfg.markov_rank:
        config["markov_head_type"] = cfg.markov_head_type
    if cfg.confidence_head:
        config["confidence_head_with_markov"] = cfg.confidence_head_with_markov
    config["max_position_embeddings"] = facts["max_position_embeddings"]
    if facts["num_target_layers"]:
        config["num_target_layers"] = facts["num_target_layers"]
    hf.write_dir(model, cfg, path, config)
