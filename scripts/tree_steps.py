#!/usr/bin/env python
"""Where a tree step's time goes against a chain step's: EAGLE-3 alone (no lookup), the adaptive
policy, chains and `--tree auto` alternating twice on the first held-out code prompt, 96 tokens,
T=0 and T=1. Per configuration: tok/s, tau, verify forwards, mean verify rows, drafting and
verify milliseconds per step, and each source's [drafted, accepted].

    LD_PRELOAD=$(python -m mlxspec.blas) MLXSPEC_BLAS_THREADS=1 python scripts/tree_steps.py
"""
import io, time, sys
import numpy as np
from mlxspec import api
from mlxspec.engine.loop import SpecStats
from mlxspec.engine.verify import SamplingParams
from mlxspec.prompts import load_prompts, encode_prompt
target, tok, _ = api.load(None, draft=None)
spec_c = api.Speculator.build(api.SpecConfig(draft="mlxspec/weights/smollm2-135m-eagle3", ngram=False), target, log=io.StringIO())
spec_t = api.Speculator.build(api.SpecConfig(draft="mlxspec/weights/smollm2-135m-eagle3", ngram=False, tree="auto"), target, log=io.StringIO())
p = load_prompts()
ids = encode_prompt(tok, "code", p["code"][0])
for temp in (0.0, 1.0):
    for name, sp in (("chain", spec_c), ("tree", spec_t), ("chain", spec_c), ("tree", spec_t)):
        st = SpecStats()
        t0 = time.perf_counter()
        n = sum(len(x) for x in sp.session(target, ids, max_tokens=96, sampling=SamplingParams(temperature=temp), stats=st))
        dt = time.perf_counter() - t0
        steps = st.target_forwards
        rows = np.mean(st.verify_lengths) if st.verify_lengths else 1
        print(f"T={temp} {name:5s} tok/s {n/dt:5.1f} tau {st.tau:.2f} fwd {steps} rows {rows:.2f} draft {1e3*st.draft_time/max(steps,1):.1f} ms/step verify {1e3*st.verify_time/max(steps,1):.1f} ms/step src {st.by_source}", flush=True)
