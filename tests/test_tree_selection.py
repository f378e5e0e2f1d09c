"""`scripts/tree_selection.py`: the offline replay of a fixed tree's node choice (what a step
accepts from the nodes the engine's `DraftTree.select` keeps, the class table's fit), on
hand-built trees whose answers are known."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tree_selection", ROOT / "scripts" / "tree_selection.py")
ts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ts)

# root (token 9); depth 1: 1 (score .6) and 2 (.3); under 1: 3 (.5) ; under 2: 4 (.25)
# node = (parent, token, score, depth, source, class, raw conditional)
TREE = [(-1, 9, 1.0, 0, "", "", 1.0),
        (0, 1, 0.6, 1, "drafter", "drafter/chain", 0.6),
        (0, 2, 0.3, 1, "drafter", "drafter/alt", 0.3),
        (1, 3, 0.5, 2, "drafter", "drafter/chain", 0.83),
        (2, 4, 0.25, 2, "drafter", "drafter/off", 0.83)]


def test_a_step_accepts_the_kept_path_that_matches_the_answer_and_nothing_past_a_missing_node():
    live = [n[2] for n in TREE]
    assert ts.accepted(TREE, live, 4, [2, 4, 7]) == 2
    assert ts.accepted(TREE, live, 3, [2, 4, 7]) == 1  # node 4 (the worst) not verified
    assert ts.accepted(TREE, live, 2, [2, 4, 7]) == 0  # nodes 1 and 3 kept
    assert ts.accepted(TREE, live, 2, [1, 3, 5]) == 2


def test_the_best_nodes_are_kept_and_never_a_node_without_its_parent():
    # node 4 outscores its parent 2 and node 1: it waits for its parent, so the two best are 1, 3
    score = [1.0, 0.6, 0.1, 0.5, 0.9]
    assert ts.accepted(TREE, score, 2, [2, 4, 7]) == 0
    assert ts.accepted(TREE, score, 2, [1, 3, 5]) == 2
    assert ts.tau_with([(TREE, [2, 4, 7])], 2, None) == 1.0
    assert ts.tau_with([(TREE, [2, 4, 7])], 4, None) == 3.0


def test_the_class_table_is_the_smoothed_hit_rate_of_nodes_whose_parent_was_right():
    # answer 1, 3: nodes 1 and 2 tried (parent = root), 1 hit; node 3 tried (parent 1 right), hit;
    # node 4 not tried (its parent 2 was wrong)
    rate = ts.fit([(TREE, [1, 3])])
    assert rate[ts.cls_key(TREE[1])] == (1 + 0.5) / (1 + 1)
    assert rate[ts.cls_key(TREE[2])] == (0 + 0.5) / (1 + 1)
    assert rate[ts.cls_key(TREE[3])] == (1 + 0.5) / (1 + 1)
    assert ts.cls_key(TREE[4]) not in rate
    assert ts.on_truth(TREE, [1, 3]) == {0, 1, 3}
