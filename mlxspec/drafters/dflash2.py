"""DFlash 2 (Inco AI / z-lab, 2026-08) block drafters as MLX modules.

The DFlash backbone (`model.py`) with three additions, named as in z-lab's files:
- `layers.N.attention_conv` / `layers.N.mlp_conv`: a two-tap dynamic depthwise convolution
  before and after each sublayer. d = kernel_projection(n) from the normed sublayer input n,
  viewed [L, side, tap, G] (G = H / conv_group_size); side 0 convolves n, side 1 the
  sublayer's output with the same d:
      out[t, c] = sum_tap (base_kernel[side, tap, c] + d[t, side, tap, c // group]) * x[t - tap, c]
  along the rows of each block only (x[-1] = 0: row 0 has no predecessor).
- logits = tanh(output_multiplier * (h @ head^T) / cap) * cap (no tanh without a cap).
- `candidate_selector`: the chain through each row's top-k candidates
  (`mlxspec.kernels.selector`): score = logit + <P[prev] * hidden_projection(h), S[candidate]>.

Sliding attention (`layer_types`, `sliding_window`) follows z-lab's own MLX port: a block row at
absolute position q sees a context row at position k iff q - k < window, so later rows of a
block see fewer context rows than row 0 (docs/dflash2.md says where mlx-vlm differs). Context
rows go through fc / hidden_norm and each layer's k_proj / k_norm / v_proj as in DFlash; they
are not convolved. Block layout: bonus-anchor (row 0 is the anchor, rows 1..B-1 draft).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel, DraftLayer
from mlxspec.kernels.selector import teacher_scores


class DynamicConv(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        h, kk = c.hidden_size, c.conv_kernel_size
        self.taps, self.group = kk, c.conv_group_size
        self.base_kernel = mx.zeros((2, kk, h))
        self.kernel_projection = nn.Linear(h, 2 * kk * (h // self.group), bias=False)

    def coefficients(self, n: mx.array) -> mx.array:
        """[..., L, H] -> dynamic coefficients [..., L, 2, taps, G]."""
        return self.kernel_projection(n).reshape(*n.shape[:-1], 2, self.taps, n.shape[-1] // self.group)

    def __call__(self, x: mx.array, d: mx.array, side: int, block: int) -> mx.array:
        """Convolve x [..., L, H] along the rows of each `block`-row block with side `side` of d."""
        *lead, L, H = x.shape
        G = H // self.group
        xb = x.reshape(*lead, L // block, block, G, self.group)
        db = d[..., side, :, :].reshape(*lead, L // block, block, self.taps, G, 1)
        out = mx.zeros_like(xb)
        for tap in range(self.taps):
            if tap == 0:
                shifted = xb
            elif tap < block:
                pad = mx.zeros_like(xb[..., :tap, :, :])
                shifted = mx.concatenate([pad, xb[..., : block - tap, :, :]], axis=-3)
            else:
                continue  # reaches before the block: zero
            k = self.base_kernel[side, tap].reshape(G, self.group).astype(x.dtype) + db[..., tap, :, :]
            out = out + k * shifted
        return out.reshape(x.shape)


class DFlash2Layer(DraftLayer):
    def __init__(self, c: DrafterConfig):
        super().__init__(c)
        self.attention_conv = DynamicConv(c)
        self.mlp_conv = DynamicConv(c)

    def __call__(self, x, pos, ctx_k, ctx_v, mask=None, block=None):
        return self.run(x, lambda y: self.self_attn(y, pos, ctx_k, ctx_v, mask), block or x.shape[-2])

    def run(self, x, attend, block: int):
        """The layer with any attention: attend(y) -> self_attn's output for the convolved,
        normed rows y (a trainer passes its own packed-block attention here)."""
        n = self.input_layernorm(x)
        d = self.attention_conv.coefficients(n)
        x = x + self.attention_conv(attend(self.attention_conv(n, d, 0, block)), d, 1, block)
        n = self.post_attention_layernorm(x)
        d = self.mlp_conv.coefficients(n)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(n, d, 0, block)), d, 1, block)


class CandidateSelector(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.top_k = c.selector_top_k
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.predecessor_codebook = mx.zeros((c.vocab_size, c.selector_rank))  # raw arrays on disk: no .weight
        self.successor_codebook = mx.zeros((c.vocab_size, c.selector_rank))


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(ids int32 [..., k], their logits [..., k]) per row, highest logit first."""
    part = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logits, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(part, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


def window_mask(q_pos: mx.array, k_pos: mx.array, window: int | None, causal: bool) -> mx.array:
    """Boolean [..., 1, Lq, Lk]: key at absolute position k is visible to a query at q iff
    q - k < window (z-lab) and, for causal layers, k <= q."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    ok = diff < window if window is not None else mx.ones(diff.shape, dtype=mx.bool_)
    if causal:
        ok = ok & (diff >= 0)
    return ok[..., None, :, :]


def _combine(mask, extra):
    if mask is None:
        return extra
    if mask.dtype == mx.bool_:
        return mask & extra
    return mask + mx.where(extra, 0.0, -mx.inf).astype(mask.dtype)


class DFlash2Model(DFlashModel):
    """Parameters of a DFlash 2 drafter, named as in z-lab files (no embed_tokens / lm_head)."""

    def __init__(self, c: DrafterConfig):
        super().__init__(c)
        self.layers = [DFlash2Layer(c) for _ in range(c.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(c)

    # -- pieces (the trainer's interface, as DFlashModel: context, layer_context_kv, hidden) --
    def logits(self, h: mx.array, head: mx.array) -> mx.array:
        """Block logits: (h @ head^T) * output_multiplier, then the softcap (float32)."""
        return self.scale_logits(h @ head.T)

    def scale_logits(self, z: mx.array) -> mx.array:
        """Output multiplier, then softcap: increasing, so the top-k of raw h @ head^T are the
        top-k of the logits (drafting scales only the k candidates' values)."""
        c = self.config
        z = z.astype(mx.float32) * c.output_multiplier
        if c.final_logit_softcapping:
            z = mx.tanh(z / c.final_logit_softcapping) * c.final_logit_softcapping
        return z

    def selector_inputs(self, h: mx.array, logits: mx.array):
        """(candidate ids [..., n, k], their logits, hidden_projection(h) [..., n, R])."""
        ids, unary = top_candidates(logits, self.config.selector_top_k)
        return ids, unary, self.candidate_selector.hidden_projection(h)

    def selector_scores(self, h: mx.array, logits: mx.array, prev: mx.array):
        """Teacher-forced selector: (ids [..., n, k], scores [..., n, k]) with row t conditioned
        on prev[..., t] (the anchor for the first drafted row, then the label before it)."""
        ids, unary, hp = self.selector_inputs(h, logits)
        cs = self.candidate_selector
        return ids, teacher_scores(unary, ids, hp, cs.predecessor_codebook, cs.successor_codebook, prev)

    def hidden(self, block_emb, block_pos, layer_kv, mask=None, block_size=None, ctx_pos=None,
               anchor_pos: int | None = None) -> mx.array:
        """Block rows [S, L, H] at positions [S, L] with per-layer context (k, v).

        block_size: rows per block (the convs stay inside a block); default L (one block).
        Sliding layers add the window to `mask` (bool, or additive) from the positions:
        context rows at `ctx_pos` [S, Lc] (default 0..Lc-1). `anchor_pos` (drafting: one
        block at anchor_pos.., context = positions 0..anchor_pos-1) takes a fast path: the
        context is sliced to what row 0 can see and no mask is built unless a row needs one.
        """
        c = self.config
        h = self.block_embeddings(block_emb)
        L = h.shape[-2]
        block = block_size or L
        for i, (layer, kv) in enumerate(zip(self.layers, layer_kv)):
            k, v = (None, None) if kv is None else kv
            m = mask
            if c.is_sliding(i) or c.is_causal(i):
                window = c.sliding_window if c.is_sliding(i) else None
                causal = c.is_causal(i)
                if anchor_pos is not None:
                    k, v, m = self._draft_window(k, v, anchor_pos, L, window, causal)
                else:
                    lc = 0 if k is None else k.shape[2]
                    cp = mx.broadcast_to(mx.arange(lc)[None], (block_pos.shape[0], lc)) if ctx_pos is None else ctx_pos
                    m = _combine(mask, window_mask(block_pos, mx.concatenate([cp, block_pos], axis=-1), window, causal))
            h = layer(h, block_pos, k, v, m, block)
        return self.norm(h)

    @staticmethod
    def _draft_window(k, v, p: int, L: int, window: int | None, causal: bool):
        start = 0 if window is None else max(0, p - window + 1)  # row 0 (position p) sees p-window+1..
        if k is not None and start:
            k, v = k[:, :, start:], v[:, :, start:]
        lc = 0 if k is None else k.shape[2]
        if (window is None or p + L - 1 - start < window) and not causal:
            return k, v, None
        q = mx.arange(p, p + L)[None]
        kp = mx.concatenate([mx.arange(start, start + lc), mx.arange(p, p + L)])[None]
        return k, v, window_mask(q, kp, window, causal)
