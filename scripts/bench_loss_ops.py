#!/usr/bin/env python
"""Where an EAGLE-3 training step's time goes: the ops of its loss over the draft vocabulary, alone.

    LD_PRELOAD=$(python -m mlxspec.blas) MLXSPEC_BLAS_THREADS=1 python scripts/bench_loss_ops.py

Shapes are the shipped recipe's: 4 windows x 255 positions (step 0 of the unrolled chain), a
576-wide hidden state, 8192 draft ids; the unrolled steps 1-6 run on a quarter of the positions.
Median process CPU time of 5 runs after one warm-up, per op (random data; numbers only).
Measured 2026-12-07 (docs/training.md, "Where a step's time goes").
"""
import time

import numpy as np
import mlxspec  # noqa
import mlx.core as mx
def t(name, f, *a):
    mx.eval(f(*a)); ts=[]
    for _ in range(5):
        t0=time.process_time(); mx.eval(f(*a)); ts.append(time.process_time()-t0)
    print(f"{name:40s} {np.median(ts)*1000:8.1f} ms")
h = mx.random.normal((4,255,576)); W = mx.random.normal((8192,576))*0.02
hs = mx.random.normal((4,64,576))
t("head matmul 1020 rows", lambda: h @ W.T)
t("head matmul 256 rows", lambda: hs @ W.T)
z = h @ W.T; mx.eval(z)
t("logsumexp [4,255,8192]", lambda: mx.logsumexp(z, axis=-1, keepdims=True))
t("z - lse", lambda: z - mx.logsumexp(z, axis=-1, keepdims=True))
t("argmax", lambda: mx.argmax(z, axis=-1))
ids = mx.random.randint(0, 8192, (4,255,8))
t("take_along_axis", lambda: mx.take_along_axis(z, ids, axis=-1))

def lossz(W): 
    z = h @ W.T; lp = z - mx.logsumexp(z, axis=-1, keepdims=True); return mx.take_along_axis(lp, ids, axis=-1).sum()
g = mx.grad(lossz)
t("grad head+lse+gather (1020 rows)", g, W)
x = mx.random.normal((4,255,1728)); Wf = mx.random.normal((576,1728))
t("fc 1728->576", lambda: x @ Wf.T)
q = mx.random.normal((4,9,255,64)); k = mx.random.normal((4,9,255,64))
t("scores", lambda: mx.softmax(q @ k.transpose(0,1,3,2), axis=-1, precise=True))
def lse_manual(z):
    m = mx.stop_gradient(z.max(-1, keepdims=True)); return m + mx.log(mx.exp(z - m).sum(-1, keepdims=True))
t("lse manual", lse_manual, z)
t("max", lambda z: z.max(-1), z)
t("exp", lambda z: mx.exp(z), z)
t("sum", lambda z: z.sum(-1), z)
t("sub", lambda z: z - 1.0, z)
t("softmax", lambda z: mx.softmax(z, axis=-1), z)
t("softmax precise", lambda z: mx.softmax(z, axis=-1, precise=True), z)
cl = mx.compile(lse_manual)
t("lse manual compiled", cl, z)
def gl(W):
    z = h @ W.T; lp = z - lse_manual(z); return mx.take_along_axis(lp, ids, axis=-1).sum()
t("grad with manual lse", mx.grad(gl), W)
t("grad with manual lse, compiled", mx.compile(mx.grad(gl)), W)
def gl2(W):
    z = h @ W.T; lp = z - mx.compile(lse_manual)(z); return mx.take_along_axis(lp, ids, axis=-1).sum()
t("grad, lse compiled inside", mx.grad(gl2), W)
a = mx.grad(gl)(W); b_ = mx.compile(mx.grad(gl))(W); r = mx.grad(lossz)(W)
print("max abs diff compiled vs ref", mx.abs(b_ - r).max().item(), "scale", mx.abs(r).max().item())
