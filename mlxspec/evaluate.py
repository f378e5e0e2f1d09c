"""Held-out acceptance and tau of a drafter (temperature 0 unless told otherwise)."""

from __future__ import annotations

import sys

from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.verify import SamplingParams


def run_prompts(target, tokenizer, drafter_factory, prompts: list[list[int]], max_tokens: int = 64,
                sampling: SamplingParams = SamplingParams(), seed: int = 0, **kw) -> tuple[SpecStats, list]:
    """Generate for each prompt; -> (merged stats, outputs)."""
    total = SpecStats()
    outs = []
    for i, ids in enumerate(prompts):
        st = SpecStats()
        d = drafter_factory(target) if drafter_factory else None
        out = []
        for c in generate_steps(target, ids, drafter=d, max_tokens=max_tokens, sampling=sampling, seed=seed + i, eos_ids=tokenizer.eos_token_ids,
                                stats=st, **kw):
            out += c
        outs.append(out)
        _merge(total, st)
    return total, outs


def _merge(t: SpecStats, s: SpecStats):
    t.prompt_tokens += s.prompt_tokens
    t.prompt_time += s.prompt_time
    # SpecStats counts the prefill's token in `generated` (tau and generation_tps subtract it
    # once): the merged stats keep that convention, one prefill token for all runs together.
    t.generated = max(t.generated, 1) + max(s.generated - 1, 0) if (t.generated or s.generated) else 0
    t.target_forwards += s.target_forwards
    t.draft_time += s.draft_time
    t.verify_time += s.verify_time
    t.gen_time += s.gen_time
    t.verify_lengths += s.verify_lengths
    n = max(len(t.drafted_at), len(s.drafted_at))
    t.drafted_at += [0] * (n - len(t.drafted_at))
    t.accepted_at += [0] * (n - len(t.accepted_at))
    for i, (d, a) in enumerate(zip(s.drafted_at, s.accepted_at)):
        t.drafted_at[i] += d
        t.accepted_at[i] += a
    t.drafted += s.drafted
    t.accepted += s.accepted


def merged_tau(st: SpecStats) -> float:
    """= st.tau: `_merge` keeps SpecStats' own convention."""
    return st.tau


def evaluate_drafter(target, tokenizer, drafter_path, n_per_category: int = 8, max_tokens: int = 64,
                     categories=("code", "prose", "chat"), block_size=None, log=sys.stderr) -> dict:
    from mlxspec.api import load_speculator

    spec = load_speculator(str(drafter_path), target, spec_type="auto", block_size=block_size, log=log)
    prompts = load_prompts()
    res = {}
    for cat in categories:
        ids = [encode_prompt(tokenizer, cat, p) for p in prompts[cat][:n_per_category]]
        st, _ = run_prompts(target, tokenizer, spec.drafter_factory, ids, max_tokens)
        res[cat] = {
            "acceptance_rate": st.acceptance_rate,
            "accepted": st.accepted,
            "drafted": st.drafted,
            "tau": merged_tau(st),
            "per_position_acceptance": st.per_position_acceptance,
            "prompts": len(ids),
            "max_tokens": max_tokens,
        }
        print(f"eval {cat}: acceptance {100 * st.acceptance_rate:.1f}% ({st.accepted}/{st.drafted}) "
              f"tau {merged_tau(st):.2f}", file=log)
    return res
