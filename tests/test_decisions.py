"""The server and the CLI make the same decisions for the same request.

`mlxspec serve` wraps every request's drafter in `ContextDrafter` (the prompt cache's prefix
taps) and runs it through `engine.batch.SpecBatch` (or, with --max-batch 1, through the same
`generate_steps` as `mlxspec generate`). What the verify-length policy is offered each step
(prompt lookup, the drafter, or both) must not depend on that wrapping: under `--spec-type
ngram` (what `--draft auto` gives a target with no known drafter) a type check on the drafter
used to see a model drafter inside the wrapper, and the policy weighed a phantom second source
that was the same lookup again.

Real SmolLM2-135M target, the speculators both commands build from the same flags. The
adaptive policy's decisions also depend on measured costs; `Untimed` leaves those out so that
each run's decisions are a function of the tokens alone and can be compared step for step.
"""

from __future__ import annotations

import pytest

from mlxspec import api, cli
from mlxspec.args import spec_config
from mlxspec.engine.batch import SpecBatch
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.policy import Kind, VerifyPolicy
from mlxspec.server.prompt_cache import ContextDrafter

PROMPT = "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2, 3]\nd = [1, 2"  # prompt lookup matches from the first step
MAX = 24


class Untimed(VerifyPolicy):
    """The adaptive policy without the measured verify / draft costs (the profile's costs only)."""

    def observe(self, source, verified, accepted, confidence=None, draft_seconds=None, verify_seconds=None, **kw):
        super().observe(source, verified, accepted, confidence)

    def observe_verify(self, length, seconds):
        pass


def _configs(flags):
    """The SpecConfig `mlxspec generate` and `mlxspec serve` build from the same flags."""
    ap = cli.build_parser()
    gen = spec_config(ap.parse_args(["generate", *flags, "--prompt", PROMPT]))
    srv = spec_config(ap.parse_args(["serve", *flags]))
    assert gen == srv
    return gen


def _run(target, ids, drafter, policy, batched: bool):
    """(tokens, verify lengths, accepted by source, the sources the policy was offered)."""
    st = SpecStats()
    if batched:
        b = SpecBatch(target, taps=tuple(drafter.taps))
        row, out = b.add(ids, drafter=drafter, max_tokens=MAX, policy=policy)
        while not row.done:
            for _, committed in b.step():
                out = out + committed
        st = row.stats
    else:
        out = [t for s in generate_steps(target, ids, drafter=drafter, max_tokens=MAX, stats=st, policy=policy) for t in s]
    offered = sorted({s.kind.value for s in (*policy.est, *policy.waited)})
    return out, st.verify_lengths, st.by_source, offered


@pytest.mark.parametrize("flags, offered", [
    (["--spec-type", "ngram"], ["lookup"]),  # model-free: the lookup is the only source
    (["--draft", str(api.shipped_drafter())], ["drafter", "lookup"]),  # DSpark + prompt lookup (the default)
])
def test_server_and_cli_make_the_same_decisions(smollm2, smollm2_path, flags, offered):
    target, tok = smollm2
    cfg = _configs(["--model", str(smollm2_path), *flags])
    spec = api.Speculator.build(cfg, target, model=str(smollm2_path))
    ids = tok.encode(PROMPT, add_special_tokens=False)
    runs = {}
    for name, wrap, batched in (("generate", False, False), ("serve --max-batch 1", True, False),
                                ("serve", True, True)):
        d = spec.make_drafter(target)
        policy = Untimed.from_profile(api.profile_for(target, d), d.max_drafts)
        runs[name] = _run(target, ids, ContextDrafter(d, [], None) if wrap else d, policy, batched)
    cli_run = runs["generate"]
    assert cli_run[3] == offered
    assert cli_run[0] == [t for s in generate_steps(target, ids, max_tokens=MAX) for t in s]  # lossless
    for name, r in runs.items():
        assert r == cli_run, name
    assert sum(a for _, a in cli_run[2].values()) > 0  # it speculated


def test_context_drafter_declares_what_it_wraps(smollm2):
    """The declarations the loop reads pass through the server's wrapper unchanged."""
    from mlxspec.engine.drafting import NoDrafter, proposals

    target, _ = smollm2
    for cfg in (api.SpecConfig(spec_type="ngram"), api.SpecConfig(draft=str(api.shipped_drafter()), ngram=True),
                api.SpecConfig(draft=str(api.shipped_drafter()), ngram=False)):
        d = api.Speculator.build(cfg, target).make_drafter(target)
        assert proposals(ContextDrafter(d, [], None)) == proposals(d)
    assert proposals(api.Speculator.build(api.SpecConfig(spec_type="ngram"), target).make_drafter(target)) == (False, True)
    assert proposals(NoDrafter()) == (False, False)
    assert Kind.LOOKUP.value == "lookup"
