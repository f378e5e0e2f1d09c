"""Verification: pure functions of (draft tokens, draft probs, target probs).

No model inside; tested on their own with hand-made distributions.

Greedy: accept the longest prefix where d_i == argmax(target row i-1's logits), then the
bonus is the target argmax at the first mismatch (or after the last draft).

Sampled (Leviathan et al. / Chen et al.): with p, q the target and draft distributions
after the SAME temperature / top-k / top-p transform: accept d_i with probability
min(1, p(d_i) / q(d_i)); on rejection draw from normalize(max(p - q, 0)); if every draft
is accepted, draw the bonus from p of the last row. The output distribution equals
sampling from the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxspec.errors import MlxspecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probs_from_logits(logits: mx.array, sp: SamplingParams) -> mx.array:
    """softmax(logits / T) restricted by top-k then top-p, renormalised. [..., V] float32.

    Applied identically to target and draft logits (lossless sampling needs that).
    """
    x = logits.astype(mx.float32) / max(sp.temperature, 1e-6)
    v = x.shape[-1]
    if sp.top_k and 0 < sp.top_k < v:
        kth = mx.sort(x, axis=-1)[..., v - sp.top_k][..., None]
        x = mx.where(x < kth, -mx.inf, x)
    p = mx.softmax(x, axis=-1)
    if sp.top_p < 1.0:
        order = mx.argsort(-p, axis=-1)
        ps = mx.take_along_axis(p, order, axis=-1)
        cum = mx.cumsum(ps, axis=-1)
        keep_sorted = (cum - ps) < sp.top_p  # keep the smallest prefix reaching top_p
        keep = mx.put_along_axis(mx.zeros_like(ps), order, keep_sorted.astype(ps.dtype), axis=-1)
        p = p * keep
        p = p / p.sum(axis=-1, keepdims=True)
    return p


def target_probs(logits, sp: SamplingParams) -> np.ndarray:
    """`probs_from_logits` of the target's rows, computed by numpy: [..., V] float32.

    The same transform (temperature, then top-k, then top-p, renormalised). MLX's CPU `exp` is
    scalar in the wheels mlxspec runs on (~13 ns an element on a 2-core AVX-512 Xeon, numpy's
    0.4), so a softmax over a 49k vocabulary took 0.8 ms a row: 2% of a SmolLM2 decode step for
    every sampled token, and a sampled verify of 3 rows paid it three times. Every path that
    samples from the target uses this one (the loop, trees, both batched engines), so a sampled
    step and an autoregressive one draw from the same numbers. EAGLE-3's sampled chain draws
    from it too (0.55 ms a draft with MLX's softmax and scatter, 0.11 with this, quiet, 2026-12-05:
    `scripts/bench_sampled_draft.py`, docs/bench/sampled-draft-2026-12-05.json);
    the other drafters keep their own MLX distributions. Verification reads a draft's q as given:
    losslessness needs q to be what the draft was drawn from, not the same code as p."""
    x = np.array(logits.astype(mx.float32) if isinstance(logits, mx.array) else logits, dtype=np.float32)
    x /= np.float32(max(sp.temperature, 1e-6))
    v = x.shape[-1]
    if sp.top_k and 0 < sp.top_k < v:
        kth = np.partition(x, v - sp.top_k, axis=-1)[..., v - sp.top_k : v - sp.top_k + 1]
        x[x < kth] = -np.inf
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf logits: caught where the rows are read
        x -= x.max(axis=-1, keepdims=True)
        p = np.exp(x, out=x)
        p /= p.sum(axis=-1, keepdims=True)
        if sp.top_p < 1.0:
            order = np.argsort(-p, axis=-1, kind="stable")
            ps = np.take_along_axis(p, order, axis=-1)
            keep_sorted = (np.cumsum(ps, axis=-1) - ps) < sp.top_p  # the smallest prefix reaching top_p
            keep = np.zeros_like(p)
            np.put_along_axis(keep, order, keep_sorted.astype(p.dtype), axis=-1)
            p *= keep
            p /= p.sum(axis=-1, keepdims=True)
    return p


def _nonfinite(who: str = "the target") -> Exception:
    return MlxspecError(f"{who} produced non-finite (NaN/Inf) logits or probabilities; its weights are "
                        "corrupt or overflow in this precision: re-download or re-convert the model")


def argmax_lazy(logits: mx.array) -> tuple[mx.array, mx.array]:
    """(argmax over the last axis, whether every logit is finite), not evaluated yet: a caller
    can start more work on the argmax before `check_finite`."""
    return mx.argmax(logits, axis=-1), mx.all(mx.isfinite(logits))


def check_finite(am: mx.array, ok: mx.array) -> mx.array:
    """Evaluate an `argmax_lazy` pair, refusing NaN/Inf logits (their argmax is meaningless)."""
    mx.eval(am, ok)
    if not ok.item():
        raise _nonfinite()
    return am


def argmax_finite(logits: mx.array) -> mx.array:
    """argmax over the last axis, refusing NaN/Inf logits (their argmax is meaningless)."""
    return check_finite(*argmax_lazy(logits))


def accept_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """draft [n]; target_argmax [n+1] (row i = the target's choice after i drafts).

    -> (number of accepted drafts a, the bonus token target_argmax[a]).
    """
    a = 0
    while a < len(draft) and draft[a] == target_argmax[a]:
        a += 1
    return a, int(target_argmax[a])


def accept_sampled(
    draft: list[int],
    q: np.ndarray,
    p: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """draft [n]; q [n, V] draft probs; p [n+1, V] target probs (same transform).

    -> (accepted count a, the next token: the residual sample at the first rejection,
    or the bonus drawn from p[n] when all n are accepted).
    """
    n = len(draft)
    if not np.isfinite(p).all():
        raise _nonfinite()
    for i in range(n):
        d = draft[i]
        if not np.isfinite(q[i]).all():  # a broken draft row proposes nothing: sample the target here
            return i, int(_draw(p[i], rng))
        pi, qi = float(p[i, d]), float(q[i, d])
        if qi > 0 and rng.random() * qi < pi:  # u < p/q without dividing
            continue
        resid = np.maximum(p[i] - q[i], 0.0)
        s = resid.sum()
        if s <= 0:  # p == q exactly: any rejection is impossible in theory; fall back to p
            resid, s = p[i], p[i].sum()
        return i, int(_draw(resid / s, rng))
    return n, int(_draw(p[n], rng))


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(probs, dtype=np.float64)
    if not (np.isfinite(c[-1]) and c[-1] > 0) or (probs < 0).any():
        raise _nonfinite("the target or drafter")  # never a token (the last id) from NaN / all-zero probabilities
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(c) - 1))


def sample_token(p: np.ndarray, rng: np.random.Generator) -> int:
    return _draw(np.asarray(p, dtype=np.float64), rng)


def pick_token(logits: mx.array, sp: SamplingParams, rng: np.random.Generator) -> int:
    """The target's next token from one row of logits [V]: its argmax (greedy, refusing NaN/Inf)
    or a draw from `target_probs` (the prefill's token, in the loop and both batched engines)."""
    if sp.greedy:
        return int(argmax_finite(logits).item())
    return sample_token(target_probs(logits, sp), rng)


def target_rows(logits: mx.array, sp: SamplingParams):
    """A verify forward's rows [L, V], evaluated for acceptance: the argmax of each row (a list,
    greedy) or its probabilities after the sampling transform ([L, V] numpy, sampled)."""
    if sp.greedy:
        return argmax_finite(logits).tolist()
    return target_probs(logits, sp)
