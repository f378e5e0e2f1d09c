"""The CUDA kernel sources compile with nvcc, wrapped exactly as mx.fast.cuda_kernel wraps a
body (one __global__ function per template instance, inputs and outputs as parameters,
template arguments as constexpr / using lines). Device code only (--ptx), as NVRTC compiles it."""

import shutil

import mlx.core as mx
import pytest

from metal_shim.emulator import EmulatorError, nvcc_compile
from mlxspec.kernels import lowbit as klowbit
from mlxspec.kernels import markov as kmarkov
from mlxspec.kernels import selector as kselector
from mlxspec.gguf import quants as L

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def test_lowbit_matmul_compiles():
    # every type and dtype once, decode (M = 1) and verify (M = 16) tiles; all variants of the
    # 4 x 3 x 5 matrix take ~1 s of nvcc each, so the test keeps a covering subset
    cases = [(L.Q1_0, mx.float32, 1), (L.Q2_0, mx.float16, 16), (L.PQ2_0, mx.bfloat16, 3),
             (L.PTQ1_0, mx.float32, 16), (L.PTQ1_0, mx.float16, 1)]
    variants = []
    for type_id, dtype, M in cases:
        K = 512
        inputs = [mx.zeros((M, K), dtype), mx.zeros((8, L.row_bytes(type_id, K)), mx.uint8),
                  mx.zeros((4,), mx.int32)]
        variants.append((inputs, klowbit.plan(M, 8, K, type_id, dtype)))
    nvcc_compile(klowbit.SPEC, variants)


def test_markov_kernels_compile():
    B, V, r = 4, 100, 256
    steps = []
    for base_dtype, w_dtype in ((mx.float32, mx.float32), (mx.float16, mx.float32), (mx.bfloat16, mx.bfloat16)):
        inputs = [mx.zeros((B, V), base_dtype), mx.zeros((V, r), w_dtype), mx.zeros((V, r), w_dtype),
                  mx.zeros((1,), mx.int32), mx.zeros((1, 4)), mx.zeros((7,), mx.uint32), mx.zeros((1,))]
        steps.append((inputs, kmarkov.plan_step(B, V, r)))
    nvcc_compile(kmarkov.STEP, steps)
    finish = [mx.zeros((B, 3), mx.int32), mx.zeros((B, 3, 4)), mx.zeros((2,), mx.uint32)]
    nvcc_compile(kmarkov.FINISH, [(finish, kmarkov.plan_finish(B, 3))])


def test_selector_chain_compiles():
    n, R, V = 7, 256, 100
    variants = []
    for k, hp_dtype, cb_dtype in ((16, mx.float32, mx.float32), (8, mx.float16, mx.bfloat16), (32, mx.bfloat16, mx.float16)):
        inputs = [mx.zeros((n, k)), mx.zeros((n, k), mx.int32), mx.zeros((n, R), hp_dtype), mx.zeros((V, R), cb_dtype),
                  mx.zeros((V, R), cb_dtype), mx.zeros((7,), mx.uint32), mx.zeros((1,))]
        variants.append((inputs, kselector.plan(n, k, R)))
    nvcc_compile(kselector.CHAIN, variants)


def test_nvcc_check_can_fail():
    """A body that does not compile is reported (so the tests above are not vacuous)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Broken(type(kmarkov.FINISH)):
        def source(self, language):
            header, body = super().source(language)
            return header, body.replace("tokens[k] = idx;", "tokens[k] = undeclared_name;")

    spec = Broken(**{f.name: getattr(kmarkov.FINISH, f.name) for f in dataclasses.fields(kmarkov.FINISH)})
    finish = [mx.zeros((2, 3), mx.int32), mx.zeros((2, 3, 4)), mx.zeros((2,), mx.uint32)]
    with pytest.raises(EmulatorError, match="undeclared_name"):
        nvcc_compile(spec, [(finish, kmarkov.plan_finish(2, 3))])
