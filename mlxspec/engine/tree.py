"""Tree drafting and tree verification: several candidate continuations in one target forward.

A step's tree is rooted at the anchor. Its nodes come from every source the step uses, merged
(a token proposed twice under the same parent is one node):

- prompt lookup: every distinct continuation of the matched n-gram's earlier occurrences
  (`NgramIndex.propose_many`), most recent first;
- a block drafter (DFlash, DSpark, DFlash 2): best-first over the block's rows, DDTree's way:
  the children of a node at depth k are row k+1's most probable tokens;
- a chain drafter (EAGLE-3): EAGLE-2's dynamic tree: at each depth the drafter runs the most
  promising frontier nodes in one forward with a tree mask (`Eagle3Drafter.draft_tree`).

Every node carries a score: the estimated probability that its whole path is accepted (the
policy's running per-position acceptance of its source, times the drafter's relative
probability of the alternative). Children are ordered and their scores fall with their rank,
so the `budget` best nodes (`DraftTree.select`) form a tree whose every node keeps a prefix of
its children. With the adaptive policy the budget itself is chosen by cost
(`choose_budget`): the node count that maximises (1 + sum of the kept scores) / (draft time +
verify time of that many rows), as the chain's length is chosen.

Verification (`accept_greedy` / `accept_sampled`) walks down from the root:

- greedy: follow the child whose token is the target's argmax; the bonus is the argmax where
  no child matches. The output is the target's greedy output, always.
- sampled: at each node the children are tried in order with recursive rejection sampling
  (SpecInfer, SpecTr, Sequoia): a lookup child x (deterministic: its proposal is a point mass)
  is accepted with probability p(x), and on rejection p loses x; a sampled drafter child,
  drawn without replacement from the drafter's q (q_i = q without the siblings drawn before
  it), is accepted with probability min(1, p(x) / q_i(x)), and on rejection
  p <- normalize(max(p - q_i, 0)). When every child is rejected the next token is drawn from
  what is left of p. Each token then has exactly the target's distribution, whatever the tree
  (tested against the exact distribution in tests/test_tree.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxspec.engine.verify import _draw, _nonfinite

SIBLING_DECAY = 0.5  # sampled children: score by rank (their sampled order), never by value


@dataclass
class TreeNode:
    token: int
    parent: int
    depth: int
    score: float
    source: str  # "root" | "lookup" | "drafter"
    q: np.ndarray | None = None  # a sampled drafter child: the distribution it was drawn from
    excl: tuple = ()  # ... without these tokens (its siblings drawn before it)
    kids: list = field(default_factory=list)
    cls: str = ""  # its calibration class (`TreeCalibration.rescore`; "" before)
    cond: float = 1.0  # its predicted acceptance given its parent's, before calibration


class DraftTree:
    def __init__(self, anchor: int):
        self.nodes = [TreeNode(int(anchor), -1, 0, 1.0, "root")]

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def tokens(self) -> list[int]:
        return [n.token for n in self.nodes]

    @property
    def parents(self) -> list[int]:
        return [n.parent for n in self.nodes]

    def child(self, parent: int, token: int) -> int | None:
        for k in self.nodes[parent].kids:
            if self.nodes[k].token == token and self.nodes[k].q is None:
                return k
        return None

    def add(self, parent: int, token: int, score: float, source: str, q=None, excl=()) -> int:
        """A child of `parent`; a deterministic token already there is merged (best score kept)."""
        token = int(token)
        if q is None:
            k = self.child(parent, token)
            if k is not None:
                self.nodes[k].score = max(self.nodes[k].score, score)
                return k
        p = self.nodes[parent]
        self.nodes.append(TreeNode(token, parent, p.depth + 1, float(score), source, q, tuple(excl)))
        p.kids.append(len(self.nodes) - 1)
        return len(self.nodes) - 1

    def path(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def ranked(self) -> list[int]:
        """Non-root nodes, best first, never a node before its parent (a merge can lift a
        child's score above its parent's: it then waits for the parent)."""
        order = sorted(range(1, len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth, i))
        out, have, waiting = [], {0}, {}
        for i in order:
            stack = [i]
            while stack:
                j = stack.pop()
                if self.nodes[j].parent in have:
                    out.append(j)
                    have.add(j)
                    stack.extend(waiting.pop(j, []))
                else:
                    waiting.setdefault(self.nodes[j].parent, []).append(j)
        return out

    def select(self, budget: int, ranked: list[int] | None = None) -> "DraftTree":
        """The root and the `budget` best nodes (of `ranked`, this tree's `ranked()` when already
        computed), re-indexed in depth order (a topological order)."""
        keep = set((self.ranked() if ranked is None else ranked)[: max(budget, 0)]) | {0}
        order = sorted(keep, key=lambda i: (self.nodes[i].depth, i))
        new_idx = {old: new for new, old in enumerate(order)}
        out = DraftTree(self.nodes[0].token)
        out.nodes = []
        for old in order:
            n = self.nodes[old]
            out.nodes.append(TreeNode(n.token, new_idx.get(n.parent, -1), n.depth, n.score, n.source, n.q, n.excl,
                                      cls=n.cls, cond=n.cond))
        for old in order:  # children in their original order (lookup first, drafter by rank)
            out.nodes[new_idx[old]].kids = [new_idx[k] for k in self.nodes[old].kids if k in keep]
        return out


# ------------------------------------------------------------------------------- builders

def add_lookup(tree: DraftTree, continuations: list, p: np.ndarray) -> None:
    """Lookup continuations (most recent first) as deterministic paths: a node at depth j scores
    its parent's score times p[j-1] (the lookup's conditional acceptance there), halved where a
    later continuation branches off an earlier one."""
    for rank, cont in enumerate(continuations):
        at, branched = 0, rank == 0
        for j, t in enumerate(cont):
            k = tree.child(at, t)
            if k is None:
                f = float(p[min(j, len(p) - 1)]) * (1.0 if branched else SIBLING_DECAY)
                branched = True
                k = tree.add(at, t, tree.nodes[at].score * f, "lookup")
            at = k


def add_rows(tree: DraftTree, rows: np.ndarray, ids: np.ndarray, p: np.ndarray, budget: int, width: int,
             sampled_q: np.ndarray | None = None) -> None:
    """A block drafter's rows as a tree, best first (DDTree): rows [n, k] candidate target ids of
    each row, best first (greedy: top-k; sampled: drawn without replacement, in draw order);
    ids/probs: `ids` [n, k] and `rows` [n, k] their draft probabilities. Child r of a node at
    depth j scores parent * p[j] * (probs[j, r] / probs[j, 0]) greedy, * SIBLING_DECAY**r sampled
    (sampled_q [n, V]: the rows' distributions, recorded for verification)."""
    n, k = ids.shape
    k = min(k, width)

    def rel(j, r):
        if sampled_q is not None:
            return SIBLING_DECAY ** r
        return float(rows[j, r] / max(rows[j, 0], 1e-12))

    heap = [(-(float(p[0]) * rel(0, 0)), 0, 0, 0)]  # (-score, parent node, depth index j, rank r)
    made = 0
    while heap and made < budget:
        neg, parent, j, r = heapq.heappop(heap)
        s = -neg
        excl = tuple(int(t) for t in ids[j, :r]) if sampled_q is not None else ()
        node = tree.add(parent, int(ids[j, r]), s, "drafter", None if sampled_q is None else sampled_q[j], excl)
        made += 1
        if r + 1 < k and ids[j, r + 1] >= 0:
            ps = tree.nodes[parent].score
            heapq.heappush(heap, (-(ps * float(p[min(j, len(p) - 1)]) * rel(j, r + 1)), parent, j, r + 1))
        if j + 1 < n:
            heapq.heappush(heap, (-(tree.nodes[node].score * float(p[min(j + 1, len(p) - 1)]) * rel(j + 1, 0)),
                                  node, j + 1, 0))


def top_candidates(q: np.ndarray, width: int, rng=None) -> np.ndarray:
    """Row-wise: the `width` most probable ids, best first (rng None), or `width` ids drawn
    without replacement in draw order (Gumbel top-k: the sorted perturbed log-probabilities are a
    sequential draw without replacement). A partial sort: O(V) per row, not O(V log V)."""
    key = np.asarray(q, np.float32)
    if rng is not None:
        with np.errstate(divide="ignore"):
            key = np.log(key) - np.log(-np.log(rng.random(key.shape)))
    k = min(width, key.shape[-1])
    part = np.argpartition(-key, k - 1, axis=-1)[..., :k]
    order = np.argsort(-np.take_along_axis(key, part, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(part, order, axis=-1)


def top_weights(z: mx.array, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy `top_candidates` from logits, on the device: the `width` most probable ids of each
    row of z [n, V], best first, and their unnormalised probabilities exp(z - max z). A tree's
    greedy scores use only ratios of probabilities within a row, so no softmax over the whole row
    is needed, and only [n, width] comes to the host (the [n, V] softmax, copy and partial sort
    cost a block drafter's tree ~8 ms a step on this CPU)."""
    z = z.astype(mx.float32)
    k = min(width, z.shape[-1])
    part = mx.argpartition(-z, kth=k - 1, axis=-1)[..., :k]
    ids, vals = np.asarray(part), np.asarray(mx.take_along_axis(z, part, axis=-1))
    order = np.argsort(-vals, axis=-1, kind="stable")
    vals = np.take_along_axis(vals, order, axis=-1)
    return np.take_along_axis(ids, order, axis=-1).astype(np.int64), np.exp(vals - vals[..., :1])


class TreeCalibration:
    """What the nodes' scores predict against what the target accepts, per class of node, so
    that the budget (`choose_budget`) counts the acceptance a node really has.

    A node's score multiplies conditional predictions down its path. The first child on a
    source's own chain ("<source>/chain": the drafter's argmax chain, the most recent lookup
    continuation) is predicted by the policy's per-position estimate, learned on that chain.
    The others are not: a sibling ("<source>/alt": the r-th candidate, scored by the draft
    probability ratio) and a first child under a sibling ("<source>/off": a block drafter's row
    was drafted for the chain's prefix, not the sibling's) are guesses. Each class keeps decayed
    sums of its predictions and hits over the nodes tried (parent on the accepted path), and its
    nodes' conditional predictions are scaled by (hits + 1) / (predicted + 1) (prior weight 1
    at ratio 1), capped so that no conditional exceeds 1."""

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.pred: dict[str, float] = {}
        self.hit: dict[str, float] = {}

    def factor(self, cls: str) -> float:
        return (self.hit.get(cls, 0.0) + 1.0) / (self.pred.get(cls, 0.0) + 1.0)

    def rescore(self, tree: DraftTree) -> None:
        """Classify every node, keep its raw conditional, and replace its score by the
        calibrated path product (nodes are in topological order: parents first)."""
        scores, conds, classes = self.calibrated(tree)
        for i, n in enumerate(tree.nodes):
            if i:
                n.score, n.cond, n.cls = scores[i], conds[i], classes[i]

    def calibrated(self, tree: DraftTree) -> tuple[list[float], list[float], list[str]]:
        """What `rescore` would set, without touching the tree (a tree still being drafted
        keeps its raw scores): -> (scores, raw conditionals, classes), root first."""
        on_chain = {0}
        for src in ("lookup", "drafter"):
            i = 0
            while True:
                kid = next((k for k in tree.nodes[i].kids if tree.nodes[k].source == src), None)
                if kid is None:
                    break
                on_chain.add(kid)
                i = kid
        raw = [n.score for n in tree.nodes]
        scores, conds, classes = [1.0] * len(raw), [1.0] * len(raw), [""] * len(raw)
        for i, n in enumerate(tree.nodes):
            if i == 0:
                continue
            par = tree.nodes[n.parent]
            conds[i] = raw[i] / raw[n.parent] if raw[n.parent] > 0 else 0.0
            first = next((k for k in par.kids if tree.nodes[k].source == n.source), None) == i
            classes[i] = f"{n.source}/{'chain' if i in on_chain else 'off' if first else 'alt'}"
            scores[i] = scores[n.parent] * min(1.0, conds[i] * self.factor(classes[i]))
        return scores, conds, classes

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """After verification: every node whose parent was accepted was tried."""
        on = set(path)
        for d in (self.pred, self.hit):
            for k in d:
                d[k] *= self.decay
        for i, n in enumerate(tree.nodes):
            if i and n.parent in on and n.cls:
                self.pred[n.cls] = self.pred.get(n.cls, 0.0) + n.cond
                self.hit[n.cls] = self.hit.get(n.cls, 0.0) + (i in on)


def choose_budget(scores: list[float], verify_time, draft_time: float, cap: int) -> int:
    """The node count (0..cap, within the measured verify lengths) that maximises expected
    tokens per second: (1 + sum of the best scores) / (draft_time + verify_time[count])."""
    cap = min(cap, len(scores), len(verify_time) - 1)
    best_n, best = 0, 1.0 / verify_time[0]
    e = 1.0
    for m in range(1, cap + 1):
        e += scores[m - 1]
        r = e / (draft_time + verify_time[m])
        if r > best * (1 + 1e-9):
            best_n, best = m, r
    return best_n


def newest_pays(scores: list[float], newest, verify_time, cap: int) -> bool:
    """Whether any node of `newest` (the depth just drafted) is among the nodes the budget would
    verify now (`choose_budget` over `scores`, root first; verify_time None: a fixed budget of
    `cap` nodes, `--tree N --verify-policy fixed`). A child never scores above its parent, so
    where none of them is kept, nothing drafted below them would be: a drafter that grows its
    tree a depth per forward stops there (EAGLE-2's expansion, sized by cost)."""
    order = sorted(range(1, len(scores)), key=lambda i: (-scores[i], i))
    n = cap if verify_time is None else choose_budget([scores[i] for i in order], verify_time, 0.0, cap)
    newest = set(newest)
    return any(i in newest for i in order[:n])


# ------------------------------------------------------------------------------- verification

def accept_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """argmax [n] (the target's choice after each node) -> (accepted path of node indices,
    root first, and the bonus token)."""
    i, path = 0, [0]
    while True:
        t = int(argmax[i])
        nxt = next((k for k in tree.nodes[i].kids if tree.nodes[k].token == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        i = nxt


def accept_sampled(tree: DraftTree, p_rows: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """p_rows [n, V] (the target's distribution after each node, sampling transform applied)
    -> (accepted path, the next token) by recursive rejection over each node's children."""
    if not np.isfinite(p_rows).all():
        raise _nonfinite()
    i, path = 0, [0]
    while True:
        p = np.asarray(p_rows[i], np.float64)
        p = p / p.sum()
        nxt = None
        for k in tree.nodes[i].kids:
            node = tree.nodes[k]
            x = node.token
            if node.q is None:  # a deterministic candidate: a point-mass proposal
                if rng.random() < p[x]:
                    nxt = k
                    break
                p[x] = 0.0
            else:
                q = np.asarray(node.q, np.float64).copy()
                if node.excl:
                    q[list(node.excl)] = 0.0
                s = q.sum()
                if not (np.isfinite(s) and s > 0):
                    continue  # a broken draft row proposes nothing
                q /= s
                if q[x] > 0 and rng.random() * q[x] < p[x]:
                    nxt = k
                    break
                p = np.maximum(p - q, 0.0)
            s = p.sum()
            if s <= 0:  # only when p equalled the proposal, where rejecting is impossible in exact arithmetic
                p, s = np.asarray(p_rows[i], np.float64), float(np.sum(p_rows[i]))
            p = p / s
        if nxt is None:
            return path, int(_draw(p, rng))
        path.append(nxt)
        i = nxt
