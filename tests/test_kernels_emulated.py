"""Metal and CUDA kernel bodies run on the CPU emulator (tests/metal_shim) against the MLX
reference. Outputs are poisoned before each emulated launch, buffers end at guard pages, and
threads run in shuffled order: unwritten outputs, overruns and missing barriers fail."""

import dataclasses
import importlib.util
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metal_shim.emulator import Emulator, EmulatorError
from mlxspec.kernels import lowbit as klowbit
from mlxspec.kernels import markov as kmarkov
from mlxspec.kernels import selector as kselector
from mlxspec.kernels._launch import KernelSpec
from mlxspec.gguf import quants as L

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the emulator")

LANGUAGES = ["metal", "cuda"]
TYPES = [L.Q1_0, L.Q2_0, L.PQ2_0, L.PTQ1_0]
# (type, M, K, x dtype): M = 1 decode, 16 block verify, 3 and 32 partial / several M slices
LOWBIT_CASES = [(t, m, 512, mx.float32) for t in TYPES for m in (1, 3, 16, 32)] + [
    (L.Q1_0, 4, 1152, mx.float16), (L.PTQ1_0, 2, 1152, mx.bfloat16), (L.Q2_0, 5, 1152, mx.float32)]
N = 27  # not a multiple of the rows per threadgroup: exercises the tail
# (B, V, r, T, base dtype, w dtype, max_groups)
MARKOV_CASES = [(5, 300, 64, 0.0, mx.float32, mx.float32, 1024), (4, 1000, 32, 0.8, mx.float16, mx.float32, 2),
                (3, 200, 64, 1.3, mx.bfloat16, mx.float16, 1024)]

# DFlash 2 selector chain: (n, k, R, V, T, hp dtype, codebook dtype)
SELECTOR_CASES = [(7, 16, 64, 300, 0.0, mx.float32, mx.float32), (5, 8, 40, 100, 0.9, mx.float16, mx.bfloat16),
                  (3, 32, 256, 500, 1.5, mx.float32, mx.float16), (15, 1, 16, 50, 0.0, mx.bfloat16, mx.float32)]
LOWBIT_TOL = dict(rtol=1e-4, atol=1e-4)  # relative to max |y| (float32 sums in another order)
LOWBIT_TOL_HALF = dict(rtol=1e-2, atol=1e-2)  # the output is rounded to x's 16-bit dtype
PROB_TOL = dict(rtol=1e-5, atol=1e-6)


def lowbit_inputs(type_id, M, K, dtype, seed=0):
    rng = np.random.default_rng(seed + type_id + 100 * M + K)
    raw = mx.array(L.quantize(type_id, rng.standard_normal((N, K)).astype(np.float32)))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    return x, raw


def markov_inputs(B, V, r, base_dtype, w_dtype, seed=0):
    rng = np.random.default_rng(seed + V + r)
    base = mx.array((rng.standard_normal((B, V)) * 2).astype(np.float32)).astype(base_dtype)
    w1 = mx.array(rng.standard_normal((V, r)).astype(np.float32) * 0.3).astype(w_dtype)
    w2 = mx.array(rng.standard_normal((V, r)).astype(np.float32) * 0.3).astype(w_dtype)
    return base, w1, w2


def run_lowbit(run, case, spec=None):
    type_id, M, K, dtype = case
    x, raw = lowbit_inputs(type_id, M, K, dtype)
    if spec is not None:
        def run_patched(s, inputs, launch):
            return run(spec, inputs, launch)
        return klowbit.lowbit_matmul_kernel(x, raw, type_id, (N, K), run_patched), x, raw
    return klowbit.lowbit_matmul_kernel(x, raw, type_id, (N, K), run), x, raw


def run_markov(run, case, key=None, patch=None):
    B, V, r, T, bd, wd, groups = case
    base, w1, w2 = markov_inputs(B, V, r, bd, wd)
    key = mx.random.key(B + V) if T > 0 else None

    def run_patched(s, inputs, launch):
        return run(patch.get(s.name, s) if patch else s, inputs, launch)

    got = kmarkov.markov_chain_kernel(base, w1, w2, 7, T, key, run_patched, max_groups=groups)
    want = kmarkov.markov_chain_reference(base, w1, w2, 7, T, key)
    return got, want


def selector_inputs(n, k, R, V, hp_dtype, cb_dtype, seed=0):
    rng = np.random.default_rng(seed + n + k + R)
    ids = mx.array(np.stack([rng.choice(V, k, replace=False) for _ in range(n)]).astype(np.int32))
    unary = mx.array(np.sort(rng.standard_normal((n, k)).astype(np.float32), axis=1)[:, ::-1].copy())
    hp = mx.array(rng.standard_normal((n, R)).astype(np.float32) * 0.5).astype(hp_dtype)
    pred = mx.array(rng.standard_normal((V, R)).astype(np.float32) * 0.3).astype(cb_dtype)
    succ = mx.array(rng.standard_normal((V, R)).astype(np.float32) * 0.3).astype(cb_dtype)
    return unary, ids, hp, pred, succ


def run_selector(run, case, spec=None):
    n, k, R, V, T, hd, cd = case
    inputs = selector_inputs(n, k, R, V, hd, cd)
    key = 1234 + n if T > 0 else None

    def run_patched(s, ins, launch):
        return run(spec or s, ins, launch)

    got = kselector.select_chain_kernel(*inputs, 11, T, key, run_patched)
    want = kselector.select_chain(*inputs, 11, T, key)
    return got, want


@pytest.fixture(scope="module", params=LANGUAGES)
def emulator(request):
    """One emulator per language, with every variant these tests launch compiled up front."""
    emu = Emulator(request.param)
    items = []
    for case in LOWBIT_CASES:
        items += emu.record(lambda run, case=case: run_lowbit(run, case))
    for case in MARKOV_CASES:
        items += emu.record(lambda run, case=case: run_markov(run, case))
    for case in SELECTOR_CASES:
        items += emu.record(lambda run, case=case: run_selector(run, case))
    emu.prepare(items)
    return emu


@pytest.mark.parametrize("case", LOWBIT_CASES, ids=lambda c: f"{L.BLOCKS[c[0]][2]}-M{c[1]}-K{c[2]}-{c[3]}")
def test_lowbit_matmul_matches_reference(emulator, case):
    y, x, raw = run_lowbit(emulator.run, case)
    type_id, M, K, dtype = case
    ref = klowbit.lowbit_matmul_reference(x, raw, type_id, (N, K))
    assert y.shape == (M, N) and y.dtype == dtype
    scale = float(mx.abs(ref.astype(mx.float32)).max())
    tol = LOWBIT_TOL if dtype == mx.float32 else LOWBIT_TOL_HALF
    np.testing.assert_allclose(np.array(y.astype(mx.float32)) / scale, np.array(ref.astype(mx.float32)) / scale,
                               **tol)


@pytest.mark.parametrize("case", MARKOV_CASES, ids=lambda c: f"B{c[0]}-V{c[1]}-r{c[2]}-T{c[3]}-groups{c[6]}")
def test_markov_chain_matches_reference(emulator, case):
    (toks, probs), (want_t, want_p) = run_markov(emulator.run, case)
    assert toks.tolist() == want_t.tolist()
    np.testing.assert_allclose(np.array(probs), np.array(want_p), **PROB_TOL)


@pytest.mark.parametrize("case", SELECTOR_CASES, ids=lambda c: f"n{c[0]}-k{c[1]}-R{c[2]}-V{c[3]}-T{c[4]}-{c[5]}-{c[6]}")
def test_selector_chain_matches_reference(emulator, case):
    (toks, picks, scores), (want_t, want_p, want_s) = run_selector(emulator.run, case)
    assert toks.tolist() == want_t.tolist() and picks.tolist() == want_p.tolist()
    np.testing.assert_allclose(np.array(scores), np.array(want_s), rtol=1e-5, atol=1e-5)


def test_selector_chain_broken_variant_is_caught():
    """Conditioning on the anchor at every step (a chain that never moves on) fails."""
    emu = Emulator("metal")
    spec = patched(kselector.CHAIN, "tg_prev[0] = clamp(tok, 0, int(V) - 1);", "")
    items = emu.record(lambda run: run_selector(run, SELECTOR_CASES[0], spec))
    emu.prepare(items)
    (toks, _, scores), (want_t, _, want_s) = run_selector(emu.run, SELECTOR_CASES[0], spec)
    assert toks.tolist() != want_t.tolist() or not np.allclose(np.array(scores), np.array(want_s), atol=1e-5)


# ---- the checks can fail: deliberately broken variants are caught ----

@dataclasses.dataclass(frozen=True)
class PatchedSpec(KernelSpec):
    """A kernel whose source has one replacement applied (a deliberately broken variant)."""
    old: str = ""
    new: str = ""

    def source(self, language):
        header, body = super().source(language)
        assert self.old in header + body, f"patch target not found in {self.stem} ({language})"
        return header.replace(self.old, self.new), body.replace(self.old, self.new)


def patched(spec, old, new):
    return PatchedSpec(name=spec.name + "_broken", inputs=spec.inputs, outputs=spec.outputs, stem=spec.stem,
                       old=old, new=new)


BROKEN_LOWBIT = {
    # forgets the last output row: caught by the poison check
    "unwritten-row": ("n0 + r < N", "n0 + r < N - 1"),
    # reads rows past the end of w: caught by the guard page
    "overrun": ("min(n0 + r, N - 1)", "(n0 + r)"),
    # PTQ1_0 trits taken in byte order instead of the interleaved order: wrong numbers
    "trit-order": ("b = e & 15;\n        n = e >> 4;", "b = e / 5;\n        n = e % 5;"),
}


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("what", sorted(BROKEN_LOWBIT))
def test_broken_lowbit_kernel_is_caught(language, what):
    old, new = BROKEN_LOWBIT[what]
    emu = Emulator(language)
    case = (L.PTQ1_0, 3, 512, mx.float32)
    with pytest.raises((EmulatorError, AssertionError)) as err:
        y, x, raw = run_lowbit(emu.run, case, spec=patched(klowbit.SPEC, old, new))
        ref = klowbit.lowbit_matmul_reference(x, raw, L.PTQ1_0, (N, 512))
        np.testing.assert_allclose(np.array(y), np.array(ref), rtol=1e-4, atol=1e-3)
    expect = {"unwritten-row": "unwritten", "overrun": "past the end of buffer 'w'", "trit-order": "Not equal"}
    assert expect[what] in str(err.value)


@pytest.mark.parametrize("language", LANGUAGES)
def test_missing_barrier_is_caught(language):
    """Without the barrier after the previous-token reduction, other simdgroups read
    threadgroup memory before it is written (poison, in the emulator's shuffled order)."""
    barrier = {"metal": "threadgroup_barrier(mem_flags::mem_threadgroup);\nconst uint prev",
               "cuda": "__syncthreads();\nconst unsigned prev"}[language]
    spec = patched(kmarkov.STEP, barrier, barrier.split("\n")[1])
    emu = Emulator(language)
    with pytest.raises((EmulatorError, AssertionError)):
        (toks, probs), (want_t, want_p) = run_markov(emu.run, MARKOV_CASES[0], patch={kmarkov.STEP.name: spec})
        assert toks.tolist() == want_t.tolist()
        np.testing.assert_allclose(np.array(probs), np.array(want_p), **PROB_TOL)


def test_benchmark_code_runs_on_the_emulator():
    """The benchmark's measurement code (scripts/bench_*.py) on tiny shapes, kernels emulated:
    it must produce rows whose outputs agree with MLX's built-in path."""
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    emu = Emulator("metal")
    rng = np.random.default_rng(0)
    rows = bench.bench_lowbit(emu.run, 1e9, [L.Q1_0, L.PTQ1_0], [("tiny", 16, 256)], [1, 2], 1, rng, reps=1)
    rows += bench.bench_markov(emu.run, 1e9, [(2, 100, 32)], 1, rng, reps=1)
    assert len(rows) == 6
    for r in rows:
        assert r["ours_error"] is None and r["mlx_error"] is None, r
        assert r["max_rel_err"] < 1e-2 and r["ours_us"] > 0 and r["floor_us"] > 0, r
        assert r.get("tokens_equal", True), r
    md = bench._row_md(rows[0])
    assert md.startswith("| lowbit_matmul | Q1_0 | tiny | 1 |")
    # a path that fails on a backend is reported in its row, not fatal
    failed = dict(rows[0], mlx_us=None, mlx_error="ValueError: bits=1 unsupported")
    assert "| - |" in bench._row_md(failed) and "bits=1 unsupported" in bench._row_md(failed)


def test_metal_wrapper_is_what_mx_fast_generates():
    """The signature mx.fast.metal_kernel writes (mlx/fast.cpp write_signature): inputs in
    order, small inputs in the constant space, outputs, then the attributes the body names."""
    from metal_shim.emulator import metal_signature

    x, raw = lowbit_inputs(L.Q1_0, 2, 256, mx.float16)
    inputs = [x, raw, mx.zeros((4,), mx.int32)]
    launch = klowbit.plan(2, N, 256, L.Q1_0, mx.float16)
    text = metal_signature(klowbit.SPEC, inputs, launch, klowbit.SPEC.source("metal")[1], emulated=False)
    head = text.split(") {", 1)[0]
    assert head.splitlines() == [
        "template <typename T, int QTYPE, int TM, int RPS>",
        "[[kernel]] void custom_kernel_mlxspec_lowbit_matmul(",
        "  const device float16_t* x [[buffer(0)]],",
        "  const device uint8_t* w [[buffer(1)]],",
        "  const constant int32_t* params [[buffer(2)]],",
        "  device float16_t* y [[buffer(3)]],",
        "  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],",
        "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],",
        "  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]],",
        "  uint3 threads_per_threadgroup [[threads_per_threadgroup]]",
    ]


def test_kernel_sources_stay_in_the_shared_subset():
    """Constructs that compile as C++ in the emulator but not as Metal (C++14-based), or that
    the shims do not implement, are kept out of the kernel sources."""
    import re

    forbidden = [r"\bstd::", r"\bauto\b", r"if\s+constexpr", r"\[[&=]\]", r"\b(float|half|int|uint)[234]\b",
                 r"\batomic", r"\bprintf\b"]
    for spec in (klowbit.SPEC, kmarkov.STEP, kmarkov.FINISH, kselector.CHAIN):
        for language in LANGUAGES:
            text = "".join(spec.source(language))
            code = re.sub(r"//[^\n]*", "", text)
            for pattern in forbidden:
                assert not re.search(pattern, code), (spec.stem, language, pattern)


@dataclasses.dataclass(frozen=True)
class InlineSpec(KernelSpec):
    """A test kernel given as text (Metal)."""
    body: str = ""

    def source(self, language):
        return "", self.body


@pytest.mark.parametrize("body, message", [
    ("if (thread_index_in_threadgroup < 48) { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
     "out[thread_position_in_grid.x] = a[thread_position_in_grid.x];", "barrier not reached"),
    ("float v = a[thread_position_in_grid.x];\n"
     "if (thread_index_in_simdgroup < 16) { v = simd_sum(v); }\n"
     "out[thread_position_in_grid.x] = v;", "SIMD collective simd_sum"),
    ("out[thread_position_in_grid.x + 1] = a[thread_position_in_grid.x];", "past the end of buffer 'out'"),
])
def test_emulator_rejects_undefined_behaviour(body, message):
    """The emulator's own checks: divergent barriers and collectives, overruns."""
    spec = InlineSpec(name="ub", inputs=("a",), outputs=("out",), stem="", body=body)
    from mlxspec.kernels._launch import Launch

    launch = Launch(grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=((64,),), output_dtypes=(mx.float32,))
    with pytest.raises(EmulatorError, match=message):
        Emulator("metal").run(spec, [mx.arange(64).astype(mx.float32)], launch)
