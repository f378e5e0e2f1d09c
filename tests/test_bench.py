"""`mlxspec bench`: a tiny end-to-end run (random-weight DSpark drafter, and draft-simple with
the target's own MLX copy as draft model) and the user errors."""

from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import pytest

from mlxspec import cli
from mlxspec.drafters.load import save_drafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel


@pytest.fixture(scope="module")
def drafter_dir(smollm2, tmp_path_factory):
    info = smollm2[0].info
    cfg = DrafterConfig(hidden_size=info.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, block_size=4, target_layer_ids=[1, 10, 20],
                        mask_token_id=16, vocab_size=info.vocab_size, sample_from_anchor=True, rope_theta=1e5,
                        markov_rank=8, confidence_head=True)
    mx.random.seed(0)
    m = DFlashModel(cfg)
    mx.eval(m.parameters())
    path = tmp_path_factory.mktemp("bench") / "dspark"
    save_drafter(m, cfg, path, "speculators", target=smollm2[0])
    return path


def test_bench_tiny_run(drafter_dir, tmp_path, capsys):
    from mlxspec.bench import mlx_lm_dir

    simple = mlx_lm_dir(None, None)  # the target's own weights: draft-simple accepts (nearly) everything
    out = tmp_path / "out"
    rc = cli.main(["bench", "--draft", str(drafter_dir), "--draft-simple", str(simple), "--num-draft-tokens", "2",
                   "--categories", "code", "--prompts-per-category", "1", "--max-tokens", "6",
                   "--repeats", "1", "--temps", "0,1", "--no-random", "--trees", "3", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    fixed = ["draft-dspark dspark [fixed]", f"draft-simple {simple.name} [fixed]"]
    adaptive = ["draft-dspark dspark [adaptive]", "draft-dspark+ngram dspark [adaptive]", "ngram [adaptive]"]
    trees = [f"{lab} tree=3" for lab in (fixed[0], *adaptive)]  # a tree row beside each chain row
    labels = ["mlx_lm AR", "mlxspec AR", fixed[0], *adaptive, fixed[1], *trees]
    assert "Command: `" in cap.out and "| T | configuration | tok/s | x AR | tau | accept | drafter |" in cap.out
    assert "x AR: over mlxspec AR, [95% interval: a paired bootstrap over the prompts]" in cap.out
    for lab in labels:
        assert f"| {lab} |" in cap.out

    doc = json.loads((out / "bench.json").read_text())
    assert [c["label"] for c in doc["configurations"]] == labels
    assert doc["meta"]["max_tokens"] == 6 and doc["meta"]["temps"] == [0.0, 1.0]
    assert doc["verify_cost"]["forward_ms"]["1"] > 0 and "5" in doc["verify_cost"]["forward_ms"]  # 4 drafts + anchor
    rows = {(r["temp"], r["configuration"], r["category"]): r for r in doc["results"]}
    assert set(rows) == {(t, lab, c) for t in (0.0, 1.0) for lab in labels for c in ("code", "all")}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["ratio_vs_mlxspec_ar"] > 0 and r["peak_memory_mb"] > 0
        assert all(len(p) == 1 for p in r["tokens_per_s_per_prompt"])
        assert r["ratio_interval"] is None  # one prompt: no interval (tests/test_bench_compare.py)
    for t in (0.0, 1.0):
        ar = rows[(t, "mlxspec AR", "all")]
        assert ar["ratio_vs_mlxspec_ar"] == 1.0 and ar["tau"] == 1.0 and ar["acceptance_rate"] is None
        for lab in adaptive:  # the policy may verify nothing on a random drafter: only sanity here
            assert rows[(t, lab, "all")]["tau"] >= 1.0
        for lab in fixed:
            r = rows[(t, lab, "all")]
            assert r["tau"] >= 1.0 and 0.0 <= r["acceptance_rate"] <= 1.0
            assert r["per_position_acceptance"] and r["mean_verify_length"] > 1
            assert r["ideal_speedup"] > 0 and r["efficiency"] == pytest.approx(r["ratio_vs_mlxspec_ar"] / r["ideal_speedup"])
            assert 0 < r["draft_share"] < 1 and r["draft_share"] + r["verify_share"] == pytest.approx(1.0)
    assert len(rows[(0.0, fixed[0], "all")]["per_position_acceptance"]) == 4
    assert 2.0 < rows[(0.0, trees[0], "all")]["mean_verify_length"] <= 4.0  # 3 nodes + the anchor (fewer near the end)
    # greedy speculative decoding is lossless: the same tokens as mlxspec AR
    for lab in labels[2:]:
        assert rows[(0.0, lab, "all")]["same_tokens_as_ar"] == [1, 1]
    simple_row = rows[(0.0, fixed[1], "all")]
    assert simple_row["acceptance_rate"] > 0.8 and simple_row["tau"] > 1.5
    assert simple_row["drafter_accepted_share"] == 1.0  # no lookup beside it: every accepted draft is the drafter's
    for t in (0.0, 1.0):  # prompt lookup alone: none of its accepted drafts are a drafter's
        assert rows[(t, "ngram [adaptive]", "all")]["drafter_accepted_share"] in (None, 0.0)

    if importlib.util.find_spec("matplotlib"):
        for name in ("speedup.png", "acceptance.png", "tau_by_category.png"):
            assert (out / name).stat().st_size > 1000
    else:
        assert "plots skipped" in cap.err


@pytest.mark.parametrize("args,message", [
    (["--draft", "/nonexistent/drafter"], "--draft /nonexistent/drafter: no such file or directory"),
    (["--draft-simple", "/nonexistent/model"], "--draft-simple /nonexistent/model: no such file or directory"),
    (["--temps", "0,hot"], "--temps '0,hot': expected comma-separated numbers"),
    (["--temps", "0,nan"], "--temps '0,nan': expected comma-separated numbers, e.g. 0,1"),
    (["--categories", "code,poetry"], "--categories: unknown category 'poetry'"),
    (["--prompts-per-category", "99"], "--prompts-per-category 99: the code set has only"),
    (["--max-tokens", "1"], "--max-tokens 1: tokens/s needs at least 2 tokens"),
    (["--policies", "fixed,greedy"], "--policies: unknown verify policy 'greedy'"),
    (["--trees", "off"], "--trees 'off': list auto and/or node counts"),
    (["--trees", "auto,wide"], "--tree 'wide': use off, auto, or a node count 1..64"),
    (["--suffix", "--no-ngram"], "--suffix adds a twin to each prompt-lookup row: drop --no-ngram"),
    (["--background-load", "-1"], "--background-load -1: use 0.."),
    (["--background-load", "999"], "--background-load 999: use 0.."),
    (["--model", "someone/Other-Model-4bit"],
     "--model someone/Other-Model-4bit: mlxspec ships no drafter for other-model; pass --draft PATH"),
])
def test_bench_user_errors(args, message, capsys):
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxspec: error: ") and message in err and err.count("\n") == 1


def test_bench_not_a_drafter(smollm2_path, tmp_path, capsys):
    assert cli.main(["bench", "--draft", str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxspec: error: ") and str(tmp_path) in err and err.count("\n") == 1


def test_background_load_spins_and_always_stops():
    """--background-load N: N spinning processes for the run, killed on exit even when the
    bench fails."""
    import time

    from mlxspec.bench import BackgroundLoad

    with pytest.raises(RuntimeError, match="bench failed"):
        with BackgroundLoad(1) as load:
            procs = list(load.procs)
            t0 = time.monotonic()
            c0 = _cpu_seconds(procs[0].pid)
            while _cpu_seconds(procs[0].pid) - c0 < 0.2 and time.monotonic() - t0 < 20:  # a loaded host is slow
                time.sleep(0.05)
            spun = _cpu_seconds(procs[0].pid) - c0
            assert procs[0].poll() is None and spun >= 0.2, f"spun {spun:.2f} s in {time.monotonic() - t0:.2f} s"
            raise RuntimeError("bench failed")
    assert procs[0].poll() is not None and load.procs == []


def test_background_load_ends_with_its_bench(tmp_path):
    """A bench killed by a signal (no __exit__) leaves no spinning process behind."""
    import subprocess
    import sys
    import time

    code = ("import sys, time\nfrom mlxspec.bench.runners import BackgroundLoad\n"
            "with BackgroundLoad(1) as load:\n    print(load.procs[0].pid, flush=True)\n    time.sleep(60)\n")
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    spinner = int(bench.stdout.readline())
    bench.kill()
    bench.wait()
    for _ in range(100):
        try:
            with open(f"/proc/{spinner}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the spinner {spinner} outlived its bench")


def _cpu_seconds(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
