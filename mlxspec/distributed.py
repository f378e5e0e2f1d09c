"""The target sharded over several processes (`mlx.launch`), speculation on top.

Design (one decider, N-1 target servers):
  * Every rank loads the target. It is sharded with mlx-lm's own `model.shard(group)`
    (tensor parallel: attention heads and MLP columns split, one all-reduce after
    `o_proj` and one after `down_proj`) when the class has `shard` and the head / KV-head /
    MLP sizes divide by the number of ranks; otherwise the layers are split into
    contiguous stages (pipeline parallel, activations passed with send/recv).
  * Rank 0 (the leader) runs the unchanged speculative loop
    (`mlxspec.engine.loop.generate_steps`) with the drafter, the sampler and the RNG; it
    alone decides what is accepted and committed. Its target is a `DistTarget`: before
    every target forward it broadcasts one small int32 header (cache id, committed length,
    the tokens to run, tap ids, logits mode), so the other ranks run the same forward on
    their shard of the weights and trim their KV caches to the same committed length.
    Nothing else crosses ranks: the drafter runs on rank 0 only (its tokens reach the other
    ranks inside that header, which the verify forward needs anyway).
  * Taps: with tensor parallelism the residual stream is replicated after each all-reduce,
    so rank 0 already holds every tapped layer's full hidden state. With pipeline
    parallelism each stage appends the taps of its own layers to the activation it passes
    on, and the last stage sends [final hidden, taps] back to rank 0, which applies the
    final norm and the LM head.
  * `--check`: after every forward all ranks all_gather (committed length, CRC32 of the
    committed tokens, own KV length) and stop with one line on any difference.
  * Failures: every blocking collective runs under a watchdog. A peer that died
    (connection lost) or does not answer within `timeout` seconds ends the process with
    one line naming it and exit code 2; nothing hangs.

Run it: `mlx.launch --backend ring --hosts 127.0.0.1 -n 2 -- .venv/bin/mlxspec generate ...`
(`mlxspec generate` switches to this module when launched with MLX_RANK set).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask

from mlxspec import api
from mlxspec.args import (
    check_blas,
    check_generate_args,
    print_generation,
    prompt_ids,
    read_prompt,
)
from mlxspec.blas import park_blas_threads, set_blas_threads
from mlxspec.errors import MlxspecError
from mlxspec.targets.load import load_target
from mlxspec.targets.model import Target, cache_length, trim_cache

DEFAULT_TIMEOUT = 120.0
_HDR = 64  # int32 words per header broadcast
_MAX_TAPS = 16
_STOP, _FWD = 1, 2
_MODES = {"all": 0, "last": 1, "none": 2}
_MODE_NAMES = {v: k for k, v in _MODES.items()}


# ----------------------------------------------------------------------------- watchdog
class Watchdog:
    """Ends the process with one line when a guarded collective takes longer than `timeout`.

    A blocked collective cannot be interrupted from Python, so the watchdog thread prints
    and calls os._exit(2)."""

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
        while True:
            time.sleep(0.2)
            with self._lock:
                d, what = self._deadline, self._what
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


# ----------------------------------------------------------------------------- links
class Links:
    """Blocking TCP sockets beside MLX's group, one per pair of ranks (ring backend).

    The ring backend's socket threads poll a pending receive (non-blocking sockets), so a rank
    waiting in an MLX collective keeps a core busy, and each MLX message crosses four threads
    (caller, stream, socket thread, peer's socket thread). On these links a waiting rank sleeps
    in recv(). They carry rank 0's per-forward header and, in pipeline mode, the activations
    (with the header, one message per hop); an empty message is a doorbell before an MLX
    collective (`--check`). One socket per pair (ports exchanged with one all_gather). Off
    (None from `connect`) without an MLX_HOSTFILE (backends other than ring): MLX's own
    collectives carry everything then.

    A message: "<ii" (int32 words, payload bytes), the words, the payload."""

    park = None  # called before every sleep (DistTarget: OpenBLAS's spinning idle workers)

    def __init__(self, socks: dict, wd: Watchdog):
        self.socks, self.wd = socks, wd

    @classmethod
    def connect(cls, group, wd: Watchdog):
        rank, n = group.rank(), group.size()
        ips = _ring_ips()
        if n == 1 or ips is None or len(ips) != n:
            return None
        lst = socket.create_server((ips[rank], 0), backlog=n)
        ports = mx.distributed.all_gather(mx.array([[lst.getsockname()[1]]], dtype=mx.int32), group=group)
        ports = [int(p) for p in wd.run("exchanging link ports", lambda: (mx.eval(ports), ports)[1]).reshape(-1).tolist()]
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
        return cls(socks, wd)

    def send(self, dst: int, words=(), payload=b"") -> None:
        """One message to `dst`: int32 words and a payload (bytes, or an evaluated float32
        mx.array)."""
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


def _ring_ips() -> list[str] | None:
    """Each rank's IP from mlx.launch's ring hostfile (a JSON list, per rank, of "ip:port")."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        return [str(h[0]).rsplit(":", 1)[0] for h in hosts]
    except (KeyError, OSError, ValueError, TypeError, IndexError):
        return None


def limit_blas_threads(rank: int) -> int | None:
    """Ranks on one host share its cores: OpenBLAS's threads per rank = cores / ranks on this
    host while they all work at once (loading; tensor parallel). Its idle threads spin, so 2
    ranks x 2 threads on 2 cores slowed every matmul ~10x (measured). Left alone when
    OPENBLAS_NUM_THREADS is set. -> the thread count set, or None. (Pipeline stages take
    every core afterwards: `DistTarget._blas_policy`.)"""
    ips = _ring_ips()
    if os.environ.get("OPENBLAS_NUM_THREADS") or ips is None or rank >= len(ips):
        return None
    local = sum(1 for ip in ips if ip == ips[rank])
    n = max(1, (os.cpu_count() or 1) // local)
    return n if set_blas_threads(n) else None


# ----------------------------------------------------------------------------- group / plan
def init(timeout: float | None = DEFAULT_TIMEOUT):
    """The world group (size 1 when not launched by mlx.launch) and its watchdog."""
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    size_hint = int(os.environ.get("MLX_WORLD_SIZE", "0") or 0)
    wd = Watchdog(rank, max(size_hint, 2) if os.environ.get("MLX_RANK") else 1, timeout)
    try:
        group = wd.run("connecting to the other ranks", lambda: mx.distributed.init())
    except MlxspecError:
        raise
    except Exception as e:  # noqa: BLE001 - backend errors are one line
        raise MlxspecError(f"rank {rank}: cannot join the distributed group: {str(e).splitlines()[0]}") from None
    wd.rank, wd.size = group.rank(), group.size()
    if wd.size > 1:
        limit_blas_threads(wd.rank)
    return group, wd


def tensor_parallel_reason(model, n: int) -> str | None:
    """None when `model.shard` (mlx-lm) can split this model over n ranks, else why not."""
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm's {type(model).__module__.rsplit('.', 1)[-1]} class has no shard()"
    args = getattr(model, "args", None)
    for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(args, k, None)
        if isinstance(v, int) and v % n:
            return f"{k}={v} does not divide by {n} ranks"
    return None


def split_layers(num_layers: int, n: int) -> list[tuple[int, int]]:
    """Contiguous stages, the first ones one layer longer when it does not divide."""
    base, extra = divmod(num_layers, n)
    out, a = [], 0
    for s in range(n):
        b = a + base + (1 if s < extra else 0)
        out.append((a, b))
        a = b
    return out


@dataclass
class DistStats:
    forwards: int = 0
    header_time: float = 0.0  # broadcasting the header (leader: send; follower: wait)
    forward_time: float = 0.0  # the forward incl. its collectives (tensor) / send+recv (pipeline)
    comm_time: float = 0.0  # pipeline: time blocked in send/recv (incl. idle_time)
    idle_time: float = 0.0  # pipeline: asleep until the previous stage has its output
    check_time: float = 0.0
    extra: dict = field(default_factory=dict)


def _words(hdr: list, toks: list) -> list[int]:
    return list(hdr) + list(toks)


class _CacheList(list):
    """A target cache that remembers its id (so the other ranks use their copy)."""

    cid: int = 0


# ----------------------------------------------------------------------------- DistTarget
class DistTarget(Target):
    """A `Target` whose forwards run on every rank of `group`.

    Rank 0 uses it like any Target (generate_steps, the drafters, the API). The other ranks
    call `serve()`, which returns when rank 0 calls `close()`.
    """

    def __init__(self, inner: Target, group, watchdog: Watchdog, mode: str = "auto", check: bool = False):
        self.__dict__.update(inner.__dict__)  # model, config, info, ... (Target's own attributes)
        self.base = inner
        self.group, self.wd, self.check = group, watchdog, check
        self.rank, self.size = group.rank(), group.size()
        self.stats = DistStats()
        self._next_cid = 1
        self._freed: list[int] = []
        self._caches: dict[int, list] = {}  # follower: cid -> its KV cache
        self._hist: dict[int, list] = {}  # cid -> tokens in that cache (for --check)
        self._closed = False
        n = self.size
        self.links = Links.connect(group, watchdog) if n > 1 else None
        why = tensor_parallel_reason(inner.model, n) if n > 1 else None
        if mode == "auto":
            mode = "tensor" if why is None else "pipeline"
        if mode == "tensor" and n > 1 and why is not None:
            raise MlxspecError(f"--dist-mode tensor: {why}; use --dist-mode pipeline")
        if mode not in ("tensor", "pipeline"):
            raise MlxspecError(f"--dist-mode {mode!r} is not one of auto, tensor, pipeline")
        self.mode = mode if n > 1 else "single"
        self.reason = why
        layers = inner.model.model.layers
        if n > 1 and mode == "pipeline" and len(layers) < n:
            raise MlxspecError(f"pipeline parallel needs at least {n} layers, the target has {len(layers)}")
        self.stages = split_layers(len(layers), n)
        if n > 1:
            from mlx_lm.models.cache import make_prompt_cache

            kinds = sorted({type(c).__name__ for c in make_prompt_cache(inner.model)})
            if set(kinds) - {"KVCache", "RotatingKVCache"}:
                raise MlxspecError(f"{self.info.model_type}: {', '.join(kinds)} caches are not supported across ranks "
                                   "yet (their rollback replays layers); run it on one rank")
        if self.mode == "tensor":
            try:
                inner.model.shard(group)
            except Exception as e:  # noqa: BLE001 - mlx-lm's own error, as one line
                raise MlxspecError(f"mlx-lm's {self.info.model_type}.shard() failed over {n} ranks: "
                                   f"{str(e).splitlines()[0]}; use --dist-mode pipeline") from None
            mx.eval(inner.model.parameters())
        elif self.mode == "pipeline":
            from mlx.utils import tree_map
            from mlx_lm.models.cache import KVCache, make_prompt_cache

            kinds = sorted({type(c).__name__ for c in make_prompt_cache(inner.model)})
            if kinds != ["KVCache"]:
                raise MlxspecError(f"pipeline parallel supports plain KV caches only; {self.info.model_type} uses "
                                   f"{', '.join(kinds)} (and cannot be tensor parallel: {why})")
            self._kv = KVCache
            a, b = self.stages[self.rank]
            for i, layer in enumerate(layers):  # drop the other stages' weights, keep the modules
                if not a <= i < b:
                    layer.update(tree_map(lambda x: mx.zeros((0,), dtype=x.dtype), layer.parameters()))
            mx.eval(inner.model.parameters())
        self.blas_threads = self._blas_policy()
        norm = getattr(layers[self.stages[self.rank][0]], "input_layernorm", None)
        self.act_dtype = norm.weight.dtype if norm is not None else mx.float32

    def _blas_policy(self) -> int | None:
        """OpenBLAS threads for this rank now that the mode is known -> the count set, or None
        (left as `init` set it: cores / ranks on this host).

        Pipeline stages over the links run one at a time (one request goes through them in
        order), and a waiting stage sleeps in recv(): the working rank can have every core of
        the host. Its idle OpenBLAS workers would spin for ~0.1 s after each call, on the
        core the next stage needs, so a rank that shares its host parks them before each sleep
        (`mlxspec.blas.park_blas_threads`). Tensor-parallel ranks compute at the same time: one
        share of the cores each. OPENBLAS_NUM_THREADS, when set, is left alone."""
        if not self._chained:
            return None
        ips = _ring_ips() or []
        local = sum(1 for ip in ips if ip == ips[self.rank]) if self.rank < len(ips) else 1
        if local > 1:
            self.links.park = park_blas_threads
        if os.environ.get("OPENBLAS_NUM_THREADS"):
            return None
        n = os.cpu_count() or 1
        return n if set_blas_threads(n) else None

    def describe(self) -> str:
        if self.mode == "tensor":
            return f"{self.size} ranks, tensor parallel (mlx-lm {self.info.model_type}.shard)"
        if self.mode == "pipeline":
            st = " ".join(f"r{r}:{a}-{b - 1}" for r, (a, b) in enumerate(self.stages))
            return f"{self.size} ranks, pipeline parallel (layers {st}; {self.reason or 'requested'})"
        return "1 rank"

    # -- Target interface -----------------------------------------------------------
    def make_cache(self) -> list:
        c = self._new_cache()
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
        if len(taps) > _MAX_TAPS:
            raise MlxspecError(f"{len(taps)} taps; the distributed header carries at most {_MAX_TAPS}")
        cid = getattr(cache, "cid", 0)
        if not cid:
            raise MlxspecError("distributed target: use a cache from target.make_cache()")
        freed = self._freed.pop() if self._freed else 0
        self._hist.pop(freed, None)
        offset = cache_length(cache)
        hdr = [_FWD, cid, offset, len(toks), _MODES[logits], len(taps), freed, int(self.check)] + list(taps)
        t0 = time.perf_counter()
        if not self._chained:
            self._send_header(hdr, toks)
        t1 = time.perf_counter()
        self.stats.header_time += t1 - t0
        out = self._forward(tokens, cache, taps, logits, words=_words(hdr, toks))
        self.stats.forward_time += time.perf_counter() - t1
        self.stats.forwards += 1
        if self.check:
            self._check(cid, offset, toks, cache)
        return out

    def _new_cache(self) -> list:
        if self.mode == "pipeline":
            return [self._kv() for _ in self.model.model.layers]
        return self.base.make_cache()

    def _own_length(self, cache) -> int:
        """Positions in this rank's part of the cache."""
        if self.mode == "pipeline":
            return int(cache[self.stages[self.rank][0]].offset)
        return cache_length(cache)

    # -- protocol -------------------------------------------------------------------
    # The header: [command, cache id, committed length, L, logits mode, n taps, freed cache id,
    # check] + taps (+ the L tokens). Over the links (ring backend) rank 0 sends it to every
    # rank (tensor parallel), or it travels with the activations from stage to stage
    # (pipeline: `_chained`, one message per hop). Otherwise it is one MLX all_sum of _HDR
    # int32 words (rank 0's values, zeros elsewhere), the tokens inline or in a second one.
    @property
    def _chained(self) -> bool:
        return self.links is not None and self.mode == "pipeline"

    def _send_header(self, hdr: list, toks: list) -> None:
        if self.links is not None:
            for d in range(1, self.size):
                self.links.send(d, _words(hdr, toks))
            return
        self._bcast_header(hdr, toks)

    def _next_header(self):
        """Follower: the next header -> (header words, tokens, payload: the activations that
        came with it, chained pipeline only)."""
        if self.links is None:
            h, toks = self._bcast_header([], [])
            return h, toks, None
        src = self.rank - 1 if self._chained else 0
        words, payload = self.links.recv(src, "header broadcast" if src == 0 else f"receiving activations from rank {src}")
        if not words:
            raise MlxspecError(f"rank {self.rank}: an empty message from rank {src} (version mismatch?)")
        n = 8 + words[5]
        return words[:n] + [0] * (8 + _MAX_TAPS - n), words[n:], payload

    def _bcast(self, arr: mx.array, what: str) -> mx.array:
        out = mx.distributed.all_sum(arr, group=self.group)  # others contribute zeros: exact
        return self.wd.run(what, lambda: (mx.eval(out), out)[1])

    def _bcast_header(self, hdr: list, toks: list):
        room = _HDR - 8 - _MAX_TAPS
        h = mx.zeros((_HDR,), dtype=mx.int32)
        if self.rank == 0:
            body = hdr + [0] * (8 + _MAX_TAPS - len(hdr))
            inline = toks if len(toks) <= room else []
            h = mx.array(body + inline + [0] * (room - len(inline)), dtype=mx.int32)
        h = self._bcast(h, "header broadcast").tolist()
        if h[0] == _FWD:
            L = h[3]
            if L <= room:
                toks = h[8 + _MAX_TAPS: 8 + _MAX_TAPS + L]
            else:
                t = mx.array(toks, dtype=mx.int32) if self.rank == 0 else mx.zeros((L,), dtype=mx.int32)
                toks = self._bcast(t, "token broadcast").tolist()
        return h, toks

    def _ring_or_wait(self, src: int, what: str, dsts=None):
        """Before an MLX collective that `src` starts: src rings `dsts` (default: every other
        rank), they sleep until it does (see `Links`)."""
        if self.links is None:
            return
        dsts = [r for r in range(self.size) if r != src] if dsts is None else dsts
        if self.rank == src:
            for d in dsts:
                self.links.ring(d)
        elif self.rank in dsts:
            self.links.wait(src, what)

    def close(self):
        """Leader: tell the other ranks to leave `serve()`. Safe to call twice."""
        if self.size == 1 or self._closed:
            self._closed = True
            return
        self._closed = True
        if self.rank == 0:
            stop = [_STOP, 0, 0, 0, 0, 0, 0, 0]
            if self._chained:
                self.links.send(1, stop)  # passed on stage by stage
            else:
                self._send_header(stop, [])

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
            if h[0] == _STOP:
                self._closed = True
                if self._chained and self.rank + 1 < self.size:
                    self.links.send(self.rank + 1, h[:8])
                return
            if h[0] != _FWD:
                raise MlxspecError(f"rank {self.rank}: unknown command {h[0]} from rank 0 (version mismatch?)")
            _, cid, offset, L, mode, ntaps, freed, check = h[:8]
            taps = tuple(h[8:8 + ntaps])
            if freed:
                self._caches.pop(freed, None)
                self._hist.pop(freed, None)
            if cid not in self._caches:
                self._caches[cid] = self._new_cache()
            cache = self._caches[cid]
            own = self._own_length(cache)
            if own < offset:
                raise MlxspecError(f"rank {self.rank}: holds {own} positions, rank 0 expects {offset}")
            trim_cache(cache, own - offset)
            t1 = time.perf_counter()
            out = self._forward(mx.array([toks]), cache, taps, _MODE_NAMES[mode],
                                words=_words(h[:8 + ntaps], toks), payload=payload)
            self.stats.forward_time += time.perf_counter() - t1
            self.stats.forwards += 1
            del out
            if check:
                self._check(cid, offset, toks, cache)

    # -- forwards -------------------------------------------------------------------
    def _forward(self, tokens, cache, taps, logits, words=(), payload=None):
        if self.mode == "tensor":
            # Every rank runs the same sharded graph; all its all-reduces happen here.
            mode = logits if (self.rank == 0 or logits == "none") else "last"
            lg, tp = self.base(tokens, cache, taps=taps, logits=mode)
            self.wd.run("tensor-parallel forward", lambda: mx.eval([x for x in (lg, tp) if x is not None]))
            return lg, tp
        return self._pipeline_forward(tokens, cache, taps, logits, words, payload)

    def _pipeline_forward(self, tokens, cache, taps, logits, words, payload):
        inner = self.model.model
        r, n = self.rank, self.size
        a, b = self.stages[r]
        L = tokens.shape[1]
        st = self.stages
        # taps carried along from stages 1..r-1, stage by stage (within a stage in request order)
        prev_taps = [t for s in range(1, r) for t in taps if st[s][0] <= t < st[s][1]]
        if r == 0:
            h = inner.embed_tokens(tokens)
            carried = []
        else:
            h, carried = self._stage_input(L, len(prev_taps), r - 1, payload,
                                           f"receiving activations from rank {r - 1}")
        mask = create_attention_mask(h, cache[a])
        mine = {}
        for i in range(a, b):
            h = inner.layers[i](h, mask, cache=cache[i])
            if i in taps:
                mine[i] = h
        if r == 0:
            local = {t: mine[t] for t in taps if t in mine}
            if n > 1:
                self._stage_output(h.astype(mx.float32), 1, words)
                later = [t for s in range(1, n) for t in taps if st[s][0] <= t < st[s][1]]
                h, back = self._stage_input(L, len(later), n - 1, None,
                                            f"receiving the last stage's output from rank {n - 1}")
                local.update({t: p.astype(self.act_dtype) for t, p in zip(later, back)})
            tap_out = mx.concatenate([local[t] for t in taps], axis=-1) if taps else None
            if logits == "none":
                out = (None, tap_out)
            else:
                hh = h[:, -1:] if logits == "last" else h
                out = (self.lm_head(inner.norm(hh)), tap_out)
            mx.eval([x for x in out if x is not None])
            return out
        new = [mine[t].astype(mx.float32) for t in taps if a <= t < b]
        dst = (r + 1) % n
        self._stage_output(mx.concatenate([h.astype(mx.float32)] + [c for c in carried] + new, axis=-1), dst,
                           words if dst else ())
        return None, None

    def _stage_output(self, msg: mx.array, dst: int, words=()) -> None:
        """This stage's [hidden | taps] (float32) to rank `dst`: computed first, then sent
        (over the links with the header words for the next stage, or MLX send after a ring)."""
        mx.eval(msg)
        tc = time.perf_counter()
        if self.links is not None:
            self.links.send(dst, words, msg)
        else:
            send = mx.distributed.send(msg, dst, group=self.group)
            self.wd.run(f"sending activations to rank {dst}", lambda: mx.eval(send))
        self.stats.comm_time += time.perf_counter() - tc

    def _stage_input(self, L: int, n_taps: int, src: int, payload, what: str):
        """[hidden | n_taps taps] of L positions from rank `src` (float32 on the wire): the
        payload that came with the header, or the next message -> (hidden in the activation
        dtype, [taps] still float32: a middle stage passes them on as they came)."""
        H = self.info.hidden_size
        shape = (1, L, H * (1 + n_taps))
        tc = time.perf_counter()
        if payload is None and self.links is not None:
            _, payload = self.links.recv(src, what)  # asleep until `src` has its output ready
        if payload is not None:
            self.stats.idle_time += time.perf_counter() - tc
            if len(payload) != 4 * L * shape[2]:
                raise MlxspecError(f"rank {self.rank}: {len(payload)} bytes of activations from rank {src}, "
                                   f"expected {4 * L * shape[2]} (version mismatch?)")
            x = mx.array(np.frombuffer(payload, dtype=np.float32).reshape(shape))
        else:
            x = mx.distributed.recv(shape, mx.float32, src, group=self.group)
            self.wd.run(what, lambda: mx.eval(x))
        self.stats.comm_time += time.perf_counter() - tc
        parts = mx.split(x, 1 + n_taps, axis=-1)
        return parts[0].astype(self.act_dtype), list(parts[1:])

    def _check(self, cid, offset, toks, cache):
        """All ranks agree on the committed tokens (CRC32) and hold that many KV positions."""
        t0 = time.perf_counter()
        hist = self._history(cid, offset, toks)
        own = self._own_length(cache)
        mine = mx.array([offset, zlib.crc32(bytes(str(hist[:offset]), "ascii")) & 0x7FFFFFFF, own - len(toks)],
                        dtype=mx.int32)
        self._ring_or_wait(0, "--check all_gather")
        g = mx.distributed.all_gather(mine[None], group=self.group)
        rows = self.wd.run("--check all_gather", lambda: (mx.eval(g), g)[1]).tolist()
        self.stats.check_time += time.perf_counter() - t0
        for r, row in enumerate(rows):
            if row != rows[0]:
                raise MlxspecError(
                    f"rank {self.rank}: ranks diverged at position {offset}: rank 0 has (committed={rows[0][0]}, "
                    f"crc={rows[0][1]:08x}, kv={rows[0][2]}), rank {r} has (committed={row[0]}, crc={row[1]:08x}, kv={row[2]})")

    def _history(self, cid, offset, toks):
        hist = self._hist.setdefault(cid, [])
        del hist[offset:]
        hist.extend(toks)
        return hist


# ----------------------------------------------------------------------------- loading / API
def load(model: str | None = None, draft: str | None = "auto", spec_type: str = "auto",
         block_size: int | None = None, num_draft_tokens: int | None = None, p_min: float | None = None,
         schedule: bool = False, mode: str = "auto", check: bool = False,
         timeout: float | None = DEFAULT_TIMEOUT, log=None, **spec_kw):
    """`mlxspec.load` for every rank of an `mlx.launch` job -> (DistTarget, tokenizer, speculator).

    Rank 0 gets the speculator (the drafter lives there only); the others get None and must
    call `target.serve()`. Rank 0 calls `target.close()` (or uses `with target:`) when done.
    spec_kw: further keyword arguments of `mlxspec.api.load_speculator`. log: as there (None: the
    `mlxspec` logger).
    """
    group, wd = init(timeout)
    try:
        inner, tok = load_target(model)
    except MlxspecError as e:
        raise MlxspecError(f"rank {group.rank()}: {e}") from None
    target = DistTarget(inner, group, wd, mode=mode, check=check)
    spec = None
    if group.rank() == 0:
        if draft == "auto":
            draft, spec_type = api.resolve_auto_draft(model, spec_type, ngram=spec_kw.get("ngram", False), log=log)
        spec = api.load_speculator(draft, target, spec_type=spec_type, block_size=block_size, num_draft_tokens=num_draft_tokens, p_min=p_min, schedule=schedule, log=log,
                                   **spec_kw)
    return target, tok, spec


def add_dist_args(p) -> None:
    """The distributed flags of `mlxspec generate` (used under mlx.launch)."""
    p.add_argument("--dist-mode", default="auto", choices=("auto", "tensor", "pipeline"),
                   help="under mlx.launch: tensor = mlx-lm's shard(); pipeline = layers split in stages; "
                        "auto = tensor when the model class can shard over the ranks")
    p.add_argument("--check", action="store_true",
                   help="under mlx.launch: verify every step that all ranks hold the same committed tokens")
    p.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="under mlx.launch: seconds a rank waits on another before exiting with an error")


def launched() -> bool:
    """True inside an mlx.launch job (MLX_RANK is set)."""
    return os.environ.get("MLX_RANK") is not None


def cmd_generate(a) -> int:
    """`mlxspec generate` under mlx.launch: rank 0 generates and prints, the others serve."""
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    check_generate_args(a)  # the same flags on every rank: all refuse alike, before loading
    if rank == 0:
        check_blas()
    draft = None if a.draft in (None, "none") or a.spec_type == "none" else a.draft
    # (the loading lines go to the mlxspec logger; only rank 0 loads a drafter, so only it has any)
    target, tok, spec = load(a.model, draft, a.spec_type, a.block_size, a.num_draft_tokens, a.p_min, a.schedule,
                             a.dist_mode, a.check, a.dist_timeout, policy=a.verify_policy, ngram=a.ngram)
    if target.rank != 0:
        target.serve()
        return 0
    with target:
        last = print_generation(target, tok, prompt_ids(a, tok, read_prompt(a)), spec, a)
        if a.verbose and last is not None:
            print(footer(target))
    return 0


def footer(target: DistTarget) -> str:
    s = target.stats
    n = max(s.forwards, 1)
    header = ("header with the activations" if target._chained
              else f"header broadcast {1e3 * s.header_time / n:.2f} ms/forward")
    line = (f"Distributed: {target.describe()}; {s.forwards} forwards, {header}, "
            f"forward {1e3 * s.forward_time / n:.1f} ms/forward")
    if target.mode == "pipeline":
        line += f" (blocked in send/recv {1e3 * s.comm_time / n:.1f} ms)"
    if target.check:
        line += f", --check {1e3 * s.check_time / n:.2f} ms/forward"
    return line
