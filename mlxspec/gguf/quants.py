"""Numpy codecs for the GGUF low-bit block types of PrismML-style targets (Bonsai).

One block holds `qk` weights of one row; blocks run along the columns of a [rows, cols]
matrix (numpy/torch order, rows = output features). Layouts:

| type   | id  | qk  | bytes | layout                                   | weight          |
|--------|-----|-----|-------|------------------------------------------|-----------------|
| Q1_0   | 41  | 128 | 18    | fp16 d, 16 bytes of sign bits LSB first  | bit ? +d : -d   |
| Q2_0   | 42  | 64  | 18    | fp16 d, 16 bytes of 2-bit codes LSB first| (code - 1) * d  |
| PQ2_0  | 142 | 128 | 34    | fp16 d, 32 bytes of 2-bit codes          | (code - 1) * d  |
| PTQ1_0 | 143 | 128 | 28    | 24 bytes 5-trit, 2 bytes 4-trit, fp16 d  | (trit - 1) * d  |

Sources, read not copied: Q1_0/Q2_0/PQ2_0 decoders and quantizers from the PrismML llama.cpp
fork's ggml-quants.c (weight j of a block: byte j/8 bit j%8 for Q1_0; byte j/4 bits
2*(j%4) for the 2-bit types). PTQ1_0 element order from the fork's CUDA mat-vec
(ggml-cuda/mmvq-ptq1_0.cuh): trit t of qs[m] is weight 16*t + m for m < 16, trit t of
qs[16+m] is weight 80 + 8*t + m, trit t of qh[h] is weight 120 + 2*t + h; a trit is read as
((byte * 3**t mod 256) * 3) >> 8 (t = 0 most significant). The 28-byte field order
(qs, qh, then d) is from several independent transcriptions of the fork's block_ptq1_0;
the copy of the fork's ggml-common.h we could read predates PTQ1_0, so that part is not
checked against the fork's own header.
"""

from __future__ import annotations

import numpy as np

from mlxspec.gguf.types import LOWBIT_TYPES, GGMLType

Q1_0, Q2_0, PQ2_0, PTQ1_0 = GGMLType.Q1_0, GGMLType.Q2_0, GGMLType.PQ2_0, GGMLType.PTQ1_0

# type id -> (weights per block, bytes per block, name)
BLOCKS = {t: (t.block_size, t.type_size, t.name) for t in LOWBIT_TYPES}

# type id -> (bits, group size) of its lossless MLX affine repack (`repack_mlx`)
MLX_LAYOUT = {Q1_0: (1, 128), Q2_0: (2, 64), PQ2_0: (2, 128), PTQ1_0: (2, 128)}

_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint32)
# _TRITS[b, t] = trit t of byte b, t = 0 most significant; uint8 wrap as in the C decoder.
_TRITS = ((((np.arange(256, dtype=np.uint32)[:, None] * _POW3) & 0xFF) * 3) >> 8).astype(np.uint8)


def block_layout(type_id: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a low-bit type id."""
    if type_id not in BLOCKS:
        known = ", ".join(f"{v[2]}={k}" for k, v in BLOCKS.items())
        raise ValueError(f"unknown low-bit GGUF type id {type_id}; known: {known}")
    qk, nbytes, _ = BLOCKS[type_id]
    return qk, nbytes


def row_bytes(type_id: int, cols: int) -> int:
    """Bytes of one row of `cols` weights."""
    qk, nbytes = block_layout(type_id)
    if cols % qk:
        raise ValueError(f"{BLOCKS[type_id][2]}: row length {cols} is not a multiple of {qk}")
    return cols // qk * nbytes


def _blocks(type_id: int, raw: np.ndarray, shape) -> np.ndarray:
    rows, cols = (int(s) for s in shape)
    qk, nbytes = block_layout(type_id)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    need = rows * row_bytes(type_id, cols)
    if raw.size != need:
        raise ValueError(
            f"{BLOCKS[type_id][2]} tensor of shape {rows}x{cols} needs {need} bytes, got {raw.size}"
        )
    return raw.reshape(rows, cols // qk, nbytes)


def _fp16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis (2 bytes) -> float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _codes(type_id: int, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block: (codes uint8 [rows, nblk, qk], d float32 [rows, nblk]).

    Codes are the unsigned stored values: sign bit for Q1_0, 0..3 for the 2-bit types,
    trit 0..2 for PTQ1_0."""
    rows, nblk, _ = blk.shape
    if type_id == Q1_0:
        bits = np.unpackbits(blk[..., 2:], axis=-1, bitorder="little")
        return bits, _fp16(blk[..., 0:2])
    if type_id in (Q2_0, PQ2_0):
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
        codes = (blk[..., 2:, None] >> shifts) & 3
        return codes.reshape(rows, nblk, -1), _fp16(blk[..., 0:2])
    if type_id == PTQ1_0:
        a = _TRITS[blk[..., 0:16]].transpose(0, 1, 3, 2).reshape(rows, nblk, 80)
        b = _TRITS[blk[..., 16:24]].transpose(0, 1, 3, 2).reshape(rows, nblk, 40)
        c = _TRITS[blk[..., 24:26]][..., :4].transpose(0, 1, 3, 2).reshape(rows, nblk, 8)
        return np.concatenate([a, b, c], axis=-1), _fp16(blk[..., 26:28])
    block_layout(type_id)
    raise AssertionError("unreachable")


def dequantize(type_id: int, raw: np.ndarray, shape) -> np.ndarray:
    """GGUF low-bit blocks -> float32 [rows, cols], exactly as the llama.cpp decoders."""
    rows, cols = (int(s) for s in shape)
    codes, d = _codes(type_id, _blocks(type_id, raw, shape))
    d = d[..., None]
    if type_id == Q1_0:
        w = np.where(codes.astype(bool), d, -d)
    else:
        w = (codes.astype(np.float32) - 1.0) * d
    return w.reshape(rows, cols).astype(np.float32)


def _round_away(x: np.ndarray) -> np.ndarray:
    # C roundf / lroundf: halves go away from zero (np.round would go to even).
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def quantize(type_id: int, w: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, row_bytes], following the reference quantizers.

    Q1_0: d = mean |w| of the block, bit = w >= 0. The 2-bit types and PTQ1_0: d = max |w|,
    code = round(w / d) + 1 (clamped to the code range)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    qk, nbytes = block_layout(type_id)
    row_bytes(type_id, cols)
    x = w.reshape(rows, cols // qk, qk)
    out = np.zeros((rows, cols // qk, nbytes), dtype=np.uint8)
    if type_id == Q1_0:
        d = (np.abs(x).sum(axis=-1, dtype=np.float32) / np.float32(qk)).astype(np.float16)
        out[..., 0:2] = d[..., None].view(np.uint8)
        out[..., 2:] = np.packbits(x >= 0, axis=-1, bitorder="little")
        return out.reshape(rows, -1)
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(1) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = _round_away(x * inv[..., None]) + 1
    d16 = amax.astype(np.float16)[..., None].view(np.uint8)
    if type_id in (Q2_0, PQ2_0):
        q = np.clip(q, 0, 3).astype(np.uint8).reshape(rows, cols // qk, qk // 4, 4)
        out[..., 0:2] = d16
        out[..., 2:] = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
        return out.reshape(rows, -1)
    # PTQ1_0: the first of five values is the most significant trit; stored byte is
    # ceil(value * 256 / 243) so the decoder can read trits with a multiply and a shift.
    t = np.clip(q, 0, 2).astype(np.uint32)

    def pack(groups: np.ndarray, ntrits: int) -> np.ndarray:
        # groups [..., bytes, ntrits], trit 0 first (most significant)
        v = np.zeros(groups.shape[:-1], dtype=np.uint32)
        for n in range(ntrits):
            v = v * 3 + groups[..., n]
        if ntrits == 4:
            v = v * 3  # qh: the first value goes to the most significant of five trits
        return ((v * 256 + 242) // 243).astype(np.uint8)

    nb = cols // qk
    a = t[..., 0:80].reshape(rows, nb, 5, 16).transpose(0, 1, 3, 2)
    b = t[..., 80:120].reshape(rows, nb, 5, 8).transpose(0, 1, 3, 2)
    c = t[..., 120:128].reshape(rows, nb, 4, 2).transpose(0, 1, 3, 2)
    out[..., 0:16] = pack(a, 5)
    out[..., 16:24] = pack(b, 5)
    out[..., 24:26] = pack(c, 4)
    out[..., 26:28] = d16
    return out.reshape(rows, -1)


def repack_mlx(type_id: int, raw: np.ndarray, shape, scale_dtype=None):
    """Lossless repack into MLX affine quantization.

    Returns (w_packed uint32 [rows, cols*bits/32], scales, biases [rows, cols/group],
    group_size, bits) such that mx.dequantize(...) equals dequantize(...) exactly:
      Q1_0   -> bits 1, group 128, scale 2d, bias -d
      Q2_0   -> bits 2, group 64,  scale d,  bias -d
      PQ2_0  -> bits 2, group 128, scale d,  bias -d
      PTQ1_0 -> bits 2, group 128, scale d,  bias -d (lossless, but 2.25 instead of 1.75 bpw)
    MLX packs element i of a row at bits [b*i, b*i+b) of the little-endian word stream, which
    is the GGUF order for Q1_0 and the 2-bit types, so their code bytes are reused as is.

    scale_dtype: np.float16 or np.float32; None picks float16 when that is exact, i.e. when
    2d does not overflow and no 2-bit code 3 (+2d) occurs: MLX may evaluate q*s + b in the
    scale dtype, and 3d - d is not exact in float16 (3d needs 12 significant bits)."""
    rows, cols = (int(s) for s in shape)
    blk = _blocks(type_id, raw, shape)
    if type_id == PTQ1_0:
        codes, d = _codes(type_id, blk)
        c = codes.reshape(rows, cols // 4, 4).astype(np.uint8)
        packed = (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6))
        has3 = False
    else:
        packed = blk[..., 2:]
        d = _fp16(blk[..., 0:2])
        has3 = type_id != Q1_0 and bool(((packed & 0x03) == 3).any() | ((packed & 0x0C) == 0x0C).any()
                                  | ((packed & 0x30) == 0x30).any() | ((packed & 0xC0) == 0xC0).any())
    bits, group = MLX_LAYOUT[type_id]
    w_packed = np.ascontiguousarray(packed).reshape(rows, -1).view("<u4").astype(np.uint32)
    scale = 2 * d if type_id == Q1_0 else d
    if scale_dtype is None:
        with np.errstate(over="ignore"):
            ok16 = bool(np.isfinite((2 * d).astype(np.float16)).all()) and not has3
        scale_dtype = np.float16 if ok16 else np.float32
    scales = scale.astype(scale_dtype).reshape(rows, cols // group)
    biases = (-d).astype(scale_dtype).reshape(rows, cols // group)
    return w_packed, scales, biases, group, bits
