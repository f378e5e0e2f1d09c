"""DFlash 2's path selector drafted over a block: the chain through the top-k candidates of each row.

Rows t = 0..n-1 of the block each keep k candidates (ids[t], their soft-capped logits
unary[t], best first). With x_{-1} = anchor and hp[t] = hidden_projection(row t):
    score_t[j] = unary[t, j] + sum_r P[x_{t-1}, r] * hp[t, r] * S[ids[t, j], r]
    pick_t     = argmax_j score_t                      (temperature == 0)
               = argmax_j (score_t / T + g_t)          (T > 0; g_t Gumbel noise: a sample of softmax(score_t / T))
    x_t        = ids[t, pick_t]
P and S are the predecessor and successor codebooks [V, R]. The draft distribution of row t is
softmax(score_t / T) over its k candidates and zero elsewhere (verification uses exactly
that; `scores` is returned for it). Ties go to the lower candidate index (the higher logit).

Gumbel noise is the Markov kernels' counter-based hash (`markov.gumbel`) over the k candidate
slots, so the GPU kernel and this reference draw the same sample for the same key.

GPU path: one `selector_chain` launch for the whole block (one threadgroup; a simdgroup per
candidate slot reduces its rank-R dot product each step); no host synchronisation.
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.kernels._launch import KernelSpec, Launch
from mlxspec.kernels.markov import gumbel, seed_words

CHAIN = KernelSpec(name="mlxspec_selector_chain", stem="selector_chain",
                   inputs=("unary", "ids", "hp", "pred", "succ", "params", "temp"),
                   outputs=("tokens", "picks", "scores"))
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_TOP_K = 32  # one simdgroup per candidate slot, at most 32 simdgroups (1024 threads)


def check(unary: mx.array, ids: mx.array, hp: mx.array, pred: mx.array, succ: mx.array, anchor=None):
    """Validate shapes (and a Python int anchor); returns (n, k, R, V)."""
    if unary.ndim != 2 or unary.shape[0] < 1 or ids.shape != unary.shape:
        raise ValueError(f"unary and ids must both be [n >= 1, k], got {list(unary.shape)} and {list(ids.shape)}")
    n, k = unary.shape
    if pred.ndim != 2 or succ.shape != pred.shape:
        raise ValueError(f"the codebooks must both be [V, R], got {list(pred.shape)} and {list(succ.shape)}")
    V, R = pred.shape
    if hp.shape != (n, R):
        raise ValueError(f"hp must be [n={n}, R={R}], got {list(hp.shape)}")
    if isinstance(anchor, int) and not 0 <= anchor < V:
        raise ValueError(f"anchor token {anchor} is outside the vocabulary [0, {V})")
    return n, k, R, V


def select_chain(unary: mx.array, ids: mx.array, hp: mx.array, pred: mx.array, succ: mx.array, anchor,
                 temperature: float = 0.0, key=None) -> tuple[mx.array, mx.array, mx.array]:
    """Pure-MLX reference (float32): (tokens int32 [n], picks int32 [n], scores float32 [n, k]).

    Lazy throughout (the predecessor stays an mx.array), so a block costs no host sync."""
    n, k, _, _ = check(unary, ids, hp, pred, succ, anchor)
    greedy = not temperature > 0
    seed = seed_words(key, fresh=not greedy)
    # the pairwise part that does not depend on the predecessor: hp[t] * S[ids[t, j]]  [n, k, R]
    pair = hp.astype(mx.float32)[:, None, :] * succ[ids].astype(mx.float32)
    u = unary.astype(mx.float32)
    prev = mx.array(anchor).astype(mx.int32).reshape(())
    tokens, picks, scores = [], [], []
    for t in range(n):
        s = u[t] + pair[t] @ pred[prev].astype(mx.float32)
        pick = mx.argmax(s if greedy else s / temperature + gumbel(seed, t, k)).astype(mx.int32)
        prev = ids[t][pick].astype(mx.int32)
        tokens.append(prev)
        picks.append(pick)
        scores.append(s)
    return mx.stack(tokens), mx.stack(picks), mx.stack(scores)


def teacher_scores(unary: mx.array, ids: mx.array, hp: mx.array, pred: mx.array, succ: mx.array,
                   prev: mx.array) -> mx.array:
    """Teacher-forced scores for training: row t conditioned on the given prev[..., t].

    unary, ids [..., n, k]; hp [..., n, R]; prev [..., n] ids -> scores [..., n, k] (float32)."""
    e = pred[prev].astype(mx.float32)  # [..., n, R]
    s_rows = succ[ids].astype(mx.float32)  # [..., n, k, R]
    return unary.astype(mx.float32) + (s_rows @ (hp.astype(mx.float32) * e)[..., None])[..., 0]


def plan(n: int, k: int, R: int) -> Launch:
    return Launch(grid=(32, k, 1), threadgroup=(32, k, 1), output_shapes=((n,), (n,), (n, k)),
                  output_dtypes=(mx.int32, mx.int32, mx.float32), template=(("K", k),))


def select_chain_kernel(unary: mx.array, ids: mx.array, hp: mx.array, pred: mx.array, succ: mx.array, anchor,
                        temperature: float, key, run) -> tuple[mx.array, mx.array, mx.array]:
    """The GPU path: `run(spec, inputs, launch)` is mx.fast (or the CPU emulator in tests)."""
    n, k, R, V = check(unary, ids, hp, pred, succ, anchor)
    if not 1 <= k <= MAX_TOP_K:
        raise ValueError(f"the selector kernel takes 1..{MAX_TOP_K} candidates per row, got {k}")
    for a in (unary, hp, pred, succ):
        if a.dtype not in KERNEL_DTYPES:
            raise TypeError(f"dtype {a.dtype} is not supported by the selector kernel")
    seed = seed_words(key, fresh=temperature > 0)
    params = mx.concatenate([mx.array([n, k, R, V], dtype=mx.uint32), seed,
                             mx.array(anchor).astype(mx.uint32).reshape(1)])
    temp = mx.array([max(float(temperature), 0.0)], dtype=mx.float32)
    return tuple(run(CHAIN, [unary, ids.astype(mx.int32), hp, pred, succ, params, temp], plan(n, k, R)))
