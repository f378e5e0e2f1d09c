"""Budget curve: held-out tau against supervised blocks and against distinct tokens.

    python scripts/plot_budget.py --out docs/bench/budget-curve RUN_DIR_OR_REPORT [...]

Reads the `heldout` points that `mlxspec train --heldout-every N` records in a run's history
(`<run>/report.json`, or `<run>/ckpt/state.json` while it trains), writes
<out>.json (the points) and <out>.png (a panel per category against each budget, one line per run).
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

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    cats = ("code", "prose", "chat")
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharey="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (key, name) in enumerate((("supervised_blocks", "supervised blocks"),
                                       ("distinct_tokens", "distinct supervised tokens"))):
        for col, cat in enumerate(cats):
            ax = axes[row][col]
            for i, (lab, pts) in enumerate(data.items()):
                ax.plot([p[key] for p in pts], [p["heldout"][cat]["tau"] for p in pts], "-o", markersize=3,
                        color=colors[i % len(colors)], label=lab)
            ax.set_xscale("log")
            # labels at 1, 2, 3 and 5 x 10^k (matplotlib's default labels overlap on a short log axis)
            ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0e}".replace("e+0", "e")))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(name)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{cat}: held-out tau (greedy, full blocks)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * len(data), 1, 1))
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
