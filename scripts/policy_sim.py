#!/usr/bin/env python
"""The adaptive policy against a simulated chain drafter: each draft accepted with a fixed
probability (independent), verify costs from a measured profile, a fixed draft cost. No model
runs, so the figures repeat exactly. Prints x AR (expected tokens per second over one-token
steps) per acceptance rate and per `probe_z` (0: the back-off before 2026-12-05), averaged over
seeds, with the requests of one seed chained through one PolicyMemory as a server's are.

    python scripts/policy_sim.py --profile docs/bench/verify-profile-smollm2-2026-12-05.json \\
        --draft-steps 0.1 --json docs/bench/policy-sim-probe-z.json
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from mlxspec.engine.policy import Kind, PolicyMemory, VerifyPolicy


def simulate(sps: dict[int, float], p_acc: float, z: float, draft_s: float, requests: int, tokens: int,
             seed: int) -> float:
    """x AR over `requests` requests of `tokens` tokens each."""
    rng = np.random.default_rng(seed)
    mem = PolicyMemory()
    produced = cost = 0.0
    for _ in range(requests):
        pol = mem.policy("t", lambda: VerifyPolicy.from_profile(sps, 7, chain=True, probe_z=z))
        done = 0
        while done < tokens:
            plan = pol.plan(7)
            drafter = plan.source.kind is Kind.DRAFTER
            n = pol.truncate(plan.source, plan.n, None, False) if drafter and plan.n else 0
            a = 0
            while a < n and rng.random() < p_acc:
                a += 1
            t_draft = draft_s * max(plan.n, 1) if drafter else None
            pol.observe(plan.source, n, a, None, t_draft, 1.0 / sps[n + 1])
            done += a + 1
            produced += a + 1
            cost += 1.0 / sps[n + 1] + (t_draft or 0.0)
    return produced / cost / sps[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="docs/bench/verify-profile-smollm2-2026-12-05.json")
    ap.add_argument("--draft-steps", type=float, default=0.1, help="a draft's cost in one-token steps")
    ap.add_argument("--rates", default="0,0.1,0.2,0.25,0.3,0.35,0.5")
    ap.add_argument("--z", default="0,0.5,1,1.5,2")
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sps = {int(k): float(v) for k, v in json.load(open(a.profile)).items()}
    draft_s = a.draft_steps / sps[1]
    rates = [float(x) for x in a.rates.split(",")]
    out = {"command": "python scripts/policy_sim.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None), "rows": []}
    print("x AR   " + " ".join(f"p={r:<6g}" for r in rates) + "   (always one draft: "
          + " ".join(f"{(1 + r) / (a.draft_steps + sps[1] / sps[2]):.3f}" for r in rates) + ")")
    for z in [float(x) for x in a.z.split(",")]:
        xs = [float(np.mean([simulate(sps, r, z, draft_s, a.requests, a.tokens, s) for s in range(a.seeds)]))
              for r in rates]
        out["rows"].append({"probe_z": z, "x_ar": dict(zip(map(str, rates), xs))})
        print(f"z={z:<4g} " + " ".join(f"{x:<8.3f}" for x in xs), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
