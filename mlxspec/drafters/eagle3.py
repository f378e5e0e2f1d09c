"""EAGLE-3 chain drafters as MLX modules.

One architecture file (mlx-lm's shape): `Eagle3Model` is built from an `Eagle3Config` and
holds its parameters under the vLLM speculators names (`fc`, `layers.0.*` with
`hidden_norm`, `norm`, `lm_head`, `embed_tokens`, `d2t`), so each format in
`mlxspec/drafters/formats/eagle3.py` only maps names.

Forward (the references: speculators' `Eagle3DraftModel`, SGLang's `LlamaForCausalLMEagle3`,
mlx-vlm 0.7.10's `Eagle3DraftModel`):
- the taps of one target position, concatenated in tap order, are fused by `fc` (no bias;
  optionally after one RMSNorm over the concatenation, `norm_before_fc`, or one per tap,
  `fc_norm`) into a hidden row;
- the first layer's attention takes `2 * hidden` inputs: the normed token embedding FIRST,
  then the normed hidden row (`hidden_norm`); its residual is the normed hidden when
  `norm_before_residual`, else the raw one; then the usual post-attention norm and MLP;
- further layers (if any) are plain Llama decoder layers; a final `norm` and the head over
  the draft vocabulary (target id = draft id + d2t[draft id]).

Row i of the drafter pairs the target's taps at position i with the NEXT token x_{i+1} and
sits at RoPE position i. Chain step k+1 feeds the drafter's own pre-norm output of step k
(without `fc`; `norm_output` files feed the post-norm one) with the token just drafted.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import mlx.core as mx
import mlx.nn as nn



@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # head rows; == vocab_size when the file has no reduced vocabulary
    target_hidden_size: int
    target_layer_ids: tuple  # "output of layer k" convention (HF hidden_states[k+1]); () = unresolved
    file_layer_ids: tuple | None = None  # the ids as the file writes them (None: the file has none)
    tap_convention: str = "speculators"  # how the file counts: speculators / llama.cpp (hidden_states index,
    # the input of layer k) | specforge (output of layer)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3-style scaling of the inverse frequencies, when set
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3-style per-head q_norm / k_norm
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated taps before fc (input_norm)
    fc_norm: bool = False  # one RMSNorm per tap before concatenation (fc_norm.N)
    norm_output: bool = False  # chain steps feed the post-norm output (EAGLE 3.1)
    has_embed: bool = False  # file carries embed_tokens (a copy of the target's)
    has_lm_head: bool = True  # False: the head is the target's (tied), full vocabulary only
    max_drafts: int = 7  # chain length the file proposes (speculators' speculative_tokens)
    source_format: str = ""
    extra: dict = field(default_factory=dict)

    lineage = "eagle3"

    @property
    def n_taps(self) -> int:
        return len(self.file_layer_ids or self.target_layer_ids or (0, 0, 0))

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)


def default_taps(num_layers: int) -> list[int]:
    """The taps of a file that names none, from the TARGET's depth: the inputs of layers 2,
    N//2 and N-3 (SafeAILab EAGLE-3, vLLM's and speculators' default), as outputs of layers."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> mx.array:
    """Inverse RoPE frequencies, with Llama 3's wavelength-dependent scaling when asked."""
    inv = 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r}")
    factor = float(scaling["factor"])
    lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = mx.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return mx.where((wavelen <= old / lo) & (wavelen >= old / hi), mid, scaled)


def rope(x: mx.array, positions: mx.array, inv_freq: mx.array) -> mx.array:
    """Rotate-half RoPE (HF layout). x [B, heads, L, D]; positions [L] or [B, L] (int)."""
    d = x.shape[-1]
    ang = positions.astype(mx.float32)[..., None] * inv_freq  # [(B,) L, D/2]
    if ang.ndim == 3:
        ang = ang[:, None]
    cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config, in_dim: int):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = self.hd ** -0.5
        b = c.attention_bias
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.hd, bias=b)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.hd, bias=b)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.n_heads * self.hd, c.hidden_size, bias=b)
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(self.hd, eps=c.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.hd, eps=c.rms_norm_eps)
        self._inv = rope_inv_freq(self.hd, c.rope_theta, c.rope_scaling)

    def qkv(self, x: mx.array, pos: mx.array):
        """x [B, L, in] at positions pos -> q [B, h, L, hd], k, v [B, kv, L, hd] (RoPE applied)."""
        b, l, _ = x.shape
        q = self.q_proj(x).reshape(b, l, self.n_heads, self.hd)
        k = self.k_proj(x).reshape(b, l, self.n_kv, self.hd)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).reshape(b, l, self.n_kv, self.hd).transpose(0, 2, 1, 3)
        return rope(q.transpose(0, 2, 1, 3), pos, self._inv), rope(k.transpose(0, 2, 1, 3), pos, self._inv), v

    def out(self, o: mx.array) -> mx.array:
        b, _, l, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, l, -1))

    def __call__(self, x, pos, cache=None, mask=None):
        q, k, v = self.qkv(x, pos)
        if cache is not None:
            k, v = cache.update(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out(o)


class _Residual(nn.Module):
    """What every chain layer does after attention: the residual, then the MLP with its own."""

    def finish(self, res: mx.array, a: mx.array) -> mx.array:
        h = res + a
        return h + self.mlp(self.post_attention_layernorm(h))


class FirstLayer(_Residual):
    """The EAGLE-3 layer: attention over [norm(embedding) | hidden_norm(hidden)]."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        h = c.hidden_size
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.self_attn = Attention(c, 2 * h)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.mlp = MLP(h, c.intermediate_size)

    def attn_input(self, emb: mx.array, hidden: mx.array):
        """-> (attention input [.., 2H], residual [.., H])."""
        hn = self.hidden_norm(hidden)
        res = hn if self.norm_before_residual else hidden
        return mx.concatenate([self.input_layernorm(emb), hn], axis=-1), res

    def __call__(self, emb, hidden, pos, cache=None, mask=None):
        x, res = self.attn_input(emb, hidden)
        return self.finish(res, self.self_attn(x, pos, cache, mask))


class Layer(_Residual):
    """Layers 1.. of a deeper EAGLE-3 drafter: plain Llama decoder layers."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        h = c.hidden_size
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.self_attn = Attention(c, h)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.mlp = MLP(h, c.intermediate_size)

    def attn_input(self, h: mx.array):
        """-> (attention input, residual), as `FirstLayer.attn_input` gives them."""
        return self.input_layernorm(h), h

    def __call__(self, h, pos, cache=None, mask=None):
        x, res = self.attn_input(h)
        return self.finish(res, self.self_attn(x, pos, cache, mask))


class Eagle3Model(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        th = c.target_hidden_size
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(c.n_taps * th, eps=c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = [nn.RMSNorm(th, eps=c.rms_norm_eps) for _ in range(c.n_taps)]
        self.fc = nn.Linear(c.n_taps * th, c.hidden_size, bias=False)
        self.layers = [FirstLayer(c)] + [Layer(c) for _ in range(1, c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.has_lm_head:
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if c.has_embed:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if c.reduced_vocab:
            self.d2t = mx.zeros((c.draft_vocab_size,), dtype=mx.int32)

    def fuse(self, taps: mx.array) -> mx.array:
        """Target taps [.., n_taps * target_hidden] -> fused hidden rows [.., hidden]."""
        if "input_norm" in self:
            taps = self.input_norm(taps)
        if "fc_norm" in self:
            parts = mx.split(taps, len(self.fc_norm), axis=-1)
            taps = mx.concatenate([n(p) for n, p in zip(self.fc_norm, parts)], axis=-1)
        return self.fc(taps)

    def __call__(self, emb: mx.array, hidden: mx.array, pos: mx.array, caches=None, mask=None) -> mx.array:
        """Token embeddings and hidden rows [B, L, H] at positions pos -> the pre-norm output."""
        caches = caches or [None] * len(self.layers)
        h = self.layers[0](emb, hidden, pos, caches[0], mask)
        for layer, cache in zip(self.layers[1:], caches[1:]):
            h = layer(h, pos, cache, mask)
        return h

    def feedback(self, h: mx.array) -> mx.array:
        """What the next chain step receives as its hidden row."""
        return self.norm(h) if self.config.norm_output else h


class KVCache:
    """Per-layer keys and values of the drafter's rows [1, kv, n, hd]; `length` rows are
    live. Rows past `length` are scratch that the next `update` overwrites, so the chain's
    tentative rows are dropped by `truncate` alone."""

    STEP = 256

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def update(self, k: mx.array, v: mx.array):
        n, p = k.shape[2], self.length
        if self.k is None or p + n > self.k.shape[2]:
            grow = (p + n + self.STEP - 1) // self.STEP * self.STEP
            new = [mx.zeros((*a.shape[:2], grow, a.shape[3]), a.dtype) for a in (k, v)]
            if self.k is not None and p:
                new[0][:, :, :p] = self.k[:, :, :p]
                new[1][:, :, :p] = self.v[:, :, :p]
            self.k, self.v = new
        self.k[:, :, p:p + n] = k
        self.v[:, :, p:p + n] = v
        self.length = p + n
        return self.k[:, :, :p + n], self.v[:, :, :p + n]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def causal_mask(n_new: int, n_total: int) -> mx.array | None:
    """Rows n_total-n_new.. each see every earlier row and themselves (None for one row)."""
    if n_new == 1:
        return None
    q = mx.arange(n_total - n_new, n_total)[:, None]
    return q >= mx.arange(n_total)[None]
