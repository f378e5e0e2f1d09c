"""The small-M GEMM in front of OpenBLAS (`mlxspec.cpu_gemm`, mlxspec/cpu/small_gemm.c): exact
against float64 for the decode / verify shapes, each output row independent of the row count
(bit for bit), everything else forwarded to OpenBLAS unchanged, out of the way while OpenBLAS runs
more than one thread, and a process with MLXSPEC_SMALL_GEMM=1 decodes speculatively with the
same tokens as autoregressively through it."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxspec import cpu_gemm
from mlxspec.device import find_openblas

F = ctypes.POINTER(ctypes.c_float)
ROWMAJOR, COLMAJOR, NOTRANS, TRANS = 101, 102, 111, 112


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """(our library, OpenBLAS), both loaded locally (this process's MLX keeps its own binding)."""
    ob_path = find_openblas()
    assert ob_path, "OpenBLAS is not installed: run scripts/setup.sh"
    path = cpu_gemm.build(tmp_path_factory.mktemp("native"))
    assert path is not None, cpu_gemm.status()
    ours, ob = ctypes.CDLL(str(path)), ctypes.CDLL(ob_path)
    ob.openblas_set_num_threads(1)
    for lib in (ours, ob):
        lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, F, ctypes.c_int, F, ctypes.c_int,
                                                         ctypes.c_float, F, ctypes.c_int]
    _attach(ours, ob)
    return ours, ob


ONE_THREAD = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 1)  # as if OpenBLAS ran one thread, whatever this process set


def _attach(ours, ob, threads=ONE_THREAD):
    ours.mlxspec_small_gemm_init(ctypes.cast(ob.cblas_sgemm, ctypes.c_void_p), ctypes.cast(threads, ctypes.c_void_p),
                                 cpu_gemm.MAX_ROWS)


def _p(a):
    return a.ctypes.data_as(F)


def _calls(ours) -> int:
    ours.mlxspec_small_gemm_calls.restype = ctypes.c_long
    return int(ours.mlxspec_small_gemm_calls())


def _gemm(lib, A, W, *, alpha=1.0, beta=0.0, C=None, order=ROWMAJOR, tb=TRANS, pad=0):
    """C = alpha * A @ W.T + beta * C through `lib` (W [N, K]; with tb=NOTRANS, C = A @ W, W [K, N]),
    with rows padded by `pad` (strides > widths)."""
    M, K = A.shape
    N = W.shape[0] if tb == TRANS else W.shape[1]
    Ap = np.zeros((M, K + pad), np.float32)
    Ap[:, :K] = A
    Wp = np.zeros((W.shape[0], W.shape[1] + pad), np.float32)
    Wp[:, :W.shape[1]] = W
    Cp = np.zeros((M, N + pad), np.float32)
    if C is not None:
        Cp[:, :N] = C
    lib.cblas_sgemm(order, NOTRANS, tb, M, N, K, alpha, _p(Ap), K + pad, _p(Wp), W.shape[1] + pad, beta, _p(Cp), N + pad)
    return Cp[:, :N]


# the products themselves need AVX-512F or AVX2 + FMA (a hardware capability, as the GPU-only tests
# need a GPU); on a CPU with neither the library is not loaded, and the tests below check that
# instead: forwarding, and a process that decodes as before
SIMD = cpu_gemm.has_simd()
needs_simd = pytest.mark.skipif(not SIMD, reason="this CPU has neither AVX-512F nor AVX2 + FMA: the small GEMM is not loaded on it")


def _kernel_rows(ours) -> int:
    """The most rows the library computes: 24 with AVX-512F and with AVX2 (small_gemm.c)."""
    assert ours.mlxspec_small_gemm_lanes() in (8, 16)
    return 24


@needs_simd
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 21, 24, 25])
@pytest.mark.parametrize("N,K", [(1536, 576), (37, 5), (50, 17), (7, 1000)])
def test_small_products_equal_float64(libs, M, N, K):
    ours, ob = libs
    if M > _kernel_rows(ours):  # more rows than the kernel computes (24): OpenBLAS's own
        rng = np.random.default_rng(M)
        A = rng.standard_normal((M, K), dtype=np.float32)
        W = rng.standard_normal((N, K), dtype=np.float32)
        before = _calls(ours)
        assert np.array_equal(_gemm(ours, A, W), _gemm(ob, A, W)) and _calls(ours) == before
        return
    rng = np.random.default_rng(M * 1000 + N + K)
    A = rng.standard_normal((M, K), dtype=np.float32)
    W = rng.standard_normal((N, K), dtype=np.float32)
    C0 = rng.standard_normal((M, N), dtype=np.float32)
    ref = A.astype(np.float64) @ W.astype(np.float64).T
    before = _calls(ours)
    got = _gemm(ours, A, W, pad=3)
    tol = 1e-6 * np.sqrt(K) * np.abs(A).max() * np.abs(W).max()
    assert np.abs(got - ref).max() <= tol
    got2 = _gemm(ours, A, W, alpha=0.5, beta=-2.0, C=C0)
    assert np.abs(got2 - (0.5 * ref - 2.0 * C0)).max() <= tol
    assert _calls(ours) == before + 2
    # every output row is the product of that row alone, bit for bit (a verify row = a decode step)
    for m in (0, M - 1):
        assert np.array_equal(_gemm(ours, A[m : m + 1], W)[0], got[m])


@needs_simd
@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16, 17, 24])
@pytest.mark.parametrize("N,K", [(64, 309), (70, 17), (512, 1000), (5, 3)])
def test_small_nn_products_equal_float64_and_each_row_alone(libs, M, N, K):
    """B not transposed (attention's P @ V): ours up to 512 columns, within float32 rounding of
    float64, and every row the product of that row alone bit for bit (OpenBLAS's are not on a
    Zen EPYC: a 9-row verify's attention rounded differently from its decode steps)."""
    ours, _ = libs
    rng = np.random.default_rng(M * 7 + N + K)
    A = rng.standard_normal((M, K), dtype=np.float32)
    B = rng.standard_normal((K, N), dtype=np.float32)
    C0 = rng.standard_normal((M, N), dtype=np.float32)
    ref = A.astype(np.float64) @ B.astype(np.float64)
    before = _calls(ours)
    got = _gemm(ours, A, B, tb=NOTRANS, pad=3)
    tol = 1e-6 * np.sqrt(K) * np.abs(A).max() * np.abs(B).max()
    assert np.abs(got - ref).max() <= tol
    got2 = _gemm(ours, A, B, tb=NOTRANS, alpha=0.5, beta=-2.0, C=C0)
    assert np.abs(got2 - (0.5 * ref - 2.0 * C0)).max() <= tol
    assert _calls(ours) == before + 2
    for m in range(M):
        assert np.array_equal(_gemm(ours, A[m : m + 1], B, tb=NOTRANS)[0], got[m]), m


def test_forwarded_products_are_openblas_own(libs):
    """More rows than the kernel computes, column-major, W not transposed and wider than 512
    columns: OpenBLAS's result exactly, not counted."""
    ours, ob = libs
    rng = np.random.default_rng(0)
    A = rng.standard_normal((_kernel_rows(ours) + 1 if SIMD else 25, 64), dtype=np.float32)
    W = rng.standard_normal((40, 64), dtype=np.float32)
    before = _calls(ours)
    assert np.array_equal(_gemm(ours, A, W), _gemm(ob, A, W))
    sq = rng.standard_normal((16, 16), dtype=np.float32)  # square: valid in either storage order
    sqW = rng.standard_normal((16, 16), dtype=np.float32)
    assert np.array_equal(_gemm(ours, sq, sqW, order=COLMAJOR), _gemm(ob, sq, sqW, order=COLMAJOR))
    wide = rng.standard_normal((16, 600), dtype=np.float32)
    assert np.array_equal(_gemm(ours, sq, wide, tb=NOTRANS), _gemm(ob, sq, wide, tb=NOTRANS))
    assert _calls(ours) == before


@needs_simd
def test_beside_openblas_threads_it_splits_a_product_over_two_cores_bit_for_bit(libs):
    """While OpenBLAS runs more than one thread (the governor saw the cores free), a product big
    enough is split by output columns between the caller and one worker of ours: every output
    the same bit for bit as on one core, odd widths included; above the kernel's rows OpenBLAS computes."""
    ours, ob = libs
    threads = [2]
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: threads[0])
    _attach(ours, ob, fn)
    rng = np.random.default_rng(7)
    try:
        for M, N, K in ((1, 1536, 576), (5, 1037, 576), (16, 576, 1536), (3, 37, 5), (_kernel_rows(ours), 96, 576)):
            A = rng.standard_normal((M, K), dtype=np.float32)
            W = rng.standard_normal((N, K), dtype=np.float32)
            C0 = rng.standard_normal((M, N), dtype=np.float32)
            threads[0] = 2
            before = _calls(ours)
            two = _gemm(ours, A, W, alpha=0.5, beta=-2.0, C=C0, pad=3)
            assert _calls(ours) == before + 1, (M, N, K)
            threads[0] = 1
            one = _gemm(ours, A, W, alpha=0.5, beta=-2.0, C=C0, pad=3)
            assert np.array_equal(two, one), (M, N, K)
            ref = 0.5 * (A.astype(np.float64) @ W.astype(np.float64).T) - 2.0 * C0
            assert np.abs(two - ref).max() <= 1e-6 * np.sqrt(K) * np.abs(A).max() * np.abs(W).max() + 1e-5
        threads[0] = 2
        R = _kernel_rows(ours) + 1
        A = np.ones((R, 32), np.float32)
        before = _calls(ours)
        assert np.array_equal(_gemm(ours, A, np.ones((5, 32), np.float32)), np.full((R, 5), 32.0, np.float32))
        assert _calls(ours) == before  # OpenBLAS computed it
    finally:
        _attach(ours, ob)


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[2])
import mlxspec, mlxspec.blas
from mlxspec import cpu_gemm
import conftest
from mlxspec.engine.ngram import NgramDrafter
from mlxspec.targets.load import load_target
from test_engine import run
mlxspec.blas.set_blas_threads(1)
conftest.write_tiny_model(sys.argv[1])
target, tok = load_target(sys.argv[1])
ids = tok.encode("the cat the cat the cat the", add_special_tokens=False)
ar = run(target, ids, max_tokens=32)
spec = run(target, ids, NgramDrafter(target.info.vocab_size, 4), max_tokens=32)
print(cpu_gemm.status())
print("equal" if ar == spec else f"differ {ar} {spec}")
"""


def test_a_process_with_it_on_decodes_speculatively_as_autoregressively(tmp_path):
    env = {**os.environ, "MLXSPEC_SMALL_GEMM": "1", "MLXSPEC_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "tiny.gguf"), str(Path(__file__).parent)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]  # on an AVX2-only CPU this was a segfault once: loaded, never attached
    status, verdict = r.stdout.strip().splitlines()[-2:]
    assert verdict == "equal"
    if not SIMD:
        assert status == "small-M GEMM: not in use: this CPU has neither AVX-512F nor AVX2 with FMA"
        return
    assert status.startswith("small-M GEMM: on (") and int(status.split("(")[1].split()[0]) > 0, status
    assert list((tmp_path / "cache" / "native").glob("small_gemm-*.so"))


def test_on_by_default_and_zero_turns_it_off(monkeypatch):
    monkeypatch.delenv("MLXSPEC_SMALL_GEMM", raising=False)
    assert cpu_gemm.enabled()
    monkeypatch.setenv("MLXSPEC_SMALL_GEMM", "0")
    assert not cpu_gemm.enabled()
    if not cpu_gemm.active():  # this process's own state (the suite preloads it through LD_PRELOAD)
        assert cpu_gemm.status() == "small-M GEMM: off (MLXSPEC_SMALL_GEMM=0)"


def test_ld_preload_puts_it_in_front_of_openblas(tmp_path):
    """`python -m mlxspec.blas` prints our library first, then OpenBLAS (with MLXSPEC_SMALL_GEMM=0
    OpenBLAS alone); a process started with that LD_PRELOAD computes its small products with it."""
    env = {**os.environ, "MLXSPEC_CACHE": str(tmp_path / "cache")}
    env.pop("LD_PRELOAD", None)
    env.pop("MLXSPEC_SMALL_GEMM", None)
    plain = subprocess.run([sys.executable, "-m", "mlxspec.blas"], env={**env, "MLXSPEC_SMALL_GEMM": "0"},
                           capture_output=True, text=True).stdout.split()
    assert plain == [find_openblas()]
    both = subprocess.run([sys.executable, "-m", "mlxspec.blas"], env=env, capture_output=True, text=True).stdout.split()
    if not SIMD:  # OpenBLAS alone, and a process started with it runs on OpenBLAS
        assert both == [find_openblas()]
        code = "import mlxspec\nfrom mlxspec import cpu_gemm\nimport mlx.core as mx\nmx.eval(mx.ones((3, 32)) @ mx.ones((64, 32)).T)\nprint(cpu_gemm.status())"
        r = subprocess.run([sys.executable, "-c", code], env={**env, "LD_PRELOAD": " ".join(both)}, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip() == "small-M GEMM: not in use: this CPU has neither AVX-512F nor AVX2 with FMA", r.stderr[-2000:]
        return
    assert len(both) == 2 and "/small_gemm-" in both[0] and both[1] == find_openblas()
    code = ("import mlxspec, mlxspec.blas\nfrom mlxspec import cpu_gemm\nimport mlx.core as mx\n"
            "mlxspec.blas.set_blas_threads(1)\nmx.eval(mx.ones((3, 32)) @ mx.ones((64, 32)).T)\n"
            "mx.eval(mx.ones((24, 32)) @ mx.ones((64, 32)).T)\nprint(cpu_gemm.status())")
    r = subprocess.run([sys.executable, "-c", code], env={**env, "LD_PRELOAD": " ".join(both)}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # preloaded, nothing calls mlxspec_small_gemm_init: its own row limit holds (24 rows, which a
    # default of 16 once sent to OpenBLAS)
    lanes = "AVX-512F" if " avx512f" in open("/proc/cpuinfo").read() else "AVX2 + FMA"
    assert r.stdout.strip().splitlines()[-1] == f"small-M GEMM: on (2 products so far; {lanes})"
