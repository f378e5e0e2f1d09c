#!/usr/bin/env python
"""Two EAGLE-3 training runs' held-out curves side by side, at equal CPU-minutes.

Each run is a training directory (its history.json, written as `mlxspec train` goes) or a shipped
drafter (its report.json). Prints a markdown table (run A's points, with run B's nearest point
beside each) and, with --json, writes run A's history with the command and stores that made it:

    python scripts/compare_history.py runs/e3m-half mlxspec/weights/smollm2-135m-eagle3 \\
        --command "mlxspec train --lineage eagle3 ... --out runs/e3m-half" --stores "runs/e3m-a (seed 0)" \\
        --minutes 90 --json docs/bench/x.json
"""

import argparse
import json
import sys
from pathlib import Path

CATS = ("code", "prose", "chat")


def fail(msg: str):
    print(f"compare_history.py: {msg}", file=sys.stderr)
    sys.exit(2)


def history(path: str) -> tuple[dict, list[dict]]:
    """-> (the file's JSON, its held-out points), from a run directory or a shipped drafter."""
    p = Path(path)
    for name in ("history.json", "report.json"):
        if (p / name).is_file():
            try:
                doc = json.loads((p / name).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                fail(f"{p / name} is not JSON ({e}); let the run write it again (it rewrites it at every held-out point)")
            return doc, [e for e in doc.get("history", []) if "heldout" in e]
    fail(f"{path} holds neither history.json nor report.json; pass a training --out directory or a "
         "shipped drafter's directory")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the run to report")
    ap.add_argument("b", help="the run to set beside it")
    ap.add_argument("--command", default="", help="the command that trained run A (kept in --json)")
    ap.add_argument("--stores", default="", help="the stores run A trained on, in words (kept in --json)")
    ap.add_argument("--minutes", type=float, default=None, help="run A's budget: marks the JSON complete")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    doc_a, ha = history(a.a)
    _, hb = history(a.b)
    if not ha or not hb:
        fail("a run has no held-out points yet; train with --heldout-every")

    def cell(h, c):
        return f"{h[c]['tau']:.3f} ({h[c]['row1']:.3f})"

    print(f"| CPU-minutes | steps (B) | code tau (row 1) | prose tau (row 1) | chat tau (row 1) | B at that minute: "
          f"{' / '.join(CATS)} tau |")
    print("|---|---|---|---|---|---|")
    for e in ha:
        o = min(hb, key=lambda x: abs(x["minutes"] - e["minutes"]))
        print(f"| {e['minutes']:.1f} | {e['step']} ({o['step']}) | "
              + " | ".join(cell(e["heldout"], c) for c in CATS) + " | "
              + " / ".join(f"{o['heldout'][c]['tau']:.3f}" for c in CATS) + " |")
    if a.json:
        done = a.minutes is not None and ha[-1]["minutes"] >= a.minutes - 0.1
        out = {"command": a.command, "stores": a.stores, "complete": done, **doc_a}
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
