"""Training data the way it is served: the target's own answers, with taps and labels.

The references (DeepSpec, SpecForge) train drafters on the target's *regenerated*
responses in its chat template, with the loss on the response only. This module builds
that for mlxspec, from the training split of the corpus only (`mlxspec.corpus`):

- chat prompts: a docstring's first sentence becomes "Write a Python function that ...",
  a reST heading becomes "Explain ..." and also "What is ..." / "Give me three tips for ..." /
  ..., and a saying from the fortunes files "What does this saying mean? ..." (the way people
  ask a chat model); the three kinds in equal parts; rendered with the target's chat template exactly
  as `generate` renders a user message (`mlxspec.prompts.encode_prompt`);
- continuations: 64-token corpus prefixes (code, prose), which is what the held-out
  code/prose prompts are.

The target answers each prompt greedily or at T=0.7 (`--regen-temps`; one batched, left-padded decode;
mlx-lm's batch caches), and the taps and top-k are taken *during* generation, so no
second prefill is needed. Each answer becomes one window of `seq_len` tokens, shifted so
its first real token is at row 0, with `start` (first response token) and `end` (one past
the last valid token, EOS included): anchors go in [start, end) only.

Store layout: `data.prepare_shards`' streamed store (memory-mapped .npy, `progress.json`
counts completed windows, any prefix is a valid mixed dataset, rerun to resume) plus
start [N] int32, end [N] int32 and source [N] str ("chat-t0", "cont-t0.7", ...).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache
from tqdm import tqdm

from mlxspec.corpus import corpus_files, read_text
from mlxspec.errors import MlxspecError
from mlxspec.prompts import CHAT_QUESTIONS, encode_prompt
from mlxspec.train.data import TOPK, _write_json_atomic, next_token_topk, taps_to_store

REGEN_FORMAT = "mlxspec-regen-1"
REGEN_ARRAYS = ("tokens", "category", "taps", "topk_ids", "topk_probs", "start", "end", "source")
TEMPS = (0.0, 0.7)  # the default answer temperatures
MAX_TEMP = 2.0


def kinds_for(temps=TEMPS) -> tuple[str, ...]:
    """The store's window kinds for these answer temperatures: chat answers, then continuations."""
    if not temps:
        raise MlxspecError("--regen-temps: pass at least one temperature, e.g. 0,0.7")
    for t in temps:
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= float(t) <= MAX_TEMP:
            raise MlxspecError(f"--regen-temps {t!r} is out of range: pass temperatures in [0, {MAX_TEMP:g}]")
    tags = [f"{float(t):g}" for t in temps]
    if len(set(tags)) != len(tags):
        raise MlxspecError(f"--regen-temps {','.join(tags)}: repeats a temperature; pass each once")
    return tuple(f"chat-t{t}" for t in tags) + tuple(f"cont-t{t}" for t in tags)


KINDS = kinds_for(TEMPS)  # ("chat-t0", "chat-t0.7", "cont-t0", "cont-t0.7")
QUESTIONS = 2  # the chat question set: 1 = code and prose questions; 2 = plus conversational ones (chat-gen)
# --regen-questions: corpus = `chat_questions` (set QUESTIONS); self = the target's own questions
# (`mlxspec.train.asked`); mixed = the two in turn
QUESTION_SOURCES = ("corpus", "self", "mixed")
_ROLE = re.compile(r":[\w:-]+:`~?([^`<]+?)(?: <[^>]*>)?`")  # :func:`x` / :class:`~a.b` -> x


# conversational questions (chat-gen): about a fortune-file saying, or about a prose heading
_GEN_QUOTE = ('What does this saying mean? "{q}"', 'Explain this quote in two sentences: "{q}"',
              'Write a short poem inspired by this line: "{q}"', 'Do you agree with this? "{q}" Answer briefly.')
_GEN_TOPIC = ("What is {t}?", "Give me three tips for {t}.", "Summarize {t} in two sentences.",
              "How do I get started with {t}?", "Write a short poem about {t}.")


def _third_person(sentence: str) -> str | None:
    """'Return the list.' -> 'returns the list'; None when it does not start with a verb-like word."""
    s = sentence.strip().rstrip(".")
    m = re.match(r"([A-Z][a-z]+)\b(.*)", s)
    if not m or len(s) < 12 or len(s) > 160:
        return None
    w, rest = m.group(1).lower(), m.group(2)
    if w in ("this", "the", "a", "an", "if", "it", "used", "internal", "helper", "private", "deprecated"):
        return None
    if w.endswith("s") and not w.endswith("ss"):
        return None  # already third person ("Returns ..."), or a noun
    if w.endswith(("ss", "sh", "ch", "x")):
        w += "es"
    elif w.endswith("y") and w[-2:-1] not in "aeiou":
        w = w[:-1] + "ies"
    else:
        w += "s"
    return w + rest


def chat_questions(seed: int = 0) -> list[tuple[str, str]]:
    """(category, question) pairs built from the corpus's training split, shuffled.

    Never the held-out prompt set: held-out files are excluded by `corpus_files(split=
    "train")` and the fixed chat questions of `mlxspec.prompts` are dropped if they occur."""
    out, gen, seen = [], [], set(CHAT_QUESTIONS)
    for f in corpus_files(None, "train"):
        text = read_text(f.path)
        if f.category == "code":
            for m in re.finditer(r'^\s*def (\w+)\(.*?\):\s*\n\s*(?:"""|\'\'\')\s*([^\n]+)', text, flags=re.M):
                if m.group(1).startswith("_"):
                    continue
                first = re.split(r"(?<=\.)\s", m.group(2).strip().rstrip("\"'").strip())[0]
                verb = _third_person(first)
                if verb:
                    q = f"Write a Python function `{m.group(1)}` that {verb}."
                    if q not in seen:
                        seen.add(q)
                        out.append(("chat-code", q))
        elif f.category == "prose":
            lines = text.splitlines()
            for a, b in zip(lines, lines[1:]):
                a = a.strip()
                if len(a) >= 6 and re.fullmatch(r"([=\-~^*])\1{3,}", b.strip() or "x") and len(b.strip()) >= len(a) - 1:
                    h = _ROLE.sub(r"\1", a).replace("``", "").replace("*", "").strip()
                    if not re.search(r"[A-Za-z]{3}", h) or h.lower().startswith(("what's new", "changelog")):
                        continue
                    q = f"Explain {h[0].lower() + h[1:] if h[:2].istitle() and not h[1:2].isupper() else h}."
                    if q not in seen:
                        seen.add(q)
                        out.append(("chat-prose", q))
        elif f.category == "fortunes" and not re.search(r"art|translate", f.rel):
            for entry in re.split(r"^%\s*$", text, flags=re.M):
                body = " ".join(ln.strip() for ln in entry.strip().splitlines() if not ln.strip().startswith("--"))
                if 24 <= len(body) <= 160 and body.isascii() and not re.search(r"[|<>{}\\_]|  ", body):
                    gen.append(_GEN_QUOTE[len(gen) % len(_GEN_QUOTE)].format(q=body.replace('"', "'")))
    # the same questions asked the way people ask a chat model (what the held-out chat prompts
    # are): what / how / tips / summarize / a poem, about the prose headings
    for i, (_, q) in enumerate(x for x in out if x[0] == "chat-prose"):
        topic = q[len("Explain "):-1]
        gen.append(_GEN_TOPIC[i % len(_GEN_TOPIC)].format(t=topic))
    rng = np.random.default_rng(seed)
    pools = [[x for x in out if x[0] == c] for c in ("chat-code", "chat-prose")]
    pools.append([("chat-gen", q) for q in dict.fromkeys(gen) if q not in seen])
    pools = [[p[i] for i in rng.permutation(len(p))] for p in pools if p]
    # round robin, so that any prefix asks the three kinds of question in equal parts
    return in_turn(*pools)


def in_turn(*pools: list) -> list:
    """The pools' items dealt one from each in turn, until every pool is spent."""
    return [x for tup in itertools.zip_longest(*pools) for x in tup if x is not None]


def chat_pool_size(n_windows: int, kinds: tuple[str, ...] = KINDS) -> int:
    """How many chat prompts `plan_items` deals for a store of n_windows windows of these kinds."""
    return sum(k.startswith("chat-") for k in kinds) * (n_windows // len(kinds) + 1)


def corpus_prefixes(tokenizer, prefix_len: int, n: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    """n (category, ids) prefixes of `prefix_len` tokens, one per training-split file at a
    random offset, code and prose alternating."""
    rng = np.random.default_rng(seed + 1)
    files = corpus_files(None, "train")
    by_cat = {c: [f for f in files if f.category == c] for c in ("code", "prose")}
    out = []
    for cat, fs in by_cat.items():
        for i in rng.permutation(len(fs)):
            if len(out) >= 2 * (n // 2 + 1) or sum(1 for c, _ in out if c == cat) >= n // 2 + 1:
                break
            ids = tokenizer.encode(read_text(fs[i].path), add_special_tokens=False)
            if len(ids) < 2 * prefix_len:
                continue
            s = int(rng.integers(0, len(ids) - 2 * prefix_len + 1))  # a file of exactly 2 x prefix_len too
            out.append((cat, ids[s : s + prefix_len]))
    code = [x for x in out if x[0] == "code"]
    prose = [x for x in out if x[0] == "prose"]
    mixed = [x for pair in zip(code, prose) for x in pair]
    return mixed[:n]


def _batch_cache(target, pads: list[int]) -> list:
    out = []
    for c in make_prompt_cache(target.model):
        if type(c) is KVCache:
            out.append(BatchKVCache(pads))
        elif type(c) is RotatingKVCache:
            out.append(BatchRotatingKVCache(c.max_size, pads))
        else:
            raise MlxspecError(f"regenerated training data needs a KV or rotating-KV target; this one has a "
                               f"{type(c).__name__} layer cache: use --data-mode corpus")
    return out


def generate_windows(target, prompts: list[list[int]], taps, seq_len: int, temp: float, eos_ids, seed: int,
                     exact_taps: bool = False):
    """Answer `prompts` in one left-padded batch -> per-row dict of window arrays.

    Every row decodes seq_len - max(prompt length) tokens (the batch shares one length),
    stops early once all rows have emitted EOS; taps and top-k come from the same forwards.
    Taps are stored as bfloat16 bits, or as float32 with exact_taps (the held-out store: a
    replay from rounded taps flips the odd near-tied draft the engine, on float32 taps, does not)."""
    b = len(prompts)
    P = max(len(p) for p in prompts)
    pads = [P - len(p) for p in prompts]
    x = np.zeros((b, P), np.int32)
    for i, p in enumerate(prompts):
        x[i, pads[i]:] = p
    cache = _batch_cache(target, pads)
    run = lambda t: target._run(lambda: target.model(t, cache=cache), t, None, tuple(taps), "all")  # noqa: E731
    logits, tp = run(mx.array(x))
    key = mx.random.key(seed)
    toks, tap_l, id_l, p_l = [mx.array(x)], [], [], []
    finished = np.zeros(b, bool)
    eos = np.asarray(sorted(eos_ids or []), np.int32)
    G = seq_len - P
    for step in range(G + 1):
        ids, pk = next_token_topk(logits)
        if temp > 0:
            key, sub = mx.random.split(key)
            nxt = mx.random.categorical(logits[:, -1].astype(mx.float32) / temp, key=sub)[:, None].astype(mx.int32)
        else:
            nxt = ids[:, -1:, 0]
        mx.eval(tp, ids, pk, nxt)
        tap_l.append(np.asarray(tp.astype(mx.float32)) if exact_taps else taps_to_store(tp))
        id_l.append(np.asarray(ids))
        p_l.append(np.asarray(pk.astype(mx.float16)))
        if step == G or finished.all():
            break
        toks.append(nxt)
        finished |= np.isin(np.asarray(nxt)[:, 0], eos)
        logits, tp = run(nxt)
    seq = np.asarray(mx.concatenate(toks, axis=1)).astype(np.int32)  # [b, P + g]
    taps_a, ids_a, p_a = (np.concatenate(a, axis=1) for a in (tap_l, id_l, p_l))
    rows = []
    for i in range(b):
        s = pads[i]
        t = seq[i, s:]
        n = len(t)
        hit = np.nonzero(np.isin(t[len(prompts[i]):], eos))[0]
        end = len(prompts[i]) + int(hit[0]) + 1 if len(hit) else n
        w = {"tokens": np.zeros(seq_len, np.int32), "taps": np.zeros((seq_len, taps_a.shape[-1]), taps_a.dtype),
             "topk_ids": np.zeros((seq_len, TOPK), np.int32), "topk_probs": np.zeros((seq_len, TOPK), np.float16)}
        w["tokens"][:n] = t
        w["taps"][:n] = taps_a[i, s : s + n]
        w["topk_ids"][:n] = ids_a[i, s : s + n]
        w["topk_probs"][:n] = p_a[i, s : s + n]
        w["start"], w["end"] = len(prompts[i]), end
        rows.append(w)
    return rows


def plan_items(tokenizer, n_windows: int, prefix_len: int = 64, seed: int = 0, max_prompt: int = 96,
               kinds: tuple[str, ...] = KINDS, asked: list[str] | None = None, questions: str = "corpus"):
    """The prompt pool of each kind (`kinds_for`): chat prompts and corpus prefixes dealt in turn.

    questions: where the chat prompts come from (`QUESTION_SOURCES`); `asked` holds the
    target's own questions for "self" and "mixed" (`mlxspec.train.asked`)."""
    chat_kinds = [k for k in kinds if k.startswith("chat-")]
    cont_kinds = [k for k in kinds if k.startswith("cont-")]
    per = n_windows // len(kinds) + 1
    n_chat = chat_pool_size(n_windows, kinds)
    own = [("chat-self", q) for q in asked or []]
    if questions == "self":
        qs = own
    elif questions == "mixed":  # one of the target's own questions, then one from the corpus, in turn
        qs = in_turn(own, chat_questions(seed))
    else:
        qs = chat_questions(seed)
    chat = []
    for cat, q in qs:
        ids = encode_prompt(tokenizer, "chat", q)
        if len(ids) <= max_prompt:
            chat.append((cat, ids))
        if len(chat) >= n_chat:
            break
    cont = corpus_prefixes(tokenizer, prefix_len, len(cont_kinds) * per, seed)
    if not chat or not cont:
        raise MlxspecError("the training corpus gave no chat prompts or no prefixes; check the corpus sources "
                           "(scripts/setup.sh installs python3.11-doc)")
    pools = {k: chat[i::len(chat_kinds)] for i, k in enumerate(chat_kinds)}
    pools.update({k: cont[i::len(cont_kinds)] for i, k in enumerate(cont_kinds)})
    return pools


def prepare_regen_store(target, tokenizer, out_dir, taps: list[int], seq_len: int = 256, windows: int = 2048,
                        batch: int = 32, seed: int = 0, max_seconds: float | None = None,
                        temps=TEMPS, questions: str = "corpus") -> Path:
    """Stream the target's own answers into a resumable store (module docstring).

    Batches cycle through the kinds of `temps` (by default chat greedy, chat T=0.7,
    continuation greedy, continuation T=0.7), so any prefix of the store holds all of them
    in equal parts. Prompts in a batch are
    of similar length (sorted within a pool chunk) to keep left padding small."""
    kinds = kinds_for(temps)
    if questions not in QUESTION_SOURCES:
        raise MlxspecError(f"--regen-questions {questions!r}: pass one of {', '.join(QUESTION_SOURCES)}")
    if questions != "corpus":
        from mlxspec.train.asked import user_prefix

        user_prefix(tokenizer, questions)  # a target without a chat template: one line before any file is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    windows = (windows // batch) * batch or batch
    settings = {"format": REGEN_FORMAT, "taps": list(taps), "seq_len": seq_len, "topk": TOPK, "windows": windows,
                "batch": batch, "seed": seed, "model": str(getattr(target.info, "source", "")), "kinds": list(kinds),
                "questions": QUESTIONS if questions == "corpus" else questions}
    meta_p, prog_p = out / "meta.json", out / "progress.json"
    if meta_p.exists():
        old = json.loads(meta_p.read_text())
        diff = [k for k in settings if k != "windows" and old.get(k) != settings[k]]
        if diff:
            raise MlxspecError(f"{out}: holds regenerated data prepared with other settings ({', '.join(diff)}); "
                               "pass a new --data directory (or the original settings to resume)")
        windows = int(old["windows"])
    else:
        from numpy.lib.format import open_memmap

        TH = len(taps) * target.info.hidden_size
        shapes = {"tokens": ((windows, seq_len), np.int32), "taps": ((windows, seq_len, TH), np.uint16),
                  "topk_ids": ((windows, seq_len, TOPK), np.int32), "topk_probs": ((windows, seq_len, TOPK), np.float16),
                  "start": ((windows,), np.int32), "end": ((windows,), np.int32),
                  "category": ((windows,), "<U10"), "source": ((windows,), "<U10")}
        for k, (shape, dt) in shapes.items():
            open_memmap(out / f"{k}.npy", "w+", dt, shape).flush()
        _write_json_atomic(prog_p, {"done": 0, "seconds": 0.0, "tokens": 0})
        _write_json_atomic(meta_p, settings)
    prog = json.loads(prog_p.read_text())
    done, spent, ntok = int(prog["done"]), float(prog["seconds"]), int(prog.get("tokens", 0))
    mm = {k: np.load(out / f"{k}.npy", mmap_mode="r+") for k in REGEN_ARRAYS}
    asked = None
    if questions != "corpus":
        from mlxspec.train.asked import stored_questions

        n_chat = chat_pool_size(windows, kinds)
        asked = stored_questions(target, tokenizer, out, n_chat if questions == "self" else n_chat // 2 + 1, seed)
    pools = plan_items(tokenizer, windows, seed=seed, kinds=kinds, asked=asked, questions=questions)
    eos = tokenizer.eos_token_ids
    bar = tqdm(total=windows, initial=done, unit="win", desc="target answers", disable=None, smoothing=0.1)
    t_start = time.time()
    while done < windows:
        t0 = time.time()
        bi = done // batch
        kind = kinds[bi % len(kinds)]
        pool = pools[kind]
        j = (bi // len(kinds)) * batch
        chunk = [pool[(j + i) % len(pool)] for i in range(batch)]
        chunk.sort(key=lambda c: len(c[1]))
        temp = float(kind.split("-t")[1])
        rows = generate_windows(target, [c[1] for c in chunk], taps, seq_len, temp, eos, seed * 100003 + bi)
        for i, (w, (cat, _)) in enumerate(zip(rows, chunk)):
            r = done + i
            for k in ("tokens", "taps", "topk_ids", "topk_probs", "start", "end"):
                mm[k][r] = w[k]
            mm["category"][r], mm["source"][r] = cat, kind
            ntok += int(w["end"] - w["start"])
        for m in mm.values():
            m.flush()
        spent += time.time() - t0
        done += batch
        _write_json_atomic(prog_p, {"done": done, "seconds": spent, "tokens": ntok})
        bar.update(batch)
        bar.set_postfix(resp_tok_s=f"{ntok / max(spent, 1e-9):.0f}")
        if max_seconds is not None and time.time() - t_start >= max_seconds:
            break
    bar.close()
    return out
