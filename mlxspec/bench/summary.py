"""Bench results as rows: one `Row` per (temperature, configuration, category + "all").

x AR comes with a 95% interval (`ratio_interval`): a paired bootstrap over the prompts. Every
configuration runs the same prompts, interleaved per prompt and repeat, so the ratio of two rows
is resampled prompt by prompt (the same prompts on both sides) and the interval covers which
prompts the run happened to draw as well as the clock's noise between repeats. With 2 prompts per
category a category's interval is wide, and that is the point: two runs of 2 prompts once gave
trees 1.14x and 0.92x their chains on code (docs/trees.md), a difference no single run of that
size could have told apart from noise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

from mlxspec.engine.loop import SpecStats

AR = "mlxspec AR"
MLX_LM = "mlx_lm AR"

@dataclass
class Row:
    """One (temperature, configuration, category) of a bench run; `category` "all" merges the
    categories. The speculative fields are None for the autoregressive rows and mlx_lm."""

    configuration: str
    engine: str  # "mlxspec" | "mlx_lm"
    temp: float
    category: str
    tokens_per_s: float | None  # mean over prompts of the median over repeats
    tokens_per_s_per_prompt: list  # [[per repeat] per prompt]
    generated_tokens: list  # per prompt (first repeat)
    peak_memory_mb: float
    tau: float | None = None
    target_forwards: int | None = None
    acceptance_rate: float | None = None
    per_position_acceptance: list | None = None
    mean_verify_length: float | None = None
    draft_share: float | None = None
    verify_share: float | None = None
    drafter_accepted_share: float | None = None  # the drafter's share of the accepted drafts (lookup's is the rest)
    same_tokens_as_ar: list | None = None  # greedy: [prompts with AR's tokens, prompts]
    ratio_vs_mlxspec_ar: float | None = None
    ratio_interval: list | None = None  # 95% paired-bootstrap interval of ratio_vs_mlxspec_ar (module docstring)
    ideal_speedup: float | None = None
    efficiency: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def forward_ms(ms: dict, L: float) -> float:
    """Time of a target forward over L tokens, linear between measured integer lengths."""
    lo = min(max(1, math.floor(L)), max(ms))
    hi = min(lo + 1, max(ms))
    f = min(max(L - lo, 0.0), 1.0)
    return ms[lo] * (1 - f) + ms[hi] * f


BOOTSTRAP = 2000  # resamples; a fixed seed, so a report is reproducible from its timings


def prompt_medians(per_prompt: list) -> list:
    """Per prompt, the median of its timed repeats (None where none was timed)."""
    out = []
    for p in per_prompt:
        xs = [x for x in p if x is not None]
        out.append(statistics.median(xs) if xs else None)
    return out


def paired_interval(a_per_prompt: list, b_per_prompt: list, level: float = 0.95, n: int = BOOTSTRAP,
                    seed: int = 0) -> list | None:
    """95% interval of mean(a) / mean(b) over prompts (each prompt's median over its repeats),
    by a paired bootstrap: prompts resampled with replacement, the same ones on both sides.
    [[tok/s per repeat] per prompt] for each -> [low, high], or None with fewer than 2 prompts
    timed on both sides (one prompt says nothing about the next)."""
    a, b = prompt_medians(a_per_prompt), prompt_medians(b_per_prompt)
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and y > 0]
    if len(pairs) < 2:
        return None
    x = np.array([p[0] for p in pairs], dtype=np.float64)
    y = np.array([p[1] for p in pairs], dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(pairs), size=(n, len(pairs)))
    ratios = x[idx].mean(axis=1) / y[idx].mean(axis=1)
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def summarize(configs, timings, s, ms) -> list[Row]:
    """One row per (temp, configuration, category + 'all')."""
    rows = []
    for temp in s["temps"]:
        for cfg in configs:
            r = timings[cfg["label"]][temp]
            for cat in s["categories"] + ["all"]:
                cats = s["categories"] if cat == "all" else [cat]
                per_prompt = [p for c in cats for p in r["tps"][c]]
                medians = [m for m in prompt_medians(per_prompt) if m is not None]
                st = SpecStats()
                for one in (x for c in cats for x in r["stats"][c]):
                    st.merge(one)
                row = Row(cfg["label"], cfg["engine"], temp, cat,
                          tokens_per_s=statistics.mean(medians) if medians else None,
                          tokens_per_s_per_prompt=per_prompt,
                          generated_tokens=[len(t) for c in cats for t in r["tokens"][c]],
                          peak_memory_mb=r["peak"] / 2**20)
                if cfg["engine"] == "mlxspec":
                    spent = st.draft_time + st.verify_time
                    row.tau, row.target_forwards = st.tau, st.target_forwards
                    row.acceptance_rate = st.acceptance_rate if st.drafted else None
                    row.per_position_acceptance = st.per_position_acceptance
                    row.mean_verify_length = statistics.mean(st.verify_lengths) if st.verify_lengths else None
                    row.draft_share = st.draft_time / spent if spent else None
                    row.verify_share = st.verify_time / spent if spent else None
                    if st.accepted and st.by_source:
                        row.drafter_accepted_share = st.by_source.get("drafter", [0, 0])[1] / st.accepted
                if temp == 0 and cfg["label"] != AR:  # greedy: the same tokens as mlxspec AR?
                    ref = timings[AR][temp]["tokens"]
                    same = [t == u for c in cats for t, u in zip(r["tokens"][c], ref[c])]
                    row.same_tokens_as_ar = [sum(same), len(same)]
                rows.append(row)
    for row in rows:
        ar = next(x for x in rows if x.configuration == AR and x.temp == row.temp and x.category == row.category)
        ok = row.tokens_per_s and ar.tokens_per_s
        row.ratio_vs_mlxspec_ar = row.tokens_per_s / ar.tokens_per_s if ok else None
        if ok and row is not ar:
            row.ratio_interval = paired_interval(row.tokens_per_s_per_prompt, ar.tokens_per_s_per_prompt)
        if row.engine == "mlxspec" and row.acceptance_rate is not None and row.mean_verify_length:
            row.ideal_speedup = row.tau * ms[1] / forward_ms(ms, row.mean_verify_length)
            row.efficiency = row.ratio_vs_mlxspec_ar / row.ideal_speedup if ok else None
    return rows
