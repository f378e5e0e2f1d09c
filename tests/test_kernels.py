"""Kernel interface: backend choice and the pure-MLX references against numpy."""

import mlx.core as mx
import numpy as np
import pytest

from mlxspec import kernels
from mlxspec.kernels import lowbit as klowbit
from mlxspec.kernels import markov as kmarkov
from mlxspec.gguf import quants as L


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv("MLXSPEC_KERNELS", "reference")
    assert kernels.backend() == "reference"
    monkeypatch.setenv("MLXSPEC_KERNELS", "auto")
    kernels.use_reference()
    try:
        assert kernels.backend() == "reference"
    finally:
        kernels.use_reference(False)
    monkeypatch.setenv("MLXSPEC_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MLXSPEC_KERNELS"):
        kernels.backend()


def test_backend_without_gpu_is_reference():
    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("a GPU backend is present")
    assert kernels.backend() == "reference"


def test_sources_have_header_and_body():
    for spec in (klowbit.SPEC, kmarkov.STEP, kmarkov.FINISH):
        for language in ("metal", "cuda"):
            header, body = spec.source(language)
            assert body.strip(), (spec.name, language)


@pytest.mark.parametrize("type_id", [L.Q1_0, L.Q2_0, L.PQ2_0, L.PTQ1_0])
def test_reference_lowbit_matmul(type_id):
    rng = np.random.default_rng(type_id)
    N, K, M = 12, 256, 3
    raw = L.quantize(type_id, rng.standard_normal((N, K)))
    x = rng.standard_normal((M, K)).astype(np.float32)
    want = x @ L.dequantize(type_id, raw, (N, K)).T
    for w in (mx.array(raw), mx.array(raw).view(mx.uint32)):  # uint8 or uint32 raw blocks
        got = kernels.lowbit_matmul(mx.array(x), w, type_id, (N, K))
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    # leading dimensions of x are kept
    y3 = kernels.lowbit_matmul(mx.array(x).reshape(1, M, K), mx.array(raw), type_id, (N, K))
    assert y3.shape == (1, M, N)
    # the MLX dequantizer is exactly the numpy one
    assert np.array_equal(np.array(klowbit.dequantize_mlx(mx.array(raw), type_id, (N, K))),
                          L.dequantize(type_id, raw, (N, K)))


def test_lowbit_checks():
    raw = mx.zeros((4, 36), dtype=mx.uint8)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 256\]"):
        kernels.lowbit_matmul(mx.zeros((2, 128)), raw, L.Q1_0, (4, 256))
    with pytest.raises(ValueError, match="needs 144 bytes"):
        kernels.lowbit_matmul(mx.zeros((2, 256)), raw[:3], L.Q1_0, (4, 256))


def _numpy_chain(base, w1, w2, anchor, T, noise):
    prev, toks, probs = anchor, [], []
    for k in range(base.shape[0]):
        z = base[k].astype(np.float64) + w2.astype(np.float64) @ w1[prev].astype(np.float64)
        s = z if T == 0 else z / T
        x = int(np.argmax(s if T == 0 else s + noise[k]))
        p = np.exp(s - s.max())
        toks.append(x)
        probs.append(p[x] / p.sum())
        prev = x
    return toks, probs


@pytest.mark.parametrize("T", [0.0, 0.7])
def test_reference_markov_chain(T):
    rng = np.random.default_rng(7)
    B, V, r = 6, 50, 8
    base = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    w1 = rng.standard_normal((V, r)).astype(np.float32)
    w2 = (rng.standard_normal((V, r)) * 0.5).astype(np.float32)
    key = mx.random.key(3)
    noise = np.array(kmarkov.gumbel(kmarkov.seed_words(key), mx.arange(B), V))
    toks, probs = kernels.markov_chain(mx.array(base), mx.array(w1), mx.array(w2), 4, T, key)
    want_t, want_p = _numpy_chain(base, w1, w2, 4, T, noise)
    assert toks.dtype == mx.int32 and toks.tolist() == want_t
    np.testing.assert_allclose(np.array(probs), want_p, rtol=1e-5)


def test_markov_head_changes_the_chain():
    """The Markov bias is conditioned on the previous draft: a head that maps token a to b
    must make b follow a."""
    V, r = 10, 4
    base = mx.zeros((3, V))
    w1 = mx.zeros((V, r)).at[2, 0].add(1.0).at[5, 1].add(1.0)
    w2 = mx.zeros((V, r)).at[5, 0].add(3.0).at[7, 1].add(3.0)
    toks, probs = kernels.markov_chain(base, w1, w2, anchor=2)
    assert toks.tolist() == [5, 7, 0]
    assert probs[0].item() == pytest.approx(np.exp(3) / (np.exp(3) + 9), rel=1e-6)


def test_markov_checks():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kernels.markov_chain(mx.zeros((2, 10)), mx.zeros((10, 4)), mx.zeros((10, 4)), anchor=10)
    with pytest.raises(ValueError, match=r"w1 and w2 must both be \[V=10, r\]"):
        kernels.markov_chain(mx.zeros((2, 10)), mx.zeros((10, 4)), mx.zeros((10, 5)), anchor=1)


def test_gumbel_samples_follow_softmax():
    """argmax(s + g) over many positions is distributed as softmax(s)."""
    s = np.log(np.array([0.5, 0.25, 0.15, 0.1], dtype=np.float32))
    n = 20000
    g = kmarkov.gumbel(kmarkov.seed_words(mx.random.key(11)), mx.arange(n), 4)
    picks = np.array(mx.argmax(mx.array(s) + g, axis=-1))
    freq = np.bincount(picks, minlength=4) / n
    np.testing.assert_allclose(freq, np.exp(s), atol=0.015)
    # different keys give different samples
    g2 = kmarkov.gumbel(kmarkov.seed_words(mx.random.key(12)), mx.arange(n), 4)
    assert not np.array_equal(np.array(g), np.array(g2))


@pytest.mark.parametrize("type_id", [L.Q1_0, L.Q2_0, L.PQ2_0, L.PTQ1_0])
def test_mlx_ops_repack_is_exact(type_id):
    rng = np.random.default_rng(type_id)
    raw = L.quantize(type_id, rng.standard_normal((6, 256)))
    raw[0, 2:10] = 0xFF  # +2 codes for the 2-bit types (bytes 0-1 hold a scale)
    wq, s, b, g, bits = klowbit.repack_mlx_ops(mx.array(raw), type_id, (6, 256))
    got = mx.dequantize(wq, s, b, group_size=g, bits=bits)
    assert np.array_equal(np.array(got), L.dequantize(type_id, raw, (6, 256)))
