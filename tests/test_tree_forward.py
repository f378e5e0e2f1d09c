"""One target forward over a tree (mlxspec.targets.tree) on every target architecture:
each node's logits and taps equal a chain forward of its path, and after keeping the accepted
path the cache equals a fresh prefill of it (sliding windows included, trees deeper than the
window), so decoding goes on exactly."""

import mlx.core as mx
import numpy as np
import pytest
from tiny_targets import ARCHS, WINDOW, tiny_target
from test_targets import PROMPT, assert_caches_equal

from mlxspec.targets.tree import keep_rows, layout, tree_support

TREE_ARCHS = [a for a in ARCHS if a != "qwen3_5"]
# anchor 0; two branches off the root, a branch off depth 2, a path deeper than WINDOW (4)
PARENTS = [-1, 0, 0, 1, 1, 3, 2, 5, 7, 8, 6]
TOKENS = [30, 12, 40, 7, 19, 22, 5, 33, 8, 14, 27]


def path_of(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@pytest.fixture(scope="module", params=TREE_ARCHS)
def target(request):
    return tiny_target(request.param)


def test_tree_rows_equal_their_paths_decoded_as_chains(target):
    assert tree_support(target) is None
    depth, _ = layout(PARENTS)
    assert depth.max() > WINDOW
    cache = target.make_cache()
    target(mx.array([PROMPT]), cache, logits="last")
    logits, taps = target(mx.array([TOKENS]), cache, taps=(1, 2), tree=PARENTS)
    for i in range(len(TOKENS)):
        path = path_of(PARENTS, i)
        ref = target.make_cache()
        target(mx.array([PROMPT]), ref, logits="last")
        lc, tc = target(mx.array([[TOKENS[j] for j in path]]), ref, taps=(1, 2))
        np.testing.assert_allclose(np.array(logits[0, i]), np.array(lc[0, -1]), atol=2e-4, err_msg=f"node {i}")
        np.testing.assert_allclose(np.array(taps[0, i]), np.array(tc[0, -1]), atol=2e-4)


@pytest.mark.parametrize("leaf", [0, 4, 6, 9, 10])
def test_keeping_a_path_equals_a_fresh_prefill_and_decoding_goes_on(target, leaf):
    path = path_of(PARENTS, leaf)
    cache = target.make_cache()
    target(mx.array([PROMPT]), cache, logits="last")
    target(mx.array([TOKENS]), cache, taps=(1,), tree=PARENTS)
    keep_rows(cache, len(TOKENS), path)
    fresh = target.make_cache()
    target(mx.array([PROMPT + [TOKENS[j] for j in path]]), fresh)
    assert_caches_equal(cache, fresh)
    for step in ([[31]], [[32]], [[33, 34, 35]]):  # one-token steps write into the ring in place
        la, _ = target(mx.array(step), cache)
        lb, _ = target(mx.array(step), fresh)
        np.testing.assert_allclose(np.array(la), np.array(lb), atol=2e-4)


def test_recurrent_targets_say_why_they_verify_chains():
    why = tree_support(tiny_target("qwen3_5"))
    assert why is not None and "recurrent" in why and "chains" in why


def test_a_malformed_tree_is_refused():
    with pytest.raises(ValueError, match="parents must come first"):
        layout([-1, 2, 0])
