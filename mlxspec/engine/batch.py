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

The rows, their ragged cache (per-row lengths: exact per-row rollback at no cost) and their
joining and leaving between steps are `batch_rows.BatchRows`; this module is the step and
what decides it (`VerifyBudget`).

A step that is autoregressive for every row (no row can draft, or the budget's cap is 0) and
greedy decides the next step's cap at once and, when it is 0 again, starts the next forward on
this step's argmax before reading it (`mx.async_eval`, as mlx-lm's `BatchGenerator` does): the
graph building, the bookkeeping and the caller's work between steps overlap the compute.
Such a step commits exactly one token per row, so the next positions are known. Rows leaving
keep the started forward for the rows that stay; rows joining drop it (its writes sit past every
row's length, never read).

Batching needs plain KV caches (dense targets). Targets with sliding-window (rotating) or
recurrent layers are refused by `batch_rows.check_batchable` with one line; callers then run those one
sequence at a time through `generate_steps`, whose rollback is exact for every cache kind.

Each row's output is what it produces alone: greedy token for token, sampled with the same
rng draws in the same order. The batched forward is not bit-identical to a single one (the
GEMMs see more rows; attention sums over more masked slots), which moves logits by float
rounding only (tests/test_batch.py compares real prompts token for token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxspec.blas import govern
from mlxspec.engine.batch_rows import BatchRows, Row
from mlxspec.engine.policy import AcceptanceEstimate, Kind, expected_tokens
from mlxspec.engine.step import Proposal, propose, record
from mlxspec.engine.verify import (
    accept_greedy,
    accept_sampled,
    argmax_lazy,
    check_finite,
    sample_token,
    target_probs,
)
from mlxspec.targets import host_rope
from mlxspec.targets.model import Target


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

class SpecBatch(BatchRows):
    """Rows speculating together over one target (see the module docstring).

    taps: the target layers the rows' drafters read (rows without a drafter ignore them).
    """

    def __init__(self, target: Target, taps: tuple = (), check_invariants: bool = True,
                 budget: VerifyBudget | None = None):
        """budget: a `VerifyBudget` capping every row's drafts by the batch's measured costs
        (from 2 rows on; alone, a row's own policy decides as in `generate_steps`)."""
        super().__init__(target, taps, check_invariants)
        self.budget = budget
        self.cap: int | None = None  # the budget's cap of the last step (None: no cap)
        self._ahead: _Ahead | None = None  # the next step, when decided or started early
        self.pipelined = 0  # steps whose forward was started by the step before (`_start_ahead`)

    def _rows_changed(self, keep: list[int] | None) -> None:
        # rows joining drop the next step decided or started for the old rows (its writes sit
        # past every row's length, never read); rows leaving keep its forward for the others
        if self._ahead is not None:
            self._ahead = self._ahead.keep(keep) if keep else None

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
            self.check_rows()
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
            p_of = {b: target_probs(vlogits[starts[b] : starts[b] + len(blocks[b])], self.rows[b].sampling)
                    for b in sampled}
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
        with host_rope.installed():  # RoPE at each row's own offset and RMSNorm as single ops, MLX's bits
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
