"""The server's prompt (prefix) cache: target KV caches plus the drafter's context, LRU.

An entry is what a finished request leaves behind: the tokens whose positions the target
cache holds (prompt + generated, minus the last anchor), that cache, and the drafter taps
of the same positions (a block drafter rebuilds its context from them in one cheap pass;
no target forward). A new request takes the entry with the longest common prefix, a deep
copy of its cache trimmed to that prefix, and prefills only the rest.

- Entries are never mutated: `fetch` hands out a deep copy (`copy.deepcopy`, as mlx-lm's
  server does; MLX arrays copy their data), and an entry takes over the cache of a request
  that has finished with it.
- Memory is bounded by `max_bytes` (the bytes the caches' buffers and the taps hold), least
  recently used first out. An entry larger than the limit is not kept.
- Cache kinds: any mlx-lm cache layer. A cache that cannot be trimmed (`is_trimmable()`
  False) is reused only when the entry is a whole prefix of the new prompt.
- Only used from the generation thread (no locking).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxspec.targets.model import cache_length, trim_cache


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else n


def cache_nbytes(cache: list) -> int:
    total = 0
    for c in cache:
        try:
            total += int(c.nbytes)
        except Exception:  # a cache kind without nbytes: count its state arrays
            st = c.state
            arrs = st if isinstance(st, (list, tuple)) else [st]
            total += sum(int(a.nbytes) for a in arrs if isinstance(a, mx.array))
    return total


def trimmable(cache: list) -> bool:
    return all(getattr(c, "is_trimmable", lambda: False)() for c in cache)


def compact(cache: list) -> None:
    """Drop the unused tail of KVCache buffers (they grow in steps of 256 positions)."""
    arrs = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None and c.offset < c.keys.shape[2]:
            c.keys = mx.contiguous(c.keys[..., : c.offset, :])
            c.values = mx.contiguous(c.values[..., : c.offset, :])
            arrs += [c.keys, c.values]
    if arrs:
        mx.eval(*arrs)


@dataclass
class Entry:
    tokens: list
    cache: list
    taps: mx.array | None  # [1, len(tokens), T*H] or None (drafter without taps)
    nbytes: int
    trimmable: bool


@dataclass
class Hit:
    cache: list  # a private copy holding `n` tokens
    n: int
    taps: mx.array | None  # taps of those n tokens (None when not needed)


class PromptCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self):
        return len(self.entries)

    def fetch(self, prompt: list[int], need_taps: bool) -> Hit | None:
        """The longest usable cached prefix of `prompt` (at least one prompt token is left to
        prefill), as a private copy; None when nothing is reusable."""
        best, best_n = None, 0
        for key, e in self.entries.items():
            if need_taps and e.taps is None:
                continue
            n = min(common_prefix(e.tokens, prompt), len(prompt) - 1)
            if n < len(e.tokens) and not e.trimmable:
                continue
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best)
        e = self.entries[best]
        cache = copy.deepcopy(e.cache)
        trim_cache(cache, len(e.tokens) - best_n)
        taps = e.taps[:, :best_n] if need_taps else None
        return Hit(cache, best_n, taps)

    def store(self, tokens: list[int], cache: list, taps: mx.array | None) -> bool:
        """Keep `cache` (which the caller hands over and no longer touches) for `tokens`."""
        if self.max_bytes <= 0 or not tokens or cache_length(cache) != len(tokens):
            return False
        if taps is not None:
            if taps.shape[1] != len(tokens):
                return False
            mx.eval(taps)
        for key, o in self.entries.items():  # already covered by a longer entry: refresh that one
            if (len(o.tokens) >= len(tokens) and o.trimmable and (o.taps is not None or taps is None)
                    and common_prefix(o.tokens, tokens) == len(tokens)):
                self.entries.move_to_end(key)
                return False
        compact(cache)
        if isinstance(getattr(cache, "log", None), list):
            cache.log.clear()  # a Target cache's undo log: an entry is never rolled back past its state
        nb = cache_nbytes(cache) + (int(taps.nbytes) if taps is not None else 0)
        if nb > self.max_bytes:
            return False
        e = Entry(list(tokens), cache, taps, nb, trimmable(cache))
        # An entry that is a prefix of the new one serves nothing the new one does not.
        for key in [k for k, o in self.entries.items()
                    if len(o.tokens) <= len(tokens) and e.trimmable and (taps is not None or o.taps is None)
                    and common_prefix(o.tokens, tokens) == len(o.tokens)]:
            self._drop(key)
        self.entries[self._next] = e
        self._next += 1
        self.nbytes += nb
        while self.nbytes > self.max_bytes and self.entries:
            self._drop(next(iter(self.entries)))
        return True

    def _drop(self, key):
        e = self.entries.pop(key)
        self.nbytes -= e.nbytes


class ContextDrafter:
    """Wraps the request's drafter for the engine: hands the cached prefix's taps to
    `begin` (the engine passes only the uncached part's) and records the tokens and taps
    that enter the target cache, so the finished request can become a cache entry."""

    def __init__(self, inner, prefix_tokens: list[int], prefix_taps: mx.array | None):
        self.inner = inner
        self.n_prefix = len(prefix_tokens)
        self.prefix_taps = prefix_taps
        self.tokens: list[int] = []
        self.tap_parts: list = []

    def __getattr__(self, name):  # taps, max_drafts, draft, ctx_len, ...
        return getattr(self.inner, name)

    def begin(self, prompt_ids, prompt_taps):
        self.tokens = list(prompt_ids)
        full = prompt_taps
        if prompt_taps is not None and self.n_prefix:
            full = mx.concatenate([self.prefix_taps.astype(prompt_taps.dtype), prompt_taps], axis=1)
        self.tap_parts = [full] if full is not None else []
        self.inner.begin(prompt_ids, full)

    def accept(self, tokens, taps):
        self.tokens.extend(int(t) for t in tokens)
        if taps is not None:
            self.tap_parts.append(taps)
        self.inner.accept(tokens, taps)

    def context_taps(self) -> mx.array | None:
        if not self.tap_parts:
            return None
        return self.tap_parts[0] if len(self.tap_parts) == 1 else mx.concatenate(self.tap_parts, axis=1)
