"""mlxspec: speculative decoding with DFlash / DSpark block drafters on MLX."""

__version__ = "0.1.0"
