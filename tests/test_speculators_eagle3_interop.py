"""vLLM's `speculators` 0.9.0 loads mlxspec's EAGLE-3 export (format "speculators-eagle3") with its
own loader (`SpeculatorModel.from_pretrained` -> `Eagle3DraftModel`) and, with its own `forward`,
gives the same draft logits and greedy chain as mlxspec's `Eagle3Drafter`.

Compared (tests/speculators_eagle3_check.py drives speculators, every case in one process; its docstring
says how):
- the file loads whole: every tensor claimed under its own name with its own values, every tensor
  of the model but speculators' training-loss copies of the verifier's head and norm taken from the
  file, the tap ids speculators reads are mlxspec's taps + 1 (validated by speculators against the
  verifier's depth), flags, layer class (Llama / Qwen3) and layer count as written;
- the first draft's logits at EVERY prompt position (teacher-forced: speculators' step 0 over all
  rows; mlxspec's Eagle3Drafter begun on each prefix), draft-vocabulary order, to 1e-4;
- the greedy chain after the prompt and the anchor: ids exactly, each step's logits to 1e-4.
  speculators' chain is its own: each draft is its forward's argmax, mapped by its d2t, fed back.

Cases: tiny random drafters on tiny targets (reduced draft vocabulary and full, norm_before_residual
true and false, one and two layers, a Qwen3 layer with fc_norm and norm_output, norm_before_fc), and
a random drafter on the real SmolLM2 target (its taps, a 2048-token draft vocabulary).

Every file is written with_embed=True: speculators 0.9.0 (with the transformers 5.19 pip gives it)
does NOT load embed_tokens from the verifier reliably when the file lacks it. Its loader marks
"not loaded" by filling embed_tokens with NaN in __init__ and loads the verifier's only where NaN
remains, but transformers' from_pretrained builds the model on the meta device and materialises a
tensor missing from the file as uninitialised memory, so embed_tokens keeps garbage unless that
memory happens to hold a NaN (seen: 3 loads in 4 kept garbage, draft logits off by ~3). A file
without embed_tokens is fine for vLLM, SGLang and mlxspec (they borrow the target's), not for
speculators' own model.

speculators still reads the verifier (`speculators_config.verifier.name_or_path`, a Hugging Face id)
for its config (tap ids checked against its depth, hidden size compared) and its head / final norm:
`verifier_dir` writes those as an HF-style directory, used in the id's place (tests run offline).
The venv is test_speculators_interop's (`~/.cache/mlxspec-peer-venvs/speculators-*`, made on first use;
MLXSPEC_SPECULATORS_PYTHON overrides).
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.drafters.eagle3 import Eagle3Config, default_taps
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.engine.eagle3 import Eagle3Drafter
from mlxspec.engine.verify import SamplingParams
from test_eagle3 import eagle3_config, random_eagle3
from test_speculators_interop import speculators_python  # noqa: F401 (the session fixture: speculators' venv)
from tiny_targets import tiny_target

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("speculators_eagle3_check.py")
PROMPT = [5, 17, 33, 2, 60, 41, 8]
ATOL = 1e-4

CASES = {
    # name: (target arch, draft vocabulary, Eagle3Config overrides)
    "llama-d2t-nbr": ("llama", 48, dict(norm_before_residual=True)),
    "llama-full-2layers": ("llama", 64, dict(num_hidden_layers=2)),
    "qwen3-d2t-fcnorm-normoutput": ("qwen3", 40, dict(qk_norm=True, fc_norm=True, norm_output=True)),
    "llama-d2t-normbeforefc-2layers": ("llama", 56, dict(norm_before_fc=True, num_hidden_layers=2,
                                                         norm_before_residual=True)),
}


def verifier_dir(target, d: Path) -> Path:
    """What speculators reads from the verifier: its config (depth, hidden size) and embedding,
    head and final norm, as an HF-style directory."""
    from mlxspec.targets.model import dense_weight, target_head_rows

    info, c = target.info, target.config
    config = {k: c[k] for k in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                "rms_norm_eps", "rope_theta", "tie_word_embeddings") if k in c}
    config.update(architectures=["Qwen3ForCausalLM" if info.model_type == "qwen3" else "LlamaForCausalLM"],
                  model_type=info.model_type, hidden_size=info.hidden_size, num_hidden_layers=info.num_layers,
                  vocab_size=info.vocab_size)
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "model.safetensors"), {
        "model.embed_tokens.weight": dense_weight(target.inner.embed_tokens, mx.float32),
        "lm_head.weight": target_head_rows(target, None),
        "model.norm.weight": target.inner.norm.weight.astype(mx.float32)}, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


def ours(target, path: Path, prompt: list[int], n_drafts: int, tmp_path: Path, attn: str = "default"):
    """mlxspec's first-draft logits at every prompt position and greedy chain, and the arguments
    that make tests/speculators_eagle3_check.py compute speculators' for the same drafter."""
    model, cfg = load_drafter(str(path), target.info, log=io.StringIO())
    d = Eagle3Drafter(model, cfg, target)
    logits, taps = target(mx.array([prompt]), target.make_cache(), taps=d.taps)
    anchor = int(mx.argmax(logits[0, -1]).item())
    ids = list(prompt) + [anchor]
    sp, rng = SamplingParams(), np.random.default_rng(0)
    first = []
    for m in range(1, len(prompt) + 1):  # the first draft after each prefix, its next token as anchor
        d.begin(prompt[:m], taps[:, :m])
        first.append(np.asarray(d.draft(ids[m], 1, sp, rng).logits[0]))
    d.begin(prompt, taps)
    out = d.draft(anchor, n_drafts, sp, rng)
    assert len(out.tokens) == n_drafts
    npz = tmp_path / "inputs.npz"
    np.savez(npz, taps=np.array(taps.astype(mx.float32)), next_ids=np.array(ids[1:]), n_drafts=np.array(n_drafts))
    args = [str(path), str(npz), str(verifier_dir(target, tmp_path / "verifier")), attn]
    return (d, cfg, out, np.stack(first)), args


def smollm2_case(smollm2, tmp_path: Path):
    target, tok = smollm2
    info = target.info
    cfg = Eagle3Config(hidden_size=info.hidden_size, intermediate_size=512, num_hidden_layers=1,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=info.vocab_size,
                       draft_vocab_size=2048, target_hidden_size=info.hidden_size,
                       target_layer_ids=tuple(default_taps(info.num_layers)), rms_norm_eps=1e-5,
                       rope_theta=100000.0, norm_before_residual=True, max_drafts=5)
    path = tmp_path / "drafter"
    save_drafter(random_eagle3(cfg, seed=23, scale=0.05), cfg, path, "speculators-eagle3", target=target,
                 with_embed=True)
    prompt = tok.encode("def fibonacci(n):\n    ", add_special_tokens=False)
    return ours(target, path, prompt, 5, tmp_path)


def tiny_case(arch: str, tmp_path: Path, seed: int, attn: str = "default", **kw):
    target = tiny_target(arch, seed=0)
    cfg = eagle3_config(**kw)
    path = tmp_path / "drafter"
    save_drafter(random_eagle3(cfg, seed=seed), cfg, path, "speculators-eagle3", target=target, with_embed=True)
    return ours(target, path, PROMPT, 6, tmp_path, attn)


@pytest.fixture(scope="module")
def checked(speculators_python, smollm2, tmp_path_factory):  # noqa: F811
    """Every case below, mlxspec's side, then speculators' in ONE process (its import is most of
    the cost) -> {case: (drafter, config, chain, first-draft logits, speculators' JSON)}."""
    made = {}
    for case, (arch, draft_vocab, kw) in CASES.items():
        made[case] = tiny_case(arch, tmp_path_factory.mktemp(case), 21, draft_vocab_size=draft_vocab, **kw)
    made["eager"] = tiny_case("llama", tmp_path_factory.mktemp("eager"), 22, attn="eager", draft_vocab_size=48,
                              norm_before_residual=True)
    made["smollm2"] = smollm2_case(smollm2, tmp_path_factory.mktemp("smollm2"))
    r = subprocess.run([speculators_python, str(CHECK), *[a for _, args in made.values() for a in args]],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()[-len(made):]
    assert len(lines) == len(made), r.stdout[-3000:]
    out = {}
    for (case, (mine, _)), line in zip(made.items(), lines):
        peer = json.loads(line)
        out[case] = (*mine, peer)
    return out


def peer_of(checked, case):
    d, cfg, out, first, peer = checked[case]
    assert "error" not in peer, f"speculators raised on {case}:\n{peer.get('error')}"
    return d, cfg, out, first, peer


def check_load(peer: dict, d: Eagle3Drafter, cfg: Eagle3Config) -> None:
    assert peer["config_class"] == "Eagle3SpeculatorConfig" and peer["model_class"] == "Eagle3DraftModel"
    assert peer["first_layer_class"] == ("Qwen3" if cfg.qk_norm else "Llama") + "DecoderEagle3FirstLayer"
    assert peer["qk_norm"] == cfg.qk_norm and peer["layers"] == cfg.num_hidden_layers
    assert peer["aux_hidden_state_layer_ids"] == [t + 1 for t in d.taps]  # speculators: hidden_states[k]
    assert peer["use_draft_vocab"] == cfg.reduced_vocab and peer["norm_before_residual"] == cfg.norm_before_residual
    assert peer["flags"] == {k: getattr(cfg, k) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    assert peer["speculative_tokens"] == cfg.max_drafts
    assert peer["unclaimed"] == [] and peer["differ"] == [], peer  # every file tensor loaded as written
    # all but speculators' training-loss copies of the verifier's head and norm come from the file
    assert set(peer["not_from_file"]) <= {"verifier_norm.weight", "verifier_lm_head.weight"}, peer["not_from_file"]
    assert "embed_tokens.weight" in peer["file_tensors"]
    assert peer["all_finite"]


def compare(peer: dict, out, first: np.ndarray, label: str) -> float:
    assert peer["forward_argmax_agrees"] and peer["rerun_max_diff"] <= 1e-5, peer["rerun_max_diff"]
    theirs_first = np.array(peer["first_logits"], dtype=np.float32)
    assert theirs_first.shape == first.shape
    np.testing.assert_allclose(first, theirs_first, rtol=0, atol=ATOL, err_msg=f"{label}: first-draft logits")
    assert peer["tokens"] == out.tokens, f"{label}: mlxspec {out.tokens} != speculators {peer['tokens']}"
    theirs = np.array(peer["logits"], dtype=np.float32)
    ours = np.asarray(out.logits)
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL, err_msg=f"{label}: chain logits")
    worst = max(float(np.abs(first - theirs_first).max()), float(np.abs(ours - theirs).max()))
    print(f"{label}: chain {out.tokens}; max |logit difference| vs speculators {worst:.2e}")
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_eagle3_export_drafts_the_same_in_speculators(checked, case):
    arch = CASES[case][0]
    d, got_cfg, out, first, peer = peer_of(checked, case)
    assert got_cfg.target_layer_ids == (0, 1, 2) and got_cfg.has_embed
    assert peer["attn_implementation"] == "simple_flex_attention"  # speculators' own default
    assert peer["verifier"]["name_or_path"] == f"tiny-{arch}"  # as written (the target's source)
    check_load(peer, d, got_cfg)
    compare(peer, out, first, case)


def test_tiny_eagle3_export_eager_attention(checked):
    """The same drafts through speculators' dense-mask (eager) attention path."""
    d, got_cfg, out, first, peer = peer_of(checked, "eager")
    assert peer["attn_implementation"] == "eager"
    check_load(peer, d, got_cfg)
    compare(peer, out, first, "eager")


def test_smollm2_eagle3_export_drafts_the_same_in_speculators(checked):
    d, got_cfg, out, first, peer = peer_of(checked, "smollm2")
    assert got_cfg.target_layer_ids == (1, 14, 26)
    assert peer["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                "architectures": ["LlamaForCausalLM"]}
    check_load(peer, d, got_cfg)
    compare(peer, out, first, "smollm2")
