"""`mlxspec bench`'s flags and the run's settings, checked before any timing."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from mlxspec.api import shipped_drafter
from mlxspec.drafters.registry import candidates, model_name
from mlxspec.errors import MlxspecError
from mlxspec.prompts import load_prompts
from mlxspec.validate import check_free_space, check_output_dir, parse_float_list

FULL = dict(prompts_per_category=4, max_tokens=96, repeats=2, temps="0,1")
QUICK = dict(prompts_per_category=1, max_tokens=32, repeats=1, temps="0")
AR = "mlxspec AR"
MLX_LM = "mlx_lm AR"


def add_bench_args(p):
    p.add_argument("--model", "-m", default=None, metavar="PATH", help="target: .gguf file or MLX/HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", action="append", default=None, metavar="PATH",
                   help="DFlash/DSpark drafter (directory or .gguf); repeatable. Default: the drafters mlxspec "
                        "ships for the target (smollm2-135m-dspark and -dflash for the default model); "
                        "'none' = no drafter")
    p.add_argument("--draft-simple", default=None, metavar="PATH",
                   help="also run draft-simple with this draft model (MLX/HF directory or .gguf, same tokenizer)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="N", help="draft-simple: tokens per draft (default 4)")
    p.add_argument("--categories", default="code,prose,chat", metavar="LIST", help="prompt categories (default code,prose,chat)")
    p.add_argument("--prompts-per-category", type=int, default=None, metavar="N",
                   help=f"prompts per category (default {FULL['prompts_per_category']}; --quick {QUICK['prompts_per_category']})")
    p.add_argument("--max-tokens", "-n", type=int, default=None, metavar="N",
                   help=f"tokens to generate per prompt (default {FULL['max_tokens']}; --quick {QUICK['max_tokens']})")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help=f"timed repeats of each prompt (default {FULL['repeats']}; --quick {QUICK['repeats']})")
    p.add_argument("--temps", default=None, metavar="LIST", help=f"temperatures, comma-separated (default {FULL['temps']}; --quick {QUICK['temps']})")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (prompt k uses seed + k)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--mlx-dir", default=None, metavar="DIR",
                   help="where the MLX copy of the target for mlx_lm goes (default: the mlxspec cache)")
    p.add_argument("--out", "-o", default=None, metavar="DIR", help="write bench.json (and PNG plots) here")
    p.add_argument("--policies", default="fixed,adaptive", metavar="LIST",
                   help="verify policies to run each drafter with (default fixed,adaptive)")
    p.add_argument("--trees", default="", metavar="LIST",
                   help="tree settings to add rows for, comma-separated (auto and/or node counts): each drafter row, "
                        "its lookup row and lookup alone get a tree row beside their chain row (default none)")
    p.add_argument("--suffix", action="store_true",
                   help="beside each prompt-lookup row, its suffix-drafting twin (--lookup suffix; the shared index "
                        "is emptied before every run, so that no run drafts from another's answer)")
    p.add_argument("--no-ngram", action="store_true",
                   help="skip the prompt-lookup rows (ngram alone; the first drafter + ngram)")
    p.add_argument("--no-random", action="store_true",
                   help="skip the random-weight copy of the first drafter (adaptive policy)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="keep N cores busy with spinning processes for the whole run (a shared machine; "
                        "default 0), started and stopped by the bench")
    p.add_argument("--quick", action="store_true",
                   help="about a minute: 1 prompt per category, 32 tokens, 1 repeat, temperature 0")


def settings(a) -> dict:
    """The run's settings from the parsed flags; MlxspecError for bad values."""
    base = QUICK if a.quick else FULL
    s = {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in base.items()}
    s["temps"] = parse_float_list("--temps", s["temps"], "0,1")
    if min(s["temps"]) < 0:
        raise MlxspecError(f"--temps {a.temps!r}: give one or more temperatures >= 0, e.g. 0,1")
    if s["max_tokens"] < 2:
        raise MlxspecError(f"--max-tokens {s['max_tokens']}: tokens/s needs at least 2 tokens")
    if s["repeats"] < 1:
        raise MlxspecError(f"--repeats {s['repeats']}: use 1 or more")
    if a.background_load < 0 or a.background_load > (os.cpu_count() or 1):
        raise MlxspecError(f"--background-load {a.background_load}: use 0..{os.cpu_count() or 1} (cores to keep busy)")
    s["background_load"] = a.background_load
    if a.num_draft_tokens < 1:
        raise MlxspecError(f"--num-draft-tokens {a.num_draft_tokens}: use 1 or more")
    sets = load_prompts()
    cats = [c.strip() for c in a.categories.split(",") if c.strip()]
    for c in cats:
        if c not in sets:
            raise MlxspecError(f"--categories: unknown category {c!r}; use some of {', '.join(sets)}")
    if not cats:
        raise MlxspecError("--categories is empty; use some of " + ", ".join(sets))
    n = s["prompts_per_category"]
    if n < 1:
        raise MlxspecError(f"--prompts-per-category {n}: use 1 or more")
    for c in cats:
        if len(sets[c]) < n:
            raise MlxspecError(f"--prompts-per-category {n}: the {c} set has only {len(sets[c])} prompts")
    s["categories"] = cats
    s["seed"] = a.seed
    s["texts"] = {c: sets[c][:n] for c in cats}
    if a.draft is None and a.model is None:
        drafts = [str(p) for p in (shipped_drafter("eagle3"), shipped_drafter("dspark"), shipped_drafter("dflash")) if p]
    elif a.draft is None:  # the drafters mlxspec ships for this target (registry.json)
        drafts = [e["path"] for e in candidates(a.model) if e["drafter"].startswith("shipped:")]
        if not drafts:
            raise MlxspecError(f"--model {a.model}: mlxspec ships no drafter for {model_name(a.model)}; "
                               "pass --draft PATH (or --draft none: the autoregressive and prompt-lookup rows, "
                               "what generate runs for it by default)")
    else:
        drafts = [d for d in a.draft if d.lower() != "none"]
    for d in drafts + ([a.draft_simple] if a.draft_simple else []):
        if not Path(d).exists():
            flag = "--draft-simple" if d == a.draft_simple else "--draft"
            raise MlxspecError(f"{flag} {d}: no such file or directory; pass a drafter directory or .gguf file")
    s["drafts"] = drafts
    s["policies"] = [x.strip() for x in a.policies.split(",") if x.strip()]
    for x in s["policies"]:
        if x not in ("fixed", "adaptive"):
            raise MlxspecError(f"--policies: unknown verify policy {x!r}; use fixed and/or adaptive")
    s["trees"] = [x.strip() for x in (getattr(a, "trees", "") or "").split(",") if x.strip()]
    from mlxspec.engine.tree_step import TreeSettings

    for x in s["trees"]:
        if not TreeSettings.parse(x).on:
            raise MlxspecError(f"--trees {a.trees!r}: list auto and/or node counts (chain rows are always there)")
    s["ngram"] = not a.no_ngram
    s["suffix"] = bool(getattr(a, "suffix", False))
    if s["suffix"] and not s["ngram"]:
        raise MlxspecError("--suffix adds a twin to each prompt-lookup row: drop --no-ngram")
    s["random"] = not a.no_random
    if a.out is not None:
        check_output_dir("--out", a.out)  # before minutes of benchmarking
        check_free_space("--out", a.out, 1 << 20)  # bench.json and the plots
    return s


def command_line(a) -> str:
    if getattr(a, "command", None):
        return a.command
    if Path(sys.argv[0]).name in ("mlxspec", "cli.py", "__main__.py") and sys.argv[1:2] == ["bench"]:
        return shlex.join(["mlxspec", *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])
