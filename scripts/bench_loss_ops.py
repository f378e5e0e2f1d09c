#!/usr/bin/env python
"""Where an EAGLE-3 training step's time goes: the ops of its loss over the draft vocabulary, alone.

    LD_PRELOAD=$(python -m mlxspec.blas) MLXSPEC_BLAS_THREADS=1 python scripts/bench_loss_ops.py

Shapes are the shipped recipe's step 0 of the unrolled chain: 4 windows x 255 positions, a
576-wide hidden state, 8192 draft ids, the target's top-8 as labels (steps 1-6 run the same ops
on a quarter of the positions). Each line is the median process CPU time of 5 runs after one
warm-up, on random data. Measured 2026-12-07: docs/training.md, "Threads, and where a step's
time goes".
"""

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per op (1-100)")
    a = ap.parse_args()
    if not 1 <= a.repeats <= 100:
        ap.error(f"--repeats {a.repeats}: pass 1-100")

    import numpy as np

    import mlxspec  # noqa: F401 - first: OpenBLAS before MLX
    import mlx.core as mx

    def timed(name, f, *args):
        mx.eval(f(*args))
        ts = []
        for _ in range(a.repeats):
            t0 = time.process_time()
            mx.eval(f(*args))
            ts.append(time.process_time() - t0)
        print(f"{name:40s} {np.median(ts) * 1000:8.1f} ms")

    def lse_parts(z):  # logsumexp as max / exp / sum: elementwise ops mx.compile can fuse
        m = mx.stop_gradient(z.max(-1, keepdims=True))
        return m + mx.log(mx.exp(z - m).sum(-1, keepdims=True))

    def lse_op(z):
        return mx.logsumexp(z, axis=-1, keepdims=True)

    h = mx.random.normal((4, 255, 576))
    W = mx.random.normal((8192, 576)) * 0.02
    ids = mx.random.randint(0, 8192, (4, 255, 8))
    z = h @ W.T
    mx.eval(z)

    def loss(W, lse):  # the soft CE's shape: head, log-softmax, the labels' log-probabilities
        z = h @ W.T
        return mx.take_along_axis(z - lse(z), ids, axis=-1).sum()

    timed("head matmul, 1020 rows", lambda: h @ W.T)
    timed("head matmul, 256 rows", lambda: h[:, :64] @ W.T)
    timed("logsumexp [4, 255, 8192]", lse_op, z)
    timed("logsumexp as max/exp/sum", lse_parts, z)
    timed("logsumexp as max/exp/sum, compiled", mx.compile(lse_parts), z)
    timed("exp", mx.exp, z)
    timed("max", lambda z: z.max(-1), z)
    timed("softmax", lambda z: mx.softmax(z, axis=-1, precise=True), z)
    timed("argmax", lambda z: mx.argmax(z, axis=-1), z)
    grads = {"logsumexp": mx.grad(lambda W: loss(W, lse_op)),
             "max/exp/sum": mx.grad(lambda W: loss(W, lse_parts))}
    grads["max/exp/sum, compiled"] = mx.compile(grads["max/exp/sum"])
    for name, g in grads.items():
        timed(f"grad head+lse+gather, {name}", g, W)
    ref, fused = grads["logsumexp"](W), grads["max/exp/sum, compiled"](W)
    print(f"max |compiled - logsumexp| of the gradient: {mx.abs(fused - ref).max().item():.3g} "
          f"(largest entry {mx.abs(ref).max().item():.3g})")


if __name__ == "__main__":
    main()
