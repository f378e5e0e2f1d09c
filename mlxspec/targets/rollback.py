"""Exact rollback of mlx-lm caches after a rejected verify.

`Target.make_cache()` returns a `TargetCache`: mlx-lm's own per-layer caches (from the
model's `make_cache()`) plus an undo log of the forwards since the last rollback. Before
each forward, `Target.__call__` records what that forward may destroy, per cache kind:

- `KVCache` (and the other plain trimmable KV caches): nothing; rollback is `trim(n)`.
- `RotatingKVCache` (sliding window): references to the key/value buffers, `offset` and
  `_idx` (free: a multi-token update builds new buffers), and for a one-token update into
  a full ring the one slot it overwrites. Rollback restores the pre-forward state and
  re-appends the kept tokens' keys/values (the last rows of the post-forward buffer)
  through the cache's own `update_and_fetch`: the window ends exactly as if only the kept
  tokens had been fed, even when the verify wrapped it.
- `ArraysCache` (recurrent state: Gated DeltaNet, Mamba): references to its arrays
  (free: the layers assign new arrays). Two strategies, `Target.recurrent_rollback`:
  "replay" (default) records the layer's input during the forward and, on a partial
  rollback, restores the state and re-runs that one decoder layer over the kept rows;
  "capture" runs the layer one token at a time during the forward and keeps the state
  after every token (rollback is then a lookup). "replay" costs one extra layer pass over
  the kept rows per rejected verify; "capture" turns one L-row layer pass into L one-row
  passes on every verify (measured in tests/test_targets.py::test_measure_recurrent_rollback
  and README "Targets").

`rollback(n)` undoes the last n positions: whole forwards are undone from their records,
a partly kept forward is undone and its kept prefix re-applied. The log is cleared after
every rollback (the engine rolls back once per verify) and holds at most MAX_LOG forwards.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxspec.errors import MlxspecError

MAX_LOG = 16
# Recurrent layers' inputs are kept for a partial rollback only for forwards up to this
# long (a verify block); a longer forward (a prompt) can still be undone as a whole.
REPLAY_MAX = 256


def cache_kind(c) -> str | None:
    if isinstance(c, RotatingKVCache):
        return "rotating"
    if isinstance(c, ArraysCache):
        return "arrays"
    if isinstance(c, (KVCache, QuantizedKVCache, ConcatenateKVCache)):
        return "kv"
    return None


class _Step:
    __slots__ = ("n", "pre", "inputs", "states")

    def __init__(self, n: int):
        self.n = n
        self.pre: dict = {}  # layer -> snapshot (rotating / arrays)
        self.inputs: dict = {}  # layer -> (layer module, x, args, kwargs) for replay
        self.states: dict = {}  # layer -> [state after token t] for capture


def _snap_rotating(c: RotatingKVCache, n: int):
    slot = None
    if n == 1 and c.keys is not None and c.keys.shape[2] == c.max_size:
        # a one-token update writes into this buffer in place: keep the slot it overwrites
        # (copied, and evaluated in `begin` with the other layers' slots in one go: a lazy
        # slice would keep the old buffer alive and make the in-place write copy all of it)
        s = c._idx if c._idx < c.max_size else c.keep
        slot = (s, c.keys[..., s : s + 1, :] + 0, c.values[..., s : s + 1, :] + 0)
    return (c.keys, c.values, c.offset, c._idx, slot)


def _restore_rotating(c: RotatingKVCache, snap) -> None:
    c.keys, c.values, c.offset, c._idx, slot = snap
    if slot is not None:
        s, k, v = slot
        c.keys[..., s : s + 1, :] = k
        c.values[..., s : s + 1, :] = v


def _snap_arrays(c: ArraysCache):
    return (list(c.cache), c.lengths, c.left_padding)


def _restore_arrays(c: ArraysCache, snap) -> None:
    cache, c.lengths, c.left_padding = snap
    c.cache = list(cache)


def slice_rows(args, kwargs, n: int, start: int, stop: int):
    """The positional/keyword arguments of a layer call restricted to rows start:stop (the
    arrays whose last axis is the sequence, e.g. an SSM padding mask)."""

    def cut(a):
        if isinstance(a, mx.array) and a.ndim >= 1 and a.shape[-1] == n:
            return a[..., start:stop]
        return a

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


class TargetCache(list):
    """mlx-lm's per-layer caches plus the undo log (see the module docstring)."""

    def __init__(self, caches):
        super().__init__(caches)
        self.kinds = [cache_kind(c) for c in caches]
        self.length = 0
        self.log: list[_Step] = []

    def __deepcopy__(self, memo):
        """A copy of the caches with an empty undo log (the records hold layer references)."""
        out = TargetCache([copy.deepcopy(c, memo) for c in self])
        out.length = self.length
        return out

    # -- called by Target.__call__ before a forward of n tokens ----------------------
    def begin(self, n: int) -> _Step:
        step = _Step(n)
        slots = []
        for i, (c, k) in enumerate(zip(self, self.kinds)):
            if k == "rotating":
                step.pre[i] = _snap_rotating(c, n)
                if step.pre[i][4] is not None:
                    slots += step.pre[i][4][1:]
            elif k == "arrays":
                step.pre[i] = _snap_arrays(c)
        if slots:
            mx.eval(slots)
        self.log.append(step)
        if len(self.log) > MAX_LOG:
            del self.log[0]
        self.length += n
        return step

    # -- rollback -----------------------------------------------------------------------
    def rollback(self, n: int) -> None:
        """Drop the last n positions exactly; n may span several recorded forwards."""
        if n < 0:
            raise ValueError(f"cannot roll back {n} positions")
        try:
            while n > 0:
                if not self.log:
                    # no record: exact only where mlx-lm's trim is (KV caches; a window not yet full)
                    if all(k != "arrays" and c.is_trimmable() for c, k in zip(self, self.kinds)):
                        for c in self:
                            c.trim(n)
                        self.length -= n
                        return
                    raise MlxspecError(
                        f"cannot roll back {n} more positions: the cache has no record of those forwards "
                        f"(only the last {MAX_LOG} forwards since the last rollback are kept)")
                step = self.log.pop()
                if n >= step.n:
                    self._undo(step)
                    n -= step.n
                else:
                    self._undo_partial(step, step.n - n)
                    n = 0
        finally:
            self.log.clear()

    def _undo(self, step: _Step) -> None:
        for i, (c, k) in enumerate(zip(self, self.kinds)):
            if k == "kv":
                c.trim(step.n)
            elif k == "rotating":
                _restore_rotating(c, step.pre[i])
            elif k == "arrays":
                _restore_arrays(c, step.pre[i])
        self.length -= step.n

    def _undo_partial(self, step: _Step, keep: int) -> None:
        n = step.n
        for i, (c, k) in enumerate(zip(self, self.kinds)):
            if k == "kv":
                c.trim(n - keep)
            elif k == "rotating":
                # n >= 2 here, so the forward took the concatenating path: its n new rows are
                # the last n rows of the buffer
                kk, vv = c.keys[..., -n:, :][..., :keep, :], c.values[..., -n:, :][..., :keep, :]
                _restore_rotating(c, step.pre[i])
                c.update_and_fetch(kk, vv)
            elif k == "arrays":
                if i in step.states:
                    _restore_arrays(c, step.states[i][keep - 1])
                    continue
                if i not in step.inputs:
                    raise MlxspecError(
                        f"cannot keep {keep} of a {n}-token forward over recurrent layer {i}: forwards longer "
                        f"than {REPLAY_MAX} tokens can only be rolled back whole")
                _restore_arrays(c, step.pre[i])
                layer, x, args, kwargs = step.inputs[i]
                args, kwargs = slice_rows(args, kwargs, n, 0, keep)
                layer(x[:, :keep], *args, **kwargs)  # output discarded: it only advances c
        self.length -= n - keep
