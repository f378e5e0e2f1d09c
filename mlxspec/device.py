"""What this process computes on, decided in one place; the environment is read here only.

`current()` is the record: MLX's GPU backend (Metal, CUDA or none: the CPU) and the switches
that change mlxspec's device decisions:

- MLXSPEC_KERNELS=reference: the pure-MLX reference kernels even on a GPU (`mlxspec.kernels.backend`);
- MLXSPEC_NATIVE_LOWBIT=0: low-bit GGUF weights repacked into MLX affine layers at load instead
  of kept as native blocks for the custom kernel (`mlxspec.targets.gguf.native_lowbit_enabled`);
- MLXSPEC_BLAS_THREADS=auto|N (and OPENBLAS_NUM_THREADS): how many threads OpenBLAS's GEMMs
  use on the CPU; `auto` (the default, unless OPENBLAS_NUM_THREADS is set) lets
  `mlxspec.blas.ThreadGovernor` follow the load from other processes (`blas_threads_setting`);
- MLXSPEC_SMALL_GEMM=0: no small-M GEMM of ours in front of OpenBLAS (`mlxspec.cpu_gemm`, used by
  default on x86-64 with AVX-512F or AVX2 + FMA and a C compiler);
- MLXSPEC_HOST_MATH=0: the target's attention softmax and SwiGLU left to MLX on the CPU instead
  of computed on the host with the same numbers (`mlxspec.targets.host_math`);
- MLXSPEC_OPENBLAS=PATH|off and MLXSPEC_NO_BLAS_REEXEC=1: which OpenBLAS `import mlxspec` loads
  on Linux CPU (`off`: none, MLX keeps its wheel's reference BLAS), and the CLI not
  re-executing to preload it (read before MLX is imported, so through `openblas_path` /
  `openblas_disabled` / `blas_reexec_disabled`, which never import it). `preload_openblas`
  loads it, from `import mlxspec` (before MLX: its CPU BLAS is decided by what is loaded when
  libmlx is; `mlxspec.blas` has the rest of OpenBLAS: threads, the CLI's re-exec).

The hardware is probed once per process, the record is built once per value of the
variables (a test that sets one sees its effect at the next `current()`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache

KERNELS_ENV = "MLXSPEC_KERNELS"
NATIVE_LOWBIT_ENV = "MLXSPEC_NATIVE_LOWBIT"
OPENBLAS_ENV = "MLXSPEC_OPENBLAS"
NO_REEXEC_ENV = "MLXSPEC_NO_BLAS_REEXEC"
BLAS_THREADS_ENV = "MLXSPEC_BLAS_THREADS"
SMALL_GEMM_ENV = "MLXSPEC_SMALL_GEMM"
HOST_MATH_ENV = "MLXSPEC_HOST_MATH"
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Device:
    gpu: str | None  # "metal" | "cuda": MLX's GPU backend; None: MLX computes on the CPU
    reference_kernels: bool = False  # MLXSPEC_KERNELS=reference
    native_lowbit: bool | None = None  # False: MLXSPEC_NATIVE_LOWBIT=0; None: automatic

    @property
    def dense(self) -> bool:
        """Dense float32 compute: on the CPU backend (see `mlxspec.targets.model.dequantize_model`)."""
        return self.gpu is None


def current() -> Device:
    env = os.environ
    return _device(env.get(KERNELS_ENV, "auto"), env.get(NATIVE_LOWBIT_ENV, ""))


@lru_cache(maxsize=None)
def _device(kernels: str, lowbit: str) -> Device:
    k = kernels.strip().lower()
    if k not in ("auto", "reference", ""):
        raise ValueError(f"{KERNELS_ENV}={k!r}: expected 'auto' or 'reference'")
    return Device(_gpu(), k == "reference", False if lowbit.strip().lower() in _OFF else None)


@lru_cache(maxsize=1)
def _gpu() -> str | None:
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    try:
        return "cuda" if mx.cuda.is_available() else None
    except AttributeError:  # an MLX build without the cuda module
        return None


def openblas_path() -> str | None:
    """MLXSPEC_OPENBLAS, if set to a path (does not import MLX)."""
    v = os.environ.get(OPENBLAS_ENV) or None
    return None if v is None or openblas_disabled() else v


def openblas_disabled() -> bool:
    """MLXSPEC_OPENBLAS=off (or 0/false/no/none): load no OpenBLAS (does not import MLX)."""
    return os.environ.get(OPENBLAS_ENV, "").strip().lower() in (*_OFF, "none")


def blas_reexec_disabled() -> bool:
    """MLXSPEC_NO_BLAS_REEXEC set (does not import MLX)."""
    return bool(os.environ.get(NO_REEXEC_ENV))


def blas_threads_setting() -> int | None:
    """The BLAS thread count the user fixed: MLXSPEC_BLAS_THREADS=N, else OPENBLAS_NUM_THREADS
    (read by OpenBLAS itself at load). None: automatic (MLXSPEC_BLAS_THREADS unset or `auto`)."""
    for name in (BLAS_THREADS_ENV, "OPENBLAS_NUM_THREADS"):
        v = os.environ.get(name, "").strip().lower()
        if not v or (name == BLAS_THREADS_ENV and v == "auto"):
            continue
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"{name}={v!r}: expected a positive thread count" +
                             (" or 'auto'" if name == BLAS_THREADS_ENV else "")) from None
        if n < 1:
            raise ValueError(f"{name}={v!r}: expected a positive thread count")
        return n
    return None


# ----------------------------------------------------------------- OpenBLAS, before MLX loads

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def find_openblas() -> str | None:
    """The OpenBLAS to load: MLXSPEC_OPENBLAS, else Debian's / Fedora's; None when there is none
    or MLXSPEC_OPENBLAS=off."""
    if openblas_disabled():
        return None
    env = openblas_path()
    if env and os.path.exists(env):
        return env
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


_LATE_WARNED: list = []


def preload_openblas() -> bool:
    """Load OpenBLAS into the global symbol scope before MLX's library is loaded (Linux;
    `import mlxspec` calls it). -> whether OpenBLAS is loaded now. Where MLX came first
    (`mlx.core` imported) its BLAS is already bound: warn once with the fix instead."""
    if not sys.platform.startswith("linux") or openblas_disabled():
        return False
    if openblas_loaded():
        apply_blas_threads_setting()
        return True
    lib = find_openblas()
    if lib is None:
        return False  # nothing to load: `blas_status` says how to install it where it matters
    if "mlx.core" in sys.modules:
        _warn_late(lib)
        return False
    import ctypes

    try:  # global scope: libmlx, loaded after, binds its BLAS calls here (mlxspec.blas: measured)
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    apply_blas_threads_setting()
    return True


def apply_blas_threads_setting() -> None:
    """MLXSPEC_BLAS_THREADS=N: OpenBLAS runs N threads from now on (OPENBLAS_NUM_THREADS OpenBLAS
    reads itself at load). Before 2026-12-05 N only switched the thread governor off and OpenBLAS
    kept its default, every core. A value that is not a count is left to the CLI's one-line error."""
    if os.environ.get(BLAS_THREADS_ENV, "").strip().lower() in ("", "auto"):
        return
    try:
        n = blas_threads_setting()
    except ValueError:
        return
    lib = find_openblas()
    if n is None or lib is None:
        return
    import ctypes

    try:
        handle = ctypes.CDLL(lib)
        handle.openblas_set_num_threads(n)
    except (OSError, AttributeError):
        return


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where there is none): what native builds are keyed by."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


def small_gemm_enabled() -> bool:
    """`mlxspec.cpu_gemm` in front of OpenBLAS unless MLXSPEC_SMALL_GEMM=0 (does not import MLX;
    it is used where it can be: x86-64 with AVX-512F or AVX2 + FMA, and a C compiler)."""
    return os.environ.get(SMALL_GEMM_ENV, "").strip().lower() not in _OFF


def host_math_enabled() -> bool:
    """The target's attention softmax and SwiGLU computed on the host (`mlxspec.targets.host_math`:
    MLX's numbers bit for bit, checked before use) unless MLXSPEC_HOST_MATH=0."""
    return os.environ.get(HOST_MATH_ENV, "").strip().lower() not in _OFF


def _warn_late(lib: str) -> None:
    if _LATE_WARNED:
        return
    _LATE_WARNED.append(True)
    try:
        if current().gpu:
            return  # MLX computes on the GPU: its CPU BLAS does not matter
    except Exception:
        pass
    import warnings

    warnings.warn("mlxspec: MLX was imported before mlxspec, so its CPU matmul runs on the reference BLAS its "
                  "wheel links (about half the speed end to end); import mlxspec before mlx / mlx_lm, or run "
                  f"with LD_PRELOAD={lib} (= $(python -m mlxspec.blas))", RuntimeWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The warnings stacklevel of the first frame outside mlxspec and the import machinery: the
    user's `import mlxspec` line."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    f, level = sys._getframe(1), 1
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith("<frozen"):  # warnings skips the import machinery's frames itself
            if not name.startswith(pkg):
                return level
            level += 1
        f = f.f_back
    return 1


def openblas_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libopenblas" in f.read()
    except OSError:
        return False
