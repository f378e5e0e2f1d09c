#!/usr/bin/env python3
"""Bounded load test of suffix drafting across requests (`serve --lookup suffix`), per API key.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/suffix_load_test.py --requests 1000 \\
        --json docs/bench/suffix_load.json

It starts the servers itself, on free loopback ports, and checks what a multi-tenant deployment
must hold (counts, not time):

1. Isolation (`--api-key k1,k2`, one suffix index per key; suffix drafting alone, `--spec-type
   ngram --num-draft-tokens 8`, a fixed length, so that the counts are exact): for each of a few
   prompts, key 1 asks it, then key 2 asks it, then key 1 again.
   Key 2's accepted draft tokens must equal key 1's first ask (key 1's answer reached key 2's
   drafts not at all), and key 1's second ask must accept more (its own answer did).
2. Sharing (`--suffix-share-keys`): the same sequence; key 2 must now accept more than key 1's
   first ask.
3. Load, on the isolating server: --requests greedy streaming requests, at most --concurrency at
   a time, the keys alternating, drawn (with repeats, as an agent's turns repeat) from a pool of
   --prompts prompts whose concurrency-1 answers were taken first. Every response must equal its
   prompt's concurrency-1 answer, with 0 errors, and the fullest suffix index (/metrics, polled
   every second) must stay within --suffix-budget tokens the whole time.

Exit code 0 when every check holds, 1 otherwise. Writes the JSON (--json).
"""

from __future__ import annotations

import argparse
import http.client
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import PROMPTS, _free_port, _wait_up, stream_chat  # noqa: E402

TOPICS = ["a stack", "a queue", "binary search", "recursion", "a closure", "a generator", "a decorator", "unicode",
          "a mutex", "a hash map", "garbage collection", "a linked list", "an iterator", "a context manager"]
FORMS = ["Explain {t} in two sentences.", "Write a short Python example of {t}.", "What is {t} used for?"]


def pool(n: int) -> list[str]:
    out = list(PROMPTS) + [f.format(t=t) for t in TOPICS for f in FORMS]
    return out[:n]


def metric(port: int, name: str) -> float | None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics", headers={"Authorization": "Bearer k1"})
    body = c.getresponse().read().decode()
    c.close()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def start(a, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxspec.cli", "serve", "--port", str(port), "--lookup", "suffix",
           "--suffix-budget", str(a.suffix_budget), "--api-key", "k1,k2", "--max-queue", str(4 * a.concurrency + 8),
           *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    MODEL[port] = _wait_up(proc, port, log).get("model")
    return proc


MODEL: dict[int, str] = {}  # port -> the model id its server answers to


def ask(port, key, prompt, max_tokens) -> dict:
    return stream_chat("127.0.0.1", port, key, MODEL[port], [{"role": "user", "content": prompt}], max_tokens)


def tenancy(a, share: bool, log: Path) -> dict:
    """Steps 1 and 2 on a fresh server: per prompt, key 1's first ask, key 2's, key 1's second."""
    port = _free_port()
    proc = start(a, port, ["--spec-type", "ngram", "--num-draft-tokens", "8", "--max-batch", "1"] + (["--suffix-share-keys"] if share else []),
                 log)
    try:
        rows = []
        for q in pool(a.prompts)[: a.tenancy_prompts]:
            first = ask(port, "k1", q, a.max_tokens)
            other = ask(port, "k2", q, a.max_tokens)
            again = ask(port, "k1", q, a.max_tokens)
            rows.append({"prompt": q, "k1_first": first["accepted"], "k2_after": other["accepted"],
                         "k1_again": again["accepted"], "same_text": first["text"] == other["text"] == again["text"]})
    finally:
        proc.terminate()
        proc.wait(30)
    return {"share_keys": share, "rows": rows}


def load(a, log: Path) -> dict:
    port = _free_port()
    proc = start(a, port, [], log)
    budget_seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            try:
                v = metric(port, "mlxspec_suffix_index_max_tokens")
                if v is not None:
                    budget_seen.append(v)
            except OSError:
                pass
            stop.wait(1.0)

    try:
        prompts = pool(a.prompts)
        ref = {}
        for i, q in enumerate(prompts):  # the concurrency-1 answers (they also warm both keys' indexes)
            ref[q] = ask(port, "k1" if i % 2 else "k2", q, a.max_tokens)["text"]
        rng = random.Random(0)
        seq = [rng.choice(prompts) for _ in range(a.requests)]
        keys = ["k1" if i % 2 else "k2" for i in range(a.requests)]
        th = threading.Thread(target=poll, daemon=True)
        th.start()
        results, errors, lock, nxt = [None] * a.requests, [], threading.Lock(), [0]
        t0 = time.perf_counter()
        done_bar = [0]

        def worker():
            while True:
                with lock:
                    i = nxt[0]
                    if i >= a.requests:
                        return
                    nxt[0] += 1
                try:
                    results[i] = ask(port, keys[i], seq[i], a.max_tokens)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    with lock:
                        errors.append(repr(e))
                with lock:
                    done_bar[0] += 1
                    n = done_bar[0]
                if n % 25 == 0 or n == a.requests:
                    el = time.perf_counter() - t0
                    print(f"\rload {n}/{a.requests} {el:.0f}s eta {el / n * (a.requests - n):.0f}s", end="",
                          file=sys.stderr, flush=True)

        threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        print(file=sys.stderr)
        stop.set()
        budget_seen.append(metric(port, "mlxspec_suffix_index_max_tokens") or 0.0)
        done = [(q, r) for q, r in zip(seq, results) if r is not None]
        mism = [q for q, r in done if r["text"] != ref[q]]
        toks = sum(r["tokens"] for _, r in done)
        return {"requests": a.requests, "concurrency": a.concurrency, "completed": len(done), "errors": len(errors),
                "error_samples": errors[:3], "not_equal_to_concurrency_1": len(mism), "mismatch_samples": mism[:3],
                "wall_s": wall, "generated_tokens": toks, "aggregate_tok_s": toks / wall,
                "accepted_tokens": sum(r["accepted"] for _, r in done),
                "accepted_per_request_first_10": [r["accepted"] for _, r in done[:10]],
                "suffix_budget": a.suffix_budget, "index_max_tokens_seen": max(budget_seen),
                "index_samples": len(budget_seen),
                "indexes": metric(port, "mlxspec_suffix_indexes")}
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=40, help="distinct prompts the load draws from")
    ap.add_argument("--tenancy-prompts", type=int, default=4)
    ap.add_argument("--suffix-budget", type=int, default=2048, help="tokens per suffix index (small: evictions happen)")
    ap.add_argument("--workdir", default="/tmp/mlxspec-suffix-load")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens", "prompts", "suffix_budget"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = {"command": "scripts/suffix_load_test.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out["isolated"] = tenancy(a, False, work / "isolated.log")
    out["shared"] = tenancy(a, True, work / "shared.log")
    out["load"] = load(a, work / "load.log")
    iso, sh, ld = out["isolated"]["rows"], out["shared"]["rows"], out["load"]
    checks = {
        "other key's text never helps (isolated: k2 == k1 first)": all(r["k2_after"] == r["k1_first"] for r in iso),
        "own text helps (k1 again: more accepted in all)": sum(r["k1_again"] for r in iso) > sum(r["k1_first"] for r in iso)
        and all(r["k1_again"] >= r["k1_first"] for r in iso),
        "shared keys help each other (k2: more accepted in all)": sum(r["k2_after"] for r in sh) > sum(r["k1_first"] for r in sh)
        and all(r["k2_after"] >= r["k1_first"] for r in sh),
        "answers equal whoever asks": all(r["same_text"] for r in iso + sh),
        "0 errors": ld["errors"] == 0 and ld["completed"] == ld["requests"],
        "every response equals its concurrency-1 answer": ld["not_equal_to_concurrency_1"] == 0,
        "index within budget": ld["index_max_tokens_seen"] <= a.suffix_budget,
    }
    out["checks"] = checks
    for k, v in checks.items():
        print(f"{'PASS' if v else 'FAIL'}  {k}")
    print(f"load: {ld['completed']}/{ld['requests']} in {ld['wall_s']:.0f} s, {ld['aggregate_tok_s']:.1f} tok/s, "
          f"fullest index {ld['index_max_tokens_seen']:.0f} of {a.suffix_budget} tokens")
    from mlxspec.bench.report import write_json

    write_json(a.json, out)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
