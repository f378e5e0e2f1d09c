"""The ranks' own blocking TCP links beside MLX's group (ring backend), and the hostfile
they are built from.

The ring backend's socket threads poll a pending receive (non-blocking sockets), so a rank
waiting in an MLX collective keeps a core busy, and each MLX message crosses four threads
(caller, stream, socket thread, the peer's socket thread). On these links a waiting rank
sleeps in recv(). They carry rank 0's per-forward header and, in pipeline mode, the
activations with it (one message per hop); an empty message is a doorbell before an MLX
collective (`--check`). Without an MLX_HOSTFILE (backends other than ring) there are none,
and MLX's own collectives carry everything.
"""

from __future__ import annotations

import json
import os
import socket
import struct

import mlx.core as mx
import numpy as np

from mlxspec.distributed.watchdog import Watchdog
from mlxspec.errors import MlxspecError


def hostfile_ips() -> list[str] | None:
    """Each rank's IP from mlx.launch's ring hostfile (a JSON list, per rank, of "ip:port")."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        return [str(h[0]).rsplit(":", 1)[0] for h in hosts]
    except (KeyError, OSError, ValueError, TypeError, IndexError):
        return None


def ranks_on_my_host(rank: int) -> int | None:
    """How many ranks share this rank's host (itself included); None without a hostfile."""
    ips = hostfile_ips()
    if ips is None or rank >= len(ips):
        return None
    return sum(1 for ip in ips if ip == ips[rank])


class Links:
    """One socket per pair of ranks (ports exchanged with one all_gather).

    A message: "<ii" (int32 words, payload bytes), the words, the payload."""

    park = None  # called before every sleep (DistTarget: OpenBLAS's spinning idle workers)
    local_pids: list | tuple = ()  # the other ranks on this host

    def __init__(self, socks: dict, wd: Watchdog):
        self.socks, self.wd = socks, wd
        wd.probe = self.closed_peer

    def closed_peer(self) -> int | None:
        """A peer whose link its kernel closed or reset (the process died), else None. Called by
        the watchdog thread during guarded waits: a rank killed inside an MLX collective is found
        here, not only by the deadline (the ring backend does not always raise on a dead peer).
        Peeks without consuming and without blocking; data waiting, or none, means alive."""
        for peer, s in list(self.socks.items()):
            try:
                if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return peer
            except BlockingIOError:
                continue  # nothing waiting: open
            except OSError:
                return peer  # reset
        return None

    @classmethod
    def connect(cls, group, wd: Watchdog):
        """-> Links, or None (one rank, or no ring hostfile)."""
        rank, n = group.rank(), group.size()
        ips = hostfile_ips()
        if n == 1 or ips is None or len(ips) != n:
            return None
        lst = socket.create_server((ips[rank], 0), backlog=n)
        got = mx.distributed.all_gather(mx.array([[lst.getsockname()[1], os.getpid()]], dtype=mx.int32), group=group)
        got = wd.run("exchanging link ports", lambda: (mx.eval(got), got)[1]).reshape(n, 2).tolist()
        ports, pids = [int(g[0]) for g in got], [int(g[1]) for g in got]
        socks = {}

        def wire():
            for peer in range(rank):  # connect to the lower ranks, accept the higher ones
                s = socket.create_connection((ips[peer], ports[peer]))
                s.sendall(struct.pack("<i", rank))
                socks[peer] = s
            for _ in range(rank + 1, n):
                s, _addr = lst.accept()
                socks[struct.unpack("<i", _recv_exact(s, 4))[0]] = s
        wd.run("connecting the links", wire)
        lst.close()
        for s in socks.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        links = cls(socks, wd)
        # the process ids of the ranks on this host (pipeline stages leave their CPU out of the
        # load their OpenBLAS thread count follows: mlxspec.blas.share_cores_with)
        links.local_pids = [pids[r] for r in range(n) if r != rank and ips[r] == ips[rank]]
        return links

    def send(self, dst: int, words=(), payload=b"") -> None:
        """One message to `dst`: int32 words and a payload (bytes, or an evaluated mx.array)."""
        data = np.asarray(payload).tobytes() if isinstance(payload, mx.array) else bytes(payload)
        msg = struct.pack(f"<ii{len(words)}i", len(words), len(data), *words) + data
        try:
            self.socks[dst].sendall(msg)
        except OSError as e:  # reset / broken pipe: the peer is gone
            raise MlxspecError(f"rank {self.wd.rank}: lost rank {dst} ({e.strerror or e})") from None

    def recv(self, src: int, what: str) -> tuple[list[int], bytearray]:
        """The next message from `src` (asleep until it comes) -> (words, payload)."""
        if self.park is not None:
            self.park()

        def one():
            s = self.socks[src]
            try:
                nw, nb = struct.unpack("<ii", _recv_exact(s, 8))
                words = list(struct.unpack(f"<{nw}i", _recv_exact(s, 4 * nw))) if nw else []
                return words, _recv_exact(s, nb) if nb else bytearray()
            except OSError as e:  # reset, or closed (ConnectionError from _recv_exact)
                raise MlxspecError(f"rank {self.wd.rank}: lost rank {src} during {what} ({e.strerror or e})") from None
        return self.wd.run(what, one)

    def ring(self, dst: int) -> None:
        self.send(dst)

    def wait(self, src: int, what: str) -> None:
        self.recv(src, what)


def _recv_exact(s: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return buf
