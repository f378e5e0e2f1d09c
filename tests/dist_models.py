"""Tiny random-weight target directories for the distributed tests (built from mlx-lm's own
classes, saved as MLX model dirs so every rank loads the very same weights)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

VOCAB = 320

FAMILIES = {
    # heads / kv heads / intermediate divide by 2: mlx-lm's shard() applies
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB,
                  rope_theta=10000.0, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=512,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                      moe_intermediate_size=32, norm_topk_prob=True),
    # mlx-lm runs mistral with its llama classes; sliding-window layers (rotating caches) included
    "mistral": dict(model_type="mistral", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                    rope_theta=10000.0, tie_word_embeddings=False, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}


def _tokenizer_json(n: int) -> dict:
    vocab = {f"t{i}": i for i in range(n)}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}


def write_tiny_target(path, family: str, seed: int = 0) -> str:
    """A random `family` model in `path` (config.json, model.safetensors, tokenizer.json).

    The weights are scaled up so the logits are peaked: greedy argmax has clear margins, as
    in a trained model, instead of near-ties that float summation order could flip."""
    from mlx.utils import tree_flatten, tree_map

    cfg = dict(FAMILIES[family])
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config=cfg)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(cfg))
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * (0.1 if w.ndim > 1 else 0.0) + (w.ndim == 1),
                          model.parameters()))
    emb = model.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape) * 1.0
    if getattr(model, "lm_head", None) is not None:
        model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * 0.5
    mx.eval(model.parameters())
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(p / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (p / "config.json").write_text(json.dumps(cfg))
    (p / "tokenizer.json").write_text(json.dumps(_tokenizer_json(VOCAB)))
    return str(p)
