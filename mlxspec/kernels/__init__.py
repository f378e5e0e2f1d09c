"""Custom kernels: one interface, three implementations (Metal, CUDA, pure MLX).

    from mlxspec import kernels
    kernels.backend()                      # "metal" | "cuda" | "reference"
    y = kernels.lowbit_matmul(x, w_raw, type_id, (N, K))
    tokens, probs = kernels.markov_chain(base_logits, w1, w2, anchor, temperature, key)
    tokens, picks, scores = kernels.selector_chain(unary, ids, hp, pred, succ, anchor, temperature, key)
    kernels.use_reference()                # or MLXSPEC_KERNELS=reference

See mlxspec/kernels/README.md for the kernels, tolerances and the emulator used in tests.
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.kernels._launch import (
    ENV_VAR,
    KernelSpec,
    Launch,
    backend,
    runner,
    use_reference,
)
from mlxspec.kernels.lowbit import lowbit_matmul_kernel, lowbit_matmul_reference
from mlxspec.kernels.markov import markov_chain_kernel, markov_chain_reference
from mlxspec.kernels.selector import select_chain, select_chain_kernel

__all__ = [
    "ENV_VAR", "KernelSpec", "Launch", "backend", "use_reference", "lowbit_matmul", "markov_chain",
    "lowbit_matmul_reference", "markov_chain_reference", "selector_chain", "select_chain",
]


def lowbit_matmul(x: mx.array, w: mx.array, type_id: int, shape) -> mx.array:
    """y[..., N] = x[..., K] @ W^T for W [N, K] stored as GGUF low-bit blocks (uint8 or uint32 raw).

    type_id: a low-bit `mlxspec.gguf.types.GGMLType` (Q1_0, Q2_0, PQ2_0, PTQ1_0); shape = (N, K)."""
    impl = backend()
    if impl == "reference":
        return lowbit_matmul_reference(x, w, type_id, shape)
    return lowbit_matmul_kernel(x, w, type_id, shape, runner(impl))


def markov_chain(base_logits: mx.array, w1: mx.array, w2: mx.array, anchor, temperature: float = 0.0,
                 key=None) -> tuple[mx.array, mx.array]:
    """DSpark Markov head over a block: tokens int32 [B] and their draft probabilities [B].

    For k in 0..B-1: z_k = base_logits[k] + w2 @ w1[x_{k-1}] (x_{-1} = anchor);
    x_k = argmax z_k when temperature == 0, else a Gumbel-max sample of softmax(z_k / T) with
    noise derived from `key` (an int or mx.random key; None draws from MLX's global generator);
    probs[k] = softmax(z_k / T)[x_k] (T = 1 when greedy)."""
    impl = backend()
    if impl == "reference":
        return markov_chain_reference(base_logits, w1, w2, anchor, temperature, key)
    return markov_chain_kernel(base_logits, w1, w2, anchor, temperature, key, runner(impl))


def selector_chain(unary: mx.array, ids: mx.array, hp: mx.array, pred: mx.array, succ: mx.array, anchor,
                   temperature: float = 0.0, key=None) -> tuple[mx.array, mx.array, mx.array]:
    """DFlash 2's path selector over a block: tokens int32 [n], picks int32 [n] (candidate slots)
    and scores float32 [n, k] (see mlxspec/kernels/selector.py).

    score_t = unary[t] + (S[ids[t]] * hp[t]) @ P[x_{t-1}] (x_{-1} = anchor); the pick is the argmax,
    or a Gumbel-max sample of softmax(score_t / T) with noise derived from `key`."""
    impl = backend()
    if impl == "reference" or unary.shape[-1] > 32:
        return select_chain(unary, ids, hp, pred, succ, anchor, temperature, key)
    return select_chain_kernel(unary, ids, hp, pred, succ, anchor, temperature, key, runner(impl))
