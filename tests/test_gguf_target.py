"""GGUF target loading: per-type round trips against numpy dequantization, error paths,
taps / trim invariants, and the real SmolLM2 model (greedy answer, perplexity, RoPE layout).

Files are written with the `gguf` package (tests/conftest.py: `write_gguf`), as llama.cpp's
converter writes them (Q/K rows permuted). Reference dequantizers here are written from the
block layouts, independently of mlxspec's loader; K-quants are compared with
`gguf.quants.dequantize` (the loader dequantizes them with it, to float16).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY, hf_name, llama_cpp_permute, write_gguf, write_tiny_model, tiny_tensors

from mlxspec.errors import MlxspecError
from mlxspec.targets.gguf import load_gguf_target
from mlxspec.targets.load import load_target
from mlxspec.targets.model import trim_cache


# ----------------------------------------------------------------------------- numpy references

def _f16(b):
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def ref_dequant(tid: int, raw: np.ndarray, shape) -> np.ndarray:
    """ggml block layouts -> float32 [rows, cols] (ggml-quants.c semantics)."""
    rows = shape[0] if len(shape) == 2 else 1
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    if tid == 0:
        return raw.view(np.float32).reshape(shape)
    if tid == 1:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if tid == 30:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if tid == 8:  # Q8_0: d, 32 x int8
        b = raw.reshape(rows, -1, 34)
        return (_f16(b[..., :2])[..., None] * b[..., 2:].view(np.int8).astype(np.float32)).reshape(shape)
    if tid in (2, 3):  # Q4_0: d, nibbles (low = 0..15, high = 16..31); Q4_1: d, m, nibbles
        bb = 18 if tid == 2 else 20
        b = raw.reshape(rows, -1, bb)
        qs = b[..., bb - 16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
        d = _f16(b[..., :2])[..., None]
        if tid == 2:
            return ((q - 8) * d).reshape(shape)
        return (q * d + _f16(b[..., 2:4])[..., None]).reshape(shape)
    if tid == 41:  # Q1_0: d, 128 sign bits LSB first: bit ? +d : -d
        b = raw.reshape(rows, -1, 18)
        bits = (b[..., 2:, None] >> np.arange(8, dtype=np.uint8)) & 1
        d = _f16(b[..., :2])[..., None]
        return np.where(bits.reshape(rows, -1, 128) == 1, d, -d).reshape(shape)
    if tid in (42, 142):  # Q2_0 (64) / PQ2_0 (128): d, 2-bit codes LSB first: (code - 1) * d
        qk, bb = (64, 18) if tid == 42 else (128, 34)
        b = raw.reshape(rows, -1, bb)
        codes = ((b[..., 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(rows, -1, qk)
        return ((codes.astype(np.float32) - 1) * _f16(b[..., :2])[..., None]).reshape(shape)
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tid)).reshape(shape).astype(np.float32)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's permute, by index (independent of the loader's reshape)."""
    idx = llama_cpp_permute(np.arange(w.shape[0])[:, None], n_head)[:, 0]
    out = np.empty_like(w)
    out[idx] = w
    return out


def loaded_weights(model) -> dict:
    """HF name -> (native dequantized float32, float32-arithmetic dequantized, module)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            native = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32)
            wide = mx.dequantize(m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                                 m.group_size, m.bits)
            out[name + ".weight"] = (np.array(native), np.array(wide), m)
        elif isinstance(m, (nn.Linear, nn.Embedding, nn.RMSNorm)):
            a = np.array(m.weight.astype(mx.float32))
            out[name + ".weight"] = (a, a, m)
    return out


def expected(name: str, tid: int, raw, shape) -> np.ndarray:
    ref = ref_dequant(tid, raw, shape)
    if ".attn_q." in name:
        ref = unpermute_rows(ref, TINY["heads"])
    elif ".attn_k." in name:
        ref = unpermute_rows(ref, TINY["kv_heads"])
    return ref


# ----------------------------------------------------------------------------- round trips

AFFINE_KEPT = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32)}
LOWBIT = {"Q1_0": (1, 128), "Q2_0": (2, 64), "PQ2_0": (2, 128), "Q2_0-all-codes": (2, 64),
          "PQ2_0-all-codes": (2, 128)}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", *AFFINE_KEPT, *LOWBIT, "Q4_K", "Q6_K"])
def test_round_trip(tmp_path, qtype, monkeypatch):
    monkeypatch.setenv("MLXSPEC_NATIVE_LOWBIT", "0")  # the MLX affine repack, also on Metal/CUDA
    path = tmp_path / f"{qtype}.gguf"
    _, written = write_tiny_model(path, qtype, tokenizer=False)
    model, cfg, g, notes = load_gguf_target(str(path))
    got = loaded_weights(model)
    assert len(g.tensors) == len(written)
    for name, (tid, raw, shape) in written.items():
        native, wide, module = got[hf_name(name)]
        ref = expected(name, tid, raw, shape)
        if len(shape) == 1 or qtype in ("F32", "F16", "BF16"):
            # dense: 2-D float matrices run in float16 (like mlx-lm), norms stay float32
            want = ref.astype(np.float16).astype(np.float32) if len(shape) == 2 else ref
            np.testing.assert_array_equal(native, want, err_msg=name)
        elif qtype in AFFINE_KEPT:
            bits, group = AFFINE_KEPT[qtype]
            assert (module.bits, module.group_size) == (bits, group), name
            # codes, scales and biases are exact: float32 arithmetic reproduces ggml bit for bit
            np.testing.assert_array_equal(wide, ref, err_msg=name)
            # as MLX computes it natively (q * scale + bias in float16): within float16 rounding of
            # the larger of the two terms (bias = -8d / -128d / m cancels against q * d)
            bias = np.repeat(np.abs(np.array(module.biases.astype(mx.float32))), group, axis=1)
            assert np.all(np.abs(native - ref) <= 2**-10 * (bias + np.abs(ref))), name
        elif qtype in LOWBIT:
            bits, group = LOWBIT[qtype]
            assert (module.bits, module.group_size) == (bits, group), name
            np.testing.assert_array_equal(native, ref, err_msg=f"{name}: not bit-exact")
        else:  # K-quants: dense float16 from gguf.quants.dequantize
            assert isinstance(module, (nn.Linear, nn.Embedding)), name
            np.testing.assert_array_equal(native, ref.astype(np.float16).astype(np.float32), err_msg=name)
    if qtype in ("Q4_K", "Q6_K"):
        assert any(qtype in n and "float16" in n for n in notes), notes


def test_qk_unpermute_restores_hf_layout(tmp_path):
    """An F32 file written from HF weights by llama.cpp's permute loads back to the HF weights."""
    path = tmp_path / "f32.gguf"
    tensors, _ = write_tiny_model(path, "F32", tokenizer=False)
    model, *_ = load_gguf_target(str(path))
    got = loaded_weights(model)
    for name in ("blk.0.attn_q.weight", "blk.1.attn_k.weight"):
        np.testing.assert_array_equal(got[hf_name(name)][0], tensors[name].astype(np.float16).astype(np.float32))


def test_dense_cpu_target_equals_native_dequantization(tmp_path):
    """load_target on CPU: dense float32 weights equal MLX's dequantization of the repack in
    float32 arithmetic (never the float16 `mx.dequantize` of float16 scales)."""
    path = tmp_path / "q4.gguf"
    write_tiny_model(path, "Q4_0")
    target, tok = load_target(str(path))
    quant, *_ = load_gguf_target(str(path))
    a = np.array(target.model.model.layers[1].self_attn.q_proj.weight)
    assert target.model.model.layers[1].self_attn.q_proj.weight.dtype == mx.float32
    np.testing.assert_array_equal(a, loaded_weights(quant)["model.layers.1.self_attn.q_proj.weight"][1])


# ----------------------------------------------------------------------------- error paths

def test_every_unsupported_tensor_is_listed(tmp_path):
    """Every tensor of a type mlxspec cannot load is named with its type, in one line."""
    path = tmp_path / "bad.gguf"
    names = ["blk.0.attn_v.weight", "blk.1.ffn_down.weight", "blk.1.ffn_up.weight"]
    write_gguf(path, tiny_tensors(), tokenizer=False, types={n: 99 for n in names} | {"blk.0.ffn_up.weight": 9})
    with pytest.raises(MlxspecError) as e:
        load_gguf_target(str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: unsupported tensor type for ")
    for n in names:
        assert f"{n} (unknown type 99)" in msg
    assert "blk.0.ffn_up.weight (Q8_1)" in msg  # known to ggml, not decodable by the gguf package


def test_mxfp4_tensor_is_dequantized_not_dropped(tmp_path):
    """MXFP4 (39) is decodable by the gguf package: loaded as float16 and said so
    (it once crashed with an IndexError because its block size was unknown here)."""
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, tiny_tensors(), tokenizer=False, types={"blk.0.ffn_up.weight": 39})
    model, cfg, g, notes = load_gguf_target(str(path))
    assert any("MXFP4 dequantized to float16" in n for n in notes), notes
    info = g.tensor_map()["blk.0.ffn_up.weight"]
    import gguf

    ref = gguf.quants.dequantize(np.asarray(g.raw(info)), gguf.GGMLQuantizationType(39)).reshape(info.shape)
    got = np.array(model.model.layers[0].mlp.up_proj.weight.astype(mx.float32))
    np.testing.assert_array_equal(got, ref.astype(np.float16).astype(np.float32))


def test_unknown_tensor_name_is_named(tmp_path):
    path = tmp_path / "extra.gguf"
    tensors = tiny_tensors()
    tensors["blk.0.attn_sinks.weight"] = np.zeros((4, 256), np.float32)
    write_gguf(path, tensors, tokenizer=False)
    with pytest.raises(MlxspecError, match=r"blk\.0\.attn_sinks\.weight"):
        load_gguf_target(str(path))


def test_missing_tensor_is_named(tmp_path):
    path = tmp_path / "missing.gguf"
    tensors = tiny_tensors()
    del tensors["blk.1.ffn_gate.weight"]
    write_gguf(path, tensors, tokenizer=False)
    with pytest.raises(MlxspecError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight"):
        load_gguf_target(str(path))


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_gguf(tiny_gguf, tmp_path, cut):
    data = tiny_gguf.read_bytes()
    keep = 200 if cut == "header" else len(data) - 1000
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:keep])
    with pytest.raises(MlxspecError) as e:
        load_target(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and "truncated" in msg and "download it again" in msg and str(bad) in msg


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, tiny_tensors(), arch="mamba")
    with pytest.raises(MlxspecError, match=r"architecture 'mamba' is not supported as a target; supported: llama"):
        load_target(str(path))


def test_tokenizer_larger_than_embedding(tmp_path):
    path = tmp_path / "small_vocab.gguf"
    tensors = tiny_tensors()
    tensors["token_embd.weight"] = tensors["token_embd.weight"][:200]
    write_gguf(path, tensors)
    with pytest.raises(MlxspecError, match=r"tokenizer has 261 tokens but the model's embedding has 200 rows"):
        load_target(str(path))


# ----------------------------------------------------------------------------- taps and trim

def test_taps_equal_plain_forward(smollm2):
    target, tok = smollm2
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Python is a programming language.")
    x = mx.array([ids])
    inner = target.model.model
    h = inner.embed_tokens(x)
    states = []
    for layer in inner.layers:
        h = layer(h, "causal", cache=None)
        states.append(h)
    plain_logits = target.model(x)
    taps = (1, 14, 27, 3)
    logits, got = target(x, target.make_cache(), taps=taps, logits="all")
    H = target.info.hidden_size
    for j, k in enumerate(taps):
        np.testing.assert_allclose(np.array(got[..., j * H:(j + 1) * H]), np.array(states[k]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(logits), np.array(plain_logits), rtol=0, atol=1e-4)
    # tap-only pass stops at the deepest tap and gives the same taps
    none_logits, got2 = target(x, target.make_cache(), taps=taps, logits="none")
    assert none_logits is None
    np.testing.assert_array_equal(np.array(got2), np.array(got))


def test_trim_then_reforward_identical(smollm2):
    target, tok = smollm2
    prefix = tok.encode("Speculative decoding drafts several tokens and verifies them")
    drafts = tok.encode(" in one forward pass of the target model", add_special_tokens=False)
    cache = target.make_cache()
    target(mx.array([prefix]), cache)
    first, _ = target(mx.array([drafts]), cache)
    mx.eval(first)
    for _ in range(2):  # reject everything, re-verify the same block: bit-identical logits
        trim_cache(cache, len(drafts))
        assert cache[0].offset == len(prefix)
        again, _ = target(mx.array([drafts]), cache)
        np.testing.assert_array_equal(np.array(again), np.array(first))
    # engine-like partial accept: keep 3 drafts, then the next step attends to exactly the committed
    # tokens (rejected rows are gone: same result as a cache that never saw them, up to the float
    # rounding of computing the 3 kept rows inside a longer block)
    a = 3
    trim_cache(cache, len(drafts) - a)
    assert cache[0].offset == len(prefix) + a
    nxt = tok.encode(" quickly", add_special_tokens=False)
    l1, _ = target(mx.array([nxt]), cache)
    fresh = target.make_cache()
    target(mx.array([prefix]), fresh)
    target(mx.array([drafts]), fresh)
    trim_cache(fresh, len(drafts) - a)
    l2, _ = target(mx.array([nxt]), fresh)
    np.testing.assert_array_equal(np.array(l1), np.array(l2))
    clean = target.make_cache()
    target(mx.array([prefix]), clean)
    target(mx.array([drafts[:a]]), clean)
    l3, _ = target(mx.array([nxt]), clean)
    np.testing.assert_allclose(np.array(l1), np.array(l3), rtol=0, atol=1e-3)
    assert int(mx.argmax(l1[0, -1]).item()) == int(mx.argmax(l3[0, -1]).item())


# ----------------------------------------------------------------------------- SmolLM2

def test_smollm2_greedy_paris(smollm2):
    from mlxspec.engine.loop import generate_steps
    from mlxspec.tokenizer import apply_chat_template

    target, tok = smollm2
    prompt = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    out = [t for step in generate_steps(target, ids, drafter=None, max_tokens=16, eos_ids=tok.eos_token_ids) for t in step]
    assert "Paris" in tok.decode(out)


# The opening of the Python tutorial (docs.python.org/3/tutorial/index.html), ~220 tokens.
PYTHON_DOCS = (
    "Python is an easy to learn, powerful programming language. It has efficient high-level data "
    "structures and a simple but effective approach to object-oriented programming. Python's elegant "
    "syntax and dynamic typing, together with its interpreted nature, make it an ideal language for "
    "scripting and rapid application development in many areas on most platforms. The Python "
    "interpreter and the extensive standard library are freely available in source or binary form for "
    "all major platforms from the Python web site, and may be freely distributed. The same site also "
    "contains distributions of and pointers to many free third party Python modules, programs and "
    "tools, and additional documentation. The Python interpreter is easily extended with new functions "
    "and data types implemented in C or C++ (or other languages callable from C). Python is also "
    "suitable as an extension language for customizable applications. This tutorial introduces the "
    "reader informally to the basic concepts and features of the Python language and system. It helps "
    "to have a Python interpreter handy for hands-on experience, but all examples are self-contained, so "
    "the tutorial can be read off-line as well. For a description of standard objects and modules, see "
    "The Python Standard Library. The Python Language Reference gives a more formal definition of the "
    "language."
)
PPL_BOUND = 40.0  # measured: correct RoPE layout 21.3; Q/K un-permute skipped 148 (239 tokens)


def perplexity(target, ids) -> float:
    logits, _ = target(mx.array([ids]), target.make_cache())
    logp = logits[0, :-1].astype(mx.float32) - mx.logsumexp(logits[0, :-1].astype(mx.float32), axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1)
    return math.exp(float(nll.mean().item()))


@pytest.fixture(scope="module")
def ppl_ids(smollm2):
    ids = smollm2[1].encode(PYTHON_DOCS)
    assert 64 < len(ids) <= 256
    return ids


def test_smollm2_perplexity(smollm2, ppl_ids):
    ppl = perplexity(smollm2[0], ppl_ids)
    print(f"SmolLM2 perplexity on the Python-docs passage ({len(ppl_ids)} tokens): {ppl:.2f}")
    assert ppl < PPL_BOUND


def test_smollm2_wrong_rope_layout_is_far_worse(smollm2_path, ppl_ids, monkeypatch):
    """Skipping the Q/K un-permute (RoPE pairs in the wrong layout) must be caught by the bound."""
    import mlxspec.targets.gguf as gt

    monkeypatch.setattr(gt, "_unpermute", lambda x, n_head: x)
    wrong, _ = load_target(str(smollm2_path))
    ppl = perplexity(wrong, ppl_ids)
    print(f"SmolLM2 perplexity with Q/K left in ggml's layout: {ppl:.2f}")
    assert ppl > 2.5 * PPL_BOUND


# ----------------------------------------------------------------------------- the float32 dense path

def _gguf_dequant(tid: int, raw, shape) -> np.ndarray:
    """`gguf.quants.dequantize` where the gguf package knows the type (float32); the block-layout
    reference above for the low-bit types it lacks (Q1_0 / Q2_0 / PQ2_0)."""
    import gguf

    try:
        qt = gguf.GGMLQuantizationType(tid)
        if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError
        return gguf.quants.dequantize(np.asarray(raw), qt).reshape(shape).astype(np.float32)
    except (ValueError, NotImplementedError):
        return ref_dequant(tid, raw, shape)


def _dense_params(model) -> dict:
    params = dict(tree_flatten_np(model))
    for v in params.values():
        assert v.dtype == np.float32
    return params


def tree_flatten_np(model):
    from mlx.utils import tree_flatten

    for k, v in tree_flatten(model.parameters()):
        yield k, np.array(v)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", *AFFINE_KEPT, *LOWBIT, "Q4_K", "Q6_K"])
def test_dense_path_is_bit_exact_float32(tmp_path, qtype):
    """load_target(dense=True): every weight equals gguf.quants.dequantize in float32, bit for bit."""
    path = tmp_path / f"{qtype}.gguf"
    _, written = write_tiny_model(path, qtype)
    target, _ = load_target(str(path), dense=True)
    got = _dense_params(target.model)
    for name, (tid, raw, shape) in written.items():
        want = _gguf_dequant(tid, raw, shape)
        if ".attn_q." in name:
            want = unpermute_rows(want, TINY["heads"])
        elif ".attn_k." in name:
            want = unpermute_rows(want, TINY["kv_heads"])
        np.testing.assert_array_equal(got[hf_name(name)], want, err_msg=f"{qtype} {name}")


def _smollm2_reference(path):
    """Independent float32 weights of the file: gguf's reader + gguf.quants.dequantize, ggml layout."""
    import gguf

    r = gguf.GGUFReader(str(path))
    w = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml ne -> numpy [rows, cols]
        w[t.name] = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
    md = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.")}
    return w, md


def test_smollm2_dense_weights_equal_gguf_dequantize(smollm2, smollm2_path):
    target, _ = smollm2
    ref, md = _smollm2_reference(smollm2_path)
    got = _dense_params(target.model)
    cfg = target.model.args
    for name, want in ref.items():
        if ".attn_q." in name:
            want = unpermute_rows(want, cfg.num_attention_heads)
        elif ".attn_k." in name:
            want = unpermute_rows(want, cfg.num_key_value_heads)
        np.testing.assert_array_equal(got[hf_name(name)], want, err_msg=name)


def _numpy_llama_logits(w: dict, md: dict, ids) -> np.ndarray:
    """A float32 llama forward in numpy over the GGUF's own tensors (Q/K in ggml's permuted
    layout, so RoPE rotates adjacent pairs, as ggml's rope mode 0 does)."""
    f = np.float32
    L = int(md["llama.block_count"])
    nh, nkv = int(md["llama.attention.head_count"]), int(md["llama.attention.head_count_kv"])
    eps, theta = f(md["llama.attention.layer_norm_rms_epsilon"]), float(md["llama.rope.freq_base"])
    emb = w["token_embd.weight"]
    x = emb[np.asarray(ids)]
    T, H = x.shape
    hd = H // nh
    pos = np.arange(T, dtype=np.float64)[:, None]
    ang = (pos * theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)).astype(f)  # [T, hd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def norm(v, g):
        return (v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g).astype(f)

    def rope(v):  # v [T, heads, hd], pairs (2i, 2i+1)
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    mask = np.triu(np.full((T, T), -np.inf, dtype=f), 1)
    for i in range(L):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(T, nh, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(T, nkv, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, nkv, hd)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / f(np.sqrt(hd)) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(T, H)
        x = x + a @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", emb)
    return norm(x, w["output_norm.weight"]) @ head.T


def test_smollm2_dense_logits_match_numpy_float32_forward(smollm2, smollm2_path):
    """The dense path computes in float32: logits within 1e-3 of an independent numpy forward
    (with float16-rounded weights they were 0.05-0.07 off)."""
    target, tok = smollm2
    ids = tok.encode("def reverse(s):\n    return s[::-1]  # The capital of France is")
    ref, md = _smollm2_reference(smollm2_path)
    want = _numpy_llama_logits(ref, md, ids)
    got, _ = target(mx.array([ids]), target.make_cache(), logits="all")
    err = np.abs(np.array(got[0].astype(mx.float32)) - want).max()
    print(f"max |logit - numpy float32| over {len(ids)} positions: {err:.2e}")
    assert err < 1e-3
