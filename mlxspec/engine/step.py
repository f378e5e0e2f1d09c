"""One speculative step's decisions, shared by the loop (`mlxspec.engine.loop.generate_steps`)
and the batched step (`mlxspec.engine.batch.SpecBatch`):

- `propose` (steps 1-2): the policy plans from history (an autoregressive step, prompt lookup's
  free proposal, or the drafter), the chosen source drafts, the policy truncates;
- `record` (after verifying): the step's counts, by source, and what the policy observes.

What a drafter can propose is what it declares (`mlxspec.engine.drafting.proposals`), never
its type, so a wrapper that forwards the declarations is driven like the drafter it wraps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mlxspec.engine.drafting import DraftOutput, catch_up, proposals
from mlxspec.engine.ngram import lookup_output
from mlxspec.engine.policy import Kind, LengthPolicy, Plan, Source
from mlxspec.engine.verify import SamplingParams


@dataclass
class Proposal:
    drafts: list  # the drafts to verify (after truncation)
    d: DraftOutput | None  # what the source drafted (its probs for sampled verification)
    source: Source
    conf: list | None  # the drafts' confidences (before truncation), if the drafter has them
    t_drafted: float  # seconds spent drafting (before truncation; earlier steps' backlog excluded)


def propose(drafter, policy: LengthPolicy, anchor: int, n: int, sampling: SamplingParams, rng,
            vocab_size: int) -> Proposal:
    """Up to n drafts after `anchor`, as the policy chooses them (n = 0: an autoregressive step)."""
    td = time.perf_counter()
    plan, lookup = Plan(Source.NONE, 0), []
    if n > 0:
        model_drafts, has_lookup = proposals(drafter)
        lookup, match = drafter.lookup(anchor, n) if has_lookup else ([], 0)
        plan = policy.plan(n, len(lookup), match, model_drafts)
    d, owed = None, 0.0
    if plan.source.is_lookup:
        d = lookup_output(lookup[: plan.n], sampling, vocab_size)
    elif plan.source.kind is Kind.DRAFTER and plan.n > 0:
        owed = catch_up(drafter)  # earlier steps' deferred work: not this draft's cost
        keep = getattr(policy, "keep_drafting", None) if getattr(policy, "stops_early", False) else None
        d = drafter.draft(anchor, plan.n, sampling, rng) if keep is None else \
            drafter.draft(anchor, plan.n, sampling, rng, more=lambda conf: keep(conf, plan.n))
    drafts = list(d.tokens[: plan.n]) if d else []
    t_drafted = time.perf_counter() - td - owed
    conf = d.confidence[: len(drafts)] if d is not None and d.confidence is not None and drafts else None
    if drafts:
        drafts = drafts[: policy.truncate(plan.source, len(drafts), conf, sampling.greedy)]
    return Proposal(drafts, d, plan.source, conf, t_drafted)


def record(stats, policy: LengthPolicy, pr: Proposal, accepted: int, verify_seconds: float) -> None:
    """After verifying pr's drafts (accepted of them): the step's counts, credited to the
    source that proposed them, and the policy's observation (verify_seconds: what the verify
    forward cost this sequence)."""
    n = len(pr.drafts)
    stats.target_forwards += 1
    stats.verify_lengths.append(n + 1)
    stats.record(n, accepted)
    if n:  # who proposed them: the model drafter or prompt lookup (any match length)
        tally = stats.by_source.setdefault("lookup" if pr.source.is_lookup else "drafter", [0, 0])
        tally[0] += n
        tally[1] += accepted
    drafted = len(pr.d.tokens) if pr.d is not None and pr.source.kind is Kind.DRAFTER else None
    policy.observe(pr.source, n, accepted, pr.conf, pr.t_drafted, verify_seconds, drafted=drafted)
