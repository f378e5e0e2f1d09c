"""`mlxspec` command line: generate, inspect, convert, train, bench.

User mistakes (bad flags, bad files, incompatible models) print ONE line
`mlxspec: error: ...` naming the problem and the fix, and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from mlxspec.errors import MlxspecError
from mlxspec.tokenizer import apply_chat_template


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + line)
        print(f"mlxspec: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _add_model_args(p):
    p.add_argument("--model", "-m", default=None, help="target: .gguf file or MLX/HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", "--draft-model", dest="draft", default="auto",
                   help="drafter: directory or .gguf (DFlash/DSpark), or a draft model for draft-simple; "
                        "'auto' = the shipped drafter for the default model; 'none' = no drafter")
    p.add_argument("--spec-type", default="auto",
                   help="auto | draft-dflash | draft-dspark | draft-simple | none (default auto: from the drafter's own parameters)")
    p.add_argument("--block-size", type=int, default=None, help="shorten the drafter's block (never lengthen)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="draft-simple: tokens per draft")
    p.add_argument("--p-min", type=float, default=None, help="DSpark: cut drafts at the first confidence below this")
    p.add_argument("--schedule", action="store_true", help="DSpark: pick the verify length from confidences and the measured verify cost")
    p.add_argument("--verify-policy", choices=("adaptive", "fixed"), default=None,
                   help="adaptive (default): verify length chosen per step from the measured verify cost and this "
                        "request's acceptance, down to plain autoregressive steps; fixed: always the full block "
                        "(the default when --block-size / --num-draft-tokens / --schedule pin the length)")
    p.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=True,
                   help="block drafters: also propose prompt-lookup (n-gram) continuations, the adaptive policy "
                        "picks per step (default on; --no-ngram turns it off)")


def _add_sampling_args(p):
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="mlxspec", description="Speculative decoding with DFlash / DSpark drafters on MLX")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text (speculative when a drafter is given)")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", "-p", default=None, help="the prompt; '-' reads stdin")
    g.add_argument("--system-prompt", default=None)
    g.add_argument("--ignore-chat-template", action="store_true")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--verbose", type=_bool, default=True, help="print the footer (True/False)")
    from mlxspec.distributed import add_dist_args  # --dist-mode, --check, --dist-timeout (under mlx.launch)

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
    from mlxspec.server.app import add_serve_args

    add_serve_args(s)
    return ap


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def check_blas(stream=sys.stderr) -> None:
    """Warn when MLX runs on Linux CPU without OpenBLAS preloaded (reference BLAS: ~60x slower GEMM)."""
    from mlxspec.blas import blas_status

    ok, msg = blas_status()
    if not ok and msg:
        print(f"mlxspec: warning: {msg}", file=stream)


def check_generate_args(a) -> None:
    """`generate`'s flags, checked before minutes of loading (every rank under mlx.launch)."""
    if a.prompt is None:
        raise MlxspecError("no prompt: pass --prompt TEXT (or --prompt - to read stdin)")
    from mlxspec.validate import check_sampling_args, check_spec_args

    check_sampling_args(a.max_tokens, a.temp, a.top_p, a.top_k, a.seed)
    check_spec_args(a.block_size, a.num_draft_tokens, a.p_min)
    if a.system_prompt is not None and a.ignore_chat_template:
        raise MlxspecError("--system-prompt needs the chat template; drop --ignore-chat-template "
                           "or put the system text into --prompt")


def read_prompt(a) -> str:
    """--prompt TEXT, or stdin with --prompt -; never empty."""
    prompt = read_stdin_prompt() if a.prompt == "-" else a.prompt
    if not prompt.strip():
        raise MlxspecError("the prompt is empty; pass some text with --prompt (or on stdin with --prompt -)")
    return prompt


def prompt_ids(a, tok, prompt: str) -> list[int]:
    """The prompt's token ids: through the chat template (with --system-prompt) unless
    --ignore-chat-template or the model has none."""
    if a.system_prompt is not None and not tok.has_chat_template:
        raise MlxspecError("--system-prompt needs a chat template and this model has none; "
                           "put the system text into --prompt")
    if tok.has_chat_template and not a.ignore_chat_template:
        msgs = ([{"role": "system", "content": a.system_prompt}] if a.system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        text = apply_chat_template(tok, msgs, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt)


def print_generation(target, tok, ids, spec, a):
    """Stream the text to stdout, then the footer (--verbose); -> the last response."""
    from mlxspec import api

    last = None
    for r in api.stream_generate(target, tok, ids, spec, a.max_tokens, a.temp, a.top_p, a.top_k, a.seed, a.stop):
        print(r.text, end="", flush=True)
        last = r
    print()
    if a.verbose and last is not None:
        print(api.footer(last))
    return last


def cmd_generate(a) -> int:
    from mlxspec import api

    check_blas()
    check_generate_args(a)
    prompt = read_prompt(a)
    draft = None if a.draft in (None, "none") else a.draft
    if a.spec_type == "none":
        draft = None
    target, tok, spec = api.load(a.model, draft, a.spec_type, a.block_size, a.num_draft_tokens, a.p_min, a.schedule,
                                 policy=a.verify_policy, ngram=a.ngram)
    print_generation(target, tok, prompt_ids(a, tok, prompt), spec, a)
    return 0


def read_stdin_prompt() -> str:
    """The prompt from stdin (--prompt -): UTF-8 text, or one line saying it is not."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlxspecError(f"stdin is not UTF-8 text (invalid byte at offset {e.start}); "
                           "pass the prompt as UTF-8") from None


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
    from mlxspec.blas import reexec_with_openblas

    reexec_with_openblas(sys.argv[1:] if argv is None else list(argv))
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        if a.cmd == "generate":
            from mlxspec import distributed

            return distributed.cmd_generate(a) if distributed.launched() else cmd_generate(a)
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
