#!/usr/bin/env python
"""Autoregressive decode speed: mlxspec vs mlx_lm, same weights, same prompts, one run.

mlx_lm cannot read GGUF, so the GGUF target is written once as MLX directories with
`mlxspec convert` (cached under the mlxspec cache, reused):

- `dense`: `--dtype float32`. mlxspec on the CPU computes dense float32 (see
  `mlxspec.targets.model.dequantize_model`), so both engines run identical dense weights.
  This is the comparison the 5% criterion applies to.
- `keep`: the lossless MLX affine repack of the GGUF's quantized tensors, loaded quantized
  by both (mlxspec with `load_target(dense=False)`).

Per (variant, repeat, prompt) each engine decodes `--max-tokens` tokens greedily with end-of-
generation disabled (both produce exactly that many tokens). Tokens/s counts the generation
only: from the first token (the prefill's) to the last, (tokens - 1) / time. The engines
run back to back on the same prompt, alternating which goes first. Reported: the median over
repeats of each engine's aggregate tokens/s over the prompts and their ratio, and the median
of the per-pair ratios (mlxspec / mlx_lm), which the pass/fail verdict uses: on a shared
machine load changes between repeats, and a back-to-back pair sees nearly the same load.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python scripts/bench_ar.py --repeats 5 --max-tokens 128 --out bench_ar.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default=None, help="target .gguf (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--variants", default="dense,keep", help="comma list of dense (float32) and keep (quantized)")
    ap.add_argument("--max-tokens", "-n", type=int, default=128)
    ap.add_argument("--repeats", "-r", type=int, default=5)
    ap.add_argument("--prompts", default="chat:0,code:0,prose:0",
                    help="category:index list from mlxspec/data/prompts.json")
    ap.add_argument("--mlx-dir", default=None, help="where the converted MLX directories go (default: mlxspec cache)")
    ap.add_argument("--out", "-o", default=None, help="write the results as JSON here")
    ap.add_argument("--threshold", type=float, default=0.95,
                    help="dense ratio below which the run reports mlxspec as too slow (exit 1)")
    return ap.parse_args(argv)


def run_mlxspec(target, ids: list[int], n: int) -> tuple[list[int], float]:
    from mlxspec.engine.loop import generate_steps

    out: list[int] = []
    t_first = None
    for step in generate_steps(target, ids, drafter=None, max_tokens=n, eos_ids=frozenset()):
        if t_first is None:
            t_first = time.perf_counter()
        out.extend(step)
    t_last = time.perf_counter()
    return out, (t_last - t_first)


def run_mlx_lm(model, tokenizer, ids: list[int], n: int) -> tuple[list[int], float]:
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out: list[int] = []
    t_first = None
    for r in stream_generate(model, tokenizer, ids, max_tokens=n, sampler=make_sampler(temp=0.0)):
        if r.finish_reason is not None and r.generation_tokens == len(out):
            break  # the closing response repeats the last token
        if t_first is None:
            t_first = time.perf_counter()
        out.append(int(r.token))
    t_last = time.perf_counter()
    return out, (t_last - t_first)


def main(argv=None) -> int:
    a = parse_args(argv)
    import mlx.core as mx
    import mlx_lm
    from tqdm import tqdm

    from mlxspec.blas import blas_status
    from mlxspec.targets.load import load_target, resolve_model_path
    from mlxspec.targets.convert import cached_mlx_copy
    from mlxspec.prompts import encode_prompt, load_prompts

    fast, blas_msg = blas_status()
    if not fast:
        print(f"warning: {blas_msg}", file=sys.stderr)
    gguf = resolve_model_path(a.model)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("dense", "keep"):
            print(f"bench_ar: unknown variant {v!r}; use dense and/or keep", file=sys.stderr)
            return 2

    sets = load_prompts()
    _, tok = load_target(gguf, dense=False)
    prompts = []
    for spec in a.prompts.split(","):
        cat, idx = spec.split(":")
        prompts.append((spec, encode_prompt(tok, cat, sets[cat][int(idx)])))

    results: dict = {}
    total = len(variants) * a.repeats * len(prompts) * 2
    bar = tqdm(total=total, desc="bench_ar", unit="run", file=sys.stderr)
    for v in variants:
        dtype = "float32" if v == "dense" else "keep"
        mdir = cached_mlx_copy(gguf, dtype, a.mlx_dir)
        bar.set_postfix_str(f"{v}: loading")
        target, _ = load_target(gguf, dense=(v == "dense"))
        model, hf_tok = mlx_lm.load(str(mdir))
        hf_tok.eos_token_ids = []  # no early stop: exactly max_tokens tokens for both
        engines = {
            "mlxspec": lambda ids, n, target=target: run_mlxspec(target, ids, n),
            "mlx_lm": lambda ids, n, model=model, hf_tok=hf_tok: run_mlx_lm(model, hf_tok, ids, n),
        }
        for fn in engines.values():  # warm-up (kernels, caches, allocator)
            fn(prompts[0][1], 8)
        per = {e: [] for e in engines}  # per repeat: aggregate tokens/s over prompts
        paired = []  # per (repeat, prompt): mlxspec tok/s / mlx_lm tok/s of the back-to-back pair
        tokens = {e: {} for e in engines}
        for rep in range(a.repeats):
            acc = {e: [0, 0.0] for e in engines}
            for pi, (name, ids) in enumerate(prompts):
                order = list(engines) if (rep + pi) % 2 == 0 else list(engines)[::-1]
                tps = {}
                for e in order:
                    bar.set_postfix_str(f"{v} r{rep} {name} {e}")
                    out, dt = engines[e](ids, a.max_tokens)
                    acc[e][0] += len(out) - 1
                    acc[e][1] += dt
                    tps[e] = (len(out) - 1) / dt
                    tokens[e].setdefault(name, out)
                    bar.update(1)
                paired.append(tps["mlxspec"] / tps["mlx_lm"])
            for e in engines:
                per[e].append(acc[e][0] / acc[e][1])
        med = {e: statistics.median(per[e]) for e in engines}
        same = {name: tokens["mlxspec"][name] == tokens["mlx_lm"][name] for name, _ in prompts}
        first_diff = {}
        for name, _ in prompts:
            x, y = tokens["mlxspec"][name], tokens["mlx_lm"][name]
            first_diff[name] = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        results[v] = {
            "mlx_dir": str(mdir),
            "tps_median": med,
            "tps_per_repeat": per,
            "ratio": med["mlxspec"] / med["mlx_lm"],
            "paired_ratios": paired,
            "paired_ratio_median": statistics.median(paired),
            "same_tokens": same,
            "first_difference": first_diff,
        }
        del target, model
        mx.clear_cache()
    bar.close()

    # ---- report
    rows = ["| variant | engine | tok/s (median) | min | max | mlxspec / mlx_lm (medians) | paired ratio "
            "(median) | same tokens |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for v, r in results.items():
        for e in ("mlx_lm", "mlxspec"):
            vals = r["tps_per_repeat"][e]
            ratio = f"{r['ratio']:.3f}" if e == "mlxspec" else ""
            pr = f"{r['paired_ratio_median']:.3f}" if e == "mlxspec" else ""
            same = f"{sum(r['same_tokens'].values())}/{len(r['same_tokens'])}" if e == "mlxspec" else ""
            label = "dense float32" if v == "dense" else "quantized (keep)"
            rows.append(f"| {label} | {e} | {r['tps_median'][e]:.1f} | {min(vals):.1f} | {max(vals):.1f} | "
                        f"{ratio} | {pr} | {same} |")
    print("\n".join(rows))
    meta = {
        "model": str(gguf),
        "prompts": {name: len(ids) for name, ids in prompts},
        "max_tokens": a.max_tokens,
        "repeats": a.repeats,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "blas": blas_msg,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "default_device": str(mx.default_device()),
    }
    verdict = None
    if "dense" in results:
        # the verdict uses the paired ratio: each pair ran back to back, so load changes on a
        # shared machine hit both engines alike (the ratio of medians mixes different moments)
        r = results["dense"]
        ratio = r["paired_ratio_median"]
        verdict = "ok" if ratio >= a.threshold else "too slow"
        print(f"\ndense float32: mlxspec runs at {ratio:.1%} of mlx_lm's decode speed (median of "
              f"{len(r['paired_ratios'])} back-to-back pairs; ratio of medians {r['ratio']:.1%}): "
              f"{'within' if verdict == 'ok' else 'OUTSIDE'} the {1 - a.threshold:.0%} budget")
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "results": results, "verdict": verdict}, indent=2))
        print(f"wrote {a.out}", file=sys.stderr)
    return 0 if verdict in (None, "ok") else 1


if __name__ == "__main__":
    sys.exit(main())
