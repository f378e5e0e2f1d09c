"""Load a target model and its tokenizer from a GGUF file or an MLX/HF directory."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model

from mlxspec import device
from mlxspec import validate as V
from mlxspec.cache import PACKAGED_MODELS, default_model_path, packaged_model_path
from mlxspec.errors import MlxspecError
from mlxspec.hub import resolve
from mlxspec.targets.gguf import load_gguf_target
from mlxspec.targets.model import Target, dequantize_model
from mlxspec.targets.plan import model_classes
from mlxspec.tokenizer import load_gguf_tokenizer, load_hf_tokenizer


def default_dense() -> bool:
    """Dense float32 compute on the CPU backend (see `dequantize_model` for why)."""
    return device.current().dense


def resolve_model_path(path: str | None) -> str:
    """None -> the default model; a name in `cache.PACKAGED_MODELS` (unless a local path of that
    name exists) -> its cached GGUF, fetched on first use; a Hugging Face repo id -> its local
    snapshot (like mlx_lm)."""
    if path is None:
        return str(default_model_path())
    if not str(path).strip():  # Path("") is the working directory
        raise MlxspecError("--model is empty: pass a .gguf file, a directory or a Hugging Face repo id, "
                           "or leave it out for the default model")
    if str(path) in PACKAGED_MODELS and not Path(path).exists():
        return str(packaged_model_path(str(path)))

    return resolve(str(path), "model")


def load_target(path: str | None = None, dense: bool | None = None,
                native_lowbit: bool | None = None) -> tuple[Target, TokenizerWrapper]:
    """-> (Target, mlx-lm TokenizerWrapper). `path` None -> the default SmolLM2-135M-Instruct GGUF.

    dense: None = float32 dense on CPU, keep quantized on Metal/CUDA.
    native_lowbit: a GGUF's low-bit weights as native blocks (`load_gguf_target`; None = automatic).
    """
    path = resolve_model_path(path)
    if dense is None:
        dense = default_dense()
    p = Path(path)
    if not p.exists():
        raise MlxspecError(f"{path}: no such file or directory; pass a .gguf file or an MLX/HF model directory")
    if p.is_dir():
        model, config, tok, notes = _load_dir(p)
    else:
        model, config, g, notes = load_gguf_target(str(p), native_lowbit=native_lowbit, dense=dense)
        tok = load_gguf_tokenizer(g.metadata)
    if dense:
        dequantize_model(model, mx.float32)
    target = Target(model, config, source=str(p), notes=notes)
    if tok.vocab_size > target.info.vocab_size:  # the base vocabulary (added tokens may be padding)
        raise MlxspecError(
            f"{path}: tokenizer has {tok.vocab_size} tokens but the model's embedding has "
            f"{target.info.vocab_size} rows; the tokenizer does not belong to this model"
        )
    return target, tok


def _load_dir(p: Path):


    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise MlxspecError(f"{p}: no config.json; pass an MLX/HF model directory or a .gguf file")

    config = V.read_json_object(cfg_path, "model config.json")
    fix = "fix the model's config.json"
    for key, hi in (("hidden_size", V.MAX_DIM), ("num_hidden_layers", V.MAX_LAYERS), ("intermediate_size", V.MAX_DIM),
                    ("num_attention_heads", V.MAX_DIM), ("num_key_value_heads", V.MAX_DIM), ("head_dim", V.MAX_DIM),
                    ("vocab_size", V.MAX_VOCAB), ("max_position_embeddings", V.MAX_CONTEXT)):
        V.get_int(config, key, str(cfg_path), 1, hi, default=None, fix=fix)
    V.get_float(config, "rms_norm_eps", str(cfg_path), 0, 1, default=None, lo_open=True, fix=fix)
    V.get_float(config, "rope_theta", str(cfg_path), 0, 1e12, default=None, lo_open=True, fix=fix)
    mt = config.get("model_type")
    try:  # any architecture mlx-lm implements; Target then checks its caches can be rolled back
        model_classes(config)
    except Exception:  # noqa: BLE001 - mlx-lm's ValueError, or a config its ModelArgs cannot take
        raise MlxspecError(f"{p}: model_type '{mt}' is not supported as a target: mlx-lm "
                           f"has no implementation of it") from None
    if not list(p.glob("*.safetensors")):
        raise MlxspecError(f"{p}: no .safetensors weights found; convert the checkpoint to safetensors")
    for st in sorted(p.glob("*.safetensors")):
        V.check_safetensors(st)  # header, offsets and sizes, before mx.load trusts them
    _check_shapes(p, config, cfg_path)
    try:
        model, config = load_model(p)
    except (ValueError, FileNotFoundError, RuntimeError, OSError, TypeError, KeyError, AttributeError) as e:
        # mlx-lm's own message, often several lines (one per parameter): kept short, on one line
        why = " ".join(str(e).split())
        raise MlxspecError(f"{p}: cannot load weights: {why[:300]}{'...' if len(why) > 300 else ''}; "
                           "the directory's config.json and weights disagree") from None
    if not (p / "tokenizer.json").exists():
        raise MlxspecError(f"{p}: no tokenizer.json; copy the model's tokenizer files into the directory")
    V.require_regular_file(p / "tokenizer.json", "tokenizer.json")
    tok = load_hf_tokenizer(p)
    return model, config, tok, []


_DIM_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "moe_intermediate_size")


def _check_shapes(p: Path, config: dict, cfg_path: Path) -> None:
    """config.json against the weights' shapes (safetensors headers; nothing is read), before
    mlx-lm builds the model: a hidden_size that disagrees with the weights otherwise surfaces
    as MLX's quantize group-size text, which names neither. Quantized tensors are compared
    by the dense shape their packing stands for."""
    from mlx.utils import tree_flatten
    from safetensors import safe_open

    shapes = {}
    for st in sorted(p.glob("*.safetensors")):
        with safe_open(st, framework="numpy") as f:
            shapes.update({k: (tuple(f.get_slice(k).get_shape()), st.name) for k in f.keys()})
    try:
        model_class, args_class = model_classes(config)
        want = dict(tree_flatten(model_class(args_class.from_dict(config)).parameters()))
    except Exception:  # noqa: BLE001 - mlx-lm's loader reports a config it cannot build
        return
    q = config.get("quantization") or config.get("quantization_config") or {}
    for name, param in want.items():
        if name not in shapes:
            continue
        got, file = shapes[name]
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{mod}.scales" in shapes:  # packed: uint32 words of `bits` bits
            bits = (q.get(mod) if isinstance(q.get(mod), dict) else q).get("bits")
            if not isinstance(bits, int) or bits <= 0:
                continue
            got = got[:-1] + (got[-1] * 32 // bits,)
        exp = tuple(param.shape)
        if got != exp:
            keys = [f"{k} {config[k]}" for k in _DIM_KEYS
                    if any(config.get(k) == e for g, e in zip(got, exp) if g != e)]
            raise MlxspecError(
                f"{cfg_path}: config.json does not match the weights: tensor {name} in {file} is {list(got)}, "
                f"config.json makes it {list(exp)}{' (' + ', '.join(keys) + ')' if keys else ''}; fix config.json "
                "or use the weights it came with")
