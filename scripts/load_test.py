#!/usr/bin/env python3
"""Load test for a running `mlxspec serve` (loopback only; not a timed test).

    scripts/load_test.py --port 8080 --requests 16 --concurrency 4 --max-tokens 32

Or the comparison (`--compare`): it starts every server itself on a free loopback port, all
at once (each idles while another is measured), and runs the same requests against them level
by level, each server in turn:
`mlxspec serve` (continuous batching, the default drafter on SmolLM2), `mlxspec serve
--max-batch 1` (one request at a time, the server before batching) and `mlx_lm.server` on the
same weights (dense float32, converted once with `mlxspec convert`; batched autoregressive
decoding as mlx-lm runs it), then a bounded run of --bounded requests at the top concurrency
against `mlxspec serve`. Per level: aggregate tok/s, per-request tok/s, p50/p95 TTFT, errors,
and whether every greedy response equals that server's concurrency-1 response to the same
prompt. Writes the JSON and a plot:

    scripts/load_test.py --compare --levels 1,2,4,8 --requests 16 --max-tokens 32 \
        --json docs/bench/serve_load.json --plot docs/bench/serve_load.png

`--cold` sends prompts no level has sent before (no prompt-cache hits on any server: the
prefill-bound case; no equality check).

Sends N streaming chat requests, at most C at a time, and reports p50/p95 time to first
token, p50/p95 total latency, aggregate generated tokens/s and the error count. Bounded in
count (--requests) and time (--time-limit). With --multi-turn it also measures the time to
first token of turn 2 of a conversation with and without the prompt cache
(`cache_prompt: false` turns it off for one request).

Standard library only (http.client + threads), so it runs from any Python.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Name three planets and one fact about each.",
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "Summarise the plot of Hamlet in one paragraph.",
    "Write a SQL query that counts rows per day.",
]


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stream_chat(host, port, key, model, messages, max_tokens, extra=None, timeout=600):
    """-> dict(ttft, total, tokens, text, cached) for one streaming request; raises on any error."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, text, usage = None, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(f"stream error: {ev['error']}")
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece or ""
    total = time.perf_counter() - t0
    c.close()
    if usage is None:
        raise RuntimeError("no usage chunk")
    return {"ttft": ttft if ttft is not None else total, "total": total, "tokens": usage["completion_tokens"],
            "text": text, "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "accepted": usage.get("mlxspec", {}).get("accepted", 0)}


def run_level(host, port, key, model, prompts, concurrency, max_tokens, time_limit, extra=None) -> tuple[dict, list]:
    """len(prompts) streaming greedy requests, at most `concurrency` at a time -> (summary, per-request
    results in prompt order; None where the request failed)."""
    results, errors, lock = [None] * len(prompts), [], threading.Lock()
    next_i = [0]
    t_start = time.perf_counter()

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= len(prompts) or time.perf_counter() - t_start > time_limit:
                    return
                next_i[0] += 1
            try:
                r = stream_chat(host, port, key, model, [{"role": "user", "content": prompts[i]}], max_tokens, extra,
                                timeout=time_limit)
                results[i] = r
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    done = [r for r in results if r is not None]
    toks = sum(r["tokens"] for r in done)
    per = [r["tokens"] / (r["total"] - r["ttft"]) for r in done if r["tokens"] > 1 and r["total"] > r["ttft"]]
    return {
        "concurrency": concurrency, "requests": len(prompts), "completed": len(done),
        "errors": len(errors) + (len(prompts) - len(done) - len(errors)), "error_samples": errors[:3],
        "wall_s": wall, "generated_tokens": toks, "aggregate_tok_s": toks / wall if wall > 0 else 0.0,
        "per_request_tok_s_p50": pct(per, 0.5),
        "ttft_p50_s": pct([r["ttft"] for r in done], 0.5), "ttft_p95_s": pct([r["ttft"] for r in done], 0.95),
        "latency_p50_s": pct([r["total"] for r in done], 0.5), "latency_p95_s": pct([r["total"] for r in done], 0.95),
    }, results


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _wait_up(proc, port, log_path, limit=300.0) -> dict:
    """Wait for GET /health to answer 200 -> its JSON (mlxspec's names the model; mlx_lm's does not)."""
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {Path(log_path).read_text()[-1500:]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            body = r.read()
            if r.status == 200:
                return json.loads(body or b"{}")
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"server on port {port} did not come up within {limit:.0f} s")


def _mlx_lm_dir(a) -> str:
    """The packaged SmolLM2 as an MLX directory of dense float32 weights (what mlxspec runs on a CPU)."""
    if a.mlx_lm_model:
        return a.mlx_lm_model
    out = Path(a.workdir) / "smollm2-135m-f32"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlxspec.cli", "convert", "--dtype", "float32", "--out", str(out),
                        "--force"], check=True)
    return str(out)


@dataclass
class _Server:
    """One server of `--compare`, up for the whole run."""

    name: str
    cmd: list
    levels: list
    model: str | None
    port: int
    proc: subprocess.Popen
    log: Path


def _median_round(rounds: list[dict]) -> dict:
    """A level's summary over the rounds: the round with the median aggregate tok/s (a run that
    happened, not a blend), with every round's aggregate beside it."""
    pick = sorted(rounds, key=lambda r: r["aggregate_tok_s"])[(len(rounds) - 1) // 2]
    return {**pick, "rounds": len(rounds), "aggregate_tok_s_rounds": [r["aggregate_tok_s"] for r in rounds],
            "errors": sum(r["errors"] for r in rounds)}


def compare(a) -> int:
    levels = [int(x) for x in a.levels.split(",")]
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (request {i})" for i in range(a.requests)]
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    mlx_dir = _mlx_lm_dir(a) if not a.only or "mlx_lm.server" in a.only else None
    servers = [  # (name, command, levels, model id when /health does not name it)
        ("mlxspec serve", [sys.executable, "-m", "mlxspec.cli", "serve"] + (["--max-batch", str(a.max_batch)] if a.max_batch else []),
         levels, None),
        ("mlxspec serve --max-batch 1", [sys.executable, "-m", "mlxspec.cli", "serve", "--max-batch", "1"],
         [levels[0], levels[-1]], None),
        ("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(mlx_dir)], levels, str(mlx_dir)),
    ]
    if a.only:
        servers = [s for s in servers if s[0] in a.only.split(",")]
    out = {"max_tokens": a.max_tokens, "requests_per_level": a.requests, "levels": levels, "servers": {}, "cold": a.cold,
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_at_start": os.getloadavg(),
           "order": "all servers up at once, idle while another runs; level by level, each server in turn"}
    failed = False
    # every server at once (each idles while another is measured), then level by level, each
    # server in turn: the pairs compared at a level run minutes apart, not a whole server's run
    # apart (this host's speed drifts by tens of percent within minutes)
    live: list[_Server] = []
    try:
        for name, cmd, lv, model in servers:
            port = _free_port()
            log_path = Path(a.workdir) / f"{name.split()[0]}-{port}.log"
            proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
            live.append(_Server(name, cmd, lv, model, port, proc, log_path))
        for sv in live:
            sv.model = _wait_up(sv.proc, sv.port, sv.log).get("model") or sv.model
            stream_chat("127.0.0.1", sv.port, None, sv.model, [{"role": "user", "content": "Hello"}], 4)  # warm-up
        per = {}  # (server, level) -> that level's summary in each round
        refs = {}
        for rnd in range(a.rounds):
            # each round alternates the order the servers run a level in (no server always goes first)
            order = live if rnd % 2 == 0 else live[::-1]
            for c in levels:
                for sv in order:
                    if c not in sv.levels:
                        continue
                    name = sv.name
                    # --cold: prompts no level (and no round) has sent before (no prompt cache hit on any server)
                    asked = [f"{p} (level {c}{f', round {rnd}' if rnd else ''})" for p in prompts] if a.cold else prompts
                    summary, res = run_level("127.0.0.1", sv.port, None, sv.model, asked, c, a.max_tokens, a.time_limit)
                    texts = [r["text"] if r else None for r in res]
                    ref = refs.setdefault(name, texts)
                    summary["equal_to_concurrency_1"] = (None if a.cold else
                                                         sum(t is not None and t == r0 for t, r0 in zip(texts, ref)))
                    per.setdefault((name, c), []).append(summary)
                    failed |= summary["errors"] > 0
                    print(f"{name:28s} c={c}{f' round {rnd + 1}/{a.rounds}' if a.rounds > 1 else ''}: "
                          f"{summary['aggregate_tok_s']:6.2f} tok/s aggregate, "
                          f"{summary['per_request_tok_s_p50']:6.2f} per request, TTFT p50 {summary['ttft_p50_s']:.2f} s "
                          f"p95 {summary['ttft_p95_s']:.2f} s, errors {summary['errors']}"
                          + ("" if a.cold else f", equal to c=1 {summary['equal_to_concurrency_1']}/{len(prompts)}"),
                          flush=True)
        rows = {sv.name: [_median_round(per[(sv.name, c)]) for c in levels if c in sv.levels] for sv in live}
        if a.rounds > 1 and "mlx_lm.server" in rows:
            # paired within a round: mlxspec serve's aggregate over mlx_lm.server's at the same level
            out["ratio_to_mlx_lm_server"] = {}
            for sv in live:
                if sv.name == "mlx_lm.server":
                    continue
                out["ratio_to_mlx_lm_server"][sv.name] = {}
                for c in sv.levels:
                    if ("mlx_lm.server", c) not in per:
                        continue
                    r = [x["aggregate_tok_s"] / y["aggregate_tok_s"]
                         for x, y in zip(per[(sv.name, c)], per[("mlx_lm.server", c)]) if y["aggregate_tok_s"] > 0]
                    out["ratio_to_mlx_lm_server"][sv.name][str(c)] = {"median": statistics.median(r), "rounds": r}
                    print(f"{sv.name:28s} c={c}: {statistics.median(r):.3f}x mlx_lm.server (median of {len(r)} "
                          f"paired rounds; {min(r):.3f}-{max(r):.3f})", flush=True)
        for sv in live:
            name, cmd = sv.name, sv.cmd
            entry = {"command": " ".join(cmd[2:] if cmd[0] == sys.executable else cmd), "levels": rows[name]}
            if name == "mlxspec serve" and a.bounded and not a.cold:
                ref = refs[name]
                big = [prompts[i % len(prompts)] for i in range(a.bounded)]
                bmt = a.bounded_max_tokens or a.max_tokens
                summary, res = run_level("127.0.0.1", sv.port, None, sv.model, big, levels[-1], bmt, a.time_limit)
                # a shorter greedy answer is the concurrency-1 answer's prefix (same model, same prompt)
                summary["max_tokens"] = bmt
                summary["equal_to_concurrency_1"] = sum(
                    r is not None and ref[i % len(prompts)] is not None and ref[i % len(prompts)].startswith(r["text"])
                    and (bmt < a.max_tokens or r["text"] == ref[i % len(prompts)]) for i, r in enumerate(res))
                entry["bounded"] = summary
                print(f"{name:28s} bounded {a.bounded} requests at c={levels[-1]}: errors {summary['errors']}, "
                      f"equal to c=1 {summary['equal_to_concurrency_1']}/{a.bounded}, "
                      f"{summary['aggregate_tok_s']:.2f} tok/s", flush=True)
                failed |= summary["errors"] > 0
            out["servers"][name] = entry
    finally:
        for sv in live:
            sv.proc.terminate()
        for sv in live:
            try:
                sv.proc.wait(30)
            except subprocess.TimeoutExpired:
                sv.proc.kill()
                sv.proc.wait()
    out["load_average_at_end"] = os.getloadavg()
    from mlxspec.bench.report import write_json

    write_json(a.json, out, indent=2)
    if a.plot:
        plot(out, a.plot)
    return 1 if failed else 0


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, e in out["servers"].items():
        cs = [r["concurrency"] for r in e["levels"]]
        ax1.plot(cs, [r["aggregate_tok_s"] for r in e["levels"]], "o-", label=name)
        ax2.plot(cs, [r["ttft_p50_s"] for r in e["levels"]], "o-", label=name)
    for ax, yl in ((ax1, "aggregate tokens / s"), (ax2, "time to first token, p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(out["levels"], [str(c) for c in out["levels"]])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, greedy, max_tokens {out['max_tokens']}, {out['requests_per_level']} requests per level")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--requests", "-n", type=int, default=16)
    ap.add_argument("--concurrency", "-c", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=600.0, help="stop sending new requests after this many seconds")
    ap.add_argument("--multi-turn", type=int, default=0, metavar="K",
                    help="also measure turn-2 TTFT with/without the prompt cache over K conversations")
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--compare", action="store_true",
                    help="start mlxspec serve, mlxspec serve --max-batch 1 and mlx_lm.server in turn and compare them")
    ap.add_argument("--levels", default="1,2,4,8", help="--compare: concurrency levels (default 1,2,4,8)")
    ap.add_argument("--bounded", type=int, default=64,
                    help="--compare: then this many requests at the top level against mlxspec serve (0: skip)")
    ap.add_argument("--bounded-max-tokens", type=int, default=None,
                    help="--compare: max_tokens of the bounded run (default --max-tokens)")
    ap.add_argument("--max-batch", type=int, default=None, help="--compare: mlxspec serve's --max-batch")
    ap.add_argument("--mlx-lm-model", default=None, help="--compare: an MLX model directory for mlx_lm.server "
                    "(default: the packaged SmolLM2 converted to float32 under --workdir)")
    ap.add_argument("--workdir", default="/tmp/mlxspec-load", help="--compare: server logs and the converted model")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--compare: run every level this many times, alternating the servers' order each round; a "
                         "level reports its median round and the paired ratio to mlx_lm.server (median of rounds)")
    ap.add_argument("--cold", action="store_true",
                    help="--compare: new prompts at every level (no prompt-cache hits; no equality check, no bounded run)")
    ap.add_argument("--only", default=None, help="--compare: comma-separated server names to run")
    ap.add_argument("--plot", default=None, help="--compare: write a plot (PNG) here")
    a = ap.parse_args(argv)
    if a.compare:
        if not (1 <= a.requests <= 10_000 and 0 <= a.bounded <= 10_000):
            ap.error("--requests must be 1..10000 and --bounded 0..10000")
        if not 1 <= a.rounds <= 100:
            ap.error(f"--rounds must be 1..100, got {a.rounds}")
        return compare(a)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        ap.error("the load test only talks to a server on this machine (127.0.0.1 / localhost / ::1)")
    if not (1 <= a.requests <= 10_000 and 1 <= a.concurrency <= 256):
        ap.error("--requests must be 1..10000 and --concurrency 1..256")

    c = http.client.HTTPConnection(a.host, a.port, timeout=10)
    c.request("GET", "/health")
    model = json.loads(c.getresponse().read())["model"]
    c.close()

    results, errors, lock = [], [], threading.Lock()
    next_i = [0]
    t_start = time.perf_counter()

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= a.requests or time.perf_counter() - t_start > a.time_limit:
                    return
                next_i[0] += 1
            msgs = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" (request {i})"}]
            try:
                r = stream_chat(a.host, a.port, a.api_key, model, msgs, a.max_tokens, timeout=a.time_limit)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    ttft = [r["ttft"] for r in results]
    tot = [r["total"] for r in results]
    toks = sum(r["tokens"] for r in results)
    out = {
        "model": model, "requests": len(results) + len(errors), "concurrency": a.concurrency,
        "max_tokens": a.max_tokens, "errors": len(errors), "wall_s": wall,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
        "latency_p50_s": pct(tot, 0.5), "latency_p95_s": pct(tot, 0.95),
        "generated_tokens": toks, "tokens_per_s": toks / wall if wall > 0 else 0.0,
    }
    print(f"{out['requests']} requests at concurrency {a.concurrency}, max_tokens {a.max_tokens}: "
          f"{wall:.1f} s, errors {len(errors)}")
    print(f"  TTFT     p50 {out['ttft_p50_s']:.3f} s   p95 {out['ttft_p95_s']:.3f} s")
    print(f"  latency  p50 {out['latency_p50_s']:.3f} s   p95 {out['latency_p95_s']:.3f} s")
    print(f"  aggregate {toks} tokens, {out['tokens_per_s']:.2f} tokens/s")
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)

    if a.multi_turn:
        with_c, without_c, cached = [], [], []
        for k in range(a.multi_turn):
            # a long-ish first turn, so the prefix matters
            m1 = [{"role": "system", "content": "You are a careful assistant. " * 40},
                  {"role": "user", "content": PROMPTS[k % len(PROMPTS)] + f" (conversation {k})"}]
            r1 = stream_chat(a.host, a.port, a.api_key, model, m1, a.max_tokens)
            m2 = m1 + [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": "Now say it shorter."}]
            off = stream_chat(a.host, a.port, a.api_key, model, m2, 1, {"cache_prompt": False})
            on = stream_chat(a.host, a.port, a.api_key, model, m2, 1)
            without_c.append(off["ttft"])
            with_c.append(on["ttft"])
            cached.append(on["cached"])
        out.update({"turn2_ttft_with_cache_s": statistics.median(with_c),
                    "turn2_ttft_without_cache_s": statistics.median(without_c),
                    "turn2_cached_tokens": statistics.median(cached)})
        print(f"  turn-2 TTFT (median of {a.multi_turn}): with prompt cache {out['turn2_ttft_with_cache_s']:.3f} s "
              f"({out['turn2_cached_tokens']:.0f} tokens reused), without {out['turn2_ttft_without_cache_s']:.3f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
