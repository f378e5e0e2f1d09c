"""`mlxspec convert`: a GGUF target written as an MLX directory that mlx_lm loads.

The quantized tensors are written as the lossless MLX affine repack (per-module bits /
group size recorded in config.json's `quantization`, as mlx_lm reads it), or dense
(`dtype="float32"` / `"float16"`). The tokenizer is written as tokenizer.json plus
tokenizer_config.json (chat template, eos) so mlx_lm's tokenizer loader accepts it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxspec.cache import cache_dir, packaged_repo
from mlxspec.errors import MlxspecError
from mlxspec.gguf.file import read_gguf
from mlxspec.logger import say
from mlxspec.targets.load import load_target, resolve_model_path
from mlxspec.targets.model import dequantize_model
from mlxspec.validate import check_free_space, check_output_dir, writing


def convert_to_mlx(model_path: str | None, out: str, dtype: str = "keep", force: bool = False) -> Path:
    """force: write into a non-empty `out` (mlxspec's files in it are replaced; others are kept).
    Files are written to a temporary directory inside `out` and renamed into place, so a failed
    run leaves no half-written file and a symlink in `out` is replaced, never written through."""
    out_p = check_output_dir("--out", out)  # before minutes of loading: a file, /dev/null/x, read-only
    if out_p.is_dir() and any(out_p.iterdir()) and not force:
        raise MlxspecError(f"--out {out}: the directory is not empty; pass a new directory, or --force to replace "
                           "mlxspec's files in it")

    src = resolve_model_path(model_path)
    if Path(src).is_dir():
        raise MlxspecError(f"{src}: already a model directory; convert takes a .gguf file")
    # mlx_lm reads MLX affine layers only: never keep native low-bit GGUF blocks here
    target, tok = load_target(src, dense=False, native_lowbit=False)
    model = target.model
    cfg = dict(target.config)
    if dtype in ("float32", "float16", "bfloat16"):
        dequantize_model(model, getattr(mx, dtype))
        cfg["torch_dtype"] = dtype
    elif dtype != "keep":
        raise MlxspecError(f"--dtype {dtype!r}: use keep, float16, bfloat16 or float32")
    else:
        q = {}
        for name, m in model.named_modules():
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                q[name] = {"group_size": m.group_size, "bits": m.bits}
        if q:
            common = max(({"group_size": v["group_size"], "bits": v["bits"]} for v in q.values()),
                         key=lambda d: sum(1 for v in q.values() if v == d))
            cfg["quantization"] = {**common, **{k: v for k, v in q.items() if v != common}}
    need = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + (16 << 20)  # + tokenizer, configs
    check_free_space("--out", out, need)
    with writing("--out", out):  # no space left, read-only, ... while writing: one line
        out_p.mkdir(parents=True, exist_ok=True)
        final, out_p = out_p, Path(tempfile.mkdtemp(prefix=".mlxspec-convert-", dir=out_p))
        try:
            _write_mlx_dir(out_p, tok, model, cfg, _source_name(src))
            for f in sorted(out_p.iterdir()):
                os.replace(f, final / f.name)  # atomic; replaces a symlink instead of following it
        finally:
            shutil.rmtree(out_p, ignore_errors=True)
    return final


def _write_mlx_dir(out_p: Path, tok, model, cfg: dict, source: str | None = None) -> None:
    tok.save_pretrained(out_p)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_p / "model.safetensors"), weights, metadata={"format": "mlx"})
    if source:  # what the model is, as HF checkpoints say it: the registry recognises the copy by it
        cfg["_name_or_path"] = source
    cfg["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "qwen3": "Qwen3ForCausalLM"}.get(cfg["model_type"], "")]
    cfg["bos_token_id"] = tok.bos_token_id
    # every end-of-generation id (e.g. <|im_end|> and <|endoftext|>): mlx_lm stops on this list
    eos = sorted(tok.eos_token_ids) or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    (out_p / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_p / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": cfg["eos_token_id"]}, indent=2)
    )


def _source_name(src: str) -> str | None:
    """The upstream repo id of a packaged GGUF (by its bytes, whatever its file name), else the
    GGUF's general.name, else None."""
    repo = packaged_repo(src)
    if repo:
        return repo
    try:
        name = read_gguf(src).metadata.get("general.name")
    except MlxspecError:
        return None
    return name if isinstance(name, str) and name else None


def cached_mlx_copy(gguf: str, dtype: str, root: str | None = None, log=None) -> Path:
    """The GGUF target as an MLX directory under <cache>/bench (or `root`), converted once
    and reused while the source file is unchanged (size and mtime stamped in `.source`).
    Used by the benchmarks so mlx_lm runs the very same weights."""

    src = Path(gguf)
    out = (Path(root) if root else cache_dir() / "bench") / f"{src.stem}-{dtype}"
    stamp = out / ".source"
    sig = f"{src.resolve()} {src.stat().st_size} {src.stat().st_mtime_ns}"
    if not (out / "config.json").exists() or not stamp.exists() or stamp.read_text() != sig:
        say(f"writing {src.name} as an MLX directory for mlx_lm: {out} (--dtype {dtype})", log)
        convert_to_mlx(str(src), str(out), dtype=dtype, force=True)
        stamp.write_text(sig)
    return out
