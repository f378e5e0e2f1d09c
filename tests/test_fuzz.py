"""mlxspec's own fuzz suite (issue 16): hostile inputs never give a traceback, crash, hang,
memory blow-up or silent wrong model.

`test_fuzz_suite` runs a few hundred seeded cases (tests/fuzz_harness.py: GGUF target and
drafter mutations made with GGUFWriter and raw structural byte edits, drafter config.json and
safetensors mutations, CLI flag and API argument boundaries, FIFOs) in a worker process under
a memory cap and a time limit; each must end as a one-line error with exit 2 or a run whose
output equals the uncorrupted baseline. The other tests pin exact messages of each class.
A larger run: `scripts/fuzz.py --cases N --seed S`.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_harness as fh  # noqa: E402

from mlxspec.errors import MlxspecError  # noqa: E402

N_CASES = int(os.environ.get("MLXSPEC_FUZZ_CASES", "300"))


def test_fuzz_suite(tmp_path):
    results, baseline = fh.run_cases(N_CASES, 0, str(tmp_path))
    assert baseline.strip(), "the baseline run printed nothing"
    bad = [f"{v} {c.group} {c.id}: {c.desc} -> {d[:200]}" for c, v, d, _ in results if v not in fh.GOOD]
    print(fh.verdict_table(results))
    assert not bad, "\n".join(bad)
    verdicts = {v for _, v, *_ in results}
    assert len(results) == N_CASES and {"error", "same", "ok"} <= verdicts
    groups = {c.group for c, *_ in results}
    assert {"gguf-target", "hf-drafter", "raw-target", "raw-drafter", "flags", "api", "files", "text", "outputs",
            "messages", "gguf-types"} <= groups


# ----------------------------------------------------------------------------- exact outcomes

@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    f = fh.Fixtures(str(tmp_path_factory.mktemp("fuzzfx")))
    yield f
    f.close()


def cli(argv, stdin=b""):
    from mlxspec import cli as cli_mod

    out, err, saved = io.StringIO(), io.StringIO(), (sys.stdout, sys.stderr, sys.stdin)
    sys.stdout, sys.stderr, sys.stdin = out, err, io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    os.environ["MLXSPEC_NO_BLAS_REEXEC"] = "1"
    try:
        try:
            rc = cli_mod.main(argv)
        except SystemExit as e:
            rc = e.code
    finally:
        sys.stdout, sys.stderr, sys.stdin = saved
    return rc, out.getvalue(), err.getvalue()


def one_error(rc, err) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("mlxspec: error: ")]
    assert rc == 2 and len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    return lines[0][len("mlxspec: error: "):]


def test_mlxspec_error_is_a_value_error_and_one_line():
    e = MlxspecError("a\nb\rc\x1dd\x00e")
    assert isinstance(e, ValueError) and str(e) == "a b c d?e"


@pytest.mark.parametrize("flag,value,msg", [
    ("--max-tokens", "0", "max_tokens (--max-tokens) 0 is out of range: pass an integer >= 1"),
    ("--temp", "nan", "temp (--temp) nan is out of range: pass a finite number >= 0.0"),
    ("--top-p", "1.5", "top_p (--top-p) 1.5 is out of range: pass a finite number in (0.0, 1.0]"),
    ("--top-k", "-1", "top_k (--top-k) -1 is out of range: pass an integer >= 0"),
    ("--seed", "-1", f"seed (--seed) -1 is out of range: pass an integer in [0, {2**63 - 1}]"),
    ("--p-min", "1.1", "p_min (--p-min) 1.1 is out of range: pass a finite number in [0.0, 1.0]"),
])
def test_flags_out_of_range(fx, flag, value, msg):
    rc, out, err = cli(fx.base_argv(extra=[flag, value]))
    assert one_error(rc, err) == msg and out == ""


def test_prompt_refusals(fx):
    argv = fx.base_argv()
    i = argv.index("--prompt") + 1
    rc, _, err = cli(argv[:i] + ["-"] + argv[i + 1:], stdin=b"the \xff the")
    assert one_error(rc, err) == "stdin is not UTF-8 text (invalid byte 0xff at offset 4); pass the text as UTF-8"
    rc, _, err = cli(argv[:i] + [""] + argv[i + 1:])
    assert one_error(rc, err) == "the prompt is empty; pass some text with --prompt (or on stdin with --prompt -)"
    rc, _, err = cli(argv + ["--system-prompt", "x", "--ignore-chat-template"])
    assert one_error(rc, err) == ("--system-prompt needs the chat template; drop --ignore-chat-template or put the "
                                  "system text into --prompt")
    rc, _, err = cli(argv[:i] + ["the " * 600] + argv[i + 1:])
    assert one_error(rc, err) == ("the prompt (602 tokens) plus max_tokens (6) exceeds the model's context length "
                                  "(512 tokens); shorten the prompt or lower --max-tokens")


def test_fifo_model_is_refused_not_opened(fx, tmp_path):
    p = tmp_path / "m.gguf"
    os.mkfifo(p)
    rc, _, err = cli(fx.base_argv(model=str(p)))
    assert one_error(rc, err) == f"{p}: not a regular file (FIFO, socket or device); pass a regular GGUF file"


def _patch(data: bytes, layout, kind: str, index: int, value: bytes) -> bytes:
    f = [x for x in layout if x[0] == kind][index]
    return data[:f[1]] + value + data[f[1] + len(value):]


def test_gguf_tensor_table_errors_name_the_tensor(fx, tmp_path):
    from mlxspec.gguf.file import read_gguf

    p = tmp_path / "t.gguf"
    offs = [x for x in fx.layout if x[0] == "t_offset"]
    p.write_bytes(_patch(fx.target_bytes, fx.layout, "t_offset", 1, fx.target_bytes[offs[0][1]:offs[0][1] + 8]))
    with pytest.raises(MlxspecError, match=r"tensor blk\.0\.attn_norm\.weight starts at data offset 0, expected \d+ "
                                           r"right after token_embd\.weight \(F16, 139264 bytes by its type and shape\)"):
        read_gguf(p)
    p.write_bytes(_patch(fx.target_bytes, fx.layout, "t_ndims", 0, struct.pack("<I", 5)))
    with pytest.raises(MlxspecError, match=r"tensor 'token_embd\.weight' has 5 dimensions \(GGUF allows 1 to 4\)"):
        read_gguf(p)


def test_gguf_metadata_is_typed_and_ranged(fx, tmp_path):
    from mlxspec.targets.gguf import load_gguf_target

    cases = [("llama.attention.head_count", fh.U32, 0, "llama.attention.head_count is 0, expected an integer in "
                                                       "[1, 1048576]"),
             ("llama.block_count", fh.ARR, [1, 2], "llama.block_count is [1, 2] (list), expected an integer"),
             ("llama.rope.freq_base", fh.F32, float("nan"), "llama.rope.freq_base is nan, expected a finite number "
                                                            "in (0, 1000000000000.0]")]
    for key, vt, v, msg in cases:
        md = [(k, vt, v, fh.I32 if vt == fh.ARR else None) if k == key else m
              for m in fx.md for k in [m[0]]]
        p = tmp_path / "m.gguf"
        fh.write_gguf_file(p, "llama", md, fx.tensors)
        with pytest.raises(MlxspecError) as e:
            load_gguf_target(str(p))
        assert msg in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize("key,written", [(1, None), (1, 1), (4, 4), (24, None), (0, None)])
def test_gguf_alignment_below_8_or_not_a_power_of_two_is_refused(fx, tmp_path, key, written):
    """general.alignment 1 (issue 39: a power of two, so it passed, and every tensor was read
    from a shifted offset until the logits were NaN), or any value not a power of two from 8 up
    (the GGUF spec: a multiple of 8), is one line naming the key and the fix where the file is
    read: exit 2 from the CLI, whether the data were padded to that alignment or not."""
    p = tmp_path / "t.gguf"
    fh.write_gguf_file(p, "llama", fx.md + [("general.alignment", fh.U32, key, None)], fx.tensors, written)
    rc, out, err = cli(fx.base_argv(model=str(p)))
    assert one_error(rc, err) == (f"{p}: general.alignment is {key}, expected a power of two from 8 up (a multiple of "
                                  "8, as the GGUF spec requires; 32 when absent); the file is corrupt or was written "
                                  "wrongly: download it again, or rewrite it with general.alignment 32")
    assert out == ""


def test_gguf_alignment_8_reads_the_same_model(fx, tmp_path):
    p = tmp_path / "t.gguf"
    fh.write_gguf_file(p, "llama", fx.md + [("general.alignment", fh.U32, 8, None)], fx.tensors, 8)
    rc, out, err = cli(fx.base_argv(model=str(p)))
    rc0, out0, _ = cli(fx.base_argv())
    assert rc == rc0 == 0 and out == out0, err


def _drafter_copy(fx, tmp_path, config=None, tensors=None):
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "drafter"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(fx.drafter, d)
    if config:
        c = json.loads((d / "config.json").read_text())
        c.update(config)
        (d / "config.json").write_text(json.dumps(c))
    if tensors:
        t = load_file(d / "model.safetensors")
        tensors(t)
        save_file(t, d / "model.safetensors")
    return str(d)


def test_drafter_config_and_weights(fx, tmp_path):
    from mlxspec.drafters.load import load_drafter

    def err(**kw):
        with pytest.raises(MlxspecError) as e:
            load_drafter(_drafter_copy(fx, tmp_path, **kw), log=io.StringIO())
        return str(e.value).split(": ", 1)[1]

    assert err(config={"aux_hidden_state_layer_ids": [1.5]}) == (
        "aux_hidden_state_layer_ids holds 1.5, expected integers in [0, 1024]; fix the drafter's config.json or "
        "download the drafter again")
    assert err(config={"aux_hidden_state_layer_ids": [1, 1]}).startswith("aux_hidden_state_layer_ids repeats 1;")
    assert err(config={"block_size": 0}).startswith("block_size is 0, expected an integer in [1, 256];")
    assert err(config={"block_size": 10**9}).startswith("block_size is 1000000000, expected an integer in [1, 256];")

    def nan(t):
        a = t["fc.weight"].copy()
        a[0, 0] = np.nan
        t["fc.weight"] = a
    assert err(tensors=nan) == "tensor fc.weight holds NaN or Inf values; the weights are corrupt, re-export them"

    def d2t(t):
        t["d2t"] = t["d2t"].copy()
        t["d2t"][-1] = 10**6
    assert err(tensors=d2t).startswith("d2t maps draft ids to target ids 1..")


def test_verification_never_emits_from_nonfinite_probabilities():
    from mlxspec.engine.verify import accept_sampled, sample_token

    rng = np.random.default_rng(0)
    p = np.full((2, 4), 0.25)
    q_bad = np.array([[math.nan] * 4])
    a, tok = accept_sampled([3], q_bad, p, rng)  # a broken draft row: the target is sampled there
    assert a == 0 and 0 <= tok < 4
    with pytest.raises(MlxspecError, match="non-finite"):
        accept_sampled([3], np.full((1, 4), 0.25), np.full((2, 4), math.nan), rng)
    with pytest.raises(MlxspecError, match="non-finite"):
        sample_token(np.zeros(4), rng)


def test_convert_refuses_non_empty_out_and_never_writes_through_symlinks(fx, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, _, err = cli(["convert", "--model", fx.target, "--out", str(out)])
    assert one_error(rc, err) == (f"--out {out}: the directory is not empty; pass a new directory, or --force to "
                                  "replace mlxspec's files in it")
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    (out / "config.json").symlink_to(outside)
    rc, stdout, err = cli(["convert", "--model", fx.target, "--out", str(out), "--force"])
    assert rc == 0, err
    assert outside.read_text() == "precious" and not (out / "config.json").is_symlink()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "notes.txt", "tokenizer.json",
         "tokenizer_config.json"])


def test_train_resumes_only_matching_settings(tmp_path):
    from dataclasses import asdict

    from mlxspec.train.checkpoint import check_out_dir
    from mlxspec.train.config import TrainConfig

    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "state.json").write_text(json.dumps({"step": 2000, "train_config": asdict(TrainConfig(
        lineage="dspark", taps=[1, 8]))}))
    check_out_dir(out, TrainConfig(lineage="dspark", taps=[1, 8], steps=4000), resume=True, force=False)  # more steps
    with pytest.raises(MlxspecError) as e:
        check_out_dir(out, TrainConfig(lineage="dflash", taps=[1, 8]), resume=True, force=False)
    assert str(e.value) == (f"--out {out} holds a checkpoint of a different run (lineage 'dspark' there, 'dflash' "
                            "here); pass the same settings to resume it, --no-resume --force to start over, or a new --out")
    with pytest.raises(MlxspecError, match="the directory is not empty; pass a new directory, or --force"):
        check_out_dir(out, TrainConfig(lineage="dflash"), resume=False, force=False)
    check_out_dir(out, TrainConfig(lineage="dflash"), resume=False, force=True)


def test_cache_refuses_a_truncated_default_model(tmp_path, monkeypatch, smollm2_path):
    from mlxspec import cache

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    models = tmp_path / "models"
    models.mkdir()
    out = models / os.path.basename(cache.DEFAULT_MODEL_MEMBER)
    out.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(MlxspecError) as e:
        cache.default_model_path(download=False)
    assert str(e.value) == (f"{out}: the cached default model is incomplete or corrupt (sha256 mismatch); run "
                            "`mlxspec generate` once with network access to download it again")
    out.unlink()
    out.symlink_to(smollm2_path)  # the session's copy (never the user's own cache: tests/conftest.py)
    assert cache.default_model_path(download=False) == out
    marker = out.with_name(out.name + ".ok")
    assert marker.read_text().endswith(cache.DEFAULT_MODEL_SHA256)


# ----------------------------------------------------------------------------- issue 25

@pytest.mark.parametrize("flag", ["--prompt", "--system-prompt", "--stop"])
def test_text_flags_that_are_not_utf8_are_refused(fx, flag):
    bad = b"abc\xff\xfedef".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    argv = fx.base_argv()
    if flag == "--prompt":
        argv[argv.index("--prompt") + 1] = bad
    else:
        argv += [flag, bad]
    rc, out, err = cli(argv)
    assert one_error(rc, err) == f"{flag} is not UTF-8 text (invalid byte 0xff at offset 3); pass the text as UTF-8"
    assert out == ""


def test_non_utf8_argv_bytes_from_a_real_process(fx):
    """The bytes as a shell passes them ($'abc\\xff\\xfedef'), through the real entry point."""
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXSPEC_NO_BLAS_REEXEC": "1"}
    argv = [a.encode() for a in fx.base_argv()]
    argv[argv.index(b"--prompt") + 1] = b"abc\xff\xfedef"
    r = subprocess.run([sys.executable.encode(), b"-m", b"mlxspec", *argv], capture_output=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stdout == b"", r.stderr
    assert r.stderr.decode() == ("mlxspec: error: --prompt is not UTF-8 text (invalid byte 0xff at offset 3); pass "
                                 "the text as UTF-8\n")


def test_api_refuses_text_that_is_no_unicode(fx):
    from mlxspec import api
    from mlxspec.targets.load import load_target

    target, tok = load_target(fx.target)
    with pytest.raises(MlxspecError) as e:
        api.generate(target, tok, "the \ud800 the", max_tokens=2)
    assert str(e.value) == "prompt is not UTF-8 text (lone surrogate U+D800 at character 4); pass the text as UTF-8"
    with pytest.raises(MlxspecError, match=r"^stop is not UTF-8 text \(invalid byte 0xff at offset 0\)"):
        api.generate(target, tok, "the the", max_tokens=2, stop=["\udcff"])


def test_convert_output_paths(fx, tmp_path):
    rc, _, err = cli(["convert", "--model", fx.target, "--out", "/dev/null/x"])
    assert one_error(rc, err) == "--out /dev/null/x: /dev/null is not a directory; pass a path inside a directory"
    ro = fx.read_only_dir()
    rc, _, err = cli(["convert", "--model", fx.target, "--out", f"{ro}/out"])
    why = "read-only file system" if os.geteuid() == 0 else "permission denied"
    assert one_error(rc, err) == f"--out {ro}/out: cannot write into {ro} ({why}); pass a directory you can write to"
    deep = tmp_path / "a" / "b" / "c"  # missing parents are created, as mkdir -p
    rc, out, err = cli(["convert", "--model", fx.target, "--out", str(deep)])
    assert rc == 0 and (deep / "config.json").is_file(), err
    full = fx.full_dir()
    if full is None:
        pytest.skip("no full file system to write to (mounting a tmpfs needs root)")
    rc, _, err = cli(["convert", "--model", fx.target, "--out", f"{full}/out"])
    assert re.fullmatch(rf"--out {full}/out: needs [\d.]+ MB but {full} has 0\.0 MB free; free some space or pass a "
                        "path on another disk", one_error(rc, err))


@pytest.mark.parametrize("fmt", ["gguf", "speculators"])
def test_no_space_left_while_writing_a_drafter(fx, fmt):
    """ENOSPC at write time (the space checks passed or could not know): Python's OSError and
    MLX's own writer (RuntimeError, no errno) both end as one line."""
    from mlxspec.drafters.load import load_drafter, save_drafter
    from mlxspec.targets.load import load_target

    full = fx.full_dir()
    if full is None:
        pytest.skip("no full file system to write to (mounting a tmpfs needs root)")
    model, cfg = load_drafter(fx.drafter, log=io.StringIO())
    out = f"{full}/d.gguf" if fmt == "gguf" else f"{full}/d"
    with pytest.raises(MlxspecError) as e:
        save_drafter(model, cfg, out, fmt, target=load_target(fx.target)[0])
    assert str(e.value).startswith(f"drafter output {out}: cannot write") and str(e.value).endswith(
        ": no space left on the device; free some space or pass a path on another disk"), str(e.value)


def test_bench_out_under_a_file_is_refused_before_benchmarking(fx):
    rc, _, err = cli(["bench", "--model", fx.target, "--draft", "none", "--quick", "--out", "/dev/null/x"])
    assert one_error(rc, err) == "--out /dev/null/x: /dev/null is not a directory; pass a path inside a directory"


def test_output_checks_for_train(tmp_path):
    """The reusable checks `train --out` calls (validate.check_output_dir)."""
    from mlxspec.validate import check_output_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(MlxspecError) as e:
        check_output_dir("--out", tmp_path / "f" / "run")
    assert str(e.value) == f"--out {tmp_path}/f/run: {tmp_path}/f is not a directory; pass a path inside a directory"
    with pytest.raises(MlxspecError, match="exists and is not a directory"):
        check_output_dir("--out", tmp_path / "f")
    assert check_output_dir("--out", tmp_path / "new" / "run") == tmp_path / "new" / "run"


def test_gguf_drafter_tensor_types_are_checked(fx, tmp_path):
    """Real files from GGUFWriter: d2t's I32 bytes labelled F32 (what a wrong type gives: the ids
    read as tiny floats) and a weight's float bytes labelled I32 are refused, naming the tensor;
    d2t as I64 holds the same ids and loads to the same drafter."""
    from mlxspec.drafters.load import load_drafter

    def load(retype):
        p = tmp_path / "d.gguf"
        fh.rewrite_gguf(fx.drafter_gguf, str(p), {}, retype=retype)
        return load_drafter(str(p), log=io.StringIO())

    with pytest.raises(MlxspecError) as e:
        load({"d2t": "F32"})
    assert str(e.value) == (f"{tmp_path}/d.gguf: tensor d2t has type F32, expected I32 or I64 (target token ids); "
                            "the drafter file is corrupt, re-export it")
    with pytest.raises(MlxspecError) as e:
        load({"fc.weight": "I32"})
    assert str(e.value) == (f"{tmp_path}/d.gguf: tensor fc.weight has integer type I32, expected a float or quantized "
                            "type (F32, F16, BF16, Q8_0, ...); the drafter file is corrupt, re-export it")
    m64, _ = load({"d2t": "I64"})
    m32, _ = load_drafter(fx.drafter_gguf, log=io.StringIO())
    assert np.array_equal(np.asarray(m64.d2t), np.asarray(m32.d2t))


def test_messages_name_the_real_cause(fx, tmp_path):
    import shutil

    from mlxspec.drafters.load import load_drafter
    from mlxspec.targets.load import load_target

    m = tmp_path / "m"
    shutil.copytree(fx.hf_target, m)
    c = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**c, "hidden_size": 255}))
    with pytest.raises(MlxspecError) as e:
        load_target(str(m))
    assert str(e.value) == (f"{m}/config.json: config.json does not match the weights: tensor "
                            f"model.embed_tokens.weight in model.safetensors is [{c['vocab_size']}, 256], config.json "
                            f"makes it [{c['vocab_size']}, 255] (hidden_size 255); fix config.json or use the weights it "
                            "came with")

    def drafter_err(mutate):
        c = json.loads(open(os.path.join(fx.drafter, "config.json")).read())
        mutate(c)
        with pytest.raises(MlxspecError) as e:
            load_drafter(_write_cfg(fx, tmp_path, c), log=io.StringIO())
        return str(e.value).split(": ", 1)[1]

    assert drafter_err(lambda c: c.pop("transformer_layer_config")) == (
        "config.json has no transformer_layer_config (the drafter's layer sizes: hidden_size, heads, ...); the "
        "drafter config is incomplete, export it again")
    assert drafter_err(lambda c: c["transformer_layer_config"].pop("hidden_size")) == (
        "target_hidden_size 256 differs from the drafter hidden size 4096 (transformer_layer_config names none: "
        "Qwen3's default); drafters with a separate target width are not supported")
    assert drafter_err(lambda c: c.pop("speculators_model_type")) == (
        "config.json is a vLLM speculators drafter (speculators_config, transformer_layer_config, architectures "
        "'DSparkSpeculator') but has no speculators_model_type; add \"speculators_model_type\": \"dspark\" (Markov "
        "head), \"dflash\" or \"dflash2\"")

    def deepspec(c):  # a DeepSpec directory that lacks its taps: says why it was read as DeepSpec
        for k in ("speculators_model_type", "speculators_config", "transformer_layer_config"):
            c.pop(k)
        c["architectures"] = ["Qwen3DSparkModel"]
    assert drafter_err(deepspec) == (
        "config.json has no target_layer_ids (read as a DeepSpec DSpark directory: architectures "
        "['Qwen3DSparkModel'], no speculators_model_type); the drafter config is incomplete")


def _write_cfg(fx, tmp_path, config: dict) -> str:
    import shutil

    d = tmp_path / "drafter"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(fx.drafter, d)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)
