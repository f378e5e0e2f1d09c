#!/usr/bin/env python
"""Tokens/s with the target on 1 vs N ranks (mlx.launch, ring backend), autoregressive and
speculative, and where the time of a step goes (header broadcast, collectives). JSON out.

    LD_PRELOAD=$(.venv/bin/python -m mlxspec.blas) HF_HUB_OFFLINE=1 \\
        .venv/bin/python scripts/bench_distributed.py [--model PATH] [--draft auto|PATH] [--ranks 1,2]
        [--dist-mode auto|tensor|pipeline] [--max-tokens 64] [--hosts 127.0.0.1] [--repeat 1] [--out FILE]
    .venv/bin/python scripts/bench_distributed.py --random-llama DIR   # an 8-head llama (tensor parallel)

Per run: generation tokens/s (AR: no drafter; spec: the drafter), tau, and per target forward
the time rank 0 spends sending the header (0 when it travels with the pipeline's activations),
the whole forward, the part blocked in send/recv (pipeline) and, of that, asleep while the
other stages compute; rank 1's own breakdown (`rank_1`); for tensor parallel the replayed cost
of that forward's all-reduces (2 per layer, [1, L, hidden] float32, timed alone on all ranks
before generating). --repeat R: rounds of (1 rank, N ranks) back to back, with per-round
ratios. --interleave K: inside the N-rank job rank 0 also loads the whole target and
alternates one process's generation with the N ranks' K times (the other ranks asleep
meanwhile), so both sides of each ratio share the machine's load; on a shared machine these
are the figures to read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a Python function that reverses a string."


def worker(job: dict) -> None:
    import mlx.core as mx

    from mlxspec import api, distributed
    from mlxspec.tokenizer import apply_chat_template

    target, tok, spec = api.load(job["model"], job["draft"], shard=distributed.Sharding(mode=job["mode"], timeout=600),
                                 log=open(os.devnull, "w"), **job.get("spec_kw", {}))
    # all-reduce replay (all ranks, before generating): 2 per layer per forward, at L = 1 and L = 9
    replay = {}
    if target.mode == "tensor":
        H, n_layers = target.info.hidden_size, target.info.num_layers
        for L in (1, 9):
            x = mx.ones((1, L, H))
            mx.eval(mx.distributed.all_sum(x, group=target.group))
            t = time.perf_counter()
            for _ in range(2 * n_layers):
                mx.eval(mx.distributed.all_sum(x, group=target.group))
            replay[L] = 1e3 * (time.perf_counter() - t)
    if target.rank != 0:
        target.serve()
        st = target.stats
        n = max(st.forwards, 1)
        print(f"BENCH_RANK{target.rank} " + json.dumps({
            "forwards": st.forwards, "blas_threads": target.blas_threads,
            "header_wait_ms_per_forward": round(1e3 * st.header_time / n, 2),
            "forward_ms": round(1e3 * st.forward_time / n, 2),
            "sendrecv_ms_per_forward": round(1e3 * st.comm_time / n, 2),
            "idle_ms_per_forward": round(1e3 * getattr(st, "idle_time", 0) / n, 2)}), flush=True)
        return
    ids = tok.encode(apply_chat_template(tok, [{"role": "user", "content": PROMPT}], add_generation_prompt=True),
                     add_special_tokens=False) if tok.has_chat_template else tok.encode(PROMPT)
    out = {"ranks": target.size, "mode": target.mode, "describe": target.describe(),
           "blas_threads": getattr(target, "blas_threads", None),
           "allreduce_replay_ms_per_forward": replay or None}
    with target:
        list(api.stream_generate(target, tok, ids, spec, max_tokens=8))  # warm-up
        for name, sp in (("ar", api.Speculator()), ("spec", spec)):
            s0 = distributed.DistStats(**vars(target.stats))
            last = None
            for r in api.stream_generate(target, tok, ids, sp, max_tokens=job["max_tokens"]):
                last = r
            st, d = last.stats, target.stats
            n = max(d.forwards - s0.forwards, 1)
            out[name] = {
                "generation_tps": round(st.generation_tps, 2), "tokens": last.generation_tokens,
                "target_forwards": st.target_forwards, "tau": round(st.tau, 3),
                "acceptance": round(st.acceptance_rate, 3),
                "header_ms_per_forward": round(1e3 * (d.header_time - s0.header_time) / n, 3),
                "forward_ms": round(1e3 * (d.forward_time - s0.forward_time) / n, 2),
                "sendrecv_ms_per_forward": round(1e3 * (d.comm_time - s0.comm_time) / n, 2),
                "idle_ms_per_forward": round(1e3 * (getattr(d, "idle_time", 0) - getattr(s0, "idle_time", 0)) / n, 2),
                "draft_s": round(st.draft_time, 3), "verify_s": round(st.verify_time, 3),
            }
        if job.get("interleave") and target.size > 1:
            out["interleaved"] = interleaved(job, target, tok, ids, spec)
    print("BENCH " + json.dumps(out), flush=True)


def interleaved(job: dict, target, tok, ids, spec) -> dict:
    """One process's generation and the N ranks' generation, alternated `job["interleave"]`
    times in this job: rank 0 also loads the whole target and generates with it alone (the
    other ranks sleep in recv meanwhile, their OpenBLAS workers parked; this rank keeps every
    core, as a process of its own would). Pairs taken seconds apart share the machine's
    load, where separate processes minutes apart do not. -> per mode (ar, spec): tok/s of each
    side per round, and the per-round ratio one process / N ranks (N ranks' cost per token)."""
    from statistics import median

    from mlxspec import api

    import ctypes

    blas = next((ctypes.CDLL(ln.split()[-1]) for ln in open("/proc/self/maps") if "libopenblas" in ln), None)
    mine = blas.openblas_get_num_threads() if blas else None  # this rank's setting (restored for its runs)
    one, _, one_spec = api.load(job["model"], job["draft"], log=open(os.devnull, "w"), **job.get("spec_kw", {}))
    list(api.stream_generate(one, tok, ids, one_spec, max_tokens=8))  # warm-up
    res = {}
    for _ in range(job["interleave"]):
        for mode, sps in (("ar", (api.Speculator(), api.Speculator())), ("spec", (one_spec, spec))):
            tps = []
            for tgt, sp in zip((one, target), sps):
                if blas:  # one process: every core (its default); the rank: what it set itself
                    blas.openblas_set_num_threads(os.cpu_count() if tgt is one else mine)
                last = None
                for r in api.stream_generate(tgt, tok, ids, sp, max_tokens=job["max_tokens"]):
                    last = r
                tps.append(last.stats.generation_tps)
            row = res.setdefault(mode, {"one_process_tps": [], "n_ranks_tps": [], "cost_per_token": []})
            row["one_process_tps"].append(round(tps[0], 2))
            row["n_ranks_tps"].append(round(tps[1], 2))
            row["cost_per_token"].append(round(tps[0] / tps[1], 2))
    for row in res.values():
        row["median_cost_per_token"] = round(median(row["cost_per_token"]), 2)
    return res


def random_llama(path: str) -> str:
    """A random SmolLM2-sized llama with 8 heads / 4 KV heads (divisible: tensor parallel)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    cfg = dict(model_type="llama", hidden_size=512, num_hidden_layers=30, intermediate_size=1536,
               num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=49152,
               rope_theta=10000.0, tie_word_embeddings=True)
    m = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(m.parameters())
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(p / "model.safetensors"), dict(tree_flatten(m.parameters())))
    (p / "config.json").write_text(json.dumps(cfg))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}  # a word-level tokenizer: the text is irrelevant here
    (p / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}))
    return str(p)


def run_once(a, n: int, draft, spec_kw) -> dict | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": a.model, "draft": draft, "mode": a.dist_mode, "max_tokens": a.max_tokens,
                   "spec_kw": spec_kw, "interleave": a.interleave}, f)
    cmd = [sys.executable, __file__, "--worker", f.name]
    if n > 1 and a.launcher == "mlxspec":  # what `mlxspec generate --ranks N` runs
        cmd = [sys.executable, "-m", "mlxspec.distributed.launch", "-n", str(n), "--"] + cmd
    elif n > 1:
        from mlxspec.distributed.launch import free_ports

        hosts = a.hosts.split(",")
        per = max(1, n // len(hosts))
        cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", a.hosts,
               "-n", str(per), "-p", str(free_ports(1)[0]), "--"] + cmd
    load0 = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")]
    if not line:
        print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
        return None
    res = json.loads(line[0][6:])
    for ln in r.stdout.splitlines():
        if ln.startswith("BENCH_RANK"):
            k, _, v = ln.partition(" ")
            res[k[len("BENCH_"):].lower().replace("rank", "rank_")] = json.loads(v)
    res["wall_s"] = round(time.perf_counter() - t, 1)
    # CPU of the whole job (launcher and ranks): mlx.launch's relay shows up here
    res["job_cpu_s"] = round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 1)
    res["launcher"] = a.launcher if n > 1 else None
    res["load_avg"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # at the start and the end of the run
    return res


def summary(results: list[dict], ranks: list[int]) -> dict:
    """Per rank count: median tok/s; per N > 1: the median over rounds of (1-rank tok/s / N-rank
    tok/s) = N ranks' cost per token relative to one process, within the same round."""
    from statistics import median

    out = {}
    for n in ranks:
        rows = [r for r in results if r["ranks"] == n]
        out[f"{n} ranks"] = {k: round(median(r[k]["generation_tps"] for r in rows), 2) for k in ("ar", "spec")}
    if 1 in ranks:
        for n in ranks:
            if n == 1:
                continue
            for k in ("ar", "spec"):
                ratios = []
                for rnd in {r["round"] for r in results}:
                    one = [r for r in results if r["round"] == rnd and r["ranks"] == 1]
                    many = [r for r in results if r["round"] == rnd and r["ranks"] == n]
                    if one and many:
                        ratios.append(one[0][k]["generation_tps"] / many[0][k]["generation_tps"])
                out[f"{n} ranks"][f"{k}_cost_per_token_vs_1"] = {"median": round(median(ratios), 2),
                                                                   "rounds": [round(x, 2) for x in ratios]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--dist-mode", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hosts", default="127.0.0.1", help="mlx.launch --hosts (IPs); ranks are spread over them")
    ap.add_argument("--launcher", choices=("mlxspec", "mlx"), default="mlxspec",
                    help="mlxspec: local ranks as `mlxspec generate --ranks N` starts them (default); "
                         "mlx: mlx.launch --backend ring (its relay threads spin a core; needed for --hosts)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (each rank count back to back); medians")
    ap.add_argument("--interleave", type=int, default=0,
                    help="in the N-rank job, also alternate one process's generation with the N ranks' this many times")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="keep N cores busy with spinning processes for the whole run (a shared machine)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--random-llama", default=None, help="write an 8-head random llama to DIR and exit")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(json.loads(Path(a.worker).read_text()))
        return 0
    if a.random_llama:
        print(random_llama(a.random_llama))
        return 0
    spec_kw = {"policy": "fixed", "ngram": False}  # the DSpark drafter alone, every drafted block verified
    draft = None if a.draft == "none" else a.draft
    ranks = [int(x) for x in a.ranks.split(",")]
    from mlxspec.bench import BackgroundLoad

    results = []
    with BackgroundLoad(a.background_load):
        for rep in range(a.repeat):  # 1 rank and N ranks back to back, repeated: ratios within a round
            for n in ranks:
                res = run_once(a, n, draft, spec_kw)
                if res is None:
                    return 1
                res["round"] = rep
                results.append(res)
                print(json.dumps(res), file=sys.stderr)
    report = {"command": " ".join(["scripts/bench_distributed.py", *sys.argv[1:]]),
              "model": a.model or "SmolLM2-135M-Instruct (default)", "draft": a.draft, "max_tokens": a.max_tokens,
              "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()[0], "background_load": a.background_load,
              "summary": summary(results, ranks), "results": results}
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
