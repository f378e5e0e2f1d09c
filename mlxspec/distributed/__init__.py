"""The target sharded over the ranks of an `mlx.launch` job, speculation on top.

One decider, N-1 target servers: every rank loads the target and keeps its share (tensor
parallel with mlx-lm's own `model.shard` when the sizes divide, else pipeline stages); rank 0
alone runs the speculative loop, and before each target forward sends the others a header so
that they run the same forward. The output is the single-process output, token for token.
See docs/distributed.md.

  * `shard`: `Sharding`, `mlxspec.api.load`'s distributed mode (`load(..., shard=Sharding())` on
    every rank -> (DistTarget, tokenizer, speculator on rank 0));
  * `target`: `DistTarget`, the header protocol, `serve()` for the other ranks;
  * `pipeline`: the layer stages and their activations; `plan`: which split applies;
  * `header`: the header's words; `links`: the ranks' blocking TCP links beside MLX's group;
  * `group`: joining the job, each rank's cores; `watchdog`: one line, not a hang, when a
    peer is lost; `check`: `--check`; `cli`: `mlxspec generate` under mlx.launch;
  * `launch`: `--ranks N`, local ranks started without mlx.launch (whose relay spins a core).

Run it: `mlxspec generate --ranks 2 ...` on one machine (`launch`: the ranks as plain children,
no relaying launcher), or `mlx.launch --backend ring --hostfile ... -- .venv/bin/mlxspec generate ...`
across hosts (`mlxspec generate` switches to `mlxspec.distributed.cli` when MLX_RANK is set).
"""

from mlxspec.distributed.cli import add_dist_args, cmd_generate, cmd_launch, footer
from mlxspec.distributed.group import DEFAULT_TIMEOUT, init, launched, limit_blas_threads
from mlxspec.distributed.links import Links
from mlxspec.distributed.plan import split_layers, tensor_parallel_reason
from mlxspec.distributed.shard import Sharding
from mlxspec.distributed.target import DistStats, DistTarget
from mlxspec.distributed.watchdog import Watchdog

__all__ = ["DEFAULT_TIMEOUT", "DistStats", "DistTarget", "Links", "Sharding", "Watchdog", "add_dist_args", "cmd_generate",
           "cmd_launch", "footer", "init", "launched", "limit_blas_threads", "split_layers", "tensor_parallel_reason"]
