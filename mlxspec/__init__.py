"""mlxspec: speculative decoding with DFlash / DSpark block drafters on MLX."""

__version__ = "0.1.0"


def _fast_blas() -> None:
    """On Linux CPU: OpenBLAS into the process before MLX loads (`mlxspec.device.preload_openblas`;
    MLX's CPU wheel links the ~60x slower reference BLAS). Imported after MLX: a warning, once.
    (Not through `mlxspec.blas`, which `python -m mlxspec.blas` runs as a script.)"""
    import sys

    if sys.platform.startswith("linux"):
        from mlxspec.cpu_gemm import preload  # OpenBLAS (and, with MLXSPEC_SMALL_GEMM=1, our small GEMM first)

        preload()
        from mlxspec.cpu_jit import enable  # MLX's compiled kernels built for this CPU, the same bits

        enable()


_fast_blas()


def __getattr__(name):  # lazy: `import mlxspec` stays cheap and loads no MLX (OpenBLAS goes first)
    if name in ("load", "generate", "stream_generate", "load_speculator", "GenerationResponse", "Speculator", "SpecConfig"):
        from mlxspec import api

        return getattr(api, name)
    raise AttributeError(name)
