"""Speculation for many sequences at once: one batched target verify per step.

`SpecBatch` runs B sequences (`Row`s). Each keeps what `generate_steps` keeps for one: its
own drafter and drafter state, its own adaptive verify policy (so its own verify length),
its own rng, stats and accepted counts. One step:
  1. every row drafts on its own and picks its own verify length (as `generate_steps`);
  2. the rows' blocks [anchor, d_1..d_n] are padded on the right to the longest and the
     target runs ONE forward over the [B, L] tokens (with taps);
  3. each row accepts with `accept_greedy` / `accept_sampled` (pure functions, per row) on
     its own rows of the logits, and commits;
  4. each row keeps only its committed positions: its length in the batch cache grows by
     accepted + 1 (exact per-row rollback; nothing is copied).

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

A step that is autoregressive for every row (no row can draft, or the budget's cap is 0) and
greedy decides the next step's cap at once and, when it is 0 again, starts the next forward on
this step's argmax before reading it (`mx.async_eval`, as mlx-lm's `BatchGenerator` does): the
graph building, the bookkeeping and the caller's work between steps overlap the compute.
Such a step commits exactly one token per row, so the next positions are known. Rows leaving
keep the started forward for the rows that stay; rows joining drop it (its writes sit past every
row's length, never read).

Batching needs plain KV caches (dense targets). Targets with sliding-window (rotating) or
recurrent layers are refused by `check_batchable` with one line; callers then run those one
sequence at a time through `generate_steps`, whose rollback is exact for every cache kind.

Each row's output is what it produces alone: greedy token for token, sampled with the same
rng draws in the same order. The batched forward is not bit-identical to a single one (the
GEMMs see more rows; attention sums over more masked slots), which moves logits by float
rounding only (tests/test_batch.py compares real prompts token for token).
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
from mlxspec.engine.policy import AcceptanceEstimate, Kind, LengthPolicy, compose, expected_tokens
from mlxspec.engine.step import Proposal, propose, record
from mlxspec.engine.verify import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    argmax_finite,
    argmax_lazy,
    check_finite,
    probs_from_logits,
    sample_token,
)
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


def _sums(points) -> list[float]:
    """Weighted least-squares sums [w, wR, wT, wR^2, wRT] over (R, T, w) points."""
    return [sum(w for _, _, w in points), sum(w * r for r, _, w in points), sum(w * t for _, t, w in points),
            sum(w * r * r for r, _, w in points), sum(w * r * t for r, t, w in points)]


def _line(w: float, x: float, y: float, xx: float, xy: float) -> tuple[float, float]:
    """The line T = a + b R (b >= 0) of least-squares sums -> (a, b)."""
    den = w * xx - x * x
    b = max((w * xy - x * y) / den if den > 1e-12 else 0.0, 0.0)
    return (y - b * x) / w, b


class VerifyBudget:
    """How many drafts each row may verify this step, chosen for the batch as a whole.

    A row's own policy prices its verify as if it ran alone, where a 9-token verify costs little
    more than a 1-token one (the weights are read once either way). In a batch the forward runs
    B x L rows and on a CPU it turns compute-bound: 8 rows x 9 tokens cost several 8-row steps.
    So before the rows draft, the batch picks one cap c on drafts per row maximising

        rate(c) = sum_b E(min(c, n_b)) / (T(B (1 + max_b min(c, n_b))) + drafting(c))

    with E the expected committed tokens (`policy.expected_tokens`, from the batch's running
    per-position acceptance), T(R) the forward cost of R block rows (the rows are padded to the
    longest block; a straight line fitted to the measured batched forwards, decayed, with the
    single-sequence verify profile's shape at their level as the prior) and
    drafting(c) the rows' measured drafting time (none at c = 0). c = 0 is a batched
    autoregressive step; while it wins, a probe step verifies one draft per row (c = 1, the
    cheapest step that measures the first draft, which decides whether c > 0 can pay; a
    probe at the best c cost 3.5 plain steps at B = 8 here), after `probe_every` steps, then
    after twice as many each time it changes nothing (up to `max_probe_every`), so the
    acceptance estimate can recover. A cap only truncates, and depends on history only, so
    output is unchanged (lossless under sampling too)."""

    def __init__(self, profile: dict[int, float], max_drafts: int, decay: float = 0.97, prior_weight: float = 2.0,
                 probe_every: int = 8, max_probe_every: int = 64):
        self.max_drafts, self.decay, self.probe_every = max_drafts, decay, probe_every
        self.max_probe_every, self.probe_interval = max_probe_every, probe_every
        self.acceptance = AcceptanceEstimate(max(max_drafts, 1))
        # the prior: the profile's points, as a shape. Its level is rescaled to the forwards
        # measured here (a profile from another moment of a drifting host, or from another
        # BLAS, can be several times off, and a line through it and a cluster of measured
        # points at one row count gets a slope of its error, not of the forward)
        prior = [(float(L), 1.0 / float(sps)) for L, sps in sorted(profile.items())]
        self.prior_line = _line(*_sums([(r, t, 1.0) for r, t in prior]))
        self.prior_sums = _sums([(r, t, prior_weight / len(prior)) for r, t in prior])  # cost() rescales its T sums
        self.obs = [0.0] * 5  # decayed weighted sums over the measured forwards: w, wR, wT, wR^2, wRT
        self.scale = [0.0, 0.0]  # decayed sums of measured seconds and of the prior line's seconds
        self.draft_time = None  # decayed mean seconds of one row's drafting
        self.since_drafts = 0

    def _prior_at(self, rows: float) -> float:
        a0, b0 = self.prior_line
        return max(a0 + b0 * rows, 1e-6)

    def cost(self, rows: float) -> float:
        """Predicted seconds of a batched forward over `rows` block rows: a line fitted to the
        measured forwards and the prior's points at the measured level."""
        s = self.scale[0] / self.scale[1] if self.scale[1] > 0 else 1.0
        level = (1.0, 1.0, s, 1.0, s)  # the prior's seconds at the measured level
        a, b = _line(*(o + f * p for o, f, p in zip(self.obs, level, self.prior_sums)))
        return max(a + b * rows, 1e-6)

    def observe_forward(self, rows: int, seconds: float) -> None:
        r = float(rows)
        self.obs = [v * self.decay for v in self.obs]
        for i, v in enumerate((1.0, r, seconds, r * r, r * seconds)):
            self.obs[i] += v
        self.scale = [self.scale[0] * self.decay + seconds, self.scale[1] * self.decay + self._prior_at(r)]

    def observe_row(self, verified: int, accepted: int, draft_seconds: float | None) -> None:
        if verified > 0:
            self.acceptance.observe(verified, accepted)
        if draft_seconds is not None and draft_seconds > 0:
            self.draft_time = draft_seconds if self.draft_time is None else 0.8 * self.draft_time + 0.2 * draft_seconds

    def cap(self, limits: list[int]) -> int:
        """The drafts per row to allow this step (rows' remaining limits given)."""
        top = min(max(limits, default=0), self.max_drafts)
        if top <= 0:
            return 0
        p = self.acceptance.p()
        dt = self.draft_time or 0.0
        best_c, best = 0, len(limits) / self.cost(len(limits))
        for c in range(1, top + 1):
            n = [min(c, x) for x in limits]  # the forward runs every row padded to the longest block
            r = sum(expected_tokens(p, k) for k in n) / (self.cost(len(n) * (1 + max(n))) + dt * sum(k > 0 for k in n))
            if r > best * (1 + 1e-9):
                best_c, best = c, r
        if best_c == 0:
            self.since_drafts += 1
            if self.since_drafts >= self.probe_interval:  # explore, then back off
                self.since_drafts = 0
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)
                return 1
        else:
            self.since_drafts, self.probe_interval = 0, self.probe_every
        return best_c


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


@dataclass(eq=False)
class _Ahead:
    """The next step, decided (its cap) and, when autoregressive, started (`SpecBatch._start_ahead`)
    for these rows at these lengths."""

    ids: list
    lens: list
    cap: int
    vlogits: mx.array | None = None
    vtaps: mx.array | None = None
    am: mx.array | None = None
    ok: mx.array | None = None
    t_sync: float = 0.0  # when the step that started it had its tokens
    t_return: float = 0.0  # and when it returned them

    def keep(self, rows: list[int]) -> "_Ahead":
        """The same for the batch's rows `rows` only (others left; one logits row per batch row)."""
        idx = mx.array(rows, dtype=mx.int32)
        return _Ahead([self.ids[i] for i in rows], [self.lens[i] for i in rows], self.cap,
                      *(None if a is None else a[idx] for a in (self.vlogits, self.vtaps, self.am)), self.ok,
                      self.t_sync, self.t_return)


class SpecBatch:
    """Rows speculating together over one target (see the module docstring).

    taps: the target layers the rows' drafters read (rows without a drafter ignore them).
    """

    def __init__(self, target: Target, taps: tuple = (), check_invariants: bool = True,
                 budget: VerifyBudget | None = None):
        """budget: a `VerifyBudget` capping every row's drafts by the batch's measured costs
        (from 2 rows on; alone, a row's own policy decides as in `generate_steps`)."""
        check_batchable(target)
        self.target = target
        self.taps = tuple(taps)
        self.check_invariants = check_invariants
        self.budget = budget
        self.cap: int | None = None  # the budget's cap of the last step (None: no cap)
        self.rows: list[Row] = []
        self._ahead: _Ahead | None = None  # the next step, when decided or started early
        self.pipelined = 0  # steps whose forward was started by the step before (`_start_ahead`)
        self.lens = _Lengths()
        self.layers = [RaggedKVCache(self.lens) for _ in range(target.info.num_layers)]

    def __len__(self) -> int:
        return len(self.rows)

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
        first = _pick(logits, row.sampling, row.rng)
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
        self._ahead = None  # the rows change: a next step decided or started for the old ones is dropped
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
        if self._ahead is not None:  # the next step's forward for the rows that stay stands
            self._ahead = self._ahead.keep(keep) if keep else None
        for layer in self.layers:
            layer.keep_rows(keep)
        self.rows = [self.rows[i] for i in keep]
        self.lens.set([self.lens.list[i] for i in keep])

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[tuple[Row, list[int]]]:
        """Draft, verify in one forward, accept and commit for every row -> [(row, committed)].

        Rows that end in this step (EOS, max_tokens) are marked `done` and stay in the batch
        until `remove` (so a caller can still `extract` their cache). A step that is
        autoregressive for every row starts the next one's forward before it returns when that
        one will be autoregressive too (`_start_ahead`)."""
        live = [r for r in self.rows if not r.done]
        if not live:
            return []
        if self.check_invariants:
            for r, n in zip(self.rows, self.lens.list):
                if not r.done:
                    _check(r, n)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.ids != [id(r) for r in self.rows] or ahead.lens != self.lens.list):
            ahead = None  # rows joined or left since (its writes sit past every row's length, unread)
        if ahead is not None:
            self.cap = ahead.cap  # decided when it was started, from the same history
        else:
            self.cap = None
            if self.budget is not None and len(live) > 1:
                self.cap = self.budget.cap(self._limits(live, 0))
        started = ahead is not None and ahead.vlogits is not None
        props = {id(r): self._propose(r, self.cap) for r in live}
        # padded block per row: [anchor, drafts..] then repeats of its last token
        blocks = [[r.anchor] + props[id(r)].drafts if not r.done else [r.anchor] for r in self.rows]
        L = max(len(b) for b in blocks)
        live_idx = [b for b, r in enumerate(self.rows) if not r.done]
        starts, rows_idx = {}, []
        for b in live_idx:
            starts[b] = len(rows_idx)
            rows_idx += range(b * L, b * L + len(blocks[b]))
        tv = time.perf_counter()
        if started:  # its logits hold one row per batch row (rows done since included)
            vlogits, vtaps = ahead.vlogits, ahead.vtaps
            starts = {b: b for b in live_idx}
            self.pipelined += 1
        else:
            vlogits, vtaps = self._forward(mx.array([b + [b[-1]] * (L - len(b)) for b in blocks]), rows_idx)
        am_of, p_of = {}, {}
        if any(self.rows[b].sampling.greedy for b in live_idx):
            am_arr, ok = (ahead.am, ahead.ok) if started else argmax_lazy(vlogits)
            if L == 1 and len(live_idx) == len(self.rows) and all(r.sampling.greedy for r in live):
                self._start_ahead(live, am_arr)  # before waiting for this step's tokens
            am = check_finite(am_arr, ok).tolist()
            am_of = {b: am[starts[b] : starts[b] + len(blocks[b])] for b in live_idx if self.rows[b].sampling.greedy}
        sampled = [b for b in live_idx if not self.rows[b].sampling.greedy]
        if sampled:
            ps = [probs_from_logits(vlogits[starts[b] : starts[b] + len(blocks[b])], self.rows[b].sampling)
                  for b in sampled]
            mx.eval(ps)
            p_of = dict(zip(sampled, ps))
        t_sync = time.perf_counter()
        # a forward started ahead ran from the last step's tokens on: its time is that step's
        # bookkeeping and this step's wait, not the caller's work between (which it overlapped,
        # however long that was; with a caller as quick as the server's, nearly the forward's)
        t_verified = t_sync - tv + (ahead.t_return - ahead.t_sync if started else 0.0)
        if self._ahead is not None:
            self._ahead.t_sync = t_sync
        if self.budget is not None:
            self.budget.observe_forward(len(blocks) * L, t_verified)  # the padded [B, L] the forward ran
        out, new_lens = [], list(self.lens.list)
        for b, r in enumerate(self.rows):
            if r.done:
                continue
            pr = props[id(r)]
            drafts = pr.drafts
            if r.sampling.greedy:
                a, nxt = accept_greedy(drafts, am_of[b])
            else:
                p_np = np.asarray(p_of[b])
                if drafts:
                    a, nxt = accept_sampled(drafts, np.asarray(pr.d.probs[: len(drafts)]), p_np[: len(drafts) + 1], r.rng)
                else:
                    a, nxt = 0, sample_token(p_np[0], r.rng)
            new_lens[b] += a + 1
            if self.budget is not None:
                self.budget.observe_row(len(drafts), a, pr.t_drafted if pr.source.kind is Kind.DRAFTER else None)
            r.drafter.accept([r.anchor] + drafts[:a], vtaps[b : b + 1, : a + 1] if vtaps is not None else None)
            out.append((r, self._commit(r, pr, a, nxt, t_verified, len(live))))
        self.lens.set(new_lens)
        if self._ahead is not None:
            self._ahead.t_return = time.perf_counter()
        return out

    def _limits(self, live: list[Row], ahead: int) -> list[int]:
        """Each row's most drafts for the step `ahead` steps from now (one token per step between)."""
        return [min(r.limit, r.max_tokens - r.produced - 1 - ahead) for r in live]

    def _forward(self, tokens: mx.array, rows_idx: list[int] | None):
        """The target over a [B, L] block at the rows' lengths -> (logits of the block rows
        `rows_idx` of the flattened B*L (None: all), taps), not evaluated. The forward runs to the
        final norm and the LM head only over the real rows (the head is a fifth of SmolLM2's
        forward; padding rows would pay it for nothing)."""
        govern()  # OpenBLAS's thread count follows the host's load (as Target.__call__ does)
        h, vtaps = self.target._run(lambda: self.target.inner(tokens, cache=self.layers), tokens, self.layers,
                                    self.taps, "hidden")
        flat = h.reshape(tokens.shape[0] * tokens.shape[1], h.shape[-1])
        whole = rows_idx is None or len(rows_idx) == flat.shape[0]
        return self.target.lm_head(flat if whole else flat[mx.array(rows_idx)]), vtaps

    def _start_ahead(self, live: list[Row], am: mx.array) -> None:
        """In an autoregressive step of every row (all greedy, none done): decide the next step's
        cap now, and if it is autoregressive too, start its forward on this step's argmax `am`
        (not evaluated yet), as mlx-lm's BatchGenerator does: the next tokens' compute then
        overlaps this step's bookkeeping and the caller's (the server streams this step's text
        meanwhile) instead of following it. Every row grows by exactly one token in such a step,
        so the next positions are known. A row that ends in this step leaves the batch before
        the next (its extra slot is never read; `remove` keeps the forward for the others)."""
        if all(r.max_tokens - r.produced <= 1 for r in live):
            return  # every row ends with this step's token: there is no next step
        if all(r.limit == 0 for r in live):
            cap = 0  # no row can draft (no drafter): every step is autoregressive
        elif self.budget is not None and len(live) > 1:
            cap = self.budget.cap(self._limits(live, 1))
        else:
            return  # a row's own policy decides from this step's outcome
        ids, lens = [id(r) for r in self.rows], [n + 1 for n in self.lens.list]
        if cap != 0:
            self._ahead = _Ahead(ids, lens, cap)  # the decision only: the next step drafts
            return
        saved = self.lens.list
        self.lens.set(lens)
        try:
            vlogits, vtaps = self._forward(am[:, None], None)
        finally:
            self.lens.set(saved)
        nam, ok = argmax_lazy(vlogits)
        mx.async_eval(nam, ok, *([vtaps] if vtaps is not None else []))
        self._ahead = _Ahead(ids, lens, 0, vlogits, vtaps, nam, ok)

    def _propose(self, r: Row, cap: int | None = None) -> Proposal:
        """Steps 1-2 of `generate_steps` for one row (`engine.step.propose`), at most `cap` drafts."""
        td = time.perf_counter()
        n = min(r.limit, r.max_tokens - r.produced - 1, r.limit if cap is None else cap)
        pr = propose(r.drafter, r.policy, r.anchor, n, r.sampling, r.rng, self.target.info.vocab_size)
        r.stats.draft_time += time.perf_counter() - td
        return pr

    def _commit(self, r: Row, pr: Proposal, a: int, nxt: int, t_verified: float, batch: int) -> list[int]:
        """Step 5 of `generate_steps` for one row (its drafter was fed already)."""
        drafts, s = pr.drafts, r.stats
        s.verify_time += t_verified
        # the row's share of the batched forward: what its verify length cost it
        record(s, r.policy, pr, a, t_verified / batch)
        committed = drafts[:a] + [nxt]
        for i, t in enumerate(committed):  # stop right after an EOS
            if t in r.eos_ids:
                committed = committed[: i + 1]
                break
        committed = committed[: r.max_tokens - r.produced]
        r.produced += len(committed)
        s.generated = r.produced
        s.gen_time = time.perf_counter() - r.t_gen
        r.anchor = committed[-1]
        if committed[-1] in r.eos_ids or r.produced >= r.max_tokens:
            r.done = True
        return committed


def _pick(logits: mx.array, sp: SamplingParams, rng) -> int:
    if sp.greedy:
        return int(argmax_finite(logits).item())
    p = probs_from_logits(logits[None], sp)
    return sample_token(np.asarray(p[0]), rng)


def _check(r: Row, n: int) -> None:
    if n != r.length:
        raise InvariantError(f"row's batch cache holds {n} positions, expected {r.length}")
    ctx = getattr(r.drafter, "ctx_len", None)
    if ctx is not None and ctx != n:
        raise InvariantError(f"row's drafter context holds {ctx} rows, its batch cache {n}")
