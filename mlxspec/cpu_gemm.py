"""The small-M GEMM in front of OpenBLAS on x86-64 Linux (`mlxspec/cpu/small_gemm.c`).

Unless MLXSPEC_SMALL_GEMM=0, `import mlxspec` puts a `cblas_sgemm` of our own in front of OpenBLAS's: the products of a
decode step or a verify (1-24 rows of activations times a weight matrix, MLX's `x @ W.T`) are
computed by reading each weight row once and multiplying it with every activation row, without
the packing OpenBLAS's GEMM does for every call; every other product goes to OpenBLAS. Each
output sums its terms in the same order whatever the row count, so a verify row equals the
decode step of the same token bit for bit. Measured (scripts/bench_small_gemm.py, docs/cli.md):
SmolLM2's forward over 1-9 tokens 1.4-1.8x faster than on OpenBLAS, one thread.

It is compiled here (`cc -O3 -march=native`, about a second) into the mlxspec cache, keyed by
the source and the CPU's flags, and loaded with RTLD_GLOBAL before OpenBLAS
(`preload`, which `import mlxspec` runs in place of `mlxspec.device.preload_openblas` when it is
on), so libmlx, loaded after both, binds its calls to it. It
computes its products on one core while OpenBLAS runs one thread, split over two (a worker
thread of its own) while OpenBLAS may run more; anything else is OpenBLAS's.
Without AVX-512F or AVX2 + FMA, or without a C compiler, it is not used (`status` says why). Never imports MLX.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
from pathlib import Path

from mlxspec.device import SMALL_GEMM_ENV as ENV
from mlxspec.device import cpu_flags
from mlxspec.device import small_gemm_enabled as enabled  # not turned off (MLXSPEC_SMALL_GEMM=0)

SOURCE = Path(__file__).with_name("cpu") / "small_gemm.c"
MAX_ROWS = 24  # the kernel computes at most 24 rows (AVX-512F: one block up to 12, groups of 8 above; small_gemm.c)
_STATE: dict = {}  # "lib": the loaded CDLL, "why": why it is not in use


def active() -> bool:
    """Whether it computes this process's small products (loaded in front of OpenBLAS)."""
    return "lib" in _STATE


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


NO_SIMD = "this CPU has neither AVX-512F nor AVX2 with FMA"


def has_simd() -> bool:
    """Whether this CPU has what the small GEMM computes with: AVX-512F (16 lanes) or AVX2 with
    FMA (8 lanes; an AMD EPYC without AVX-512, seen here 2026-12-04)."""
    flags = cpu_flags().split()
    return "avx512f" in flags or ("avx2" in flags and "fma" in flags)


def build(out_dir: Path | None = None, cc: str | None = None, source: Path = SOURCE,
          flags: tuple = ("-pthread",), libs: tuple = ("-ldl",), state: dict | None = None) -> Path | None:
    """The compiled library of `source` (built once per source and CPU, `cc -O3 -march=native`
    plus `flags`), or None (no compiler, or it failed: `state["why"]`, this module's state by
    default). Also builds `cpu/mlx_math.c` (`mlxspec.targets.host_math`)."""
    from mlxspec.cache import cache_dir

    state = _STATE if state is None else state
    cc = cc or os.environ.get("CC") or "cc"
    key = hashlib.sha1(source.read_bytes() + " ".join(flags).encode() + cpu_flags().encode()
                       + platform.machine().encode()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir else cache_dir() / "native"
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp.so")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", *flags, "-o", str(tmp), str(source), *libs],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        state["why"] = f"cannot build it ({cc}: {e})"
        return None
    if r.returncode != 0:
        state["why"] = f"{cc} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:] or ['?']}"
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, lib)
    return lib


def load_global() -> ctypes.CDLL | None:
    """Build and load it into the global symbol scope (call before OpenBLAS and MLX load) -> the
    library, which the caller must attach to OpenBLAS (`attach`) whether or not it computes:
    loaded with RTLD_GLOBAL, its cblas_sgemm takes MLX's calls, and unattached it finds no
    OpenBLAS behind it (RTLD_NEXT from a dlopen'ed library does not see the global scope)."""
    if not _x86():
        _STATE["why"] = f"x86-64 only (this is {platform.machine()})"
        return None
    path = build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    if lib.mlxspec_small_gemm_available():
        _STATE["lib"] = lib
    else:  # built without the vector instructions after all: it only forwards
        _STATE["why"] = NO_SIMD
    return lib


def preload() -> bool:
    """`import mlxspec` on Linux: unless MLXSPEC_SMALL_GEMM=0, and while MLX is not loaded yet, this library
    then OpenBLAS into the global scope, this one forwarding to OpenBLAS; otherwise
    `device.preload_openblas` alone. -> whether OpenBLAS is loaded."""
    import sys

    from mlxspec import device

    preloaded = _preloaded_path()
    if preloaded:  # LD_PRELOAD=$(python -m mlxspec.blas) put it in front already
        _STATE["lib"] = ctypes.CDLL(preloaded)
        return device.preload_openblas()
    if enabled() and _x86() and not has_simd():
        # nothing it could compute here: never loaded (loaded and left unattached, it once
        # forwarded to nothing: a segfault on the first GEMM, seen on an EPYC before it had an AVX2 path)
        _STATE["why"] = NO_SIMD
        return device.preload_openblas()
    if not enabled() or "mlx.core" in sys.modules or device.openblas_loaded() or device.find_openblas() is None:
        if enabled():
            _STATE["why"] = ("OpenBLAS or MLX was loaded before it: import mlxspec first, or "
                             "LD_PRELOAD=$(python -m mlxspec.blas)")
        return device.preload_openblas()
    try:
        small = load_global()
    except OSError as e:  # never a reason for `import mlxspec` to fail: OpenBLAS alone
        small, _STATE["why"] = None, f"cannot load it: {e}"
    if not device.preload_openblas():
        return False
    if small is not None:
        attach(small, ctypes.CDLL(device.find_openblas()))  # the handle of the copy just loaded
    return True


def preload_paths() -> list[str]:
    """What `python -m mlxspec.blas` prints for LD_PRELOAD: this library (built now) before
    OpenBLAS when it is on, else OpenBLAS alone."""
    from mlxspec import device

    ob = device.find_openblas()
    if not ob:
        return []
    if enabled() and _x86() and has_simd():
        path = build()
        if path is not None:
            return [str(path), ob]
    return [ob]


def _preloaded_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            return next((ln.split()[-1] for ln in f if "/small_gemm-" in ln), None)
    except OSError:
        return None


def profile_key() -> str:
    """Part of the verify-cost profile's key: the profile measured without it, or with another
    build of it (the library's name carries the hash of its source and the CPU's flags), is not
    this one: a kernel that computes more rows changes the curve's shape (17 rows went from 3.2
    one-row steps to under 2 when AVX-512 learned 24 rows, and a cached curve would have kept
    the policy off the long verifies)."""
    if not active():
        return ""
    lib = _STATE.get("lib")
    name = Path(getattr(lib, "_name", "") or "").name
    return f"small-gemm:{name}" if name else "small-gemm"


def attach(lib: ctypes.CDLL, openblas: ctypes.CDLL) -> None:
    """Forward what it does not compute to `openblas`, and follow its thread count."""
    sgemm = ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p)
    threads = ctypes.cast(openblas.openblas_get_num_threads, ctypes.c_void_p) \
        if hasattr(openblas, "openblas_get_num_threads") else None
    lib.mlxspec_small_gemm_init(sgemm, threads, ctypes.c_int(MAX_ROWS))


def calls() -> int | None:
    """Products computed by it in this process so far (None: not in use)."""
    lib = _STATE.get("lib")
    if lib is None:
        return None
    lib.mlxspec_small_gemm_calls.restype = ctypes.c_long
    return int(lib.mlxspec_small_gemm_calls())


def status() -> str:
    """One line: whether it is in use, and why not."""
    if active():
        lanes = int(_STATE["lib"].mlxspec_small_gemm_lanes()) if hasattr(_STATE["lib"], "mlxspec_small_gemm_lanes") else 16
        return f"small-M GEMM: on ({calls()} products so far; {'AVX-512F' if lanes == 16 else 'AVX2 + FMA'})"
    if not enabled():
        return f"small-M GEMM: off ({ENV}=0)"
    return f"small-M GEMM: not in use: {_STATE.get('why', 'OpenBLAS was loaded before it (import mlxspec first)')}"
