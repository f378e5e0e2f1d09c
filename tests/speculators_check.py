"""Run by tests/test_speculators_interop.py with the python of a separate venv that has torch
and vLLM's `speculators` (never mlxspec): load an mlxspec-written drafter with speculators' own
loaders and compute its greedy block drafts with speculators' own modules.

argv: DRAFTER_DIR INPUTS.npz VERIFIER_DIR, repeated for each drafter checked  ->  one JSON line per
drafter, in order (one whose check raised: {"error": its traceback}); one process checks them all,
since importing torch and speculators is most of the cost.
speculators loads the verifier's embedding / head / final norm from
`speculators_config.verifier.name_or_path` (a Hugging Face id): VERIFIER_DIR is a local copy of
those tensors, used in its place because tests run offline.
INPUTS.npz (written by mlxspec): taps [1, n, T*H] (the target's hidden states at the context
positions 0..n-1), block_emb [1, B, H] (the target's embedding of [anchor, MASK, ...]), anchor.
"""

import json
import sys
import traceback

import numpy as np
import torch
from safetensors.numpy import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig


def main(path: str, inputs: str, verifier_dir: str) -> None:
    cfg = SpeculatorModelConfig.from_pretrained(path)
    verifier = cfg.speculators_config.verifier.model_dump()
    cfg.speculators_config.verifier.name_or_path = verifier_dir
    model = SpeculatorModel.from_pretrained(path, config=cfg, dtype=torch.float32)
    model = model.float().eval()
    file = load_file(f"{path}/model.safetensors")
    out = {
        "config_class": type(cfg).__name__,
        "model_class": type(model).__name__,
        "verifier": verifier,
        "sample_from_anchor": bool(cfg.sample_from_anchor),
        "aux_hidden_state_layer_ids": list(cfg.aux_hidden_state_layer_ids),
        "lm_head_finite": bool(torch.isfinite(model.lm_head.weight).all()),
        "lm_head_equals_file": bool(np.array_equal(model.lm_head.weight.detach().numpy(),
                                                   file["lm_head.weight"].astype(np.float32)))
        if "lm_head.weight" in file else None,
    }
    z = np.load(inputs)
    taps = torch.from_numpy(z["taps"])
    h = torch.from_numpy(z["block_emb"])
    anchor = int(z["anchor"])
    n, B = taps.shape[1], h.shape[1]
    with torch.no_grad():
        ctx = model.hidden_norm(model.fc(taps))
        cos, sin = model.rotary_emb(h, torch.arange(n + B)[None])
        for layer in model.layers:
            layer.self_attn.config._attn_implementation = "eager"  # no mask: [context | block] in full
            h = layer(target_hidden=ctx, hidden_states=h, attention_mask=None, position_embeddings=(cos, sin))
        h = model.norm(h)[0]
        rows = h if cfg.sample_from_anchor else h[1:]
        base = model.lm_head(rows)
        d2t = model.d2t if model.use_draft_vocab else None
        markov = getattr(model, "markov_head", None)
        tokens, logits, prev = [], [], anchor
        for k in range(rows.shape[0]):
            zk = base[k]
            if markov is not None:
                zk = zk + markov.block_bias(prev_token_ids=torch.tensor([[prev]]),
                                            hidden_states=rows[k][None, None])[0, 0]
            d = int(torch.argmax(zk))
            prev = d + int(d2t[d]) if d2t is not None else d
            tokens.append(prev)
            logits.append(zk.numpy().tolist())
    out["tokens"] = tokens
    out["logits"] = logits
    print(json.dumps(out))


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 3:
        sys.exit("usage: speculators_check.py (DRAFTER_DIR INPUTS.npz VERIFIER_DIR)...")
    for i in range(0, len(args), 3):
        try:
            main(*args[i:i + 3])
        except Exception:  # noqa: BLE001 - reported on this drafter's line; the next ones still run
            print(json.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()
