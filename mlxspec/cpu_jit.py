"""MLX's compiled CPU kernels built for this CPU, with the same bits (x86-64 Linux).

`mx.compile` on the CPU writes each fused elementwise kernel (mlx-lm's SwiGLU, `nn.silu`, the
GELUs, a sampler's arithmetic) as C++ and builds it with the `g++` it finds on PATH
(`g++ -std=c++17 -O3 -fPIC -shared`) into `$TMPDIR/mlx/<version>/cpu`, once per machine. Built for
generic x86-64, every fused multiply-add inside MLX's `exp` is a call into libm: mlx-lm's SwiGLU
kernel takes 15.8 ns an element here. Built with `-march=native -ffp-contract=off`, 7.3 ns, and
the same bits: the fma calls become the fma instruction, which rounds once as they do, and no
other multiply and add is fused (the ISO C++ mode MLX builds in keeps contraction off too).

Unless MLXSPEC_NATIVE_JIT=0, `import mlxspec` (x86-64 Linux, a `g++` on PATH) puts a wrapper `g++`
first on PATH (the real one plus those two flags) and points TMPDIR at a kernel folder of its
own in the mlxspec cache, keyed by the CPU's flags and the compiler, so a kernel built for one CPU
is never loaded on another and MLX's shared folder keeps its generic kernels. Python's own
temporary folder is pinned first (`tempfile.gettempdir`), so only MLX's kernels move; child
processes inherit both variables, and an mlxspec child points its own tempfile back at the
folder the first process had (MLXSPEC_TMPDIR_OUTSIDE).

The first target loaded checks the bits (`check`): a set of compiled functions (SwiGLU, exp,
the tanh GELU, softplus, erf) against MLX's uncompiled ops, bitwise, on random and extreme inputs.
On a mismatch the wrapper is dropped for the rest of the process and the folder keeps the
verdict, so later processes do not enable it. Measured on SmolLM2-135M (docs/cli.md): a 9-row
verify 67.8 -> 61.0 ms, a one-row step unchanged. Never imports MLX at import.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

ENV = "MLXSPEC_NATIVE_JIT"
OUTSIDE_ENV = "MLXSPEC_TMPDIR_OUTSIDE"  # TMPDIR before the first process enabled it ("": unset)
FLAGS = ("-march=native", "-ffp-contract=off")
DIR_NAME = "mlx-jit"
_STATE: dict = {}  # "dir": the kernel folder in use, "old": (PATH, TMPDIR) before, "why": not in use, "checked"


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def active() -> bool:
    """Whether this process builds MLX's compiled kernels with FLAGS."""
    return "dir" in _STATE


def _strip_ours(path: str) -> str:
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and f"{os.sep}{DIR_NAME}{os.sep}" not in p + os.sep)


def _key(gxx: str) -> str:
    from mlxspec.device import cpu_flags

    st = os.stat(gxx)
    ident = f"{' '.join(FLAGS)}|{cpu_flags()}|{platform.machine()}|{gxx}|{st.st_size}|{int(st.st_mtime)}"
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def enable(force: bool = False, root: Path | None = None) -> bool:
    """`import mlxspec` on Linux: the wrapper first on PATH and TMPDIR at the kernel folder
    (`root`, default the mlxspec cache) -> whether it is on. force: ignore MLXSPEC_NATIVE_JIT."""
    if active():
        return True
    if not force and not enabled_by_env():
        _STATE["why"] = f"off ({ENV}=0)"
        return False
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        _STATE["why"] = f"x86-64 Linux only (this is {sys.platform} {platform.machine()})"
        return False
    path = _strip_ours(os.environ.get("PATH", ""))  # a child process inherits our wrapper: skip it
    gxx = shutil.which("g++", path=path)
    if gxx is None:
        _STATE["why"] = "no g++ on PATH (MLX cannot compile kernels either)"
        return False
    gxx = os.path.realpath(gxx)
    if root is None:
        from mlxspec.cache import cache_dir

        root = cache_dir() / DIR_NAME
    d = Path(root) / _key(gxx)
    try:
        verdict = (d / "verdict").read_text().strip() if (d / "verdict").exists() else ""
        if verdict and verdict != "ok":
            _STATE["why"] = f"an earlier check found other bits ({verdict})"
            return False
        (d / "bin").mkdir(parents=True, exist_ok=True)
        (d / "tmp").mkdir(exist_ok=True)
        wrapper = d / "bin" / "g++"
        text = f"#!/bin/sh\nexec '{gxx}' {' '.join(FLAGS)} \"$@\"\n"
        if not wrapper.exists() or wrapper.read_text() != text:
            tmp = wrapper.with_name(f"g++.{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.chmod(0o755)
            os.replace(tmp, wrapper)
    except OSError as e:
        _STATE["why"] = f"cannot write its folder {d}: {e}"
        return False
    _pin_tempdir()
    _STATE["old"] = (os.environ.get("PATH"), os.environ.get("TMPDIR"))
    os.environ["PATH"] = str(d / "bin") + os.pathsep + path
    os.environ["TMPDIR"] = str(d / "tmp")
    _STATE["dir"] = d
    _STATE.pop("why", None)
    return True


def _pin_tempdir() -> None:
    """Python's temporary folder stays the one outside ours: in a child that inherited TMPDIR
    pointing at a kernel folder, the one its first ancestor had (OUTSIDE_ENV), which tempfile
    is pointed back at if it had read ours already."""
    outside = os.environ.get(OUTSIDE_ENV)
    if outside is None:
        outside = os.environ.get("TMPDIR", "")
        os.environ[OUTSIDE_ENV] = outside
    if outside:
        os.environ["TMPDIR"] = outside
    else:
        os.environ.pop("TMPDIR", None)
    if tempfile.tempdir and f"{os.sep}{DIR_NAME}{os.sep}" in tempfile.tempdir + os.sep:
        tempfile.tempdir = None
    tempfile.gettempdir()


def disable(why: str) -> None:
    """Back to MLX's own build for the kernels not built yet (those built stay loaded)."""
    old = _STATE.pop("old", None)
    if old is not None:
        for name, value in zip(("PATH", "TMPDIR"), old):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    _STATE.pop("dir", None)
    _STATE["why"] = why


def _cases():
    import mlx.core as mx

    return {
        "swiglu": lambda g, x: (g * mx.sigmoid(g)) * x,
        "exp": lambda g, x: mx.exp(g) * x + 1.5,
        "gelu-tanh": lambda g, x: 0.5 * g * (1 + mx.tanh(0.7978845608 * (g + 0.044715 * g * g * g))) * x,
        "softplus": lambda g, x: mx.logaddexp(g, 0.0) - x,
        "erf": lambda g, x: mx.erf(g / 3.0) * x,
    }


def compare() -> list[str]:
    """The compiled cases whose bits differ from MLX's uncompiled ops (empty: all equal)."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    g = np.concatenate([rng.uniform(-100, 100, 1 << 15), rng.standard_normal(1 << 15) * 3,
                        [0.0, -0.0, 88.7, -88.7, 89.0, -89.0, 1e-30, -1e-30, np.inf, -np.inf, np.nan]])
    a = mx.array(g.astype(np.float32))
    b = mx.array(rng.standard_normal(a.size).astype(np.float32))
    cases = _cases()
    both = mx.compile(lambda g, x: [f(g, x) for f in cases.values()])  # one build for all of them
    wants, gots = [f(a, b) for f in cases.values()], both(a, b)
    return [name for name, want, got in zip(cases, wants, gots)
            if not np.array_equal(np.array(want).view(np.uint32), np.array(got).view(np.uint32))]


def check() -> bool:
    """Once per process while it is on (the folder remembers a passed check): the compiled cases
    bitwise against MLX's uncompiled ops; on a mismatch, `disable` and record it. -> on."""
    if not active() or _STATE.get("checked"):
        return active()
    _STATE["checked"] = True
    d = _STATE["dir"]
    if (d / "verdict").exists() and (d / "verdict").read_text().strip() == "ok":
        return True
    bad = compare()
    verdict = "ok" if not bad else "compiled " + ", ".join(bad) + " differ from MLX's ops"
    try:
        (d / "verdict").write_text(verdict + "\n")
    except OSError:
        pass
    if bad:
        disable(f"the check found other bits: {verdict}")
    return not bad


def profile_key() -> str:
    """Part of the verify-cost profile's key (a curve measured with generic kernels is another shape)."""
    return "|native-jit" if active() else ""


def status() -> str:
    if active():
        return f"MLX's compiled kernels: built for this CPU ({' '.join(FLAGS)}; {_STATE['dir']})"
    return f"MLX's compiled kernels: generic: {_STATE.get('why', 'not enabled')}"
