"""Where the drafter and prompt lookup disagree, who is right (docs/policy.md, 2026-12-05):

    LD_PRELOAD="$(python -m mlxspec.blas)" python scripts/lookup_agreement.py --max-tokens 64 \
        --json docs/bench/lookup-agreement.json

On the target's own greedy continuations of the held-out prompts (16 code, 16 prose, 8 chat), at
every position, teacher-forced: the shipped EAGLE-3 drafter's first draft against prompt lookup's
first token (`engine.ngram.NgramIndex`, 2-4-grams), and how often each is the target's token."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not 2 <= a.max_tokens <= 1024:
        ap.error("--max-tokens must be 2-1024")
    import mlxspec  # noqa: F401  (OpenBLAS before MLX)
    from mlxspec import api

    import mlx.core as mx
    import numpy as np

    from mlxspec.engine.ngram import NgramIndex
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, spec = api.load(draft=str(api.shipped_drafter("eagle3")))
    e3 = spec.make_drafter(target).block
    prompts = load_prompts()
    res = {}
    for cat, k in (("code", 16), ("prose", 16), ("chat", 8)):
        n = dict(steps=0, lookup=0, agree=0, l_agree=0, l_dis=0, d_dis=0, d_none=0)
        for text in prompts[cat][:k]:
            ids = encode_prompt(tok, cat, text)
            cache = target.make_cache()
            lg, _ = target(mx.array([ids]), cache, logits="last")
            out = [int(mx.argmax(lg[0, -1]).item())]
            for _ in range(a.max_tokens - 1):
                lg, _ = target(mx.array([[out[-1]]]), cache, logits="last")
                out.append(int(mx.argmax(lg[0, -1]).item()))
            seq = ids + out
            _, taps = target(mx.array([seq]), target.make_cache(), taps=e3.taps, logits="last")
            e3.reset()
            h = e3._run_pairs(taps[:, : len(seq) - 1], seq[1:])  # row i predicts token i + 2
            pred = np.asarray(e3.to_target(mx.argmax(e3.logits(h)[0], axis=-1)))
            index = NgramIndex(2, 4)
            index.reset(ids)
            for j in range(len(out) - 1):  # anchor out[j] at position len(ids) + j
                d1, nxt = int(pred[len(ids) + j - 1]), out[j + 1]
                look, _ = index.propose(out[j], 1)
                n["steps"] += 1
                if look:
                    n["lookup"] += 1
                    if d1 == look[0]:
                        n["agree"] += 1
                        n["l_agree"] += look[0] == nxt
                    else:
                        n["l_dis"] += look[0] == nxt
                        n["d_dis"] += d1 == nxt
                else:
                    n["d_none"] += d1 == nxt
                index.extend([out[j]])
        dis, none = n["lookup"] - n["agree"], n["steps"] - n["lookup"]
        res[cat] = {"positions": n["steps"], "with_lookup": round(n["lookup"] / n["steps"], 3),
                    "agree_of_lookup": round(n["agree"] / max(n["lookup"], 1), 3),
                    "lookup_right_when_agree": round(n["l_agree"] / max(n["agree"], 1), 3),
                    "lookup_right_when_disagree": round(n["l_dis"] / max(dis, 1), 3),
                    "drafter_right_when_disagree": round(n["d_dis"] / max(dis, 1), 3),
                    "drafter_right_without_lookup": round(n["d_none"] / max(none, 1), 3)}
        print(cat, res[cat], file=sys.stderr, flush=True)
    text = json.dumps({"command": "scripts/lookup_agreement.py " + " ".join(sys.argv[1:] if argv is None else argv),
                       "max_tokens": a.max_tokens, "categories": res}, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
