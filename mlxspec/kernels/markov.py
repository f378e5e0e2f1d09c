"""DSpark Markov head drafted over a block: each row adds a low-rank term of the previous token.

For k in 0..B-1, with x_{-1} = anchor:
    z_k = base_logits[k] + W2 @ W1[x_{k-1}]          (W1, W2 stored [V, r])
    x_k = argmax z_k                                   (temperature == 0)
        = argmax (z_k / T + g_k)                       (T > 0; g_k Gumbel noise: a sample of softmax(z_k / T))
    q_k = softmax(z_k / T)[x_k]                        (T = 1 when greedy: the max probability)

Gumbel noise comes from a counter-based hash of (seed, k, v) so the GPU kernels and the MLX
reference draw the same sample for the same key. Ties in argmax go to the lower token id, as
mx.argmax does.

GPU path: one `markov_step` launch per position (each reads W2 once and writes a few floats per
threadgroup; the next launch reduces them to the previous token) and one `markov_finish`
launch for the block; nothing of size [B, V] is materialised. All launches stay in the lazy
graph, there is no host synchronisation inside the block.
"""

from __future__ import annotations

import mlx.core as mx

from mlxspec.kernels._launch import KernelSpec, Launch

STEP = KernelSpec(name="mlxspec_markov_step", stem="markov_step",
                  inputs=("base", "w1", "w2", "prev_i", "prev_f", "params", "temp"),
                  outputs=("part_i", "part_f"))
FINISH = KernelSpec(name="mlxspec_markov_finish", stem="markov_finish",
                    inputs=("part_i", "part_f", "params"), outputs=("tokens", "probs"))

NSG = 8          # simdgroups (warps) per threadgroup
MAX_GROUPS = 1024
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def check(base: mx.array, w1: mx.array, w2: mx.array, anchor=None) -> tuple[int, int, int]:
    """Validate shapes (and a Python int anchor); returns (B, V, r)."""
    if base.ndim != 2 or base.shape[0] < 1:
        raise ValueError(f"base_logits must be [B >= 1, V], got {list(base.shape)}")
    B, V = base.shape
    if w1.ndim != 2 or w2.shape != w1.shape or w1.shape[0] != V:
        raise ValueError(f"w1 and w2 must both be [V={V}, r], got {list(w1.shape)} and {list(w2.shape)}")
    if isinstance(anchor, int) and not 0 <= anchor < V:
        raise ValueError(f"anchor token {anchor} is outside the vocabulary [0, {V})")
    return B, V, w1.shape[1]


def seed_words(key, fresh: bool = False) -> mx.array:
    """Two uint32 seed words [2] from an int or an mx.random key (no host sync). key=None gives
    fresh words from MLX's global generator when `fresh`, else zeros."""
    if key is None:
        if fresh:
            return mx.random.randint(0, 1 << 31, (2,)).astype(mx.uint32)
        return mx.zeros((2,), dtype=mx.uint32)
    if isinstance(key, int):
        return mx.array([key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF], dtype=mx.uint32)
    words = mx.array(key).astype(mx.uint32).reshape(-1)
    if words.size < 2:
        words = mx.concatenate([words, mx.zeros((2 - words.size,), dtype=mx.uint32)])
    return words[:2]


def _fmix32(h: mx.array) -> mx.array:
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return h ^ (h >> 16)


def gumbel(seed: mx.array, k, V: int) -> mx.array:
    """Gumbel noise [V] for position k (an int, or an array of positions: [..., V]), the same
    bits as mlxs_gumbel in the kernels."""
    u32 = mx.uint32
    v = mx.arange(V, dtype=u32)
    h = _fmix32((v * mx.array(0x9E3779B9, dtype=u32)) ^ seed[0])
    salt = (mx.array(k, dtype=u32)[..., None] + 1) * mx.array(0x85EBCA6B, dtype=u32)
    h = _fmix32(h ^ salt ^ seed[1])
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / 16777216.0)
    return -mx.log(-mx.log(u))


def markov_chain_reference(base: mx.array, w1: mx.array, w2: mx.array, anchor, temperature: float = 0.0,
                           key=None) -> tuple[mx.array, mx.array]:
    """Pure-MLX reference: a loop over the B positions, float32 throughout."""
    B, V, _ = check(base, w1, w2, anchor)
    greedy = not temperature > 0
    seed = seed_words(key, fresh=not greedy)
    prev = mx.array(anchor).astype(mx.int32).reshape(())
    w2f = w2.astype(mx.float32)
    tokens, probs = [], []
    for k in range(B):
        z = base[k].astype(mx.float32) + w2f @ w1[prev].astype(mx.float32)
        s = z if greedy else z / temperature
        score = s if greedy else s + gumbel(seed, k, V)
        x = mx.argmax(score).astype(mx.int32)
        probs.append(mx.exp(s[x] - mx.logsumexp(s)))
        tokens.append(x)
        prev = x
    return mx.stack(tokens), mx.stack(probs)


def plan_step(B: int, V: int, r: int, max_groups: int = MAX_GROUPS) -> Launch:
    tiles = -(-V // 32)
    groups = max(1, min(-(-tiles // NSG), max_groups))
    return Launch(grid=(32, NSG * groups, 1), threadgroup=(32, NSG, 1),
                  output_shapes=((groups,), (groups, 4)), output_dtypes=(mx.int32, mx.float32),
                  template=(("NSG", NSG), ("RL", r // 32)))


def plan_finish(B: int, groups: int) -> Launch:
    return Launch(grid=(32, B, 1), threadgroup=(32, 1, 1), output_shapes=((B,), (B,)),
                  output_dtypes=(mx.int32, mx.float32))


def markov_chain_kernel(base: mx.array, w1: mx.array, w2: mx.array, anchor, temperature: float, key,
                        run, max_groups: int = MAX_GROUPS) -> tuple[mx.array, mx.array]:
    """The GPU path: `run(spec, inputs, launch)` is mx.fast (or the CPU emulator in tests).
    max_groups caps the threadgroups per step (each then covers more rows)."""
    B, V, r = check(base, w1, w2, anchor)
    if r % 32:
        raise ValueError(f"the Markov kernel needs a rank that is a multiple of 32, got {r}")
    for a in (base, w1, w2):
        if a.dtype not in KERNEL_DTYPES:
            raise TypeError(f"dtype {a.dtype} is not supported by the Markov kernel")
    seed = seed_words(key, fresh=temperature > 0)
    step = plan_step(B, V, r, max_groups)
    groups = step.output_shapes[0][0]
    temp = mx.array([max(float(temperature), 0.0)], dtype=mx.float32)
    prev_i = mx.array(anchor).astype(mx.int32).reshape(1)
    prev_f = mx.zeros((1, 4), dtype=mx.float32)
    parts_i, parts_f = [], []
    for k in range(B):
        params = mx.concatenate([mx.array([V, r, k, prev_i.shape[0]], dtype=mx.uint32), seed,
                                 mx.array([groups], dtype=mx.uint32)])
        prev_i, prev_f = run(STEP, [base, w1, w2, prev_i, prev_f, params, temp], step)
        parts_i.append(prev_i)
        parts_f.append(prev_f)
    params = mx.array([B, groups], dtype=mx.uint32)
    tokens, probs = run(FINISH, [mx.stack(parts_i), mx.stack(parts_f), params], plan_finish(B, groups))
    return tokens, probs
