"""How the target is split over the ranks: tensor parallel (mlx-lm's own `model.shard`)
when the class can shard over them, else contiguous layer stages (pipeline parallel)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.errors import MlxspecError

MODES = ("auto", "tensor", "pipeline")


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


def choose_mode(target, n: int, mode: str = "auto") -> tuple[str, str | None]:
    """-> (mode: "single" | "tensor" | "pipeline", why tensor parallel does not apply or None).
    Refuses, in one line, what cannot run across n ranks."""
    if mode not in MODES:
        raise MlxspecError(f"--dist-mode {mode!r} is not one of {', '.join(MODES)}")
    if n == 1:
        return "single", None
    model = target.model
    why = tensor_parallel_reason(model, n)
    if mode == "auto":
        mode = "tensor" if why is None else "pipeline"
    if mode == "tensor" and why is not None:
        raise MlxspecError(f"--dist-mode tensor: {why}; use --dist-mode pipeline")
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
    if set(kinds) - {"KVCache", "RotatingKVCache"}:
        raise MlxspecError(f"{target.info.model_type}: {', '.join(kinds)} caches are not supported across ranks "
                           "yet (their rollback replays layers); run it on one rank")
    if mode == "pipeline":
        if len(target.inner.layers) < n:
            raise MlxspecError(f"pipeline parallel needs at least {n} layers, the target has {len(target.inner.layers)}")
        if kinds != ["KVCache"]:
            raise MlxspecError(f"pipeline parallel supports plain KV caches only; {target.info.model_type} uses "
                               f"{', '.join(kinds)} (and cannot be tensor parallel: {why})")
    return mode, why


def shard_tensor_parallel(target, group) -> None:
    """mlx-lm's `model.shard(group)`: attention heads and MLP columns split over the ranks."""
    try:
        target.model.shard(group)
    except Exception as e:  # noqa: BLE001 - mlx-lm's own error, as one line
        raise MlxspecError(f"mlx-lm's {target.info.model_type}.shard() failed over {group.size()} ranks: "
                           f"{str(e).splitlines()[0]}; use --dist-mode pipeline") from None
    mx.eval(target.model.parameters())
