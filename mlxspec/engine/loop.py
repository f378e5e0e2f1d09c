"""The speculative decoding loop: draft, verify, accept, commit, trim.

One function, `generate_steps`, drives any `Drafter`. Per step:
  1. draft: the drafter proposes up to n tokens after the anchor (one forward for
     block drafters, plus the Markov chain for DSpark);
  2. truncation: the verify-length policy (one `mlxspec.engine.policy.LengthPolicy`: fixed,
     the p_min cut, the confidence schedule or adaptive) plans before drafting (from
     history only: an autoregressive step, prompt lookup or the drafter) and truncates
     after (`mlxspec.engine.step.propose`);
  3. verify: ONE target forward over [anchor, d_1..d_n] (with taps);
  4. accept: `accept_greedy` / `accept_sampled` (pure functions in verify.py);
  5. commit the accepted drafts plus the bonus; trim the target cache back to the
     committed length; append the committed rows' taps to the drafter's context.

Invariants (checked every step; `InvariantError` if broken):
  - target cache length == number of committed tokens before the anchor
    (prompt + generated - 1): the anchor itself is never in the cache;
  - a block drafter's context length == the target cache length (its context ends
    right before the anchor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import numpy as np

from mlxspec.engine.drafting import Drafter, NoDrafter
from mlxspec.engine.policy import FixedLength, LengthPolicy, Source
from mlxspec.engine.step import Proposal, propose, record
from mlxspec.engine.tree import TreeCalibration
from mlxspec.engine.tree_step import TreeSettings, tree_step
from mlxspec.engine.verify import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    argmax_lazy,
    check_finite,
    pick_token,
    sample_token,
    target_rows,
)
from mlxspec.logger import say
from mlxspec.targets.model import Target, cache_length, trim_cache
from mlxspec.targets.tree import tree_support


class InvariantError(AssertionError):
    pass


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generated: int = 0
    target_forwards: int = 0  # verify forwards after the prefill
    drafted: int = 0
    accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    gen_time: float = 0.0
    drafted_at: list = field(default_factory=list)  # per position i (0-based)
    accepted_at: list = field(default_factory=list)
    verify_lengths: list = field(default_factory=list)
    by_source: dict = field(default_factory=dict)  # "drafter" | "lookup" -> [drafted, accepted]

    def merge(self, s: "SpecStats") -> None:
        """Add another run's counts into these (one prefill token for all runs together)."""
        t = self
        t.prompt_tokens += s.prompt_tokens
        t.prompt_time += s.prompt_time
        # `generated` counts the prefill's token (tau and generation_tps subtract it once)
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
        for k, (d, a) in s.by_source.items():
            mine = t.by_source.setdefault(k, [0, 0])
            mine[0] += d
            mine[1] += a

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Tokens committed per target forward (bonus included), prefill excluded."""
        return (self.generated - 1) / self.target_forwards if self.target_forwards else 1.0

    @property
    def per_position_acceptance(self) -> list:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def generation_tps(self) -> float:
        return (self.generated - 1) / self.gen_time if self.gen_time > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    def record(self, n: int, a: int):
        while len(self.drafted_at) < n:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n):
            self.drafted_at[i] += 1
            if i < a:
                self.accepted_at[i] += 1
        self.drafted += n
        self.accepted += a

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated": self.generated,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tau": self.tau,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "generation_tps": self.generation_tps,
            "prompt_tps": self.prompt_tps,
        }


def generate_steps(
    target: Target,
    prompt_ids: list[int],
    *,
    drafter: Drafter | None = None,
    max_tokens: int = 256,
    sampling: SamplingParams = SamplingParams(),
    seed: int | None = 0,
    eos_ids: set[int] | frozenset = frozenset(),
    policy: LengthPolicy | None = None,
    stats: SpecStats | None = None,
    check_invariants: bool = True,
    cache: list | None = None,
    tree=None,
) -> Iterator[list[int]]:
    """Yield the tokens committed at each step (the first yield is the prefill's token).

    Stops after an EOS token (included), or at max_tokens.

    policy: how many drafts each step verifies (`mlxspec.engine.policy`; `Speculator.session`
    builds a request's; None: the drafter's full proposal every step, `FixedLength`).

    cache: a target cache to continue instead of a fresh one (the server's prompt cache):
    it already holds the first cache_length(cache) tokens of prompt_ids (fewer than all
    of them) and only the rest is prefilled; the drafter's `begin` then gets the taps of
    the uncached part only, so its caller must supply the prefix's context. The cache is
    updated in place.

    tree: `mlxspec.engine.tree_step.TreeSettings` (or "off" / "auto" / a node count): verify a
    tree of candidates per step instead of one chain, where the target can (one log line says
    why not where it cannot: recurrent layers).
    """
    drafter = drafter or NoDrafter()
    policy = FixedLength() if policy is None else policy
    stats = stats if stats is not None else SpecStats()
    rng = np.random.default_rng(seed)
    taps = tuple(drafter.taps)
    cache = target.make_cache() if cache is None else cache
    n_cached = cache_length(cache)
    if not prompt_ids:
        raise ValueError("empty prompt")
    if n_cached >= len(prompt_ids):
        raise ValueError(f"the cache holds {n_cached} tokens; at least one of the {len(prompt_ids)} prompt tokens must remain to prefill")

    t0 = time.perf_counter()
    logits, ptaps = target(mx.array([prompt_ids[n_cached:]]), cache, taps=taps, logits="last")
    first = pick_token(logits[0, -1], sampling, rng)
    stats.prompt_tokens, stats.prompt_time = len(prompt_ids), time.perf_counter() - t0
    drafter.begin(prompt_ids, ptaps)
    t_gen = time.perf_counter()
    stats.generated = 1
    yield [first]
    if first in eos_ids or max_tokens <= 1:
        stats.gen_time = time.perf_counter() - t_gen
        return
    anchor, produced = first, 1
    if type(drafter) is NoDrafter and sampling.greedy:  # autoregressive: each step built while the last runs
        yield from _greedy_ar(target, cache, anchor, produced, max_tokens, eos_ids, stats, policy, t_gen,
                              len(prompt_ids) if check_invariants else None)
        return
    trees = tree_settings(target, tree)
    cal = TreeCalibration() if trees.on else None

    while produced < max_tokens:
        if check_invariants:
            _check(target, cache, drafter, len(prompt_ids) + produced - 1)
        # 1-2. draft and truncate, as the policy chooses (never more than can still be
        # committed: the bonus takes one slot)
        n_cap = min(drafter.max_drafts, max_tokens - produced - 1)
        res = tree_step(target, cache, drafter, policy, anchor, n_cap, sampling, rng, trees, taps, stats, cal) \
            if trees.on and n_cap > 0 else None
        if res is not None:  # a tree was verified; else (trees off, or an autoregressive plan) a chain
            accepted, nxt = res
        else:
            td = time.perf_counter()
            pr = propose(drafter, policy, anchor, n_cap, sampling, rng, target.info.vocab_size) if not trees.on \
                else Proposal([], None, Source.NONE, None, 0.0)
            drafts = pr.drafts
            stats.draft_time += time.perf_counter() - td
            # 3. verify [anchor, drafts] in one forward
            tv = time.perf_counter()
            vlogits, vtaps = target(mx.array([[anchor] + drafts]), cache, taps=taps,
                                    logits="all" if drafts else "last")
            # 4. accept
            rows = target_rows(vlogits[0], sampling)
            t_verified = time.perf_counter() - tv
            if sampling.greedy:
                a, nxt = accept_greedy(drafts, rows)
            elif drafts:
                a, nxt = accept_sampled(drafts, np.asarray(pr.d.probs[: len(drafts)]), rows, rng)
            else:
                a, nxt = 0, sample_token(rows[0], rng)
            # 5. commit, trim, feed the drafter
            trim_cache(cache, len(drafts) - a)
            drafter.accept([anchor] + drafts[:a], vtaps[:, : a + 1] if vtaps is not None else None)
            stats.verify_time += time.perf_counter() - tv
            record(stats, policy, pr, a, t_verified)
            accepted = drafts[:a]
        produced, committed = _commit(accepted + [nxt], eos_ids, max_tokens, produced)
        stats.generated = produced
        stats.gen_time = time.perf_counter() - t_gen
        yield committed
        if committed[-1] in eos_ids:
            return
        anchor = committed[-1]
    stats.gen_time = time.perf_counter() - t_gen


def _greedy_ar(target, cache, anchor: int, produced: int, max_tokens: int, eos_ids, stats, policy, t_gen,
               prompt_len: int | None) -> Iterator[list[int]]:
    """Greedy decoding without drafts, pipelined as mlx-lm's `generate_step` is: the forward of
    token t+1 is built on t's argmax before t is read back (`mx.async_eval`), so the Python that
    builds a step overlaps the one before it (SmolLM2 on 2 cores: 101% of mlx_lm's AR speed,
    `scripts/bench_ar.py`, where step at a time was ~7% behind it; docs/results.md). The same tokens as one step at a time: each forward is the
    one the unpipelined loop runs, on the same token. At most one step runs ahead, and it is
    rolled back wherever the request ends (EOS, max_tokens, or the caller closing the
    generator), so the cache holds exactly the committed positions afterwards."""
    def step(tok: mx.array):
        lg, _ = target(tok, cache, logits="last")
        am, ok = argmax_lazy(lg[0, -1])
        mx.async_eval(am, ok)
        return am, ok

    t = time.perf_counter()
    cur = step(mx.array([[anchor]]))
    ahead = None
    try:
        while produced < max_tokens:
            if prompt_len is not None:
                _check(target, cache, None, prompt_len + produced)
            ahead = step(cur[0].reshape(1, 1)) if produced + 1 < max_tokens else None
            tok = int(check_finite(*cur).item())
            now = time.perf_counter()
            record(stats, policy, Proposal([], None, Source.NONE, None, 0.0), 0, now - t)
            stats.verify_time += now - t
            t = now
            produced, committed = _commit([tok], eos_ids, max_tokens, produced)
            stats.generated = produced
            stats.gen_time = time.perf_counter() - t_gen
            yield committed
            if tok in eos_ids or ahead is None:
                return
            cur, ahead = ahead, None
    finally:
        if ahead is not None:  # one forward ran past what was committed: take its position back
            mx.eval(ahead[0])
            trim_cache(cache, 1)


def _commit(committed: list, eos_ids, max_tokens: int, produced: int) -> tuple[int, list]:
    """The tokens a step commits: up to and including an EOS, within max_tokens."""
    for i, t in enumerate(committed):  # stop right after an EOS
        if t in eos_ids:
            committed = committed[: i + 1]
            break
    committed = committed[: max_tokens - produced]
    return produced + len(committed), committed


def tree_settings(target: Target, tree) -> TreeSettings:
    """The step's tree settings, off (with one log line saying why) where the target cannot
    verify trees."""
    ts = TreeSettings.parse(tree)
    if ts.on:
        why = getattr(target, "_tree_why", False)
        if why is False:
            why = target._tree_why = tree_support(target)
            if why:
                say(f"mlxspec: --tree {ts.mode if ts.mode != 'fixed' else ts.nodes}: {why}")
        if why:
            return TreeSettings("off")
    return ts


def _check(target, cache, drafter, expected_len):
    n = cache_length(cache)
    if n != expected_len:
        raise InvariantError(f"target cache holds {n} positions, expected {expected_len}")
    ctx = getattr(drafter, "ctx_len", None)
    if ctx is not None and ctx != n:
        raise InvariantError(f"drafter context holds {ctx} rows, target cache {n}")
