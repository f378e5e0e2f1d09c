"""Every mlx-lm target architecture mlxspec claims, through the model's own forward and cache:
llama, qwen3, qwen3_moe, gemma3 (sliding window smaller than the context), mistral with a
sliding window, qwen3_5 (Gated DeltaNet + attention), and two more families published drafters
target: llama with Llama-3.1's llama3 RoPE scaling, and gpt_oss (MoE, attention sinks,
sliding-window layers). Tiny random-weight models built
from mlx-lm's own classes (tests/tiny_targets.py).

For each: greedy speculative output equals autoregressive token for token with blocks
rejected at every position; after a rejection at every block position the cache equals a
fresh prefill of the committed tokens (and gives the same next logits). Speculative sampling
has the target's distribution (the TV bound of tests/test_engine.py) on one architecture per
kind of cache (`SAMPLED_ARCHS`).
"""

from __future__ import annotations

import io

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_targets import ARCHS, WINDOW, tiny_model, tiny_target

from mlxspec import api
from mlxspec.engine.drafting import DraftOutput, SimpleDrafter
from mlxspec.engine.loop import SpecStats, generate_steps
from mlxspec.engine.verify import SamplingParams
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import Target, cache_length, trim_cache
from mlxspec.targets.rollback import cache_kind

PROMPT = [5, 9, 2, 7, 11, 3, 8]  # longer than WINDOW


def run(target, ids, drafter=None, max_tokens=28, **kw):
    return [t for step in generate_steps(target, ids, drafter=drafter, max_tokens=max_tokens, **kw) for t in step]


class OracleDrafter:
    """Drafts the target's own greedy continuation with one wrong token at position k, k
    cycling 0..n (n = all right), so every block position gets rejected in turn; asks for
    taps so the verify runs with the layer hooks."""

    name = "oracle"
    ctx_len = None

    def __init__(self, full, vocab, n, taps):
        self.full, self.vocab, self.max_drafts, self.taps = full, vocab, n, tuple(taps)
        self.calls, self.pos, self.accepted = 0, 0, []

    def begin(self, ids, taps):
        assert taps.shape[:2] == (1, len(ids))
        self.pos = len(ids)

    def accept(self, tokens, taps):
        assert taps.shape[1] == len(tokens)
        self.accepted.append(len(tokens) - 1)
        self.pos += len(tokens)

    def draft(self, anchor, n, sp, rng):
        k = self.calls % (n + 1)
        self.calls += 1
        right = self.full[self.pos + 1 : self.pos + 1 + n]
        toks = right[:k] + ([(right[k] + 1) % self.vocab] if k < n else []) + right[k + 1 :]
        return DraftOutput(toks, None, None)


class Skip:
    """A decoder layer that passes its input through (attributes still read from the layer)."""

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, x, *args, **kwargs):
        return x


@pytest.fixture(scope="module", params=ARCHS)
def arch_target(request):
    return request.param, tiny_target(request.param)


def test_cache_kinds_are_the_models_own(arch_target):
    arch, target = arch_target
    kinds = [cache_kind(c) for c in target.make_cache()]
    want = {"gemma3": "rotating", "mistral": "rotating", "gpt_oss": "rotating", "qwen3_5": "arrays"}.get(arch)
    assert (want in kinds) if want else set(kinds) == {"kv"}
    assert target.info.num_layers == 4 and target.info.vocab_size == 64 and target.info.hidden_size == 32


def test_norm_scale_reproduces_the_final_norm(arch_target):
    """`norm_scale` gives the scale a plain RMSNorm needs to equal the target's final norm,
    for llama-style norms (weight) and Gemma's (1 + weight) alike: the drafter trainer
    starts its own norm there."""
    from mlxspec.targets.model import norm_scale

    arch, target = arch_target
    norm = target.model.model.norm
    saved = norm.weight
    try:  # a non-trivial weight (the fixture is shared: restored after)
        norm.weight = mx.random.normal(norm.weight.shape, key=mx.random.key(3))
        x = mx.random.normal((5, 32), key=mx.random.key(4))
        s = norm_scale(norm, 32)
        assert mx.allclose(mx.fast.rms_norm(x, s, norm.eps), norm(x), atol=1e-5).item(), arch
        offset = 1.0 if arch == "gemma3" else 0.0
        assert mx.allclose(s, norm.weight + offset, atol=1e-5).item(), arch
    finally:
        norm.weight = saved


def test_taps_and_logits_from_the_models_own_forward(arch_target):
    """Taps = the outputs of decoder layer k (checked against a forward truncated after k
    layers by mlx-lm's own module), logits = mlx-lm's forward, "last" = its last row."""
    arch, target = arch_target
    x = mx.array([PROMPT + [1, 4, 6]])
    ref = target.model(x)
    logits, taps = target(x, target.make_cache(), taps=(2, 0), logits="all")
    np.testing.assert_array_equal(np.array(logits), np.array(ref))
    last, _ = target(x, target.make_cache(), logits="last")
    np.testing.assert_allclose(np.array(last[:, 0]), np.array(ref[:, -1]), atol=1e-5)
    inner, H = target.inner, target.info.hidden_size
    layers = list(inner.layers)
    for j, k in enumerate((2, 0)):
        try:  # the model's own forward with the layers above k (and the final norm) skipped
            inner.layers[k + 1 :] = [Skip(layer) for layer in layers[k + 1 :]]
            inner.norm, norm = nn.Identity(), inner.norm
            want = inner(x)
        finally:
            inner.layers[:] = layers
            inner.norm = norm
        np.testing.assert_allclose(np.array(taps[..., j * H : (j + 1) * H]), np.array(want), atol=1e-5)
    none, taps2 = target(x, target.make_cache(), taps=(2, 0), logits="none")
    assert none is None
    np.testing.assert_allclose(np.array(taps2), np.array(taps), atol=1e-5)
    hid, taps3 = target.forward_hidden(x, (2, 0))
    np.testing.assert_allclose(np.array(target.lm_head(hid)), np.array(ref), atol=1e-4)
    np.testing.assert_allclose(np.array(taps3), np.array(taps), atol=1e-5)
    assert list(inner.layers) == layers  # the hooks are gone


def test_greedy_speculative_equals_autoregressive(arch_target, mode="replay"):
    arch, target = arch_target
    ar = run(target, PROMPT)
    n = 5
    drafter = OracleDrafter(PROMPT + ar, 64, n, taps=(0, 2))
    stats = SpecStats()
    try:
        target.recurrent_rollback = mode
        out = run(target, PROMPT, drafter, stats=stats)
    finally:
        del target.recurrent_rollback
    assert out == ar
    # rejected at every block position, and whole blocks accepted too
    assert set(drafter.accepted) == set(range(n + 1))


# One architecture per kind of cache the engine rolls back: KV + rotating sliding-window layers
# (mistral; gemma3 and gpt_oss hold the same) and recurrent arrays + KV (qwen3_5). Plain KV
# (llama, qwen3, qwen3_moe, llama3_1) is sampled by tests/test_engine.py's simple-T1 case: the
# same SimpleDrafter at T=1 on a 2-layer llama. The check runs 1200 generations; on the other
# architectures the rollback it relies on is checked exactly (greedy == AR with a rejection at
# every block position, and the cache == a fresh prefill after each), so sampling each of them
# too repeated the same slow path (~6 minutes of the suite on a loaded 2-core host).
SAMPLED_ARCHS = ["mistral", "qwen3_5"]
SAMPLED_ELSEWHERE = {"llama": "tests/test_engine.py::test_sampling_is_lossless_and_the_check_catches_a_wrong_rule"}


def _cache_kinds(arch):
    return frozenset(cache_kind(c) for c in tiny_target(arch).make_cache())


def test_sampled_archs_cover_every_cache_kind():
    """A new architecture whose caches are of another combination of kinds joins SAMPLED_ARCHS."""
    import test_engine as te

    assert {_cache_kinds(a) for a in ARCHS} == {_cache_kinds(a) for a in [*SAMPLED_ARCHS, *SAMPLED_ELSEWHERE]}
    assert _cache_kinds("llama") == frozenset(cache_kind(c) for c in te.tiny_llama(1).make_cache())
    assert "simple" in dict((c[0], c) for c in te.SAMPLED_CASES)


@pytest.mark.parametrize("arch", SAMPLED_ARCHS)
def test_sampled_distribution_is_the_targets(arch):
    """Speculative sampling with a related draft model (SimpleDrafter: its own cache is rolled
    back over several forwards) reproduces the target's exact distribution of 4 tokens."""
    import test_engine as te

    target = tiny_target(arch, seed=1, vocab=te.V)
    dmodel, cfg = tiny_model(arch, seed=2, vocab=te.V, base=target.model, noise=0.3)
    draft = Target(dmodel, cfg)
    sp = SamplingParams(temperature=1.0)
    exact = te.exact_distribution(target, te.TINY_PROMPT, sp, te.N_TOKENS)
    stats = SpecStats()
    res = te.distribution_check(te.sample_many(target, lambda: SimpleDrafter(draft, 3), sp, 1200, stats), exact)
    bad = {k: v for k, v in res.items() if v[0] > v[1]}
    assert not bad, f"speculative sampling differs from the target's distribution: {bad}"
    assert 0.1 < stats.accepted / stats.drafted < 0.95


def logical_state(c):
    """What a cache holds that future forwards can see: KV rows [0, offset), the last
    window - 1 rows of a rotating cache in temporal order, the recurrent arrays."""
    k = cache_kind(c)
    if k == "kv":
        return c.offset, [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    if k == "rotating":
        w = min(c.offset, c.max_size - 1)
        return c.offset, [c._temporal_order(c.keys)[..., -w:, :], c._temporal_order(c.values)[..., -w:, :]]
    return None, list(c.cache)


def assert_caches_equal(a, b):
    assert cache_length(a) == cache_length(b)
    for i, (ca, cb) in enumerate(zip(a, b)):
        (oa, sa), (ob, sb) = logical_state(ca), logical_state(cb)
        assert oa == ob, f"layer {i}: offset {oa} != {ob}"
        for x, y in zip(sa, sb):
            assert x.shape == y.shape, f"layer {i}: {x.shape} != {y.shape}"
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4, err_msg=f"layer {i}")


def test_rollback_at_every_block_position_equals_fresh_prefill(arch_target, mode="replay"):
    """Prefill, verify a block longer than the sliding window (it wraps), reject after each
    position in turn: the rolled-back cache equals a fresh prefill of the kept tokens, and
    the next forwards give the same logits (one-token steps first: a merely trimmed ring
    would leave the rejected rows in the window those steps write into)."""
    arch, target = arch_target
    block = [13, 1, 22, 40, 17, 6]
    assert len(block) > WINDOW
    nxt = [mx.array([[30]]), mx.array([[31]]), mx.array([[32, 33, 34]])]
    try:
        target.recurrent_rollback = mode
        for keep in range(1, len(block) + 1):
            cache = target.make_cache()
            target(mx.array([PROMPT]), cache, logits="last")
            target(mx.array([block]), cache, taps=(1,))
            trim_cache(cache, len(block) - keep)
            fresh = target.make_cache()
            target(mx.array([PROMPT + block[:keep]]), fresh)
            assert_caches_equal(cache, fresh)
            for step in nxt:  # one-token steps write into the ring in place; then a block
                la, _ = target(step, cache)
                lb, _ = target(step, fresh)
                np.testing.assert_allclose(np.array(la), np.array(lb), atol=1e-4)
    finally:
        del target.recurrent_rollback


def test_rollback_spanning_several_forwards_and_one_token_steps(arch_target):
    """Undo a prompt-continuation plus several one-token forwards (the draft model's pattern),
    including one-token writes into a full sliding-window ring."""
    arch, target = arch_target
    cache = target.make_cache()
    target(mx.array([PROMPT]), cache)
    before = target.make_cache()
    target(mx.array([PROMPT]), before)
    mx.eval([c.state for c in cache])
    target(mx.array([[4, 5, 6]]), cache)
    for t in (7, 8, 9, 10, 11):  # wraps the ring one slot at a time
        lg, _ = target(mx.array([[t]]), cache, logits="last")
        mx.eval(lg)
    trim_cache(cache, 3 + 5 - 2)  # keep the first 2 of the 3-token forward
    fresh = target.make_cache()
    target(mx.array([PROMPT + [4, 5]]), fresh)
    assert_caches_equal(cache, fresh)
    trim_cache(cache, 0)
    # a lone one-token step on a full ring, undone whole
    target(mx.array([[12]]), cache)
    trim_cache(cache, 1)
    assert_caches_equal(cache, fresh)
    # one-token steps writing into a full ring in place, the last two undone: the second-oldest
    # row the last step overwrote is inside the window again and must come back
    for t in (12, 13, 14, 15):
        target(mx.array([[t]]), cache)
    trim_cache(cache, 2)
    for t in (12, 13):
        target(mx.array([[t]]), fresh)
    assert_caches_equal(cache, fresh)
    la, _ = target(mx.array([[16]]), cache)
    lb, _ = target(mx.array([[16]]), fresh)
    np.testing.assert_allclose(np.array(la), np.array(lb), atol=1e-4)


def test_unsupported_architecture_is_one_line():
    with pytest.raises(MlxspecError, match="'linear' is not supported as a target") as e:
        Target(nn.Linear(4, 4), {"model_type": "linear"})
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- Python API and hub ids

@pytest.mark.parametrize("arch", ARCHS)
def test_api_takes_an_mlx_lm_model_and_tokenizer_straight(tmp_path, arch):
    """mlx_lm.load(...) -> (model, tokenizer) go straight into mlxspec.generate, with a draft
    model, and give mlx_lm.generate's greedy text."""
    import mlx_lm
    from tiny_targets import write_tiny_dir

    _, tdir = write_tiny_dir(tmp_path / "target", arch, seed=0)
    _, ddir = write_tiny_dir(tmp_path / "draft", arch, seed=5)
    model, tok = mlx_lm.load(tdir)
    prompt = [1, 5, 9, 2, 7, 3, 8]  # ids: transformers swaps in Qwen3.5's own tokenizer class for the toy one
    want = mlx_lm.generate(model, tok, prompt, max_tokens=12)
    spec = api.Speculator.build(api.SpecConfig(draft=ddir, spec_type="draft-simple", num_draft_tokens=3, ngram=False), model)
    got = api.generate(model, tok, prompt, spec, max_tokens=12)
    assert got == want and want


def _cli(*args, hf_home, timeout=300):
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "mlxspec.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_hub_ids_resolve_from_the_local_cache_offline(tmp_path):
    """--model and --draft take Hugging Face repo ids (a cached snapshot in HF_HOME, offline);
    a sliding-window target with a draft model gives the plain run's text; an uncached repo is
    one line, exit 2."""
    from tiny_targets import hub_snapshot_dir, write_hub_repo

    hf = tmp_path / "hf"
    write_hub_repo(hf, "tiny-org/gemma3-tiny", "gemma3", seed=0)
    write_hub_repo(hf, "tiny-org/gemma3-tiny-draft", "gemma3", seed=5)
    common = ["--prompt", "t1 t5 t9 t2 t7 t3 t8", "--max-tokens", 16, "--ignore-chat-template", "--verbose", "False"]
    plain = _cli("generate", "--model", "tiny-org/gemma3-tiny", "--draft", "none", *common, hf_home=hf)
    assert plain.returncode == 0, plain.stderr
    spec = _cli("generate", "--model", "tiny-org/gemma3-tiny", "--spec-type", "draft-simple",
                "--draft", "tiny-org/gemma3-tiny-draft", "--num-draft-tokens", 3, *common, hf_home=hf)
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.strip()
    # no registry drafter for this repo: --draft auto (the default) says so in one line and runs
    # model-free prompt lookup under the adaptive policy; the text is the plain run's
    auto = _cli("generate", "--model", "tiny-org/gemma3-tiny", *common, hf_home=hf)
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout == plain.stdout
    assert ("mlxspec: --draft auto: no known drafter for 'gemma3-tiny' (registry v4); prompt lookup (ngram, "
            "model-free) under the adaptive verify policy; --draft PATH for a block drafter, --draft none for "
            "plain decoding") in auto.stderr.splitlines(), auto.stderr
    _, _, sp = api.load(str(hub_snapshot_dir(hf, "tiny-org/gemma3-tiny")), log=io.StringIO())
    assert (sp.spec_type, sp.policy, sp.drafter_factory is not None) == ("ngram", "adaptive", True)
    off = _cli("generate", "--model", "tiny-org/gemma3-tiny", "--no-ngram", *common, hf_home=hf)
    assert off.returncode == 0 and off.stdout == plain.stdout and "autoregressive (--no-ngram)" in off.stderr
    missing = _cli("generate", "--model", "tiny-org/not-there", "--draft", "none", *common, hf_home=hf)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    lines = [ln for ln in missing.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "tiny-org/not-there" in lines[0] and "HF_HUB_OFFLINE" in lines[0], missing.stderr


def test_a_hub_snapshot_is_named_by_its_repo_id(tmp_path):
    """Where a hub id resolved to (a snapshot directory named by its commit), the repo id is
    the name drafter files and the server give the target; other paths keep theirs."""
    from tiny_targets import hub_snapshot_dir

    from mlxspec.cache import hub_repo_of, verifier_name

    snap = hub_snapshot_dir(tmp_path / "hf", "mlx-community/Qwen3-8B-4bit")
    assert hub_repo_of(snap) == hub_repo_of(snap / "model.safetensors") == "mlx-community/Qwen3-8B-4bit"
    assert verifier_name(str(snap)) == "mlx-community/Qwen3-8B-4bit"
    assert hub_repo_of(tmp_path / "models" / "qwen") is None
    assert verifier_name(str(tmp_path / "qwen")) == str(tmp_path / "qwen")
    assert verifier_name("/x/gemma-3-270m-q4_k_m.gguf") == "google/gemma-3-270m"


def test_draft_auto_picks_the_registry_drafter_and_validates_it(tmp_path):
    """--draft auto on a hub target takes its most preferred drafter from
    mlxspec/data/registry.json (here DeepSpec's DSpark repo id for Qwen3-8B, holding a tiny
    random DSpark drafter in the offline cache; the target 4-bit like mlx-community's); the
    output is the target's; `inspect` shows
    the pairing and the other published drafter; a drafter that does not fit its target is
    refused in one line."""
    import test_engine as te
    from tiny_targets import hub_snapshot_dir, write_hub_repo

    from mlxspec.drafters.load import save_drafter
    from mlxspec.drafters.registry import candidates, lookup, model_name

    assert model_name("mlx-community/Qwen3-8B-4bit") == "qwen3-8b"
    assert [e["drafter"] for e in candidates("mlx-community/Qwen3-8B-4bit")] == [
        "deepseek-ai/dspark_qwen3_8b_block7", "z-lab/Qwen3-8B-DFlash-b16"]
    assert lookup("Qwen/Qwen3-14B")["drafter"] == "deepseek-ai/dspark_qwen3_14b_block7"
    assert lookup("someone/unknown-model") is None
    hf = tmp_path / "hf"
    model, _ = write_hub_repo(hf, "mlx-community/Qwen3-8B-4bit", "qwen3", bits=4)  # really 4-bit
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    info = Target(model, {"model_type": "qwen3"}).info
    m = te.random_drafter(info, block=4, anchor_first=True, markov_rank=4, confidence=True, taps=(0, 2), heads=4,
                          kv_heads=2, head_dim=8, mask=63)
    save_drafter(m, m.config, hub_snapshot_dir(hf, "deepseek-ai/dspark_qwen3_8b_block7"), "deepspec", target=info)
    common = ["--prompt", "t1 t5 t9 t2 t7 t3 t8", "--max-tokens", 12, "--ignore-chat-template", "--verbose", "False"]
    plain = _cli("generate", "--model", "mlx-community/Qwen3-8B-4bit", "--draft", "none", *common, hf_home=hf)
    auto = _cli("generate", "--model", "mlx-community/Qwen3-8B-4bit", *common, hf_home=hf)
    assert plain.returncode == 0 and auto.returncode == 0, auto.stderr
    assert "--draft auto: deepseek-ai/dspark_qwen3_8b_block7 (dspark, deepspec; registry v4)" in auto.stderr
    assert "lineage=dspark" in auto.stderr
    assert auto.stdout == plain.stdout and plain.stdout.strip()
    r = _cli("inspect", "mlx-community/Qwen3-8B-4bit", hf_home=hf)
    assert r.returncode == 0, r.stderr
    assert ("drafter (--draft auto): deepseek-ai/dspark_qwen3_8b_block7 (dspark, deepspec; registry v4); "
            "also published: z-lab/Qwen3-8B-DFlash-b16 (dflash)") in r.stdout
    # the registry's drafter for Qwen3-4B, but built for a wider model: refused before generating
    write_hub_repo(hf, "Qwen/Qwen3-4B", "qwen3")
    wide = te.random_drafter(info, block=4, anchor_first=True, taps=(0, 2), hidden=48, heads=4, kv_heads=2,
                             head_dim=8, mask=63)
    save_drafter(wide, wide.config, hub_snapshot_dir(hf, "deepseek-ai/dspark_qwen3_4b_block7"), "deepspec",
                 target=info)
    bad = _cli("generate", "--model", "Qwen/Qwen3-4B", *common, hf_home=hf)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    errs = [ln for ln in bad.stderr.splitlines() if ln.startswith("mlxspec: error")]
    assert len(errs) == 1 and "hidden" in errs[0], bad.stderr


def test_registry_table_is_well_formed():
    """Every registry entry names a target, a drafter (hub id or a shipped directory that
    exists), a known lineage and its source; no drafter is listed twice; packaged short
    names and their cached GGUF file names match the same entries."""
    import re

    from mlxspec.drafters.registry import candidates, model_name, table

    t = table()
    assert isinstance(t["version"], int) and t["version"] >= 2
    seen = set()
    for e in t["entries"]:
        assert set(e) == {"target", "drafter", "lineage", "source"}, e
        assert e["lineage"] in ("dflash", "dspark", "dflash2", "eagle3"), e
        assert e["source"] in ("mlxspec", "z-lab", "deepspec", "angelslim", "redhat", "lmsys"), e
        assert e["drafter"] not in seen, e
        seen.add(e["drafter"])
        if e["drafter"].startswith("shipped:"):
            from pathlib import Path

            assert any(Path(c["path"]).is_dir() for c in candidates(e["target"]) if c["drafter"] == e["drafter"]), e
        else:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", e["drafter"]), e
        assert model_name(e["target"]) == e["target"].lower()
    assert model_name("gemma3-270m") == model_name("/cache/models/gemma-3-270m-q4_k_m.gguf") == "gemma-3-270m"
    assert model_name("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b-instruct"


def test_deepcopy_keeps_the_caches_and_drops_the_log(arch_target):
    """The server's prompt cache deep-copies caches: the copy holds the same state, no undo
    records (they reference layers), and can still be trimmed where mlx-lm's trim is exact."""
    import copy

    arch, target = arch_target
    cache = target.make_cache()
    target(mx.array([PROMPT[:3]]), cache)
    cp = copy.deepcopy(cache)
    assert cp.log == [] and cache.log and cache_length(cp) == 3
    assert_caches_equal(cp, cache)
    if arch == "qwen3_5":
        with pytest.raises(MlxspecError, match="no record"):
            trim_cache(cp, 1)
    else:
        trim_cache(cp, 1)  # 3 positions: a 4-token window is not full yet
        fresh = target.make_cache()
        target(mx.array([PROMPT[:2]]), fresh)
        assert_caches_equal(cp, fresh)


# per-token state capture, the other rollback of recurrent layers (only qwen3_5 has them)

def test_greedy_speculative_equals_autoregressive_with_capture():
    test_greedy_speculative_equals_autoregressive(("qwen3_5", tiny_target("qwen3_5")), "capture")


def test_rollback_with_capture_equals_fresh_prefill():
    test_rollback_at_every_block_position_equals_fresh_prefill(("qwen3_5", tiny_target("qwen3_5")), "capture")
