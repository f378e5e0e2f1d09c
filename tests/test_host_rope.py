"""RoPE and RMSNorm in fewer operations on the CPU (mlxspec.targets.host_rope, the `host_rope`
primitive in mlxspec/cpu/mlx_ops.cpp): the numbers of MLX's own fallbacks, bit for bit, in every
target forward they take part in, and a check that notices when they are not."""

import mlx.core as mx
import numpy as np
import pytest
from test_host_math import _forwards
from tiny_targets import ARCHS, tiny_target

from mlxspec.targets import host_rope
from mlxspec.targets.model import trim_cache



def _bits(a) -> np.ndarray:
    return np.array(a).view(np.uint32)


def test_it_is_on_here():
    assert host_rope.check(), host_rope.status()
    assert host_rope.status() == "RoPE and RMSNorm: one op each (equal to MLX's bit for bit)"


@pytest.mark.parametrize("trad", [False, True])
@pytest.mark.parametrize("dims,D", [(64, 64), (32, 64), (16, 24)])
def test_rope_equals_mlx_at_every_offset_and_layout(dims, D, trad):
    """Offsets across the table's growth (4,096 and beyond), 1-17 rows, a transposed input (as
    attention passes it), partial rotary dims, both layouts, bit for bit."""
    assert host_rope.check()
    rng = np.random.default_rng(dims + D)
    for off in (0, 1, 2, 181, 4095, 4096, 9000, 100_003):
        for T in (1, 3, 17):
            x = mx.array(rng.standard_normal((1, T, 3, D)).astype(np.float32) * 5).transpose(0, 2, 1, 3)
            want = host_rope._ROPE(x, dims, traditional=trad, base=10000.0, scale=1.0, offset=off)
            got = host_rope.exact_rope(x, dims, traditional=trad, base=10000.0, scale=1.0, offset=off)
            assert got.shape == want.shape
            assert np.array_equal(_bits(got), _bits(want)), (off, T)


def test_what_it_does_not_cover_goes_to_mlx(monkeypatch):
    """A 0-d array offset, a negative one, another dtype, both a base and frequencies: MLX's own rope."""
    used = []
    monkeypatch.setattr(host_rope, "_host_rope", lambda *a: used.append(a) or None)
    x = mx.ones((1, 2, 3, 8))
    host_rope.exact_rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=mx.array(3))
    host_rope.exact_rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=-2)
    host_rope.exact_rope(mx.ones((2, 2, 3, 8)), 8, traditional=False, base=10000.0, scale=1.0,
                         offset=mx.array([4, -1], mx.int32))
    with pytest.raises(ValueError):  # MLX's own error
        host_rope.exact_rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=3, freqs=mx.ones((4,)))
    host_rope.exact_rope(x.astype(mx.bfloat16), 8, traditional=False, base=10000.0, scale=1.0, offset=3)
    assert not used
    host_rope.exact_rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=3)
    assert len(used) == 1


def test_rope_with_an_offset_per_batch_row_equals_mlx():
    """A ragged batch (the server's batched cache) passes one offset per row."""
    rng = np.random.default_rng(11)
    for offs in ([0, 5, 171], [4097, 3, 3], [9, 9, 9]):
        for T in (1, 4):
            x = mx.array(rng.standard_normal((3, T, 6, 64)).astype(np.float32)).transpose(0, 2, 1, 3)
            o = mx.array(offs, mx.int32)
            want = host_rope._ROPE(x, 64, traditional=False, base=100000.0, scale=1.0, offset=o)
            got = host_rope.exact_rope(x, 64, traditional=False, base=100000.0, scale=1.0, offset=o)
            assert np.array_equal(_bits(got), _bits(want)), (offs, T)


def test_rope_with_the_modules_own_frequencies_equals_mlx():
    """Llama 3's scaled RoPE passes periods (freqs) instead of a base: the table is read off
    them, and a new freqs array gets its own table."""
    rng = np.random.default_rng(7)
    for f in (np.geomspace(1.0, 5e5, 32), np.geomspace(2.0, 1e4, 32)):
        freqs = mx.array(f.astype(np.float32))
        for off, T in ((0, 1), (300, 9), (5000, 4)):
            x = mx.array(rng.standard_normal((1, 4, T, 64)).astype(np.float32))
            want = host_rope._ROPE(x, 64, traditional=False, base=None, scale=1.0, offset=off, freqs=freqs)
            got = host_rope.exact_rope(x, 64, traditional=False, base=None, scale=1.0, offset=off, freqs=freqs)
            assert np.array_equal(_bits(got), _bits(want)), (off, T)


def test_rms_norm_equals_mlx():
    rng = np.random.default_rng(3)
    for shape, mag in (((1, 1, 576), 1.0), ((2, 9, 640), 50.0), ((1, 17, 64), 1e-4), ((3, 1152), 7.0)):
        x = mx.array(rng.standard_normal(shape).astype(np.float32) * mag)
        w = mx.array(rng.standard_normal(shape[-1:]).astype(np.float32))
        for eps in (1e-5, 1e-6):
            assert np.array_equal(_bits(host_rope.exact_rms_norm(x, w, eps)), _bits(mx.fast.rms_norm(x, w, eps)))


@pytest.mark.parametrize("arch", ARCHS)
def test_target_forwards_are_the_same_bits_with_it(arch, monkeypatch):
    """Every tiny architecture: prefill, chain, one-token steps and tree logits equal with RoPE
    and RMSNorm as single ops and without, and they were used where the model calls them."""
    assert host_rope.check()
    ropes, norms = [], []
    real_rope, real_norm = host_rope._host_rope, host_rope._norm
    monkeypatch.setattr(host_rope, "_host_rope", lambda *a: ropes.append(a[0].shape) or real_rope(*a))
    monkeypatch.setattr(host_rope, "_norm", lambda *a: norms.append(a[0].shape) or real_norm(*a))
    target = tiny_target(arch)
    monkeypatch.setitem(host_rope._STATE, "ok", False)
    off = _forwards(target, True, monkeypatch)
    assert not ropes and not norms
    monkeypatch.setitem(host_rope._STATE, "ok", True)
    on = _forwards(target, True, monkeypatch)
    for a, b in zip(off, on):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), arch
    assert len(ropes) > 0, arch
    assert len(norms) > 0, arch


def test_smollm2_verify_and_decode_are_the_same_bits_with_it(smollm2, monkeypatch):
    """The real target at a context of 300: a 9-row verify and the 9 decode steps give the same
    logits with it and without, and the rows equal the steps."""
    target, _ = smollm2
    ids = list(range(100, 400))
    nxt = [5, 77, 901, 13, 4444, 21, 8, 99, 1000]
    got = {}
    assert host_rope.check()
    # one forward on MLX's own RoPE first: on a 2-core Zen EPYC (2026-12-07), the first forward of
    # this target loaded right after test_target_forwards_are_the_same_bits_with_it[llama3_1]
    # rounded MLX's RoPE path differently from every later forward and from a fresh process
    # (by 3e-5 in the logits); ours equals the later ones and the fresh process's
    monkeypatch.setitem(host_rope._STATE, "ok", False)
    target(mx.array([ids[:16]]), target.make_cache(), logits="last")
    for on in (False, True):
        monkeypatch.setitem(host_rope._STATE, "ok", on)
        cache = target.make_cache()
        target(mx.array([ids]), cache, logits="last")
        lg, taps = target(mx.array([nxt]), cache, taps=(2, 15))
        trim_cache(cache, len(nxt))
        steps = [np.array(target(mx.array([[t]]), cache)[0][0, -1]) for t in nxt]
        got[on] = (np.array(lg[0]), np.stack(steps), np.array(taps))
    for a, b in zip(got[False], got[True]):
        assert np.array_equal(_bits(a), _bits(b))
    assert np.array_equal(got[True][0], got[True][1])


def test_the_check_notices_a_rotation_rounded_otherwise(monkeypatch):
    """A rotation one ulp off (as a fused multiply-add would round it) fails the check, and then
    nothing is installed."""
    real = host_rope._host_rope
    monkeypatch.setattr(host_rope, "_STATE", {})
    monkeypatch.setattr(host_rope, "_host_rope",
                        lambda *a: mx.array(np.nextafter(np.array(real(*a)), np.float32(np.inf))))
    assert not host_rope.check()
    assert "its RoPE differs from this MLX's" in host_rope.status(), host_rope.status()
    with host_rope.installed():
        assert mx.fast.rope is host_rope._ROPE and mx.fast.rms_norm is host_rope._RMS_NORM


def test_the_host_math_switch_turns_it_off_too():
    import os
    import subprocess
    import sys

    code = ("import mlxspec\nfrom mlxspec.targets import host_rope\nimport mlx.core as mx\n"
            "with host_rope.installed():\n    assert mx.fast.rope is host_rope._ROPE\n"
            "print(host_rope.status())")
    env = dict(os.environ, MLXSPEC_HOST_MATH="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "RoPE and RMSNorm: MLX's (the host math is off or not MLX primitives)"


def test_the_extension_finds_mlx_headers_past_another_mlx_folder(tmp_path, monkeypatch):
    """mlx is a namespace package: a folder named mlx on sys.path (a script's own folder, the
    working directory) joins it, first. The build must still compile against MLX's headers."""
    import importlib
    import importlib.util

    from mlxspec import cpu_ops

    (tmp_path / "mlx").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    locations = list(importlib.util.find_spec("mlx").submodule_search_locations)
    assert str(tmp_path / "mlx") == locations[0], locations  # the trap is set
    mlx_dir, _ = cpu_ops._versions()
    assert (mlx_dir / "include" / "mlx" / "array.h").exists(), mlx_dir
