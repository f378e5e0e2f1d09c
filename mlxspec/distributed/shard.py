"""`mlxspec.api.load` for every rank of an `mlx.launch` job."""

from __future__ import annotations

from dataclasses import replace

from mlxspec.api import SpecConfig, Speculator
from mlxspec.distributed.group import DEFAULT_TIMEOUT, init
from mlxspec.distributed.target import DistTarget
from mlxspec.errors import MlxspecError
from mlxspec.targets.load import load_target

_UNSET = object()


def load(model: str | None = None, draft=_UNSET, *, config: SpecConfig | None = None, mode: str = "auto",
         check: bool = False, timeout: float | None = DEFAULT_TIMEOUT, log=None, **fields):
    """-> (DistTarget, tokenizer, speculator), on every rank.

    model, draft, config and the keyword fields (spec_type, block_size, policy, ngram, ...):
    as `mlxspec.api.load`. mode: "auto" | "tensor" | "pipeline"; check: `--check`; timeout:
    seconds a rank waits on another (None: forever). Rank 0 gets the speculator (the drafter
    lives there only); the others get None and must call `target.serve()`. Rank 0 calls
    `target.close()` (or uses `with target:`) when done.
    """
    if draft is not _UNSET:
        fields["draft"] = draft
    config = replace(config or SpecConfig(), **fields) if fields else (config or SpecConfig())  # checked here, on every rank
    group, wd = init(timeout)
    try:
        inner, tok = load_target(model)
    except MlxspecError as e:
        raise MlxspecError(f"rank {group.rank()}: {e}") from None
    target = DistTarget(inner, group, wd, mode=mode, check=check)
    spec = Speculator.build(config, target, model=model, log=log) if group.rank() == 0 else None
    return target, tok, spec
