"""Held-out row-1 agreement and tau against CPU-minutes of training, one line per run.

    scripts/plot_learning.py eagle3=runs/e3-a/history.json --json docs/bench/learning-eagle3.json \
        --png docs/bench/learning.png [--data-minutes eagle3=46]

Each RUN=PATH is an `mlxspec train` history.json, state.json or report.json (any lineage); the held-out
points it recorded (`--heldout-every`) are drawn per category. --data-minutes adds the minutes its
data took (the x axis is then data + training). --ref LABEL=CODE,PROSE,CHAT draws a horizontal
reference tau (e.g. the shipped DSpark drafter's held-out tau). Errors: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CATS = ("code", "prose", "chat")


def points(path: Path) -> list[dict]:
    """The held-out points of an EAGLE-3 history (CPU minutes) or of a block trainer's
    report.json / checkpoint state.json (its CPU seconds where recorded; else wall seconds)."""
    h = json.loads(path.read_text())
    out = []
    for p in h.get("history", []):
        if "heldout" in p:
            if "minutes" not in p:
                p = {**p, "minutes": p.get("cpu_s", p.get("elapsed_s", 0.0)) / 60}
            out.append(p)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=HISTORY")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--data-minutes", action="append", default=[], metavar="LABEL=MIN")
    p.add_argument("--ref", action="append", default=[], metavar="LABEL=CODE,PROSE,CHAT")
    a = p.parse_args(argv)
    try:
        extra = {k: float(v) for k, v in (x.split("=", 1) for x in a.data_minutes)}
        refs = {k: [float(t) for t in v.split(",")] for k, v in (x.split("=", 1) for x in a.ref)}
        runs = {}
        for r in a.runs:
            label, _, path = r.partition("=")
            if not path or not Path(path).is_file():
                raise ValueError(f"{r!r}: pass LABEL=PATH to a history.json")
            runs[label] = points(Path(path))
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"plot_learning: error: {e}", file=sys.stderr)
        return 2
    out = {"runs": {}, "refs": refs}
    for label, pts in runs.items():
        off = extra.get(label, 0.0)
        out["runs"][label] = [{"minutes": off + q["minutes"], "step": q["step"],
                               **{f"{c}_{k}": q["heldout"][c][k] for c in CATS if c in q["heldout"]
                                  for k in ("tau", "row1")}} for q in pts]
        last = out["runs"][label][-1] if out["runs"][label] else None
        if last:
            print(f"{label}: {last['minutes']:.1f} min, " + ", ".join(
                f"{c} tau {last[f'{c}_tau']:.3f} row1 {last[f'{c}_row1']:.3f}" for c in CATS if f"{c}_tau" in last))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if a.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True)
        for j, c in enumerate(CATS):
            for label, pts in out["runs"].items():
                xs = [q["minutes"] for q in pts if f"{c}_tau" in q]
                axes[0, j].plot(xs, [q[f"{c}_row1"] for q in pts if f"{c}_tau" in q], "o-", label=label, ms=3)
                axes[1, j].plot(xs, [q[f"{c}_tau"] for q in pts if f"{c}_tau" in q], "o-", label=label, ms=3)
            for k, (rl, v) in enumerate(refs.items()):
                axes[1, j].axhline(v[j], ls="--", color=f"C{k + len(runs)}", label=rl)
            axes[0, j].set_title(c)
            axes[1, j].set_xlabel("CPU minutes (data + training)" if extra else "CPU minutes of training")
        axes[0, 0].set_ylabel("held-out row-1 agreement")
        axes[1, 0].set_ylabel("held-out tau (chains of up to 7)")
        axes[1, 2].legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
