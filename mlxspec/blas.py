"""Fast BLAS on Linux CPU.

The `mlx[cpu]` wheel links netlib's reference BLAS (~2 GFLOP/s). Debian's
`libopenblas0-pthread` exports the same symbols; preloading it (LD_PRELOAD) makes MLX's
CPU GEMM ~60x faster, and a 16-token verify of SmolLM2 cost ~2x a 1-token decode
instead of ~14x. Speculative decoding on Linux CPU depends on it.

`import mlxspec` loads it itself (`mlxspec.device.preload_openblas`): while MLX is not imported yet, a
`ctypes.CDLL(path, RTLD_GLOBAL)` puts OpenBLAS in the process's global symbol scope, and
libmlx, loaded after it, binds its BLAS calls there instead of to the wheel's netlib (measured
on 2 cores: a 512x512 float32 matmul 2.3 ms against 38 ms, as fast as LD_PRELOAD). So a plain
`python app.py` that imports mlxspec before mlx (or mlx_lm) runs at full speed. Imported after
MLX, it cannot: it warns once with the fix (import mlxspec first, or
`LD_PRELOAD=$(python -m mlxspec.blas) python app.py`). `mlxspec` (the CLI, entry point
`mlxspec.__main__`) still re-executes itself once with the library preloaded where the import
did not load it; set MLXSPEC_NO_BLAS_REEXEC=1 to turn that off, MLXSPEC_OPENBLAS=off to load
none at all.
"""

from __future__ import annotations

import os
import sys

from mlxspec import device

# where OpenBLAS is found and how it is loaded before MLX: `mlxspec.device` (`import mlxspec` does it)
CANDIDATES = device.OPENBLAS_CANDIDATES
find_openblas = device.find_openblas
openblas_loaded = device.openblas_loaded
preload_openblas = device.preload_openblas


def default_blas_threads() -> None:
    """OpenBLAS back at its default count (every usable core), as another engine in this
    process would find it (bench runs mlx_lm here); the governor decides again at its next
    tick. Pins from `set_blas_threads` are cleared."""
    _PINNED.clear()
    n = device.blas_threads_setting() or _usable_cores()
    _set_threads(n)
    if _GOVERNOR and _GOVERNOR[0] is not None:
        _GOVERNOR[0].threads = None


_PINNED: list = []  # set by set_blas_threads: the count is the caller's, not the governor's


def set_blas_threads(n: int) -> bool:
    """openblas_set_num_threads(n) on the preloaded OpenBLAS (ctypes: the same handle the
    process already uses). -> False when OpenBLAS is not loaded (nothing to set)."""
    lib = _openblas()
    if lib is None:
        return False
    lib.openblas_set_num_threads(int(n))
    _PINNED[:] = [int(n)]  # an explicit count: the governor leaves it alone from now on
    return True


def blas_threads() -> int | None:
    """openblas_get_num_threads() of the preloaded OpenBLAS, or None when it is not loaded."""
    lib = _openblas()
    return int(lib.openblas_get_num_threads()) if lib is not None else None


def park_blas_threads() -> bool:
    """End OpenBLAS's worker threads now; its next threaded call starts them again (as after
    fork). An idle worker spins for ~2^28 cycles after each call (OPENBLAS_THREAD_TIMEOUT,
    read once at load), so a process about to sleep parks them to leave the cores to another
    process on the host. Call it only while no BLAS call runs. -> False when unavailable."""
    lib = _openblas()
    if lib is None or not hasattr(lib, "blas_thread_shutdown_"):
        return False
    lib.blas_thread_shutdown_()
    return True


class ThreadGovernor:
    """OpenBLAS's thread count, following the load that other processes put on this host.

    A threaded OpenBLAS call splits its GEMM over its threads and waits for all of them. When
    another process holds a core, the worker on that core runs late and every call of a
    decode step waits for it: measured on the 2-core CI machine under load, a step of 30 small
    GEMVs and one head GEMV took 49 ms on 1 thread and 626 ms on 2. On an idle host the
    second thread helps (the GEMVs are memory-bound and two cores stream faster).

    So every `period` seconds (checked at each `tick()`, which `Target.__call__` makes) it
    measures the CPU time the host spent outside this process at normal priority (/proc/stat
    minus os.times(); niced jobs yield to us and do not count), smooths it, and gives up one
    thread per core that another process keeps at least 3/4 busy: threads = cores - int(others +
    0.25), at least 1. A lighter load keeps every thread: a load-test client streaming 8 requests
    (~0.5 core) cost the server 10% at 1 thread against 2 (median of 4 alternating runs). After
    a pause in ticking (the process idled while another one worked) the next tick only starts a
    new sample: the load of the pause is the past, not the next step's. For some shapes OpenBLAS's threaded GEMM rounds differently from one
    thread (logits differ by ~1e-5), like a verify block against a decode step; greedy tokens
    stay the same (tests/test_blas.py), and set MLXSPEC_BLAS_THREADS=N for bitwise-repeatable
    runs. It does nothing where OpenBLAS is not loaded (macOS, the GPU),
    where the user fixed the count (MLXSPEC_BLAS_THREADS=N or OPENBLAS_NUM_THREADS) or where
    `set_blas_threads` pinned it (tensor-parallel ranks, which compute at once; pipeline
    stages are governed with the other stages counted as their own: `share_cores_with`).
    """

    def __init__(self, period: float = 0.5, cores: int | None = None, sample=None, apply=None, clock=None,
                 exclude=()):
        """exclude: process ids whose CPU counts as ours (pipeline stages on one host: they
        compute one at a time, each sleeps while another runs)."""
        import time

        self.period = period
        self._clock = clock or time.monotonic
        self._next = 0.0
        self.cores = cores or _usable_cores()
        self.exclude = list(exclude)
        # -> (host busy seconds, this process's (and the excluded ones') seconds, wall)
        self._sample = sample or (lambda: _cpu_sample(self.exclude))
        self._apply = apply or _set_threads
        self.others = 0.0  # smoothed cores busy outside this process
        self.threads: int | None = None
        self._last = None
        self.changes = 0

    def choose(self, others: float) -> int:
        return max(1, min(self.cores, self.cores - int(others + 0.25)))

    def tick(self) -> int | None:
        if self._clock() < self._next:  # the common case: one clock read
            return self.threads
        s = self._sample()
        if s is None:
            return self.threads
        if self._last is None:
            self._last = s
            return self.threads
        busy, mine, wall = (a - b for a, b in zip(s, self._last))
        if wall > 4 * self.period:  # no tick for a while: this process idled; sample afresh from now
            self._last, self._next = s, s[2] + self.period
            return self.threads
        if wall < self.period:
            self._next = self._last[2] + self.period
            return self.threads
        self._last, self._next = s, s[2] + self.period
        others = max(0.0, (busy - mine) / wall)
        self.others = others if self.threads is None else 0.5 * self.others + 0.5 * others
        n = self.choose(self.others)
        if n != self.threads:
            self._apply(n)
            self.changes += self.threads is not None
            self.threads = n
        return n


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


def _pid_cpu(pid: int) -> float:
    """CPU seconds (user + system) of another process, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, ValueError, IndexError):
        return 0.0


def _cpu_sample(exclude=()):
    """(host busy CPU seconds, this process's (plus `exclude`'s) CPU seconds, monotonic
    seconds), or None."""
    import time

    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # busy = user + system + irq + softirq + steal: not idle or iowait, and not `nice`, the
    # time of processes started below normal priority (a niced job yields its core to a
    # woken worker at once, so it does not make threaded calls wait)
    busy = v[0] + v[2] + sum(v[5:8])
    if os.getpriority(os.PRIO_PROCESS, 0) > 0:  # we are niced ourselves: our time is in `nice`
        busy += v[1]
    t = os.times()
    return busy / _TICKS, t.user + t.system + sum(_pid_cpu(p) for p in exclude), time.monotonic()


def _set_threads(n: int) -> None:
    lib = _openblas()
    if lib is not None:
        lib.openblas_set_num_threads(int(n))


_GOVERNOR: list = []


def govern() -> int | None:
    """One tick of the process's `ThreadGovernor` (created at the first call; None when the
    thread count is not ours to choose). -> the thread count in use, if governed."""
    if not _GOVERNOR:
        _GOVERNOR.append(ThreadGovernor() if _governable() else None)
    g = _GOVERNOR[0]
    return g.tick() if g is not None and not _PINNED else None


def _governable() -> bool:
    """The thread count is ours to choose: Linux, OpenBLAS loaded, no count fixed by the user."""
    return sys.platform.startswith("linux") and device.blas_threads_setting() is None and _openblas() is not None


def share_cores_with(pids) -> bool:
    """Let the governor choose this process's thread count again (undoing a pin), counting the
    CPU of `pids` as its own: processes that compute only while this one waits (the other
    pipeline stages on this host). -> True when governed (False: OpenBLAS not loaded, not
    Linux, or the user fixed the count)."""
    if not _governable():
        return False
    _PINNED.clear()
    _GOVERNOR.clear()
    _GOVERNOR.append(ThreadGovernor(exclude=pids))
    _set_threads(_GOVERNOR[0].cores)
    _GOVERNOR[0].threads = _GOVERNOR[0].cores
    return True


_LIB: list = []


def _openblas():
    if not _LIB:
        lib, path = None, _loaded_openblas_path()
        if path:  # the mapped file itself: a CDLL of another copy would be a second library
            try:
                import ctypes

                lib = ctypes.CDLL(path)
                lib.openblas_set_num_threads  # noqa: B018 - an OpenBLAS, not another BLAS
            except (OSError, AttributeError):
                lib = None
        _LIB.append(lib)
    return _LIB[0]


def _loaded_openblas_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            return next((ln.split()[-1] for ln in f if "libopenblas" in ln and "/" in ln), None)
    except OSError:
        return None


def blas_status() -> tuple[bool, str]:
    """(fast, message). Always fast off Linux (Accelerate / Metal / CUDA)."""
    if not sys.platform.startswith("linux"):
        return True, ""
    try:
        if device.current().gpu:
            return True, ""
    except Exception:
        pass
    if openblas_loaded():
        from mlxspec import cpu_gemm, cpu_jit

        return True, ("OpenBLAS preloaded" + ("; small-M GEMM in front" if cpu_gemm.active() else "")
                      + ("; MLX's kernels built for this CPU" if cpu_jit.active() else ""))
    lib = find_openblas()
    if lib:
        return False, (f"MLX is using reference BLAS (~60x slower matmul); run with "
                       f"LD_PRELOAD={lib}")
    return False, ("MLX is using reference BLAS (~60x slower matmul); install Debian's "
                   "libopenblas0-pthread (scripts/setup.sh does) and preload it")


def reexec_with_openblas(argv: list[str]) -> None:
    """Replace this process by the same command with OpenBLAS preloaded (Linux only)."""
    if not sys.platform.startswith("linux") or device.blas_reexec_disabled():
        return
    if openblas_loaded() or "mlx" in sys.modules:
        return
    lib = find_openblas()
    if not lib:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = (lib + " " + env["LD_PRELOAD"]).strip() if env.get("LD_PRELOAD") else lib
    env[device.NO_REEXEC_ENV] = "1"  # never loop
    os.execve(sys.executable, [sys.executable, "-m", "mlxspec", *argv], env)


if __name__ == "__main__":
    from mlxspec.cpu_gemm import preload_paths

    print(" ".join(preload_paths()))
