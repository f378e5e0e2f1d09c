"""mlxspec: speculative decoding with DFlash / DSpark block drafters on MLX."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import mlxspec` stays cheap (the CLI re-execs before mlx loads)
    if name in ("load", "generate", "stream_generate", "load_speculator", "GenerationResponse", "Speculator", "SpecConfig"):
        from mlxspec import api

        return getattr(api, name)
    raise AttributeError(name)
