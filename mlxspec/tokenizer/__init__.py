"""Tokenizers: built from GGUF metadata (llama.cpp's tokenization) or loaded from a model directory."""

from mlxspec.tokenizer.build import (
    apply_chat_template,
    load_gguf_tokenizer,
    load_hf_tokenizer,
    tokenizer_family,
)

__all__ = ["apply_chat_template", "load_gguf_tokenizer", "load_hf_tokenizer", "tokenizer_family"]
