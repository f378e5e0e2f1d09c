"""The suffix index (a generalized suffix automaton over documents) and suffix drafting:
exact continuations and counts on hand-made sequences, the same as a brute-force count on
random interleaved documents, eviction order, the budget never exceeded, and proposals."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mlxspec.engine.policy import Source
from mlxspec.engine.suffix import Matcher, SuffixIndex, SuffixLookup, match_bucket

from test_engine import tiny  # noqa: F401  (a fixture)


def brute_continuations(docs: list[list[int]], context: list[int]) -> tuple[int, dict[int, int]]:
    """The longest suffix of context followed by some token in some document -> (its
    length, {next token: count over all its occurrences})."""
    for m in range(len(context), 0, -1):
        pat = context[-m:]
        counts: dict[int, int] = {}
        for d in docs:
            for i in range(len(d) - m):
                if d[i : i + m] == pat:
                    counts[d[i + m]] = counts.get(d[i + m], 0) + 1
        if counts:
            return m, counts
    return 0, {}


def brute_longest(docs: list[list[int]], query: list[int]) -> int:
    """The length of the longest suffix of query that occurs in some document."""
    for m in range(len(query), 0, -1):
        pat = query[-m:]
        if any(d[i : i + m] == pat for d in docs for i in range(len(d) - m + 1)):
            return m
    return 0


def test_continuations_hand_made():
    ix = SuffixIndex()
    ix.open([1, 2, 3, 1, 2, 4, 1, 2, 3])
    # [1, 2] occurs three times, twice followed by 3, once by 4, once at the end (no continuation)
    assert ix.continuations([5, 1, 2]) == (2, {3: 2, 4: 1})
    assert ix.continuations([2, 3, 1]) == (3, {2: 1})
    assert ix.continuations([9]) == (0, {})
    # [1, 2, 3] occurs twice, the second at the end: only the first one continues
    assert ix.continuations([1, 2, 3]) == (3, {1: 1})


def test_continuations_across_documents():
    ix = SuffixIndex()
    for d in ([1, 2, 3], [1, 2, 4], [7, 1, 2, 3]):
        ix.open(d)
    assert ix.continuations([1, 2]) == (2, {3: 2, 4: 1})
    assert ix.continuations([7, 1]) == (2, {2: 1})
    assert len(ix) == 10


@pytest.mark.parametrize("seed", range(6))
def test_same_as_brute_force_on_interleaved_documents(seed):
    """Documents grow in any interleaving (concurrent requests); every context's longest
    continuing match and its counts equal a brute-force count."""
    rng = random.Random(seed)
    ix = SuffixIndex(max_occ=10_000)
    docs = {ix.open(): [] for _ in range(3)}
    for _ in range(120):
        d = rng.choice(list(docs))
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
        ix.extend(d, toks)
        docs[d] += toks
        assert ix.docs[d] == docs[d]
    for _ in range(60):
        ctx = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        assert ix.continuations(ctx) == brute_continuations(list(docs.values()), ctx), ctx


def test_eviction_drops_the_least_recently_used_documents():
    ix = SuffixIndex(budget=10)  # evicts down to 7 tokens
    a = ix.open([1, 2, 3, 4])
    b = ix.open([5, 6, 7, 8])
    ix.touch([a])  # a is used again: b is now the least recent
    c = ix.open([9, 10, 11, 12])
    assert list(ix.docs) == [a, c] and len(ix) == 8
    assert ix.continuations([5, 6]) == (0, {})  # b's text is gone
    assert ix.continuations([2]) == (1, {3: 1}) and ix.continuations([10]) == (1, {11: 1})
    d = ix.open([13, 14, 15])  # 11 > 10: a (least recent) goes
    assert list(ix.docs) == [c, d] and len(ix) == 7


def test_a_proposal_counts_as_a_use():
    ix = SuffixIndex(budget=10)
    a = ix.open([1, 2, 3, 4])
    b = ix.open([5, 6, 7, 8])
    v, l = ix.find([1])
    assert ix.propose(v, l, 2, 2)[0] == [3, 4]  # drafted from a: a is the most recent now
    ix.open([9, 10, 11])
    assert a in ix.docs and b not in ix.docs


def test_one_document_over_the_budget_keeps_its_tail():
    ix = SuffixIndex(budget=8)
    d = ix.open(range(20))
    assert len(ix) <= 8 and ix.docs[d] == list(range(20))[-len(ix):]
    assert ix.continuations([18]) == (1, {19: 1})


@pytest.mark.parametrize("seed", range(3))
def test_budget_never_exceeded_and_index_stays_exact(seed):
    rng = random.Random(seed)
    ix = SuffixIndex(budget=40, max_occ=10_000)
    open_docs = [ix.open() for _ in range(2)]
    for step in range(200):
        if rng.random() < 0.1:
            open_docs[rng.randrange(2)] = ix.open()
        d = rng.choice(open_docs)
        ix.extend(d, [rng.randrange(4) for _ in range(rng.randrange(1, 6))])
        assert len(ix) <= 40
        assert len(ix) == sum(len(t) for t in ix.docs.values())
        if step % 20 == 0:
            ctx = [rng.randrange(4) for _ in range(5)]
            assert ix.continuations(ctx) == brute_continuations(list(ix.docs.values()), ctx)
    assert ix.generation > 0  # it did evict


@pytest.mark.parametrize("seed", range(3))
def test_matcher_finds_the_longest_match_of_a_growing_query(seed):
    rng = random.Random(seed)
    ix = SuffixIndex()
    for _ in range(3):
        ix.open([rng.randrange(3) for _ in range(20)])
    m = Matcher(ix, depth=1000)
    query: list[int] = []
    for _ in range(100):
        query.append(rng.randrange(3))
        m.feed(query[-1:])
        v, l = m.where()
        assert l == brute_longest(list(ix.docs.values()), query)
        assert ix.len[ix.link[v]] < l <= ix.len[v]


@pytest.mark.parametrize("seed", range(3))
def test_matcher_stays_valid_while_the_index_grows_and_is_rebuilt(seed):
    """Text added elsewhere between two tokens can make an earlier match longer than the
    matcher knows (it is a lower bound then); after a rebuild it is found again exactly."""
    rng = random.Random(seed)
    ix = SuffixIndex(budget=60)
    other = ix.open()
    m = Matcher(ix, depth=1000)
    query: list[int] = []
    for _ in range(150):
        gen = ix.generation
        ix.extend(other, [rng.randrange(3) for _ in range(rng.randrange(0, 3))])
        query.append(rng.randrange(3))
        m.feed(query[-1:])
        v, l = m.where()
        longest = brute_longest(list(ix.docs.values()), query)
        assert l <= longest and (l == longest or ix.generation == gen)
        assert l == 0 or ix.len[ix.link[v]] < l <= ix.len[v]
        if l:
            assert ix.continuations(query[-l:])[0] >= 0 and brute_longest(list(ix.docs.values()), query[-l:]) == l
    assert ix.generation > 0


def test_propose_copies_the_continuation_scaled_by_the_match():
    text = [7, 1, 2, 3, 4, 5, 8, 9, 9, 6, 1, 2]
    ix = SuffixIndex()
    d = ix.open(text)
    # anchor 3 after [1, 2]: the match [1, 2, 3] (3 tokens) allows alpha x 3 drafts
    assert ix.propose(ix.last[d], len(text), 3, 16, own=d) == ([4, 5, 8], 3, 3.0)
    assert ix.propose(ix.last[d], len(text), 3, 16, own=d, alpha=2.0) == ([4, 5, 8, 9, 9, 6], 3, 6.0)
    assert ix.propose(ix.last[d], len(text), 3, 2, own=d)[0] == [4, 5]  # capped by n


def test_periodic_text_extends_itself():
    text = [1, 2, 3, 1, 2, 3, 1, 2]
    ix = SuffixIndex()
    d = ix.open(text)
    # text + anchor 3 ends in [1, 2, 3, 1, 2, 3] (6 tokens, at 0..5): its continuation runs past
    # the text into the anchor and the drafts themselves
    assert ix.propose(ix.last[d], len(text), 3, 16, own=d) == ([1, 2, 3, 1, 2, 3], 6, 6.0)


def test_propose_stops_below_the_minimum_probability():
    text = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1]
    ix = SuffixIndex()
    d = ix.open(text)
    # anchor 2 after [1]: [1, 2] was followed by 3 twice and by 4 once -> 3 at 2/3, then 1 at 2/3
    toks, match, score = ix.propose(ix.last[d], len(text), 2, 8, own=d)
    assert (toks, match) == ([3, 1], 2) and score == pytest.approx(4 / 3)
    assert ix.propose(ix.last[d], len(text), 2, 8, own=d, min_prob=0.7)[0] == []
    assert ix.propose(ix.last[d], len(text), 9, 8, own=d)[0] == []  # never seen


def test_propose_many_gives_every_distinct_continuation_by_count():
    text = [1, 2, 3, 1, 2, 3, 1, 2, 4, 1]
    ix = SuffixIndex()
    d = ix.open(text)
    # anchor 2 after [1]: [1, 2] was followed by 3 1 2 twice and by 4 1 once, whose next token is
    # the request's own continuation past its end: the anchor 2
    assert ix.propose_many(ix.last[d], len(text), 2, 3, 4, own=d) == ([[3, 1, 2], [4, 1, 2]], 2, [2, 1])
    assert ix.propose_many(ix.last[d], len(text), 2, 3, 1, own=d)[0] == [[3, 1, 2]]  # width 1
    assert ix.propose_many(ix.last[d], len(text), 9, 3, 4, own=d)[0] == []  # never seen


def test_equal_counts_go_to_the_most_recent_occurrence():
    text = [1, 2, 3, 1, 2, 4, 1]
    ix = SuffixIndex()
    d = ix.open(text)
    # [1, 2] was followed once by 3, then once by 4: 4 (at 1/2), then the 1 that followed it
    toks, match, score = ix.propose(ix.last[d], len(text), 2, 8, own=d)
    assert (toks, match, score) == ([4, 1], 2, 1.0)


def test_lookup_drafts_from_the_shared_index_of_earlier_requests():
    shared = SuffixIndex()
    first = SuffixLookup(shared, prompt_tail=2)
    first.reset([4, 5, 6])  # an earlier request: its output (after its prompt's tail) enters the shared index
    first.extend([10, 11, 12, 13, 14, 15, 16])
    assert shared.docs[first.shared_doc] == [5, 6, 10, 11, 12, 13, 14, 15, 16]
    lk = SuffixLookup(shared)
    lk.reset([5, 10, 11, 12])
    assert lk.propose(13, 8) == ([14, 15, 16], 4)  # [10, 11, 12, 13] matched, 3 drafts
    assert lk.propose_many(13, 8, 4) == ([[14, 15, 16]], 4)
    assert SuffixLookup(None).propose(13, 8) == ([], 0)
    alone = SuffixLookup(None)
    alone.reset([5, 10, 11, 12])
    assert alone.propose(13, 8) == ([], 0)  # only the shared index knew
    # 3 tokens of another request's text are weak evidence: the shared index needs 4 by default
    short = SuffixLookup(shared)
    short.reset([5, 11, 12])
    assert short.propose(13, 8) == ([], 0) and short.propose_many(13, 8, 4) == ([], 0)
    three = SuffixLookup(shared, shared_min_match=3)
    three.reset([5, 11, 12])
    assert three.propose(13, 8) == ([14, 15, 16], 3)
    with pytest.raises(ValueError, match="shared_min_match must be >= 1"):
        SuffixLookup(shared, shared_min_match=0)


def test_lookup_takes_the_better_scored_proposal():
    shared = SuffixIndex()
    shared.open([3, 4, 0, 1, 2, 9, 9])  # one earlier answer: 3 4 0 1 2 -> 9 9
    lk = SuffixLookup(shared, alpha=2.0, prompt_tail=0)
    lk.reset([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1])  # this request twice says 1 2 -> 3 4
    # both match 5 long ([3, 4, 0, 1, 2]): local 8 drafts for sure, shared 2 drafts
    assert lk.propose(2, 8) == ([3, 4, 0, 1, 2, 3, 4, 0], 5)
    lk.reset([5, 3, 4, 0, 1])  # nothing here: the earlier answer drafts
    assert lk.propose(2, 8) == ([9, 9], 5)


def test_a_proposal_says_whether_earlier_requests_made_it():
    """The match length a suffix lookup hands the policy says where the match was found
    (`Match.shared`), so the policy keeps apart estimates for the two (`Source.lookup`)."""
    shared = SuffixIndex()
    shared.open([3, 4, 0, 1, 2, 9, 9])
    lk = SuffixLookup(shared, alpha=2.0, prompt_tail=0)
    lk.reset([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1])
    toks, m = lk.propose(2, 8)
    assert (m, m.shared, Source.lookup(m)) == (5, False, Source.lookup(5))
    many, m = lk.propose_many(2, 8, 4)
    assert many[0] == [3, 4, 0, 1, 2, 3, 4, 0] and not m.shared
    lk.reset([5, 3, 4, 0, 1])
    toks, m = lk.propose(2, 8)
    assert (toks, m, m.shared) == ([9, 9], 5, True)
    assert Source.lookup(m) == Source.lookup(5, shared=True) == Source.of("lookup5s") != Source.lookup(5)
    many, m = lk.propose_many(2, 8, 4)
    assert many == [[9, 9]] and m.shared


def test_no_proposal_from_a_match_of_the_anchor_alone():
    """SuffixLookup's shortest match is 2 tokens, as prompt lookup's shortest n-gram: the anchor
    alone matched any earlier occurrence of the token (on the agent trace beside EAGLE-3 such
    proposals were accepted 0 times in 16 verifies); the index itself still proposes from one
    token where asked (min_match=1, ArcticInference's rule)."""
    text = [1, 2, 3, 4, 5, 6, 7]
    ix = SuffixIndex()
    d = ix.open(text)
    # anchor 3 after [.., 7]: only [3] matches
    assert ix.propose(ix.last[d], len(text), 3, 8, own=d, alpha=4.0) == ([4, 5, 6, 7], 1, 4.0)
    assert ix.propose(ix.last[d], len(text), 3, 8, own=d, alpha=4.0, min_match=2)[0] == []
    assert ix.propose_many(ix.last[d], len(text), 3, 2, 4, own=d)[0] == [[4, 5]]
    assert ix.propose_many(ix.last[d], len(text), 3, 2, 4, own=d, min_match=2)[0] == []
    lk = SuffixLookup(None)
    lk.reset(text)
    assert lk.propose(3, 8) == ([], 0) and lk.propose_many(3, 8, 4) == ([], 0)
    lk.reset(text + [2])  # [2, 3] now matches: 2 tokens
    assert lk.propose(3, 8) == ([4, 5, 6, 7, 2, 3, 4, 5], 2)
    one = SuffixLookup(None, min_match=1)
    one.reset(text)
    assert one.propose(3, 8) == ([4, 5, 6, 7], 1)
    with pytest.raises(ValueError, match="min_match must be >= 1"):
        SuffixLookup(None, min_match=0)


def test_match_buckets():
    assert [match_bucket(m) for m in (0, 1, 4, 5, 7, 8, 15, 16, 31, 32, 500)] == [0, 1, 4, 5, 5, 8, 8, 16, 16, 32, 32]


# ----------------------------------------------------------------------------- the engine with suffix drafting

def test_greedy_suffix_drafting_equals_autoregressive_and_learns_from_earlier_requests(smollm2):
    from mlxspec.engine.drafting import BlockDrafter
    from mlxspec.engine.loop import SpecStats
    from mlxspec.engine.ngram import LookupBlockDrafter, NgramDrafter
    from mlxspec.engine.policy import VerifyPolicy
    from test_engine import random_drafter, run

    target, tok = smollm2
    V = target.info.vocab_size
    ids = tok.encode("Write the numbers from one to twenty in words, separated by commas:", add_special_tokens=False)
    ar = run(target, ids, max_tokens=24)
    shared = SuffixIndex(1000)
    accepted = []
    for _ in range(2):  # the second request drafts from the first one's answer
        st = SpecStats()
        assert run(target, ids, NgramDrafter(V, 16, index=SuffixLookup(shared)), max_tokens=24, stats=st) == ar
        accepted.append(st.accepted)
    assert accepted[1] >= 20 and accepted[1] > accepted[0]
    block = BlockDrafter(random_drafter(target.info, block=4, taps=(1, 10, 20)), target)
    d = LookupBlockDrafter(block, V, index=SuffixLookup(shared))
    st = SpecStats()
    assert run(target, ids, d, max_tokens=24, stats=st, policy=VerifyPolicy([1.0, 1.1, 1.2, 1.3, 1.4], 4)) == ar
    assert st.by_source.get("lookup", [0, 0])[1] > 0


def test_sampling_with_a_shared_suffix_index_is_lossless(tiny):  # noqa: F811  (the fixture)
    """Every sample drafts from the earlier samples' outputs (a small budget: evictions and
    rebuilds happen between them); the sampled sequences keep the target's distribution."""
    import numpy as np

    from mlxspec.engine.loop import SpecStats, generate_steps
    from mlxspec.engine.ngram import NgramDrafter
    from mlxspec.engine.policy import VerifyPolicy
    from mlxspec.engine.verify import SamplingParams
    from test_engine import N_TOKENS, TINY_PROMPT, V, distribution_check, exact_distribution

    target, _, _ = tiny
    sp = SamplingParams(temperature=1.0)
    shared = SuffixIndex(budget=64)
    out, st = [], SpecStats()
    for seed in range(1500):
        # shared_min_match 2: with 4-token answers, a 4-token match would rarely occur
        d = NgramDrafter(V, 3, index=SuffixLookup(shared, prompt_tail=2, shared_min_match=2))
        pol = VerifyPolicy([1.0, 1.05, 1.1, 1.15], 3, probe_every=2) if seed % 2 else None
        toks = [t for s in generate_steps(target, TINY_PROMPT, drafter=d, max_tokens=N_TOKENS, sampling=sp, seed=seed,
                                          policy=pol, stats=st) for t in s]
        assert len(toks) == N_TOKENS
        out.append(toks)
    res = distribution_check(np.array(out), exact_distribution(target, TINY_PROMPT, sp, N_TOKENS))
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"
    assert shared.generation > 0 and len(shared) <= 64
    assert st.drafted > 1000 and st.accepted > 100  # it did draft from the earlier samples


# ----------------------------------------------------------------------------- where the shared index lives

def _chat_ids(tok, text: str) -> list[int]:
    from mlxspec.tokenizer import apply_chat_template

    return tok.encode(apply_chat_template(tok, [{"role": "user", "content": text}]), add_special_tokens=False)


def _modeled_costs():
    """scripts/lookup_heldout.py's fixed_costs: the policy sees the committed AVX-512 verify
    profile and no clock."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_lookup_heldout", root / "scripts" / "lookup_heldout.py")
    lh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lh)
    return lh.fixed_costs(1.45, lh.read_profile(str(root / "docs/bench/verify-profile-smollm2-avx512-2026-12-05.json")))


def test_one_speculator_drafts_a_repeated_request_from_its_first_answer(smollm2):
    """The Python API: a speculator's requests share one suffix index, so the same request
    a second time is drafted from the first answer (the adaptive policy, as by default)."""
    from mlxspec import api

    target, tok = smollm2
    spec = api.Speculator.build(api.SpecConfig(spec_type="ngram", lookup="suffix", policy="adaptive",
                                               num_draft_tokens=8), target)
    prompt = _chat_ids(tok, "Explain in two sentences why the sky is blue.")
    runs = []
    # the adaptive policy sets each verify's length from the costs it measures; pinned to a
    # committed verify profile (as the benches' --modeled runs are), the counts do not depend on
    # how busy the host is (measured costs: 24 of 40 in one CI run on 2 shared cores; pinned: 2, then 34)
    with _modeled_costs():
        for _ in range(2):
            last = None
            for r in api.stream_generate(target, tok, prompt, spec, max_tokens=40):
                last = r
            runs.append((last.stats.accepted, last.generation_tokens))
    (first, n1), (second, n2) = runs
    assert n1 == n2 == 40
    assert second >= 30 and second >= first + 25, runs
    assert len(spec.suffix) >= 40
    other = api.Speculator.build(api.SpecConfig(spec_type="ngram", lookup="suffix", suffix_budget=0), target)
    assert other.suffix is None  # budget 0: each request drafts only from itself
    assert api.Speculator.build(api.SpecConfig(spec_type="ngram"), target).suffix is None  # prompt lookup: none


def _ask(worker, ids, tenant, n=32):
    """One greedy job on a running server worker -> (text, accepted drafts)."""
    import asyncio
    import time

    from mlxspec.server.job import Job

    async def go():
        job = Job(ids=ids, max_tokens=n, temp=0.0, top_p=1.0, top_k=0, seed=0, stop=[], speculative=True,
                  use_cache=False, deadline=time.perf_counter() + 600, loop=asyncio.get_running_loop(), tenant=tenant)
        assert worker.try_submit(job)
        text = ""
        while True:
            ev = await job.events.get()
            if ev[0] == "text":
                text += ev[1]
            elif ev[0] == "done":
                return text, ev[2]["mlxspec"]["accepted"]
            else:
                raise AssertionError(ev)
    return asyncio.run(go())


def test_server_keeps_one_suffix_index_per_api_key(smollm2, smollm2_path):
    """Another key's text never raises this key's accepted drafts; with --suffix-share-keys it
    does. The fixed policy makes the counts exact; the batched path (the default) runs them."""
    from mlxspec import api
    from mlxspec.server.worker import Worker

    _, tok = smollm2
    ids = _chat_ids(tok, "Explain in two sentences why the sky is blue.")
    cfg = api.SpecConfig(spec_type="ngram", lookup="suffix", num_draft_tokens=8)
    w = Worker(dict(model=None, config=cfg), 0, 4)
    w.start()
    try:
        text0, cold = _ask(w, ids, tenant="k0")
        assert _ask(w, ids, tenant="k1") == (text0, cold)  # key 1 is not drafted from key 0's answer
        text, warm = _ask(w, ids, tenant="k0")  # key 0 is
        assert text == text0 and warm >= cold + 15
        assert len(w.suffix_indexes()) == 2 and all(len(s) >= 32 for s in w.suffix_indexes())
        metrics = w.metrics.render(0, None, w.suffix_indexes())
        assert "mlxspec_suffix_indexes 2" in metrics and f"mlxspec_suffix_index_budget_tokens {api.SUFFIX_BUDGET}" in metrics
        w.share_keys = True  # as --suffix-share-keys: key 1 now drafts from what key 0 sent through the shared index
        _ask(w, ids, tenant="k0")
        assert _ask(w, ids, tenant="k1") == (text0, warm)
    finally:
        w.stop()


def test_the_suffix_cache_is_saved_while_the_server_runs(smollm2, smollm2_path, tmp_path):
    """--suffix-cache-every: a finished request's text reaches the file while the server runs
    (a crash loses at most the interval, not everything since the start), and a server started
    from that file alone drafts the same request from the first answer. The first worker batches
    (the default), the second runs one request at a time: both loops save when due."""
    import json
    import shutil
    import time

    from mlxspec import api
    from mlxspec.server.worker import Worker

    _, tok = smollm2
    ids = _chat_ids(tok, "Explain in two sentences why the sky is blue.")
    cfg = api.SpecConfig(spec_type="ngram", lookup="suffix", num_draft_tokens=8)
    path, crashed = tmp_path / "suffix.json", tmp_path / "as-left-by-a-crash.json"
    w = Worker(dict(model=None, config=cfg), 0, 4, suffix_cache=str(path), suffix_cache_every=0.2)
    w.start()
    try:
        assert not path.exists()  # nothing learned yet: nothing written
        text0, cold = _ask(w, ids, tenant="k0")
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.copy(path, crashed)  # what a crash now would leave: the shutdown save below never counts
        assert w.unsaved == 0
    finally:
        w.stop()
    saved = json.loads(crashed.read_text())["indexes"]
    assert sum(len(d) for d in saved["k0"]) >= 32  # the key's index holds the prompt's tail and the answer
    again = Worker(dict(model=None, config=cfg), 0, 4, max_batch=1, suffix_cache=str(crashed), suffix_cache_every=0.2)
    again.start()
    try:
        text, warm = _ask(again, ids, tenant="k0")
        assert text == text0 and warm >= cold + 15  # drafted from the answer the periodic save kept
    finally:
        again.stop()


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_suffix_cache_interval_is_one_line_and_exit_2(value):
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "mlxspec.cli", "serve", "--lookup", "suffix", "--suffix-cache", "s.json",
                          "--suffix-cache-every", value], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"mlxspec: error: --suffix-cache-every {float(value)} is out of range: use a number of seconds, 0 or more "
        "(0 saves at shutdown only)"], bad.stderr


def test_several_api_keys_each_a_tenant():
    from starlette.requests import Request

    from mlxspec.server.errors import APIError
    from mlxspec.server.params import check_key

    def req(key):
        return Request({"type": "http", "headers": [(b"authorization", f"Bearer {key}".encode())]})

    assert check_key(None, req("x")) is None
    a1, b2 = check_key("a1,b2", req("a1")), check_key("a1,b2", req("b2"))
    assert a1 != b2 and check_key("b2,a1", req("a1")) == check_key("a1", req("a1")) == a1  # not its place in the list
    assert "a1" not in a1
    with pytest.raises(APIError):
        check_key("a1,b2", req("a1,b2"))


def _bare_worker():
    """A server worker's suffix-index side only (no model): what `suffix_cache` reads and fills."""
    from mlxspec import api
    from mlxspec.server.worker import Worker

    w = Worker.__new__(Worker)
    w.spec, w.tenants, w.share_keys = api.Speculator(suffix=SuffixIndex(api.SUFFIX_BUDGET)), {}, False
    return w


def test_suffix_cache_file_round_trip_is_atomic(tmp_path):
    import io

    from mlxspec.server import suffix_cache

    w = _bare_worker()
    w.tenant_spec("k0").suffix.open([1, 2, 3])
    w.tenant_spec("k0").suffix.open([4, 5])
    w.tenant_spec("k1").suffix.open([6, 7, 8])
    w.spec.suffix.open([9])
    path = tmp_path / "suffix.json"
    suffix_cache.save(str(path), w, "m.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["suffix.json"]  # no temporary file left
    again, log = _bare_worker(), io.StringIO()
    suffix_cache.restore(str(path), again, "m.gguf", log)
    assert log.getvalue() == ""
    assert again.tenant_spec("k0").suffix.documents() == [[1, 2, 3], [4, 5]]  # least recently used first
    assert again.tenant_spec("k1").suffix.documents() == [[6, 7, 8]]
    assert again.spec.suffix.documents() == [[9]]
    assert again.tenant_spec("k1").suffix.continuations([6, 7]) == (2, {8: 1})


@pytest.mark.parametrize("content, why", [
    ("{not json", "Expecting property name"),
    ('{"format": "mlxspec-suffix-cache", "version": 1, "model": "other.gguf", "indexes": {}}', "another model"),
    ('{"format": "mlxspec-suffix-cache", "version": 1, "model": "m.gguf", "indexes": {"k0": [[1, -2]]}}', "malformed"),
    ('[1, 2]', "not an mlxspec suffix cache"),
])
def test_a_bad_suffix_cache_is_one_line_and_an_empty_start(tmp_path, content, why):
    import io

    from mlxspec.server import suffix_cache

    path = tmp_path / "suffix.json"
    path.write_text(content)
    w, log = _bare_worker(), io.StringIO()
    suffix_cache.restore(str(path), w, "m.gguf", log)
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mlxspec serve: --suffix-cache {path}: cannot use it (")
    assert lines[0].endswith("starting without it") and why in lines[0]
    assert w.tenants == {} and len(w.spec.suffix) == 0
    suffix_cache.restore(str(tmp_path / "absent.json"), w, "m.gguf", log)  # no file: an empty start, nothing said
    assert len(log.getvalue().splitlines()) == 1


def test_suffix_flags_reach_the_config():
    from mlxspec import api, cli
    from mlxspec.args import spec_config

    a = cli.build_parser().parse_args(["serve", "--spec-type", "ngram", "--lookup", "suffix", "--suffix-budget", "100",
                                       "--suffix-share-keys", "--suffix-cache", "s.json"])
    assert spec_config(a) == api.SpecConfig(spec_type="ngram", lookup="suffix", suffix_budget=100)
    assert a.suffix_share_keys and a.suffix_cache == "s.json"
    assert spec_config(cli.build_parser().parse_args(["generate", "--prompt", "x"])).lookup == "ngram"  # the default
    with pytest.raises(api.MlxspecError, match="--lookup 'tree' is not one of ngram, suffix"):
        api.SpecConfig(lookup="tree")


def test_lookup_heldout_with_fixed_costs_is_a_pure_function_of_the_code(smollm2, tmp_path):
    """scripts/lookup_heldout.py --fixed-costs: the adaptive policy sees the profiled costs, not
    the clock, so two runs give the same tau and the same choices to the count (the docs compare
    versions of the code with it); the policy's observe is restored after; a bad --configs is
    argparse's exit 2."""
    import importlib.util
    import json
    from pathlib import Path

    from mlxspec.engine.policy import VerifyPolicy

    path = Path(__file__).resolve().parent.parent / "scripts" / "lookup_heldout.py"
    spec = importlib.util.spec_from_file_location("lookup_heldout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    observe = VerifyPolicy.observe
    runs = []
    for i in range(2):
        out = tmp_path / f"{i}.json"
        assert mod.main(["--configs", "default+suffix,lookup", "--prompts", "1", "--max-tokens", "12",
                         "--fixed-costs", "--json", str(out)]) == 0
        assert VerifyPolicy.observe is observe
        runs.append(json.loads(out.read_text()))
    assert runs[0]["outputs_identical"] and runs[0]["fixed_costs"]
    strip = [{c: {k: {f: v for f, v in r.items() if f != "tok_s"} for k, r in cats.items()}
              for c, cats in run["configs"].items()} for run in runs]
    assert strip[0] == strip[1] and set(strip[0]) == {"default+suffix", "lookup"}
    assert all(r["tau"] >= 1.0 and r["generated"] >= 2 for cats in strip[0].values() for r in cats.values())
    with pytest.raises(SystemExit) as e:
        mod.main(["--configs", "default,nope"])
    assert e.value.code == 2


def _script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_agent_copy_ceiling_counts_by_hand():
    """scripts/agent_bench.py --replay's copy ceiling, on a conversation worked out by hand: the
    longest copyable span per forward at the profiled cost of its rows, the rest at fresh_x; a
    lookup's ceiling needs a 2-token match first; the suffix ceiling copies earlier answers too."""
    ceiling = _script("agent_bench").copy_ceiling
    steps = {L: 1 + 0.1 * (L - 1) for L in range(1, 18)}
    convo = [([1, 2, 3, 4, 5, 6, 7, 8], [9, 3, 4, 5, 6, 10, 11]), ([20, 21], [22, 10, 11, 12])]
    # turn 1, any span: [3, 4, 5, 6] copied in one forward of 5 rows (1.4 steps), then 11 fresh
    # (0.5): 6 tokens in 1.9 steps; turn 2: nothing to copy, 3 fresh tokens
    assert ceiling(convo, steps, 16, False, 2.0) == [
        {"copied": 4, "fresh": 1, "copy_forwards": 1, "x_ar": round(6 / 1.9, 3)},
        {"copied": 0, "fresh": 3, "copy_forwards": 0, "x_ar": 2.0}]
    # after a 2-token match: 3 and 4 are fresh ([8, 9], [9, 3] never occurred before), [3, 4]
    # then finds [5, 6] (the text goes on 7, 8), 11 fresh: 6 tokens in 2.7 steps
    assert ceiling(convo, steps, 16, False, 2.0, min_match=2)[0] == {
        "copied": 2, "fresh": 3, "copy_forwards": 1, "x_ar": round(6 / 2.7, 3)}
    # with the earlier answer: turn 2 copies [10, 11] from it (3 rows, 1.2 steps)
    assert ceiling(convo, steps, 16, True, 2.0)[1] == {"copied": 2, "fresh": 0, "copy_forwards": 1, "x_ar": 2.5}
    # at most 1 draft a forward: 3 (+ 4, the bonus), 5 (+ 6), then 10 and 11 fresh
    one = ceiling(convo, steps, 1, False, 2.0)[0]
    assert (one["copied"], one["fresh"], one["copy_forwards"]) == (2, 2, 2)


def test_lookup_heldout_reads_a_committed_profile(smollm2, tmp_path):
    """--profile: fixed-cost runs read a committed verify profile (runs of different sessions
    compare); a file that is not a profile is one line."""
    mod = _script("lookup_heldout")
    from mlxspec import api

    keep = api.profile_for
    out = tmp_path / "r.json"
    prof = "docs/bench/verify-profile-smollm2-2026-12-04.json"
    from pathlib import Path

    prof = str(Path(__file__).resolve().parent.parent / prof)
    assert mod.main(["--configs", "lookup", "--prompts", "1", "--max-tokens", "8", "--categories", "code",
                     "--fixed-costs", "--profile", prof, "--json", str(out)]) == 0
    assert api.profile_for is keep
    import json

    assert json.loads(out.read_text())["profile"] == prof
    bad = tmp_path / "bad.json"
    bad.write_text('{"1": 10.0, "3": 5.0}')
    with pytest.raises(SystemExit, match="lengths must run 1..n"):
        mod.main(["--fixed-costs", "--profile", str(bad)])
    bad.write_text('{"1": 10.0, "2": NaN}')
    with pytest.raises(SystemExit, match="positive, finite"):
        mod.main(["--fixed-costs", "--profile", str(bad)])
    bad.write_text("not json")
    with pytest.raises(SystemExit, match="not a verify profile"):
        mod.main(["--fixed-costs", "--profile", str(bad)])
    with pytest.raises(SystemExit) as e:
        mod.main(["--profile", prof])  # without --fixed-costs: argparse's exit 2
    assert e.value.code == 2


def test_lookup_heldout_models_each_run_on_the_profile(smollm2, tmp_path):
    """--fixed-costs also prices every run on the profile (verify rows at the profile's time,
    drafter forwards and heads at --fwd-ms / --head-ms): by hand on counts given, then on real
    runs, where AR is exactly 1x and the EAGLE-3 default's forwards and heads are counted (and
    the counting is undone after); a bad --temp is argparse's exit 2."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from mlxspec.drafters.eagle3 import Eagle3Model
    from mlxspec.engine.eagle3 import Eagle3Drafter

    mod = _script("lookup_heldout")
    costs = {"verify_s": {1: 0.04, 2: 0.044, 3: 0.05}, "fwd_s": 0.001, "head_s": 0.0005}
    st = SimpleNamespace(verify_lengths=[1, 3, 2, 5], generated=9)  # 8 tokens after the prefill's
    got = mod.modeled(st, {"fwd": 4, "head": 2}, costs)  # a 5-row verify is priced as the longest, 3
    assert got["modeled_x_ar"] == round(8 * 0.04 / (0.04 + 0.05 + 0.044 + 0.05 + 0.005), 4)
    assert got["modeled_draft_share"] == round(0.005 / 0.189, 4) and got["drafter_forwards"] == 4
    assert got["modeled_s"] == pytest.approx(0.189)

    call, logits = Eagle3Model.__call__, Eagle3Drafter.logits
    out = tmp_path / "m.json"
    prof = str(Path(__file__).resolve().parent.parent / "docs/bench/verify-profile-smollm2-avx512-2026-12-05.json")
    assert mod.main(["--configs", "ar,default", "--prompts", "1", "--max-tokens", "10", "--categories", "code",
                     "--fixed-costs", "--profile", prof, "--json", str(out)]) == 0
    assert (Eagle3Model.__call__, Eagle3Drafter.logits) == (call, logits)
    rep = json.loads(out.read_text())
    ar, default = rep["configs"]["ar"]["code"], rep["configs"]["default"]["code"]
    assert ar["modeled_x_ar"] == 1.0 and ar["drafter_forwards"] == 0 and rep["outputs_identical"]
    assert default["drafter_forwards"] > 0 and default["drafter_heads"] > 0 and default["modeled_x_ar"] > 0
    with pytest.raises(SystemExit) as e:
        mod.main(["--temp", "3"])
    assert e.value.code == 2


def test_agent_bench_modeled_repeats_to_the_digit(smollm2, tmp_path):
    """scripts/agent_bench.py --modeled: the conversation priced on a committed profile, the
    policy seeing those costs and not the clock, so two runs give the same figures."""
    import json
    from pathlib import Path

    mod = _script("agent_bench")
    prof = str(Path(__file__).resolve().parent.parent / "docs/bench/verify-profile-smollm2-avx512-2026-12-05.json")
    reps = []
    for i in range(2):
        out = tmp_path / f"a{i}.json"
        assert mod.main(["--turns", "2", "--max-tokens", "8", "--configs", "AR,default+suffix", "--modeled", prof,
                         "--out", str(out)]) == 0
        reps.append(json.loads(out.read_text())["configs"])
    assert reps[0] == reps[1] and set(reps[0]) == {"default+suffix"}
    row = reps[0]["default+suffix"]
    assert len(row["turns"]) == 2 and row["overall_modeled_x_ar"] > 0 and all(t["tau"] >= 1 for t in row["turns"])
