"""Prompt sets for evaluation and benchmarks, built from the HELD-OUT corpus split.

- code: held-out CPython stdlib files cut right after a `def ...:` line (the model
  completes the function body);
- prose: held-out Python-docs reST files cut after ~600 characters of a paragraph;
- chat: a few fixed questions, rendered with the model's chat template.
The set is written once to `mlxspec/data/prompts.json` (`build_prompts`) so that
every run compares the same prompts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mlxspec.corpus import corpus_files, read_text
from mlxspec.tokenizer import apply_chat_template

PROMPTS_FILE = Path(__file__).parent / "data" / "prompts.json"

CHAT_QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for writing clear documentation.",
    "Write a short poem about the sea.",
    "How do I read a file line by line in Python?",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def build_prompts(n_per_category: int = 16, max_chars: int = 1200) -> dict[str, list[str]]:
    files = corpus_files(None, "heldout")
    code, prose = [], []
    for f in files:
        text = read_text(f.path)
        if f.category == "code":
            for i, m in enumerate(re.finditer(r"^( *)def \w+\(.*\):[ \t]*\n", text, flags=re.M)):
                if i >= 3:  # at most 3 prompts per file
                    break
                end = m.end()
                start = max(0, end - max_chars)
                start = text.find("\n", start) + 1 if start > 0 else 0
                code.append(text[start:end] + m.group(1) + "    ")
        elif f.category == "prose":
            paras = [p for p in re.split(r"\n\s*\n", text) if len(p) > 400 and not p.lstrip().startswith((".. ", "::", "+", "=", "-"))]
            for p in paras[:2]:
                prose.append(p[:600].rsplit(" ", 1)[0])
    step_c = max(1, len(code) // n_per_category)
    step_p = max(1, len(prose) // n_per_category)
    return {
        "code": code[::step_c][:n_per_category],
        "prose": prose[::step_p][:n_per_category],
        "chat": CHAT_QUESTIONS[:n_per_category],
    }


def load_prompts() -> dict[str, list[str]]:
    if PROMPTS_FILE.exists():
        return json.loads(PROMPTS_FILE.read_text())
    return build_prompts()


def encode_prompt(tokenizer, category: str, text: str) -> list[int]:
    """chat prompts go through the chat template; code/prose are raw continuations."""
    if category == "chat" and tokenizer.has_chat_template:
        s = apply_chat_template(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(s, add_special_tokens=False)
    return tokenizer.encode(text)
