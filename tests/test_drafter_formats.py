"""Drafter formats: real writers, random weights, small dims; every format round-trips,
the same weights give the same hidden states in every format, and broken files fail with
messages that name the tensors."""

from __future__ import annotations

import io
import json
import os

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mlx.utils import tree_unflatten

from mlxspec.errors import MlxspecError
from mlxspec.drafters.common import model_tensors
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.gguf.file import read_gguf
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.targets.model import TargetInfo

V, H = 512, 64
TAPS = [1, 3, 5]


# ----------------------------------------------------------------------------- helpers

def make_cfg(**kw) -> DrafterConfig:
    base = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, block_size=7, target_layer_ids=list(TAPS),
                mask_token_id=500, vocab_size=V, rope_theta=1_000_000.0, sample_from_anchor=True)
    base.update(kw)
    return DrafterConfig(**base)


def make_model(cfg: DrafterConfig, seed: int = 0) -> DFlashModel:
    """Random weights; norms around 1 and non-zero biases so a dropped tensor would show."""
    mx.random.seed(seed)
    m = DFlashModel(cfg)
    new = {k: mx.random.normal(v.shape) * 0.1 + (1.0 if k.endswith("norm.weight") else 0.0)
           for k, v in model_tensors(m).items() if k != "d2t"}
    m.update(tree_unflatten(list(new.items())))
    if cfg.draft_vocab_size:  # every other target id, as speculators offsets
        ids = np.arange(cfg.draft_vocab_size) * 2 + 1
        m.d2t = mx.array((ids - np.arange(cfg.draft_vocab_size)).astype(np.int32))
    mx.eval(m.parameters())
    return m


# the target the test drafters serve (what the HF writers record: num_target_layers, verifier)
TARGET = TargetInfo(hidden_size=H, num_layers=8, vocab_size=V, model_type="qwen3", source="test/tiny-qwen3")


def write(tmp, model, cfg, fmt, name=None, **opts) -> str:
    p = os.path.join(str(tmp), (name or fmt) + (".gguf" if fmt.startswith("gguf") else ""))
    opts.setdefault("target", TARGET)
    save_drafter(model, cfg, p, fmt, **opts)
    return p


def quiet_load(path, **kw):
    buf = io.StringIO()
    m, c = load_drafter(path, log=buf, **kw)
    return m, c, buf.getvalue()


def assert_same_params(a: DFlashModel, b: DFlashModel):
    ta, tb = model_tensors(a), model_tensors(b)
    assert set(ta) == set(tb), set(ta) ^ set(tb)
    for k in ta:
        x, y = ta[k], tb[k]
        if mx.issubdtype(x.dtype, mx.floating):
            x, y = x.astype(mx.float32), y.astype(mx.float32)
        assert mx.array_equal(x, y).item(), k


def hidden_and_logits(model: DFlashModel, cfg: DrafterConfig, seed: int = 1):
    rng = np.random.default_rng(seed)
    n_ctx = 5
    taps = mx.array(rng.standard_normal((1, n_ctx, len(cfg.target_layer_ids) * cfg.hidden_size)), dtype=mx.float32)
    ctx = model.context(taps)
    pos_c = mx.arange(n_ctx)[None]
    kv = [layer.self_attn.context_kv(ctx, pos_c) for layer in model.layers]
    emb = mx.array(rng.standard_normal((1, cfg.block_size, cfg.hidden_size)), dtype=mx.float32)
    pos_b = (n_ctx + mx.arange(cfg.block_size))[None]
    h = model.hidden(emb, pos_b, kv)
    logits = model.lm_head(h) if cfg.has_lm_head else None
    mx.eval(h, *([logits] if logits is not None else []))
    return h, logits


def _gguf_value(writer, key, v):
    if isinstance(v, bool):
        writer.add_bool(key, v)
    elif isinstance(v, int):
        writer.add_uint32(key, v) if v >= 0 else writer.add_int32(key, v)
    elif isinstance(v, float):
        writer.add_float32(key, v)
    elif isinstance(v, str):
        writer.add_string(key, v)
    else:
        writer.add_array(key, list(v))


def rewrite_gguf(src, dst, *, set_keys=None, drop_keys=(), drop_tensors=(), replace_tensors=None, arch=None):
    """Copy a GGUF changing metadata / tensors (replace_tensors: name -> (array, raw_dtype))."""
    g = read_gguf(src)
    w = gguf.GGUFWriter(dst, arch or g.architecture)
    for k, v in g.metadata.items():
        if k in ("general.architecture", "general.alignment") or k in drop_keys or k in (set_keys or {}):
            continue
        _gguf_value(w, k, v)
    for k, v in (set_keys or {}).items():
        _gguf_value(w, k, v)
    for t in g.tensors:
        if t.name in drop_tensors:
            continue
        if replace_tensors and t.name in replace_tensors:
            arr, raw = replace_tensors[t.name]
            w.add_tensor(t.name, arr, raw_dtype=raw)
            continue
        raw = np.asarray(g.raw(t))
        np_t = {0: "<f4", 1: "<f2", 30: "<u2", 26: "<i4", 27: "<i8"}[t.type_id]
        arr = np.frombuffer(raw, dtype=np_t).reshape(t.shape)
        w.add_tensor(t.name, arr, raw_dtype=gguf.GGMLQuantizationType.BF16 if t.type_id == 30 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def edit_config(path, **changes):
    cp = os.path.join(path, "config.json")
    with open(cp) as f:
        c = json.load(f)
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    with open(cp, "w") as f:
        json.dump(c, f)
    return c


def edit_tensors(path, drop=(), add=None):
    fp = os.path.join(path, "model.safetensors")
    t = dict(mx.load(fp))
    for k in drop:
        t.pop(k)
    t.update(add or {})
    mx.save_safetensors(fp, t)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def dflash_bonus():
    cfg = make_cfg(sample_from_anchor=False, has_lm_head=True)
    return make_model(cfg, 0), cfg


@pytest.fixture(scope="module")
def dspark_first():
    cfg = make_cfg(markov_rank=16, confidence_head=True, has_embed=True, has_lm_head=True)
    return make_model(cfg, 1), cfg


@pytest.fixture(scope="module")
def dspark_snr():
    cfg = make_cfg(markov_rank=16, confidence_head=True, log_snr=True, min_log_snr=-9.0, max_log_snr=9.0,
                   has_lm_head=True)
    return make_model(cfg, 2), cfg


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("fmt", ["zlab", "speculators", "gguf"])
def test_dflash_round_trip(tmp_path, dflash_bonus, fmt):
    model, cfg = dflash_bonus
    m2, c2, _ = quiet_load(write(tmp_path, model, cfg, fmt))
    assert_same_params(model, m2)
    assert (c2.target_layer_ids, c2.block_size, c2.mask_token_id, c2.vocab_size) == (TAPS, 7, 500, V)
    assert (c2.lineage, c2.sample_from_anchor, c2.source_format) == ("dflash", False, fmt)
    assert c2.rope_theta == cfg.rope_theta and c2.num_key_value_heads == 2 and c2.head_dim == 16


@pytest.mark.parametrize("fmt,opts", [("deepspec", {}), ("speculators", {}), ("gguf", {}),
                                      ("gguf-dspark-legacy", {}), ("gguf-dspark-legacy", {"doubled_prefix": True})])
def test_dspark_round_trip(tmp_path, dspark_first, fmt, opts):
    model, cfg = dspark_first
    m2, c2, _ = quiet_load(write(tmp_path, model, cfg, fmt, **opts))
    assert_same_params(model, m2)
    assert (c2.lineage, c2.sample_from_anchor, c2.markov_rank, c2.confidence_head) == ("dspark", True, 16, True)
    assert c2.confidence_head_with_markov and c2.has_embed and c2.has_lm_head
    assert c2.target_layer_ids == TAPS


@pytest.mark.parametrize("fmt,opts", [("gguf", {}), ("gguf-dspark-legacy", {"doubled_prefix": True})])
def test_log_snr_round_trip(tmp_path, dspark_snr, fmt, opts):
    model, cfg = dspark_snr
    m2, c2, out = quiet_load(write(tmp_path, model, cfg, fmt, **opts))
    assert_same_params(model, m2)
    assert c2.log_snr and (c2.min_log_snr, c2.max_log_snr) == (-9.0, 9.0)
    assert "log_snr=yes" in out


@pytest.mark.parametrize("fmt", ["speculators", "gguf"])
def test_reduced_vocab_round_trip(tmp_path, fmt):
    cfg = make_cfg(markov_rank=8, draft_vocab_size=100, has_lm_head=True, sample_from_anchor=False)
    model = make_model(cfg, 3)
    p = write(tmp_path, model, cfg, fmt)
    m2, c2, _ = quiet_load(p)
    assert_same_params(model, m2)
    assert c2.draft_vocab_size == 100
    # the on-disk conventions differ: speculators keeps offsets (+ t2d), GGUF absolute target ids
    want_ids = np.arange(100) * 2 + 1
    if fmt == "gguf":
        g = read_gguf(p)
        d2t = np.frombuffer(np.asarray(g.raw(g.tensor_map()["d2t"])), dtype="<i4")
        assert np.array_equal(d2t, want_ids)
    else:
        t = mx.load(os.path.join(p, "model.safetensors"))
        assert np.array_equal(np.array(t["d2t"]), want_ids - np.arange(100))
        assert np.flatnonzero(np.array(t["t2d"])).tolist() == want_ids.tolist()


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_round_trip_in_hf(tmp_path, kind):
    cfg = make_cfg(markov_rank=8, markov_head_type=kind, confidence_head=True, has_lm_head=True)
    model = make_model(cfg, 4)
    for fmt in ("deepspec", "speculators"):
        m2, c2, out = quiet_load(write(tmp_path, model, cfg, fmt))
        assert_same_params(model, m2)
        assert c2.markov_head_type == kind and f"markov={kind}/r8" in out
    with pytest.raises(MlxspecError, match=f"GGUF cannot hold a {kind} Markov head"):
        write(tmp_path, model, cfg, "gguf")


def test_same_weights_same_hidden_and_logits_in_every_format(tmp_path, dspark_first, dflash_bonus):
    for (model, cfg), fmts in ((dspark_first, ["deepspec", "speculators", "gguf", "gguf-dspark-legacy"]),
                               (dflash_bonus, ["zlab", "speculators", "gguf"])):
        h0, l0 = hidden_and_logits(model, cfg)
        for fmt in fmts:
            m2, c2, _ = quiet_load(write(tmp_path, model, cfg, fmt, name=f"{fmt}-{cfg.lineage}"))
            h, logits = hidden_and_logits(m2, c2)
            assert mx.array_equal(h0, h).item(), fmt
            assert mx.array_equal(l0, logits).item(), fmt


def test_bf16_and_f16_tensors(tmp_path, dflash_bonus):
    model, cfg = dflash_bonus
    for dt in (mx.bfloat16, mx.float16):
        m = DFlashModel(cfg)
        m.update(model.parameters())
        m.set_dtype(dt)
        for fmt in ("gguf", "zlab"):
            m2, _, _ = quiet_load(write(tmp_path, m, cfg, fmt, name=f"{fmt}-{dt}"))
            assert m2.fc.weight.dtype == dt
            assert_same_params(m, m2)
        if dt == mx.bfloat16:
            g = read_gguf(os.path.join(str(tmp_path), f"gguf-{dt}.gguf"))
            assert g.tensor_map()["fc.weight"].type_name == "BF16"


def test_gguf_quantized_tensor_is_dequantized_and_unknown_type_is_named(tmp_path, dflash_bonus):
    model, cfg = dflash_bonus
    src = write(tmp_path, model, cfg, "gguf")
    w = np.array(model.layers[0].mlp.up_proj.weight)  # [128, 64]
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    dst = rewrite_gguf(src, str(tmp_path / "q8.gguf"),
                       replace_tensors={"blk.0.ffn_up.weight": (q, gguf.GGMLQuantizationType.Q8_0)})
    m2, _, _ = quiet_load(dst)
    got = np.array(m2.layers[0].mlp.up_proj.weight.astype(mx.float32))
    assert np.abs(got - w).max() <= np.abs(w).max() / 100  # Q8_0 error bound

    # a type id no reader knows: patch the tensor table entry of blk.0.ffn_up.weight
    data = bytearray(open(dst, "rb").read())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # n_dims u32, two u64 dims
    assert int.from_bytes(data[at:at + 4], "little") == 8
    data[at:at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(MlxspecError, match=r"tensor blk\.0\.ffn_up\.weight has type unknown type 99"):
        quiet_load(str(bad))


def test_tap_convention_gguf_plus_one_hf_raw(tmp_path, dspark_first):
    model, cfg = dspark_first
    pg = write(tmp_path, model, cfg, "gguf")
    pl = write(tmp_path, model, cfg, "gguf-dspark-legacy")
    ps = write(tmp_path, model, cfg, "speculators")
    pd = write(tmp_path, model, cfg, "deepspec")
    assert read_gguf(pg).metadata["dflash.target_layers"] == [t + 1 for t in TAPS]
    assert read_gguf(pl).metadata["dspark.target_layers"] == TAPS
    assert json.load(open(os.path.join(ps, "config.json")))["aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert json.load(open(os.path.join(pd, "config.json")))["target_layer_ids"] == TAPS
    ids = {p: quiet_load(p)[1].target_layer_ids for p in (pg, pl, ps, pd)}
    assert all(v == TAPS for v in ids.values()), ids


def test_rope_parameters_and_rope_theta_both_accepted(tmp_path, dspark_first, dflash_bonus):
    model, cfg = dspark_first
    p = write(tmp_path, model, cfg, "deepspec")
    assert "rope_parameters" in json.load(open(os.path.join(p, "config.json")))
    assert quiet_load(p)[1].rope_theta == 1_000_000.0
    edit_config(p, rope_parameters=None, rope_theta=500000.0)
    assert quiet_load(p)[1].rope_theta == 500000.0
    # transformers v5 per-layer-type form
    edit_config(p, rope_theta=None, rope_parameters={"full_attention": {"rope_theta": 250000.0, "rope_type": "default"}})
    assert quiet_load(p)[1].rope_theta == 250000.0
    edit_config(p, rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(MlxspecError, match="rope type 'yarn' is not supported"):
        quiet_load(p)
    model, cfg = dflash_bonus
    pz = write(tmp_path, model, cfg, "zlab")
    assert json.load(open(os.path.join(pz, "config.json")))["rope_theta"] == 1_000_000.0
    edit_config(pz, rope_theta=None, rope_parameters={"rope_theta": 123456.0, "rope_type": "default"})
    assert quiet_load(pz)[1].rope_theta == 123456.0


def test_gguf_block_size_string_default_and_old_mask_key(tmp_path, dflash_bonus):
    model, cfg = dflash_bonus
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "s.gguf"), set_keys={"dflash.block_size": "5"},
                     drop_keys=("tokenizer.ggml.mask_token_id",))
    with pytest.raises(MlxspecError, match="no mask token id"):
        quiet_load(p)
    p = rewrite_gguf(src, str(tmp_path / "s.gguf"), set_keys={"dflash.block_size": "5", "dflash.mask_token_id": 7},
                     drop_keys=("tokenizer.ggml.mask_token_id",))
    c = quiet_load(p)[1]
    assert (c.block_size, c.mask_token_id) == (5, 7)
    p = rewrite_gguf(src, str(tmp_path / "d.gguf"), drop_keys=("dflash.block_size",))
    assert quiet_load(p)[1].block_size == 16


def test_bias_free_confidence_head_is_a_zero_bias(tmp_path, dspark_first):
    model, cfg = dspark_first
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "nb.gguf"), drop_tensors=("conf_proj.bias",))
    m2 = quiet_load(p)[0]
    assert mx.array_equal(m2.confidence_head.proj.bias, mx.zeros((1,))).item()


def test_markov_head_semantics():
    """vanilla / gated / rnn against the DeepSpec formulas written out in numpy."""
    rng = np.random.default_rng(0)
    r, prev, hid = 4, np.array([3, 7]), rng.standard_normal((2, H)).astype(np.float32)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    for kind in ("vanilla", "gated", "rnn"):
        m = DFlashModel(make_cfg(markov_rank=r, markov_head_type=kind)).markov_head
        W1, W2 = np.array(m.markov_w1.weight), np.array(m.markov_w2.weight)
        e = W1[prev]
        b, carry = m.step(mx.array(prev), mx.array(hid))
        if kind == "vanilla":
            want = e @ W2.T
        elif kind == "gated":
            G, gb = np.array(m.gate_proj.weight), np.array(m.gate_proj.bias)
            want = (sig(np.concatenate([hid, e], -1) @ G.T + gb) * e) @ W2.T
        else:
            J, jb = np.array(m.joint_proj.weight), np.array(m.joint_proj.bias)
            z = np.concatenate([np.zeros_like(e), e, hid], -1) @ J.T + jb
            u, c, o = np.split(z, 3, -1)
            want = np.tanh(o) @ W2.T
            s1 = sig(u) * 0 + (1 - sig(u)) * np.tanh(c)
            assert np.allclose(np.array(carry), s1, atol=1e-5)
            b2, _ = m.step(mx.array(prev), mx.array(hid), carry)
            z2 = np.concatenate([s1, e, hid], -1) @ J.T + jb
            assert np.allclose(np.array(b2), np.tanh(np.split(z2, 3, -1)[2]) @ W2.T, atol=1e-5)
            with pytest.raises(NotImplementedError):
                m.bias(m.state(mx.array(prev)))
        assert np.allclose(np.array(b), want, atol=1e-5), kind


# ----------------------------------------------------------------------------- strict loading

def test_log_snr_tensors_with_metadata_saying_no_are_named(tmp_path, dspark_snr):
    model, cfg = dspark_snr
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "x.gguf"),
                     drop_keys=("dflash.log_snr_conditioning", "dflash.min_log_snr", "dflash.max_log_snr"))
    with pytest.raises(MlxspecError) as e:
        quiet_load(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: 4 tensors not claimed by the drafter its metadata describes: ")
    assert ("log_snr_fc1.weight, log_snr_fc1.bias, log_snr_fc2.weight, log_snr_fc2.bias: log-SNR conditioning "
            "(dflash.log_snr_conditioning is absent)") in msg
    p = rewrite_gguf(src, str(tmp_path / "y.gguf"), set_keys={"dflash.log_snr_conditioning": False})
    with pytest.raises(MlxspecError, match=r"log-SNR conditioning \(dflash.log_snr_conditioning=false\)"):
        quiet_load(p)


def test_metadata_promising_missing_tensors_fails_naming_them(tmp_path, dspark_snr):
    model, cfg = dspark_snr
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "a.gguf"), drop_tensors=("log_snr_fc2.weight", "log_snr_fc2.bias"))
    with pytest.raises(MlxspecError) as e:
        quiet_load(p)
    assert (f"{p}: missing tensors: log_snr_fc2.weight, log_snr_fc2.bias: log-SNR conditioning "
            "(dflash.log_snr_conditioning=true)") in str(e.value)
    p = rewrite_gguf(src, str(tmp_path / "b.gguf"), drop_tensors=("markov_w1.weight", "markov_w2.weight"))
    with pytest.raises(MlxspecError, match=r"missing tensors: markov_w1\.weight, markov_w2\.weight: Markov head "
                                           r"\(dflash\.markov_rank=16\)"):
        quiet_load(p)
    p = rewrite_gguf(src, str(tmp_path / "c.gguf"), drop_tensors=("conf_proj.weight", "conf_proj.bias"))
    with pytest.raises(MlxspecError, match=r"missing tensor: conf_proj\.weight: confidence head "
                                           r"\(dflash\.confidence_head=true\)"):
        quiet_load(p)


def test_tensors_present_metadata_says_no(tmp_path, dspark_first):
    model, cfg = dspark_first
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "a.gguf"),
                     set_keys={"dflash.confidence_head": False, "dflash.has_confidence_head": False})
    with pytest.raises(MlxspecError, match=r"conf_proj\.weight, conf_proj\.bias: confidence head "
                                           r"\(dflash\.confidence_head=false\)"):
        quiet_load(p)
    p = rewrite_gguf(src, str(tmp_path / "b.gguf"), set_keys={"dflash.markov_rank": 0})
    with pytest.raises(MlxspecError, match=r"markov_w1\.weight, markov_w2\.weight: Markov head \(dflash\.markov_rank=0\)"):
        quiet_load(p)
    p = rewrite_gguf(src, str(tmp_path / "c.gguf"), set_keys={"dflash.confidence_head": False})
    with pytest.raises(MlxspecError, match="disagree; fix the metadata"):
        quiet_load(p)
    # z-lab config carrying DSpark tensors
    pz = write(tmp_path, model, cfg, "deepspec", name="z")
    edit_config(pz, architectures=["DFlashDraftModel"], dflash_config={"target_layer_ids": TAPS, "mask_token_id": 500,
                "block_size": 7}, markov_rank=None, enable_confidence_head=None, markov_head_type=None,
                confidence_head_with_markov=None)
    with pytest.raises(MlxspecError) as e:
        quiet_load(pz)
    assert ("confidence_head.proj.weight, confidence_head.proj.bias: confidence head (config has no "
            "enable_confidence_head); markov_head.markov_w1.weight, markov_head.markov_w2.weight: Markov head (config "
            "has no markov_rank)") in str(e.value)


def test_hf_missing_unknown_and_misshapen_tensors(tmp_path, dflash_bonus):
    model, cfg = dflash_bonus
    p = write(tmp_path, model, cfg, "zlab")
    edit_tensors(p, drop=["layers.1.mlp.down_proj.weight"], add={"foo.weight": mx.zeros((3,))})
    with pytest.raises(MlxspecError) as e:
        quiet_load(p)
    assert str(e.value) == (
        f"{p}: 1 tensor not claimed by the drafter its metadata describes: foo.weight: not part of a DFlash/DSpark "
        "drafter; and missing tensor: layers.1.mlp.down_proj.weight: backbone; the file's tensors and metadata "
        "disagree: re-export the drafter or fix its metadata"
    )
    p = write(tmp_path, model, cfg, "zlab", name="z2")
    edit_config(p, intermediate_size=96)
    with pytest.raises(MlxspecError) as e:
        quiet_load(p)
    assert str(e.value).startswith(
        f"{p}: tensor shape mismatch: layers.0.mlp.down_proj.weight has shape [64, 128], expected [64, 96]; "
        "layers.0.mlp.gate_proj.weight has shape [128, 64], expected [96, 64]; ")
    assert str(e.value).endswith("the file does not match its own metadata: re-export the drafter")


def test_legacy_and_zlab_cannot_carry_reduced_vocab(tmp_path):
    cfg = make_cfg(markov_rank=8, draft_vocab_size=100, has_lm_head=True)
    model = make_model(cfg, 5)
    src = write(tmp_path, model, cfg, "gguf")
    base = make_cfg(markov_rank=8, has_lm_head=True)
    legacy = write(tmp_path, make_model(base, 5), base, "gguf-dspark-legacy")
    g = read_gguf(src)
    d2t = np.frombuffer(np.asarray(g.raw(g.tensor_map()["d2t"])), dtype="<i4").copy()
    # the legacy file with a d2t added: unclaimed, named
    gl = read_gguf(legacy)
    w = gguf.GGUFWriter(str(tmp_path / "l2.gguf"), "dspark")
    for k, v in gl.metadata.items():
        if k not in ("general.architecture", "general.alignment"):
            _gguf_value(w, k, v)
    for t in gl.tensors:
        w.add_tensor(t.name, np.frombuffer(np.asarray(gl.raw(t)), dtype="<f4").reshape(t.shape))
    w.add_tensor("d2t", d2t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MlxspecError, match=r"d2t: reduced draft vocabulary \(the legacy dspark format has no "
                                           r"reduced vocabulary\)"):
        quiet_load(str(tmp_path / "l2.gguf"))
    with pytest.raises(MlxspecError, match="zlab format cannot hold a Markov or confidence head"):
        write(tmp_path, model, cfg, "zlab")


def test_writers_refuse_layouts_their_format_cannot_express(tmp_path, dspark_first, dflash_bonus):
    model, cfg = dflash_bonus  # bonus-anchor DFlash
    for fmt, what in (("deepspec", "a bonus-anchor"), ("gguf-dspark-legacy", "bonus-anchor")):
        with pytest.raises(MlxspecError, match=what):
            write(tmp_path, model, cfg, fmt)
    first = make_cfg(sample_from_anchor=True)  # anchor-first DFlash (DeepSpec baseline)
    with pytest.raises(MlxspecError) as e:
        write(tmp_path, make_model(first, 6), first, "zlab")
    assert "zlab format cannot hold an anchor-first (sample_from_anchor=true) drafter" in str(e.value)
    model, cfg = dspark_first
    with pytest.raises(MlxspecError, match="cannot hold a Markov or confidence head"):
        write(tmp_path, model, cfg, "zlab")
    snr = make_cfg(markov_rank=4, log_snr=True)
    for fmt in ("deepspec", "speculators", "zlab"):
        with pytest.raises(MlxspecError, match="cannot hold log-SNR conditioning"):
            write(tmp_path, make_model(snr, 7), snr, fmt)
    with pytest.raises(MlxspecError, match="unknown drafter format 'onnx'"):
        write(tmp_path, model, cfg, "onnx")


def test_not_a_drafter(tmp_path, dflash_bonus):
    model, cfg = dflash_bonus
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "llama.gguf"), arch="llama")
    with pytest.raises(MlxspecError, match=r"general.architecture = 'llama' is not a drafter"):
        quiet_load(p)
    p = rewrite_gguf(src, str(tmp_path / "causal.gguf"), set_keys={"dflash.attention.causal": True})
    with pytest.raises(MlxspecError, match="causal block attention"):
        quiet_load(p)
    p = rewrite_gguf(src, str(tmp_path / "dsv4.gguf"), set_keys={"dflash.hyper_connection.count": 4})
    with pytest.raises(MlxspecError, match="DeepSeek-V4 DSpark backbones"):
        quiet_load(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MlxspecError, match="no config.json"):
        quiet_load(str(tmp_path / "empty"))
    pz = write(tmp_path, model, cfg, "zlab")
    edit_config(pz, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(MlxspecError, match="sliding-window draft attention"):
        quiet_load(pz)


def test_speculators_verifier_copies_are_claimed_unused(tmp_path, dspark_first):
    model, cfg = dspark_first
    p = write(tmp_path, model, cfg, "speculators")
    edit_tensors(p, add={"verifier_norm.weight": mx.ones((H,))})
    m2, _, _ = quiet_load(p)
    assert_same_params(model, m2)
    edit_tensors(p, add={"verifier_norm.weight": mx.ones((H + 1,))})
    with pytest.raises(MlxspecError, match=r"verifier_norm\.weight has shape \[65\], expected \[64\]"):
        quiet_load(p)


# ----------------------------------------------------------------------------- what peers' loaders need

ACCEPTED_TRUE = (True, 1, "true", "True", "TRUE", " yes ", "Yes", "1", "on", "t", "y")
ACCEPTED_FALSE = (False, 0, "false", "False", "no", "NO", "0", "off", "f", "n")
REFUSED = ("maybe", "", "2", 2, -1, 0.5, "truee", [1])


@pytest.mark.parametrize("value", ACCEPTED_TRUE + ACCEPTED_FALSE)
def test_layout_key_boolean_spellings_hf(tmp_path, dspark_first, dflash_bonus, value):
    want = value in ACCEPTED_TRUE and value is not False
    model, cfg = dspark_first
    p = write(tmp_path, model, cfg, "speculators")
    edit_config(p, sample_from_anchor=value)
    c = quiet_load(p)[1]
    assert (c.sample_from_anchor, c.extra["layout_from"]) == (want, "key:sample_from_anchor")
    model, cfg = dflash_bonus  # z-lab: the key inside dflash_config
    pz = write(tmp_path, model, cfg, "zlab")
    dc = json.load(open(os.path.join(pz, "config.json")))["dflash_config"]
    edit_config(pz, dflash_config={**dc, "sample_from_anchor": value})
    assert quiet_load(pz)[1].sample_from_anchor == want


@pytest.mark.parametrize("value", REFUSED)
def test_layout_key_non_boolean_is_refused_hf(tmp_path, dspark_first, value):
    model, cfg = dspark_first
    p = write(tmp_path, model, cfg, "speculators")
    edit_config(p, sample_from_anchor=value)
    with pytest.raises(MlxspecError) as e:
        quiet_load(p)
    assert str(e.value) == f"{p}: sample_from_anchor = {value!r} is not a boolean; write true or false"


@pytest.mark.parametrize("value,want", [("true", True), ("Yes", True), ("1", True), (1, True),
                                        ("false", False), ("no", False), ("0", False), (0, False)])
def test_layout_key_boolean_spellings_gguf(tmp_path, dspark_first, value, want):
    model, cfg = dspark_first
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "s.gguf"), set_keys={"dflash.sample_from_anchor": value})
    assert quiet_load(p)[1].sample_from_anchor is want


def test_layout_key_non_boolean_is_refused_gguf(tmp_path, dspark_first):
    model, cfg = dspark_first
    src = write(tmp_path, model, cfg, "gguf")
    for value in ("maybe", 2):
        p = rewrite_gguf(src, str(tmp_path / "s.gguf"), set_keys={"dflash.sample_from_anchor": value})
        with pytest.raises(MlxspecError) as e:
            quiet_load(p)
        assert str(e.value) == f"{p}: dflash.sample_from_anchor = {value!r} is not a boolean; write true or false"


def test_other_boolean_keys_are_strict_too(tmp_path, dspark_first):
    model, cfg = dspark_first
    p = write(tmp_path, model, cfg, "speculators")
    edit_config(p, enable_confidence_head="yes")
    assert quiet_load(p)[1].confidence_head is True
    edit_config(p, enable_confidence_head="sometimes")
    with pytest.raises(MlxspecError, match=r"enable_confidence_head = 'sometimes' is not a boolean; write true or false$"):
        quiet_load(p)


# z-lab's published DFlash configs (z-lab/Qwen3-8B-DFlash-b16 and siblings): every key but
# auto_map (their remote code, not shipped by mlxspec), transformers_version and the target's
# bos/eos token ids. z-lab's MLX loader (dflash/model_mlx.py `_draft_config`) indexes
# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
# intermediate_size, rms_norm_eps, max_position_embeddings and dflash_config.{target_layer_ids,
# mask_token_id}; the MLX ports also read num_target_layers.
ZLAB_REFERENCE_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "block_size", "dflash_config", "dtype",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads", "num_hidden_layers",
    "num_key_value_heads", "num_target_layers", "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window",
    "tie_word_embeddings", "use_cache", "use_sliding_window", "vocab_size",
}


def test_zlab_config_has_the_reference_key_set(tmp_path, dflash_bonus):
    model, cfg = dflash_bonus
    p = write(tmp_path, model, cfg, "zlab")
    c = json.load(open(os.path.join(p, "config.json")))
    assert ZLAB_REFERENCE_KEYS <= set(c), sorted(ZLAB_REFERENCE_KEYS - set(c))
    assert {"target_layer_ids", "mask_token_id"} <= set(c["dflash_config"])
    assert c["num_target_layers"] == TARGET.num_layers and c["max_position_embeddings"] == 32768
    assert c["architectures"] == ["DFlashDraftModel"] and c["dtype"] == "float32"
    # read back and written again without a target: what the file said is kept
    m2, c2, _ = quiet_load(p)
    p2 = write(tmp_path, m2, c2, "zlab", name="again", target=None)
    again = json.load(open(os.path.join(p2, "config.json")))
    assert again == c
    with pytest.raises(MlxspecError) as e:
        write(tmp_path, model, cfg, "zlab", name="none", target=None)
    assert str(e.value) == (f"{tmp_path}/none: the zlab format needs num_target_layers; "
                            "pass target= to save_drafter")


def test_speculators_config_names_the_verifier(tmp_path, dspark_first):
    model, cfg = dspark_first
    p = write(tmp_path, model, cfg, "speculators")
    v = json.load(open(os.path.join(p, "config.json")))["speculators_config"]["verifier"]
    assert v == {"name_or_path": "test/tiny-qwen3", "architectures": ["Qwen3ForCausalLM"]}
    m2, c2, _ = quiet_load(p)
    p2 = write(tmp_path, m2, c2, "speculators", name="again", target=None)
    assert json.load(open(os.path.join(p2, "config.json")))["speculators_config"]["verifier"] == v
    with pytest.raises(MlxspecError) as e:
        write(tmp_path, model, cfg, "speculators", name="none", target=None)
    assert str(e.value) == (f"{tmp_path}/none: the speculators format needs speculators_config.verifier; "
                            "pass target= to save_drafter")


def test_speculators_reduced_vocab_without_head_needs_the_target(tmp_path):
    cfg = make_cfg(markov_rank=8, draft_vocab_size=100, sample_from_anchor=True)
    model = make_model(cfg, 3)
    with pytest.raises(MlxspecError) as e:
        write(tmp_path, model, cfg, "speculators")  # a TargetInfo has no head rows
    assert str(e.value) == (f"{tmp_path}/speculators: the speculators format needs lm_head.weight with a reduced "
                            "vocabulary (d2t); pass the Target as target= so its head rows are written")


def test_gguf_dflash_drafter_without_vocab_key_takes_the_targets(tmp_path):
    cfg = make_cfg(sample_from_anchor=False)  # borrows embedding and head: no vocab-sized tensor
    model = make_model(cfg, 5)
    src = write(tmp_path, model, cfg, "gguf")
    p = rewrite_gguf(src, str(tmp_path / "novocab.gguf"), drop_keys=("dflash.vocab_size",))
    with pytest.raises(MlxspecError) as e:
        quiet_load(p)
    assert str(e.value) == (f"{p}: cannot tell the vocabulary size (no dflash.vocab_size, tokenizer or vocab-sized "
                            "tensor); load it with its target, or re-export the drafter with its vocab_size")
    m2, c2, _ = quiet_load(p, target_info=TargetInfo(hidden_size=H, num_layers=8, vocab_size=V, model_type="qwen3"))
    assert c2.vocab_size == V
    assert_same_params(model, m2)
