"""The deadline on every blocking wait between ranks: a peer that is dead, stopped or
unreachable ends this rank with one line and exit code 2 instead of a hang."""

from __future__ import annotations

import os
import sys
import threading
import time

from mlxspec.errors import MlxspecError


GRACE = 1.0  # seconds a wait goes on after a peer's link closed before this rank gives up


class Watchdog:
    """Ends the process with one line when a guarded wait takes longer than `timeout`.

    A blocked collective cannot be interrupted from Python, so the watchdog thread prints
    and calls os._exit(2)."""

    probe = None  # -> a rank whose link closed, or None (`Links.closed_peer`, set by Links)

    def __init__(self, rank: int, size: int, timeout: float | None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._deadline = None
        self._what = ""
        self._lock = threading.Lock()
        if timeout:
            threading.Thread(target=self._run, daemon=True, name="mlxspec-watchdog").start()

    def peers(self, who: str | None = None) -> str:
        if who:
            return who
        others = [r for r in range(self.size) if r != self.rank]
        return f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ",".join(map(str, others))

    def _run(self):
        closed_at = None  # (the wait's deadline, when its peer's link was first seen closed)
        while True:
            time.sleep(0.2)
            with self._lock:
                d, what = self._deadline, self._what
            lost = self.probe() if d is not None and self.probe is not None else None
            # a closed link ends the rank only if the same wait is still going a second later: a
            # peer that finished and exited while this rank completes its last collective is not lost
            if lost is None:
                closed_at = None
            elif closed_at is None or closed_at[0] != d:
                closed_at = (d, time.monotonic())
            if closed_at is not None and time.monotonic() - closed_at[1] >= GRACE:
                print(f"mlxspec: error: rank {self.rank}: lost rank {lost} during {what} (its link closed); "
                      f"it died: check its log", file=sys.stderr, flush=True)
                os._exit(2)
            if d is not None and time.monotonic() > d:
                print(f"mlxspec: error: rank {self.rank}: {self.peers()} did not answer within "
                      f"{self.timeout:g}s ({what}); it is dead, stopped or unreachable", file=sys.stderr, flush=True)
                os._exit(2)

    def run(self, what: str, fn):
        """fn() under the deadline; a lost connection becomes one MlxspecError line."""
        with self._lock:
            self._deadline = time.monotonic() + self.timeout if self.timeout else None
            self._what = what
        try:
            return fn()
        except RuntimeError as e:
            msg = str(e)
            if "[ring]" in msg or "peer" in msg or "connection" in msg.lower() or "socket" in msg.lower():
                raise MlxspecError(f"rank {self.rank}: lost {self.peers()} during {what} ({msg.strip()})") from None
            raise
        finally:
            with self._lock:
                self._deadline = None
