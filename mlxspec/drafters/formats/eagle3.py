"""EAGLE-3 drafter directories: vLLM speculators (`speculators_model_type: eagle3`) and
SpecForge / SGLang / SafeAILab (`LlamaForCausalLMEagle3`, `midlayer.*`).

Tap ids are converted ONCE, here, to the output-of-layer convention the rest of mlxspec uses:

| format       | where the ids are                                | id k means              | no ids          |
|--------------|--------------------------------------------------|-------------------------|-----------------|
| speculators  | `eagle_aux_hidden_state_layer_ids`               | hidden_states[k]: the   | target's default|
|              |                                                  | output of layer k-1     |                 |
| specforge    | `eagle_config.eagle_aux_hidden_state_layer_ids`  | the output of layer k   | target's default|
| safeailab    | none (same tensors as specforge, no eagle_config) | -                       | target's default|

The default (`mlxspec.drafters.eagle3.default_taps`) is the inputs of layers 2, N//2 and N-3
of the TARGET (vLLM, speculators, SGLang and SafeAILab agree), resolved by the loader once the
target's depth is known. Reading speculators ids as SpecForge's (or the reverse) taps every layer
one too deep and acceptance collapses with no error: the PR #122 failure, for taps.
"""

from __future__ import annotations

import os
from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxspec import validate as V
from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model
from mlxspec.drafters.formats import hf
from mlxspec.errors import MlxspecError

FIX = hf.FIX
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "max_position_embeddings": 2048}
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class RawEagle3:
    """What an EAGLE-3 reader hands back: the config (taps possibly unresolved) and tensors
    under `Eagle3Model`'s names."""

    def __init__(self, cfg: Eagle3Config, weights: dict, fmt: str, path: str):
        self.cfg, self.weights, self.fmt, self.path = cfg, weights, fmt, path


# ----------------------------------------------------------------------------- detection

def _eagle_archs(config: dict) -> list[str]:
    return [a for a in hf.architectures(config) if "eagle3" in a.lower()]


def detect_speculators(config: dict, path: str) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def detect_specforge(config: dict, path: str) -> bool:
    """SpecForge / SGLang (`LlamaForCausalLMEagle3` or an `eagle_config`), or a SafeAILab
    EAGLE-3 directory (a one-layer Llama config with `draft_vocab_size` and `midlayer.*` tensors)."""
    if "speculators_model_type" in config:
        return False
    if _eagle_archs(config) or isinstance(config.get("eagle_config"), dict):
        return True
    return "draft_vocab_size" in config and _has_midlayer(path)


def _has_midlayer(path: str) -> bool:
    import glob
    for fp in glob.glob(os.path.join(path, "*.safetensors")):
        try:
            with open(fp, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > 1 << 26:
                    continue
                if b'"midlayer.' in f.read(n):
                    return True
        except OSError:
            continue
    return False


# ----------------------------------------------------------------------------- reading

def _dims(c: dict, path: str, where: str) -> dict:
    """Llama / Qwen3 dimensions of the drafter layer (absent keys: that model_type's defaults,
    as transformers serialises only the differing ones)."""
    if not isinstance(c, dict):
        raise MlxspecError(f"{path}: {where or 'config.json'} is {type(c).__name__}, expected an object; {FIX}")
    mt = str(c.get("model_type") or "llama")
    base = hf.QWEN3_DEFAULTS if mt == "qwen3" else LLAMA_DEFAULTS
    m = {**base, **{k: v for k, v in c.items() if v is not None}}

    def g(k, hi=V.MAX_DIM, **kw):
        return V.get_int(m, k, path, 1, hi, integral_float=True, fix=FIX, **kw)

    hidden, heads = g("hidden_size"), g("num_attention_heads")
    scaling = m.get("rope_scaling") or (m.get("rope_parameters") if isinstance(m.get("rope_parameters"), dict) else None)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind not in (None, "default", "llama3"):
        raise MlxspecError(f"{path}: rope type {kind!r} is not supported for EAGLE-3 drafters (default or llama3); "
                           "use a drafter trained with one of them")
    theta = m.get("rope_theta", (scaling or {}).get("rope_theta", base["rope_theta"]))
    if m.get("layer_types") and "sliding_attention" in m["layer_types"]:
        raise MlxspecError(f"{path}: sliding-window EAGLE-3 layers are not supported; use a full-attention drafter")
    return dict(
        hidden_size=hidden, intermediate_size=g("intermediate_size"),
        num_hidden_layers=g("num_hidden_layers", V.MAX_LAYERS), num_attention_heads=heads,
        num_key_value_heads=g("num_key_value_heads", default=heads),
        head_dim=g("head_dim", default=max(hidden // heads, 1)),
        vocab_size=g("vocab_size", V.MAX_VOCAB),
        rms_norm_eps=V.get_float(m, "rms_norm_eps", path, 0, 1, lo_open=True, fix=FIX),
        rope_theta=V.as_float(theta, "rope_theta", path, 0, 1e12, lo_open=True, fix=FIX),
        rope_scaling=dict(scaling) if kind == "llama3" else None,
        max_position_embeddings=g("max_position_embeddings", 1 << 30),
        attention_bias=hf.parse_flag(m.get("attention_bias", False), "attention_bias", path),
        qk_norm=mt == "qwen3",
    )


def _taps(ids, key: str, path: str):
    if ids is None:
        return None
    return tuple(V.as_int_list(ids, key, path, 0, V.MAX_LAYERS, unique=True, min_len=1, integral_float=True, fix=FIX))


def _header(config: dict, path: str, fmt: str, shapes: dict) -> Eagle3Config:
    if fmt == "speculators":
        if "transformer_layer_config" not in config:
            raise MlxspecError(f"{path}: config.json has no transformer_layer_config (the drafter's layer sizes); "
                               "the drafter config is incomplete, export it again")
        dims = _dims(config["transformer_layer_config"], path, "transformer_layer_config")
        key = "eagle_aux_hidden_state_layer_ids"
        ids = _taps(config.get(key), key, path)
        taps = tuple(k - 1 for k in ids) if ids else ()
        convention = "speculators"
        spec = config.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        n = methods[0].get("speculative_tokens", 7) if isinstance(methods[0], dict) else 7
        max_drafts = V.as_int(n, "speculators_config.proposal_methods[0].speculative_tokens", path, 1, V.MAX_BLOCK,
                              integral_float=True, fix=FIX)
        extra = {"verifier": spec.get("verifier")}
    else:
        dims = _dims(config, path, "")
        ec = config.get("eagle_config")
        ids = None
        if isinstance(ec, dict):
            ids = _taps(ec.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids", path)
        taps = ids or ()
        convention = "specforge" if isinstance(ec, dict) else "safeailab"
        max_drafts, extra = 7, {}
    if any(t < 0 for t in taps):
        raise MlxspecError(f"{path}: tap id 0 in the speculators convention is the embedding output, which mlxspec "
                           "does not tap; use a drafter whose taps are decoder layers")
    if "lm_head.weight" in shapes:
        dv = shapes["lm_head.weight"][0]
    else:
        dv = config.get("draft_vocab_size", dims["vocab_size"])
    dv = V.as_int(dv, "draft_vocab_size", path, 1, V.MAX_VOCAB, integral_float=True, fix=FIX)
    said = config.get("draft_vocab_size")
    if said is not None and "lm_head.weight" in shapes and int(said) != dv:
        raise MlxspecError(f"{path}: draft_vocab_size {said} but lm_head.weight has {dv} rows; {FIX}")
    th = V.get_int(config, "target_hidden_size", path, 1, V.MAX_DIM, default=dims["hidden_size"], integral_float=True,
                   fix=FIX)
    flags = {k: hf.parse_flag(config.get(k, False), k, path) for k in FLAGS}
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise MlxspecError(f"{path}: norm_before_fc and fc_norm are both set; they are exclusive: {FIX}")
    return Eagle3Config(**dims, draft_vocab_size=dv, target_hidden_size=th, target_layer_ids=taps,
                        file_layer_ids=ids, tap_convention=convention, **flags,
                        has_embed="embed_tokens.weight" in shapes, has_lm_head="lm_head.weight" in shapes,
                        max_drafts=max_drafts, source_format=f"{fmt}-eagle3" if fmt == "speculators" else fmt,
                        extra=extra)


def to_model_name(file_name: str) -> str:
    """File tensor name -> `Eagle3Model` name (SpecForge's `midlayer` is layer 0)."""
    name = hf.sanitize(file_name)
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def expected(cfg: Eagle3Config) -> dict:
    """Eagle3Model parameter name -> shape (lazy: nothing is allocated)."""
    n = len(cfg.target_layer_ids) or len(cfg.file_layer_ids or ()) or 3
    return {k: tuple(v.shape) for k, v in tree_flatten(Eagle3Model(replace(cfg, target_layer_ids=(0,) * n)).parameters())}


def claim(path: str, cfg: Eagle3Config, tensors: dict) -> dict:
    """Strict: every file tensor claimed, every needed one present, shapes agree. -> model weights."""
    want = expected(cfg)
    ignored = {"t2d": (cfg.vocab_size,), "verifier_norm.weight": None, "verifier_lm_head.weight": None}
    out, unclaimed, bad = {}, [], []
    for fname, arr in tensors.items():
        m = to_model_name(fname)
        if m in ignored:
            if ignored[m] is not None and tuple(arr.shape) != ignored[m]:
                bad.append(f"{fname} has shape {list(arr.shape)}, expected {list(ignored[m])}")
            continue
        if m not in want:
            unclaimed.append(fname)
        elif tuple(arr.shape) != want[m]:
            bad.append(f"{fname} has shape {list(arr.shape)}, expected {list(want[m])}")
        else:
            out[m] = arr
    missing = [m for m in want if m not in out and not any(to_model_name(f) == m for f in tensors)]
    msgs = []
    if unclaimed:
        msgs.append(f"{len(unclaimed)} tensor(s) not claimed by the EAGLE-3 drafter its config describes: "
                    + ", ".join(sorted(unclaimed)[:12]))
    if missing:
        if cfg.source_format == "specforge":  # named as SpecForge's layout names them
            missing = ["midlayer." + m[len("layers.0."):] if m.startswith("layers.0.") else m for m in missing]
        why = " (reduced draft vocabulary: d2t)" if "d2t" in missing else ""
        msgs.append("missing tensor(s): " + ", ".join(sorted(missing)[:12]) + why)
    if bad:
        msgs.append("shape mismatch: " + "; ".join(bad[:8]))
    if msgs:
        raise MlxspecError(f"{path}: " + "; and ".join(msgs) + "; the file's tensors and config.json disagree: "
                           "re-export the drafter or fix its config.json")
    for k, a in out.items():
        if k == "d2t":
            out[k] = a.astype(mx.int32)
        elif not mx.issubdtype(a.dtype, mx.floating):
            raise MlxspecError(f"{path}: tensor {k} has integer type {a.dtype}; expected a float tensor")
    return out


def _read(path: str, config: dict, fmt: str) -> RawEagle3:
    tensors = hf.read_tensors(path)
    shapes = {to_model_name(k): tuple(v.shape) for k, v in tensors.items()}
    cfg = _header(config, path, fmt, shapes)
    if cfg.reduced_vocab and "d2t" not in shapes:
        raise MlxspecError(f"{path}: draft vocabulary {cfg.draft_vocab_size} differs from the target vocabulary "
                           f"{cfg.vocab_size} but the file has no d2t (draft id -> target id offsets); {FIX}")
    if "fc.weight" in shapes and shapes["fc.weight"][1] % cfg.target_hidden_size == 0:
        n = shapes["fc.weight"][1] // cfg.target_hidden_size
        if cfg.file_layer_ids and len(cfg.file_layer_ids) != n:
            raise MlxspecError(f"{path}: fc.weight takes {n} taps of {cfg.target_hidden_size} but the config names "
                               f"{len(cfg.file_layer_ids)} tap ids {list(cfg.file_layer_ids)}; {FIX}")
    return RawEagle3(cfg, claim(path, cfg, tensors), cfg.source_format, path)


def read_speculators(path: str, config: dict, target_vocab: int | None = None) -> RawEagle3:
    return _read(path, config, "speculators")


def read_specforge(path: str, config: dict, target_vocab: int | None = None) -> RawEagle3:
    return _read(path, config, "specforge")


# ----------------------------------------------------------------------------- writing

def _layer_config(cfg: Eagle3Config) -> dict:
    d = {"model_type": "qwen3" if cfg.qk_norm else "llama", "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
         "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
         "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
         "attention_bias": cfg.attention_bias, "hidden_act": "silu", "tie_word_embeddings": False,
         "mlp_bias": False}
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d


def _tensors(model: Eagle3Model, cfg: Eagle3Config, target, path: str, fmt: str, with_embed: bool) -> dict:
    out = {}
    for name, a in tree_flatten(model.parameters()):
        if name == "embed_tokens.weight" and not with_embed:
            continue
        if name == "d2t":
            out.update(hf.vocab_maps(a, cfg.vocab_size))
            continue
        out[("midlayer." + name[len("layers.0."):]) if fmt == "specforge" and name.startswith("layers.0.") else name] = a
    if with_embed and "embed_tokens.weight" not in out:
        if getattr(target, "inner", None) is None:
            raise MlxspecError(f"{path}: embed_tokens needs the target: pass target= to save_drafter")
        from mlxspec.targets.model import dense_weight
        out["embed_tokens.weight"] = dense_weight(target.inner.embed_tokens, mx.float32).astype(model.fc.weight.dtype)
    if not cfg.has_lm_head:
        raise MlxspecError(f"{path}: this drafter borrows the target's LM head; the {fmt} format needs lm_head.weight")
    return out


def write_speculators(model: Eagle3Model, cfg: Eagle3Config, path: str, target=None, with_embed: bool = False) -> None:
    """vLLM speculators 0.9.0's layout (`Eagle3SpeculatorConfig`). with_embed: also write the
    target's embedding as embed_tokens. vLLM, SGLang and mlxspec borrow the target's; speculators'
    own loader (`SpeculatorModel.from_pretrained`) needs it in the file, verifier at hand or not:
    without it embed_tokens keeps uninitialised memory (its NaN "not loaded" marker does not survive
    transformers' meta-device loading; tests/test_speculators_eagle3_interop.py)."""
    info = getattr(target, "info", target)
    verifier = cfg.extra.get("verifier")
    if info is not None:
        from mlxspec.cache import verifier_name
        arch = (getattr(target, "config", None) or {}).get("architectures") or \
            [hf.HF_ARCHITECTURES.get(info.model_type, info.model_type)]
        verifier = {"name_or_path": verifier_name(info.source) if info.source else info.model_type,
                    "architectures": list(arch)}
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [int(t) + 1 for t in cfg.target_layer_ids],
        **{k: bool(getattr(cfg, k)) for k in FLAGS},
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.max_drafts}],
            "default_proposal_method": "greedy", "verifier": verifier or {"name_or_path": None, "architectures": []},
        },
    }
    hf.save_dir(path, config, _tensors(model, cfg, target, path, "speculators", with_embed))


def write_specforge(model: Eagle3Model, cfg: Eagle3Config, path: str, target=None, with_embed: bool = False) -> None:
    """SpecForge / SGLang's layout: a flat Llama config, `LlamaForCausalLMEagle3`, taps as
    outputs of layers in `eagle_config`, `midlayer.*`; no embedding (the target's is used)."""
    if cfg.num_hidden_layers != 1:
        raise MlxspecError(f"{path}: the specforge format holds one layer (midlayer); this drafter has "
                           f"{cfg.num_hidden_layers}: write it as speculators")
    if cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output:
        raise MlxspecError(f"{path}: the specforge format has no norm_before_fc / fc_norm / norm_output; write it as "
                           "speculators")
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_layer_config(cfg),
              "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
              "norm_before_residual": bool(cfg.norm_before_residual),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(t) for t in cfg.target_layer_ids],
                               "use_aux_hidden_state": True}}
    hf.save_dir(path, config, _tensors(model, cfg, target, path, "specforge", with_embed))
