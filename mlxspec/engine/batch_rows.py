"""The batch's rows and their cache: who is in the batch, at which length, and how rows join
and leave between steps (`BatchRows`; `batch.SpecBatch` adds the step).

A `Row` keeps what `generate_steps` keeps for one sequence: its own drafter and drafter
state, its own adaptive verify policy, its own rng, stats and accepted counts.

The batched cache (`RaggedKVCache`, one per layer) holds the rows with per-row lengths: row
b's positions 0..len_b-1 sit at buffer slots 0..len_b-1, a step writes its block at slots
len_b.., and the mask lets query j of row b see slots <= len_b + j only, so the slots past a
row's length (another row's longer history, padding, rejected drafts) are never read.
mlx-lm's `BatchKVCache` left-pads instead: rows share one end slot, so after a step where
rows keep different numbers of tokens every row but the longest would have to be shifted
right (a copy of its whole cache, every step) or carry holes in a per-row mask. Per-row
lengths make rollback free and let a row's prompt be copied in once, at its join.

Sequences join between steps: `add` prefills one prompt alone, in a cache of its own as
`generate_steps` does (a prompt cache can keep it), `add_many` prefills several, each from
its own cached prefix if it has one, in one forward; then their K/V are copied into the
batch, one concatenation per layer. Finished or removed rows leave between steps (`remove`; `extract`
gives a row's cache back as a single-sequence `TargetCache`).

Batching needs plain KV caches (dense targets). Targets with sliding-window (rotating) or
recurrent layers are refused by `check_batchable` with one line; callers then run those one
sequence at a time through `generate_steps`, whose rollback is exact for every cache kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from mlxspec.blas import govern
from mlxspec.engine.drafting import Drafter, NoDrafter
from mlxspec.engine.loop import InvariantError, SpecStats
from mlxspec.engine.policy import LengthPolicy, compose
from mlxspec.engine.verify import SamplingParams, pick_token
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import Target, cache_length
from mlxspec.targets.rollback import TargetCache

STEP = 256  # batch buffers grow in whole steps of slots, as mlx-lm's KVCache does


def _slots(n: int) -> int:
    """Buffer slots for n positions: n rounded up to whole STEPs."""
    return (n + STEP - 1) // STEP * STEP


def check_batchable(target: Target) -> None:
    """Raise one line unless every layer of the target has a plain KV cache."""
    kinds = target.make_cache().kinds
    if any(k != "kv" for k in kinds) or any(type(c).__name__ != "KVCache" for c in target.make_cache()):
        other = sorted({type(c).__name__ for c in target.make_cache() if type(c).__name__ != "KVCache"})
        raise MlxspecError(
            f"model_type '{target.info.model_type}' has {', '.join(other)} layers: batched speculation needs plain "
            "KV caches, so its sequences run one at a time")


class _Lengths:
    """Per-row lengths shared by every layer's cache: a Python list (the batch's bookkeeping)
    and its mx.array (RoPE offsets, masks, write positions)."""

    def __init__(self):
        self.list: list[int] = []
        self.array = mx.zeros((0,), dtype=mx.int32)

    def set(self, lengths: list[int]) -> None:
        self.list = [int(x) for x in lengths]
        self.array = mx.array(self.list, dtype=mx.int32)


class RaggedKVCache:
    """One layer's K/V for B rows of different lengths (see the module docstring). The
    batch moves the lengths; a forward only writes its block at each row's length."""

    def __init__(self, lengths: _Lengths):
        self.lens = lengths
        self.keys: mx.array | None = None  # [B, n_kv, capacity, head_dim]
        self.values: mx.array | None = None

    @property
    def offset(self):
        """The RoPE position of each row's first new token: one int when the rows are level
        (then every op is the one mlx-lm's KVCache runs, bit for bit at B = 1)."""
        lens = self.lens.list
        return lens[0] if min(lens) == max(lens) else self.lens.array

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        L = keys.shape[2]
        lens = self.lens.list
        end = max(lens) + L
        if self.keys is None or end > self.keys.shape[2]:
            self._grow(end, keys, values)
        if min(lens) == max(lens):
            p = lens[0]
            self.keys[..., p : p + L, :] = keys
            self.values[..., p : p + L, :] = values
        else:
            idx = (self.lens.array[:, None] + mx.arange(L, dtype=mx.int32))[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)
            self.values = mx.put_along_axis(self.values, idx, values, axis=2)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, end: int, keys, values):
        cap = _slots(end)
        B, H, _, D = keys.shape
        new = [mx.zeros((B, H, cap, a.shape[3]), a.dtype) for a in (keys, values)]
        if self.keys is not None:
            old = self.keys.shape[2]
            new = [mx.concatenate([o, n[:, :, old:]], axis=2) for o, n in zip((self.keys, self.values), new)]
        self.keys, self.values = new

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs) -> mx.array:
        """[B, 1, N, S]: query j of row b (position len_b + j) sees slots 0..len_b + j. Level rows
        get mlx-lm's own causal mask (None for one token, "causal" for a block)."""
        lens = self.lens.list
        if min(lens) == max(lens):
            return create_attention_mask(N, lens[0], return_array, window_size)
        S = max(lens) + N
        q = self.lens.array[:, None] + mx.arange(N, dtype=mx.int32)  # [B, N]
        mask = mx.arange(S, dtype=mx.int32)[None, None, :] <= q[:, :, None]
        if window_size is not None:
            mask = mask & (mx.arange(S, dtype=mx.int32)[None, None, :] > q[:, :, None] - window_size)
        return mask[:, None]

    # -- rows joining and leaving (between steps) -----------------------------------
    def append_rows(self, keys: mx.array, values: mx.array, capacity: int) -> None:
        """Add rows ([b, n_kv, C, hd]; each row's slots past its length are never read) with
        room for `capacity` slots at least: one concatenation, whatever b is."""
        cap = max(capacity, self.keys.shape[2] if self.keys is not None else keys.shape[2])

        def fit(a):
            a = a[:, :, :cap]
            return mx.pad(a, [(0, 0), (0, 0), (0, cap - a.shape[2]), (0, 0)]) if a.shape[2] < cap else a

        k, v = fit(keys), fit(values)
        if self.keys is None:
            self.keys, self.values = k, v
            return
        self.keys = mx.concatenate([fit(self.keys), k], axis=0)
        self.values = mx.concatenate([fit(self.values), v], axis=0)

    def keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.keys = self.values = None
            return
        idx = mx.array(rows, dtype=mx.int32)
        self.keys, self.values = self.keys[idx], self.values[idx]


@dataclass(eq=False)
class Row:
    """One sequence of the batch: `generate_steps`' per-request state."""

    prompt_ids: list[int]
    drafter: Drafter
    sampling: SamplingParams
    rng: np.random.Generator
    eos_ids: frozenset
    max_tokens: int
    limit: int  # most drafts per step
    policy: LengthPolicy | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    tag: object = None  # the caller's (the server's job)
    anchor: int = -1
    produced: int = 0
    done: bool = False
    t_gen: float = 0.0

    @property
    def length(self) -> int:
        """Target positions this row's cache holds (prompt + generated - 1)."""
        return len(self.prompt_ids) + self.produced - 1


class BatchRows:
    """The rows of a batch over one target and their ragged cache: rows join (`add`, `add_many`)
    and leave (`extract`, `remove`) between steps; `batch.SpecBatch` steps them.

    taps: the target layers the rows' drafters read (rows without a drafter ignore them).
    """

    def __init__(self, target: Target, taps: tuple = (), check_invariants: bool = True):
        check_batchable(target)
        self.target = target
        self.taps = tuple(taps)
        self.check_invariants = check_invariants
        self.rows: list[Row] = []
        self.lens = _Lengths()
        self.layers = [RaggedKVCache(self.lens) for _ in range(target.info.num_layers)]

    def __len__(self) -> int:
        return len(self.rows)

    def _rows_changed(self, keep: list[int] | None) -> None:
        """Before the rows change: `keep` the indices of the rows that stay (None: rows join).
        What a subclass holds for the old rows is updated here (`SpecBatch`'s next step)."""

    def check_rows(self) -> None:
        """Raise `InvariantError` unless every live row's cache and drafter context hold the
        positions its count of tokens says."""
        for r, n in zip(self.rows, self.lens.list):
            if not r.done:
                _check(r, n)

    # -- joining ------------------------------------------------------------------------
    def _row(self, prompt_ids: list[int], *, drafter: Drafter | None = None, max_tokens: int = 256,
             sampling: SamplingParams = SamplingParams(), seed: int | None = 0,
             eos_ids: set[int] | frozenset = frozenset(), policy: LengthPolicy | None = None, tag=None) -> Row:
        """A joining sequence's row (checked; not prefilled yet). Arguments as `generate_steps`'."""
        drafter = drafter or NoDrafter()
        if tuple(drafter.taps) not in ((), self.taps):
            raise ValueError(f"the drafter reads taps {tuple(drafter.taps)}, the batch {self.taps}")
        if not prompt_ids:
            raise ValueError("empty prompt")
        return Row(list(prompt_ids), drafter, sampling, np.random.default_rng(seed), frozenset(eos_ids), max_tokens,
                   drafter.max_drafts, compose(policy), tag=tag)

    def _start_row(self, row: Row, logits: mx.array, ptaps, prompt_time: float) -> list[int]:
        """After its prefill: the row's first token and its drafter's context -> [first token].
        A row done already (EOS, max_tokens 1) is marked `done` and does not join; the caller
        copies the joining rows' K/V in (`_join`)."""
        first = pick_token(logits, row.sampling, row.rng)
        row.stats.prompt_tokens, row.stats.prompt_time = len(row.prompt_ids), prompt_time
        row.drafter.begin(list(row.prompt_ids), ptaps)
        row.t_gen = time.perf_counter()
        row.stats.generated = row.produced = 1
        row.anchor = first
        if first in row.eos_ids or row.max_tokens <= 1:
            row.done = True
        return [first]

    def _join(self, rows: list[Row], keys: list, values: list, ns: list[int]) -> None:
        """Copy joining rows in: per layer, keys/values [len(rows), n_kv, >= max(ns), hd], row i's
        first ns[i] slots its positions; ONE concatenation per layer for all of them (one per
        row would copy the growing batch once per row)."""
        if not rows:
            return
        self._rows_changed(None)  # a next step decided or started for the old rows is dropped
        cap = _slots(max(ns + self.lens.list))  # later steps grow it (`_grow`)
        for layer, k, v in zip(self.layers, keys, values):
            layer.append_rows(k, v, cap)
        self.rows += rows
        self.lens.set(self.lens.list + list(ns))

    def add(self, prompt_ids: list[int], *, cache: list | None = None, **kw) -> tuple[Row, list[int]]:
        """Prefill one sequence alone and join it to the batch -> (row, [first token]).

        Keyword arguments as `generate_steps`' (drafter, max_tokens, sampling, seed, eos_ids,
        policy) and the caller's `tag`; `cache` may hold a prefix of the prompt (the server's
        prompt cache) and is consumed. A row that is done after its first token (EOS,
        max_tokens 1) does not join."""
        row = self._row(prompt_ids, **kw)
        cache = self.target.make_cache() if cache is None else cache
        n_cached = cache_length(cache)
        if n_cached >= len(prompt_ids):
            raise ValueError(f"the cache holds {n_cached} tokens; at least one of the {len(prompt_ids)} "
                             "prompt tokens must remain to prefill")
        t0 = time.perf_counter()
        logits, ptaps = self.target(mx.array([prompt_ids[n_cached:]]), cache, taps=tuple(row.drafter.taps),
                                    logits="last")
        logits = logits[0, -1]
        mx.eval(logits)
        first = self._start_row(row, logits, ptaps, time.perf_counter() - t0)
        if not row.done:
            self._join([row], [c.keys for c in cache], [c.values for c in cache], [cache_length(cache)])
        return row, first

    def add_many(self, requests: list[dict]) -> list[tuple[Row, list[int]]]:
        """Prefill several sequences in ONE batched forward and join them -> [(row, [first token])].

        Each request holds `add`'s keyword arguments (prompt_ids, drafter, max_tokens, sampling,
        seed, eos_ids, policy, tag, and optionally `cache`, a prefix of its prompt: the server's
        prompt cache). The rows start at their cached lengths (per-row lengths, as in a step) and
        the uncached rest of each prompt is padded on the right (causal: a row's padding comes
        after its tokens and is never read); each row's first token comes from its own last
        prompt position, and its K/V are copied into the batch with the others' in one
        concatenation per layer. One forward over B prompts costs far less than B forwards on a
        CPU (the weights are read once; mlx-lm's server prefills its waiting prompts the same
        way). Unlike `add`, a `cache` is read, not extended: a row done at its first token (EOS,
        max_tokens 1) leaves nothing to store."""
        if len(requests) <= 1:
            return [self.add(**r) for r in requests]
        caches = [r.get("cache") for r in requests]
        rows = [self._row(**{k: v for k, v in r.items() if k != "cache"}) for r in requests]
        cached = [cache_length(c) if c is not None else 0 for c in caches]
        for row, n in zip(rows, cached):
            if n >= len(row.prompt_ids):
                raise ValueError(f"the cache holds {n} tokens; at least one of the {len(row.prompt_ids)} "
                                 "prompt tokens must remain to prefill")
        rest = [r.prompt_ids[n:] for r, n in zip(rows, cached)]
        B, S = len(rows), max(len(p) for p in rest)
        taps = self.taps if any(tuple(r.drafter.taps) for r in rows) else ()
        t0 = time.perf_counter()
        govern()
        tokens = mx.array([p + [p[-1]] * (S - len(p)) for p in rest])
        lens = _Lengths()
        lens.set(cached)
        fresh = [RaggedKVCache(lens) for _ in self.layers]
        if any(cached):  # the cached prefixes, one buffer per layer, each row at slots 0..n-1
            cap = _slots(max(cached) + S)
            ref = next(c for c in caches if c is not None and cache_length(c))
            for i, layer in enumerate(fresh):
                for name in ("keys", "values"):
                    like = getattr(ref[i], name)  # (shape and dtype for the rows without a prefix)
                    setattr(layer, name, mx.concatenate(
                        [mx.pad(getattr(c[i], name)[:, :, :n], [(0, 0), (0, 0), (0, cap - n), (0, 0)]) if n
                         else mx.zeros((1, like.shape[1], cap, like.shape[3]), like.dtype)
                         for c, n in zip(caches, cached)], axis=0))
        h, ptaps = self.target._run(lambda: self.target.inner(tokens, cache=fresh), tokens, fresh, taps, "hidden")
        last = h[mx.arange(B), mx.array([len(p) - 1 for p in rest])]  # [B, H]: each row's last position
        logits = self.target.lm_head(last)
        mx.eval(logits, *([ptaps] if ptaps is not None else []))
        elapsed = time.perf_counter() - t0
        out = []
        for b, (row, p) in enumerate(zip(rows, rest)):
            first = self._start_row(row, logits[b], ptaps[b : b + 1, : len(p)] if tuple(row.drafter.taps) else None,
                                    elapsed)
            out.append((row, first))
        joining = [b for b, r in enumerate(rows) if not r.done]
        if joining:
            idx = None if len(joining) == B else mx.array(joining)  # (no gather when every row joins)
            self._join([rows[b] for b in joining], [c.keys if idx is None else c.keys[idx] for c in fresh],
                       [c.values if idx is None else c.values[idx] for c in fresh],
                       [cached[b] + len(rest[b]) for b in joining])
        return out

    # -- leaving --------------------------------------------------------------------------
    def extract(self, row: Row) -> TargetCache:
        """A single-sequence copy of the row's cache (its `length` positions)."""
        b = self.rows.index(row)
        n = self.lens.list[b]
        out = []
        for layer in self.layers:
            c = KVCache()
            c.keys = mx.contiguous(layer.keys[b : b + 1, :, :n])
            c.values = mx.contiguous(layer.values[b : b + 1, :, :n])
            c.offset = n
            out.append(c)
        mx.eval([x for c in out for x in (c.keys, c.values)])
        tc = TargetCache(out)
        tc.length = n
        return tc

    def remove(self, rows) -> None:
        """Drop rows from the batch (finished, cancelled) between steps."""
        gone = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        self._rows_changed(keep)  # the next step's forward for the rows that stay stands
        for layer in self.layers:
            layer.keep_rows(keep)
        self.rows = [self.rows[i] for i in keep]
        self.lens.set([self.lens.list[i] for i in keep])


def _check(r: Row, n: int) -> None:
    if n != r.length:
        raise InvariantError(f"row's batch cache holds {n} positions, expected {r.length}")
    ctx = getattr(r.drafter, "ctx_len", None)
    if ctx is not None and ctx != n:
        raise InvariantError(f"row's drafter context holds {ctx} rows, its batch cache {n}")
