"""Training data for drafters: corpus files -> token windows -> target taps and labels.

The target is run once over every training window (the same prefill that produces the
taps also produces the target's own next-token distribution); results are cached on
disk (taps as bfloat16 bits, labels as float16) so training steps never run the target.

The corpus and its fixed train/held-out split: `mlxspec.corpus`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlxspec.corpus import DEFAULT_SOURCES, corpus_files, read_text
from mlxspec.errors import MlxspecError

TOPK = 8
DEFAULT_BUDGET = {"code": 100_000, "prose": 50_000, "fortunes": 10_000}
def token_windows(files, tokenizer, seq_len: int, max_tokens: int, seed: int = 0) -> np.ndarray:
    """Non-overlapping windows of seq_len tokens cut from shuffled files (int32 [N, L])."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(files))
    wins, total = [], 0
    for i in order:
        text = read_text(files[i].path)
        if len(text) < 200:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        for s in range(0, len(ids) - seq_len + 1, seq_len):
            wins.append(ids[s : s + seq_len])
            total += seq_len
            if total >= max_tokens:
                return np.asarray(wins, dtype=np.int32)
    return np.asarray(wins, dtype=np.int32)


def next_token_topk(logits: mx.array, chunk: int = 64) -> tuple[mx.array, mx.array]:
    """The target's TOPK most likely next tokens and their probabilities, most likely first.

    Two-level search: the TOPK largest logits lie in the TOPK vocabulary chunks with the
    largest maxima, so one max-reduction over the logits plus a search among
    TOPK * chunk candidates replaces a softmax and an argpartition over the whole
    vocabulary (those two cost more than half the forward on CPU). A vocabulary of at most
    TOPK chunks is searched whole; one of fewer than TOPK tokens fills the missing places with
    token 0 at probability 0. Probabilities are exact: exp(logit - logsumexp) over the full
    vocabulary."""
    logits = logits.astype(mx.float32)
    *lead, V = logits.shape
    if V <= 0:
        raise MlxspecError("the target's logits have an empty vocabulary axis; the model's output head is broken")
    k = min(TOPK, V)
    if -(-V // chunk) > TOPK:  # more chunks than TOPK: search the TOPK best chunks only
        pad = (-V) % chunk
        x = logits if not pad else mx.concatenate(
            [logits, mx.full((*lead, pad), -mx.inf, dtype=mx.float32)], axis=-1)
        xc = x.reshape(*lead, -1, chunk)
        top_chunks = mx.argpartition(-mx.max(xc, axis=-1), TOPK - 1, axis=-1)[..., :TOPK]  # [..., K]
        cand = mx.take_along_axis(xc, top_chunks[..., None], axis=-2).reshape(*lead, TOPK * chunk)
        cand_ids = (top_chunks[..., None] * chunk + mx.arange(chunk)).reshape(*lead, TOPK * chunk)
    else:  # a small vocabulary: every token is a candidate
        cand, cand_ids = logits, mx.broadcast_to(mx.arange(V), logits.shape)
    best = mx.argpartition(-cand, k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(cand, best, axis=-1)
    ids = mx.take_along_axis(cand_ids, best, axis=-1)
    pk = mx.exp(vals - mx.logsumexp(logits, axis=-1, keepdims=True))
    order = mx.argsort(-pk, axis=-1)
    ids, pk = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(pk, order, axis=-1)
    if k < TOPK:  # the store's arrays are TOPK wide
        ids = mx.concatenate([ids, mx.zeros((*lead, TOPK - k), dtype=mx.int32)], axis=-1)
        pk = mx.concatenate([pk, mx.zeros((*lead, TOPK - k), dtype=pk.dtype)], axis=-1)
    return ids, pk


STREAM_ARRAYS = ("tokens", "category", "taps", "topk_ids", "topk_probs")
STREAM_FORMAT = "mlxspec-stream-2"  # 1: taps float16 (overflows on Gemma), 2: taps bfloat16 bits


def taps_to_store(tp: mx.array) -> np.ndarray:
    """Target taps as stored: bfloat16 bit patterns in a uint16 array (numpy has no bfloat16).

    Not float16: Gemma's residual stream has channels past float16's 65504 (measured on
    Gemma-3-270M, taps 9 and 13: about 2.6 values per million were inf in float16, and one
    inf makes every loss NaN). bfloat16 keeps float32's range at float16's size.
    Non-finite taps are refused here, where they enter the store, so a format-2 store
    never needs scanning when it is read."""
    if not mx.isfinite(tp).all().item():
        raise MlxspecError("the target's hidden states at the tapped layers hold inf/NaN; its forward "
                           "overflows: run the target in float32 (the CPU default) and prepare the data again")
    return np.asarray(tp.astype(mx.bfloat16).view(mx.uint16))


def taps_from_store(a: np.ndarray) -> mx.array:
    """Stored taps as float32: uint16 arrays hold bfloat16 bits (format 2), float16
    arrays are format-1 stores."""
    if a.dtype == np.uint16:
        return mx.array(a).view(mx.bfloat16).astype(mx.float32)
    return mx.array(a).astype(mx.float32)


def check_finite_taps(path, taps: np.ndarray, chunk: int = 64) -> None:
    """Refuse a float16 store (format 1, or older .npz shards) whose taps hold inf/NaN: a
    target whose activations overflow float16, and one such value turns every training loss
    into NaN. Format-2 (bfloat16) stores were checked as they were written (`taps_to_store`)."""
    if taps.dtype != np.float16:
        return
    bad = 0
    for s in range(0, len(taps), chunk):
        a = np.asarray(taps[s : s + chunk])
        bad += int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise MlxspecError(f"{path}: {bad} stored tap values are inf/NaN (the target's activations overflowed "
                           "this store's float16); prepare the data again into a new --data directory "
                           "(this version stores taps as bfloat16)")


def corpus_plan(tokenizer, seq_len: int, tokens_per_category: dict[str, int], sources=None,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The corpus windows of a store, in its fixed order: (tokens int32 [N, L], category [N]).

    Each category's budget of `seq_len` windows is cut from the training split
    (`token_windows`), then all are shuffled together with `seed`, so any prefix is a mixed
    dataset. `prepare_shards` writes this order; the online source (`train.online`) reads it."""
    files = corpus_files(sources, "train")
    windows, cats = [], []
    for cat, budget in tokens_per_category.items():
        w = token_windows([f for f in files if f.category == cat], tokenizer, seq_len, budget, seed)
        windows.append(w.reshape(-1, seq_len))
        cats += [cat] * len(w)
    tokens = np.concatenate(windows)
    if len(tokens) == 0:
        raise MlxspecError(f"the training corpus gave no window of {seq_len} tokens; check the corpus sources "
                           "(scripts/setup.sh installs python3.11-doc) or pass a smaller --seq-len")
    order = np.random.default_rng(seed).permutation(len(tokens))
    return tokens[order], np.asarray(cats)[order]


def target_pass(target, tokens: np.ndarray, taps: list[int]) -> dict[str, np.ndarray]:
    """What a store holds for windows `tokens` [b, L]: one batched causal prefill gives every
    position's taps and the target's next-token top-k. Returns the stored arrays: taps
    [b, L, T*H] uint16 (bfloat16 bits, `taps_to_store`), topk_ids [b, L, K] int32, topk_probs
    [b, L, K] float16. `prepare_shards` writes them to disk; the online source
    (`train.online`) feeds them to the training step directly."""
    hid, tp = target.forward_hidden(mx.array(np.asarray(tokens)), taps)
    ids, pk = next_token_topk(target.lm_head(hid))
    mx.eval(tp, ids, pk)
    return {"taps": taps_to_store(tp), "topk_ids": np.asarray(ids),
            "topk_probs": np.asarray(pk.astype(mx.float16))}


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def prepare_shards(
    target,
    tokenizer,
    out_dir: str | os.PathLike,
    taps: list[int],
    seq_len: int = 256,
    tokens_per_category: dict[str, int] | None = None,
    batch: int = 16,
    sources=None,
    seed: int = 0,
    max_seconds: float | None = None,
    log=None,
) -> Path:
    """Run the target over corpus windows; stream taps + labels into one resumable store.

    Throughput (measured on 2 cores, OpenBLAS, SmolLM2-135M float32; model card): one
    batched causal prefill of [batch, seq_len] gives every position's taps and the
    target's next-token distribution at once, so no decode loop is needed. The top-K
    comes from `mx.topk` on the logits plus one logsumexp (a softmax + argpartition over
    the 49k vocabulary cost more than half the forward).

    Layout of `out_dir` (numpy .npy files, memory-mapped while writing and reading):
      tokens [N, L] int32, category [N] str (written first, they are cheap),
      taps [N, L, T*H] uint16 (bfloat16 bits, read with `taps_from_store`),
      topk_ids [N, L, K] int32, topk_probs [N, L, K] float16,
      meta.json (settings), progress.json {"done": n}: rows < n are complete.
    Windows are in a fixed shuffled order (categories interleaved), so any prefix is a
    valid, mixed dataset; rerunning the same command resumes at `done`. Different
    settings on an existing store are refused.
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokens_per_category = tokens_per_category or DEFAULT_BUDGET
    settings = {"format": STREAM_FORMAT, "taps": list(taps), "seq_len": seq_len, "topk": TOPK,
                "budget": tokens_per_category, "seed": seed, "model": str(getattr(target.info, "source", "")),
                "sources": sources or DEFAULT_SOURCES}
    meta_p, prog_p = out / "meta.json", out / "progress.json"
    if meta_p.exists():
        old = json.loads(meta_p.read_text())
        diff = [k for k in settings if old.get(k) != settings[k]]
        if diff:
            raise MlxspecError(f"{out}: holds training data prepared with other settings ({', '.join(diff)}); "
                               "pass a new --data directory (or the original settings to resume)")
        tokens = np.load(out / "tokens.npy", mmap_mode="r")
    else:
        plan, cats = corpus_plan(tokenizer, seq_len, tokens_per_category, sources, seed)
        np.save(out / "tokens.npy", plan)
        np.save(out / "category.npy", cats)
        tokens = np.load(out / "tokens.npy", mmap_mode="r")
        n, TH = len(tokens), len(taps) * target.info.hidden_size
        from numpy.lib.format import open_memmap

        open_memmap(out / "taps.npy", "w+", np.uint16, (n, seq_len, TH)).flush()
        open_memmap(out / "topk_ids.npy", "w+", np.int32, (n, seq_len, TOPK)).flush()
        open_memmap(out / "topk_probs.npy", "w+", np.float16, (n, seq_len, TOPK)).flush()
        _write_json_atomic(prog_p, {"done": 0, "seconds": 0.0})
        _write_json_atomic(meta_p, {**settings, "windows": n})
    prog = json.loads(prog_p.read_text())
    done, spent = int(prog["done"]), float(prog.get("seconds", 0.0))
    n = len(tokens)
    taps_mm = np.load(out / "taps.npy", mmap_mode="r+")
    ids_mm = np.load(out / "topk_ids.npy", mmap_mode="r+")
    p_mm = np.load(out / "topk_probs.npy", mmap_mode="r+")
    bar = tqdm(total=n * seq_len, initial=done * seq_len, unit="tok", unit_scale=True,
               desc="target taps", disable=None, smoothing=0.1)
    t_start = time.time()
    while done < n:
        t0 = time.time()
        e = min(n, done + batch)
        rows = target_pass(target, np.asarray(tokens[done:e]), taps)
        taps_mm[done:e] = rows["taps"]
        ids_mm[done:e] = rows["topk_ids"]
        p_mm[done:e] = rows["topk_probs"]
        for m in (taps_mm, ids_mm, p_mm):
            m.flush()
        spent += time.time() - t0
        bar.update((e - done) * seq_len)
        done = e
        _write_json_atomic(prog_p, {"done": done, "seconds": spent})
        if max_seconds is not None and time.time() - t_start >= max_seconds:
            break  # after at least one batch, so every call makes progress
    bar.close()
    return out


def stream_progress(path: str | os.PathLike) -> tuple[int, int, float]:
    """(windows done, windows planned, target seconds spent) of a streamed store."""
    p = Path(path)
    prog = json.loads((p / "progress.json").read_text())
    return int(prog["done"]), int(json.loads((p / "meta.json").read_text())["windows"]), float(prog["seconds"])


def load_shards(path: str | os.PathLike, max_windows: int | None = None, first: int = 0) -> dict[str, np.ndarray]:
    """Training data as arrays: a streamed store (memory-mapped, its completed rows only)
    or the older directory of `shard_XXXX.npz` files. `first`: skip the store's first windows
    (`--data DIR@N`); `max_windows` then counts from there."""
    out = _load_shards(path)
    n = len(out["tokens"])
    if first >= n:
        raise MlxspecError(f"--data {path}@{first}: the store holds {n} completed windows, none from window {first} on; "
                           f"prepare more (mlxspec train --prepare-only --data {path}) or pass a smaller N")
    stop = n if max_windows is None else min(n, first + max_windows)
    out = {k: v[first:stop] for k, v in out.items()} if (first or stop < n) else out
    check_finite_taps(path, out["taps"])  # the windows to be read
    return out


def _load_shards(path) -> dict[str, np.ndarray]:
    """A store's completed windows, not checked yet (`load_shards`)."""
    p = Path(path)
    if (p / "progress.json").exists():
        done = stream_progress(p)[0]
        if done == 0:
            raise MlxspecError(f"{path}: the training data store has no completed windows yet; "
                               "run `mlxspec train --prepare-only` on it first")
        out = {k: np.load(p / f"{k}.npy", mmap_mode="r")[:done] for k in STREAM_ARRAYS}
        for k in ("start", "end", "source"):  # regenerated stores (`mlxspec.train.regen`)
            if (p / f"{k}.npy").exists():
                out[k] = np.load(p / f"{k}.npy", mmap_mode="r")[:done]
        return out
    files = sorted(p.glob("shard_*.npz"))
    if not files:
        raise MlxspecError(f"{path}: no training shards; run `mlxspec train --prepare-only` (or any `mlxspec train`) first")
    parts = [dict(np.load(f)) for f in files]
    return {k: np.concatenate([q[k] for q in parts]) for k in parts[0]}


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
    if not (isinstance(prefix_len, int) and isinstance(gen_len, int) and prefix_len >= 1 and gen_len >= 1):
        raise MlxspecError(f"generated windows need a corpus prefix and a continuation of at least 1 token each "
                           f"(prefix_len {prefix_len!r}, gen_len {gen_len!r}); pass --prefix-len below --seq-len")
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
            tap_l.append(tp)
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
            taps=taps_to_store(mx.concatenate(tap_l, axis=1)),
            topk_ids=np.asarray(mx.concatenate(id_l, axis=1)).astype(np.int32),
            topk_probs=np.asarray(mx.concatenate(p_l, axis=1)),
            category=cats[s : s + b],
            start=np.full(b, prefix_len, np.int32),
        )
        shard += 1
    bar.close()
    return out
