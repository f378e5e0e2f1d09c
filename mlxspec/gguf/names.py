"""llama.cpp tensor names -> Hugging Face / mlx-lm parameter names (Llama, Qwen2, Qwen3 dense)."""

from __future__ import annotations

import re

# llama.cpp name inside a block -> mlx-lm name inside `model.layers.<i>`
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> mlx-lm parameter prefix + suffix; None if unknown."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    return None

