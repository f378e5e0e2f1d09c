"""Two pieces of the target's forward on a CPU computed in C, with the same numbers as MLX's
bit for bit, an order of magnitude faster: the attention softmax and the SwiGLU activation.

The MLX wheel for x86-64 runs their exp one element at a time (~13 ns an element in the softmax,
~27 in mlx-lm's compiled `swiglu`, on the 2-core Xeon this was measured on), so they are what
grows with the rows of a verify besides the GEMM: in SmolLM2-135M at a context of 180, 9 rows
spend ~8 ms in the softmax and ~9 in the SwiGLU, 17 rows ~20 and ~21 (docs/cli.md).

- Attention: on a CPU MLX computes `mx.fast.scaled_dot_product_attention` by its fallback:
  q * scale, q @ k^T, the mask, a softmax, @ v. `exact_sdpa` computes the same, with the softmax
  (and the causal mask) by `mlxspec/cpu/mlx_math.c`, which reproduces MLX's softmax and exp
  element for element. The products stay the ones MLX's matmul computes (the small GEMM's or
  OpenBLAS's).
- SwiGLU: `exact_swiglu` computes silu(g) * x there, with MLX's Sigmoid and exp, rounded as the
  compiled kernel rounds.

Where `mlxspec.cpu_ops` builds (the default on x86-64 Linux), both run as MLX primitives inside
the graph, at every size: the attention with a causal mask or none as one op, other masks as
MLX's ops around the softmax primitive. Otherwise the C runs between two evaluations of the graph
(a cut that costs ~100-200 us a layer here), only from the sizes below.

So the logits are the ones mlx-lm's forward gives, bit for bit, which `check()` verifies in each
process before the first use (against `mx.fast` and mlx-lm's `swiglu` themselves: GQA and MHA,
the causal mask, boolean and additive masks, gates of every sign and size) and
tests/test_host_math.py checks on real forwards. Anything the check does not cover (another
dtype, attention sinks, a GPU) goes to MLX unchanged.

`Target.__call__` installs both for the duration of a forward (`installed()`), never around
`forward_hidden` (training: no host round trip inside a traced function). MLXSPEC_HOST_MATH=0
turns them off; `status()` says whether they are on and why not.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu

from mlxspec import cpu_ops

SOURCE = Path(__file__).resolve().parents[1] / "cpu" / "mlx_math.c"
# scores per call (heads x query rows x keys) from which the host softmax is used, and SwiGLU
# elements per call from which the host computes it: below, the evaluation each waits for (a
# layer's graph cut in two, ~100-200 us on this VM) costs about what it saves. SmolLM2 at context
# 180, OpenBLAS's threads fixed, MLX / host softmax / both alternating forward by forward, medians
# of 20 (ms): 9 rows 60.2 / 66.6 / 64.4, 13 rows 78.6 / 78.8 / 67.4, 17 rows 95.9 / 82.4 / 73.9
# (identical code, 7 rows, read 52-60: the noise); at context 1,000 a 3-row verify's 27,000
# scores already save ~7 ms (scripts/host_math_rows.py, docs/cli.md).
MIN_ELEMENTS = 20_000
MAX_ELEMENTS = 1 << 24  # above, MLX keeps them (a host copy of 64 MB and one back)
SWIGLU_MIN_ELEMENTS = 18_000  # SmolLM2: 12 rows and more (1,536 a row)
_STATE: dict = {}  # "lib", "ok": the check passed, "why": why it is not used
_ORIGINAL = mx.fast.scaled_dot_product_attention
_SWIGLU = swiglu  # mlx-lm's compiled one, which model modules import by name


def _lib():
    if "lib" in _STATE or "why" in _STATE:
        return _STATE.get("lib")
    from mlxspec import cpu_gemm, device

    if not device.host_math_enabled():
        _STATE["why"] = f"{device.HOST_MATH_ENV}=0"
        return None
    path = cpu_gemm.build(source=SOURCE, flags=("-ffp-contract=off",), libs=("-lm",), state=_STATE)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.mlxspec_softmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long]
    lib.mlxspec_softmax_rows.restype = None
    lib.mlxspec_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.mlxspec_swiglu.restype = None
    _STATE["lib"] = lib
    return lib


def _ops():
    """mlxspec's MLX primitives (`mlxspec.cpu_ops`: the same C inside MLX's graph, no evaluation
    to wait for), or None: then the host computes between two evaluations."""
    return None if _lib() is None else cpu_ops.module()


def in_graph() -> bool:
    """Whether the host math runs as MLX primitives (any size pays: no graph cut)."""
    return _ops() is not None


def softmax_rows(x: np.ndarray, q_rows: int, causal_from: int = -1) -> np.ndarray:
    """MLX's softmax over the last axis of a C-contiguous float32 array, in place (the causal
    mask first where causal_from >= 0: row r keeps columns <= causal_from + r % q_rows)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"the host math is not available: {_STATE.get('why')}")
    assert x.dtype == np.float32 and x.flags.c_contiguous
    n = x.shape[-1]
    lib.mlxspec_softmax_rows(x.ctypes.data, x.size // n, n, q_rows, causal_from)
    return x


def _eligible(q, k, v, mask, sinks) -> bool:
    if sinks is not None or q.ndim != 4 or k.ndim != 4 or (q.shape[2] < 2 and not in_graph()):
        return False
    if not (q.dtype == k.dtype == v.dtype == mx.float32) or q.shape[1] % k.shape[1]:
        return False
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    return (0 if in_graph() else MIN_ELEMENTS) <= q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= MAX_ELEMENTS


def exact_sdpa(q, k, v, *, scale, mask=None, sinks=None, **kw):
    """`mx.fast.scaled_dot_product_attention` on the CPU, its softmax on the host (see above)."""
    if kw or not _eligible(q, k, v, mask, sinks):
        return _ORIGINAL(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)
    return _host_sdpa(q, k, v, scale, mask)


def _host_sdpa(q, k, v, scale, mask):
    """MLX's fallback with the softmax in C: one primitive (causal or no mask), or MLX's ops around
    the softmax primitive, or the scores evaluated and softmaxed between two evaluations."""
    B, Hq, L, D = q.shape
    Hk, kL = k.shape[1], k.shape[2]
    rep = Hq // Hk
    ops = _ops()
    if ops is not None and (mask is None or isinstance(mask, str)):  # the whole fallback as one op
        return ops.host_attention(q, k, v, float(scale), max(kL - L, 0) if mask == "causal" else -1)
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
    if ops is not None:  # in MLX's graph, on its CPU stream
        out = ops.host_softmax(scores, L, causal) @ v
    else:
        host = np.array(scores, copy=True)  # evaluates q, k, v and the products; C-contiguous float32
        softmax_rows(host, L, causal)
        out = mx.array(host) @ v
    return out.reshape(B, Hq, L, -1) if rep > 1 else out


def exact_swiglu(gate, x):
    """mlx-lm's `swiglu(gate, x)` = silu(gate) * x in C: always as a primitive, from
    SWIGLU_MIN_ELEMENTS between evaluations."""
    if not (gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape
            and (in_graph() or gate.size >= SWIGLU_MIN_ELEMENTS)):
        return _SWIGLU(gate, x)
    return _host_swiglu(gate, x)


def _host_swiglu(gate, x):
    ops = _ops()
    if ops is not None:
        return ops.host_swiglu(gate, x)
    mx.eval(gate, x)
    g, u = np.array(gate, copy=True), np.array(x, copy=True)
    out = np.empty_like(g)
    _lib().mlxspec_swiglu(g.ctypes.data, u.ctypes.data, out.ctypes.data, g.size)
    return mx.array(out)


def _cases():
    """Shapes and masks a verify meets: (q, k, v, mask) with Lk > L."""
    rng = np.random.default_rng(0)

    def arr(*s):
        return mx.array(rng.standard_normal(s).astype(np.float32))

    cases = []
    for hq, hk, L, kL in ((9, 3, 9, 301), (4, 4, 17, 40), (8, 2, 2, 17), (6, 3, 5, 5), (9, 3, 1, 180)):
        q, k, v = arr(1, hq, L, 64), arr(1, hk, kL, 64), arr(1, hk, kL, 64)
        cases.append((q, k, v, "causal"))
        keep = rng.random((L, kL)) < 0.7
        keep[:, 0] = True
        cases.append((q, k, v, mx.array(keep)))
        cases.append((q, k, v, mx.array(np.where(keep, 0.0, -np.inf).astype(np.float32))))
        cases.append((q, k, v, mx.array(np.broadcast_to(keep, (1, hq, L, kL)).copy())))
        cases.append((q, k, v, None))
        kb, vb = arr(1, hk, kL + 7, 64), arr(1, hk, kL + 7, 64)  # a cache's slices: rows at their stride
        cases.append((q, kb[:, :, :kL], vb[:, :, :kL], "causal"))
    return cases


def check() -> bool:
    """Whether the host attention equals `mx.fast.scaled_dot_product_attention` on every case of
    `_cases`, and the host SwiGLU equals mlx-lm's `swiglu`, bit for bit in this process (MLX's
    version and this CPU); the first call decides."""
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
    if ok:
        rng = np.random.default_rng(1)
        for n, scale in ((1536 * 9, 3.0), (4097, 40.0), (17, 0.01)):
            g = rng.standard_normal((1, n)).astype(np.float32) * scale
            g[0, :4] = (0.0, -0.0, 95.0, -95.0)
            g, x = mx.array(g), mx.array(rng.standard_normal((1, n)).astype(np.float32))
            if not np.array_equal(np.array(_SWIGLU(g, x)).view(np.uint32), np.array(_host_swiglu(g, x)).view(np.uint32)):
                ok = False
                _STATE["why"] = f"its SwiGLU differs from this mlx-lm's ({mx.__version__}; {n} elements)"
                break
    _STATE["ok"] = ok
    return ok


def usable() -> bool:
    """On: the default device is the CPU, the library built and the check passed."""
    return mx.default_device() == mx.cpu and check()


_USERS: dict = {}  # the mlx_lm.models modules that call `swiglu` by name, by len(sys.modules) when listed


def _swiglu_users() -> list:
    """The loaded mlx-lm model modules whose global `swiglu` is mlx-lm's (each imports it by name)."""
    import sys

    if _USERS.get("n") != len(sys.modules):
        _USERS["n"] = len(sys.modules)
        _USERS["mods"] = [m for name, m in list(sys.modules.items())
                          if name.startswith("mlx_lm.models.") and getattr(m, "swiglu", None) is _SWIGLU]
    return _USERS["mods"]


@contextlib.contextmanager
def installed(rows: int = 2, keys: int = 0):
    """Inside (where `usable()`), `mx.fast.scaled_dot_product_attention` is `exact_sdpa` and the
    mlx-lm model modules' `swiglu` is `exact_swiglu`, for a forward of `rows` query rows over
    `keys` keys. As primitives, always; between evaluations, not for one row under 1,024 keys,
    so a short decode step pays no call of ours per layer (a one-row step over more keys is
    installed but only an MLP as wide as SWIGLU_MIN_ELEMENTS takes over in it: there the softmax
    needs 2+ rows, `_eligible`)."""
    if (rows < 2 and keys < 1024 and not in_graph()) or not usable() \
            or mx.fast.scaled_dot_product_attention is exact_sdpa:
        yield
        return
    mods = _swiglu_users()
    mx.fast.scaled_dot_product_attention = exact_sdpa
    for m in mods:
        m.swiglu = exact_swiglu
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = _ORIGINAL
        for m in mods:
            m.swiglu = _SWIGLU


def status() -> str:
    """One line for `mlxspec doctor` / the init line."""
    if usable():
        lanes = int(_STATE["lib"].mlxspec_math_lanes())
        how = "MLX primitives" if in_graph() else f"between evaluations: {cpu_ops.why()}"
        return f"host softmax and SwiGLU: on ({lanes} lanes, {how}; equal to MLX's bit for bit)"
    if mx.default_device() != mx.cpu:
        return "host softmax and SwiGLU: off (not on the CPU)"
    return f"host softmax and SwiGLU: off ({_STATE.get('why', 'not checked')})"
