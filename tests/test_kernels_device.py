"""The same parity checks run for real through mx.fast.metal_kernel / mx.fast.cuda_kernel
when MLX has a Metal or CUDA backend; skipped elsewhere."""

import mlx.core as mx
import numpy as np
import pytest

from mlxspec import kernels
from mlxspec.kernels import lowbit as klowbit
from mlxspec.kernels import markov as kmarkov
from mlxspec.kernels._launch import runner
from mlxspec.gguf import quants as L

BACKEND = kernels.backend()
pytestmark = pytest.mark.skipif(
    BACKEND == "reference",
    reason="no Metal or MLX CUDA backend here (kernels.backend() == 'reference'); "
    "tests/test_kernels_emulated.py runs the same kernel bodies on the CPU emulator",
)


@pytest.mark.parametrize("type_id", [L.Q1_0, L.Q2_0, L.PQ2_0, L.PTQ1_0])
@pytest.mark.parametrize("M", [1, 4, 16, 32])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_lowbit_matmul_on_device(type_id, M, dtype):
    rng = np.random.default_rng(type_id + M)
    N, K = 300, 4096
    raw = mx.array(L.quantize(type_id, rng.standard_normal((N, K)).astype(np.float32)))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    y = klowbit.lowbit_matmul_kernel(x, raw, type_id, (N, K), runner(BACKEND))
    ref = klowbit.lowbit_matmul_reference(x, raw, type_id, (N, K)).astype(mx.float32)
    scale = float(mx.abs(ref).max())
    tol = 1e-4 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(y.astype(mx.float32)) / scale, np.array(ref) / scale, rtol=tol, atol=tol)
    # the public entry point takes the same path
    np.testing.assert_allclose(np.array(kernels.lowbit_matmul(x, raw, type_id, (N, K)).astype(mx.float32)),
                               np.array(y.astype(mx.float32)), rtol=0, atol=0)


@pytest.mark.parametrize("T", [0.0, 0.8])
@pytest.mark.parametrize("V, r", [(1000, 64), (151936, 256)])
def test_markov_chain_on_device(T, V, r):
    rng = np.random.default_rng(V)
    B = 8
    base = mx.array((rng.standard_normal((B, V)) * 2).astype(np.float32))
    w1 = mx.array((rng.standard_normal((V, r)) * 0.3).astype(np.float32))
    w2 = mx.array((rng.standard_normal((V, r)) * 0.3).astype(np.float32))
    key = mx.random.key(1) if T > 0 else None
    toks, probs = kernels.markov_chain(base, w1, w2, 11, T, key)
    want_t, want_p = kmarkov.markov_chain_reference(base, w1, w2, 11, T, key)
    assert toks.tolist() == want_t.tolist()
    np.testing.assert_allclose(np.array(probs), np.array(want_p), rtol=1e-4, atol=1e-6)
