#!/usr/bin/env python
"""How sharp an EAGLE-3 drafter's sampled proposals should be: the drafter's temperature as a
multiple of the request's (`engine.eagle3.DRAFT_SHARPEN`).

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/draft_temperature.py \
        --sharpen 0.5,0.7,0.85,1.0,1.2 --temps 1,0.7 --json docs/bench/draft-temperature.json
    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/draft_temperature.py --generate --sharpen 1.0,0.7 \
        --temps 1 --prompts 16 --seeds 2 --max-tokens 64 --num-draft-tokens 3 \
        --json docs/bench/draft-temperature-generate-fixed3.json

Default (offline): on the held-out store (the target's greedy continuations of the held-out
prompts, `mlxspec train --heldout-prompts 16 --heldout-tokens 128`; --sampled: continuations
sampled at the first --temps value, a store of their own), at every anchor of every
continuation, the chance that the first draft is accepted, sum_x min(p(x), q(x)), with p the
target's next-token distribution at temperature T and q the drafter's first draft at
sharpen x T (plain T, top-k / top-p off). Exact, no sampling.

--generate: the engine end to end on held-out prompts at temperature T, the drafter alone
(no lookup; the adaptive policy, or --num-draft-tokens N fixed), each prompt run --seeds times
per sharpen value in rotating order, with the same seeds: tau (accepted tokens per verify, exact for the draws made) and generation tok/s
(noisy on a shared host: compare within one run).
"""

import argparse
import io
import json
import math
import statistics
import sys
import time
from pathlib import Path


def floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(math.isfinite(x) and x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, comma-separated (e.g. 0.7,1.0)")
    return out


def offline(target, tok, path, a) -> dict:
    import mlx.core as mx
    import numpy as np

    from mlxspec.drafters.load import load_drafter
    from mlxspec.train.data import taps_from_store
    from mlxspec.train.eagle3 import frozen_for_eagle3, ttt_hidden
    from mlxspec.train.heldout import build_heldout, default_heldout_dir

    m, cfg = load_drafter(path, target.info, log=io.StringIO())
    m.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)  # as the engine runs it
    fz = frozen_for_eagle3(target, m)
    taps = cfg.target_layer_ids
    d = default_heldout_dir(target, taps, a.prompts, a.max_tokens)
    if a.sampled:  # the target's own sampled continuations at T, a store beside the greedy one
        d = Path(str(d) + f"-sampled-T{a.temps[0]:g}")
    store = build_heldout(target, tok, taps, d, n_per_category=a.prompts, max_tokens=a.max_tokens,
                          temp=a.temps[0] if a.sampled else 0.0)
    d_ids = mx.array(fz["d_ids"])
    res = {}
    for T in a.temps:
        res[str(T)] = {}
        for cat in ("code", "prose", "chat"):
            z = np.load(Path(store) / f"{cat}.npz")
            acc = {s: [] for s in a.sharpen}
            greedy = []
            for w in range(len(z["tokens"])):
                tokens, start, end = z["tokens"][w], int(z["start"][w]), int(z["end"][w])
                anchors = np.arange(start, min(end - 1, start + a.max_tokens))
                sel = mx.array(np.maximum(anchors - 1, 0).astype(np.int32))  # pair a-1 drafts from anchor a
                h = ttt_hidden(m, fz["embed"], taps_from_store(z["taps"][w])[None],
                               mx.array(tokens[None].astype(np.int32)), 1, sel)[0][:, sel]
                zq = (m.norm(h) @ fz["head"].T)[0]
                lg, _ = target(mx.array(tokens[: anchors[-1] + 1].astype(np.int32))[None], target.make_cache())
                pd = mx.softmax(lg[0][mx.array(anchors)].astype(mx.float32) / T, axis=-1)[:, d_ids]
                greedy.append(np.asarray(mx.take_along_axis(pd, mx.argmax(zq, axis=-1)[:, None], axis=-1)[:, 0]))
                for s in a.sharpen:
                    acc[s].append(np.asarray(mx.minimum(pd, mx.softmax(zq / (s * T), axis=-1)).sum(axis=-1)))
            row = {str(s): round(float(np.concatenate(v).mean()), 4) for s, v in acc.items()}
            row["argmax draft"] = round(float(np.concatenate(greedy).mean()), 4)
            res[str(T)][cat] = row
            print(f"T={T} {cat}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    return {"first_draft_acceptance": res, "anchors_per_prompt": a.max_tokens}


def generate(target, tok, path, a) -> dict:
    from mlxspec import api
    from mlxspec.engine.loop import SpecStats
    from mlxspec.engine.verify import SamplingParams
    from mlxspec.prompts import encode_prompt, load_prompts

    fixed = dict(policy="fixed", num_draft_tokens=a.num_draft_tokens) if a.num_draft_tokens else {}
    spec = api.Speculator.build(api.SpecConfig(draft=path, ngram=False, **fixed), target, log=io.StringIO())
    prompts = [encode_prompt(tok, "code", p) for p in load_prompts()["code"][: a.prompts]]
    eos = api._eos_ids(tok)
    res = {}
    for T in a.temps:
        sp = SamplingParams(temperature=T)
        runs = {s: [] for s in a.sharpen}
        for i, (ids, seed) in enumerate((ids, seed) for ids in prompts for seed in range(a.seeds)):
            order = a.sharpen[i % len(a.sharpen):] + a.sharpen[: i % len(a.sharpen)]
            for s in order:
                d = spec.make_drafter(target)
                getattr(d, "block", d).sharpen = s
                st = SpecStats()
                for _ in spec.session(target, ids, max_tokens=a.max_tokens, sampling=sp, seed=seed, eos_ids=eos,
                                      stats=st, drafter=d):
                    pass
                runs[s].append((st.generated - 1, st.target_forwards, st.generation_tps))
        res[str(T)] = {}
        for s, rs in runs.items():
            made, fw = sum(r[0] for r in rs), sum(r[1] for r in rs)
            row = res[str(T)][str(s)] = {"tau": round(made / max(fw, 1), 3),
                                         "tok_s_median": round(statistics.median(r[2] for r in rs), 2)}
            print(f"T={T} sharpen {s}: tau {row['tau']:.3f}, median {row['tok_s_median']} tok/s", flush=True)
    return {"code_prompts": a.prompts, "seeds": a.seeds, "max_tokens": a.max_tokens,
            "policy": f"fixed, {a.num_draft_tokens} drafts" if a.num_draft_tokens else "adaptive", "generate": res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="mlxspec/weights/smollm2-135m-eagle3", help="an EAGLE-3 drafter export")
    ap.add_argument("--sharpen", type=floats, default=floats("0.5,0.7,0.85,1.0,1.2"))
    ap.add_argument("--temps", type=floats, default=floats("1"))
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per category (offline: 1-16)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--generate", action="store_true", help="end to end on held-out code prompts (module docstring)")
    ap.add_argument("--sampled", action="store_true",
                    help="offline: on the target's continuations sampled at the first --temps value, not greedy ones")
    ap.add_argument("--seeds", type=int, default=1, help="--generate: runs per prompt and sharpen value")
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="--generate: the fixed policy at this length")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not 1 <= a.prompts <= 16 or not 1 <= a.max_tokens <= 1024:
        ap.error(f"--prompts {a.prompts} --max-tokens {a.max_tokens}: prompts must be 1-16, max tokens 1-1024")
    if a.seeds < 1 or (a.num_draft_tokens is not None and a.num_draft_tokens < 1):
        ap.error(f"--seeds {a.seeds} --num-draft-tokens {a.num_draft_tokens}: both must be at least 1")
    if not Path(a.draft).exists():
        ap.error(f"--draft {a.draft}: no drafter export there")

    from mlxspec.errors import MlxspecError
    from mlxspec.targets.load import load_target

    try:
        target, tok = load_target(None)
        out = (generate if a.generate else offline)(target, tok, a.draft, a)
    except MlxspecError as e:
        print(f"draft_temperature.py: {e}", file=sys.stderr)
        return 2
    out = {"command": "scripts/draft_temperature.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
           "draft": a.draft, "sharpen": a.sharpen, "temps": a.temps, **out}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
