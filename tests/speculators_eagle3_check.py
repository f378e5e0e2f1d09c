"""Run by tests/test_speculators_eagle3_interop.py with the python of a separate venv that has torch
and vLLM's `speculators` 0.9.0 (never mlxspec): load an mlxspec-written EAGLE-3 drafter (speculators
layout) with speculators' own loaders (`SpeculatorModelConfig.from_pretrained`,
`SpeculatorModel.from_pretrained` -> `Eagle3DraftModel`) and draft with its own `forward`.

argv: DRAFTER_DIR INPUTS.npz VERIFIER_DIR ATTN, repeated for each drafter checked  ->  one JSON line
per drafter, in order (a drafter whose check raised: {"error": its traceback}). One process checks
them all: importing torch and speculators takes ~14 s here, the checks well under one each.
VERIFIER_DIR stands in for `speculators_config.verifier.name_or_path` (a Hugging Face id; the tests
run offline): a config.json and the verifier's embedding / head / final norm. speculators' EAGLE-3
loader reads it whatever the file holds (tap ids checked against its depth, hidden size compared,
embed_tokens taken from it when the file has none). ATTN: the drafter layer's attention
implementation ("default": speculators' own choice, simple_flex_attention; or "eager").
INPUTS.npz (written by mlxspec): taps [1, n, T*H] (the target's taps at prompt positions 0..n-1),
next_ids [n] (x_1..x_n: the token after each position, the last one the anchor), n_drafts.

How the chain is driven. `Eagle3DraftModel.forward(hidden_states, input_ids, document_ids,
ttt_steps=k)` is speculators' training-time test: step 0 runs every row i = (fc(taps_i), x_{i+1})
causally; step j >= 1 runs row i again from the layer's own pre-norm output of step j-1 at row i
(post-norm with norm_output) and the token input_ids[i + j] (teacher forcing: the input shifted by
j), attending to the step-0 rows <= i and to row i of steps 1..j (the diagonal), one position further.
Row n-1 of step j is thus exactly draft j+1 of a greedy chain from the prompt's pairs once
input_ids[n-1+j] is draft j: this script appends its OWN argmax (mapped to target ids by d2t) to
input_ids (rows past n-1 padded: zero taps, document id -1, which no earlier row sees; with
speculators' default flex attention up to a whole 128-row block) and runs forward again with one
more step, K times. Step-0 logits at every row are the first-draft logits at
every prompt position (teacher-forced). Logits are read from `lm_head`'s output (a forward hook):
forward itself returns only each step's argmax, which must agree.
"""

import json
import sys
import traceback

import numpy as np
import torch
from safetensors.numpy import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig

IGNORED_ON_LOAD = ("verifier_norm.weight", "verifier_lm_head.weight")  # speculators' training-loss copies


def load(path: str, verifier_dir: str, attn: str):
    cfg = SpeculatorModelConfig.from_pretrained(path)
    verifier = cfg.speculators_config.verifier.model_dump()
    cfg.speculators_config.verifier.name_or_path = verifier_dir
    if attn != "default":
        cfg.transformer_layer_config._attn_implementation = attn
    model = SpeculatorModel.from_pretrained(path, config=cfg, dtype=torch.float32)
    return cfg, verifier, model.float().eval()


def loaded_as_file(model, path: str) -> dict:
    """Every file tensor under the same name in the model, with the same values; what the model
    holds that the file does not."""
    file = load_file(f"{path}/model.safetensors")
    sd = model.state_dict()
    unclaimed = sorted(k for k in file if k not in sd)
    differ = sorted(k for k in file if k in sd and not np.array_equal(sd[k].detach().numpy().astype(file[k].dtype),
                                                                      file[k]))
    return {"unclaimed": unclaimed, "differ": differ, "not_from_file": sorted(k for k in sd if k not in file),
            "file_tensors": sorted(file)}


def main(path: str, inputs: str, verifier_dir: str, attn: str) -> None:
    cfg, verifier, model = load(path, verifier_dir, attn)
    first_layer = model.layers[0]
    out = {
        "config_class": type(cfg).__name__,
        "model_class": type(model).__name__,
        "first_layer_class": type(first_layer).__name__,
        "attn_implementation": model._attn_impl,
        "verifier": verifier,
        "aux_hidden_state_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
        "layers": len(model.layers),
        "use_draft_vocab": bool(model.use_draft_vocab),
        "norm_before_residual": bool(first_layer.norm_before_residual),
        "flags": {k: bool(getattr(model.config, k)) for k in ("norm_before_fc", "fc_norm", "norm_output")},
        "qk_norm": hasattr(first_layer.self_attn, "q_norm"),
        "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
        "all_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        **loaded_as_file(model, path),
    }
    z = np.load(inputs)
    taps = torch.from_numpy(z["taps"]).float()
    nxt = [int(t) for t in z["next_ids"]]
    K = int(z["n_drafts"])
    n = taps.shape[1]
    d2t = model.d2t if model.use_draft_vocab else None

    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()[0]))

    # flex attention's block mask, extended per step by whole 128-row blocks, needs a sequence of
    # whole blocks (speculators' training pads to them): pad there, not with the dense eager mask
    block = 128 if model._attn_impl == "simple_flex_attention" else 1

    def run(extra):
        """forward over the prompt's pairs with the chain so far fed by teacher forcing, one step
        per draft -> (each step's logits [S, Vd], each step's argmax from forward)."""
        p = -(-(n + len(extra)) // block) * block - n  # padded rows: the chain's tokens, then 0
        hs = torch.cat([taps, taps.new_zeros(1, p, taps.shape[2])], dim=1)
        ids = torch.tensor([nxt + extra + [0] * (p - len(extra))])
        doc = torch.tensor([[0] * n + [-1] * p])
        seen.clear()
        with torch.no_grad():
            drafts = model(hidden_states=hs, input_ids=ids, document_ids=doc, ttt_steps=len(extra) + 1)
        assert len(seen) == len(extra) + 1, len(seen)
        return list(seen), [d[0] for d in drafts]

    chain, chain_logits, forward_argmax_agrees, rerun = [], [], True, 0.0
    for k in range(K):
        steps, argmaxes = run(chain)
        if k == 0:
            out["first_logits"] = steps[0][:n].numpy().tolist()  # every prompt position, teacher-forced
        for j in range(k):  # earlier steps of this longer run: the same logits as their own run
            rerun = max(rerun, float((steps[j][n - 1] - torch.tensor(chain_logits[j])).abs().max()))
        zk = steps[k][n - 1]
        d = int(torch.argmax(zk))
        forward_argmax_agrees &= int(argmaxes[k][n - 1]) == d
        chain.append(d + int(d2t[d]) if d2t is not None else d)
        chain_logits.append(zk.numpy().tolist())
    out.update(tokens=chain, logits=chain_logits, forward_argmax_agrees=forward_argmax_agrees, rerun_max_diff=rerun)
    print(json.dumps(out))


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 4:
        sys.exit("usage: speculators_eagle3_check.py (DRAFTER_DIR INPUTS.npz VERIFIER_DIR ATTN)...")
    for i in range(0, len(args), 4):
        try:
            main(*args[i:i + 4])
        except Exception:  # noqa: BLE001 - reported on this drafter's line; the next ones still run
            print(json.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()
