"""GGUF drafters: `general.architecture = dflash` (llama.cpp mainline, PrismML prism-v7)
and the legacy PrismML `dspark` architecture. Read and write.

Name map: `gguf_name` (DFlashModel name -> GGUF tensor name) is the one table per
format; `model_name` is its inverse. ggml shapes {in, out} are torch [out, in] (the
tolerant reader already reverses them).

Conventions handled here, once:
- taps: `dflash.target_layers` holds layer-INPUT ids (HF id + 1) -> minus 1; the legacy
  `dspark.target_layers` holds HF ids as written by PrismML's converter -> as is.
- d2t: GGUF stores absolute target ids (llama.cpp scatters with them); DFlashModel keeps
  the speculators offsets (target = draft + d2t[draft]).
- metadata vs tensors: a key that is present must agree with the tensors. Absent keys
  mean what llama.cpp makes of them: `log_snr_conditioning` absent = off (so log-SNR
  tensors with no key fail); Markov head and confidence head absent = as the tensors
  say (mainline and PrismML both detect the Markov head from markov_w1, and mainline
  counts a missing has_confidence_head as present). Legacy `dspark`: markov_rank and
  confidence_head absent = off, as PrismML's legacy loader.
"""

from __future__ import annotations

import math
import re

import gguf
import mlx.core as mx
import numpy as np

from mlxspec import validate as V
from mlxspec.drafters.common import (
    RawDrafter,
    _group,
    claim_tensors,
    model_tensors,
    parse_flag,
    to_mx,
)
from mlxspec.drafters.config import DrafterConfig, DrafterSpec
from mlxspec.drafters.features import FeatureRules, infer_features
from mlxspec.errors import MlxspecError
from mlxspec.gguf import decode
from mlxspec.gguf.file import GGUFFile, TensorInfo, type_name
from mlxspec.gguf.types import GGMLType

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {
    "gguf": {
        "fc": "fc",
        "hidden_norm": "enc.output_norm",
        "norm": "output_norm",
        "embed_tokens": "token_embd",
        "lm_head": "output",
        "markov_head.markov_w1": "markov_w1",
        "markov_head.markov_w2": "markov_w2",
        "confidence_head.proj": "conf_proj",
        "log_snr_fc1": "log_snr_fc1",
        "log_snr_fc2": "log_snr_fc2",
    },
    "gguf-dspark-legacy": {
        "fc": "dspark.fc",
        "hidden_norm": "dspark.hidden_norm",
        "norm": "output_norm",
        "embed_tokens": "token_embd",
        "lm_head": "output",
        "markov_head.markov_w1": "dspark.markov_head_a",
        "markov_head.markov_w2": "dspark.markov_head_b",
        "confidence_head.proj": "dspark.confidence_head",
        "log_snr_fc1": "dspark.log_snr_fc1",
        "log_snr_fc2": "dspark.log_snr_fc2",
    },
}


# Absent Markov / confidence keys: as the tensors say for `dflash` (mainline and PrismML
# detect the Markov head from markov_w1, mainline counts a missing has_confidence_head as
# present), off for the legacy `dspark` (PrismML's legacy loader); log-SNR absent is off.
RULES = FeatureRules(
    confidence_keys=("confidence_head", "has_confidence_head"), from_tensors=True, note_prefix="",
    absent={"Markov head": "no dflash.markov_rank; detected from markov_w1.weight",
            "confidence head": "no dflash.confidence_head; detected from conf_proj.weight",
            "log-SNR conditioning": "dflash.log_snr_conditioning is absent"},
)
LEGACY_RULES = FeatureRules(
    confidence_keys=("confidence_head", "has_confidence_head"), from_tensors=False, note_prefix="",
    absent={"Markov head": "dspark.markov_rank is absent", "confidence head": "dspark.confidence_head is absent",
            "log-SNR conditioning": "dspark.log_snr_conditioning is absent"},
    no_reduced_vocab="the legacy dspark format has no reduced vocabulary",
)


# DFlash 2 (llama.cpp PR #27342): the selector's three tensors (the codebooks, raw arrays in
# z-lab files, are `.weight` tensors here) and each layer's two convolutions, whose base
# kernels have no `.weight` (ggml {n_embd, kernel, 2} = torch [2, kernel, H]).
_DFLASH2_TOP = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
_DFLASH2_CONV = {"attention_conv": "attn_conv", "mlp_conv": "ffn_conv"}
_DFLASH2_CONV_PART = {"base_kernel": "base", "kernel_projection.weight": "proj.weight"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def gguf_name(model_name: str, fmt: str) -> str:
    """DFlashModel parameter name -> GGUF tensor name for `fmt` (the one name map)."""
    if model_name == "d2t":
        return "d2t"
    if fmt == "gguf":
        if model_name in _DFLASH2_TOP:
            return _DFLASH2_TOP[model_name]
        m = re.fullmatch(r"layers\.(\d+)\.(attention_conv|mlp_conv)\.(base_kernel|kernel_projection\.weight)", model_name)
        if m:
            return f"blk.{m.group(1)}.{_DFLASH2_CONV[m.group(2)]}_{_DFLASH2_CONV_PART[m.group(3)]}"
    base, _, suffix = model_name.rpartition(".")
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", base)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{suffix}"
    if base in _TOP[fmt]:
        return f"{_TOP[fmt][base]}.{suffix}"
    return model_name  # no GGUF spelling (e.g. gated/rnn Markov parts): never found in a file


def model_name(file_name: str, fmt: str) -> str | None:
    """GGUF tensor name -> DFlashModel name, None when the name is not a drafter tensor."""
    if file_name == "d2t":
        return "d2t"
    if fmt == "gguf":
        inv = {v: k for k, v in _DFLASH2_TOP.items()}
        if file_name in inv:
            return inv[file_name]
        m = re.fullmatch(r"blk\.(\d+)\.(attn|ffn)_conv_(base|proj\.weight)", file_name)
        if m:
            conv = {v: k for k, v in _DFLASH2_CONV.items()}[f"{m.group(2)}_conv"]
            part = {v: k for k, v in _DFLASH2_CONV_PART.items()}[m.group(3)]
            return f"layers.{m.group(1)}.{conv}.{part}"
    base, _, suffix = file_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        inv = {v: k for k, v in _LAYER.items()}
        return f"layers.{m.group(1)}.{inv[m.group(2)]}.{suffix}" if m.group(2) in inv else None
    inv = {v: k for k, v in _TOP[fmt].items()}
    return f"{inv[base]}.{suffix}" if base in inv else None


# ----------------------------------------------------------------------------- reading

class _Meta:
    """Key lookup for one architecture; the legacy `dspark` keys may be doubled."""

    def __init__(self, g: GGUFFile, arch: str, legacy: bool):
        self.md, self.arch, self.legacy = g.metadata, arch, legacy

    def std(self, key, default=None):
        return self.md.get(f"{self.arch}.{key}", default)

    def special_key(self, key) -> str | None:
        """The key under which a drafter-specific value lives, or None if absent."""
        cands = [f"dspark.dspark.{key}", f"dspark.{key}"] if self.legacy else [f"dflash.{key}"]
        return next((k for k in cands if k in self.md), None)

    def special(self, key, default=None):
        k = self.special_key(key)
        return self.md[k] if k is not None else default


def _tensor_array(g: GGUFFile, info: TensorInfo):
    """A GGUF tensor as an array: floats stay F32/F16/BF16, quantized ones are dequantized
    (to float16), integer ones (d2t) stay integer."""
    raw = np.asarray(g.raw(info))
    shape = info.shape
    t = info.type_id
    if t == GGMLType.BF16:
        return mx.array(np.frombuffer(raw, dtype="<u2").reshape(shape)).view(mx.bfloat16)
    if t in decode.PLAIN_DTYPES:
        return decode.plain(raw, t, shape)
    try:
        return decode.dequantize(raw, t, shape).astype(np.float16)
    except (ValueError, NotImplementedError, KeyError) as e:
        raise MlxspecError(
            f"{g.path}: tensor {info.name} has type {type_name(t)}, which mlxspec cannot read for a drafter "
            f"({e}); re-export the drafter with F16/BF16/Q8_0 tensors"
        )


_INT_TYPES = (GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.I64)
_ID_TYPES = (GGMLType.I32, GGMLType.I64)  # d2t: target token ids (llama.cpp writes I32)


def _check_type(g: GGUFFile, info: TensorInfo, mname: str) -> None:
    """The ggml type a tensor must have, whatever its shape says: ids are integers, weights
    are float or quantized. A d2t typed F32 over integer bits would otherwise load as floats
    near zero and map every draft to the wrong token, silently."""
    t = info.type_id
    if mname == "d2t" and t not in _ID_TYPES:
        raise MlxspecError(f"{g.path}: tensor {info.name} has type {type_name(t)}, expected I32 or I64 (target token "
                           "ids); the drafter file is corrupt, re-export it")
    if mname != "d2t" and t in _INT_TYPES:
        raise MlxspecError(f"{g.path}: tensor {info.name} has integer type {type_name(t)}, expected a float or "
                           "quantized type (F32, F16, BF16, Q8_0, ...); the drafter file is corrupt, re-export it")


def _unsupported(g: GGUFFile, m: _Meta) -> None:
    path = g.path
    if (m.special("hyper_connection.count") or m.std("hyper_connection.count") or 0) > 0:
        raise MlxspecError(f"{path}: DeepSeek-V4 DSpark backbones (hyper-connections, MoE) are not supported")
    causal = m.special("attention.causal", m.std("attention.causal"))
    dflash2 = not m.legacy and m.special("selector_top_k") is not None
    if causal is not None and parse_flag(causal, f"{m.arch}.attention.causal", path) and not dflash2:
        raise MlxspecError(f"{path}: causal block attention ({m.arch}.attention.causal=true) is not supported")
    if m.special("decoder_arch") is not None:
        raise MlxspecError(f"{path}: decoder_arch {m.special('decoder_arch')!r} drafters are not supported")
    for k in ("norm_before_fc", "norm_before_residual"):
        if parse_flag(m.special(k, False), f"{m.arch}.{k}", path):
            raise MlxspecError(f"{path}: {m.arch}.{k}=true drafters are not supported")
    ht = m.special("markov_head_type")
    if ht is not None and str(ht).lower() != "vanilla":
        raise MlxspecError(f"{path}: GGUF {ht} Markov heads are not supported (GGUF spells only vanilla heads)")


def _dflash2_fields(m: _Meta, shapes: dict, n_layers: int, path: str) -> dict:
    """DFlash 2 settings of a `dflash` file, {} for DFlash / DSpark. llama.cpp's marker is
    dflash.selector_top_k > 0; a file carrying the selector / conv tensors without it is
    refused with each of them named (llama.cpp would run it as DFlash, silently)."""
    markers = [n for n in shapes if n.startswith("selector_") or re.fullmatch(r"blk\.\d+\.(attn|ffn)_conv_.+", n)]
    top_k = m.special("selector_top_k")
    if top_k is None or V.as_int(top_k, "dflash.selector_top_k", path, 0, V.MAX_VOCAB) == 0:
        if markers:
            kind = lambda n: "DFlash 2 path selector" if n.startswith("selector_") else "DFlash 2 convolutions"  # noqa: E731
            raise MlxspecError(
                f"{path}: {len(markers)} tensors are DFlash 2's but the metadata has no dflash.selector_top_k (the "
                f"marker llama.cpp reads): {_group(markers, kind, {})}; read as DFlash it would draft without them: "
                "re-export the drafter with its DFlash 2 metadata"
            )
        return {}
    f = {}
    for key in DFLASH2_KEYS:
        v = m.special(key)
        if v is None:
            raise MlxspecError(f"{path}: DFlash 2 GGUF (dflash.selector_top_k={top_k}) has no dflash.{key}; the "
                               "drafter file is incomplete")
        f[key] = V.as_int(v, f"dflash.{key}", path, 1, V.MAX_VOCAB)
    f["output_multiplier"] = V.as_float(m.std("logit_scale", 1.0), "dflash.logit_scale", path, 0, 1e6, lo_open=True)
    cap = m.std("final_logit_softcapping")
    f["final_logit_softcapping"] = None if cap is None or float(cap) == 0 else V.as_float(
        cap, "dflash.final_logit_softcapping", path, 0, 1e6, lo_open=True)
    window = m.std("attention.sliding_window")
    if window is not None and V.as_int(window, "dflash.attention.sliding_window", path, 0, 1 << 30) > 0:
        pattern = m.std("attention.sliding_window_pattern", True)
        pattern = list(pattern) if isinstance(pattern, (list, tuple, np.ndarray)) else [pattern] * n_layers
        if len(pattern) == 1:
            pattern = pattern * n_layers
        if len(pattern) != n_layers:
            raise MlxspecError(f"{path}: dflash.attention.sliding_window_pattern has {len(pattern)} entries for "
                               f"{n_layers} layers; the drafter file is corrupt")
        f["layer_types"] = tuple("sliding_attention" if parse_flag(x, "dflash.attention.sliding_window_pattern", path)
                                 else "full_attention" for x in pattern)
        f["sliding_window"] = int(window)
    causal = m.special("attention.causal", m.std("attention.causal"))
    f["block_causal"] = False if causal is None else parse_flag(causal, "dflash.attention.causal", path)
    return f


def detect_dflash(g: GGUFFile, path: str) -> bool:
    return g.architecture == "dflash"


def detect_legacy(g: GGUFFile, path: str) -> bool:
    return g.architecture == "dspark"


def not_a_drafter(g: GGUFFile, path: str) -> MlxspecError:
    return MlxspecError(
        f"{path}: general.architecture = {g.architecture!r} is not a drafter (expected dflash, dspark or eagle3); "
        "pass the drafter GGUF, not the target"
    )


def read_gguf_drafter(path: str, g: GGUFFile, target_vocab: int | None = None) -> RawDrafter:
    """g: the parsed file (arch dflash or dspark). target_vocab: the target's vocabulary
    size, used when the file names none (a drafter that borrows the target's embedding and
    head needs no vocabulary of its own)."""
    arch = g.architecture
    legacy = arch == "dspark"
    fmt = "gguf-dspark-legacy" if legacy else "gguf"
    m = _Meta(g, arch, legacy)
    _unsupported(g, m)
    shapes = {t.name: tuple(t.shape) for t in g.tensors}
    info_of = {t.name: t for t in g.tensors}
    tn = lambda model: gguf_name(model, fmt)  # noqa: E731

    def need_std(key):
        v = m.std(key)
        if v is None:
            raise MlxspecError(f"{path}: GGUF metadata has no {arch}.{key}; the drafter file is incomplete")
        return v

    def dim(key, v=None, hi=V.MAX_DIM):
        return V.as_int(need_std(key) if v is None else v, f"{arch}.{key}", path, 1, hi)

    H = dim("embedding_length")
    heads = dim("attention.head_count")
    dims = dict(
        hidden_size=H,
        intermediate_size=dim("feed_forward_length"),
        num_hidden_layers=dim("block_count", hi=V.MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=dim("attention.head_count_kv", m.std("attention.head_count_kv", heads)),
        head_dim=dim("attention.key_length", m.std("attention.key_length", max(H // heads, 1))),
        rms_norm_eps=V.as_float(m.std("attention.layer_norm_rms_epsilon", 1e-6),
                                f"{arch}.attention.layer_norm_rms_epsilon", path, 0, 1, lo_open=True),
        rope_theta=V.as_float(m.std("rope.freq_base", 10000.0), f"{arch}.rope.freq_base", path, 0, 1e12,
                              lo_open=True),
    )
    th = m.special("target_hidden_size")
    if th is not None and V.as_int(th, f"{arch}.target_hidden_size", path, 1, V.MAX_DIM) != H:
        raise MlxspecError(f"{path}: target_hidden_size {th} differs from the drafter width {H}; not supported")

    # block size: string or int; dflash default 16 (llama.cpp), legacy requires it (PrismML)
    bs = m.special("block_size")
    if bs is None:
        if legacy:
            raise MlxspecError(f"{path}: GGUF metadata has no dspark.block_size; the drafter file is incomplete")
        block = 16
    else:
        try:
            block = int(bs.strip()) if isinstance(bs, str) else V.as_int(bs, f"{arch}.block_size", path, None)
        except ValueError:
            raise MlxspecError(f"{path}: block_size {bs!r} is not an integer") from None
    if block <= 0:
        raise MlxspecError(f"{path}: block_size {block} must be positive")
    if block > V.MAX_BLOCK:
        raise MlxspecError(f"{path}: block_size {block} is larger than {V.MAX_BLOCK}; the file is corrupt")

    layers = m.special("target_layers", m.special("target_layer_ids"))
    if layers is None:
        raise MlxspecError(f"{path}: GGUF metadata has no {arch}.target_layers; the drafter file is incomplete")
    layers = V.as_int_list(layers, f"{arch}.target_layers", path, 0, V.MAX_LAYERS, unique=True, min_len=1)
    taps = layers if legacy else [x - 1 for x in layers]  # dflash stores layer-input ids

    mask = g.metadata.get("tokenizer.ggml.mask_token_id")
    if mask is None:
        mask = m.special("mask_token_id", m.special("noise_token_id"))
    if mask is None:
        raise MlxspecError(
            f"{path}: no mask token id (tokenizer.ggml.mask_token_id or {arch}.mask_token_id); the drafter file "
            "is incomplete"
        )

    layout_key = m.special_key("sample_from_anchor") or (
        "dspark.sample_from_anchor" if legacy else "dflash.sample_from_anchor")
    sfa = m.special("sample_from_anchor")
    layout_value = None if sfa is None else parse_flag(sfa, layout_key, path)

    model_shapes = {model_name(f, fmt): s for f, s in shapes.items() if model_name(f, fmt) is not None}
    lookup = lambda key: None if m.special_key(key) is None else (m.special_key(key), m.special(key))  # noqa: E731
    features, notes = infer_features(lookup, model_shapes, H, LEGACY_RULES if legacy else RULES, path)
    # log-SNR bounds: required when on (as llama.cpp)
    lo, hi = m.special("min_log_snr"), m.special("max_log_snr")
    if features["log_snr"]:
        if lo is None or hi is None:
            raise MlxspecError(f"{path}: log-SNR conditioning is on but min_log_snr/max_log_snr are missing")
        lo = V.as_float(lo, f"{arch}.min_log_snr", path)
        hi = V.as_float(hi, f"{arch}.max_log_snr", path)
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
            raise MlxspecError(f"{path}: log-SNR bounds min {lo}, max {hi} must be finite with max > min")
    lo = V.as_float(lo, f"{arch}.min_log_snr", path, default=-9.0)
    hi = V.as_float(hi, f"{arch}.max_log_snr", path, default=9.0)

    # vocabulary
    draft_vocab = features["draft_vocab_size"]
    vocab = m.std("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in g.metadata:
        vocab = len(g.metadata["tokenizer.ggml.tokens"])
    if vocab is None:
        for cand in (tn("embed_tokens.weight"), tn("markov_head.markov_w1.weight")) + (
                (tn("lm_head.weight"),) if draft_vocab is None else ()):
            if cand in shapes:
                vocab = shapes[cand][0]
                break
    if vocab is None and target_vocab is not None:
        vocab = int(target_vocab)  # embedding and head are borrowed from the target: its vocabulary
    if vocab is None:
        raise MlxspecError(
            f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size, tokenizer or vocab-sized tensor); "
            "load it with its target, or re-export the drafter with its vocab_size"
        )

    spec = DrafterSpec(
        **dims,
        **features,
        **({} if legacy else _dflash2_fields(m, shapes, dims["num_hidden_layers"], path)),
        block_size=block,
        target_layer_ids=taps,
        mask_token_id=V.as_int(mask, "mask_token_id", path, 0, V.MAX_VOCAB),
        vocab_size=V.as_int(vocab, f"{arch}.vocab_size", path, 1, V.MAX_VOCAB),
        min_log_snr=lo,
        max_log_snr=hi,
        source_format=fmt,
        extra={"sliding_window": m.std("attention.sliding_window")},
    )
    # d2t without output.weight: the head is borrowed from the target's rows at the d2t
    # ids (see formats/speculators.py for why mlxspec writes such files).
    extra_claimed = {"fc.scale": (1,)} if (not legacy and "fc.scale" in shapes) else {}
    claimed = claim_tensors(path, spec, shapes, to_model=lambda f: model_name(f, fmt), to_file=tn,
                            notes=notes, extra_claimed=extra_claimed)
    weights = {}
    for fname, mname in claimed.items():
        _check_type(g, info_of[fname], mname)
    if extra_claimed:
        _check_type(g, info_of["fc.scale"], "fc.scale")
    for fname, mname in claimed.items():
        a = _tensor_array(g, info_of[fname])
        if mname == "d2t":
            a = np.asarray(a).astype(np.int64) - np.arange(a.shape[0], dtype=np.int64)  # absolute -> offsets
        weights[mname] = to_mx(mname, a)
    if extra_claimed:  # llama.cpp multiplies fc's output by fc.scale: fold it into the weight
        s = float(np.asarray(_tensor_array(g, info_of["fc.scale"]), dtype=np.float32).reshape(-1)[0])
        w = weights["fc.weight"]
        weights["fc.weight"] = (w.astype(mx.float32) * s).astype(w.dtype)
    return RawDrafter(spec, weights, fmt, layout_key, layout_value, path=path)


# ----------------------------------------------------------------------------- writing

def _np_for_gguf(a: mx.array):
    """(numpy array, raw ggml dtype or None) for GGUFWriter.add_tensor."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)), gguf.GGMLQuantizationType.BF16
    if a.dtype == mx.float16:
        return np.array(a), None
    if mx.issubdtype(a.dtype, mx.floating):
        return np.array(a.astype(mx.float32)), None
    return np.array(a), None


def write_gguf_drafter(model, cfg: DrafterConfig, path: str, fmt: str, doubled_prefix: bool = False) -> None:
    """Write a GGUF drafter. `gguf`: arch dflash, tap ids + 1, explicit
    dflash.sample_from_anchor and DSpark / log-SNR keys. `gguf-dspark-legacy`: arch dspark,
    raw tap ids, `dspark.*` keys (`dspark.dspark.*` with doubled_prefix).

    Refuses gated/rnn Markov heads (no GGUF spelling), and for the legacy format bonus-
    anchor drafters (PrismML's legacy dspark drafter is anchor-first whatever a key says)
    and reduced vocabularies."""
    if cfg.markov_rank and cfg.markov_head_type != "vanilla":
        raise MlxspecError(f"{path}: GGUF cannot hold a {cfg.markov_head_type} Markov head; write it as speculators")
    if fmt == "gguf-dspark-legacy":
        if not cfg.sample_from_anchor:
            raise MlxspecError(
                f"{path}: the legacy dspark GGUF format cannot hold a bonus-anchor (sample_from_anchor=false) "
                "drafter: PrismML reads it anchor-first and would draft one row early; write it as gguf"
            )
        if cfg.draft_vocab_size:
            raise MlxspecError(f"{path}: the legacy dspark GGUF format cannot hold a reduced vocabulary; write it as gguf")
    elif doubled_prefix:
        raise MlxspecError("save_drafter: doubled_prefix applies only to gguf-dspark-legacy")
    if cfg.lineage == "dflash2" and fmt != "gguf":
        raise MlxspecError(f"{path}: the legacy dspark GGUF format cannot hold a DFlash 2 drafter; write it as gguf")
    causal = cfg.block_causal
    if cfg.lineage == "dflash2" and causal is None:  # z-lab's "sliding layers are causal": one flag in GGUF
        kinds = {cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)}
        if len(kinds) > 1:
            raise MlxspecError(f"{path}: GGUF has one dflash.attention.causal for all layers; this drafter is causal "
                               "in its sliding layers only (is_causal absent): write it as zlab")
        causal = kinds.pop()

    arch = "dspark" if fmt == "gguf-dspark-legacy" else "dflash"
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    taps = [int(t) for t in cfg.target_layer_ids]
    if arch == "dflash":
        sp = "dflash."
        w.add_uint32("dflash.block_size", cfg.block_size)
        w.add_array("dflash.target_layers", [t + 1 for t in taps])  # layer-input ids
        w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
        w.add_bool("dflash.has_confidence_head", bool(cfg.confidence_head))  # mainline's spelling
    else:
        sp = "dspark.dspark." if doubled_prefix else "dspark."
        w.add_uint32(sp + "block_size", cfg.block_size)
        w.add_array(sp + "target_layers", taps)  # HF ids, as PrismML's converter writes them
        w.add_uint32(sp + "mask_token_id", cfg.mask_token_id)
    w.add_bool(sp + "sample_from_anchor", bool(cfg.sample_from_anchor))
    w.add_uint32(sp + "markov_rank", cfg.markov_rank)
    w.add_bool(sp + "confidence_head", bool(cfg.confidence_head))
    if cfg.confidence_head:
        w.add_bool(sp + "confidence_head_with_markov", bool(cfg.confidence_head_with_markov and cfg.markov_rank))
    w.add_bool(sp + "log_snr_conditioning", bool(cfg.log_snr))
    if cfg.lineage == "dflash2":
        for key in DFLASH2_KEYS:
            w.add_uint32(f"dflash.{key}", int(getattr(cfg, key)))
        w.add_float32("dflash.logit_scale", float(cfg.output_multiplier))
        if cfg.final_logit_softcapping:
            w.add_float32("dflash.final_logit_softcapping", float(cfg.final_logit_softcapping))
        if cfg.sliding_window and "sliding_attention" in (cfg.layer_types or ()):
            w.add_uint32("dflash.attention.sliding_window", int(cfg.sliding_window))
            w.add_array("dflash.attention.sliding_window_pattern",
                        [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)])
        w.add_bool("dflash.attention.causal", bool(causal))
    if cfg.log_snr:
        w.add_float32(sp + "min_log_snr", cfg.min_log_snr)
        w.add_float32(sp + "max_log_snr", cfg.max_log_snr)

    for name, arr in model_tensors(model).items():
        if name == "d2t":
            ids = np.arange(arr.shape[0], dtype=np.int64) + np.asarray(arr).astype(np.int64)
            w.add_tensor("d2t", ids.astype(np.int32))  # absolute target ids
            continue
        data, raw_dtype = _np_for_gguf(arr)
        w.add_tensor(gguf_name(name, fmt), data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_dflash(model, cfg: DrafterConfig, path: str, target=None, **options) -> None:
    write_gguf_drafter(model, cfg, path, "gguf", **options)


def write_legacy(model, cfg: DrafterConfig, path: str, target=None, **options) -> None:
    write_gguf_drafter(model, cfg, path, "gguf-dspark-legacy", **options)
