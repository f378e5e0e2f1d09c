"""The verify-length policy (pure functions and its state), prompt lookup (n-gram) drafting,
and the engine with both: greedy output equals autoregressive, sampled output keeps the
target's distribution (the TV-bound check of test_engine), and the policy's decisions.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.ngram import LookupBlockDrafter, NgramDrafter, NgramIndex
from mlxspec.engine.policy import (AcceptanceEstimate, Calibration, ConfidenceCut, ConfidenceSchedule, FixedLength, Kind,
                                   Plan, PolicyMemory, Source, VerifyPolicy, best_length, choose_verify_length,
                                   expected_tokens, stopping_length, truncate_p_min)
from mlxspec.engine.suffix import Match
from mlxspec.engine.verify import SamplingParams

from test_engine import (N_TOKENS, PROMPT, TINY_PROMPT, V, Oracle, distribution_check, exact_distribution,
                         random_drafter, run, tiny)  # noqa: F401  (tiny is a fixture)

FLAT = [1.0, 1.13, 1.3, 1.37, 1.4, 1.45, 1.5, 1.52, 1.54]  # verify cost of 1..9 tokens, shaped like this machine's


# ----------------------------------------------------------------------------- pure functions

def test_expected_tokens_hand_computed():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_best_length_zero_when_drafting_cannot_pay():
    # acceptance 0.1: a 2-token verify costs 1.13x and yields 1.1 tokens -> autoregressive
    assert best_length([0.1] * 8, FLAT, 0.0, 8)[0] == 0
    # even perfect drafts do not pay when the verify costs more than they bring
    assert best_length([1.0] * 8, [1.0] + [10.0] * 8, 0.0, 8)[0] == 0  # 9 tokens for 10x
    # a draft forward costing 2 decode steps kills a drafter with p = 0.4
    assert best_length([0.4] * 8, FLAT, 2.0, 8)[0] == 0


def test_best_length_full_block_when_drafts_are_right():
    assert best_length([1.0] * 8, FLAT, 0.0, 8)[0] == 8
    assert best_length([1.0] * 8, FLAT, 0.0, 5)[0] == 5  # capped


def test_best_length_hand_computed_middle():
    # p = 0.8 then 0: E(1) = 1.8 over 1.13 = 1.593; E(2) = 1.8 over 1.3 = 1.38; AR 1.0 -> l = 1
    l, r = best_length([0.8, 0.0, 0.9], FLAT, 0.0, 3)
    assert l == 1 and r == pytest.approx(1.8 / 1.13)


def test_stopping_length_never_looks_at_later_rows():
    prior = [0.6] * 6
    known = [0.9, 0.9, 0.05, 0.9, 0.9, 0.9]
    l = stopping_length(known, prior, FLAT, 0.0)
    # the decision for row i depends on known[:i] only: changing rows after the stop, or
    # after any admitted row's decision point, never changes earlier decisions
    for i in range(1, len(known) + 1):
        alt = known[:i] + [0.99] * (len(known) - i)
        assert stopping_length(alt, prior, FLAT, 0.0) >= min(l, i - 1)
    assert l == 2  # row 3 is almost surely rejected


def test_acceptance_estimate_counts_conditional_trials():
    e = AcceptanceEstimate(4, decay=1.0, prior_weight=0.0)
    e.observe(verified=4, accepted=1)  # row 1 hit, row 2 tried and missed, rows 3-4 not tried
    e.observe(verified=2, accepted=2)  # rows 1, 2 hit
    assert list(e.tried) == [2, 2, 0, 0]
    assert list(e.hit) == [2, 1, 0, 0]


def test_calibration_scales_confidences_to_observed_acceptance():
    c = Calibration(weight=0.0)
    for _ in range(20):
        c.observe([0.8, 0.8], verified=2, accepted=1)  # says 0.8, right half the time per try
    out = c.apply([0.8])
    assert 0.3 < out[0] < 0.6


def test_policy_goes_autoregressive_and_probes_with_back_off():
    pol = VerifyPolicy(FLAT, 8, probe_every=2, max_probe_every=8)
    for _ in range(30):  # a drafter that is never right
        plan = pol.plan(8)
        if plan.source == "drafter":
            pol.observe("drafter", pol.truncate("drafter", 8, None, True), 0, None, 0.3)
    # estimates collapsed: most steps are plain autoregressive, probes are spaced out
    plans = [pol.plan(8) for _ in range(16)]
    probes = [p for p in plans if p.source == "drafter"]
    assert all(p.probe for p in probes) and 1 <= len(probes) <= 3
    assert pol.probe_interval("drafter") == 8
    # a probe verifies at least one draft
    pol.last_probe = True
    assert pol.truncate("drafter", 8, None, True) >= 1


def test_memory_carries_what_a_request_learned_into_the_next():
    """A second request of the same speculator starts where the first left off: a drafter
    found useless is not explored from the optimistic prior again, while the counts are
    capped so that the new request can still move the estimate."""
    mem = PolicyMemory(cap=6.0)
    first = mem.policy("greedy", lambda: VerifyPolicy(FLAT, 8, probe_every=2, max_probe_every=16))
    fresh_p1 = first.estimate("drafter").p()[0]
    for _ in range(40):  # never right
        if first.plan(8).source == "drafter":
            first.observe("drafter", first.truncate("drafter", 8, None, True), 0, None, 0.3)
    second = mem.policy("greedy", lambda: VerifyPolicy(FLAT, 8, probe_every=2, max_probe_every=16))
    assert second.estimate("drafter").p()[0] < 0.5 * fresh_p1
    assert float(second.estimate("drafter").tried.max()) <= 6.0 + 1e-9
    assert second.probe_interval("drafter") == first.probe_interval("drafter") > 2
    assert sum(second.plan(8).source == "drafter" for _ in range(8)) <= 1  # no burst of probes
    # another sampling regime keeps its own history
    other = mem.policy("temp=1", lambda: VerifyPolicy(FLAT, 8, probe_every=2))
    assert other.estimate("drafter").p()[0] == fresh_p1 and other.probe_interval("drafter") == 2
    # capped counts: a request where the drafter is right recovers within a few verifications
    for _ in range(30):
        if second.plan(8).source == "drafter":
            second.observe("drafter", second.truncate("drafter", 8, None, True), 8, None, 0.01)
    assert second.plan(8).source == "drafter"


def test_policy_recovers_when_acceptance_rises():
    pol = VerifyPolicy(FLAT, 8, probe_every=2)
    for _ in range(20):
        plan = pol.plan(8)
        if plan.source == "drafter":
            pol.observe("drafter", 1, 0, None, 0.1)
    for _ in range(40):
        plan = pol.plan(8)
        if plan.source == "drafter":
            pol.observe("drafter", pol.truncate("drafter", 8, None, True), 8, None, 0.1)
    assert pol.plan(8).source == "drafter" and pol.truncate("drafter", 8, None, True) == 8


def test_policy_prefers_the_lookup_when_it_is_better_and_free():
    pol = VerifyPolicy(FLAT, 8)
    for _ in range(10):
        pol.observe("lookup", 4, 4)
        pol.observe("drafter", 4, 0, None, 0.5)
    assert pol.plan(8, lookup_len=4).source == Source.LOOKUP
    # each n-gram match length keeps its own estimate: an unseen one starts at the prior
    plan = pol.plan(8, lookup_len=4, match=3)
    assert (plan.source, plan.source.kind, plan.source.match) == (Source.lookup(3), Kind.LOOKUP, 3)
    assert pol.plan(8, lookup_len=4, lookup_source="lookup3").source == "lookup3"  # the older names
    assert pol.plan(8, lookup_len=0).source in (Source.NONE, Source.DRAFTER)
    assert pol.plan(8, lookup_len=4, match=3, model_drafts=False).source.is_lookup  # no drafter to weigh


def test_a_longer_lookup_match_starts_from_what_shorter_ones_learned():
    """A match length the policy has not seen starts from the longest shorter one it has (where
    that is above the pooled estimate), position by position: a suffix match growing from 4 to
    8, 16, 32 tokens keeps the long verifies its 4-token matches earned instead of starting each
    length over from the pooled estimate (which the 2-token matches drag down); a shorter match
    learns nothing from a longer one."""
    pol = VerifyPolicy([1.0] + [1.05] * 16, 16)
    for _ in range(20):
        pol.observe(Source.lookup(2), 4, 0)  # 2-token matches: wrong
        pol.observe(Source.lookup(4), 16, 16)  # 4-token matches: right to the end
    pooled, four = pol.estimate(Source.LOOKUP).p(), pol.estimate(Source.lookup(4)).p()
    assert pooled[0] < 0.6 < 0.9 < four[0]
    eight = pol.estimate(Source.lookup(8))
    assert np.allclose(eight.p(), np.maximum(pooled, four)) and np.allclose(eight.p(), four)
    assert pol.plan(16, lookup_len=16, match=8, model_drafts=False) == Plan(Source.lookup(8), 16)
    # an unseen length between them starts from the 2-token matches' or the pooled estimate,
    # whichever is higher: the pooled one here, not the 4-token matches'
    three = pol.estimate(Source.lookup(3)).p()
    assert np.allclose(three, pooled) and three[0] < 0.6
    # what a length learns itself still moves it off the inherited prior
    for _ in range(10):
        pol.observe(Source.lookup(8), 16, 0)
    assert pol.estimate(Source.lookup(8)).p()[0] < 0.2


def test_matches_in_earlier_requests_keep_their_own_estimates():
    """Suffix drafting's matches in the shared index over earlier requests (`Source.shared`)
    start as trusted as the request's own and then learn apart: a workload whose requests share
    only phrases (chat) stops paying for them without losing its own matches, and the other way
    round; names round-trip ("lookup8s")."""
    pol = VerifyPolicy([1.0 + 0.15 * i for i in range(17)], 16)
    for _ in range(20):
        pol.observe(Source.lookup(4), 8, 8)  # this request's own 4-token matches: right
    own = pol.estimate(Source.LOOKUP).p()
    fresh = pol.estimate(Source.lookup(0, shared=True)).p()
    assert np.allclose(fresh, own)  # a first shared proposal is trusted as the own ones are
    for _ in range(20):
        pol.observe(Source.lookup(4, shared=True), 8, 0)  # other requests' 4-token matches: wrong
    assert pol.estimate(Source.lookup(4, shared=True)).p()[0] < 0.2 < 0.9 < pol.estimate(Source.lookup(4)).p()[0]
    assert np.allclose(pol.estimate(Source.LOOKUP).p(), own)  # the own pooled estimate did not move
    assert pol.plan(8, lookup_len=8, match=Match(4, True), model_drafts=False).source.kind is Kind.NONE
    assert pol.plan(8, lookup_len=8, match=4, model_drafts=False) == Plan(Source.lookup(4), 8)
    # an unseen shared length starts from the shared ones', not the own ones'
    assert pol.estimate(Source.lookup(8, shared=True)).p()[0] < 0.3
    for name in ("lookup8s", "lookups", "lookup8", "lookup"):
        assert str(Source.of(name)) == name and pickle.loads(pickle.dumps(Source.of(name))) == Source.of(name)
    assert Source.of("lookup8s").shared and not Source.of("lookup8").shared


def test_a_lookup_right_to_the_end_of_what_it_verified_is_tried_longer():
    """A lookup whose matches were right at every position it was verified at (7 of 7, as the
    plan stopped at 7) is tried further when it proposes more: an untried position starts from
    the position before's estimate, not from the 0.8 continuation prior. On this host's profile
    (docs/bench/verify-profile-smollm2-2026-12-04.json: 8 rows cost 1.76 steps, 17 rows 2.68),
    with 0.8 beyond position 7 the plan stopped at 7 for good and a 32-token suffix match (a
    function sent back) verified 7 of its 16 drafts per step; a lookup that is wrong where it is
    tried is not trusted any further than before."""
    import json
    from pathlib import Path

    prof = json.loads((Path(__file__).resolve().parent.parent / "docs/bench/verify-profile-smollm2-2026-12-04.json").read_text())
    sps = {int(k): v for k, v in prof.items()}
    pol = VerifyPolicy.from_profile(sps, 16)
    for _ in range(6):
        pol.observe(Source.lookup(32), 7, 7)
    p = pol.estimate(Source.lookup(32)).p()
    assert p[7] >= p[6] > 0.9  # position 8, never tried, starts from position 7's estimate
    assert pol.plan(16, lookup_len=16, match=32, model_drafts=False) == Plan(Source.lookup(32), 16)
    # a lookup that is right only at its first position stays short
    pol = VerifyPolicy.from_profile(sps, 16)
    for _ in range(10):
        pol.observe(Source.lookup(4), 7, 1)
    p4 = pol.estimate(Source.lookup(4)).p()
    assert p4[1] < 0.3 and p4[2] == pytest.approx(0.8, abs=0.01)
    assert pol.plan(16, lookup_len=16, match=4, model_drafts=False).n <= 2
    # the drafter's estimate (no continuation prior) is unchanged: the previous position's
    e = AcceptanceEstimate(8)
    for _ in range(5):
        e.observe(3, 3)
    q = e.p()
    assert np.allclose(q[3:], q[3]) and q[3] == pytest.approx((0 + q[2] * 2.0) / 2.0)


def test_source_carries_its_kind_and_match():
    assert [str(s) for s in (Source.NONE, Source.DRAFTER, Source.LOOKUP, Source.lookup(3))] == [
        "none", "drafter", "lookup", "lookup3"]
    assert Source.of("lookup4") == Source.lookup(4) and Source.of("lookup4").match == 4
    assert Source.of("drafter").kind is Kind.DRAFTER and not Source.DRAFTER.is_lookup
    assert Source.lookup(2) != Source.lookup(3) and len({Source.lookup(2), Source.lookup(2), Source.LOOKUP}) == 2
    import copy
    import pickle

    for s in (Source.lookup(3), Source.DRAFTER):
        for c in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
            assert (c, c.kind, c.match) == (s, s.kind, s.match)


def test_fixed_and_confidence_policies():
    """FixedLength asks for the full block (or at most max_drafts); ConfidenceCut (--p-min) and
    ConfidenceSchedule (--schedule) cut by confidences, outermost first, then hand the rest to
    the policy inside; without confidences they cut nothing."""
    assert FixedLength().plan(6) == Plan(Source.DRAFTER, 6)
    assert FixedLength(2).plan(6) == Plan(Source.DRAFTER, 2) and FixedLength(2).plan(1).n == 1
    conf = [0.9, 0.8, 0.4, 0.9]
    assert FixedLength().truncate(Source.DRAFTER, 4, conf, True) == 4
    assert ConfidenceCut(0.5, FixedLength()).truncate(Source.DRAFTER, 4, conf, True) == 2
    assert ConfidenceCut(0.95, FixedLength()).truncate(Source.DRAFTER, 4, conf, True) == 0
    assert ConfidenceCut(0.5, FixedLength()).truncate(Source.DRAFTER, 4, None, True) == 4
    sps = {1: 10.0, 2: 9.5, 3: 9.0, 4: 8.0, 5: 7.0}
    assert ConfidenceSchedule(sps, FixedLength()).truncate(Source.DRAFTER, 4, conf, True) == choose_verify_length(conf, sps)
    both = ConfidenceCut(0.5, ConfidenceSchedule(sps, FixedLength()))
    assert both.truncate(Source.DRAFTER, 4, conf, True) == choose_verify_length(conf[:truncate_p_min(conf, 0.5)], sps)
    # the adaptive policy inside gets what is left, and is what plans and learns
    pol = VerifyPolicy(FLAT, 8)
    cut = ConfidenceCut(0.5, pol)
    assert cut.plan(8, 3, 2, True) == pol.plan(8, 3, 2, True)
    cut.observe(Source.DRAFTER, 2, 2, conf, 0.1, 0.02)
    assert pol.estimate(Source.DRAFTER).tried[:2].tolist() == [1.0, 1.0] and pol.obs_w[2] == 1.0


def test_policy_uses_confidences_under_greedy():
    pol = VerifyPolicy(FLAT, 8)
    assert pol.truncate("drafter", 8, [0.99] * 3 + [0.01] * 5, greedy=True) == 3


# ----------------------------------------------------------------------------- prompt lookup

def _run_simulated(pol, steps, cost, p_accept=0.6, seed=0):
    """Drive a policy for `steps` drafter steps against a simulated clock: cost(step, L) is the
    verify time of L tokens at that step; each draft is right with probability p_accept
    (given the previous one was). Returns the verify lengths the policy chose."""
    rng = np.random.default_rng(seed)
    lengths = []
    for step in range(steps):
        plan = pol.plan(8)
        n = pol.truncate(plan.source, plan.n, None, greedy=True) if plan.source == "drafter" else 0
        acc = 0
        while acc < n and rng.random() < p_accept:
            acc += 1
        pol.observe_verify(n + 1, cost(step, n + 1))
        if plan.source == "drafter":
            pol.observe("drafter", n, acc, None, draft_seconds=0.1)
        lengths.append(n + 1)
    return lengths


def test_policy_follows_verify_costs_that_change_mid_request():
    """Simulated clock: the start-up profile says a 9-token verify costs 1.9 steps (a quiet
    machine); halfway through the request a busy core makes long verifies dearer (9 tokens:
    3.2 steps of the new, slower 1-token step, as measured with one core busy). The policy
    moves to shorter verifies once it has measured them, and its choice then pays more under
    the real costs than the start-up profile's choice would."""
    quiet = [1.0 + 0.1125 * (L - 1) for L in range(1, 10)]  # 1 -> 1.0, 9 -> 1.9
    busy = [1.4 * (1.0 + 0.275 * (L - 1)) for L in range(1, 10)]  # 1 -> 1.4, 9 -> 1.4 * 3.2
    cost = lambda step, L: (quiet if step < 60 else busy)[L - 1]  # noqa: E731
    pol = VerifyPolicy(quiet, 8, probe_every=4)
    lengths = _run_simulated(pol, 160, cost, p_accept=0.85)
    before = np.median(lengths[30:60])
    after = np.median(lengths[130:])
    assert after < before, (before, after)
    # what the policy believes now is close to the real costs at the lengths it uses
    used = int(after)
    assert abs(pol.verify_time[used - 1] - busy[used - 1]) / busy[used - 1] < 0.1
    # and its choice beats the start-up profile's choice under the real (busy) costs
    from mlxspec.engine.policy import best_length, expected_tokens

    p = pol.estimate("drafter").p()
    l_now = best_length(p, pol.verify_time, 0.1, 8)[0]
    l_old = best_length(p, [1.4 * t for t in quiet], 0.1, 8)[0]
    real = lambda l: expected_tokens(p, l) / (0.1 * (l > 0) + busy[l])  # noqa: E731
    assert l_now < l_old and real(l_now) > real(l_old)


def test_policy_cost_tracking_is_a_pure_function_of_history():
    """Two policies fed the same (simulated) history make the same decisions: the cost curve
    is data, never the target's answer to the block being verified (lossless as before)."""
    quiet = [1.0 + 0.1125 * (L - 1) for L in range(1, 10)]
    cost = lambda step, L: quiet[L - 1] * (1 + 0.5 * (step % 7 == 0)) * (1 + 0.1 * L * (step > 40))  # noqa: E731
    a = _run_simulated(VerifyPolicy(quiet, 8), 80, cost, seed=3)
    b = _run_simulated(VerifyPolicy(quiet, 8), 80, cost, seed=3)
    assert a == b


def test_ngram_index_longest_and_most_recent_match():
    ix = NgramIndex(2, 3)
    ix.reset([1, 2, 3, 9, 1, 2, 4, 7, 5, 2])
    assert ix.propose(1, 3) == ([], 0)  # neither (5, 2, 1) nor (2, 1) occurred before
    ix.reset([1, 2, 3, 9, 1, 2, 4, 7, 1])
    # (1, 2) occurs at 0-1 and 4-5: the most recent continuation is 4, 7
    assert ix.propose(2, 2) == ([4, 7], 2)
    assert ix.propose(2, 0) == ([], 0)


def test_ngram_prefers_longer_matches():
    ix = NgramIndex(2, 3)
    ix.reset([7, 1, 2, 3, 6, 1, 2, 4, 7, 1])
    # tail (7, 1, 2): the 3-gram matches at 0-2 -> continuation 3; the 2-gram (1, 2) would say 4
    assert ix.propose(2, 1) == ([3], 3)


def test_ngram_periodic_text_extends_itself():
    ix = NgramIndex(2, 4)
    ix.reset([5, 6, 5, 6, 5])
    toks, n = ix.propose(6, 6)
    assert toks == [5, 6, 5, 6, 5, 6] and n >= 2


def test_ngram_index_rejects_bad_sizes():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


# ----------------------------------------------------------------------------- engine: greedy

@pytest.fixture(scope="module")
def sm(smollm2):
    target, tok = smollm2
    ids = tok.encode(PROMPT, add_special_tokens=False)
    return target, ids, run(target, ids)


def _policy(max_drafts, **kw):
    return VerifyPolicy(FLAT, max_drafts, **kw)


def test_greedy_policy_with_random_drafter_is_lossless_and_mostly_autoregressive(sm, monkeypatch):
    target, ids, ar = sm
    # the policy sees FLAT's costs (in steps) and a block forward of 0.1 step, not the clock: with
    # measured times the count of autoregressive steps followed the host's load (10 of 22 under a
    # parallel suite run, 2026-12-05; 11 needed), a test of the clock rather than of the policy
    observe = VerifyPolicy.observe

    def unclocked(self, source, verified, accepted, confidence=None, draft_seconds=None, verify_seconds=None, **kw):
        return observe(self, source, verified, accepted, confidence, None if draft_seconds is None else 0.1, None, **kw)

    monkeypatch.setattr(VerifyPolicy, "observe", unclocked)
    st = SpecStats()
    d = BlockDrafter(random_drafter(target.info, block=8, taps=(1, 10, 20)), target)
    out = run(target, ids, d, stats=st, policy=_policy(8, probe_every=2))
    assert out == ar
    # most steps verified no draft at all
    assert sum(1 for l in st.verify_lengths if l == 1) >= len(st.verify_lengths) // 2


def test_greedy_policy_with_oracle_is_lossless(sm):
    target, ids, ar = sm
    inner = BlockDrafter(random_drafter(target.info, block=4, taps=(1, 10, 20)), target)
    st = SpecStats()
    out = run(target, ids, Oracle(inner, ids + ar, target.info.vocab_size), stats=st, policy=_policy(4))
    assert out == ar and st.accepted > 0


def test_greedy_ngram_is_lossless_and_accepts_on_repetitive_text(smollm2):
    target, tok = smollm2
    ids = tok.encode("a b c d e f a b c d e f a b c d e f a b c", add_special_tokens=False)
    ar = run(target, ids, max_tokens=20)
    for policy in (None, _policy(8)):
        st = SpecStats()
        out = run(target, ids, NgramDrafter(target.info.vocab_size, 8), max_tokens=20, stats=st, policy=policy)
        assert out == ar
        assert st.accepted / max(st.drafted, 1) > 0.5 and st.tau > 2.0


def test_greedy_lookup_block_drafter_is_lossless(smollm2):
    target, tok = smollm2
    ids = tok.encode("x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", add_special_tokens=False)
    ar = run(target, ids, max_tokens=20)
    d = LookupBlockDrafter(BlockDrafter(random_drafter(target.info, block=4, taps=(1, 10, 20)), target),
                           target.info.vocab_size)
    st = SpecStats()
    assert run(target, ids, d, max_tokens=20, stats=st, policy=_policy(4)) == ar


# ----------------------------------------------------------------------------- engine: sampled

def _sample(target, make, sp, n, policy_kw=None):
    out = []
    for seed in range(n):
        pol = None if policy_kw is None else VerifyPolicy([1.0, 1.05, 1.1, 1.15], 3, **policy_kw)
        toks = [t for s in generate_steps(target, TINY_PROMPT, drafter=make(), max_tokens=N_TOKENS, sampling=sp, seed=seed,
                                          policy=pol) for t in s]
        assert len(toks) == N_TOKENS
        out.append(toks)
    return np.array(out)


@pytest.mark.parametrize("kind", ["ngram", "dspark+policy", "dspark+ngram+policy"])
def test_sampling_with_policy_and_lookup_is_lossless(tiny, kind):  # noqa: F811  (the fixture)
    target, _, dspark = tiny
    sp = SamplingParams(temperature=1.0)
    make = {
        "ngram": lambda: NgramDrafter(V, 3, n_min=1, n_max=2),
        "dspark+policy": lambda: BlockDrafter(dspark, target),
        "dspark+ngram+policy": lambda: LookupBlockDrafter(BlockDrafter(dspark, target), V, n_min=1, n_max=2),
    }[kind]
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)
    res = distribution_check(_sample(target, make, sp, 1500, {"probe_every": 2}), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"


def test_verify_profile_is_keyed_by_the_blas_library_and_monotone(monkeypatch):
    """A profile measured without the OpenBLAS preload (netlib's reference BLAS: ~5x slower and
    another shape) is never reused with it, and a longer verify never measures cheaper than a
    shorter one (noise is not a profile)."""
    from mlxspec.engine import profile
    from test_engine import tiny_llama

    target = tiny_llama(1)
    monkeypatch.setattr(profile, "_loaded_openblas_path", lambda: None)
    netlib = profile._key(target)
    monkeypatch.setattr(profile, "_loaded_openblas_path", lambda: "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    assert profile._key(target) != netlib
    sps = profile.measure_verify_sps(target, 6, context=16, repeats=2)
    assert sorted(sps) == list(range(1, 7))
    assert all(sps[L + 1] <= sps[L] for L in range(1, 6))


def test_a_chain_drafter_drafts_only_the_length_that_pays():
    """EAGLE-3 drafts one forward per token: the policy prices each draft and asks for only the
    drafts that pay, where a block drafter (one forward for the whole block) drafts it all and
    truncates afterwards. Verify cost flat; acceptance 0.6 per position."""
    vt = [1.0] * 8
    for chain, want_full in ((True, False), (False, True)):
        pol = VerifyPolicy(vt, 7, chain=chain)
        for _ in range(40):
            pol.estimate(Source.DRAFTER).observe(7, 4)
        pol.draft_time[Source.DRAFTER] = 0.15 if chain else 0.15 * 7  # per draft / per block
        plan = pol.plan(7)
        assert plan.source.kind is Kind.DRAFTER
        assert (plan.n == 7) == want_full and 1 <= plan.n <= 7
        # what it observes is per drafted token for a chain, per block otherwise
        pol.observe(plan.source, plan.n, 0, draft_seconds=0.15 * plan.n)
        assert pol.draft_time[Source.DRAFTER] == pytest.approx(0.15 if chain else 0.15 * 7 * 0.8 + 0.15 * 7 * 0.2)



def test_lookup_beside_a_drafter_proposes_past_the_drafters_length_and_the_drafter_never_does(smollm2):
    """Beside the shipped EAGLE-3 chain (7 drafts), under the adaptive policy, prompt lookup may
    propose up to 16 (an agent's file sent back: a long earlier match is worth a long verify);
    the policy plans the drafter at most its own 7 and a lookup that has been right up to 16;
    the drafter is never asked for more than 7 through the engine, whose output equals
    autoregressive. A flag that pins lengths keeps the lookup at the drafter's length."""
    from mlxspec import api

    pol = VerifyPolicy([1.0] + [1.02] * 16, 16, chain=True, model_cap=7)
    for _ in range(20):  # both always right so far
        pol.observe(Source.DRAFTER, 7, 7)
        pol.observe(Source.lookup(4), 16, 16)
    assert pol.plan(16, 0, 0, True) == Plan(Source.DRAFTER, 7)
    assert pol.plan(16, 16, 4, True) == Plan(Source.lookup(4), 16)

    target, tok = smollm2
    ids = tok.encode("x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", add_special_tokens=False)
    ar = run(target, ids, max_tokens=40)
    spec = api.Speculator.build(api.SpecConfig(draft=str(api.shipped_drafter("eagle3"))), target)
    assert "lookup<=16" in spec.description
    d = spec.make_drafter(target)
    assert (d.max_drafts, d.model_max) == (16, 7)
    asked, proposed = [], []
    inner, look = d.block.draft, d.lookup
    d.block.draft = lambda anchor, n, sp, rng, **kw: asked.append(n) or inner(anchor, n, sp, rng, **kw)
    d.lookup = lambda anchor, n: (lambda r: proposed.append(len(r[0])) or r)(look(anchor, n))
    assert [t for s in spec.session(target, ids, max_tokens=40, drafter=d) for t in s] == ar
    assert max(proposed) > 7 and (not asked or max(asked) <= 7), (proposed, asked)
    pinned = api.Speculator.build(api.SpecConfig(draft=str(api.shipped_drafter("eagle3")), num_draft_tokens=5), target)
    assert pinned.make_drafter(target).max_drafts == 5 and "lookup<=" not in pinned.description


def test_chain_draft_time_is_per_forward_run():
    """A chain drafter's draft time is learnt per forward: by the plan's length, or by the
    forwards the step reports (a tree that stopped growing early ran fewer than planned)."""
    pol = VerifyPolicy(FLAT, 8, chain=True)
    pol.last_drafted = 6  # what plan() set
    pol.observe(Source.DRAFTER, 2, 1, None, 0.06, None)
    assert pol.draft_time[Source.DRAFTER] == pytest.approx(0.01)
    pol = VerifyPolicy(FLAT, 8, chain=True)
    pol.last_drafted = 6
    pol.observe(Source.DRAFTER, 2, 1, None, 0.06, None, drafted=3)
    assert pol.draft_time[Source.DRAFTER] == pytest.approx(0.02)
    assert pol.last_drafted == 6  # the plan's record is left alone


def test_verify_profile_measures_once_for_every_shorter_length(monkeypatch, tmp_path):
    """The cached curve serves every verify length up to the longest measured (a drafter with
    a shorter block reads its first lengths); the first curve spans at least MIN_LEN (17: the
    default drafter's and lookup's longest verify), so a short chain asked for first does not
    make the default measure again; a longer request measures the longer curve."""
    from mlxspec.engine import profile
    from test_engine import tiny_llama

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    target = tiny_llama(1)
    measured = []
    real = profile.measure_verify_sps

    def counted(t, max_len, **kw):
        measured.append(max_len)
        return real(t, max_len, context=16, repeats=1)

    monkeypatch.setattr(profile, "measure_verify_sps", counted)
    assert profile.MIN_LEN == 17
    chain = profile.verify_profile(target, 9)  # an EAGLE-3 chain of 8, asked for first
    default = profile.verify_profile(target, 17)
    short = profile.verify_profile(target, 3)
    assert measured == [17] and sorted(chain) == list(range(1, 10)) and sorted(default) == list(range(1, 18))
    assert chain == {L: default[L] for L in range(1, 10)} and short == {L: default[L] for L in (1, 2, 3)}
    longer = profile.verify_profile(target, 20)
    assert measured == [17, 20] and sorted(longer) == list(range(1, 21))
    assert profile.verify_profile(target, 17) == {L: longer[L] for L in range(1, 18)} and measured == [17, 20]


def test_a_chain_drafter_probe_drafts_only_what_it_verifies():
    """A probe of a losing chain drafter (EAGLE-3: one forward per draft) drafts the one draft it
    verifies, not its full chain of 7 (6 wasted forwards per probe); a block drafter's probe asks
    for its whole block (one forward whatever the length)."""
    for chain, want in ((True, 1), (False, 7)):
        pol = VerifyPolicy(FLAT, 7, probe_every=2, chain=chain)
        for _ in range(6):
            pol.observe(Source.DRAFTER, 1, 0)  # never right: the autoregressive step wins
        plans = [pol.plan(7) for _ in range(4)]
        probes = [p for p in plans if p.probe]
        assert probes and all(p.source == Source.DRAFTER and p.n == want for p in probes), plans
        assert pol.last_drafted == (want if plans[-1].probe else 0)


def test_a_drafter_near_break_even_is_not_shut_out_by_a_few_unlucky_probes():
    """EAGLE-3 at T=1 accepts ~0.3 of its first drafts, where one draft pays ~1.1x on this CPU's
    costs. Its estimate dips below break-even by chance; probes then failing one after another
    used to double their spacing to 64 steps, and the policy memory carried the lock-out into
    every later request (the bench's EAGLE-3 at T=1: tau 1.008). Probes stay frequent while the
    estimate given one standard deviation of doubt would pay; a drafter that is never right
    is still spaced out."""
    vt = [1.0, 1.07, 1.10, 1.15, 1.33, 1.45, 1.45, 1.56]  # this host's profile with the small GEMM
    for z, spaced_out in ((0.0, True), (1.0, False)):
        pol = VerifyPolicy(vt, 7, probe_every=4, max_probe_every=64, chain=True, probe_z=z)
        pol.observe(Source.DRAFTER, 1, 0, None, 0.1)  # draft time: 0.1 steps a draft (break-even ~0.17)
        # 4 right in 10, then an unlucky stretch of 11 wrong (at 0.3, one request in ~50 has one)
        for a in [1, 0, 0, 1, 0, 1, 0, 0, 1, 0] + [0] * 11:
            pol.last_probe = True
            pol.observe(Source.DRAFTER, 1, a, None, 0.1)
        assert pol.plan(7).source.kind is Kind.NONE  # below break-even now: autoregressive
        assert (pol.probe_interval(Source.DRAFTER) > 4) is spaced_out
    never = VerifyPolicy(vt, 7, probe_every=4, max_probe_every=64, chain=True)
    for _ in range(25):
        never.last_probe = True
        never.observe(Source.DRAFTER, 1, 0, None, 0.06)
    assert never.probe_interval(Source.DRAFTER) == 64
