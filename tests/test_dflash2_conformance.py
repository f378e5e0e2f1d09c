"""mlxspec's DFlash 2 drafts equal an independent implementation's: mlx-vlm 0.7.10's
`speculative/drafters/dflash2`, loading the same mlxspec-written z-lab directory with its own
loader and drafting with its own modules (tests/mlxvlm_dflash2_check.py).

Several draft calls run on ONE drafter cache (mlx-vlm's) / one BlockDrafter context (mlxspec's),
with a sliding layer and a full layer. Compared per call: the block logits (1e-4), each row's
top-k candidate set, and the chosen chain (exactly).

Window semantics (docs/dflash2.md): mlxspec follows z-lab's port, a block row at position q sees
context position k iff q - k < window. mlx-vlm shows every row whatever its rotating cache holds.
While p + B - 1 < window (p = the anchor's position) both mean "all context" and mlxspec's own
drafting path must match mlx-vlm. Once the window binds they differ by design: there the test
checks that they do differ, and that mlxspec's layers, given the context rows mlx-vlm's cache
handed over (recorded by the peer script), give mlx-vlm's logits, candidates and chain.

mlx-vlm runs in its own venv, `~/.cache/mlxspec-peer-venvs/mlxvlm-*` (`conftest.peer_venv`: per machine, named by the pins), created here on first use from
PyPI: mlx (this venv's version, `mlx[cpu]` on Linux), `mlx-vlm==0.7.10 --no-deps` and the few
modules its drafter package imports. MLXSPEC_MLXVLM_PYTHON points at an existing interpreter.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ensure_peer_venv, peer_venv
from mlx.utils import tree_flatten, tree_unflatten

from mlxspec import kernels
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.dflash2 import top_candidates
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.drafters.build import make_model
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.verify import SamplingParams
from mlxspec.targets.model import target_head_rows
from tiny_targets import tiny_target

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHECK = Path(__file__).with_name("mlxvlm_dflash2_check.py")
MLX = f"mlx[cpu]=={mx.__version__}" if sys.platform.startswith("linux") else f"mlx=={mx.__version__}"
# what mlx_vlm.speculative.drafters imports (its package __init__ pulls in mlx_vlm.utils)
DEPS = ("numpy", "requests", "huggingface_hub", "pillow", "transformers")
VENV = peer_venv("mlxvlm", (MLX, *DEPS, "mlx-vlm==0.7.10"))
WINDOW, BLOCK = 8, 4
SCHEDULE = [2, 2, 3, 1, 4]  # new context rows before each call: anchors at positions 2, 4, 7, 8, 12


@pytest.fixture(scope="session")
def mlxvlm_python() -> str:
    if os.environ.get("MLXSPEC_MLXVLM_PYTHON"):
        return os.environ["MLXSPEC_MLXVLM_PYTHON"]
    return ensure_peer_venv(VENV, "import mlx_vlm.speculative.drafters.dflash2",
                            [[MLX, *DEPS], ["--no-deps", "mlx-vlm==0.7.10"]])


def dflash2_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, block_size=BLOCK, target_layer_ids=[0, 2], mask_token_id=63,
                vocab_size=64, rope_theta=10000.0, sample_from_anchor=False, conv_kernel_size=2, conv_group_size=8,
                selector_rank=16, selector_top_k=8, output_multiplier=0.7, final_logit_softcapping=6.0,
                layer_types=("sliding_attention", "full_attention"), sliding_window=WINDOW, block_causal=False)
    base.update(kw)
    return DrafterConfig(**base)


def random_dflash2(cfg: DrafterConfig, seed: int = 0):
    """Random weights at scales where every part shows: norms near 1, convs and codebooks
    large enough that a dropped conv or selector changes the chain."""
    mx.random.seed(seed)
    m = make_model(cfg)
    scale = {"base_kernel": 0.5, "codebook": 1.0, "hidden_projection": 0.5}
    new = {}
    for k, v in tree_flatten(m.parameters()):
        s = next((x for n, x in scale.items() if n in k), 0.2)
        new[k] = mx.random.normal(v.shape) * s + (1.0 if k.endswith("norm.weight") else 0.0)
    m.update(tree_unflatten(list(new.items())))
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_target("qwen3", seed=0)
    cfg = dflash2_config()
    path = tmp_path_factory.mktemp("dflash2") / "zlab"
    save_drafter(random_dflash2(cfg), cfg, path, "zlab", target=target)
    model, cfg = load_drafter(str(path), target.info, log=io.StringIO())
    ids = [int(x) for x in np.random.default_rng(5).integers(0, 63, sum(SCHEDULE) + 1)]
    _, taps = target(mx.array([ids]), target.make_cache(), taps=tuple(cfg.target_layer_ids))
    return target, path, model, cfg, ids, taps.astype(mx.float32)


def mlxspec_calls(target, model, cfg, ids, taps):
    """Greedy drafts through BlockDrafter, one context for all calls: ([(anchor position,
    DraftOutput, per-layer context K/V)], the drafter)."""
    d = BlockDrafter(model, target, dtype=mx.float32)
    outs, p = [], 0
    for i, n in enumerate(SCHEDULE):
        rows = (ids[p : p + n], taps[:, p : p + n])
        d.begin(*rows) if i == 0 else d.accept(*rows)
        p += n
        outs.append((p, d.draft(ids[p], BLOCK - 1, SamplingParams(), np.random.default_rng(0)),
                     [None if kv is None else (kv[0], kv[1]) for kv in d.ctx_kv]))
    return outs, d


def layers_given_context(model, cfg, d, p, anchor, kv, keep):
    """mlxspec's layers with each layer shown only its last keep[i] context rows (no window)."""
    wide = make_model(dataclasses.replace(cfg, sliding_window=1 << 30))
    wide.update(model.parameters())
    kv = [(k[:, :, k.shape[2] - n :], v[:, :, v.shape[2] - n :]) for (k, v), n in zip(kv, keep)]
    emb = d.embed(mx.array([[anchor] + [cfg.mask_token_id] * (BLOCK - 1)])).astype(mx.float32)
    h = wide.hidden(emb, mx.arange(p, p + BLOCK)[None], kv)[0, 1:]
    logits = wide.logits(h, d.head)
    ids, unary, hp = wide.selector_inputs(h, logits)
    cs = wide.candidate_selector
    tokens, _, _ = kernels.select_chain(unary, ids, hp, cs.predecessor_codebook, cs.successor_codebook, anchor)
    return logits, ids, tokens


def test_drafts_equal_mlx_vlm(mlxvlm_python, setup, tmp_path):
    target, path, model, cfg, ids, taps = setup
    outs, d = mlxspec_calls(target, model, cfg, ids, taps)
    inputs = {"embed": np.array(target.embed(mx.arange(64)).astype(mx.float32)),
              "head": np.array(target_head_rows(target, None)), "n_calls": len(SCHEDULE), "block_size": BLOCK}
    p = 0
    for i, n in enumerate(SCHEDULE):
        inputs[f"taps_{i}"] = np.array(taps[:, p : p + n])
        p += n
        inputs[f"anchor_{i}"] = ids[p]
    np.savez(tmp_path / "inputs.npz", **inputs)
    r = subprocess.run([mlxvlm_python, str(CHECK), str(path), str(tmp_path / "inputs.npz")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["model_class"] == "DFlash2DraftModel"

    binds = 0
    for (p, out, kv), peer in zip(outs, got["calls"]):
        logits = np.array(peer["logits"], dtype=np.float32)
        if p + BLOCK - 1 < WINDOW:  # the window shows every context row in both semantics
            assert peer["ctx_keys"] == [p, p]
            np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=0, atol=1e-4)
            ours = np.sort(np.asarray(top_candidates(out.logits, cfg.selector_top_k)[0]), axis=-1)
            assert ours.tolist() == peer["candidates"]
            assert out.tokens == peer["chain"]
        else:  # z-lab's absolute window hides context from later rows; mlx-vlm does not
            binds += 1
            assert np.abs(np.asarray(out.logits) - logits).max() > 1e-3
        # where the context each layer sees is the same, the drafts are the same
        lg, cand, chain = layers_given_context(model, cfg, d, p, ids[p], kv, peer["ctx_keys"])
        np.testing.assert_allclose(np.asarray(lg), logits, rtol=0, atol=1e-4)
        assert np.sort(np.asarray(cand), axis=-1).tolist() == peer["candidates"]
        assert chain.tolist() == peer["chain"]
    assert binds >= 2
    # the sliding layer was shown a window's worth at most once the window filled (mlx-vlm)
    assert all(c["ctx_keys"][0] <= WINDOW - 2 + n for c, n in zip(got["calls"], SCHEDULE))
