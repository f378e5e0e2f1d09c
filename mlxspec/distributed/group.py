"""Joining the `mlx.launch` job: the world group, its watchdog, and each rank's share of
the host's cores."""

from __future__ import annotations

import os

import mlx.core as mx

from mlxspec import device
from mlxspec.blas import set_blas_threads
from mlxspec.distributed.links import ranks_on_my_host
from mlxspec.distributed.watchdog import Watchdog
from mlxspec.errors import MlxspecError

DEFAULT_TIMEOUT = 120.0


def launched() -> bool:
    """True inside an mlx.launch job (MLX_RANK is set)."""
    return os.environ.get("MLX_RANK") is not None


def init(timeout: float | None = DEFAULT_TIMEOUT):
    """The world group (size 1 when not launched by mlx.launch) and its watchdog."""
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    size_hint = int(os.environ.get("MLX_WORLD_SIZE", "0") or 0)
    wd = Watchdog(rank, max(size_hint, 2) if launched() else 1, timeout)
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


def limit_blas_threads(rank: int) -> int | None:
    """Ranks on one host share its cores: OpenBLAS's threads per rank = cores / ranks on this
    host (loading and tensor parallel run at once; pipeline stages, see there). Its idle threads spin, so 2
    ranks x 2 threads on 2 cores slowed every matmul ~10x (measured). Left alone when
    the user fixed the count (MLXSPEC_BLAS_THREADS=N or OPENBLAS_NUM_THREADS, as
    `device.blas_threads_setting` reads them). -> the thread count set, or None. (Pipeline
    stages hand the count back to the governor once they are wired: `mlxspec.distributed.pipeline`.)"""
    local = ranks_on_my_host(rank)
    if device.blas_threads_setting() is not None or local is None:
        return None
    n = max(1, (os.cpu_count() or 1) // local)
    return n if set_blas_threads(n) else None
