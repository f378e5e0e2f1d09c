"""EAGLE-3 training (mlxspec/train/eagle3.py): its training-time-test pass is exactly the chain
the drafting runtime proposes, and a short run learns a target it can see."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model
from mlxspec.engine.eagle3 import Eagle3Drafter
from mlxspec.engine.verify import SamplingParams
from mlxspec.train.eagle3 import ttt_hidden
from tiny_targets import tiny_target


def random_eagle3(target, taps=(0, 1, 2), draft_vocab=48, nbr=False, seed=1, layers=1) -> tuple[Eagle3Model, Eagle3Config]:
    info = target.info
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=info.vocab_size, draft_vocab_size=draft_vocab,
                       target_hidden_size=info.hidden_size, target_layer_ids=tuple(taps),
                       file_layer_ids=tuple(t + 1 for t in taps), norm_before_residual=nbr)
    m = Eagle3Model(cfg)
    mx.random.seed(seed)
    m.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.3 if w.dtype == mx.float32 else w, m.parameters()))
    if cfg.reduced_vocab:
        ids = np.sort(np.random.default_rng(seed).choice(info.vocab_size, draft_vocab, replace=False))
        m.d2t = mx.array(ids - np.arange(draft_vocab)).astype(mx.int32)
    return m, cfg


@pytest.mark.parametrize("nbr,layers", [(False, 1), (True, 1), (False, 2), (True, 3)])
def test_ttt_pass_is_the_drafted_chain(nbr, layers):
    """Feed the drafter's own greedy chain as the 'true' tokens: the TTT pass at the anchor's
    pair must give the same chain, and the same logits (1e-4), for deeper drafters too."""
    target = tiny_target("llama", seed=0)
    model, cfg = random_eagle3(target, nbr=nbr, layers=layers)
    d = Eagle3Drafter(model, cfg, target, max_drafts=5)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(0, 60, 9)]
    anchor = 7
    _, taps = target(mx.array([prompt]), target.make_cache(), taps=d.taps, logits="last")
    d.begin(prompt, taps)
    out = d.draft(anchor, 5, SamplingParams(), rng)
    tokens = np.array(prompt + [anchor] + out.tokens, np.int32)
    L = len(tokens)
    full_taps = mx.concatenate([taps, mx.random.normal((1, L - taps.shape[1], taps.shape[2]))], axis=1)
    emb = target.embed(mx.arange(target.info.vocab_size))
    outs = ttt_hidden(model, emb, full_taps, mx.array(tokens[None]), 5)
    i = len(prompt) - 1  # the pair (last prompt tap, anchor)
    logits = mx.stack([d.logits(h[:, i:i + 1])[0, 0] for h in outs])
    assert float(mx.abs(logits - out.logits).max()) < 1e-4
    assert d.to_target(mx.argmax(logits, axis=-1)).tolist() == out.tokens


@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_on_a_subset_of_positions_equals_the_full_pass(layers):
    target = tiny_target("llama", seed=0)
    model, cfg = random_eagle3(target, layers=layers)
    rng = np.random.default_rng(3)
    L = 20
    taps = mx.random.normal((2, L, 3 * target.info.hidden_size))
    tokens = mx.array(rng.integers(0, 64, (2, L)).astype(np.int32))
    emb = target.embed(mx.arange(target.info.vocab_size))
    full = ttt_hidden(model, emb, taps, tokens, 4)
    sel = mx.array([0, 3, 7, 18])
    part = ttt_hidden(model, emb, taps, tokens, 4, sel)
    assert float(mx.abs(part[0] - full[0]).max()) < 1e-5
    for k in range(1, 4):
        assert float(mx.abs(part[k] - full[k][:, sel]).max()) < 1e-4


def test_train_eagle3_exports_a_drafter_that_loads_resumes_and_is_lossless(tmp_path, capsys):
    """`mlxspec train --lineage eagle3` end to end on a tiny target: a store, a few seconds of
    training, a speculators-eagle3 export that loads back (lineage eagle3, the trained taps) and
    drafts under the engine with greedy output equal to the target's; a second run resumes."""
    import io
    import json

    import conftest

    from mlxspec.cli import main
    from mlxspec.drafters.load import load_drafter
    from mlxspec.engine.loop import SpecStats
    from mlxspec.targets.load import load_target
    from test_engine import run

    model = tmp_path / "tiny.gguf"
    conftest.write_tiny_model(model)
    d, out = tmp_path / "d", tmp_path / "o"
    common = ["train", "--model", str(model), "--data", str(d), "--out", str(out), "--lineage", "eagle3",
              "--corpus", "fortunes=/usr/share/games/fortunes/*", "--tokens", "fortunes=512", "--seq-len", "32",
              "--draft-vocab", "200", "--ttt-steps", "3"]
    assert main(common + ["--prepare-only"]) == 0, capsys.readouterr().err
    assert main(common + ["--minutes", "0.05"]) == 0, capsys.readouterr().err
    state = json.loads((out / "state.json").read_text())
    assert state["step"] > 0 and state["config"]["taps"] == [0]
    assert main(common + ["--minutes", "0.1"]) == 0
    assert "resumed" in capsys.readouterr().out
    assert json.loads((out / "state.json").read_text())["step"] > state["step"]
    target, tok = load_target(str(model))
    m, cfg = load_drafter(str(out / "hf"), target.info, log=io.StringIO())
    assert cfg.lineage == "eagle3" and cfg.target_layer_ids == (0,) and cfg.draft_vocab_size == 200
    ids = tok.encode("the the the", add_special_tokens=False)
    st = SpecStats()
    assert run(target, ids, Eagle3Drafter(m, cfg, target, 3), max_tokens=24, stats=st) == run(target, ids, max_tokens=24)
    assert st.drafted > 0

    # --init-from continues an export: its weights and draft vocabulary (at lr ~0 it exports them back)
    again = tmp_path / "o2"
    args = [a if a != str(out) else str(again) for a in common]
    assert main(args + ["--minutes", "0.02", "--init-from", str(out / "hf"), "--lr", "1e-12"]) == 0
    m2, cfg2 = load_drafter(str(again / "hf"), target.info, log=io.StringIO())
    assert cfg2.draft_vocab_size == 200 and np.array_equal(np.asarray(m2.d2t), np.asarray(m.d2t))
    np.testing.assert_allclose(np.asarray(m2.fc.weight), np.asarray(m.fc.weight), atol=1e-6)
    losses = [h["loss"] for h in json.loads((again / "state.json").read_text())["history"] if "loss" in h]
    assert losses and np.isfinite(losses).all()
    ckpt = mx.load(str(again / "checkpoint.safetensors"))
    assert {str(v.dtype) for v in ckpt.values()} == {"mlx.core.float32"}  # trained in float32, whatever the export's
    capsys.readouterr()
    assert main(args + ["--minutes", "0.02", "--init-from", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err

    # --online: no store, the target runs on each step's corpus windows; resumable at the cursor
    online = ["train", "--model", str(model), "--out", str(tmp_path / "on"), "--lineage", "eagle3", "--online",
              "--corpus", "fortunes=/usr/share/games/fortunes/*", "--tokens", "fortunes=512", "--seq-len", "32",
              "--data-batch", "4", "--draft-vocab", "200", "--ttt-steps", "3"]
    assert main(online + ["--minutes", "0.02"]) == 0, capsys.readouterr().err
    st = json.loads((tmp_path / "on" / "state.json").read_text())
    assert st["step"] > 0 and st["cursor"] == 4 * st["step"] and st["source"]["kind"] == "online-corpus"
    m3, cfg3 = load_drafter(str(tmp_path / "on" / "hf"), target.info, log=io.StringIO())
    st3 = SpecStats()
    assert run(target, ids, Eagle3Drafter(m3, cfg3, target, 3), max_tokens=24, stats=st3) == run(target, ids, max_tokens=24)


def test_heldout_replay_equals_the_engine_for_eagle3(smollm2, tmp_path):
    """`train.heldout.heldout_tau` with the EAGLE-3 lengths (one TTT pass + the greedy anchor walk)
    gives the engine's own counts (fixed policy, chains of 7, no lookup) for the shipped EAGLE-3
    drafter on the same held-out prompts: accepted/drafted, tau, per-position acceptance."""
    import io

    from mlxspec.api import shipped_drafter
    from mlxspec.drafters.load import load_drafter
    from mlxspec.evaluate import evaluate_drafter
    from mlxspec.train.eagle3 import frozen_for_eagle3, heldout_lengths
    from mlxspec.train.heldout import build_heldout, heldout_tau

    target, tok = smollm2
    path = shipped_drafter("eagle3")
    assert path is not None, "the shipped EAGLE-3 drafter is missing from mlxspec/weights/"
    m, cfg = load_drafter(str(path), target.info, log=io.StringIO())
    Eagle3Drafter(m, cfg, target)  # as the engine runs it (float32 on CPU)
    frozen = frozen_for_eagle3(target, m)
    cats = ("code", "chat")
    store = build_heldout(target, tok, list(cfg.target_layer_ids), tmp_path / "heldout", n_per_category=2,
                          max_tokens=32, categories=cats)
    mine = heldout_tau(m, frozen, store, categories=cats, lengths=heldout_lengths(m, frozen, cfg.max_drafts),
                       n_drafts=cfg.max_drafts)
    ref = evaluate_drafter(target, tok, path, n_per_category=2, max_tokens=32, categories=cats, log=io.StringIO())
    assert sum(ref[c]["accepted"] for c in cats) > 0
    for cat in cats:
        assert (mine[cat]["accepted"], mine[cat]["drafted"]) == (ref[cat]["accepted"], ref[cat]["drafted"])
        assert mine[cat]["tau"] == pytest.approx(ref[cat]["tau"])
        np.testing.assert_allclose(mine[cat]["per_position_acceptance"], ref[cat]["per_position_acceptance"])


def test_regen_chat_questions_mix_three_kinds_and_never_the_heldout_ones():
    """The regenerated store's chat prompts ask about code, about the docs, and the way people
    ask a chat model (what / tips / summarize / a poem, sayings from the fortunes files), in
    equal parts from the first question on; the held-out chat questions never occur."""
    from mlxspec.prompts import CHAT_QUESTIONS
    from mlxspec.train.regen import chat_questions

    qs = chat_questions(0)
    assert [c for c, _ in qs[:6]] == ["chat-code", "chat-prose", "chat-gen"] * 2
    gen = [q for c, q in qs if c == "chat-gen"]
    assert any(q.startswith("What does this saying mean?") for q in gen)
    assert any(q.startswith("Write a short poem about") for q in gen)
    assert not set(CHAT_QUESTIONS) & {q for _, q in qs}


def test_regen_corpus_prefixes_take_a_file_exactly_twice_the_prefix_long():
    """A training file that tokenizes to exactly 2 x prefix_len tokens is a valid source (Gemma's
    tokenizer hit it on the real corpus: `rng.integers(0, 0)` raised `ValueError: high <= 0` and
    the store was never written); shorter files are skipped."""
    from mlxspec.train.regen import corpus_prefixes

    firsts = set()

    class ExactLength:  # every file tokenizes to exactly 2 x 8 ids, file-specific
        def encode(self, text, add_special_tokens=False):
            h = 1000 * (abs(hash(text)) % 10**6)
            firsts.add(h)
            return [h + i for i in range(16)]

    out = corpus_prefixes(ExactLength(), 8, 6)
    assert len(out) == 6 and [c for c, _ in out] == ["code", "prose"] * 3
    # each prefix is its file's first 8 ids: offset 0 is the only start that leaves 8 ids to continue
    assert all(ids == list(range(ids[0], ids[0] + 8)) and ids[0] in firsts for _, ids in out)


# ----------------------------------------------------------------------------- --online

ONLINE_TAPS = [1, 14, 26]
ONLINE_SRC = {"fortunes": ["/usr/share/games/fortunes/*"]}
ONLINE_BUDGET = {"fortunes": 256}  # 8 windows of 32 tokens


def _online_source(smollm2):
    from mlxspec.train.online import OnlineCorpus

    target, tok = smollm2
    return OnlineCorpus(target, tok, ONLINE_TAPS, seq_len=32, tokens_per_category=ONLINE_BUDGET, batch=4,
                        sources=ONLINE_SRC)


def _online_tc():
    from mlxspec.train.eagle3 import Eagle3TrainConfig

    # a budget no test reaches: the cosine factor stays 1 in float32, so the steps do not depend on timing
    return Eagle3TrainConfig(taps=ONLINE_TAPS, draft_vocab=512, ttt_steps=3, lr=1e-3, warmup=2, minutes=1e6,
                             seqs_per_step=2, seq_len=32, ttt_fraction=0.5, save_minutes=1e6)


def _eagle3_weights(out):
    return {k: np.asarray(v) for k, v in mx.load(str(out / "checkpoint.safetensors")).items()}


def test_online_eagle3_equals_a_store_of_the_same_windows_read_in_order_and_resumes_at_the_next_window(
        smollm2, tmp_path):
    """`mlxspec train --lineage eagle3 --online`: 4 steps over the 8 corpus windows (2 a step)
    equal 4 steps over a store prepared from the same windows, read in order (same draft
    vocabulary, losses, weights); stopped after 2 steps and resumed, the run reads windows 4-7
    only and ends with the same weights; the checkpoint keeps the cursor."""
    import json

    from mlxspec.train.data import load_shards, prepare_shards
    from mlxspec.train.eagle3 import StoreInOrder, train_eagle3

    target, tok = smollm2
    quiet = lambda *a: None  # noqa: E731
    src = _online_source(smollm2)
    on = train_eagle3(target, src, tmp_path / "on", _online_tc(), log=quiet, stop_after=4)
    assert on["steps"] == 4 and src.target_tokens == 8 * 32  # each window through the target once
    store = tmp_path / "store"
    prepare_shards(target, tok, store, ONLINE_TAPS, seq_len=32, tokens_per_category=ONLINE_BUDGET, batch=4,
                   sources=ONLINE_SRC)
    off = train_eagle3(target, StoreInOrder(load_shards(store)), tmp_path / "off", _online_tc(), log=quiet,
                       stop_after=4)
    st_on, st_off = (json.loads((tmp_path / d / "state.json").read_text()) for d in ("on", "off"))
    assert st_on["d_ids"] == st_off["d_ids"] and len(st_on["d_ids"]) == 512
    assert st_on["cursor"] == st_off["cursor"] == 8 and st_on["source"]["kind"] == "online-corpus"
    w_on, w_off = _eagle3_weights(tmp_path / "on"), _eagle3_weights(tmp_path / "off")
    assert w_on.keys() == w_off.keys()
    for k in w_on:
        np.testing.assert_allclose(w_on[k], w_off[k], rtol=0, atol=1e-6, err_msg=k)

    first = _online_source(smollm2)
    train_eagle3(target, first, tmp_path / "run", _online_tc(), log=quiet, stop_after=2)
    assert json.loads((tmp_path / "run" / "state.json").read_text())["cursor"] == 4
    again = _online_source(smollm2)
    msgs = []
    train_eagle3(target, again, tmp_path / "run", _online_tc(), log=msgs.append, stop_after=4)
    assert msgs[0].startswith(f"mlxspec train: resumed {tmp_path / 'run'} at step 2")
    assert (again.first_taken, again.taken) == (4, 4)  # the next unseen windows, each once
    for k, v in _eagle3_weights(tmp_path / "run").items():
        np.testing.assert_allclose(v, w_on[k], rtol=0, atol=1e-6, err_msg=k)
    # other online data on resume is refused: the cursor would point into another plan of windows
    from mlxspec.errors import MlxspecError
    from mlxspec.train.online import OnlineCorpus

    other = OnlineCorpus(target, tok, ONLINE_TAPS, seq_len=32, tokens_per_category={"fortunes": 320}, batch=4,
                         sources=ONLINE_SRC)
    with pytest.raises(MlxspecError, match="holds a run trained on other online data"):
        train_eagle3(target, other, tmp_path / "run", _online_tc(), log=quiet, stop_after=6)


def test_chat_weight_draws_chat_windows_that_much_more_often_and_weight_one_draws_as_before():
    from mlxspec.train.eagle3 import Windows

    def store(n, chat):
        return {"tokens": np.zeros((n, 8), np.int32),
                "source": np.array(["chat-t0" if i < chat else "cont-t0" for i in range(n)])}

    stores = [store(40, 20), store(60, 10)]  # 30 chat windows of 100
    w = Windows(stores, 8, seed=3, chat_weight=3.0)
    draws = [w._draw() for _ in range(6000)]
    chat = np.mean([str(s["source"][i]).startswith("chat") for s, i in draws])
    assert abs(chat - 90 / 160) < 0.02  # 30 * 3 / (30 * 3 + 70)
    # every window can be drawn, from the store it belongs to
    assert {(id(s), i) for s, i in draws} == {(id(s), i) for s in stores for i in range(len(s["tokens"]))}
    b = Windows(stores, 8, seed=3, chat_weight=1.0)  # the draws of runs before --chat-weight existed
    old = np.random.default_rng(3)
    p = np.array([40, 60]) / 100
    for _ in range(50):
        s = stores[old.choice(2, p=p)]
        expected = (id(s), int(old.integers(len(s["tokens"]))))
        got = b._draw()
        assert (id(got[0]), got[1]) == expected


def test_chat_weight_without_chat_windows_or_for_a_block_lineage_is_one_line(tmp_path, capsys):
    from mlxspec.cli import main
    from mlxspec.errors import MlxspecError
    from mlxspec.train.eagle3 import Windows, check_chat_weight

    def one_line(args, text):
        assert main(["train", *args, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and text in err, err

    one_line(["--lineage", "dspark", "--chat-weight", "2"], "--chat-weight applies to --lineage eagle3")
    one_line(["--lineage", "eagle3", "--online", "--chat-weight", "2"], "--online reads corpus windows in order")
    for bad in ("0", "-1", "nan", "inf", "1e9"):
        one_line(["--lineage", "eagle3", "--chat-weight", bad], "is out of range: pass a finite number in (0.0, 1000.0]")
    assert not (tmp_path / "o").exists()  # refused before anything was written
    corpus = [{"tokens": np.zeros((5, 8), np.int32)}]  # a corpus store: no chat answers
    regen = [{"tokens": np.zeros((2, 8), np.int32), "source": np.array(["cont-t0", "chat-t0.7"])}]
    with pytest.raises(MlxspecError, match="no --data store holds chat answers"):
        check_chat_weight(corpus, 2.0)
    with pytest.raises(MlxspecError, match="no --data store holds chat answers"):
        Windows(corpus, 8, seed=0, chat_weight=2.0)  # the API path refuses it too
    check_chat_weight(corpus, 1.0)
    check_chat_weight(regen, 2.0)


def test_train_head_moves_the_head_from_the_target_rows_and_resumes_only_with_the_same_flag(tmp_path, capsys):
    """--train-head: the exported head leaves the target's rows at the draft ids (without it they
    stay exactly those rows), the file drafts losslessly, and a run resumed with the other setting
    is one line; the flag for a block lineage is one line too."""
    import io

    import conftest

    from mlxspec.cli import main
    from mlxspec.drafters.load import load_drafter
    from mlxspec.targets.load import load_target
    from mlxspec.targets.model import target_head_rows
    from test_engine import run

    model = tmp_path / "tiny.gguf"
    conftest.write_tiny_model(model)
    d = tmp_path / "d"
    common = ["train", "--model", str(model), "--data", str(d), "--lineage", "eagle3",
              "--corpus", "fortunes=/usr/share/games/fortunes/*", "--tokens", "fortunes=512", "--seq-len", "32",
              "--draft-vocab", "200", "--ttt-steps", "3", "--minutes", "0.03"]
    assert main(common + ["--prepare-only", "--out", str(tmp_path / "p")]) == 0, capsys.readouterr().err
    target, tok = load_target(str(model))
    heads = {}
    for name, extra in (("frozen", []), ("trained", ["--train-head"])):
        assert main(common + ["--out", str(tmp_path / name)] + extra) == 0, capsys.readouterr().err
        m, cfg = load_drafter(str(tmp_path / name / "hf"), target.info, log=io.StringIO())
        ids = np.asarray(m.d2t) + np.arange(cfg.draft_vocab_size)
        rows = np.asarray(target_head_rows(target, mx.array(ids.astype(np.int32))))
        heads[name] = np.abs(np.asarray(m.lm_head.weight.astype(mx.float32)) - rows).max()
        prompt = tok.encode("the the the", add_special_tokens=False)
        assert run(target, prompt, Eagle3Drafter(m, cfg, target, 3), max_tokens=16) == run(target, prompt, max_tokens=16)
    assert heads["frozen"] < 1e-6 < 1e-3 < heads["trained"], heads
    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "trained"), "--minutes", "0.06"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "trained with --train-head" in err, err
    assert main(["train", "--lineage", "dspark", "--train-head", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--train-head applies to --lineage eagle3" in err, err


def test_layers_trains_a_deeper_drafter_and_grows_an_export_that_drafts_as_before(tmp_path, capsys):
    """--layers 2 trains a two-layer EAGLE-3 drafter that loads back with 2 chain layers and is
    lossless; --init-from a one-layer export with --layers 2 adds a layer that starts as the
    identity (the grown file drafts the export's chains and logits), and --train-new-only
    leaves every inherited weight as exported; mismatches are one line."""
    import io
    import json

    import conftest

    from mlxspec.cli import main
    from mlxspec.drafters.load import load_drafter
    from mlxspec.engine.loop import SpecStats
    from mlxspec.targets.load import load_target
    from test_engine import run

    model = tmp_path / "tiny.gguf"
    conftest.write_tiny_model(model)
    d = tmp_path / "d"
    common = ["train", "--model", str(model), "--data", str(d), "--lineage", "eagle3",
              "--corpus", "fortunes=/usr/share/games/fortunes/*", "--tokens", "fortunes=512", "--seq-len", "32",
              "--draft-vocab", "200", "--ttt-steps", "3"]
    assert main(common + ["--out", str(tmp_path / "p"), "--prepare-only"]) == 0, capsys.readouterr().err
    two, one, grown = tmp_path / "two", tmp_path / "one", tmp_path / "grown"
    assert main(common + ["--out", str(two), "--layers", "2", "--warm-start", "--minutes", "0.05"]) == 0
    target, tok = load_target(str(model))
    m2, cfg2 = load_drafter(str(two / "hf"), target.info, log=io.StringIO())
    assert cfg2.num_hidden_layers == 2 and len(m2.layers) == 2
    ids = tok.encode("the the the", add_special_tokens=False)
    st = SpecStats()
    assert run(target, ids, Eagle3Drafter(m2, cfg2, target, 3), max_tokens=24, stats=st) == run(target, ids, max_tokens=24)
    assert st.drafted > 0
    capsys.readouterr()
    assert main(common + ["--out", str(two), "--minutes", "0.1"]) == 2  # resumed with another depth
    assert "--layers 2" in capsys.readouterr().err

    assert main(common + ["--out", str(one), "--minutes", "0.05"]) == 0
    m1, cfg1 = load_drafter(str(one / "hf"), target.info, log=io.StringIO())
    assert main(common + ["--out", str(grown), "--minutes", "0.03", "--init-from", str(one / "hf"), "--layers", "2",
                          "--train-new-only"]) == 0, capsys.readouterr().err
    mg, cfgg = load_drafter(str(grown / "hf"), target.info, log=io.StringIO())
    assert cfgg.num_hidden_layers == 2
    capsys.readouterr()
    assert main(common + ["--out", str(grown), "--minutes", "0.06", "--init-from", str(one / "hf"),
                          "--layers", "2"]) == 2  # resumed without --train-new-only: everything would learn
    assert "trained with --train-new-only" in capsys.readouterr().err
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "norm.weight"):
        a, b = (dict(tree_flatten(m.parameters()))[name] for m in (m1, mg))
        np.testing.assert_allclose(np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32)), atol=1e-6)
    rng = np.random.default_rng(0)
    _, taps = target(mx.array([ids]), target.make_cache(), taps=[0], logits="last")
    # at lr ~0 the new layer stays the identity: the grown file drafts the export's chain
    start = tmp_path / "start"
    assert main(common + ["--out", str(start), "--minutes", "0.02", "--init-from", str(one / "hf"), "--layers", "2",
                          "--lr", "1e-12"]) == 0
    ms, cfgs = load_drafter(str(start / "hf"), target.info, log=io.StringIO())
    outs = []
    for m, c in ((m1, cfg1), (ms, cfgs)):
        dr = Eagle3Drafter(m, c, target, 3)
        dr.begin(ids, taps)
        outs.append(dr.draft(ids[-1], 3, SamplingParams(), rng))
    assert outs[0].tokens == outs[1].tokens
    assert float(mx.abs(outs[0].logits - outs[1].logits).max()) < 2e-2  # the exports are bfloat16
    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "x"), "--minutes", "0.02", "--init-from", str(two / "hf")]) == 2
    assert "has 2 chain layers, more than --layers 1; pass --layers 2" in capsys.readouterr().err
    assert main(common + ["--out", str(tmp_path / "y"), "--minutes", "0.02", "--train-new-only"]) == 2
    assert "--train-new-only" in capsys.readouterr().err
    assert main(common + ["--out", str(tmp_path / "z"), "--minutes", "0.02", "--init-from", str(one / "hf"),
                          "--train-new-only"]) == 2
    assert "no layer is new" in capsys.readouterr().err
