"""Verification as pure functions, on hand-made distributions (no model inside).

Statistical checks use a total-variation bound that holds with probability >= 1 - DELTA
for the empirical distribution of N i.i.d. draws from the exact one (see `tv_bound`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.engine.verify import SamplingParams, accept_greedy, accept_sampled, probs_from_logits, sample_token, target_probs

DELTA = 1e-4


def tv_bound(p: np.ndarray, n: int, delta: float = DELTA) -> float:
    """Upper bound on TV(empirical of n draws, p) that fails with probability <= delta.

    E[TV] <= 1/2 sum_k sqrt(p_k (1 - p_k) / n) (Jensen on each |count/n - p_k|), and TV moves
    by at most 1/n when one draw changes, so McDiarmid adds sqrt(ln(1/delta) / (2n)).
    """
    p = np.asarray(p, dtype=np.float64)
    return 0.5 * float(np.sum(np.sqrt(p * (1 - p) / n))) + math.sqrt(math.log(1 / delta) / (2 * n))


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


# ----------------------------------------------------------------------------- greedy

@pytest.mark.parametrize(
    "draft, target_argmax, expected",
    [
        ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all accepted: the bonus is the row after the last draft
        ([1, 6, 7], [5, 6, 7, 8], (0, 5)),  # none: the target's own token replaces d_1
        ([5, 9, 7], [5, 6, 7, 8], (1, 6)),  # middle: d_3 matching does not matter after a miss
        ([5, 6, 9], [5, 6, 7, 8], (2, 7)),  # last draft wrong
        ([], [4], (0, 4)),  # no drafts: plain autoregressive step
    ],
)
def test_accept_greedy(draft, target_argmax, expected):
    assert accept_greedy(draft, target_argmax) == expected


# ----------------------------------------------------------------------------- sampled

def test_sampled_p_equals_q_accepts_everything():
    rng = np.random.default_rng(0)
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    bonus_counts = np.zeros(4)
    for _ in range(2000):
        draft = [sample_token(p[i], rng) for i in range(2)]
        a, nxt = accept_sampled(draft, p[:2], p, rng)
        assert a == 2
        bonus_counts[nxt] += 1
    # the bonus comes from the row after the last draft
    assert tv(bonus_counts, p[2]) <= tv_bound(p[2], 2000)


def test_sampled_rejects_mass_where_p_has_none_and_draws_the_residual():
    rng = np.random.default_rng(1)
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0.0, 0.0, 0.0, 1.0]])
    counts = np.zeros(4)
    for _ in range(2000):
        a, nxt = accept_sampled([3], q, p, rng)
        assert a == 0  # p(3) = 0: always rejected
        counts[nxt] += 1
    assert counts[2:].sum() == 0  # never a token the target gives no mass
    assert tv(counts, np.array([0.5, 0.5, 0, 0])) <= tv_bound(np.array([0.5, 0.5, 0, 0]), 2000)


def test_sampled_residual_and_output_distributions_are_exact():
    """d ~ q, one draft: on rejection the token follows normalize(max(p - q, 0)); overall the
    committed token follows p (lossless); the acceptance rate is sum min(p, q)."""
    rng = np.random.default_rng(2)
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    q = np.array([[0.4, 0.3, 0.2, 0.1]])
    resid = np.maximum(p[0] - q[0], 0)
    resid = resid / resid.sum()  # [0, 0, 0.25, 0.75]
    n = 20000
    first = np.zeros(4)
    rejected = np.zeros(4)
    accepted = 0
    for _ in range(n):
        d = sample_token(q[0], rng)
        a, nxt = accept_sampled([d], q, p, rng)
        tok = d if a == 1 else nxt
        first[tok] += 1
        if a == 1:
            accepted += 1
        else:
            rejected[nxt] += 1
    assert tv(first, p[0]) <= tv_bound(p[0], n)
    m = int(rejected.sum())
    assert rejected[:2].sum() == 0
    assert tv(rejected, resid) <= tv_bound(resid, m)
    acc = np.minimum(p[0], q[0]).sum()  # 0.6
    assert abs(accepted / n - acc) <= math.sqrt(math.log(2 / DELTA) / (2 * n))  # Hoeffding


def test_sampled_check_detects_a_wrong_residual():
    """The same check with a deliberately wrong rule (resample from p instead of the residual)
    fails: the bound is tight enough to matter."""
    rng = np.random.default_rng(3)
    p = np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.4, 0.3, 0.2, 0.1])
    n = 20000
    first = np.zeros(4)
    for _ in range(n):
        d = sample_token(q, rng)
        tok = d if rng.random() * q[d] < p[d] else sample_token(p, rng)
        first[tok] += 1
    assert tv(first, p) > tv_bound(p, n)


# ----------------------------------------------------------------------------- transforms

# the drafts' transform (MLX) and the target's (`target_probs`, numpy: MLX's CPU exp is ~30x slower)
# must be the same transform: every exact check below runs on both
IMPLS = {"mlx": lambda z, sp: np.asarray(probs_from_logits(mx.array(z), sp)),
         "numpy": lambda z, sp: target_probs(mx.array(z), sp)}
impls = pytest.mark.parametrize("impl", sorted(IMPLS))


def _probs(logits, impl="mlx", **kw):
    return IMPLS[impl](np.asarray(logits, np.float32), SamplingParams(**kw))


@impls
def test_temperature_only(impl):
    z = np.array([1.0, 2.0, 3.0, 4.0])
    for t in (1.0, 0.5, 2.0):
        e = np.exp(z / t - (z / t).max())
        np.testing.assert_allclose(_probs(z, impl, temperature=t), e / e.sum(), rtol=1e-5, atol=1e-7)


@impls
def test_top_k_exact(impl):
    z = np.array([1.0, 2.0, 3.0, 4.0])
    e3, e4 = math.exp(3), math.exp(4)
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_k=2), [0, 0, e3 / (e3 + e4), e4 / (e3 + e4)],
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_k=1), [0, 0, 0, 1], atol=1e-7)
    # top_k >= V (and 0) leave the distribution alone
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_k=4), _probs(z, impl, temperature=1.0), rtol=1e-6)
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_k=0), _probs(z, impl, temperature=1.0), rtol=1e-6)


@impls
def test_top_p_exact(impl):
    base = np.array([0.5, 0.25, 0.15, 0.1])
    z = np.log(base)[[2, 0, 3, 1]]  # unsorted on purpose: [0.15, 0.5, 0.1, 0.25]
    # smallest prefix (by probability) whose mass reaches top_p
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_p=0.7), [0, 2 / 3, 0, 1 / 3], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_p=0.8), [0.15, 0.5, 0, 0.25] / np.float32(0.9),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_probs(z, impl, temperature=1.0, top_p=0.3), [0, 1, 0, 0], atol=1e-7)
    # batched rows are transformed independently
    two = _probs(np.stack([z, z[::-1]]), impl, temperature=1.0, top_p=0.7)
    np.testing.assert_allclose(two[1], [1 / 3, 0, 2 / 3, 0], rtol=1e-5, atol=1e-7)


@impls
def test_top_k_then_top_p_with_temperature(impl):
    z = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    # T = 0.5 doubles the logits; top-k 3 keeps {2, 3, 4}; top-p 0.9 then drops index 2
    e = np.exp(np.array([4.0, 6.0, 8.0]) - 8.0)
    k3 = e / e.sum()  # [0.0159, 0.1173, 0.8668]
    assert k3[2] < 0.9 < k3[1] + k3[2]
    expect = np.array([0, 0, 0, k3[1], k3[2]]) / (k3[1] + k3[2])
    np.testing.assert_allclose(_probs(z, impl, temperature=0.5, top_k=3, top_p=0.9), expect, rtol=1e-5, atol=1e-7)


def test_the_targets_numpy_transform_matches_the_drafts_on_a_real_vocabulary():
    """target_probs against probs_from_logits over 49,152 logits: the same kept set under top-k,
    probabilities within float32 rounding, and NaN logits give non-finite rows (which acceptance
    refuses) rather than a distribution."""
    z = np.random.default_rng(0).standard_normal((3, 49152)).astype(np.float32) * 4
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=0.8, top_k=100, top_p=0.5)):
        a, b = _probs(z, "numpy", **kw), _probs(z, "mlx", **kw)
        assert a.dtype == np.float32 and a.shape == z.shape
        assert np.array_equal(a > 0, b > 0)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)
    assert target_probs(z[0], SamplingParams(temperature=1.0)).shape == (49152,)
    assert not np.isfinite(target_probs(np.full((2, 8), np.nan, np.float32), SamplingParams(temperature=1.0))).any()


def test_sample_token_never_draws_zero_mass():
    rng = np.random.default_rng(4)
    p = np.array([0.0, 0.3, 0.0, 0.7, 0.0])
    draws = {sample_token(p, rng) for _ in range(3000)}
    assert draws == {1, 3}
