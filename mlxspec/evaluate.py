"""Held-out acceptance and tau of a drafter (temperature 0 unless told otherwise)."""

from __future__ import annotations

import sys

from mlxspec.api import SpecConfig, Speculator
from mlxspec.engine.loop import SpecStats
from mlxspec.engine.verify import SamplingParams
from mlxspec.prompts import encode_prompt, load_prompts


def run_prompts(target, tokenizer, speculator, prompts: list[list[int]], max_tokens: int = 64,
                sampling: SamplingParams = SamplingParams(), seed: int = 0) -> tuple[SpecStats, list]:
    """Generate for each prompt through `Speculator.session`; -> (merged stats, outputs).

    speculator: a `Speculator`, or a drafter factory (callable(target) -> Drafter, or None
    for autoregressive) run at its full block under the fixed policy."""
    if not isinstance(speculator, Speculator):
        speculator = Speculator(drafter_factory=speculator, policy="fixed")
    total = SpecStats()
    outs = []
    for i, ids in enumerate(prompts):
        st = SpecStats()
        out = []
        for c in speculator.session(target, ids, max_tokens=max_tokens, sampling=sampling, seed=seed + i,
                                    eos_ids=tokenizer.eos_token_ids, stats=st):
            out += c
        outs.append(out)
        total.merge(st)
    return total, outs


def evaluate_drafter(target, tokenizer, drafter_path, n_per_category: int = 8, max_tokens: int = 64,
                     categories=("code", "prose", "chat"), block_size=None, log=sys.stderr) -> dict:
    """The drafter alone (no prompt lookup) at its full block: the fixed policy."""
    cfg = SpecConfig(draft=str(drafter_path), block_size=block_size, policy="fixed", ngram=False)
    spec = Speculator.build(cfg, target, log=log)
    prompts = load_prompts()
    res = {}
    for cat in categories:
        ids = [encode_prompt(tokenizer, cat, p) for p in prompts[cat][:n_per_category]]
        st, _ = run_prompts(target, tokenizer, spec, ids, max_tokens)
        res[cat] = {
            "acceptance_rate": st.acceptance_rate,
            "accepted": st.accepted,
            "drafted": st.drafted,
            "tau": st.tau,
            "per_position_acceptance": st.per_position_acceptance,
            "prompts": len(ids),
            "max_tokens": max_tokens,
        }
        print(f"eval {cat}: acceptance {100 * st.acceptance_rate:.1f}% ({st.accepted}/{st.drafted}) "
              f"tau {st.tau:.2f}", file=log)
    return res
