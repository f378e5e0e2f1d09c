"""vLLM speculators directories: `speculators_model_type` dspark, dflash or dflash2.

The backbone lives in `transformer_layer_config`; taps are `aux_hidden_state_layer_ids`
(hidden_states indices, i.e. tap id + 1); explicit `sample_from_anchor`; any Markov head
type; an optional reduced draft vocabulary (`d2t`, with `t2d` claimed but unused). No log-SNR.
dflash2 (speculators 0.9.0 `DFlash2SpeculatorConfig`): conv_kernel_size, conv_group_size,
selector_rank, selector_top_k at the top level, sliding layers in transformer_layer_config,
`sliding_window_non_causal` (default true); no output multiplier or softcap (1.0 / none).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxspec import validate as V
from mlxspec.drafters.common import RawDrafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.formats import hf
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import target_head_rows

RULES = hf.hf_rules("speculators", from_tensors=True, reduced_vocab=True)


def looks_like(config: dict) -> str | None:
    """Why a config.json without speculators_model_type still reads as vLLM speculators', or None."""
    why = [k for k in ("speculators_config", "transformer_layer_config") if k in config]
    why += [f"architectures {a!r}" for a in hf.architectures(config) if a.endswith("Speculator")]
    return ", ".join(why) or None


def detect(config: dict, path: str) -> bool:
    if "speculators_model_type" not in config:
        why = looks_like(config)
        if why:  # not a DeepSpec or z-lab directory with a missing key: say what it is
            raise MlxspecError(f"{path}: config.json is a vLLM speculators drafter ({why}) but has no "
                               "speculators_model_type; add \"speculators_model_type\": \"dspark\" (Markov head), "
                               "\"dflash\" or \"dflash2\"")
        return False
    kind = config["speculators_model_type"]
    if kind == "eagle3":  # a chain drafter: formats/eagle3.py reads it
        return False
    if kind not in ("dspark", "dflash", "dflash2"):
        raise MlxspecError(f"{path}: speculators_model_type {kind!r} is not a drafter mlxspec reads (dspark, "
                           "dflash, dflash2 or eagle3)")
    return True


DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def header(config: dict, path: str, shapes: dict | None = None):
    if "transformer_layer_config" not in config:  # else Qwen3's defaults (hidden 4096) would stand in
        raise MlxspecError(f"{path}: config.json has no transformer_layer_config (the drafter's layer sizes: "
                           "hidden_size, heads, ...); the drafter config is incomplete, export it again")
    base = config["transformer_layer_config"]
    v2 = config["speculators_model_type"] == "dflash2"
    hf.refuse_dflash2_markers(path, shapes or {}, v2, f"speculators_model_type {config['speculators_model_type']}")
    dims = hf.backbone(base, path, dflash2=v2)
    theta = hf.rope_theta(base, path, hf.QWEN3_DEFAULTS["rope_theta"])
    extra = {"speculators_model_type": config["speculators_model_type"],
             "verifier": (config.get("speculators_config") or {}).get("verifier")}
    aux = hf.need(config, "aux_hidden_state_layer_ids", "", path)
    aux = V.as_int_list(aux, "aux_hidden_state_layer_ids", path, 0, V.MAX_LAYERS, unique=True, min_len=1,
                        integral_float=True, fix=hf.FIX)
    taps = [t - 1 for t in aux]  # speculators counts hidden_states, i.e. tap id + 1
    mask = V.get_int(config, "mask_token_id", path, 0, V.MAX_VOCAB, integral_float=True, fix=hf.FIX)
    block = V.get_int(config, "block_size", path, 1, V.MAX_BLOCK, default=8, integral_float=True, fix=hf.FIX)
    th = config.get("target_hidden_size")
    if th is not None and int(th) != dims["hidden_size"]:
        said = "" if isinstance(base, dict) and "hidden_size" in base else \
            " (transformer_layer_config names none: Qwen3's default)"
        raise MlxspecError(
            f"{path}: target_hidden_size {th} differs from the drafter hidden size {dims['hidden_size']}{said}; "
            "drafters with a separate target width are not supported"
        )
    fields = dict(**dims, rope_theta=theta, block_size=block, target_layer_ids=taps, mask_token_id=mask)
    if v2:
        for k in DFLASH2_KEYS:
            fields[k] = V.get_int(config, k, path, 1, V.MAX_VOCAB, default={"conv_kernel_size": 2,
                                  "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}[k],
                                  integral_float=True, fix=hf.FIX)
        lt = base.get("layer_types")
        if lt:
            fields["layer_types"] = tuple(lt)
            if "sliding_attention" in lt:
                fields["sliding_window"] = V.get_int(base, "sliding_window", path, 1, 1 << 30, integral_float=True,
                                                     fix=hf.FIX)
        nc = hf.parse_flag(config.get("sliding_window_non_causal", True), "sliding_window_non_causal", path)
        fields["block_causal"] = False if nc else None  # false: causal inside the sliding layers' blocks
    return fields, "sample_from_anchor", config.get("sample_from_anchor"), extra


def extra_claimed(fields: dict, shapes: dict) -> dict:
    """Frozen verifier copies some speculators versions save, and t2d: claimed, unused.

    No lm_head with d2t: the head is BORROWED from the target (its rows at the d2t ids), as
    for any drafter that carries no head of its own. mlxspec's trainer writes such files:
    the head is frozen target rows, so storing it would only duplicate the target's weights
    (4.7M params for SmolLM2 with 8192 ids)."""
    out = {"verifier_norm.weight": (fields["hidden_size"],),
           "verifier_lm_head.weight": (fields["vocab_size"], fields["hidden_size"])}
    if "d2t" in shapes and "t2d" in shapes:
        out["t2d"] = (fields["vocab_size"],)
    return out


def read(path: str, config: dict, target_vocab: int | None = None) -> RawDrafter:
    return hf.read_dir(path, config, "speculators", header, RULES, extra_claimed, header_shapes=True)


def write(model, cfg: DrafterConfig, path: str, target=None, **options) -> None:
    """Any layout (explicit key), any Markov head type. A reduced vocabulary also writes the
    target's head rows at the d2t ids as lm_head: speculators never borrows the verifier's."""
    hf.no_options(options, "speculators")
    hf.refuse_log_snr(cfg, path, "speculators")
    facts = hf.target_facts(cfg, target, path, "speculators")
    kind = cfg.lineage
    if kind == "dflash2":
        if cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping:
            hf.refuse(path, "speculators", "a DFlash 2 output multiplier or softcap (speculators 0.9.0 has neither)",
                      "zlab or gguf")
        if cfg.block_causal and any(not cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)):
            hf.refuse(path, "speculators", "causal blocks in full-attention layers", "zlab or gguf")
    layer_types = list(cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers)
    config = {
        "speculators_model_type": kind,
        "architectures": [{"dspark": "DSparkSpeculator", "dflash": "DFlashSpeculator",
                           "dflash2": "DFlash2DraftModel"}[kind]],
        "transformer_layer_config": {
            **hf.backbone_config(cfg), "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
            "layer_types": layer_types,
            **({"sliding_window": cfg.sliding_window} if "sliding_attention" in layer_types else {}),
        },
        "aux_hidden_state_layer_ids": [int(t) + 1 for t in cfg.target_layer_ids],
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": bool(cfg.sample_from_anchor),
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.n_drafts}],
            "default_proposal_method": "greedy",
            "verifier": facts["verifier"],
        },
    }
    if kind == "dflash2":
        config.update({k: int(getattr(cfg, k)) for k in DFLASH2_KEYS})
        config["sliding_window_non_causal"] = not cfg.block_causal and cfg.block_causal is not None
    head = {}
    if cfg.draft_vocab_size and not cfg.has_lm_head:
        # float32 rows: the very rows a borrowing reader uses (identical drafts either way)
        if getattr(target, "model", None) is None:
            raise MlxspecError(f"{path}: the speculators format needs lm_head.weight with a reduced vocabulary "
                               "(d2t); pass the Target as target= so its head rows are written")
        d2t = np.asarray(model.d2t).astype(np.int64)
        ids = mx.array((np.arange(d2t.shape[0]) + d2t).astype(np.int32))
        head["lm_head.weight"] = target_head_rows(target, ids)
    hf.write_dir(model, cfg, path, config, head)
