"""Which optional parts a drafter file carries (Markov head and its rank and type, confidence
head, log-SNR conditioning, reduced draft vocabulary, own embeddings / LM head), decided
once for every format from its metadata and its tensors.

A key that is present wins and must then agree with the tensors (`claim_tensors` checks
it); an absent key means what the format's `FeatureRules` say: "off", or "as the tensors
say" (speculators and GGUF `dflash`, whose writers omit keys the tensors imply).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from mlxspec import validate as V
from mlxspec.drafters.common import parse_flag
from mlxspec.errors import MlxspecError


@dataclass(frozen=True)
class FeatureRules:
    """How one format spells the optional features and reads an absent key."""

    confidence_keys: tuple  # the keys that switch the confidence head (aliases must agree)
    from_tensors: bool  # absent Markov / confidence keys mean "as the tensors say" (else "off")
    note_prefix: str  # written before a key in error notes ("config " for config.json)
    absent: dict  # feature -> error note when its key is absent
    no_reduced_vocab: str | None = None  # note when the format cannot hold d2t; None: it can
    int_opts: dict = field(default_factory=dict)  # validate.as_int options for markov_rank


def infer_features(
    lookup: Callable[[str], tuple[str, Any] | None], shapes: dict, hidden: int, rules: FeatureRules, path: str
) -> tuple[dict, dict]:
    """(DrafterSpec feature fields, notes for claim_tensors' errors).

    lookup(key): (the key as the file writes it, its value), or None when the file has no
    such key. shapes: DFlashModel parameter name -> shape for the tensors in the file.
    hidden: the drafter width (a confidence head wider than it also reads the Markov state).
    """
    notes: dict = {}
    prefix = rules.note_prefix

    w1 = shapes.get("markov_head.markov_w1.weight")
    found = lookup("markov_rank")
    if found is not None:
        rank = V.as_int(found[1], found[0], path, 0, V.MAX_DIM, **rules.int_opts)
        notes["Markov head"] = f"{prefix}{found[0]}={rank}"
    else:
        rank = int(w1[1]) if (rules.from_tensors and w1 is not None and len(w1) == 2) else 0
        notes["Markov head"] = rules.absent["Markov head"]
    found = lookup("markov_head_type")
    head_type = None if found is None else found[1]
    if head_type is None:
        head_type = "vanilla"
        if rules.from_tensors and "markov_head.gate_proj.weight" in shapes:
            head_type = "gated"
        elif rules.from_tensors and "markov_head.joint_proj.weight" in shapes:
            head_type = "rnn"
    head_type = str(head_type).lower()
    if rank and head_type not in ("vanilla", "gated", "rnn"):
        raise MlxspecError(f"{path}: markov_head_type {head_type!r} is unknown (vanilla, gated, rnn)")
    notes["gated/rnn Markov head"] = f"markov_head_type={head_type}"

    conf_w = shapes.get("confidence_head.proj.weight")
    keys = [f for f in map(lookup, rules.confidence_keys) if f is not None]
    if len(keys) == 2 and parse_flag(keys[0][1], keys[0][0], path) != parse_flag(keys[1][1], keys[1][0], path):
        raise MlxspecError(
            f"{path}: {keys[0][0]}={keys[0][1]} and {keys[1][0]}={keys[1][1]} disagree; fix the metadata"
        )
    if keys:
        conf = parse_flag(keys[0][1], keys[0][0], path)
        notes["confidence head"] = f"{prefix}{keys[0][0]}={'true' if conf else 'false'}"
    else:
        conf = bool(rules.from_tensors and conf_w is not None)
        notes["confidence head"] = rules.absent["confidence head"]
    found = lookup("confidence_head_with_markov")
    if found is not None and found[1] is not None:
        with_markov = parse_flag(found[1], found[0], path)
    else:
        with_markov = bool(conf_w is None or len(conf_w) != 2 or conf_w[1] != hidden)

    found = lookup("log_snr_conditioning")
    log_snr = False if found is None else parse_flag(found[1], found[0], path)
    notes["log-SNR conditioning"] = (rules.absent["log-SNR conditioning"] if found is None
                                     else f"{prefix}{found[0]}={'true' if log_snr else 'false'}")

    draft_vocab = None
    if rules.no_reduced_vocab is not None:
        notes["reduced draft vocabulary"] = rules.no_reduced_vocab
    elif "d2t" in shapes:
        draft_vocab = int(shapes["d2t"][0])

    return dict(
        markov_rank=rank,
        markov_head_type=head_type,
        confidence_head=conf,
        confidence_head_with_markov=with_markov,
        log_snr=log_snr,
        draft_vocab_size=draft_vocab,
        has_embed="embed_tokens.weight" in shapes,
        has_lm_head="lm_head.weight" in shapes,
    ), notes
