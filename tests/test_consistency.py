"""One behaviour across the API, the CLI and mlx-lm, and the helpers they share: BOS on string
prompts, tau after merging runs, the trainer's target head on a quantized target, and the
drafter's context K/V grown in steps (same drafts as one concatenation)."""

from __future__ import annotations

import io
import os

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest import write_tiny_model

from mlxspec import api
from mlxspec.evaluate import run_prompts
from mlxspec.targets.load import load_target
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.targets.model import target_head_rows
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.verify import SamplingParams

SHIPPED_DSPARK = os.path.join(os.path.dirname(__file__), "..", "mlxspec", "weights", "smollm2-135m-dspark")


# ----------------------------------------------------------------------------- BOS, as mlx-lm

@pytest.fixture(scope="module")
def spm_tok(golden_models):
    """llama.cpp's llama-spm vocabulary: a tokenizer that adds BOS."""
    from mlxspec.gguf.file import read_gguf
    from mlxspec.tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(read_gguf(golden_models / "ggml-vocab-llama-spm.gguf").metadata)
    assert tok.add_bos_token and tok.bos_token == "<s>"
    return tok


def _prompt_and_tokens(target, tok, prompt):
    out = list(api.stream_generate(target, tok, prompt, max_tokens=4))
    return out[0].prompt_tokens, [r.token for r in out]


def test_string_prompt_gets_bos_like_mlx_lm(smollm2, spm_tok):
    """mlx-lm's stream_generate: add special tokens unless the text already starts with BOS.
    (SmolLM2's 49152 rows cover the 32000 llama-spm ids, so its forward runs on them.)"""
    target, _ = smollm2
    text = "Hello world, this is a test"
    with_bos = spm_tok.encode(text)
    assert with_bos[0] == spm_tok.bos_token_id and with_bos[1:] == spm_tok.encode(text, add_special_tokens=False)
    n, toks = _prompt_and_tokens(target, spm_tok, text)
    assert n == len(with_bos)
    assert toks == _prompt_and_tokens(target, spm_tok, with_bos)[1]  # the same ids as the CLI passes
    # a prompt that already starts with BOS gets no second one
    n2, toks2 = _prompt_and_tokens(target, spm_tok, "<s>" + text)
    assert n2 == len(with_bos) and toks2 == toks
    assert api.encode_prompt(spm_tok, "<s>" + text) == with_bos


def test_string_prompt_without_bos_vocab_is_unchanged(smollm2):
    target, tok = smollm2  # SmolLM2: add_bos false
    assert api.encode_prompt(tok, "The capital of France is") == tok.encode("The capital of France is",
                                                                           add_special_tokens=False)


# ----------------------------------------------------------------------------- tau after merging

def test_tau_after_merging_runs(tiny_gguf):
    target, tok = load_target(str(tiny_gguf))
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("the the", "t he", "the")]
    merged, outs = run_prompts(target, tok, None, prompts, max_tokens=5)
    singles = []
    for i, ids in enumerate(prompts):
        st = SpecStats()
        for _ in generate_steps(target, ids, drafter=None, max_tokens=5, sampling=SamplingParams(), seed=i, eos_ids=tok.eos_token_ids, stats=st):
            pass
        singles.append(st)
    assert [s.tau for s in singles] == [1.0, 1.0, 1.0]  # autoregressive: one token per forward
    assert merged.tau == 1.0
    assert merged.tau == sum(s.generated - 1 for s in singles) / sum(s.target_forwards for s in singles)
    assert merged.generated - 1 == sum(s.generated - 1 for s in singles)


# ----------------------------------------------------------------------------- the trainer's head

def test_trainer_target_head_dequantizes_a_quantized_target(tmp_path):

    path = tmp_path / "q4.gguf"
    _, written = write_tiny_model(path, "Q4_0")
    target, _ = load_target(str(path), dense=False)  # as on Metal / CUDA: weights stay quantized
    assert hasattr(target.model.model.embed_tokens, "scales")
    tid, raw, shape = written["token_embd.weight"]  # tied head
    want = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType(tid)).reshape(shape)
    head = target_head_rows(target, None)
    assert head.dtype == mx.float32
    np.testing.assert_array_equal(np.array(head), want.astype(np.float32))
    np.testing.assert_array_equal(np.array(target_head_rows(target, mx.array([3, 1]))), want[[3, 1]])


# ----------------------------------------------------------------------------- context K/V growth

@pytest.fixture(scope="module")
def dspark(smollm2):
    target, _ = smollm2
    spec = api.Speculator.build(api.SpecConfig(draft=SHIPPED_DSPARK, ngram=False), target, log=io.StringIO())
    return target, spec


def test_context_grows_in_steps_and_drafts_as_one_concatenation(dspark):
    target, spec = dspark
    a, b = spec.make_drafter(target), spec.make_drafter(target)
    H, T = target.info.hidden_size, len(a.taps)
    rng = np.random.default_rng(0)
    n = 700
    taps = mx.array(rng.standard_normal((1, n, T * H)).astype(np.float32))
    a.begin(list(range(n)), taps)
    b.begin(list(range(5)), taps[:, :5])
    assert b.ctx_len == 5 and b._ctx_buf[0] is None  # projected at the next draft, not per step
    b.ctx_kv  # reading the context projects the pending rows
    assert b._ctx_buf[0][0].shape[2] == BlockDrafter.CTX_STEP
    p, step = 5, BlockDrafter.CTX_STEP
    for size in (3, 250, 1, 9, 300, 132):  # crosses the capacity several times
        cap = b._ctx_buf[0][0].shape[2]
        b.accept(list(range(size)), taps[:, p:p + size])
        b.ctx_kv
        new_cap = b._ctx_buf[0][0].shape[2]
        # as mlx-lm's KVCache: unchanged while it fits, else the kept rows + whole steps
        assert new_cap == (cap if p + size <= cap else p + (size + step - 1) // step * step)
        p += size
    assert p == n == a.ctx_len == b.ctx_len
    # float32 rounding only: OpenBLAS sums a 5-row and a 700-row GEMM in different orders
    # (seen: 1.1e-5 on a value of 20.9, about 6 ulp), hence a relative term as well
    for (ka, va), (kb, vb) in zip(a.ctx_kv, b.ctx_kv):
        assert ka.shape == kb.shape == (1, ka.shape[1], n, ka.shape[3])
        np.testing.assert_allclose(np.array(kb), np.array(ka), rtol=2e-6, atol=1e-5)
        np.testing.assert_allclose(np.array(vb), np.array(va), rtol=2e-6, atol=1e-5)
    sp = SamplingParams()
    assert a.draft(7, 8, sp, rng).tokens == b.draft(7, 8, sp, rng).tokens
    # rewinding then accepting overwrites the dropped rows
    b.trim_context(100)
    b.accept(list(range(100)), taps[:, n - 100:])
    for (ka, _), (kb, _) in zip(a.ctx_kv, b.ctx_kv):
        np.testing.assert_allclose(np.array(kb), np.array(ka), rtol=2e-6, atol=1e-5)
    assert a.draft(11, 8, sp, rng).tokens == b.draft(11, 8, sp, rng).tokens
