"""The attention softmax and the SwiGLU on the host (mlxspec.targets.host_math,
mlxspec/cpu/mlx_math.c): the numbers MLX's own softmax and mlx-lm's compiled swiglu give, bit for
bit, in every target forward they take part in, and a check that notices when they are not."""

import mlx.core as mx
import numpy as np
import pytest
from test_targets import PROMPT
from test_tree_forward import PARENTS, TOKENS
from tiny_targets import ARCHS, tiny_target

from mlxspec import cpu_gemm, device
from mlxspec.targets import host_math
from mlxspec.targets.model import trim_cache
from mlxspec.targets.tree import tree_support

LOWEST = np.finfo(np.float32).min
FLAGS = set(device.cpu_flags().split())
NATIVE_LANES = 16 if "avx512f" in FLAGS else 8 if {"avx2", "fma"} <= FLAGS else 1


def mlx_softmax(x: np.ndarray, q_rows: int, causal: int) -> np.ndarray:
    """What MLX's attention fallback computes: where(mask, x, lowest), then softmax."""
    a = mx.array(x)
    if causal >= 0:
        rows = np.arange(x.shape[0]) % q_rows
        keep = (rows[:, None] + causal) >= np.arange(x.shape[1])[None]
        a = mx.where(mx.array(keep), a, mx.array(LOWEST, mx.float32))
    return np.array(mx.softmax(a, axis=-1, precise=True))


def test_it_is_on_here():
    assert host_math.usable(), host_math.status()
    assert host_math.status().startswith(f"host softmax and SwiGLU: on ({NATIVE_LANES} lanes"), host_math.status()


# the tiny architectures whose MLPs (and MoE experts) call mlx-lm's `swiglu` by name (gemma3: GELU;
# gpt_oss: its own clamped activation)
SWIGLU_ARCHS = {"llama", "qwen3", "qwen3_moe", "mistral", "llama3_1", "qwen3_5"}
BUILDS = {"native": (), "scalar": ("-mno-avx",)}
if NATIVE_LANES == 16:
    BUILDS["avx2"] = ("-mno-avx512f",)  # the path an AVX2-only CPU builds, run here


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The library as this CPU builds it, and its AVX2 and scalar paths (what an AVX2-only EPYC
    or another CPU would run): name -> (CDLL, lanes)."""
    import ctypes

    out = {}
    for name, extra in BUILDS.items():
        state: dict = {}
        path = cpu_gemm.build(out_dir=tmp_path_factory.mktemp(name), source=host_math.SOURCE,
                              flags=("-ffp-contract=off", *extra), libs=("-lm",), state=state)
        assert path is not None, (name, state)
        lib = ctypes.CDLL(str(path))
        lib.mlxspec_softmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long]
        lib.mlxspec_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
        out[name] = (lib, int(lib.mlxspec_math_lanes()))
    return out


@pytest.mark.parametrize("build", list(BUILDS))
def test_softmax_rows_equal_mlx_bit_for_bit(builds, build):
    lib, lanes = builds[build]
    assert lanes == {"native": NATIVE_LANES, "avx2": 8, "scalar": 1}[build]
    rng = np.random.default_rng(1)
    for trial in range(200):
        rows, n = int(rng.integers(1, 30)), int(rng.integers(1, 600))  # tails of every length
        x = (rng.standard_normal((rows, n)) * rng.choice([0.01, 1.0, 8.0, 60.0])).astype(np.float32)
        if trial % 5 == 0:
            x[rng.random(x.shape) < 0.1] = -np.inf  # an additive mask's -inf
            x[:, 0] = 0.0
        q_rows = int(rng.integers(1, rows + 1))
        causal = -1 if trial % 2 else int(rng.integers(0, max(n - q_rows, 0) + 1))
        want = mlx_softmax(x, q_rows, causal)
        got = np.ascontiguousarray(x.copy())
        lib.mlxspec_softmax_rows(got.ctypes.data, rows, n, q_rows, causal)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (rows, n, causal)


@pytest.mark.parametrize("build", list(BUILDS))
def test_swiglu_equals_mlx_lm_bit_for_bit(builds, build):
    from mlx_lm.models.activations import swiglu

    lib, _ = builds[build]
    rng = np.random.default_rng(2)
    for trial in range(100):
        n = int(rng.integers(1, 5000))
        scale = float(rng.choice([0.01, 1.0, 6.0, 40.0, 200.0]))
        g = (rng.standard_normal(n) * scale).astype(np.float32)
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        g[: min(n, 4)] = (0.0, -0.0, 95.0, -95.0)[: min(n, 4)]  # sigmoid's two sides of zero, exp past +-88
        want = np.array(swiglu(mx.array(g), mx.array(x)))
        got = np.empty_like(g)
        lib.mlxspec_swiglu(g.ctypes.data, x.ctypes.data, got.ctypes.data, n)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (build, n, scale)


@pytest.mark.parametrize("where", ["MLX primitives", "between evaluations"])
def test_the_check_notices_a_softmax_that_sums_in_another_order(where, tmp_path, monkeypatch):
    """A normalizer summed in four lanes (what a compiler's reassociation would do) is within
    1e-7 of MLX's and not equal to it: the check must refuse it, with the reason, whether the C
    runs as MLX primitives (`mlxspec.cpu_ops`, built again from the mutant) or between two
    evaluations."""
    from mlxspec import cpu_ops

    src = host_math.SOURCE.read_text()
    line = "for (j = 0; j < n; j++) s = s + x[j];  /* left to right, as MLX sums */"
    assert line in src
    four = ("float s4[4] = {0, 0, 0, 0}; for (j = 0; j < n; j++) s4[j % 4] += x[j]; "
            "s = (s4[0] + s4[1]) + (s4[2] + s4[3]);")
    mutant = tmp_path / "softmax.c"
    mutant.write_text(src.replace(line, four))
    state: dict = {}
    path = cpu_gemm.build(out_dir=tmp_path, source=mutant, flags=("-ffp-contract=off",), libs=("-lm",), state=state)
    assert path is not None, state
    monkeypatch.setattr(host_math, "SOURCE", mutant)
    monkeypatch.setattr(host_math, "_STATE", {})
    monkeypatch.setattr(cpu_gemm, "build", lambda **kw: path)
    if where == "MLX primitives":
        monkeypatch.setattr(cpu_ops, "SOURCES", [cpu_ops.SOURCES[0], mutant])
        monkeypatch.setattr(cpu_ops, "_STATE", {})
        assert host_math.in_graph(), cpu_ops.why()
    else:
        monkeypatch.setattr(cpu_ops, "_STATE", {"why": "left out by the test"})
        assert not host_math.in_graph()
    assert not host_math.check()
    assert not host_math.usable()
    assert "differs from this MLX's" in host_math.status(), host_math.status()
    with host_math.installed():  # refused: mx.fast is left alone
        assert mx.fast.scaled_dot_product_attention is host_math._ORIGINAL


def _forwards(target, on: bool, monkeypatch):
    """Prompt prefill, a 9-token chain, the same 9 tokens one at a time, and a tree: logits."""
    monkeypatch.setitem(host_math._STATE, "ok", on)
    cache = target.make_cache()
    pre, _ = target(mx.array([PROMPT]), cache, logits="all")
    chain = TOKENS[:9]
    lc, taps = target(mx.array([chain]), cache, taps=(1,))
    trim_cache(cache, len(chain))
    steps = [np.array(target(mx.array([[t]]), cache)[0][0, -1]) for t in chain]
    trim_cache(cache, len(chain))
    out = [np.array(pre), np.array(lc), np.array(taps), np.stack(steps)]
    if tree_support(target) is None:
        lt, _ = target(mx.array([TOKENS]), cache, tree=PARENTS)
        out.append(np.array(lt))
    return out


@pytest.mark.parametrize("where", ["MLX primitives", "between evaluations"])
@pytest.mark.parametrize("arch", ARCHS)
def test_target_forwards_are_the_same_bits_with_it(arch, where, monkeypatch):
    """Every tiny architecture: prefill, chain, one-token steps and tree logits equal with the
    host softmax and without it (every call taken by it here: no lower bound on its size), and
    it was used wherever the model's attention goes through mx.fast (gpt_oss's sinks do not);
    as MLX primitives (the default here) and computed between two evaluations."""
    from mlxspec import cpu_ops

    assert host_math.check()
    if where == "between evaluations":
        monkeypatch.setattr(cpu_ops, "_STATE", {"why": "left out by the test"})
    assert host_math.in_graph() == (where == "MLX primitives"), cpu_ops.why()
    monkeypatch.setattr(host_math, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(host_math, "SWIGLU_MIN_ELEMENTS", 0)
    swiglus = []
    real_swiglu = host_math._host_swiglu
    monkeypatch.setattr(host_math, "_host_swiglu", lambda g, x: swiglus.append(g.shape) or real_swiglu(g, x))
    calls = []
    real = host_math._host_sdpa
    monkeypatch.setattr(host_math, "_host_sdpa", lambda *a: calls.append(a[0].shape) or real(*a))
    target = tiny_target(arch)
    off = _forwards(target, False, monkeypatch)
    assert not calls and not swiglus
    on = _forwards(target, True, monkeypatch)
    for a, b in zip(off, on):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), arch
    assert (len(calls) > 0) == (arch != "gpt_oss"), (arch, len(calls))
    assert (len(swiglus) > 0) == (arch in SWIGLU_ARCHS), (arch, len(swiglus))


def test_smollm2_verify_rows_equal_decode_steps_and_mlx(smollm2, monkeypatch):
    """The real target at a context of 300: a 9-row verify (where the host softmax takes over by
    the default size rule) gives the logits of MLX's attention, and each row equals the one-token
    decode step of the same token, bit for bit."""
    target, _ = smollm2
    ids = list(range(100, 400))
    nxt = [5, 77, 901, 13, 4444, 21, 8, 99, 1000]
    assert host_math._eligible(mx.zeros((1, 9, 9, 64)), mx.zeros((1, 3, 309, 64)), mx.zeros((1, 3, 309, 64)), "causal", None)
    got = {}
    assert host_math.check()
    for on in (False, True):
        monkeypatch.setitem(host_math._STATE, "ok", on)
        cache = target.make_cache()
        target(mx.array([ids]), cache, logits="last")
        lg, _ = target(mx.array([nxt]), cache)
        trim_cache(cache, len(nxt))
        steps = [np.array(target(mx.array([[t]]), cache)[0][0, -1]) for t in nxt]
        got[on] = (np.array(lg[0]), np.stack(steps))
    assert np.array_equal(got[True][0], got[False][0])
    assert np.array_equal(got[True][0], got[True][1])


def test_the_switch_turns_it_off_and_says_so():
    import os
    import subprocess
    import sys

    code = ("import mlxspec\nfrom mlxspec.targets import host_math\nimport mlx.core as mx\n"
            "with host_math.installed():\n    assert mx.fast.scaled_dot_product_attention is host_math._ORIGINAL\n"
            "print(host_math.status())")
    env = dict(os.environ, MLXSPEC_HOST_MATH="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "host softmax and SwiGLU: off (MLXSPEC_HOST_MATH=0)"
