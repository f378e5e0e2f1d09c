"""DFlash / DSpark block drafters as MLX modules.

One architecture file (mlx-lm's shape): `DFlashModel` is built from a `DrafterConfig`
(`mlxspec/drafters/config.py`) and holds the parameters under the z-lab / DeepSpec
names (no `model.` prefix), so each format in `mlxspec/drafters/formats/` only maps names.

Backbone (DFlash): context = concat(target taps) -> fc -> hidden_norm. Each draft layer
turns context rows into extra K/V with its own k_proj / k_norm / v_proj (no
input_layernorm on context), RoPE at the context rows' absolute positions. Queries
come from block rows only; attention over [context | block] with no mask inside the
block; final norm; logits through the target's LM head unless the file has its own.

DSpark adds a Markov head (bias(prev) = W2 . W1[prev], slot 0 conditioned on the
anchor), a confidence head, and optionally log-SNR conditioning of block rows.

Block layout (`sample_from_anchor`, see config.py): which one a file uses is decided by
`mlxspec.drafters.load.resolve_layout`, never by the type the user asked for.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxspec.drafters.config import DrafterConfig


def rope(x: mx.array, positions: mx.array, theta: float) -> mx.array:
    """Rotate-half RoPE (HF layout) at arbitrary positions.

    x [..., L, D]; positions broadcastable to [..., L] (int). Used for context rows,
    block rows and training alike, so all three agree exactly.
    """
    d = x.shape[-1]
    inv = mx.exp(-math.log(theta) * mx.arange(0, d, 2, dtype=mx.float32) / d)
    ang = positions.astype(mx.float32)[..., None] * inv  # [..., L, D/2]
    cos, sin = mx.cos(ang).astype(x.dtype), mx.sin(ang).astype(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.theta = c.rope_theta
        self.scale = self.hd**-0.5
        h = c.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, h, bias=False)
        self.q_norm = nn.RMSNorm(self.hd, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.hd, eps=c.rms_norm_eps)

    def _kv(self, x: mx.array, pos: mx.array):
        b, l, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, l, self.n_kv, self.hd)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, l, self.n_kv, self.hd).transpose(0, 2, 1, 3)
        return rope(k, pos[:, None, :], self.theta), v

    def context_kv(self, ctx: mx.array, pos: mx.array):
        """Context rows [B, Lc, H] at positions [B, Lc] -> (k, v) [B, n_kv, Lc, hd]."""
        return self._kv(ctx, pos)

    def __call__(self, x, pos, ctx_k, ctx_v, mask=None):
        b, l, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, l, self.n_heads, self.hd)).transpose(0, 2, 1, 3)
        q = rope(q, pos[:, None, :], self.theta)
        k, v = self._kv(x, pos)
        if ctx_k is not None:
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, l, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def __call__(self, x, pos, ctx_k, ctx_v, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), pos, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Markov logit bias of DSpark. W1 = Embedding(V_target, r); W2 = Linear(r -> V_draft).

    Semantics of the three `markov_head_type`s, as in DeepSpec (`build_markov_head`) and
    its public ports in SGLang and vLLM speculators (all agree); h is the row's post-norm
    hidden state, e = W1[prev]:
    - vanilla: bias = W2 . e
    - gated:   g = sigmoid(gate_proj([h ; e])), bias = W2 . (g * e);
               gate_proj: Linear(H + r -> r, bias)
    - rnn:     a carry s starts at 0 for every block; (u, c, o) = split3(joint_proj([s ; e ; h]));
               s' = sigmoid(u) * s + (1 - sigmoid(u)) * tanh(c); bias = W2 . tanh(o);
               joint_proj: Linear(2r + H -> 3r, bias)
    The confidence head always reads e (`state`), never the gated/recurrent latent.
    `step` and `block_bias` are correct for every type; `bias(state(prev))` is the vanilla
    shortcut and refuses the other types. Computed in float32.
    """

    def __init__(self, c: DrafterConfig):
        super().__init__()
        r, vd = c.markov_rank, c.draft_vocab_size or c.vocab_size
        self.kind = c.markov_head_type
        self.rank = r
        self.markov_w1 = nn.Embedding(c.vocab_size, r)
        self.markov_w2 = nn.Linear(r, vd, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(c.hidden_size + r, r, bias=True)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + c.hidden_size, 3 * r, bias=True)
        elif self.kind != "vanilla":
            raise ValueError(f"unknown markov_head_type {self.kind!r} (vanilla, gated, rnn)")

    def state(self, prev: mx.array, hidden: mx.array | None = None) -> mx.array:
        """e = W1[prev] in float32: the confidence head's Markov feature (`hidden` unused)."""
        return self.markov_w1(prev).astype(mx.float32)

    def bias(self, state: mx.array) -> mx.array:
        """W2 . state: the whole bias for a vanilla head. Use `step`/`block_bias` otherwise."""
        if self.kind != "vanilla":
            raise NotImplementedError(
                f"MarkovHead.bias(state) is the vanilla bias; a {self.kind} head needs step() or block_bias()"
            )
        return self.markov_w2(state)

    def step(self, prev: mx.array, hidden: mx.array | None = None, carry: mx.array | None = None):
        """One left-to-right step: (bias [..., V_draft], carry for the next step).

        prev [...] token ids, hidden [..., H] (needed by gated/rnn); carry None at the
        first row of a block (rnn starts from zeros; other types ignore it)."""
        e = self.state(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), None
        h = hidden.astype(mx.float32)
        if self.kind == "gated":
            g = mx.sigmoid(self.gate_proj(mx.concatenate([h, e], axis=-1)))
            return self.markov_w2(g * e), None
        s = mx.zeros_like(e) if carry is None else carry
        u, c, o = mx.split(self.joint_proj(mx.concatenate([s, e, h], axis=-1)), 3, axis=-1)
        u = mx.sigmoid(u)
        return self.markov_w2(mx.tanh(o)), u * s + (1.0 - u) * mx.tanh(c)

    def block_bias(self, prev: mx.array, hidden: mx.array) -> mx.array:
        """Teacher-forced bias for whole blocks: prev [..., L] ids, hidden [..., L, H] ->
        [..., L, V_draft]; position k conditions on prev[..., k] (rnn scans along L)."""
        if self.kind != "rnn":
            return self.step(prev, hidden)[0]
        out, carry = [], None
        for k in range(prev.shape[-1]):
            b, carry = self.step(prev[..., k], hidden[..., k, :], carry)
            out.append(b)
        return mx.stack(out, axis=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        extra = c.markov_rank if (c.confidence_head_with_markov and c.markov_rank) else 0
        self.proj = nn.Linear(c.hidden_size + extra, 1, bias=True)

    def __call__(self, h, state=None):
        x = h if state is None else mx.concatenate([h.astype(mx.float32), state], axis=-1)
        return mx.sigmoid(self.proj(x.astype(mx.float32)))[..., 0]


def log_snr_features(log_snr: mx.array, lo: float, hi: float) -> mx.array:
    """128 features: 64 sin then 64 cos of t * exp(-ln(10000) i / 64), t in [0, 1000]."""
    t = (log_snr - lo) / (hi - lo) * 1000.0
    freqs = mx.exp(-math.log(10000.0) * mx.arange(64, dtype=mx.float32) / 64)
    a = t[..., None] * freqs
    return mx.concatenate([mx.sin(a), mx.cos(a)], axis=-1)


class DFlashModel(nn.Module):
    """Parameters of a DFlash / DSpark drafter, named as in z-lab / DeepSpec files."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        n_taps = len(c.target_layer_ids)
        self.fc = nn.Linear(n_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [DraftLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.has_embed:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if c.has_lm_head:
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size or c.vocab_size, bias=False)
        if c.markov_rank:
            self.markov_head = MarkovHead(c)
        if c.confidence_head:
            self.confidence_head = ConfidenceHead(c)
        if c.draft_vocab_size:
            # EAGLE-3 / speculators convention, kept as stored: target_id = draft_id + d2t[draft_id]
            self.d2t = mx.zeros((c.draft_vocab_size,), dtype=mx.int32)
        if c.log_snr:
            self.log_snr_fc1 = nn.Linear(128, c.hidden_size, bias=True)
            self.log_snr_fc2 = nn.Linear(c.hidden_size, c.hidden_size, bias=True)

    # -- pieces ---------------------------------------------------------------
    def context(self, taps: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(taps))

    def layer_context_kv(self, ctx: mx.array, pos: mx.array) -> list:
        """Per-layer context (k, v) for context rows [B, Lc, H] at positions [B, Lc]."""
        return [layer.self_attn.context_kv(ctx, pos) for layer in self.layers]

    def block_embeddings(self, emb: mx.array) -> mx.array:
        """Add log-SNR conditioning (max on the anchor row, min on mask rows)."""
        if not self.config.log_snr:
            return emb
        c = self.config
        l = emb.shape[-2]
        snr = mx.array([c.max_log_snr] + [c.min_log_snr] * (l - 1), dtype=mx.float32)
        feat = log_snr_features(snr, c.min_log_snr, c.max_log_snr)
        cond = self.log_snr_fc2(nn.silu(self.log_snr_fc1(feat)))
        return emb + cond.astype(emb.dtype)

    def hidden(self, block_emb, block_pos, layer_kv, mask=None) -> mx.array:
        """Block rows [B, L, H] at positions [B, L] with per-layer context (k, v)."""
        h = self.block_embeddings(block_emb)
        for layer, (k, v) in zip(self.layers, layer_kv):
            h = layer(h, block_pos, k, v, mask)
        return self.norm(h)

