#!/usr/bin/env python
"""Usage: LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_context_kv.py [CTX=4096] [STEPS=64]

Drafting time at a 4k context, old (concatenate every accept) vs new (grown in steps) context
K/V, alternated in one process: begin(ctx rows), then 64 steps of accept(3 rows) + draft(8).
Reports medians per step (this machine's 2 cores are shared, so medians, not means)."""
import time, sys, io, statistics
import mlx.core as mx, numpy as np
from mlxspec.targets.load import load_target
from mlxspec.api import SpecConfig, Speculator
from mlxspec.engine.verify import SamplingParams
from mlxspec.engine.drafting import BlockDrafter


class OldKV(BlockDrafter):  # the pre-fix accept: concatenate the whole context each step
    def reset(self):
        self._old = [None] * len(self.model.layers); self.ctx_len = 0

    @property
    def ctx_kv(self):
        return self._old

    def accept(self, tokens, taps):
        n = taps.shape[1]
        pos = mx.arange(self.ctx_len, self.ctx_len + n)[None]
        ctx = self.model.context(taps.astype(self.head.dtype))
        for i, layer in enumerate(self.model.layers):
            k, v = layer.self_attn.context_kv(ctx, pos)
            if self._old[i] is not None:
                pk, pv = self._old[i]
                k, v = mx.concatenate([pk, k], axis=2), mx.concatenate([pv, v], axis=2)
            self._old[i] = (k, v)
        self.ctx_len += n


target, tok = load_target()
spec = Speculator.build(SpecConfig(draft="mlxspec/weights/smollm2-135m-dspark", ngram=False), target, log=io.StringIO())
new = spec.make_drafter(target)
old = OldKV(new.model, target)
H = target.info.hidden_size; T = len(new.taps)
rng = np.random.default_rng(0)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 64
taps = mx.array(rng.standard_normal((1, ctx, T * H)).astype(np.float32))
step_taps = [mx.array(rng.standard_normal((1, 3, T * H)).astype(np.float32)) for _ in range(steps)]
mx.eval(taps, step_taps)
sp = SamplingParams()
times = {"old": {"accept": [], "draft": []}, "new": {"accept": [], "draft": []}}
outs = {"old": [], "new": []}
for name, d in (("old", old), ("new", new)):
    d.begin(list(range(ctx)), taps); mx.eval([x for kv in d.ctx_kv for x in kv]); d.draft(5, 8, sp, rng)
for st in step_taps:
    for name, d in (("old", old), ("new", new)):
        t0 = time.perf_counter(); d.accept([1, 2, 3], st); mx.eval([x for kv in d.ctx_kv for x in kv])
        t1 = time.perf_counter(); out = d.draft(7, 8, sp, rng); t2 = time.perf_counter()
        times[name]["accept"].append(t1 - t0); times[name]["draft"].append(t2 - t1); outs[name].append(out.tokens)
for name in ("old", "new"):
    a = statistics.median(times[name]["accept"]) * 1000; dr = statistics.median(times[name]["draft"]) * 1000
    print(f"{name}: ctx {ctx}+{3*steps}: accept {a:.2f} ms, draft {dr:.2f} ms, accept+draft {a+dr:.2f} ms (median per step)")
print("identical drafts:", outs["old"] == outs["new"])
