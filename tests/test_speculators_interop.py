"""vLLM's `speculators` library loads mlxspec's drafters with its own loaders
(`SpeculatorModelConfig.from_pretrained`, `SpeculatorModel.from_pretrained`) and, with its own
modules, drafts the same tokens as mlxspec.

speculators needs torch, which mlxspec does not: the check runs as a subprocess
(tests/speculators_check.py) in a separate venv, `~/.cache/mlxspec-peer-venvs/speculators-*` (`conftest.peer_venv`: per machine, named by the pins),
created here on first use: `pip install torch==2.13.0 speculators==0.9.0` from PyPI (torch's
CPU wheel where pip finds one, e.g. with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu),
then torchvision / torchaudio uninstalled (declared by speculators, never imported by it).
That install takes minutes, hence the `slow` marker (`pytest -m "not slow"` leaves it out).
MLXSPEC_SPECULATORS_PYTHON points at an existing interpreter that has both instead.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import ensure_peer_venv, peer_venv

from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.verify import SamplingParams

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ("torch==2.13.0", "speculators==0.9.0")
VENV = peer_venv("speculators", REQUIREMENTS)
CHECK = Path(__file__).with_name("speculators_check.py")
SHIPPED = ROOT / "mlxspec" / "weights"


@pytest.fixture(scope="session")
def speculators_python() -> str:
    """A python with torch and speculators: MLXSPEC_SPECULATORS_PYTHON, else the project's
    test venv, created and installed from PyPI when absent (skips only when that fails)."""
    if os.environ.get("MLXSPEC_SPECULATORS_PYTHON"):
        return os.environ["MLXSPEC_SPECULATORS_PYTHON"]
    # speculators declares torchvision / torchaudio but never imports them; PyPI's builds of
    # them need a CUDA torch and break `import transformers` next to the CPU one
    return ensure_peer_venv(VENV, "import speculators, torch", [list(REQUIREMENTS)],
                            uninstall=("torchvision", "torchaudio"))


def _mlxspec_drafts(target, tok, path, prompt):
    """mlxspec's greedy block after the prompt, and the inputs speculators needs to redo it."""
    model, cfg = load_drafter(str(path), target.info, log=io.StringIO())
    d = BlockDrafter(model, target)
    ids = tok.encode(prompt, add_special_tokens=False)
    logits, taps = target(mx.array([ids]), target.make_cache(), taps=d.taps)
    anchor = int(mx.argmax(logits[0, -1]).item())
    d.begin(ids, taps)
    out = d.draft(anchor, d.max_drafts, SamplingParams(), np.random.default_rng(0))
    block = [anchor] + [cfg.mask_token_id] * (d.block_size - 1)
    inputs = {"taps": np.array(taps.astype(mx.float32)), "anchor": np.array(anchor),
              "block_emb": np.array(target.embed(mx.array([block])).astype(mx.float32))}
    return out, inputs, cfg


@pytest.fixture(scope="module")
def verifier_dir(smollm2, tmp_path_factory) -> Path:
    """The tensors speculators takes from the verifier (embedding = tied head, final norm), as an
    HF-style directory: stands in for the Hugging Face download, the tests run offline."""
    from mlxspec.targets.model import target_head_rows

    target, _ = smollm2
    d = tmp_path_factory.mktemp("verifier")
    mx.save_safetensors(str(d / "model.safetensors"), {
        "model.embed_tokens.weight": target_head_rows(target, None),
        "model.norm.weight": target.model.model.norm.weight.astype(mx.float32)}, metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "tie_word_embeddings": True}))
    return d


SHIPPED_CASES = ["smollm2-135m-dspark", "smollm2-135m-dflash"]
WRITTEN_CASES = [(16, True), (0, False)]


def _written(target, rank: int, layout: bool, path: Path) -> Path:
    """A fresh random drafter with a reduced vocabulary and no head of its own, written by
    save_drafter: the speculators writer stores the target's rows at the d2t ids as lm_head."""
    info = target.info
    cfg = DrafterConfig(hidden_size=info.hidden_size, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, block_size=6,
                        target_layer_ids=[2, 14, 27], mask_token_id=16, vocab_size=info.vocab_size,
                        sample_from_anchor=layout, rope_theta=100000.0, markov_rank=rank, confidence_head=bool(rank),
                        draft_vocab_size=2048)
    mx.random.seed(3)
    m = DFlashModel(cfg)
    ids = np.sort(np.random.default_rng(3).choice(info.vocab_size, 2048, replace=False))
    m.d2t = mx.array((ids - np.arange(2048)).astype(np.int32))  # speculators' offsets
    mx.eval(m.parameters())
    save_drafter(m, cfg, path, "speculators", target=target)
    return path


@pytest.fixture(scope="module")
def checked(speculators_python, smollm2, verifier_dir, tmp_path_factory):
    """Every drafter below, mlxspec's block, then speculators' in ONE process (importing torch and
    speculators is most of the cost) -> {case: (mlxspec's drafts, its config, speculators' JSON)}."""
    target, tok = smollm2
    cases = {name: (SHIPPED / name, "def fibonacci(n):\n    ") for name in SHIPPED_CASES}
    for rank, layout in WRITTEN_CASES:
        path = _written(target, rank, layout, tmp_path_factory.mktemp(f"written-{rank}") / "drafter")
        cases[(rank, layout)] = (path, "The capital of France is")
    ours, args = {}, []
    for case, (path, prompt) in cases.items():
        out, inputs, cfg = _mlxspec_drafts(target, tok, path, prompt)
        npz = tmp_path_factory.mktemp("inputs") / "inputs.npz"
        np.savez(npz, **inputs)
        ours[case] = (out, cfg)
        args += [str(path), str(npz), str(verifier_dir)]
    r = subprocess.run([speculators_python, str(CHECK), *args], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()[-len(cases):]
    assert len(lines) == len(cases), r.stdout[-3000:]
    return {case: (*ours[case], json.loads(line)) for case, line in zip(cases, lines)}


def _check(checked, case):
    out, cfg, got = checked[case]
    assert "error" not in got, f"speculators raised on {case}:\n{got.get('error')}"
    assert got["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert got["sample_from_anchor"] == cfg.sample_from_anchor
    assert got["aux_hidden_state_layer_ids"] == [t + 1 for t in cfg.target_layer_ids]
    if cfg.draft_vocab_size:
        assert got["lm_head_finite"] and got["lm_head_equals_file"]  # loaded, not left at init
    assert got["tokens"] == out.tokens
    np.testing.assert_allclose(np.array(got["logits"]), np.asarray(out.logits), rtol=0, atol=2e-3)
    return got


@pytest.mark.parametrize("name", SHIPPED_CASES)
def test_shipped_drafters_load_and_draft_in_speculators(checked, name):
    got = _check(checked, name)
    assert got["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert got["model_class"] == ("DSparkDraftModel" if "dspark" in name else "DFlashDraftModel")


@pytest.mark.parametrize("rank,layout", WRITTEN_CASES)
def test_written_drafters_load_and_draft_in_speculators(checked, rank, layout):
    """Fresh random drafters with a reduced vocabulary and no head of their own, written by
    save_drafter: the speculators writer stores the target's rows at the d2t ids as lm_head."""
    got = _check(checked, (rank, layout))
    # the packaged GGUF's upstream repo, not a path on this machine
    assert got["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
