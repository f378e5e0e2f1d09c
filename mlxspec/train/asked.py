"""Chat questions the target asks itself: the user turn sampled from its own chat template.

The corpus gives questions about Python and its docs (`regen.chat_questions`), but the chat
prompts people send a small instruct model are about anything: a poem about the sea, the
seasons, a recipe. An instruct model has learned that distribution from its own tuning data,
and it hands it back when asked to continue a template that stops right after the user
header (Magpie: Xu et al. 2024, "Alignment Data Synthesis from Scratch by Prompting Aligned
LLMs with Nothing"). Each sample is one question; the target then answers it as usual.

The questions are a function of (target, seed, count), sampled in batches from one shared
prefix, and written once next to the store they feed (`questions.json`), so a resumed store
asks the same ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from mlxspec.errors import MlxspecError
from mlxspec.prompts import CHAT_QUESTIONS
from mlxspec.tokenizer import apply_chat_template

_SENTINEL = "\x00QUESTION\x00"
_FORMAT = "mlxspec-asked-1"


def user_prefix(tokenizer, source: str = "self") -> list[int]:
    """The token ids of the chat template up to where a user's message begins (source: the
    --regen-questions value that needs them, for the error)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise MlxspecError(f"--regen-questions {source} needs a target with a chat template; pass --regen-questions corpus")
    s = apply_chat_template(tokenizer, [{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    return tokenizer.encode(s[: s.index(_SENTINEL)], add_special_tokens=False)


def _min_p(logits: mx.array, p: float) -> mx.array:
    """Logits with every token less likely than p times the likeliest set to -inf (min-p: the
    tail cut without a sort over the vocabulary, which top-p needs at every step)."""
    x = logits.astype(mx.float32)
    return mx.where(x >= mx.max(x, axis=-1, keepdims=True) + float(np.log(p)), x, -mx.inf)


def clean(text: str) -> str | None:
    """A sampled user turn -> the question, or None when it is not one a user would send."""
    q = " ".join(text.split())
    if not 16 <= len(q) <= 400 or not q.isascii() or not re.search(r"[A-Za-z]{3}", q):
        return None
    if re.search(r"<\|?|\|>|\[INST\]|https?://", q):  # template debris, links
        return None
    return q


def sample_questions(target, tokenizer, n: int, seed: int = 0, max_tokens: int = 64, temp: float = 1.0,
                     min_p: float = 0.05, batch: int = 32) -> list[str]:
    """n distinct questions (module docstring), never one of the held-out chat prompts."""
    prefix = user_prefix(tokenizer)
    eos = np.asarray(sorted(tokenizer.eos_token_ids or []), np.int32)
    seen = set(CHAT_QUESTIONS)
    out: list[str] = []
    key = mx.random.key(seed)
    bar = tqdm(total=n, unit="q", desc="questions", disable=None)
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 4 * (n // batch + 1) + 8:
            raise MlxspecError(f"the target asked only {len(out)} usable questions of {n} in {tries - 1} batches; "
                               "pass --regen-questions corpus")
        cache = make_prompt_cache(target.model)
        logits = target.model(mx.array([prefix] * batch), cache=cache)[:, -1]
        steps: list[np.ndarray] = []
        done = np.zeros(batch, bool)
        for _ in range(max_tokens):
            key, sub = mx.random.split(key)
            nxt = mx.random.categorical(_min_p(logits, min_p) / temp, key=sub).astype(mx.int32)
            t = np.asarray(nxt)
            steps.append(t)
            done |= np.isin(t, eos)
            if done.all():
                break
            logits = target.model(nxt[:, None], cache=cache)[:, -1]
        for r in np.stack(steps, axis=1):
            hit = np.nonzero(np.isin(r, eos))[0]
            if not len(hit):  # ran past max_tokens: not one question
                continue
            q = clean(tokenizer.decode(r[: hit[0]].tolist()))
            if q and q not in seen:
                seen.add(q)
                out.append(q)
                bar.update(1)
                if len(out) == n:
                    break
    bar.close()
    return out


def stored_questions(target, tokenizer, store: str | Path, n: int, seed: int) -> list[str]:
    """The store's own questions (questions.json), sampled and written on the first call."""
    f = Path(store) / "questions.json"
    if f.exists():
        try:
            d = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise MlxspecError(f"{f}: unreadable ({type(e).__name__}); delete it to ask the questions again, "
                               "or pass a new --data directory") from None
        qs = d.get("questions") if isinstance(d, dict) else None
        if not isinstance(qs, list) or not all(isinstance(q, str) for q in qs):
            raise MlxspecError(f"{f}: is not a question list; delete it to ask the questions again, "
                               "or pass a new --data directory")
        if d.get("format") != _FORMAT or d.get("seed") != seed or len(qs) < n:
            raise MlxspecError(f"{f}: holds questions for other settings; pass a new --data directory")
        return qs[:n]
    qs = sample_questions(target, tokenizer, n, seed)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "seed": seed, "questions": qs}, indent=0))
    tmp.replace(f)
    return qs
