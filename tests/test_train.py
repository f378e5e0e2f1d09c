"""`mlxspec train` pieces on SmolLM2 with a tiny drafter: data, loss going down, resume,
export to HF and GGUF with identical drafts after loading back."""

from __future__ import annotations

import io
import json

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.drafters.load import load_drafter
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.train.data import load_shards, prepare_generated_shards, prepare_shards, taps_from_store, taps_to_store
from mlxspec.train.export import export_all
from mlxspec.train.batches import parse_data_mix
from mlxspec.train.config import TrainConfig
from mlxspec.train.trainer import train

TAPS = [1, 8, 15]


@pytest.fixture(scope="module")
def shards(smollm2, tmp_path_factory):
    target, tok = smollm2
    out = tmp_path_factory.mktemp("shards")
    prepare_generated_shards(target, tok, out, TAPS, prefix_len=32, gen_len=32,
                             tokens_per_category={"code": 64}, batch=2)
    return out


def _tc(**kw):
    base = dict(lineage="dspark", block_size=4, layers=1, intermediate_size=64, markov_rank=8,
                draft_vocab=512, seqs_per_step=2, anchors_per_seq=4, warmup=2, lr=3e-3, taps=TAPS,
                checkpoint_every=5)
    base.update(kw)
    return TrainConfig(**base)


def _drafts(model, target, tok):
    """One block of 4 drafts after a code prompt -> (tokens, logits, confidence)."""
    ids = tok.encode("def add(a, b):\n    return", add_special_tokens=False)
    d = BlockDrafter(model, target)
    cache = target.make_cache()
    _, taps = target(mx.array([ids]), cache, taps=d.taps)
    d.begin(ids, taps)
    o = d.draft(ids[-1], 4, SamplingParams(), np.random.default_rng(0))
    return o.tokens, np.asarray(o.logits), o.confidence


def test_generated_shards_follow_the_target(shards):
    z = load_shards(shards)
    assert z["tokens"].shape == (2, 64) and z["taps"].shape == (2, 64, 3 * 576)
    # from the prefix on, each token is the target's own greedy choice at the previous position
    assert (z["topk_ids"][:, 31:-1, 0] == z["tokens"][:, 32:]).all()
    assert (z["start"] == 32).all()


def test_taps_store_keeps_activations_past_float16():
    """Gemma's residual stream has channels past float16's 65504: the store keeps them
    finite (bfloat16 bits), to bfloat16's 8-bit precision."""
    x = mx.array([[0.5, -3.25, 70000.0, -1.5e5, 1e-3]])
    back = taps_from_store(taps_to_store(x))
    assert back.dtype == mx.float32
    assert np.isfinite(np.asarray(back)).all()
    assert np.allclose(np.asarray(back), np.asarray(x), rtol=2 ** -8)
    assert np.isinf(np.asarray(x.astype(mx.float16))).any()  # what format 1 stored
    # a target whose own forward overflows is refused where the taps enter the store
    with pytest.raises(MlxspecError, match=r"^the target's hidden states at the tapped layers hold inf/NaN"):
        taps_to_store(mx.array([[1.0, float("inf")]]))
    with pytest.raises(MlxspecError, match="inf/NaN"):
        taps_to_store(mx.array([[float("nan"), 0.0]]))


def test_streamed_store_is_resumable_and_refuses_overflowed_taps(smollm2, tmp_path):
    """prepare_shards streams target taps (bfloat16 bits) + top-k labels, resumes where it
    stopped, and a store whose taps overflowed (format 1, float16) is refused in one line."""
    target, tok = smollm2
    src = {"fortunes": ["/usr/share/games/fortunes/*"]}
    out = tmp_path / "store"
    prepare_shards(target, tok, out, TAPS, seq_len=32, tokens_per_category={"fortunes": 96}, batch=1,
                   sources=src, max_seconds=0.0)  # stops after the first window
    assert json.loads((out / "progress.json").read_text())["done"] == 1
    prepare_shards(target, tok, out, TAPS, seq_len=32, tokens_per_category={"fortunes": 96}, batch=1, sources=src)
    z = load_shards(out)
    assert z["taps"].dtype == np.uint16 and z["taps"].shape == (3, 32, 3 * 576)
    # row 1 (from the resumed run) equals the target's own taps, rounded to bfloat16
    _, tp = target.forward_hidden(mx.array(np.asarray(z["tokens"][1:2])), TAPS)
    got = np.asarray(taps_from_store(np.asarray(z["taps"][1:2])))
    assert np.array_equal(got, np.asarray(tp.astype(mx.bfloat16).astype(mx.float32)))
    assert (np.asarray(z["topk_ids"][:, :-1, 0]) >= 0).all()
    # `--data DIR@N`: the store from window N on (a continuation on the windows not trained on yet)
    tail = load_shards(out, first=1)
    assert np.array_equal(np.asarray(tail["tokens"]), np.asarray(z["tokens"][1:]))
    assert np.array_equal(np.asarray(load_shards(out, max_windows=1, first=1)["taps"]), np.asarray(z["taps"][1:2]))
    with pytest.raises(MlxspecError, match=r"@3: the store holds 3 completed windows, none from window 3 on"):
        load_shards(out, first=3)
    assert parse_data_mix(f"{out}@2:0.5,{out}") == [(str(out), 0.5, 2), (str(out), 1.0, 0)]
    with pytest.raises(MlxspecError, match=r"DIR@N takes the store's windows from N on; got 'x'"):
        parse_data_mix(f"{out}@x")
    named = tmp_path / "run@2"  # a directory whose own name holds '@' is that directory
    named.mkdir()
    assert parse_data_mix(str(named)) == [(str(named), 1.0, 0)]

    bad = tmp_path / "old"
    bad.mkdir()
    for k in ("tokens", "category", "topk_ids", "topk_probs", "meta.json", "progress.json"):
        f = out / (k if k.endswith(".json") else f"{k}.npy")
        (bad / f.name).write_bytes(f.read_bytes())
    t16 = np.asarray(taps_from_store(np.asarray(z["taps"]))).astype(np.float16)
    t16[2, 5, 7] = np.inf
    np.save(bad / "taps.npy", t16)
    with pytest.raises(MlxspecError, match=r"1 stored tap values are inf/NaN .* prepare the data again"):
        load_shards(bad)
    # only the windows to be read are checked: the first two are finite
    assert load_shards(bad, max_windows=2)["taps"].shape[0] == 2


def test_loss_decreases_resume_and_export(smollm2, shards, tmp_path):
    target, tok = smollm2
    out = tmp_path / "run"
    model, cfg, info = train(target, str(shards), str(out), _tc(steps=10), resume=False, log=lambda *a: None)
    h = info["history"]
    assert h[-1]["loss"] < h[0]["loss"], h
    # resume: a longer schedule continues from the checkpoint at step 10
    msgs = []
    model, cfg, info = train(target, str(shards), str(out), _tc(steps=12), resume=True, log=msgs.append)
    assert msgs == ["resumed from step 10"]
    assert json.loads((out / "ckpt" / "state.json").read_text())["step"] == 12

    hf, gg = export_all(model, cfg, out, target=target)
    drafts = [_drafts(m, target, tok) for m in
              [model] + [load_drafter(str(p), target.info, log=io.StringIO())[0] for p in (hf, gg)]]
    for tokens, logits, conf in drafts[1:]:
        assert tokens == drafts[0][0]
        np.testing.assert_allclose(logits, drafts[0][1], atol=1e-4)
        np.testing.assert_allclose(conf, drafts[0][2], atol=1e-5)
    _, cfg_gg = load_drafter(str(gg), target.info, log=io.StringIO())
    assert cfg_gg.sample_from_anchor is True and cfg_gg.target_layer_ids == TAPS
    assert cfg_gg.lineage == "dspark" and cfg_gg.draft_vocab_size == 512


def test_train_flags_with_defaults_pass_the_check():
    """The defaults themselves must pass the flag check (a regression: --tokens left at its
    default None made `mlxspec train` crash before doing anything)."""
    from mlxspec.cli import build_parser
    from mlxspec.errors import MlxspecError
    from mlxspec.train.cli import check_train_args

    p = build_parser()
    check_train_args(p.parse_args(["train", "--out", "x"]))
    check_train_args(p.parse_args(["train", "--out", "x", "--tokens", "code=100,prose=5"]))
    with pytest.raises(MlxspecError, match="--tokens"):
        check_train_args(p.parse_args(["train", "--out", "x", "--tokens", "code"]))
    with pytest.raises(MlxspecError, match=r"--heldout-prompts 17 is out of range: pass an integer .*16"):
        check_train_args(p.parse_args(["train", "--out", "x", "--heldout-prompts", "17"]))
    with pytest.raises(MlxspecError, match="--heldout-tokens 0 is out of range"):
        check_train_args(p.parse_args(["train", "--out", "x", "--heldout-tokens", "0"]))
    with pytest.raises(MlxspecError, match="--heldout-tokens 100000 is out of range: pass an integer .*1024"):
        check_train_args(p.parse_args(["train", "--out", "x", "--heldout-tokens", "100000"]))


def test_default_taps_spread_over_the_target_layers():
    """Without --taps the drafter reads five layers spread from layer 1 to the
    third-to-last: SmolLM2's shipped taps for its 30 layers, 1,5,9,13,16 for Gemma-3-270M;
    every tap exists, none repeats and none is the final layer (which the drafter loader
    refuses), also on tiny targets; a 1-layer target has none to tap."""
    from mlxspec.train.cli import check_taps, default_taps

    assert default_taps(30) == [1, 8, 15, 22, 28]
    assert default_taps(18) == [1, 5, 9, 13, 16]
    assert default_taps(24) == [1, 7, 12, 17, 22]
    assert default_taps(2) == [0] and default_taps(1) == []
    with pytest.raises(MlxspecError) as e:
        check_taps(default_taps(1), 1)
    assert str(e.value) == ("the target has 1 layer: drafters tap intermediate layers and it has none; train for a "
                            "target with at least 2 layers")
    for n in range(2, 80):
        taps = default_taps(n)
        assert taps == sorted(set(taps)) and taps[0] >= 0 and taps[-1] < n - 1, (n, taps)
        check_taps(taps, n)
        if n >= 10:
            assert len(taps) == 5 and taps[0] == 1 and taps[-1] == n - 2, (n, taps)


@pytest.mark.parametrize("taps,msg", [
    ("1,8,40", "--taps 1,8,40: layer 40 is outside the target, which has 30 layers (valid taps 0..28); pass layer "
               "numbers below 29"),
    ("1,8,15,22,29", "--taps 1,8,15,22,29: layer 29 is the last layer of the target (30 layers); drafters tap "
                     "intermediate layers, not the final one (the drafter loader refuses such a drafter); pass "
                     "layer numbers below 29"),
])
def test_taps_the_drafter_loader_refuses_are_refused_at_entry(smollm2_path, tmp_path, capsys, taps, msg):
    """--taps naming a layer the target does not have, or its final layer (issue 39: that one
    ran on until the memory cap), is one line with exit code 2, before any data is prepared."""
    from mlxspec.cli import main

    rc = main(["train", "--model", str(smollm2_path), "--out", str(tmp_path / "o"), "--taps", taps,
               "--data", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"mlxspec: error: {msg}", err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("V", [1, 3, 8, 9, 64, 261, 272, 512, 513, 520, 4096])
def test_next_token_topk_is_the_exact_top_k_for_any_vocabulary(V):
    """The two-level search equals a plain full top-k over the vocabulary, also for
    vocabularies of fewer than TOPK chunks (issue 39: 272 tokens crashed argpartition) or
    fewer than TOPK tokens (the missing places are token 0 at probability 0)."""
    from mlxspec.train.data import TOPK, next_token_topk

    rng = np.random.default_rng(V)
    logits = rng.standard_normal((2, 3, V)).astype(np.float32) * 4
    ids, pk = next_token_topk(mx.array(logits))
    ids, pk = np.asarray(ids), np.asarray(pk)
    k = min(TOPK, V)
    want = np.argsort(-logits, axis=-1)[..., :k]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert ids.shape == pk.shape == (2, 3, TOPK) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids[..., :k], want)
    np.testing.assert_allclose(pk[..., :k], np.take_along_axis(p, want, -1), rtol=1e-5, atol=1e-7)
    assert (ids[..., k:] == 0).all() and (pk[..., k:] == 0).all()


def test_train_prepares_a_store_on_a_tiny_vocabulary_target(tmp_path, capsys):
    """`mlxspec train` on a target with a vocabulary of 272 tokens (under 8 chunks of 64: the
    fuzz suite's tiny target; issue 39 crashed here): the store's top-k is the full top-k of the
    target's own logits at every position."""
    import conftest

    from mlxspec.cli import main
    from mlxspec.targets.load import load_target

    model = tmp_path / "tiny.gguf"
    conftest.write_tiny_model(model)
    d = tmp_path / "d"
    assert main(["train", "--model", str(model), "--prepare-only", "--data", str(d), "--out", str(tmp_path / "o"),
                 "--corpus", "fortunes=/usr/share/games/fortunes/*", "--tokens", "fortunes=64", "--seq-len",
                 "16"]) == 0, capsys.readouterr().err
    z = load_shards(str(d))
    assert json.loads((d / "meta.json").read_text())["taps"] == [0]  # every layer but the last
    target, _ = load_target(str(model))
    logits = np.asarray(target(mx.array(np.asarray(z["tokens"])), target.make_cache(), logits="all")[0])
    assert logits.shape[-1] == 272
    want = np.argsort(-logits, axis=-1)[..., :8]
    np.testing.assert_array_equal(np.asarray(z["topk_ids"]), want)


def test_dense_training_forward_equals_the_inference_forward():
    """The training forward (`block_hidden`: K blocks per window in one pass, each seeing the
    context before its anchor and its own rows) gives, for every block, the hidden states the
    inference path computes for that anchor alone (context K/V of rows < anchor, one block)."""
    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.drafters.model import DFlashModel
    from mlxspec.train.blocks import block_hidden

    c = DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, block_size=4, target_layer_ids=[0, 1], mask_token_id=3,
                      vocab_size=100, sample_from_anchor=True, rms_norm_eps=1e-6, rope_theta=10000.0)
    mx.random.seed(0)
    m = DFlashModel(c)
    S, L, K, B = 2, 20, 3, 4
    taps = mx.random.normal((S, L, 128))
    anchors = mx.array([[2, 7, 15], [1, 9, 14]])
    emb = mx.random.normal((S, K, B, 64))
    pos = anchors[:, :, None] + mx.arange(B)
    h = block_hidden(m, taps, emb, pos, anchors)
    for s in range(S):
        for k in range(K):
            a = int(anchors[s, k])
            kv = m.layer_context_kv(m.context(taps[s : s + 1, :a]), mx.arange(a)[None])
            ref = m.hidden(emb[s : s + 1, k], pos[s : s + 1, k], kv)
            np.testing.assert_allclose(np.asarray(h[s, k]), np.asarray(ref[0]), atol=2e-5)


def test_dense_anchors_cover_every_valid_position_of_a_regen_window():
    """anchors_per_seq=0 supervises every anchor in [start, end - block] of a window once, and
    no anchor outside it; padded anchors carry no label."""
    from mlxspec.train.batches import Batcher

    L, B = 32, 4
    store = {"tokens": np.arange(2 * L, dtype=np.int32).reshape(2, L) % 50,
             "topk_ids": np.zeros((2, L, 8), np.int32), "topk_probs": np.ones((2, L, 8), np.float16) / 8,
             "taps": np.zeros((2, L, 6), np.uint16), "start": np.array([10, 10], np.int32),
             "end": np.array([20, 20], np.int32)}
    tc = TrainConfig(block_size=B, anchors_per_seq=0, seqs_per_step=2, taps=[0])
    b = Batcher([(store, 1.0)], tc, np.arange(50, dtype=np.int32), seed=0)()
    an, av = np.asarray(b["anchors"]), np.asarray(b["aval"]) > 0
    for r in range(2):
        assert sorted(an[r][av[r]].tolist()) == list(range(10, 20 - B + 1))
    assert (np.asarray(b["label"])[~av] == -1).all()


def test_heldout_replay_equals_the_engine(smollm2, tmp_path):
    """`train.heldout.heldout_tau` (one teacher-forced pass + the greedy anchor walk) gives the
    engine's own counts on the same held-out prompts for the shipped DSpark drafter: tau,
    accepted/drafted, per-position acceptance."""
    from pathlib import Path

    from mlxspec.evaluate import evaluate_drafter
    from mlxspec.train.heldout import build_heldout, frozen_for, heldout_tau

    target, tok = smollm2
    path = Path(__file__).parents[1] / "mlxspec" / "weights" / "smollm2-135m-dspark"
    m, cfg = load_drafter(str(path), target.info, log=io.StringIO())
    cats = ("code", "chat")
    store = build_heldout(target, tok, cfg.target_layer_ids, tmp_path / "heldout", n_per_category=2,
                          max_tokens=32, categories=cats)
    mine = heldout_tau(m, frozen_for(target, m), store, categories=cats)
    ref = evaluate_drafter(target, tok, path, n_per_category=2, max_tokens=32, categories=cats, log=io.StringIO())
    assert sum(ref[c]["accepted"] for c in cats) > 0  # the comparison covers accepted drafts
    for cat in cats:
        assert (mine[cat]["accepted"], mine[cat]["drafted"]) == (ref[cat]["accepted"], ref[cat]["drafted"])
        assert mine[cat]["tau"] == pytest.approx(ref[cat]["tau"])
        np.testing.assert_allclose(mine[cat]["per_position_acceptance"], ref[cat]["per_position_acceptance"])
        assert mine[cat]["tau_se"] >= 0.0


def test_train_flags_that_do_not_apply_are_not_checked():
    """--prefix-len belongs to generated windows only: corpus and regen windows of any
    --seq-len pass, and in generated mode its default follows --seq-len (issue 25, item 5)."""
    from mlxspec.cli import build_parser
    from mlxspec.train.cli import check_train_args

    p = build_parser()
    for mode in ("corpus", "regen"):
        check_train_args(p.parse_args(["train", "--out", "x", "--data-mode", mode, "--seq-len", "2"]))
    a = p.parse_args(["train", "--out", "x", "--data-mode", "generated", "--seq-len", "64"])
    check_train_args(a)
    assert a.prefix_len == 16


@pytest.mark.parametrize("mode", ["corpus", "regen", "generated", "online"])
def test_prefix_len_is_checked_in_every_data_mode(tmp_path, capsys, mode):
    """--prefix-len given: out of range is one line in every data mode (issue 39: `train
    --prefix-len 0` in corpus mode went on to prepare data), and outside --data-mode generated,
    where no window has a corpus prefix, it is refused as not applying; exit 2, before any
    target is loaded."""
    from mlxspec.cli import main

    mode_args = ["--online"] if mode == "online" else ["--data-mode", mode]
    base = ["train", "--model", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "o"), "--seq-len", "64",
            *mode_args]
    for v, msg in [("0", "--prefix-len 0 is out of range: pass an integer in [1, 63]"),
                   ("64", "--prefix-len 64 is out of range: pass an integer in [1, 63]")]:
        assert main([*base, "--prefix-len", v]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"mlxspec: error: {msg}"], err
    rc = main([*base, "--prefix-len", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    if mode == "generated":  # it applies: the run goes on to the missing model
        assert rc == 2 and "absent.gguf" in err[-1], err
    else:
        shown = "online corpus" if mode == "online" else mode
        assert rc == 2 and err == [f"mlxspec: error: --prefix-len 16 applies to --data-mode generated only ({shown} "
                                   "windows have no corpus prefix); drop --prefix-len or pass --data-mode generated"], err
    assert not (tmp_path / "o").exists()


def test_memory_exhaustion_while_writing_is_not_a_disk_error(tmp_path):
    """An ENOMEM (a memory map the address-space limit refuses: issue 39's `train --taps ...29`
    under the fuzz memory cap), a MemoryError or MLX's allocator failing inside `writing` is
    reported as memory exhaustion, not "cannot write ...; check the path and the disk"."""
    import errno

    from mlxspec.validate import writing

    want = (f"--data {tmp_path}: out of memory (the process could not allocate more; not a disk problem); free "
            "memory, raise the process's memory limit (ulimit -v) or lower the sizes of the run")
    for exc in (OSError(errno.ENOMEM, "Cannot allocate memory"), MemoryError(),
                RuntimeError("[malloc] Unable to allocate 1073741824 bytes.")):
        with pytest.raises(MlxspecError) as e, writing("--data", tmp_path):
            raise exc
        assert str(e.value) == want
    with pytest.raises(MlxspecError, match="no space left on the device"), writing("--data", tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["notadir", "/dev/null/x"])
def test_train_out_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    """train --out under a file or under /dev/null: one line naming --out and the cause, exit
    code 2, before the target is loaded (read-only and full disks: tests/test_fuzz.py's
    output-path classes, through the same validate.check_output_dir)."""
    from mlxspec.cli import main

    if where == "notadir":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "run"
    else:
        out = where
    assert main(["train", "--out", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mlxspec: error: --out {out}: ") and "not a directory" in err[0], err


def test_dflash2_training_forward_equals_the_drafting_forward():
    """DFlash 2's training forward (K packed blocks, convs inside each block, `block_attention`)
    equals `DFlash2Model.hidden` drafting one block at that anchor, and the trainer's greedy
    choice is the path selector's chain under teacher forcing."""
    from mlxspec.drafters.build import make_model
    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.train.blocks import block_hidden_dflash2

    c = DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, block_size=4, target_layer_ids=[0, 1], mask_token_id=3,
                      vocab_size=100, sample_from_anchor=False, rms_norm_eps=1e-6, rope_theta=10000.0,
                      conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    mx.random.seed(1)
    m = make_model(c)
    for layer in m.layers:  # non-zero convs so that a wrong block boundary shows
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.random.normal(conv.base_kernel.shape) * 0.5 + 0.5
    S, L, K, B = 2, 20, 3, 4
    taps = mx.random.normal((S, L, 128))
    anchors = mx.array([[2, 7, 15], [1, 9, 14]])
    emb = mx.random.normal((S, K, B, 64))
    pos = anchors[:, :, None] + mx.arange(B)
    h = block_hidden_dflash2(m, taps, emb, pos, anchors)
    for s in range(S):
        for k in range(K):
            a = int(anchors[s, k])
            kv = m.layer_context_kv(m.context(taps[s : s + 1, :a]), mx.arange(a)[None])
            ref = m.hidden(emb[s : s + 1, k], pos[s : s + 1, k], kv, anchor_pos=a)
            np.testing.assert_allclose(np.asarray(h[s, k]), np.asarray(ref[0]), atol=2e-5)


def test_dflash2_trains_exports_and_loads_back(smollm2, shards, tmp_path):
    """mlxspec train --lineage dflash2: the loss goes down; the HF and GGUF exports load back
    as lineage dflash2 (bonus-anchor) with the trained selector and give the same drafts."""
    target, tok = smollm2
    out = tmp_path / "run"
    tc = _tc(lineage="dflash2", steps=8, sample_from_anchor=False, markov_rank=0, selector_rank=8,
             selector_top_k=4, intermediate_size=64)
    model, cfg, info = train(target, str(shards), str(out), tc, resume=False, log=lambda *a: None)
    h = [x for x in info["history"] if "loss" in x]
    assert h[-1]["loss"] < h[0]["loss"], h
    assert cfg.lineage == "dflash2" and cfg.sample_from_anchor is False and cfg.draft_vocab_size is None
    hf, gg = export_all(model, cfg, out, target=target)
    ids = tok.encode("def add(a, b):\n    return", add_special_tokens=False)
    drafts = []
    for p in (hf, gg):
        m, c2 = load_drafter(str(p), target.info, log=io.StringIO())
        assert c2.lineage == "dflash2" and c2.selector_top_k == 4 and c2.sample_from_anchor is False
        d = BlockDrafter(m, target)
        cache = target.make_cache()
        _, taps = target(mx.array([ids]), cache, taps=d.taps)
        d.begin(ids, taps)
        drafts.append(d.draft(ids[-1], 3, SamplingParams(), np.random.default_rng(0)).tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 3


def test_heldout_every_records_the_budget_curve(smollm2, shards, tmp_path):
    """--heldout-every: held-out tau at step 0 and every N steps, with the supervised blocks
    and distinct tokens so far (scripts/plot_budget.py draws them)."""
    from mlxspec.train.heldout import build_heldout

    target, tok = smollm2
    store = build_heldout(target, tok, TAPS, tmp_path / "heldout", n_per_category=1, max_tokens=8)
    tc = _tc(steps=4, anchors_per_seq=0, heldout=str(store), heldout_every=2)
    _, _, info = train(target, str(shards), str(tmp_path / "run"), tc, resume=False, log=lambda *a: None)
    pts = [h for h in info["history"] if "heldout" in h]
    assert [p["step"] for p in pts] == [0, 2, 4]
    assert pts[0]["supervised_blocks"] == 0 and pts[1]["supervised_blocks"] > 0
    assert pts[2]["supervised_blocks"] > pts[1]["supervised_blocks"]
    assert 0 < pts[2]["distinct_tokens"] <= 2 * 64
    # training CPU seconds (the evaluations not counted): the x axis of scripts/plot_learning.py
    assert 0 <= pts[0]["cpu_s"] < pts[1]["cpu_s"] < pts[2]["cpu_s"]
    for p in pts:
        assert set(p["heldout"]) == {"code", "prose", "chat"} and all(v["tau"] >= 1.0 for v in p["heldout"].values())
        assert all(v["tau_se"] >= 0.0 for v in p["heldout"].values())


def test_train_seed_draws_the_corpus_windows_and_resumes_its_store(tmp_path, capsys):
    """`mlxspec train --prepare-only --seed N`: the corpus store is drawn with seed N (the flag
    was not passed to the preparation: every seed gave seed 0's windows, and a seed-1 store
    could not be resumed from the command line)."""
    from mlxspec.cli import main

    src = "fortunes=/usr/share/games/fortunes/*"
    stores = {}
    for seed in (1, 2):
        d = tmp_path / f"s{seed}"
        args = ["train", "--prepare-only", "--data", str(d), "--out", str(tmp_path / f"o{seed}"), "--corpus", src,
                "--tokens", "fortunes=96", "--seq-len", "32", "--seed", str(seed)]
        assert main(args) == 0, capsys.readouterr().err
        assert json.loads((d / "meta.json").read_text())["seed"] == seed
        stores[seed] = np.asarray(load_shards(str(d))["tokens"]).copy()
        assert main(args) == 0, capsys.readouterr().err  # resumes its own store
    assert stores[1].shape == stores[2].shape and not np.array_equal(stores[1], stores[2])


def test_init_from_a_shallower_export_grows_it_and_trains_only_the_new_layer(smollm2, shards, tmp_path):
    """--init-from with fewer layers than --layers: at step 0 the grown drafter drafts exactly
    as the export (the new layer's output projections start at zero); with --train-new-only
    training changes the new layer only; a deeper export is refused in one line."""
    from mlx.utils import tree_flatten

    target, tok = smollm2
    one, cfg1, _ = train(target, str(shards), str(tmp_path / "one"), _tc(steps=3), resume=False, log=lambda *a: None)
    hf, _ = export_all(one, cfg1, tmp_path / "one", target=target)
    grown, cfg2, _ = train(target, str(shards), str(tmp_path / "g0"), _tc(steps=0, layers=2, init_from=str(hf)),
                           resume=False, log=lambda *a: None)
    assert cfg2.num_hidden_layers == 2
    t1, l1, _ = _drafts(load_drafter(str(hf), target.info, log=io.StringIO())[0], target, tok)
    t2, l2, _ = _drafts(grown, target, tok)
    assert t1 == t2
    np.testing.assert_allclose(l2, l1, atol=1e-4)

    trained, _, info = train(target, str(shards), str(tmp_path / "g1"),
                             _tc(steps=4, layers=2, init_from=str(hf), train_new_only=True),
                             resume=False, log=lambda *a: None)
    before = dict(tree_flatten(grown.parameters()))
    after = dict(tree_flatten(trained.parameters()))
    changed = {k for k in after if not np.array_equal(np.asarray(after[k]), np.asarray(before[k]))}
    assert changed and all(k.startswith("layers.1.") for k in changed), sorted(changed)
    assert any(k.endswith("o_proj.weight") for k in changed)  # the zero start opens

    hf2, _ = export_all(trained, cfg2, tmp_path / "g1", target=target)
    with pytest.raises(MlxspecError, match="num_hidden_layers 2 differ from this run's \\(1\\)"):
        train(target, str(shards), str(tmp_path / "g2"), _tc(steps=1, init_from=str(hf2)),
              resume=False, log=lambda *a: None)
    with pytest.raises(MlxspecError, match="--train-new-only trains the layers a drafter grows by"):
        train(target, str(shards), str(tmp_path / "g3"), _tc(steps=1, init_from=str(hf), train_new_only=True),
              resume=False, log=lambda *a: None)


def test_heldout_tau_se_resamples_the_prompts():
    """tau's standard error over the held-out prompts: 0 when every prompt gives the same tau,
    growing with their spread, the resampled ratio's std (fixed seed, so reproducible)."""
    from mlxspec.train.heldout import bootstrap_se

    assert bootstrap_se([(30, 20), (15, 10), (45, 30)]) == 0.0  # tau 1.5 in every prompt
    assert bootstrap_se([(30, 20)]) == 0.0
    spread = [(20, 20), (40, 20)]  # tau 1.0 and 2.0
    se = bootstrap_se(spread)
    assert se == bootstrap_se(spread) and 0.3 < se < 0.4  # ~0.5 / sqrt(2) for two equal-weight prompts
    assert bootstrap_se([(20, 20), (30, 20)]) < se


def test_paired_difference_removes_what_the_prompts_share():
    """Two drafters on the same prompts: a constant lead has no spread however unequal the
    prompts are (the unpaired SE of either is large); a lead on one prompt only is uncertain;
    prompts of different stores are refused in one line."""
    from mlxspec.train.heldout import bootstrap_se, paired_difference

    b = [(20, 20), (60, 20), (30, 20)]  # tau 1, 3, 1.5: prompts far apart
    a = [(22, 20), (62, 20), (32, 20)]  # +0.1 on every prompt
    pd = paired_difference(a, b)
    assert abs(pd["diff"] - 0.1) < 1e-12 and pd["se"] < 1e-12 and pd["p_ahead"] == 1.0
    assert bootstrap_se(a) > 0.3  # what an unpaired comparison would have to beat
    one = paired_difference([(26, 20), (60, 20), (30, 20)], b)  # +0.3 on the first prompt only
    assert abs(one["diff"] - 0.1) < 1e-12 and one["se"] > 0.05 and 0.5 < one["p_ahead"] < 0.75
    with pytest.raises(ValueError, match="2 prompts against 3"):
        paired_difference(a[:2], b)


def test_heldout_store_per_prompt_count_and_length():
    """The held-out store's path: one per prompt count and length, so the two never mix, and
    "-f32" on every name (its taps float32: a store cached before, with bfloat16 taps, is
    not read as if it replayed the engine exactly)."""
    from types import SimpleNamespace

    from mlxspec.train.heldout import default_heldout_dir

    t = SimpleNamespace(info=SimpleNamespace(source="/m/SmolLM2-135M-Instruct.Q4_1.gguf"))
    d = default_heldout_dir(t, [1, 8, 15, 22, 28])
    assert d.name == "SmolLM2-135M-Instruct.Q4_1-t1_8_15_22_28-f32" and d.parent.name == "heldout"
    assert default_heldout_dir(t, [1, 8, 15, 22, 28], 8, 64) == d
    assert default_heldout_dir(t, [1, 8, 15, 22, 28], 16, 128).name == "SmolLM2-135M-Instruct.Q4_1-t1_8_15_22_28-n16-m128-f32"


def test_heldout_store_refuses_a_store_made_at_another_temperature(smollm2, tmp_path):
    """A sampled held-out store (`build_heldout(temp=)`, scripts/draft_temperature.py --sampled)
    and a greedy one never stand in for each other: reusing a directory at another temperature
    or seed is refused in one line naming both; the same settings reuse it."""
    from mlxspec.errors import MlxspecError
    from mlxspec.train.heldout import build_heldout

    target, tok = smollm2
    kw = dict(n_per_category=1, max_tokens=4, categories=("chat",))
    build_heldout(target, tok, [1, 14], tmp_path / "greedy", **kw)
    before = (tmp_path / "greedy" / "chat.npz").stat().st_mtime_ns
    build_heldout(target, tok, [1, 14], tmp_path / "greedy", **kw)  # reused, not rebuilt
    assert (tmp_path / "greedy" / "chat.npz").stat().st_mtime_ns == before
    with pytest.raises(MlxspecError, match=r"made at temperature 0 \(seed 0\), asked for 1 \(seed 0\)"):
        build_heldout(target, tok, [1, 14], tmp_path / "greedy", temp=1.0, **kw)
    build_heldout(target, tok, [1, 14], tmp_path / "t1", temp=1.0, seed=3, **kw)
    with pytest.raises(MlxspecError, match=r"made at temperature 1 \(seed 3\), asked for 1 \(seed 4\)"):
        build_heldout(target, tok, [1, 14], tmp_path / "t1", temp=1.0, seed=4, **kw)
    with pytest.raises(MlxspecError, match="asked for 0"):
        build_heldout(target, tok, [1, 14], tmp_path / "t1", **kw)


def test_regen_temps_make_one_chat_and_one_continuation_kind_each(smollm2):
    """--regen-temps: each temperature is a chat and a continuation kind; the default keeps the
    stores' order (chat-t0, chat-t0.7, cont-t0, cont-t0.7) and their prompt pools, so stores
    prepared before resume; the pools of a three-temperature store are disjoint and dealt in
    turn (chat prompts: from the same question list)."""
    from mlxspec.train.regen import KINDS, kinds_for, plan_items

    _, tok = smollm2
    assert KINDS == ("chat-t0", "chat-t0.7", "cont-t0", "cont-t0.7") == kinds_for((0, 0.7))
    assert kinds_for([1.0]) == ("chat-t1", "cont-t1")
    two = plan_items(tok, 64, kinds=KINDS)
    # the default pools are the split stores were prepared with before --regen-temps existed:
    # the chat prompts that fit and the corpus prefixes, each dealt alternately to greedy and T=0.7
    from mlxspec.train.regen import chat_questions, corpus_prefixes, encode_prompt

    per = 64 // 4 + 1
    chat = [(c, ids) for c, q in chat_questions(0) for ids in [encode_prompt(tok, "chat", q)] if len(ids) <= 96]
    chat, cont = chat[:2 * per], corpus_prefixes(tok, 64, 2 * per, 0)
    old = {"chat-t0": chat[0::2], "chat-t0.7": chat[1::2], "cont-t0": cont[0::2], "cont-t0.7": cont[1::2]}
    assert {k: [(c, list(ids)) for c, ids in v] for k, v in two.items()} == \
        {k: [(c, list(ids)) for c, ids in v] for k, v in old.items()}
    three = plan_items(tok, 96, kinds=kinds_for([0, 0.7, 1]))
    assert set(three) == {"chat-t0", "chat-t0.7", "chat-t1", "cont-t0", "cont-t0.7", "cont-t1"}
    for kind in ("chat", "cont"):
        pools = [three[f"{kind}-t{t}"] for t in ("0", "0.7", "1")]
        assert min(map(len, pools)) >= 96 // 6
        ids = [tuple(p[1]) for pool in pools for p in pool]
        assert len(ids) == len(set(ids))  # no prompt answered at two temperatures
        if kind == "cont":
            continue  # corpus prefixes are sampled for the total asked, so only disjointness holds
        merged = [None] * sum(map(len, pools))
        for i, pool in enumerate(pools):
            merged[i::3] = pool
        dealt = [None] * (len(two[f"{kind}-t0"]) + len(two[f"{kind}-t0.7"]))
        dealt[0::2], dealt[1::2] = two[f"{kind}-t0"], two[f"{kind}-t0.7"]
        n = min(len(merged), len(dealt))
        assert [p[1] for p in merged[:n]] == [p[1] for p in dealt[:n]]  # the same prompts, dealt in turn


@pytest.mark.parametrize("temps,msg", [("1,x", "--regen-temps '1,x': expected comma-separated numbers, e.g. 0,0.7"),
                                       (",", "expected comma-separated numbers"), ("2.5", "out of range"),
                                       ("nan", "--regen-temps 'nan': expected comma-separated numbers"),
                                       ("1,1.0", "repeats")])
def test_bad_regen_temps_are_one_line(tmp_path, capsys, temps, msg):
    """--regen-temps is checked where it enters: one line naming the value, exit 2, no target loaded."""
    from mlxspec.cli import main

    rc = main(["train", "--out", str(tmp_path / "o"), "--data-mode", "regen", "--regen-temps", temps, "--prepare-only"])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "--regen-temps" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
