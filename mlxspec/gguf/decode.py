"""GGUF tensor data -> numpy arrays: stored values as they are, dequantized floats, or a
lossless repack into MLX affine quantization. Used by target and drafter loading.

- `plain`: F32 / F16 / integer tensors as stored (no copy); `bf16_as_f32`: BF16, exactly.
- `dequantize`: any other type mlxspec or the `gguf` package decodes -> float32.
- `repack_mlx`: Q4_0 / Q4_1 / Q8_0 (group 32, 4 or 8 bits, what `mx.load` makes of them)
  and the low-bit types (`quants.repack_mlx`) -> (w uint32, scales, biases, group, bits).
"""

from __future__ import annotations

from functools import cache

import gguf
import numpy as np

from mlxspec.gguf import quants
from mlxspec.gguf.types import LOWBIT_TYPES, GGMLType

PLAIN_DTYPES = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.I8: "<i1", GGMLType.I16: "<i2",
                GGMLType.I32: "<i4", GGMLType.I64: "<i8"}

# type id -> (bits, group size) of the MLX affine layout `repack_mlx` produces
MLX_LAYOUT = {GGMLType.Q4_0: (4, 32), GGMLType.Q4_1: (4, 32), GGMLType.Q8_0: (8, 32), **quants.MLX_LAYOUT}


def plain(raw: np.ndarray, type_id: int, shape) -> np.ndarray:
    """An F32 / F16 / I8..I64 tensor's values as stored (a view of `raw`)."""
    return np.frombuffer(raw, dtype=PLAIN_DTYPES[type_id]).reshape(shape)


def bf16_as_f32(raw: np.ndarray, shape) -> np.ndarray:
    """BF16 -> float32 (exact: the bf16 bits are the high half of the float32)."""
    u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


@cache
def package_decodes(type_id: int) -> bool:
    """Whether the `gguf` package dequantizes this type (tried on one block of zeros)."""
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
        _, type_size = gguf.constants.GGML_QUANT_SIZES[qtype]
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except (ValueError, NotImplementedError, KeyError):
        return False
    return True


def dequantizable(type_id: int) -> bool:
    return type_id in LOWBIT_TYPES or package_decodes(type_id)


def dequantize(raw: np.ndarray, type_id: int, shape) -> np.ndarray:
    """Quantized blocks -> float32 of `shape` (blocks run along the last axis). Raises
    ValueError or NotImplementedError, with the `gguf` package's reason, for a type neither
    mlxspec nor the package decodes."""
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    raw = np.asarray(raw)
    if type_id in LOWBIT_TYPES:
        return quants.dequantize(type_id, raw, (rows, shape[-1])).reshape(shape)

    qtype = gguf.GGMLQuantizationType(type_id)
    out = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
    return np.asarray(out, dtype=np.float32).reshape(shape)


def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned codes [rows, cols] into uint32 words, LSB first (MLX's order)."""
    per = 32 // bits
    rows, cols = codes.shape
    c = codes.astype(np.uint32).reshape(rows, cols // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(c << shifts, axis=2).astype(np.uint32)


def _fp16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[:, 0]


def _q4_0(b: np.ndarray, rows: int, cols: int):
    d = _fp16(b[:, :2])
    qs = b[:, 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15 low, 16..31 high
    scales = d.reshape(rows, cols // 32)
    return _pack_bits(codes.reshape(rows, cols), 4), scales, (-8 * scales).astype(np.float16)


def _q4_1(b: np.ndarray, rows: int, cols: int):
    d, m = _fp16(b[:, :2]), _fp16(b[:, 2:4])
    qs = b[:, 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return _pack_bits(codes.reshape(rows, cols), 4), d.reshape(rows, cols // 32), m.reshape(rows, cols // 32)


def _q8_0(b: np.ndarray, rows: int, cols: int):
    d = _fp16(b[:, :2])
    q = b[:, 2:].view(np.int8).astype(np.int16) + 128
    scales = d.reshape(rows, cols // 32)
    return (_pack_bits(q.reshape(rows, cols).astype(np.uint8), 8), scales,
            (-128 * scales.astype(np.float32)).astype(np.float16))


_AFFINE = {GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q8_0: _q8_0}


def repack_mlx(raw: np.ndarray, type_id: int, shape):
    """A 2-D tensor of a type in MLX_LAYOUT -> (w uint32, scales, biases, group_size, bits) with
    mx.dequantize(...) equal to the GGUF decoder's values."""
    if type_id in LOWBIT_TYPES:
        return quants.repack_mlx(type_id, raw, shape)
    rows, cols = shape
    w, scales, biases = _AFFINE[type_id](np.asarray(raw).reshape(-1, GGMLType(type_id).type_size), rows, cols)
    bits, group = MLX_LAYOUT[type_id]
    return w, scales, biases, group, bits
