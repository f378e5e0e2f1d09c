#!/usr/bin/env python
"""Tokens/s with the target on 1 vs N ranks (mlx.launch, ring backend), autoregressive and
speculative, and where the time of a step goes (header broadcast, collectives). JSON out.

    LD_PRELOAD=$(.venv/bin/python -m mlxspec.blas) HF_HUB_OFFLINE=1 \\
        .venv/bin/python scripts/bench_distributed.py [--model PATH] [--draft auto|PATH] [--ranks 1,2]
        [--dist-mode auto|tensor|pipeline] [--max-tokens 64] [--hosts 127.0.0.1] [--out FILE]
    .venv/bin/python scripts/bench_distributed.py --random-llama DIR   # an 8-head llama (tensor parallel)

Per run: generation tokens/s (AR: no drafter; spec: the drafter), tau, and per target forward
the time rank 0 spends broadcasting the header, the whole forward, the part blocked in
send/recv (pipeline), and for tensor parallel the replayed cost of that forward's all-reduces
(2 per layer, [1, L, hidden] float32, timed alone on all ranks before generating).
On one machine N ranks share its cores: the point is the cost of the collectives, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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

    target, tok, spec = distributed.load(job["model"], job["draft"], mode=job["mode"], timeout=600,
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
            "idle_ms_per_forward": round(1e3 * st.idle_time / n, 2)}), flush=True)
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
                "idle_ms_per_forward": round(1e3 * (d.idle_time - s0.idle_time) / n, 2),
                "draft_s": round(st.draft_time, 3), "verify_s": round(st.verify_time, 3),
            }
    print("BENCH " + json.dumps(out), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--dist-mode", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hosts", default="127.0.0.1", help="mlx.launch --hosts (IPs); ranks are spread over them")
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
    results = []
    for n in [int(x) for x in a.ranks.split(",")]:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"model": a.model, "draft": draft, "mode": a.dist_mode, "max_tokens": a.max_tokens,
                       "spec_kw": spec_kw}, f)
        cmd = [sys.executable, __file__, "--worker", f.name]
        if n > 1:
            hosts = a.hosts.split(",")
            per = max(1, n // len(hosts))
            cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", a.hosts,
                   "-n", str(per), "-p", str(free_port()), "--"] + cmd
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")]
        if not line:
            print(r.stdout[-2000:], r.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(line[0][6:])
        for ln in r.stdout.splitlines():
            if ln.startswith("BENCH_RANK"):
                k, _, v = ln.partition(" ")
                res[k[len("BENCH_"):].lower().replace("rank", "rank_")] = json.loads(v)
        res["wall_s"] = round(time.perf_counter() - t, 1)
        results.append(res)
        print(json.dumps(res), file=sys.stderr)
    report = {"model": a.model or "SmolLM2-135M-Instruct (default)", "draft": a.draft, "max_tokens": a.max_tokens,
              "cpu_count": os.cpu_count(), "load_avg": os.getloadavg()[0], "results": results}
    text = json.dumps(report, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
