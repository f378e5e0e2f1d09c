#!/usr/bin/env python3
"""Benchmark the custom kernels of mlxspec on a GPU backend against MLX built-ins and the
memory-bandwidth floor.

    python scripts/bench_kernels.py --backend metal|cuda [--quick] [--only lowbit|markov] [--out results.json]

(scripts/bench_metal.py and scripts/bench_cuda.py are this with the backend chosen.)
Prints a markdown table; exits 2 with a message when MLX has no such backend here.

Each kernel is timed against MLX's built-in path and against the memory-bandwidth floor:
  - low-bit matmul vs mx.quantized_matmul on the lossless repack (mlxspec.gguf.quants.repack_mlx),
  - Markov block drafting vs the same chain in MLX ops (markov_chain_reference),
  - floor = bytes that must move / measured copy bandwidth (an elementwise copy of 1 GiB).
Shapes are Qwen3-8B's projection layers (Bonsai-8B has the same dimensions): 4096x4096,
4096->12288 and 12288->4096, for M = 1, 4, 8, 16, 32 activation rows.
See mlxspec/kernels/README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from mlxspec.gguf import quants as L  # noqa: E402
from mlxspec.kernels import lowbit as klowbit  # noqa: E402
from mlxspec.kernels import markov as kmarkov  # noqa: E402
from mlxspec.kernels._launch import runner  # noqa: E402

# (name, N = output features, K = input features)
SHAPES = [("q/o 4096x4096", 4096, 4096), ("up/gate 4096->12288", 12288, 4096), ("down 12288->4096", 4096, 12288)]
MS = [1, 4, 8, 16, 32]
TYPES = [L.Q1_0, L.Q2_0, L.PQ2_0, L.PTQ1_0]
MARKOV = [(4, 151936, 256), (7, 151936, 256), (16, 151936, 256)]  # (B, V, r), Qwen3 vocabulary


def backend_available(language: str) -> bool:
    if language == "metal":
        return mx.metal.is_available()
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


def random_blocks(type_id: int, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed raw blocks [N, row_bytes]: small positive scales, ternary codes
    for the 2-bit types (so the repack keeps float16 scales, as for real checkpoints)."""
    qk, nb = L.block_layout(type_id)
    nblk = K // qk
    d = rng.uniform(0.005, 0.05, (N, nblk)).astype("<f2").view(np.uint8).reshape(N, nblk, 2)
    out = np.empty((N, nblk, nb), dtype=np.uint8)
    if type_id == L.Q1_0:
        out[..., 2:] = rng.integers(0, 256, (N, nblk, 16), dtype=np.uint8)
        out[..., 0:2] = d
    elif type_id in (L.Q2_0, L.PQ2_0):
        c = rng.integers(0, 3, (N, nblk, qk // 4, 4), dtype=np.uint8)
        out[..., 2:] = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
        out[..., 0:2] = d
    else:
        v5 = rng.integers(0, 243, (N, nblk, 24), dtype=np.uint32)
        v4 = rng.integers(0, 81, (N, nblk, 2), dtype=np.uint32) * 3
        out[..., 0:24] = (v5 * 256 + 242) // 243
        out[..., 24:26] = (v4 * 256 + 242) // 243
        out[..., 26:28] = d
    return out.reshape(N, -1)


def timeit(fn, reps: int, iters: int) -> float:
    """Median seconds per call; `reps` calls are queued per evaluation to hide launch latency."""
    mx.eval(fn())
    mx.synchronize()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of an elementwise copy (read + write counted)."""
    x = mx.zeros((nbytes // 4,), dtype=mx.uint32)
    mx.eval(x)
    t = timeit(lambda x=x: x + 1, reps=2, iters=5)
    del x
    return 2 * nbytes / t


def _try_time(fn, reps: int, iters: int):
    """(seconds per call, None) or (None, error text) when the path fails on this backend."""
    try:
        return timeit(fn, reps, iters), None
    except Exception as e:  # e.g. a bit width MLX's built-in path does not support here
        return None, f"{type(e).__name__}: {e}"[:200]


def _rel_err(y: mx.array, ref: mx.array) -> float:
    y, ref = y.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(y - ref).max() / (mx.abs(ref).max() + 1e-30))


def bench_lowbit(run, bw: float, types, shapes, ms, iters: int, rng, reps: int | None = None) -> list[dict]:
    """`run` launches kernels (mlxspec.kernels._launch.runner(language)); `reps` calls are
    queued per timed evaluation (default 20 for M <= 8, else 10). The error column compares
    our output with x @ dequantized(W)^T in float32."""
    rows = []
    for type_id in types:
        for shape_name, N, K in shapes:
            raw_np = random_blocks(type_id, N, K, rng)
            wq, s, b, g, bits = L.repack_mlx(type_id, raw_np, (N, K))
            raw = mx.array(raw_np)
            wq, s, b = mx.array(wq), mx.array(s).astype(mx.float16), mx.array(b).astype(mx.float16)
            dense = klowbit.dequantize_mlx(raw, type_id, (N, K))
            mx.eval(raw, wq, s, b, dense)
            for M in ms:
                x = mx.array(rng.standard_normal((M, K)).astype(np.float16))
                ours = lambda: klowbit.lowbit_matmul_kernel(x, raw, type_id, (N, K), run)  # noqa: E731
                mlx_q = lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=g, bits=bits)  # noqa: E731
                n = reps or (20 if M <= 8 else 10)
                t_ours, ours_fail = _try_time(ours, n, iters)
                t_mlx, mlx_fail = _try_time(mlx_q, n, iters)
                err = _rel_err(ours(), x.astype(mx.float32) @ dense.T) if t_ours else None
                moved = raw.nbytes + x.nbytes + M * N * 2
                rows.append(dict(kernel="lowbit_matmul", type=L.BLOCKS[type_id][2], shape=shape_name, N=N, K=K,
                                 M=M, ours_us=t_ours and t_ours * 1e6, mlx_us=t_mlx and t_mlx * 1e6,
                                 floor_us=moved / bw * 1e6, bytes=moved,
                                 ours_gbps=t_ours and moved / t_ours / 1e9, max_rel_err=err,
                                 mlx_path=f"quantized_matmul bits={bits} group={g}",
                                 ours_error=ours_fail, mlx_error=mlx_fail))
                print(_row_md(rows[-1]), flush=True)
    return rows


def bench_markov(run, bw: float, cases, iters: int, rng, reps: int = 3) -> list[dict]:
    rows = []
    for B, V, r in cases:
        base = mx.array((rng.standard_normal((B, V)) * 2).astype(np.float16))
        w1 = mx.array((rng.standard_normal((V, r)) * 0.05).astype(np.float32))
        w2 = mx.array((rng.standard_normal((V, r)) * 0.05).astype(np.float32))
        mx.eval(base, w1, w2)
        for T in (0.0, 1.0):
            key = mx.random.key(0) if T > 0 else None
            ours = lambda: kmarkov.markov_chain_kernel(base, w1, w2, 3, T, key, run)  # noqa: E731
            ref = lambda: kmarkov.markov_chain_reference(base, w1, w2, 3, T, key)  # noqa: E731
            t_ours, ours_fail = _try_time(ours, reps, iters)
            t_mlx, mlx_fail = _try_time(ref, reps, iters)
            same, err = None, None
            if t_ours and t_mlx:
                (t1, p1), (t2, p2) = ours(), ref()
                same, err = t1.tolist() == t2.tolist(), _rel_err(p1, p2)
            moved = B * (w2.nbytes + V * base.itemsize)
            rows.append(dict(kernel="markov_chain", type=f"T={T}", shape=f"B={B} V={V} r={r}", N=V, K=r, M=B,
                             ours_us=t_ours and t_ours * 1e6, mlx_us=t_mlx and t_mlx * 1e6,
                             floor_us=moved / bw * 1e6, bytes=moved, ours_gbps=t_ours and moved / t_ours / 1e9,
                             max_rel_err=err, tokens_equal=same, mlx_path="MLX ops (markov_chain_reference)",
                             ours_error=ours_fail, mlx_error=mlx_fail))
            print(_row_md(rows[-1]), flush=True)
    return rows


HEADER = ("| kernel | type | shape | M/B | ours us | MLX us | floor us | ours GB/s | ours/floor | vs MLX | err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def _row_md(r: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    ratio = lambda a, b: None if a is None or b is None else a / b  # noqa: E731
    text = (f"| {r['kernel']} | {r['type']} | {r['shape']} | {r['M']} | {num(r['ours_us'], '.1f')} | "
            f"{num(r['mlx_us'], '.1f')} | {r['floor_us']:.1f} | {num(r['ours_gbps'], '.0f')} | "
            f"{num(ratio(r['ours_us'], r['floor_us']), '.2f')}x | {num(ratio(r['mlx_us'], r['ours_us']), '.2f')}x | "
            f"{num(r['max_rel_err'], '.1e')} |")
    for side in ("ours_error", "mlx_error"):
        if r.get(side):
            text += f" {side}: {r[side]}"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Benchmark mlxspec kernels against MLX built-ins.")
    ap.add_argument("--backend", choices=["metal", "cuda"], required=True)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="one shape, M in (1, 16), B = 7 only")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", choices=["lowbit", "markov"], help="run one kernel only")
    args = ap.parse_args(argv)
    language = args.backend
    if not backend_available(language):
        need = "an Apple GPU (mx.metal.is_available())" if language == "metal" else \
            "MLX built with CUDA and a visible GPU (mx.cuda.is_available())"
        print(f"bench_{language}: needs {need}, which is not available here. Nothing was measured.",
              file=sys.stderr)
        return 2
    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(0)
    shapes, ms, markov = (SHAPES[:1], [1, 16], MARKOV[1:2]) if args.quick else (SHAPES, MS, MARKOV)
    bw = copy_bandwidth()
    print(f"# mlxspec kernels on {language}: mlx {mx.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    print(HEADER)
    rows = []
    if args.only in (None, "lowbit"):
        rows += bench_lowbit(runner(language), bw, TYPES, shapes, ms, args.iters, rng)
    if args.only in (None, "markov"):
        rows += bench_markov(runner(language), bw, markov, args.iters, rng)
    if args.out:
        info = dict(backend=language, mlx=mx.__version__, platform=platform.platform(),
                    device=str(mx.default_device()), copy_gbps=bw / 1e9)
        with open(args.out, "w") as f:
            json.dump(dict(info=info, results=rows), f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
