"""`mlxspec generate` under `mlx.launch`: its extra flags, the command and its footer."""

from __future__ import annotations

import os

from mlxspec import api
from mlxspec.args import check_blas, check_generate_args, print_generation, prompt_ids, read_prompt, spec_config
from mlxspec.distributed.group import DEFAULT_TIMEOUT
from mlxspec.distributed.plan import MODES
from mlxspec.distributed.shard import Sharding
from mlxspec.distributed.target import DistTarget


def add_dist_args(p) -> None:
    """The distributed flags of `mlxspec generate` (used under mlx.launch)."""
    p.add_argument("--dist-mode", default="auto", choices=MODES,
                   help="under mlx.launch: tensor = mlx-lm's shard(); pipeline = layers split in stages; "
                        "auto = tensor when the model class can shard over the ranks")
    p.add_argument("--check", action="store_true",
                   help="under mlx.launch: verify every step that all ranks hold the same committed tokens")
    p.add_argument("--dist-timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="under mlx.launch: seconds a rank waits on another before exiting with an error")
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="run the target sharded over N ranks on this machine (ring backend, started by mlxspec "
                        "itself; for other hosts use mlx.launch, docs/distributed.md). Default 1: one process")


def cmd_launch(a, argv: list[str]) -> int:
    """`mlxspec generate --ranks N` (N > 1, not under a launcher): check the flags once, then run
    the same command as N local ranks (`launch.launch_local`)."""
    from mlxspec.distributed.launch import check_ranks, generate_command, launch_local, without_ranks_flag

    n = check_ranks(a.ranks)
    check_generate_args(a)
    check_blas()
    return launch_local(n, generate_command(without_ranks_flag(argv)))


def cmd_generate(a) -> int:
    """Rank 0 generates and prints, the others serve."""
    rank = int(os.environ.get("MLX_RANK", "0") or 0)
    check_generate_args(a)  # the same flags on every rank: all refuse alike, before loading
    if rank == 0:
        check_blas()
    # (the loading lines go to the mlxspec logger; only rank 0 loads a drafter, so only it has any)
    target, tok, spec = api.load(a.model, config=spec_config(a),
                                 shard=Sharding(mode=a.dist_mode, check=a.check, timeout=a.dist_timeout))
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
    header = ("header with the activations" if target.chained
              else f"header broadcast {1e3 * s.header_time / n:.2f} ms/forward")
    line = (f"Distributed: {target.describe()}; {s.forwards} forwards, {header}, "
            f"forward {1e3 * s.forward_time / n:.1f} ms/forward")
    if target.mode == "pipeline":
        line += f" (blocked in send/recv {1e3 * s.comm_time / n:.1f} ms)"
    if target.check:
        line += f", --check {1e3 * s.check_time / n:.2f} ms/forward"
    return line
