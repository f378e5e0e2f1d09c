"""Target models (Llama, Qwen2, Qwen3 dense, Gemma-3 text) from a GGUF file.

Tensor names map to mlx-lm with `mlxspec.gguf.names`; how each tensor is loaded, and what
it costs in memory, is decided by the load plan (`mlxspec.targets.plan`, also what
`mlxspec inspect` reports); the conversions are `mlxspec.gguf.decode`. Every tensor in the
file's table is either converted or named in the error: nothing is dropped silently.

Tensor types:
- F32 / F16 / BF16: loaded as they are.
- Q4_0 / Q4_1 / Q8_0: kept quantized, repacked losslessly into MLX affine
  quantization (group 32; 4 or 8 bits), exactly what `mx.load` produces for them.
- Q1_0 / Q2_0 / PQ2_0 / PTQ1_0: repacked losslessly (bit-exact) into MLX affine bits 1/2
  (`gguf.quants.repack_mlx`; PTQ1_0's ternary goes to 2 bits, 2.25 instead of 1.75 bpw).
  With a Metal or CUDA kernel backend the Linear layers of these types (all but `lm_head`)
  instead keep the file's blocks as they are, as `targets.lowbit_linear.NativeLowBitLinear`,
  multiplied by the custom low-bit kernel (`native_lowbit_enabled`; off with
  MLXSPEC_NATIVE_LOWBIT=0 or `load_gguf_target(..., native_lowbit=False)`).
- K-quants and other types the `gguf` package can decode: dequantized to float16
  (memory cost: 2 bytes per weight instead of ~0.5).
- With `dense=True` (the float32 CPU path) nothing is rounded to float16: F32/BF16 and
  dequantized tensors stay float32, and `dequantize_model` expands the affine layers
  in float32 arithmetic, so every weight equals `gguf.quants.dequantize` bit for bit.
- Anything else: an error naming each such tensor and its type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec import device, kernels
from mlxspec import validate as V
from mlxspec.errors import MlxspecError
from mlxspec.gguf import decode
from mlxspec.gguf.file import GGUFFile, TensorInfo, read_gguf
from mlxspec.gguf.names import gguf_to_hf_name
from mlxspec.gguf.types import LOWBIT_TYPES, GGMLType
from mlxspec.targets.lowbit_linear import NativeLowBitLinear
from mlxspec.targets.plan import (
    AFFINE,
    BF16,
    NATIVE,
    PLAIN,
    REPACK,
    UNSUPPORTED,
    TensorPlan,
    model_classes,
    plan_target,
)

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# Gemma-3 values llama.cpp does not store but hard-codes (src/llama-model.cpp): the local
# (sliding-window) layers' RoPE base and one global layer in every 6.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_PATTERN = 6


@dataclass
class Converted:
    """One converted tensor: either a plain array or an MLX affine-quantized triple."""

    array: np.ndarray | None = None
    wq: np.ndarray | None = None
    scales: np.ndarray | None = None
    biases: np.ndarray | None = None
    group_size: int = 0
    bits: int = 0
    note: str = ""


def convert_tensor(g: GGUFFile, p: TensorPlan) -> Converted:
    """The tensor's data as its plan says (`p.how` is not UNSUPPORTED)."""
    info = p.info
    raw, t, shape = g.raw(info), info.type_id, info.shape
    if p.how == PLAIN:
        return Converted(array=decode.plain(raw, t, shape))
    if p.how == BF16:  # kept as bf16 values via float32 bits
        return Converted(array=decode.bf16_as_f32(raw, shape), note="bf16")
    if p.how == NATIVE:
        return Converted(array=np.asarray(raw).reshape(shape[0], -1))
    if p.how in (AFFINE, REPACK):
        w, s, b, gs, bits = decode.repack_mlx(raw, t, shape)
        note = "PTQ1_0 repacked losslessly into MLX 2-bit affine (2.25 bpw)" if t == GGMLType.PTQ1_0 else ""
        return Converted(wq=w, scales=s, biases=b, group_size=gs, bits=bits, note=note)
    wide = np.float32 if p.dense else np.float16
    arr = decode.dequantize(raw, t, shape).astype(wide)
    if t in LOWBIT_TYPES:
        note = f"{info.type_name} (not 2-D) dequantized to {np.dtype(wide).name}"
    elif p.dense:
        note = f"{info.type_name} dequantized to float32"
    else:
        note = f"{info.type_name} dequantized to float16 (2 bytes per weight in memory)"
    return Converted(array=arr, note=note)


# ---------------------------------------------------------------- config

def gguf_config(g: GGUFFile) -> dict:
    """mlx-lm style config dict from GGUF metadata."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise MlxspecError(
            f"{g.path}: architecture '{arch}' is not supported as a target; "
            f"supported: {', '.join(SUPPORTED_ARCHS)}"
        )

    where = g.path

    def i(key, lo=1, hi=V.MAX_DIM, **kw):
        return V.get_int(md, f"{arch}.{key}", where, lo, hi, **kw)

    tmap = g.tensor_map()
    n_head = i("attention.head_count")
    hidden = i("embedding_length")
    n_kv = i("attention.head_count_kv", default=n_head)
    if n_head % n_kv:
        raise MlxspecError(f"{where}: {arch}.attention.head_count {n_head} is not a multiple of "
                           f"{arch}.attention.head_count_kv {n_kv}; the file is corrupt or not a supported model")
    if f"{arch}.attention.key_length" not in md and hidden % n_head:
        raise MlxspecError(f"{where}: {arch}.embedding_length {hidden} is not a multiple of "
                           f"{arch}.attention.head_count {n_head}; the file is corrupt or not a supported model")
    head_dim = i("attention.key_length", default=hidden // n_head)
    if head_dim % 2:
        raise MlxspecError(f"{where}: head dimension {head_dim} is odd (RoPE needs an even one); "
                           "the file is corrupt or not a supported model")
    emb = tmap.get("token_embd.weight")
    if emb is None or len(emb.shape) != 2:
        raise MlxspecError(f"{where}: tensor token_embd.weight is missing or not 2-D; the file is incomplete")
    vocab = i("vocab_size", hi=V.MAX_VOCAB, default=emb.shape[0])
    if vocab != emb.shape[0]:
        raise MlxspecError(f"{where}: {arch}.vocab_size {vocab} disagrees with token_embd.weight's "
                           f"{emb.shape[0]} rows; the file is corrupt")
    cfg = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": i("block_count", hi=V.MAX_LAYERS),
        "intermediate_size": i("feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": V.get_float(md, f"{arch}.attention.layer_norm_rms_epsilon", where, 0, 1, default=1e-6,
                                    lo_open=True),
        "vocab_size": vocab,
        "rope_theta": V.get_float(md, f"{arch}.rope.freq_base", where, 0, 1e12, default=10000.0, lo_open=True),
        "tie_word_embeddings": "output.weight" not in tmap,
        "max_position_embeddings": i("context_length", hi=V.MAX_CONTEXT, default=32768),
    }
    if arch == "qwen2":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tmap
    if arch == "gemma3":  # mlx-lm's text-only Gemma-3 (model_type gemma3 is the multimodal wrapper)
        cfg["model_type"] = "gemma3_text"
        cfg["sliding_window"] = i("attention.sliding_window", hi=V.MAX_CONTEXT)
        cfg["sliding_window_pattern"] = GEMMA3_SLIDING_PATTERN
        cfg["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
        # Attention scale 1/sqrt(head_dim), except Gemma-3-27B's (62 layers) 1/sqrt(hidden / heads), as llama.cpp.
        cfg["query_pre_attn_scalar"] = hidden // n_head if cfg["num_hidden_layers"] == 62 else head_dim
    scaling = V.get_str(md, f"{arch}.rope.scaling.type", where, default=None)
    if scaling and scaling != "none":
        if scaling == "linear":
            factor = V.get_float(md, f"{arch}.rope.scaling.factor", where, 0, 1e6, lo_open=True)
            cfg["rope_scaling"] = {"type": "linear", "factor": factor}
        else:
            raise MlxspecError(f"{g.path}: rope scaling '{scaling}' is not supported yet; use a model without it")
    return cfg


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """llama.cpp tensor name -> shape (slowest axis first) the architecture in `cfg` needs."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv, hd = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"], cfg["head_dim"]
    out = {"token_embd.weight": (v, h), "output.weight": (v, h), "output_norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
            b + "attn_q.weight": (q, h), b + "attn_k.weight": (kv, h), b + "attn_v.weight": (kv, h),
            b + "attn_output.weight": (h, q), b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,),
            b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h), b + "ffn_down.weight": (h, f),
            b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
            b + "post_attention_norm.weight": (h,), b + "post_ffw_norm.weight": (h,),
        })
    return out


def check_tensor_shapes(g: GGUFFile, cfg: dict) -> None:
    """Every tensor the architecture knows must have the shape the metadata implies, and
    every layer the metadata declares must have its tensors: checked before any data is
    read or any module is built, with one line naming the tensor."""
    want = expected_shapes(cfg)
    tmap = g.tensor_map()
    for t in g.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= cfg["num_hidden_layers"]:
            raise MlxspecError(f"{g.path}: tensor {t.name} belongs to layer {m.group(1)} but the metadata declares "
                               f"{cfg['num_hidden_layers']} layers ({g.architecture}.block_count); the file is corrupt")
        shape = want.get(t.name)
        if shape is not None and tuple(t.shape) != shape:
            raise MlxspecError(
                f"{g.path}: tensor {t.name} has shape {list(t.shape)} but the metadata "
                f"({cfg['model_type']}: hidden {cfg['hidden_size']}, ffn {cfg['intermediate_size']}, heads "
                f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}, head dim {cfg['head_dim']}, vocab "
                f"{cfg['vocab_size']}) needs {list(shape)}; the file is corrupt or a different variant")
    core = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    missing = [f"blk.{i}.{c}.weight" for i in range(cfg["num_hidden_layers"]) for c in core
               if f"blk.{i}.{c}.weight" not in tmap]
    missing += [n for n in ("token_embd.weight", "output_norm.weight") if n not in tmap]
    missing = [f"{n} ({gguf_to_hf_name(n)})" for n in missing]
    if missing:
        raise MlxspecError(
            f"{g.path}: the metadata declares {cfg['num_hidden_layers']} layers but tensors are missing: "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; the file is incomplete or corrupt")


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation (rows = heads * head_dim).

    The converter reorders each head's rows from HF's rotate-half RoPE layout to ggml's
    interleaved layout. Rows are whole quantization groups, so this works on packed
    weights, scales and biases alike, losslessly.
    """
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def load_gguf_weights(g: GGUFFile, cfg: dict, native: bool = False, dense: bool = False) -> tuple[dict, dict, list[str]]:
    """-> (weights name -> np array, quantization per module prefix, notes).

    quantization: {"group_size", "bits"} for MLX affine layers; with `native`, {"native":
    type id} for layers kept as raw GGUF blocks (`plan.native_eligible`; weight uint8 [N, row
    bytes], rows in the model's order)."""
    weights: dict[str, np.ndarray] = {}
    quant: dict[str, dict] = {}
    notes: list[str] = []
    unsupported: list[TensorInfo] = []
    unknown_names: list[str] = []
    permute = cfg["model_type"] == "llama"
    # llama.cpp's converter stores Gemma's RMSNorm weights +1 (its norm multiplies by the weight);
    # mlx-lm's Gemma-3 norm multiplies by 1 + weight, as the checkpoint stores it.
    norm_offset = 1.0 if cfg["model_type"] == "gemma3_text" else 0.0
    for p in plan_target(g, native, dense):
        name, info = p.name, p.info
        if name is None:
            unknown_names.append(info.name)
            continue
        if p.how == UNSUPPORTED:
            unsupported.append(info)
            continue
        c = convert_tensor(g, p)
        prefix = name.rsplit(".", 1)[0]
        n_perm = None
        if permute and (".q_proj." in name or ".k_proj." in name):
            n_perm = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
        fix = (lambda a: _unpermute(a, n_perm)) if n_perm else (lambda a: a)
        if c.wq is not None:
            weights[name] = fix(c.wq)
            weights[prefix + ".scales"] = fix(c.scales)
            weights[prefix + ".biases"] = fix(c.biases)
            quant[prefix] = {"group_size": c.group_size, "bits": c.bits}
        elif norm_offset and name.endswith("norm.weight"):
            weights[name] = c.array.astype(np.float32) - np.float32(norm_offset)
        else:
            weights[name] = fix(c.array)
            if p.how == NATIVE:
                quant[prefix] = {"native": info.type_id}
        if c.note and c.note not in notes:
            notes.append(c.note)
    if unsupported:
        listed = ", ".join(f"{t.name} ({t.type_name})" for t in unsupported[:8])
        more = f" and {len(unsupported) - 8} more" if len(unsupported) > 8 else ""
        raise MlxspecError(
            f"{g.path}: unsupported tensor type for {listed}{more}; "
            "re-quantize the model to a supported type (F16, BF16, Q8_0, Q4_0, Q4_1, Q1_0, Q2_0, K-quants)"
        )
    if unknown_names:
        raise MlxspecError(
            f"{g.path}: tensors not used by the {cfg['model_type']} model: {', '.join(unknown_names[:8])}"
            f"{' ...' if len(unknown_names) > 8 else ''}; this file is a different architecture or variant"
        )
    return weights, quant, notes


NATIVE_ENV = device.NATIVE_LOWBIT_ENV


def _kernel_backend() -> str:
    return kernels.backend()


def native_lowbit_enabled(override: bool | None = None) -> bool:
    """Keep Q1_0/Q2_0/PQ2_0/PTQ1_0 Linear weights as native GGUF blocks run by the custom
    kernel? `override` True/False decides; None: yes when the kernel backend is "metal" or
    "cuda", unless MLXSPEC_NATIVE_LOWBIT=0. Elsewhere the kernel would only be its MLX
    reference (a repack per call), so the load-time repack is used instead."""
    if override is not None:
        return bool(override)
    if device.current().native_lowbit is False:
        return False
    return _kernel_backend() in ("metal", "cuda")


def _replace_module(model, path: str, new) -> None:
    *parents, last = path.split(".")
    obj = model
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, list) else getattr(obj, p)
    if isinstance(obj, list):
        obj[int(last)] = new
    else:
        setattr(obj, last, new)


def _module_at(model, path: str):
    obj = model
    for p in path.split("."):
        obj = obj[int(p)] if isinstance(obj, list) else getattr(obj, p)
    return obj


def load_gguf_target(path: str, native_lowbit: bool | None = None, dense: bool = False):
    """-> (mlx-lm model, config dict, GGUFFile, notes).

    native_lowbit: see `native_lowbit_enabled` (None = automatic).
    dense: for the float32 dense path (`mlxspec.targets.model.dequantize_model` follows): float
    tensors and tensors dequantized here stay float32 instead of float16, so every weight
    equals `gguf.quants.dequantize` exactly; MLX-quantized layers stay quantized."""
    g = read_gguf(path)
    cfg = gguf_config(g)
    check_tensor_shapes(g, cfg)
    native = native_lowbit_enabled(native_lowbit)
    weights, quant, notes = load_gguf_weights(g, cfg, native=native, dense=dense)
    model_class, args_class = model_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights  # e.g. drops an unused tied lm_head
    natives = {p: q["native"] for p, q in quant.items() if "native" in q}
    affine = {p: q for p, q in quant.items() if "native" not in q}
    for prefix, tid in natives.items():
        lin = _module_at(model, prefix)
        if not isinstance(lin, nn.Linear):
            raise MlxspecError(f"{path}: {prefix} is a {type(lin).__name__}, not a Linear; cannot keep it native")
        n, k = lin.weight.shape
        _replace_module(model, prefix, NativeLowBitLinear(k, n, tid, bias="bias" in lin))
    if natives:
        notes.append(f"{len(natives)} low-bit Linear layers kept as native GGUF blocks (custom kernel)")
    if affine:
        def pred(p, m):
            return affine.get(p, False) if hasattr(m, "to_quantized") else False

        nn.quantize(model, class_predicate=pred)
    want = dict(nn.utils.tree_flatten(model.parameters()))
    missing = [k for k in want if k not in weights]
    if missing:
        raise MlxspecError(
            f"{path}: required tensors are missing: {', '.join(missing[:6])}"
            f"{' ...' if len(missing) > 6 else ''}; the file is incomplete"
        )
    arrays = {}
    for k, v in weights.items():
        a = mx.array(v)
        if a.dtype == mx.float32 and v.ndim == 2 and k.endswith("weight") and not dense:
            a = a.astype(mx.float16)  # dense matrices stored f32: run in f16 like mlx-lm
        arrays[k] = a
    model.load_weights(list(arrays.items()), strict=True)
    mx.eval(model.parameters())
    return model, cfg, g, notes
