"""Acceptance-floor regression tests for the shipped SmolLM2 drafters (temperature 0).

Why these exist (llama.cpp PR #122): a drafter read with the wrong block layout drafts
every token one row late; nothing errors, the output stays correct, and only acceptance
shows it (51% -> 0.27%). Tests that assert "drafting happens" pass through that. These
assert acceptance itself.

Floors: on HELD-OUT prompts (the first 4 code and 2 prose prompts of mlxspec/data/prompts.json,
cut from files of the held-out split the drafters never trained on), 32 tokens each, full
blocks. Measured with exactly these runs (2026-12-03, the shipped files; at 48 tokens,
the length before 2026-12-03, the rates were within 0.2 points of these):
  dspark 4.4% (43/986) tau 1.30;  dflash 4.3% (42/988) tau 1.29.
The floor (3.0%) sits at about 0.7x the measured rate and 1.6x the collapse below.

The collapse itself is shown on 6 corpus prefixes from the TRAINING split
(tests/data/acceptance_prompts.json), where the gap is widest: dflash 8.1% (66/812) read
right, 1.9% (19/1027) with the wrong layout (48 tokens: 8.1% and 1.9%). Ceiling 3.0%: half
the floor of a correct read there (6%), 1.6x the measured collapse. The greedy runs are
deterministic, so the margins are not sampling noise.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mlxspec.api import SpecConfig, Speculator, shipped_drafter
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.evaluate import run_prompts
from mlxspec.prompts import encode_prompt, load_prompts

MAX_TOKENS = 32
FLOOR = {"dspark": 0.030, "dflash": 0.030}  # held-out prompts
TRAIN_FLOOR = 0.06  # training-split prompts, for the collapse comparison
COLLAPSE_CEILING = 0.030  # the wrong layout must fall below this (training-split prompts)
TRAIN_PROMPTS = Path(__file__).parent / "data" / "acceptance_prompts.json"


@pytest.fixture(scope="module")
def prompts(smollm2):
    """Held-out: 4 code and 2 prose prompts."""
    _, tok = smollm2
    p = load_prompts()
    return [encode_prompt(tok, "code", t) for t in p["code"][:4]] + [encode_prompt(tok, "prose", t) for t in p["prose"][:2]]


@pytest.fixture(scope="module")
def train_prompts():
    return json.loads(TRAIN_PROMPTS.read_text())["prompts"]


@pytest.fixture(scope="module")
def autoregressive(smollm2, prompts):
    target, tok = smollm2
    _, outs = run_prompts(target, tok, None, prompts, MAX_TOKENS)
    return outs


def _path(kind):
    p = shipped_drafter(kind)
    assert p is not None, f"the shipped {kind} drafter is missing from mlxspec/weights/"
    return str(p)


def _run(smollm2, prompts, factory):
    target, tok = smollm2
    return run_prompts(target, tok, factory, prompts, MAX_TOKENS)


def _rate(st):
    return f"acceptance {st.acceptance_rate:.1%} ({st.accepted}/{st.drafted} drafts accepted)"


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_acceptance_floor_and_lossless(smollm2, prompts, autoregressive, kind):
    target, _ = smollm2
    spec = Speculator.build(SpecConfig(draft=_path(kind), ngram=False), target, log=io.StringIO())
    st, outs = _run(smollm2, prompts, spec.drafter_factory)
    assert st.acceptance_rate >= FLOOR[kind], (
        f"{kind} drafter {_rate(st)} is below the floor {FLOOR[kind]:.0%}: drafting works but the "
        "target rejects it; check the block layout, taps and mask"
    )
    # greedy speculative decoding is lossless: token for token the target's own output
    for i, (a, b) in enumerate(zip(outs, autoregressive)):
        assert a == b, f"prompt {i}: speculative output differs from autoregressive at token " \
                       f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_wrong_layout_collapses_acceptance(smollm2, train_prompts):
    """PR #122's failure, documented: the anchor-first drafter read with the bonus-anchor
    rule drafts one row late. Output stays correct; acceptance collapses.

    Shown on the DFlash drafter (anchor-first, as DeepSpec's DFlash baselines). On the
    DSpark drafter the wrong layout does NOT collapse (measured on the 120k-token DSpark, 9.3% vs 8.5%):
    its base logits beyond row 0 are weak, so its acceptance comes mostly from the Markov
    head conditioning on the previous token, which the row shift does not disturb."""
    target, _ = smollm2
    from mlxspec.drafters.load import load_drafter

    model, cfg = load_drafter(_path("dflash"), target.info, log=io.StringIO())
    assert cfg.sample_from_anchor is True
    right, want = _run(smollm2, train_prompts, lambda t: BlockDrafter(model, t))
    assert right.acceptance_rate >= TRAIN_FLOOR, f"read right: {_rate(right)}"
    st, outs = _run(smollm2, train_prompts, lambda t: BlockDrafter(model, t, force_sample_from_anchor=False))
    assert st.acceptance_rate < COLLAPSE_CEILING, f"wrong layout should collapse acceptance, got {_rate(st)}"
    assert outs == want  # nothing errors, output still lossless: only speed shows it


@pytest.mark.parametrize("kind,requested", [("dspark", "draft-dflash"), ("dflash", "draft-dspark")])
def test_wrong_spec_type_is_corrected(smollm2, prompts, kind, requested):
    """Requesting the other lineage: warned (naming both), then the file's lineage and
    layout are used, so acceptance stays at its normal level: the drafter drafts exactly what
    the one read without a spec type does (whose acceptance `test_acceptance_floor_and_lossless`
    holds to the floor), shown on the first held-out prompt (every draft, accept and token the
    same; the six prompts cost a minute more for the same comparison)."""
    target, _ = smollm2
    log = io.StringIO()
    spec = Speculator.build(SpecConfig(draft=_path(kind), spec_type=requested, ngram=False), target, log=log)
    text = log.getvalue()
    assert requested in text and kind in text and "warning" in text.lower(), text
    assert f"lineage={kind} sample_from_anchor=true" in text, text
    plain = Speculator.build(SpecConfig(draft=_path(kind), ngram=False), target, log=io.StringIO())
    st, outs = _run(smollm2, prompts[:1], spec.drafter_factory)
    want, want_outs = _run(smollm2, prompts[:1], plain.drafter_factory)
    assert st.drafted > 0 and (st.accepted, st.drafted) == (want.accepted, want.drafted), (
        f"with --spec-type {requested} requested: {_rate(st)}, read as the file says: {_rate(want)}")
    assert st.per_position_acceptance == want.per_position_acceptance and outs == want_outs


# ----------------------------------------------------------------------------- EAGLE-3
# The shipped EAGLE-3 drafter, fixed policy, chains of 7, no lookup, the same 6 held-out prompts x 32
# tokens (the file shipped 2026-12-03, the 3-hour recipe): 9.7% (69/709 drafts) tau 1.59. Its file read
# with SpecForge's tap convention (every tap one layer deeper: 2, 15, 27 instead of 1, 14, 26): 7.8%
# (60/772) tau 1.48. (At 48 tokens: 10.2% and 8.1%.)
EAGLE3_FLOOR = 0.07  # about 0.7x the measured rate


def _eagle3(smollm2, path, prompts):
    target, _ = smollm2
    spec = Speculator.build(SpecConfig(draft=str(path), ngram=False, policy="fixed"), target, log=io.StringIO())
    return _run(smollm2, prompts, spec.drafter_factory)


@pytest.fixture(scope="module")
def eagle3_right(smollm2, prompts):
    """The shipped EAGLE-3 file read as it says (both tests below compare against it)."""
    return _eagle3(smollm2, _path("eagle3"), prompts)


def test_eagle3_acceptance_floor_and_lossless(eagle3_right, autoregressive):
    st, outs = eagle3_right
    assert st.acceptance_rate >= EAGLE3_FLOOR, (
        f"eagle3 drafter {_rate(st)} is below the floor {EAGLE3_FLOOR:.1%}: drafting works but the target "
        "rejects it; check the taps (their convention), the d2t map and the chain's pairing")
    assert outs == autoregressive


def test_eagle3_read_with_the_wrong_tap_convention(smollm2, prompts, autoregressive, eagle3_right, tmp_path):
    """The shipped speculators file rewritten as SpecForge's layout with the SAME numbers (what an
    engine that assumes SpecForge's convention reads) taps every layer one deeper. It loads, drafts
    at full speed, stays lossless, and accepts less; it does NOT collapse for this drafter (measured
    9.7% -> 7.8%): SmolLM2's residual stream changes little from one layer to the next, so the
    features one layer late are nearly the ones it was trained on. A drafter whose taps differ in
    what they carry collapses: tests/test_eagle3.py builds one (32/32 first drafts accepted read
    right, 1/32 one layer late), the failure the tap conventions are read for."""
    import shutil

    from mlxspec.drafters.load import load_drafter

    src = _path("eagle3")
    cfg = json.loads((Path(src) / "config.json").read_text())
    wrong = tmp_path / "as-specforge"
    wrong.mkdir()
    shutil.copy(Path(src) / "model.safetensors", wrong / "model.safetensors")
    flat = {**cfg["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
            "norm_before_residual": cfg["norm_before_residual"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"]}}
    (wrong / "config.json").write_text(json.dumps(flat))
    target, _ = smollm2
    right_taps = load_drafter(src, target.info, log=io.StringIO())[1].target_layer_ids
    wrong_taps = load_drafter(str(wrong), target.info, log=io.StringIO())[1].target_layer_ids
    assert [w - r for w, r in zip(wrong_taps, right_taps)] == [1, 1, 1]
    right, _ = eagle3_right
    st, outs = _eagle3(smollm2, wrong, prompts)
    assert right.acceptance_rate >= EAGLE3_FLOOR, f"read right: {_rate(right)}"
    assert st.accepted < right.accepted and st.acceptance_rate < right.acceptance_rate, (
        f"one layer deeper: {_rate(st)}, read right: {_rate(right)}")
    assert outs == autoregressive  # nothing errors, output still lossless: only speed shows it
