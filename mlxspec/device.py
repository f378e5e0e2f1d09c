"""What this process computes on, decided in one place; the environment is read here only.

`current()` is the record: MLX's GPU backend (Metal, CUDA or none: the CPU) and the switches
that change mlxspec's device decisions:

- MLXSPEC_KERNELS=reference: the pure-MLX reference kernels even on a GPU (`mlxspec.kernels.backend`);
- MLXSPEC_NATIVE_LOWBIT=0: low-bit GGUF weights repacked into MLX affine layers at load instead
  of kept as native blocks for the custom kernel (`mlxspec.targets.gguf.native_lowbit_enabled`);
- MLXSPEC_BLAS_THREADS=auto|N (and OPENBLAS_NUM_THREADS): how many threads OpenBLAS's GEMMs
  use on the CPU; `auto` (the default, unless OPENBLAS_NUM_THREADS is set) lets
  `mlxspec.blas.ThreadGovernor` follow the load from other processes (`blas_threads_setting`);
- MLXSPEC_OPENBLAS=PATH and MLXSPEC_NO_BLAS_REEXEC=1: which OpenBLAS the CLI preloads on Linux
  CPU, and not re-executing to preload it (`mlxspec.blas`; read before MLX is imported, so
  through `openblas_path` / `blas_reexec_disabled`, which never import it).

The hardware is probed once per process, the record is built once per value of the
variables (a test that sets one sees its effect at the next `current()`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

KERNELS_ENV = "MLXSPEC_KERNELS"
NATIVE_LOWBIT_ENV = "MLXSPEC_NATIVE_LOWBIT"
OPENBLAS_ENV = "MLXSPEC_OPENBLAS"
NO_REEXEC_ENV = "MLXSPEC_NO_BLAS_REEXEC"
BLAS_THREADS_ENV = "MLXSPEC_BLAS_THREADS"
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
    """MLXSPEC_OPENBLAS, if set (does not import MLX)."""
    return os.environ.get(OPENBLAS_ENV) or None


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
