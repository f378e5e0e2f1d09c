"""Held-out tau in seconds, not minutes: the greedy decode replayed from one drafter pass.

Greedy speculative decoding with full blocks is deterministic: from anchor a the drafter
proposes its argmax chain, the target accepts the leading drafts that equal its own greedy
tokens, and the next anchor is a + accepted + 1. Its Markov head conditions each row on the
previous draft, which equals the target's token whenever that row was accepted, so the
accepted length at *every* anchor follows from one teacher-forced pass over the target's
greedy continuation (`blocks.block_logits`). Replaying the anchor walk over those lengths
gives the tau, acceptance and per-position acceptance `mlxspec.evaluate.evaluate_drafter`
measures with the engine on the same prompts and token budget, for a fraction of the cost
(checked against it in tests/test_train.py and the model card).

The continuation store holds the target's greedy answers to the held-out prompts of
`mlxspec/data/prompts.json` (taps and all), built once per target and taps.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.errors import MlxspecError
from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.train.blocks import block_logits, draft_choice
from mlxspec.train.regen import generate_windows

CATEGORIES = ("code", "prose", "chat")


def target_name(target) -> str:
    """The name a target's cached training files go under: its hub repo (a snapshot's directory
    name is its commit hash) or its file's stem."""
    from mlxspec.cache import hub_repo_of

    repo = hub_repo_of(target.info.source)
    return repo.replace("/", "--") if repo else Path(target.info.source).stem


def default_heldout_dir(target, taps, n_per_category: int = 8, max_tokens: int = 64) -> Path:
    """Where `mlxspec train --heldout-every` keeps the target's held-out answers for these taps
    (a store per prompt count and answer length; "-f32": stores with float32 taps, so a cache
    written before them, with bfloat16 taps, is not replayed as if it were exact)."""
    from mlxspec.cache import cache_dir

    name = f"{target_name(target)}-t{'_'.join(map(str, taps))}"
    if (n_per_category, max_tokens) != (8, 64):
        name += f"-n{n_per_category}-m{max_tokens}"
    return cache_dir() / "heldout" / f"{name}-f32"


def build_heldout(target, tokenizer, taps, out: str | Path, n_per_category: int = 8, max_tokens: int = 64,
                  categories=CATEGORIES, temp: float = 0.0, seed: int = 0) -> Path:
    """The target's greedy continuations of the held-out prompts -> out/<category>.npz, with
    float32 taps, so `heldout_tau` replays exactly what the engine drafts. temp > 0: sampled
    continuations instead (seed), for measures of sampled decoding (a store of its own)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts()
    for cat in categories:
        f = out / f"{cat}.npz"
        if f.exists():
            with np.load(f) as z:  # stores written before `temp` existed are greedy
                made = (float(z["temp"]) if "temp" in z.files else 0.0, int(z["seed"]) if "seed" in z.files else 0)
            if made[0] != temp or (temp > 0 and made[1] != seed):
                raise MlxspecError(f"{f}: held-out store made at temperature {made[0]:g} (seed {made[1]}), asked "
                                   f"for {temp:g} (seed {seed}); pass another directory or delete this one")
            continue
        ids = [encode_prompt(tokenizer, cat, p) for p in prompts[cat][:n_per_category]]
        P = max(len(i) for i in ids)
        rows = generate_windows(target, ids, taps, P + max_tokens + 1, temp, tokenizer.eos_token_ids, seed,
                                exact_taps=True)
        np.savez(f, **{k: np.stack([r[k] for r in rows]) for k in ("tokens", "taps", "start", "end")},
                 max_tokens=max_tokens, temp=temp, seed=seed)
    return out


def _accepted_lengths(model, frozen, tokens: np.ndarray, taps: mx.array, lo: int, hi: int, end: int) -> np.ndarray:
    """Accepted drafts at every anchor a in [lo, hi) of one greedy continuation whose valid
    tokens end at `end` (drafts past it are never counted as accepted)."""
    c = model.config
    B = c.block_size
    anchors = np.arange(lo, hi)
    L = len(tokens)
    pos = anchors[:, None] + np.arange(B)
    block = np.full((len(anchors), B), c.mask_token_id, np.int32)
    block[:, 0] = tokens[anchors]
    q = anchors[:, None] + 1 + np.arange(c.layout.n_drafts)  # predicted positions of the predicting rows
    truth = np.where(q < end, tokens[np.minimum(q, L - 1)], -1)
    prev = tokens[np.minimum(q - 1, L - 1)]
    b = {"taps": taps[None], "block_tok": mx.array(block[None]), "pos": mx.array(pos[None].astype(np.int32)),
         "anchors": mx.array(anchors[None].astype(np.int32)), "prev": mx.array(prev[None].astype(np.int32))}
    logits, h, _ = block_logits(model, frozen, b)
    pred = np.asarray(draft_choice(model, logits, h, b["prev"]))[0]  # [K, n] draft ids
    ok = (frozen["d_ids"][pred] == truth) & (truth >= 0)
    return np.cumprod(ok, axis=1).sum(axis=1)


def heldout_tau(model, frozen: dict, store: str | Path, categories=CATEGORIES, *, lengths=None,
                n_drafts: int | None = None) -> dict:
    """{category: {tau, tau_se, per_prompt, acceptance_rate, accepted, drafted,
    per_position_acceptance}} from the
    replayed greedy decode of each held-out continuation (module docstring), counted as
    `engine.loop.SpecStats` counts. frozen = {"embed": target embeddings [V, H], "head": the
    head's rows at the draft ids, "d_ids": the draft ids (numpy)}. lengths(tokens, taps, lo, hi, end) ->
    accepted drafts at each anchor, for a chain drafter (`train.eagle3.heldout_lengths`, with its
    n_drafts); default: the block drafter's own pass."""
    from mlxspec.train.data import taps_from_store

    if lengths is None:  # a block drafter: its teacher-forced block pass
        n_drafts = model.config.layout.n_drafts

        def lengths(tokens, taps, lo, hi, end):
            return _accepted_lengths(model, frozen, tokens, taps, lo, hi, end)
    res = {}
    for cat in categories:
        z = np.load(Path(store) / f"{cat}.npz")
        budget = int(z["max_tokens"])
        steps = made_all = accepted = drafted = 0
        hits, tries = np.zeros(n_drafts), np.zeros(n_drafts)
        per_prompt = []  # (tokens made past the prefill's, steps) of each continuation
        for w in range(len(z["tokens"])):
            tokens, start, end = z["tokens"][w], int(z["start"][w]), int(z["end"][w])
            hi, steps0 = min(end, start + budget), steps
            n_acc = lengths(tokens, taps_from_store(z["taps"][w]), start, hi, end)
            made, a = 1, start  # the prefill's token (at `start`) is the first anchor
            while made < budget and a + 1 < end:
                n_d = min(n_drafts, budget - made - 1)
                acc = min(int(n_acc[a - start]), n_d)
                steps += 1
                drafted += n_d
                accepted += acc
                tries[:n_d] += 1
                hits[:acc] += 1
                step = min(acc + 1, end - (a + 1), budget - made)  # stop after EOS / at max_tokens
                made += step
                a += step
            per_prompt.append((made - 1, steps - steps0))
            made_all += made - 1
        res[cat] = {"tau": made_all / steps if steps else 1.0, "tau_se": bootstrap_se(per_prompt),
                    "per_prompt": per_prompt,
                    "acceptance_rate": accepted / max(drafted, 1),
                    "accepted": accepted, "drafted": drafted,
                    "per_position_acceptance": (hits / np.maximum(tries, 1)).tolist(),
                    "prompts": int(len(z["tokens"])), "max_tokens": budget}
    return res


def _resampled_tau(per_prompt: list, idx: np.ndarray) -> np.ndarray:
    """tau (sum made / sum steps) of each resampled prompt set idx [draws, prompts]."""
    made, steps = (np.asarray(x, np.float64) for x in zip(*per_prompt))
    return made[idx].sum(1) / np.maximum(steps[idx].sum(1), 1)


def _draws(n_prompts: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_prompts, (n, n_prompts))


def bootstrap_se(per_prompt: list, n: int = 2000, seed: int = 0) -> float:
    """The standard error of tau (sum made / sum steps) over the prompts, by resampling the
    prompts (fixed seed): how far apart two drafters' held-out tau must be before the
    prompt set can tell them apart."""
    if len(per_prompt) < 2:
        return 0.0
    return float(np.std(_resampled_tau(per_prompt, _draws(len(per_prompt), n, seed))))


def paired_difference(a: list, b: list, n: int = 2000, seed: int = 0) -> dict:
    """tau(a) - tau(b) for two drafters replayed on the same prompts (per_prompt lists of
    (made, steps) in the same order), with its standard error and the share of bootstrap draws
    in which a is ahead, resampling the prompts jointly. The pairing removes what the prompts
    share (an easy prompt is easy for both), so it tells drafters apart far below the
    unpaired `tau_se`."""
    if len(a) != len(b):
        raise ValueError(f"paired_difference: {len(a)} prompts against {len(b)}; both must be replayed on one store")
    whole = np.arange(len(a))[None]
    diff = float((_resampled_tau(a, whole) - _resampled_tau(b, whole))[0])
    if len(a) < 2:
        return {"diff": diff, "se": 0.0, "p_ahead": float(diff > 0)}
    idx = _draws(len(a), n, seed)
    d = _resampled_tau(a, idx) - _resampled_tau(b, idx)
    return {"diff": diff, "se": float(np.std(d)), "p_ahead": float(np.mean(d > 0))}


def frozen_for(target, model) -> dict:
    """The target's embeddings and head rows a drafter borrows, for `heldout_tau`."""
    from mlxspec.targets.model import target_head_rows

    V = target.info.vocab_size
    c = model.config
    if c.draft_vocab_size:
        d_ids = (np.asarray(model.d2t) + np.arange(c.draft_vocab_size)).astype(np.int64)
    else:
        d_ids = np.arange(V)
    head = model.lm_head.weight.astype(mx.float32) if "lm_head" in model else target_head_rows(target, None)[mx.array(d_ids)]
    f = {"embed": target.embed(mx.arange(V)).astype(mx.float32), "head": head, "d_ids": d_ids}
    mx.eval(f["embed"], f["head"])
    return f
