"""`DistTarget`: a `Target` whose forwards run on every rank of the group.

Rank 0 (the leader) runs the unchanged speculative loop with the drafter, the sampler and
the RNG, and alone decides what is accepted and committed. Before each target forward its
`DistTarget` sends the header (`mlxspec.distributed.header`), so the other ranks run the
same forward on their share of the weights and trim their KV caches to the same committed
length. Nothing else crosses ranks: the drafter's tokens reach them inside that header,
which the verify forward needs anyway. Tensor parallel: every rank runs mlx-lm's sharded
graph, whose all-reduces replicate the residual stream, so rank 0 holds every tapped layer's
hidden state. Pipeline parallel: `mlxspec.distributed.pipeline.Stages`.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import mlx.core as mx

from mlxspec.distributed import header
from mlxspec.distributed.check import Check
from mlxspec.distributed.links import Links
from mlxspec.distributed.pipeline import Stages
from mlxspec.distributed.plan import choose_mode, shard_tensor_parallel
from mlxspec.distributed.watchdog import Watchdog
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import Target, cache_length, trim_cache


@dataclass
class DistStats:
    forwards: int = 0
    header_time: float = 0.0  # sending the header (leader) / waiting for it (followers)
    forward_time: float = 0.0  # the forward incl. its collectives (tensor) / send+recv (pipeline)
    comm_time: float = 0.0  # pipeline: time blocked in send/recv (incl. idle_time)
    idle_time: float = 0.0  # pipeline: asleep until the previous stage has its output
    check_time: float = 0.0
    extra: dict = field(default_factory=dict)


class _CacheList(list):
    """A target cache that remembers its id (so the other ranks use their copy)."""

    cid: int = 0


class DistTarget(Target):
    """A `Target` whose forwards run on every rank of `group`.

    Rank 0 uses it like any Target (generate_steps, the drafters, the API). The other ranks
    call `serve()`, which returns when rank 0 calls `close()` (or leaves `with target:`).
    """

    def __init__(self, inner: Target, group, watchdog: Watchdog, mode: str = "auto", check: bool = False):
        super().__init__(inner.model, inner.config, source=inner.info.source, notes=inner.info.notes)
        self.base = inner
        self.group, self.wd = group, watchdog
        self.rank, self.size = group.rank(), group.size()
        self.stats = DistStats()
        self._next_cid = 1
        self._freed: list[int] = []
        self._caches: dict[int, list] = {}  # follower: cid -> its KV cache
        self._closed = False
        self.mode, self.reason = choose_mode(inner, self.size, mode)
        self.links = Links.connect(group, watchdog) if self.size > 1 else None
        self.check = check  # rank 0's flag; a follower follows the header's
        self._checker = Check(group, self.links, watchdog, self.stats) if self.size > 1 else None
        self.pipe = Stages(self, group, self.links, watchdog, self.stats) if self.mode == "pipeline" else None
        if self.mode == "tensor":
            shard_tensor_parallel(self, group)
        self.blas_threads = self.pipe.blas_threads if self.pipe else None
        # pipeline over the links: the header travels with the activations, stage by stage
        self.chained = self.pipe is not None and self.links is not None

    def describe(self) -> str:
        if self.mode == "tensor":
            return f"{self.size} ranks, tensor parallel (mlx-lm {self.info.model_type}.shard)"
        if self.mode == "pipeline":
            return f"{self.size} ranks, pipeline parallel (layers {self.pipe.describe()}; {self.reason or 'requested'})"
        return "1 rank"

    # -- Target interface -----------------------------------------------------------
    def make_cache(self) -> list:
        c = self.pipe.make_cache() if self.pipe else self.base.make_cache()
        try:
            c.cid = self._next_cid
        except AttributeError:  # a plain list
            c = _CacheList(c)
            c.cid = self._next_cid
        self._next_cid += 1
        if self.size > 1:
            weakref.finalize(c, self._freed.append, c.cid)
        return c

    def __call__(self, tokens, cache, taps=(), logits="all"):
        if self.size == 1:
            return self.base(tokens, cache, taps=taps, logits=logits)
        if self._closed:
            raise MlxspecError("the distributed target was closed")
        toks = [int(t) for t in tokens.reshape(-1).tolist()]
        taps = tuple(int(t) for t in taps)
        if len(taps) > header.MAX_TAPS:
            raise MlxspecError(f"{len(taps)} taps; the distributed header carries at most {header.MAX_TAPS}")
        cid = getattr(cache, "cid", 0)
        if not cid:
            raise MlxspecError("distributed target: use a cache from target.make_cache()")
        freed = self._freed.pop() if self._freed else 0
        self._checker.forget(freed)
        offset = cache_length(cache)
        hdr = header.forward_header(cid, offset, len(toks), logits, taps, freed, self.check)
        t0 = time.perf_counter()
        if not self.chained:
            self._send_header(hdr, toks)
        t1 = time.perf_counter()
        self.stats.header_time += t1 - t0
        out = self._forward(tokens, cache, taps, logits, hdr + toks)
        self.stats.forward_time += time.perf_counter() - t1
        self.stats.forwards += 1
        if self.check:
            self._checker(cid, offset, toks, self._own_length(cache))
        return out

    def _own_length(self, cache) -> int:
        return self.pipe.own_length(cache) if self.pipe else cache_length(cache)

    # -- the header -------------------------------------------------------------------
    def _send_header(self, hdr: list, toks: list) -> None:
        if self.links is not None:
            for d in range(1, self.size):
                self.links.send(d, hdr + toks)
        else:
            self._bcast_header(hdr, toks)

    def _next_header(self):
        """Follower: the next header -> (header words, tokens, payload: the activations that
        came with it, chained pipeline only)."""
        if self.links is None:
            h, toks = self._bcast_header([], [])
            return h, toks, None
        src = self.rank - 1 if self.chained else 0
        words, payload = self.links.recv(src, "header broadcast" if src == 0 else f"receiving activations from rank {src}")
        if not words:
            raise MlxspecError(f"rank {self.rank}: an empty message from rank {src} (version mismatch?)")
        h, toks = header.split(words)
        return h, toks, payload

    def _bcast(self, arr: mx.array, what: str) -> mx.array:
        out = mx.distributed.all_sum(arr, group=self.group)  # others contribute zeros: exact
        return self.wd.run(what, lambda: (mx.eval(out), out)[1])

    def _bcast_header(self, hdr: list, toks: list):
        """Over MLX's collectives (no links): one all_sum of header.WORDS int32."""
        h = mx.array(header.pack_words(hdr, toks), dtype=mx.int32) if self.rank == 0 \
            else mx.zeros((header.WORDS,), dtype=mx.int32)
        h = self._bcast(h, "header broadcast").tolist()
        if h[0] == header.FWD:
            toks = header.inline_tokens(h)
            if toks is None:
                L = h[3]
                t = mx.array(toks, dtype=mx.int32) if self.rank == 0 else mx.zeros((L,), dtype=mx.int32)
                toks = self._bcast(t, "token broadcast").tolist()
        return h, toks

    def close(self):
        """Leader: tell the other ranks to leave `serve()`. Safe to call twice."""
        if self.size == 1 or self._closed:
            self._closed = True
            return
        self._closed = True
        if self.rank == 0:
            if self.chained:
                self.links.send(1, header.stop_header())  # passed on stage by stage
            else:
                self._send_header(header.stop_header(), [])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()
            return False
        try:  # leaving on an error: still tell the followers, but the peers may be gone already,
            self.close()  # and the error that brought us here is the one to report
        except (MlxspecError, OSError):
            pass
        return False

    def serve(self):
        """Follower loop: run the leader's forwards until it calls close()."""
        if self.rank == 0:
            raise MlxspecError("serve() is for ranks other than 0; rank 0 generates")
        while True:
            t0 = time.perf_counter()
            h, toks, payload = self._next_header()
            self.stats.header_time += time.perf_counter() - t0
            if h[0] == header.STOP:
                self._closed = True
                if self.chained and self.rank + 1 < self.size:
                    self.links.send(self.rank + 1, header.stop_header())
                return
            if h[0] != header.FWD:
                raise MlxspecError(f"rank {self.rank}: unknown command {h[0]} from rank 0 (version mismatch?)")
            _, cid, offset, L, mode, ntaps, freed, check = h[:header.FIXED]
            taps = tuple(h[header.FIXED:header.FIXED + ntaps])
            if freed:
                self._caches.pop(freed, None)
                self._checker.forget(freed)
            if cid not in self._caches:
                self._caches[cid] = self.make_cache()
            cache = self._caches[cid]
            own = self._own_length(cache)
            if own < offset:
                raise MlxspecError(f"rank {self.rank}: holds {own} positions, rank 0 expects {offset}")
            trim_cache(cache, own - offset)
            t1 = time.perf_counter()
            self._forward(mx.array([toks]), cache, taps, header.MODE_NAMES[mode],
                          h[:header.FIXED + ntaps] + toks, payload)
            self.stats.forward_time += time.perf_counter() - t1
            self.stats.forwards += 1
            if check:
                self._checker(cid, offset, toks, self._own_length(cache))

    def _forward(self, tokens, cache, taps, logits, words=(), payload=None):
        if self.mode == "tensor":
            # Every rank runs the same sharded graph; all its all-reduces happen here.
            mode = logits if (self.rank == 0 or logits == "none") else "last"
            lg, tp = self.base(tokens, cache, taps=taps, logits=mode)
            self.wd.run("tensor-parallel forward", lambda: mx.eval([x for x in (lg, tp) if x is not None]))
            return lg, tp
        return self.pipe.forward(tokens, cache, taps, logits, lambda h: self.lm_head(self.inner.norm(h)),
                                 words, payload)
