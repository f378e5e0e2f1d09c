"""The model drafter's share of the accepted drafts under the default configuration (the shipped
drafter with prompt lookup beside it, adaptive policy), per category of the held-out prompts.

    python scripts/drafter_share.py [--prompts 2] [--max-tokens 64]

One `load()` speculator for every request, as an app would use it.
"""
import argparse
import io

from mlxspec.api import SpecConfig, Speculator, stream_generate
from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.targets.load import load_target

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=2)
ap.add_argument("--max-tokens", type=int, default=64)
a = ap.parse_args()
if not 1 <= a.prompts <= 16 or not 1 <= a.max_tokens <= 1024:
    ap.error(f"--prompts {a.prompts} --max-tokens {a.max_tokens}: prompts must be 1-16, max tokens 1-1024")
t, tok = load_target(None)
p = load_prompts()
spec = Speculator.build(SpecConfig(), t, log=io.StringIO())
for cat in ("code", "prose", "chat"):
    D = L = 0
    for x in p[cat][:a.prompts]:
        r = None
        for r in stream_generate(t, tok, encode_prompt(tok, cat, x), spec, max_tokens=a.max_tokens):
            pass
        bs = r.stats.by_source
        D += bs.get("drafter", [0, 0])[1]
        L += bs.get("lookup", [0, 0])[1]
    print(f"{cat}: accepted drafts from the drafter {D}, from lookup {L}, drafter share {D / max(D + L, 1):.2f}")
