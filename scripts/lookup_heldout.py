#!/usr/bin/env python
"""Prompt lookup against suffix drafting on the held-out prompts, through the engine (greedy,
adaptive policy): tau, tokens/s and what each source drafted and had accepted, per category.

    LD_PRELOAD=$(python -m mlxspec.blas) MLXSPEC_BLAS_THREADS=1 python scripts/lookup_heldout.py \\
        --configs default,default+suffix --fixed-costs --json docs/bench/lookup-heldout.json

Each configuration is one `Speculator` over all prompts (as an app holds one: suffix drafting's
shared index fills across them). Under the adaptive policy tau depends on the costs it measures,
and on this host they drift run to run (the same code gave default code tau 2.06 and 2.17 in two
runs); `--fixed-costs` makes the policy see the profiled verify costs and a fixed drafting cost
per drafter forward (`--draft-ms`) instead of the clock, so tau is a pure function of the code
and the profile, and two versions compare exactly. The profile is the machine's (measured once
and cached; its shape moves with the host: a later session measured a decode step of 87 ms and
a 17-row verify at 2.68 steps); `--profile FILE` reads a committed one instead
(docs/bench/verify-profile-smollm2-2026-12-04.json), so runs compare across sessions too.
tokens/s is measured either way.

With `--fixed-costs` each row also has a **modeled x AR**: the tokens generated over what the
steps would cost on the profile's machine, every verify priced at the profile's time for its
row count and every drafter forward and head at `--fwd-ms` / `--head-ms` (counted as they run:
the committed pairs' forwards and a tree's included), against one profile step per token. It
repeats exactly, so two policies compare without the clock's noise (the timed bench confirms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time

from pathlib import Path

DSPARK = str(Path(__file__).resolve().parent.parent / "mlxspec/weights/smollm2-135m-dspark")
CONFIGS = {"default": dict(), "default+suffix": dict(lookup="suffix"),
           "default+suffix-local": dict(lookup="suffix", suffix_budget=0),
           "dspark": dict(draft=DSPARK), "dspark+suffix": dict(draft=DSPARK, lookup="suffix"),
           "dspark+suffix-local": dict(draft=DSPARK, lookup="suffix", suffix_budget=0),
           "lookup": dict(spec_type="ngram"), "suffix": dict(spec_type="ngram", lookup="suffix"),
           "eagle3": dict(ngram=False), "ar": dict(draft="none"),
           "default+tree": dict(tree="auto"), "eagle3+tree": dict(ngram=False, tree="auto"), "dspark-alone": dict(draft=DSPARK, ngram=False)}
CATEGORIES = ("code", "prose", "chat")
# the modeled price of one EAGLE-3 drafter forward and one head (ms), measured on the AVX-512 host
# (2026-12-05, docs/policy.md); the policy's own draft cost is --draft-ms
FWD_MS, HEAD_MS = 1.1, 0.45


def read_profile(path: str) -> dict[int, float]:
    """A verify profile file ({length: steps/second}, as the cache keeps it) -> {int: float},
    or one line and exit 2."""
    try:
        sps = {int(k): float(v) for k, v in json.loads(Path(path).read_text()).items()}
    except (OSError, ValueError, AttributeError) as e:
        raise SystemExit(f"lookup_heldout: --profile {path}: not a verify profile ({e}); "
                         "give a JSON of length -> steps/second, e.g. docs/bench/verify-profile-smollm2-2026-12-04.json")
    if sorted(sps) != list(range(1, len(sps) + 1)) or len(sps) < 2 or not all(0 < v < math.inf for v in sps.values()):
        raise SystemExit(f"lookup_heldout: --profile {path}: lengths must run 1..n with positive, finite steps/second")
    return sps


@contextlib.contextmanager
def fixed_costs(draft_ms: float | None, profile: dict[int, float] | None = None):
    """While open (draft_ms not None), the policy sees the profile's verify costs and draft_ms
    per drafter forward (a chain drafter's per drafted token, a block drafter's per block), not
    the clock; `profile` (steps/second per verify length) in place of the machine's cached one."""
    from mlxspec import api
    from mlxspec.engine.policy import Kind, Source, VerifyPolicy

    observe, profile_for = VerifyPolicy.observe, api.profile_for

    def given(target, drafter):
        n = drafter.max_drafts + 1
        if n > len(profile):
            raise SystemExit(f"lookup_heldout: --profile has lengths 1..{len(profile)}, the drafter verifies up to {n}")
        return {L: profile[L] for L in range(1, n + 1)}

    def fixed(self, source, verified, accepted, confidence=None, draft_seconds=None, verify_seconds=None, *,
              drafted=None):
        ds = None
        if draft_seconds is not None and Source.of(source).kind is Kind.DRAFTER:
            forwards = max(self.last_drafted if drafted is None else drafted, 1) if self.chain else 1
            ds = draft_ms / 1e3 * forwards
        return observe(self, source, verified, accepted, confidence, ds, None, drafted=drafted)

    if draft_ms is not None:
        VerifyPolicy.observe = fixed
        if profile is not None:
            api.profile_for = given
    try:
        yield
    finally:
        VerifyPolicy.observe, api.profile_for = observe, profile_for


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="default,default+suffix", help="comma-separated, from: " + ", ".join(CONFIGS))
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per category (at most 16 code, 16 prose, 8 chat)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated, from: " + ", ".join(CATEGORIES))
    ap.add_argument("--fixed-costs", action="store_true", help="the policy sees fixed costs, not the clock (module docstring)")
    ap.add_argument("--draft-ms", type=float, default=8.0,
                    help="--fixed-costs: drafting cost per drafter forward (ms; EAGLE-3: per drafted token, a block drafter: per block)")
    ap.add_argument("--profile", default=None,
                    help="--fixed-costs: a verify profile file (length -> steps/second) in place of the machine's")
    ap.add_argument("--fwd-ms", type=float, default=FWD_MS,
                    help="--fixed-costs: modeled cost of one drafter forward (ms; EAGLE-3 on the AVX-512 host: 1.0-1.3)")
    ap.add_argument("--head-ms", type=float, default=HEAD_MS,
                    help="--fixed-costs: modeled cost of one drafter head over its draft vocabulary (ms)")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature (0: greedy; above it each prompt is drawn with seed = its index, the "
                         "same in every configuration, so outputs differ between them and are not compared)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.profile and not a.fixed_costs:
        ap.error("--profile needs --fixed-costs")
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    if not names or any(n not in CONFIGS for n in names):
        ap.error(f"--configs: name one or more of {', '.join(CONFIGS)}")
    a.categories = [c.strip() for c in a.categories.split(",") if c.strip()]
    if not a.categories or any(c not in CATEGORIES for c in a.categories):
        ap.error(f"--categories: name one or more of {', '.join(CATEGORIES)}")
    if not 1 <= a.prompts <= 16 or not 2 <= a.max_tokens <= 1024 or not 0 <= a.draft_ms < 1e4:
        ap.error("--prompts must be 1-16, --max-tokens 2-1024, --draft-ms 0-10000")
    if not (0 <= a.fwd_ms < 1e4 and 0 <= a.head_ms < 1e4):
        ap.error("--fwd-ms and --head-ms must be 0-10000")
    if not 0 <= a.temp <= 2:
        ap.error("--temp must be 0-2")

    import mlxspec  # noqa: F401  (OpenBLAS before MLX)
    from mlxspec import api

    target, tok, _ = api.load(draft="none")
    profile = read_profile(a.profile) if a.profile else None
    a.costs = None
    if a.fixed_costs:
        from mlxspec.engine.ngram import LOOKUP_MAX
        from mlxspec.engine.profile import verify_profile

        a.costs = model_costs(profile or verify_profile(target, LOOKUP_MAX + 1), a.fwd_ms, a.head_ms)
    with fixed_costs(a.draft_ms if a.fixed_costs else None, profile):
        rows, outs = run(api, target, tok, names, a)
    same = a.temp > 0 or all(len({json.dumps(o) for o in by.values()}) == 1 for by in outs.values())
    report = {"command": "scripts/lookup_heldout.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%d %H:%M"), "fixed_costs": a.fixed_costs, "draft_ms": a.draft_ms,
              "profile": a.profile, "fwd_ms": a.fwd_ms, "head_ms": a.head_ms,
              "temperature": a.temp, "prompts_per_category": a.prompts, "max_tokens": a.max_tokens, "configs": rows,
              "outputs_identical": same}
    text = json.dumps(report, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0 if same else 1


@contextlib.contextmanager
def counting():
    """Counts the EAGLE-3 drafter's layer forwards and heads while open -> the dict it fills (the
    plain forward's and the inference forward's, `mlxspec.drafters.eagle3_fast`)."""
    from mlxspec.drafters.eagle3 import Eagle3Model
    from mlxspec.drafters.eagle3_fast import FastForward
    from mlxspec.engine.eagle3 import Eagle3Drafter

    n = {"fwd": 0, "head": 0}
    patched = [(Eagle3Model, "__call__", "fwd"), (FastForward, "__call__", "fwd"),
               (Eagle3Drafter, "logits", "head"), (FastForward, "greedy", "head")]
    saved = [(cls, name, getattr(cls, name)) for cls, name, _ in patched]

    def counted(fn, key):
        def wrapper(self, *args, **kw):  # a forward of a deeper drafter counts once per layer
            n[key] += len(self.layers) if key == "fwd" else 1
            return fn(self, *args, **kw)
        return wrapper

    for (cls, name, key), (_, _, fn) in zip(patched, saved):
        setattr(cls, name, counted(fn, key))
    try:
        yield n
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def model_costs(sps: dict[int, float], fwd_ms: float = FWD_MS, head_ms: float = HEAD_MS) -> dict:
    """What `modeled` prices a run with: a profile (steps/second per verify length), the drafter's
    forward and head in ms."""
    return {"verify_s": {int(L): 1.0 / float(v) for L, v in sps.items()}, "fwd_s": fwd_ms / 1e3, "head_s": head_ms / 1e3}


def modeled(stats, n: dict, costs: dict) -> dict:
    """Modeled seconds of a run's steps (module docstring) and x AR on that model."""
    vs = costs["verify_s"]
    verify = sum(vs[min(L, max(vs))] for L in stats.verify_lengths)
    draft = n["fwd"] * costs["fwd_s"] + n["head"] * costs["head_s"]
    tokens = max(stats.generated - 1, 0)
    return {"modeled_x_ar": round(tokens * vs[1] / max(verify + draft, 1e-12), 4), "modeled_s": verify + draft,
            "modeled_draft_share": round(draft / max(verify + draft, 1e-12), 4),
            "drafter_forwards": n["fwd"], "drafter_heads": n["head"]}


def run(api, target, tok, names, a):
    """Every configuration over the held-out prompts -> (rows per config and category, outputs)."""
    from mlxspec.engine.loop import SpecStats
    from mlxspec.engine.verify import SamplingParams
    from mlxspec.prompts import encode_prompt, load_prompts

    prompts = load_prompts()
    rows, outs = {}, {}
    for name in names:
        spec = api.Speculator.build(api.SpecConfig(**CONFIGS[name]), target)
        for cat in a.categories:
            total, got = SpecStats(), []
            with counting() as n:
                for i, text in enumerate(prompts[cat][: a.prompts]):
                    st, out = SpecStats(), []
                    for step in spec.session(target, encode_prompt(tok, cat, text), max_tokens=a.max_tokens,
                                             eos_ids=api._eos_ids(tok), stats=st,
                                             sampling=SamplingParams(temperature=a.temp), seed=i):
                        out += step
                    total.merge(st)
                    got.append(out)
            outs.setdefault(cat, {})[name] = got
            row = rows.setdefault(name, {})[cat] = {"tau": round(total.tau, 3), "tok_s": round(total.generation_tps, 2),
                                                    "forwards": total.target_forwards, "generated": total.generated,
                                                    "by_source_drafted_accepted": total.by_source}
            if a.costs:
                row.update(modeled(total, n, a.costs))
            print(f"{name} {cat}: tau {total.tau:.3f}, {total.generation_tps:.1f} tok/s, {total.by_source}"
                  + (f", modeled {row['modeled_x_ar']:.3f}x AR" if a.costs else ""), file=sys.stderr, flush=True)
    return rows, outs


if __name__ == "__main__":
    sys.exit(main())
