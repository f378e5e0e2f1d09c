"""The target sharded over two local ranks (mlx.launch, ring backend on 127.0.0.1): the
speculative output must equal the single-process output token for token, greedy and sampled;
a dead or stopped rank must end the other with one line, not a hang.

Tiny random-weight llama / qwen2 / qwen3 targets are built from mlx-lm's classes and saved as
MLX model dirs (every rank loads the same weights); SmolLM2 is the default GGUF target with
the shipped DSpark drafter (9 heads: not divisible by 2, so pipeline parallel).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dist_models import FAMILIES, VOCAB, write_tiny_target  # noqa: E402

from mlxspec import api  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Verify every drafted block: a timing-based policy would make the drafted/accepted counts
# differ from run to run (the tokens never do).
SPEC_KW = {"policy": "fixed"}
PY = sys.executable
LAUNCH = str(Path(PY).parent / "mlx.launch")
WORKER = str(Path(__file__).parent / "dist_worker.py")

PROMPT = [11, 42, 7, 99, 123, 5, 64, 200, 17, 3]
TINY_CASES = [
    {"prompt": PROMPT, "max_tokens": 20, "temp": 0.0},
    {"prompt": PROMPT, "max_tokens": 20, "temp": 0.8, "top_p": 0.95, "seed": 3},
]
# (run id, family, dist mode): one tensor-parallel run per family tested here (llama, qwen2,
# qwen3, mistral with sliding-window layers, qwen3_moe: mlx-lm shards all of them), plus
# pipeline parallel forced on two of them.
TINY_RUNS = [("llama-tensor", "llama", "auto"), ("qwen2-tensor", "qwen2", "auto"),
             ("qwen3-tensor", "qwen3", "auto"), ("mistral-tensor", "mistral", "auto"),
             ("qwen3_moe-tensor", "qwen3_moe", "auto"),
             ("llama-pipeline", "llama", "pipeline"), ("qwen3-pipeline", "qwen3", "pipeline")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: dict, tmp: Path, timeout: float = 400) -> dict:
    """Run tests/dist_worker.py on 2 local ranks with mlx.launch; rank 0's RESULT line."""
    jp = tmp / f"job{free_port()}.json"
    jp.write_text(json.dumps(job))
    r = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(free_port()),
                        "--", PY, WORKER, str(jp)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc={r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "mlxspec: error" not in r.stderr, r.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def tiny_drafter(path: Path) -> str:
    from mlxspec.drafters.load import save_drafter
    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.drafters.model import DFlashModel

    cfg = DrafterConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, block_size=4, target_layer_ids=[0, 2],
                        mask_token_id=5, vocab_size=VOCAB, sample_from_anchor=True, rope_theta=1e4,
                        markov_rank=8, confidence_head=True)
    mx.random.seed(1)
    m = DFlashModel(cfg)
    mx.eval(m.parameters())
    save_drafter(m, cfg, str(path), "deepspec")
    return str(path)


def single_process(model, draft, cases) -> list[dict]:
    """The reference: the same generation in this process, unsharded."""
    target, tok, spec = api.load(model, draft, log=open(os.devnull, "w"), **SPEC_KW)
    out = []
    for c in cases:
        toks, last = [], None
        for r in api.stream_generate(target, tok, c["prompt"], spec, max_tokens=c.get("max_tokens", 24), temp=c.get("temp", 0.0),
                                     top_p=c.get("top_p", 1.0), top_k=0, seed=c.get("seed", 0)):
            toks.append(r.token)
            last = r
        out.append({"tokens": toks, "accepted": last.stats.accepted, "drafted": last.stats.drafted})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Every tiny run in ONE mlx.launch job (start-up dominates on a 2-core machine)."""
    tmp = tmp_path_factory.mktemp("dist")
    dirs = {f: write_tiny_target(tmp / f, f) for f in FAMILIES}
    draft = tiny_drafter(tmp / "drafter")
    job = {"runs": [{"model": dirs[fam], "draft": draft, "mode": mode, "check": True, "timeout": 120,
                     "cases": TINY_CASES, "spec_kw": SPEC_KW} for _, fam, mode in TINY_RUNS]}
    res = launch(job, tmp)
    ref = {fam: single_process(dirs[fam], draft, TINY_CASES) for fam in FAMILIES}
    return {rid: (run, ref[fam]) for (rid, fam, _), run in zip(TINY_RUNS, res["runs"])}


@pytest.mark.parametrize("rid", [r[0] for r in TINY_RUNS])
def test_tiny_equals_single_process(tiny, rid):
    run, ref = tiny[rid]
    assert run["mode"] == rid.split("-")[1], run["describe"]
    for got, want in zip(run["cases"], ref):
        assert got["tokens"] == want["tokens"]  # greedy, then sampled with the same seed
        assert (got["accepted"], got["drafted"]) == (want["accepted"], want["drafted"])  # taps were full
    assert run["cases"][0]["drafted"] > 0


def test_smollm2_pipeline_equals_single_process(smollm2, tmp_path):
    from mlxspec.tokenizer import apply_chat_template

    _, tok = smollm2  # the session's (the ranks load their own)
    text = apply_chat_template(tok, [{"role": "user", "content": "Write a Python function that reverses a string."}],
                               add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    cases = [{"prompt": ids, "max_tokens": 16, "temp": 0.0},
             {"prompt": ids, "max_tokens": 8, "temp": 0.7, "top_p": 0.9, "seed": 1}]
    res = launch({"runs": [{"model": None, "draft": "auto", "check": True, "timeout": 300, "cases": cases,
                            "spec_kw": SPEC_KW}]},
                 tmp_path)["runs"][0]
    assert res["mode"] == "pipeline", res["describe"]  # 9 heads do not split over 2 ranks
    ref = single_process(None, "auto", cases)
    for got, want in zip(res["cases"], ref):
        assert got["tokens"] == want["tokens"]
        assert (got["accepted"], got["drafted"]) == (want["accepted"], want["drafted"])
    assert res["cases"][0]["accepted"] > 0


def _spawn_ranks(job_path: Path, port: int, tmp: Path):
    """The two ranks as mlx.launch starts them (MLX_RANK, MLX_HOSTFILE), but with their pids
    in hand so the test can kill or stop one. (Under mlx.launch the launcher itself also
    terminates the survivors when a rank exits.)"""
    hf = tmp / "hosts.json"
    hf.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=str(hf), MLX_WORLD_SIZE="2")
        procs.append(subprocess.Popen([PY, WORKER, str(job_path)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT))
    return procs


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_stopped_rank_gives_one_line_error(tmp_path, how):
    d = write_tiny_target(tmp_path / "llama", "llama")
    # a stopped rank is found by the watchdog (6 s); a killed one by the lost connection,
    # well before a 30 s watchdog even on a loaded machine
    timeout = 6 if how == "stop" else 30
    job = {"runs": [{"model": d, "draft": None, "check": True, "timeout": timeout,
                     "cases": [{"prompt": PROMPT, "max_tokens": 400, "progress": True}]}]}
    jp = tmp_path / "job.json"
    jp.write_text(json.dumps(job))
    r0, r1 = _spawn_ranks(jp, free_port(), tmp_path)
    try:
        line = ""
        deadline = time.monotonic() + 240
        while "TOKEN 3" not in line:  # generation is under way on both ranks
            assert time.monotonic() < deadline and r0.poll() is None, r0.stderr.read()[-2000:]
            line = r0.stdout.readline()
        r1.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t = time.monotonic()
        rc = r0.wait(timeout=timeout + 30)
        took = time.monotonic() - t
        err = r0.stderr.read()
        errs = [ln for ln in err.splitlines() if ln.startswith("mlxspec: error")]
        assert rc == 2, err[-2000:]
        assert len(errs) == 1 and "rank 1" in errs[0], err[-2000:]
        if how == "stop":
            assert "did not answer within" in errs[0] and took >= timeout - 1
        else:
            assert "lost rank 1" in errs[0] and took < timeout, (took, errs)
    finally:
        for p in (r0, r1):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_cli_under_mlx_launch_prints_once_and_matches(tmp_path):
    """`mlx.launch ... -- mlxspec generate`: rank 0 prints exactly what one process prints."""
    d = write_tiny_target(tmp_path / "qwen3", "qwen3")
    draft = tiny_drafter(tmp_path / "drafter")
    mlxspec = str(Path(PY).parent / "mlxspec")
    args = ["generate", "--model", d, "--draft", draft, "--prompt", "t11 t42 t7 t99 t123", "-n", "16",
            "--verbose", "False"]
    one = subprocess.run([mlxspec, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(free_port()),
                          "--", mlxspec, *args, "--check"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "error" not in two.stderr, two.stderr[-2000:]
    assert one.stdout.strip() and two.stdout == one.stdout
    # --draft auto (the default) with no known drafter: prompt lookup on rank 0, the same text;
    # this time the ranks started by `--ranks 2` (mlxspec's own launcher, no mlx.launch)
    auto = [a for a in args if a not in ("--draft", draft)]
    three = subprocess.run([mlxspec, *auto, "--check", "--ranks", "2"], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    assert three.returncode == 0 and "error" not in three.stderr, three.stderr[-2000:]
    assert "prompt lookup (ngram" in three.stderr, three.stderr[-2000:]
    assert three.stdout == one.stdout


def test_ranks_flag_is_checked_before_any_rank_starts():
    mlxspec = str(Path(PY).parent / "mlxspec")
    for extra, needle in ((["--ranks", "0"], "--ranks 0: give 1 to 16 local ranks"),
                          (["--ranks", "2", "--temp", "-1"], "--temp")):
        r = subprocess.run([mlxspec, "generate", "--prompt", "hi", *extra], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]
    env = dict(os.environ, MLX_RANK="0")
    r = subprocess.run([mlxspec, "generate", "--prompt", "hi", "--ranks", "2"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 2 and "under mlx.launch leave it out" in r.stderr, r.stderr[-2000:]


def test_local_launcher_sleeps_while_ranks_run():
    """The launcher waits in wait(): the job's CPU (launcher and both ranks) does not grow with
    how long the ranks run. 2 s and 8 s of two sleeping ranks differ by well under 1.5 s
    of CPU (mlx.launch's relay threads poll an always-writable stdin pipe: about 0.6
    CPU-seconds per second on this machine, ~3.6 s here)."""
    import resource

    def job(seconds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        r = subprocess.run([PY, "-m", "mlxspec.distributed.launch", "-n", "2", "--", PY, "-c",
                            f"import os, time; time.sleep({seconds}); print('rank', os.environ['MLX_RANK'], "
                            "os.environ['MLX_WORLD_SIZE'])"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert r.returncode == 0 and r.stdout == "rank 0 2\n", (r.stdout, r.stderr)
        assert wall >= seconds
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    short, long = job(2), job(8)
    # the defect costs ~0.6 CPU-s per second of running (3.6 s over the 6 s); the two jobs'
    # start-up work (imports of 3 interpreters) varies by up to ~0.8 s on a loaded host
    assert long - short < 1.5, (short, long)


def test_local_launcher_reports_a_failing_rank_once():
    """A rank that fails: its exit code and its own line; the line every rank prints, once."""
    code = ("import os, sys; r = int(os.environ['MLX_RANK']); "
            "print('mlxspec: error: same on every rank', file=sys.stderr); "
            "r == 1 and print('mlxspec: error: only rank 1 saw this', file=sys.stderr); sys.exit(2 if r else 0)")
    r = subprocess.run([PY, "-m", "mlxspec.distributed.launch", "-n", "3", "--", PY, "-c", code],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines == ["mlxspec: error: same on every rank", "mlxspec: error: rank 1: only rank 1 saw this"], lines


def test_recurrent_target_is_refused_in_one_line(tmp_path):
    """qwen3_5 (Gated DeltaNet caches, rolled back by replaying layers): refused on every rank."""
    from tiny_targets import write_tiny_dir

    _, d = write_tiny_dir(tmp_path / "qwen3_5", "qwen3_5")
    jp = tmp_path / "job.json"
    jp.write_text(json.dumps({"runs": [{"model": d, "draft": None, "timeout": 60, "cases": []}]}))
    r = subprocess.run([LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2", "-p", str(free_port()),
                        "--", PY, WORKER, str(jp)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("mlxspec: error")]
    assert errs and all("caches are not supported across ranks" in e for e in errs), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "RESULT" not in r.stdout
