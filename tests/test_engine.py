"""The decode loop: lossless greedy and sampled output, stops and limits, invariants,
the drafters' context bookkeeping, the DSpark Markov chain, truncation and the scheduler.

Greedy tests run SmolLM2-135M (the `smollm2` fixture) against random-weight drafters, which
are almost always rejected, and against drafters forced to be right (the target drafting for
itself; an "oracle" wrapper that makes a varying prefix of each block correct) so the accept
path is exercised too. Sampling tests run tiny random llamas (vocabulary 8) whose exact
output distribution is enumerated.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.targets.model import Target
from mlxspec.engine import loop as engine
from mlxspec.engine.drafting import BlockDrafter, DraftOutput, SimpleDrafter
from mlxspec.engine.loop import InvariantError, SpecStats, generate_steps
from mlxspec.engine.policy import (ConfidenceCut, ConfidenceSchedule, FixedLength, choose_verify_length,
                                   truncate_p_min)
from mlxspec.engine.verify import SamplingParams, probs_from_logits, sample_token

MAX = 24
PROMPT = "The capital of France is"


# ----------------------------------------------------------------------------- helpers

def run(target, ids, drafter=None, max_tokens=MAX, **kw) -> list[int]:
    return [t for step in generate_steps(target, ids, drafter=drafter, max_tokens=max_tokens, **kw) for t in step]


def drafter_config(info, block=4, anchor_first=True, markov_rank=0, confidence=False, draft_vocab=None,
                   taps=(1, 10, 20), hidden=None, layers=1, heads=4, kv_heads=2, head_dim=32, mask=16,
                   vocab=None, **kw) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden or info.hidden_size, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, block_size=block,
        target_layer_ids=list(taps), mask_token_id=mask, vocab_size=vocab or info.vocab_size,
        sample_from_anchor=anchor_first, rope_theta=1e5, markov_rank=markov_rank,
        confidence_head=confidence, draft_vocab_size=draft_vocab, **kw)


def random_drafter(info, seed=0, markov_scale=1.0, **kw) -> DFlashModel:
    """A random-weight DFlash / DSpark drafter; with draft_vocab, d2t maps onto a random sorted
    subset of the target vocabulary (EAGLE-3 offsets: target = draft + d2t[draft])."""
    cfg = drafter_config(info, **kw)
    mx.random.seed(seed)
    m = DFlashModel(cfg)
    if cfg.draft_vocab_size:
        ids = np.sort(np.random.default_rng(seed).choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False))
        m.d2t = mx.array(ids - np.arange(len(ids)), dtype=mx.int32)
    if cfg.markov_rank and markov_scale != 1.0:
        mh = m.markov_head
        mh.markov_w2.weight = mh.markov_w2.weight * markov_scale
    mx.eval(m.parameters())
    return m


class Oracle:
    """Wraps a drafter and replaces a prefix of each draft by the target's own greedy tokens,
    its length cycling 0..n, then one wrong token, so blocks are partly accepted. The wrapped
    drafter still drafts (and keeps its context) as in a real run."""

    def __init__(self, inner, full: list[int], vocab: int):
        self.inner, self.full, self.vocab, self.calls = inner, full, vocab, 0
        self.name, self.taps, self.max_drafts = inner.name, inner.taps, inner.max_drafts

    @property
    def ctx_len(self):
        return getattr(self.inner, "ctx_len", None)

    def begin(self, ids, taps):
        self.inner.begin(ids, taps)
        self.pos = len(ids)  # the anchor's position

    def accept(self, tokens, taps):
        self.inner.accept(tokens, taps)
        self.pos += len(tokens)

    def draft(self, anchor, n, sp, rng):
        d = self.inner.draft(anchor, n, sp, rng)
        m = len(d.tokens)
        k = self.calls % (m + 1)
        self.calls += 1
        right = self.full[self.pos + 1 : self.pos + 1 + m]
        toks = right[:k] + ([(right[k] + 1) % self.vocab] if k < m else []) + list(d.tokens[k + 1 :])
        return DraftOutput(toks, d.probs, d.confidence, d.logits)


@pytest.fixture(scope="module")
def sm(smollm2):
    """(target, prompt ids, autoregressive greedy tokens)."""
    target, tok = smollm2
    ids = tok.encode(PROMPT, add_special_tokens=False)
    return target, ids, run(target, ids)


# ----------------------------------------------------------------------------- greedy lossless

# A covering design instead of the full 2 x 2 x 3 x 2 product (time): every block size runs
# with both lineages, both layouts and both vocabularies, and every pair of the two-valued
# factors (lineage, layout, reduced vocab) appears in all four combinations.
GREEDY_CASES = [
    # lineage, sample_from_anchor, block, draft vocab
    ("dflash", True, 2, None),
    ("dspark", False, 2, 512),
    ("dflash", False, 4, 512),
    ("dspark", True, 4, None),
    ("dflash", True, 8, 512),
    ("dspark", False, 8, None),
]


@pytest.mark.parametrize("lineage, anchor_first, block, dvocab", GREEDY_CASES,
                         ids=[f"{l}-{'af' if a else 'ba'}-b{b}-{'dv' if d else 'full'}" for l, a, b, d in GREEDY_CASES])
def test_greedy_random_drafter_is_lossless(sm, lineage, anchor_first, block, dvocab):
    target, ids, ar = sm
    dspark = lineage == "dspark"
    m = random_drafter(target.info, seed=block, block=block, anchor_first=anchor_first,
                       markov_rank=8 if dspark else 0, confidence=dspark, draft_vocab=dvocab)
    drafter = BlockDrafter(m, target)
    assert drafter.name == lineage
    assert drafter.max_drafts == (block if anchor_first else block - 1)
    stats = SpecStats()
    out = run(target, ids, drafter, stats=stats)
    assert out == ar
    assert stats.generated == MAX and stats.drafted > 0


@pytest.mark.parametrize("dspark", [False, True])
def test_greedy_partly_accepted_blocks_are_lossless(sm, dspark):
    """Oracle-assisted block drafter: blocks accepted 0..n deep, drafter context appended
    with several rows at a time; invariants checked every step."""
    target, ids, ar = sm
    m = random_drafter(target.info, seed=3, block=4, markov_rank=8 if dspark else 0, confidence=dspark,
                       draft_vocab=512 if dspark else None)
    stats = SpecStats()
    out = run(target, ids, Oracle(BlockDrafter(m, target), ids + ar, target.info.vocab_size), stats=stats)
    assert out == ar
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    assert stats.tau > 1.5


def test_greedy_self_drafting_accepts_everything(sm):
    target, ids, ar = sm
    stats = SpecStats()
    out = run(target, ids, SimpleDrafter(target, 4), stats=stats)
    assert out == ar
    assert stats.acceptance_rate == 1.0
    assert stats.tau > 3
    assert stats.per_position_acceptance == [1.0] * len(stats.per_position_acceptance)


def test_greedy_max_drafts_caps_the_block(sm):
    target, ids, ar = sm
    stats = SpecStats()
    out = run(target, ids, SimpleDrafter(target, 4), max_tokens=12, policy=FixedLength(2), stats=stats)
    assert out == ar[:12]
    assert max(stats.verify_lengths) == 3


# ----------------------------------------------------------------------------- stops and limits

def _first_new_index(ar, start=5):
    return next(i for i in range(start, len(ar)) if ar[i] not in ar[:i])


@pytest.mark.parametrize("kind", ["none", "self", "oracle"])
def test_eos_stops_right_after_it(sm, kind):
    target, ids, ar = sm
    i = _first_new_index(ar)
    drafter = {
        "none": lambda: None,
        "self": lambda: SimpleDrafter(target, 4),  # the EOS lands inside an accepted block
        "oracle": lambda: Oracle(BlockDrafter(random_drafter(target.info, block=8), target), ids + ar,
                                 target.info.vocab_size),
    }[kind]()
    steps = list(generate_steps(target, ids, drafter=drafter, max_tokens=MAX, eos_ids={ar[i]}))
    out = [t for s in steps for t in s]
    assert out == ar[: i + 1]
    assert steps[-1][-1] == ar[i]


def test_eos_as_first_token(sm):
    target, ids, ar = sm
    assert run(target, ids, SimpleDrafter(target, 4), eos_ids={ar[0]}) == ar[:1]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 11])
def test_max_tokens_exact_when_blocks_overshoot(sm, max_tokens):
    """Self-drafting accepts every draft, so every block would run past the limit."""
    target, ids, ar = sm
    stats = SpecStats()
    out = run(target, ids, SimpleDrafter(target, 4), max_tokens=max_tokens, stats=stats)
    assert out == ar[:max_tokens]
    assert stats.generated == max_tokens
    blk = Oracle(BlockDrafter(random_drafter(target.info, block=8), target), ids + ar, target.info.vocab_size)
    assert run(target, ids, blk, max_tokens=max_tokens) == ar[:max_tokens]


def test_block_drafts_do_not_depend_on_how_many_are_kept(sm):
    """Near max_tokens fewer drafts are needed: the block is still the full block and the
    extra drafts are dropped, so the kept ones are the same as in a full draft."""
    target, ids, _ = sm
    for dspark in (False, True):
        m = random_drafter(target.info, seed=5, block=8, markov_rank=8 if dspark else 0, confidence=dspark,
                           markov_scale=30.0)
        dr = BlockDrafter(m, target)
        _, taps = target(mx.array([ids]), target.make_cache(), taps=dr.taps, logits="none")
        dr.begin(ids, taps)
        full = dr.draft(ids[-1], dr.max_drafts, SamplingParams(), None)
        for n in (1, 3, 5):
            d = dr.draft(ids[-1], n, SamplingParams(), None)
            assert d.tokens == full.tokens[:n]
            np.testing.assert_allclose(np.asarray(d.logits), np.asarray(full.logits[:n]), atol=1e-4)
            if dspark:
                np.testing.assert_allclose(d.confidence, full.confidence[:n], atol=1e-5)


# ----------------------------------------------------------------------------- invariants

class Recorder:
    """Wraps a drafter and records (drafter context length) at every draft call."""

    def __init__(self, inner, lose_row_at: int | None = None):
        self.inner, self.lose_row_at, self.seen, self.accepts = inner, lose_row_at, [], 0
        self.name, self.taps, self.max_drafts = inner.name, inner.taps, inner.max_drafts

    @property
    def ctx_len(self):
        return self.inner.ctx_len

    def begin(self, ids, taps):
        self.inner.begin(ids, taps)

    def accept(self, tokens, taps):
        self.inner.accept(tokens, taps)
        self.accepts += 1
        if self.accepts == self.lose_row_at:
            self.inner.trim_context(1)  # corrupt: the drafter forgets a committed row

    def draft(self, anchor, n, sp, rng):
        self.seen.append(self.inner.ctx_len)
        return self.inner.draft(anchor, n, sp, rng)


def test_drafter_context_tracks_target_cache_after_rejections(sm):
    target, ids, ar = sm
    rec = Recorder(BlockDrafter(random_drafter(target.info, block=4), target))
    produced, expected = 0, []
    stats = SpecStats()
    gen = generate_steps(target, ids, drafter=rec, max_tokens=12, stats=stats)
    for step in gen:
        produced += len(step)
        if produced < 11:  # a draft is asked for while a draft and the bonus still fit
            expected.append(len(ids) + produced - 1)  # the context ends right before the anchor
    assert rec.seen == expected
    assert stats.accepted < stats.drafted  # rejections happened and were trimmed


def test_corrupted_target_cache_raises(sm, monkeypatch):
    target, ids, _ = sm
    real = engine.trim_cache
    monkeypatch.setattr(engine, "trim_cache", lambda cache, n: real(cache, n + 1))  # trims one too many
    with pytest.raises(InvariantError, match="target cache holds"):
        run(target, ids, BlockDrafter(random_drafter(target.info, block=4), target), max_tokens=6)


def test_corrupted_drafter_context_raises(sm):
    target, ids, _ = sm
    rec = Recorder(BlockDrafter(random_drafter(target.info, block=4), target), lose_row_at=2)
    with pytest.raises(InvariantError, match="drafter context holds"):
        run(target, ids, rec, max_tokens=8)


def test_incremental_context_equals_one_append(sm):
    """BlockDrafter.accept in pieces (as the loop feeds it) == one append of the whole context."""
    target, ids, ar = sm
    for dspark in (False, True):
        m = random_drafter(target.info, seed=7, block=4, markov_rank=8 if dspark else 0)
        seq = ids + ar[:10]
        _, taps = target(mx.array([seq]), target.make_cache(), taps=m.config.target_layer_ids, logits="none")
        one, pieces = BlockDrafter(m, target), BlockDrafter(m, target)
        one.begin(seq, taps)
        cuts = [0, len(ids), len(ids) + 1, len(ids) + 4, len(ids) + 5, len(seq)]
        pieces.begin(seq[: cuts[1]], taps[:, : cuts[1]])
        for a, b in zip(cuts[1:], cuts[2:]):
            pieces.accept(seq[a:b], taps[:, a:b])
        assert one.ctx_len == pieces.ctx_len == len(seq)
        anchor = ar[10]
        h1, z1 = one.base_logits(anchor, one.max_drafts)
        h2, z2 = pieces.base_logits(anchor, pieces.max_drafts)
        np.testing.assert_allclose(np.asarray(z2), np.asarray(z1), atol=1e-4, rtol=1e-4)
        d1 = one.draft(anchor, 4, SamplingParams(), None)
        d2 = pieces.draft(anchor, 4, SamplingParams(), None)
        assert d1.tokens == d2.tokens
        # trimming the context back and re-appending gives the same drafts again
        pieces.trim_context(3)
        pieces.accept(seq[-3:], taps[:, -3:])
        assert pieces.draft(anchor, 4, SamplingParams(), None).tokens == d1.tokens


# ----------------------------------------------------------------------------- DSpark Markov chain

@pytest.mark.parametrize("dvocab", [None, 512])
def test_markov_chain_greedy_matches_numpy_reference(sm, dvocab):
    target, ids, ar = sm
    m = random_drafter(target.info, seed=11, block=6, markov_rank=16, confidence=True, draft_vocab=dvocab,
                       markov_scale=40.0)
    dr = BlockDrafter(m, target)
    _, taps = target(mx.array([ids]), target.make_cache(), taps=dr.taps, logits="none")
    dr.begin(ids, taps)
    anchor = ar[0]
    out = dr.draft(anchor, dr.max_drafts, SamplingParams(), None)
    h, base = dr.base_logits(anchor, dr.max_drafts)
    h, base = np.asarray(h, np.float64), np.asarray(base, np.float64)
    w1 = np.asarray(m.markov_head.markov_w1.weight, np.float64)  # [V_target, r]
    w2 = np.asarray(m.markov_head.markov_w2.weight, np.float64)  # [V_draft, r]
    cw = np.asarray(m.confidence_head.proj.weight, np.float64)[0]
    cb = float(np.asarray(m.confidence_head.proj.bias)[0])
    d2t = np.arange(base.shape[1]) if dvocab is None else np.asarray(dr.d2t)
    prev, toks, zs, confs = anchor, [], [], []
    for k in range(base.shape[0]):  # slot 0 conditioned on the anchor
        z = base[k] + w2 @ w1[prev]
        confs.append(1 / (1 + math.exp(-(cw @ np.concatenate([h[k], w1[prev]]) + cb))))
        prev = int(d2t[int(np.argmax(z))])
        toks.append(prev)
        zs.append(z)
    assert out.tokens == toks
    np.testing.assert_allclose(np.asarray(out.logits), np.stack(zs), atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(out.confidence, confs, atol=1e-5)
    # the chain matters here: plain argmax of the base logits would draft something else
    assert toks != [int(d2t[i]) for i in base.argmax(-1)]


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_markov_chain_other_head_types_match_teacher_forced_bias(sm, kind):
    """Greedy chain for gated / rnn heads == the trainer's teacher-forced `block_bias` on the
    drafted tokens (prev = [anchor, d_1 .. d_{n-1}])."""
    target, ids, ar = sm
    m = random_drafter(target.info, seed=12, block=5, markov_rank=16, markov_head_type=kind, markov_scale=40.0)
    dr = BlockDrafter(m, target)
    _, taps = target(mx.array([ids]), target.make_cache(), taps=dr.taps, logits="none")
    dr.begin(ids, taps)
    out = dr.draft(ar[0], dr.max_drafts, SamplingParams(), None)
    h, base = dr.base_logits(ar[0], dr.max_drafts)
    prev = mx.array([ar[0]] + out.tokens[:-1])
    z = base + m.markov_head.block_bias(prev, h)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(z), atol=1e-3, rtol=1e-4)
    assert out.tokens == np.asarray(z).argmax(-1).tolist()
    assert run(target, ids, dr, max_tokens=10) == ar[:10]


# ----------------------------------------------------------------------------- truncation and scheduler

def test_truncate_p_min():
    c = [0.9, 0.6, 0.3, 0.8]
    assert truncate_p_min(c, 0.5) == 2  # cut at the first confidence below p_min, not later ones
    assert truncate_p_min(c, 0.95) == 0
    assert truncate_p_min(c, 0.2) == 4
    assert truncate_p_min([0.5, 0.4], 0.5) == 1  # equal to p_min is kept
    assert truncate_p_min([], 0.5) == 0


def test_choose_verify_length_hand_computed():
    sps = {1: 10.0, 2: 9.0, 3: 8.0, 4: 5.0, 5: 4.0}
    # l=0: 10; l=1: 1.9*9 = 17.1; l=2: (1.9+0.72)*8 = 20.96; l=3: (2.62+0.648)*5 = 16.34 -> 2
    assert choose_verify_length([0.9, 0.8, 0.9, 0.9], sps) == 2
    # nothing beats verifying the anchor alone: 1.05*9 = 9.45 < 10
    assert choose_verify_length([0.05, 0.9], sps) == 0
    # cheap verifies admit everything
    flat = {l: 10.0 for l in range(1, 6)}
    assert choose_verify_length([0.5, 0.5, 0.5, 0.5], flat) == 4
    # a profile that stops at 2 tokens bounds the choice
    assert choose_verify_length([0.9, 0.9, 0.9], {1: 10.0, 2: 9.0}) == 1
    # equal value is not an improvement
    assert choose_verify_length([0.0], {1: 10.0, 2: 10.0}) == 0


def test_choose_verify_length_stops_at_first_non_improvement():
    sps = {1: 10.0, 2: 9.0, 3: 8.0, 4: 8.0, 5: 8.0}
    conf = [0.9, 0.1, 1.0, 1.0]
    # l=1: 1.9*9 = 17.1; l=2: 1.99*8 = 15.92 (worse: stop); l=4 would give 2.17*8 = 17.36 > 17.1
    vals = [10.0]
    surv, exp = 1.0, 1.0
    for l, c in enumerate(conf, 1):
        surv *= c
        exp += surv
        vals.append(exp * sps[l + 1])
    assert int(np.argmax(vals)) == 4  # the global optimum is further out ...
    assert choose_verify_length(conf, sps) == 1  # ... but the rule stops at the first drop


class ConfRecorder(Recorder):
    """Records the confidences of every draft (the delegation is Recorder's)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.confs = []

    def draft(self, anchor, n, sp, rng):
        d = super().draft(anchor, n, sp, rng)
        self.confs.append(d.confidence[:n])
        return d


@pytest.mark.parametrize("mode", ["p_min", "schedule"])
def test_engine_verifies_the_truncated_length(sm, mode):
    target, ids, ar = sm
    m = random_drafter(target.info, seed=13, block=6, markov_rank=8, confidence=True)
    rec = ConfRecorder(BlockDrafter(m, target))
    stats = SpecStats()
    sps = {1: 10.0, 2: 9.5, 3: 9.0, 4: 8.0, 5: 7.0, 6: 6.5, 7: 6.0}
    policy = ConfidenceCut(0.5, FixedLength()) if mode == "p_min" else ConfidenceSchedule(sps, FixedLength())
    out = run(target, ids, rec, max_tokens=14, stats=stats, policy=policy)
    assert out == ar[:14]
    if mode == "p_min":
        want = [1 + truncate_p_min(c, 0.5) for c in rec.confs]
    else:
        want = [1 + choose_verify_length(c, sps) for c in rec.confs]
    # steps after the last draft call (only the bonus still fits) verify the anchor alone
    want += [1] * (len(stats.verify_lengths) - len(want))
    assert stats.verify_lengths == want
    assert len(set(want)) > 1  # the confidences actually cut some blocks and not others


# ----------------------------------------------------------------------------- sampling is lossless

V = 8
TINY_PROMPT = [1, 2, 3]
N_TOKENS = 4


def tiny_llama(seed: int, base: Target | None = None, noise: float = 0.0) -> Target:
    """A random 2-layer llama over 8 tokens; with `base`, a copy of it with Gaussian noise
    (relative to each tensor's spread) on every weight: a different but related model."""
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    args = ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V,
                     tie_word_embeddings=False, rope_theta=10000.0)
    m = Model(args)
    m.lm_head.weight = m.lm_head.weight * 3.0  # peakier than uniform
    if base is not None:
        m.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape) * w.std(), base.model.parameters()))
    mx.eval(m.parameters())
    return Target(m, {"hidden_size": 32, "model_type": "llama"})


def exact_distribution(target: Target, prompt: list[int], sp: SamplingParams, n: int) -> np.ndarray:
    """P(t_1..t_n) of autoregressive sampling, by enumerating every prefix: [V] * n."""
    seqs, probs = [[]], np.ones(1)
    for _ in range(n):
        logits = target.model(mx.array([prompt + s for s in seqs]))
        p = np.asarray(probs_from_logits(logits[:, -1], sp), np.float64)
        probs = (probs[:, None] * p).reshape(-1)
        seqs = [s + [v] for s in seqs for v in range(V)]
    return probs.reshape([V] * n)


def tv_bound(p: np.ndarray, n: int, delta: float = 1e-4) -> float:
    """TV(empirical of n i.i.d. draws, p) exceeds this with probability <= delta: its mean is at
    most 1/2 sum sqrt(p_k (1 - p_k) / n) (Jensen), and McDiarmid adds sqrt(ln(1/delta) / (2n))
    (one draw moves TV by at most 1/n)."""
    p = np.asarray(p, np.float64).reshape(-1)
    return 0.5 * float(np.sum(np.sqrt(p * (1 - p) / n))) + math.sqrt(math.log(1 / delta) / (2 * n))


def distribution_check(samples: np.ndarray, exact: np.ndarray) -> dict:
    """Per-position marginals of t_1..t_4 and the joint of (t_2, t_3) (the first speculative
    step): name -> (TV, bound). 5 checks at delta = 1e-4 each: false alarm <= 5e-4."""
    n = len(samples)
    out = {}
    for i in range(N_TOKENS):
        p = exact.sum(axis=tuple(j for j in range(N_TOKENS) if j != i))
        c = np.bincount(samples[:, i], minlength=V)
        out[f"t{i + 1}"] = (0.5 * np.abs(c / n - p).sum(), tv_bound(p, n))
    p23 = exact.sum(axis=(0, 3))
    c23 = np.bincount(samples[:, 1] * V + samples[:, 2], minlength=V * V).reshape(V, V)
    out["t2,t3"] = (0.5 * np.abs(c23 / n - p23).sum(), tv_bound(p23, n))
    return out


def sample_many(target, make_drafter, sp, n, stats=None) -> np.ndarray:
    out = []
    for seed in range(n):
        toks = run(target, TINY_PROMPT, make_drafter(), max_tokens=N_TOKENS, sampling=sp, seed=seed, stats=stats)
        assert len(toks) == N_TOKENS
        out.append(toks)
    return np.array(out)


def accept_everything(draft, q, p, rng):
    """A deliberately wrong rule: keep every draft, bonus from the last row."""
    return len(draft), sample_token(p[len(draft)], rng)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama(1)
    draft = tiny_llama(2, base=target, noise=0.3)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, block_size=3, target_layer_ids=[0], mask_token_id=7,
                        vocab_size=V, sample_from_anchor=True, rope_theta=1e4, markov_rank=4, confidence_head=True,
                        draft_vocab_size=6)
    mx.random.seed(3)
    dspark = DFlashModel(cfg)
    dspark.d2t = mx.array([0, 0, 1, 1, 1, 1], dtype=mx.int32)  # draft ids -> target ids 0 1 3 4 5 6
    mx.eval(dspark.parameters())
    return target, draft, dspark


SAMPLED_CASES = [
    # drafter, sampling, N (lossless), N (wrong rule)
    ("simple", SamplingParams(temperature=1.0), 1500, 400),
    ("dspark", SamplingParams(temperature=0.7, top_k=4), 1500, 400),
]


@pytest.mark.parametrize("kind, sp, n, n_wrong", SAMPLED_CASES, ids=["simple-T1", "dspark-T0.7-topk4"])
def test_sampling_is_lossless_and_the_check_catches_a_wrong_rule(tiny, monkeypatch, kind, sp, n, n_wrong):
    target, draft, dspark = tiny  # dspark: Markov chain sampling over a reduced draft vocabulary
    make = {
        "simple": lambda: SimpleDrafter(draft, 3),
        "dspark": lambda: BlockDrafter(dspark, target),
    }[kind]
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)
    stats = SpecStats()
    res = distribution_check(sample_many(target, make, sp, n, stats), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"
    # both verification branches ran
    assert 0.1 < stats.accepted / stats.drafted < 0.9

    monkeypatch.setattr(engine, "accept_sampled", accept_everything)
    wrong = distribution_check(sample_many(target, make, sp, n_wrong), exact)
    assert any(t > b for t, b in wrong.values()), f"the check missed a wrong acceptance rule: {wrong}"


def test_float16_drafter_context_survives_taps_past_float16(sm):
    """Gemma's taps reach ~1e5, past float16's 65504: a float16 drafter (the Metal default)
    computes fc + hidden_norm in float32, so its context stays finite and matches a float32
    drafter's to float16 precision."""
    target = sm[0]
    taps = mx.random.normal((1, 6, 3 * target.info.hidden_size), key=mx.random.key(1))
    taps[0, 2, 7] = 9.0e4
    taps[0, 4, 100] = -1.2e5
    ref = BlockDrafter(random_drafter(target.info, taps=(1, 10, 20)), target, dtype=mx.float32).context(taps)
    d16 = BlockDrafter(random_drafter(target.info, taps=(1, 10, 20)), target, dtype=mx.float16)
    got = d16.context(taps)
    assert got.dtype == mx.float16
    assert np.isfinite(np.asarray(got.astype(mx.float32))).all()
    assert np.allclose(np.asarray(got.astype(mx.float32)), np.asarray(ref), atol=3e-2, rtol=1e-2)
    # what the old path (cast the taps to float16 first) gave
    assert not np.isfinite(np.asarray(d16.model.context(taps.astype(mx.float16)).astype(mx.float32))).all()


# ----------------------------------------------------------------------------- pipelined AR

@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_5"])
def test_pipelined_greedy_ar_equals_one_step_at_a_time_and_leaves_the_cache_exact(arch, monkeypatch):
    """Greedy decoding without drafts builds each forward while the last one runs (one step
    ahead): the same tokens as the step-at-a-time loop (a NoDrafter subclass still takes it),
    stopping at an EOS or max_tokens, and a request closed early, at an EOS or at max_tokens
    leaves the cache holding exactly the committed positions, equal to a fresh prefill of them
    (sliding windows and a recurrent target included)."""
    from test_targets import PROMPT as IDS
    from test_targets import assert_caches_equal
    from tiny_targets import tiny_target

    from mlxspec.engine.drafting import NoDrafter
    from mlxspec.targets.model import cache_length

    class StepAtATime(NoDrafter):
        pass

    target = tiny_target(arch)

    def run(drafter, eos=frozenset(), max_tokens=14, cache=None, take=None):
        g = generate_steps(target, IDS, drafter=drafter, max_tokens=max_tokens, eos_ids=eos, cache=cache)
        out = []
        for s in g:
            out += s
            if take is not None and len(out) >= take:
                g.close()
                break
        return out

    ref = run(StepAtATime())
    pipelined = []
    real = engine._greedy_ar
    monkeypatch.setattr(engine, "_greedy_ar", lambda *a: pipelined.append(1) or real(*a))
    assert run(None) == ref and len(ref) == 14
    assert pipelined == [1]  # the pipelined loop ran (and the subclass took the step-at-a-time one)
    eos = frozenset({ref[6]})
    assert run(None, eos) == run(StepAtATime(), eos) == ref[: ref.index(ref[6]) + 1]
    for kw in ({"take": 5}, {"eos": eos}, {"max_tokens": 9}):
        cache = target.make_cache()
        out = run(None, cache=cache, **kw)
        assert cache_length(cache) == len(IDS) + len(out) - 1, kw
        fresh = target.make_cache()
        target(mx.array([IDS + out[:-1]]), fresh)
        assert_caches_equal(cache, fresh)
