"""Agent benchmark: a replayed multi-turn coding-agent conversation, turn by turn, x AR.

    MLXSPEC_BLAS_THREADS=1 .venv/bin/python scripts/agent_bench.py --turns 5 --max-tokens 64 \\
        --out docs/bench/agent_bench.json

The conversation is built from one held-out code file (`mlxspec.corpus`, split "heldout": no
drafter trained on it) by `make_trace`, deterministically from --seed, the way a coding agent
talks to a local server: the file with a question about one function; a test run's output
quoting the function back; the same file sent back with a small edit and the function to
rewrite; the function to rewrite again; then a new session (a sub-agent, or the same agent
restarted without its history) sending the third request again. Each turn's prompt is the
whole conversation so far, the model's own earlier answers included (greedy: every
configuration gets the same answers), except the new session's, which is that one message.

Every configuration is one `Speculator` for the whole conversation (as an app or a server
holds one), so suffix drafting's shared index holds the earlier turns' answers. Turns run
one configuration after another on the same prompt, the order rotating per turn, so load on
the machine falls on all alike. x AR = generation tok/s (prefill excluded) over AR's on the
same turn; `overall` is total generated tokens over total generation time, over AR's.

--replay: no timing; the AR answers replayed through each lookup (prompt lookup, suffix
drafting at alpha 1 and 4, and without its shared index) with every proposal verified, tau per turn: what the proposals are
worth before the adaptive policy decides how many to verify. It also writes each turn's copy
ceiling (`ceiling`): what any lookup that copies spans of earlier text could reach, told the
answer in advance: at each position it verifies exactly the longest span (up to the most
drafts) that continues the answer and occurs in the text it may copy from (the request's own
text for prompt lookup; the earlier answers too for suffix drafting), paying the profiled
verify cost of that many rows. The tokens no span covers run at `--fresh-x` (the default's
x AR on text it has not seen: turns 1-2).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import time
from pathlib import Path

import mlxspec  # noqa: F401  (OpenBLAS before MLX)
from mlxspec import api
from mlxspec.corpus import corpus_files, read_text
from mlxspec.engine.loop import SpecStats
from mlxspec.engine.ngram import NgramIndex
from mlxspec.engine.suffix import SuffixIndex, SuffixLookup
from mlxspec.tokenizer import apply_chat_template

CONFIGS = {  # name -> SpecConfig fields ("AR" is the plain loop)
    "AR": None,
    "lookup": dict(spec_type="ngram"),
    "suffix": dict(spec_type="ngram", lookup="suffix"),
    "default": dict(),
    "default+suffix": dict(lookup="suffix"),
    # trees (docs/trees.md): every distinct continuation of the match, most frequent first
    "suffix+tree": dict(spec_type="ngram", lookup="suffix", tree="auto"),
    "default+suffix+tree": dict(lookup="suffix", tree="auto"),
}


def pick_function(seed: int, min_lines: int = 8, max_lines: int = 24):
    """A held-out code file and one function in it -> (relative path, source lines, function node)."""
    files = [f for f in corpus_files(split="heldout") if f.category == "code"]
    random.Random(seed).shuffle(files)
    for f in files:
        text = read_text(f.path)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                 and min_lines <= n.end_lineno - n.lineno + 1 <= max_lines
                 and len((ast.get_docstring(n) or "").splitlines()) <= 2]  # code, not a docstring
        if funcs:
            return f.rel, text.splitlines(), funcs[random.Random(seed).randrange(len(funcs))]
    raise SystemExit("agent_bench: no held-out code file with a function of the right size")


def make_trace(seed: int = 0, context: int = 12) -> list[tuple[str, bool]]:
    """The user's side of the conversation, built from one held-out function: (message, whether
    it starts a new session without the history)."""
    rel, lines, fn = pick_function(seed)
    name = fn.name
    lo, hi = max(0, fn.lineno - 1 - context), min(len(lines), fn.end_lineno + context)
    excerpt = lines[lo:hi]
    body = lines[fn.lineno - 1 : fn.end_lineno]
    path = rel.split("/", 1)[1]
    code = "\n".join(excerpt)
    # a small edit: one line of the function gets a trailing comment, a blank line goes
    mid = fn.lineno - 1 - lo + len(body) // 2
    edited = list(excerpt)
    edited[mid] = edited[mid] + "  # checked"
    blank = next((i for i in range(fn.lineno - 1 - lo, len(edited)) if not edited[i].strip()), None)
    if blank is not None:
        del edited[blank]
    fail_line = body[len(body) // 2].strip()
    tool = "\n".join([
        "$ python -m pytest -x tests/test_" + path.replace("/", "_"),
        "============================= FAILURES =============================",
        f"___________________________ test_{name} ___________________________",
        "",
        *[f"    {l}" for l in body[: len(body) // 2 + 1]],
        f">   {fail_line}",
        "E   AssertionError",
        f"{path}:{fn.lineno + len(body) // 2}: AssertionError",
        "=========================== 1 failed in 0.12s ======================",
    ])
    rewrite = (f"I changed the file a little:\n\n```python\n{chr(10).join(edited)}\n```\n\nRewrite `{name}` so that it "
               "is clearer. Give the whole function.")
    return [
        (f"Here is part of `{path}`:\n\n```python\n{code}\n```\n\nWhat does `{name}` do? Quote the lines you explain.", False),
        (f"I ran the tests. Output:\n\n```\n{tool}\n```\n\nWhich line of `{name}` fails, and why?", False),
        (rewrite, False),
        (f"Rewrite `{name}` once more, with type hints and a docstring. Give the whole function.", False),
        (rewrite, True),
    ]


def build(name: str, target, draft: str | None = None):
    """The configuration's `Speculator`; draft: the drafter of the configurations that have one
    (default: --draft auto's, the shipped one)."""
    fields = CONFIGS[name]
    if fields is None:
        return api.Speculator()
    if draft and fields.get("spec_type") != "ngram":
        fields = {**fields, "draft": draft}
    return api.Speculator.build(api.SpecConfig(**fields), target)


def run_turn(target, tok, spec, ids: list[int], max_tokens: int) -> tuple[list[int], SpecStats]:
    stats = SpecStats()
    out = []
    for step in spec.session(target, ids, max_tokens=max_tokens, eos_ids=api._eos_ids(tok), stats=stats):
        out += step
    return out, stats


def replay(convo: list[tuple[list[int], list[int]]], make, n: int = 8) -> list[float]:
    """tau per turn when `make()`'s lookup index proposes up to n drafts after every committed
    token of the recorded greedy answers and every proposal is verified (no model needed)."""
    out = []
    for ids, answer in convo:
        ix = make()
        ix.reset(ids)
        anchor, pos, forwards = answer[0], 1, 0
        while pos < len(answer):
            prop, _ = ix.propose(anchor, min(n, len(answer) - pos))
            a = 0
            while a < len(prop) and prop[a] == answer[pos + a]:
                a += 1
            forwards += 1
            ix.extend([anchor] + answer[pos : pos + a])
            pos += a
            if pos < len(answer):
                anchor, pos = answer[pos], pos + 1
        ix.extend([anchor])
        out.append(round((len(answer) - 1) / max(forwards, 1), 3))
    return out


def copy_ceiling(convo: list[tuple[list[int], list[int]]], steps: dict[int, float], n: int, shared: bool,
                 fresh_x: float, min_match: int = 0, prompt_tail: int = 16) -> list[dict]:
    """Per turn: forwards, tokens copied and x AR (in target steps) of an oracle that copies the
    longest span (<= n tokens) of the text it may read that continues the answer, verified at
    steps[rows] steps a forward; the tokens it cannot copy cost 1 / fresh_x steps each.
    min_match 0: any span (a bound on every copying drafter); m: only a span that follows an
    earlier occurrence of the last m tokens (the best proposal a lookup whose shortest match is
    m tokens could make, choosing among its candidates with the answer known).
    shared: earlier answers (after their prompt's last prompt_tail tokens) may be copied too."""
    enc = lambda toks: "".join(chr(0x100 + t) for t in toks)  # noqa: E731  (substring search over ids)

    def longest(text: str, want: str, key: str) -> int:
        if not key:  # any span: grow while it occurs
            L = 0
            while L < len(want) and want[: L + 1] in text:
                L += 1
            return L
        best, i = 0, text.find(key)
        while i >= 0 and best < len(want):
            cont = text[i + len(key) : i + len(key) + len(want)]
            L = 0
            while L < len(cont) and cont[L] == want[L]:
                L += 1
            best, i = max(best, L), text.find(key, i + 1)
        return best

    out, earlier = [], ""
    for ids, answer in convo:
        own, pos, forwards, copied, cost, fresh = enc(ids) + enc(answer[:1]), 1, 0, 0, 0.0, 0
        while pos < len(answer):
            text = own + "\0" + earlier if shared else own
            key = own[-min_match:] if min_match else ""
            L = longest(text, enc(answer[pos : pos + min(n, len(answer) - pos)]), key)
            if L:
                forwards, copied, cost = forwards + 1, copied + L, cost + steps[L + 1]
            else:
                fresh, cost = fresh + 1, cost + 1.0 / fresh_x
            own += enc(answer[pos : pos + L + 1])
            pos += L + 1
        earlier += "\0" + enc(ids[-prompt_tail:] + answer)
        gen = len(answer) - 1
        out.append({"copied": copied, "fresh": fresh, "copy_forwards": forwards, "x_ar": round(gen / cost, 3) if cost else None})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    p.add_argument("--print-trace", action="store_true", help="print the user messages and exit")
    p.add_argument("--replay", action="store_true", help="tau of each lookup with every proposal verified (no timing)")
    p.add_argument("--drafts", default="8", help="--replay: the most drafts per proposal, comma-separated (e.g. 8,16,32)")
    p.add_argument("--fresh-x", type=float, default=1.5,
                   help="--replay: x AR assumed for the tokens no copy covers (the default on fresh text; run 3: 1.35-1.63)")
    p.add_argument("--modeled", default=None, metavar="PROFILE",
                   help="no timing: each configuration's steps priced on this verify profile, as "
                        "scripts/lookup_heldout.py --fixed-costs does (the policy sees those costs, not the clock)")
    p.add_argument("--draft", default=None, metavar="PATH",
                   help="the drafter of the configurations that have one (default: the shipped one, as --draft auto)")
    p.add_argument("--out", default=None, help="write the JSON report here (else stdout)")
    a = p.parse_args(argv)
    raw = a.drafts
    try:
        a.drafts = [int(x) for x in raw.split(",")]
    except ValueError:
        a.drafts = []
    if not a.drafts or min(a.drafts) < 1:
        p.error(f"--drafts {raw!r}: give positive integers, comma-separated (e.g. 8,16,32)")
    if a.draft and not Path(a.draft).exists():
        p.error(f"--draft {a.draft}: no drafter there; pass an export directory (e.g. runs/x/hf) or leave it out")
    users = make_trace(a.seed)
    if a.turns > len(users):
        p.error(f"--turns {a.turns}: the trace has {len(users)} turns")
    if a.print_trace:
        print("\n\n-----\n\n".join(("(new session)\n" if fresh else "") + u for u, fresh in users[: a.turns]))
        return 0
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    if "AR" not in names or any(n not in CONFIGS for n in names):
        p.error(f"--configs must include AR and name only {', '.join(CONFIGS)}")
    target, tok, _ = api.load(draft="none")
    if a.replay:
        return _replay(target, tok, users[: a.turns], a)
    if a.modeled:
        return _modeled(target, tok, users[: a.turns], [n for n in names if n != "AR"], a)
    specs = {n: build(n, target, a.draft) for n in names}
    warm = _chat(tok, [{"role": "user", "content": "Say hello."}])
    for n in names:  # the verify profile and MLX's first calls, on a throwaway speculator
        run_turn(target, tok, build(n, target, a.draft), warm, 4)
    msgs: list[dict] = []
    turns, totals = [], {n: [0, 0.0] for n in names}
    for t in range(a.turns):
        text, fresh = users[t]
        if fresh:
            msgs = []
        msgs.append({"role": "user", "content": text})
        ids = _chat(tok, msgs)
        row = {"turn": t + 1, "new_session": fresh, "prompt_tokens": len(ids), "configs": {}}
        order = names[t % len(names):] + names[: t % len(names)]
        outs = {}
        for n in order:
            out, st = run_turn(target, tok, specs[n], ids, a.max_tokens)
            outs[n] = out
            totals[n][0] += st.generated - 1
            totals[n][1] += st.gen_time
            row["configs"][n] = {"tok_s": round(st.generation_tps, 2), "tau": round(st.tau, 3),
                                 "accepted": st.accepted, "drafted": st.drafted, "generated": st.generated}
        ar = row["configs"]["AR"]["tok_s"]
        for n in names:
            c = row["configs"][n]
            c["x_ar"] = round(c["tok_s"] / ar, 3) if ar else None
            c["equal_ar"] = outs[n] == outs["AR"]
        answer = tok.decode([x for x in outs["AR"] if x not in api._eos_ids(tok)])
        msgs.append({"role": "assistant", "content": answer})
        turns.append(row)
        print(f"turn {t + 1} ({len(ids)} prompt tokens): " + ", ".join(
            f"{n} {row['configs'][n]['x_ar']:.2f}x" for n in names), file=sys.stderr, flush=True)
    ar_rate = totals["AR"][0] / totals["AR"][1]
    report = {
        "command": "scripts/agent_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": "SmolLM2-135M-Instruct (default target)",
        "trace": {"seed": a.seed, "file": pick_function(a.seed)[0], "function": pick_function(a.seed)[2].name},
        "configs": {n: ("autoregressive" if CONFIGS[n] is None else specs[n].description) for n in names},
        "turns": turns,
        "overall_x_ar": {n: round(totals[n][0] / totals[n][1] / ar_rate, 3) for n in names},
        "greedy_equal_ar": all(c["equal_ar"] for r in turns for c in r["configs"].values()),
    }
    _emit(report, a.out)
    return 0


def _emit(report: dict, out: str | None) -> None:
    """The JSON report to `out`, else to stdout."""
    text = json.dumps(report, indent=1)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def _replay(target, tok, users, a) -> int:
    msgs, convo = [], []
    for text, fresh in users:
        msgs = [] if fresh else msgs
        msgs.append({"role": "user", "content": text})
        ids = _chat(tok, msgs)
        out, _ = run_turn(target, tok, api.Speculator(), ids, a.max_tokens)
        convo.append((ids, out))
        msgs.append({"role": "assistant", "content": tok.decode([x for x in out if x not in api._eos_ids(tok)])})
    by_n = {}
    for n in a.drafts:
        lookups = {"prompt lookup": lambda: NgramIndex(2, 4)}
        for alpha in (1.0, 4.0):  # a fresh shared index per length: it fills across the turns
            shared = SuffixIndex(api.SUFFIX_BUDGET)
            lookups[f"suffix alpha {alpha:g}"] = lambda shared=shared, alpha=alpha: SuffixLookup(shared, alpha=alpha)
        lookups["suffix alpha 4, no shared index"] = lambda: SuffixLookup(None, alpha=4.0)
        by_n[str(n)] = {name: replay(convo, make, n) for name, make in lookups.items()}
    from mlxspec.engine.profile import verify_profile

    n = max(a.drafts)
    sps = verify_profile(target, n + 1)
    steps = {L: sps[1] / sps[L] for L in sps}  # a verify of L rows, in decode steps
    ceiling = {}
    for name, shared, m in (("any span of the request", False, 0), ("any span of the request or earlier answers", True, 0),
                            ("after a 2-token match in the request", False, 2),
                            ("after a 2-token match in the request or earlier answers", True, 2)):
        turns = copy_ceiling(convo, steps, n, shared, a.fresh_x, min_match=m)
        gen = sum(len(ans) - 1 for _, ans in convo)
        total = sum((len(ans) - 1) / t["x_ar"] for (_, ans), t in zip(convo, turns) if t["x_ar"])  # None: nothing generated
        ceiling[name] = {"turns": turns, "overall_x_ar": round(gen / total, 3)}
    report = {"command": "scripts/agent_bench.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": a.max_tokens,
              "tau_every_draft_verified": by_n,
              "ceiling": {"drafts": n, "fresh_x": a.fresh_x, "verify_steps": {L: round(v, 3) for L, v in steps.items()},
                          **ceiling}}
    _emit(report, a.out)
    return 0


MODELED_DRAFT_MS = 1.45  # --modeled: the policy's drafting cost per EAGLE-3 draft (the AVX-512 host, 2026-12-05)


def _modeled(target, tok, users, names, a) -> int:
    """--modeled: every configuration through the whole conversation with fixed costs (the
    profile's verify costs, 1.45 ms a draft for the policy; 1.1 ms a drafter forward and 0.45 a
    head in the price): modeled x AR per turn and overall, repeatable to the digit."""
    lh = _script_module("lookup_heldout")
    prof = lh.read_profile(a.modeled)
    costs = lh.model_costs(prof)
    t1, report, answers = costs["verify_s"][1], {}, None
    with lh.fixed_costs(MODELED_DRAFT_MS, prof):
        for name in names:
            spec, msgs, turns, tokens, seconds, outs = build(name, target, a.draft), [], [], 0, 0.0, []
            for t, (text, fresh) in enumerate(users):
                msgs = [] if fresh else msgs
                msgs.append({"role": "user", "content": text})
                with lh.counting() as n:
                    out, st = run_turn(target, tok, spec, _chat(tok, msgs), a.max_tokens)
                m = lh.modeled(st, n, costs)
                tokens += st.generated - 1
                seconds += m["modeled_s"]
                turns.append({"turn": t + 1, "modeled_x_ar": m["modeled_x_ar"], "tau": round(st.tau, 3)})
                outs.append(out)
                answer = answers[t] if answers else tok.decode([x for x in out if x not in api._eos_ids(tok)])
                msgs.append({"role": "assistant", "content": answer})
            answers = answers or [tok.decode([x for x in o if x not in api._eos_ids(tok)]) for o in outs]
            report[name] = {"turns": turns, "overall_modeled_x_ar": round(tokens * t1 / seconds, 3)}
            print(f"{name}: " + ", ".join(f"{r['modeled_x_ar']:.2f}x" for r in turns)
                  + f"; overall {report[name]['overall_modeled_x_ar']:.3f}x", file=sys.stderr, flush=True)
    _emit({"command": "scripts/agent_bench.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M"),
           "profile": a.modeled, "configs": report}, a.out)
    return 0


def _script_module(name: str):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _chat(tok, msgs) -> list[int]:
    return tok.encode(apply_chat_template(tok, msgs), add_special_tokens=False)


if __name__ == "__main__":
    sys.exit(main())
