"""Rank 0's per-forward header: what the other ranks need to run the same forward.

Words: [command, cache id, committed length, L, logits mode, n taps, freed cache id, check]
+ the tap ids, then the L tokens. Over the links it is sent as is (variable length); over
MLX's collectives it is one all_sum of `WORDS` int32 (rank 0's values, zeros elsewhere), the
tokens inline when they fit, else in a second all_sum."""

from __future__ import annotations

WORDS = 64  # int32 words of one all_sum header
MAX_TAPS = 16
FIXED = 8  # the words before the taps
STOP, FWD = 1, 2
MODES = {"all": 0, "last": 1, "none": 2}
MODE_NAMES = {v: k for k, v in MODES.items()}


def forward_header(cid: int, offset: int, n_tokens: int, logits: str, taps, freed: int, check: bool) -> list[int]:
    return [FWD, cid, offset, n_tokens, MODES[logits], len(taps), freed, int(check)] + list(taps)


def stop_header() -> list[int]:
    return [STOP] + [0] * (FIXED - 1)


def split(words: list[int]) -> tuple[list[int], list[int]]:
    """header words + tokens (as sent over a link) -> (header padded to FIXED + MAX_TAPS, tokens)."""
    n = FIXED + words[5]
    return words[:n] + [0] * (FIXED + MAX_TAPS - n), words[n:]


def pack_words(hdr: list[int], toks: list[int]) -> list[int]:
    """The all_sum form: WORDS int32, the tokens inline when they fit (else none)."""
    room = WORDS - FIXED - MAX_TAPS
    inline = toks if len(toks) <= room else []
    return hdr + [0] * (FIXED + MAX_TAPS - len(hdr)) + inline + [0] * (room - len(inline))


def inline_tokens(h: list[int]) -> list[int] | None:
    """The tokens of an all_sum header, or None when they come in a second all_sum."""
    room = WORDS - FIXED - MAX_TAPS
    L = h[3]
    return h[FIXED + MAX_TAPS: FIXED + MAX_TAPS + L] if L <= room else None
