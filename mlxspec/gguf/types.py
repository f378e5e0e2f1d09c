"""GGML tensor types: id, name and block layout, including the low-bit types of the
PrismML llama.cpp fork (Q1_0, Q2_0, PQ2_0, PTQ1_0; codecs in mlxspec/gguf/quants.py)."""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    """A ggml type id, with `block_size` (weights per block) and `type_size` (bytes per block)."""

    def __new__(cls, value: int, block_size: int, type_size: int):
        obj = int.__new__(cls, value)
        obj._value_ = value
        obj.block_size = block_size
        obj.type_size = type_size
        return obj

    F32 = (0, 1, 4)
    F16 = (1, 1, 2)
    Q4_0 = (2, 32, 18)
    Q4_1 = (3, 32, 20)
    Q5_0 = (6, 32, 22)
    Q5_1 = (7, 32, 24)
    Q8_0 = (8, 32, 34)
    Q8_1 = (9, 32, 36)
    Q2_K = (10, 256, 84)
    Q3_K = (11, 256, 110)
    Q4_K = (12, 256, 144)
    Q5_K = (13, 256, 176)
    Q6_K = (14, 256, 210)
    Q8_K = (15, 256, 292)
    IQ2_XXS = (16, 256, 66)
    IQ2_XS = (17, 256, 74)
    IQ3_XXS = (18, 256, 98)
    IQ1_S = (19, 256, 50)
    IQ4_NL = (20, 32, 18)
    IQ3_S = (21, 256, 110)
    IQ2_S = (22, 256, 82)
    IQ4_XS = (23, 256, 136)
    I8 = (24, 1, 1)
    I16 = (25, 1, 2)
    I32 = (26, 1, 4)
    I64 = (27, 1, 8)
    F64 = (28, 1, 8)
    IQ1_M = (29, 256, 56)
    BF16 = (30, 1, 2)
    TQ1_0 = (34, 256, 54)
    TQ2_0 = (35, 256, 66)
    MXFP4 = (39, 32, 17)
    NVFP4 = (40, 64, 36)
    Q1_0 = (41, 128, 18)
    Q2_0 = (42, 64, 18)
    PQ2_0 = (142, 128, 34)
    PTQ1_0 = (143, 128, 28)


LOWBIT_TYPES = (GGMLType.Q1_0, GGMLType.Q2_0, GGMLType.PQ2_0, GGMLType.PTQ1_0)

# type id -> (name, block size in weights, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {int(t): (t.name, t.block_size, t.type_size) for t in GGMLType}


def type_name(type_id: int) -> str:
    return GGML_TYPES.get(type_id, (f"unknown type {type_id}",))[0]
