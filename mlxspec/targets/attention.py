"""The target's attention on a CPU, with its softmax computed in C: the same numbers as MLX's,
bit for bit, several times faster.

On a CPU MLX computes `mx.fast.scaled_dot_product_attention` by its fallback: q * scale,
q @ k^T, the mask, a softmax, @ v. The MLX wheel for x86-64 runs that softmax's exp one element
at a time (~13 ns an element on the 2-core Xeon this was measured on), so it is what grows with
the rows of a verify: at a context of 300, SmolLM2-135M's 30 softmaxes take ~1.3 ms for one row,
~11 for 9 and ~21 for 17 (`scripts/attention_rows.py`, docs/cli.md).

`exact_sdpa` builds the same graph from the same MLX ops, except that the scores are evaluated
and the softmax (with the causal mask) is computed by `mlxspec/cpu/softmax.c`, which reproduces
MLX's own softmax and exp element for element. Nothing else changes: the products are MLX's
(and the small GEMM's), so the logits are the ones mlx-lm's forward gives, bit for bit, which
`check()` verifies in each process before the first use (against `mx.fast` itself, on the
shapes a verify has: GQA and MHA, the causal mask, boolean and additive masks) and which
tests/test_attention.py checks on real forwards. Anything the check does not cover (another
dtype, attention sinks, a GPU) goes to `mx.fast` unchanged.

`Target.__call__` installs it for the duration of a forward (`installed()`), never around
`forward_hidden` (training: no host round trip inside a traced function). MLXSPEC_HOST_SOFTMAX=0
turns it off; `status()` says whether it is on and why not.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import mlx.core as mx
import numpy as np

SOURCE = Path(__file__).resolve().parents[1] / "cpu" / "softmax.c"
# scores per call (heads x query rows x keys) from which the host softmax is used: below, the
# evaluation it waits for (~60 us a layer) costs about what it saves (SmolLM2, 10 interleaved
# rounds: at a context of 180, 4 rows (6,600 scores) 4 ms slower, 5 rows (8,300) 3.5 ms faster,
# 9 rows (15,300) 8 ms faster; at 300, 4 rows (10,900) 2.6 ms faster)
MIN_ELEMENTS = 10_000
MAX_ELEMENTS = 1 << 24  # above, MLX keeps them (a host copy of 64 MB and one back)
_STATE: dict = {}  # "lib", "ok": the check passed, "why": why it is not used
_ORIGINAL = mx.fast.scaled_dot_product_attention


def _lib():
    if "lib" in _STATE or "why" in _STATE:
        return _STATE.get("lib")
    from mlxspec import cpu_gemm, device

    if not device.host_softmax_enabled():
        _STATE["why"] = f"{device.HOST_SOFTMAX_ENV}=0"
        return None
    path = cpu_gemm.build(source=SOURCE, flags=("-ffp-contract=off",), libs=("-lm",), state=_STATE)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.mlxspec_softmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.mlxspec_softmax_rows.restype = None
    _STATE["lib"] = lib
    return lib


def softmax_rows(x: np.ndarray, q_rows: int, causal_from: int = -1) -> np.ndarray:
    """MLX's softmax over the last axis of a C-contiguous float32 array, in place (the causal
    mask first where causal_from >= 0: row r keeps columns <= causal_from + r % q_rows)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"the host softmax is not available: {_STATE.get('why')}")
    assert x.dtype == np.float32 and x.flags.c_contiguous
    n = x.shape[-1]
    lib.mlxspec_softmax_rows(x.ctypes.data, x.size // n, n, q_rows, causal_from)
    return x


def _eligible(q, k, v, mask, sinks) -> bool:
    if sinks is not None or q.ndim != 4 or k.ndim != 4 or q.shape[2] < 2:
        return False
    if not (q.dtype == k.dtype == v.dtype == mx.float32) or q.shape[1] % k.shape[1]:
        return False
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    return MIN_ELEMENTS <= q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= MAX_ELEMENTS


def exact_sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
    """`mx.fast.scaled_dot_product_attention` on the CPU, its softmax on the host (see above)."""
    if kw or not _eligible(q, k, v, mask, sinks):
        return _ORIGINAL(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
    return _host_sdpa(q, k, v, scale, mask)


def _host_sdpa(q, k, v, scale, mask):
    """MLX's fallback, op for op, with the scores evaluated and softmaxed on the host."""
    B, Hq, L, D = q.shape
    Hk, kL = k.shape[1], k.shape[2]
    rep = Hq // Hk
    qs = mx.array(scale, q.dtype) * q
    if rep > 1:
        qs = qs.reshape(B, Hk, rep, L, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = qs @ mx.swapaxes(k, -1, -2)
    causal = -1
    if isinstance(mask, mx.array):
        m = mask
        if rep > 1 and m.ndim >= 3:
            m = mx.expand_dims(m, -3) if m.shape[-3] == 1 else m.reshape(*m.shape[:-3], Hk, rep, *m.shape[-2:])
        scores = mx.where(m, scores, mx.array(np.finfo(np.float32).min, mx.float32)) if m.dtype == mx.bool_ \
            else scores + m
    elif mask == "causal":
        causal = max(kL - L, 0)
    host = np.array(scores, copy=True)  # evaluates q, k, v and the products; C-contiguous float32
    softmax_rows(host, L, causal)
    out = mx.array(host) @ v
    return out.reshape(B, Hq, L, -1) if rep > 1 else out


def _cases():
    """Shapes and masks a verify meets: (q, k, v, mask) with Lk > L."""
    rng = np.random.default_rng(0)

    def arr(*s):
        return mx.array(rng.standard_normal(s).astype(np.float32))

    cases = []
    for hq, hk, L, kL in ((9, 3, 9, 301), (4, 4, 17, 40), (8, 2, 2, 17), (6, 3, 5, 5)):
        q, k, v = arr(1, hq, L, 64), arr(1, hk, kL, 64), arr(1, hk, kL, 64)
        cases.append((q, k, v, "causal"))
        keep = rng.random((L, kL)) < 0.7
        keep[:, 0] = True
        cases.append((q, k, v, mx.array(keep)))
        cases.append((q, k, v, mx.array(np.where(keep, 0.0, -np.inf).astype(np.float32))))
        cases.append((q, k, v, mx.array(np.broadcast_to(keep, (1, hq, L, kL)).copy())))
    return cases


def check() -> bool:
    """Whether `exact_sdpa` equals `mx.fast.scaled_dot_product_attention` bit for bit in this
    process (MLX's version and this CPU), on every case of `_cases`; the first call decides."""
    if "ok" in _STATE:
        return _STATE["ok"]
    if _lib() is None:
        _STATE["ok"] = False
        return False
    ok = True
    for q, k, v, mask in _cases():
        a = np.array(_ORIGINAL(q, k, v, scale=0.125, mask=mask))
        b = np.array(_host_sdpa(q, k, v, 0.125, mask))
        if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            ok = False
            _STATE["why"] = (f"its softmax differs from this MLX's ({mx.__version__}; "
                             f"q {tuple(q.shape)}, k {tuple(k.shape)}, mask {mask if isinstance(mask, str) else mask.dtype})")
            break
    _STATE["ok"] = ok
    return ok


def usable() -> bool:
    """On: the default device is the CPU, the library built and the check passed."""
    return mx.default_device() == mx.cpu and check()


@contextlib.contextmanager
def installed(rows: int = 2, keys: int = 0):
    """`mx.fast.scaled_dot_product_attention` is `exact_sdpa` inside (where `usable()`), for a
    forward of `rows` query rows over `keys` keys: not for one row under 1,024 keys, which no
    head count takes over the size rule, so a decode step pays no call of ours per layer."""
    if (rows < 2 and keys < 1024) or not usable() or mx.fast.scaled_dot_product_attention is exact_sdpa:
        yield
        return
    mx.fast.scaled_dot_product_attention = exact_sdpa
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = _ORIGINAL


def status() -> str:
    """One line for `mlxspec doctor` / the init line."""
    if usable():
        lanes = int(_STATE["lib"].mlxspec_softmax_lanes())
        return f"host attention softmax: on ({lanes} lanes; equal to MLX's bit for bit)"
    if mx.default_device() != mx.cpu:
        return "host attention softmax: off (not on the CPU)"
    return f"host attention softmax: off ({_STATE.get('why', 'not checked')})"
