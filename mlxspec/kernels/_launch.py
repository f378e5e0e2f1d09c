"""Kernel declarations, backend choice, and launching through mx.fast.

A kernel is declared once as a `KernelSpec` (name, input and output names, the stem of its
source files); each call is planned as a `Launch` (grid and threadgroup in threads, template
arguments, output shapes and dtypes). The same spec and plan are run by
mx.fast.metal_kernel (source `mlxspec/metal/<stem>.metal`), by mx.fast.cuda_kernel (source
`mlxspec/cuda/<stem>.cu`), or, in the tests, by the CPU emulator in tests/metal_shim.

A source file holds an optional header (helper functions) and the kernel body, separated by
the line `// ---- kernel body ----`. The body is what mx.fast wraps in a generated function
whose parameters are the declared inputs and outputs (and, for Metal, the thread attributes
the body names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from mlxspec import device

BODY_MARKER = "// ---- kernel body ----"
_ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = {"metal": _ROOT / "metal", "cuda": _ROOT / "cuda"}
SOURCE_SUFFIX = {"metal": ".metal", "cuda": ".cu"}

ENV_VAR = device.KERNELS_ENV
_forced: str | None = None


@dataclass(frozen=True)
class KernelSpec:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stem: str

    def source(self, language: str) -> tuple[str, str]:
        """(header, body) of this kernel for "metal" or "cuda"."""
        return _read_source(language, self.stem)


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple
    template: tuple = field(default_factory=tuple)  # ((name, int | bool | mx.Dtype), ...)


@lru_cache(maxsize=None)
def _read_source(language: str, stem: str) -> tuple[str, str]:
    path = SOURCE_DIRS[language] / f"{stem}{SOURCE_SUFFIX[language]}"
    text = path.read_text()
    if BODY_MARKER not in text:
        raise ValueError(f"{path}: missing the line '{BODY_MARKER}'")
    header, body = text.split(BODY_MARKER, 1)
    return header, body


def use_reference(flag: bool = True) -> None:
    """Force the pure-MLX reference kernels (True) or go back to automatic choice (False)."""
    global _forced
    _forced = "reference" if flag else None


def backend() -> str:
    """The kernel implementation in use: "metal", "cuda" or "reference".

    Metal on an Apple GPU, CUDA when MLX runs on CUDA, otherwise the reference. Forced to the
    reference by use_reference() or by the environment variable MLXSPEC_KERNELS=reference.
    Custom kernels run only on the GPU: with a CPU default device the reference is used."""
    dev = device.current()  # MLXSPEC_KERNELS is checked there
    if _forced == "reference" or dev.reference_kernels:
        return "reference"
    if mx.default_device() != mx.gpu:
        return "reference"
    return dev.gpu or "reference"


@lru_cache(maxsize=None)
def _fast_kernel(language: str, spec: KernelSpec):
    header, body = spec.source(language)
    make = mx.fast.metal_kernel if language == "metal" else mx.fast.cuda_kernel
    return make(name=spec.name, input_names=list(spec.inputs), output_names=list(spec.outputs),
                source=body, header=header)


def run_fast(language: str, spec: KernelSpec, inputs: list, launch: Launch) -> list:
    """Run a planned launch through mx.fast.metal_kernel or mx.fast.cuda_kernel."""
    kernel = _fast_kernel(language, spec)
    return kernel(inputs=inputs, template=list(launch.template), grid=launch.grid,
                  threadgroup=launch.threadgroup, output_shapes=[list(s) for s in launch.output_shapes],
                  output_dtypes=list(launch.output_dtypes))


def runner(language: str | None = None):
    """A callable (spec, inputs, launch) -> outputs for the given or current GPU backend."""
    language = language or backend()
    if language not in ("metal", "cuda"):
        raise ValueError(f"no GPU kernel runner for backend {language!r}")
    return lambda spec, inputs, launch: run_fast(language, spec, inputs, launch)
