"""The EAGLE-3 inference forward (`mlxspec.drafters.eagle3_fast.FastForward`, what the engine drafts
with) computes what the drafter's plain forward (`Eagle3Model`, what training and the conformance
tests read) computes: a chain row, k committed pairs under a causal mask, and a tree's depth
(rows at one position under a tree mask), on every option of the layer that changes its
arithmetic (biases, q/k norms, Llama 3 RoPE scaling, the residual after the norm), and for 2-3 layers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.drafters.eagle3 import KVCache, causal_mask
from mlxspec.drafters.eagle3_fast import FastForward
from mlxspec.engine.eagle3 import Eagle3Drafter
from test_eagle3 import eagle3_config, random_eagle3
from tiny_targets import tiny_target

VARIANTS = {
    "plain": {},
    "bias+qk_norm": dict(attention_bias=True, qk_norm=True),
    "llama3 rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "norm before residual": dict(norm_before_residual=True),
    "two layers": dict(num_hidden_layers=2),
    "three layers, bias+qk_norm": dict(num_hidden_layers=3, attention_bias=True, qk_norm=True),
}


def _pair(model, rows: int, seed: int):
    """Two sets of per-layer caches holding the same `rows` committed rows (run by the plain forward)."""
    rng = np.random.default_rng(seed)
    caches = [[KVCache() for _ in model.layers] for _ in range(2)]
    if rows:
        emb = mx.array(rng.standard_normal((1, rows, 32)).astype(np.float32))
        hid = mx.array(rng.standard_normal((1, rows, 32)).astype(np.float32))
        for c in caches:
            mx.eval(model(emb, hid, mx.arange(rows), c, causal_mask(rows, rows)))
    return caches


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_forward_equals_the_plain_forward(variant):
    cfg = eagle3_config(**VARIANTS[variant])
    model = random_eagle3(cfg, seed=7)
    head = model.lm_head.weight
    fast = FastForward(model, head)
    rng = np.random.default_rng(1)

    def rows(n):
        return (mx.array(rng.standard_normal((1, n, 32)).astype(np.float32)),
                mx.array(rng.standard_normal((1, n, 32)).astype(np.float32)))

    for before, n in ((0, 5), (9, 1), (9, 4)):  # the prompt's pairs; a chain row; a step's accepted pairs
        plain_c, fast_c = _pair(model, before, seed=before + n)
        emb, hid = rows(n)
        want = model(emb, hid, mx.arange(before, before + n), plain_c, causal_mask(n, before + n))
        got = fast(emb, hid, before, fast_c, causal_mask(n, before + n))
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
        for fc_, pc in zip(fast_c, plain_c):  # every layer's keys and values
            for a, b in ((fc_.k, pc.k), (fc_.v, pc.v)):
                np.testing.assert_allclose(np.array(a[:, :, :before + n]), np.array(b[:, :, :before + n]),
                                           rtol=1e-5, atol=1e-5)
        z_want = (model.norm(want) @ head.T).astype(mx.float32)
        np.testing.assert_allclose(np.array(fast.logits(got)), np.array(z_want), rtol=1e-5, atol=1e-5)
        z, best, top = fast.greedy(got)  # the chain's head: its argmax and the softmax at it
        zw = np.array(z_want, np.float64)
        np.testing.assert_allclose(np.array(z), zw, rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.array(best), zw.argmax(-1))
        np.testing.assert_allclose(np.array(top), 1.0 / np.exp(zw - zw.max(-1, keepdims=True)).sum(-1), rtol=1e-5)

    # a tree's depth: 3 rows at one position, each seeing the committed rows and one earlier row
    before, m = 6, 3
    plain_c, fast_c = _pair(model, before, seed=3)
    first_e, first_h = rows(2)  # the previous depth's 2 rows, at position `before`
    vis0 = np.zeros((2, before + 2), bool)
    vis0[:, :before] = True
    vis0[[0, 1], [before, before + 1]] = True
    want0 = model(first_e, first_h, mx.full((2,), before, dtype=mx.int32), plain_c, mx.array(vis0))
    got0 = fast(first_e, first_h, before, fast_c, mx.array(vis0), shared=True)
    np.testing.assert_allclose(np.array(got0), np.array(want0), rtol=1e-5, atol=1e-5)
    emb, hid = rows(m)
    vis = np.zeros((m, before + 2 + m), bool)
    vis[:, :before] = True
    vis[[0, 1, 2], [before, before, before + 1]] = True  # parents: row 0, row 0, row 1
    vis[np.arange(m), before + 2 + np.arange(m)] = True
    want = model(emb, hid, mx.full((m,), before + 1, dtype=mx.int32), plain_c, mx.array(vis))
    got = fast(emb, hid, before + 1, fast_c, mx.array(vis), shared=True)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_the_drafter_uses_it_and_drafts_the_same_chains(layers):
    target = tiny_target("llama", seed=0)
    one = eagle3_config(num_hidden_layers=layers)
    assert Eagle3Drafter(random_eagle3(one, seed=5), one, target)._fast is not None

    from mlxspec.engine.verify import SamplingParams

    ids = [1, 5, 9, 2, 7, 3, 11, 4]
    cache = target.make_cache()
    _, taps = target(mx.array([ids]), cache, taps=tuple(one.target_layer_ids), logits="last")
    drafts = {}
    for name in ("fast", "plain"):
        d = Eagle3Drafter(random_eagle3(one, seed=5), one, target, max_drafts=6)
        if name == "plain":
            d._fast = None
        d.begin(ids, taps)
        out = d.draft(3, 6, SamplingParams(), np.random.default_rng(0))
        drafts[name] = (out.tokens, np.round(np.array(out.confidence), 5).tolist())
    assert drafts["fast"] == drafts["plain"]
