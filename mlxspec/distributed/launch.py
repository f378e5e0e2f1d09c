"""`mlxspec generate --ranks N`: N local ranks of the ring backend, started without `mlx.launch`.

`mlx.launch` relays every rank's stdin, stdout and stderr through one Python thread per rank.
Each thread select()s on the rank's stdin pipe for writing, which is always writable, so the
loop never sleeps: on this 2-core machine two ranks that only slept for 8 s cost 11.8
CPU-seconds under mlx.launch (1.47 of the 2 cores) and 1.9 here (the imports);
`scripts/bench_distributed.py --launcher mlx` shows what that takes from the ranks.

Here the ranks are plain children that inherit the terminal: rank 0 writes the output,
the other ranks' stdout goes to /dev/null (they print nothing) and their stderr to a file,
shown at the end where it says something rank 0 did not (a failing rank's own error line:
rank 0 only sees that it lost the rank; an error every rank hits is printed once).
The launcher then sleeps in wait() until a rank exits (one thread forwards rank 0's stderr
in blocking reads); it costs no CPU while they run. The
environment is what mlx.launch's ring backend sets (MLX_RANK, MLX_HOSTFILE with one free
127.0.0.1 port per rank, MLX_WORLD_SIZE), so the ranks run exactly the code they run under
mlx.launch. When one rank exits with an error the others get `GRACE_S` to report and stop
(rank 0 prints the one error line, as under mlx.launch), then are terminated.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from mlxspec.errors import MlxspecError

MAX_LOCAL_RANKS = 16
GRACE_S = 15.0  # after a rank fails, how long the others get to print their line and exit


def check_ranks(n) -> int:
    """--ranks: an int in 1..MAX_LOCAL_RANKS."""
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise MlxspecError(f"--ranks must be a whole number of local ranks, got {n!r}") from None
    if not 1 <= n <= MAX_LOCAL_RANKS:
        raise MlxspecError(f"--ranks {n}: give 1 to {MAX_LOCAL_RANKS} local ranks "
                           "(for other hosts use mlx.launch --hostfile, docs/distributed.md)")
    return n


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_env(rank: int, n: int, hostfile: str) -> dict:
    return dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=hostfile, MLX_WORLD_SIZE=str(n))


def without_ranks_flag(argv: list[str]) -> list[str]:
    """argv with every `--ranks N` / `--ranks=N` removed (the ranks must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--ranks":
            skip = True
            continue
        if a.startswith("--ranks="):
            continue
        out.append(a)
    return out


def launch_local(n: int, command: list[str], *, stdout=None) -> int:
    """Run `command` as ranks 0..n-1 of a ring job on 127.0.0.1 and wait -> an exit code.

    rank 0's stdout goes to `stdout` (default: ours) and its stderr to ours as it comes; the
    other ranks' stderr lines that rank 0 did not print come after. The code is rank 0's, or
    the first failing rank's when rank 0 exited 0."""
    ports = free_ports(n)
    fd, hostfile = tempfile.mkstemp(prefix="mlxspec-hosts-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    procs: list[subprocess.Popen] = []
    logs = [tempfile.TemporaryFile() for _ in range(n - 1)]
    seen: list[bytes] = []
    fwd = None
    try:
        for r in range(n):
            procs.append(subprocess.Popen(command, env=rank_env(r, n, hostfile), stdin=subprocess.DEVNULL,
                                          stdout=stdout if r == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.PIPE if r == 0 else logs[r - 1]))
            if r == 0:
                fwd = threading.Thread(target=_forward, args=(procs[0].stderr, seen), daemon=True)
                fwd.start()
        code = _wait(procs)
    except KeyboardInterrupt:  # the terminal sent SIGINT to every rank as well
        _stop(procs, GRACE_S)
        code = 130
    finally:
        _stop(procs, 0.0)
        os.unlink(hostfile)
    if fwd is not None:
        fwd.join(timeout=5)
    said = {ln.strip() for ln in b"".join(seen).splitlines()}
    for r, log in enumerate(logs, start=1):
        log.seek(0)
        for ln in log.read().splitlines():
            if ln.strip() and ln.strip() not in said:
                text = ln.decode(errors="replace")
                pre = "mlxspec: error: "
                print(f"{pre}rank {r}: {text[len(pre):]}" if text.startswith(pre) else f"[rank {r}] {text}",
                      file=sys.stderr)
                said.add(ln.strip())
        log.close()
    return code


def _forward(pipe, seen: list[bytes]) -> None:
    """rank 0's stderr to ours, chunk by chunk (blocking reads: asleep between them)."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while True:
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            break
        seen.append(chunk)
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stderr.write(chunk.decode(errors="replace"))


def _wait(procs: list[subprocess.Popen]) -> int:
    """Sleep until every rank exits; after the first failure give the rest GRACE_S."""
    codes: dict[int, int] = {}
    pids = {p.pid: r for r, p in enumerate(procs)}
    deadline = None
    while len(codes) < len(procs):
        if deadline is None:
            pid, status = os.waitpid(-1, 0)  # asleep until a child exits
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
                continue
        if pid not in pids:
            continue
        r = pids[pid]
        procs[r].returncode = code = os.waitstatus_to_exitcode(status)
        codes[r] = code
        if (code != 0 or r == 0) and deadline is None:
            deadline = time.monotonic() + GRACE_S
    failed = [c for r, c in sorted(codes.items()) if c != 0]
    if 0 not in codes:  # rank 0 did not exit within GRACE_S of another rank's failure
        return failed[0] if failed else 1
    if codes[0] != 0:
        return codes[0]
    if len(codes) < len(procs):  # rank 0 finished, another rank did not
        print(f"mlxspec: error: rank(s) {sorted(set(range(len(procs))) - set(codes))} did not exit "
              f"{GRACE_S:.0f} s after rank 0 finished; they were terminated", file=sys.stderr)
        return 2
    return failed[0] if failed else 0


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    end = time.monotonic() + grace
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(timeout=max(end - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def generate_command(argv: list[str]) -> list[str]:
    """The rank command for `mlxspec <argv>` (argv without --ranks)."""
    return [sys.executable, "-m", "mlxspec", *argv]


def main(argv: list[str] | None = None) -> int:
    """`python -m mlxspec.distributed.launch -n N -- CMD...`: any command as N local ranks
    (what `mlxspec generate --ranks N` does for itself; scripts and tests use it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mlxspec.distributed.launch")
    ap.add_argument("-n", type=int, default=2, help="local ranks")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command after --")
    try:
        n = check_ranks(a.n)
    except MlxspecError as e:
        print(f"mlxspec: error: {e}", file=sys.stderr)
        return 2
    return launch_local(n, cmd)


if __name__ == "__main__":
    sys.exit(main())
