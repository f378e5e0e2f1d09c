"""DeepSpec DSpark directories: an architecture containing "DSpark" (`Qwen3DSparkModel`).

Taps, mask and block size at the top level; DeepSpec code never reads a layout key, so
these drafters are anchor-first (also its plain-DFlash baselines with markov_rank 0).
No log-SNR, no reduced vocabulary.
"""

from __future__ import annotations

from mlxspec.drafters.common import RawDrafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.formats import hf, speculators
from mlxspec.errors import MlxspecError

RULES = hf.hf_rules("deepspec", from_tensors=False, reduced_vocab=False)


def detect(config: dict, path: str) -> bool:
    return ("speculators_model_type" not in config and speculators.looks_like(config) is None
            and any("dspark" in a.lower() for a in hf.architectures(config)))


def _need(config: dict, key: str, path: str):
    """A required key; the message says why the directory was read as DeepSpec's."""
    if config.get(key) is None:
        archs = [a for a in hf.architectures(config) if "dspark" in a.lower()]
        raise MlxspecError(f"{path}: config.json has no {key} (read as a DeepSpec DSpark directory: architectures "
                           f"{archs}, no speculators_model_type); the drafter config is incomplete")
    return config[key]


def header(config: dict, path: str):
    dims = hf.backbone(config, path)
    theta = hf.rope_theta(config, path, hf.QWEN3_DEFAULTS["rope_theta"])
    taps = _need(config, "target_layer_ids", path)
    mask = _need(config, "mask_token_id", path)
    block = _need(config, "block_size", path)
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
