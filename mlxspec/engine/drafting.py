"""Drafters behind one small interface (llama.cpp `common/speculative.cpp`'s shape).

The decode loop (`mlxspec.engine.loop`) only sees this protocol:

    taps: tuple[int, ...]     # target layers whose outputs the drafter conditions on
    max_drafts: int           # most drafts one call can return
    proposes_model_drafts     # draft() runs a model (False: its draft() is prompt lookup)
    has_lookup                # lookup(anchor, n) -> (tokens, n-gram length) offers prompt lookup too
    begin(prompt_ids, prompt_taps)   after the target's prefill
    draft(anchor, n, sp, rng) -> DraftOutput
    accept(tokens, taps)      the committed rows (anchor + accepted drafts) and their taps

Implementations: `BlockDrafter` (DFlash, DSpark and DFlash 2: one forward drafts the block,
plus the Markov chain for DSpark and the path selector's chain for DFlash 2), `SimpleDrafter` (a classic small draft model), and
`NoDrafter` (autoregressive); `mlxspec.engine.ngram` adds prompt lookup (`NgramDrafter`, and
`LookupBlockDrafter` beside a block drafter). The loop learns what a drafter proposes from the
two declarations (`proposals`), never from its type, so a wrapper that forwards them (the
server's `ContextDrafter`) is driven exactly like the drafter it wraps.
"""

from __future__ import annotations

import time

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlxspec import kernels
from mlxspec.drafters.config import Layout
from mlxspec.drafters.dflash2 import top_candidates
from mlxspec.drafters.model import DFlashModel
from mlxspec.engine.verify import SamplingParams, probs_from_logits, sample_token
from mlxspec.targets.load import default_dense
from mlxspec.targets.model import Target, target_head_rows, trim_cache


@dataclass
class DraftOutput:
    tokens: list  # target-vocabulary ids, len n
    probs: mx.array | np.ndarray | None  # [n, V_target] draft distributions (sampling only; read with np.asarray)
    confidence: list | None  # per-position confidences (DSpark's confidence head; EAGLE-3's draft probabilities)
    logits: mx.array | None = None  # [n, V_draft] Markov-corrected logits (debug/tests)


class Drafter(Protocol):
    name: str
    taps: tuple
    max_drafts: int
    proposes_model_drafts: bool  # optional, default True
    has_lookup: bool  # optional, default False; True: lookup(anchor, n) -> (tokens, match length)
    # optional, default False; True: draft(..., more=f) calls f(confidences so far) after each
    # draft and stops the chain when it returns False (a chain drafter, EAGLE-3)
    stops_early: bool

    def begin(self, prompt_ids: list[int], prompt_taps: mx.array | None) -> None: ...

    def draft(self, anchor: int, n: int, sp: SamplingParams, rng: np.random.Generator) -> DraftOutput: ...

    def accept(self, tokens: list[int], taps: mx.array | None) -> None: ...


def proposals(drafter) -> tuple[bool, bool]:
    """(model drafts, prompt lookup): what `drafter` declares it proposes; a drafter that
    declares nothing proposes model drafts only."""
    return bool(getattr(drafter, "proposes_model_drafts", True)), bool(getattr(drafter, "has_lookup", False))


def catch_up(drafter) -> float:
    """Process what `drafter.accept` deferred, when more is pending than one step commits, and
    return the seconds it took (0: nothing done).

    Drafters defer the committed rows' work to their next draft, so autoregressive and lookup
    steps cost them nothing. The next draft then runs the whole backlog: after 64 autoregressive
    steps an EAGLE-3 probe's one draft took 38 ms against 6.5 in steady state (measured here).
    Timed as drafting, that made the drafter look 6x as costly, the policy stopped asking it, the
    backlog grew, and the next probe looked costlier still. The backlog is owed whichever source
    a step picks, so `propose` runs it before the draft and leaves it out of the draft time the
    policy learns from (it stays in the stats' wall time)."""
    inner = getattr(drafter, "block", drafter)
    run = getattr(inner, "catch_up", None)
    if run is None or getattr(inner, "backlog", 0) <= inner.max_drafts + 1:
        return 0.0
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


class NoDrafter:
    name = "none"
    taps: tuple = ()
    max_drafts = 0
    proposes_model_drafts = False
    has_lookup = False

    def begin(self, prompt_ids, prompt_taps):
        pass

    def draft(self, anchor, n, sp, rng):
        return DraftOutput([], None, None)

    def accept(self, tokens, taps):
        pass


class BlockDrafter:
    """DFlash / DSpark drafting runtime: cached context K/V, one forward per block.

    Invariant: the context covers target positions 0..ctx_len-1 and the anchor sits at
    position ctx_len (checked in `draft`).
    """

    proposes_model_drafts, has_lookup = True, False

    def __init__(self, model: DFlashModel, target: Target, block_size: int | None = None, dtype=None,
                 force_sample_from_anchor: bool | None = None):
        """force_sample_from_anchor: read the block with this layout instead of the file's.
        Only for demonstrating PR #122's failure (tests, experiments): on an anchor-first
        drafter, False drafts every token one row late and acceptance collapses."""
        c = model.config

        if dtype is None and default_dense():
            dtype = mx.float32  # CPU: float16 matmuls are several times slower than float32 BLAS
        if dtype is not None:
            model.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a)
            mx.eval(model.parameters())
        self.model, self.cfg, self.target = model, c, target
        self.name = c.lineage
        self.taps = tuple(c.target_layer_ids)
        self.block_size = block_size or c.block_size
        anchor_first = c.sample_from_anchor if force_sample_from_anchor is None else force_sample_from_anchor
        self.layout = Layout(anchor_first, self.block_size)
        self.max_drafts, self.first_row = self.layout.n_drafts, self.layout.first_row
        # Draft vocabulary -> target ids (EAGLE-3 offsets), and the head over it.
        if c.draft_vocab_size:
            self.d2t = mx.arange(c.draft_vocab_size, dtype=mx.int32) + model.d2t.astype(mx.int32)
        else:
            self.d2t = None
        if c.has_lm_head:
            self.head = model.lm_head.weight.astype(mx.float32)
        else:
            self.head = target_head_rows(target, self.d2t)
        self.embed = model.embed_tokens if c.has_embed else target.embed
        self.selector = getattr(model, "candidate_selector", None)
        mx.eval(self.head)
        self.reset()

    # -- context ------------------------------------------------------------------
    CTX_STEP = 256  # context K/V grow in steps of this many rows, as mlx-lm's KVCache does

    def reset(self):
        self._ctx_buf: list = [None] * len(self.model.layers)  # per layer [k, v], capacity >= ctx_len
        self._written = 0  # context rows whose K/V are in the buffers
        self._pending: list = []  # committed rows' taps not projected yet

    @property
    def ctx_len(self) -> int:
        """Target positions the context covers (the anchor sits at this position)."""
        return self._written + sum(t.shape[1] for t in self._pending)

    @property
    def backlog(self) -> int:
        """Committed rows accepted but not projected into the context yet."""
        return sum(t.shape[1] for t in self._pending)

    def catch_up(self) -> None:
        """Project the pending rows now, evaluated (`catch_up` above)."""
        self._flush()
        mx.eval([a for b in self._ctx_buf if b is not None for a in b])

    @property
    def ctx_kv(self) -> list:
        """Per layer (k, v) [1, n_kv, ctx_len, hd] of the context rows (views of the buffers)."""
        self._flush()
        L = self._written
        return [None if b is None or L == 0 else (b[0][:, :, :L], b[1][:, :, :L]) for b in self._ctx_buf]

    def begin(self, prompt_ids, prompt_taps):
        self.reset()
        self.accept(prompt_ids, prompt_taps)

    def accept(self, tokens, taps):
        """Append the committed rows' taps [1, n, T*H] at positions ctx_len.. ctx_len+n-1.

        The projection into context K/V waits for the next draft: steps the policy runs
        autoregressively cost the drafter nothing, and the rows of several steps are
        projected in one batch."""
        if taps.shape[1]:
            self._pending.append(taps)

    def context(self, taps: mx.array) -> mx.array:
        """fc + hidden_norm over target taps, in the drafter's dtype. A float16 drafter
        computes it in float32: Gemma's taps reach ~1e5, past float16's 65504, and one inf
        there makes every draft NaN (lossless still, but nothing is accepted)."""
        dt = self.model.hidden_norm.weight.dtype
        if dt == mx.float16:
            return self.model.context(taps.astype(mx.float32)).astype(dt)
        return self.model.context(taps.astype(dt))

    def _flush(self):
        if not self._pending:
            return
        taps = self._pending[0] if len(self._pending) == 1 else mx.concatenate(self._pending, axis=1)
        self._pending = []
        n, p = taps.shape[1], self._written
        pos = mx.arange(p, p + n)[None]
        ctx = self.context(taps)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.self_attn.context_kv(ctx, pos)
            buf = self._ctx_buf[i]
            if buf is None or p + n > buf[0].shape[2]:  # grow by whole steps, keep rows 0..p-1
                grow = (n + self.CTX_STEP - 1) // self.CTX_STEP * self.CTX_STEP
                new = [mx.zeros((*a.shape[:2], grow, a.shape[3]), a.dtype) for a in (k, v)]
                if buf is not None:
                    new = [mx.concatenate([b[:, :, :p], z], axis=2) for b, z in zip(buf, new)]
                buf = self._ctx_buf[i] = new
            buf[0][:, :, p : p + n] = k
            buf[1][:, :, p : p + n] = v
        self._written += n

    def trim_context(self, n: int):
        """Drop the last n context rows (used by tests and by callers that rewind)."""
        if n <= 0:
            return
        self._flush()
        self._written -= n  # rows past the written ones are overwritten by the next flush

    # -- drafting -------------------------------------------------------------------
    def block_hidden(self, anchor: int, n_rows: int) -> mx.array:
        p = self.ctx_len
        toks = mx.array([[anchor] + [self.cfg.mask_token_id] * (n_rows - 1)])
        emb = self.embed(toks).astype(self.head.dtype)
        pos = mx.arange(p, p + n_rows)[None]
        if self.selector is not None:  # DFlash 2: sliding windows from the anchor's position
            return self.model.hidden(emb, pos, self.ctx_kv, anchor_pos=p)[0]
        return self.model.hidden(emb, pos, self.ctx_kv)[0]  # [n_rows, H]

    def base_logits(self, anchor: int, n: int) -> tuple[mx.array, mx.array]:
        """Hidden states and logits (draft vocab, before any Markov correction or DFlash 2
        scaling) of the first n predicting rows, read by the file's layout.

        The whole block is always run and the rows past n dropped: block rows attend to
        each other (no mask), so a shorter block would change every row's prediction."""
        h = self.block_hidden(anchor, self.block_size)[self.first_row : self.first_row + n]
        return h, h @ self.head.T

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def draft(self, anchor: int, n: int, sp: SamplingParams, rng: np.random.Generator) -> DraftOutput:
        n = min(n, self.max_drafts)
        if n <= 0:
            return DraftOutput([], None, None)
        h, base = self.base_logits(anchor, n)
        if self.selector is not None:
            return self._selector_chain(anchor, h, base, sp, rng)
        mh = getattr(self.model, "markov_head", None)
        ch = getattr(self.model, "confidence_head", None)
        if mh is None:
            if sp.greedy:
                toks = self.to_target(mx.argmax(base, axis=-1))
                conf = None
                if ch is not None:
                    conf = ch(h)
                mx.eval(toks, *([conf] if conf is not None else []))
                return DraftOutput(toks.tolist(), None, None if conf is None else conf.tolist(), base)
            q_d = probs_from_logits(base, sp)
            toks = [int(x) for x in _sample_rows(np.asarray(q_d), rng)]
            tgt = self.to_target(mx.array(toks)).tolist()
            conf = None if ch is None else ch(h).tolist()  # p_min / scheduler apply when sampling too
            return DraftOutput(tgt, self._scatter(q_d), conf, base)
        return self._markov_chain(anchor, h, base, mh, ch, sp, rng)

    def _selector_chain(self, anchor, h, base, sp, rng):
        """DFlash 2: the chain through each row's top-k candidates (`kernels.selector_chain`),
        starting from the anchor; greedy takes each row's best score.

        Sampling: the draft distribution of row t is softmax(score_t / T) over its k candidates
        and zero elsewhere (z-lab's; temperature only, no top-k / top-p), sampled by Gumbel-max
        with a key drawn from `rng`; verification receives exactly that q, so rejection
        sampling stays lossless whatever the target's own top-k / top-p."""
        model, cs = self.model, self.selector
        ids, raw = top_candidates(base, model.config.selector_top_k)  # base: h @ head^T, before scaling
        unary, hp = model.scale_logits(raw), cs.hidden_projection(h)
        base = model.scale_logits(base)  # the block logits (lazy: only sampling and tests read them)
        temp = 0.0 if sp.greedy else float(sp.temperature)
        key = None if sp.greedy else int(rng.integers(0, 1 << 62))
        tokens, _, scores = kernels.selector_chain(unary, ids, hp, cs.predecessor_codebook, cs.successor_codebook,
                                                   int(anchor), temp, key)
        q = None
        if not sp.greedy:
            qk = mx.softmax(scores / temp, axis=-1)
            q = mx.put_along_axis(mx.zeros(base.shape, dtype=mx.float32), ids, qk, axis=-1)
        mx.eval(tokens, *([q] if q is not None else []))
        return DraftOutput(tokens.tolist(), q, None, base)

    def _markov_chain(self, anchor, h, base, mh, ch, sp, rng):
        """DSpark: z_k = base_k + W2 . W1[x_{k-1}], x_{-1} = anchor; left to right, each
        step conditioned on the token actually drawn.

        With a Metal / CUDA kernel backend, a vanilla head drafts the whole block in one
        `kernels.markov_chain` call when it applies: no reduced draft vocabulary (W1 is
        indexed by target ids, the kernel indexes it by the drawn column), a rank that is a
        multiple of 32, and greedy or plain-temperature sampling (the kernel samples
        softmax(z / T) by Gumbel-max with a key drawn from `rng`; no top-k / top-p). The
        confidences, z and (sampling) the q rows are then computed afterwards in one batched
        pass from the known tokens. Otherwise (reference backend, gated / rnn heads) the
        per-position loop below runs."""
        with_markov = self.cfg.confidence_head_with_markov
        plain = sp.greedy or ((not sp.top_k or sp.top_k >= base.shape[-1]) and sp.top_p >= 1.0)
        if (mh.kind == "vanilla" and self.d2t is None and mh.rank % 32 == 0 and plain
                and kernels.backend() in ("metal", "cuda")):
            key = None if sp.greedy else int(rng.integers(0, 1 << 62))
            temp = 0.0 if sp.greedy else float(sp.temperature)
            tok_arr, _ = kernels.markov_chain(base, mh.markov_w1.weight, mh.markov_w2.weight, int(anchor),
                                              temp, key)
            prevs = mx.concatenate([mx.array([anchor], dtype=mx.int32), tok_arr[:-1].astype(mx.int32)])
            e = mh.state(prevs)  # [n, r] float32: W1 rows of the conditioning tokens
            z_all = base + mh.bias(e)  # [n, V]; lazy unless sampling needs it
            conf = None if ch is None else ch(h, e if with_markov else None)
            q = None if sp.greedy else probs_from_logits(z_all, sp)
            mx.eval(tok_arr, *[a for a in (conf, q) if a is not None])
            probs = None if q is None else self._scatter(q)
            return DraftOutput(tok_arr.tolist(), probs, None if conf is None else conf.tolist(), z_all)
        prev = mx.array([anchor])
        toks, zs, confs, qs = [], [], [], []
        carry = None  # rnn heads: a fresh carry for every block
        for k in range(base.shape[0]):
            bias, carry = mh.step(prev, h[k : k + 1], carry)
            z = base[k : k + 1] + bias
            if ch is not None:
                confs.append(ch(h[k : k + 1], mh.state(prev) if with_markov else None))
            if sp.greedy:
                d = mx.argmax(z, axis=-1)
            else:
                q = probs_from_logits(z, sp)
                mx.eval(q)
                d = mx.array([_sample_rows(np.asarray(q), rng)[0]])
                qs.append(q)
            prev = self.to_target(d)
            toks.append(prev)
            zs.append(z)
        tok_arr = mx.concatenate(toks)
        z_all = mx.concatenate(zs)
        conf = mx.concatenate(confs) if confs else None
        mx.eval(tok_arr, z_all, *([conf] if conf is not None else []))
        probs = self._scatter(mx.concatenate(qs)) if qs else None
        return DraftOutput(tok_arr.tolist(), probs, None if conf is None else conf.tolist(), z_all)

    def _scatter(self, q_d: mx.array) -> mx.array:
        return scatter_draft(q_d, self.d2t, self.target.info.vocab_size)


def scatter_draft_host(q_d: np.ndarray, d2t: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """`scatter_draft` on the host, for distributions computed by numpy (EAGLE-3's sampled drafts)."""
    if d2t is None:
        return q_d
    out = np.zeros((q_d.shape[0], vocab_size), np.float32)
    out[:, d2t] = q_d
    return out


def scatter_draft(q_d: mx.array, d2t: mx.array | None, vocab_size: int) -> mx.array:
    """Draft-vocabulary distributions [n, Vd] -> target vocabulary [n, V] (d2t: the target id of
    each draft id; None: the draft vocabulary is the target's)."""
    if d2t is None:
        return q_d
    out = mx.zeros((q_d.shape[0], vocab_size), dtype=q_d.dtype)
    out[:, d2t] = q_d
    return out


def _sample_rows(q: np.ndarray, rng: np.random.Generator) -> list[int]:
    return [sample_token(row, rng) for row in q]


class SimpleDrafter:
    """A classic small draft model sharing the target's tokenizer (mlx-lm's draft model).

    Its KV cache holds `held`; before drafting it is rewound to the longest common
    prefix with the committed tokens and fed the rest plus the anchor.
    """

    name = "simple"
    taps: tuple = ()
    proposes_model_drafts, has_lookup = True, False

    def __init__(self, draft: Target, num_draft: int = 4):
        self.draft_model = draft
        self.max_drafts = num_draft
        self.cache, self.held, self.committed = None, [], []

    def begin(self, prompt_ids, prompt_taps):
        self.cache = self.draft_model.make_cache()
        self.held, self.committed = [], list(prompt_ids)

    def accept(self, tokens, taps):
        self.committed += list(tokens)

    def draft(self, anchor, n, sp, rng):
        n = min(n, self.max_drafts)
        if n <= 0:
            return DraftOutput([], None, None)
        keep = 0
        lim = min(len(self.held), len(self.committed))
        while keep < lim and self.held[keep] == self.committed[keep]:
            keep += 1
        trim_cache(self.cache, len(self.held) - keep)
        feed = self.committed[keep:] + [anchor]
        self.held = self.committed + [anchor]
        toks, qs = [], []
        for i in range(n):
            logits, _ = self.draft_model(mx.array([feed]), self.cache, logits="last")
            z = logits[0, -1:]
            if sp.greedy:
                x = int(mx.argmax(z, axis=-1).item())
            else:
                q = probs_from_logits(z, sp)
                x = sample_token(np.asarray(q[0]), rng)
                qs.append(q)
            toks.append(x)
            if i < n - 1:
                feed = [x]
                self.held.append(x)
        return DraftOutput(toks, mx.concatenate(qs) if qs else None, None)
