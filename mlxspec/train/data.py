"""Training data for drafters: corpus files -> token windows -> target taps and labels.

The target is run once over every training window (the same prefill that produces the
taps also produces the target's own next-token distribution); results are cached on
disk as float16 shards so training steps never run the target.

Split: a file belongs to the held-out set iff crc32(relative path) % 20 == 0 (5%), a
fixed rule, so prompts built from held-out files never overlap training text.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

DEFAULT_SOURCES = {
    "code": [sysconfig.get_paths()["stdlib"] + "/**/*.py"],
    "prose": ["/usr/share/doc/python3.11/html/_sources/**/*.rst.txt"],
    "fortunes": ["/usr/share/games/fortunes/*"],
}
TOPK = 8
DEFAULT_TAPS = [1, 8, 15, 22, 28]  # SmolLM2 (30 layers): spread over the depth, never the last
DEFAULT_BUDGET = {"code": 100_000, "prose": 50_000, "fortunes": 10_000}


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % 20 == 0


@dataclass
class CorpusFile:
    path: str
    rel: str
    category: str


def corpus_files(sources: dict[str, list[str]] | None = None, split: str = "train") -> list[CorpusFile]:
    sources = sources or DEFAULT_SOURCES
    out = []
    for cat, pats in sources.items():
        for pat in pats:
            if os.path.isdir(pat):
                pat = os.path.join(pat, "**", "*")
            root = pat.split("*")[0]
            for p in sorted(glob.glob(pat, recursive=True)):
                sub = p[len(root):]
                if not os.path.isfile(p) or p.endswith((".dat", ".u8", ".pyc")) or any(
                    s in sub for s in ("site-packages", "/test", "test/", "idle_test", "lib2to3/tests")
                ):
                    continue
                rel = f"{cat}/{os.path.relpath(p, root)}"
                if (split == "heldout") == is_heldout(rel):
                    out.append(CorpusFile(p, rel, cat))
    return out


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def token_windows(files, tokenizer, seq_len: int, max_tokens: int, seed: int = 0) -> np.ndarray:
    """Non-overlapping windows of seq_len tokens cut from shuffled files (int32 [N, L])."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(files))
    wins, total = [], 0
    for i in order:
        text = read_text(files[i].path)
        if len(text) < 200:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False, parse_special=False)
        for s in range(0, len(ids) - seq_len + 1, seq_len):
            wins.append(ids[s : s + seq_len])
            total += seq_len
            if total >= max_tokens:
                return np.asarray(wins, dtype=np.int32)
    return np.asarray(wins, dtype=np.int32)


def next_token_topk(logits: mx.array) -> tuple[mx.array, mx.array]:
    """The target's TOPK most likely next tokens and their probabilities, most likely first."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    ids = mx.argpartition(-probs, TOPK, axis=-1)[..., :TOPK]
    pk = mx.take_along_axis(probs, ids, axis=-1)
    order = mx.argsort(-pk, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(pk, order, axis=-1)


def prepare_shards(
    target,
    tokenizer,
    out_dir: str | os.PathLike,
    taps: list[int],
    seq_len: int = 256,
    tokens_per_category: dict[str, int] | None = None,
    batch: int = 8,
    sources=None,
    seed: int = 0,
) -> Path:
    """Run the target over training windows; write shards of taps + labels.

    Each shard `shard_XXXX.npz`: tokens [N, L] int32, taps [N, L, T*H] float16,
    topk_ids [N, L, K] int32, topk_probs [N, L, K] float16 (the target's distribution
    of the NEXT token at each position), category [N] str.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens_per_category = tokens_per_category or DEFAULT_BUDGET
    files = corpus_files(sources, "train")
    windows, cats = [], []
    for cat, budget in tokens_per_category.items():
        fs = [f for f in files if f.category == cat]
        w = token_windows(fs, tokenizer, seq_len, budget, seed)
        windows.append(w)
        cats += [cat] * len(w)
    windows = np.concatenate(windows)
    cats = np.asarray(cats)
    n = len(windows)
    bar = tqdm(total=n * seq_len, unit="tok", unit_scale=True, desc="target taps", disable=None)
    shard, buf = 0, {"tokens": [], "taps": [], "topk_ids": [], "topk_probs": [], "category": []}

    def flush():
        nonlocal shard, buf
        if not buf["tokens"]:
            return
        np.savez(out / f"shard_{shard:04d}.npz", **{k: np.concatenate(v) for k, v in buf.items()})
        shard += 1
        buf = {k: [] for k in buf}

    for s in range(0, n, batch):
        x = mx.array(windows[s : s + batch])
        hid, tp = target.forward_hidden(x, taps)
        ids, pk = next_token_topk(target.lm_head(hid))
        mx.eval(tp, ids, pk)
        buf["tokens"].append(windows[s : s + batch])
        buf["taps"].append(np.asarray(tp.astype(mx.float16)))
        buf["topk_ids"].append(np.asarray(ids).astype(np.int32))
        buf["topk_probs"].append(np.asarray(pk.astype(mx.float16)))
        buf["category"].append(cats[s : s + batch])
        bar.update(x.size)
        if sum(len(t) for t in buf["tokens"]) >= 256:
            flush()
    flush()
    bar.close()
    return out


def load_shards(path: str | os.PathLike) -> dict[str, np.ndarray]:
    files = sorted(Path(path).glob("shard_*.npz"))
    if not files:
        from ..errors import MlxspecError

        raise MlxspecError(f"{path}: no training shards; run `mlxspec train --prepare-only` (or any `mlxspec train`) first")
    parts = [dict(np.load(f)) for f in files]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def prepare_generated_shards(
    target,
    tokenizer,
    out_dir: str | os.PathLike,
    taps: list[int],
    prefix_len: int = 64,
    gen_len: int = 192,
    tokens_per_category: dict[str, int] | None = None,
    batch: int = 32,
    sources=None,
    seed: int = 0,
) -> Path:
    """Corpus prefixes continued by the TARGET itself (greedy), with taps and labels.

    Why: a block row k > 1 is labelled with the target's prediction after k unseen
    tokens. On raw corpus text those tokens are the corpus's, not the target's, so the
    label is inconsistent with decoding whenever they differ (for a 135M target, about
    every other token): measured, rows 2.. of a drafter trained on corpus windows were
    accepted ~1% of the time. On the target's own greedy continuation the chain is
    exactly what greedy verification accepts. Anchors are drawn in the generated part
    only (`start` = prefix_len).

    Shard layout as `prepare_shards`, plus start [N] int32.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens_per_category = tokens_per_category or DEFAULT_BUDGET
    files = corpus_files(sources, "train")
    prefixes, cats = [], []
    for cat, budget in tokens_per_category.items():
        fs = [f for f in files if f.category == cat]
        n_seq = max(1, budget // gen_len)
        w = token_windows(fs, tokenizer, prefix_len, n_seq * prefix_len, seed)
        # spread over the corpus: one window per file chunk, not the first n of one file
        prefixes.append(w[:n_seq])
        cats += [cat] * len(w[:n_seq])
    prefixes = np.concatenate(prefixes)
    cats = np.asarray(cats)
    order = np.random.default_rng(seed).permutation(len(prefixes))
    prefixes, cats = prefixes[order], cats[order]
    n = len(prefixes)
    L = prefix_len + gen_len
    bar = tqdm(total=n * gen_len, unit="tok", unit_scale=True, desc="target continuations", disable=None)
    shard = 0
    for s in range(0, n, batch):
        x = mx.array(prefixes[s : s + batch])
        b = x.shape[0]
        cache = target.make_cache()
        toks = [x]
        tap_l, id_l, p_l = [], [], []

        logits, tp = target(x, cache, taps=taps, logits="all")
        for _ in range(gen_len + 1):  # the last pass gives the last token's taps
            ids, pk = next_token_topk(logits)
            nxt = ids[:, -1:, 0]  # greedy: the target's own next token
            mx.eval(tp, ids, pk, nxt)
            tap_l.append(tp.astype(mx.float16))
            id_l.append(ids)
            p_l.append(pk.astype(mx.float16))
            if sum(t.shape[1] for t in toks) == L:
                break
            toks.append(nxt)
            logits, tp = target(nxt, cache, taps=taps, logits="all")
            bar.update(b)
        seq = np.asarray(mx.concatenate(toks, axis=1)).astype(np.int32)
        np.savez(
            out / f"shard_{shard:04d}.npz",
            tokens=seq,
            taps=np.asarray(mx.concatenate(tap_l, axis=1)),
            topk_ids=np.asarray(mx.concatenate(id_l, axis=1)).astype(np.int32),
            topk_probs=np.asarray(mx.concatenate(p_l, axis=1)),
            category=cats[s : s + b],
            start=np.full(b, prefix_len, np.int32),
        )
        shard += 1
    bar.close()
    return out
