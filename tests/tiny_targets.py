"""Tiny random-weight mlx-lm models of every target architecture mlxspec claims, built from
mlx-lm's own classes through the same config -> class route `mlx_lm.utils.load_model` takes."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map

from mlxspec.targets.model import Target

WINDOW = 4  # sliding window, smaller than every test context


def tiny_config(arch: str, vocab: int = 64) -> dict:
    base = dict(hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0,
                max_position_embeddings=512, tie_word_embeddings=False)
    if arch == "llama":
        return dict(base, model_type="llama")
    if arch == "qwen3":
        return dict(base, model_type="qwen3", tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return dict(base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                    mlp_only_layers=[0], moe_intermediate_size=16, norm_topk_prob=True)
    if arch == "gemma3":
        return dict(base, model_type="gemma3_text", sliding_window=WINDOW, sliding_window_pattern=2,
                    query_pre_attn_scalar=8, rope_local_base_freq=10000.0)
    if arch == "mistral":  # mlx-lm runs "mistral" with its llama classes; windowed layers via layer_types
        return dict(base, model_type="mistral", sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
    if arch == "qwen3_5":
        return dict(base, model_type="qwen3_5", full_attention_interval=2, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_conv_kernel_dim=4,
                    rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if arch == "llama3_1":  # Llama-3.1: llama with the "llama3" RoPE frequency scaling
        return dict(base, model_type="llama", rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "gpt_oss":  # MoE, attention sinks, sliding-window layers alternating with full ones
        return dict(base, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    raise ValueError(arch)


ARCHS = ["llama", "qwen3", "qwen3_moe", "gemma3", "mistral", "qwen3_5", "llama3_1", "gpt_oss"]


def tiny_model(arch: str, seed: int = 0, vocab: int = 64, base=None, noise: float = 0.0, head_scale: float = 3.0):
    """(mlx-lm model, config). Weights random from `seed`; with `base` (a model of the same
    config), base's weights plus relative Gaussian noise: a related draft model."""
    from mlx_lm.utils import _get_classes

    cfg = tiny_config(arch, vocab)
    model_class, args_class = _get_classes(config=cfg)
    mx.random.seed(seed)
    m = model_class(args_class.from_dict(cfg))
    if base is not None:
        m.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape) * w.std(), base.parameters()))
    else:
        # a peakier head than the init's, so greedy/sampled outputs are not near-uniform
        head = m.language_model if hasattr(m, "language_model") else m
        if "lm_head" in head:  # (a tied head is left alone: scaling the embedding too is far too peaky)
            head.lm_head.weight = head.lm_head.weight * head_scale
    mx.eval(m.parameters())
    return m, cfg


def tiny_target(arch: str, seed: int = 0, vocab: int = 64, **kw) -> Target:
    m, cfg = tiny_model(arch, seed, vocab, **kw)
    return Target(m, cfg, source=f"tiny-{arch}")


def tokenizer_json(n: int) -> dict:
    """A word-level tokenizer over "t0".."t{n-1}" (whitespace-split)."""
    vocab = {f"t{i}": i for i in range(n)}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}


def write_tiny_dir(path, arch: str, seed: int = 0, vocab: int = 64, bits: int | None = None, **kw):
    """An MLX model directory of the tiny `arch` model (mlx-lm's own save_model/save_config),
    with a word-level tokenizer.json: what `mlx_lm.load` and `mlxspec --model` read. bits:
    quantized as mlx_lm.convert -q does (nn.quantize, group size 32, `quantization` in the
    config), like the mlx-community/*-4bit repos."""
    import json
    from pathlib import Path

    import mlx.nn as nn
    from mlx_lm.utils import save_config, save_model

    m, cfg = tiny_model(arch, seed, vocab, **kw)
    if bits is not None:
        nn.quantize(m, group_size=32, bits=bits)
        cfg = dict(cfg, quantization={"group_size": 32, "bits": bits})
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    save_model(p, m)
    save_config(dict(cfg), p / "config.json")
    (p / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab)))
    # without this transformers picks the model family's tokenizer class (Qwen2Tokenizer, ...)
    (p / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return m, str(p)


def write_hub_repo(hf_home, repo: str, arch: str, **kw):
    """`repo` as a cached Hugging Face snapshot under `hf_home` (the layout huggingface_hub's
    cache uses: refs/main -> snapshots/<commit>/...), for offline hub-id tests."""
    return write_tiny_dir(hub_snapshot_dir(hf_home, repo), arch, **kw)


def hub_snapshot_dir(hf_home, repo: str):
    """The snapshot directory of `repo` in the hub cache under `hf_home` (refs/main points to it)."""
    from pathlib import Path

    commit = "0123456789abcdef0123456789abcdef01234567"
    root = Path(hf_home) / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit
