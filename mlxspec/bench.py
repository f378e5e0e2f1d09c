"""`mlxspec bench`: mlx_lm vs mlxspec autoregressive vs mlxspec speculative, in ONE process.

Configurations, each run on the same prompts at each temperature:
- `mlx_lm AR`: mlx_lm's own `stream_generate` on the same weights, written once as an MLX
  directory (`convert_to_mlx`; dense float32 on the CPU, where mlxspec computes dense
  float32; the quantized repack on Metal/CUDA) and cached under the mlxspec cache dir;
- `mlxspec AR`: `generate_steps` without a drafter;
- one row per drafter (`--draft`, default: the shipped DSpark and DFlash drafters) and for
  `--draft-simple`: `generate_steps` with that drafter.

Numbers (all measured in the run):
- tokens/s: per prompt, (generated tokens - 1) / time from the first token (the prefill's)
  to the last, i.e. prefill excluded; median over `--repeats`; then the mean over the
  prompts of the category ("all": over every prompt). Generation stops at EOS (both
  engines; `--ignore-eos` always generates `--max-tokens`);
- x AR: tokens/s over mlxspec AR's (same temperature, same category);
- tau (tokens per target forward, bonus included), acceptance, per-position acceptance,
  mean verify length, draft / verify share of the step time: merged over prompts and repeats;
- ideal speedup = tau * t(1) / t(mean verify length), t(L) the time of one target forward
  over L tokens, measured here (`measure_verify_sps`) at the mean context of the run
  (mean prompt length + max_tokens / 2); efficiency = measured speedup / ideal;
- peak memory: `mx.get_peak_memory()`, reset per (configuration, temperature); resident
  weights included (each configuration holds only its own models).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from tqdm import tqdm

from mlxspec.api import Speculator, load_speculator, make_policy, shipped_drafter
from mlxspec.blas import blas_status, default_blas_threads
from mlxspec.cache import display_path, hub_repo_of
from mlxspec.drafters.load import load_drafter
from mlxspec.drafters.model import DFlashModel
from mlxspec.drafters.registry import candidates, model_name
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.profile import measure_verify_sps
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.logger import capture
from mlxspec.prompts import encode_prompt, load_prompts
from mlxspec.targets.convert import cached_mlx_copy
from mlxspec.targets.load import default_dense, load_target, resolve_model_path
from mlxspec.validate import check_free_space, check_output_dir, writing

FULL = dict(prompts_per_category=4, max_tokens=96, repeats=2, temps="0,1")
QUICK = dict(prompts_per_category=1, max_tokens=32, repeats=1, temps="0")
AR = "mlxspec AR"
MLX_LM = "mlx_lm AR"


def add_bench_args(p):
    p.add_argument("--model", "-m", default=None, metavar="PATH", help="target: .gguf file or MLX/HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", action="append", default=None, metavar="PATH",
                   help="DFlash/DSpark drafter (directory or .gguf); repeatable. Default: the drafters mlxspec "
                        "ships for the target (smollm2-135m-dspark and -dflash for the default model); "
                        "'none' = no drafter")
    p.add_argument("--draft-simple", default=None, metavar="PATH",
                   help="also run draft-simple with this draft model (MLX/HF directory or .gguf, same tokenizer)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="N", help="draft-simple: tokens per draft (default 4)")
    p.add_argument("--categories", default="code,prose,chat", metavar="LIST", help="prompt categories (default code,prose,chat)")
    p.add_argument("--prompts-per-category", type=int, default=None, metavar="N",
                   help=f"prompts per category (default {FULL['prompts_per_category']}; --quick {QUICK['prompts_per_category']})")
    p.add_argument("--max-tokens", "-n", type=int, default=None, metavar="N",
                   help=f"tokens to generate per prompt (default {FULL['max_tokens']}; --quick {QUICK['max_tokens']})")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help=f"timed repeats of each prompt (default {FULL['repeats']}; --quick {QUICK['repeats']})")
    p.add_argument("--temps", default=None, metavar="LIST", help=f"temperatures, comma-separated (default {FULL['temps']}; --quick {QUICK['temps']})")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (prompt k uses seed + k)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--mlx-dir", default=None, metavar="DIR",
                   help="where the MLX copy of the target for mlx_lm goes (default: the mlxspec cache)")
    p.add_argument("--out", "-o", default=None, metavar="DIR", help="write bench.json (and PNG plots) here")
    p.add_argument("--policies", default="fixed,adaptive", metavar="LIST",
                   help="verify policies to run each drafter with (default fixed,adaptive)")
    p.add_argument("--no-ngram", action="store_true",
                   help="skip the prompt-lookup rows (ngram alone; the first drafter + ngram)")
    p.add_argument("--no-random", action="store_true",
                   help="skip the random-weight copy of the first drafter (adaptive policy)")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="keep N cores busy with spinning processes for the whole run (a shared machine; "
                        "default 0), started and stopped by the bench")
    p.add_argument("--quick", action="store_true",
                   help="about a minute: 1 prompt per category, 32 tokens, 1 repeat, temperature 0")


# ----------------------------------------------------------------------------- settings

def settings(a) -> dict:
    """The run's settings from the parsed flags; MlxspecError for bad values."""
    base = QUICK if a.quick else FULL
    s = {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in base.items()}
    try:
        s["temps"] = [float(t) for t in str(s["temps"]).split(",") if t.strip()]
    except ValueError:
        raise MlxspecError(f"--temps {s['temps']!r}: expected comma-separated numbers, e.g. 0,1") from None
    if not s["temps"] or min(s["temps"]) < 0:
        raise MlxspecError(f"--temps {a.temps!r}: give one or more temperatures >= 0, e.g. 0,1")
    if s["max_tokens"] < 2:
        raise MlxspecError(f"--max-tokens {s['max_tokens']}: tokens/s needs at least 2 tokens")
    if s["repeats"] < 1:
        raise MlxspecError(f"--repeats {s['repeats']}: use 1 or more")
    if a.background_load < 0 or a.background_load > (os.cpu_count() or 1):
        raise MlxspecError(f"--background-load {a.background_load}: use 0..{os.cpu_count() or 1} (cores to keep busy)")
    s["background_load"] = a.background_load
    if a.num_draft_tokens < 1:
        raise MlxspecError(f"--num-draft-tokens {a.num_draft_tokens}: use 1 or more")
    sets = load_prompts()
    cats = [c.strip() for c in a.categories.split(",") if c.strip()]
    for c in cats:
        if c not in sets:
            raise MlxspecError(f"--categories: unknown category {c!r}; use some of {', '.join(sets)}")
    if not cats:
        raise MlxspecError("--categories is empty; use some of " + ", ".join(sets))
    n = s["prompts_per_category"]
    if n < 1:
        raise MlxspecError(f"--prompts-per-category {n}: use 1 or more")
    for c in cats:
        if len(sets[c]) < n:
            raise MlxspecError(f"--prompts-per-category {n}: the {c} set has only {len(sets[c])} prompts")
    s["categories"] = cats
    s["seed"] = a.seed
    s["texts"] = {c: sets[c][:n] for c in cats}
    if a.draft is None and a.model is None:
        drafts = [str(p) for p in (shipped_drafter("dspark"), shipped_drafter("dflash")) if p]
    elif a.draft is None:  # the drafters mlxspec ships for this target (registry.json)
        drafts = [e["path"] for e in candidates(a.model) if e["drafter"].startswith("shipped:")]
        if not drafts:
            raise MlxspecError(f"--model {a.model}: mlxspec ships no drafter for {model_name(a.model)}; "
                               "pass --draft PATH (or --draft none: the autoregressive and prompt-lookup rows, "
                               "what generate runs for it by default)")
    else:
        drafts = [d for d in a.draft if d.lower() != "none"]
    for d in drafts + ([a.draft_simple] if a.draft_simple else []):
        if not Path(d).exists():
            flag = "--draft-simple" if d == a.draft_simple else "--draft"
            raise MlxspecError(f"{flag} {d}: no such file or directory; pass a drafter directory or .gguf file")
    s["drafts"] = drafts
    s["policies"] = [x.strip() for x in a.policies.split(",") if x.strip()]
    for x in s["policies"]:
        if x not in ("fixed", "adaptive"):
            raise MlxspecError(f"--policies: unknown verify policy {x!r}; use fixed and/or adaptive")
    s["ngram"] = not a.no_ngram
    s["random"] = not a.no_random
    if a.out is not None:
        check_output_dir("--out", a.out)  # before minutes of benchmarking
        check_free_space("--out", a.out, 1 << 20)  # bench.json and the plots
    return s


def command_line(a) -> str:
    if getattr(a, "command", None):
        return a.command
    if Path(sys.argv[0]).name in ("mlxspec", "cli.py", "__main__.py") and sys.argv[1:2] == ["bench"]:
        return shlex.join(["mlxspec", *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def mlx_lm_dir(model: str | None, root: str | None) -> Path:
    """The target as an MLX directory mlx_lm loads (float32 on CPU, the lossless repack
    on Metal/CUDA); shared with scripts/bench_ar.py through `cached_mlx_copy`."""
    src = Path(resolve_model_path(model))
    if src.is_dir():
        return src
    return cached_mlx_copy(str(src), "float32" if default_dense() else "keep", root)


# ----------------------------------------------------------------------------- runners
# A runner: run(ids, temp, seed, max_tokens) -> (tokens, seconds from first to last token, SpecStats | None)

def mlxspec_runner(target, eos, speculator=None):
    def run(ids, temp, seed, max_tokens):
        st = SpecStats()
        drafter = speculator.make_drafter(target) if speculator else None
        policy = make_policy(target, drafter, speculator, temp) if speculator else None  # per request, as in generate
        out, t_first = [], None
        for step in generate_steps(target, ids, drafter=drafter, max_tokens=max_tokens, sampling=SamplingParams(temp), seed=seed, eos_ids=eos, stats=st,
                                   policy=policy):
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
    rnd = DFlashModel(cfg)
    if cfg.draft_vocab_size:
        rnd.d2t = model.d2t
    mx.eval(rnd.parameters())
    return Speculator(drafter_factory=lambda t: BlockDrafter(rnd, t), spec_type=spec.spec_type, p_min=None, schedule=False, num_draft_tokens=None,
                      description=f"{spec.description} (random weights)", policy=spec.policy)


class BackgroundLoad:
    """`n` processes that spin on a core each for the duration of a `with` block: the bench on
    a shared machine (an editor, a build, another model), reproducibly. They are killed on
    exit, also when the bench fails or is interrupted."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess

        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
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


def time_config(label, run, s, prompts, bar) -> dict:
    """Warm up, then every (temp, repeat, prompt) of one configuration.
    -> {temp: {"tps": {cat: [[per repeat] per prompt]}, "stats": {cat: [SpecStats]}, "tokens": {cat: [...]}, "peak": bytes}}"""
    res = {}
    first = prompts[s["categories"][0]][0]
    for temp in s["temps"]:
        bar.set_postfix_str(f"{label} T={temp:g}")
        gc.collect()
        mx.reset_peak_memory()
        run(first, temp, s["seed"], 8)  # warm-up: kernels, allocator
        r = {"tps": {}, "stats": {}, "tokens": {}}
        for c in s["categories"]:
            r["tps"][c] = [[] for _ in prompts[c]]
            r["stats"][c] = []  # one SpecStats per generation
            r["tokens"][c] = [None] * len(prompts[c])
        for rep in range(s["repeats"]):
            k = 0  # prompt index over all categories: its seed
            for c in s["categories"]:
                for i, ids in enumerate(prompts[c]):
                    out, dt, st = run(ids, temp, s["seed"] + k, s["max_tokens"])
                    r["tps"][c][i].append((len(out) - 1) / dt if len(out) > 1 and dt > 0 else None)
                    if st is not None:
                        r["stats"][c].append(st)
                    if rep == 0:
                        r["tokens"][c][i] = out
                    k += 1
                    bar.update(1)
        r["peak"] = mx.get_peak_memory()
        res[temp] = r
    return res


# ----------------------------------------------------------------------------- summary

def forward_ms(ms: dict, L: float) -> float:
    """Time of a target forward over L tokens, linear between measured integer lengths."""
    lo = min(max(1, math.floor(L)), max(ms))
    hi = min(lo + 1, max(ms))
    f = min(max(L - lo, 0.0), 1.0)
    return ms[lo] * (1 - f) + ms[hi] * f


def summarize(configs, timings, s, ms) -> list[dict]:
    """One row per (temp, configuration, category + 'all')."""
    rows = []
    for temp in s["temps"]:
        for cfg in configs:
            r = timings[cfg["label"]][temp]
            for cat in s["categories"] + ["all"]:
                cats = s["categories"] if cat == "all" else [cat]
                per_prompt = [p for c in cats for p in r["tps"][c]]
                medians = [statistics.median([x for x in p if x is not None]) for p in per_prompt
                           if any(x is not None for x in p)]
                st = SpecStats()
                for one in (x for c in cats for x in r["stats"][c]):
                    st.merge(one)
                row = {
                    "configuration": cfg["label"], "engine": cfg["engine"], "temp": temp, "category": cat,
                    "tokens_per_s": statistics.mean(medians) if medians else None,
                    "tokens_per_s_per_prompt": per_prompt,
                    "generated_tokens": [len(t) for c in cats for t in r["tokens"][c]],
                    "peak_memory_mb": r["peak"] / 2**20,
                }
                if cfg["engine"] == "mlxspec":
                    spent = st.draft_time + st.verify_time
                    row.update({
                        "tau": st.tau, "target_forwards": st.target_forwards,
                        "acceptance_rate": st.acceptance_rate if st.drafted else None,
                        "per_position_acceptance": st.per_position_acceptance,
                        "mean_verify_length": statistics.mean(st.verify_lengths) if st.verify_lengths else None,
                        "draft_share": st.draft_time / spent if spent else None,
                        "verify_share": st.verify_time / spent if spent else None,
                    })
                if temp == 0 and cfg["label"] != AR:  # greedy: the same tokens as mlxspec AR?
                    ref = timings[AR][temp]["tokens"]
                    same = [t == u for c in cats for t, u in zip(r["tokens"][c], ref[c])]
                    row["same_tokens_as_ar"] = [sum(same), len(same)]
                rows.append(row)
    for row in rows:
        ar = next(x for x in rows if x["configuration"] == AR and x["temp"] == row["temp"]
                  and x["category"] == row["category"])
        ok = row["tokens_per_s"] and ar["tokens_per_s"]
        row["ratio_vs_mlxspec_ar"] = row["tokens_per_s"] / ar["tokens_per_s"] if ok else None
        if row["engine"] == "mlxspec" and row.get("acceptance_rate") is not None and row["mean_verify_length"]:
            row["ideal_speedup"] = row["tau"] * ms[1] / forward_ms(ms, row["mean_verify_length"])
            row["efficiency"] = row["ratio_vs_mlxspec_ar"] / row["ideal_speedup"] if ok else None
    return rows


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def markdown(rows, meta, s, ms, context) -> str:
    temps = s["temps"]
    L_max = max(ms)
    out = [
        "## mlxspec bench",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Target `{hub_repo_of(meta['model']) or Path(meta['model']).name}` (mlxspec: {meta['target_compute']}; mlx_lm: `{meta['mlx_lm_dir']}`). "
        f"Prompts: {', '.join(f'{c} {len(v)}' for c, v in meta['prompt_tokens'].items())}; "
        f"max {s['max_tokens']} tokens{' (EOS ignored)' if meta['ignore_eos'] else ', stop at EOS'}; "
        f"{s['repeats']} repeat(s); temps {', '.join(f'{t:g}' for t in temps)}; seed {s['seed']}.",
        f"Machine: {meta['platform']}, {meta['cpus']} CPUs, device {meta['device']}, {meta['blas'] or 'BLAS: default'}"
        f"{'; ' + str(meta['background_load']) + ' core(s) kept busy (--background-load)' if meta.get('background_load') else ''}; "
        f"mlx {meta['mlx']}, mlx_lm {meta['mlx_lm']}; {meta['date']}.",
        f"Target forward at context {context}: 1 token {ms[1]:.2f} ms"
        + (f", {L_max} tokens {ms[L_max]:.2f} ms ({ms[L_max] / ms[1]:.2f}x)." if L_max > 1 else "."),
        "",
        "tok/s: generation only (prefill excluded), median over repeats, mean over prompts. "
        "x AR: over mlxspec AR. ideal = tau * t(1) / t(mean verify length); eff = x AR / ideal.",
        "",
        "| T | configuration | tok/s | x AR | tau | accept | verify len | ideal | eff | draft / verify | peak MiB | greedy = AR |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in (r for r in rows if r["category"] == "all"):
        share = (f"{100 * r['draft_share']:.0f}% / {100 * r['verify_share']:.0f}%"
                 if r.get("draft_share") is not None and r.get("acceptance_rate") is not None else "–")
        same = f"{r['same_tokens_as_ar'][0]}/{r['same_tokens_as_ar'][1]}" if "same_tokens_as_ar" in r else "–"
        out.append(
            f"| {r['temp']:g} | {r['configuration']} | {_f(r['tokens_per_s'], '{:.1f}')} | "
            f"{_f(r['ratio_vs_mlxspec_ar'])} | {_f(r.get('tau'))} | {_f(r.get('acceptance_rate'), '{:.1%}')} | "
            f"{_f(r.get('mean_verify_length'))} | {_f(r.get('ideal_speedup'))} | {_f(r.get('efficiency'), '{:.0%}')} | "
            f"{share} | {r['peak_memory_mb']:.0f} | {same} |")
    out += ["", "By category:", "",
            "| T | configuration | category | tok/s | x AR | tau | accept | eff |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["category"] != "all"):
        out.append(f"| {r['temp']:g} | {r['configuration']} | {r['category']} | {_f(r['tokens_per_s'], '{:.1f}')} | "
                   f"{_f(r['ratio_vs_mlxspec_ar'])} | {_f(r.get('tau'))} | {_f(r.get('acceptance_rate'), '{:.1%}')} | "
                   f"{_f(r.get('efficiency'), '{:.0%}')} |")
    spec_rows = [r for r in rows if r["category"] == "all" and r.get("acceptance_rate") is not None]
    if spec_rows:
        n = max(len(r["per_position_acceptance"]) for r in spec_rows)
        out += ["", "Per-position acceptance (all categories): at position k, the share of the steps that drafted "
                    "k or more tokens whose first k drafts were all accepted.", "",
                "| T | configuration | " + " | ".join(str(i + 1) for i in range(n)) + " |",
                "|---|---|" + "---:|" * n]
        for r in spec_rows:
            ppa = r["per_position_acceptance"] + [None] * (n - len(r["per_position_acceptance"]))
            out.append(f"| {r['temp']:g} | {r['configuration']} | " + " | ".join(_f(x) for x in ppa) + " |")
    return "\n".join(out)


def _save(fig, ax, out: Path, name: str) -> str:
    """Legend outside the axes, write the PNG, free the figure; -> the file name."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def write_plots(rows, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; plots skipped (pip install 'mlxspec[plot]')", file=sys.stderr)
        return []
    written = []
    allr = [r for r in rows if r["category"] == "all"]
    temps = sorted({r["temp"] for r in rows})
    labels = list(dict.fromkeys(r["configuration"] for r in rows))
    width = 0.8 / len(temps)

    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels) + 3), 4.5))
    for j, t in enumerate(temps):
        xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(labels))]
        rs = [next(r for r in allr if r["configuration"] == lab and r["temp"] == t) for lab in labels]
        ax.bar(xs, [r["ratio_vs_mlxspec_ar"] or 0 for r in rs], width, label=f"T={t:g} measured")
        ideal = [(x, r["ideal_speedup"]) for x, r in zip(xs, rs) if r.get("ideal_speedup")]
        if ideal:
            ax.scatter(*zip(*ideal), marker="_", s=400, color="black", label="ideal" if j == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s relative to mlxspec AR")
    ax.set_title("Speedup per configuration (all categories)")
    written.append(_save(fig, ax, out, "speedup.png"))

    spec = [r for r in allr if r.get("acceptance_rate") is not None]
    if spec:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for r in spec:
            ppa = r["per_position_acceptance"]
            ax.plot(range(1, len(ppa) + 1), ppa, marker="o", label=f"{r['configuration']} T={r['temp']:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance (accepted / drafted)")
        ax.set_ylim(0, 1.02)
        ax.set_title("Per-position acceptance")
        written.append(_save(fig, ax, out, "acceptance.png"))

        cats = list(dict.fromkeys(r["category"] for r in rows))
        keys = [(r["configuration"], r["temp"]) for r in spec]
        w = 0.8 / len(keys)
        fig, ax = plt.subplots(figsize=(max(8, 1.5 * len(cats) + 3), 4.5))
        for j, (lab, t) in enumerate(keys):
            taus = [next(r["tau"] for r in rows if r["configuration"] == lab and r["temp"] == t and r["category"] == c)
                    for c in cats]
            ax.bar([i + (j - (len(keys) - 1) / 2) * w for i in range(len(cats))], taus, w, label=f"{lab} T={t:g}")
        ax.set_xticks(range(len(cats)), cats)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("tau (tokens per target forward)")
        ax.set_title("tau by prompt category")
        written.append(_save(fig, ax, out, "tau_by_category.png"))
    return written


# ----------------------------------------------------------------------------- the run

def cmd_bench(a) -> int:
    s = settings(a)
    fast, blas_msg = blas_status()
    if not fast:
        print(f"bench: warning: {blas_msg}", file=sys.stderr)
    if s["background_load"]:
        print(f"bench: keeping {s['background_load']} core(s) busy for the whole run (--background-load)", file=sys.stderr)
    with BackgroundLoad(s["background_load"]):
        return _bench(a, s, blas_msg)


def _bench(a, s, blas_msg) -> int:
    model_path = resolve_model_path(a.model)
    target, tok = load_target(model_path)
    eos = set() if a.ignore_eos else set(tok.eos_token_ids)
    prompts = {c: [encode_prompt(tok, c, t) for t in s["texts"][c]] for c in s["categories"]}

    def speculator(cfg, target):
        kind, path = cfg["kind"], cfg["path"]
        n = a.num_draft_tokens if kind == "draft-simple" else None
        spec = load_speculator(path, target, spec_type="ngram" if kind == "ngram" else kind, num_draft_tokens=n,
                               policy=cfg["policy"], ngram=cfg.get("ngram", False))
        if cfg.get("random"):
            spec = random_weights(spec, path, target)
        return spec

    # configurations; every drafter is loaded once here so that a bad one fails before any timing
    configs = [{"label": AR, "engine": "mlxspec", "kind": "none", "path": None, "max_drafts": 0}]
    wanted = []
    for i, p in enumerate(s["drafts"]):
        wanted += [dict(path=p, kind="auto", policy=pol) for pol in s["policies"]]
        if i == 0 and s["ngram"]:
            wanted.append(dict(path=p, kind="auto", policy="adaptive", ngram=True))
    if s["drafts"] and s["random"]:
        wanted.append(dict(path=s["drafts"][0], kind="auto", policy="adaptive", random=True))
    if s["ngram"]:
        wanted.append(dict(path=None, kind="ngram", policy="adaptive"))
    if a.draft_simple:
        wanted.append(dict(path=a.draft_simple, kind="draft-simple", policy="fixed"))
    for w in wanted:
        with capture() as log:  # the loading lines go into the row, not on stderr
            spec = speculator(w, target)
        label = spec.spec_type + (f" {Path(w['path']).name}" if w["path"] and w["kind"] != "ngram" else "")
        label += " (random weights)" if w.get("random") else ""
        label += f" [{w['policy']}]"
        if any(c["label"] == label for c in configs):
            label += f" #{len(configs)}"
        configs.append({"label": label, "engine": "mlxspec", **w, "path": str(w["path"]) if w["path"] else None,
                        "description": spec.description, "load_log": "\n".join(log).strip(),
                        "max_drafts": spec.make_drafter(target).max_drafts})
        del spec
    if not wanted:
        print("bench: no drafter (none shipped, none given with --draft): only autoregressive rows", file=sys.stderr)
    configs.append({"label": MLX_LM, "engine": "mlx_lm", "kind": "none", "path": None, "max_drafts": 0})
    mdir = mlx_lm_dir(a.model, a.mlx_dir)

    # target forward cost t(L) at the run's mean context
    n_prompts = sum(len(v) for v in prompts.values())
    context = round(sum(len(i) for v in prompts.values() for i in v) / n_prompts + s["max_tokens"] / 2)
    L_max = max(c["max_drafts"] for c in configs) + 1
    print(f"bench: timing target forwards of 1..{L_max} tokens at context {context}", file=sys.stderr)
    sps = measure_verify_sps(target, L_max, context=context, repeats=7)
    ms = {L: 1000.0 / v for L, v in sps.items()}

    total = len(configs) * len(s["temps"]) * s["repeats"] * n_prompts
    timings = {}
    with tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, dynamic_ncols=True) as bar:
        for cfg in configs:  # mlx_lm last, after the mlxspec target is freed: peak memory is its own
            if cfg["engine"] == "mlx_lm":
                del target
                gc.collect()
                mx.clear_cache()
                model, hf_tok = mlx_lm.load(str(mdir))
                hf_tok.eos_token_ids = eos
                run = mlx_lm_runner(model, hf_tok)
            else:
                with capture():
                    spec = speculator(cfg, target) if cfg["kind"] != "none" else None
                run = mlxspec_runner(target, eos, spec)
            timings[cfg["label"]] = time_config(cfg["label"], run, s, prompts, bar)
            del run
            spec = model = None
            gc.collect()
            mx.clear_cache()
    order = [configs[-1]] + configs[:-1]  # report: mlx_lm, mlxspec AR, speculative
    rows = summarize(order, timings, s, ms)

    meta = {
        "command": command_line(a),
        "model": display_path(model_path),
        "mlx_lm_dir": display_path(mdir),
        "target_compute": "dense float32" if default_dense() else "quantized",
        "categories": s["categories"],
        "prompt_tokens": {c: [len(i) for i in v] for c, v in prompts.items()},
        "max_tokens": s["max_tokens"], "repeats": s["repeats"], "temps": s["temps"], "seed": s["seed"],
        "ignore_eos": a.ignore_eos, "background_load": s["background_load"], "loadavg": os.getloadavg(),
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "blas": blas_msg,
        "platform": platform.platform(), "cpus": os.cpu_count(), "device": str(mx.default_device()),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    print(markdown(rows, meta, s, ms, context))
    if a.out:
        out = Path(a.out)
        doc = {
            "meta": meta,
            "configurations": [{k: v for k, v in c.items()} for c in order],
            "verify_cost": {"context": context, "forward_ms": ms, "repeats": 7},
            "results": rows,
        }
        with writing("--out", out):
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench.json").write_text(json.dumps(doc, indent=2))
            plots = write_plots(rows, out)
        print(f"bench: wrote {out / 'bench.json'}" + (f" and {', '.join(plots)}" if plots else ""), file=sys.stderr)
    return 0
