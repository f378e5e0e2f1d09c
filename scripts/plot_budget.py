"""Budget curve: held-out tau against supervised blocks and against distinct tokens.

    python scripts/plot_budget.py --out docs/bench/budget-curve RUN_DIR_OR_REPORT [...]

Reads the `heldout` points that `mlxspec train --heldout-every N` records in a run's history
(`<run>/report.json`, or `<run>/ckpt/state.json` while it trains), writes
<out>.json (the points) and <out>.png (a panel per category against each budget, one line per run).

With `--goals code=1.8,...` each panel also shows the goal and two log-linear fits of tau on the
budget, extended to it: one over the whole curve and one over the points from `--recent-from`
blocks on (the latest segments). <out>.json gets a "fits" entry: each fit's slope (tau per 10x
budget) and the budget at which it reaches the goal (null where it never does): the answer to
"how much more compute" the curve can give, under the assumption that the fitted trend holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def points(src: Path) -> list[dict]:
    for f in (src, src / "report.json", src / "ckpt" / "state.json"):
        if f.is_file():
            hist = json.loads(f.read_text())["history"]
            return [h for h in hist if "heldout" in h]
    raise SystemExit(f"{src}: no report.json or ckpt/state.json with a history")


def log_fit(xs, ys, goal: float) -> dict:
    """tau = intercept + slope * log10(budget), least squares; where it reaches `goal`."""
    x, y = np.log10(np.asarray(xs, np.float64)), np.asarray(ys, np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return {"points": int(len(x)), "slope_per_10x": None, "intercept": None, "budget_at_goal": None}
    slope, icpt = np.polyfit(x, y, 1)
    at = float(10 ** ((goal - icpt) / slope)) if slope > 0 else None
    return {"points": int(len(x)), "slope_per_10x": float(slope), "intercept": float(icpt), "budget_at_goal": at,
            "budget_range": [float(10 ** x.min()), float(10 ** x.max())]}


def measured(p: dict, cat: str) -> bool:
    """The point has a held-out tau for this category (earlier points lack chat, stored as NaN)."""
    return np.isfinite(p["heldout"].get(cat, {}).get("tau", np.nan))


def fits(data: dict, goals: dict, recent_from: float) -> dict:
    """{budget key: {category: {goal, "whole curve": fit, "latest segments": fit | None}}}; the
    latest segments are the points from `recent_from` supervised blocks on."""
    out = {}
    for key in ("supervised_blocks", "distinct_tokens"):
        out[key] = {}
        for cat, goal in goals.items():
            kept = [p for run in data.values() for p in run if p[key] > 0 and measured(p, cat)]
            pts = [(p[key], p["heldout"][cat]["tau"]) for p in kept]
            recent = [(p[key], p["heldout"][cat]["tau"]) for p in kept if p["supervised_blocks"] >= recent_from]
            out[key][cat] = {"goal": goal, "latest_from_blocks": recent_from, "whole curve": log_fit(*zip(*pts), goal),
                             "latest segments": log_fit(*zip(*recent), goal) if recent else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", action="append", default=None, help="one per run (default: the directory name)")
    ap.add_argument("--prior", action="append", default=None,
                    help="BLOCKS:TOKENS already behind a run's start (its --init-from drafter), one per run")
    ap.add_argument("--extra", default=None,
                    help="JSON {label: [{supervised_blocks, distinct_tokens, heldout: {cat: {tau}}}]}: earlier runs")
    ap.add_argument("--goals", default=None, help="CATEGORY=TAU,...: draw the goals and fit the curve to them")
    ap.add_argument("--recent-from", type=float, default=1.9e5,
                    help="the second fit takes the points from this many supervised blocks on")
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
    goals = {c: float(v) for c, v in (g.split("=") for g in a.goals.split(","))} if a.goals else {}
    fitted = fits(data, goals, a.recent_from) if goals else {}
    out.with_suffix(".json").write_text(json.dumps({**data, "fits": fitted} if fitted else data, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    cats = ("code", "prose", "chat")
    fig, axes = plt.subplots(2, 3, figsize=(13, 8), sharey="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (key, name) in enumerate((("supervised_blocks", "supervised blocks"),
                                       ("distinct_tokens", "distinct supervised tokens"))):
        for col, cat in enumerate(cats):
            ax = axes[row][col]
            for i, (lab, pts) in enumerate(data.items()):
                pts = [p for p in pts if measured(p, cat)]
                ax.plot([p[key] for p in pts], [p["heldout"][cat]["tau"] for p in pts], "-o", markersize=3,
                        color=colors[i % len(colors)], label=lab)
            if cat in goals:
                f = fitted[key][cat]
                ax.axhline(goals[cat], color="k", ls=":", lw=1)
                ax.annotate(f"goal {goals[cat]}", (0.02, goals[cat]), xycoords=("axes fraction", "data"),
                            va="bottom", fontsize=8)
                notes = []
                for style, fit_name in (("--", "whole curve"), ("-.", "latest segments")):
                    fit = f[fit_name]
                    if not fit or fit["slope_per_10x"] is None:
                        continue
                    if style == "-." and fit["points"] == f["whole curve"]["points"]:
                        continue  # the same points: the same line
                    lo, hi = fit["budget_range"]
                    at = fit["budget_at_goal"]
                    xs = np.geomspace(lo, max(hi, min(at or hi, hi * 1e3)), 50)
                    ax.plot(xs, fit["intercept"] + fit["slope_per_10x"] * np.log10(xs), style, color="grey", lw=1,
                            label=f"log-linear fit: {fit_name}")
                    notes.append(f"{fit_name}: {fit['slope_per_10x']:+.2f} per 10x, " +
                                 (f"goal at {at:.0e}" if at and at < 1e12 else "goal never / beyond 1e12"))
                ax.text(0.98, 0.03, "\n".join(notes), transform=ax.transAxes, ha="right", va="bottom", fontsize=7,
                        color="dimgrey", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
            ax.set_xscale("log")
            # labels at 1, 2, 3 and 5 x 10^k (matplotlib's default labels overlap on a short log axis)
            lo, hi = ax.get_xlim()
            ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5) if hi / lo < 30 else (1,)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0e}".replace("e+0", "e")))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(name)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{cat}: held-out tau (greedy, full blocks)")
    handles = axes[0][0].get_legend_handles_labels()
    fig.legend(*handles, loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.035 * len(handles[0]), 1, 1))
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
