"""EAGLE-3 chain drafters (issue 36, goal 1: read and run): the two file formats and their tap
conventions, the errors a user can cause (one line naming the problem and the fix), the chain
under the loop (greedy output equals the target's on several architectures, under the adaptive
policy, with prompt lookup beside it, through the API and the CLI), lossless sampling within the
TV bound, and PR #122's failure for taps: the same file read with the other convention's tap ids
loses its acceptance while every output stays correct. Conformance of the drafts with mlx-vlm
0.7.10's EAGLE-3 drafter: test_eagle3_conformance.py.

Tap conventions (mlxspec/drafters/formats/eagle3.py): speculators (vLLM, mlx-vlm) id k is the
output of layer k-1 (HF hidden_states[k]); SpecForge / SGLang id k is the output of layer k;
mlxspec's own taps are outputs of layers.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxspec.api import SpecConfig, Speculator
from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model, default_taps
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.engine import loop as engine
from mlxspec.engine.eagle3 import Eagle3Drafter
from mlxspec.engine.loop import SpecStats
from mlxspec.engine.ngram import LookupBlockDrafter
from mlxspec.engine.policy import Source, VerifyPolicy
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import Target
from test_cli import assert_user_error
from test_cli import run as cli
from test_engine import (N_TOKENS, TINY_PROMPT, V, accept_everything, distribution_check, exact_distribution, run,
                         sample_many, tiny_llama)
from tiny_targets import tiny_config, tiny_target, write_tiny_dir

GREEDY = SamplingParams()


# ----------------------------------------------------------------------------- tiny drafters

def eagle3_config(**kw) -> Eagle3Config:
    """A tiny drafter for the 4-layer tiny targets (hidden 32, vocab 64), tapping the outputs of
    layers 0, 1, 2 (the only three a 4-layer target offers: its last layer is never a tap)."""
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=64, draft_vocab_size=64, target_hidden_size=32,
                target_layer_ids=(0, 1, 2), rope_theta=10000.0)
    base.update(kw)
    return Eagle3Config(**base)


def random_eagle3(cfg: Eagle3Config, seed: int = 0, scale: float = 0.2) -> Eagle3Model:
    """Random weights (norms near 1) and, for a reduced vocabulary, a d2t onto a random sorted
    subset of the target's ids (offsets: target id = draft id + d2t[draft id])."""
    mx.random.seed(seed)
    m = Eagle3Model(cfg)
    new = {k: mx.random.normal(v.shape) * (0.1 if k.endswith("norm.weight") else scale)
           + (1.0 if k.endswith("norm.weight") else 0.0)
           for k, v in tree_flatten(m.parameters()) if k != "d2t"}
    m.update(tree_unflatten(list(new.items())))
    if cfg.reduced_vocab:
        ids = np.sort(np.random.default_rng(seed).choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False))
        m.d2t = mx.array(ids - np.arange(cfg.draft_vocab_size), dtype=mx.int32)
    mx.eval(m.parameters())
    return m


def deep_target(layers: int, arch: str = "llama", seed: int = 0) -> Target:
    """A tiny target with more layers than tiny_targets' four."""
    from mlx_lm.utils import _get_classes

    cfg = dict(tiny_config(arch), num_hidden_layers=layers)
    model_class, args_class = _get_classes(config=cfg)
    mx.random.seed(seed)
    m = model_class(args_class.from_dict(cfg))
    mx.eval(m.parameters())
    return Target(m, cfg, source=f"tiny-{arch}-{layers}")


def write(path, cfg, seed=0, fmt="speculators-eagle3", target=None, **kw) -> str:
    save_drafter(random_eagle3(cfg, seed), cfg, path, fmt, target=target, **kw)
    return str(path)


def edit_config(path, fn) -> None:
    p = Path(path) / "config.json"
    c = json.loads(p.read_text())
    fn(c)
    p.write_text(json.dumps(c))


def edit_tensors(path, fn) -> None:
    p = Path(path) / "model.safetensors"
    t = dict(mx.load(str(p)))
    fn(t)
    mx.save_safetensors(str(p), t, metadata={"format": "pt"})


def as_specforge_config(c: dict) -> dict:
    """A speculators config.json rewritten in SpecForge's layout with the SAME tap numbers: the
    file read as if its ids were SpecForge's (the tensors need no rename: mlxspec accepts
    `layers.0.*` as well as `midlayer.*`)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], **c["transformer_layer_config"],
            "draft_vocab_size": c["draft_vocab_size"], "target_hidden_size": c["target_hidden_size"],
            "norm_before_residual": c["norm_before_residual"],
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c["eagle_aux_hidden_state_layer_ids"])}}


def load(path, target, **kw):
    log = io.StringIO()
    model, cfg = load_drafter(str(path), target.info, log=log, **kw)
    return model, cfg, log.getvalue()


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama", seed=0)


# ----------------------------------------------------------------------------- reading

@pytest.mark.parametrize("fmt, ids, convention", [("speculators-eagle3", [1, 2, 3], "speculators"),
                                                  ("specforge", [0, 1, 2], "specforge")])
def test_formats_round_trip_with_their_tap_convention(llama, tmp_path, fmt, ids, convention):
    """Each writer writes its own convention's ids; each reader converts them back to the outputs
    of layers 0, 1, 2, and the weights (d2t included) come back exactly."""
    cfg = eagle3_config(draft_vocab_size=48, norm_before_residual=True)
    ref = random_eagle3(cfg, seed=1)
    save_drafter(ref, cfg, tmp_path / "d", fmt, target=llama)
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    file_ids = c["eagle_aux_hidden_state_layer_ids"] if fmt != "specforge" else \
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert file_ids == ids
    names = set(mx.load(str(tmp_path / "d" / "model.safetensors")))
    assert any(n.startswith("midlayer." if fmt == "specforge" else "layers.0.") for n in names)
    assert {"d2t", "t2d"} <= names and "embed_tokens.weight" not in names
    model, got, line = load(tmp_path / "d", llama)
    assert got.target_layer_ids == (0, 1, 2) and got.file_layer_ids == tuple(ids)
    assert got.tap_convention == convention and got.source_format == fmt
    assert got.draft_vocab_size == 48 and got.norm_before_residual
    for k, v in tree_flatten(ref.parameters()):
        assert mx.array_equal(dict(tree_flatten(model.parameters()))[k], v), k
    assert line.strip() == (
        f"mlxspec: drafter lineage=eagle3 taps=0,1,2 (output of layer) file_ids={','.join(map(str, ids))} "
        f"({convention}) taps_from=file ({convention} ids) layers=1 draft_vocab=48/64 max_drafts=7 "
        f"norm_before_residual=true format={fmt}")


def test_both_formats_draft_the_same(llama, tmp_path):
    cfg = eagle3_config(draft_vocab_size=40)
    outs = []
    for fmt in ("speculators-eagle3", "specforge"):
        model, c, _ = load(write(tmp_path / fmt, cfg, seed=2, fmt=fmt, target=llama), llama)
        d = Eagle3Drafter(model, c, llama)
        ids = [3, 9, 27, 1, 14]
        _, taps = llama(mx.array([ids]), llama.make_cache(), taps=d.taps)
        d.begin(ids, taps)
        outs.append(d.draft(5, 4, GREEDY, np.random.default_rng(0)))
    assert outs[0].tokens == outs[1].tokens
    assert mx.array_equal(outs[0].logits, outs[1].logits)


def test_embedding_in_the_file_is_used(llama, tmp_path):
    """speculators files often carry embed_tokens (a copy of the target's): read and used."""
    path = write(tmp_path / "d", eagle3_config(), target=llama, with_embed=True)
    model, cfg, _ = load(path, llama)
    assert cfg.has_embed and mx.array_equal(model.embed_tokens.weight, llama.inner.embed_tokens.weight)
    assert Eagle3Drafter(model, cfg, llama).embed is model.embed_tokens


def test_no_tap_ids_gets_the_targets_default(tmp_path):
    """A file without tap ids: the default from the TARGET's depth (inputs of layers 2, N//2,
    N-3 = outputs of 1, N//2-1, N-4), never from the drafter's one layer."""
    assert default_taps(8) == [1, 3, 4] and default_taps(32) == [1, 15, 28]
    target = deep_target(8)
    path = write(tmp_path / "d", eagle3_config(target_layer_ids=(1, 3, 4)), target=target)
    edit_config(path, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    _, cfg, line = load(path, target)
    assert cfg.target_layer_ids == (1, 3, 4) and cfg.file_layer_ids is None
    assert "taps=1,3,4 (output of layer) file_ids=none (speculators) taps_from=default for a 8-layer target " \
           "(inputs of layers 2, N//2, N-3)" in line
    # SpecForge / SafeAILab: no eagle_config at all
    sf = write(tmp_path / "sf", eagle3_config(target_layer_ids=(1, 3, 4)), fmt="specforge", target=target)
    edit_config(sf, lambda c: c.pop("eagle_config"))
    _, cfg, line = load(sf, target)
    assert cfg.target_layer_ids == (1, 3, 4) and cfg.tap_convention == "safeailab"
    assert "taps_from=default for a 8-layer target" in line
    # the same file on a deeper target taps deeper
    _, cfg, _ = load(path, deep_target(12))
    assert cfg.target_layer_ids == (1, 5, 8)


def test_default_taps_on_a_too_shallow_target(llama, tmp_path):
    """On a 4-layer target the default taps (outputs of 1, 1, 0) repeat a layer: one line."""
    path = write(tmp_path / "d", eagle3_config(), target=llama)
    edit_config(path, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    with pytest.raises(MlxspecError) as e:
        load(path, llama)
    assert str(e.value) == (
        f"{path}: the file names no tap ids, and the default taps for a 4-layer target (outputs of layers 1, 1, "
        "0) repeat or leave the target: the defaults need at least 7 layers; use a drafter whose config.json "
        "names its taps (eagle_aux_hidden_state_layer_ids)")


def _error(path, target) -> str:
    with pytest.raises(MlxspecError) as e:
        load(path, target)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_and_unclaimed_tensors_are_named(llama, tmp_path):
    fix = "the file's tensors and config.json disagree: re-export the drafter or fix its config.json"
    path = write(tmp_path / "d", eagle3_config(draft_vocab_size=48), target=llama)
    edit_tensors(path, lambda t: t.pop("layers.0.hidden_norm.weight"))
    assert _error(path, llama) == f"{path}: missing tensor(s): layers.0.hidden_norm.weight; {fix}"

    path = write(tmp_path / "e", eagle3_config(), target=llama)
    edit_tensors(path, lambda t: t.update({"layers.0.self_attn.rotary.weight": mx.zeros((4,))}))
    assert _error(path, llama) == (f"{path}: 1 tensor(s) not claimed by the EAGLE-3 drafter its config describes: "
                                   f"layers.0.self_attn.rotary.weight; {fix}")

    path = write(tmp_path / "f", eagle3_config(draft_vocab_size=48), target=llama)
    edit_tensors(path, lambda t: t.pop("d2t"))
    assert _error(path, llama) == (
        f"{path}: draft vocabulary 48 differs from the target vocabulary 64 but the file has no d2t (draft id -> "
        "target id offsets); fix the drafter's config.json or download the drafter again")

    # SpecForge files are named in their own names
    path = write(tmp_path / "g", eagle3_config(), fmt="specforge", target=llama)
    edit_tensors(path, lambda t: t.pop("midlayer.hidden_norm.weight"))
    assert _error(path, llama) == f"{path}: missing tensor(s): midlayer.hidden_norm.weight; {fix}"


@pytest.mark.parametrize("fmt, ids, shown, layer", [
    ("speculators-eagle3", [1, 2, 4], 4, 3),  # speculators id 4 = output of layer 3, the last
    ("specforge", [0, 1, 3], 3, 3),
    ("specforge", [0, 1, 9], 9, 9),
])
def test_taps_past_the_target(llama, tmp_path, fmt, ids, shown, layer):
    path = write(tmp_path / "d", eagle3_config(), fmt=fmt, target=llama)
    conv = "speculators" if fmt != "specforge" else "specforge"

    def set_ids(c):
        if fmt == "specforge":
            c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        else:
            c["eagle_aux_hidden_state_layer_ids"] = ids
    edit_config(path, set_ids)
    assert _error(path, llama) == (
        f"{path}: tap {shown} ({conv} convention) is the output of layer {layer}, but tiny-llama has 4 layers "
        "(taps 0..2, the last layer excluded): the drafter was made for a deeper target; use the drafter "
        "trained for this target")


def test_hidden_size_and_vocabulary_must_match_the_target(llama, tmp_path):
    path = write(tmp_path / "h", eagle3_config(target_hidden_size=16))
    assert _error(path, llama) == (
        f"{path}: drafter target_hidden_size 16 (fc takes 3 x 16) does not match tiny-llama hidden size 32; use the "
        "drafter trained for this target")
    path = write(tmp_path / "v", eagle3_config(vocab_size=80, draft_vocab_size=48))
    assert _error(path, llama) == (
        f"{path}: drafter vocabulary 80 does not match tiny-llama vocabulary 64; use the drafter trained for this "
        "target's tokenizer")
    path = write(tmp_path / "d", eagle3_config(draft_vocab_size=48), target=llama)
    edit_tensors(path, lambda t: t.update(d2t=(t["d2t"] + 20)))
    msg = _error(path, llama)
    assert msg.startswith(f"{path}: d2t maps draft ids to target ids ") and msg.endswith(
        "outside the vocabulary [0, 64); the drafter weights are corrupt")


def test_requesting_another_lineage_is_corrected(llama, tmp_path):
    path = write(tmp_path / "d", eagle3_config(), target=llama)
    _, cfg, log = load(path, llama, requested="draft-dflash")
    assert cfg.lineage == "eagle3"
    assert "warning: requested draft-dflash but" in log and "using draft-eagle3 from the file" in log


# ----------------------------------------------------------------------------- the command line

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    _, path = write_tiny_dir(tmp_path_factory.mktemp("target") / "llama", "llama", seed=0)
    return path


def _generate(model, draft, *extra):
    return cli("generate", "--model", model, "--draft", draft, "--prompt", "t1 t2 t3 t4 t1 t2", "--max-tokens", 12,
               "--ignore-chat-template", "--verbose", "False", *extra)


def test_cli_generate_with_an_eagle3_drafter(tiny_dir, llama, tmp_path):
    path = write(tmp_path / "d", eagle3_config(draft_vocab_size=48), target=llama)
    ar = _generate(tiny_dir, "none")
    assert ar.returncode == 0, ar.stderr
    r = _generate(tiny_dir, path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ar.stdout and ar.stdout.strip()


def test_cli_generate_with_a_bad_drafter_is_one_line(tiny_dir, llama, tmp_path):
    path = write(tmp_path / "d", eagle3_config(), target=llama)
    edit_config(path, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 5]))
    assert_user_error(_generate(tiny_dir, path),
                      f"mlxspec: error: {path}: tap 5 (speculators convention) is the output of layer 4, but "
                      f"{tiny_dir} has 4 layers (taps 0..2, the last layer excluded): the drafter was made for a "
                      "deeper target; use the drafter trained for this target")
    path = write(tmp_path / "e", eagle3_config(target_hidden_size=48))
    assert_user_error(_generate(tiny_dir, path), startswith=f"mlxspec: error: {path}: drafter target_hidden_size 48")


@pytest.mark.parametrize("fmt, ids, conv", [("speculators-eagle3", "1, 2, 3", "speculators"),
                                           ("specforge", "0, 1, 2", "specforge")])
def test_cli_inspect_eagle3(llama, tmp_path, fmt, ids, conv):
    path = write(tmp_path / "d", eagle3_config(draft_vocab_size=48), fmt=fmt, target=llama)
    r = cli("inspect", path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for want in (f"role: drafter (eagle3), format {fmt}",
                 f"taps (target layer outputs): 0, 1, 2; in the file: {ids} ({conv} ids)",
                 "draft vocab 48 of 64 (d2t)", "problems:\n  none found", "loader: mlxspec: drafter lineage=eagle3"):
        assert want in out, (want, out)


def test_cli_inspect_eagle3_without_tap_ids_and_broken(llama, tmp_path):
    path = write(tmp_path / "d", eagle3_config(), target=llama)
    edit_config(path, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    r = cli("inspect", path)
    assert r.returncode == 0, r.stderr
    assert "taps (target layer outputs): none in the file: the target's default (inputs of layers 2, N//2, N-3)" \
        in r.stdout and "problems:\n  none found" in r.stdout
    # a broken file is listed as a problem (inspect reports what it can), as for every drafter
    edit_tensors(path, lambda t: t.pop("fc.weight"))
    r = cli("inspect", path)
    assert r.returncode == 0, r.stderr
    problems = r.stdout.split("problems:")[1].strip().splitlines()
    assert problems == [f"- {path}: missing tensor(s): fc.weight; the file's tensors and config.json disagree: "
                        "re-export the drafter or fix its config.json"], problems


# ----------------------------------------------------------------------------- greedy is lossless

def lens_drafter(target: Target, cfg: Eagle3Config, seed: int = 3) -> Eagle3Model:
    """A "logit lens" drafter: fc passes the last tap (the output of layer 2) through, its layers
    add nothing (o_proj = down_proj = 0), its norm and head are the target's final norm and LM head
    rows (at the draft vocabulary). It drafts the target's early guess at the anchor again and
    again: right wherever the target repeats itself, which these tiny targets do for long
    stretches, so whole chains get kept (a random drafter is almost never right)."""
    from mlxspec.targets.model import norm_scale, target_head_rows

    m = random_eagle3(cfg, seed)
    h, th = cfg.hidden_size, cfg.target_hidden_size
    m.fc.weight = mx.concatenate([mx.zeros((h, 2 * th)), mx.eye(h, th)], axis=1)
    for layer in m.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    m.norm.weight = norm_scale(target.inner.norm, h)
    ids = mx.arange(cfg.draft_vocab_size) + m.d2t if cfg.reduced_vocab else None
    m.lm_head.weight = target_head_rows(target, ids)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("arch, draft_vocab, nbr, layers", [
    ("llama", 6, True, 1), ("qwen3", 8, False, 1), ("gemma3", 6, False, 2), ("mistral", 8, True, 1)])
def test_greedy_is_lossless(arch, draft_vocab, nbr, layers):
    """Over 8 tokens; gemma3 and mistral have sliding-window layers (window 4, shorter than the
    context). Both a random drafter (rejected nearly always) and a logit-lens one (whole chains
    kept) give the target's own tokens."""
    target = tiny_target(arch, seed=0, vocab=8)
    cfg = eagle3_config(vocab_size=8, draft_vocab_size=draft_vocab, norm_before_residual=nbr, num_hidden_layers=layers)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 8, 10)]
    ar = run(target, ids, max_tokens=40)
    for model in (random_eagle3(cfg, seed=3), lens_drafter(target, cfg)):
        d = Eagle3Drafter(model, cfg, target, max_drafts=4)
        assert d.name == "eagle3" and d.taps == (0, 1, 2) and d.max_drafts == 4
        stats = SpecStats()
        assert run(target, ids, d, max_tokens=40, stats=stats) == ar
        assert stats.drafted > 0
    assert stats.accepted_at[2] > 0  # the lens drafter's chains were kept past their second draft


def test_policy_and_prompt_lookup_beside_it(llama):
    """Under the adaptive policy with prompt lookup: steps that verify lookup drafts, or none,
    still hand their committed rows to the drafter (its cache keeps only committed pairs)."""
    cfg = eagle3_config(draft_vocab_size=48)
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 64, 8)]
    ar = run(llama, ids + ids + ids, max_tokens=40)
    d = LookupBlockDrafter(Eagle3Drafter(random_eagle3(cfg, seed=4), cfg, llama, max_drafts=5), 64)
    pol = VerifyPolicy([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], d.max_drafts)
    stats = SpecStats()
    assert run(llama, ids + ids + ids, d, max_tokens=40, stats=stats, policy=pol) == ar
    assert stats.by_source.get("lookup", [0, 0])[1] > 0  # lookup drafts were accepted
    assert stats.by_source.get("drafter", [0, 0])[0] > 0  # and the EAGLE-3 chain was verified


@pytest.mark.parametrize("ngram", [True, False])
def test_api_builds_the_chain_drafter(llama, tmp_path, ngram):
    path = write(tmp_path / "d", eagle3_config(draft_vocab_size=48), fmt="specforge", target=llama)
    log = io.StringIO()
    spec = Speculator.build(SpecConfig(draft=path, ngram=ngram), llama, log=log)
    assert spec.spec_type == ("draft-eagle3+ngram" if ngram else "draft-eagle3")
    assert "lineage=eagle3 taps=0,1,2" in log.getvalue()
    ids = [int(x) for x in np.random.default_rng(2).integers(0, 64, 8)]
    stats = SpecStats()
    out = [t for step in spec.session(llama, ids + ids, max_tokens=30, stats=stats) for t in step]
    assert out == run(llama, ids + ids, max_tokens=30)
    assert stats.drafted > 0
    # --num-draft-tokens caps the chain
    spec = Speculator.build(SpecConfig(draft=path, ngram=False, num_draft_tokens=2), llama, log=io.StringIO())
    assert spec.make_drafter(llama).max_drafts == 2


def test_drafter_cache_holds_only_committed_pairs(llama):
    """After each draft the drafter's cache holds exactly the committed pairs: the prompt's and,
    after accept, one per committed token (the last tap waits for the next anchor)."""
    cfg = eagle3_config()
    d = Eagle3Drafter(random_eagle3(cfg, seed=5), cfg, llama)
    ids = [4, 8, 15, 16, 23]
    cache = llama.make_cache()
    _, taps = llama(mx.array([ids]), cache, taps=d.taps)
    d.begin(ids, taps)
    # the prompt's pairs whose next token is known run at begin (prompt processing, not drafting:
    # timed as drafting, their cost once made the policy stop asking the drafter); the last waits
    assert d.committed == 4 and len(d._next) == 0 and d._taps[0].shape[1] == 1
    out = d.draft(42, 5, GREEDY, np.random.default_rng(0))
    assert len(out.tokens) == 5 and out.logits.shape == (5, 64)
    lazy = Eagle3Drafter(random_eagle3(cfg, seed=5), cfg, llama)
    lazy.reset()
    lazy._taps, lazy._next = [taps], ids[1:]  # begin before the change: everything left to draft()
    ref = lazy.draft(42, 5, GREEDY, np.random.default_rng(0))
    assert out.tokens == ref.tokens and np.allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=1e-5)
    assert d.committed == 5  # pairs (x_i taps, x_{i+1}) for i < 5, the last paired with the anchor 42
    _, vt = llama(mx.array([[42] + out.tokens[:2]]), cache, taps=d.taps)
    d.accept([42] + out.tokens[:2], vt)
    d.draft(7, 3, GREEDY, np.random.default_rng(0))
    assert d.committed == 8


def test_a_long_backlog_is_caught_up_outside_the_draft_time(llama):
    """Drafters defer committed rows to their next draft, so autoregressive steps cost them
    nothing. After a long autoregressive stretch `propose` runs that backlog first (timed as
    drafting, a 64-step backlog made one EAGLE-3 draft look 6x as costly and the policy shut the
    drafter out). Catching up changes no draft: tokens and logits equal the lazy drafter's, for
    the chain drafter and a block drafter, and the output is the target's."""
    from mlxspec.engine.drafting import BlockDrafter, catch_up
    from mlxspec.engine.policy import Plan
    from test_engine import random_drafter

    cfg = eagle3_config()
    ids = [4, 8, 15, 16, 23]
    makers = [lambda: Eagle3Drafter(random_eagle3(cfg, seed=5), cfg, llama, max_drafts=3),
              lambda: BlockDrafter(random_drafter(llama.info, seed=2, taps=(0, 1, 2), block=4), llama)]
    for make in makers:
        eager, lazy = make(), make()
        cache = llama.make_cache()
        _, taps = llama(mx.array([ids]), cache, taps=eager.taps)
        eager.begin(ids, taps)
        lazy.begin(ids, taps)
        toks = run(llama, ids, max_tokens=14)
        for a, b in zip(toks[:-1], toks[1:]):  # 13 autoregressive steps: [anchor] verified each
            _, vt = llama(mx.array([[a]]), cache, taps=eager.taps)
            eager.accept([a], vt)
            lazy.accept([a], vt)
        assert eager.backlog >= 12 > eager.max_drafts + 1
        assert catch_up(eager) > 0 and eager.backlog == 0 and catch_up(eager) == 0.0
        x, y = (d.draft(toks[-1], 3, GREEDY, np.random.default_rng(0)) for d in (eager, lazy))
        assert x.tokens == y.tokens and np.allclose(np.asarray(x.logits), np.asarray(y.logits), atol=1e-5)

    class Scripted:  # 12 autoregressive steps, then the drafter every step
        def __init__(self):
            self.i, self.backlogs = 0, []

        def plan(self, n, lookup_len=0, match=0, model_drafts=True):
            self.i += 1
            return Plan(Source.DRAFTER, n) if self.i > 12 else Plan(Source.NONE, 0)

        def truncate(self, source, n, conf, greedy):
            return n

        def observe(self, source, verified, accepted, *a, **k):
            pass

    d = makers[0]()
    seen = []
    real = d.catch_up
    d.catch_up = lambda: (seen.append(d.backlog), real())[1]
    assert run(llama, ids, d, max_tokens=24, policy=Scripted()) == run(llama, ids, max_tokens=24)
    assert seen[:1] == [12]  # the first draft after the stretch caught up its 12 pairs first


def test_drafts_carry_confidences_and_a_stopped_chain_is_a_prefix(llama):
    """Each draft's confidence is the drafter's probability of the token it drafted (greedy: its
    top probability, from the draft logits); a chain stopped by `more` is a prefix of the full
    one, and `more` saw the confidences of exactly the drafts made."""
    cfg = eagle3_config(draft_vocab_size=48)
    d = Eagle3Drafter(random_eagle3(cfg, seed=5), cfg, llama, max_drafts=6)
    ids = [4, 8, 15, 16, 23]
    _, taps = llama(mx.array([ids]), llama.make_cache(), taps=d.taps)
    d.begin(ids, taps)
    full = d.draft(42, 6, GREEDY, np.random.default_rng(0))
    z = np.asarray(full.logits, np.float64)
    top = 1.0 / np.exp(z - z.max(-1, keepdims=True)).sum(-1)  # softmax at the row's argmax
    assert len(full.confidence) == 6 and np.allclose(full.confidence, top, atol=1e-5)
    seen = []
    part = d.draft(42, 6, GREEDY, np.random.default_rng(0), more=lambda c: (seen.append(list(c)), len(c) < 3)[1])
    assert part.tokens == full.tokens[:3] and np.allclose(part.confidence, full.confidence[:3], atol=1e-6)
    assert [len(c) for c in seen] == [1, 2, 3] and np.allclose(seen[-1], full.confidence[:3], atol=1e-6)
    assert d.committed == 5  # the stopped chain left only the committed pairs


def test_sampled_confidences_never_read_the_drawn_token(llama):
    """Sampled, a draft's confidence is its row's top probability, read before the draw: the
    policy may drop draft i on the confidences of rows <= i, and a confidence that depended on
    the drawn token would make which tokens get verified depend on their values (lossy). Two
    draws from the same row that differ in the token have the same confidence."""
    cfg = eagle3_config(draft_vocab_size=48)
    d = Eagle3Drafter(random_eagle3(cfg, seed=5, scale=0.05), cfg, llama, max_drafts=1)
    ids = [4, 8, 15, 16, 23]
    _, taps = llama(mx.array([ids]), llama.make_cache(), taps=d.taps)
    d.begin(ids, taps)
    sp = SamplingParams(temperature=1.0)
    outs = [d.draft(42, 1, sp, np.random.default_rng(s)) for s in range(8)]
    assert len({o.tokens[0] for o in outs}) > 1  # different tokens drawn
    assert len({round(o.confidence[0], 7) for o in outs}) == 1
    q = np.asarray(outs[0].probs)[0]
    assert outs[0].confidence[0] == pytest.approx(float(q.max()), rel=1e-5)


def record_lengths(d: Eagle3Drafter, lengths: list) -> Eagle3Drafter:
    """d, with the length of every chain it drafts appended to `lengths`."""
    real = d.draft

    def draft(*a, **k):
        out = real(*a, **k)
        lengths.append(len(out.tokens))
        return out

    d.draft = draft
    return d


def test_the_policy_stops_a_chain_by_its_confidences():
    """`keep_drafting`: with one forward per draft, drafting on pays while the calibrated
    confidences so far and the estimates beyond them say a longer verify gains more than it
    costs. Cheap drafts and free verify rows: always on; a confident chain goes on where an
    unconfident one stops; never past the planned length."""
    flat = VerifyPolicy([1.0] * 8, 7, chain=True, stops_early=True)
    flat.draft_time[Source.DRAFTER] = 0.0
    assert flat.stops_early and flat.keep_drafting([0.5], 7) and not flat.keep_drafting([0.9] * 7, 7)
    vt = [1.0, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3]
    p, q = (VerifyPolicy(vt, 7, chain=True, stops_early=s) for s in (True, False))
    for pol in (p, q):
        pol.draft_time[Source.DRAFTER] = 0.06
        for _ in range(20):  # a drafter right 3 times in 3
            pol.observe(Source.DRAFTER, 3, 3)
    assert p.keep_drafting([0.95, 0.95], 7) and not p.keep_drafting([0.95, 0.05], 7)
    assert not p.keep_drafting([0.95, 0.95], 2)  # the cap
    assert not VerifyPolicy([1.0] * 8, 7, chain=False, stops_early=True).stops_early  # chains only


def test_stopping_early_keeps_greedy_output_and_drafts_less(llama):
    """The adaptive policy asks the EAGLE-3 chain for its cap and stops it by its confidences:
    the output is the target's (a logit-lens drafter, whose chains are often kept, and a random
    one), and chains stopped at different lengths."""
    target = tiny_target("llama", seed=0, vocab=8)
    cfg = eagle3_config(vocab_size=8, draft_vocab_size=6)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 8, 10)]
    ar = run(target, ids, max_tokens=40)
    for model in (random_eagle3(cfg, seed=3), lens_drafter(target, cfg)):
        drafted = []
        d = record_lengths(Eagle3Drafter(model, cfg, target, max_drafts=5), drafted)
        pol = VerifyPolicy([1.0, 1.02, 1.04, 1.06, 1.08, 1.1], 5, chain=True, stops_early=True)
        pol.draft_time[Source.DRAFTER] = 0.03
        assert run(target, ids, d, max_tokens=40, policy=pol) == ar
        assert drafted and len(set(drafted)) > 1, drafted


# ----------------------------------------------------------------------------- sampling is lossless

def test_sampling_is_lossless_and_the_check_catches_a_wrong_rule(monkeypatch):
    """Each chain token is drawn from the drafter's own distribution over a reduced draft
    vocabulary (6 of 8 ids), scattered to the target's for verification. tiny_llama has 2 layers,
    so the drafter taps one (the output of layer 0)."""
    target = tiny_llama(1)
    cfg = eagle3_config(vocab_size=V, draft_vocab_size=6, target_layer_ids=(0,), head_dim=8, hidden_size=32)
    m = random_eagle3(cfg, seed=6, scale=0.4)
    sp = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)
    stats = SpecStats()
    res = distribution_check(sample_many(target, lambda: Eagle3Drafter(m, cfg, target), sp, 1500, stats), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"
    assert 0.05 < stats.accepted / stats.drafted < 0.95  # both branches of the rule ran
    assert max(stats.accepted_at[1:] or [0]) > 0  # and chains were kept past their first token
    monkeypatch.setattr(engine, "accept_sampled", accept_everything)
    wrong = distribution_check(sample_many(target, lambda: Eagle3Drafter(m, cfg, target), sp, 400), exact)
    assert any(t > b for t, b in wrong.values()), f"the check missed a wrong acceptance rule: {wrong}"


def test_sampling_with_chains_stopped_by_confidence_is_lossless(monkeypatch):
    """Stopping a sampled chain as its confidences come in (the drawn tokens' probabilities) is
    a stopping rule: the target's exact distribution of 4 tokens within the TV bound, with
    chains stopped at different lengths, and the check catches a wrong acceptance rule."""
    target = tiny_llama(1)
    cfg = eagle3_config(vocab_size=V, draft_vocab_size=6, target_layer_ids=(0,), head_dim=8, hidden_size=32)
    m = random_eagle3(cfg, seed=6, scale=0.4)
    sp = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)
    lengths = []

    def sample(n):
        out = []
        for seed in range(n):
            d = record_lengths(Eagle3Drafter(m, cfg, target, max_drafts=3), lengths)
            pol = VerifyPolicy([1.0, 1.0, 1.0, 1.0], 3, chain=True, stops_early=True)
            pol.draft_time[Source.DRAFTER] = 0.32  # a first row below ~0.55 stops the chain (of 2 here)
            for _ in range(10):
                pol.observe(Source.DRAFTER, 3, 3)
            out.append(run(target, TINY_PROMPT, d, max_tokens=N_TOKENS, sampling=sp, seed=seed, policy=pol))
        return np.array(out)

    res = distribution_check(sample(1500), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"
    assert len(set(lengths)) > 1, set(lengths)
    monkeypatch.setattr(engine, "accept_sampled", accept_everything)
    wrong = distribution_check(sample(400), exact)
    assert any(t > b for t, b in wrong.values()), f"the check missed a wrong acceptance rule: {wrong}"


def test_sampled_trees_are_lossless_and_the_check_catches_a_wrong_rule(monkeypatch):
    """EAGLE-3's dynamic tree at T=1 (each node's children drawn without replacement from the
    drafter's own distribution over a reduced vocabulary, verified by recursive rejection over
    the siblings) reproduces the target's exact distribution of 4 tokens; always walking to the
    first child is caught."""
    from mlxspec.engine import tree_step as ts
    from mlxspec.engine.loop import generate_steps
    from mlxspec.engine.policy import FixedLength
    from test_tree import first_child

    target = tiny_llama(1)
    cfg = eagle3_config(vocab_size=V, draft_vocab_size=6, target_layer_ids=(0,), head_dim=8, hidden_size=32)
    m = random_eagle3(cfg, seed=6, scale=0.4)
    sp = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, TINY_PROMPT, sp, N_TOKENS)

    def sample(n, stats=None):
        return np.array([[t for s in generate_steps(target, TINY_PROMPT, drafter=Eagle3Drafter(m, cfg, target),
                                                    max_tokens=N_TOKENS, sampling=sp, seed=seed, stats=stats,
                                                    policy=FixedLength(), tree=5) for t in s] for seed in range(n)])

    stats = SpecStats()
    res = distribution_check(sample(1200, stats), exact)
    assert not {k: v for k, v in res.items() if v[0] > v[1]}, res
    assert max(stats.verify_lengths) == 6 and 0.05 < stats.accepted / stats.drafted < 0.95

    monkeypatch.setattr(ts, "accept_sampled", first_child)
    wrong = distribution_check(sample(400), exact)
    assert any(t > b for t, b in wrong.values()), wrong


def test_sampled_draft_bench_script_runs(tmp_path):
    """scripts/bench_sampled_draft.py (the sampled drafts' host cost, docs/bench): both ways
    timed, written as JSON; a draft vocabulary larger than the target's is argparse's exit 2."""
    from test_suffix import _script

    mod = _script("bench_sampled_draft")
    out = tmp_path / "s.json"
    assert mod.main(["--repeats", "2", "--vocab", "512", "--draft-vocab", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ms_by_drafts"]
    assert set(rows) == {"1", "2", "4"} and all(r["mlx"] > 0 and r["numpy"] > 0 for r in rows.values())
    with pytest.raises(SystemExit) as e:
        mod.main(["--vocab", "10", "--draft-vocab", "20"])
    assert e.value.code == 2


def test_sampled_draft_probs_are_the_drafters_own(llama):
    cfg = eagle3_config(draft_vocab_size=48)
    d = Eagle3Drafter(random_eagle3(cfg, seed=7), cfg, llama)
    ids = [1, 2, 3, 4]
    _, taps = llama(mx.array([ids]), llama.make_cache(), taps=d.taps)
    d.begin(ids, taps)
    sp = SamplingParams(temperature=0.8)
    out = d.draft(5, 3, sp, np.random.default_rng(1))
    q = np.asarray(out.probs)
    assert q.shape == (3, 64) and np.allclose(q.sum(-1), 1.0, atol=1e-5)
    off = np.setdiff1d(np.arange(64), np.asarray(d.d2t))
    assert (q[:, off] == 0).all()  # nothing outside the draft vocabulary
    z = np.asarray(out.logits) / 0.8
    want = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(q[:, np.asarray(d.d2t)], want / want.sum(-1, keepdims=True), atol=1e-5)
    assert all(q[i, t] > 0 for i, t in enumerate(out.tokens))
    # sharpened (scripts/draft_temperature.py): drawn from, and verified against, q at 0.7 x 0.8
    d.begin(ids, taps)
    d.sharpen = 0.7
    out = d.draft(5, 3, sp, np.random.default_rng(1))
    z = np.asarray(out.logits) / (0.8 * 0.7)
    want = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.probs)[:, np.asarray(d.d2t)], want / want.sum(-1, keepdims=True),
                               atol=1e-5)


# ----------------------------------------------------------------------------- PR #122, for taps

ORACLE_V, ORACLE_H, ORACLE_LAYERS = 32, 64, 6


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A target and an EAGLE-3 drafter built to be right when, and only when, its taps are read
    in the file's own convention.

    Target: a 6-layer llama with attention switched off (o_proj = 0), so every position's state is
    a function of its token alone and greedy decoding follows x_{t+1} = g(x_t); its layer 1
    rewrites the residual stream (MLP output x30), so the outputs of layers 0 and 1 differ.
    Drafter: fc passes the first tap through (the output of layer 0: speculators id 1), the
    layer adds nothing (o_proj = down_proj = 0), and the head is the least-squares fit that maps
    that tap of token x to g(g(x)): from the pair (taps of x_{n-1}, anchor x_n) it drafts
    x_{n+1}. Written as speculators with ids [1, 3, 4]; read as SpecForge ids, the same numbers
    tap outputs 1, 3, 4: one layer too deep."""
    from mlx_lm.models.llama import Model, ModelArgs

    V_, H, L = ORACLE_V, ORACLE_H, ORACLE_LAYERS
    mx.random.seed(0)
    m = Model(ModelArgs(model_type="llama", hidden_size=H, num_hidden_layers=L, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V_,
                        tie_word_embeddings=False, rope_theta=10000.0))
    for i, layer in enumerate(m.model.layers):
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        if i == 1:
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 30.0
    mx.eval(m.parameters())
    target = Target(m, {"hidden_size": H, "model_type": "llama"}, source="oracle-target")
    alone = [target(mx.array([[x]]), target.make_cache(), taps=(0,)) for x in range(V_)]  # each token's state
    g = np.array([int(mx.argmax(lg[0, -1]).item()) for lg, _ in alone])
    f = np.concatenate([np.asarray(t[0], np.float64) for _, t in alone])
    f = f / np.sqrt((f * f).mean(-1, keepdims=True) + 1e-6)  # the drafter's final RMSNorm (weight 1)
    head = np.linalg.lstsq(f, 10.0 * np.eye(V_)[g[g]], rcond=None)[0].T

    cfg = Eagle3Config(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=V_, draft_vocab_size=V_, target_hidden_size=H,
                       target_layer_ids=(0, 2, 3), max_drafts=1)
    d = random_eagle3(cfg, seed=8)
    d.fc.weight = mx.concatenate([mx.eye(H), mx.zeros((H, 2 * H))], axis=1)
    d.layers[0].self_attn.o_proj.weight = mx.zeros_like(d.layers[0].self_attn.o_proj.weight)
    d.layers[0].mlp.down_proj.weight = mx.zeros_like(d.layers[0].mlp.down_proj.weight)
    d.norm.weight = mx.ones((H,))
    d.lm_head.weight = mx.array(head, dtype=mx.float32)
    root = tmp_path_factory.mktemp("oracle")
    save_drafter(d, cfg, root / "speculators", "speculators-eagle3", target=target)
    # the same file, its config.json rewritten as SpecForge's with the same tap numbers
    shutil.copytree(root / "speculators", root / "as-specforge")
    edit_config(root / "as-specforge", lambda c: (c.clear(), c.update(as_specforge_config(
        json.loads((root / "speculators" / "config.json").read_text())))))
    return target, root, g


def test_wrong_tap_convention_collapses_acceptance(oracle):
    """PR #122's failure, for taps: the file read with the other convention's ids taps every
    layer one too deep. Nothing errors and the output stays the target's; only acceptance shows
    it. One prompt per token y of the vocabulary, one draft each (3 tokens: the prefill's, the
    draft, the bonus): the first draft after y is drafted from y's taps, so this is the drafter's
    first-draft acceptance over every token, exactly (greedy: no sampling noise). (The floor on a
    trained drafter comes with the shipped SmolLM2 EAGLE-3 drafter of issue 36; this hand-built
    one shows the mechanism.)"""
    target, root, g = oracle
    prompts = [[y] for y in range(ORACLE_V)]
    ar = [run(target, p, max_tokens=3) for p in prompts]
    results = {}
    for name in ("speculators", "as-specforge"):
        log = io.StringIO()
        spec = Speculator.build(SpecConfig(draft=str(root / name), ngram=False, num_draft_tokens=1), target, log=log)
        stats = SpecStats()
        outs = [[t for s in spec.session(target, p, max_tokens=3, stats=stats) for t in s] for p in prompts]
        assert outs == ar, f"{name}: greedy output must stay the target's whatever the taps"
        assert stats.drafted == ORACLE_V
        results[name] = (stats, log.getvalue())
    right, wrong = results["speculators"][0], results["as-specforge"][0]
    assert "taps=0,2,3 (output of layer) file_ids=1,3,4 (speculators)" in results["speculators"][1]
    assert "taps=1,3,4 (output of layer) file_ids=1,3,4 (specforge)" in results["as-specforge"][1]
    assert right.accepted == ORACLE_V, f"read right: {right.accepted}/{right.drafted} accepted"
    assert wrong.accepted <= ORACLE_V // 8, (
        f"read one layer too deep the drafter should collapse: {wrong.accepted}/{wrong.drafted} accepted")


def test_wrong_tap_convention_changes_the_drafts(oracle):
    """The drafts themselves, and the resolved taps, which differ by exactly one layer."""
    target, root, _ = oracle
    drafts, taps = {}, {}
    for name in ("speculators", "as-specforge"):
        model, cfg, _ = load(root / name, target)
        d = Eagle3Drafter(model, cfg, target)
        taps[name] = np.array(cfg.target_layer_ids)
        seqs = []
        for x in range(ORACLE_V):
            _, t = target(mx.array([[x]]), target.make_cache(), taps=d.taps)
            d.begin([x], t)
            seqs.append(d.draft(0, 1, GREEDY, np.random.default_rng(0)).tokens[0])
        drafts[name] = np.array(seqs)
    assert (taps["as-specforge"] - taps["speculators"] == 1).all()
    assert (drafts["speculators"] != drafts["as-specforge"]).mean() > 0.8
