"""Low-bit matmul reading GGUF-native blocks: y[M, N] = x[M, K] @ W[N, K]^T.

Types: Q1_0, Q2_0, PQ2_0, PTQ1_0 (mlxspec.gguf.types); layouts in mlxspec/gguf/quants.py.
The kernel is tuned for M = 1..32 activation rows (decode and block verify); larger M works
but re-reads the weights once per TM rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxspec.gguf.quants import (
    BLOCKS,
    MLX_LAYOUT,
    PTQ1_0,
    Q1_0,
    block_layout,
    row_bytes,
)
from mlxspec.kernels._launch import KernelSpec, Launch

SPEC = KernelSpec(name="mlxspec_lowbit_matmul", inputs=("x", "w", "params"), outputs=("y",),
                  stem="lowbit_matmul")

RPS = 4   # output rows per simdgroup (warp)
NSG = 2   # simdgroups per threadgroup
TM_CHOICES = (1, 2, 4, 8, 16)
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _as_bytes(w: mx.array) -> mx.array:
    if w.dtype == mx.uint8:
        return w
    if w.dtype == mx.uint32:
        return w.view(mx.uint8)
    raise TypeError(f"low-bit weights must be uint8 or uint32 raw blocks, got {w.dtype}")


def check(x: mx.array, w: mx.array, type_id: int, shape) -> tuple[int, int, int, int]:
    """Validate arguments; returns (M, N, K, row_bytes) with M the rows of x flattened."""
    block_layout(type_id)
    N, K = (int(s) for s in shape)
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"x must be [..., {K}], got {list(x.shape)}")
    rb = row_bytes(type_id, K)
    nbytes = w.size * (4 if w.dtype == mx.uint32 else 1)
    if nbytes != N * rb:
        raise ValueError(f"{BLOCKS[type_id][2]} weight of shape [{N}, {K}] needs {N * rb} bytes, got {nbytes}")
    return x.size // K, N, K, rb


def plan(M: int, N: int, K: int, type_id: int, dtype) -> Launch:
    """Launch geometry: threadgroup (32, NSG, 1); each simdgroup owns RPS output rows and TM
    activation rows; grid z covers M in slices of TM."""
    tm = next((t for t in TM_CHOICES if t >= M), TM_CHOICES[-1])
    groups = -(-N // (RPS * NSG))
    return Launch(grid=(32, groups * NSG, -(-M // tm)), threadgroup=(32, NSG, 1),
                  output_shapes=((M, N),), output_dtypes=(dtype,),
                  template=(("T", dtype), ("QTYPE", int(type_id)), ("TM", tm), ("RPS", RPS)))


def lowbit_matmul_kernel(x: mx.array, w: mx.array, type_id: int, shape, run) -> mx.array:
    """The GPU path: `run(spec, inputs, launch)` is mx.fast (or the CPU emulator in tests).
    x is [..., K]; leading dimensions are flattened into the M rows."""
    M, N, K, rb = check(x, w, type_id, shape)
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"x dtype {x.dtype} is not supported by the low-bit kernel")
    params = mx.array([M, N, K, rb], dtype=mx.int32)
    (y,) = run(SPEC, [x.reshape(M, K), _as_bytes(w).reshape(N, rb), params], plan(M, N, K, type_id, x.dtype))
    return y.reshape(*x.shape[:-1], N)


# ---- pure-MLX reference ----

_TRITS = mx.array(((((np.arange(256, dtype=np.uint32)[:, None] * np.array([1, 3, 9, 27, 81], np.uint32))
                     & 0xFF) * 3) >> 8).astype(np.uint8))


def _codes_and_scale(w: mx.array, type_id: int, shape):
    """(codes uint8 [N, K/qk, qk] for PTQ1_0 trits, or the raw code bytes for the other types;
    d float32 [N, K/qk, 1])."""
    N, K = (int(s) for s in shape)
    qk, nb = block_layout(type_id)
    blk = _as_bytes(w).reshape(N, K // qk, nb)
    if type_id == PTQ1_0:
        d = blk[..., 26:28].view(mx.float16).astype(mx.float32)
        a = _TRITS[blk[..., 0:16]].transpose(0, 1, 3, 2).reshape(N, K // qk, 80)
        b = _TRITS[blk[..., 16:24]].transpose(0, 1, 3, 2).reshape(N, K // qk, 40)
        c = _TRITS[blk[..., 24:26]][..., :4].transpose(0, 1, 3, 2).reshape(N, K // qk, 8)
        return mx.concatenate([a, b, c], axis=-1), d
    return blk[..., 2:], blk[..., 0:2].view(mx.float16).astype(mx.float32)


def dequantize_mlx(w: mx.array, type_id: int, shape) -> mx.array:
    """GGUF low-bit blocks -> float32 [N, K] with MLX ops (same values as
    `mlxspec.gguf.quants.dequantize`)."""
    N, K = (int(s) for s in shape)
    qk, _ = block_layout(type_id)
    codes, d = _codes_and_scale(w, type_id, shape)
    if type_id == Q1_0:
        bits = (codes[..., None] >> mx.arange(8, dtype=mx.uint8)) & 1
        return mx.where(bits.reshape(N, K // qk, qk) > 0, d, -d).reshape(N, K)
    if type_id != PTQ1_0:
        codes = ((codes[..., None] >> mx.array([0, 2, 4, 6], dtype=mx.uint8)) & 3).reshape(N, K // qk, qk)
    return ((codes.astype(mx.float32) - 1.0) * d).reshape(N, K)


def repack_mlx_ops(w: mx.array, type_id: int, shape):
    """Lossless MLX affine repack with MLX ops (lazy; see `mlxspec.gguf.quants.repack_mlx` for the
    mapping): (w_q uint32, scales float32, biases float32, group_size, bits)."""
    N, K = (int(s) for s in shape)
    qk, _ = block_layout(type_id)
    codes, d = _codes_and_scale(w, type_id, shape)
    if type_id == PTQ1_0:
        c = codes.reshape(N, K // 16, 16).astype(mx.uint32)
        wq = (c << (2 * mx.arange(16, dtype=mx.uint32))).sum(axis=-1).astype(mx.uint32)
    else:
        wq = mx.contiguous(codes).reshape(N, -1).view(mx.uint32)
    bits, group = MLX_LAYOUT[type_id]
    scales = (2 * d if type_id == Q1_0 else d).reshape(N, K // qk)
    return wq, scales, (-d).reshape(N, K // qk), group, bits


def lowbit_matmul_reference(x: mx.array, w: mx.array, type_id: int, shape) -> mx.array:
    """Pure-MLX reference: lossless repack (float32 scales, exact weights) and
    mx.quantized_matmul in float32, cast to x.dtype."""
    check(x, w, type_id, shape)
    wq, scales, biases, group, bits = repack_mlx_ops(w, type_id, shape)
    y = mx.quantized_matmul(x.astype(mx.float32), wq, scales, biases, transpose=True, group_size=group, bits=bits)
    return y.astype(x.dtype)
