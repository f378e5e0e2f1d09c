"""Hugging Face drafter directories: z-lab DFlash, DeepSpec DSpark, vLLM speculators.

All three store the tensors under DFlashModel's own names (z-lab / DeepSpec names, no
`model.` prefix), so `hf_name` is the whole name map; they differ in config.json:

| format      | recognised by                          | taps                          | layout key                  |
|-------------|----------------------------------------|-------------------------------|-----------------------------|
| zlab        | `dflash_config` / DFlash architecture  | dflash_config.target_layer_ids| dflash_config.sample_from_anchor |
| deepspec    | architecture containing "DSpark"       | target_layer_ids              | sample_from_anchor          |
| speculators | `speculators_model_type` dspark/dflash | aux_hidden_state_layer_ids-1  | sample_from_anchor          |

Tap ids are converted here, once, to the "output of layer k" convention. Missing Qwen3
dimensions take transformers' Qwen3Config defaults (speculators serialises only the keys
that differ from them). Rope: top-level `rope_theta` or transformers-v5 `rope_parameters`.
"""

from __future__ import annotations

import glob
import json
import os

import mlx.core as mx
import numpy as np

from mlxspec import validate as V
from mlxspec.errors import MlxspecError
from mlxspec.drafters.model import DrafterConfig
from mlxspec.drafters.load import RawDrafter, claim_tensors, model_tensors, parse_flag, to_mx

_FIX = "fix the drafter's config.json or download the drafter again"

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


# ----------------------------------------------------------------------------- reading

def _load_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise MlxspecError(f"{path}: no config.json; pass a drafter directory (z-lab, DeepSpec or speculators)")
    return V.read_json_object(cfg_path, "drafter config.json")


def detect_format(config: dict, path: str) -> str:
    if "speculators_model_type" in config:
        kind = config["speculators_model_type"]
        if kind not in ("dspark", "dflash"):
            raise MlxspecError(
                f"{path}: speculators_model_type {kind!r} is not a block drafter (dspark or dflash)"
            )
        return "speculators"
    archs = [str(a) for a in (config.get("architectures") or [])]
    if any("dspark" in a.lower() for a in archs):
        return "deepspec"
    if "dflash_config" in config or any("dflash" in a.lower() for a in archs):
        return "zlab"
    raise MlxspecError(
        f"{path}: config.json is not a DFlash/DSpark drafter (architectures {archs or 'missing'}, no "
        "dflash_config or speculators_model_type)"
    )


def _read_tensors(path: str) -> dict:
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
        return V.get_float(c, "rope_theta", path, 0, 1e12, lo_open=True, fix=_FIX)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return V.get_float(rp, "rope_theta", path, 0, 1e12, lo_open=True, fix=_FIX)
    if default is None:
        raise MlxspecError(f"{path}: config.json has neither rope_theta nor rope_parameters.rope_theta")
    return float(default)


def _need(c: dict, key: str, where: str, path: str):
    if key not in c or c[key] is None:
        raise MlxspecError(f"{path}: config.json has no {where}{key}; the drafter config is incomplete")
    return c[key]


def _backbone(c: dict, path: str) -> dict:
    """Qwen3 dimensions from a (possibly diff-serialised) config dict."""
    if not isinstance(c, dict):
        raise MlxspecError(f"{path}: transformer_layer_config is {type(c).__name__}, expected an object; {_FIX}")
    layer_types = c.get("layer_types") or []
    if "sliding_attention" in layer_types:
        raise MlxspecError(
            f"{path}: sliding-window draft attention (layer_types {sorted(set(layer_types))}) is not "
            "supported; use a drafter with full attention"
        )
    if c.get("is_causal"):
        raise MlxspecError(f"{path}: causal block attention (is_causal: true) is not supported; DFlash blocks are non-causal")
    merged = {**{k: v for k, v in QWEN3_DEFAULTS.items() if v is not None}, **{k: v for k, v in c.items() if v is not None}}

    def g(k, hi=V.MAX_DIM):
        return V.get_int(merged, k, path, 1, hi, integral_float=True, fix=_FIX)

    hidden, heads = g("hidden_size"), g("num_attention_heads")
    return dict(
        hidden_size=hidden,
        intermediate_size=g("intermediate_size"),
        num_hidden_layers=g("num_hidden_layers", V.MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=V.get_int(merged, "num_key_value_heads", path, 1, V.MAX_DIM, default=heads,
                                      integral_float=True, fix=_FIX),
        head_dim=V.get_int(merged, "head_dim", path, 1, V.MAX_DIM, default=max(hidden // heads, 1),
                           integral_float=True, fix=_FIX),
        rms_norm_eps=V.get_float(merged, "rms_norm_eps", path, 0, 1, lo_open=True, fix=_FIX),
        vocab_size=g("vocab_size", V.MAX_VOCAB),
    )


def _flag(v, key: str, path: str) -> bool:
    """Strict: true/false, 1/0, yes/no ... (`drafter.parse_flag`); anything else is refused."""
    return parse_flag(v, key, path)


def read_hf_drafter(path: str) -> RawDrafter:
    config = _load_config(path)
    fmt = detect_format(config, path)
    tensors = _read_tensors(path)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    extra: dict = {}
    notes: dict = {}

    if fmt == "speculators":
        kind = config["speculators_model_type"]
        extra["speculators_model_type"] = kind
        base = config.get("transformer_layer_config") or {}
        dims = _backbone(base, path)
        theta = rope_theta(base, path, QWEN3_DEFAULTS["rope_theta"])
        extra["verifier"] = (config.get("speculators_config") or {}).get("verifier")
        aux = _need(config, "aux_hidden_state_layer_ids", "", path)
        aux = V.as_int_list(aux, "aux_hidden_state_layer_ids", path, 0, V.MAX_LAYERS, unique=True, min_len=1,
                            integral_float=True, fix=_FIX)
        taps = [t - 1 for t in aux]  # speculators counts hidden_states, i.e. tap id + 1
        mask = V.get_int(config, "mask_token_id", path, 0, V.MAX_VOCAB, integral_float=True, fix=_FIX)
        block = V.get_int(config, "block_size", path, 1, V.MAX_BLOCK, default=8, integral_float=True, fix=_FIX)
        layout_key, layout_value = "sample_from_anchor", config.get("sample_from_anchor")
        th = config.get("target_hidden_size")
        if th is not None and int(th) != dims["hidden_size"]:
            raise MlxspecError(
                f"{path}: target_hidden_size {th} differs from the drafter hidden size {dims['hidden_size']}; "
                "drafters with a separate target width are not supported"
            )
    else:
        dims = _backbone(config, path)
        theta = rope_theta(config, path, QWEN3_DEFAULTS["rope_theta"])
        if fmt == "zlab":
            dc = config.get("dflash_config") or {}
            taps = dc.get("target_layer_ids", config.get("target_layer_ids"))
            if taps is None:
                _need(dc, "target_layer_ids", "dflash_config.", path)
            mask = dc.get("mask_token_id", config.get("mask_token_id"))
            if mask is None:
                _need(dc, "mask_token_id", "dflash_config.", path)
            b_top, b_dc = config.get("block_size"), dc.get("block_size")
            if b_top is not None and b_dc is not None and int(b_top) != int(b_dc):
                raise MlxspecError(
                    f"{path}: block_size {b_top} and dflash_config.block_size {b_dc} disagree; fix config.json"
                )
            block = b_dc if b_dc is not None else b_top
            if block is None:
                _need(dc, "block_size", "dflash_config.", path)
            if "sample_from_anchor" in dc:
                layout_key, layout_value = "dflash_config.sample_from_anchor", dc["sample_from_anchor"]
            else:
                layout_key, layout_value = "sample_from_anchor", config.get("sample_from_anchor")
            extra["num_target_layers"] = config.get("num_target_layers")
            extra["max_position_embeddings"] = config.get("max_position_embeddings")
        else:  # deepspec
            taps = _need(config, "target_layer_ids", "", path)
            mask = _need(config, "mask_token_id", "", path)
            block = _need(config, "block_size", "", path)
            layout_key, layout_value = "sample_from_anchor", config.get("sample_from_anchor")
            extra["num_target_layers"] = config.get("num_target_layers")
            extra["num_anchors"] = config.get("num_anchors")
        taps = V.as_int_list(taps, "target_layer_ids", path, -1, V.MAX_LAYERS, unique=True, min_len=1,
                             integral_float=True, fix=_FIX)
        mask = V.as_int(mask, "mask_token_id", path, 0, V.MAX_VOCAB, integral_float=True, fix=_FIX)
        block = V.as_int(block, "block_size", path, 1, V.MAX_BLOCK, integral_float=True, fix=_FIX)

    H = dims["hidden_size"]
    # -- DSpark features: a present key must agree with the tensors; absent keys mean
    # "off" for z-lab / DeepSpec and "as the tensors say" for speculators, whose class
    # defaults changed between releases.
    infer = fmt == "speculators"
    w1 = shapes.get("markov_head.markov_w1.weight")
    if "markov_rank" in config:
        rank = V.get_int(config, "markov_rank", path, 0, V.MAX_DIM, integral_float=True, fix=_FIX)
        notes["Markov head"] = f"config markov_rank={rank}"
    else:
        rank = int(w1[1]) if (infer and w1 is not None and len(w1) == 2) else 0
        notes["Markov head"] = "inferred from markov_head.markov_w1" if infer else "config has no markov_rank"
    head_type = config.get("markov_head_type")
    if head_type is None:
        head_type = "vanilla"
        if infer and "markov_head.gate_proj.weight" in shapes:
            head_type = "gated"
        elif infer and "markov_head.joint_proj.weight" in shapes:
            head_type = "rnn"
    head_type = str(head_type).lower()
    if rank and head_type not in ("vanilla", "gated", "rnn"):
        raise MlxspecError(f"{path}: markov_head_type {head_type!r} is unknown (vanilla, gated, rnn)")
    notes["gated/rnn Markov head"] = f"markov_head_type={head_type}"
    conf_w = shapes.get("confidence_head.proj.weight")
    if "enable_confidence_head" in config:
        conf = _flag(config["enable_confidence_head"], "enable_confidence_head", path)
        notes["confidence head"] = f"config enable_confidence_head={'true' if conf else 'false'}"
    else:
        conf = bool(infer and conf_w is not None)
        notes["confidence head"] = "inferred from the tensors" if infer else "config has no enable_confidence_head"
    if "confidence_head_with_markov" in config and config["confidence_head_with_markov"] is not None:
        with_markov = _flag(config["confidence_head_with_markov"], "confidence_head_with_markov", path)
    else:
        with_markov = bool(conf_w is None or len(conf_w) != 2 or conf_w[1] != H)
    log_snr = _flag(config.get("log_snr_conditioning", False), "log_snr_conditioning", path)
    notes["log-SNR conditioning"] = f"config log_snr_conditioning={'true' if log_snr else 'false or absent'}"
    min_snr = V.get_float(config, "min_log_snr", path, default=-9.0, fix=_FIX)
    max_snr = V.get_float(config, "max_log_snr", path, default=9.0, fix=_FIX)
    if log_snr and not max_snr > min_snr:
        raise MlxspecError(f"{path}: max_log_snr {max_snr} must be greater than min_log_snr {min_snr}")

    # -- reduced draft vocabulary (speculators d2t/t2d; t2d is claimed but unused)
    extra_claimed = {}
    if fmt == "speculators":  # frozen verifier copies some speculators versions save: claimed, unused
        extra_claimed.update({"verifier_norm.weight": (dims["hidden_size"],),
                              "verifier_lm_head.weight": (dims["vocab_size"], dims["hidden_size"])})
    draft_vocab = None
    if fmt == "speculators" and "d2t" in shapes:
        draft_vocab = int(shapes["d2t"][0])
        if "t2d" in shapes:
            extra_claimed["t2d"] = (dims["vocab_size"],)
        # No lm_head with d2t: the head is BORROWED from the target (its rows at the d2t
        # ids), as for any drafter that carries no head of its own. mlxspec's trainer
        # writes such files: the head is frozen target rows, so storing it would only
        # duplicate the target's weights (4.7M params for SmolLM2 with 8192 ids).
    elif fmt != "speculators":
        notes["reduced draft vocabulary"] = f"the {fmt} format has no reduced vocabulary"
    extra["draft_vocab_size_config"] = config.get("draft_vocab_size")

    cfg = DrafterConfig(
        **dims,
        block_size=block,
        target_layer_ids=taps,
        mask_token_id=mask,
        rope_theta=theta,
        markov_rank=rank,
        markov_head_type=head_type,
        confidence_head=conf,
        confidence_head_with_markov=with_markov,
        log_snr=log_snr,
        min_log_snr=min_snr,
        max_log_snr=max_snr,
        draft_vocab_size=draft_vocab,
        has_embed="embed_tokens.weight" in shapes,
        has_lm_head="lm_head.weight" in shapes,
        source_format=fmt,
        extra=extra,
    )
    if layout_value is not None:
        layout_value = _flag(layout_value, layout_key, path)
    claimed = claim_tensors(path, cfg, shapes, to_model=lambda f: f, to_file=hf_name, notes=notes,
                            extra_claimed=extra_claimed)
    weights = {m: to_mx(m, tensors[f]) for f, m in claimed.items()}
    return RawDrafter(cfg, weights, fmt, layout_key, layout_value, path=path)


# ----------------------------------------------------------------------------- writing

def _refuse(path: str, fmt: str, what: str, use: str) -> None:
    raise MlxspecError(f"{path}: the {fmt} format cannot hold {what}; write it as {use}")


def _backbone_config(cfg: DrafterConfig) -> dict:
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


def _target_facts(cfg: DrafterConfig, target, path: str, fmt: str) -> dict:
    """What the HF writers record about the target: num_target_layers, max_position_embeddings,
    verifier (speculators). From `target` (a Target or TargetInfo), else from what the drafter
    was read with (cfg.extra); refused when a peer's loader needs it and nothing says it."""
    info = getattr(target, "info", target)
    tcfg = getattr(target, "config", None) or {}
    n_layers = info.num_layers if info is not None else cfg.extra.get("num_target_layers")
    mpe = tcfg.get("max_position_embeddings") or cfg.extra.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS
    if info is not None:
        arch = tcfg.get("architectures") or [HF_ARCHITECTURES.get(info.model_type, info.model_type)]
        verifier = {"name_or_path": info.source or info.model_type, "architectures": list(arch)}
    else:
        verifier = cfg.extra.get("verifier")
    if n_layers is None and fmt == "zlab":
        raise MlxspecError(f"{path}: the zlab format needs num_target_layers; pass target= to save_drafter")
    if verifier is None and fmt == "speculators":
        raise MlxspecError(f"{path}: the speculators format needs speculators_config.verifier; "
                           "pass target= to save_drafter")
    return {"num_target_layers": None if n_layers is None else int(n_layers),
            "max_position_embeddings": int(mpe), "verifier": verifier}


def _weights_dtype(model) -> str:
    dt = model.fc.weight.dtype
    return {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dt, "float32")


def write_hf_drafter(model, cfg: DrafterConfig, path: str, fmt: str, target=None) -> None:
    """config.json + model.safetensors. Refuses what the format cannot express:

    - zlab: bonus-anchor DFlash only. An anchor-first drafter is refused rather than
      written with a `sample_from_anchor` key, because z-lab's own loaders (and vLLM's
      dflash path) ignore that key and would read it one row late; likewise no DSpark
      heads, log-SNR or reduced vocabulary.
    - deepspec: anchor-first only (DeepSpec code never reads a layout key); no log-SNR,
      no reduced vocabulary.
    - speculators: any layout (explicit key), any Markov head type; no log-SNR.
    """
    if cfg.log_snr:
        _refuse(path, fmt, "log-SNR conditioning (no public loader of it reads those tensors)", "gguf")
    if fmt == "zlab":
        if cfg.markov_rank or cfg.confidence_head:
            _refuse(path, fmt, "a Markov or confidence head", "deepspec, speculators or gguf")
        if cfg.sample_from_anchor:
            _refuse(path, fmt, "an anchor-first (sample_from_anchor=true) drafter: z-lab loaders read "
                    "bonus-anchor and would draft one row late", "speculators or gguf")
        if cfg.draft_vocab_size:
            _refuse(path, fmt, "a reduced draft vocabulary (d2t)", "speculators or gguf")
    elif fmt == "deepspec":
        if not cfg.sample_from_anchor:
            _refuse(path, fmt, "a bonus-anchor (sample_from_anchor=false) drafter: DeepSpec drafters are "
                    "read anchor-first and would draft one row early", "zlab, speculators or gguf")
        if cfg.draft_vocab_size:
            _refuse(path, fmt, "a reduced draft vocabulary (d2t)", "speculators or gguf")
    elif fmt != "speculators":
        raise MlxspecError(f"unknown Hugging Face drafter format {fmt!r}")

    taps = [int(t) for t in cfg.target_layer_ids]
    base = _backbone_config(cfg)
    facts = _target_facts(cfg, target, path, fmt)
    if fmt == "zlab":
        # every key z-lab's published configs carry (Qwen3-8B-DFlash-b16 and siblings) except
        # auto_map (remote code not shipped) and the target's bos/eos ids
        config = {
            "architectures": ["DFlashDraftModel"],
            **base,
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
            "dtype": _weights_dtype(model),
            "block_size": cfg.block_size,
            "dflash_config": {
                "block_size": cfg.block_size,
                "target_layer_ids": taps,
                "mask_token_id": cfg.mask_token_id,
            },
        }
    elif fmt == "deepspec":
        config = {
            "architectures": ["Qwen3DSparkModel"],
            **base,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
            "block_size": cfg.block_size,
            "target_layer_ids": taps,
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
    else:
        kind = "dspark" if cfg.markov_rank else "dflash"
        n = cfg.n_drafts
        config = {
            "speculators_model_type": kind,
            "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
            "transformer_layer_config": {
                **base, "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
            },
            "aux_hidden_state_layer_ids": [t + 1 for t in taps],
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
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": n}],
                "default_proposal_method": "greedy",
                "verifier": facts["verifier"],
            },
        }

    tensors = {}
    if fmt == "speculators" and cfg.draft_vocab_size and not cfg.has_lm_head:
        # speculators reads a reduced-vocabulary drafter's head from the file (it never
        # borrows the verifier's): write the target's head rows at the d2t ids, in float32 so
        # they are the very rows a borrowing reader uses (identical drafts either way)
        if getattr(target, "model", None) is None:
            raise MlxspecError(f"{path}: the speculators format needs lm_head.weight with a reduced vocabulary "
                               "(d2t); pass the Target as target= so its head rows are written")
        from mlxspec.engine.drafting import target_head_rows

        d2t = np.asarray(model.d2t).astype(np.int64)
        ids = mx.array((np.arange(d2t.shape[0]) + d2t).astype(np.int32))
        tensors["lm_head.weight"] = target_head_rows(target, ids)
    for name, arr in model_tensors(model).items():
        if name == "d2t":
            d2t = np.asarray(arr).astype(np.int64)
            tensors["d2t"] = mx.array(d2t)
            t2d = np.zeros(cfg.vocab_size, dtype=np.bool_)
            t2d[np.arange(d2t.shape[0]) + d2t] = True
            tensors["t2d"] = mx.array(t2d)
        else:
            tensors[hf_name(name)] = arr
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "pt"})
