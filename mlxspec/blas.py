"""Fast BLAS on Linux CPU.

The `mlx[cpu]` wheel links netlib's reference BLAS (~2 GFLOP/s). Debian's
`libopenblas0-pthread` exports the same symbols; preloading it (LD_PRELOAD) makes MLX's
CPU GEMM ~60x faster, and a 16-token verify of SmolLM2 cost ~2x a 1-token decode
instead of ~14x. Speculative decoding on Linux CPU depends on it.

`mlxspec` (the CLI, entry point `mlxspec.__main__`) re-executes itself once with the
library preloaded when it is installed and not yet loaded, before MLX is imported; set MLXSPEC_NO_BLAS_REEXEC=1 to turn that off. Python API
users preload it themselves (`LD_PRELOAD=$(python -m mlxspec.blas) python app.py`).
"""

from __future__ import annotations

import os
import sys

from mlxspec import device

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def find_openblas() -> str | None:
    env = device.openblas_path()
    if env and os.path.exists(env):
        return env
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def openblas_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libopenblas" in f.read()
    except OSError:
        return False


def set_blas_threads(n: int) -> bool:
    """openblas_set_num_threads(n) on the preloaded OpenBLAS (ctypes: the same handle the
    process already uses). -> False when OpenBLAS is not loaded (nothing to set)."""
    lib = _openblas()
    if lib is None:
        return False
    lib.openblas_set_num_threads(int(n))
    return True


def park_blas_threads() -> bool:
    """End OpenBLAS's worker threads now; its next threaded call starts them again (as after
    fork). An idle worker spins for ~2^28 cycles after each call (OPENBLAS_THREAD_TIMEOUT,
    read once at load), so a process about to sleep parks them to leave the cores to another
    process on the host. Call it only while no BLAS call runs. -> False when unavailable."""
    lib = _openblas()
    if lib is None or not hasattr(lib, "blas_thread_shutdown_"):
        return False
    lib.blas_thread_shutdown_()
    return True


_LIB: list = []


def _openblas():
    if not _LIB:
        lib, path = None, _loaded_openblas_path()
        if path:  # the mapped file itself: a CDLL of another copy would be a second library
            try:
                import ctypes

                lib = ctypes.CDLL(path)
                lib.openblas_set_num_threads  # noqa: B018 - an OpenBLAS, not another BLAS
            except (OSError, AttributeError):
                lib = None
        _LIB.append(lib)
    return _LIB[0]


def _loaded_openblas_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            return next((ln.split()[-1] for ln in f if "libopenblas" in ln and "/" in ln), None)
    except OSError:
        return None


def blas_status() -> tuple[bool, str]:
    """(fast, message). Always fast off Linux (Accelerate / Metal / CUDA)."""
    if not sys.platform.startswith("linux"):
        return True, ""
    try:
        if device.current().gpu:
            return True, ""
    except Exception:
        pass
    if openblas_loaded():
        return True, "OpenBLAS preloaded"
    lib = find_openblas()
    if lib:
        return False, (f"MLX is using reference BLAS (~60x slower matmul); run with "
                       f"LD_PRELOAD={lib}")
    return False, ("MLX is using reference BLAS (~60x slower matmul); install Debian's "
                   "libopenblas0-pthread (scripts/setup.sh does) and preload it")


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process by the same command with OpenBLAS preloaded (Linux only)."""
    if not sys.platform.startswith("linux") or device.blas_reexec_disabled():
        return
    if openblas_loaded() or "mlx" in sys.modules:
        return
    lib = find_openblas()
    if not lib:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = (lib + " " + env["LD_PRELOAD"]).strip() if env.get("LD_PRELOAD") else lib
    env[device.NO_REEXEC_ENV] = "1"  # never loop
    os.execve(sys.executable, [sys.executable, "-m", "mlxspec", *argv], env)


if __name__ == "__main__":
    print(find_openblas() or "")
