"""x AR's interval in `mlxspec bench` (`mlxspec.bench.summary.paired_interval`: a paired bootstrap
over the prompts) and `scripts/bench_compare.py`, which compares two configurations of one run
against a goal, on a bench.json written by a real run (docs/bench/trees-code-avx512-2026-12-05)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxspec.bench.summary import paired_interval

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "docs" / "bench" / "trees-code-avx512-2026-12-05" / "bench.json"
SCRIPT = ROOT / "scripts" / "bench_compare.py"
TREE = "draft-eagle3+ngram smollm2-135m-eagle3 [adaptive] tree=auto"
CHAIN = "draft-eagle3+ngram smollm2-135m-eagle3 [adaptive]"


def test_the_same_ratio_on_every_prompt_is_an_interval_of_one_point():
    assert paired_interval([[2.0], [4.0], [6.0]], [[1.0], [2.0], [3.0]]) == [2.0, 2.0]


def test_the_interval_spans_what_resampling_the_prompts_can_give():
    # two prompts, one 1x and one 3x over the same AR: a resample holds either one twice (1x or
    # 3x, each a quarter of the time) or both (2x), so the 95% interval is exactly [1, 3]
    assert paired_interval([[1.0], [3.0]], [[1.0], [1.0]]) == [1.0, 3.0]


def test_each_prompt_counts_the_median_of_its_repeats_and_untimed_ones_drop_out():
    # medians 2 and 4 over 1 and 2: every resample is 2x; the third prompt was never timed
    assert paired_interval([[1.0, 5.0, 2.0], [4.0, 4.0, 9.0], [None]], [[1.0], [2.0], [1.0]]) == [2.0, 2.0]


def test_one_prompt_has_no_interval():
    assert paired_interval([[3.0, 3.1]], [[1.0, 1.0]]) is None
    assert paired_interval([[3.0], [None]], [[1.0], [1.0]]) is None


def _compare(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_compare_trees_with_chains_on_a_real_run():
    r = _compare(str(RUN), "--a", TREE, "--b", CHAIN, "--goal", "1.10")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == TREE and lines[1] == f"  over {CHAIN}"
    # the figures of docs/trees.md's table (1.57 / 1.55 and 1.10 / 1.19 x AR), paired per prompt
    assert "T=0 code   3 prompts: 1.017 [0.985, 1.065]  goal 1.1: not met" in lines
    assert "T=1 code   3 prompts: 0.924 [0.835, 0.986]  goal 1.1: not met" in lines


def test_a_goal_inside_the_interval_cannot_be_told():
    r = _compare(str(RUN), "--a", TREE, "--b", CHAIN, "--goal", "1.0")
    assert r.returncode == 0, r.stderr
    assert "T=0 code   3 prompts: 1.017 [0.985, 1.065]  goal 1: cannot tell" in r.stdout.splitlines()


@pytest.mark.parametrize("args,message", [
    (["--a", "eagle3", "--b", CHAIN], "--a 'eagle3' names 4 configurations of this run; give one of: 'mlx_lm AR'"),
    (["--a", TREE, "--b", "no such row"], "--b 'no such row' names 0 configurations of this run"),
    (["--a", CHAIN, "--b", CHAIN], "--a and --b both name"),
    (["--a", TREE, "--b", CHAIN, "--goal", "-1"], "--goal -1.0: give a finite ratio above 0"),
    (["--a", TREE, "--b", CHAIN, "--goal", "0"], "--goal 0.0: give a finite ratio above 0"),
    (["--a", TREE, "--b", CHAIN, "--goal", "nan"], "--goal nan: give a finite ratio above 0"),
    (["--a", TREE, "--b", CHAIN, "--goal", "inf"], "--goal inf: give a finite ratio above 0"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    r = _compare(str(RUN), *args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("bench_compare: error: ") and message in r.stderr and r.stderr.count("\n") == 1


def test_a_file_that_is_not_a_bench_run_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text('{"rows": []}')
    r = _compare(str(bad), "--a", TREE, "--b", CHAIN)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"{bad}: not a bench.json of mlxspec bench" in r.stderr
