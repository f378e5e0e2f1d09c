"""Run mlxspec's Metal and CUDA kernel bodies on the CPU, wrapped the way mx.fast wraps them.

`Emulator("metal").run(spec, inputs, launch)` has the same contract as
mlxspec.kernels._launch.run_fast: it builds the function MLX would generate around the kernel
body (parameters named after the declared inputs and outputs, Metal thread attributes the body
mentions, template arguments), compiles it with g++ against metal_shim.h (or cuda_shim.h),
runs the launch grid on cooperative fibers and returns the outputs as mx arrays.

Each launch runs twice, with outputs pre-filled with different poison bytes and threads
scheduled in different orders; an output byte that differs was never written (or is racy) and
fails the launch. Reads or writes past the end of any buffer fault and fail the launch.

Subset (what the shims implement; kernels must stay inside it):
  Metal: scalar types (float, half/float16_t, bfloat16_t, int/uint/ushort/uchar, fixed-width ints),
    uint3 attributes, as_type, scalar math (exp, log, max, min, abs, floor, ...),
    simd_sum/max/min, simd_shuffle(_xor/_down), simd_broadcast(_first), simd_prefix_exclusive_sum,
    threadgroup arrays declared as `threadgroup T name[N]...;` in the body,
    threadgroup_barrier / simdgroup_barrier. No vector types, atomics, textures or simdgroup
    matrices.
  CUDA: threadIdx/blockIdx/blockDim/gridDim, __syncthreads, __syncwarp, __shfl_(xor_|down_)sync
    with a full mask, `__shared__ T name[N]...;` in the body, __half/__nv_bfloat16 conversions,
    expf/logf/fmaxf/fminf.
  Both: the threadgroup size is a multiple of 32 and every lane of a simdgroup (warp) reaches
    each SIMD collective; every thread of a group reaches each barrier. For Metal, the grid is
    a multiple of the threadgroup (MLX would dispatch partial groups otherwise); for CUDA the
    grid is rounded up to whole blocks, as mx.fast.cuda_kernel does.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.kernels._launch import KernelSpec, Launch

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("MLXSPEC_EMU_CACHE", Path(tempfile.gettempdir()) / "mlxspec-emu-cache"))
CXX = shutil.which("g++")
NVCC = shutil.which("nvcc")

METAL_TYPES = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float32: "float",
}
CUDA_TYPES = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
}
# the order in which mx.fast.metal_kernel appends the attributes a body names
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
)
CONSTANT_BELOW = 8  # MLX binds inputs with fewer elements in the constant address space
CUDA_DEFAULT_HEADER_SHIM = '#include "cuda_shim.h"\n'
# what the MLX CUDA JIT puts first; for nvcc we stand in real CUDA headers for MLX's utils.cuh
CUDA_DEFAULT_HEADER_NVCC = """#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/limits>
#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


class EmulatorError(AssertionError):
    """The emulated launch failed: a fault, an unwritten output, a divergent barrier..."""


def _template_value(value, types) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return types[value]


def _rewrite_shared(body: str, keyword: str) -> str:
    """`threadgroup T name[A][B];` -> a reference to per-threadgroup emulator storage."""
    pattern = re.compile(rf"\b{keyword}\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]+\])+)\s*;")
    counter = iter(range(1 << 30))
    return pattern.sub(
        lambda m: f"auto& {m.group(2)} = *shim::tg_alloc<{m.group(1)}{m.group(3)}>({next(counter)});", body
    )


def metal_signature(spec: KernelSpec, inputs, launch: Launch, body: str, emulated: bool) -> str:
    """The function mx.fast.metal_kernel generates around `body` (attributes dropped when emulated)."""
    lines = []
    tpl = launch.template
    if tpl:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in tpl]
        lines.append("template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, tpl)) + ">")
    params = []
    index = 0
    for name, arr in zip(spec.inputs, inputs):
        space = "constant" if arr.size < CONSTANT_BELOW else "device"
        ref = "&" if arr.ndim == 0 else "*"
        attr = "" if emulated else f" [[buffer({index})]]"
        params.append(f"  const {space} {METAL_TYPES[arr.dtype]}{ref} {name}{attr}")
        index += 1
        for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                              ("_ndim", "const constant int&")):
            if arr.ndim > 0 and (name + suffix) in body:
                raise NotImplementedError(f"{name}{suffix}: shape arguments are outside the emulated subset")
    for name, dtype in zip(spec.outputs, launch.output_dtypes):
        attr = "" if emulated else f" [[buffer({index})]]"
        params.append(f"  device {METAL_TYPES[dtype]}* {name}{attr}")
        index += 1
    for attr_name, attr_type in METAL_ATTRIBUTES:
        if attr_name in body:
            attr = "" if emulated else f" [[{attr_name}]]"
            params.append(f"  {attr_type} {attr_name}{attr}")
    kernel = "" if emulated else "[[kernel]] "
    lines.append(f"{kernel}void custom_kernel_{spec.name}(\n" + ",\n".join(params) + ") {")
    return "\n".join(lines) + "\n" + body + "\n}\n"


def cuda_wrapper(spec: KernelSpec, inputs, launch: Launch, header: str, body: str, default_header: str) -> str:
    """The source mx.fast.cuda_kernel JIT-compiles (mlx/backend/cuda/custom_kernel.cpp)."""
    out = [default_header, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"]
    out.append(f"__global__ void custom_kernel_{spec.name}(\n")
    params = []
    for name, arr in zip(spec.inputs, inputs):
        params.append(f"    const {CUDA_TYPES[arr.dtype]}* {name}")
        if arr.ndim > 0 and any(name + s in body for s in ("_shape", "_strides", "_ndim")):
            raise NotImplementedError(f"{name}: shape arguments are outside the emulated subset")
    for name, dtype in zip(spec.outputs, launch.output_dtypes):
        params.append(f"    {CUDA_TYPES[dtype]}* {name}")
    out.append(",\n".join(params) + ") {\n")
    for name, value in launch.template:
        if isinstance(value, bool):
            out.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            out.append(f"  constexpr int {name} = {value};\n")
        else:
            out.append(f"  using {name} = {CUDA_TYPES[value]};\n")
    out.append("\n" + body + "\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(out)


def _variant_key(spec: KernelSpec, inputs, launch: Launch) -> tuple:
    ins = tuple((str(a.dtype), a.ndim == 0) for a in inputs)
    tpl = tuple((n, v if isinstance(v, (bool, int)) else str(v)) for n, v in launch.template)
    return (spec.name, spec.stem, ins, tuple(str(d) for d in launch.output_dtypes), tpl)


def _metal_call(spec: KernelSpec, inputs, launch: Launch, body: str) -> str:
    targs = ""
    if launch.template:
        targs = "<" + ", ".join(_template_value(v, METAL_TYPES) for _, v in launch.template) + ">"
    n_in = len(spec.inputs)
    args = []
    for i, arr in enumerate(inputs):
        ptr = f"reinterpret_cast<const {METAL_TYPES[arr.dtype]}*>(shim::L->buffers[{i}].data)"
        args.append(f"*{ptr}" if arr.ndim == 0 else ptr)
    for o, dtype in enumerate(launch.output_dtypes):
        args.append(f"reinterpret_cast<{METAL_TYPES[dtype]}*>(shim::L->buffers[{n_in + o}].data)")
    args += [f"a.{name}" for name, _ in METAL_ATTRIBUTES if name in body]
    return f"  const auto a = shim::metal_attrs();\n  (void)a;\n  custom_kernel_{spec.name}{targs}({', '.join(args)});\n"


def translation_unit(language: str, spec: KernelSpec, variants: list) -> str:
    """One C++ file running `variants` [(inputs, launch), ...] of one kernel, chosen by argv[1]."""
    header, body = spec.source(language)
    n_in = len(spec.inputs)
    parts, calls, seen = [], [], set()
    if language == "metal":
        body = _rewrite_shared(body, "threadgroup")
        parts.append('#include "metal_shim.h"\n' + header + "\n")
        for inputs, launch in variants:
            fn = metal_signature(spec, inputs, launch, body, True)
            if fn not in seen:  # variants differing only in template arguments share the template
                seen.add(fn)
                parts.append(fn)
            calls.append(_metal_call(spec, inputs, launch, body))
    else:
        body = _rewrite_shared(body, "__shared__")
        parts.append(CUDA_DEFAULT_HEADER_SHIM + header)
        for v, (inputs, launch) in enumerate(variants):
            wrapped = cuda_wrapper(spec, inputs, launch, "", body, "")
            parts.append(wrapped.replace(f"custom_kernel_{spec.name}(", f"custom_kernel_{spec.name}_v{v}(", 1))
            args = [f"reinterpret_cast<const {CUDA_TYPES[a.dtype]}*>(shim::L->buffers[{i}].data)"
                    for i, a in enumerate(inputs)]
            args += [f"reinterpret_cast<{CUDA_TYPES[d]}*>(shim::L->buffers[{n_in + o}].data)"
                     for o, d in enumerate(launch.output_dtypes)]
            calls.append(f"  mlx::core::cu::custom_kernel_{spec.name}_v{v}({', '.join(args)});\n")
    for v, call in enumerate(calls):
        parts.append(f"\nstatic void shim_variant_{v}() {{\n{call}}}\n")
    parts.append("static shim::VariantFn shim_variants[] = {"
                 + ", ".join(f"shim_variant_{v}" for v in range(len(calls))) + "};\n")
    parts.append("int main(int argc, char** argv) {\n"
                 f"  return shim::main(argc, argv, shim_variants, {len(calls)}, "
                 f"{'true' if language == 'cuda' else 'false'});\n}}\n")
    return "".join(parts)


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_bytes(data: bytes, dtype, shape) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(data, dtype=np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dtype = np.dtype(str(dtype).split(".")[-1].replace("bool_", "bool"))
    return mx.array(np.frombuffer(data, dtype=np_dtype).reshape(shape))


class Emulator:
    """Compile-and-run kernels for one language ("metal" or "cuda") on the CPU.

    `run(spec, inputs, launch)` compiles on first use of a variant (kernel, dtypes, template);
    `prepare(items)` compiles many variants of a kernel into one binary ahead of time, and
    `record(fn)` lists the launches a driver would make (without running them) for prepare."""

    def __init__(self, language: str, opt: str = "-O1"):
        if CXX is None:
            raise RuntimeError("g++ is not on PATH")
        self.language = language
        self.opt = opt
        self.variants: dict[tuple, tuple[Path, int]] = {}

    def _pch_dir(self) -> Path:
        shim_text = "".join((HERE / f).read_text() for f in ("shim_core.h", "metal_shim.h", "cuda_shim.h"))
        key = hashlib.sha256((shim_text + self.opt + self.language).encode()).hexdigest()[:16]
        pch = CACHE / f"pch-{self.language}-{key}"
        header = f"{self.language}_shim.h"
        if not (pch / f"{header}.gch").exists():
            pch.mkdir(parents=True, exist_ok=True)
            tmp = pch / f"{header}.gch.{os.getpid()}"
            res = subprocess.run([CXX, "-std=c++20", self.opt, "-w", "-x", "c++-header", "-I", str(HERE),
                                  str(HERE / header), "-o", str(tmp)], capture_output=True, text=True)
            if res.returncode != 0:
                raise EmulatorError(f"g++ failed on {header}:\n{res.stderr[-4000:]}")
            os.replace(tmp, pch / f"{header}.gch")
        return pch

    def compile(self, source: str) -> Path:
        shim_text = "".join((HERE / f).read_text() for f in ("shim_core.h", "metal_shim.h", "cuda_shim.h"))
        key = hashlib.sha256((source + shim_text + self.opt).encode()).hexdigest()[:20]
        CACHE.mkdir(parents=True, exist_ok=True)
        exe = CACHE / f"k{key}"
        if exe.exists():
            return exe
        src = CACHE / f"k{key}.cpp"
        src.write_text(source)
        tmp = CACHE / f"k{key}.{os.getpid()}.tmp"
        cmd = [CXX, "-std=c++20", self.opt, "-w", "-I", str(self._pch_dir()), "-I", str(HERE), str(src),
               "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise EmulatorError(f"g++ failed on {src}:\n{res.stderr[-4000:]}")
        os.replace(tmp, exe)
        return exe

    def prepare(self, items) -> None:
        """Compile the variants of [(spec, inputs, launch), ...] not compiled yet, one binary per
        kernel, two compilers at a time."""
        by_spec: dict[KernelSpec, dict[tuple, tuple]] = {}
        for spec, inputs, launch in items:
            key = _variant_key(spec, inputs, launch)
            if key not in self.variants:
                by_spec.setdefault(spec, {})[key] = (inputs, launch)
        jobs = [(spec, list(v.keys()), list(v.values())) for spec, v in by_spec.items()]
        if not jobs:
            return
        self._pch_dir()
        sources = [translation_unit(self.language, spec, variants) for spec, _, variants in jobs]
        with ThreadPoolExecutor(max_workers=2) as pool:
            exes = list(pool.map(self.compile, sources))
        for (spec, keys, _), exe in zip(jobs, exes):
            for index, key in enumerate(keys):
                self.variants[key] = (exe, index)

    @staticmethod
    def record(fn) -> list:
        """Call fn(run) with a runner that records launches and returns zeros; returns the list."""
        items = []

        def fake(spec, inputs, launch):
            items.append((spec, [mx.zeros(a.shape, a.dtype) for a in inputs], launch))
            return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]

        fn(fake)
        return items

    def run(self, spec: KernelSpec, inputs: list, launch: Launch) -> list:
        for a in inputs:
            if a.dtype not in METAL_TYPES:
                raise NotImplementedError(f"dtype {a.dtype} is outside the emulated subset")
        mx.eval(*inputs)
        key = _variant_key(spec, inputs, launch)
        if key not in self.variants:
            self.prepare([(spec, inputs, launch)])
        exe, index = self.variants[key]
        sizes = [a.nbytes for a in inputs]
        out_sizes = [int(np.prod(s, dtype=np.int64)) * d.size for s, d in zip(launch.output_shapes, launch.output_dtypes)]
        with tempfile.TemporaryDirectory() as tmp:
            fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
            fin.write_bytes(b"".join(_to_bytes(a) for a in inputs))
            argv = [str(exe), str(index), *map(str, launch.grid), *map(str, launch.threadgroup), str(fin),
                    str(fout), str(len(inputs)), str(len(out_sizes)), *map(str, sizes + out_sizes),
                    *spec.inputs, *spec.outputs]
            res = subprocess.run(argv, capture_output=True, text=True)
            if res.returncode != 0:
                raise EmulatorError(f"{self.language} kernel {spec.name} (exit {res.returncode}): "
                                    f"{res.stderr.strip()[-2000:]}")
            data = fout.read_bytes()
        outs, pos = [], 0
        for shape, dtype, n in zip(launch.output_shapes, launch.output_dtypes, out_sizes):
            outs.append(_from_bytes(data[pos:pos + n], dtype, shape))
            pos += n
        return outs

    __call__ = run


def nvcc_compile(spec: KernelSpec, variants: list, arch: str = "sm_80") -> None:
    """Compile the wrapped CUDA body for each (inputs, launch) variant to PTX with nvcc
    (device code only, as NVRTC does in mx.fast.cuda_kernel); one nvcc run for all variants."""
    header, body = spec.source("cuda")
    parts = [CUDA_DEFAULT_HEADER_NVCC, header]
    for v, (inputs, launch) in enumerate(variants):
        wrapped = cuda_wrapper(spec, inputs, launch, "", body, "")
        parts.append(wrapped.replace(f"custom_kernel_{spec.name}(", f"custom_kernel_{spec.name}_v{v}(", 1))
    source = "".join(parts)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(source)
        res = subprocess.run([NVCC, "--ptx", f"-arch={arch}", "-std=c++17", "-Werror", "all-warnings",
                              str(src), "-o", str(Path(tmp) / "k.ptx")],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise EmulatorError(f"nvcc failed for {spec.name}:\n{res.stderr[-4000:]}")
