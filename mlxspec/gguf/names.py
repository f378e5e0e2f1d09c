"""llama.cpp tensor names -> Hugging Face / mlx-lm parameter names (Llama, Qwen2, Qwen3 dense, Gemma-3)."""

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
# Gemma-3 has four norms per block: llama.cpp's ffn_norm is the pre-feedforward one there.
ARCH_LAYER_NAMES = {
    "gemma3": {
        **LAYER_NAMES,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """llama.cpp tensor name of architecture `arch` (general.architecture) -> mlx-lm parameter
    prefix + suffix; None if unknown."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    layer_names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{suffix}"
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    return None

