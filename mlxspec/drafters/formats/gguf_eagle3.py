"""llama.cpp's EAGLE-3 GGUF drafters (`general.architecture = eagle3`). Read and write.

The layout, as llama.cpp's converter writes it (convert_hf_to_gguf.py: the Llama converter
switches to the `eagle3` architecture for a one-layer config with `draft_vocab_size`, and needs
`--target-model-dir` for the target's config and tokenizer) and its loader reads it
(src/models/eagle3.cpp, src/llama-arch.cpp):

- metadata: the usual Llama keys under `eagle3.` (block_count = 1, embedding_length,
  feed_forward_length, attention.head_count / head_count_kv, attention.layer_norm_rms_epsilon,
  rope.freq_base, rope.dimension_count, vocab_size = the TARGET's vocabulary, the target's
  tokenizer), `eagle3.target_hidden_size`, `eagle3.norm_before_residual` (absent = false),
  `eagle3.norm_before_fc` (absent = false; then `enc.output_norm.weight` over the concatenated
  taps), and the three tap ids.
- tap ids: `eagle3.target_layers` (the key llama.cpp shares with DFlash, LLM_KV_TARGET_LAYERS);
  builds from around the merge of PR #18039 read `eagle3.extract_layers` instead. Both hold the
  same numbers, in the same convention: id k is the hidden state ENTERING layer k (the target
  graph stores `t_layer_inp[k]`, PR #18039: "extract ... at layer INPUT"; PR #25794 lets k = N,
  the last layer's output), i.e. HF hidden_states[k], the output of layer k-1. Converted ONCE
  here: mlxspec tap = id - 1. What the converter puts there: the inputs of layers 2, N//2, N-3 of
  the target (from --target-model-dir), or since PR #25794 the draft config's top-level
  `eagle_aux_hidden_state_layer_ids` (speculators' ids, the same convention) when it has them.
- tensors (ggml shapes are {in, out}; the reader reverses them to torch's [out, in]):
  `fc.weight`, `blk.0.attn_norm.weight` (input_layernorm), `blk.0.attn_norm_2.weight`
  (hidden_norm), `blk.0.attn_{q,k,v,output}.weight` (q/k/v take 2 x hidden), `blk.0.ffn_norm`,
  `blk.0.ffn_{gate,up,down}.weight`, `output_norm.weight`, `output.weight` (draft vocabulary rows;
  absent: the target's head), optional `token_embd.weight`, optional `d2t` (I64, ABSOLUTE target
  ids: llama.cpp scatters the draft logits into the target vocabulary with it; the HF offsets
  plus arange), optional `rope_freqs.weight` (Llama-3 RoPE scaling as per-frequency divisors; the
  scaling parameters themselves are not stored). `t2d` is dropped.
- Q/K rows: the `eagle3` architecture uses llama.cpp's "norm" RoPE, so the converter permutes
  q_proj / k_proj rows as for Llama targets; undone here (k with the kv head count).

Stability: the layout changed without a version key: the tap key was renamed (extract_layers ->
target_layers), the loader's revisions named hidden_norm by different tensor ids (the converter
and tensor table followed here write `blk.0.attn_norm_2`), and the head became optional. This
reader takes either tap key (both present must agree) and follows the latest merged converter for
everything else; a file from a fork (`blk.0.hidden_norm`, `d2t.weight` offsets, ...) fails the
strict claiming with its tensors named.
"""

from __future__ import annotations

import math
import re

import gguf
import mlx.core as mx
import numpy as np

from mlxspec import validate as V
from mlxspec.drafters.common import parse_flag
from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model, rope_inv_freq
from mlxspec.drafters.formats.eagle3 import RawEagle3, expected
from mlxspec.drafters.formats.gguf import _check_type, _np_for_gguf, _tensor_array
from mlxspec.errors import MlxspecError
from mlxspec.gguf.file import GGUFFile

ARCH = "eagle3"
FMT = "gguf-eagle3"
TAP_KEYS = ("eagle3.target_layers", "eagle3.extract_layers")  # newest first
FIX = "re-convert the drafter with llama.cpp's convert_hf_to_gguf.py (--target-model-dir)"

# Eagle3Model name inside layer i -> llama.cpp name inside blk.i
_LAYER = {
    "input_layernorm": "attn_norm",
    "hidden_norm": "attn_norm_2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"fc": "fc", "input_norm": "enc.output_norm", "norm": "output_norm", "lm_head": "output",
        "embed_tokens": "token_embd"}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}


def gguf_name(model_name: str) -> str:
    """Eagle3Model parameter name -> llama.cpp tensor name (the one name map)."""
    if model_name == "d2t":
        return "d2t"
    base, _, suffix = model_name.rpartition(".")
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", base)
    if m and m.group(2) in _LAYER:
        return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{suffix}"
    return f"{_TOP[base]}.{suffix}" if base in _TOP else model_name


def model_name(file_name: str) -> str | None:
    """llama.cpp tensor name -> Eagle3Model name; None for a name this drafter has no use for."""
    if file_name == "d2t":
        return "d2t"
    base, _, suffix = file_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        return f"layers.{m.group(1)}.{_LAYER_INV[m.group(2)]}.{suffix}" if m.group(2) in _LAYER_INV else None
    return f"{_TOP_INV[base]}.{suffix}" if base in _TOP_INV else None


def _permute(w, n_head: int):
    """HF rotate-half rows -> llama.cpp's interleaved rows, per head (what the converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w, n_head: int):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- Llama-3 RoPE

def rope_factors(cfg: Eagle3Config) -> np.ndarray | None:
    """The `rope_freqs.weight` llama.cpp's converter writes for a Llama-3-scaled config: the
    divisor of each inverse frequency (1 = unscaled), None without scaling."""
    if not cfg.rope_scaling:
        return None
    plain = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, None), np.float64)
    scaled = np.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), np.float64)
    return (plain / scaled).astype(np.float32)


def llama3_scaling(factors: np.ndarray, head_dim: int, theta: float, path: str) -> dict | None:
    """`rope_freqs.weight` -> an equivalent Llama-3 `rope_scaling` dict (None if every factor is 1).

    The file stores only the per-frequency divisors f: 1 above the high-frequency boundary, the
    scale factor below the low one, 1 / ((1 - s) / factor + s) between, s linear in 1/wavelength.
    Only the boundaries in 1/wavelength are identifiable, so the parameters are chosen to put them
    there (original_max_position_embeddings and the low/high factors fitted, not the checkpoint's),
    and the result is checked to reproduce every divisor; a file it cannot reproduce is refused."""
    f = np.asarray(factors, np.float64).reshape(-1)
    if f.shape[0] != head_dim // 2:
        raise MlxspecError(f"{path}: rope_freqs.weight has {f.shape[0]} values, expected head_dim / 2 = "
                           f"{head_dim // 2}; {FIX}")
    if not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise MlxspecError(f"{path}: rope_freqs.weight has non-positive or non-finite values; {FIX}")
    if np.allclose(f, 1.0, rtol=1e-6, atol=0):
        return None
    factor = float(f.max())
    plain = np.asarray(rope_inv_freq(head_dim, theta, None), np.float64)
    x = plain / (2 * math.pi)  # 1 / wavelength
    hi = np.isclose(f, 1.0, rtol=1e-5, atol=0)
    lo = np.isclose(f, factor, rtol=1e-5, atol=0)
    mid = ~(hi | lo)
    x_lo_max = float(x[lo].max())
    x_hi_min = float(x[hi].min()) if hi.any() else 2.0 * float(x.max())
    s = (1.0 / f[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    if mid.sum() >= 2:  # s = a * x - b, boundaries where s = 0 and s = 1
        a, nb = np.polyfit(x[mid], s, 1)
        x_lb, x_hb = -nb / a, (1.0 - nb) / a
    elif mid.sum() == 1:
        x0, s0 = float(x[mid][0]), float(s[0])
        w = 0.5 * min((x0 - x_lo_max) / s0 if s0 > 0 else math.inf, (x_hi_min - x0) / (1 - s0) if s0 < 1 else math.inf)
        x_lb, x_hb = x0 - s0 * w, x0 + (1 - s0) * w
    else:
        gap = x_hi_min - x_lo_max
        x_lb, x_hb = x_lo_max + gap / 3, x_lo_max + 2 * gap / 3
    scaling = None
    if x_hb > x_lb > 0:
        a = 1.0 / (x_hb - x_lb)
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": x_lb * a,
                   "high_freq_factor": x_lb * a + 1.0, "original_max_position_embeddings": a}
        got = np.asarray(rope_inv_freq(head_dim, theta, scaling), np.float64)
        if not np.allclose(got, plain / f, rtol=1e-4, atol=0):
            scaling = None
    if scaling is None:
        raise MlxspecError(f"{path}: rope_freqs.weight is not a Llama-3 RoPE scaling (the only per-frequency "
                           "scaling mlxspec runs for EAGLE-3 drafters); use a drafter without it or with llama3 "
                           "rope_scaling")
    return scaling


# ----------------------------------------------------------------------------- reading

def detect(g: GGUFFile, path: str) -> bool:
    return g.architecture == ARCH


def _taps(md: dict, path: str) -> list[int]:
    found = {k: V.as_int_list(md[k], k, path, 0, V.MAX_LAYERS, unique=True, min_len=1) for k in TAP_KEYS if k in md}
    if not found:
        raise MlxspecError(f"{path}: GGUF metadata has no {TAP_KEYS[0]} (or {TAP_KEYS[1]}): the target layers the "
                           f"drafter reads; the drafter file is incomplete, {FIX}")
    if len({tuple(v) for v in found.values()}) > 1:
        raise MlxspecError(f"{path}: {TAP_KEYS[0]} = {found[TAP_KEYS[0]]} but {TAP_KEYS[1]} = {found[TAP_KEYS[1]]}; "
                           f"the two spellings of the tap ids must agree: {FIX}")
    ids = next(iter(found.values()))
    if 0 in ids:
        raise MlxspecError(f"{path}: tap id 0 is the input of layer 0 (the token embedding), which mlxspec does not "
                           "tap; use a drafter whose taps are decoder layers")
    return ids


def read(path: str, g: GGUFFile, target_vocab: int | None = None) -> RawEagle3:
    """g: the parsed file (arch eagle3). target_vocab: the target's vocabulary size, used when
    the file names none."""
    md = g.metadata
    info_of = {t.name: t for t in g.tensors}
    shapes = {t.name: tuple(t.shape) for t in g.tensors}

    def key(k, default=None, required=False):
        v = md.get(f"{ARCH}.{k}", default)
        if v is None and required:
            raise MlxspecError(f"{path}: GGUF metadata has no {ARCH}.{k}; the drafter file is incomplete, {FIX}")
        return v

    def dim(k, default=None, hi=V.MAX_DIM):
        return V.as_int(key(k, default, required=True), f"{ARCH}.{k}", path, 1, hi)

    for k in ("fc_norm", "norm_output"):  # per-tap fc norms / post-norm feedback: no GGUF spelling followed here
        if parse_flag(key(k, False), f"{ARCH}.{k}", path):
            raise MlxspecError(f"{path}: {ARCH}.{k} = true is not supported for GGUF EAGLE-3 drafters; use the "
                               "drafter's speculators directory")
    kind = md.get(f"{ARCH}.rope.scaling.type")
    if kind not in (None, "none"):
        raise MlxspecError(f"{path}: {ARCH}.rope.scaling.type = {kind!r} is not supported for EAGLE-3 drafters "
                           "(default or Llama-3 RoPE only); use a drafter trained with one of them")
    H, heads = dim("embedding_length"), dim("attention.head_count")
    head_dim = dim("attention.key_length", max(H // heads, 1))
    if dim("attention.value_length", head_dim) != head_dim:
        raise MlxspecError(f"{path}: {ARCH}.attention.value_length differs from key_length {head_dim}; not an "
                           "EAGLE-3 Llama layer")
    if dim("rope.dimension_count", head_dim) != head_dim:
        raise MlxspecError(f"{path}: {ARCH}.rope.dimension_count {key('rope.dimension_count')} is not the head "
                           f"dimension {head_dim}: partial RoPE is not supported for EAGLE-3 drafters")
    theta = V.as_float(key("rope.freq_base", 10000.0), f"{ARCH}.rope.freq_base", path, 0, 1e12, lo_open=True)
    scaling = None
    if "rope_freqs.weight" in info_of:
        _check_type(g, info_of["rope_freqs.weight"], "rope_freqs")
        scaling = llama3_scaling(np.asarray(_tensor_array(g, info_of["rope_freqs.weight"]), np.float32),
                                 head_dim, theta, path)

    ids = _taps(md, path)
    vocab = key("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in md:
        vocab = len(md["tokenizer.ggml.tokens"])
    if vocab is None and "token_embd.weight" in shapes:
        vocab = shapes["token_embd.weight"][0]
    if vocab is None and "output.weight" in shapes and "d2t" not in shapes:
        vocab = shapes["output.weight"][0]
    if vocab is None and target_vocab is not None:
        vocab = int(target_vocab)  # the drafter borrows the target's embedding: its vocabulary
    if vocab is None:
        raise MlxspecError(f"{path}: cannot tell the target vocabulary size (no {ARCH}.vocab_size, tokenizer or "
                           "vocab-sized tensor); load it with its target")
    vocab = V.as_int(vocab, f"{ARCH}.vocab_size", path, 1, V.MAX_VOCAB)
    has_head = "output.weight" in shapes
    if not has_head and "d2t" in shapes:
        raise MlxspecError(f"{path}: d2t without output.weight: a reduced draft vocabulary needs its own head "
                           f"(llama.cpp would scatter the target's full head with it); {FIX}")
    draft_vocab = shapes["output.weight"][0] if has_head else vocab
    if "d2t" in shapes and shapes["d2t"] != (draft_vocab,):
        raise MlxspecError(f"{path}: d2t has shape {list(shapes['d2t'])} but output.weight has {draft_vocab} rows; "
                           f"{FIX}")
    if draft_vocab != vocab and "d2t" not in shapes:
        raise MlxspecError(f"{path}: draft vocabulary {draft_vocab} (output.weight rows) differs from the target "
                           f"vocabulary {vocab} but the file has no d2t (draft id -> target id); {FIX}")

    cfg = Eagle3Config(
        hidden_size=H, intermediate_size=dim("feed_forward_length"),
        num_hidden_layers=dim("block_count", hi=V.MAX_LAYERS), num_attention_heads=heads,
        num_key_value_heads=dim("attention.head_count_kv", heads), head_dim=head_dim,
        vocab_size=vocab, draft_vocab_size=V.as_int(draft_vocab, "output.weight rows", path, 1, V.MAX_VOCAB),
        target_hidden_size=dim("target_hidden_size"),
        target_layer_ids=tuple(k - 1 for k in ids), file_layer_ids=tuple(ids), tap_convention="llama.cpp",
        rms_norm_eps=V.as_float(key("attention.layer_norm_rms_epsilon", required=True),
                                f"{ARCH}.attention.layer_norm_rms_epsilon", path, 0, 1, lo_open=True),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=V.as_int(key("context_length", 131072), f"{ARCH}.context_length", path, 1, 1 << 30),
        norm_before_residual=parse_flag(key("norm_before_residual", False), f"{ARCH}.norm_before_residual", path),
        norm_before_fc=parse_flag(key("norm_before_fc", False), f"{ARCH}.norm_before_fc", path),
        has_embed="token_embd.weight" in shapes, has_lm_head=has_head, source_format=FMT,
    )
    weights = _claim(g, cfg, path)
    return RawEagle3(cfg, weights, FMT, path)


def _claim(g: GGUFFile, cfg: Eagle3Config, path: str) -> dict:
    """Strict: every file tensor claimed, every needed one present, shapes agree; Q/K rows
    un-permuted, d2t to offsets. Errors name the GGUF tensors."""
    want = expected(cfg)
    unclaimed, bad, claimed = [], [], {}
    for t in g.tensors:
        if t.name == "rope_freqs.weight":
            continue  # read into cfg.rope_scaling
        m = model_name(t.name)
        if m is None or m not in want:
            unclaimed.append(t.name)
        elif tuple(t.shape) != want[m]:
            bad.append(f"{t.name} has shape {list(t.shape)}, expected {list(want[m])}")
        else:
            claimed[m] = t
    missing = [gguf_name(m) for m in want if m not in claimed and gguf_name(m) not in {t.name for t in g.tensors}]
    msgs = []
    if unclaimed:
        msgs.append(f"{len(unclaimed)} tensor(s) not claimed by the EAGLE-3 drafter its metadata describes: "
                    + ", ".join(sorted(unclaimed)[:12]))
    if missing:
        why = {"enc.output_norm.weight": " (eagle3.norm_before_fc = true)"}
        msgs.append("missing tensor(s): " + ", ".join(n + why.get(n, "") for n in sorted(missing)[:12]))
    if bad:
        msgs.append("shape mismatch: " + "; ".join(bad[:8]))
    if msgs:
        raise MlxspecError(f"{path}: " + "; and ".join(msgs) + f"; the file's tensors and metadata disagree: {FIX}")
    for m, t in claimed.items():
        _check_type(g, t, m)
    out = {}
    for m, t in claimed.items():
        a = _tensor_array(g, t)
        if m == "d2t":
            a = np.asarray(a).astype(np.int64) - np.arange(a.shape[0], dtype=np.int64)  # absolute -> offsets
            out[m] = mx.array(a.astype(np.int32))
            continue
        if m.endswith("self_attn.q_proj.weight"):
            a = _unpermute(a, cfg.num_attention_heads)
        elif m.endswith("self_attn.k_proj.weight"):
            a = _unpermute(a, cfg.num_key_value_heads)
        out[m] = a if isinstance(a, mx.array) else mx.array(np.ascontiguousarray(a))
    return out


# ----------------------------------------------------------------------------- writing

def write(model: Eagle3Model, cfg: Eagle3Config, path: str, target=None, **options) -> None:
    """llama.cpp's layout as its converter writes it (both tap keys, so builds before and after
    the rename read it), minus the tokenizer: llama.cpp's loader wants the target's tokenizer in
    the drafter file; mlxspec reads the vocabulary size from `eagle3.vocab_size`. Refuses what
    llama.cpp's EAGLE-3 graph cannot run."""
    if options:
        raise MlxspecError(f"{path}: the gguf-eagle3 format takes no options ({', '.join(options)})")
    why = []
    if cfg.num_hidden_layers != 1:
        why.append(f"{cfg.num_hidden_layers} layers (llama.cpp runs one)")
    if cfg.qk_norm:
        why.append("q/k norms")
    if cfg.attention_bias:
        why.append("attention biases")
    if cfg.fc_norm or cfg.norm_output:
        why.append("fc_norm / norm_output")
    if len(cfg.target_layer_ids) != 3:
        why.append(f"{len(cfg.target_layer_ids) or 'no'} tap ids (llama.cpp takes three)")
    if not cfg.has_lm_head and cfg.reduced_vocab:
        why.append("a reduced vocabulary without its own head")
    if why:
        raise MlxspecError(f"{path}: llama.cpp's EAGLE-3 GGUF cannot hold this drafter: {', '.join(why)}; write it as "
                           "speculators-eagle3")
    w = gguf.GGUFWriter(path, ARCH)
    w.add_uint32(f"{ARCH}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{ARCH}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{ARCH}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{ARCH}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{ARCH}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{ARCH}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{ARCH}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{ARCH}.attention.value_length", cfg.head_dim)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_theta)
    w.add_uint32(f"{ARCH}.rope.dimension_count", cfg.head_dim)
    w.add_uint32(f"{ARCH}.vocab_size", cfg.vocab_size)
    ids = [int(t) + 1 for t in cfg.target_layer_ids]  # layer-input ids
    for k in TAP_KEYS:
        w.add_array(k, ids)
    w.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden_size)
    w.add_bool(f"{ARCH}.norm_before_residual", bool(cfg.norm_before_residual))
    if cfg.norm_before_fc:
        w.add_bool(f"{ARCH}.norm_before_fc", True)
    from mlx.utils import tree_flatten

    for name, a in tree_flatten(model.parameters()):
        if name == "d2t":
            ids_abs = np.arange(a.shape[0], dtype=np.int64) + np.asarray(a).astype(np.int64)
            w.add_tensor("d2t", ids_abs, raw_dtype=gguf.GGMLQuantizationType.I64)
            continue
        data, raw_dtype = _np_for_gguf(a)
        if name.endswith("self_attn.q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(data), raw_dtype=raw_dtype)
    factors = rope_factors(cfg)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
