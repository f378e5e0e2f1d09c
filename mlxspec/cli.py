"""`mlxspec` command line: generate, inspect, convert, train, bench.

User mistakes (bad flags, bad files, incompatible models) print ONE line
`mlxspec: error: ...` naming the problem and the fix, and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from mlxspec.args import (
    add_model_args,
    add_sampling_args,
    check_blas,
    check_generate_args,
    print_generation,
    prompt_ids,
    read_prompt,
    spec_config,
)
from mlxspec.errors import MlxspecError
from mlxspec.logger import to_stderr


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + line)
        print(f"mlxspec: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="mlxspec", description="Speculative decoding with DFlash / DSpark drafters on MLX")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text (speculative when a drafter is given)")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", "-p", default=None, help="the prompt; '-' reads stdin")
    g.add_argument("--system-prompt", default=None)
    g.add_argument("--ignore-chat-template", action="store_true")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--verbose", type=_bool, default=True, help="print the footer (True/False)")
    from mlxspec.distributed import (
        add_dist_args,  # --dist-mode, --check, --dist-timeout (under mlx.launch)
    )

    add_dist_args(g)

    i = sub.add_parser("inspect", help="describe a GGUF file or model directory and what mlxspec makes of it")
    i.add_argument("path")

    c = sub.add_parser("convert", help="write a GGUF target as an MLX directory (mlx_lm can load it)")
    c.add_argument("--model", "-m", default=None)
    c.add_argument("--out", "-o", required=True)
    c.add_argument("--dtype", choices=("keep", "float16", "bfloat16", "float32"), default="keep",
                   help="keep: the GGUF's quantized tensors as the lossless MLX affine repack (default); "
                        "float16/bfloat16/float32: dense weights in that dtype")
    c.add_argument("--force", action="store_true", help="write into a non-empty --out (replaces mlxspec's files there)")

    t = sub.add_parser("train", help="train a DFlash or DSpark drafter for a target")
    from mlxspec.train.cli import add_train_args

    add_train_args(t)

    b = sub.add_parser("bench", help="side-by-side benchmark: mlx_lm, mlxspec autoregressive, speculative")
    from mlxspec.bench import add_bench_args

    add_bench_args(b)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with speculative decoding and a prompt cache")
    from mlxspec.server.args import add_serve_args

    add_serve_args(s)
    return ap


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def cmd_generate(a) -> int:
    from mlxspec import api

    check_blas()
    check_generate_args(a)
    prompt = read_prompt(a)
    target, tok, spec = api.load(a.model, config=spec_config(a))
    print_generation(target, tok, prompt_ids(a, tok, prompt), spec, a)
    return 0


def cmd_inspect(a) -> int:
    from mlxspec.inspect import inspect_path

    print(inspect_path(a.path))
    return 0


def cmd_convert(a) -> int:
    from mlxspec.targets.convert import convert_to_mlx

    out = convert_to_mlx(a.model, a.out, dtype=a.dtype, force=a.force)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    with to_stderr():  # the library's report lines (mlxspec.logger), printed as they always were
        return _run(a, argv)


def _run(a, argv: list[str]) -> int:
    try:
        if a.cmd == "generate":
            from mlxspec import distributed

            if distributed.launched():
                if a.ranks != 1:
                    raise MlxspecError("--ranks starts its own local ranks; under mlx.launch leave it out "
                                       "(mlx.launch -n sets the number of ranks)")
                return distributed.cmd_generate(a)
            if a.ranks != 1:
                return distributed.cmd_launch(a, argv)
            return cmd_generate(a)
        if a.cmd == "inspect":
            return cmd_inspect(a)
        if a.cmd == "convert":
            return cmd_convert(a)
        if a.cmd == "train":
            from mlxspec.train.cli import cmd_train

            return cmd_train(a)
        if a.cmd == "bench":
            from mlxspec.bench import cmd_bench

            return cmd_bench(a)
        if a.cmd == "serve":
            from mlxspec.server.app import cmd_serve

            return cmd_serve(a)
    except MlxspecError as e:
        print(f"mlxspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmlxspec: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
