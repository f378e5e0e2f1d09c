"""A Linear layer that keeps GGUF low-bit blocks as stored and multiplies with the kernel.

`NativeLowBitLinear` holds W [N, K] (N output features) as the raw GGUF blocks of one of the
PrismML types, Q1_0 (41), Q2_0 (42), PQ2_0 (142) or PTQ1_0 (143): `weight` is uint8
[N, row_bytes] (or the same bytes viewed as uint32), exactly the bytes of the file, rows in
the model's order. `__call__` is `kernels.lowbit_matmul`: the Metal / CUDA kernel where one
runs, the pure-MLX reference elsewhere (correct but it repacks the weight on every call, so
CPU inference should use the load-time repack or dense weights instead; see
`mlxspec.targets.gguf.native_lowbit_enabled` and `mlxspec.targets.model.dequantize_model`).

The weight is not trainable (integer bytes); `dense()` gives it as float32 [N, K].
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxspec import kernels
from mlxspec.gguf import quants as lowbit

TYPE_IDS = tuple(lowbit.BLOCKS)  # 41, 42, 142, 143


class NativeLowBitLinear(nn.Module):
    """y = x @ W^T (+ bias) with W [output_dims, input_dims] in GGUF low-bit blocks."""

    def __init__(self, input_dims: int, output_dims: int, type_id: int, bias: bool = False):
        super().__init__()
        if type_id not in lowbit.BLOCKS:
            lowbit.block_layout(type_id)  # raises, naming the known types
        self.type_id = int(type_id)
        self.input_dims = int(input_dims)
        self.output_dims = int(output_dims)
        rb = lowbit.row_bytes(type_id, input_dims)  # checks input_dims % qk
        self.weight = mx.zeros((output_dims, rb), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.freeze()

    @classmethod
    def from_blocks(cls, raw, type_id: int, shape, bias=None) -> "NativeLowBitLinear":
        """From the raw blocks (numpy or mx, uint8 or uint32) of W with shape (N, K)."""
        n, k = (int(s) for s in shape)
        m = cls(k, n, type_id, bias=bias is not None)
        w = mx.array(np.ascontiguousarray(raw).view(np.uint8)) if isinstance(raw, np.ndarray) else raw
        if w.dtype == mx.uint32:
            w = w.view(mx.uint8)
        m.weight = w.reshape(n, -1)
        if bias is not None:
            m.bias = mx.array(bias)
        return m

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the logical weight."""
        return self.output_dims, self.input_dims

    def _extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
                f"type={lowbit.BLOCKS[self.type_id][2]}, bias={'bias' in self}")

    def dense(self, dtype=mx.float32) -> mx.array:
        """W as a dense [N, K] array (exact: `mlxspec.gguf.quants.dequantize`, then cast to dtype)."""
        raw = np.array(self.weight.view(mx.uint8) if self.weight.dtype == mx.uint32 else self.weight)
        return mx.array(lowbit.dequantize(self.type_id, raw, self.shape)).astype(dtype)

    def __call__(self, x: mx.array) -> mx.array:
        y = kernels.lowbit_matmul(x, self.weight, self.type_id, self.shape)
        if "bias" in self:
            y = y + self.bias.astype(y.dtype)
        return y
