"""One target forward over a tree of candidate tokens, and keeping only the accepted path.

A tree of n nodes is a flat list in topological order: node 0 is the anchor (the root), every
other node's parent comes before it (`parents[0] == -1`). Verifying it is one forward of the
n tokens where

- each node attends to the committed context and to its ancestors (itself included), never to
  its siblings or cousins: the attention mask of every layer is replaced, per layer, by the
  tree mask (`layer_mask`), which on a sliding-window layer (`RotatingKVCache`) also keeps
  each node's window measured from its own position;
- each node sits at position offset + depth, not offset + index: every attention module's
  `rope` is replaced for the call by `TreeRope`, which rotates row i by the rotation of
  position offset + depth[i]. The rotations are read off the model's own RoPE module by
  applying it to basis vectors (RoPE is linear per position), so every variant mlx-lm has
  (default, llama3 scaling, yarn, partial rotary dims, traditional pairing) is exact.

Row i of the logits is the target's distribution after the path root..i, as if that path had
been decoded alone. After acceptance, `keep_rows` keeps the K/V rows of the accepted path
(rows 0, i_1, i_2, ...: ascending) and drops the rest: KV caches by moving those rows down in
place, sliding windows by restoring the pre-forward window and re-appending the kept rows
(as `TargetCache`'s partial rollback does). The kept rows are exactly what a chain over the
path would have written: same keys, same positions.

Recurrent layers (Gated DeltaNet, Mamba) have no per-row state a tree could share, so
`tree_support` refuses them with the reason, and the engine verifies a chain there.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache


def layout(parents) -> tuple[np.ndarray, np.ndarray]:
    """parents [n] (parents[0] == -1, parents[i] < i) -> (depth [n], ancestor-or-self [n, n] bool)."""
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a tree's node 0 is its root (parent -1)")
    depth = np.zeros(n, np.int64)
    anc = np.zeros((n, n), bool)
    anc[0, 0] = True
    for i in range(1, n):
        p = int(parents[i])
        if not 0 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}: parents must come first")
        depth[i] = depth[p] + 1
        anc[i] = anc[p]
        anc[i, i] = True
    return depth, anc


def _ropes(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(owner, attribute, rope module) of every RoPE inside one decoder layer."""
    out = []
    for _, m in layer.named_modules():
        r = m.get("rope") if isinstance(m, dict) else None
        if isinstance(r, nn.Module):
            out.append((m, "rope", r))
    return out


def _signature(rope: nn.Module):
    """What a RoPE module computes, as a hashable value (mlx-lm gives every layer its own
    instance of the same rotation; Gemma-3's local and global layers differ)."""
    items = []
    for k, v in sorted(vars(rope).items()):
        if isinstance(v, (int, float, bool, str, type(None))):
            items.append((k, v))
    for k, v in sorted(rope.items()):
        if isinstance(v, mx.array):
            items.append((k, tuple(np.asarray(v.astype(mx.float32)).reshape(-1).tolist())))
        elif isinstance(v, (int, float, bool, str, type(None))):
            items.append((k, v))
    return (type(rope).__name__, tuple(items))


class TreeRope(nn.Module):
    """Stands in for a RoPE module during a tree forward: row i at position offset + depth[i]."""

    def __init__(self, rope: nn.Module, depth: np.ndarray):
        super().__init__()
        self._rope, self._depth, self._mats = rope, depth, {}

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        off = int(offset.item()) if isinstance(offset, mx.array) else int(offset)
        D = x.shape[-1]
        key = (off, D)
        m = self._mats.get(key)
        if m is None:
            P = int(self._depth.max()) + 1
            basis = mx.broadcast_to(mx.eye(D, dtype=mx.float32)[None, :, None, :], (1, D, P, D))
            cols = self._rope(basis, offset=off)[0]  # [D (input axis j), P, D (output)]: R(off+p) e_j
            m = mx.transpose(cols[:, mx.array(self._depth)], (1, 0, 2))  # [n, j, out]
            self._mats[key] = m
        y = mx.matmul(x.astype(mx.float32)[..., None, :], m)[..., 0, :]
        return y.astype(x.dtype)


def _context_rows(c) -> int:
    """Keys/values a layer's cache holds BEFORE a multi-token update, as the update returns them."""
    if c.keys is None:
        return 0
    if isinstance(c, RotatingKVCache):
        n = c.keys.shape[2]
        t = n if (c._idx == n or c._idx < c.offset) else c._idx
        return min(t, c.max_size - 1)
    return int(c.offset)


def layer_mask(c, depth: np.ndarray, anc: np.ndarray) -> mx.array:
    """The boolean mask [n, context + n] of one layer for a tree forward (module docstring)."""
    n = len(depth)
    C = _context_rows(c)
    vis = np.ones((n, C + n), bool)
    vis[:, C:] = anc
    if isinstance(c, RotatingKVCache):
        w = int(c.max_size)
        # context column j holds position offset - C + j; node i sits at offset + depth[i]
        cols = np.arange(C)
        vis[:, :C] = cols[None, :] >= (C + depth[:, None] - w + 1)
        vis[:, C:] &= (depth[:, None] - depth[None, :]) < w
    return mx.array(vis)


def tree_support(target) -> str | None:
    """None when `target` can verify trees; else why not (one line)."""
    import inspect

    if "tree" not in inspect.signature(type(target).__call__).parameters:
        return (f"a {type(target).__name__} (e.g. a target sharded over ranks: its forward's header carries no "
                "tree) verifies chains")
    cache = target.make_cache()
    for i, (c, k) in enumerate(zip(cache, cache.kinds)):
        if k == "arrays":
            return f"layer {i} is recurrent ({type(c).__name__}): its state cannot branch, so trees fall back to chains"
        if isinstance(c, RotatingKVCache) and c.keep:
            return f"layer {i}'s sliding window keeps {c.keep} sink rows: trees fall back to chains"
        if not isinstance(c, (KVCache, RotatingKVCache)):
            return f"layer {i}'s cache ({type(c).__name__}) cannot keep a tree path: trees fall back to chains"
    for i, layer in enumerate(target.inner.layers):
        if not _ropes(layer):
            return f"layer {i} has no RoPE module mlxspec can reposition: trees fall back to chains"
    return None


_SITES: dict = {}  # (ids of the layers) -> (the layers, their RoPE sites): walked once per model, not per verify


def rope_sites(layers) -> list[tuple[nn.Module, str, nn.Module, tuple]]:
    """(owner, attribute, RoPE module, its signature) for every RoPE in `layers`, found once per
    set of layers (walking the module tree and reading the rotations cost ~7 ms per verify)."""
    key = tuple(id(x) for x in layers)
    hit = _SITES.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], layers)):
        sites = [(o, a, r, _signature(r)) for layer in layers for o, a, r in _ropes(layer)]
        if len(_SITES) > 16:
            _SITES.clear()
        hit = _SITES[key] = (list(layers), sites)  # the layers kept alive: their ids stay theirs
    if any(getattr(o, a) is not r for o, a, r, _ in hit[1]):  # a RoPE replaced since: walk again
        _SITES.pop(key)
        return rope_sites(layers)
    return hit[1]


class TreeForward:
    """The per-call state of a tree forward: the masks by layer and the swapped RoPE modules."""

    def __init__(self, parents):
        self.depth, self.anc = layout(parents)
        self.n = len(self.depth)
        self._swapped: list = []
        self._masks: dict = {}

    def swap_ropes(self, layers) -> None:
        made: dict = {}  # one TreeRope (one set of rotations per call) for every identical RoPE
        for owner, attr, rope, sig in rope_sites(layers):
            tr = made.get(sig)
            if tr is None:
                tr = made[sig] = TreeRope(rope, self.depth)
            self._swapped.append((owner, attr, rope))
            setattr(owner, attr, tr)

    def restore(self) -> None:
        for owner, attr, rope in reversed(self._swapped):
            setattr(owner, attr, rope)
        self._swapped = []

    def call_layer(self, layer, c, x, args, kwargs):
        """Run one decoder layer with its mask argument replaced by the tree mask."""
        key = (type(c).__name__, _context_rows(c), getattr(c, "max_size", None))
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = layer_mask(c, self.depth, self.anc)
        if args:
            args = (mask,) + tuple(args[1:])
        else:
            kwargs = {**kwargs, "mask": mask}
        return layer(x, *args, **kwargs)


def keep_rows(cache, n: int, rows) -> None:
    """After a forward of n tokens into `cache`, keep only the rows `rows` (ascending, from 0)
    of that forward, as if only they had been fed, in that order."""
    from mlxspec.targets.rollback import TargetCache, _restore_rotating

    rows = [int(r) for r in rows]
    k = len(rows)
    if rows == list(range(k)):  # a prefix: the chain's rollback
        if isinstance(cache, TargetCache):
            cache.rollback(n - k)
        elif n > k:
            for c in cache:
                c.trim(n - k)
        return
    j0 = 0  # rows 0 .. j0-1 of the path are already where they belong
    while j0 < k and rows[j0] == j0:
        j0 += 1
    moved = rows[j0:]
    # consecutive moved rows (a branch taken whole) are one slice, else a gather (the slice is the
    # cheaper op on the CPU; both end in the cache's own slice update)
    run = moved == list(range(moved[0], moved[0] + len(moved)))
    gathers: dict = {}  # offset -> the moved rows' indices (one array for all layers at that offset)
    idx = mx.array(rows)
    step = cache.log[-1] if isinstance(cache, TargetCache) and cache.log else None
    if step is not None and step.n != n:
        raise AssertionError(f"keep_rows: the last forward was {step.n} rows, not {n}")
    for i, c in enumerate(cache):
        if isinstance(c, RotatingKVCache):
            if step is None:
                raise AssertionError("keep_rows on a sliding window needs the cache's record of the forward")
            kk, vv = c.keys[..., -n:, :][..., idx, :], c.values[..., -n:, :][..., idx, :]
            _restore_rotating(c, step.pre[i])
            c.update_and_fetch(kk, vv)
        else:
            o = c.offset - n
            if run:
                a, b = o + moved[0], o + moved[0] + len(moved)
                kk, vv = c.keys[..., a:b, :], c.values[..., a:b, :]
            else:
                g = gathers.get(o)
                if g is None:
                    g = gathers[o] = mx.array([o + r for r in moved])
                kk, vv = mx.take(c.keys, g, axis=2), mx.take(c.values, g, axis=2)
            c.keys[..., o + j0 : o + k, :] = kk
            c.values[..., o + j0 : o + k, :] = vv
            c.offset = o + k
    if isinstance(cache, TargetCache):
        cache.length -= n - k
        cache.log.clear()
