"""`mlxspec bench`: load once, time every configuration, report."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
from tqdm import tqdm

from mlxspec.bench.report import markdown, write_plots
from mlxspec.bench.runners import (BackgroundLoad, mlx_lm_dir, mlx_lm_runner, mlxspec_runner, random_weights,
                                   time_interleaved)
from mlxspec.bench.settings import command_line, settings
from mlxspec.bench.summary import AR, MLX_LM, summarize
from mlxspec.api import SpecConfig, Speculator
from mlxspec.blas import blas_status
from mlxspec.cache import display_path
from mlxspec.engine.profile import measure_verify_sps
from mlxspec.logger import capture
from mlxspec.prompts import encode_prompt
from mlxspec.targets.load import default_dense, load_target, resolve_model_path
from mlxspec.validate import writing

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

    def speculator(w) -> Speculator:
        kind = w["kind"]
        cfg = SpecConfig(draft=w["path"], spec_type="ngram" if kind == "ngram" else kind, policy=w["policy"],
                         num_draft_tokens=a.num_draft_tokens if kind == "draft-simple" else None,
                         ngram=w.get("ngram", False), tree=w.get("tree", "off"), lookup=w.get("lookup", "ngram"))
        spec = Speculator.build(cfg, target, model=a.model)
        return random_weights(spec, w["path"], target) if w.get("random") else spec

    # configurations; every drafter is loaded here, once, so that a bad one fails before any
    # timing; `held` is what each one keeps resident, which the other rows' peaks leave out
    configs = [{"label": AR, "engine": "mlxspec", "kind": "none", "path": None, "max_drafts": 0}]
    specs, held = {AR: None}, {AR: 0}
    base = mx.get_active_memory()
    wanted = []
    for i, p in enumerate(s["drafts"]):
        wanted += [dict(path=p, kind="auto", policy=pol) for pol in s["policies"]]
        if s["ngram"]:  # each drafter with prompt lookup beside it (the default configuration)
            wanted.append(dict(path=p, kind="auto", policy="adaptive", ngram=True))
    if s["drafts"] and s["random"]:
        wanted.append(dict(path=s["drafts"][0], kind="auto", policy="adaptive", random=True))
    if s["ngram"]:
        wanted.append(dict(path=None, kind="ngram", policy="adaptive"))
    if s["suffix"]:  # each lookup row's suffix-drafting twin
        wanted += [dict(w, lookup="suffix") for w in list(wanted) if w.get("ngram") or w["kind"] == "ngram"]
    if a.draft_simple:
        wanted.append(dict(path=a.draft_simple, kind="draft-simple", policy="fixed"))
    # a tree row beside each drafter / lookup chain row (not the random-weight one)
    wanted += [dict(w, tree=t) for w in list(wanted) if not w.get("random") and w["kind"] != "draft-simple"
               for t in s["trees"]]
    for w in wanted:
        before = mx.get_active_memory()
        with capture() as log:  # the loading lines go into the row, not on stderr
            spec = speculator(w)
        label = spec.spec_type + (f" {Path(w['path']).name}" if w["path"] and w["kind"] != "ngram" else "")
        label += " (random weights)" if w.get("random") else ""
        label += " lookup=suffix" if w.get("lookup") == "suffix" else ""
        label += f" [{w['policy']}]" + (f" tree={w['tree']}" if w.get("tree") else "")
        if any(c["label"] == label for c in configs):
            label += f" #{len(configs)}"
        configs.append({"label": label, "engine": "mlxspec", **w, "path": str(w["path"]) if w["path"] else None,
                        "description": spec.description, "load_log": "\n".join(log).strip(),
                        "max_drafts": spec.make_drafter(target).max_drafts})
        specs[label], held[label] = spec, max(0, mx.get_active_memory() - before)
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

    # mlx_lm's own copy of the weights, resident beside mlxspec's for the whole run: the rows
    # run interleaved, generation by generation (`time_interleaved`); each row's peak leaves out
    # the bytes the others hold
    before = mx.get_active_memory()
    model, hf_tok = mlx_lm.load(str(mdir))
    hf_tok.eos_token_ids = eos
    held[MLX_LM] = max(0, mx.get_active_memory() - before)
    runners = {c["label"]: mlxspec_runner(target, eos, specs[c["label"]]) for c in configs if c["engine"] == "mlxspec"}
    runners[MLX_LM] = mlx_lm_runner(model, hf_tok)

    def elsewhere(label):
        own = held[label] + (0 if label == MLX_LM else base)  # base: the mlxspec target
        return max(0, mx.get_active_memory() - own)

    total = len(configs) * len(s["temps"]) * s["repeats"] * n_prompts
    with tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, dynamic_ncols=True) as bar:
        timings = time_interleaved(configs, runners, s, prompts, bar, elsewhere)
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
            "results": [r.to_dict() for r in rows],
        }
        with writing("--out", out):
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench.json").write_text(json.dumps(doc, indent=2))
            plots = write_plots(rows, out)
        print(f"bench: wrote {out / 'bench.json'}" + (f" and {', '.join(plots)}" if plots else ""), file=sys.stderr)
    return 0
