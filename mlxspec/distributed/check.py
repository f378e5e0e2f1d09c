"""`--check`: after every forward all ranks all_gather (committed length, CRC32 of the
committed tokens, own KV length) and stop with one line on any difference."""

from __future__ import annotations

import time
import zlib

import mlx.core as mx

from mlxspec.errors import MlxspecError


class Check:
    def __init__(self, group, links, wd, stats):
        self.group, self.links, self.wd, self.stats = group, links, wd, stats
        self.rank = group.rank()
        self._hist: dict[int, list] = {}  # cache id -> tokens in that cache

    def forget(self, cid: int) -> None:
        self._hist.pop(cid, None)

    def __call__(self, cid: int, offset: int, toks: list, own: int) -> None:
        """All ranks agree on the committed tokens (CRC32) and hold that many KV positions
        (own: this rank's KV length after the forward)."""
        t0 = time.perf_counter()
        hist = self._hist.setdefault(cid, [])
        del hist[offset:]
        hist.extend(toks)
        mine = mx.array([offset, zlib.crc32(bytes(str(hist[:offset]), "ascii")) & 0x7FFFFFFF, own - len(toks)],
                        dtype=mx.int32)
        if self.links is not None:  # the others sleep until rank 0 rings (MLX's collectives poll)
            if self.rank == 0:
                for d in range(1, self.group.size()):
                    self.links.ring(d)
            else:
                self.links.wait(0, "--check all_gather")
        g = mx.distributed.all_gather(mine[None], group=self.group)
        rows = self.wd.run("--check all_gather", lambda: (mx.eval(g), g)[1]).tolist()
        self.stats.check_time += time.perf_counter() - t0
        for r, row in enumerate(rows):
            if row != rows[0]:
                raise MlxspecError(
                    f"rank {self.rank}: ranks diverged at position {offset}: rank 0 has (committed={rows[0][0]}, "
                    f"crc={rows[0][1]:08x}, kv={rows[0][2]}), rank {r} has (committed={row[0]}, crc={row[1]:08x}, kv={row[2]})")
