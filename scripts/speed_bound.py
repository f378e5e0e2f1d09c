#!/usr/bin/env python
"""How fast a chain drafter can make greedy decoding on this machine, from what it measurably
does: its held-out acceptance (P(the first k drafts are all accepted), k = 1..7, from a trainer
report) and the costs a bench run measured (the target's verify forward per row count, and the
drafter's cost per draft). No policy runs, so this bounds every policy:

- best fixed length: max over L of tau(L) t(1) / (t_verify(L + 1) + t_draft(L)), what a policy
  gets that knows the acceptance curve but not which step will go well;
- per-step oracle: each step drafts exactly the drafts that will be accepted (none: a plain
  autoregressive step), (1 + E[A]) t(1) / E[t_verify(A + 1) + t_draft(A)]: no policy beats it;
- the geometric acceptance (P(first k right) = a^k) at which the best fixed length reaches
  `--goal`: how good the drafter must be for that goal on this machine.

    python scripts/speed_bound.py --report mlxspec/weights/smollm2-135m-eagle3/report.json \\
        --bench docs/bench/default-avx512-fused-2026-12-05/bench.json --draft-ms 0.66,2.69,4.75,5.5,6.12,7.8,9.49 \\
        --goal 1.5 --json docs/bench/speed-bound-eagle3.json

--draft-ms: the chain's drafting time for 1, 2, ... drafts (ms; one value: per draft);
`--measure` times the shipped EAGLE-3 drafter here instead (a held-out code prompt, medians of 15).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def tau(surv: list[float], n: int) -> float:
    return 1.0 + sum(surv[:n])


def best_fixed(surv: list[float], tv: list[float], td: list[float]) -> tuple[int, float]:
    """(L, x AR) of the best fixed chain length; tv[L - 1]: a verify over L rows; td[L - 1]: L drafts."""
    best = (0, 1.0)
    for n in range(1, min(len(surv), len(tv) - 1, len(td)) + 1):
        x = tau(surv, n) * tv[0] / (tv[n] + td[n - 1])
        if x > best[1]:
            best = (n, x)
    return best


def oracle(surv: list[float], tv: list[float], td: list[float]) -> float:
    """x AR of the per-step oracle: A = k with probability surv[k-1] - surv[k] (A = 0: 1 - surv[0])."""
    n = min(len(surv), len(tv) - 1, len(td))
    s = [1.0] + list(surv[:n]) + [0.0]
    tokens = cost = 0.0
    for a in range(n + 1):
        pa = s[a] - s[a + 1]
        tokens += pa * (1 + a)
        cost += pa * (tv[a] + (td[a - 1] if a else 0.0))
    return tokens * tv[0] / cost


def needed(tv: list[float], td: list[float], goal: float, n: int) -> float | None:
    """The smallest geometric acceptance a (P(first k right) = a^k) whose best fixed length
    reaches `goal` x AR; None if even a = 1 does not."""
    lo, hi = 0.0, 1.0
    if best_fixed([hi ** k for k in range(1, n + 1)], tv, td)[1] < goal:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        if best_fixed([mid ** k for k in range(1, n + 1)], tv, td)[1] >= goal:
            hi = mid
        else:
            lo = mid
    return hi


def measure_draft_ms(n: int) -> list[float]:
    import mlx.core as mx
    import numpy as np

    from mlxspec import api
    from mlxspec.engine.verify import SamplingParams
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, _ = api.load(None, "none")
    spec = api.Speculator.build(api.SpecConfig(draft=str(Path(__file__).resolve().parent.parent
                                                         / "mlxspec/weights/smollm2-135m-eagle3"), ngram=False), target)
    d = spec.make_drafter(target)
    ids = encode_prompt(tok, "code", load_prompts()["code"][0])
    _, taps = target(mx.array([ids]), target.make_cache(), taps=tuple(d.taps), logits="last")
    d.begin(ids, taps)
    rng, out = np.random.default_rng(0), []
    for k in range(1, n + 1):
        ts = []
        for _ in range(15):
            t = time.perf_counter()
            d.draft(int(ids[-1]), k, SamplingParams(), rng)
            ts.append(time.perf_counter() - t)
        out.append(float(np.median(ts)) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="a trainer report.json (its last held-out evaluation)")
    ap.add_argument("--bench", required=True, help="a bench.json whose verify_cost gives the target's costs")
    ap.add_argument("--draft-ms", default=None, help="drafting ms for 1, 2, .. drafts, comma-separated (one value: per draft)")
    ap.add_argument("--measure", action="store_true", help="time the shipped EAGLE-3 drafter here")
    ap.add_argument("--goal", type=float, default=1.5, help="x AR whose required acceptance is reported")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    for f in (a.report, a.bench):
        if not Path(f).is_file():
            ap.error(f"{f}: no such file")
    if (a.draft_ms is None) == (not a.measure):
        ap.error("give --draft-ms or --measure (one of them)")
    hist = json.loads(Path(a.report).read_text()).get("history") or []
    held = next((h["heldout"] for h in reversed(hist) if h.get("heldout")), None)
    if not held:
        ap.error(f"{a.report}: no held-out evaluation in its history")
    cost = json.loads(Path(a.bench).read_text()).get("verify_cost")
    if not cost:
        ap.error(f"{a.bench}: no verify_cost")
    fm = cost["forward_ms"]
    tv = [float(fm[str(k)]) for k in range(1, len(fm) + 1)]
    n = max(len(v["per_position"]) for v in held.values())
    if a.measure:
        td = measure_draft_ms(n)
    else:
        try:
            td = [float(x) for x in a.draft_ms.split(",")]
        except ValueError:
            ap.error(f"--draft-ms {a.draft_ms!r}: comma-separated milliseconds")
        if len(td) == 1:
            td = [td[0] * k for k in range(1, n + 1)]
        if len(td) < n or min(td) < 0:
            ap.error(f"--draft-ms: give {n} non-negative values (or one per-draft value)")
    out = {"report": a.report, "bench": a.bench, "verify_ms": tv, "draft_ms": td, "goal": a.goal,
           "needed_geometric_acceptance": needed(tv, td, a.goal, n), "categories": {},
           "command": " ".join(sys.argv)}
    print(f"{'category':8s} {'row 1':>6s} {'tau(7)':>7s} {'best fixed L':>13s} {'x AR':>6s} {'oracle x AR':>12s}")
    for cat, h in held.items():
        surv = [float(x) for x in h["per_position"]]
        L, x = best_fixed(surv, tv, td)
        o = oracle(surv, tv, td)
        out["categories"][cat] = {"per_position": surv, "tau_chain": tau(surv, len(surv)), "best_fixed_length": L,
                                  "best_fixed_x_ar": x, "oracle_x_ar": o}
        print(f"{cat:8s} {surv[0]:6.3f} {tau(surv, len(surv)):7.3f} {L:13d} {x:6.3f} {o:12.3f}")
    nd = out["needed_geometric_acceptance"]
    print(f"geometric acceptance a (P(first k right) = a^k) for {a.goal}x at the best fixed length: "
          + (f"{nd:.3f}" if nd is not None else "unreachable"))
    from mlxspec.bench.report import write_json

    write_json(a.json, out)


if __name__ == "__main__":
    main()
