"""`Sharding`: `mlxspec.api.load`'s distributed mode. Passed as `SpecConfig.shard` (or
`load(..., shard=Sharding(...))`), it has every rank of an `mlx.launch` job join the group,
load the target and keep its share (`DistTarget`); `api.load` then builds the speculator on
rank 0 only (the drafter lives there; the other ranks call `target.serve()`)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxspec.distributed.group import DEFAULT_TIMEOUT, init
from mlxspec.distributed.target import DistTarget
from mlxspec.errors import MlxspecError
from mlxspec.targets.load import load_target


@dataclass(frozen=True)
class Sharding:
    """How the target is split over the job's ranks. mode: "auto" | "tensor" | "pipeline";
    check: `--check`; timeout: seconds a rank waits on another (None: forever)."""

    mode: str = "auto"
    check: bool = False
    timeout: float | None = DEFAULT_TIMEOUT

    def load_target(self, model: str | None):
        """On every rank: join the group and load `model`, sharded -> (DistTarget, tokenizer,
        whether this rank speculates: rank 0 only). Rank 0 calls `target.close()` (or uses
        `with target:`) when done."""
        group, wd = init(self.timeout)
        try:
            inner, tok = load_target(model)
        except MlxspecError as e:
            raise MlxspecError(f"rank {group.rank()}: {e}") from None
        target = DistTarget(inner, group, wd, mode=self.mode, check=self.check)
        return target, tok, group.rank() == 0
