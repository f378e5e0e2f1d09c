"""Run by tests/test_dflash2_conformance.py with the python of a separate venv that has mlx-vlm
0.7.10 (never mlxspec): load an mlxspec-written DFlash 2 drafter with mlx-vlm's own loader
(`mlx_vlm.speculative.drafters.load_drafter`) and draft several blocks on ONE drafter cache with
mlx-vlm's own modules (`_hidden`, `_logits`, `candidate_selector.select`: the body of its
`draft_block`, split open so the block logits can be returned too).

argv: DRAFTER_DIR INPUTS.npz -> prints one JSON line.
INPUTS.npz (written by mlxspec): embed [V, H] and head [V, H] (the target's embedding and LM head,
which the drafter borrows), n_calls, block_size, and per call i: taps_i [1, n_i, T*H] (the
context rows new since the previous call) and anchor_i.
Per call it returns the block logits of rows 1..B-1, each row's top-k candidate set, the greedy
chain, and for each layer how many context keys mlx-vlm's cache handed to attention.
"""

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel


class _Target:
    """The two tensors mlx-vlm's bind() borrows from a target."""

    def __init__(self, embed, head):
        v, h = embed.shape
        self.embed_tokens = nn.Embedding(v, h)
        self.embed_tokens.weight = mx.array(embed)
        self.lm_head = nn.Linear(h, v, bias=False)
        self.lm_head.weight = mx.array(head)


def main(path: str, inputs: str) -> None:
    z = np.load(inputs)
    model, kind = load_drafter(path)
    # DFlash2DraftModel.bind first checks the target's rollback support, which a stand-in lacks;
    # the binding itself is DFlashDraftModel's
    DFlashDraftModel.bind(model, _Target(z["embed"], z["head"]))
    cache = model.make_cache()
    seen = {}
    for i, c in enumerate(cache):
        orig = c.update_and_fetch

        def wrapped(k, v, _orig=orig, _i=i):
            keys, values = _orig(k, v)
            seen[_i] = int(keys.shape[2])
            return keys, values

        c.update_and_fetch = wrapped
    B = int(z["block_size"])
    calls = []
    for n in range(int(z["n_calls"])):
        anchor = int(z[f"anchor_{n}"])
        hidden = mx.array(z[f"taps_{n}"])
        block = mx.array([[anchor] + [int(model.config.mask_token_id)] * (B - 1)], dtype=mx.int32)
        h = model._hidden(block, hidden, cache)[:, 1:]
        logits = model._logits(h)
        chain = model.candidate_selector.select(h, logits, mx.array([anchor], dtype=mx.int32),
                                                lambda x: mx.argmax(x, axis=-1))
        k = model.candidate_selector.top_k
        cands = mx.argpartition(logits, -k, axis=-1)[..., -k:]
        mx.eval(logits, chain, cands)
        calls.append({
            "logits": np.array(logits[0].astype(mx.float32)).tolist(),
            "candidates": [sorted(r) for r in np.array(cands[0]).tolist()],
            "chain": np.array(chain[0]).tolist(),
            "ctx_keys": [seen[i] for i in range(len(cache))],
        })
    print(json.dumps({"kind": kind, "model_class": type(model).__name__, "calls": calls}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
