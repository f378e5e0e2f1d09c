#!/usr/bin/env python
"""One switch of the EAGLE-3 drafter (a class attribute of `Eagle3Drafter`) on against off, end to
end, paired prompt by prompt and alternating in one process, with autoregressive decoding timed
in the same rounds. Greedy output must be identical across all three. Switches:
- `stops_early`: chains stopped by their confidences as they are drafted (never past the length
  the estimates plan, sooner where the drafts' calibrated confidences say the rest will not pay)
  against chains of the planned length;
- `fast_forward`: drafting with the inference forward (`mlxspec.drafters.eagle3_fast`) against
  the plain one.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/eagle3_ab.py --switch stops_early --prompts 4 \\
        --max-tokens 96 --repeats 2 --json docs/bench/stop-ab.json

Per category: x AR of each (median over prompts of the per-prompt median over repeats), tau,
verify rows per step, and the paired ratio on / off with a 95% bootstrap interval. Each
configuration is one `Speculator` (its policy memory carries across requests, as an app's).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", default="stops_early", choices=("stops_early", "fast_forward"))
    ap.add_argument("--draft", default=str(ROOT / "mlxspec/weights/smollm2-135m-eagle3"))
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts per category (1-8)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-ngram", action="store_true", help="the drafter alone (no prompt lookup beside it)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.prompts <= 8 or not 2 <= a.max_tokens <= 1024 or not 1 <= a.repeats <= 10:
        ap.error("--prompts 1-8, --max-tokens 2-1024, --repeats 1-10")
    if not Path(a.draft).exists():
        ap.error(f"--draft {a.draft}: no drafter there")

    from tqdm import tqdm

    from mlxspec import api
    from mlxspec.engine.eagle3 import Eagle3Drafter
    from mlxspec.engine.loop import SpecStats
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, _ = api.load(None, "none")
    eos = set(tok.eos_token_ids)
    texts = load_prompts()
    prompts = [(c, encode_prompt(tok, c, t)) for c in ("code", "prose", "chat") for t in texts[c][: a.prompts]]
    specs = {"AR": api.Speculator.build(api.SpecConfig(draft="none"), target),
             "on": api.Speculator.build(api.SpecConfig(draft=a.draft, ngram=not a.no_ngram), target),
             "off": api.Speculator.build(api.SpecConfig(draft=a.draft, ngram=not a.no_ngram), target)}
    res = {k: [[None] * a.repeats for _ in prompts] for k in specs}
    outs = {}
    bar = tqdm(total=a.repeats * len(prompts) * len(specs), unit="gen", desc=f"{a.switch} A/B")
    for r in range(a.repeats):
        for i, (cat, ids) in enumerate(prompts):
            order = list(specs) if (r + i) % 2 == 0 else list(reversed(specs))
            for name in order:
                setattr(Eagle3Drafter, a.switch, name != "off")
                st = SpecStats()
                t0 = time.perf_counter()
                toks = [x for s in specs[name].session(target, ids, max_tokens=a.max_tokens, eos_ids=eos, stats=st)
                        for x in s]
                dt = time.perf_counter() - t0
                outs.setdefault(i, {})[name] = toks
                res[name][i][r] = {"tok_s": (len(toks) - 1) / max(dt, 1e-9), "tokens": st.generated - 1,
                                   "forwards": st.target_forwards, "rows": sum(st.verify_lengths),
                                   "by_source": {k: list(v) for k, v in st.by_source.items()}}
                bar.update(1)
    bar.close()
    setattr(Eagle3Drafter, a.switch, True)
    same = all(len({tuple(v) for v in o.values()}) == 1 for o in outs.values())
    rng = np.random.default_rng(0)
    out = {"command": " ".join(sys.argv), "switch": a.switch, "identical_outputs": same, "categories": {}}
    for cat in ("code", "prose", "chat", "all"):
        idx = [i for i, (c, _) in enumerate(prompts) if cat in (c, "all")]
        row = {}
        speed = {}
        for name in specs:
            speed[name] = np.array([np.median([x["tok_s"] for x in res[name][i]]) for i in idx])
            toks = sum(x["tokens"] for i in idx for x in res[name][i])
            fw = sum(x["forwards"] for i in idx for x in res[name][i])
            rows = sum(x["rows"] for i in idx for x in res[name][i])
            src = {k: [sum(x["by_source"].get(k, [0, 0])[j] for i in idx for x in res[name][i]) for j in (0, 1)]
                   for k in ("drafter", "lookup")}
            row[name] = {"x_ar": float(np.median(speed[name] / speed["AR"])) if name != "AR" else 1.0,
                         "tau": toks / max(fw, 1), "rows_per_verify": rows / max(fw, 1),
                         "drafted_accepted": src}
        ratio = speed["on"] / speed["off"]
        boots = [float(np.exp(np.mean(np.log(rng.choice(ratio, len(ratio)))))) for _ in range(2000)]
        row["on_over_off"] = {"geomean": float(np.exp(np.mean(np.log(ratio)))),
                                    "interval": [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]}
        out["categories"][cat] = row
        s = row["on_over_off"]
        print(f"{cat:6s} " + "  ".join(f"{n} {row[n]['x_ar']:.2f}x (tau {row[n]['tau']:.2f}, rows {row[n]['rows_per_verify']:.1f}, "
                                       f"drafter {row[n]['drafted_accepted']['drafter']}, lookup {row[n]['drafted_accepted']['lookup']})"
                                       for n in ("on", "off"))
              + f"  on/off {s['geomean']:.3f} [{s['interval'][0]:.3f}, {s['interval'][1]:.3f}]")
    print(f"identical outputs: {same}")
    from mlxspec.bench.report import write_json

    write_json(a.json, out)


if __name__ == "__main__":
    main()
