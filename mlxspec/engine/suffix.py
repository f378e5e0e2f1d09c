"""Suffix drafting (SuffixDecoding, as in Snowflake's ArcticInference): model-free proposals
from the longest earlier match of the text so far, in this request and in earlier ones.

The index (`SuffixIndex`) is a generalized suffix automaton over documents of token ids.
Why an automaton and not ArcticInference's depth-capped suffix tree:
- appending a token is amortised O(1) (the classic online construction; the tree inserts each
  new token into up to max-depth suffixes, O(64) per token, which is what costs in Python on
  a 2-core CPU where a prompt of a few thousand tokens is indexed per request);
- the longest match of a growing query (the request's tokens) against another index is kept
  in amortised O(1) per token as well (`Matcher`, matching statistics along suffix links);
- the occurrences of a match are the leaves of its state's subtree in the suffix-link tree,
  each recorded once as (document, end position), so the continuations and their counts are
  read from the documents themselves at lookup (capped at `max_occ` occurrences).
What it gives up: removing a document. Eviction instead drops the least recently used
documents down to a low-water mark (3/4 of the budget) and rebuilds the automaton from the
rest, so a rebuild happens at most once per quarter-budget of appended tokens (amortised O(1)
per token again) and the token count never exceeds the budget.

Proposals (`SuffixIndex.propose`): from the longest match, and from up to `max_backoff`
shorter ones along the suffix links, a chain of the most frequent continuation at each step,
stopped when its path probability (the product of the chosen tokens' shares of the counts,
ArcticInference's rule) falls below `min_prob` (0.1), at most alpha x the match length long;
equal counts go to the most recent occurrence (what prompt lookup proposes); the chain with
the highest expected accepted length (the sum of its path probabilities) wins.
`propose_many` gives the distinct continuations of the longest match instead, most frequent
first (equal counts: most recent first), for tree verification (`mlxspec.engine.tree`).

`SuffixLookup` is the per-request proposer behind `NgramIndex`'s interface (reset / extend /
propose(anchor, k) -> (tokens, match length)): its own index over prompt + generated tokens,
plus a shared index (earlier requests' outputs, and this one's as it grows) consulted the same
way; the better-scored proposal wins. Where a shared index lives (a `Speculator`, the server,
per API key) is the app's business.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

ROOT = 0


class Match(int):
    """A bucketed match length (`match_bucket`) that says whether it was found in the shared
    index over earlier requests (`shared`) or in the request's own text: the policy keeps an
    acceptance estimate for each (`engine.policy.Source.lookup`)."""

    shared: bool

    def __new__(cls, m: int, shared: bool = False):
        self = super().__new__(cls, m)
        self.shared = bool(shared)
        return self


def match_bucket(m: int) -> int:
    """The match length the policy keeps an acceptance estimate for (`Source.lookup(match)`):
    exact up to 4, then 5, 8, 16, 32 (a suffix match can be hundreds of tokens long)."""
    if m <= 4:
        return m
    return 5 if m < 8 else 8 if m < 16 else 16 if m < 32 else 32


class SuffixIndex:
    """A generalized suffix automaton over documents (lists of token ids) with LRU eviction
    under a token budget (None: unbounded). Thread-safe (one lock)."""

    def __init__(self, budget: int | None = None, *, low_water: float = 0.75, max_occ: int = 64):
        if budget is not None and budget < 1:
            raise ValueError(f"suffix index budget must be >= 1 token, got {budget}")
        self.budget, self.low_water, self.max_occ = budget, low_water, max_occ
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self.last: dict[int, int] = {}  # document -> the state of its whole text
        self.generation = 0  # +1 per rebuild: states held elsewhere (matchers) are stale
        self.lock = threading.RLock()
        self._next_doc = 0
        self._reset()

    def _reset(self):
        self.nxt: list[dict[int, int]] = [{}]  # transitions
        self.link: list[int] = [-1]  # suffix links
        self.len: list[int] = [0]  # longest string of each state
        self.kids: list[set[int] | None] = [None]  # the suffix-link tree
        self.ends: list[list[int] | None] = [None]  # (doc << 32 | pos) of the prefixes that end in a state
        self.ntokens = 0

    # -- size ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Tokens held (what the budget bounds)."""
        return self.ntokens

    @property
    def states(self) -> int:
        return len(self.len)

    # -- documents ----------------------------------------------------------------------
    def open(self, tokens=()) -> int:
        """A new document (most recently used), with `tokens` appended -> its id."""
        with self.lock:
            doc = self._next_doc
            self._next_doc += 1
            self.docs[doc] = []
            self.last[doc] = ROOT
            self.extend(doc, tokens)
            return doc

    def extend(self, doc: int, tokens) -> None:
        """Append tokens to a document (one evicted meanwhile starts again from them)."""
        with self.lock:
            if doc not in self.docs:
                self.docs[doc], self.last[doc] = [], ROOT
            self.docs.move_to_end(doc)
            for t in tokens:
                self._append(doc, int(t))
                if self.budget is not None and self.ntokens > self.budget:
                    self._evict(doc)

    def documents(self) -> list[list[int]]:
        """The documents' tokens, least recently used first (`open` them in this order to get
        the same index back)."""
        with self.lock:
            return [list(t) for t in self.docs.values() if t]

    def touch(self, docs) -> None:
        with self.lock:
            for d in docs:
                if d in self.docs:
                    self.docs.move_to_end(d)

    def _evict(self, current: int) -> None:
        """Drop least recently used documents down to the low-water mark (the current one, the
        most recent, is cut to its tail if it alone is over), then rebuild."""
        target = int(self.budget * self.low_water)
        total = self.ntokens
        for d in list(self.docs):
            if total <= target:
                break
            if d != current:
                total -= len(self.docs.pop(d))
                del self.last[d]
        if total > target:
            toks = self.docs[current]
            self.docs[current] = toks[total - target:]
        self._rebuild()

    def _rebuild(self) -> None:
        docs = list(self.docs.items())
        self._reset()
        for d, toks in docs:
            self.docs[d], self.last[d] = [], ROOT
            for t in toks:
                self._append(d, t)
        self.generation += 1

    # -- the automaton ------------------------------------------------------------------
    def _new(self, length: int, nxt: dict, link: int) -> int:
        s = len(self.len)
        self.len.append(length)
        self.nxt.append(nxt)
        self.link.append(-1)
        self.kids.append(None)
        self.ends.append(None)
        self._set_link(s, link)
        return s

    def _set_link(self, s: int, parent: int) -> None:
        old = self.link[s]
        if old >= 0:
            self.kids[old].discard(s)
        self.link[s] = parent
        if parent >= 0:
            if self.kids[parent] is None:
                self.kids[parent] = set()
            self.kids[parent].add(s)

    def _clone(self, p: int, c: int, q: int) -> int:
        """Split q: a state for its strings up to len(p) + 1, which p's chain now reaches."""
        nxt, link = self.nxt, self.link
        clone = self._new(self.len[p] + 1, dict(nxt[q]), link[q])
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        self._set_link(q, clone)
        return clone

    def _append(self, doc: int, c: int) -> None:
        toks = self.docs[doc]
        end = (doc << 32) | len(toks)
        toks.append(c)
        self.ntokens += 1
        last, nxt, ln = self.last[doc], self.nxt, self.len
        q = nxt[last].get(c)
        if q is not None:  # another document already continued this prefix with c
            s = q if ln[q] == ln[last] + 1 else self._clone(last, c, q)
        else:
            s = self._new(ln[last] + 1, {}, -1)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = s
                p = self.link[p]
            if p == -1:
                self._set_link(s, ROOT)
            else:
                q = nxt[p][c]
                self._set_link(s, q if ln[p] + 1 == ln[q] else self._clone(p, c, q))
        if self.ends[s] is None:
            self.ends[s] = []
        self.ends[s].append(end)
        self.last[doc] = s

    # -- lookup -------------------------------------------------------------------------
    def occurrences(self, state: int, cap: int | None = None) -> list[tuple[int, int]]:
        """(document, end position) of the occurrences of a state's strings: all of them, or
        `cap` of them in no particular order (the counts are then a sample)."""
        cap = self.max_occ if cap is None else cap
        out, stack = [], [state]
        while stack and len(out) < cap:
            s = stack.pop()
            if self.ends[s]:
                out.extend(self.ends[s])
            if self.kids[s]:
                stack.extend(self.kids[s])
        return [(e >> 32, e & 0xFFFFFFFF) for e in out[:cap]]

    def find(self, tokens) -> tuple[int, int]:
        """(state, length) of the longest suffix of `tokens` that occurs in the index."""
        m = Matcher(self, depth=len(tokens) or 1)
        m.feed(tokens)
        return m.where()

    def continuations(self, context) -> tuple[int, dict[int, int]]:
        """The longest suffix of `context` that occurs with a following token -> (its length,
        {next token: count}); (0, {}) when none does."""
        with self.lock:
            v, l = self.find(context)
            while v > ROOT:  # the root is the empty match
                counts = self._counts(self.occurrences(v), 1)
                if counts:
                    return l, counts
                v = self.link[v]
                l = self.len[v] if v != -1 else 0
            return 0, {}

    def _counts(self, occ, j: int, own: int | None = None, ext=(), latest: dict | None = None) -> dict[int, int]:
        """{token at j after each occurrence: count}; `latest` gets each token's most recent
        occurrence (document, position)."""
        counts: dict[int, int] = {}
        for d, p in occ:
            t = self._token(d, p + j, own, ext)
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
                if latest is not None and (d, p) > latest.get(t, (-1, -1)):
                    latest[t] = (d, p)
        return counts

    def _token(self, d: int, i: int, own: int | None, ext) -> int | None:
        toks = self.docs.get(d)
        if toks is None:
            return None
        if i < len(toks):
            return toks[i]
        if d == own and i - len(toks) < len(ext):  # the request itself: it continues with the anchor and the chain
            return ext[i - len(toks)]
        return None

    def propose(self, state: int, length: int, anchor: int, n: int, *, own: int | None = None, alpha: float = 1.0,
                min_prob: float = 0.1, max_backoff: int = 4, min_match: int = 1) -> tuple[list[int], int, float]:
        """A chain of up to n tokens to follow `anchor`, where (state, length) is the longest match
        of the text before the anchor -> (tokens, match length incl. the anchor, score = expected
        accepted tokens); no proposal from a match shorter than `min_match` tokens. own: the
        document that is this request's own text (its continuation past its end is the anchor and
        the chain, so periodic text extends itself)."""
        best: tuple[list[int], int, float] = ([], 0, 0.0)
        best_docs: set = set()
        if n <= 0:
            return best
        with self.lock:
            v, l, tries, walked = state, length, 0, 0
            while v != -1 and tries < max_backoff and walked < 64:
                walked += 1
                l = min(l, self.len[v])
                if l + 1 < min_match:
                    break  # backing off only shortens the match
                u = self.nxt[v].get(anchor)
                if u is not None:
                    k = min(n, int(alpha * (l + 1) + 1e-6))
                    if k > 0:
                        tries += 1
                        toks, score, docs = self._chain(u, k, min_prob, own, anchor)
                        if score > best[2]:
                            best, best_docs = (toks, l + 1, score), docs
                v = self.link[v]
                l = self.len[v] if v != -1 else 0
            self.touch(best_docs)
        return best

    def propose_many(self, state: int, length: int, anchor: int, n: int, width: int, *,
                     own: int | None = None, min_match: int = 1) -> tuple[list[list[int]], int, list[int]]:
        """Up to `width` distinct continuations (up to n tokens each) of the longest match that
        the anchor extends, of at least `min_match` tokens -> (continuations, match length incl.
        the anchor, their counts); most frequent first, ties to the most recent occurrence."""
        if n <= 0 or width <= 0:
            return [], 0, []
        with self.lock:
            v, l = state, length
            while v != -1:
                l = min(l, self.len[v])
                if l + 1 < min_match:
                    break
                u = self.nxt[v].get(anchor)
                if u is not None:
                    seen: dict[tuple, list] = {}
                    for d, p in self.occurrences(u):
                        toks: list[int] = []
                        for j in range(1, n + 1):
                            t = self._token(d, p + j, own, [anchor] + toks)
                            if t is None:
                                break
                            toks.append(t)
                        if toks:
                            c = seen.setdefault(tuple(toks), [0, (-1, -1)])
                            c[0] += 1
                            c[1] = max(c[1], (d, p))
                    if seen:
                        best = sorted(seen.items(), key=lambda kv: (kv[1][0], kv[1][1]), reverse=True)[:width]
                        self.touch({d for (d, _p) in [kv[1][1] for kv in best]})
                        return [list(k) for k, _ in best], l + 1, [c for _, (c, _r) in best]
                v = self.link[v]
                l = self.len[v] if v != -1 else 0
        return [], 0, []

    def _chain(self, u: int, k: int, min_prob: float, own: int | None, anchor: int):
        alive = self.occurrences(u)
        out: list[int] = []
        prob, score, docs = 1.0, 0.0, set()
        for j in range(1, k + 1):
            ext = [anchor] + out
            latest: dict = {}
            counts = self._counts(alive, j, own, ext, latest)
            if not counts:
                break
            tok = max(counts, key=lambda t: (counts[t], latest[t]))  # ties: the most recent (as prompt lookup)
            prob *= counts[tok] / sum(counts.values())
            if prob < min_prob:
                break
            out.append(tok)
            score += prob
            alive = [(d, p) for d, p in alive if self._token(d, p + j, own, ext) == tok]
            if j == 1:
                docs = {d for d, _ in alive}
        return out, score, docs


class Matcher:
    """The longest suffix of a growing query (a request's tokens) that occurs in `index`, as
    (state, length), kept in amortised O(1) per token; after an eviction rebuilt the index it
    is found again from the last `depth` tokens."""

    def __init__(self, index: SuffixIndex, depth: int = 64):
        self.index, self.depth = index, depth
        self.state, self.length = ROOT, 0
        self.tail: list[int] = []
        self.gen = index.generation

    def feed(self, tokens) -> None:
        with self.index.lock:
            if self.gen != self.index.generation:
                self.gen, self.state, self.length = self.index.generation, ROOT, 0
                for t in self.tail:
                    self._step(t)
            for t in tokens:
                t = int(t)
                self.tail.append(t)
                self._step(t)
            if len(self.tail) > 2 * self.depth:
                del self.tail[: -self.depth]

    def _step(self, t: int) -> None:
        ix = self.index
        v, l = self.where_unlocked()
        while v != ROOT and t not in ix.nxt[v]:
            v = ix.link[v]
            l = ix.len[v]
        if t in ix.nxt[v]:
            v, l = ix.nxt[v][t], l + 1
        else:
            l = 0
        self.state, self.length = v, l

    def where_unlocked(self) -> tuple[int, int]:
        ix, v, l = self.index, self.state, self.length
        while v != ROOT and l <= ix.len[ix.link[v]]:  # a clone took the shorter strings since
            v = ix.link[v]
        return v, l

    def where(self) -> tuple[int, int]:
        with self.index.lock:
            if self.gen != self.index.generation:
                self.feed(())
            return self.where_unlocked()


class SuffixLookup:
    """Suffix drafting for one request, with `NgramIndex`'s interface: an index over the prompt
    and the generated tokens, and `shared` (a `SuffixIndex` over earlier requests' outputs; this
    request's output joins it as it is generated) consulted the same way.

    The request's document in the shared index starts with the prompt's last `prompt_tail`
    tokens (the end of the question, not the whole prompt: that is in the request's own index,
    and prompts would fill the budget with copies of one conversation), so that the start of
    an answer is found again from the same question. `shared` may be replaced between requests
    (the server: one per API key)."""

    name = "suffix"

    # alpha 4, not ArcticInference's 1: a lookup's drafts cost nothing to make, and the adaptive
    # policy verifies only what pays by its estimate per match length; replayed on the agent
    # trace (scripts/agent_bench.py) with every draft verified, alpha 4 is never below prompt
    # lookup's tau per turn, alpha 1 is below it on the first turn (docs/suffix.md)
    # min_match 2, as prompt lookup's shortest n-gram: a match of the anchor alone is any earlier
    # occurrence of the token; beside the EAGLE-3 drafter on the agent trace such proposals were
    # accepted 0 times in 16 verifies, each verify costing ~1.2 steps for the one token it commits
    # shared_min_match 4: a 2-3-token match in other requests' text is weak evidence (common
    # bigrams of the language); on the 40 held-out prompts with fixed costs, 4 moved EAGLE-3 +
    # suffix from 2.250/2.254/1.405 to 2.291/2.259/1.384 and DSpark + suffix's chat from 1.093 to
    # 1.145 (lookup: 1.151), and kept the agent replay's repeated session (docs/suffix.md, run 4)
    def __init__(self, shared: SuffixIndex | None = None, *, alpha: float = 4.0, min_prob: float = 0.1,
                 max_depth: int = 64, prompt_tail: int = 16, min_match: int = 2, shared_min_match: int = 4):
        for name, v in (("min_match", min_match), ("shared_min_match", shared_min_match)):
            if v < 1:
                raise ValueError(f"suffix {name} must be >= 1, got {v}")
        self.shared, self.alpha, self.min_prob, self.max_depth = shared, alpha, min_prob, max_depth
        self.min_match, self.shared_min_match = min_match, shared_min_match
        self.prompt_tail = prompt_tail
        self.reset(())

    @property
    def tokens(self) -> list[int]:
        return self.local.docs[self.doc]

    def reset(self, tokens) -> None:
        self.local = SuffixIndex()
        self.doc = self.local.open(tokens)
        self.shared_doc, self.matcher = None, None
        if self.shared is not None:
            tokens = [int(t) for t in tokens]
            self.matcher = Matcher(self.shared, self.max_depth)
            self.matcher.feed(tokens)
            self.shared_doc = self.shared.open(tokens[-self.prompt_tail:] if self.prompt_tail else ())

    def extend(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        self.local.extend(self.doc, tokens)
        if self.shared is not None:
            self.shared.extend(self.shared_doc, tokens)
            self.matcher.feed(tokens)

    def propose_many(self, anchor: int, k: int, width: int) -> tuple[list[list[int]], int]:
        """Up to `width` distinct continuations of up to k tokens (the request's own longest match
        first, then the shared index's) -> (continuations, bucketed match length)."""
        loc = self.local
        outs, m, _ = loc.propose_many(loc.last[self.doc], len(loc.docs[self.doc]), int(anchor), k, width, own=self.doc,
                                      min_match=self.min_match)
        shared = False
        if self.shared is not None:
            with self.shared.lock:
                v, l = self.matcher.where()
                more, m2, _ = self.shared.propose_many(v, l, int(anchor), k, width, own=self.shared_doc,
                                                       min_match=self.shared_min_match)
            shared = m2 > m
            if shared:  # the longer match's continuations first
                outs, more, m = more, outs, m2
            outs += [c for c in more if c not in outs][: max(width - len(outs), 0)]
        return outs, Match(match_bucket(m), shared) if outs else 0

    def propose(self, anchor: int, k: int) -> tuple[list[int], int]:
        """Up to k tokens to follow `anchor` -> (tokens, bucketed match length; 0 if none)."""
        if k <= 0:
            return [], 0
        kw = dict(alpha=self.alpha, min_prob=self.min_prob)
        loc = self.local
        best = loc.propose(loc.last[self.doc], len(loc.docs[self.doc]), int(anchor), k, own=self.doc,
                           min_match=self.min_match, **kw)
        shared = False
        if self.shared is not None:
            with self.shared.lock:  # no rebuild between finding the match and reading it
                v, l = self.matcher.where()
                other = self.shared.propose(v, l, int(anchor), k, own=self.shared_doc,
                                            min_match=self.shared_min_match, **kw)
            shared = other[2] > best[2]
            if shared:
                best = other
        toks, match, _ = best
        return (toks, Match(match_bucket(match), shared)) if toks else ([], 0)
