"""GGUF low-bit codecs: hand-made blocks, round trips, and the lossless MLX repack."""

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.gguf import quants as L

TYPES = [L.Q1_0, L.Q2_0, L.PQ2_0, L.PTQ1_0]


def _f16_bytes(v):
    return np.array([v], dtype="<f2").view(np.uint8)


def test_block_sizes():
    assert L.block_layout(L.Q1_0) == (128, 18)
    assert L.block_layout(L.Q2_0) == (64, 18)
    assert L.block_layout(L.PQ2_0) == (128, 34)
    assert L.block_layout(L.PTQ1_0) == (128, 28)
    with pytest.raises(ValueError, match="unknown low-bit"):
        L.block_layout(12)


def test_q1_0_sign_bits_are_lsb_first():
    blk = np.zeros(18, np.uint8)
    blk[0:2] = _f16_bytes(0.5)
    blk[2] = 0b0000_0101  # weights 0 and 2 positive
    blk[17] = 0b1000_0000  # weight 127 positive
    w = L.dequantize(L.Q1_0, blk, (1, 128))[0]
    pos = np.flatnonzero(w > 0)
    assert pos.tolist() == [0, 2, 127]
    assert set(np.unique(w)) == {-0.5, 0.5}


@pytest.mark.parametrize("type_id", [L.Q2_0, L.PQ2_0])
def test_two_bit_codes_lsb_first(type_id):
    qk, nbytes = L.block_layout(type_id)
    blk = np.full(nbytes, 0x55, np.uint8)  # every code 01 -> 0
    blk[0:2] = _f16_bytes(2.0)
    blk[2] = 0b11_10_01_00  # weights 0..3: codes 0, 1, 2, 3
    w = L.dequantize(type_id, blk, (1, qk))[0]
    assert w[:4].tolist() == [-2.0, 0.0, 2.0, 4.0]
    assert not w[4:].any()


def _ptq_byte(trits):
    # the stored byte is ceil(v * 256 / 243) of the base-3 value, first trit most significant
    v = 0
    for t in trits:
        v = v * 3 + t
    if len(trits) == 4:
        v *= 3
    return (v * 256 + 242) // 243


@pytest.mark.parametrize(
    "where, trit, expect",
    [("qs", (0, 3), 3), ("qs", (1, 3), 19), ("qs", (4, 15), 79), ("qs", (0, 16), 80),
     ("qs", (2, 21), 101), ("qh", (0, 0), 120), ("qh", (0, 1), 121), ("qh", (3, 1), 127)],
)
def test_ptq1_0_trit_positions(where, trit, expect):
    """Trit t of qs[m] is weight 16t+m (m<16), 80+8t+(m-16) (m>=16); of qh[h], 120+2t+h."""
    n, m = trit
    blk = np.zeros(28, np.uint8)
    blk[0:24] = _ptq_byte((1,) * 5)
    blk[24:26] = _ptq_byte((1,) * 4)
    zeros = [1] * (5 if where == "qs" else 4)
    zeros[n] = 2
    blk[m if where == "qs" else 24 + m] = _ptq_byte(tuple(zeros))
    blk[26:28] = _f16_bytes(1.5)
    w = L.dequantize(L.PTQ1_0, blk, (1, 128))[0]
    assert np.flatnonzero(w).tolist() == [expect]
    assert w[expect] == 1.5


@pytest.mark.parametrize("type_id", TYPES)
def test_roundtrip_is_a_fixed_point(type_id):
    rng = np.random.default_rng(type_id)
    w = rng.standard_normal((6, 256)).astype(np.float32)
    raw = L.quantize(type_id, w)
    assert raw.shape == (6, L.row_bytes(type_id, 256))
    dq = L.dequantize(type_id, raw, w.shape)
    # the quantizer is idempotent on its own output, and the approximation is sane
    assert np.array_equal(L.quantize(type_id, dq), raw)
    assert np.corrcoef(w.ravel(), dq.ravel())[0, 1] > 0.7


def test_ternary_input_is_exact():
    rng = np.random.default_rng(3)
    w = (rng.integers(-1, 2, (4, 256)) * 0.25).astype(np.float32)
    for t in (L.Q2_0, L.PQ2_0, L.PTQ1_0):
        assert np.array_equal(L.dequantize(t, L.quantize(t, w), w.shape), w)


def test_wrong_size_is_an_error():
    with pytest.raises(ValueError, match="needs 36 bytes"):
        L.dequantize(L.Q1_0, np.zeros(35, np.uint8), (2, 128))
    with pytest.raises(ValueError, match="not a multiple of 64"):
        L.row_bytes(L.Q2_0, 100)


def _random_raw(type_id, rows, cols, rng):
    qk, nbytes = L.block_layout(type_id)
    raw = rng.integers(0, 256, (rows, cols // qk, nbytes), dtype=np.uint8)
    d = (rng.standard_normal((rows, cols // qk)) * 0.05).astype("<f2")
    if type_id == L.PTQ1_0:
        raw[..., 26:28] = d.view(np.uint8).reshape(rows, -1, 2)
    else:
        raw[..., 0:2] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_id", TYPES)
def test_repack_mlx_is_bit_exact(type_id):
    rng = np.random.default_rng(10 + type_id)
    for raw in (_random_raw(type_id, 5, 512, rng), L.quantize(type_id, rng.standard_normal((5, 512)))):
        wq, s, b, g, bits = L.repack_mlx(type_id, raw, (5, 512))
        assert wq.dtype == np.uint32 and wq.shape == (5, 512 * bits // 32)
        got = mx.dequantize(mx.array(wq), mx.array(s), mx.array(b), group_size=g, bits=bits)
        assert np.array_equal(np.array(got.astype(mx.float32)), L.dequantize(type_id, raw, (5, 512)))


def test_repack_scale_dtype_rule():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 128)).astype(np.float32)
    assert L.repack_mlx(L.PQ2_0, L.quantize(L.PQ2_0, w), w.shape)[1].dtype == np.float16
    raw = L.quantize(L.PQ2_0, w)
    raw[0, 2] = 0xFF  # four +2 codes: float16 would round 3d - d
    assert L.repack_mlx(L.PQ2_0, raw, w.shape)[1].dtype == np.float32


def test_mlx_one_bit_matmul_matches():
    """mx.quantized_matmul with bits=1 works in the installed MLX and equals the dense product."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    raw = L.quantize(L.Q1_0, w)
    wq, s, b, g, bits = L.repack_mlx(L.Q1_0, raw, w.shape)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    got = mx.quantized_matmul(mx.array(x), mx.array(wq), mx.array(s).astype(mx.float32),
                              mx.array(b).astype(mx.float32), transpose=True, group_size=g, bits=bits)
    ref = x @ L.dequantize(L.Q1_0, raw, w.shape).T
    np.testing.assert_allclose(np.array(got), ref, rtol=1e-4, atol=1e-4)
