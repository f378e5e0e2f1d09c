#!/usr/bin/env python
"""Two configurations of one `mlxspec bench` run against each other, per temperature and category,
with a 95% interval from a paired bootstrap over the prompts (`mlxspec.bench.summary.paired_interval`):
both ran the same prompts, interleaved per prompt and repeat, so the ratio is resampled prompt by
prompt and says whether the run can tell the two apart.

    python scripts/bench_compare.py docs/bench/trees-code-avx512-2026-12-05/bench.json \\
        --a "eagle3+ngram smollm2-135m-eagle3 [adaptive] tree=auto" --b "eagle3+ngram smollm2-135m-eagle3 [adaptive]" \\
        --goal 1.10

--a / --b: a configuration's label, or a part of it that names one configuration only (where
it is part of several, the one label that ends with it).
--goal G: each line also says whether the interval is above G (met), below it (not met), or
straddles it (this run cannot tell).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from mlxspec.bench.summary import paired_interval, prompt_medians


def fail(msg: str) -> None:
    print(f"bench_compare: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def pick(labels: list[str], want: str, flag: str) -> str:
    if want in labels:
        return want
    hits = [x for x in labels if want in x]
    if len(hits) > 1:  # "... [adaptive]" is also part of "... [adaptive] tree=auto": the one it ends
        hits = [x for x in hits if x.endswith(want)] or hits
    if len(hits) != 1:
        fail(f"{flag} {want!r} names {len(hits)} configurations of this run; give one of: "
             + "; ".join(repr(x) for x in labels))
    return hits[0]


def compare(results: list, a: str, b: str, goal: float | None = None) -> list[dict]:
    rows = {(r["configuration"], r["temp"], r["category"]): r for r in results}
    out = []
    for (label, temp, cat), ra in rows.items():
        if label != a or (b, temp, cat) not in rows:
            continue
        rb = rows[(b, temp, cat)]
        ma = [x for x in prompt_medians(ra["tokens_per_s_per_prompt"]) if x is not None]
        mb = [x for x in prompt_medians(rb["tokens_per_s_per_prompt"]) if x is not None]
        if not ma or not mb:
            continue
        ratio = statistics.mean(ma) / statistics.mean(mb)
        ci = paired_interval(ra["tokens_per_s_per_prompt"], rb["tokens_per_s_per_prompt"])
        verdict = None
        if goal is not None:
            verdict = ("cannot tell (one prompt)" if ci is None else "met" if ci[0] >= goal
                       else "not met" if ci[1] < goal else "cannot tell")
        out.append({"temp": temp, "category": cat, "prompts": len(ma), "ratio": ratio, "interval": ci,
                    "tau_a": ra.get("tau"), "tau_b": rb.get("tau"), "goal": goal, "verdict": verdict})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", help="a bench.json written by mlxspec bench --out")
    ap.add_argument("--a", required=True, help="the configuration measured (label or a unique part of it)")
    ap.add_argument("--b", required=True, help="the configuration it is measured against")
    ap.add_argument("--goal", type=float, default=None, help="a ratio to judge each line against")
    ap.add_argument("--json", default=None, help="also write the lines here")
    args = ap.parse_args(argv)
    path = Path(args.bench_json)
    try:
        data = json.loads(path.read_text())
        results = data["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{path}: not a bench.json of mlxspec bench ({type(e).__name__}: {e}); pass the bench.json in a --out folder")
    if args.goal is not None and not (math.isfinite(args.goal) and args.goal > 0):
        fail(f"--goal {args.goal}: give a finite ratio above 0, e.g. 1.10")
    labels = list(dict.fromkeys(r["configuration"] for r in results))
    a, b = pick(labels, args.a, "--a"), pick(labels, args.b, "--b")
    if a == b:
        fail(f"--a and --b both name {a!r}; give two configurations")
    lines = compare(results, a, b, args.goal)
    print(f"{a}\n  over {b}\n  ({data.get('meta', {}).get('command', path)})")
    for x in lines:
        ci = x["interval"]
        iv = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[one prompt: no interval]"
        print(f"T={x['temp']:g} {x['category']:6s} {x['prompts']} prompts: {x['ratio']:.3f} {iv}"
              + (f"  goal {x['goal']:g}: {x['verdict']}" if x["verdict"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"a": a, "b": b, "source": str(path), "lines": lines}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
