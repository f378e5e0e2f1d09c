"""`scripts/speed_bound.py`: the x AR a chain drafter's measured acceptance allows at this
machine's measured costs, for the best fixed length and for a per-step oracle; exact values on
hand-computed cases, and the script on the shipped drafter's report and a committed bench run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "speed_bound.py"
spec = importlib.util.spec_from_file_location("speed_bound", SCRIPT)
sb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)


def test_best_fixed_length_and_the_oracle_by_hand():
    # verify 1, 2, 3 rows: 10, 12, 14 ms; drafting 1, 2 drafts: 1, 2 ms; P(first 1 right) 0.5, P(first 2) 0.25
    tv, td, surv = [10.0, 12.0, 14.0], [1.0, 2.0], [0.5, 0.25]
    # L=1: 1.5 * 10 / 13 = 1.1538; L=2: 1.75 * 10 / 16 = 1.09375
    assert sb.best_fixed(surv, tv, td) == (1, pytest.approx(15 / 13))
    # the oracle: A=0 (p 0.5) one token in 10 ms; A=1 (0.25) 2 in 12+1; A=2 (0.25) 3 in 14+2
    assert sb.oracle(surv, tv, td) == pytest.approx((0.5 + 0.5 + 0.75) * 10 / (5 + 3.25 + 4))
    # nothing ever right: AR; always right: the longest chain
    assert sb.best_fixed([0.0, 0.0], tv, td) == (0, 1.0)
    assert sb.oracle([1.0, 1.0], tv, td) == pytest.approx(3 * 10 / 16)


def test_the_acceptance_needed_for_a_goal():
    tv, td = [10.0, 12.0, 14.0], [1.0, 2.0]
    a = sb.needed(tv, td, 1.5, 2)
    assert sb.best_fixed([a, a * a], tv, td)[1] == pytest.approx(1.5, abs=1e-6)
    assert sb.needed(tv, td, 10.0, 2) is None  # more than 3 tokens a step could give


def test_the_script_on_the_shipped_drafter(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--report", str(ROOT / "mlxspec/weights/smollm2-135m-eagle3/report.json"),
                        "--bench", str(ROOT / "docs/bench/default-avx512-fused-2026-12-05/bench.json"),
                        "--draft-ms", "1.4", "--goal", "1.5", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert set(d["categories"]) == {"code", "prose", "chat"}
    for c in d["categories"].values():
        assert 1.0 < c["best_fixed_x_ar"] <= c["oracle_x_ar"]
    assert d["categories"]["chat"]["best_fixed_x_ar"] < 1.5 < d["categories"]["code"]["best_fixed_x_ar"]
    bad = subprocess.run([sys.executable, str(SCRIPT), "--report", str(out), "--bench", str(out), "--draft-ms", "1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no held-out evaluation" in bad.stderr
