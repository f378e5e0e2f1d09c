"""Tree drafting and verification end to end (mlxspec.engine.tree, tree_step): greedy output
equals autoregressive on every target architecture that verifies trees, with tree candidates
from a block drafter's rows and from prompt lookup; sampling with trees keeps the target's
exact distribution (and the check catches a wrong rule); the acceptance rule on its own against
hand-made distributions; `--tree` parsing."""

import mlx.core as mx
import numpy as np
import pytest
from tiny_targets import tiny_target

import test_engine as te
from mlxspec.engine import tree_step as ts
from mlxspec.engine.drafting import BlockDrafter, DraftOutput
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.ngram import LookupBlockDrafter, NgramDrafter
from mlxspec.engine.policy import FixedLength
from mlxspec.engine.tree import DraftTree, accept_sampled
from mlxspec.engine.tree_step import TreeSettings
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from test_tree_forward import TREE_ARCHS

PROMPT = [5, 9, 2, 7, 11, 3, 8]


def run(target, drafter=None, max_tokens=30, **kw):
    return [t for s in generate_steps(target, PROMPT, drafter=drafter, max_tokens=max_tokens, **kw) for t in s]


class SecondGuess:
    """A block drafter that knows the target's greedy continuation: at every other row its
    argmax is wrong and the right token is its second choice, so a chain stops there and a
    tree with two children per node goes on."""

    name, taps, ctx_len = "second-guess", (1,), None
    proposes_model_drafts, has_lookup = True, False

    def __init__(self, full, vocab, n):
        self.full, self.vocab, self.max_drafts, self.pos = full, vocab, n, 0

    def begin(self, ids, taps):
        self.pos = len(ids)

    def accept(self, tokens, taps):
        self.pos += len(tokens)

    def draft(self, anchor, n, sp, rng):
        right = self.full[self.pos + 1 : self.pos + 1 + n]
        z = np.zeros((len(right), self.vocab), np.float32)
        toks = []
        for j, t in enumerate(right):
            wrong = (t + 1 + j) % self.vocab
            z[j, t], z[j, wrong] = 2.0, 3.0 if (self.pos + j) % 2 else 1.0
            toks.append(int(np.argmax(z[j])))
        return DraftOutput(toks, None, None, mx.array(z))


@pytest.mark.parametrize("arch", TREE_ARCHS)
def test_greedy_tree_equals_autoregressive_and_beats_the_chain(arch):
    target = tiny_target(arch)
    ar = run(target)
    full = PROMPT + ar
    chain, tree = SpecStats(), SpecStats()
    assert run(target, SecondGuess(full, 64, 4), stats=chain, policy=FixedLength()) == ar
    got = run(target, LookupBlockDrafter(SecondGuess(full, 64, 4), 64), stats=tree, policy=FixedLength(), tree=8)
    assert got == ar
    assert max(tree.verify_lengths) == 9  # 8 nodes and the anchor
    assert tree.tau > chain.tau * 1.3, (tree.tau, chain.tau)


def test_a_recurrent_target_verifies_chains_and_says_why(caplog):
    target = tiny_target("qwen3_5")
    ar = run(target)
    st = SpecStats()
    with caplog.at_level("INFO", logger="mlxspec"):
        assert run(target, SecondGuess(PROMPT + ar, 64, 4), stats=st, policy=FixedLength(), tree=8) == ar
    assert max(st.verify_lengths) == 5  # chains of 4
    assert any("recurrent" in r.getMessage() and "chains" in r.getMessage() for r in caplog.records)


def test_lookup_trees_hold_every_distinct_continuation():
    from mlxspec.engine.ngram import NgramIndex, propose_many

    ix = NgramIndex(2, 4)
    ix.reset([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 7, 5, 1, 2])
    conts, n = propose_many(ix, 3, 3, 4)
    assert n == 3 and conts == [[7, 5, 1], [8, 1, 2], [9, 1, 2]]
    tree = DraftTree(3)
    from mlxspec.engine.tree import add_lookup

    add_lookup(tree, conts, np.full(8, 0.6))
    assert sorted(tree.nodes[k].token for k in tree.nodes[0].kids) == [7, 8, 9]
    assert len(tree) == 1 + 3 * 3  # three continuations that differ at their first token share only the root


def test_tree_settings_parse_and_refuse_in_one_line():
    assert TreeSettings.parse("off").on is False
    assert TreeSettings.parse("auto").mode == "auto"
    assert TreeSettings.parse("12") == TreeSettings("fixed", 12)
    for bad in ("-1", "wide", "0.5", "65"):
        with pytest.raises(MlxspecError, match="--tree .*off, auto, or a node count"):
            TreeSettings.parse(bad)


# ----------------------------------------------------------------------------- sampling is lossless

def _rows_tree(q, sibling_q):
    """Root children: a lookup token (deterministic), then two drawn from q without replacement;
    the first drawn one has a lookup child and a drawn child."""
    t = DraftTree(0)
    rng = np.random.default_rng(123)
    from mlxspec.engine.tree import top_candidates

    a, b = top_candidates(q, 2, rng)
    t.add(0, 3, 0.9, "lookup")
    ka = t.add(0, int(a), 0.5, "drafter", q, ())
    t.add(0, int(b), 0.25, "drafter", q, (int(a),))
    t.add(ka, 1, 0.4, "lookup")
    (c,) = top_candidates(sibling_q, 1, rng)
    t.add(ka, int(c), 0.3, "drafter", sibling_q, ())
    return t


def test_tree_acceptance_keeps_the_targets_distribution_and_catches_a_wrong_rule(monkeypatch):
    V = 6
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V) * 0.7, size=6)  # the target's row after each node
    q, q2 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    n = 40000

    def check(rule):
        first, second = np.zeros(V), {}
        for s in range(n):
            # a fresh draw of the drafter's children every time (they are random too)
            t = _rows_tree(q, q2) if s == 0 else _rebuild(q, q2, s)
            path, nxt = rule(t, p[: len(t)], np.random.default_rng(s))
            toks = [t.nodes[i].token for i in path[1:]] + [nxt]
            first[toks[0]] += 1
            if len(path) > 1 and t.nodes[path[1]].kids:
                second.setdefault(path[1], []).append(toks[1])
        res = {"t1": (0.5 * np.abs(first / n - p[0]).sum(), te.tv_bound(p[0], n))}
        for node, ys in second.items():
            c = np.bincount(ys, minlength=V) / len(ys)
            res[f"after node {node}"] = (0.5 * np.abs(c - p[node]).sum(), te.tv_bound(p[node], len(ys)))
        return res

    def _rebuild(q, q2, seed):
        t = DraftTree(0)
        from mlxspec.engine.tree import top_candidates

        r = np.random.default_rng(10_000 + seed)
        a, b = top_candidates(q, 2, r)
        t.add(0, 3, 0.9, "lookup")
        ka = t.add(0, int(a), 0.5, "drafter", q, ())
        t.add(0, int(b), 0.25, "drafter", q, (int(a),))
        t.add(ka, 1, 0.4, "lookup")
        (c,) = top_candidates(q2, 1, r)
        t.add(ka, int(c), 0.3, "drafter", q2, ())
        return t

    # node rows of the tree above: 0 root, 1 lookup 3, 2 first drawn, 3 second drawn, 4, 5 under 2
    res = check(accept_sampled)
    assert not {k: v for k, v in res.items() if v[0] > v[1]}, res
    assert any(k.startswith("after") for k in res)

    def no_residual(t, p_rows, rng):  # a wrong rule: siblings tried against the untouched p
        i, path = 0, [0]
        while True:
            pr = p_rows[i] / p_rows[i].sum()
            nxt = None
            for k in t.nodes[i].kids:
                x, qq = t.nodes[k].token, t.nodes[k].q
                if (qq is None and rng.random() < pr[x]) or (qq is not None and rng.random() * qq[x] < pr[x]):
                    nxt = k
                    break
            if nxt is None:
                return path, int(rng.choice(len(pr), p=pr))
            path.append(nxt)
            i = nxt

    wrong = check(no_residual)
    assert any(t > b for t, b in wrong.values()), wrong


def first_child(tree, p_rows, rng):
    """A deliberately wrong sampled tree rule: always walk to the first child, bonus from there."""
    i, path = 0, [0]
    while tree.nodes[i].kids:
        i = tree.nodes[i].kids[0]
        path.append(i)
    return path, int(rng.choice(p_rows.shape[1], p=p_rows[i] / p_rows[i].sum()))


@pytest.mark.parametrize("lookup", [False, True], ids=["dspark", "dspark+lookup"])
def test_sampling_with_trees_is_lossless_through_the_engine(lookup, monkeypatch):
    """The engine's tree step at T=0.7/top-k 4 (a DSpark drafter over a reduced vocabulary, its
    rows' other candidates drawn without replacement; with lookup: deterministic candidates
    merged in) reproduces the target's exact distribution of 4 tokens; always accepting the
    first child instead is caught."""
    tiny = te.tiny.__wrapped__()
    target, _, dspark = tiny
    sp = SamplingParams(temperature=0.7, top_k=4)
    exact = te.exact_distribution(target, te.TINY_PROMPT, sp, te.N_TOKENS)

    def make():
        d = BlockDrafter(dspark, target)
        return LookupBlockDrafter(d, te.V) if lookup else d

    def sample(n, stats=None):
        out = []
        for seed in range(n):
            toks = [t for s in generate_steps(target, te.TINY_PROMPT, drafter=make(), max_tokens=te.N_TOKENS,
                                              sampling=sp, seed=seed, stats=stats, policy=FixedLength(), tree=5)
                    for t in s]
            out.append(toks)
        return np.array(out)

    stats = SpecStats()
    res = te.distribution_check(sample(1200, stats), exact)
    assert not {k: v for k, v in res.items() if v[0] > v[1]}, res
    assert max(stats.verify_lengths) == 6 and 0.05 < stats.accepted / stats.drafted < 0.9

    monkeypatch.setattr(ts, "accept_sampled", first_child)
    wrong = te.distribution_check(sample(400), exact)
    assert any(t > b for t, b in wrong.values()), wrong


# ----------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def real(smollm2):
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok = smollm2
    ids = encode_prompt(tok, "code", load_prompts()["code"][1])
    ar = [t for s in generate_steps(target, ids, max_tokens=40) for t in s]
    return target, ids, ar


@pytest.mark.parametrize("draft, policy, tree", [("eagle3", "fixed", "8"), ("dspark", "fixed", "8"),
                                                 ("lookup", "fixed", "8"), ("eagle3", "adaptive", "auto")])
def test_real_model_trees_equal_autoregressive(real, draft, policy, tree):
    """SmolLM2 with each shipped drafter (with prompt lookup merged in) and with lookup alone:
    greedy tree output == autoregressive; the fixed trees verify 8 nodes and beat the chain's
    acceptance per step."""
    from mlxspec import api

    target, ids, ar = real
    path = None if draft == "lookup" else str(api.shipped_drafter(draft))
    cfg = api.SpecConfig(draft=path, spec_type="ngram" if draft == "lookup" else "auto", policy=policy, tree=tree)
    spec = api.Speculator.build(cfg, target)
    assert spec.tree.on and "tree=" in spec.description
    st = SpecStats()
    assert [t for s in spec.session(target, ids, max_tokens=40, stats=st) for t in s] == ar
    if policy == "fixed" and draft != "lookup":
        assert max(st.verify_lengths) == 9
        chain = SpecStats()
        spec.tree = TreeSettings("off")
        assert [t for s in spec.session(target, ids, max_tokens=40, stats=chain) for t in s] == ar
        assert st.tau > chain.tau, (st.tau, chain.tau)


def test_cli_refuses_a_bad_tree_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mlxspec", "generate", "--prompt", "hi", "--tree", "wide"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("--tree 'wide': use off, auto, or a node count 1..64")
    assert "Traceback" not in r.stderr


def test_calibration_learns_what_siblings_really_get_and_shrinks_the_budget():
    """Node classes and exact factors: a drafter chain (0.9, 0.9) with a sibling at the root
    (predicted 0.45) and a first child under that sibling (off the chain). After the target
    accepts the chain every step, the siblings' factor falls to exactly (0 + 1) / (sum of the
    decayed predictions + 1), the chain's rises, and the cost-chosen budget drops the siblings."""
    from mlxspec.engine.tree import TreeCalibration, choose_budget

    def make():
        t = DraftTree(1)
        a = t.add(0, 10, 0.9, "drafter")
        t.add(a, 11, 0.81, "drafter")
        b = t.add(0, 20, 0.45, "drafter")
        t.add(b, 21, 0.405, "drafter")
        return t

    cal = TreeCalibration(decay=1.0)
    t = make()
    cal.rescore(t)
    assert [n.cls for n in t.nodes[1:]] == ["drafter/chain", "drafter/chain", "drafter/alt", "drafter/off"]
    assert [round(n.cond, 6) for n in t.nodes[1:]] == [0.9, 0.9, 0.45, 0.9]
    assert [round(n.score, 6) for n in t.nodes] == [1.0, 0.9, 0.81, 0.45, 0.405]  # no history: factor 1
    cost = [1.0, 1.05, 1.10, 1.15, 1.20]  # verify seconds by rows
    assert choose_budget([t.nodes[i].score for i in t.ranked()], cost, 0.0, 4) == 4
    for _ in range(10):
        t = make()
        cal.rescore(t)
        cal.observe(t, [0, 1, 2])  # the chain accepted; node 4's parent (3) never is: untried
    assert cal.factor("drafter/alt") == pytest.approx(1 / (10 * 0.45 + 1))
    assert cal.factor("drafter/chain") == pytest.approx((20 + 1) / (10 * 1.8 + 1))
    assert "drafter/off" not in cal.pred
    t = make()
    cal.rescore(t)
    assert t.nodes[3].score == pytest.approx(0.45 / 5.5)
    assert t.nodes[2].score == pytest.approx((0.9 * 21 / 19) ** 2)
    assert choose_budget([t.nodes[i].score for i in t.ranked()], cost, 0.0, 4) == 2


def test_a_chain_drafters_tree_stops_growing_where_the_budget_keeps_no_newest_node(real):
    """EAGLE-2's expansion sized by cost: after each depth, the tree grows on only if the budget
    (chosen by `choose_budget` over the scores so far) would verify one of that depth's nodes.
    Exact on a hand tree; on the shipped EAGLE-3 drafter, a verify whose every extra row costs a
    whole step stops the tree after its first depth (one drafter forward, not six), and a flat
    cost lets it reach the depth asked for."""
    import numpy as np

    from mlxspec import api
    from mlxspec.engine.tree import newest_pays
    from mlxspec.engine.verify import SamplingParams

    flat, steep = [1.0] * 65, [1.0 + k for k in range(10)]
    scores = [1.0, 0.9, 0.3, 0.2]  # node 3 is the newest depth's only node
    assert newest_pays(scores, [3], flat, 8) and not newest_pays(scores, [3], [1.0, 1.05, 1.1, 10.0], 8)
    assert newest_pays(scores, [1, 2], [1.0, 1.5, 10.0, 10.0], 8)  # node 1 alone pays: (1.9/1.5 > 1)
    # a fixed budget (--tree N, fixed policy): grown while a new node is among the N best
    assert newest_pays(scores, [3], None, 3) and not newest_pays(scores, [3], None, 2)

    target, ids, _ = real
    spec = api.Speculator.build(api.SpecConfig(draft=str(api.shipped_drafter("eagle3")), ngram=False), target)
    d = spec.make_drafter(target)
    _, taps = target(mx.array([ids]), target.make_cache(), taps=d.taps, logits="none")
    p = np.full(16, 0.6)
    for cost, depths in ((steep, 1), (flat, 6)):
        d.begin(ids, taps)
        tree = DraftTree(ids[-1])
        got = d.draft_tree(tree, 6, 4, SamplingParams(), np.random.default_rng(0), p,
                           lambda t, new: newest_pays([n.score for n in t.nodes], new, cost, 64))
        assert got == depths and max(n.depth for n in tree.nodes) == depths, (cost, got)
