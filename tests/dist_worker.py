"""Run by every rank of an mlx.launch job in tests/test_distributed.py (or by hand):

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 -- python tests/dist_worker.py JOB.json

JOB: {"runs": [{"model": path|null, "draft": path|"auto"|null, "mode": "auto", "check": true,
                "timeout": 60, "cases": [{"prompt": [ids], "max_tokens": 24, "temp": 0.0,
                                          "top_p": 1.0, "seed": 0, "progress": false}]}]}
Every run loads its target on every rank and shards it; rank 0 generates, the others serve.
Rank 0 prints one line `RESULT {"runs": [{"mode": ..., "cases": [{"tokens": [...], ...}]}]}`.
"""

import json
import os
import sys

from mlxspec import api, distributed
from mlxspec.errors import MlxspecError


def run_one(run: dict) -> dict | None:
    shard = distributed.Sharding(mode=run.get("mode", "auto"), check=run.get("check", False),
                                 timeout=run.get("timeout", 60))
    target, tok, spec = api.load(run.get("model"), run.get("draft"), spec_type=run.get("spec_type", "auto"),
                                 shard=shard, **run.get("spec_kw", {}))
    if target.rank != 0:
        target.serve()
        return None
    out = []
    with target:
        for c in run["cases"]:
            toks, last = [], None
            for r in api.stream_generate(target, tok, c["prompt"], spec, max_tokens=c.get("max_tokens", 24), temp=c.get("temp", 0.0),
                                         top_p=c.get("top_p", 1.0), top_k=0, seed=c.get("seed", 0)):
                toks.append(r.token)
                last = r
                if c.get("progress"):
                    print(f"TOKEN {len(toks)}", flush=True)
            s = last.stats
            out.append({"tokens": toks, "accepted": s.accepted, "drafted": s.drafted, "forwards": s.target_forwards})
    return {"cases": out, "mode": target.mode, "describe": target.describe(), "footer": distributed.footer(target)}


def main(job_path) -> int:
    job = json.load(open(job_path))
    print(f"PID {os.environ.get('MLX_RANK', '0')} {os.getpid()}", file=sys.stderr, flush=True)
    runs = [run_one(r) for r in job["runs"]]
    if runs and runs[0] is not None:
        print("RESULT " + json.dumps({"runs": runs}), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1]))
    except MlxspecError as e:
        print(f"mlxspec: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
