"""The batched speculative step (mlxspec.engine.batch): every row's output equals what it
produces alone.

Greedy: the real SmolLM2-135M target with the shipped DSpark drafter (+ prompt lookup, the
adaptive policy: mlxspec's defaults), chat prompts of different lengths joining and leaving
a running batch (B moves through 1..4), token for token against `generate_steps` alone.
Sampling: tiny random llamas whose exact output distribution is enumerated (the approach of
tests/test_engine.py): seeded rows give their solo tokens, and many batched samples match the
target's distribution while a wrong acceptance rule is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxspec import api
from mlxspec.engine import batch as batch_mod
from mlxspec.engine.batch import SpecBatch, VerifyBudget
from mlxspec.engine.batch_rows import check_batchable
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.loop import generate_steps
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.tokenizer import apply_chat_template
from test_engine import N_TOKENS, TINY_PROMPT, accept_everything, distribution_check, exact_distribution
from test_engine import tiny  # noqa: F401 - the fixture
from tiny_targets import tiny_target

MAX = 14
PROMPTS = ["Hi", "Write a haiku about the sea.", "def fibonacci(n):\n    # return the n-th Fibonacci number",
           "List three prime numbers, then explain in two sentences why each of them is prime."]


@pytest.fixture(scope="module")
def default(smollm2):
    target, tok = smollm2
    spec = api.Speculator.build(api.SpecConfig(draft=str(api.shipped_drafter())), target)
    ids = [tok.encode(apply_chat_template(tok, [{"role": "user", "content": p}], add_generation_prompt=True),
                      add_special_tokens=False) for p in PROMPTS]
    return target, spec, api._eos_ids(tok), ids


def solo(target, spec, eos, ids, max_tokens=MAX) -> list[int]:
    d = spec.make_drafter(target)
    return [t for s in generate_steps(target, ids, drafter=d, max_tokens=max_tokens, eos_ids=eos,
                                      policy=api.make_policy(target, d, spec)) for t in s]


def test_greedy_rows_joining_and_leaving_equal_their_solo_runs(default):
    target, spec, eos, ids = default
    limits = [MAX, MAX, 8, MAX]  # row 2 leaves early; rows join after 0, 0, 2 and 4 steps
    refs = [solo(target, spec, eos, i, m) for i, m in zip(ids, limits)]
    assert len({len(i) for i in ids}) == len(ids)  # ragged lengths
    b = SpecBatch(target, taps=tuple(spec.make_drafter(target).taps))
    out, sizes, steps = {}, [], 0

    def join(k):
        d = spec.make_drafter(target)
        row, first = b.add(ids[k], drafter=d, max_tokens=limits[k], eos_ids=eos, policy=api.make_policy(target, d, spec),
                           tag=k)
        out[k] = list(first)

    join(0)
    join(1)
    while len(b) or len(out) < 4:
        if steps == 2 and 2 not in out:
            join(2)
        if steps == 4 and 3 not in out:
            join(3)
        sizes.append(len(b))
        for row, committed in b.step():
            out[row.tag] += committed
        b.remove([r for r in b.rows if r.done])
        steps += 1
    assert [out[k] for k in range(4)] == refs
    assert max(sizes) >= 3  # the rows really ran together


def test_rows_prefilled_together_equal_their_solo_runs(default):
    """`add_many`: four prompts of different lengths prefilled in one forward (right-padded),
    joining a batch that already runs a row, then stepped together: each row's tokens equal
    its solo run; a max_tokens=1 row answers its first token and never joins."""
    target, spec, eos, ids = default
    refs = [solo(target, spec, eos, i) for i in ids]
    b = SpecBatch(target, taps=tuple(spec.make_drafter(target).taps))

    def req(k, max_tokens=MAX):
        d = spec.make_drafter(target)
        return dict(prompt_ids=ids[k], drafter=d, max_tokens=max_tokens, eos_ids=eos,
                    policy=api.make_policy(target, d, spec), tag=k)

    out = {}
    row, first = b.add(**req(0))
    out[0] = list(first)
    for row, committed in b.step():  # row 0 is one step ahead of the others
        out[row.tag] += committed
    joined = b.add_many([req(1), req(2), req(3), dict(req(0, max_tokens=1), tag="one")])
    assert [r.tag for r, _ in joined] == [1, 2, 3, "one"] and joined[-1][0].done and len(b) == 4
    assert joined[-1][1] == refs[0][:1]
    for r, first in joined[:3]:
        out[r.tag] = list(first)
    while any(not r.done for r in b.rows):
        for row, committed in b.step():
            out[row.tag] += committed
    assert [out[k] for k in range(4)] == refs


def test_rows_joining_from_cached_prefixes_together_equal_their_solo_runs(default):
    """`add_many` with prompt-cache hits (the server's second turn): two rows start from cached
    prefixes of different lengths (their drafters given the prefix taps, as the server's
    `ContextDrafter` does), one from nothing, prefilled in one forward while a row runs: each
    row's tokens equal its solo run. A cache holding the whole prompt is refused."""
    import mlx.core as mx

    from mlxspec.server.prompt_cache import ContextDrafter

    target, spec, eos, ids = default
    refs = [solo(target, spec, eos, i) for i in ids]
    taps = tuple(spec.make_drafter(target).taps)
    b = SpecBatch(target, taps=taps)

    def req(k, n_cached=0):
        cache, ptaps = None, None
        if n_cached:
            cache = target.make_cache()
            _, ptaps = target(mx.array([ids[k][:n_cached]]), cache, taps=taps, logits="last")
        d = ContextDrafter(spec.make_drafter(target), ids[k][:n_cached], ptaps)
        return dict(prompt_ids=ids[k], drafter=d, max_tokens=MAX, eos_ids=eos,
                    policy=api.make_policy(target, d, spec), tag=k, cache=cache)

    out = {}
    row, first = b.add(**{k: v for k, v in req(0).items() if k != "cache"})
    out[0] = list(first)
    for row, committed in b.step():
        out[row.tag] += committed
    joined = b.add_many([req(1, len(ids[1]) - 1), req(2), req(3, len(ids[3]) // 2)])
    assert [r.tag for r, _ in joined] == [1, 2, 3] and len(b) == 4
    for r, first in joined:
        out[r.tag] = list(first)
    while any(not r.done for r in b.rows):
        for row, committed in b.step():
            out[row.tag] += committed
    assert [out[k] for k in range(4)] == refs
    whole = req(1, len(ids[1]) - 1)
    whole["cache"] = target.make_cache()
    target(mx.array([ids[1]]), whole["cache"], logits="last")
    with pytest.raises(ValueError, match="at least one of the"):
        b.add_many([whole, req(2)])


def test_extracted_row_cache_continues_like_the_solo_cache(default):
    """A row's cache taken out of the batch (the server's prompt cache keeps it) holds the same
    positions a solo run's cache would: continuing from it gives the same tokens."""
    target, spec, eos, ids = default
    b = SpecBatch(target, taps=tuple(spec.make_drafter(target).taps))
    rows = [b.add(i, drafter=spec.make_drafter(target), max_tokens=6, eos_ids=eos)[0] for i in ids[:2]]
    toks = {id(r): [r.anchor] for r in rows}
    while not all(r.done for r in rows):
        for r, c in b.step():
            toks[id(r)] += c
    r = rows[1]
    cache = b.extract(r)
    held = ids[1] + toks[id(r)][:-1]
    assert cache.length == len(held) == r.length
    follow = ids[1] + toks[id(r)] + [13]
    want = [t for s in generate_steps(target, follow, max_tokens=4, eos_ids=eos) for t in s]
    got = [t for s in generate_steps(target, follow, max_tokens=4, eos_ids=eos, cache=cache) for t in s]
    assert got == want


def test_seeded_sampled_rows_equal_their_solo_runs(tiny):
    """Fixed verify lengths: each row draws its own rng in the solo order, so its tokens are
    the solo run's for the same seed."""
    target, _, dspark = tiny
    sp = SamplingParams(temperature=0.7, top_k=4)
    prompts = [TINY_PROMPT, [4, 5], [1, 2, 3, 6, 0, 1], [2]]
    for seed in range(3):
        want = [[t for s in generate_steps(target, p, drafter=BlockDrafter(dspark, target), max_tokens=10,
                                           sampling=sp, seed=seed * 10 + k) for t in s] for k, p in enumerate(prompts)]
        b = SpecBatch(target, taps=(0,))
        got = {}
        for k, p in enumerate(prompts):
            row, first = b.add(p, drafter=BlockDrafter(dspark, target), max_tokens=10, sampling=sp,
                               seed=seed * 10 + k, tag=k)
            got[k] = first
        while len(b):
            for row, c in b.step():
                got[row.tag] = got[row.tag] + c
            b.remove([r for r in b.rows if r.done])
        assert [got[k] for k in range(4)] == want


def sample_batched(target, dspark, sp, n, B=4) -> np.ndarray:
    out = []
    for start in range(0, n, B):
        b = SpecBatch(target, taps=(0,), check_invariants=False)
        got = {}
        for seed in range(start, min(start + B, n)):
            _, first = b.add(TINY_PROMPT, drafter=BlockDrafter(dspark, target), max_tokens=N_TOKENS, sampling=sp,
                             seed=seed, tag=seed)
            got[seed] = first
        while len(b):
            for row, c in b.step():
                got[row.tag] = got[row.tag] + c
            b.remove([r for r in b.rows if r.done])
        out += [got[s] for s in sorted(got)]
    return np.array(out)


@pytest.mark.slow  # ~35 s on a busy 2-core machine; the seeded test above covers the same path quickly
def test_batched_sampling_is_lossless_and_the_check_catches_a_wrong_rule(tiny, monkeypatch):
    target, _, dspark = tiny
    sp = SamplingParams(temperature=0.7, top_k=4)
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)
    res = distribution_check(sample_batched(target, dspark, sp, 1500), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"batched speculative sampling differs from the target's distribution: {bad}"
    monkeypatch.setattr(batch_mod, "accept_sampled", accept_everything)
    wrong = distribution_check(sample_batched(target, dspark, sp, 400), exact)
    assert any(t > b for t, b in wrong.values()), f"the check missed a wrong acceptance rule: {wrong}"


@pytest.mark.parametrize("arch, kind", [("gemma3", "RotatingKVCache"), ("qwen3_5", "ArraysCache")])
def test_rotating_and_recurrent_targets_are_refused_in_one_line(arch, kind):
    with pytest.raises(MlxspecError) as e:
        check_batchable(tiny_target(arch))
    msg = str(e.value)
    assert "\n" not in msg and kind in msg and "one at a time" in msg


# ----------------------------------------------------------------------------- the batch's verify budget

def test_budget_verifies_long_blocks_when_rows_cost_little_and_none_when_they_cost_a_lot():
    """VerifyBudget's cap: a flat forward cost (memory-bound: more rows are nearly free) and
    drafts that are usually right -> the whole block; a cost growing with every row and drafts
    that are rarely right -> 0 (a batched autoregressive step), with a probe now and then."""
    flat = VerifyBudget({L: 1 / (0.010 + 0.0001 * L) for L in range(1, 10)}, max_drafts=8)
    for _ in range(30):
        flat.observe_forward(40, 0.0145)
        flat.observe_row(8, 8, 0.001)
    assert flat.cap([8] * 4) == 8
    assert flat.cap([2, 8, 0, 8]) == 8  # rows' remaining limits: a row near max_tokens caps itself
    steep = VerifyBudget({L: 1 / (0.010 * L) for L in range(1, 10)}, max_drafts=8, probe_every=5)
    for _ in range(30):
        steep.observe_forward(16, 0.16)
        steep.observe_row(4, 0, 0.002)
    caps = [steep.cap([8] * 8) for _ in range(40)]
    # probes of one draft per row after 5 plain steps, then 10, then 20 (backing off)
    assert [i for i, c in enumerate(caps) if c] == [4, 14, 34] and {caps[4], caps[14], caps[34]} == {1}
    assert steep.cost(80) == pytest.approx(0.8, rel=0.05)  # the fitted line: 10 ms a row


def test_budget_prior_is_a_shape_rescaled_to_the_measured_forwards():
    """A profile 5x too slow (measured under netlib BLAS, or on a busier moment) with every
    measured forward at one row count: the cost line keeps the profile's shape at the measured
    level (a plain fit through both put a 118 ms/row slope on a 10 ms/row forward and the batch
    never drafted)."""
    slow = VerifyBudget({L: 1 / (0.5 + 0.08 * L) for L in range(1, 10)}, max_drafts=8)
    for _ in range(40):
        slow.observe_forward(2, 0.115)
    s = 0.115 / (0.5 + 0.08 * 2)
    assert slow.cost(2) == pytest.approx(0.115, rel=0.02)
    assert slow.cost(18) == pytest.approx(s * (0.5 + 0.08 * 18), rel=0.05)


def test_budget_caps_rows_and_output_is_unchanged(default):
    """A budget that allows one draft per row: every row verifies at most 2 tokens, and greedy
    output is still each row's solo output."""
    target, spec, eos, ids = default
    budget = VerifyBudget({L: 1 / (0.01 * L) for L in range(1, 10)}, max_drafts=8, probe_every=10**6)
    budget.cap = lambda limits: 1
    b = SpecBatch(target, taps=tuple(spec.make_drafter(target).taps), budget=budget)
    rows = {}
    for k in (1, 2):
        d = spec.make_drafter(target)
        row, first = b.add(ids[k], drafter=d, max_tokens=8, eos_ids=eos, policy=api.make_policy(target, d, spec))
        rows[id(row)] = (row, list(first))
    while len(b):
        for r, c in b.step():
            rows[id(r)][1].extend(c)
        b.remove([r for r in b.rows if r.done])
    for row, toks in rows.values():
        assert max(row.stats.verify_lengths) <= 2
        assert toks == solo(target, spec, eos, row.prompt_ids, 8)


def test_autoregressive_steps_start_the_next_forward_ahead_and_output_is_unchanged(default):
    """Rows without a drafter: every step is autoregressive, so each starts the next one's
    forward before returning (`SpecBatch._start_ahead`, as mlx-lm's BatchGenerator overlaps its
    steps). Rows join mid-run, one ends early and stays a step before it is removed: every
    row's tokens equal its solo autoregressive run."""
    target, spec, eos, ids = default
    limits = [MAX, 6, MAX, MAX]
    refs = [[t for s in generate_steps(target, i, max_tokens=m, eos_ids=eos) for t in s] for i, m in zip(ids, limits)]
    b = SpecBatch(target)
    out = {}
    for row, first in b.add_many([dict(prompt_ids=ids[k], max_tokens=limits[k], eos_ids=eos, tag=k) for k in (0, 1)]):
        out[row.tag] = list(first)
    steps = 0
    while len(b) or len(out) < 4:
        if steps == 3:
            for row, first in b.add_many([dict(prompt_ids=ids[k], max_tokens=limits[k], eos_ids=eos, tag=k)
                                          for k in (2, 3)]):
                out[row.tag] = list(first)
        for row, committed in b.step():
            out[row.tag] += committed
        if steps % 2:  # rows done stay in the batch for a step now and then
            b.remove([r for r in b.rows if r.done])
        steps += 1
        if not any(not r.done for r in b.rows):
            b.remove(list(b.rows))
    assert [out[k] for k in range(4)] == refs
    assert b.pipelined >= 10


def test_budget_switching_between_drafting_and_autoregressive_steps_keeps_output(default):
    """Drafting rows under a budget whose cap moves between 0 (autoregressive: the next forward
    starts ahead, its taps still reach each drafter) and 1-3 drafts: greedy output is each row's
    solo output and every drafter's context stays aligned (the batch checks it every step)."""
    target, _, eos, ids = default
    # the fixed policy drafts whatever the cap allows (an adaptive one may have learned not to)
    spec = api.Speculator.build(api.SpecConfig(draft=str(api.shipped_drafter()), policy="fixed"), target)
    budget = VerifyBudget({L: 1 / (0.01 * L) for L in range(1, 10)}, max_drafts=8, probe_every=10**6)
    caps = iter([0, 0, 0, 2, 0, 0, 1, 0, 0, 0, 3] * 10)
    budget.cap = lambda limits: next(caps)
    b = SpecBatch(target, taps=tuple(spec.make_drafter(target).taps), budget=budget)
    rows = {}
    reqs = []
    for k in (0, 1, 3):
        d = spec.make_drafter(target)
        reqs.append(dict(prompt_ids=ids[k], drafter=d, max_tokens=MAX, eos_ids=eos, policy=api.make_policy(target, d, spec)))
    for row, first in b.add_many(reqs):
        rows[id(row)] = (row, list(first))
    while len(b):
        for r, c in b.step():
            rows[id(r)][1].extend(c)
        b.remove([r for r in b.rows if r.done])
    assert b.pipelined >= 3
    for row, toks in rows.values():
        assert toks == solo(target, spec, eos, row.prompt_ids, MAX)
    assert sum(row.stats.drafted for row, _ in rows.values()) > 0  # the drafting steps did draft
