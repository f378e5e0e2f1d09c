"""Tokenizer tests: llama.cpp golden tokenizations, the SmolLM2 test model, synthetic vocabularies."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from conftest_vocab import (  # noqa: E402
    GOLDEN_VOCABS,
    REFUSED_VOCABS,
    read_golden,
    test_gguf_path,
    vocab_path,
)

from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402

from mlxspec.errors import MlxspecError  # noqa: E402
from mlxspec.gguf.file import read_gguf  # noqa: E402
from mlxspec.tokenizer import (  # noqa: E402
    apply_chat_template,
    load_gguf_tokenizer,
    load_hf_tokenizer,
    tokenizer_family,
)
from mlxspec.tokenizer.pretokenizers import BPE_PRE_TOKENIZERS, SUPPORTED_MODELS, VERIFIED_BPE_PRE  # noqa: E402

_MD_CACHE: dict = {}


def _metadata(path):
    key = str(path)
    if key not in _MD_CACHE:
        _MD_CACHE[key] = read_gguf(path).metadata
    return _MD_CACHE[key]


def _vocab_metadata(name):
    p, why = vocab_path(name)
    if p is None:
        pytest.skip(why)
    return p, _metadata(p)


@pytest.fixture(scope="module")
def smol():
    p, why = test_gguf_path()
    if p is None:
        pytest.skip(why)
    t0 = time.perf_counter()
    tok = load_gguf_tokenizer(_metadata(p))
    tok.build_seconds = time.perf_counter() - t0
    return tok


# ---------------------------------------------------------------------------------------------
# llama.cpp golden data
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_golden_tokenization(name):
    path, md = _vocab_metadata(name)
    tok = load_gguf_tokenizer(md)
    cases = read_golden(path)
    assert cases
    bad = []
    for text, expected in cases:
        # test-tokenizer-0.cpp: add_special=false, parse_special=false
        got = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        if got != expected:
            bad.append((text, expected, got))
    assert not bad, f"{name}: {len(bad)}/{len(cases)} differ, first: {bad[0]!r}"


@pytest.mark.parametrize("name", GOLDEN_VOCABS)
def test_golden_roundtrip_and_stream(name):
    path, md = _vocab_metadata(name)
    tok = load_gguf_tokenizer(md)
    for text, expected in read_golden(path):
        assert tok.decode(expected) == text, (name, text)
        det = tok.detokenizer
        segs = []
        for t in expected:
            det.add_token(t)
            segs.append(det.last_segment)
        det.finalize()
        segs.append(det.last_segment)
        assert "".join(segs) == text == det.text
        assert not any("\ufffd" in s for s in segs), (name, text, segs)


def test_golden_families_claimed():
    """Every golden BPE pre-tokenizer is in the claimed list, and claimed as verified."""
    for name in GOLDEN_VOCABS:
        p, _ = vocab_path(name)
        if p is None:
            pytest.skip("golden data unavailable")
        md = _metadata(p)
        assert md["tokenizer.ggml.model"] in SUPPORTED_MODELS
        if md["tokenizer.ggml.model"] == "gpt2":
            assert md["tokenizer.ggml.pre"] in BPE_PRE_TOKENIZERS
            assert md["tokenizer.ggml.pre"] in VERIFIED_BPE_PRE


@pytest.mark.parametrize("name", sorted(REFUSED_VOCABS))
def test_refused_golden_vocab(name):
    _, md = _vocab_metadata(name)
    with pytest.raises(MlxspecError, match=REFUSED_VOCABS[name]):
        load_gguf_tokenizer(md)


def test_reader_matches_gguf_reader():
    """read_gguf agrees with gguf.GGUFReader on the tokenizer keys."""
    import gguf

    p, md = _vocab_metadata("phi-3")
    r = gguf.GGUFReader(p)
    for key, field in r.fields.items():
        if not key.startswith(("tokenizer.", "general.")):
            continue
        ref = field.contents()
        got = md[key]
        if isinstance(got, np.ndarray):
            np.testing.assert_allclose(got, np.asarray(ref, dtype=got.dtype))
        else:
            assert got == ref, key


def test_bos_conventions():
    _, md = _vocab_metadata("llama-bpe")  # llama3: adds BOS by default
    tok = load_gguf_tokenizer(md)
    assert tok.encode("Hello")[0] == 128000 == tok.bos_token_id
    assert tok.encode("Hello", add_special_tokens=False)[0] != 128000
    _, md = _vocab_metadata("llama-spm")  # SentencePiece: BOS, space prefix
    tok = load_gguf_tokenizer(md)
    ids = tok.encode("Hello world")
    assert ids[0] == 1 and tok.convert_ids_to_tokens(ids[1]) == "\u2581Hello"
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    assert tok.decode(ids) == "<s> Hello world"
    _, md = _vocab_metadata("qwen2")  # gpt2 model without add_bos_token: no BOS
    tok = load_gguf_tokenizer(md)
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids
    assert tok.convert_tokens_to_ids("<|endoftext|>") in tok.eos_token_ids


def test_spm_multibyte_stream():
    _, md = _vocab_metadata("llama-spm")
    tok = load_gguf_tokenizer(md)
    text = "naïve 🦙 日本 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(re.fullmatch("<0x[0-9A-F]{2}>", t) for t in tok.convert_ids_to_tokens(ids))  # byte-fallback tokens
    det = tok.detokenizer
    out = []
    for i in ids:
        det.add_token(i)
        seg = det.last_segment
        assert "\ufffd" not in seg
        out.append(seg)
    det.finalize()
    assert "".join(out) + det.last_segment == text


# ---------------------------------------------------------------------------------------------
# The SmolLM2 test model
# ---------------------------------------------------------------------------------------------

def test_smol_roundtrip(smol):
    assert isinstance(smol, TokenizerWrapper)
    assert tokenizer_family(_metadata(test_gguf_path()[0])) == "gpt2/smollm"
    assert len(smol) == 49152
    ids = smol.encode("The capital of France is")
    assert ids and all(isinstance(i, int) for i in ids)
    assert smol.bos_token_id not in ids[:1] or smol.add_bos_token  # GGUF says add_bos_token = false
    assert smol.decode(ids) == "The capital of France is"
    # ~1 s on this machine kind's 2 shared cores (load average ~14), 4.7 s seen with tests running
    # alongside; the bound catches a pathological build, not noise
    assert smol.build_seconds < 15.0, smol.build_seconds


def test_smol_special_tokens(smol):
    im_start = smol.convert_tokens_to_ids("<|im_start|>")
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    assert smol.convert_ids_to_tokens(im_start) == "<|im_start|>"
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == im_start and ids[-1] == im_end
    raw = smol.encode("<|im_start|>user", add_special_tokens=False, split_special_tokens=True)
    assert im_start not in raw
    assert smol.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smol.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert im_end in smol.eos_token_ids
    assert smol.eos_token_id in smol.eos_token_ids


def test_smol_chat_template(smol):
    assert smol.has_chat_template and "<|im_start|>" in smol.chat_template
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    s = apply_chat_template(smol, msgs)
    assert s == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not apply_chat_template(smol, msgs, add_generation_prompt=False).endswith("assistant\n")
    default_system = apply_chat_template(smol, msgs[1:])
    assert default_system.startswith("<|im_start|>system\n") and default_system.endswith(
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smol.encode(s, add_special_tokens=False)
    assert ids.count(smol.convert_tokens_to_ids("<|im_start|>")) == 3


def test_chat_template_errors(smol):
    with pytest.raises(MlxspecError, match="boom"):
        apply_chat_template(smol, [], chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(MlxspecError):  # the sandbox refuses attribute escapes
        apply_chat_template(smol, [], chat_template="{{ ''.__class__.__mro__ }}")
    s = apply_chat_template(
        smol,
        [{"role": "user", "content": "é"}],
        chat_template="{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "{% generation %}x{% endgeneration %}",
    )
    assert s == '{"role": "user", "content": "é"}x'


def test_hf_tokenizer_json(smol, tmp_path):
    """A tokenizer.json made the way HF ships SmolLM2's (Digits + ByteLevel) tokenizes like the GGUF."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    p, _ = test_gguf_path()
    md = _metadata(p)
    vocab = {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    types = md["tokenizer.ggml.token_type"]
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(md["tokenizer.ggml.tokens"], types) if ty == 3]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": md["tokenizer.chat_template"],
    }))
    tok = load_hf_tokenizer(tmp_path)
    texts = ["The capital of France is", "  x = 12345;\n\tif (a) { b(); }  ", "héllo 日本 🦙!", ""]
    p2, _ = vocab_path("starcoder")  # same pre-tokenizer family; a varied corpus
    if p2 is not None:
        texts += [t for t, _ in read_golden(p2)]
    for t in texts:
        assert tok.encode(t, add_special_tokens=False) == smol.encode(t, add_special_tokens=False), t
    msgs = [{"role": "user", "content": "Hi"}]
    assert apply_chat_template(tok, msgs) == apply_chat_template(smol, msgs)
    ids = tok.encode("<|im_start|>user\nhé<|im_end|>", add_special_tokens=False)
    assert ids == smol.encode("<|im_start|>user\nhé<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids) == "<|im_start|>user\nhé<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhé"
    assert tok.eos_token_id == smol.convert_tokens_to_ids("<|im_end|>") and tok.eos_token_id in tok.eos_token_ids
    raw = tok.encode("<|im_start|>", add_special_tokens=False, split_special_tokens=True)
    assert smol.convert_tokens_to_ids("<|im_start|>") not in raw


def test_hf_missing(tmp_path):
    with pytest.raises(MlxspecError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# Synthetic vocabularies (no downloads)
# ---------------------------------------------------------------------------------------------

def _tiny_gpt2(as_numpy: bool, pre="gpt-2", **extra):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = [bytes_to_unicode()[b] for b in range(256)]
    merged = ["Ġt", "he", "Ġthe", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = chars + merged + specials
    types = [1] * (256 + len(merged)) + [3] * len(specials)
    merges = ["Ġ t", "h e", "Ġt he", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": np.array(tokens) if as_numpy else tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32) if as_numpy else types,
        "tokenizer.ggml.merges": np.array(merges) if as_numpy else merges,
        "tokenizer.ggml.eos_token_id": np.uint32(len(tokens) - 1) if as_numpy else len(tokens) - 1,
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    }
    md.update(extra)
    return md


def test_synthetic_lists_and_numpy_agree():
    a = load_gguf_tokenizer(_tiny_gpt2(False))
    b = load_gguf_tokenizer(_tiny_gpt2(True))
    text = "hello the world<|im_end|>"
    assert a.encode(text) == b.encode(text)
    ids = a.encode(" the world")
    assert a.convert_ids_to_tokens(ids) == ["Ġthe", "Ġworld"]
    assert a.decode(a.encode(text)) == text
    assert a.eos_token_ids == {a.convert_tokens_to_ids("<|im_end|>"), a.convert_tokens_to_ids("<|endoftext|>")}
    assert a.bos_token_id == a.convert_tokens_to_ids("<|endoftext|>")
    assert a.encode("x")[:1] != [a.bos_token_id]  # gpt-2 does not add BOS by default
    c = load_gguf_tokenizer(_tiny_gpt2(False, **{"tokenizer.ggml.add_bos_token": True}))
    assert c.encode("x")[0] == c.bos_token_id
    assert c.encode("x", add_special_tokens=False)[0] != c.bos_token_id


def test_synthetic_eot_token():
    md = _tiny_gpt2(False)
    md["tokenizer.ggml.eot_token_id"] = 65  # any id: it must be listed
    assert 65 in load_gguf_tokenizer(md).eos_token_ids


def test_unknown_pre_tokenizer_refused():
    with pytest.raises(MlxspecError, match="no-such-pre") as e:
        load_gguf_tokenizer(_tiny_gpt2(False, pre="no-such-pre"))
    assert "supported" in str(e.value) and "qwen2" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "something-else"])
def test_unsupported_models_refused(model):
    md = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(MlxspecError, match=model):
        load_gguf_tokenizer(md)


def test_missing_tokenizer_refused():
    with pytest.raises(MlxspecError, match="tokenizer.ggml.model"):
        load_gguf_tokenizer({"general.architecture": "llama"})


def test_stream_splits_multibyte_bytes():
    tok = load_gguf_tokenizer(_tiny_gpt2(False))
    text = "é🦙 x"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte in this tiny vocab
    det = tok.detokenizer
    segs = []
    for i in ids:
        det.add_token(i)
        segs.append(det.last_segment)
    assert segs[:2] == ["", "é"] and segs[2:5] == ["", "", ""] and segs[5] == "🦙"
    det.finalize()
    assert det.text == text
    det2 = tok.detokenizer
    det2.add_token(ids[0])
    det2.finalize()  # a dangling partial character becomes U+FFFD at the end
    assert det2.text == "\ufffd"


def test_read_gguf_errors(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 20)
    with pytest.raises(MlxspecError, match="not a GGUF"):
        read_gguf(p)
    with pytest.raises(MlxspecError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")
