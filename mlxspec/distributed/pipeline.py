"""Pipeline parallel: contiguous layer stages, one per rank, run one after the other.

Rank 0 embeds and runs its stage, each stage passes [hidden | the taps of the layers so far]
(float32) to the next, and the last sends [final hidden | its taps] back to rank 0, which
applies the final norm and the LM head. Over the links the header travels with the
activations (one message per hop); without them MLX send/recv carries the activations.

Cores: one request goes through the stages in order, so one rank works at a time and the
others sleep in recv(). So each stage may use every core the host's other jobs leave free:
its OpenBLAS thread count follows `mlxspec.blas.ThreadGovernor`, as a single process's does,
with the other ranks on this host counted as its own (`share_cores_with`: they compute only
while it waits). Measured on this 2-core machine, idle: 1 thread per stage cost 1.73x one
process per token (AR), every core per stage 1.05x; with other jobs on the cores the
governor drops to 1 thread, where 2-thread OpenBLAS was erratic (docs/distributed.md).
OpenBLAS's idle workers spin for ~0.1 s after each threaded call, so a rank sharing its host
parks them before each sleep (`mlxspec.blas.park_blas_threads`). OPENBLAS_NUM_THREADS or
MLXSPEC_BLAS_THREADS fixes the count instead.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxspec.blas import blas_threads, govern, park_blas_threads, share_cores_with
from mlxspec.distributed.links import ranks_on_my_host
from mlxspec.distributed.plan import split_layers
from mlxspec.errors import MlxspecError


class Stages:
    """This rank's stage of the target (the other stages' weights dropped)."""

    def __init__(self, target, group, links, wd, stats):
        self.inner, self.hidden = target.inner, target.info.hidden_size
        self.group, self.links, self.wd, self.stats = group, links, wd, stats
        self.rank, self.size = group.rank(), group.size()
        self.stages = split_layers(len(self.inner.layers), self.size)
        a, b = self.stages[self.rank]
        for i, layer in enumerate(self.inner.layers):  # drop the other stages' weights, keep the modules
            if not a <= i < b:
                layer.update(tree_map(lambda x: mx.zeros((0,), dtype=x.dtype), layer.parameters()))
        mx.eval(target.model.parameters())
        norm = getattr(self.inner.layers[a], "input_layernorm", None)
        self.act_dtype = norm.weight.dtype if norm is not None else mx.float32
        self.blas_threads = self._take_the_cores()

    def _take_the_cores(self) -> int | None:
        """Park OpenBLAS's workers before each sleep when ranks share this host (see the
        module doc) -> this rank's OpenBLAS thread count, or None (no OpenBLAS / no links)."""
        if self.links is None:
            return None
        if (ranks_on_my_host(self.rank) or 1) > 1:
            self.links.park = park_blas_threads
            share_cores_with(self.links.local_pids)
        return blas_threads()

    def make_cache(self) -> list:
        return [KVCache() for _ in self.inner.layers]

    def own_length(self, cache) -> int:
        """Positions in this rank's part of the cache."""
        return int(cache[self.stages[self.rank][0]].offset)

    def describe(self) -> str:
        return " ".join(f"r{r}:{a}-{b - 1}" for r, (a, b) in enumerate(self.stages))

    def forward(self, tokens, cache, taps, logits, head, words=(), payload=None):
        """Rank 0: the whole forward -> (logits, taps), `head(h)` for the logits. Other
        ranks: their stage -> (None, None). words: the header to pass on; payload: the
        activations that came with it."""
        govern()  # this stage's OpenBLAS threads: the cores the host's other jobs leave free
        inner, st = self.inner, self.stages
        r, n = self.rank, self.size
        a, b = st[r]
        L = tokens.shape[1]
        # taps carried along from stages 1..r-1, stage by stage (within a stage in request order)
        prev_taps = [t for s in range(1, r) for t in taps if st[s][0] <= t < st[s][1]]
        if r == 0:
            h = inner.embed_tokens(tokens)
            carried = []
        else:
            h, carried = self._input(L, len(prev_taps), r - 1, payload, f"receiving activations from rank {r - 1}")
        mask = create_attention_mask(h, cache[a])
        mine = {}
        for i in range(a, b):
            h = inner.layers[i](h, mask, cache=cache[i])
            if i in taps:
                mine[i] = h
        if r == 0:
            local = {t: mine[t] for t in taps if t in mine}
            if n > 1:
                self._output(h.astype(mx.float32), 1, words)
                later = [t for s in range(1, n) for t in taps if st[s][0] <= t < st[s][1]]
                h, back = self._input(L, len(later), n - 1, None, f"receiving the last stage's output from rank {n - 1}")
                local.update({t: p.astype(self.act_dtype) for t, p in zip(later, back)})
            tap_out = mx.concatenate([local[t] for t in taps], axis=-1) if taps else None
            if logits == "none":
                out = (None, tap_out)
            else:
                out = (head(h[:, -1:] if logits == "last" else h), tap_out)
            mx.eval([x for x in out if x is not None])
            return out
        new = [mine[t].astype(mx.float32) for t in taps if a <= t < b]
        dst = (r + 1) % n
        self._output(mx.concatenate([h.astype(mx.float32)] + carried + new, axis=-1), dst, words if dst else ())
        return None, None

    def _output(self, msg: mx.array, dst: int, words=()) -> None:
        """This stage's [hidden | taps] (float32) to rank `dst`: computed first, then sent
        (over the links with the header for the next stage, or with MLX send)."""
        mx.eval(msg)
        tc = time.perf_counter()
        if self.links is not None:
            self.links.send(dst, words, msg)
        else:
            send = mx.distributed.send(msg, dst, group=self.group)
            self.wd.run(f"sending activations to rank {dst}", lambda: mx.eval(send))
        self.stats.comm_time += time.perf_counter() - tc

    def _input(self, L: int, n_taps: int, src: int, payload, what: str):
        """[hidden | n_taps taps] of L positions from rank `src` (float32 on the wire): the
        payload that came with the header, or the next message -> (hidden in the activation
        dtype, [taps] still float32: a middle stage passes them on as they came)."""
        shape = (1, L, self.hidden * (1 + n_taps))
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
