"""The load plan of a GGUF target: for each tensor, the mlx-lm parameter it becomes, how it is
loaded and the memory it then takes. The loader (`mlxspec.targets.gguf`) follows the plan and
`mlxspec inspect` reports it, so the report is what loading does.

How a tensor is loaded (`TensorPlan.how`):
- PLAIN: F32 / F16 as stored; BF16: widened to float32 bits (exact).
- AFFINE: Q4_0 / Q4_1 / Q8_0, 2-D: kept quantized, repacked losslessly into MLX affine
  (group 32; 4 or 8 bits).
- REPACK: Q1_0 / Q2_0 / PQ2_0 / PTQ1_0, 2-D: repacked bit-exact into MLX affine 1 or 2 bits.
- NATIVE: the same low-bit types in a decoder layer's Linear weight, with `native`: kept as
  the file's blocks for the custom kernel (`native_eligible`).
- DEQUANT: any other type mlxspec or the `gguf` package decodes: float16 (float32 with `dense`).
- UNSUPPORTED: everything else (`problem` says why).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

from mlxspec.gguf import decode
from mlxspec.gguf.file import GGUFFile, TensorInfo
from mlxspec.gguf.names import gguf_to_hf_name
from mlxspec.gguf.types import GGML_TYPES, LOWBIT_TYPES, GGMLType

PLAIN, BF16, AFFINE, REPACK, NATIVE, DEQUANT, UNSUPPORTED = (
    "plain", "bf16", "affine", "repack", "native", "dequant", "unsupported")
_AFFINE_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0)


@dataclass(frozen=True)
class TensorPlan:
    info: TensorInfo
    name: str | None  # mlx-lm parameter name; None: the model has no such tensor
    how: str
    dense: bool = False
    problem: str | None = None

    @property
    def n_weights(self) -> int:
        return int(np.prod(self.info.shape)) if self.info.shape else 1

    @property
    def what(self) -> str:
        """How the tensor is loaded, in words."""
        t, tname = self.info.type_id, self.info.type_name
        wide = "float32" if self.dense else "float16"
        if self.how in (PLAIN, BF16):
            return f"{tname} as is"
        if self.how == AFFINE:
            return f"kept quantized: MLX affine {decode.MLX_LAYOUT[t][0]}-bit, group 32 (lossless)"
        if self.how == REPACK:
            bits, group = decode.MLX_LAYOUT[t]
            return f"repacked bit-exact: MLX affine {bits}-bit, group {group}"
        if self.how == NATIVE:
            return "kept as native GGUF blocks (custom kernel)"
        if self.how == DEQUANT:
            return f"dequantized to {wide}" + ("" if t in LOWBIT_TYPES else " with the gguf package")
        return "unsupported"

    def memory(self) -> int | None:
        """Bytes the tensor takes once loaded (None when it cannot be loaded): float matrices
        run in float16 unless `dense`; MLX affine layers take bits per weight plus a float16
        scale and bias per group."""
        n, t = self.n_weights, self.info.type_id
        if self.how in (PLAIN, BF16):
            wide = t in (GGMLType.F32, GGMLType.BF16) and (self.dense or len(self.info.shape) != 2)
            return n * (4 if wide else 2)
        if self.how in (AFFINE, REPACK):
            bits, group = decode.MLX_LAYOUT[t]
            return n * bits // 8 + n // group * 4
        if self.how == NATIVE:
            return self.info.nbytes
        if self.how == DEQUANT:
            return n * (4 if self.dense else 2)
        return None


def native_eligible(name: str | None, info: TensorInfo) -> bool:
    """Whether a tensor may stay in native low-bit blocks: a 2-D Q1_0/Q2_0/PQ2_0/PTQ1_0
    weight of a decoder layer's Linear. Not the embedding (looked up, not multiplied) and not
    lm_head (callers read `lm_head.weight` as a dense or MLX-quantized matrix, e.g.
    targets.model.target_head_rows), which keep the lossless repack."""
    return (info.type_id in LOWBIT_TYPES and len(info.shape) == 2 and name is not None
            and name.startswith("model.layers.") and name.endswith(".weight"))


def plan_tensor(info: TensorInfo, native: bool = False, dense: bool = False, arch: str | None = None) -> TensorPlan:
    """native: keep eligible low-bit Linear weights as blocks; dense: the float32 CPU path;
    arch: the file's general.architecture (the names of Gemma-3's norms differ)."""
    name = gguf_to_hf_name(info.name, arch)
    t, two_d = info.type_id, len(info.shape) == 2

    def plan(how, problem=None):
        return TensorPlan(info, name, how, dense, problem)

    if t not in GGML_TYPES:
        return plan(UNSUPPORTED, f"{info.name} has tensor type {info.type_name}, which mlxspec cannot read")
    if t in (GGMLType.F32, GGMLType.F16):
        return plan(PLAIN)
    if t == GGMLType.BF16:
        return plan(BF16)
    if two_d and t in _AFFINE_TYPES:
        return plan(AFFINE)
    if native and native_eligible(name, info):
        return plan(NATIVE)
    if two_d and t in LOWBIT_TYPES:
        return plan(REPACK)
    if decode.dequantizable(t):
        return plan(DEQUANT)
    return plan(UNSUPPORTED, f"{info.name} has tensor type {info.type_name}, which mlxspec cannot load")


def plan_target(g: GGUFFile, native: bool = False, dense: bool = False) -> list[TensorPlan]:
    """The plan of every tensor in the file's table, in table order."""
    return [plan_tensor(info, native, dense, g.architecture) for info in g.tensors]


def model_classes(config: dict):
    """(Model, ModelArgs) of mlx-lm's implementation of `config["model_type"]`, after mlx-lm's
    model type remapping. ValueError when mlx-lm has none."""
    model_type = config["model_type"]
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    remapped = [MODEL_ARCHITECTURE_REMAPPING.get((model_type, a)) for a in archs]
    model_type = next((m for m in remapped if m is not None), MODEL_REMAPPING.get(model_type, model_type))
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"Model type {model_type} not supported.") from e
    return module.Model, module.ModelArgs
