#!/usr/bin/env python
"""The confidence scheduler vs full blocks vs autoregressive, shipped DSpark drafter, greedy.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_schedule.py

4 held-out code prompts, 64 tokens; numbers quoted in the README (Results).
"""
import dataclasses, io, time
from mlxspec.targets.load import load_target
from mlxspec.api import SpecConfig, Speculator, shipped_drafter
from mlxspec.evaluate import run_prompts
from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.engine.profile import measure_verify_sps
T, tok = load_target(None)
p = load_prompts()
prompts = [encode_prompt(tok, "code", t) for t in p["code"][:4]]
spec = Speculator.build(SpecConfig(draft=str(shipped_drafter("dspark")), policy="fixed", ngram=False), T, log=io.StringIO())
sps = measure_verify_sps(T, 9)  # (the schedule itself uses the cached profile, `mlxspec.api.profile_for`)
print("verify steps/s by length", {k: round(v, 1) for k, v in sps.items()})
run_prompts(T, tok, None, prompts[:1], 8)  # warm-up
for name, sp in [("AR", None), ("dspark", spec), ("dspark+schedule", dataclasses.replace(spec, schedule=True))]:
    t = time.perf_counter(); st, _ = run_prompts(T, tok, sp, prompts, 64); el = time.perf_counter() - t
    print(name, f"gen tok/s {st.generated / st.gen_time:.1f} tau {st.tau:.2f} acc {st.acceptance_rate:.3f} mean verify len {sum(st.verify_lengths)/len(st.verify_lengths):.2f}")
