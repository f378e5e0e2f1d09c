"""Model-free drafting: prompt lookup (n-gram matching against the text so far).

The last n tokens (the anchor included) are looked up among the earlier prompt and
generated tokens; the tokens that followed the most recent earlier occurrence are the
proposal. Longer n-grams are tried first (n_max down to n_min). This is what llama.cpp's
n-gram speculative types, vLLM's `ngram` method and transformers' `prompt_lookup_num_tokens`
do. The proposal costs a dictionary lookup, no forward.

Also `LookupBlockDrafter`: a block drafter plus lookup; the engine's policy picks, per
step and from history only, the lookup's tokens or the block drafter's.

Both drafters take the lookup index they use (`index`): `NgramIndex` by default, or
`mlxspec.engine.suffix.SuffixLookup` (suffix drafting: longer matches, counts, and a shared
index over earlier requests). An index has reset(tokens), extend(tokens) and
propose(anchor, k) -> (tokens, match length).
"""

from __future__ import annotations

import numpy as np

from mlxspec.engine.drafting import DraftOutput

LOOKUP_MAX = 16  # beside a model drafter, under the adaptive policy: the lookup's most drafts


class NgramIndex:
    """Most recent end position of every n-gram (n_min..n_max) in a growing token list."""

    name = "ngram"
    MAX_ENDS = 8

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}
        self.ends: dict[tuple, list] = {}  # the n-gram's earlier end positions (most recent MAX_ENDS)

    def reset(self, tokens) -> None:
        self.tokens, self.last, self.ends = [], {}, {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            i = len(self.tokens) - 1
            for n in range(self.n_min, min(self.n_max, i + 1) + 1):
                key = tuple(self.tokens[i - n + 1 : i + 1])
                prev = self.last.get(key)
                if prev is not None:  # a repeat: keep the earlier ends too (trees use them)
                    ends = self.ends.setdefault(key, [prev])
                    ends.append(i)
                    if len(ends) > self.MAX_ENDS:
                        del ends[0]
                self.last[key] = i

    def propose(self, anchor: int, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest matching n-gram ending in `anchor`
        (the anchor follows self.tokens); -> (tokens, n of the match, 0 if none)."""
        if k <= 0:
            return [], 0
        seq = self.tokens + [int(anchor)]
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            end = self.last.get(tuple(seq[-n:]))
            if end is None:
                continue
            out: list[int] = []
            cur = end + 1  # continue after the earlier occurrence; periodic text extends itself
            while len(out) < k:
                ext = seq[cur] if cur < len(seq) else out[cur - len(seq)]
                out.append(ext)
                cur += 1
            return out, n
        return [], 0


def _continuation(seq: list, end: int, k: int) -> list:
    out: list[int] = []
    cur = end + 1  # continue after the earlier occurrence; periodic text extends itself
    while len(out) < k:
        out.append(seq[cur] if cur < len(seq) else out[cur - len(seq)])
        cur += 1
    return out


def propose_many(index, anchor: int, k: int, width: int) -> tuple[list[list[int]], int]:
    """Up to `width` distinct continuations (most recent first) of the longest n-gram ending
    in `anchor` -> (continuations, n of the match); an index without the method gives its one
    proposal (a tree of one path)."""
    if hasattr(index, "propose_many"):  # suffix drafting: continuations ranked by count
        return index.propose_many(anchor, k, width)
    if not hasattr(index, "ends"):
        toks, m = index.propose(anchor, k)
        return ([toks] if toks else []), m
    if k <= 0:
        return [], 0
    seq = index.tokens + [int(anchor)]
    for n in range(min(index.n_max, len(seq) - 1), index.n_min - 1, -1):
        key = tuple(seq[-n:])
        last = index.last.get(key)
        if last is None:
            continue
        outs: list[list[int]] = []
        for end in reversed(index.ends.get(key, [last])):
            c = _continuation(seq, end, k)
            if c not in outs:
                outs.append(c)
            if len(outs) >= width:
                break
        return outs, n
    return [], 0


def lookup_output(tokens: list[int], sp, vocab_size: int) -> DraftOutput:
    """A deterministic proposal as a draft: under sampling its draft distributions are
    one-hot rows (what sampled verification needs), kept on the host where verification reads
    them (a copy into MLX and back: 0.33 ms against 0.12 for 16 rows of 49,152, 2026-12-05)."""
    if sp.greedy or not tokens:
        return DraftOutput(tokens, None, None)
    q = np.zeros((len(tokens), vocab_size), np.float32)
    q[np.arange(len(tokens)), tokens] = 1.0
    return DraftOutput(tokens, q, None)


class NgramDrafter:
    """`--spec-type ngram`: prompt lookup behind the same Drafter protocol."""

    name = "ngram"
    taps: tuple = ()
    proposes_model_drafts, has_lookup = False, True  # draft() is the lookup itself

    def __init__(self, vocab_size: int, max_drafts: int = 8, n_min: int = 2, n_max: int = 4, index=None):
        self.vocab_size, self.max_drafts = vocab_size, max_drafts
        self.index = NgramIndex(n_min, n_max) if index is None else index
        self.name = self.index.name

    def begin(self, prompt_ids, prompt_taps):
        self.index.reset(prompt_ids)

    def accept(self, tokens, taps):
        self.index.extend(tokens)

    def lookup(self, anchor: int, n: int) -> tuple[list[int], int]:
        """(proposed tokens, length of the n-gram that matched; 0 = no match)."""
        return self.index.propose(anchor, min(n, self.max_drafts))

    def draft(self, anchor, n, sp, rng) -> DraftOutput:
        return lookup_output(self.lookup(anchor, n)[0], sp, self.vocab_size)


class LookupBlockDrafter:
    """A model drafter (DFlash / DSpark / DFlash 2 blocks, EAGLE-3 chains) with prompt lookup beside it (`--ngram`).

    `draft` is the block drafter's; `lookup` is the free n-gram proposal. Which one is
    verified is the policy's choice (`mlxspec.engine.policy`), made from this request's measured
    acceptance of each, before either is verified."""

    proposes_model_drafts, has_lookup = True, True

    def __init__(self, block, vocab_size: int, n_min: int = 2, n_max: int = 4, index=None, lookup_max: int = 0):
        self.block = block
        self.index = NgramIndex(n_min, n_max) if index is None else index
        self.name = f"{block.name}+{self.index.name}"
        self.taps = block.taps
        # the model drafter's most drafts; the lookup may propose more (lookup_max: its drafts cost
        # nothing, and a long earlier match, an agent's file sent back, is worth a long verify):
        # max_drafts is the larger, the policy caps the model's plans at model_max
        self.model_max = block.max_drafts
        self.max_drafts = max(block.max_drafts, int(lookup_max))
        self.chain = bool(getattr(block, "chain", False))  # a chain drafter's cost is per draft (policy)
        self.stops_early = bool(getattr(block, "stops_early", False))  # it can be stopped as it drafts
        self.vocab_size = vocab_size

    @property
    def ctx_len(self):
        return getattr(self.block, "ctx_len", None)

    def begin(self, prompt_ids, prompt_taps):
        self.block.begin(prompt_ids, prompt_taps)
        self.index.reset(prompt_ids)

    def accept(self, tokens, taps):
        self.block.accept(tokens, taps)
        self.index.extend(tokens)

    def lookup(self, anchor: int, n: int) -> tuple[list[int], int]:
        return self.index.propose(anchor, min(n, self.max_drafts))

    def draft(self, anchor, n, sp, rng, **kw) -> DraftOutput:
        return self.block.draft(anchor, min(n, self.model_max), sp, rng, **kw)
