#!/usr/bin/env python
"""Is a drafter's chat acceptance held back by which questions it trained on? Held-out tau and
row-1 agreement of EAGLE-3 drafters on three sets of chat questions none of them trained on:

- heldout: the 8 held-out chat prompts (`mlxspec/data/prompts.json`, what the bench asks);
- corpus: unseen questions of the kind the regen stores ask (`train.regen.chat_questions`),
  beyond what stores of seeds 0..--corpus-seeds-1 with --windows windows each took;
- self: questions the target asks itself (`train.asked`, seed 99: not a store's seed).

    LD_PRELOAD=$(python -m mlxspec.blas) MLXSPEC_BLAS_THREADS=1 python scripts/chat_domain_gap.py \\
        mlxspec/weights/smollm2-135m-eagle3 runs/ft-self/hf --json docs/bench/chat-domain-gap.json

Answers are the target's greedy ones (float32 taps, `--max-tokens`), replayed as
`mlxspec train --heldout-every` replays them (`train.heldout.heldout_tau`).
"""

import argparse
import io
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs="+")
    ap.add_argument("--n", type=int, default=16, help="questions per set (heldout has 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--windows", type=int, default=1024, help="windows per training store (its questions are skipped)")
    ap.add_argument("--corpus-seeds", type=int, default=2)
    ap.add_argument("--cache", default="runs/chat-domain-gap", help="where the answer stores are kept")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import numpy as np

    from mlxspec.api import load
    from mlxspec.drafters.load import load_drafter
    from mlxspec.prompts import encode_prompt, load_prompts
    from mlxspec.train.asked import sample_questions
    from mlxspec.train.eagle3 import frozen_for_eagle3, heldout_lengths
    from mlxspec.train.heldout import heldout_tau
    from mlxspec.train.regen import chat_pool_size, chat_questions, generate_windows

    target, tok, _ = load(None, None)
    taps = None
    models = []
    for d in a.drafters:
        m, cfg = load_drafter(d, target.info, log=io.StringIO())
        taps = taps or list(cfg.target_layer_ids)
        assert list(cfg.target_layer_ids) == taps, f"{d}: other taps"
        models.append((d, m))

    n_chat = chat_pool_size(a.windows)  # the chat questions a store of the default kinds answers
    used = {q for s in range(a.corpus_seeds) for _, q in chat_questions(s)[:n_chat]}
    unseen = [q for _, q in chat_questions(0) if q not in used]
    rng = np.random.default_rng(0)
    sets = {"heldout": load_prompts()["chat"],
            "corpus": [unseen[i] for i in rng.permutation(len(unseen))[: a.n]],
            "self": sample_questions(target, tok, a.n, seed=99)}
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    for name, qs in sets.items():  # one store per set: <cache>/<name>/chat.npz, as build_heldout writes it
        f = cache / name / "chat.npz"
        kept = cache / name / "questions.json"  # written after chat.npz: both there = a finished store
        if f.exists() and kept.exists() and json.loads(kept.read_text()) == qs:
            continue
        f.parent.mkdir(exist_ok=True)
        ids = [encode_prompt(tok, "chat", q) for q in qs]
        P = max(len(i) for i in ids)
        rows = generate_windows(target, ids, taps, P + a.max_tokens + 1, 0.0, tok.eos_token_ids, 0, exact_taps=True)
        np.savez(f, **{k: np.stack([r[k] for r in rows]) for k in ("tokens", "taps", "start", "end")},
                 max_tokens=a.max_tokens, temp=0.0, seed=0)
        kept.write_text(json.dumps(qs, indent=0))
    out = {"command": "scripts/chat_domain_gap.py " + " ".join(a.drafters), "sets": sets, "results": {}}
    for d, m in models:
        fr = frozen_for_eagle3(target, m)
        steps = 7
        res = {}
        for name in sets:
            r = heldout_tau(m, fr, cache / name, ("chat",), lengths=heldout_lengths(m, fr, steps), n_drafts=steps)["chat"]
            res[name] = {"tau": r["tau"], "tau_se": r["tau_se"], "row1": r["per_position_acceptance"][0],
                         "acceptance": r["acceptance_rate"], "prompts": r["prompts"]}
            print(f"{d}  {name:8s} row1 {res[name]['row1']:.3f}  tau {r['tau']:.3f} ± {r['tau_se']:.3f}  "
                  f"({r['prompts']} questions)", flush=True)
        out["results"][d] = res
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
