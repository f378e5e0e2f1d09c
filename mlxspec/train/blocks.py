"""The training forward: K blocks of every window in one pass, teacher-forced.

Each block attends to the context strictly before its anchor and to its own rows, never to
another block (`block_attention`), which is the attention `DraftAttention` computes at
inference for that anchor alone (tests/test_train.py checks every block, DFlash / DSpark and
DFlash 2). `block_logits` gives the draft logits of the predicting rows, `draft_choice` the
greedy draft of each row given the previous label (DFlash 2: through its path selector).
Used by the trainer's losses and by the held-out replay (`train.heldout`).
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.drafters.model import DFlashModel, rope


def block_attention(attn, x: mx.array, pos: mx.array, ck: mx.array, cv: mx.array, ctx_bias: mx.array) -> mx.array:
    """The drafter's attention for K blocks per window at once, without a K*B x K*B mask.

    x [S, K, B, H] block rows at positions pos [S, K, B]; ck, cv [S, n_kv, L, hd] the
    window's context K/V; ctx_bias [S, 1, 1, K, 1, L] is 0 where a context row lies before
    the block's anchor and -inf elsewhere. Each block attends to its visible context and
    to its own B rows (no mask inside a block), never to another block: the same
    attention as `DraftAttention` at inference, in O(K*B*(L+B)) instead of O((K*B)^2)."""
    S, K, B, _ = x.shape
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.hd
    rep = nh // nkv
    q = attn.q_norm(attn.q_proj(x).reshape(S, K, B, nh, hd))
    k = attn.k_norm(attn.k_proj(x).reshape(S, K, B, nkv, hd))
    v = attn.v_proj(x).reshape(S, K, B, nkv, hd)
    q = q.reshape(S, K, B, nkv, rep, hd).transpose(0, 3, 4, 1, 2, 5)  # [S, nkv, rep, K, B, hd]
    k = k.transpose(0, 3, 1, 2, 4)[:, :, None]  # [S, nkv, 1, K, B, hd]
    v = v.transpose(0, 3, 1, 2, 4)[:, :, None]
    p6 = pos[:, None, None]
    q = rope(q, p6, attn.theta) * attn.scale
    k = rope(k, p6, attn.theta)
    L = ck.shape[2]
    s_ctx = (q.reshape(S, nkv, rep * K * B, hd) @ ck.swapaxes(-1, -2)).reshape(S, nkv, rep, K, B, L) + ctx_bias
    s_blk = q @ k.swapaxes(-1, -2)  # [S, nkv, rep, K, B, B]
    p = mx.softmax(mx.concatenate([s_ctx, s_blk], axis=-1), axis=-1, precise=True)
    o = (p[..., :L].reshape(S, nkv, rep * K * B, L) @ cv).reshape(S, nkv, rep, K, B, hd) + p[..., L:] @ v
    return attn.o_proj(o.transpose(0, 3, 4, 1, 2, 5).reshape(S, K, B, nh * hd))


def block_hidden(model: DFlashModel, taps: mx.array, emb: mx.array, pos: mx.array, anchors: mx.array) -> mx.array:
    """Post-norm hidden states [S, K, B, H] of K blocks per window (training forward).

    taps [S, L, T*H] float32; emb [S, K, B, H] block embeddings; anchors [S, K]."""
    S, L, _ = taps.shape
    ctx = model.context(taps)
    layer_kv = model.layer_context_kv(ctx, mx.broadcast_to(mx.arange(L)[None], (S, L)))
    visible = mx.arange(L)[None, None, :] < anchors[:, :, None]  # [S, K, L]
    ctx_bias = mx.where(visible, 0.0, -mx.inf).astype(mx.float32)[:, None, None, :, None, :]
    h = model.block_embeddings(emb)
    for layer, (ck, cv) in zip(model.layers, layer_kv):
        h = h + block_attention(layer.self_attn, layer.input_layernorm(h), pos, ck, cv, ctx_bias)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def block_hidden_dflash2(model, taps: mx.array, emb: mx.array, pos: mx.array, anchors: mx.array) -> mx.array:
    """`block_hidden` for DFlash 2 (`drafters/dflash2.py`): each layer's dynamic convs run along
    the rows of each block (`DFlash2Layer.run`), attention is `block_attention`. Full-attention,
    non-causal layers only (what `mlxspec train` builds)."""
    S, L, _ = taps.shape
    _, K, B, H = emb.shape
    ctx = model.context(taps)
    layer_kv = model.layer_context_kv(ctx, mx.broadcast_to(mx.arange(L)[None], (S, L)))
    visible = mx.arange(L)[None, None, :] < anchors[:, :, None]
    ctx_bias = mx.where(visible, 0.0, -mx.inf).astype(mx.float32)[:, None, None, :, None, :]
    h = model.block_embeddings(emb).reshape(S, K * B, H)
    for layer, (ck, cv) in zip(model.layers, layer_kv):
        def attend(y, layer=layer, ck=ck, cv=cv):
            return block_attention(layer.self_attn, y.reshape(S, K, B, H), pos, ck, cv, ctx_bias).reshape(S, K * B, H)

        h = layer.run(h, attend, B)
    return model.norm(h).reshape(S, K, B, H)


def block_logits(model: DFlashModel, frozen: dict, b: dict):
    """Teacher-forced draft logits [S, K, n, V_draft] of the predicting rows of every block
    (Markov bias conditioned on b["prev"]; DFlash 2: multiplier and softcap), their hidden
    states and the Markov state."""
    c = model.config
    emb = frozen["embed"][b["block_tok"]]  # [S, K, B, H]
    if c.lineage == "dflash2":
        h = block_hidden_dflash2(model, b["taps"], emb, b["pos"], b["anchors"])
        h = h[:, :, c.layout.first_row:]
        return model.scale_logits(h @ frozen["head"].T), h, None
    h = block_hidden(model, b["taps"], emb, b["pos"], b["anchors"])
    h = h[:, :, c.layout.first_row:]  # predicting rows [S, K, n, H]
    logits = h @ frozen["head"].T  # [S, K, n, Vd]
    state = None
    if c.markov_rank:
        state = model.markov_head.state(b["prev"])
        logits = logits + model.markov_head.block_bias(b["prev"], h)
    return logits.astype(mx.float32), h, state


def draft_choice(model, logits: mx.array, h: mx.array, prev: mx.array) -> mx.array:
    """The greedy draft of each row given the teacher-forced previous token (draft ids):
    the argmax of the logits, or for DFlash 2 the path selector's pick among its top-k."""
    if model.config.lineage != "dflash2":
        return mx.argmax(logits, axis=-1)
    ids, scores = model.selector_scores(h, logits, prev)
    return mx.take_along_axis(ids, mx.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
