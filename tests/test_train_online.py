"""Online training (`mlxspec train --online`, `train.online`): the target runs inside the
loop on the next corpus windows, with no store. On SmolLM2 with a tiny drafter: it trains on
exactly what an offline store of the same windows holds, it resumes at the next unseen
window, and flag combinations that mean nothing are one line with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxspec.errors import MlxspecError
from mlxspec.train.data import load_shards, prepare_shards
from mlxspec.train.online import OnlineCorpus
from mlxspec.train.config import TrainConfig
from mlxspec.train.trainer import train

TAPS = [1, 8, 15]
SRC = {"fortunes": ["/usr/share/games/fortunes/*"]}
BUDGET = {"fortunes": 256}  # 8 windows of 32 tokens
L, BATCH = 32, 4


def _tc(**kw):
    base = dict(lineage="dspark", block_size=4, layers=1, intermediate_size=64, markov_rank=8, draft_vocab=512,
                seqs_per_step=2, anchors_per_seq=4, warmup=2, lr=3e-3, taps=TAPS, checkpoint_every=100,
                history_every=1, steps=4)
    base.update(kw)
    return TrainConfig(**base)


def _source(smollm2):
    target, tok = smollm2
    return OnlineCorpus(target, tok, TAPS, seq_len=L, tokens_per_category=BUDGET, batch=BATCH, sources=SRC)


def _weights(model):
    return {k: np.asarray(v) for k, v in tree_flatten(model.parameters())}


def _losses(info):
    return [(h["step"], h["loss"]) for h in info["history"] if "loss" in h]


@pytest.fixture(scope="module")
def online_run(smollm2, tmp_path_factory):
    """4 uninterrupted online steps over the 8 windows (2 per step), and the source."""
    target, _ = smollm2
    src = _source(smollm2)
    out = tmp_path_factory.mktemp("online")
    model, _, info = train(target, src, str(out), _tc(), resume=False, log=lambda *a: None)
    return model, info, src, out


def test_online_training_equals_offline_training_on_a_store_of_the_same_windows(smollm2, online_run, tmp_path):
    """Online over N windows = offline from a store prepared from the same N windows (same
    --data-batch), read in order: the same losses and the same final weights."""
    target, tok = smollm2
    model_on, info_on, src, out = online_run
    store = tmp_path / "store"
    prepare_shards(target, tok, store, TAPS, seq_len=L, tokens_per_category=BUDGET, batch=BATCH, sources=SRC)
    z = load_shards(store)
    assert len(z["tokens"]) == src.n == 8
    # the online source's arrays are bitwise the store's
    got = src.take(0, 8)
    for k in ("tokens", "taps", "topk_ids", "topk_probs", "category"):
        assert np.array_equal(got[k], np.asarray(z[k])), k
    model_off, _, info_off = train(target, str(store), str(tmp_path / "off"), _tc(window_order="sequential"),
                                   resume=False, log=lambda *a: None)
    lon, loff = _losses(info_on), _losses(info_off)
    assert [s for s, _ in lon] == [0, 1, 2, 3] and [s for s, _ in loff] == [0, 1, 2, 3]
    np.testing.assert_allclose([v for _, v in lon], [v for _, v in loff], rtol=0, atol=1e-6)
    won, woff = _weights(model_on), _weights(model_off)
    assert won.keys() == woff.keys()
    for k in won:
        np.testing.assert_allclose(won[k], woff[k], rtol=0, atol=1e-6, err_msg=k)
    st = json.loads((out / "ckpt" / "state.json").read_text())
    assert st["step"] == 4 and st["data"]["cursor"] == 8 and st["data"]["source"]["kind"] == "online-corpus"
    assert st["data"]["target_tokens"] == 8 * L  # each window through the target once (the vocabulary: the same chunks)
    # drawn at random (the offline default) the same store trains on other windows: the test can tell them apart
    _, _, info_rand = train(target, str(store), str(tmp_path / "rand"), _tc(steps=2), resume=False, log=lambda *a: None)
    assert [v for _, v in _losses(info_rand)][1] != pytest.approx([v for _, v in lon][1], abs=1e-6)


def test_online_resume_continues_with_the_next_unseen_windows(smollm2, online_run, tmp_path):
    """Stopped after 2 steps (windows 0-3), resumed: the run takes windows 4-7 only (the
    target sees no seen window again) and ends equal to the uninterrupted run."""
    target, _ = smollm2
    model_ref, info_ref, _, _ = online_run
    out = tmp_path / "run"
    first = _source(smollm2)
    train(target, first, str(out), _tc(), resume=False, log=lambda *a: None, stop_after=2)
    st = json.loads((out / "ckpt" / "state.json").read_text())
    assert st["step"] == 2 and st["data"]["cursor"] == 4
    assert (first.first_taken, first.taken) == (0, 4)
    again = _source(smollm2)
    msgs = []
    model, _, info = train(target, again, str(out), _tc(), resume=True, log=msgs.append)
    assert msgs == ["resumed from step 2"]
    assert (again.first_taken, again.taken) == (4, 4) and again.target_tokens == 4 * L
    st = json.loads((out / "ckpt" / "state.json").read_text())
    # 8 windows for the draft vocabulary in the first run (VOCAB_WINDOWS covers them), 4 to train here
    assert st["step"] == 4 and st["data"]["cursor"] == 8 and st["data"]["target_tokens"] == 12 * L
    np.testing.assert_allclose([v for _, v in _losses(info)], [v for _, v in _losses(info_ref)], rtol=0, atol=1e-6)
    ref = _weights(model_ref)
    for k, v in _weights(model).items():
        np.testing.assert_allclose(v, ref[k], rtol=0, atol=1e-6, err_msg=k)
    # other data on resume is refused: the cursor would point into another plan of windows
    other = OnlineCorpus(target, smollm2[1], TAPS, seq_len=L, tokens_per_category={"fortunes": 320}, batch=BATCH,
                         sources=SRC)
    with pytest.raises(MlxspecError, match=r"holds a checkpoint trained on other data \(budget, windows\)"):
        train(target, other, str(out), _tc(steps=6), resume=True, log=lambda *a: None)


@pytest.mark.parametrize("flags, line", [
    (["--data", "d"], "--online: the target runs inside the training loop and keeps no store; drop --data"),
    (["--prepare-only"], "--online --prepare-only: online training prepares no store; drop one of them"),
    (["--data-mode", "regen"], "--online --data-mode regen: online training reads corpus windows only; "
                               "prepare a regen store and train from it, or drop --data-mode"),
    (["--data-seconds", "5"], "--online: --data-seconds bounds store preparation; online there is none, drop it"),
    (["--window-order", "random"], "--online --window-order random: online training reads the windows in order "
                                   "(each once per pass); drop --window-order"),
])
def test_online_flags_that_mean_nothing_are_one_line(tmp_path, capsys, flags, line):
    from mlxspec.cli import main

    assert main(["train", "--out", str(tmp_path / "o"), "--online", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mlxspec: error: {line}"]
    assert not (tmp_path / "o").exists()


def test_window_order_sequential_refuses_a_mix():
    from mlxspec.train.batches import Batcher

    s = {"tokens": np.zeros((2, 16), np.int32)}
    with pytest.raises(MlxspecError, match="window order sequential reads one store in order; got 2 stores"):
        Batcher([(s, 1.0), (s, 1.0)], TrainConfig(window_order="sequential", taps=[0]), np.arange(4), seed=0)
