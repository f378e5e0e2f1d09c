"""Online training data: the target runs inside the training loop, no store on disk.

A store costs 5.8 kB per token (SmolLM2's five taps as bfloat16 plus the top-8), so 1e8
tokens would need 580 GB; online, each step takes the next corpus windows, runs the target
over them (`data.target_pass`, the prefill `prepare_shards` runs) and feeds the step the
arrays a store row would hold. The windows are `data.corpus_plan`'s (the training split, in
the store's fixed order); a run longer than the plan starts another pass over it.

Equal to offline training on a store prepared from the same windows with the same
`--data-batch`, read in order (`window_order="sequential"`): the target runs over the same
chunks of `batch` windows, aligned on the plan (chunk k = windows [k*batch, (k+1)*batch)),
so every array is bitwise the store's. The trainer's checkpoint records the cursor
(windows consumed) and the anchor sampler's state, so a resumed run continues with the
next unseen windows (only the rest of a partly read chunk is recomputed).
"""

from __future__ import annotations

import time

import numpy as np

from mlxspec.errors import MlxspecError
from mlxspec.train.data import DEFAULT_BUDGET, DEFAULT_SOURCES, STREAM_FORMAT, TOPK, corpus_plan, target_pass

ONLINE_KIND = "online-corpus"
VOCAB_WINDOWS = 64  # windows whose target top-1 choose the draft vocabulary (with every plan window's tokens)


class OnlineCorpus:
    """Corpus windows run through `target` as the trainer reads them (module docstring).

    `take(cursor, n)` gives windows cursor .. cursor+n-1 (modulo the plan, or its first
    `limit` windows) as a store's arrays; `target_tokens` / `target_seconds` count the
    target's work in this process."""

    def __init__(self, target, tokenizer, taps: list[int], seq_len: int = 256,
                 tokens_per_category: dict[str, int] | None = None, batch: int = 16, sources=None, seed: int = 0):
        if batch < 1:
            raise MlxspecError(f"online data: batch must be >= 1, got {batch}")
        self.target, self.taps, self.batch, self.seq_len = target, list(taps), int(batch), int(seq_len)
        self.budget = tokens_per_category or DEFAULT_BUDGET
        self.sources, self.seed = sources, seed
        self.tokens, self.category = corpus_plan(tokenizer, seq_len, self.budget, sources, seed)
        self.n = len(self.tokens)
        self.limit = self.n
        self._chunks: dict[int, dict] = {}
        self.target_tokens, self.target_seconds = 0, 0.0
        self.first_taken: int | None = None  # the first window this process took, and how many
        self.taken = 0

    def __getitem__(self, k):  # the plan's windows, as a store's "tokens" / "category"
        return {"tokens": self.tokens, "category": self.category}[k]

    def settings(self) -> dict:
        """What the windows depend on (a resumed run must match; `batch` only sets the chunks)."""
        return {"kind": ONLINE_KIND, "format": STREAM_FORMAT, "taps": self.taps, "seq_len": self.seq_len,
                "topk": TOPK, "budget": self.budget, "seed": self.seed,
                "model": str(getattr(self.target.info, "source", "")), "sources": self.sources or DEFAULT_SOURCES,
                "windows": self.limit}

    def set_limit(self, max_windows: int | None) -> None:
        """Read only the plan's first `max_windows` windows (`TrainConfig.max_windows`)."""
        self.limit = self.n if max_windows is None else max(1, min(self.n, int(max_windows)))

    def _chunk(self, k: int) -> dict:
        if k not in self._chunks:
            s, e = k * self.batch, min(self.n, (k + 1) * self.batch)
            t0 = time.time()
            # keep the previous chunk (a step may span two) and, from the vocabulary pass, the
            # chunks the next steps read: no window goes through the target twice
            keep = -(-min(self.limit, VOCAB_WINDOWS) // self.batch)
            self._chunks = {j: v for j, v in self._chunks.items() if 0 <= j - (k - 1) <= keep}
            self._chunks[k] = target_pass(self.target, self.tokens[s:e], self.taps)
            self.target_seconds += time.time() - t0
            self.target_tokens += (e - s) * self.seq_len
        return self._chunks[k]

    def take(self, cursor: int, n: int) -> dict[str, np.ndarray]:
        """Windows cursor .. cursor+n-1 (modulo `limit`) with their taps and top-k, as a store's arrays."""
        idx = [(cursor + r) % self.limit for r in range(n)]
        if self.first_taken is None:
            self.first_taken = idx[0]
        self.taken += n
        rows = {k: [] for k in ("taps", "topk_ids", "topk_probs")}
        for i in idx:
            c = self._chunk(i // self.batch)
            for k in rows:
                rows[k].append(c[k][i % self.batch])
        out = {k: np.stack(v) for k, v in rows.items()}
        out["tokens"] = self.tokens[idx]
        out["category"] = self.category[idx]
        return out

    def topk_sample(self) -> np.ndarray:
        """The target's top-k ids [m, L, k] on the plan's first m = min(limit, VOCAB_WINDOWS)
        windows (chunks kept for the steps that read them next): what EAGLE-3 training chooses
        its draft vocabulary from (`train.eagle3.StoreInOrder.topk_sample` for a store)."""
        m = min(self.limit, VOCAB_WINDOWS)
        return np.concatenate([self._chunk(k)["topk_ids"] for k in range(-(-m // self.batch))])[:m]

    def vocabulary_sample(self) -> dict[str, np.ndarray]:
        """What `start.draft_vocabulary` counts: the target's top-1 on the first
        VOCAB_WINDOWS windows of the plan (within `limit`), the tokens of every window.
        Equals a store of the same windows when it holds no more than VOCAB_WINDOWS."""
        return {"tokens": self.tokens[: self.limit], "topk_ids": self.topk_sample()[..., 0]}
