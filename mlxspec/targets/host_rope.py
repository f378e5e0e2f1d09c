"""RoPE and RMSNorm in the target's forward on a CPU in fewer operations, with MLX's numbers bit for bit.

On the CPU, MLX computes `mx.fast.rope` and `mx.fast.rms_norm` by their fallbacks (mlx/fast.cpp):
graphs of small operations, each one evaluated on its own. RoPE is ~20 of them (the positions,
the inverse frequencies, their exp, cos and sin, four multiplies, a subtract, an add, the slices,
a concatenate) for every query and key of every layer: 60 calls and ~1,200 operations in a
SmolLM2-135M forward, whatever its rows. That cost ~1.3 ms of Python graph building and several
ms of evaluation in a ~45 ms decode step here (`scripts/bench_rope.py`, docs/results.md).

- RoPE: one op (`mlxspec.cpu_ops` `host_rope`) that rotates with cos and sin tables. The tables
  are MLX's own values: read off the original `mx.fast.rope` applied once to a probe whose first
  half is ones and second half zeros (its output is then exactly cos and sin for each position:
  1 * c - 0 * s = c, 1 * s + 0 * c = s), for positions 0..P at once, which the fallback computes
  with the same operations on the same values (a position p's theta is float(p) * inv_freq, the
  fallback's (arange + offset) * scale for integer offsets below 2^24). The rotation itself is
  the fallback's multiplies, subtract and add, each rounded to float (-ffp-contract=off).
- RMSNorm: the fallback's own operations (square, mean, + eps, rsqrt, multiplies), as one
  `mx.compile`d function: the elementwise ones fuse into MLX's compiled kernels (built for this
  CPU with the same rounding, `mlxspec.cpu_jit`), 3 evaluated operations instead of 7.

`check()` compares both with the originals bit for bit in each process before the first use
(offsets from 0 to 70,000 and per batch row, partial and full rotary dims, both layouts, transposed inputs, several
bases and scales, given frequencies; norms of several widths and magnitudes); tests/test_host_rope.py compares whole
forwards. Where the check fails, the extension is missing, or a call is one these do not cover
(another dtype or rank, a stream, an offset that is neither an int nor one int32 per batch row,
a negative one), the originals run unchanged.
`Target.__call__` installs them for the duration of a forward (`installed()`), never around
training (no gradient through the op). MLXSPEC_HOST_MATH=0 turns them off with the host math.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

from mlxspec.targets import host_math

_ROPE = mx.fast.rope
_RMS_NORM = mx.fast.rms_norm
_TABLES: dict = {}  # (dims, base, scale, id(freqs)) -> (cos [P, dims/2], sin [P, dims/2], freqs), float32
_STATE: dict = {}  # "ok": the check passed, "why": why not
MIN_TABLE = 4096
MAX_POSITION = 1 << 24  # float32 holds every integer position below


def _table(dims: int, base, scale: float, freqs, need: int):
    """MLX's cos and sin of every position below `need` (at least), read off its own rope (with
    the module's own frequencies where it has them: Llama 3's scaled RoPE)."""
    key = (dims, None if base is None else float(base), float(scale), id(freqs))
    t = _TABLES.get(key)
    if t is None or t[0].shape[0] < need or t[2] is not freqs:
        P = max(MIN_TABLE, 1 << max(need - 1, 1).bit_length())
        half = dims // 2
        probe = mx.concatenate([mx.ones((half,), mx.float32), mx.zeros((half,), mx.float32)])
        out = _ROPE(mx.broadcast_to(probe, (1, 1, P, dims)), dims, traditional=False, base=base, scale=scale,
                    offset=0, freqs=freqs, stream=mx.cpu)[0, 0]
        t = (mx.contiguous(out[:, :half]), mx.contiguous(out[:, half:]), freqs)
        mx.eval(*t[:2])
        _TABLES[key] = t
    return t


def _offsets(offset, batch: int):
    """The offset as an int, or a list of one int per batch row (an mx.array of shape [batch]:
    a ragged batch's row lengths), or None where it is neither."""
    if type(offset) is int:
        return offset
    if isinstance(offset, mx.array) and offset.ndim == 1 and offset.size == batch and offset.dtype == mx.int32:
        return offset.tolist()
    return None


def _rope_eligible(a, dims, base, offs, freqs, stream) -> bool:
    lo, hi = (offs, offs) if type(offs) is int else (min(offs), max(offs)) if offs else (-1, 0)
    return (stream is None and (base is None) != (freqs is None) and a.ndim == 4 and a.dtype == mx.float32
            and 0 <= lo and hi + a.shape[-2] < MAX_POSITION
            and isinstance(dims, int) and 0 < dims <= a.shape[-1] and dims % 2 == 0)


def exact_rope(a, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
    """`mx.fast.rope` as one op where eligible (module docstring), else the original."""
    offs = _offsets(offset, a.shape[0]) if a.ndim == 4 else None
    if offs is None or not _rope_eligible(a, dims, base, offs, freqs, stream) or not host_math.in_graph():
        return _ROPE(a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                     stream=stream)
    return _host_rope(a, dims, traditional, base, scale, offs, freqs)


def _host_rope(a, dims, traditional, base, scale, offset, freqs=None):
    """offset: an int, or one int per batch row."""
    T = a.shape[2]
    if type(offset) is int:
        cos, sin, _ = _table(dims, base, scale, freqs, offset + T)
        cos, sin = cos[offset: offset + T], sin[offset: offset + T]
    else:
        cos, sin, _ = _table(dims, base, scale, freqs, max(offset) + T)
        idx = mx.array(np.asarray(offset, np.int32)[:, None] + np.arange(T, dtype=np.int32))
        cos, sin = cos[idx], sin[idx]  # [B, T, dims / 2]
    return host_math._ops().host_rope(a, cos, sin, dims, bool(traditional))


@mx.compile
def _norm(x, w, eps):
    """mlx/fast.cpp's RMSNorm fallback for float32 x and weight, operation for operation."""
    return (x * mx.rsqrt(mx.mean(mx.square(x), -1, keepdims=True) + eps)) * w


def exact_rms_norm(x, weight, eps, *, stream=None):
    """`mx.fast.rms_norm` as one compiled function where eligible (float32, a weight), else the original."""
    if stream is not None or weight is None or x.dtype != mx.float32 or weight.dtype != mx.float32 \
            or weight.ndim != 1 or x.ndim == 0 or weight.shape[0] != x.shape[-1]:
        return _RMS_NORM(x, weight, eps, stream=stream)
    return _norm(x, weight, mx.array(eps, mx.float32))


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


def check() -> bool:
    """Whether both equal the originals bit for bit on the cases below, in this process (MLX's
    version and this CPU): the first call with the host math on as MLX primitives decides; while
    they are not available (off, or not built), False."""
    if not (host_math.usable() and host_math.in_graph() and hasattr(host_math._ops(), "host_rope")):
        _STATE["why"] = "the host math is off or not MLX primitives"  # looked at every call: no verdict kept
        return False
    if "ok" in _STATE:
        return _STATE["ok"]
    ok = True
    rng = np.random.default_rng(0)
    cases = [(9, 64, 64, 1, 0, False, 10000.0, 1.0), (9, 64, 64, 5, 183, False, 100000.0, 1.0),
             (3, 64, 64, 17, 4090, False, 100000.0, 1.0), (4, 128, 64, 9, 70000, False, 1e6, 1.0),
             (2, 64, 32, 3, 77, False, 10000.0, 0.25), (2, 64, 64, 7, 12, True, 10000.0, 1.0),
             (2, 80, 40, 2, 5000, True, 500000.0, 0.5), (1, 256, 256, 1, 123456, False, 1e6, 1.0)]
    freqs = mx.array(np.geomspace(1.0, 8e5, 32).astype(np.float32))  # periods, as Llama 3's RoPE passes them
    cases += [(3, 64, 64, 9, 300, False, None, 1.0), (2, 64, 64, 2, 9999, True, None, 1.0)]
    for H, D, dims, T, off, trad, base, scale in cases if ok else ():
        x = mx.array(rng.standard_normal((1, T, H, D)).astype(np.float32) * 3).transpose(0, 2, 1, 3)
        f = freqs if base is None else None
        want = _ROPE(x, dims, traditional=trad, base=base, scale=scale, offset=off, freqs=f)
        if not _same(want, _host_rope(x, dims, trad, base, scale, off, f)):
            ok = False
            _STATE["why"] = f"its RoPE differs from this MLX's ({mx.__version__}; dims {dims} of {D}, offset {off})"
    if ok:  # a ragged batch: each row at its own offset
        x = mx.array(rng.standard_normal((3, 4, 5, 64)).astype(np.float32))
        offs = mx.array([0, 171, 5000], mx.int32)
        if not _same(_ROPE(x, 64, traditional=False, base=10000.0, scale=1.0, offset=offs),
                     _host_rope(x, 64, False, 10000.0, 1.0, [0, 171, 5000])):
            ok = False
            _STATE["why"] = f"its RoPE differs from this MLX's ({mx.__version__}; offsets per batch row)"
    for n, mag in ((576, 1.0), (960, 30.0), (64, 1e-3), (2048, 1e3)) if ok else ():
        x = mx.array(rng.standard_normal((1, 5, n)).astype(np.float32) * mag)
        w = mx.array(rng.standard_normal((n,)).astype(np.float32))
        if not _same(_RMS_NORM(x, w, 1e-5), exact_rms_norm(x, w, 1e-5)):
            ok = False
            _STATE["why"] = f"its RMSNorm differs from this MLX's ({mx.__version__}; width {n})"
    _STATE["ok"] = ok
    return ok


@contextlib.contextmanager
def installed():
    """Inside (where `check()` passed on the CPU), `mx.fast.rope` is `exact_rope` and
    `mx.fast.rms_norm` is `exact_rms_norm`."""
    if mx.default_device() != mx.cpu or not check() or mx.fast.rope is exact_rope:
        yield
        return
    mx.fast.rope, mx.fast.rms_norm = exact_rope, exact_rms_norm
    try:
        yield
    finally:
        mx.fast.rope, mx.fast.rms_norm = _ROPE, _RMS_NORM


def status() -> str:
    if check():
        return "RoPE and RMSNorm: one op each (equal to MLX's bit for bit)"
    return f"RoPE and RMSNorm: MLX's ({_STATE.get('why', 'not checked')})"
