"""Run by tests/test_eagle3_conformance.py with the python of a separate venv that has mlx-vlm
0.7.10 (never mlxspec): load an EAGLE-3 drafter in the vLLM speculators layout with mlx-vlm's own
loader (`mlx_vlm.speculative.drafters.load_drafter`, which reads the tap ids as speculators does:
`capture_layer_ids` = id - 1) and run several rounds on ONE drafter state with mlx-vlm's own
modules: `prefill_from_target_hidden`, the body of `draft_block` split open so each step's draft
logits can be returned too (`_forward_tokens`, `_logits`, `_sample`), and
`accept_verified_tokens`. A second copy of the drafter runs the same rounds through the unopened
`draft_block`, so the opened body is checked against mlx-vlm's own.

argv: DRAFTER_DIR INPUTS.npz -> prints one JSON line.
INPUTS.npz (written by mlxspec's test): embed [V, H] (the target's embedding, which mlx-vlm's
`bind` borrows), prompt_ids [n0], prompt_taps [1, n0, 3H], first_bonus, n_calls, and per call i:
drafts_i (chain length) and, for every call but the last, accepted_i (drafts the target kept),
bonus_i and verify_taps_i [1, accepted_i + 1, 3H] (the target's taps at the anchor and the kept
drafts).
"""

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.speculative.drafters import load_drafter

I32 = mx.int32


class _Target:
    """What mlx-vlm's bind() borrows from a target: its embedding."""

    def __init__(self, embed):
        v, h = embed.shape
        self.embed_tokens = nn.Embedding(v, h)
        self.embed_tokens.weight = mx.array(embed)


def load(path, embed):
    model, kind = load_drafter(path)
    # a file without embed_tokens: mlx-vlm's loader drops the weightless module, and bind()
    # (which compares shapes with it) would fail; put back the module bind() then replaces
    if model.embed_tokens is None:
        model.embed_tokens = nn.Embedding(*embed.shape)
    model.reset(_Target(embed))
    return model, kind


def opened_draft(model, n):
    """draft_block(block_size = n + 1, greedy), with the logits of every step."""
    tok, h_prev = model._seed_token.astype(I32), model._seed_hidden
    tokens, logits = [tok], [model._logits(h_prev)]
    model._seed_token = model._seed_hidden = None
    model._round_appended = 0
    while len(tokens) < n:
        h_prev = model._forward_tokens(tok, h_prev, I32)
        model._round_appended += 1
        lg = model._logits(h_prev)
        tok = model._sample(lg, None, I32, True)
        tokens.append(tok)
        logits.append(lg)
    return mx.concatenate(tokens, axis=1), mx.concatenate(logits, axis=1)


def main(path: str, inputs: str) -> None:
    z = np.load(inputs)
    model, kind = load(path, z["embed"])
    ref, _ = load(path, z["embed"])
    prompt = mx.array(z["prompt_ids"][None], dtype=I32)
    for m in (model, ref):
        m.prefill_from_target_hidden(prompt, mx.array(z["prompt_taps"]), int(z["first_bonus"]), None, I32, greedy=True)
    calls = []
    n_calls = int(z["n_calls"])
    for i in range(n_calls):
        n = int(z[f"drafts_{i}"])
        draft, logits = opened_draft(model, n)
        ref_draft = ref.draft_block(int(z["first_bonus"]), None, None, n + 1, None, I32, greedy=True)
        mx.eval(draft, logits, ref_draft)
        calls.append({"tokens": np.array(draft[0]).tolist(), "draft_block_tokens": np.array(ref_draft[0]).tolist(),
                      "logits": np.array(logits[0].astype(mx.float32)).tolist()})
        if i == n_calls - 1:
            break
        a, bonus = int(z[f"accepted_{i}"]), int(z[f"bonus_{i}"])
        vt = mx.array(z[f"verify_taps_{i}"])
        for m, d in ((model, draft), (ref, ref_draft)):
            new_tokens = np.array(d[0, :a]).tolist() + [bonus]
            m.accept_verified_tokens(vt, d, a, new_tokens, None, I32, greedy=True)
    cfg = model.config
    print(json.dumps({"kind": kind, "model_class": type(model).__name__,
                      "target_layer_ids": list(cfg.target_layer_ids),
                      "capture_layer_ids": list(cfg.capture_layer_ids),
                      "uses_draft_vocab": bool(model.uses_draft_vocab),
                      "norm_before_residual": bool(cfg.norm_before_residual),
                      "layers": len(model.layers), "calls": calls}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
