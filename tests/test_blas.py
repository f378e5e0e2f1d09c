"""OpenBLAS's thread governor (mlxspec.blas.ThreadGovernor): its choices under a simulated
host load, and that the thread count it changes leaves greedy tokens as they were."""

import os

import mlx.core as mx
import numpy as np
import pytest

from mlxspec import blas
from mlxspec.blas import ThreadGovernor


class Host:
    """A simulated host: `others` cores busy outside this process, `mine` inside it."""

    def __init__(self):
        self.t = 0.0
        self.busy = 0.0
        self.me = 0.0
        self.others = 0.0
        self.mine = 1.0

    def run(self, seconds):
        self.t += seconds
        self.busy += (self.others + self.mine) * seconds
        self.me += self.mine * seconds

    def sample(self):
        return self.busy, self.me, self.t


def _governor(host, cores=2):
    applied = []
    g = ThreadGovernor(period=0.5, cores=cores, sample=host.sample, apply=applied.append,
                       clock=lambda: host.t)
    return g, applied


def test_quiet_host_uses_every_core_and_a_busy_core_drops_a_thread():
    h = Host()
    g, applied = _governor(h)
    assert g.tick() is None  # the first sample only starts the clock
    for _ in range(10):
        h.run(0.1)
        g.tick()
    assert g.threads == 2 and applied == [2]
    h.others = 1.0  # `yes > /dev/null` on one core
    for _ in range(20):
        h.run(0.1)
        g.tick()
    assert g.threads == 1 and applied == [2, 1] and g.changes == 1
    h.others = 0.0  # the other job ends: the second thread comes back
    for _ in range(30):
        h.run(0.1)
        g.tick()
    assert g.threads == 2 and applied == [2, 1, 2]


def test_a_load_while_this_process_idled_does_not_drop_a_thread():
    """Another server answered (1.8 cores) while this one idled without ticking; when this one
    works again beside a light load (a client, 0.4 core) it keeps both threads: the idle gap's
    load is not counted."""
    h = Host()
    g, applied = _governor(h)
    for _ in range(10):
        h.run(0.1)
        g.tick()
    assert g.threads == 2
    h.others, h.mine = 1.8, 0.0
    h.run(20.0)  # no ticks: idle
    h.others, h.mine = 0.4, 1.0
    for _ in range(30):
        h.run(0.1)
        g.tick()
        assert g.threads == 2
    assert applied == [2]


def test_samples_only_once_per_period():
    h = Host()
    calls = []

    def sample():
        calls.append(h.t)
        return h.sample()

    g = ThreadGovernor(period=0.5, cores=2, sample=sample, apply=lambda n: None, clock=lambda: h.t)
    for _ in range(50):  # 50 forwards of 20 ms = 1 s
        g.tick()
        h.run(0.02)
    assert 2 <= len(calls) <= 4


@pytest.mark.parametrize("others,cores,threads", [(0.0, 2, 2), (0.3, 2, 2), (0.6, 2, 2), (0.8, 2, 1), (1.0, 2, 1),
                                                   (3.0, 2, 1), (1.0, 8, 7), (2.5, 8, 6), (0.0, 1, 1)])
def test_choice(others, cores, threads):
    assert ThreadGovernor(cores=cores, sample=lambda: None, apply=lambda n: None).choose(others) == threads


def test_thread_count_keeps_greedy_tokens(smollm2):
    """The governor may switch mid-generation. OpenBLAS's threaded GEMM does not give the same
    bits as one thread for every shape (a 10-row prefill differed by ~1e-5 in the last digits),
    so what must hold is what a user sees: the same greedy tokens, and logits that agree far
    below any gap that picks a token."""
    from mlxspec.engine.loop import generate_steps

    if blas._openblas() is None:
        pytest.fail("OpenBLAS is not loaded: run the tests with scripts/test.sh (it preloads it)")
    target, tok = smollm2
    prompts = ["def reverse(s):\n    return s[::-1]\n# Explain this code to a beginner",
               "Write a haiku about the sea."]
    outs, logits = {}, {}
    try:
        for th in (1, 2):
            blas._set_threads(th)
            outs[th] = [sum(generate_steps(target, tok.encode(p), max_tokens=24, eos_ids=frozenset()), [])
                        for p in prompts]
            ids = tok.encode(prompts[0])
            c = target.make_cache()
            res = [target(mx.array([ids[:-9]]), c, logits="all")[0], target(mx.array([ids[-9:]]), c, logits="all")[0]]
            mx.eval(*res)
            logits[th] = [np.array(r) for r in res]
    finally:
        blas.default_blas_threads()
    assert outs[1] == outs[2]
    for a, b in zip(logits[1], logits[2]):
        assert np.abs(a - b).max() < 1e-3


def test_excluded_processes_count_as_our_own():
    """A process in `exclude` (another pipeline stage on this host) is not load: with a real
    spinning child, the load outside us falls by the child's own CPU time (read from its
    /proc entry) once it is excluded. Both samples cover the same second, so other jobs on a
    shared host cancel out (the earlier absolute bounds failed whenever the host was busy)."""
    import os
    import subprocess
    import sys
    import time

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        c0, a0, e0 = blas._pid_cpu(spin.pid), blas._cpu_sample(), blas._cpu_sample((spin.pid,))
        time.sleep(1.0)
        c1, a1, e1 = blas._pid_cpu(spin.pid), blas._cpu_sample(), blas._cpu_sample((spin.pid,))
        wall = a1[2] - a0[2]
        others_all = ((a1[0] - a0[0]) - (a1[1] - a0[1])) / wall
        others_excl = ((e1[0] - e0[0]) - (e1[1] - e0[1])) / wall
        child = (c1 - c0) / wall
        assert child >= 0.1, (child, os.getloadavg())  # the spinner ran (a busy host gives it less than a core)
        # excluding it removes exactly its time (tick rounding and the microseconds between reads aside)
        assert others_all - others_excl == pytest.approx(child, abs=0.08), (others_all, others_excl, child)
        assert others_all >= child - 0.08  # and the plain sample does count it as load
    finally:
        spin.kill()
        spin.wait()
    assert blas._pid_cpu(spin.pid) == 0.0  # a process that is gone counts nothing


@pytest.mark.parametrize("env", ["MLXSPEC_BLAS_THREADS", "OPENBLAS_NUM_THREADS"])
def test_ranks_sharing_a_host_leave_a_user_fixed_thread_count_alone(monkeypatch, env):
    """Two ranks on one host split its cores between their OpenBLAS pools, unless the user fixed
    the count with either variable (MLXSPEC_BLAS_THREADS was ignored here before)."""
    from mlxspec.distributed import group

    if not blas.openblas_loaded():
        pytest.fail("the suite runs with OpenBLAS preloaded (scripts/test.sh)")
    before = blas.blas_threads()
    monkeypatch.setattr(group, "ranks_on_my_host", lambda rank: 2)
    for name in ("MLXSPEC_BLAS_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    try:
        assert group.limit_blas_threads(0) == max(1, (os.cpu_count() or 1) // 2)
        monkeypatch.setenv(env, "1")
        assert group.limit_blas_threads(0) is None
    finally:
        blas._PINNED.clear()
        blas._set_threads(before)


# ----------------------------------------------------------------------------- import mlxspec loads OpenBLAS

_GEMM = """
import sys, time
{first}
import mlx.core as mx
a = mx.random.normal((512, 512)); b = mx.random.normal((512, 512)); mx.eval(a @ b)
t = time.perf_counter()
for _ in range(8):
    mx.eval(a @ b)
print((time.perf_counter() - t) / 8, "libopenblas" in open("/proc/self/maps").read())
"""


def _gemm_in_a_fresh_process(first: str, **env):
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLXSPEC_OPENBLAS")}
    e.update(env)
    r = subprocess.run([sys.executable, "-W", "always", "-c", _GEMM.format(first=first)], capture_output=True,
                       text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr
    seconds, loaded = r.stdout.split()
    return float(seconds), loaded == "True", r.stderr


@pytest.mark.skipif(not blas.sys.platform.startswith("linux") or not blas.find_openblas(),
                    reason="Linux with Debian's libopenblas0-pthread (scripts/setup.sh installs it)")
def test_import_mlxspec_before_mlx_gives_mlx_openblas_without_ld_preload():
    """A plain `python app.py` (no LD_PRELOAD) that imports mlxspec before mlx: MLX's GEMM runs
    on OpenBLAS, loaded by `import mlxspec` (ctypes, RTLD_GLOBAL) before libmlx bound its BLAS
    calls (measured: a 512x512 float32 matmul 2.3 ms against netlib's 38 ms on 2 cores). Here
    it must be several times faster than with MLXSPEC_OPENBLAS=off (netlib), and no warning."""
    fast, loaded, err = _gemm_in_a_fresh_process("import mlxspec")
    assert loaded and "RuntimeWarning" not in err, err
    slow, loaded_off, _ = _gemm_in_a_fresh_process("import mlxspec", MLXSPEC_OPENBLAS="off")
    assert not loaded_off
    assert fast * 3 < slow, (fast, slow)


@pytest.mark.skipif(not blas.sys.platform.startswith("linux") or not blas.find_openblas(),
                    reason="Linux with Debian's libopenblas0-pthread (scripts/setup.sh installs it)")
def test_import_mlxspec_after_mlx_warns_once_with_the_fix():
    """Imported after MLX, mlxspec cannot give it OpenBLAS any more: one RuntimeWarning naming
    the fix (import mlxspec first, or LD_PRELOAD=$(python -m mlxspec.blas)), at the user's
    import line, however often it is asked again."""
    _, loaded, err = _gemm_in_a_fresh_process(
        "import mlx.core\nimport mlxspec\nimport mlxspec.blas\nmlxspec.blas.preload_openblas()\nfrom mlxspec import api")
    assert not loaded
    lines = [ln for ln in err.splitlines() if "RuntimeWarning" in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith("<string>:4: RuntimeWarning: mlxspec: MLX was imported before mlxspec"), err
    assert f"LD_PRELOAD={blas.find_openblas()} (= $(python -m mlxspec.blas))" in lines[0]


@pytest.mark.skipif(not blas.sys.platform.startswith("linux") or not blas.find_openblas(),
                    reason="Linux with Debian's libopenblas0-pthread (scripts/setup.sh installs it)")
@pytest.mark.parametrize("preload", [False, True])
def test_mlxspec_blas_threads_sets_openblas_own_count(preload):
    """MLXSPEC_BLAS_THREADS=N is the count OpenBLAS runs, whether `import mlxspec` loads OpenBLAS
    or LD_PRELOAD did (until 2026-12-05 it only switched the governor off, and OpenBLAS kept every
    core: 'one-thread' training jobs ran two)."""
    import subprocess
    import sys

    code = "import mlxspec, mlxspec.blas\nprint(mlxspec.blas.blas_threads())"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    if preload:
        env["LD_PRELOAD"] = blas.find_openblas()
    counts = {}
    for n in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", code], env={**env, "MLXSPEC_BLAS_THREADS": n},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        counts[n] = int(r.stdout.split()[-1])
    assert counts["1"] == 1 and counts["2"] == 2, counts
