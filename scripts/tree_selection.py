"""How much of a fixed tree's tau is lost in choosing its nodes, not in drafting them.

    LD_PRELOAD=$(python -m mlxspec.blas) python scripts/tree_selection.py --categories chat --prompts 8 \\
        --max-tokens 128 --width 4 --json docs/bench/tree-selection-chat-2026-12-06.json

Runs the default's drafter (EAGLE-3 with prompt lookup's continuations merged in) with a fixed
tree of --nodes nodes, greedy, and records every step's whole candidate tree before the nodes
are chosen (what the drafter and the lookup proposed, with each node's score, class and raw
conditional), and the target's answer (the same in every configuration: greedy output is the
target's). Then, offline, the accepted length of each step under other choices of --nodes nodes
from the same candidates:
- `live`: the engine's choice (calibrated scores, best first);
- `calibrated in sample`: scores from the hit rate per (source, class, depth, conditional bin)
  measured on these very steps: optimistic (fitted and scored on the same data);
- `calibrated out of sample`: the same table fitted on the other half of the prompts (2-fold):
  what a scorer that learned those rates beforehand would get;
- `knowing the answer`: the deepest right path among the candidates, cut at --nodes: the
  ceiling of any choice from these candidates (not reachable: it reads the answer).
tau = 1 + mean accepted length per step (the replayed steps: the bonus token included).
"""

from __future__ import annotations

import argparse
import collections
import sys

BINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def accepted(nodes: list[tuple], score: list[float], budget: int, truth: list[int]) -> int:
    """Tokens of `truth` accepted when the engine keeps the `budget` best nodes by `score`
    (`DraftTree.ranked` and `select`, then `accept_greedy` with the answer as the target's argmax).
    nodes: (parent, token, score, depth, source, ...) in the recorded tree's order, root first."""
    from mlxspec.engine.tree import DraftTree, TreeNode, accept_greedy

    tree = DraftTree(nodes[0][1])
    tree.nodes = [TreeNode(n[1], n[0], n[3], s, n[4] or "root") for n, s in zip(nodes, score)]
    for i, n in enumerate(tree.nodes[1:], 1):
        tree.nodes[n.parent].kids.append(i)
    kept = tree.select(budget)
    path, _ = accept_greedy(kept, [truth[n.depth] if n.depth < len(truth) else -1 for n in kept.nodes])
    return len(path) - 1


def cls_key(node: tuple) -> tuple:
    _parent, _tok, _score, depth, source, cls, cond = node
    b = next(j for j in range(len(BINS) - 1) if cond < BINS[j + 1])
    return source, cls.split("/")[-1], min(depth, 3), b


def on_truth(nodes: list[tuple], truth: list[int]) -> set:
    on = {0}
    for i in range(1, len(nodes)):
        parent, tok, _s, depth = nodes[i][:4]
        if parent in on and depth - 1 < len(truth) and truth[depth - 1] == tok:
            on.add(i)
    return on


def fit(steps: list) -> dict:
    """Hit rate per class of the nodes whose parent was right (a Beta(0.5, 0.5)-smoothed mean)."""
    tally = collections.defaultdict(lambda: [0, 0])
    for nodes, truth in steps:
        on = on_truth(nodes, truth)
        for i in range(1, len(nodes)):
            if nodes[i][0] in on:
                t = tally[cls_key(nodes[i])]
                t[0] += 1
                t[1] += i in on
    return {k: (h + 0.5) / (n + 1) for k, (n, h) in tally.items()}


def tau_with(steps: list, budget: int, rate: dict | None) -> float:
    got = 0
    for nodes, truth in steps:
        score = [n[2] for n in nodes]
        if rate is not None:
            score = [1.0] * len(nodes)
            for i in range(1, len(nodes)):
                score[i] = score[nodes[i][0]] * rate.get(cls_key(nodes[i]), 0.01)
        got += accepted(nodes, score, budget, truth)
    return 1 + got / max(len(steps), 1)


def record(a) -> dict[str, list]:
    """category -> per prompt, the list of (candidate tree, the answer after its anchor)."""
    from tqdm import tqdm

    from mlxspec import api
    from mlxspec.engine.loop import SpecStats
    from mlxspec.engine.tree import DraftTree
    from mlxspec.prompts import encode_prompt, load_prompts

    target, tok, _ = api.load(None, "none")
    texts, eos = load_prompts(), set(tok.eos_token_ids)
    spec = api.Speculator.build(api.SpecConfig(draft=a.draft, policy="fixed", tree="off"), target)
    spec.tree = api.TreeSettings("fixed", a.nodes, a.width)
    trees: list = []
    select = DraftTree.select

    def recording(self, budget, ranked=None):
        trees.append([(n.parent, n.token, n.score, n.depth, n.source, n.cls, n.cond) for n in self.nodes])
        return select(self, budget, ranked)

    out = {}
    DraftTree.select = recording
    try:
        jobs = [(c, t) for c in a.categories for t in texts[c][: a.prompts]]
        for cat, text in tqdm(jobs, unit="answer", desc="recording"):
            trees.clear()
            yields = [list(s) for s in spec.session(target, encode_prompt(tok, cat, text), max_tokens=a.max_tokens,
                                                    eos_ids=eos, stats=SpecStats())]
            flat = [t for y in yields for t in y]
            steps, at = [], len(yields[0]) - 1  # the first yield is the prefill's token
            for k, nodes in enumerate(trees):
                if nodes[0][1] != flat[at]:
                    raise SystemExit(f"tree_selection: step {k} is rooted at {nodes[0][1]}, the answer has {flat[at]} "
                                     "there: the recording lost its place")
                steps.append((nodes, flat[at + 1: at + 1 + a.nodes + 1]))
                at += len(yields[k + 1]) if k + 1 < len(yields) else 0
            out.setdefault(cat, []).append(steps)
    finally:
        DraftTree.select = select
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="mlxspec/weights/smollm2-135m-eagle3")
    ap.add_argument("--categories", default="chat")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per category (1-16; chat has 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--nodes", type=int, default=7, help="the tree's nodes (7: as many as the chain's drafts)")
    ap.add_argument("--width", type=int, default=4, help="children tried per node (--tree's default: 4)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.categories = [c.strip() for c in a.categories.split(",") if c.strip()]
    if set(a.categories) - {"code", "prose", "chat"} or not a.categories:
        ap.error("--categories: one or more of code, prose, chat")
    if not (1 <= a.prompts <= 16 and 2 <= a.max_tokens <= 1024 and 1 <= a.nodes <= 64 and 1 <= a.width <= 16):
        ap.error("--prompts 1-16, --max-tokens 2-1024, --nodes 1-64, --width 1-16")
    import mlxspec  # noqa: F401  (OpenBLAS before MLX)
    from mlxspec.bench.report import write_json

    report = {"command": "scripts/tree_selection.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "nodes": a.nodes, "width": a.width, "categories": {}}
    for cat, prompts in record(a).items():
        steps = [s for p in prompts for s in p]
        halves = (prompts[0::2], prompts[1::2])
        cross = sum(tau_with([s for p in halves[1 - h] for s in p], a.nodes, fit([s for p in halves[h] for s in p]))
                    * sum(len(p) for p in halves[1 - h]) for h in (0, 1) if halves[h]) / len(steps)
        row = {"steps": len(steps), "live": tau_with(steps, a.nodes, None),
               "calibrated_in_sample": tau_with(steps, a.nodes, fit(steps)),
               "calibrated_out_of_sample": cross if all(halves) else None,
               "knowing_the_answer": 1 + sum(min(len(on_truth(n, t)) - 1, a.nodes) for n, t in steps) / len(steps)}
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        report["categories"][cat] = row
        print(f"{cat}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
