"""mlxspec's EAGLE-3 drafts equal an independent implementation's: mlx-vlm 0.7.10's
`speculative/drafters/eagle3` (`Eagle3DraftModel`), loading the drafter with its own loader and
drafting with its own modules (tests/mlxvlm_eagle3_check.py).

Tiny random drafters in BOTH formats, written by mlxspec's writers: vLLM speculators (read by
mlx-vlm as written) and SpecForge. mlx-vlm reads only the speculators layout, and reads tap ids as
speculators does (`capture_layer_ids` = id - 1), so the test hands it the SpecForge directory
converted the way a user would convert it: SpecForge id k (the output of layer k) becomes
speculators id k + 1, `midlayer.` becomes `layers.0.`, the flat Llama config becomes
`transformer_layer_config`. That conversion is exactly the convention difference under test: both
tools must then tap the same target layers (mlxspec from the SpecForge file, mlx-vlm from the
converted one) and draft the same tokens. Cases: reduced draft vocabulary (d2t) and full,
norm_before_residual true and false, one and two layers, with and without embed_tokens in the file.

Several rounds run on ONE drafter state in each tool: the prompt's pairs, a chain, some drafts
accepted plus a bonus (none, some, all), another chain, ... mlxspec through Eagle3Drafter's
begin / draft / accept; mlx-vlm through prefill_from_target_hidden, draft_block's body (opened up
to return each step's logits; its own draft_block runs beside it on a second copy and must agree)
and accept_verified_tokens. Compared per round: the draft token ids exactly, each step's draft
logits (draft-vocabulary order) to 1e-4.

Positions: mlx-vlm puts pair i at RoPE position i + 1 (its `_next_position` starts at 1), mlxspec at
i. RoPE makes attention depend on position differences only, so the logits agree to float
tolerance; a bug in either's positions (a chain row at the wrong offset) still shows.

mlx-vlm runs in its own venv, `~/.cache/mlxspec-peer-venvs/mlxvlm-*`, made on first use by test_dflash2_conformance's
fixture (reused here). MLXSPEC_MLXVLM_PYTHON points at an existing interpreter.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxspec.drafters.load import save_drafter
from mlxspec.engine.eagle3 import Eagle3Drafter
from mlxspec.engine.verify import SamplingParams
from test_dflash2_conformance import mlxvlm_python  # noqa: F401 (the session fixture: mlx-vlm's venv)
from test_eagle3 import eagle3_config, load, random_eagle3
from tiny_targets import tiny_target

pytestmark = pytest.mark.slow

CHECK = Path(__file__).with_name("mlxvlm_eagle3_check.py")
PROMPT = [5, 17, 33, 2, 60, 41, 8]
# (drafts in the chain, drafts the target keeps); the last round only drafts
SCHEDULE = [(4, 2), (3, 0), (1, 1), (5, 5), (2, 1), (6, None)]

CASES = {
    # name: (format, draft vocabulary, norm_before_residual, layers, embed_tokens in the file)
    "speculators-d2t-nbr": ("speculators-eagle3", 48, True, 1, True),
    "speculators-full-2layers": ("speculators-eagle3", 64, False, 2, False),
    "specforge-d2t": ("specforge", 40, False, 1, False),
    "specforge-full-nbr": ("specforge", 64, True, 1, False),
}


def specforge_to_speculators(src: Path, dst: Path) -> None:
    """What a user does to hand a SpecForge drafter to a speculators reader (mlx-vlm): ids k -> k + 1,
    `midlayer.` -> `layers.0.`, the flat Llama config -> transformer_layer_config."""
    c = json.loads((src / "config.json").read_text())
    layer = {k: v for k, v in c.items() if k not in ("architectures", "draft_vocab_size", "target_hidden_size",
                                                     "norm_before_residual", "eagle_config")}
    ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    out = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": layer, "draft_vocab_size": c["draft_vocab_size"],
           "target_hidden_size": c["target_hidden_size"], "norm_before_residual": c["norm_before_residual"],
           "eagle_aux_hidden_state_layer_ids": [k + 1 for k in ids],
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": 7}], "default_proposal_method": "greedy"}}
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(out))
    t = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(dst / "model.safetensors"),
                        {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v
                         for k, v in t.items()}, metadata={"format": "pt"})


def mlxspec_rounds(target, d: Eagle3Drafter):
    """The rounds through Eagle3Drafter, as the loop drives it (the target verifies only the kept
    drafts here; its next token is the bonus). -> (draft outputs, inputs for the peer)."""
    cache = target.make_cache()
    logits, taps = target(mx.array([PROMPT]), cache, taps=d.taps)
    anchor = int(mx.argmax(logits[0, -1]).item())
    d.begin(PROMPT, taps)
    inputs = {"prompt_ids": np.array(PROMPT), "prompt_taps": np.array(taps), "first_bonus": anchor,
              "n_calls": len(SCHEDULE), "embed": np.array(target.inner.embed_tokens.weight)}
    outs = []
    for i, (n, kept) in enumerate(SCHEDULE):
        out = d.draft(anchor, n, SamplingParams(), np.random.default_rng(0))
        assert len(out.tokens) == n
        outs.append(out)
        inputs[f"drafts_{i}"] = n
        if kept is None:
            break
        rows = [anchor] + out.tokens[:kept]
        vl, vt = target(mx.array([rows]), cache, taps=d.taps)
        bonus = int(mx.argmax(vl[0, -1]).item())
        d.accept(rows, vt)
        inputs.update({f"accepted_{i}": kept, f"bonus_{i}": bonus, f"verify_taps_{i}": np.array(vt)})
        anchor = bonus
    return outs, inputs


@pytest.mark.parametrize("case", list(CASES))
def test_drafts_equal_mlx_vlm(mlxvlm_python, tmp_path, case):  # noqa: F811
    fmt, draft_vocab, nbr, layers, with_embed = CASES[case]
    target = tiny_target("llama", seed=0)
    cfg = eagle3_config(draft_vocab_size=draft_vocab, norm_before_residual=nbr, num_hidden_layers=layers)
    path = tmp_path / "drafter"
    save_drafter(random_eagle3(cfg, seed=11), cfg, path, fmt, target=target, with_embed=with_embed)
    model, got_cfg, _ = load(path, target)
    assert got_cfg.target_layer_ids == (0, 1, 2) and got_cfg.has_embed == with_embed
    peer_dir = path
    if fmt == "specforge":
        assert got_cfg.file_layer_ids == (0, 1, 2) and got_cfg.tap_convention == "specforge"
        peer_dir = tmp_path / "for-mlx-vlm"
        specforge_to_speculators(path, peer_dir)
    d = Eagle3Drafter(model, got_cfg, target)
    outs, inputs = mlxspec_rounds(target, d)
    np.savez(tmp_path / "inputs.npz", **inputs)
    r = subprocess.run([mlxvlm_python, str(CHECK), str(peer_dir), str(tmp_path / "inputs.npz")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    peer = json.loads(r.stdout.strip().splitlines()[-1])
    assert peer["model_class"] == "Eagle3DraftModel" and peer["kind"] == "eagle3"
    # the same target layers: mlx-vlm's capture ids (speculators id - 1) are mlxspec's taps
    assert peer["capture_layer_ids"] == list(d.taps)
    assert peer["uses_draft_vocab"] == (draft_vocab != 64) and peer["norm_before_residual"] == nbr
    assert peer["layers"] == layers
    assert len(peer["calls"]) == len(SCHEDULE)
    worst = 0.0
    for i, (out, call) in enumerate(zip(outs, peer["calls"])):
        assert call["tokens"] == call["draft_block_tokens"], f"round {i}: mlx-vlm's opened body != draft_block"
        assert out.tokens == call["tokens"], f"round {i}: mlxspec {out.tokens} != mlx-vlm {call['tokens']}"
        theirs = np.array(call["logits"], dtype=np.float32)
        assert theirs.shape == (SCHEDULE[i][0], draft_vocab)
        np.testing.assert_allclose(np.asarray(out.logits), theirs, rtol=0, atol=1e-4, err_msg=f"round {i}")
        worst = max(worst, float(np.abs(np.asarray(out.logits) - theirs).max()))
    print(f"{case}: max |logit difference| vs mlx-vlm {worst:.2e}")


def test_the_converted_file_reads_the_same_in_mlxspec(tmp_path):
    """The SpecForge -> speculators conversion the conformance test hands mlx-vlm is right by
    mlxspec's own readers too: both files tap the same layers and hold the same weights."""
    target = tiny_target("llama", seed=0)
    cfg = eagle3_config(draft_vocab_size=40)
    save_drafter(random_eagle3(cfg, seed=12), cfg, tmp_path / "sf", "specforge", target=target)
    specforge_to_speculators(tmp_path / "sf", tmp_path / "spec")
    a, ca, _ = load(tmp_path / "sf", target)
    b, cb, _ = load(tmp_path / "spec", target)
    assert ca.target_layer_ids == cb.target_layer_ids == (0, 1, 2)
    assert (ca.file_layer_ids, cb.file_layer_ids) == ((0, 1, 2), (1, 2, 3))
    pb = dict(tree_flatten(b.parameters()))
    for k, v in tree_flatten(a.parameters()):
        assert mx.array_equal(pb[k], v), k
