"""`mlxspec serve`'s flags (importable without the server's own dependencies)."""

from __future__ import annotations

import argparse
import os

from mlxspec.args import add_model_args, add_sampling_args


def add_serve_args(p):
    add_model_args(p)
    add_sampling_args(p)  # the defaults of requests that leave a field out (as `generate`'s)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=os.environ.get("MLXSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $MLXSPEC_API_KEY, else no key); several keys "
                        "separated by commas: each key's requests draft (--lookup suffix) only from that key's earlier ones")
    p.add_argument("--suffix-share-keys", action="store_true",
                   help="--lookup suffix: one suffix index for all API keys (default: one per key, so that no key's "
                        "speed depends on what another key's requests said)")
    p.add_argument("--suffix-cache", default=None, metavar="PATH",
                   help="--lookup suffix: keep the suffix indexes in this file across restarts (loaded at start, "
                        "saved atomically at shutdown and every --suffix-cache-every seconds); without it they are "
                        "never written to disk")
    p.add_argument("--suffix-cache-every", type=float, default=60.0, metavar="SECONDS",
                   help="--suffix-cache: save it this often while requests have finished since the last save, so "
                        "a crash loses at most that much (default 60; 0: at shutdown only)")
    p.add_argument("--model-id", default=None, help="the name clients send as 'model' (default: the model file's stem)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=_size("1G"),
                   help="memory for cached prompt prefixes (KV cache + drafter context), LRU; 0 disables (default 1G)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting or running before 429 (default 16)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests generated together, speculating in one batched verify per step (continuous "
                        "batching; default 8 on 2+ cores); 1 runs one request at a time")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request time limit in seconds (default 600)")
    p.add_argument("--max-body-bytes", type=_size, default=_size("4M"), help="largest request body (default 4M)")
    p.add_argument("--max-tokens-limit", type=int, default=8192, help="largest max_tokens a request may ask (default 8192)")


def _size(s) -> int:
    s = str(s).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if s and s[-1] in mult:
            return int(float(s[:-1]) * mult[s[-1]])
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 1G, got {s!r}") from None
