"""`--draft auto` recognises a target by what it is, not by its file name (issue 25).

With the real packaged SmolLM2-135M-Instruct GGUF: a renamed copy (by its sha256), the
directory `mlxspec convert` writes from that copy (by config.json `_name_or_path`), and a
copy rewritten without its `general.*` names under another name (by architecture and
vocabulary) all get the shipped DSpark drafter; `inspect` shows the match and its basis;
the renamed copy generates exactly the default model's tokens with the same drafter.
"""

from __future__ import annotations

import io
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mlxspec.drafters.registry import identify, lookup  # noqa: E402

SHIPPED = "shipped:smollm2-135m-eagle3"  # the registry's first entry for SmolLM2 (it won the bench)


@pytest.fixture(scope="module")
def renamed(smollm2_path, tmp_path_factory):
    p = tmp_path_factory.mktemp("renamed") / "my-model.gguf"
    shutil.copyfile(smollm2_path, p)
    return p


def _cli(argv):
    from test_fuzz import cli

    return cli(argv)


def test_a_renamed_copy_is_recognised_by_its_bytes(renamed):
    ident = identify(str(renamed))
    assert ident.name == "smollm2-135m-instruct"
    assert ident.basis == "sha256 of the packaged HuggingFaceTB/SmolLM2-135M-Instruct GGUF"
    assert lookup(str(renamed), ident)["drafter"] == SHIPPED
    rc, out, err = _cli(["inspect", str(renamed)])
    assert rc == 0, err
    assert ("  identified as: smollm2-135m-instruct (by sha256 of the packaged HuggingFaceTB/SmolLM2-135M-Instruct "
            "GGUF)") in out
    assert f"  drafter (--draft auto): {SHIPPED} (eagle3, mlxspec; registry v" in out


def test_a_renamed_copy_generates_what_the_default_model_does(smollm2_path, renamed):
    common = ["--prompt", "def reverse(s):", "--max-tokens", "8", "--verbose", "False"]
    rc0, default, err0 = _cli(["generate", *common])
    rc1, copy, err1 = _cli(["generate", "--model", str(renamed), *common])
    assert rc0 == 0 and rc1 == 0, err0 + err1
    assert copy == default and default.strip()
    assert (f"mlxspec: --draft auto: {SHIPPED} (eagle3, mlxspec; registry v" in err1
            and "the target is SmolLM2-135M-Instruct, recognised by sha256 of the packaged" in err1), err1
    assert "no known drafter" not in err1


def test_a_converted_directory_is_recognised_by_its_config(renamed, tmp_path):
    from mlxspec.targets.convert import convert_to_mlx

    out = convert_to_mlx(str(renamed), str(tmp_path / "converted"))  # from the renamed copy: no name to go by
    ident = identify(str(out))
    assert (ident.name, ident.basis) == ("smollm2-135m-instruct",
                                         "config.json _name_or_path 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    assert lookup(str(out), ident)["drafter"] == SHIPPED
    rc, report, err = _cli(["inspect", str(out)])
    assert rc == 0 and "  identified as: smollm2-135m-instruct (by config.json _name_or_path" in report, err


def test_without_names_the_shape_recognises_it(renamed, tmp_path):
    """general.name / basename dropped and the bytes changed (rewritten): the architecture and
    vocabulary of SmolLM2 are what is left; a name that the registry knows would win over them."""
    import fuzz_harness as fh

    p = tmp_path / "anonymous.gguf"
    drop = ("general.name", "general.basename", "general.finetune", "general.size_label")
    fh.rewrite_gguf(str(renamed), str(p), {}, drop=drop)
    ident = identify(str(p))
    assert ident.name == "smollm2-135m-instruct"
    assert ident.basis == ("GGUF metadata: architecture llama, vocabulary 49152 tokens, hidden 576, 30 layers "
                           "(the shape of SmolLM2-135M-Instruct)")
    from mlxspec.drafters.registry import describe

    assert describe(str(p)).startswith(f"{SHIPPED} (eagle3, mlxspec; registry v")
    log = io.StringIO()
    from mlxspec.api import resolve_auto_draft

    draft, spec_type = resolve_auto_draft(str(p), log=log)
    assert draft.endswith("smollm2-135m-eagle3") and "recognised by GGUF metadata: architecture llama" in log.getvalue()
