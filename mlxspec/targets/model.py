"""The target model: an mlx-lm model plus hidden-state taps and an exactly rollbackable cache.

`Target` runs the mlx-lm model's OWN forward (its masks, its `make_cache()`, its layer
loop): taps are taken by swapping the tapped entries of the decoder's `layers` list for
thin recording wrappers for the duration of one call, so any architecture mlx-lm runs
(Llama, Qwen2/3, Qwen3-MoE, Mistral, Gemma-3 with sliding windows, Qwen3.5 with Gated
DeltaNet layers, ...) is a target, provided its caches can be rolled back exactly
(`mlxspec.targets.rollback`: KV trim, rotating-window restore, recurrent-state replay). Anything
else gets a one-line `MlxspecError` naming the architecture.

Tap convention (the one used everywhere inside mlxspec): tap id k = the output of
decoder layer k (0-based) = HF `hidden_states[k + 1]`. File formats with other
conventions are converted once, at load time.

The wrappers exist only inside a call (the module tree, parameter names, `shard()` and
saving see the plain model); a Target is not meant to be called from two threads at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlxspec import cpu_jit
from mlxspec.blas import govern
from mlxspec.errors import MlxspecError
from mlxspec.targets import host_math, host_rope
from mlxspec.targets.lowbit_linear import NativeLowBitLinear
from mlxspec.targets.rollback import REPLAY_MAX, TargetCache, cache_kind, slice_rows


@dataclass
class TargetInfo:
    """What a drafter must agree with."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    model_type: str
    source: str = ""
    notes: list = field(default_factory=list)


class _Stop(Exception):
    """Raised after the deepest tap of a logits="none" pass: the rest is not needed."""


class _Hook:
    """Stands in for one decoder layer during a call: forwards every attribute to it and
    routes the call through `fn(layer, *args, **kwargs)`."""

    def __init__(self, layer, fn):
        self._mlxspec_layer = layer
        self._mlxspec_fn = fn

    def __getattr__(self, name):
        return getattr(self._mlxspec_layer, name)

    def __call__(self, *args, **kwargs):
        return self._mlxspec_fn(self._mlxspec_layer, *args, **kwargs)


class _LastRow(nn.Module):
    """The final norm, applied to the last position only (logits="last")."""

    def __init__(self, norm):
        super().__init__()
        self.inner = norm

    def __call__(self, h):
        return self.inner(h[:, -1:])


def _decoder(model: nn.Module):
    """The module holding `embed_tokens` and the `layers` list (model.model for mlx-lm's
    text models, language_model.model for the multimodal wrappers)."""
    for m in (getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None)):
        if isinstance(m, nn.Module) and isinstance(m.get("layers") if isinstance(m, dict) else None, list) \
                and "embed_tokens" in m:
            return m
    return None


def _model_type(model, config) -> str:
    return str(config.get("model_type") or getattr(getattr(model, "args", None), "model_type", "")
               or type(model).__module__.rsplit(".", 1)[-1])


class Target:
    #: "replay" or "capture": how recurrent (ArraysCache) layers are rolled back (targets/rollback.py)
    recurrent_rollback = "replay"

    def __init__(self, model: nn.Module, config: dict, source: str = "", notes=None):
        self.model = model
        self.config = config
        mt = _model_type(model, config)
        inner = _decoder(model)
        if inner is None:
            raise MlxspecError(
                f"model_type '{mt}' is not supported as a target: mlxspec needs an mlx-lm decoder with "
                f"embed_tokens and a list of layers ({type(model).__name__} has neither)")
        self.inner = inner
        head = getattr(model, "language_model", None)
        self._head = head if isinstance(head, nn.Module) and getattr(head, "model", None) is inner else model
        try:
            kinds = [cache_kind(c) for c in make_prompt_cache(model)]
        except Exception as e:  # noqa: BLE001 - an mlx-lm model that cannot build its cache
            raise MlxspecError(f"model_type '{mt}' is not supported as a target: make_cache() failed: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if len(kinds) != len(inner.layers) or None in kinds:
            bad = [type(c).__name__ for c in make_prompt_cache(model) if cache_kind(c) is None]
            raise MlxspecError(
                f"model_type '{mt}' is not supported as a target: its cache "
                f"({', '.join(sorted(set(bad))) or f'{len(kinds)} entries for {len(inner.layers)} layers'}) "
                f"cannot be rolled back exactly; supported: KVCache, RotatingKVCache, ArraysCache")
        hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size") \
            or getattr(getattr(model, "args", None), "hidden_size", None) or inner.embed_tokens.weight.shape[1]
        self.info = TargetInfo(
            hidden_size=int(hidden),
            num_layers=len(inner.layers),
            vocab_size=int(inner.embed_tokens.weight.shape[0]),
            model_type=mt,
            source=source,
            notes=list(notes or []),
        )
        cpu_jit.check()  # MLX's kernels built for this CPU: their bits checked before the first forward

    # -- pieces a drafter borrows -------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def lm_head(self, h: mx.array) -> mx.array:
        """Logits from final-normed hidden states (the model's own head or tied embedding)."""
        m = self._head
        if "lm_head" in m and not getattr(m, "tie_word_embeddings", False):
            return m.lm_head(h)
        return self.inner.embed_tokens.as_linear(h)

    def make_cache(self) -> TargetCache:
        """The model's own `make_cache()` caches, with the undo log `trim_cache` needs."""
        return TargetCache(make_prompt_cache(self.model))

    def rollback(self, cache: list, n: int) -> None:
        """Drop the last n positions of `cache` exactly (what a rejected verify wrote)."""
        trim_cache(cache, n)

    # -- forward --------------------------------------------------------------------
    def _run(self, fn, tokens, cache, taps, logits, tree=None):
        """One pass of the model's own forward with the decoder layers hooked (all of them for a
        tree: `mlxspec.targets.tree.TreeForward` replaces their masks and RoPE positions)."""
        inner = self.inner
        layers = inner.layers
        L = tokens.shape[1]
        want = {k: i for i, k in enumerate(taps)}
        for k in taps:
            if not 0 <= k < len(layers):
                raise MlxspecError(f"tap {k} is outside the target's {len(layers)} layers")
        kept: list = [None] * len(taps)
        stop = max(taps) if (logits == "none" and taps) else None
        step = cache.begin(L) if isinstance(cache, TargetCache) else None
        recurrent = {i for i, k in enumerate(cache.kinds) if k == "arrays"} if step is not None else set()
        capture = self.recurrent_rollback == "capture" and L > 1

        def hooked(i):
            def call(layer, x, *args, **kwargs):
                if i in recurrent and capture:
                    c = cache[i]
                    outs, states = [], []
                    for t in range(L):
                        a, kw = slice_rows(args, kwargs, L, t, t + 1)
                        outs.append(layer(x[:, t : t + 1], *a, **kw))
                        states.append((list(c.cache), c.lengths, c.left_padding))
                    step.states[i] = states
                    h = mx.concatenate(outs, axis=1)
                elif tree is not None:
                    h = tree.call_layer(layer, cache[i], x, args, kwargs)
                else:
                    if i in recurrent and L <= REPLAY_MAX:
                        step.inputs[i] = (layer, x, args, kwargs)
                    h = layer(x, *args, **kwargs)
                if i in want:
                    kept[want[i]] = h
                if i == stop:
                    raise _Stop
                return h

            return call

        hooks = set(range(len(layers))) if tree is not None else set(want) | recurrent
        saved = {i: layers[i] for i in hooks}
        norm = inner.get("norm") if logits == "last" else None
        try:
            if tree is not None:
                tree.swap_ropes([saved[i] for i in sorted(saved)])
            for i in hooks:
                layers[i] = _Hook(saved[i], hooked(i))
            if norm is not None:
                inner.norm = _LastRow(norm)
            out = fn()
        except _Stop:
            out = None
        finally:
            if tree is not None:
                tree.restore()
            for i, layer in saved.items():
                layers[i] = layer
            if norm is not None:
                inner.norm = norm
        tap_out = (mx.concatenate(kept, axis=-1) if len(kept) > 1 else kept[0]) if taps else None
        return out, tap_out

    def __call__(
        self,
        tokens: mx.array,
        cache: list,
        taps: Sequence[int] = (),
        logits: str = "all",
        tree=None,
    ) -> tuple[mx.array | None, mx.array | None]:
        """Run tokens [1, L] through the target, appending to `cache`.

        tree: the parents of the L tokens (a tree in topological order, `parents[0] == -1`;
        `mlxspec.targets.tree`): row i then attends to its ancestors only and sits at its
        depth; keep the accepted path with `keep_rows`. Only where `tree_support` is None.

        Returns (logits, taps): logits [1, L, V] ("all"), [1, 1, V] ("last") or None;
        taps [1, L, len(taps) * H] (the outputs of the requested layers, concatenated
        in the requested order) or None. logits="none" stops after the deepest tap, so the
        caches of the layers above it are left behind: use it only on a throw-away cache.
        """
        taps = tuple(taps)
        govern()  # OpenBLAS's thread count follows the host's load (mlxspec.blas.ThreadGovernor)
        tf = None
        if tree is not None and logits != "none":
            from mlxspec.targets.tree import TreeForward

            tf = TreeForward(tree)
            if tf.n != tokens.shape[1]:
                raise ValueError(f"a tree of {tf.n} nodes for {tokens.shape[1]} tokens")
        model = self.inner if logits == "none" else self.model
        # the attention softmax and the SwiGLU on the host, bit for bit MLX's
        with host_math.installed(tokens.shape[1], tokens.shape[1] + _context(cache)), host_rope.installed():
            out, tap_out = self._run(lambda: model(tokens, cache=cache), tokens, cache, taps, logits, tf)
        if logits == "none":
            return None, tap_out
        if logits == "last" and out.shape[1] != 1:
            out = out[:, -1:]
        return out, tap_out

    def forward_hidden(self, tokens: mx.array, taps: Sequence[int]) -> tuple[mx.array, mx.array]:
        """Cache-free causal forward for training: (final normed hidden [B, L, H], taps)."""
        return self._run(lambda: self.inner(tokens), tokens, None, tuple(taps), "hidden")


def _context(cache) -> int:
    """The positions a cache holds, 0 where it cannot say (no cache, recurrent layers only)."""
    try:
        return cache_length(cache) if cache else 0
    except AttributeError:
        return 0


def cache_length(cache: list) -> int:
    for c in cache:
        if hasattr(c, "offset"):
            return int(c.offset)
    return cache.length


def trim_cache(cache: list, n: int) -> None:
    """Drop the last n positions from every layer's cache: exactly (restoring sliding windows
    and recurrent state) for a `Target.make_cache()` cache, by `trim` for a plain list."""
    if isinstance(cache, TargetCache):
        cache.rollback(n)
    elif n > 0:
        for c in cache:
            c.trim(n)


def dense_weight(m: nn.Module, dtype=mx.float32) -> mx.array:
    """The weight of a Linear / Embedding layer as a dense matrix in `dtype`, whether it is
    plain, MLX-quantized or native low-bit: the one helper every caller uses.

    MLX-quantized weights are dequantized with their scales and biases cast to float32
    first: `mx.dequantize` computes in the dtype of the scales, so with the GGUF blocks'
    float16 scales every weight would be rounded to float16. In float32, q * scale + bias
    reproduces `gguf.quants.dequantize` bit for bit (Q4_0 / Q4_1 / Q8_0 / low-bit repacks)."""
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
    `mlxspec.gguf.quants.dequantize`.
    """
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


def target_head_rows(target: Target, ids: mx.array | None) -> mx.array:
    """The target's LM-head rows (all, or the draft vocabulary's), dense float32."""
    m = target.model
    mod = m.lm_head if getattr(m, "lm_head", None) is not None else m.model.embed_tokens
    w = dense_weight(mod, mx.float32)  # exact float32, never via float16
    return w if ids is None else w[ids]


def norm_scale(norm: nn.Module, dims: int) -> mx.array:
    """The per-channel scale an RMSNorm of the target applies, float32, whatever its
    convention: llama-style norms multiply by `weight`, mlx-lm's Gemma norms by
    `1 + weight`. Measured by applying the norm to a row of ones (whose RMS is 1) and
    undoing its eps, so a drafter's plain RMSNorm can start at the target's scale."""
    eps = float(getattr(norm, "eps", 0.0) or 0.0)
    out = norm(mx.ones((1, dims), dtype=mx.float32)).astype(mx.float32)[0]
    return out * math.sqrt(1.0 + eps)
