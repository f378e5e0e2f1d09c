"""Python API and CLI: load_speculator / stream_generate / generate, stop strings, limits,
plain mlx-lm models, and drafters refused before any generation."""

from __future__ import annotations

import dataclasses
import io

import mlx.core as mx
import pytest

from mlxspec import api, cli
from mlxspec.errors import MlxspecError
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.engine.drafting import SimpleDrafter
from mlxspec.engine.loop import generate_steps

PROMPT = "The capital of France is"
N = 24


def dspark_cfg(info, **kw) -> DrafterConfig:
    base = dict(hidden_size=info.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, block_size=4, target_layer_ids=[1, 10, 20], mask_token_id=16,
                vocab_size=info.vocab_size, sample_from_anchor=True, rope_theta=1e5, markov_rank=8,
                confidence_head=True)
    base.update(kw)
    return DrafterConfig(**base)


def write_dspark(path, cfg: DrafterConfig, seed: int = 0) -> str:
    mx.random.seed(seed)
    m = DFlashModel(cfg)
    mx.eval(m.parameters())
    save_drafter(m, cfg, str(path), "deepspec")
    return str(path)


@pytest.fixture(scope="module")
def sm(smollm2):
    """(target, tokenizer, prompt ids, autoregressive greedy tokens, their text)."""
    target, tok = smollm2
    ids = tok.encode(PROMPT, add_special_tokens=False)
    ar = [t for s in generate_steps(target, ids, drafter=None, max_tokens=N) for t in s]
    return target, tok, ids, ar, tok.decode(ar)


@pytest.fixture(scope="module")
def dspark_dir(sm, tmp_path_factory):
    return write_dspark(tmp_path_factory.mktemp("drafter") / "dspark", dspark_cfg(sm[0].info))


def quiet_speculator(path, target, **kw):
    log = io.StringIO()
    spec = api.load_speculator(path, target, log=log, **kw)
    return spec, log.getvalue()


# ----------------------------------------------------------------------------- streaming

def test_stream_generate_responses(sm, dspark_dir):
    target, tok, ids, ar, _ = sm
    spec, log = quiet_speculator(dspark_dir, target)
    assert "lineage=dspark" in log and "sample_from_anchor=true" in log
    assert spec.spec_type == "draft-dspark"
    rs = list(api.stream_generate(target, tok, PROMPT, spec, max_tokens=12))
    assert all(isinstance(r, api.GenerationResponse) for r in rs)
    assert [r.token for r in rs] == ar[:12]
    assert "".join(r.text for r in rs) == tok.decode(ar[:12])
    assert [r.generation_tokens for r in rs] == list(range(1, 13))
    assert [r.finish_reason for r in rs] == [None] * 11 + ["length"]
    last = rs[-1]
    s = last.stats
    assert s.drafted > 0 and last.acceptance_rate == s.accepted / s.drafted
    assert last.tau == pytest.approx(11 / s.target_forwards) and last.tau >= 1.0
    assert last.prompt_tokens == len(ids)
    foot = api.footer(last)
    assert "Generation: 12 tokens" in foot and "Speculative: acceptance" in foot and "tau" in foot
    # every draft is credited to the source that proposed it (drafter or prompt lookup)
    assert sum(d for d, _ in s.by_source.values()) == s.drafted
    assert sum(a for _, a in s.by_source.values()) == s.accepted
    assert "drafter" in s.by_source and set(s.by_source) <= {"drafter", "lookup"}
    d, a = s.by_source["drafter"]
    assert "Accepted by source: " in foot and f"drafter {a}/{d} drafts" in foot


def test_draft_simple_speculator_accepts_everything(sm, smollm2_path):
    """draft-simple with the target's own file as the draft model: every draft is right."""
    target, tok, ids, ar, text = sm
    spec, _ = quiet_speculator(str(smollm2_path), target, spec_type="draft-simple", num_draft_tokens=4)
    rs = list(api.stream_generate(target, tok, ids, spec, max_tokens=N))
    assert [r.token for r in rs] == ar
    assert "".join(r.text for r in rs) == text
    assert rs[-1].acceptance_rate == 1.0 and rs[-1].tau > 3
    assert any(r.from_draft for r in rs)


def test_generate_equals_cli(sm, dspark_dir, smollm2_path, capsys):
    target, tok, _, _, _ = sm
    spec, _ = quiet_speculator(dspark_dir, target)
    text = api.generate(target, tok, PROMPT, spec, max_tokens=16)
    rc = cli.main(["generate", "--model", str(smollm2_path), "--draft", dspark_dir, "--prompt", PROMPT,
                   "--ignore-chat-template", "-n", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    # mlx_lm's layout: a rule, the text, a rule, the footer
    assert out.startswith("=" * 10 + "\n" + text + "\n" + "=" * 10 + "\n")
    footer = out[len(text) + 12:]
    assert "Generation: 16 tokens" in footer and "Speculative: acceptance" in footer


def test_plain_mlx_lm_model(sm, dspark_dir):
    """An app holding an mlx-lm model passes it straight in (wrapped by `as_target`)."""
    target, tok, _, _, _ = sm
    plain = target.model  # the mlx_lm llama Model under the Target
    wrapped = api.as_target(plain)
    assert dataclasses.astuple(wrapped.info)[:4] == dataclasses.astuple(target.info)[:4]
    spec_plain, _ = quiet_speculator(dspark_dir, plain)
    spec, _ = quiet_speculator(dspark_dir, target)
    a = api.generate(plain, tok, PROMPT, spec_plain, max_tokens=12)
    b = api.generate(target, tok, PROMPT, spec, max_tokens=12)
    assert a == b and a
    with pytest.raises(MlxspecError, match="cannot use object as a target"):
        api.as_target(object())


# ----------------------------------------------------------------------------- stops and limits

@pytest.mark.parametrize("stop", [["\n\n"], ["answer"], ["2018"], ["-01-"], ["is:", "\n\n"], [" 12:1X"], ["zzz"]])
def test_stop_strings(sm, stop):
    """The text never contains a stop string nor anything after it, even when the stop string
    spans several tokens of one accepted block; a stop string that never completes holds
    nothing back at the end."""
    target, tok, ids, ar, full = sm
    spec = api.Speculator(drafter_factory=lambda t: SimpleDrafter(t, 4), spec_type="draft-simple", description="self")
    rs = list(api.stream_generate(target, tok, ids, spec, max_tokens=N, stop=stop))
    text = "".join(r.text for r in rs)
    hits = [full.find(s) for s in stop if s in full]
    if hits:
        assert text == full[: min(hits)]
        assert rs[-1].finish_reason == "stop"
    else:
        assert text == full
        assert rs[-1].finish_reason == "length"
    assert not any(s in text for s in stop)


@pytest.mark.parametrize("max_tokens", [1, 5, 9])
def test_max_tokens_exact_through_the_api(sm, max_tokens):
    target, tok, ids, ar, _ = sm
    spec = api.Speculator(drafter_factory=lambda t: SimpleDrafter(t, 4), spec_type="draft-simple", description="self")
    rs = list(api.stream_generate(target, tok, ids, spec, max_tokens=max_tokens))
    assert [r.token for r in rs] == ar[:max_tokens]
    assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == max_tokens


def test_eos_finishes_with_stop(sm):
    target, tok, ids, ar, _ = sm
    i = next(i for i in range(5, N) if ar[i] not in ar[:i])

    class Tok:  # the SmolLM2 tokenizer with one of the generated tokens as EOS
        eos_token_ids = {ar[i]}
        encode, decode, detokenizer = tok.encode, tok.decode, tok.detokenizer

    spec = api.Speculator(drafter_factory=lambda t: SimpleDrafter(t, 4), spec_type="draft-simple", description="self")
    rs = list(api.stream_generate(target, Tok(), ids, spec, max_tokens=N))
    assert [r.token for r in rs] == ar[: i + 1]
    assert rs[-1].finish_reason == "stop"
    assert "".join(r.text for r in rs) == tok.decode(ar[:i])  # the EOS itself adds no text


# ----------------------------------------------------------------------------- refusals

def test_block_size_longer_than_trained(sm, dspark_dir, smollm2_path, capsys):
    target, tok, ids, ar, _ = sm
    with pytest.raises(MlxspecError, match=r"--block-size 9 is longer than the drafter's trained block \(4\)"):
        quiet_speculator(dspark_dir, target, block_size=9)
    rc = cli.main(["generate", "--model", str(smollm2_path), "--draft", dspark_dir, "--block-size", "9",
                   "--prompt", PROMPT])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("mlxspec: error: --block-size 9 is longer than the drafter's trained block (4)")
    # shorter is fine and still lossless
    spec, _ = quiet_speculator(dspark_dir, target, block_size=2)
    rs = list(api.stream_generate(target, tok, ids, spec, max_tokens=8))
    assert [r.token for r in rs] == ar[:8]
    assert max(rs[-1].stats.verify_lengths) <= 3


BAD = {
    "hidden": (dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1),
               r"drafter hidden size 64 .* does not match .* hidden size 576"),
    "vocab": (dict(vocab_size=1000, mask_token_id=16), r"drafter vocabulary 1000 does not match .* vocabulary 49152"),
    "tap-outside": (dict(target_layer_ids=[1, 10, 40]), r"tap layer 40 is outside .* 30 layers"),
    "tap-last": (dict(target_layer_ids=[1, 10, 29]), r"tap layer 29 is the last layer"),
    "mask": (dict(mask_token_id=60000), r"mask token id 60000 is outside .* vocabulary"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_incompatible_drafter_refused_before_generation(sm, tmp_path, what):
    target, tok, ids, _, _ = sm
    change, msg = BAD[what]
    path = write_dspark(tmp_path / what, dspark_cfg(target.info, **change))
    with pytest.raises(MlxspecError, match=msg) as e:
        load_drafter(path, target.info, log=io.StringIO())
    assert "\n" not in str(e.value) and path in str(e.value)
    with pytest.raises(MlxspecError, match=msg):
        quiet_speculator(path, target)


# ----------------------------------------------------------------------------- SpecConfig, load, session

def test_spec_config_from_flags_equals_the_api_one():
    """`mlxspec generate`'s flags build the SpecConfig the API takes; 'none' means no drafter;
    one ngram default (on) for the CLI and the API."""
    from mlxspec.args import spec_config

    g = cli.build_parser().parse_args(["generate", "--draft", "d.gguf", "--block-size", "3", "--p-min", "0.5",
                                       "--verify-policy", "fixed", "--prompt", "x"])
    assert spec_config(g) == api.SpecConfig(draft="d.gguf", block_size=3, p_min=0.5, policy="fixed", ngram=True)
    assert spec_config(cli.build_parser().parse_args(["generate", "--prompt", "x"])) == api.SpecConfig()
    assert api.SpecConfig().ngram is True and api.SpecConfig().draft == "auto"
    assert api.SpecConfig(draft="none").draft is None
    assert api.SpecConfig(draft="d.gguf", spec_type="none").draft is None
    assert api.SpecConfig(block_size=4).verify_policy == "fixed" and api.SpecConfig().verify_policy == "adaptive"
    assert api.SpecConfig(schedule=True, policy="adaptive").verify_policy == "adaptive"
    with pytest.raises(dataclasses.FrozenInstanceError):
        api.SpecConfig().block_size = 2


@pytest.mark.parametrize("kw, msg", [
    (dict(spec_type="draft-foo"), "--spec-type 'draft-foo' is not one of auto, draft-dflash, draft-dspark, draft-dflash2, "
                                  "draft-eagle3, draft-simple, ngram, none"),
    (dict(policy="sometimes"), "--verify-policy 'sometimes' is not one of adaptive, fixed"),
    (dict(draft=""), "--draft is empty: pass a .gguf file, a directory or a Hugging Face repo id, 'auto' or 'none'"),
    (dict(draft=3), "draft=3: pass a path (or a Hugging Face repo id) as a string, or None"),
])
def test_spec_config_refuses_bad_values(kw, msg):
    with pytest.raises(MlxspecError) as e:
        api.SpecConfig(**kw)
    assert str(e.value) == msg


def test_load_takes_a_config_or_its_fields(sm, dspark_dir, smollm2_path):
    """load(model, config=SpecConfig(...)) and load(model, draft, **fields) are the same load;
    the session is what stream_generate runs."""
    target, tok, ids, ar, _ = sm
    cfg = api.SpecConfig(draft=dspark_dir, block_size=3, ngram=False)
    _, _, a = api.load(str(smollm2_path), config=cfg, log=io.StringIO())
    _, _, b = api.load(str(smollm2_path), dspark_dir, block_size=3, ngram=False, log=io.StringIO())
    _, _, c = api.load(str(smollm2_path), config=api.SpecConfig(draft=dspark_dir), block_size=3, ngram=False,
                       log=io.StringIO())
    assert (a.spec_type, a.description, a.policy) == (b.spec_type, b.description, b.policy) == (
        c.spec_type, c.description, c.policy) == ("draft-dspark", "dspark dspark block=3", "fixed")
    st = api.SpecStats()
    steps = [t for s in a.session(target, ids, max_tokens=10, stats=st) for t in s]
    assert steps == ar[:10] == [r.token for r in api.stream_generate(target, tok, ids, a, max_tokens=10)]
    assert st.drafted > 0 and max(st.verify_lengths) <= 4
    with pytest.raises(TypeError):
        api.load(str(smollm2_path), config=cfg, blocksize=3)


def test_distributed_loading_is_a_mode_of_the_one_load(sm, dspark_dir, smollm2_path):
    """`load(..., shard=Sharding())` is how every rank of an mlx.launch job loads (here one rank,
    not launched): the sharded target, the speculator on rank 0, the single process's tokens.
    A shard that is no Sharding is one line, and the package defines no second `load`."""
    import ast
    from pathlib import Path

    from mlxspec.distributed import DistTarget, Sharding

    target, tok, ids, ar, _ = sm
    t, _, spec = api.load(str(smollm2_path), dspark_dir, ngram=False, shard=Sharding(mode="auto", timeout=60),
                          log=io.StringIO())
    assert isinstance(t, DistTarget) and (t.rank, t.size) == (0, 1) and spec.spec_type == "draft-dspark"
    with t:
        assert [r.token for r in api.stream_generate(t, tok, ids, spec, max_tokens=10)] == ar[:10]
    with pytest.raises(MlxspecError) as e:
        api.SpecConfig(shard="tensor")
    assert str(e.value) == ("shard='tensor': pass a mlxspec.distributed.Sharding(mode=..., check=..., timeout=...), "
                            "or None for one process")
    pkg = Path(api.__file__).parent
    loads = [str(f.relative_to(pkg)) for f in sorted(pkg.rglob("*.py"))
             for node in ast.parse(f.read_text()).body if isinstance(node, ast.FunctionDef) and node.name == "load"]
    assert loads == ["api.py"]
