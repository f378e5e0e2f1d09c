"""The engines bench times: a runner is run(ids, temp, seed, max_tokens) -> (tokens, seconds
from the first token to the last, SpecStats | None), and `time_interleaved` drives them all over the
run's prompts, temperatures and repeats, generation by generation."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlxspec.api import Speculator
from mlxspec.blas import default_blas_threads
from mlxspec.drafters.load import load_drafter
from mlxspec.drafters.model import DFlashModel
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.loop import SpecStats
from mlxspec.engine.suffix import SuffixIndex
from mlxspec.engine.verify import SamplingParams
from mlxspec.targets.convert import cached_mlx_copy
from mlxspec.targets.load import default_dense, resolve_model_path

def mlx_lm_dir(model: str | None, root: str | None) -> Path:
    """The target as an MLX directory mlx_lm loads (float32 on CPU, the lossless repack
    on Metal/CUDA); shared with scripts/bench_ar.py through `cached_mlx_copy`."""
    src = Path(resolve_model_path(model))
    if src.is_dir():
        return src
    return cached_mlx_copy(str(src), "float32" if default_dense() else "keep", root)


def mlxspec_runner(target, eos, speculator: Speculator | None = None):
    """mlxspec through the API: `Speculator.session` (a new drafter and verify policy per
    request, as generate makes them); no speculator: autoregressive. A speculator with a shared
    suffix index starts every run from an empty one (no run drafts from another's answer)."""
    spec = speculator or Speculator()

    def run(ids, temp, seed, max_tokens):
        nonlocal spec
        if spec.suffix is not None:
            spec = replace(spec, suffix=SuffixIndex(spec.suffix.budget))
        st = SpecStats()
        out, t_first = [], None
        for step in spec.session(target, ids, max_tokens=max_tokens, sampling=SamplingParams(temp), seed=seed,
                                 eos_ids=eos, stats=st):
            if t_first is None:
                t_first = time.perf_counter()
            out += step
        return out, time.perf_counter() - t_first, st

    return run


def random_weights(spec, path, target):
    """The same drafter architecture with random weights: what the adaptive policy must
    survive (a drafter that is never right must cost at most a few percent)."""
    model, cfg = load_drafter(path, target.info)
    mx.random.seed(0)
    if cfg.lineage == "eagle3":
        from mlxspec.drafters.eagle3 import Eagle3Model
        from mlxspec.engine.eagle3 import Eagle3Drafter

        rnd = Eagle3Model(cfg)
        if cfg.reduced_vocab:
            rnd.d2t = model.d2t
        mx.eval(rnd.parameters())
        n = spec.num_draft_tokens
        return Speculator(drafter_factory=lambda t: Eagle3Drafter(rnd, cfg, t, n), spec_type=spec.spec_type,
                          p_min=None, schedule=False, num_draft_tokens=n,
                          description=f"{spec.description} (random weights)", policy=spec.policy)
    rnd = DFlashModel(cfg)
    if cfg.draft_vocab_size:
        rnd.d2t = model.d2t
    mx.eval(rnd.parameters())
    return Speculator(drafter_factory=lambda t: BlockDrafter(rnd, t), spec_type=spec.spec_type, p_min=None, schedule=False, num_draft_tokens=None,
                      description=f"{spec.description} (random weights)", policy=spec.policy)


_SPIN = "import os, sys\np = int(sys.argv[1])\nwhile os.getppid() == p:\n    pass\n"


class BackgroundLoad:
    """`n` processes that spin on a core each for the duration of a `with` block: the bench on
    a shared machine (an editor, a build, another model), reproducibly. They are killed on
    exit, also when the bench fails or is interrupted."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess

        for _ in range(self.n):
            # spins until killed, or until its parent is gone (a bench killed by a signal
            # that skips __exit__ leaves no spinner behind)
            self.procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []
        return False


def mlx_lm_runner(model, tokenizer):
    def run(ids, temp, seed, max_tokens):
        default_blas_threads()  # OpenBLAS as mlx_lm finds it in a process of its own
        mx.random.seed(seed)
        out, t_first = [], None
        for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(temp=temp)):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(r.token))
        return out, time.perf_counter() - t_first, None

    return run


def time_one(run, s, temp, rep: int, r: dict, c: str, i: int, ids, k: int) -> None:
    """One generation of one configuration: prompt i of category c (seed + k), into r
    ({"tps": {cat: [[per repeat] per prompt]}, "stats": {cat: [SpecStats]}, "tokens": {cat: [...]}})."""
    out, dt, st = run(ids, temp, s["seed"] + k, s["max_tokens"])
    r["tps"][c][i].append((len(out) - 1) / dt if len(out) > 1 and dt > 0 else None)
    if st is not None:
        r["stats"][c].append(st)
    if rep == 0:
        r["tokens"][c][i] = out


def time_interleaved(configs, runners: dict, s, prompts, bar, resident_elsewhere) -> dict:
    """Every configuration, interleaved generation by generation: for each temperature, repeat
    and prompt, each configuration runs that prompt once, so a row's ratio to another compares
    generations seconds apart (a shared host drifts by tens of percent within minutes here;
    rows timed one after the other carried that drift into their ratios: a drafter that was
    never right came out 0.83x AR in one run and 1.12x in another). resident_elsewhere(label)
    -> the bytes other rows keep resident while this one runs (its peak leaves them out).
    -> {label: {temp: {"tps", "stats", "tokens", "peak"}}}"""
    res = {c["label"]: {} for c in configs}
    first = prompts[s["categories"][0]][0]
    # (category, index in it, prompt ids); the position k in this list gives the seed, seed + k
    work = [(c, i, ids) for c in s["categories"] for i, ids in enumerate(prompts[c])]
    for temp in s["temps"]:
        for c in configs:
            bar.set_postfix_str(f"warm-up {c['label']} T={temp:g}")
            runners[c["label"]](first, temp, s["seed"], 8)  # kernels, allocator
            res[c["label"]][temp] = {"tps": {cat: [[] for _ in prompts[cat]] for cat in s["categories"]},
                                     "stats": {cat: [] for cat in s["categories"]},  # one SpecStats per generation
                                     "tokens": {cat: [None] * len(prompts[cat]) for cat in s["categories"]},
                                     "peak": 0}
        for rep in range(s["repeats"]):
            for k, (cat, i, ids) in enumerate(work):
                for c in configs:
                    label = c["label"]
                    bar.set_postfix_str(f"{label} T={temp:g} repeat {rep + 1}/{s['repeats']}")
                    mx.reset_peak_memory()
                    r = res[label][temp]
                    time_one(runners[label], s, temp, rep, r, cat, i, ids, k)
                    r["peak"] = max(r["peak"], mx.get_peak_memory() - resident_elsewhere(label))
                    bar.update(1)
    return res
