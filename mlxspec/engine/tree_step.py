"""One speculative step over a tree (`mlxspec.engine.tree`): plan, draft the tree, verify it in
one target forward, keep the accepted path. The loop (`mlxspec.engine.loop.generate_steps`)
calls `tree_step` instead of its chain step when trees are on (`TreeSettings`, `--tree`).

What the step drafts follows the policy's plan, so a tree never costs more drafting than the
chain it replaces: an autoregressive plan stays a plain step; a lookup plan becomes a lookup
tree (every distinct continuation of the match); a drafter plan becomes the drafter's tree
with the lookup's continuations merged in (free). How many nodes are verified: `--tree N` with
`--verify-policy fixed` always N (trees and chains compare at equal rows); otherwise at most N
(auto: as many as the measured verify costs allow), chosen by `choose_budget` from the nodes'
scores and the policy's measured verify time per row count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxspec.engine.drafting import catch_up, proposals
from mlxspec.engine.ngram import propose_many
from mlxspec.engine.policy import Kind, Source
from mlxspec.engine.tree import (DraftTree, TreeCalibration, accept_greedy, accept_sampled, add_lookup, add_rows,
                                 choose_budget, newest_pays, top_candidates, top_weights)
from mlxspec.engine.verify import target_rows
from mlxspec.errors import MlxspecError
from mlxspec.targets.tree import keep_rows

DEFAULT_P = {"lookup": 0.6, "drafter": 0.5}  # scores' acceptance where the policy keeps no estimate


@dataclass(frozen=True)
class TreeSettings:
    """`--tree`: off (chains), auto (node count chosen by cost, up to `nodes`), or a count."""

    mode: str = "off"  # off | auto | fixed
    nodes: int = 16  # auto: the most nodes; fixed: the nodes verified (the root excluded)
    width: int = 4  # children tried per node

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @classmethod
    def parse(cls, value) -> "TreeSettings":
        if isinstance(value, TreeSettings):
            return value
        v = str(value if value is not None else "off").strip().lower()
        if v in ("off", "0", "none", "false"):
            return cls("off")
        if v == "auto":
            return cls("auto")
        try:
            n = int(v)
        except ValueError:
            n = -1
        if not 1 <= n <= 64:
            raise MlxspecError(f"--tree {value!r}: use off, auto, or a node count 1..64")
        return cls("fixed", n)


def _p(policy, source: Source, key: str) -> np.ndarray:
    est = getattr(policy, "estimate", None)
    return est(source).p() if est is not None else np.full(16, DEFAULT_P[key])


def _inner(drafter):
    return getattr(drafter, "block", drafter)


def _costs(policy, settings: TreeSettings) -> list[float] | None:
    """The policy's verify costs by length where the budget is chosen by cost (None: fixed)."""
    return policy.verify_time if settings.mode != "fixed" and hasattr(policy, "verify_time") else None


def draft_tree(drafter, policy, anchor: int, n_cap: int, sampling, rng, settings: TreeSettings,
               cal: TreeCalibration | None, vt: list[float] | None):
    """-> (tree before selection or None for an autoregressive step, plan source, draft seconds,
    drafter forwards). A chain drafter's tree grows while its newest depth would be verified
    (the budget chosen by the verify costs `vt`, scores calibrated by `cal`), at most the plan's
    length deep. vt: `_costs(policy, settings)` (None: a fixed tree, grown to full depth)."""
    model_drafts, has_lookup = proposals(drafter)
    conts, match = [], 0
    if has_lookup and hasattr(drafter, "index"):
        conts, match = propose_many(drafter.index, anchor, n_cap, settings.width)
    elif has_lookup:  # a wrapper without its index (the server's): its one proposal
        toks, match = drafter.lookup(anchor, n_cap)
        conts = [toks]
    conts = [c for c in conts if c]
    plan = policy.plan(n_cap, max((len(c) for c in conts), default=0), match, model_drafts)
    if plan.n <= 0 or plan.source.kind is Kind.NONE:
        return None, plan.source, 0.0, 0
    tree = DraftTree(anchor)
    lookup_src = Source.lookup(match)
    if conts:
        add_lookup(tree, [c[: n_cap] for c in conts], _p(policy, lookup_src, "lookup"))
    forwards = 0
    if plan.source.kind is Kind.DRAFTER and model_drafts:
        catch_up(drafter)  # earlier steps' deferred work, outside the draft time the policy learns
    td = time.perf_counter()
    if plan.source.kind is Kind.DRAFTER and model_drafts:
        inner = _inner(drafter)
        p = _p(policy, Source.DRAFTER, "drafter")
        budget = settings.nodes
        if hasattr(inner, "draft_tree"):
            # fixed: N nodes hold no path deeper than N; either way the tree stops growing where
            # its newest depth would not be verified (the nodes kept are the same, the forwards fewer)
            depth = plan.n if settings.mode != "fixed" else min(n_cap, inner.max_drafts, budget)

            def more(t, newest):
                scores = cal.calibrated(t)[0] if cal is not None else [n.score for n in t.nodes]
                return newest_pays(scores, newest, vt, budget)
            forwards = inner.draft_tree(tree, max(depth, 1), settings.width, sampling, rng, p, more)
        else:
            d = drafter.draft(anchor, n_cap, sampling, rng)
            forwards = 1
            if d.tokens:
                _add_block(tree, inner, d, p, budget, settings.width, sampling, rng)
    return tree, plan.source, time.perf_counter() - td, forwards


def _add_block(tree, inner, d, p, budget, width, sampling, rng) -> None:
    """A block drafter's rows into the tree: each row's candidates start with the token the
    block drafted there (DSpark's Markov head or DFlash 2's selector may have picked another than
    the row's argmax), then the row's other candidates (greedy: by probability; sampled: drawn
    without replacement after it)."""
    n = len(d.tokens)
    ids = np.full((n, width), -1, np.int64)
    if sampling.greedy:
        rows = np.ones((n, width))
        if d.logits is not None:
            top, qs = top_weights(d.logits[:n], width + 1)
            to_t = getattr(inner, "to_target", None)
            tids = np.asarray(to_t(mx.array(top.astype(np.int32)))) if to_t else top
        for j, t in enumerate(d.tokens):
            row = [t]
            if d.logits is not None:
                row += [int(x) for x in tids[j] if x != t][: width - 1]
                rows[j, : len(row)] = [qs[j, 0]] + [qs[j, list(tids[j]).index(x)] for x in row[1:]]
            ids[j, : len(row)] = row
        add_rows(tree, rows, ids, p, budget, width)
    else:
        q = np.asarray(d.probs[:n], np.float64)  # [n, V]: row j's distribution; token j was drawn from it
        for j, t in enumerate(d.tokens):
            rest = q[j].copy()
            rest[t] = 0.0
            s = rest.sum()
            more = [int(x) for x in top_candidates(rest / s, width - 1, rng) if rest[x] > 0] if s > 0 and width > 1 else []
            row = [t] + more
            ids[j, : len(row)] = row
        add_rows(tree, np.ones((n, width)), ids, p, budget, width, q)


def tree_step(target, cache, drafter, policy, anchor: int, n_cap: int, sampling, rng, settings: TreeSettings,
              taps, stats, cal: TreeCalibration | None = None):
    """One tree step -> (accepted tokens, next token) or None where the plan is an autoregressive
    step (the caller runs it). Updates the cache, the drafter, the policy and stats. cal: the
    generation's node-score calibration (scores rescaled before the budget, updated after)."""
    t0 = time.perf_counter()
    vt = _costs(policy, settings)  # fixed for the step: the policy learns costs after the verify
    tree, source, t_draft, forwards = draft_tree(drafter, policy, anchor, n_cap, sampling, rng, settings, cal, vt)
    if tree is None or len(tree) <= 1:
        return None
    cap = min(settings.nodes, len(tree) - 1)
    if cal is not None:
        cal.rescore(tree)
    ranked = tree.ranked()
    if vt is not None:
        # the drafting is paid for: keep the nodes whose verify rows pay (as truncating a chain)
        cap = max(1, choose_budget([tree.nodes[i].score for i in ranked], vt, 0.0, cap))
    tree = tree.select(cap, ranked)
    stats.draft_time += time.perf_counter() - t0
    tv = time.perf_counter()
    vlogits, vtaps = target(mx.array([tree.tokens]), cache, taps=taps, logits="all", tree=tree.parents)
    rows = target_rows(vlogits[0], sampling)
    t_verified = time.perf_counter() - tv
    path, nxt = accept_greedy(tree, rows) if sampling.greedy else accept_sampled(tree, rows, rng)
    keep_rows(cache, len(tree), path)
    if cal is not None:
        cal.observe(tree, path)
    accepted = [tree.nodes[i].token for i in path[1:]]
    drafter.accept([anchor] + accepted, vtaps[:, mx.array(path)] if vtaps is not None else None)
    stats.verify_time += time.perf_counter() - tv
    _record(stats, policy, tree, path, source, t_draft, forwards, t_verified)
    return accepted, nxt


def _primary(tree: DraftTree, source: str) -> list[int]:
    """The source's own chain in the tree: from the root, its first child each time."""
    out, i = [], 0
    while True:
        kid = next((k for k in tree.nodes[i].kids if tree.nodes[k].source == source), None)
        if kid is None:
            return out
        out.append(kid)
        i = kid


def _record(stats, policy, tree: DraftTree, path: list, source: Source, t_draft: float, forwards: int,
            t_verified: float) -> None:
    nodes, a = len(tree) - 1, len(path) - 1
    depth = max(n.depth for n in tree.nodes)
    stats.target_forwards += 1
    stats.verify_lengths.append(nodes + 1)
    stats.record(depth, a)
    stats.drafted += nodes - depth  # record() counted one per depth; a tree verifies every node
    for key in ("lookup", "drafter"):
        made = sum(1 for n in tree.nodes if n.source == key)
        if made:
            tally = stats.by_source.setdefault(key, [0, 0])
            tally[0] += made
            tally[1] += sum(1 for i in path[1:] if tree.nodes[i].source == key)
    if hasattr(policy, "observe_verify"):
        policy.observe_verify(nodes + 1, t_verified)
    on_path = set(path)
    for key, src in (("lookup", None), ("drafter", Source.DRAFTER)):
        chain = _primary(tree, key)
        if not chain:
            continue
        ok = 0
        while ok < len(chain) and chain[ok] in on_path:
            ok += 1
        if src is None:
            src = source if source.is_lookup else Source.LOOKUP
        timed = key == "drafter" and forwards > 0
        # a tree may stop growing before the plan's length: the draft time is per forward run
        policy.observe(src, len(chain), ok, None, t_draft if timed else None, None,
                       drafted=forwards if timed else None)
