"""The inference forward of EAGLE-3 drafters, the engine's drafting (`mlxspec.engine.eagle3`).

The same arithmetic as `Eagle3Model.__call__` (tested equal on every row), in fewer and larger
operations, because a drafter row on the CPU costs its operations more than its arithmetic
(~10 M multiply-adds a row, ~40 operations):
- q, k and v in one matmul over the weights concatenated once (their biases too), gate and up
  in another;
- RoPE by `mx.fast.rope` at contiguous positions from an offset passed as an array, so that each
  compiled function is traced once per row count;
- the work before attention (norms, the concatenation, q/k/v, RoPE) and after it (the output
  projection, residuals, the MLP) and the head (final norm, matmul) each `mx.compile`d.
Attention over the drafter's cache stays outside them (its length changes every step).

Scripts/bench: `scripts/bench_eagle3_draft.py` (ms per draft, plain against this).
Deeper drafters (2+ layers) run each layer so, one after another.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxspec.drafters.eagle3 import Eagle3Model


def top_probability(z: mx.array) -> mx.array:
    """Each row's largest probability under softmax(z) [.., V] -> [..] (lazy, on the device)."""
    return mx.exp(mx.max(z, axis=-1) - mx.logsumexp(z, axis=-1))


class _LayerForward:
    """One layer's work before attention (norms, q/k/v in one matmul, RoPE) and after it (the
    output projection, residual, the MLP with gate and up in one matmul), each `mx.compile`d."""

    def __init__(self, layer, first: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.nh, self.nkv, self.hd = attn.n_heads, attn.n_kv, attn.hd
        self.inter = mlp.gate_proj.weight.shape[0]
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        # [out, in] as nn.Linear keeps them, transposed at the product: an evaluated transposed
        # copy took the slow path (0.16 ms against 0.07 for q, k and v here)
        self.w_qkv = mx.concatenate([p.weight for p in projs], axis=0)
        self.b_qkv = mx.concatenate([p.bias for p in projs]) if "bias" in attn.q_proj else None
        self.w_gu = mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight], axis=0)
        self.freqs = 1.0 / attn._inv  # mx.fast.rope's periods; the inverse frequencies carry any scaling
        mx.eval(self.w_qkv, self.w_gu, self.freqs, *([self.b_qkv] if self.b_qkv is not None else []))
        self.layer, self.attn, self.mlp, self.first = layer, attn, mlp, first
        self.pre = mx.compile(self._pre_first if first else self._pre_plain)
        self.post = mx.compile(self._post_attention)

    def _rope(self, x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(x, self.hd, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.freqs)

    def _pre_first(self, emb: mx.array, hidden: mx.array, offset: mx.array):
        x, res = self.layer.attn_input(emb, hidden)
        return self._qkv(x, offset) + (res,)

    def _pre_plain(self, h: mx.array, offset: mx.array):
        x, res = self.layer.attn_input(h)
        return self._qkv(x, offset) + (res,)

    def _qkv(self, x: mx.array, offset: mx.array):
        qkv = x @ self.w_qkv.T
        if self.b_qkv is not None:
            qkv = qkv + self.b_qkv
        b, l, _ = x.shape
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q = qkv[..., :nq].reshape(b, l, self.nh, self.hd)
        k = qkv[..., nq:nq + nk].reshape(b, l, self.nkv, self.hd)
        v = qkv[..., nq + nk:].reshape(b, l, self.nkv, self.hd).transpose(0, 2, 1, 3)
        if "q_norm" in self.attn:
            q, k = self.attn.q_norm(q), self.attn.k_norm(k)
        qk = self._rope(mx.concatenate([q, k], axis=2).transpose(0, 2, 1, 3), offset)  # one RoPE for both
        return qk[:, :self.nh], qk[:, self.nh:], v

    def _post_attention(self, o: mx.array, res: mx.array) -> mx.array:
        h = res + self.attn.out(o)
        gu = self.layer.post_attention_layernorm(h) @ self.w_gu.T
        g, u = gu[..., :self.inter], gu[..., self.inter:]
        return h + self.mlp.down_proj(g * mx.sigmoid(g) * u)


class FastForward:
    """Built from a loaded `Eagle3Model` (weights read once: rebuild after changing them)."""

    @classmethod
    def of(cls, model: Eagle3Model, head: mx.array) -> "FastForward":
        """The model's inference forward, built once per set of weights (a drafter is built per
        request; its traced functions are kept while the weights are the same arrays)."""
        weights = [a for _, a in tree_flatten([layer.parameters() for layer in model.layers])] + [model.norm.weight, head]
        ff = getattr(model, "_inference_forward", None)
        if ff is None or len(ff.weights) != len(weights) or any(a is not b for a, b in zip(ff.weights, weights)):
            ff = cls(model, head)
            ff.weights = weights
            object.__setattr__(model, "_inference_forward", ff)  # an attribute, never a parameter
        return ff

    def __init__(self, model: Eagle3Model, head: mx.array):
        self.layers = [_LayerForward(layer, i == 0) for i, layer in enumerate(model.layers)]
        self.scale = model.layers[0].self_attn.scale
        self.model, self.head = model, head
        self._logits = mx.compile(self._head)
        self._greedy = mx.compile(self._greedy_head)

    def _head(self, h: mx.array) -> mx.array:
        return (self.model.norm(h) @ self.head.T).astype(mx.float32)

    def _greedy_head(self, h: mx.array):
        z = self._head(h)
        return z, mx.argmax(z, axis=-1), top_probability(z)

    def __call__(self, emb: mx.array, hidden: mx.array, start: int, caches, mask=None, shared: bool = False) -> mx.array:
        """Rows [1, L, H] at positions start.. (appended to `caches`, one per layer) -> the last
        layer's pre-norm outputs. shared: every row at position `start` (the nodes of one depth
        of a tree)."""
        off = mx.array(start, dtype=mx.int32)
        m = emb.shape[1]
        h = None
        for lf, cache in zip(self.layers, caches):
            if shared:  # the rows as a batch of one row each, so that RoPE gives them one position
                args = (emb.reshape(m, 1, -1), hidden.reshape(m, 1, -1)) if lf.first else (h.reshape(m, 1, -1),)
                q, k, v, res = lf.pre(*args, off)
                q, k, v = (x.transpose(2, 1, 0, 3) for x in (q, k, v))  # [m, heads, 1, d] -> [1, heads, m, d]
                res = res.reshape(1, m, -1)
            else:
                q, k, v, res = lf.pre(emb, hidden, off) if lf.first else lf.pre(h, off)
            k, v = cache.update(k, v)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            h = lf.post(o, res)
        return h

    def logits(self, h: mx.array) -> mx.array:
        """Pre-norm outputs [.., H] -> draft-vocabulary logits (float32)."""
        return self._logits(h)

    def greedy(self, h: mx.array):
        """Pre-norm outputs [.., H] -> (logits, argmax, top probability), one compiled function."""
        return self._greedy(h)
