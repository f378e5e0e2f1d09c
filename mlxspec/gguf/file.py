"""A small, tolerant GGUF reader: metadata, tensor table and raw tensor bytes.

Why not `gguf.GGUFReader`: it refuses files holding tensor types its enum does not
know (Q2_0, PrismML's PQ2_0 / PTQ1_0), and `mx.load` silently drops every tensor from
the first unknown type onward. mlxspec needs the whole table to decide, tensor by
tensor, what it can load and to name precisely what it cannot.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxspec.errors import MlxspecError
from mlxspec.gguf.types import GGML_TYPES, type_name
from mlxspec.validate import is_power_of_two, require_regular_file

GGUF_MAGIC = b"GGUF"


@dataclass
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # numpy/torch order: slowest axis first (ggml ne reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    _mm: np.memmap | None = field(default=None, repr=False)

    def tensor_map(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view (no copy)."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[info.offset : info.offset + info.nbytes]

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class _Cursor:
    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise MlxspecError(
                f"{self.path}: GGUF file is truncated (header ends at byte {len(self.buf)}, "
                f"needed {self.pos + n}); download it again"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, t: int):
        fmt, n = _SCALARS[t]
        return struct.unpack(fmt, self.take(n))[0]

    def string(self) -> str:
        n = self.scalar(10)
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, t: int):
        if t in _SCALARS:
            v = self.scalar(t)
            return bool(v) if t == 7 else v
        if t == 8:
            return self.string()
        if t == 9:
            et = self.scalar(4)
            n = self.scalar(10)
            if et in _NP:
                size = _SCALARS[et][1]
                arr = np.frombuffer(self.take(n * size), dtype=_NP[et]).copy()
                return arr.tolist() if n <= 4096 else arr
            if et == 9 and getattr(self, "depth", 0) >= 8:
                raise MlxspecError(f"{self.path}: GGUF metadata arrays nested deeper than 8; the file is corrupt")
            self.depth = getattr(self, "depth", 0) + 1
            try:
                return [self.value(et) for _ in range(n)]
            finally:
                self.depth -= 1
        raise MlxspecError(f"{self.path}: unknown GGUF metadata value type {t}; the file is corrupt")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse header, metadata and tensor table. Tensor data stays on disk (memmap)."""
    path = os.fspath(path)
    require_regular_file(path, "GGUF file")  # a FIFO would block forever
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise MlxspecError(f"{path}: not a GGUF file (magic {head!r}); pass a .gguf file or a model directory")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), path)
    cur.take(4)
    version = cur.scalar(4)
    if version not in (2, 3):
        raise MlxspecError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    # (absurd counts end at the truncation check: every entry takes at least 12 bytes)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise MlxspecError(f"{path}: metadata key {key!r} appears twice; the file is corrupt, download it again")
        metadata[key] = cur.value(cur.scalar(4))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        if len(name.encode("utf-8", errors="replace")) >= 64:  # GGML_MAX_NAME, as llama.cpp checks
            raise MlxspecError(f"{path}: tensor name {name[:40]!r}... is {len(name)} characters long (GGUF allows "
                               "63); the tensor table is corrupt, download the file again")
        nd = cur.scalar(4)
        if not 1 <= nd <= MAX_DIMS:
            raise MlxspecError(f"{path}: tensor {name!r} has {nd} dimensions (GGUF allows 1 to {MAX_DIMS}); "
                               "the tensor table is corrupt, download the file again")
        ne = [cur.scalar(10) for _ in range(nd)]
        t = cur.scalar(4)
        off = cur.scalar(10)
        raw_infos.append((name, t, tuple(reversed(ne)), off))
    align = metadata.get("general.alignment", 32)
    # the GGUF spec: a multiple of 8; llama.cpp: a power of two. Below 8 (1 passed the power-of-two
    # check alone) every tensor was read from a shifted offset and the model gave NaN logits.
    if not is_power_of_two(align) or align < 8 or align > 1 << 30:
        raise MlxspecError(f"{path}: general.alignment is {align!r}, expected a power of two from 8 up (a multiple "
                           "of 8, as the GGUF spec requires; 32 when absent); the file is corrupt or was written "
                           "wrongly: download it again, or rewrite it with general.alignment 32")
    data_start = (cur.pos + align - 1) // align * align
    tensors = validate_tensor_table(path, raw_infos, data_start, align, size)
    return GGUFFile(path, version, metadata, tensors, mm)


MAX_DIMS = 4  # GGML_MAX_DIMS


def validate_tensor_table(path: str, raw_infos, data_start: int, align: int, size: int) -> list[TensorInfo]:
    """Check the whole tensor table against the file before any data is read (as llama.cpp's
    gguf.cpp does): unique names, positive dimensions without element-count overflow, rows
    that are whole blocks of the type, aligned offsets, tensors laid out one after another in
    table order (no overlaps, gaps or a type whose size disagrees with the layout), all inside
    the file. Unknown types (size not computable) are kept for the loader to name."""
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    expected = 0  # data offset where the next tensor must start (None after an unknown type)
    for name, t, shape, off in raw_infos:
        fix = "the tensor table is corrupt, download the file again"
        if name in seen:
            raise MlxspecError(f"{path}: tensor {name} appears twice in the tensor table; {fix}")
        seen.add(name)
        n_el = 1
        for d in shape:
            if d < 1:
                raise MlxspecError(f"{path}: tensor {name} has shape {list(shape)} with a dimension below 1; {fix}")
            n_el *= d
            if n_el > 1 << 62:
                raise MlxspecError(f"{path}: tensor {name} has shape {list(shape)}: its element count overflows; {fix}")
        if off % align:
            raise MlxspecError(f"{path}: tensor {name} starts at data offset {off}, not a multiple of the "
                               f"alignment {align}; {fix}")
        if t in GGML_TYPES:
            tname, bs, bb = GGML_TYPES[t]
            if shape[-1] % bs:
                raise MlxspecError(f"{path}: tensor {name} ({tname}) has rows of {shape[-1]} values, not a whole "
                                   f"number of {bs}-value blocks; {fix}")
            nbytes = n_el // bs * bb
        else:
            nbytes = -1  # unknown: size cannot be computed
        if expected is not None and off != expected:
            if not tensors:
                raise MlxspecError(f"{path}: the first tensor {name} starts at data offset {off}, expected 0; {fix}")
            prev = tensors[-1]
            raise MlxspecError(f"{path}: tensor {name} starts at data offset {off}, expected {expected} right after "
                               f"{prev.name} ({prev.type_name}, {prev.nbytes} bytes by its type and shape): overlapping "
                               f"or misplaced tensors, or a type that disagrees with the data size; {fix}")
        if tensors and tensors[-1].nbytes < 0 and off < tensors[-1].offset - data_start:
            raise MlxspecError(f"{path}: tensor {name} starts at data offset {off}, before the previous tensor; {fix}")
        info = TensorInfo(name, t, shape, data_start + off, nbytes)
        end = info.offset + max(nbytes, 0)
        if end > size:
            raise MlxspecError(
                f"{path}: GGUF file is truncated: tensor {name} ends at byte {end} "
                f"but the file has {size} bytes; download it again"
            )
        expected = None if nbytes < 0 else off + (nbytes + align - 1) // align * align
        tensors.append(info)
    return tensors
