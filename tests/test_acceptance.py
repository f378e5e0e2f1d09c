"""Acceptance-floor regression tests for the shipped SmolLM2 drafters (temperature 0).

Why these exist (llama.cpp PR #122): a drafter read with the wrong block layout drafts
every token one row late; nothing errors, the output stays correct, and only acceptance
shows it (51% -> 0.27%). Tests that assert "drafting happens" pass through that. These
assert acceptance itself: each floor sits well under the drafter's measured rate on
these prompts (see mlxspec/drafters/README.md) and well over a collapse.
"""

from __future__ import annotations

import io

import pytest

from mlxspec.api import load_speculator, shipped_drafter
from mlxspec.evaluate import run_prompts
from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.spec.drafters import BlockDrafter

MAX_TOKENS = 48
# Measured on these 6 prompts (4 code, 2 prose held-out), greedy, 48 tokens:
# see mlxspec/drafters/README.md. Floors: well under the measurement, well over a collapse.
FLOOR = {"dspark": 0.25, "dflash": 0.20}
COLLAPSE_CEILING = 0.08  # the wrong layout must fall below this


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tok = smollm2
    p = load_prompts()
    return [encode_prompt(tok, "code", t) for t in p["code"][:4]] + [
        encode_prompt(tok, "prose", t) for t in p["prose"][:2]
    ]


@pytest.fixture(scope="module")
def autoregressive(smollm2, prompts):
    target, tok = smollm2
    _, outs = run_prompts(target, tok, None, prompts, MAX_TOKENS)
    return outs


def _path(kind):
    p = shipped_drafter(kind)
    assert p is not None, f"the shipped {kind} drafter is missing from mlxspec/drafters/"
    return str(p)


def _run(smollm2, prompts, factory):
    target, tok = smollm2
    return run_prompts(target, tok, factory, prompts, MAX_TOKENS)


def _rate(st):
    return f"acceptance {st.acceptance_rate:.1%} ({st.accepted}/{st.drafted} drafts accepted)"


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_acceptance_floor_and_lossless(smollm2, prompts, autoregressive, kind):
    target, _ = smollm2
    spec = load_speculator(_path(kind), target, log=io.StringIO())
    st, outs = _run(smollm2, prompts, spec.drafter_factory)
    assert st.acceptance_rate >= FLOOR[kind], (
        f"{kind} drafter {_rate(st)} is below the floor {FLOOR[kind]:.0%}: drafting works but the "
        "target rejects it; check the block layout, taps and mask"
    )
    # greedy speculative decoding is lossless: token for token the target's own output
    for i, (a, b) in enumerate(zip(outs, autoregressive)):
        assert a == b, f"prompt {i}: speculative output differs from autoregressive at token " \
                       f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_wrong_layout_collapses_acceptance(smollm2, prompts, autoregressive):
    """PR #122's failure, documented: the anchor-first DSpark drafter read with the
    bonus-anchor rule drafts one row late. Output stays correct; acceptance collapses."""
    target, _ = smollm2
    from mlxspec.loading.drafter import load_drafter

    model, cfg = load_drafter(_path("dspark"), target.info, log=io.StringIO())
    assert cfg.sample_from_anchor is True
    st, outs = _run(smollm2, prompts, lambda t: BlockDrafter(model, t, force_sample_from_anchor=False))
    assert st.acceptance_rate < COLLAPSE_CEILING, f"wrong layout should collapse acceptance, got {_rate(st)}"
    assert outs == autoregressive  # nothing errors, output still lossless: only speed shows it


def test_wrong_spec_type_is_corrected(smollm2, prompts):
    """Requesting draft-dflash for the DSpark file: warned, then the file's lineage and
    layout are used, so acceptance stays at its normal level."""
    target, _ = smollm2
    log = io.StringIO()
    spec = load_speculator(_path("dspark"), target, spec_type="draft-dflash", log=log)
    text = log.getvalue()
    assert "draft-dflash" in text and "dspark" in text and "warning" in text.lower(), text
    assert "lineage=dspark sample_from_anchor=true" in text, text
    st, _ = _run(smollm2, prompts, spec.drafter_factory)
    assert st.acceptance_rate >= FLOOR["dspark"], f"with the wrong --spec-type requested: {_rate(st)}"
