"""`mlxspec bench` (filled in by the benchmark work; see scripts/bench.py)."""


def add_bench_args(p):
    p.add_argument("--quick", action="store_true")


def cmd_bench(a) -> int:
    from .errors import MlxspecError

    raise MlxspecError("mlxspec bench is not available in this build yet")
