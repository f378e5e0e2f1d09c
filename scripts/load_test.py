#!/usr/bin/env python3
"""Load test for a running `mlxspec serve` (loopback only; not a timed test).

    scripts/load_test.py --port 8080 --requests 16 --concurrency 4 --max-tokens 32

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
import statistics
import sys
import threading
import time

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
            "text": text, "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


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
    a = ap.parse_args(argv)
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
