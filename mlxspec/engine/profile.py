"""Verify-cost profile for the confidence scheduler: target steps/second per block length.

Measured once per (model file, device, BLAS) and cached as JSON under the mlxspec cache dir,
for the longest verify asked for so far: a shorter request reads the first lengths of it (a
drafter switch does not measure again), a longer one measures the longer curve. The first
curve measured spans at least MIN_LEN lengths, the longest verify of the default drafter and of
prompt lookup, so a short chain asked for first (an EAGLE-3 chain of 8) does not make the next
default run measure all over again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import mlx.core as mx

from mlxspec.blas import _loaded_openblas_path
from mlxspec.cache import cache_dir
from mlxspec.engine.ngram import LOOKUP_MAX
from mlxspec.targets.model import Target, trim_cache

MIN_LEN = LOOKUP_MAX + 1  # 17: lookup's longest verify, and a DSpark block of 16 drafts plus its anchor


def _key(target: Target) -> str:
    src = target.info.source or "memory"
    st = os.stat(src) if os.path.exists(src) else None
    # the BLAS library is part of the machine: a profile measured under netlib's reference BLAS
    # (a run without the OpenBLAS preload) is ~5x too slow and the wrong shape for OpenBLAS
    from mlxspec.cpu_gemm import profile_key

    from mlxspec import cpu_jit
    from mlxspec.targets import host_math, host_rope

    # so are the small GEMM, the host softmax and SwiGLU, RoPE and RMSNorm as single ops and MLX's
    # kernels built for this CPU (a curve measured without them is another shape)
    blas = (_loaded_openblas_path() or "no-openblas") + profile_key() + (("|host-math-primitives" if host_math.in_graph() else "|host-math") if host_math.usable() else "") \
        + ("|host-rope" if host_rope.check() else "") + cpu_jit.profile_key()
    ident = f"v5|{src}|{st.st_size if st else 0}|{st.st_mtime if st else 0}|{mx.default_device()}|{platform.node()}|{blas}"
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def measure_verify_sps(target: Target, max_len: int, context: int = 128, repeats: int = 7) -> dict[int, float]:
    """Best-of-rounds steps/second of a forward over L = 1..max_len tokens at `context`.

    Lengths are measured round-robin (L = 1, 2, .., max_len, then again), so load from
    other processes hits every length alike and the ratios between lengths, which are what
    the policy uses, stay right on a busy machine."""
    cache = target.make_cache()
    mx.eval(target(mx.array([[1] * context]), cache, logits="last")[0])
    times: dict[int, list[float]] = {L: [] for L in range(1, max_len + 1)}
    for r in range(repeats + 1):
        for L in range(1, max_len + 1):
            x = mx.array([[7] * L])
            t = time.perf_counter()
            lg, _ = target(x, cache)
            mx.eval(lg)
            if r:  # round 0 warms up
                times[L].append(time.perf_counter() - t)
            trim_cache(cache, L)
    # the fastest of the rounds: load from other processes only ever slows a forward down,
    # and on a loaded CPU a multi-threaded GEMM suffers more than a 1-row GEMV, which a
    # median would bake into the curve's shape
    # and a longer forward never costs less than a shorter one: what noise says otherwise is
    # noise (the running maximum over L of the best times)
    best, out = 0.0, {}
    for L in range(1, max_len + 1):
        best = max(best, min(times[L]))
        out[L] = 1.0 / best
    return out


def verify_profile(target: Target, max_len: int) -> dict[int, float]:
    """Steps/second per verify length 1..max_len: the cached curve's first lengths when it is
    long enough, else measured (and cached in its place)."""
    path = cache_dir() / "profiles" / f"{_key(target)}.json"
    if path.exists():
        sps = {int(k): v for k, v in json.loads(path.read_text()).items()}
        if max(sps, default=0) >= max_len:
            return {L: sps[L] for L in range(1, max_len + 1)}
    sps = measure_verify_sps(target, max(max_len, MIN_LEN))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(sps))
    os.replace(tmp, path)  # whole or absent, for a process reading it at the same time
    return {L: sps[L] for L in range(1, max_len + 1)}
