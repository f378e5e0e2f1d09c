"""The target model: an mlx-lm model plus hidden-state taps and a trimmable cache.

`Target` wraps any mlx-lm dense decoder whose module tree is `model.embed_tokens`,
`model.layers`, `model.norm` (+ `lm_head` or tied embeddings): Llama, Qwen2, Qwen3.
It does not fork those classes; it only walks their layers so it can keep the
residual-stream output of chosen layers ("taps").

Tap convention (the one used everywhere inside mlxspec): tap id k = the output of
decoder layer k (0-based) = HF `hidden_states[k + 1]`. File formats with other
conventions are converted once, at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache


@dataclass
class TargetInfo:
    """What a drafter must agree with."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    model_type: str
    source: str = ""
    notes: list = field(default_factory=list)


class Target:
    def __init__(self, model: nn.Module, config: dict, source: str = "", notes=None):
        self.model = model
        self.config = config
        inner = model.model
        self.info = TargetInfo(
            hidden_size=int(config["hidden_size"]),
            num_layers=len(inner.layers),
            vocab_size=int(inner.embed_tokens.weight.shape[0]),
            model_type=str(config.get("model_type", "")),
            source=source,
            notes=list(notes or []),
        )

    # -- pieces a drafter borrows -------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.model.embed_tokens(tokens)

    def lm_head(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states."""
        if getattr(self.model, "lm_head", None) is not None:
            return self.model.lm_head(h)
        return self.model.model.embed_tokens.as_linear(h)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.model.model.layers]

    # -- forward --------------------------------------------------------------------
    def __call__(
        self,
        tokens: mx.array,
        cache: list,
        taps: Sequence[int] = (),
        logits: str = "all",
    ) -> tuple[mx.array | None, mx.array | None]:
        """Run tokens [1, L] through the target, appending to `cache`.

        Returns (logits, taps): logits [1, L, V] ("all"), [1, 1, V] ("last") or None;
        taps [1, L, len(taps) * H] (the outputs of the requested layers, concatenated
        in the requested order) or None.
        """
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        mask = create_attention_mask(h, cache[0])
        want = {k: i for i, k in enumerate(taps)}
        kept: list = [None] * len(taps)
        last_tap = max(taps) if taps else -1
        for i, (layer, c) in enumerate(zip(inner.layers, cache)):
            h = layer(h, mask, cache=c)
            if i in want:
                kept[want[i]] = h
            if logits == "none" and i == last_tap:
                # Nothing after the deepest tap is needed; the caches of the layers
                # above stay unchanged, so callers must use this only for tap-only
                # passes over a throw-away cache.
                break
        tap_out = mx.concatenate(kept, axis=-1) if taps else None
        if logits == "none":
            return None, tap_out
        if logits == "last":
            h = h[:, -1:]
        return self.lm_head(inner.norm(h)), tap_out

    def forward_hidden(self, tokens: mx.array, taps: Sequence[int]) -> tuple[mx.array, mx.array]:
        """Cache-free causal forward for training: (final normed hidden [B, L, H], taps)."""
        inner = self.model.model
        h = inner.embed_tokens(tokens)
        mask = "causal" if tokens.shape[1] > 1 else None
        want = {k: i for i, k in enumerate(taps)}
        kept: list = [None] * len(taps)
        for i, layer in enumerate(inner.layers):
            h = layer(h, mask, cache=None)
            if i in want:
                kept[want[i]] = h
        return inner.norm(h), mx.concatenate(kept, axis=-1)


def cache_length(cache: list) -> int:
    return cache[0].offset


def trim_cache(cache: list, n: int) -> None:
    """Drop the last n positions from every layer's cache."""
    if n > 0:
        for c in cache:
            c.trim(n)


def dense_weight(m: nn.Module, dtype=mx.float32) -> mx.array:
    """The weight of a Linear / Embedding layer as a dense matrix in `dtype`, whether it is
    plain, MLX-quantized or native low-bit: the one helper every caller uses.

    MLX-quantized weights are dequantized with their scales and biases cast to float32
    first: `mx.dequantize` computes in the dtype of the scales, so with the GGUF blocks'
    float16 scales every weight would be rounded to float16. In float32, q * scale + bias
    reproduces `gguf.quants.dequantize` bit for bit (Q4_0 / Q4_1 / Q8_0 / low-bit repacks)."""
    from .lowbit_linear import NativeLowBitLinear

    if isinstance(m, NativeLowBitLinear):
        return m.dense(dtype)
    if "scales" in m:
        f32 = mx.float32
        biases = m.biases.astype(f32) if m.get("biases") is not None else None
        w = mx.dequantize(m.weight, m.scales.astype(f32), biases, m.group_size, m.bits)
        return w.astype(dtype)
    return m.weight.astype(dtype)


def dequantize_model(model: nn.Module, dtype=mx.float32) -> nn.Module:
    """Replace quantized Linear/Embedding layers by dense ones in `dtype`, in place.

    Why: on Linux CPU, MLX's quantized matmul is a plain loop while dense float32
    matmul goes through BLAS (OpenBLAS when preloaded), so a 16-row verify costs
    ~2x a 1-row decode dense, but ~14x quantized. On Metal / CUDA keep the weights
    quantized: there the quantized kernels are the fast path.

    Also densifies `NativeLowBitLinear` layers (raw GGUF low-bit blocks) exactly, with
    `loading.lowbit.dequantize`.
    """
    from .lowbit_linear import NativeLowBitLinear

    def dense(m):
        if isinstance(m, NativeLowBitLinear):
            lin = nn.Linear(m.input_dims, m.output_dims, bias="bias" in m)
            lin.weight = m.dense(dtype)
            if "bias" in m:
                lin.bias = m.bias.astype(dtype)
            return lin
        w = dense_weight(m, dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            e = nn.Embedding(*w.shape)
            e.weight = w
            return e
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
        lin.weight = w
        if "bias" in m:
            lin.bias = m.bias.astype(dtype)
        return lin

    def walk(mod):
        for key, child in mod.children().items():
            items = child if isinstance(child, list) else [child]
            for i, c in enumerate(items):
                if isinstance(c, (nn.QuantizedLinear, nn.QuantizedEmbedding, NativeLowBitLinear)):
                    if isinstance(child, list):
                        child[i] = dense(c)
                    else:
                        setattr(mod, key, dense(c))
                elif isinstance(c, nn.Module):
                    walk(c)

    walk(model)
    model.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a)
    mx.eval(model.parameters())
    return model
