"""DFlash 2 drafters: the selector chain on its own, the published z-lab layout, lineage from the
tensors (a DFlash 2 file is never read as DFlash), the sliding window, and the engine: greedy
output equals autoregressive, sampling stays within the TV bound, the adaptive policy and
prompt lookup run beside it. Conformance with mlx-vlm: test_dflash2_conformance.py."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.drafters.common import expected_shapes
from mlxspec.drafters.dflash2 import window_mask
from mlxspec.drafters.formats import zlab
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.drafters.build import make_model
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.loop import SpecStats
from mlxspec.engine.ngram import LookupBlockDrafter
from mlxspec.engine.policy import VerifyPolicy
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.kernels.markov import gumbel, seed_words
from mlxspec.kernels.selector import select_chain, teacher_scores
from test_dflash2_conformance import dflash2_config, random_dflash2
from mlxspec.engine import loop as engine
from test_engine import N_TOKENS, accept_everything, TINY_PROMPT, V, distribution_check, exact_distribution, run, sample_many, tiny_llama
from tiny_targets import tiny_target

FIXTURE = Path(__file__).parent / "data" / "zlab-dflash2"


# ----------------------------------------------------------------------------- the selector chain

def numpy_chain(unary, ids, hp, P, S, anchor, temperature=0.0, seed=None):
    """The chain written out with numpy, one row at a time."""
    prev, toks, scores = anchor, [], []
    for t in range(unary.shape[0]):
        s = unary[t] + np.array([np.sum(P[prev] * hp[t] * S[c]) for c in ids[t]])
        g = 0.0 if not temperature > 0 else np.asarray(gumbel(seed, t, len(s)))
        j = int(np.argmax(s if not temperature > 0 else s / temperature + g))
        prev = int(ids[t, j])
        toks.append(prev)
        scores.append(s)
    return toks, np.array(scores)


def chain_inputs(seed=0, n=5, k=4, R=8, V_=20):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(V_, k, replace=False) for _ in range(n)]).astype(np.int32)
    unary = np.sort(rng.standard_normal((n, k)).astype(np.float32), axis=1)[:, ::-1].copy()
    return (unary, ids, rng.standard_normal((n, R)).astype(np.float32),
            rng.standard_normal((V_, R)).astype(np.float32), rng.standard_normal((V_, R)).astype(np.float32))


def test_select_chain_hand_computed():
    # 2 rows, 2 candidates, rank 1: P[anchor=2]=5, hp=[1, -1]; row 0 scores 1+5*1*1=6 vs 2+5*1*(-1)=-3
    unary = np.array([[1.0, 2.0], [0.5, 0.0]], np.float32)
    ids = np.array([[3, 4], [1, 2]], np.int32)
    P = np.array([[0], [1], [5], [0], [-1]], np.float32)
    S = np.array([[0], [1], [-1], [1], [-1]], np.float32)
    hp = np.array([[1.0], [-1.0]], np.float32)
    toks, picks, scores = select_chain(*map(mx.array, (unary, ids, hp, P, S)), anchor=2)
    # the unary winner (4) loses to 3 once the pairwise term counts; row 1 from 3: P[3]=0 -> unary
    assert toks.tolist() == [3, 1] and picks.tolist() == [0, 0]
    np.testing.assert_allclose(np.asarray(scores), [[6.0, -3.0], [0.5, 0.0]])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_select_chain_matches_numpy_and_teacher_forcing(temperature):
    unary, ids, hp, P, S = chain_inputs()
    seed = seed_words(12345)
    toks, picks, scores = select_chain(*map(mx.array, (unary, ids, hp, P, S)), 7, temperature, 12345)
    ref_toks, ref_scores = numpy_chain(unary, ids, hp, P, S, 7, temperature, seed)
    assert toks.tolist() == ref_toks
    assert [int(ids[t, j]) for t, j in enumerate(picks.tolist())] == ref_toks
    np.testing.assert_allclose(np.asarray(scores), ref_scores, rtol=1e-5, atol=1e-5)
    # teacher forcing with the chain's own predecessors gives the chain's scores
    prev = mx.array([7] + ref_toks[:-1])
    tf = teacher_scores(*map(mx.array, (unary, ids, hp, P, S)), prev)
    np.testing.assert_allclose(np.asarray(tf), ref_scores, rtol=1e-5, atol=1e-5)


def test_select_chain_sampling_draws_softmax_over_the_candidates():
    unary, ids, hp, P, S = chain_inputs(n=1, k=4)
    counts = np.zeros(4)
    for key in range(3000):
        _, picks, scores = select_chain(*map(mx.array, (unary, ids, hp, P, S)), 3, 1.5, key)
        counts[int(picks[0].item())] += 1
    q = np.exp(np.asarray(scores[0]) / 1.5)
    q /= q.sum()
    assert 0.5 * np.abs(counts / counts.sum() - q).sum() < 0.03


# ----------------------------------------------------------------------------- the published layout

def fixture_spec():
    config = json.loads((FIXTURE / "config.json").read_text())
    header = json.loads((FIXTURE / "safetensors-header.json").read_text())
    shapes = {k: tuple(v["shape"]) for k, v in header.items()}
    fields, key, value, extra = zlab.header(config, "fixture", shapes)
    return fields, shapes, (key, value)


def test_published_config_and_header_are_read_as_dflash2():
    fields, shapes, (key, value) = fixture_spec()
    cfg = dataclasses.replace(dflash2_config(), **fields)
    assert cfg.lineage == "dflash2" and value is None  # bonus-anchor by the z-lab convention
    assert (cfg.selector_top_k, cfg.selector_rank, cfg.conv_kernel_size, cfg.conv_group_size) == (16, 256, 2, 16)
    assert cfg.final_logit_softcapping == 20.0 and abs(cfg.output_multiplier - 0.19611613513818404) < 1e-12
    assert cfg.layer_types == ("sliding_attention",) * 5 and cfg.sliding_window == 2048
    assert cfg.block_causal is False and cfg.rope_theta == 500000.0 and cfg.target_layer_ids == [1, 13, 25, 37, 49]
    # every tensor of the published header, each with its shape, and nothing else
    assert expected_shapes(cfg) == shapes


def test_dflash2_tensors_under_a_dflash_config_are_refused_by_name(tmp_path):
    cfg = dflash2_config()
    path = tmp_path / "d"
    save_drafter(random_dflash2(cfg), cfg, path, "zlab", target=tiny_target("qwen3"))
    c = json.loads((path / "config.json").read_text())
    c["architectures"] = ["DFlashDraftModel"]
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del c["dflash_config"][k]
    (path / "config.json").write_text(json.dumps(c))
    with pytest.raises(MlxspecError) as e:
        load_drafter(str(path), log=io.StringIO())
    msg = str(e.value)
    assert "DFlash 2's" in msg and "read as DFlash it would draft without them" in msg
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight", "layers.1.mlp_conv.kernel_projection.weight",
                 "layers.0.attention_conv.base_kernel"):
        assert name in msg


def test_dflash2_config_missing_its_tensors_names_them(tmp_path):
    cfg = dflash2_config()
    path = tmp_path / "d"
    save_drafter(random_dflash2(cfg), cfg, path, "zlab", target=tiny_target("qwen3"))
    w = mx.load(str(path / "model.safetensors"))
    for k in [k for k in w if "conv" in k or k.startswith("candidate_selector.")]:
        del w[k]
    mx.save_safetensors(str(path / "model.safetensors"), w)
    with pytest.raises(MlxspecError) as e:
        load_drafter(str(path), log=io.StringIO())
    msg = str(e.value)
    assert "missing tensors" in msg and "DFlash 2 path selector" in msg and "DFlash 2 convolutions" in msg
    assert "candidate_selector.successor_codebook" in msg and "layers.1.attention_conv.base_kernel" in msg


@pytest.mark.parametrize("requested", ["draft-dflash", "draft-dspark"])
def test_requested_type_only_warns_and_init_line(tmp_path, requested):
    cfg = dflash2_config()
    path = tmp_path / "d"
    save_drafter(random_dflash2(cfg), cfg, path, "zlab", target=tiny_target("qwen3"))
    log = io.StringIO()
    _, got = load_drafter(str(path), requested=requested, log=log)
    lines = log.getvalue().splitlines()
    assert got.lineage == "dflash2"
    assert lines[0].startswith(f"mlxspec: warning: requested {requested} but ")
    assert "a DFlash 2 drafter (path selector top-8, rank 16" in lines[0] and "using draft-dflash2" in lines[0]
    assert ("draft one row early" in lines[0]) == (requested == "draft-dspark")
    assert "lineage=dflash2 sample_from_anchor=false" in lines[1]
    assert "selector=top8/r16 conv=2x8 window=8" in lines[1]
    log = io.StringIO()
    load_drafter(str(path), requested="draft-dflash2", log=log)
    assert len(log.getvalue().splitlines()) == 1


def test_zlab_round_trip_keeps_everything(tmp_path):
    cfg = dflash2_config(block_causal=None)
    m = random_dflash2(cfg)
    path = tmp_path / "d"
    save_drafter(m, cfg, path, "zlab", target=tiny_target("qwen3"))
    m2, c2 = load_drafter(str(path), log=io.StringIO())
    for f in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
              "final_logit_softcapping", "layer_types", "sliding_window", "block_causal", "target_layer_ids"):
        assert getattr(c2, f) == getattr(cfg, f), f
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(m.parameters())), dict(tree_flatten(m2.parameters()))
    assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)


# ----------------------------------------------------------------------------- sliding window

def test_window_mask_is_absolute_positions():
    m = np.asarray(window_mask(mx.array([[10, 11]]), mx.array([[6, 7, 8, 10, 11]]), 4, False))[0, 0]
    # q=10 sees k in 7..10 (q - k < 4) and the later block row 11; q=11 sees 8..11
    assert m.tolist() == [[False, True, True, True, True], [False, False, True, True, True]]
    c = np.asarray(window_mask(mx.array([[10, 11]]), mx.array([[8, 10, 11]]), None, True))[0, 0]
    assert c.tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize("p", [3, 5, 9, 20])
def test_drafting_fast_path_equals_the_general_mask(p):
    """The drafting path slices the context to what row 0 can see and masks only when a row
    needs it; the general path masks the whole context by positions. Same hidden states."""
    cfg = dflash2_config(block_causal=None)  # z-lab's absent is_causal: sliding layers causal
    m = random_dflash2(cfg, seed=3)
    rng = np.random.default_rng(p)
    taps = mx.array(rng.standard_normal((1, p, 2 * 32)), dtype=mx.float32)
    kv = m.layer_context_kv(m.context(taps), mx.arange(p)[None])
    emb = mx.array(rng.standard_normal((1, 4, 32)), dtype=mx.float32)
    pos = mx.arange(p, p + 4)[None]
    fast = m.hidden(emb, pos, kv, anchor_pos=p)
    general = m.hidden(emb, pos, kv)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(general), rtol=1e-5, atol=1e-5)
    if p + 3 >= cfg.sliding_window:  # the window changes the result
        mw = make_model(dataclasses.replace(cfg, sliding_window=1 << 20))
        mw.update(m.parameters())
        assert np.abs(np.asarray(mw.hidden(emb, pos, kv)) - np.asarray(fast)).max() > 1e-3


# ----------------------------------------------------------------------------- engine

@pytest.fixture(scope="module")
def qwen():
    target = tiny_target("qwen3", seed=0)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 60, 12)]
    return target, ids, run(target, ids, max_tokens=30)


@pytest.mark.parametrize("window, block", [(8, 4), (3, 6), (None, 8)])
def test_greedy_is_lossless(qwen, window, block):
    target, ids, ar = qwen
    cfg = dflash2_config(block_size=block, sliding_window=window,
                         layer_types=("sliding_attention", "full_attention") if window else None)
    d = BlockDrafter(random_dflash2(cfg, seed=block), target)
    assert d.name == "dflash2" and d.max_drafts == block - 1
    stats = SpecStats()
    assert run(target, ids, d, max_tokens=30, stats=stats) == ar
    assert stats.drafted > 0


def test_policy_and_prompt_lookup_beside_it(qwen):
    target, ids, ar = qwen
    cfg = dflash2_config()
    block = BlockDrafter(random_dflash2(cfg, seed=2), target)
    d = LookupBlockDrafter(block, target.info.vocab_size)
    pol = VerifyPolicy([1.0, 1.1, 1.2, 1.3], d.max_drafts)
    stats = SpecStats()
    assert run(target, ids + ids, d, max_tokens=30, stats=stats, policy=pol) == run(target, ids + ids, max_tokens=30)


@pytest.fixture(scope="module")
def tiny():
    target = tiny_llama(1)
    cfg = dflash2_config(vocab_size=V, mask_token_id=7, selector_top_k=4, selector_rank=8, block_size=4,
                         target_layer_ids=[0], sliding_window=3, final_logit_softcapping=3.0, output_multiplier=1.0)
    return target, random_dflash2(cfg, seed=4)


def test_sampling_is_lossless(tiny, monkeypatch):
    """The draft distribution verification receives is softmax(score / T) over the k = 4
    candidates (zero on the other 4 tokens); the sampled sequences follow the target's."""
    target, m = tiny
    sp = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)
    stats = SpecStats()
    res = distribution_check(sample_many(target, lambda: BlockDrafter(m, target), sp, 1500, stats), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"
    assert 0.05 < stats.accepted / stats.drafted < 0.95
    monkeypatch.setattr(engine, "accept_sampled", accept_everything)  # the check catches a wrong rule
    wrong = distribution_check(sample_many(target, lambda: BlockDrafter(m, target), sp, 400), exact)
    assert any(t > b for t, b in wrong.values()), wrong


def test_sampled_draft_q_is_the_candidate_softmax(tiny):
    target, m = tiny
    d = BlockDrafter(m, target)
    _, taps = target(mx.array([TINY_PROMPT]), target.make_cache(), taps=d.taps)
    d.begin(TINY_PROMPT, taps)
    out = d.draft(5, 3, SamplingParams(temperature=0.7), np.random.default_rng(1))
    q = np.asarray(out.probs)
    assert q.shape == (3, V) and np.allclose(q.sum(-1), 1.0, atol=1e-5)
    assert ((q > 0).sum(-1) <= 4).all()  # zero outside the 4 candidates
    assert all(q[i, t] > 0 for i, t in enumerate(out.tokens))


# ----------------------------------------------------------------------------- GGUF

@pytest.mark.parametrize("causal", [False, True])
def test_gguf_round_trip_and_llama_cpp_names(tmp_path, causal):
    from mlxspec.gguf.file import read_gguf

    cfg = dflash2_config(block_causal=causal)
    m = random_dflash2(cfg)
    path = tmp_path / "d2.gguf"
    save_drafter(m, cfg, path, "gguf", target=tiny_target("qwen3"))
    g = read_gguf(str(path))
    names = {t.name: tuple(t.shape) for t in g.tensors}
    assert g.architecture == "dflash"
    assert names["selector_predecessor.weight"] == (64, 16) and names["selector_hidden.weight"] == (16, 32)
    assert names["blk.0.attn_conv_base"] == (2, 2, 32) and names["blk.1.ffn_conv_proj.weight"] == (16, 32)
    assert g.metadata["dflash.selector_top_k"] == 8 and g.metadata["dflash.attention.sliding_window"] == 8
    assert list(g.metadata["dflash.target_layers"]) == [1, 3]  # layer-input ids
    m2, c2 = load_drafter(str(path), log=io.StringIO())
    for f in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "final_logit_softcapping",
              "layer_types", "sliding_window", "block_causal", "target_layer_ids", "sample_from_anchor"):
        assert getattr(c2, f) == getattr(cfg, f), f
    assert abs(c2.output_multiplier - cfg.output_multiplier) < 1e-6
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(m.parameters())), dict(tree_flatten(m2.parameters()))
    assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_gguf_without_the_selector_key_is_refused_by_name(tmp_path):
    from test_drafter_formats import rewrite_gguf

    cfg = dflash2_config()
    src, dst = tmp_path / "a.gguf", tmp_path / "b.gguf"
    save_drafter(random_dflash2(cfg), cfg, src, "gguf", target=tiny_target("qwen3"))
    rewrite_gguf(src, dst, drop_keys=("dflash.selector_top_k",))
    with pytest.raises(MlxspecError) as e:
        load_drafter(str(dst), log=io.StringIO())
    msg = str(e.value)
    assert "no dflash.selector_top_k" in msg and "read as DFlash it would draft without them" in msg
    assert "selector_successor.weight" in msg and "blk.1.attn_conv_base" in msg


# ----------------------------------------------------------------------------- speculators

def test_speculators_dflash2_round_trip(tmp_path):
    """speculators 0.9.0's DFlash2SpeculatorConfig: its keys, no multiplier or softcap."""
    cfg = dflash2_config(output_multiplier=1.0, final_logit_softcapping=None)
    m = random_dflash2(cfg)
    path = tmp_path / "s"
    save_drafter(m, cfg, path, "speculators", target=tiny_target("qwen3"))
    c = json.loads((path / "config.json").read_text())
    assert c["speculators_model_type"] == "dflash2" and c["architectures"] == ["DFlash2DraftModel"]
    assert (c["selector_top_k"], c["selector_rank"], c["conv_kernel_size"], c["conv_group_size"]) == (8, 16, 2, 8)
    assert c["sliding_window_non_causal"] is True and c["transformer_layer_config"]["sliding_window"] == 8
    m2, c2 = load_drafter(str(path), log=io.StringIO())
    assert c2.lineage == "dflash2" and c2.layer_types == cfg.layer_types and c2.block_causal is False
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(m.parameters())), dict(tree_flatten(m2.parameters()))
    assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)
    with pytest.raises(MlxspecError, match="output multiplier or softcap"):
        save_drafter(m, dflash2_config(), tmp_path / "t", "speculators", target=tiny_target("qwen3"))
    # the same tensors declared as speculators dflash are refused by name
    c["speculators_model_type"] = "dflash"
    (path / "config.json").write_text(json.dumps(c))
    with pytest.raises(MlxspecError, match="tensors are DFlash 2's.*candidate_selector.successor_codebook"):
        load_drafter(str(path), log=io.StringIO())


# ----------------------------------------------------------------------------- registry

def test_draft_auto_knows_the_published_dflash2_drafter():
    from mlxspec.drafters.registry import describe, lookup

    for target in ("Qwen/Qwen3.8-27B", "mlx-community/Qwen3.8-27B-4bit", "unsloth/Qwen3.8-27B-Q4_K_M.gguf"):
        e = lookup(target)
        assert e["drafter"] == "z-lab/Qwen3.8-27B-DFlash2" and e["lineage"] == "dflash2", target
    assert describe("Qwen/Qwen3.8-27B").startswith("z-lab/Qwen3.8-27B-DFlash2 (dflash2, z-lab; registry v4)")


def test_packed_blocks_equal_separate_drafts():
    """The trainer's shape: two blocks packed in one row (block_size keeps the convs apart, the
    mask keeps the attention apart) give each block's drafting-path hidden states."""
    cfg = dflash2_config(sliding_window=6)
    m = random_dflash2(cfg, seed=5)
    rng = np.random.default_rng(0)
    L = 12
    kv = m.layer_context_kv(m.context(mx.array(rng.standard_normal((1, L, 64)), dtype=mx.float32)),
                            mx.arange(L)[None])
    anchors = [5, 9]
    emb = mx.array(rng.standard_normal((1, 8, 32)), dtype=mx.float32)
    pos = mx.array([[a + j for a in anchors for j in range(4)]])
    vis_ctx = np.arange(L)[None, :] < np.repeat(anchors, 4)[:, None]
    same = np.repeat(np.arange(2), 4)
    mask = mx.array(np.concatenate([vis_ctx, same[:, None] == same[None, :]], axis=1)[None, None])
    packed = m.hidden(emb, pos, kv, mask=mask, block_size=4)[0]
    for i, a in enumerate(anchors):
        sub = [(k[:, :, :a], v[:, :, :a]) for k, v in kv]
        one = m.hidden(emb[:, 4 * i : 4 * i + 4], mx.arange(a, a + 4)[None], sub, anchor_pos=a)[0]
        np.testing.assert_allclose(np.asarray(packed[4 * i : 4 * i + 4]), np.asarray(one), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- command line

def test_generate_with_a_dflash2_drafter_and_a_disagreeing_spec_type(tmp_path):
    """mlxspec generate --draft DIR: the init line says lineage=dflash2 with the selector; a
    --spec-type draft-dflash only warns; the text is the plain run's."""
    import subprocess
    import sys

    from tiny_targets import write_tiny_dir

    _, model_dir = write_tiny_dir(tmp_path / "target", "qwen3", seed=0)
    cfg = dflash2_config()
    save_drafter(random_dflash2(cfg), cfg, tmp_path / "d2", "zlab", target=tiny_target("qwen3", seed=0))

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "mlxspec.cli", "generate", "--model", model_dir, "--prompt",
                            "w1 w2 w3 w4", "--max-tokens", "12", "--temp", "0", *args], capture_output=True, text=True,
                           timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        return r

    plain = cli("--draft", "none")
    got = cli("--draft", str(tmp_path / "d2"), "--spec-type", "draft-dflash")
    assert "warning: requested draft-dflash but" in got.stderr and "using draft-dflash2" in got.stderr
    assert "lineage=dflash2" in got.stderr and "selector=top8/r16" in got.stderr
    text = lambda r: r.stdout.split("==========")[1]  # noqa: E731 (the generated text, not the timings)
    assert text(got) == text(plain) and text(plain).strip()
    ok = cli("--draft", str(tmp_path / "d2"), "--spec-type", "draft-dflash2")
    assert "warning" not in ok.stderr and text(ok) == text(plain)


def test_inspect_describes_a_dflash2_drafter(tmp_path):
    from mlxspec.inspect import inspect_path

    cfg = dflash2_config()
    save_drafter(random_dflash2(cfg), cfg, tmp_path / "d2", "zlab", target=tiny_target("qwen3"))
    text = inspect_path(str(tmp_path / "d2"))
    assert "role: drafter (dflash2), format zlab" in text
    assert ("DFlash 2: path selector top-8, rank 16; convs 2 taps, groups of 8; logits x0.7, softcap 6.0; "
            "1 of 2 layers sliding (window 8); causal blocks: no") in text


def test_drafts_do_not_depend_on_how_the_context_arrived(qwen):
    """z-lab's absolute window is a function of positions only: the context appended in one
    piece or in several gives the same drafts, also once the window binds."""
    target, ids, _ = qwen
    cfg = dflash2_config(sliding_window=5)
    m = random_dflash2(cfg, seed=7)
    _, taps = target(mx.array([ids]), target.make_cache(), taps=tuple(cfg.target_layer_ids))
    one = BlockDrafter(m, target, dtype=mx.float32)
    one.begin(ids[:11], taps[:, :11])
    pieces = BlockDrafter(m, target, dtype=mx.float32)
    pieces.begin(ids[:2], taps[:, :2])
    for a, b in ((2, 3), (3, 7), (7, 11)):
        pieces.draft(ids[a], 3, SamplingParams(), np.random.default_rng(0))
        pieces.accept(ids[a:b], taps[:, a:b])
    x = one.draft(ids[11], 3, SamplingParams(), np.random.default_rng(0))
    y = pieces.draft(ids[11], 3, SamplingParams(), np.random.default_rng(0))
    assert x.tokens == y.tokens
    np.testing.assert_allclose(np.asarray(x.logits), np.asarray(y.logits), rtol=1e-5, atol=1e-5)
