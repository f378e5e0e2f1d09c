"""Lineage and block layout: one table for `resolve_layout`, the file matrix (format x
lineage x sample_from_anchor true/false/absent), requested-type warnings, the init line,
and validation against the target."""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import FrozenInstanceError, asdict

import pytest

from mlxspec.errors import MlxspecError
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.formats import read_drafter
from mlxspec.drafters.load import load_drafter, resolve_layout
from mlxspec.logger import to_stderr
from mlxspec.targets.model import TargetInfo
from test_drafter_formats import edit_config, make_cfg, make_model, rewrite_gguf, write

# ----------------------------------------------------------------------------- the table

LAYOUT_TABLE = [
    # format, lineage, value in file -> sample_from_anchor, layout_from
    ("zlab", "dflash", None, False, "convention:zlab"),
    ("zlab", "dflash", True, True, "key:k"),
    ("deepspec", "dflash", None, True, "convention:deepspec"),  # DeepSpec DFlash baselines: anchor-first
    ("deepspec", "dspark", None, True, "convention:deepspec"),
    ("deepspec", "dspark", False, False, "key:k"),
    ("speculators-dspark", "dspark", None, True, "convention:speculators-dspark"),
    ("speculators-dspark", "dspark", False, False, "key:k"),
    ("speculators-dflash", "dflash", None, False, "convention:speculators-dflash"),
    ("speculators-dflash", "dflash", True, True, "key:k"),
    ("gguf", "dspark", None, True, "convention:gguf-dspark"),
    ("gguf", "dflash", None, False, "convention:gguf-dflash"),
    ("gguf", "dspark", False, False, "key:k"),
    ("gguf", "dflash", True, True, "key:k"),
    ("gguf-dspark-legacy", "dspark", None, True, "convention:gguf-dspark-legacy"),
    ("gguf-dspark-legacy", "dspark", False, False, "key:k"),
]


@pytest.mark.parametrize("fmt,lineage,value,sfa,src", LAYOUT_TABLE)
def test_resolve_layout_table(fmt, lineage, value, sfa, src):
    got_sfa, got_src, reason = resolve_layout(fmt, lineage, value, "k")
    assert (got_sfa, got_src) == (sfa, src)
    assert reason


def test_resolve_layout_unknown_format():
    with pytest.raises(ValueError):
        resolve_layout("onnx", "dflash", None)


# ----------------------------------------------------------------------------- the file matrix

def load(path, **kw):
    buf = io.StringIO()
    m, c = load_drafter(path, log=buf, **kw)
    return c, buf.getvalue().splitlines()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("layout")
    bonus = make_cfg(sample_from_anchor=False)  # z-lab style DFlash
    first = make_cfg(sample_from_anchor=True)  # DeepSpec DFlash baseline: no Markov head, anchor-first
    dspark = make_cfg(markov_rank=16, confidence_head=True)
    dspark_bonus = make_cfg(markov_rank=16, confidence_head=True, sample_from_anchor=False)
    mb, mf, md, mdb = (make_model(c, i) for i, c in enumerate((bonus, first, dspark, dspark_bonus)))
    return {
        "zlab-dflash": write(d, mb, bonus, "zlab", name="zlab-dflash"),
        "deepspec-dflash": write(d, mf, first, "deepspec", name="deepspec-dflash"),
        "deepspec-dspark": write(d, md, dspark, "deepspec", name="deepspec-dspark"),
        "speculators-dflash": write(d, mb, bonus, "speculators", name="spec-dflash"),
        "speculators-dspark": write(d, md, dspark, "speculators", name="spec-dspark"),
        "gguf-dflash": write(d, mb, bonus, "gguf", name="gguf-dflash"),
        "gguf-dspark": write(d, md, dspark, "gguf", name="gguf-dspark"),
        "gguf-dspark-bonus": write(d, mdb, dspark_bonus, "gguf", name="gguf-dspark-bonus"),
        "legacy": write(d, md, dspark, "gguf-dspark-legacy", name="legacy"),
        "legacy-doubled": write(d, md, dspark, "gguf-dspark-legacy", name="legacy2", doubled_prefix=True),
        "dir": d,
    }


def variant(files, base: str, state) -> str:
    """The base file with its layout key set to True/False or removed (None)."""
    src = files[base]
    tag = {True: "t", False: "f", None: "a"}[state]
    if src.endswith(".gguf"):
        if base.startswith("legacy"):
            key = "dspark.dspark.sample_from_anchor" if base == "legacy-doubled" else "dspark.sample_from_anchor"
        else:
            key = "dflash.sample_from_anchor"
        dst = str(files["dir"] / f"{base}-{tag}.gguf")
        if state is None:
            return rewrite_gguf(src, dst, drop_keys=(key,))
        return rewrite_gguf(src, dst, set_keys={key: state})
    import shutil

    dst = str(files["dir"] / f"{base}-{tag}")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    c = json.load(open(os.path.join(dst, "config.json")))
    if base.startswith("zlab"):
        dc = dict(c["dflash_config"])
        dc.pop("sample_from_anchor", None)
        if state is not None:
            dc["sample_from_anchor"] = state
        edit_config(dst, dflash_config=dc, sample_from_anchor=None)
    else:
        edit_config(dst, sample_from_anchor=state)
    return dst


MATRIX = [
    # base file, key state -> sample_from_anchor, lineage, layout_from
    ("zlab-dflash", None, False, "dflash", "convention:zlab"),
    ("zlab-dflash", True, True, "dflash", "key:dflash_config.sample_from_anchor"),
    ("zlab-dflash", False, False, "dflash", "key:dflash_config.sample_from_anchor"),
    ("deepspec-dflash", None, True, "dflash", "convention:deepspec"),
    ("deepspec-dspark", None, True, "dspark", "convention:deepspec"),
    ("deepspec-dspark", False, False, "dspark", "key:sample_from_anchor"),
    ("speculators-dflash", None, False, "dflash", "convention:speculators-dflash"),
    ("speculators-dflash", True, True, "dflash", "key:sample_from_anchor"),
    ("speculators-dspark", None, True, "dspark", "convention:speculators-dspark"),
    ("speculators-dspark", False, False, "dspark", "key:sample_from_anchor"),
    ("speculators-dspark", True, True, "dspark", "key:sample_from_anchor"),
    ("gguf-dflash", None, False, "dflash", "convention:gguf-dflash"),
    ("gguf-dflash", True, True, "dflash", "key:dflash.sample_from_anchor"),
    ("gguf-dspark", None, True, "dspark", "convention:gguf-dspark"),
    ("gguf-dspark", False, False, "dspark", "key:dflash.sample_from_anchor"),
    ("gguf-dspark", True, True, "dspark", "key:dflash.sample_from_anchor"),
    ("legacy", None, True, "dspark", "convention:gguf-dspark-legacy"),
    ("legacy", True, True, "dspark", "key:dspark.sample_from_anchor"),
    ("legacy-doubled", False, False, "dspark", "key:dspark.dspark.sample_from_anchor"),
]


@pytest.mark.parametrize("base,state,sfa,lineage,src", MATRIX)
def test_file_layout_matrix(files, base, state, sfa, lineage, src):
    cfg, lines = load(variant(files, base, state))
    assert (cfg.sample_from_anchor, cfg.lineage) == (sfa, lineage)
    assert cfg.n_drafts == (7 if sfa else 6)
    assert cfg.extra["layout_from"] == src and cfg.layout_reason
    assert len(lines) == 1 and lines[0].startswith("mlxspec: drafter ")
    assert f"lineage={lineage} sample_from_anchor={'true' if sfa else 'false'} " in lines[0]
    assert lines[0].endswith(f"layout_from={src}")


# ----------------------------------------------------------------------------- requested type

def test_dspark_file_requested_as_dflash_warns_and_keeps_file_layout(files):
    p = files["gguf-dspark"]
    cfg, lines = load(p, requested="draft-dflash")
    assert (cfg.lineage, cfg.sample_from_anchor) == ("dspark", True)
    assert lines[0] == (
        f"mlxspec: warning: requested draft-dflash but {p} is a DSpark drafter (Markov head, rank 16); using "
        "draft-dspark with sample_from_anchor=true from the file: the dflash path would drop the Markov head and "
        "confidence truncation, and this file is anchor-first (sample_from_anchor=true), so the draft-dflash "
        "layout would draft one row late and acceptance collapses"
    )
    assert len(lines) == 2 and lines[1].startswith("mlxspec: drafter lineage=dspark sample_from_anchor=true ")


def test_dflash_file_requested_as_dspark_warns(files):
    p = files["zlab-dflash"]
    cfg, lines = load(p, requested="draft-dspark")
    assert (cfg.lineage, cfg.sample_from_anchor) == ("dflash", False)
    assert lines[0] == (
        f"mlxspec: warning: requested draft-dspark but {p} is a DFlash drafter (no Markov head); using draft-dflash "
        "with sample_from_anchor=false from the file: the dspark path would look for a Markov head and confidence "
        "head the file does not have, and this file is bonus-anchor (sample_from_anchor=false), so the "
        "draft-dspark layout would draft one row early and acceptance collapses"
    )
    assert len(lines) == 2


def test_bonus_anchor_dspark_requested_as_dflash_warns_without_layout_collapse(files):
    cfg, lines = load(files["gguf-dspark-bonus"], requested="draft-dflash")
    assert (cfg.lineage, cfg.sample_from_anchor) == ("dspark", False)
    assert "drop the Markov head and confidence truncation" in lines[0]
    assert "acceptance collapses" not in lines[0]


def test_deepspec_dflash_baseline_is_anchor_first_whatever_is_requested(files):
    p = files["deepspec-dflash"]
    cfg, lines = load(p, requested="draft-dflash")  # lineage agrees: no warning, still anchor-first
    assert (cfg.lineage, cfg.sample_from_anchor, len(lines)) == ("dflash", True, 1)
    cfg, lines = load(p, requested="draft-dspark")
    assert (cfg.lineage, cfg.sample_from_anchor) == ("dflash", True)
    assert lines[0].startswith(f"mlxspec: warning: requested draft-dspark but {p} is a DFlash drafter")
    assert "acceptance collapses" not in lines[0]  # both read it anchor-first


@pytest.mark.parametrize("requested", ["auto", "draft-dspark"])
def test_no_warning_when_request_agrees(files, requested):
    cfg, lines = load(files["speculators-dspark"], requested=requested)
    assert len(lines) == 1 and cfg.lineage == "dspark"


def test_unknown_requested_type():
    with pytest.raises(MlxspecError) as e:
        load_drafter("/nonexistent", requested="eagle3")
    assert str(e.value) == "unknown drafter type 'eagle3'; use one of: auto, draft-dflash, draft-dspark, draft-dflash2, draft-eagle3"


def test_init_line_exact_and_on_stderr(files, capsys):
    """The command line (`to_stderr`, as `mlxspec.cli.main` runs every command) prints it alone."""
    with to_stderr():
        load_drafter(files["gguf-dspark"])
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "mlxspec: drafter lineage=dspark sample_from_anchor=true block_size=7 taps=1,3,5 mask=500 "
        "markov=vanilla/r16 confidence=yes log_snr=no format=gguf layout_from=key:dflash.sample_from_anchor"
    ]
    with to_stderr():
        load_drafter(files["zlab-dflash"])
    assert capsys.readouterr().err.splitlines() == [
        "mlxspec: drafter lineage=dflash sample_from_anchor=false block_size=7 taps=1,3,5 mask=500 markov=none "
        "confidence=no log_snr=no format=zlab layout_from=convention:zlab"
    ]


def test_library_reports_through_the_mlxspec_logger(files, capsys, caplog):
    """Outside the command line the init line goes to logging.getLogger("mlxspec"), at INFO,
    and nothing is printed; a mismatch warning is at WARNING."""
    with caplog.at_level(logging.INFO, logger="mlxspec"):
        load_drafter(files["zlab-dflash"])
        load_drafter(files["gguf-dspark"], requested="draft-dflash")
    assert capsys.readouterr().err == ""
    got = [(r.name, r.levelno, r.getMessage().split(" ")[1]) for r in caplog.records]
    assert got == [("mlxspec", logging.INFO, "drafter"), ("mlxspec", logging.WARNING, "warning:"),
                   ("mlxspec", logging.INFO, "drafter")]


# ----------------------------------------------------------------------------- target validation

def tinfo(**kw):
    base = dict(hidden_size=64, num_layers=8, vocab_size=512, model_type="qwen3", source="t.gguf")
    base.update(kw)
    return TargetInfo(**base)


def test_validation_passes_for_a_matching_target(files):
    cfg, lines = load(files["gguf-dspark"], target_info=tinfo())
    assert len(lines) == 1


@pytest.mark.parametrize("info,msg", [
    (tinfo(hidden_size=128), "drafter hidden size 64 (fc takes 3 taps x 64) does not match t.gguf hidden size 128; "
                             "use the drafter trained for this target"),
    (tinfo(num_layers=5), "tap layer 5 is outside t.gguf, which has 5 layers (valid taps 0..3); use the drafter "
                          "trained for this target"),
    (tinfo(num_layers=6), "tap layer 5 is the last layer of t.gguf (6 layers); drafters tap intermediate layers, "
                          "not the final one: the drafter was made for a deeper target (or its tap ids are off by "
                          "one); use the drafter trained for this target"),
    (tinfo(vocab_size=1024), "drafter vocabulary 512 does not match t.gguf vocabulary 1024; use the drafter trained "
                             "for this target's tokenizer"),
])
def test_validation_errors(files, info, msg):
    p = files["speculators-dspark"]
    buf = io.StringIO()
    with pytest.raises(MlxspecError) as e:
        load_drafter(p, target_info=info, log=buf)
    assert str(e.value) == f"{p}: {msg}"
    assert buf.getvalue() == ""  # refused before any init line


def test_validation_mask_and_embedding_tap(tmp_path):
    cfg = make_cfg(mask_token_id=600, markov_rank=4)
    p = write(tmp_path, make_model(cfg), cfg, "gguf")
    with pytest.raises(MlxspecError) as e:
        load_drafter(p, target_info=tinfo(), log=io.StringIO())
    assert str(e.value) == (
        f"{p}: mask token id 600 is outside t.gguf vocabulary (0..511); the file's mask_token_id is wrong for "
        "this target"
    )
    cfg = make_cfg(target_layer_ids=[-1, 3, 5], markov_rank=4)
    p = write(tmp_path, make_model(cfg), cfg, "deepspec")
    c, _ = load(p)
    assert c.target_layer_ids == [-1, 3, 5]
    with pytest.raises(MlxspecError) as e:
        load_drafter(p, target_info=tinfo(), log=io.StringIO())
    assert str(e.value) == (
        f"{p}: tap -1 (the embedding output) is not supported by mlxspec's target taps; use a drafter whose taps "
        "are decoder layers"
    )


def test_validation_num_target_layers(files, tmp_path):
    import shutil

    p = str(tmp_path / "ds")
    shutil.copytree(files["deepspec-dspark"], p)
    edit_config(p, num_target_layers=36)
    assert load(p, target_info=tinfo(num_layers=36))[0].extra["num_target_layers"] == 36
    with pytest.raises(MlxspecError) as e:
        load_drafter(p, target_info=tinfo(), log=io.StringIO())
    assert str(e.value) == (
        f"{p}: drafter was trained for a 36-layer target (num_target_layers) but t.gguf has 8 layers; use the "
        "drafter trained for this target"
    )


# ----------------------------------------------------------------------------- the config

def test_layout_is_required_and_comes_from_resolve_layout(tmp_path):
    fields = {k: v for k, v in asdict(make_cfg()).items() if k not in ("sample_from_anchor", "layout_reason")}
    with pytest.raises(TypeError, match="sample_from_anchor"):
        DrafterConfig(**fields)
    cfg = DrafterConfig(**fields, sample_from_anchor=False)
    with pytest.raises(FrozenInstanceError):
        cfg.sample_from_anchor = True
    # the readers hand back no layout at all; the loader's is resolve_layout's answer
    for fmt, sfa in (("zlab", False), ("deepspec", True), ("gguf", False)):
        c = make_cfg(sample_from_anchor=sfa)
        p = write(tmp_path, make_model(c), c, fmt)
        raw = read_drafter(p)
        assert not hasattr(raw.spec, "sample_from_anchor")
        want, src, reason = resolve_layout(raw.fmt, raw.spec.lineage, raw.layout_value, raw.layout_key)
        got = load(p)[0]
        assert (got.sample_from_anchor, got.extra["layout_from"], got.layout_reason) == (want, src, reason)
        assert got.sample_from_anchor == sfa
