"""Budget curve: held-out tau against supervised blocks and against distinct tokens.

    python scripts/plot_budget.py --out docs/bench/budget-curve RUN_DIR_OR_REPORT [...]

Reads the `heldout` points that `mlxspec train --heldout-every N` records in a run's history
(`<run>/report.json`, or `<run>/ckpt/state.json` while it trains), writes
<out>.json (the points) and <out>.png (two panels, one line per category and run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(src: Path) -> list[dict]:
    for f in (src, src / "report.json", src / "ckpt" / "state.json"):
        if f.is_file():
            hist = json.loads(f.read_text())["history"]
            return [h for h in hist if "heldout" in h]
    raise SystemExit(f"{src}: no report.json or ckpt/state.json with a history")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", action="append", default=None, help="one per run (default: the directory name)")
    ap.add_argument("--prior", action="append", default=None,
                    help="BLOCKS:TOKENS already behind a run's start (its --init-from drafter), one per run")
    ap.add_argument("--extra", default=None,
                    help="JSON {label: [{supervised_blocks, distinct_tokens, heldout: {cat: {tau}}}]}: earlier runs")
    a = ap.parse_args()
    labels = a.label or [Path(r).name for r in a.runs]
    data = {lab: points(Path(r)) for lab, r in zip(labels, a.runs)}
    for (lab, pts), pr in zip(list(data.items()), a.prior or []):
        b0, t0 = (float(x) for x in pr.split(":"))
        data[lab] = [{**p, "supervised_blocks": p["supervised_blocks"] + b0, "distinct_tokens": p["distinct_tokens"] + t0}
                     for p in pts]
    if a.extra:
        data.update(json.loads(Path(a.extra).read_text()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, name in ((axes[0], "supervised_blocks", "supervised blocks"),
                          (axes[1], "distinct_tokens", "distinct supervised tokens")):
        for lab, pts in data.items():
            for cat, style in (("code", "-o"), ("prose", "-s"), ("chat", "-^")):
                xs = [p[key] for p in pts]
                ys = [p["heldout"][cat]["tau"] for p in pts]
                ax.plot(xs, ys, style, label=f"{lab} {cat}", markersize=4)
        ax.set_xlabel(name)
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out tau (greedy, full blocks)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
