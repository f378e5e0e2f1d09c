"""mlxspec's MLX primitives for the CPU (`mlxspec/cpu/mlx_ops.cpp`): MLX's softmax with the causal
mask, MLX's attention fallback with a causal mask or none, and mlx-lm's SwiGLU, computed by
`mlxspec/cpu/mlx_math.c` (and the cblas_sgemm MLX's matmul calls) inside MLX's graph.

`mlxspec.targets.host_math` computes both with MLX's own numbers, 16 lanes at a time. Called from
Python, each needed the graph evaluated up to it (a layer's graph cut in two, ~100-200 us on this
VM), so it paid only from ~13 rows. As primitives they run on MLX's CPU stream like any op, in
place of the ops they replace, at every row count.

The extension is built here on first use (`g++ -O2 -march=native -ffp-contract=off -std=c++20`,
about 6 seconds) against the MLX wheel's headers and nanobind's sources, in the nanobind domain
MLX's own bindings use (`NB_DOMAIN=mlx`), into the mlxspec cache, keyed by the sources, the CPU,
MLX, nanobind and Python. Without nanobind (the `cpu` extra installs it), a C++ compiler, or
Python's headers, or if the built module does not take MLX's arrays, `module()` returns None and says
why (`why`): host_math then computes on the host between two evaluations, as before. Never
imports MLX at import."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

MODULE = "mlxspec_mlx_ops"  # NB_MODULE's name in mlx_ops.cpp
SOURCES = [Path(__file__).with_name("cpu") / "mlx_ops.cpp", Path(__file__).with_name("cpu") / "mlx_math.c"]
FLAGS = ("-O2", "-march=native", "-ffp-contract=off", "-fPIC")
_STATE: dict = {}  # "mod": the loaded module, "why": why not


def _versions():
    import nanobind

    spec = importlib.util.find_spec("mlx")
    # mlx is a namespace package: any directory named mlx on sys.path joins it (a script's own
    # folder, the working directory), so take the one that holds MLX's headers
    dirs = [Path(p) for p in spec.submodule_search_locations]
    mlx_dir = next((d for d in dirs if (d / "include" / "mlx" / "array.h").exists()), dirs[0])
    from importlib.metadata import version

    return mlx_dir, f"mlx {version('mlx')}|nanobind {nanobind.__version__}|{sys.version}"


def build(out_dir: Path | None = None, cxx: str | None = None) -> Path | None:
    """The extension's path, built once per key; None (and `why`) where it cannot be."""
    from mlxspec.cache import cache_dir
    from mlxspec.device import cpu_flags

    try:
        import nanobind
    except ImportError:
        _STATE["why"] = "nanobind is not installed (pip install 'mlxspec[cpu]')"
        return None
    mlx_dir, versions = _versions()
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        _STATE["why"] = f"Python's headers are missing ({include}/Python.h)"
        return None
    key = hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()
                       + cpu_flags().encode() + platform.machine().encode() + versions.encode()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir else cache_dir() / "native" / f"mlx-ops-{key}"
    lib = out_dir / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    if lib.exists():
        return lib
    cxx = cxx or os.environ.get("CXX") or "g++"
    cc = os.environ.get("CC") or "cc"
    tmp = out_dir / f"build-{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        obj = tmp / "mlx_math.o"
        steps = [
            [cc, *FLAGS, "-c", str(SOURCES[1]), "-o", str(obj)],
            [cxx, *FLAGS, "-std=c++20", "-DNB_DOMAIN=mlx", "-shared", "-fvisibility=hidden",
             "-I", str(mlx_dir / "include"), "-I", nanobind.include_dir(),
             "-I", str(Path(nanobind.source_dir()).parent / "ext" / "robin_map" / "include"), "-I", include,
             str(SOURCES[0]), str(Path(nanobind.source_dir()) / "nb_combined.cpp"), str(obj),
             "-L", str(mlx_dir / "lib"), "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(tmp / lib.name)],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                err = [ln for ln in (r.stderr or r.stdout).splitlines() if "error" in ln][:1] or ["?"]
                _STATE["why"] = f"{cmd[0]} failed: {err[0].strip()}"
                return None
        os.replace(tmp / lib.name, lib)
    except (OSError, subprocess.SubprocessError) as e:
        _STATE["why"] = f"cannot build it: {e}"
        return None
    finally:
        for p in tmp.glob("*") if tmp.exists() else ():
            p.unlink(missing_ok=True)
        if tmp.exists():
            tmp.rmdir()
    return lib


def module():
    """The extension module (MLX imported first), or None: `why` says why."""
    if "mod" in _STATE or "why" in _STATE:
        return _STATE.get("mod")
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        _STATE["why"] = f"x86-64 Linux only (this is {sys.platform} {platform.machine()})"
        return None
    path = build()
    if path is None:
        return None
    import mlx.core as mx

    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.host_swiglu(mx.zeros((2,)), mx.zeros((2,)))  # takes MLX's arrays (the same nanobind ABI)
    except (ImportError, OSError, TypeError) as e:
        _STATE["why"] = f"the built module does not work with this MLX: {str(e).splitlines()[0]}"
        return None
    _STATE["mod"] = mod
    return mod


def why() -> str:
    return _STATE.get("why", "")
