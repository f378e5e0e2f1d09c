#!/usr/bin/env python
"""Seeded fuzz run of mlxspec's hostile-input promises; prints a verdict table.

    LD_PRELOAD=$(.venv/bin/python -m mlxspec.blas) .venv/bin/python scripts/fuzz.py --cases 500 --seed 1

Every case must end as a one-line error with exit 2 ("error"), or a normal run whose output
equals the uncorrupted baseline ("same"; "ok" for valid flag values). Any other verdict
(traceback, crash, hang, oom, wrong, accepted, refused, bad-error, bad-exit) is listed and
makes the exit status 1. A case that names its cause must be refused naming it ("misleading"
otherwise). Every run includes the generated classes of issue 25 (non-UTF-8 text in every
text input, every output path under every bad parent, GGUF drafter tensor types, the
misleading-message configs). Cases and mechanics: tests/fuzz_harness.py.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fuzz_harness as fh  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=fh.CASE_LIMIT_S, help="seconds per case")
    ap.add_argument("--verbose", "-v", action="store_true", help="one line per case")
    ap.add_argument("--group", action="append", default=None,
                    help="run only this group of cases (repeatable): gguf-target, gguf-drafter, gguf-types, "
                         "hf-drafter, hf-target, raw-target, raw-drafter, inspect, flags, text, outputs, messages, "
                         "api, files")
    a = ap.parse_args()
    if a.cases < 1 or a.seed < 0:
        ap.error("--cases must be >= 1 and --seed >= 0")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="mlxspec-fuzz-") as d:
        results, _ = fh.run_cases(a.cases, a.seed, d, log=sys.stdout if a.verbose else None, limit_s=a.limit,
                                  groups=a.group)
    print(f"\nmlxspec fuzz: {len(results)} cases, seed {a.seed}, {time.time() - t0:.0f} s")
    print(fh.verdict_table(results))
    bad = [(c, v, dt) for c, v, dt, _ in results if v not in fh.GOOD]
    for c, v, dt in bad:
        print(f"FAIL {v:10s} {c.group:12s} {c.id}: {c.desc} -> {dt[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
