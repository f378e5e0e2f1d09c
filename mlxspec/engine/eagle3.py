"""The EAGLE-3 drafting runtime: a chain drafter behind the `Drafter` protocol.

Pairing (the references: speculators, SGLang, mlx-vlm): drafter row i pairs the target's taps
at position i with the token x_{i+1} that follows. `begin` and `accept` hand over committed
tokens and their taps; the last tap waits for its next token, which is the anchor of the next
`draft`. `draft(anchor, n)` first runs the pairs not yet in the drafter's cache (committed:
they stay), whose last output gives draft 1; each further draft k+1 runs one row from the
drafter's own output of step k and the token just drafted, at the next position. Those chain
rows are tentative: the cache is truncated back to the committed pairs before `draft` returns,
so it only ever holds committed pairs.

Greedy chains are built lazily (argmax -> d2t -> embedding never leaves the graph) and
evaluated once; sampled chains draw each token from the drafter's own distribution (draft
vocabulary, scattered to the target's for verification), so rejection sampling stays lossless.

Sampled drafts come from the drafter at `sharpen` x the request's temperature (top-k / top-p
as requested), 1 by default. Verification uses the distribution each draft was drawn from, so
`sharpen` changes speed only, never the output distribution. A sharper proposal overlaps the
target more on the first draft (sum_x min(p(x), q(x)) on the 40 held-out prompts, T=1, q at
0.7 T against q at T: code 0.520 / 0.493, prose 0.459 / 0.440, chat 0.433 / 0.399), but end to
end at T=1 it did not raise tau (16 code prompts x 2 seeds, 3 fixed drafts: 1.427 against
1.438; adaptive, one seed: 1.078 against 1.126): on the target's sampled continuations the
first-draft gain is gone (code 0.357 at 0.7 T against 0.367 at T), so the default stays at the
request's temperature (`scripts/draft_temperature.py`, docs/results.md).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model, KVCache, causal_mask
from mlxspec.drafters.eagle3_fast import FastForward, top_probability
from mlxspec.engine.drafting import DraftOutput, scatter_draft_host
from mlxspec.engine.tree import SIBLING_DECAY, DraftTree, top_candidates, top_weights
from mlxspec.engine.verify import SamplingParams, sample_token, target_probs
from mlxspec.targets.load import default_dense
from mlxspec.targets.model import Target, target_head_rows

DRAFT_SHARPEN = 1.0  # sampled drafts: the drafter's temperature over the request's (module docstring)


class Eagle3Drafter:
    proposes_model_drafts, has_lookup = True, False
    chain = True  # drafting cost grows with the number of drafts (one drafter forward each)
    stops_early = True  # draft(..., more=) reports each draft's confidence and can stop the chain
    fast_forward = True  # drafters draft with `FastForward` (False: the plain forward, for A/B)

    def __init__(self, model: Eagle3Model, cfg: Eagle3Config, target: Target, max_drafts: int | None = None,
                 dtype=None):
        if dtype is None and default_dense():
            dtype = mx.float32  # CPU: float16 matmuls are several times slower than float32 BLAS
        if dtype is not None:
            model.apply(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype else a)
            mx.eval(model.parameters())
        self.model, self.cfg, self.target = model, cfg, target
        self.name = "eagle3"
        self.taps = tuple(cfg.target_layer_ids)
        self.max_drafts = int(max_drafts or cfg.max_drafts)
        self.sharpen = DRAFT_SHARPEN
        self.d2t = (mx.arange(cfg.draft_vocab_size, dtype=mx.int32) + model.d2t.astype(mx.int32)
                    if cfg.reduced_vocab else None)
        self._d2t_np = None if self.d2t is None else np.asarray(self.d2t)
        self.head = model.lm_head.weight if cfg.has_lm_head else target_head_rows(target, self.d2t)
        self.embed = model.embed_tokens if cfg.has_embed else target.embed
        mx.eval(self.head)
        # the same forward in fewer operations (one-layer drafters; tested equal row for row)
        self._fast = FastForward.of(model, self.head) if self.fast_forward else None
        self.reset()

    def reset(self):
        self.cache = [KVCache() for _ in self.model.layers]
        self._taps: list = []  # committed taps not in the cache yet, positions committed..
        self._next: list[int] = []  # their next tokens (one fewer: the last awaits the anchor)
        self._last_h = None  # the drafter's output for the last committed pair
        self._anchor_used = False  # draft() already paired the last tap with this step's anchor

    @property
    def committed(self) -> int:
        """Pairs in the drafter's cache (= target positions 0..committed-1)."""
        return self.cache[0].length

    def begin(self, prompt_ids, prompt_taps):
        self.reset()
        n = 0 if prompt_taps is None else int(prompt_taps.shape[1])
        ids = [int(t) for t in prompt_ids]
        self._taps = [prompt_taps] if n else []
        self._next = ids[len(ids) - n + 1:] if n else []  # taps of a tail only: pair that tail
        self._commit_known()

    def _pending_taps(self) -> mx.array:
        return self._taps[0] if len(self._taps) == 1 else mx.concatenate(self._taps, axis=1)

    def _run_pairs(self, taps: mx.array, nxt: list[int]) -> mx.array:
        """Run (tap, next token) pairs into the cache -> the drafter's pre-norm outputs [1, L, H]."""
        if len(nxt) != taps.shape[1]:
            raise AssertionError(f"eagle3 drafter: {taps.shape[1]} pending taps but {len(nxt)} next tokens")
        dt = self.model.fc.weight.dtype
        return self._step(self.embed(mx.array([nxt])).astype(dt), self.model.fuse(taps.astype(dt)))

    def _commit_known(self) -> None:
        """Run the pending pairs whose next token is known (all but the last tap) into the cache
        now, evaluated: the prompt's pairs are part of the prompt's processing. Left to the first
        `draft`, they were timed as drafting (~0.1-0.3 s for a few hundred tokens here), and the
        policy, seeing one draft cost that much, stopped asking the drafter."""
        if len(self._next) == 0 or not self._taps:
            return
        taps, k = self._pending_taps(), len(self._next)
        if k >= taps.shape[1]:
            raise AssertionError(f"eagle3 drafter: {taps.shape[1]} pending taps but {k} known next tokens")
        h = self._run_pairs(taps[:, :k], self._next)
        mx.eval(h, *[a for c in self.cache for a in (c.k, c.v)])
        self._taps, self._next = [taps[:, k:]], []

    @property
    def backlog(self) -> int:
        """Committed pairs whose next token is known but not run into the cache yet."""
        return len(self._next)

    def catch_up(self) -> None:
        """Run the known pending pairs now, evaluated (`mlxspec.engine.drafting.catch_up`)."""
        self._commit_known()

    def accept(self, tokens, taps):
        tokens = [int(t) for t in tokens]
        self._next += tokens[1:] if self._anchor_used else tokens
        self._anchor_used = False
        if taps is not None and taps.shape[1]:
            self._taps.append(taps)

    # -- drafting -------------------------------------------------------------------
    def _step(self, emb: mx.array, hidden: mx.array) -> mx.array:
        """Rows [1, L, H] at the next positions, appended to the cache -> pre-norm outputs."""
        p, n = self.committed, emb.shape[1]
        if self._fast is not None:
            return self._fast(emb, hidden, p, self.cache, causal_mask(n, p + n))
        return self.model(emb, hidden, mx.arange(p, p + n), self.cache, causal_mask(n, p + n))

    def _commit(self, anchor: int) -> None:
        """Run the pending pairs (the last one paired with the anchor) into the cache."""
        if self._anchor_used or not self._taps:
            return
        h = self._run_pairs(self._pending_taps(), self._next + [int(anchor)])
        self._last_h = h[:, -1:]
        self._taps, self._next, self._anchor_used = [], [], True

    def proposal_sampling(self, sp: SamplingParams) -> SamplingParams:
        """The sampling a sampled draft is drawn with: the request's at `sharpen` x its temperature."""
        return dataclasses.replace(sp, temperature=sp.temperature * self.sharpen)

    def logits(self, h: mx.array) -> mx.array:
        """Pre-norm outputs [.., H] -> draft-vocabulary logits (float32)."""
        if self._fast is not None:
            return self._fast.logits(h)
        return (self.model.norm(h) @ self.head.T).astype(mx.float32)

    def greedy_head(self, h: mx.array):
        """Pre-norm outputs [.., H] -> (logits, argmax, top probability): one compiled function
        with the inference forward."""
        if self._fast is not None:
            return self._fast.greedy(h)
        z = self.logits(h)
        return z, mx.argmax(z, axis=-1), top_probability(z)

    def to_target(self, ids: mx.array) -> mx.array:
        return ids if self.d2t is None else self.d2t[ids]

    def draft(self, anchor: int, n: int, sp: SamplingParams, rng: np.random.Generator, more=None) -> DraftOutput:
        """Up to n drafts after `anchor`, each with its confidence: the drafter's top
        probability at that row (greedy: the probability of the token it drafted). Sampled, it
        is read from the row's distribution before the draw, never from the drawn token: the
        policy may drop draft i on confidences of rows <= i, and a rule that looked at the
        drawn token's own probability would verify some tokens more often than the proposal
        draws them (lossy). more(confidences so far) -> False stops the chain after that draft;
        None drafts all n, built lazily and evaluated once."""
        n = min(n, self.max_drafts)
        self._commit(anchor)
        if n <= 0 or self._last_h is None:
            return DraftOutput([], None, None)
        base = self.committed
        h = self._last_h
        toks, zs, qs, cs, conf = [], [], [], [], []
        sq = self.proposal_sampling(sp)
        for k in range(n):
            if sp.greedy:  # logits [1, Vd], the argmax and its probability
                z, d, c = (x[0] for x in self.greedy_head(h))
                cs.append(c)
            else:  # drawn on the host from numpy's softmax, the distribution verification reads
                z = self.logits(h)[0]
                q = target_probs(z, sq)
                i = sample_token(q[0], rng)
                d = mx.array([i])
                qs.append(q)
                conf.append(float(q[0].max()))  # the row's, not the drawn token's (docstring)
            zs.append(z)
            t = self.to_target(d)
            toks.append(t)
            if k == n - 1:
                break
            if more is not None and sp.greedy:
                mx.async_eval(cs[-1], t)  # computed while the next row's graph is built
            nxt = self._step(self.embed(t[None]).astype(h.dtype), self.model.feedback(h))
            if more is not None:
                if sp.greedy:
                    conf.append(float(cs[-1].item()))
                if not more(conf):
                    break
            h = nxt
        for c in self.cache:
            c.truncate(base)
        tok_arr, z_all = mx.concatenate(toks), mx.concatenate(zs)
        if sp.greedy:
            c_all = mx.concatenate(cs)
            mx.eval(tok_arr, z_all, c_all)
            conf = c_all.tolist()
        else:
            mx.eval(tok_arr, z_all)
        probs = scatter_draft_host(np.concatenate(qs), self._d2t_np, self.target.info.vocab_size) if qs else None
        return DraftOutput(tok_arr.tolist(), probs, conf, z_all)

    def draft_tree(self, tree: DraftTree, depth: int, width: int, sp: SamplingParams, rng: np.random.Generator,
                   p: np.ndarray, more=None) -> int:
        """EAGLE-2's dynamic tree, added to `tree` (rooted at the anchor): at each depth the
        `width` best children of every frontier node join the tree, and the `width` best new
        nodes (by path score) become the next frontier, run in ONE drafter forward whose tree
        mask lets each row see the committed pairs and its own ancestors' rows (position:
        committed + depth - 1, as the chain). Scores: parent * q(x_r) greedy (the drafter's own
        probability, calibrated as it is at every position of the chain:
        scripts/confidence_calibration.py, as EAGLE-2 ranks its tree), parent * p[depth - 1] *
        SIBLING_DECAY**r sampled (children drawn without replacement in draw order, each recorded
        with the distribution it was drawn from; scored by rank, never by value). more(tree, new nodes) -> False
        stops the growth after a depth (`tree.newest_pays`: the budget would keep none of it).
        -> the depths drafted (drafter forwards run, the first pair's included)."""
        self._commit(tree.nodes[0].token)
        if depth <= 0 or self._last_h is None:
            return 0
        base = self.committed
        sq = self.proposal_sampling(sp)
        frontier = [(0, self._last_h[0, 0])]  # (tree node, its pre-norm output [H])
        rows: list[int] = []  # the tree node of each tentative drafter row, in cache order
        forwards = 0
        for d in range(depth):
            z = self.logits(mx.stack([h for _, h in frontier])[None])[0]  # [m, Vd]
            if sp.greedy:  # the best `width` of each row, found on the device, and their probabilities
                cand, qc = top_weights(z, width)
                qc = qc * np.asarray(top_probability(z))[:, None]
            else:  # on the host, as the chain's draws (`draft`)
                q = target_probs(z, sq)
                cand = top_candidates(q, width, rng)
            tgt = np.asarray(self.to_target(mx.array(cand.astype(np.int32))))
            pd = float(p[min(d, len(p) - 1)])
            qt = None if sp.greedy else scatter_draft_host(q, self._d2t_np, self.target.info.vocab_size)
            children = []
            for j, (node, _) in enumerate(frontier):
                ps = tree.nodes[node].score
                for r in range(cand.shape[1]):
                    cond = qc[j, r] if sp.greedy else pd * SIBLING_DECAY ** r
                    k = tree.add(node, int(tgt[j, r]), ps * cond, "drafter",
                                 None if sp.greedy else qt[j], () if sp.greedy else tuple(int(t) for t in tgt[j, :r]))
                    children.append((k, j))
            if d == depth - 1 or (more is not None and not more(tree, [k for k, _ in children])):
                break
            best = sorted(children, key=lambda c: (-tree.nodes[c[0]].score, c[0]))[:width]
            m, before = len(best), len(rows)
            emb = self.embed(mx.array([[tree.nodes[k].token for k, _ in best]])).astype(frontier[0][1].dtype)
            hid = self.model.feedback(mx.stack([frontier[j][1] for _, j in best])[None])
            vis = np.zeros((m, base + before + m), bool)
            vis[:, :base] = True
            for i, (k, _) in enumerate(best):
                anc = set(tree.path(k))
                vis[i, base:base + before] = [r in anc for r in rows]
                vis[i, base + before + i] = True
            if self._fast is not None:
                out = self._fast(emb, hid, base + d, self.cache, mx.array(vis), shared=True)
            else:
                out = self.model(emb, hid, mx.full((m,), base + d, dtype=mx.int32), self.cache, mx.array(vis))
            forwards += 1
            rows += [k for k, _ in best]
            frontier = [(k, out[0, i]) for i, (k, _) in enumerate(best)]
        for c in self.cache:
            c.truncate(base)
        return forwards + 1
