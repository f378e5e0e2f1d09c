"""Training throughput in supervised blocks per second (issue 22), one configuration per run.

    scripts/bench_train.py --data runs/corpus-smollm2 --steps 12 --out docs/bench/train-throughput.json \
        --config dense:anchors=0 --config a64:anchors=64 --config a16:anchors=16 --config dense-b4:anchors=0,block=4

Each configuration trains the shipped SmolLM2 DSpark recipe (1 layer, draft vocabulary 8192)
from scratch for --steps steps on the same store; the first 2 steps (graph build, compile) are
left out and the median step time of the rest is reported. `--code-root DIR` imports mlxspec
from another checkout (e.g. a `git worktree` of an older commit) to measure "before".
Run it with OPENBLAS_NUM_THREADS=1 for the one-thread figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--config", action="append", required=True, help="NAME:anchors=N,block=B,seqs=S,compile=0|1")
    ap.add_argument("--code-root", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.code_root:
        sys.path.insert(0, a.code_root)
    import mlx.core as mx
    import numpy as np

    import mlxspec
    from mlxspec.targets.load import load_target
    from mlxspec.train import trainer as tr

    target, _ = load_target(None)
    rows = []
    for spec in a.config:
        name, _, kv = spec.partition(":")
        opts = dict(x.split("=") for x in kv.split(",") if x)
        anchors = int(opts.get("anchors", 0))
        tc = tr.TrainConfig(steps=a.steps, anchors_per_seq=anchors, block_size=int(opts.get("block", 8)),
                            seqs_per_step=int(opts.get("seqs", 4)), checkpoint_every=10**9)
        if "compile" in opts and hasattr(tc, "compile"):
            tc.compile = opts["compile"] == "1"
        times = []
        orig_eval = mx.eval

        def timed_eval(*args, **kw):  # the trainer evaluates once per step
            orig_eval(*args, **kw)
            times.append(time.perf_counter())

        tr.mx.eval = timed_eval
        try:
            with tempfile.TemporaryDirectory() as d:
                _, _, info = tr.train(target, a.data, d, tc, resume=False, log=lambda *x: None, force=True)
        finally:
            tr.mx.eval = orig_eval
        dt = np.diff(times)[2:]
        step_s = float(np.median(dt))
        L = 256
        blocks = tc.seqs_per_step * (anchors if anchors else L - tc.block_size - 2)
        hist = info["history"]
        measured = hist[-1].get("supervised_blocks")
        if measured:  # dense: windows can have fewer valid anchors than K
            blocks = measured / (hist[-1]["step"] + 1)
        row = {"config": name, "anchors_per_window": anchors or "all", "block_size": tc.block_size,
               "seqs_per_step": tc.seqs_per_step, "compile": getattr(tc, "compile", False),
               "median_step_s": step_s, "supervised_blocks_per_step": blocks,
               "blocks_per_s": blocks / step_s, "code": mlxspec.__file__}
        rows.append(row)
        print(f"{name}: {step_s:.3f} s/step, {blocks:.0f} blocks/step -> {blocks / step_s:.0f} blocks/s", flush=True)
    if a.out:
        p = Path(a.out)
        old = json.loads(p.read_text()) if p.exists() else []
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(old + [{"command": " ".join(sys.argv), "rows": rows}], indent=1))


if __name__ == "__main__":
    main()
