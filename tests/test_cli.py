"""The `mlxspec` command line, run as a user runs it (a subprocess): `generate` and `inspect`
end to end, `convert` into a directory mlx_lm loads, and the user-error paths: one line on
stderr naming the problem and the fix, exit code 2, no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_tensors, write_gguf, write_tiny_model

TEXTS = [
    "Hello world",
    "The capital of France is Paris.\n\n  def f(x):\n\treturn x**2  # 12345 ünïcödé 日本語 🤖",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces and trailing   ",
    "the the the",
]


def run(*args, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "mlxspec.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


def assert_user_error(r: subprocess.CompletedProcess, message: str | None = None, startswith: str | None = None):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert len(lines) == 1, r.stderr
    if message is not None:
        assert lines[0] == message
    if startswith is not None:
        assert lines[0].startswith(startswith), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- end to end

def test_generate_smollm2(smollm2_path):
    r = run("generate", "--model", smollm2_path, "--draft", "none", "--prompt", "What is the capital of France?",
            "--max-tokens", 16, "--verbose", "False")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_tiny_reads_stdin(tiny_gguf):
    r = run("generate", "--model", tiny_gguf, "--draft", "none", "--prompt", "-", "--max-tokens", 5, stdin="the cat")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_installed_command_preloads_openblas_before_mlx(tiny_gguf):
    """The `mlxspec` console script, started without LD_PRELOAD, has OpenBLAS loaded before MLX
    is imported (`import mlxspec` loads it; where it could not, the CLI re-executes itself with
    it preloaded): no reference-BLAS warning, which `generate` prints when libopenblas is not in
    its own /proc/self/maps (reference BLAS: 10.4 vs 17.7 tok/s on the default generate)."""
    from mlxspec.blas import find_openblas

    assert find_openblas(), "scripts/setup.sh installs Debian's libopenblas0-pthread"
    exe = Path(sys.executable).with_name("mlxspec")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLXSPEC_NO_BLAS_REEXEC")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([str(exe), "generate", "--model", str(tiny_gguf), "--draft", "none", "--prompt", "the cat",
                        "--max-tokens", "3"], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "reference BLAS" not in r.stderr, r.stderr
    # without the re-exec too: the import loaded it
    env["MLXSPEC_NO_BLAS_REEXEC"] = "1"
    r = subprocess.run([str(exe), "generate", "--model", str(tiny_gguf), "--draft", "none", "--prompt", "the cat",
                        "--max-tokens", "3"], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0 and "reference BLAS" not in r.stderr, r.stderr
    # and with none loaded (MLXSPEC_OPENBLAS=off) the warning is what a user would see
    env["MLXSPEC_OPENBLAS"] = "off"
    r = subprocess.run([str(exe), "generate", "--model", str(tiny_gguf), "--draft", "none", "--prompt", "the cat",
                        "--max-tokens", "3"], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0 and "mlxspec: warning: MLX is using reference BLAS" in r.stderr, r.stderr


def test_inspect_smollm2(smollm2_path):
    r = run("inspect", smollm2_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for want in ("GGUF version 3", "272 tensors", "general.architecture: \"llama\"", "Q4_1         210 tensors",
                 "blk.*.attn_q.weight", "[576, 576]", "role: target (llama)",
                 "dims: 30 layers, hidden 576, heads 9 (kv 3, head_dim 64), ffn 1536, vocab 49152",
                 "kept quantized: MLX affine 4-bit, group 32 (lossless)", "Q/K rows: un-permuted",
                 "tokenizer: gpt2/smollm, 49152 tokens", "problems:\n  none found"):
        assert want in out, want


def test_inspect_lists_problems(tmp_path):
    """Unsupported tensor types and stray tensors are listed as problems; inspect still reports (exit 0)."""
    path = tmp_path / "odd.gguf"
    tensors = tiny_tensors()
    tensors["blk.0.attn_sinks.weight"] = np.zeros((4, 256), np.float32)
    write_gguf(path, tensors, types={"blk.1.ffn_up.weight": 99, "blk.0.attn_v.weight": "Q4_K"})
    r = run("inspect", path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "- blk.1.ffn_up.weight has tensor type unknown type 99" in out
    assert "- tensors not used by the llama model: blk.0.attn_sinks.weight" in out
    assert "dequantized to float16 with the gguf package; memory" in out  # the K-quant's cost is stated


def test_inspect_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, tiny_tensors(), arch="mamba")
    r = run("inspect", path)
    assert r.returncode == 0, r.stderr
    assert "- architecture 'mamba' is not supported" in r.stdout


def _tiny_drafter(rank: int):
    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.drafters.model import DFlashModel

    cfg = DrafterConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, block_size=4, target_layer_ids=[0, 1],
                        mask_token_id=5, vocab_size=272, markov_rank=rank, confidence_head=bool(rank),
                        sample_from_anchor=bool(rank))
    m = DFlashModel(cfg)
    mx.eval(m.parameters())
    return m, cfg


@pytest.mark.parametrize("rank,fmt,lineage,layout", [
    (0, "gguf", "dflash", "bonus-anchor (sample_from_anchor=false): dflash.sample_from_anchor=false in the file"),
    (16, "gguf", "dspark", "anchor-first (sample_from_anchor=true): dflash.sample_from_anchor=true in the file"),
    (16, "deepspec", "dspark", "anchor-first (sample_from_anchor=true): no sample_from_anchor key; DeepSpec"),
])
def test_inspect_drafter(tmp_path, rank, fmt, lineage, layout):
    from mlxspec.drafters.load import save_drafter

    m, cfg = _tiny_drafter(rank)
    path = tmp_path / ("d.gguf" if fmt == "gguf" else "d")
    save_drafter(m, cfg, path, fmt)
    r = run("inspect", path)
    assert r.returncode == 0, r.stderr
    assert f"role: drafter ({lineage}), format {fmt}" in r.stdout
    assert f"layout: {layout}" in r.stdout
    assert "taps (target layer outputs): 0, 1" in r.stdout
    assert "problems:\n  none found" in r.stdout


def test_inspect_broken_drafter_is_a_problem(tmp_path):
    import gguf

    from mlxspec.drafters.load import save_drafter

    m, cfg = _tiny_drafter(0)
    good = tmp_path / "d.gguf"
    save_drafter(m, cfg, good, "gguf")
    # drop a metadata key the drafter needs: rewrite the file without dflash.block_count
    reader = gguf.GGUFReader(str(good))
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "dflash")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "dflash.block_count"):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vt)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(x) for x in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run("inspect", bad)
    assert r.returncode == 0, r.stderr
    assert "role: drafter" not in r.stdout
    assert "- " in r.stdout.split("problems:")[1] and "block_count" in r.stdout.split("problems:")[1]


# ----------------------------------------------------------------------------- convert

def test_tokenizer_save_pretrained_matches_mlx_lm(smollm2, tmp_path):
    """tokenizer.json written from GGUF metadata: mlx_lm's tokenizer encodes, decodes and renders the
    chat template exactly as mlxspec's tokenizer does."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxspec.tokenizer import apply_chat_template

    _, tok = smollm2
    tok.save_pretrained(tmp_path)
    hf = load_tokenizer(tmp_path)
    for t in TEXTS:
        for special in (True, False):
            assert hf.encode(t, add_special_tokens=special) == tok.encode(t, add_special_tokens=special), t
        ids = tok.encode(t)
        assert hf.decode(ids) == tok.decode(ids)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == apply_chat_template(tok, msgs)
    assert isinstance(hf.detokenizer, BPEStreamingDetokenizer)


@pytest.mark.parametrize("name,detok", [("llama-spm", "SPMStreamingDetokenizer"), ("phi-3", "SPMStreamingDetokenizer"),
                                        ("gpt-2", "BPEStreamingDetokenizer"), ("llama-bpe", "BPEStreamingDetokenizer"),
                                        ("qwen2", "BPEStreamingDetokenizer")])
def test_tokenizer_save_pretrained_golden_vocabs(tmp_path, name, detok, golden_models):
    """llama.cpp's vocab-only GGUFs (cached by the tokenizer tests): the written tokenizer.json encodes
    llama.cpp's test texts exactly as mlxspec does, with and without BOS, SentencePiece included."""
    from conftest_vocab import GOLDEN_SEPARATOR
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxspec.gguf.file import read_gguf
    from mlxspec.tokenizer import load_gguf_tokenizer

    vocab = golden_models / f"ggml-vocab-{name}.gguf"
    inp = Path(str(vocab) + ".inp")
    tok = load_gguf_tokenizer(read_gguf(vocab).metadata)
    tok.save_pretrained(tmp_path)
    hf = load_tokenizer(tmp_path)
    assert type(hf.detokenizer).__name__ == detok
    texts = inp.read_bytes().decode("utf-8").split(GOLDEN_SEPARATOR) + TEXTS  # bytes: keep \r as is
    for t in texts:
        for special in (True, False):
            assert hf.encode(t, add_special_tokens=special) == tok.encode(t, add_special_tokens=special), repr(t)
        ids = tok.encode(t, add_special_tokens=False)
        assert hf.decode(ids) == tok.decode(ids), repr(t)


@pytest.mark.parametrize("dtype", ["keep", "float32"])
def test_convert_tiny_loads_in_mlx_lm(tmp_path, dtype):
    """`mlxspec convert`: mlx_lm loads the directory and computes the same logits as mlxspec."""
    import mlx_lm

    from mlxspec.targets.load import load_target

    src = tmp_path / "tiny.gguf"
    write_tiny_model(src, "Q4_0")
    out = tmp_path / f"mlx-{dtype}"
    r = run("convert", "--model", src, "--out", out, "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out}"
    model, hf_tok = mlx_lm.load(str(out))
    target, tok = load_target(str(src), dense=(dtype == "float32"))
    for t in TEXTS:
        assert hf_tok.encode(t) == tok.encode(t)
    ids = mx.array([tok.encode("the cat sat on the mat")])
    ours, _ = target(ids, target.make_cache())
    theirs = model(ids)
    np.testing.assert_array_equal(np.array(theirs.astype(mx.float32)), np.array(ours.astype(mx.float32)))
    if dtype == "keep":
        import json

        q = json.loads((out / "config.json").read_text())["quantization"]
        assert (q["bits"], q["group_size"]) == (4, 32)
    assert sorted(hf_tok.eos_token_ids) == sorted(tok.eos_token_ids)


def test_convert_refuses_a_directory(tmp_path):
    r = run("convert", "--model", tmp_path, "--out", tmp_path / "o")
    assert_user_error(r, f"mlxspec: error: {tmp_path}: already a model directory; convert takes a .gguf file")


# ----------------------------------------------------------------------------- user errors

def test_missing_file():
    r = run("generate", "--model", "/nonexistent/model.gguf", "--draft", "none", "--prompt", "hi")
    assert_user_error(r, "mlxspec: error: /nonexistent/model.gguf: no such file or directory; pass a .gguf file "
                         "or an MLX/HF model directory")


@pytest.mark.parametrize("cmd, flag, value", [
    ("generate", "--model", ""), ("generate", "--draft", " "),
    ("bench", "--model", ""), ("convert", "--model", " "), ("train", "--model", ""),
])
def test_empty_model_or_draft(cmd, flag, value, tmp_path):
    """An empty --model would resolve to the working directory: refused where it enters (the
    one resolver every command's --model goes through)."""
    extra = {"generate": ["--prompt", "hi"], "bench": ["--draft", "none", "--quick"],
             "convert": ["--out", tmp_path / "o"], "train": ["--out", tmp_path / "o", "--prepare-only"]}[cmd]
    r = run(cmd, flag, value, *extra)
    tail = ", or leave it out for the default model" if flag == "--model" else ", 'auto' or 'none'"
    assert_user_error(r, f"mlxspec: error: {flag} is empty: pass a .gguf file, a directory or a Hugging Face "
                         f"repo id{tail}")


def test_inspect_empty_path():
    assert_user_error(run("inspect", ""), "mlxspec: error: the path is empty: pass a .gguf file, a model/drafter "
                                          "directory or a Hugging Face repo id")


def test_inspect_missing_path():
    r = run("inspect", "/nonexistent/model.gguf")
    assert_user_error(r, "mlxspec: error: /nonexistent/model.gguf: no such file or directory; pass a .gguf file "
                         "or a model/drafter directory")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is not a model")
    r = run("generate", "--model", p, "--draft", "none", "--prompt", "hi")
    assert_user_error(r, f"mlxspec: error: {p}: not a GGUF file (magic b'hell'); pass a .gguf file or a model directory")
    r = run("inspect", p)
    assert_user_error(r, f"mlxspec: error: {p}: not a GGUF file (magic b'hell'); pass a .gguf file or a model directory")


@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_gguf(tiny_gguf, tmp_path, cut):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: 200 if cut == "header" else len(data) - 1000])
    r = run("generate", "--model", bad, "--draft", "none", "--prompt", "hi")
    if cut == "header":
        line = assert_user_error(r, startswith=f"mlxspec: error: {bad}: GGUF file is truncated (header ends at "
                                               "byte 200, needed ")
        assert line.endswith("); download it again")
    else:
        line = assert_user_error(r, startswith=f"mlxspec: error: {bad}: GGUF file is truncated: tensor ")
        assert line.endswith(f"but the file has {len(data) - 1000} bytes; download it again")


def test_bad_flag_value():
    r = run("generate", "--max-tokens", "abc", "--prompt", "hi")
    assert_user_error(r, "mlxspec: error: argument --max-tokens/-n: invalid int value: 'abc' "
                         "(see `mlxspec generate --help`)")
    r = run("generate", "--verbose", "maybe", "--prompt", "hi")
    assert_user_error(r, "mlxspec: error: argument --verbose: expected True or False, got 'maybe' "
                         "(see `mlxspec generate --help`)")
    r = run("convert", "--out", "x", "--dtype", "int4")
    assert_user_error(r, startswith="mlxspec: error: argument --dtype: invalid choice: 'int4'")


def test_unknown_spec_type(tiny_gguf):
    r = run("generate", "--model", tiny_gguf, "--spec-type", "draft-foo", "--prompt", "hi")
    assert_user_error(r, "mlxspec: error: --spec-type 'draft-foo' is not one of auto, draft-dflash, draft-dspark, "
                         "draft-dflash2, draft-eagle3, draft-simple, ngram, none")


def test_no_prompt(tiny_gguf):
    r = run("generate", "--model", tiny_gguf, "--draft", "none")
    assert_user_error(r, "mlxspec: error: no prompt: pass --prompt TEXT (or --prompt - to read stdin)")


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "mamba.gguf"
    write_gguf(p, tiny_tensors(), arch="mamba")
    r = run("generate", "--model", p, "--draft", "none", "--prompt", "hi")
    assert_user_error(r, f"mlxspec: error: {p}: architecture 'mamba' is not supported as a target; "
                         "supported: llama, qwen2, qwen3, gemma3")


def test_unsupported_tensor_type(tmp_path):
    p = tmp_path / "odd.gguf"
    write_gguf(p, tiny_tensors(), types={"blk.1.ffn_up.weight": 99})
    r = run("generate", "--model", p, "--draft", "none", "--prompt", "hi")
    assert_user_error(r, f"mlxspec: error: {p}: unsupported tensor type for blk.1.ffn_up.weight (unknown type 99); "
                         "re-quantize the model to a supported type (F16, BF16, Q8_0, Q4_0, Q4_1, Q1_0, Q2_0, K-quants)")


def test_generate_help_is_current():
    """--spec-type lists every spec type the API takes (ngram included); --draft says what auto does."""
    import argparse

    from mlxspec.api import SPEC_TYPES
    from mlxspec.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a.help for a in sub.choices["generate"]._actions}
    assert " | ".join(SPEC_TYPES) in " ".join(actions["spec_type"].split())
    draft = " ".join(actions["draft"].split())
    assert "recognised by its contents" in draft and "prompt lookup (ngram)" in draft
    assert "the shipped drafter for the default model" not in draft
