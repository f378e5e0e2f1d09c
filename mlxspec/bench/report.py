"""Bench results as Markdown (stdout) and PNG plots (with the optional matplotlib)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxspec.bench.summary import Row
from mlxspec.cache import hub_repo_of


def write_json(path, obj, indent: int = 1) -> None:
    """A result people compare (a script's --json), indented, its folder made; None: nothing."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=indent) + "\n")


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _xar(r: Row) -> str:
    """x AR with its 95% paired-bootstrap interval over the prompts, where there is one."""
    ci = r.ratio_interval
    return _f(r.ratio_vs_mlxspec_ar) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def markdown(rows: list[Row], meta, s, ms, context) -> str:
    temps = s["temps"]
    L_max = max(ms)
    out = [
        "## mlxspec bench",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Target `{hub_repo_of(meta['model']) or Path(meta['model']).name}` (mlxspec: {meta['target_compute']}; mlx_lm: `{meta['mlx_lm_dir']}`). "
        f"Prompts: {', '.join(f'{c} {len(v)}' for c, v in meta['prompt_tokens'].items())}; "
        f"max {s['max_tokens']} tokens{' (EOS ignored)' if meta['ignore_eos'] else ', stop at EOS'}; "
        f"{s['repeats']} repeat(s); temps {', '.join(f'{t:g}' for t in temps)}; seed {s['seed']}.",
        f"Machine: {meta['platform']}, {meta['cpus']} CPUs, device {meta['device']}, {meta['blas'] or 'BLAS: default'}"
        f"{'; ' + str(meta['background_load']) + ' core(s) kept busy (--background-load)' if meta.get('background_load') else ''}; "
        f"mlx {meta['mlx']}, mlx_lm {meta['mlx_lm']}; {meta['date']}.",
        f"Target forward at context {context}: 1 token {ms[1]:.2f} ms"
        + (f", {L_max} tokens {ms[L_max]:.2f} ms ({ms[L_max] / ms[1]:.2f}x)." if L_max > 1 else "."),
        "",
        "tok/s: generation only (prefill excluded), median over repeats, mean over prompts. "
        "x AR: over mlxspec AR, [95% interval: a paired bootstrap over the prompts]. ideal = tau * t(1) / t(mean verify length); eff = x AR / ideal. "
        "drafter: the drafter's share of the accepted drafts (prompt lookup's is the rest).",
        "",
        "| T | configuration | tok/s | x AR | tau | accept | drafter | verify len | ideal | eff | draft / verify | peak MiB | "
        "greedy = AR |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in (r for r in rows if r.category == "all"):
        share = (f"{100 * r.draft_share:.0f}% / {100 * r.verify_share:.0f}%"
                 if r.draft_share is not None and r.acceptance_rate is not None else "–")
        same = f"{r.same_tokens_as_ar[0]}/{r.same_tokens_as_ar[1]}" if r.same_tokens_as_ar is not None else "–"
        out.append(
            f"| {r.temp:g} | {r.configuration} | {_f(r.tokens_per_s, '{:.1f}')} | "
            f"{_xar(r)} | {_f(r.tau)} | {_f(r.acceptance_rate, '{:.1%}')} | "
            f"{_f(r.drafter_accepted_share, '{:.0%}')} | {_f(r.mean_verify_length)} | {_f(r.ideal_speedup)} | {_f(r.efficiency, '{:.0%}')} | "
            f"{share} | {r.peak_memory_mb:.0f} | {same} |")
    out += ["", "By category:", "",
            "| T | configuration | category | tok/s | x AR | tau | accept | eff | drafter |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r.category != "all"):
        out.append(f"| {r.temp:g} | {r.configuration} | {r.category} | {_f(r.tokens_per_s, '{:.1f}')} | "
                   f"{_xar(r)} | {_f(r.tau)} | {_f(r.acceptance_rate, '{:.1%}')} | "
                   f"{_f(r.efficiency, '{:.0%}')} | {_f(r.drafter_accepted_share, '{:.0%}')} |")
    spec_rows = [r for r in rows if r.category == "all" and r.acceptance_rate is not None]
    if spec_rows:
        n = max(len(r.per_position_acceptance) for r in spec_rows)
        out += ["", "Per-position acceptance (all categories): at position k, the share of the steps that drafted "
                    "k or more tokens whose first k drafts were all accepted.", "",
                "| T | configuration | " + " | ".join(str(i + 1) for i in range(n)) + " |",
                "|---|---|" + "---:|" * n]
        for r in spec_rows:
            ppa = r.per_position_acceptance + [None] * (n - len(r.per_position_acceptance))
            out.append(f"| {r.temp:g} | {r.configuration} | " + " | ".join(_f(x) for x in ppa) + " |")
    return "\n".join(out)


def _save(fig, ax, out: Path, name: str) -> str:
    """Legend outside the axes, write the PNG, free the figure; -> the file name."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def write_plots(rows: list[Row], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; plots skipped (pip install 'mlxspec[plot]')", file=sys.stderr)
        return []
    written = []
    allr = [r for r in rows if r.category == "all"]
    temps = sorted({r.temp for r in rows})
    labels = list(dict.fromkeys(r.configuration for r in rows))
    width = 0.8 / len(temps)

    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels) + 3), 4.5))
    for j, t in enumerate(temps):
        xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(labels))]
        rs = [next(r for r in allr if r.configuration == lab and r.temp == t) for lab in labels]
        ax.bar(xs, [r.ratio_vs_mlxspec_ar or 0 for r in rs], width, label=f"T={t:g} measured")
        ideal = [(x, r.ideal_speedup) for x, r in zip(xs, rs) if r.ideal_speedup]
        if ideal:
            ax.scatter(*zip(*ideal), marker="_", s=400, color="black", label="ideal" if j == 0 else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s relative to mlxspec AR")
    ax.set_title("Speedup per configuration (all categories)")
    written.append(_save(fig, ax, out, "speedup.png"))

    spec = [r for r in allr if r.acceptance_rate is not None]
    if spec:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for r in spec:
            ppa = r.per_position_acceptance
            ax.plot(range(1, len(ppa) + 1), ppa, marker="o", label=f"{r.configuration} T={r.temp:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance (accepted / drafted)")
        ax.set_ylim(0, 1.02)
        ax.set_title("Per-position acceptance")
        written.append(_save(fig, ax, out, "acceptance.png"))

        cats = list(dict.fromkeys(r.category for r in rows))
        keys = [(r.configuration, r.temp) for r in spec]
        w = 0.8 / len(keys)
        fig, ax = plt.subplots(figsize=(max(8, 1.5 * len(cats) + 3), 4.5))
        for j, (lab, t) in enumerate(keys):
            taus = [next(r.tau for r in rows if r.configuration == lab and r.temp == t and r.category == c)
                    for c in cats]
            ax.bar([i + (j - (len(keys) - 1) / 2) * w for i in range(len(cats))], taus, w, label=f"{lab} T={t:g}")
        ax.set_xticks(range(len(cats)), cats)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("tau (tokens per target forward)")
        ax.set_title("tau by prompt category")
        written.append(_save(fig, ax, out, "tau_by_category.png"))
    return written
