"""One training step: the drafter's forward over a step's blocks, the lineage's loss, the
gradient and the optimizer update.

What differs per lineage is a loss (`LOSSES`, keyed by the drafter config's `lineage`) and,
where its drafter is not run block by block like DFlash's, a forward; the loop
(`trainer.train`), the data (`batches`) and the checkpoints (`checkpoint`) are shared.

Losses (k = 1-based draft index inside the block):
- DFlash: CE on the predicting rows, weight exp(-(k-1)/gamma).
- DFlash 2: the DFlash CE plus the path selector's cross-entropy over its top-k candidates.
- DSpark: 0.1*CE + 0.9*L1(p_draft, p_target) + BCE(confidence, 1 - 0.5*L1), weights
  exp(-(k-1)/4); Markov head teacher-forced on the label sequence.
CE is on the target's argmax, or with `loss="kl"` a soft cross-entropy on its stored top-k.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlxspec.drafters.model import DFlashModel
from mlxspec.kernels.selector import teacher_scores
from mlxspec.train.blocks import block_logits, draft_choice
from mlxspec.train.config import TrainConfig


def token_ce(logits: mx.array, b: dict, tc: TrainConfig) -> tuple[mx.array, mx.array]:
    """Per predicting row: the cross-entropy to the label (or, `loss="kl"`, to the target's
    top-k distribution) and 1 where the row has a label -> (ce, valid), both [S, K, n]."""
    label = b["label"]
    valid = (label >= 0).astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    if tc.loss == "kl":
        # KL to the target's stored top-k distribution (renormalised over the top-k ids in
        # the draft vocabulary), up to the target's constant entropy term
        logp_k = mx.take_along_axis(logits, b["tk_ids"], axis=-1) - lse[..., None]
        pt = b["tk_p"] / mx.maximum(b["tk_p"].sum(-1, keepdims=True), 1e-6)
        ce = -(pt * logp_k).sum(-1) * valid
    else:
        picked = mx.take_along_axis(logits, mx.maximum(label, 0)[..., None], axis=-1)[..., 0]
        ce = (lse - picked) * valid
    return ce, valid


def _dflash_ce(logits, h, b: dict, tc: TrainConfig):
    """DFlash's CE, weighted exp(-(k-1)/gamma) over the block -> (loss, weights, valid)."""
    ce, valid = token_ce(logits, b, tc)
    k = mx.arange(h.shape[2], dtype=mx.float32)
    gamma = tc.gamma or (7.0 if tc.block_size >= 16 else 4.0)
    w = mx.exp(-k / gamma)
    return (ce * w).sum() / mx.maximum((valid * w).sum(), 1e-6), w, valid


def dflash_loss(model: DFlashModel, logits, h, state, b: dict, tc: TrainConfig):
    loss, _, _ = _dflash_ce(logits, h, b, tc)
    return loss, {"ce": loss}


def dflash2_loss(model: DFlashModel, logits, h, state, b: dict, tc: TrainConfig):
    loss, w, valid = _dflash_ce(logits, h, b, tc)
    metrics = {"ce": loss}
    c, label = model.config, b["label"]
    # the path selector: cross-entropy over its k candidates, where the label is one of
    # them (its pick is the draft), conditioned on the previous label (teacher forcing)
    kk = c.selector_top_k
    ids = mx.stop_gradient(mx.argpartition(-mx.stop_gradient(logits), kk - 1, axis=-1)[..., :kk])
    cs = model.candidate_selector
    scores = teacher_scores(mx.take_along_axis(logits, ids, axis=-1), ids, cs.hidden_projection(h),
                            cs.predecessor_codebook, cs.successor_codebook, b["prev"])
    hit = ids == mx.maximum(label, 0)[..., None]
    present = hit.any(-1).astype(mx.float32) * valid
    picked_s = (scores * hit).sum(-1)
    sel = (mx.logsumexp(scores, axis=-1) - picked_s) * present
    sel_m = (sel * w).sum() / mx.maximum((present * w).sum(), 1e-6)
    metrics["selector_ce"] = sel_m
    return loss + sel_m, metrics


def dspark_loss(model: DFlashModel, logits, h, state, b: dict, tc: TrainConfig):
    c = model.config
    ce, _ = token_ce(logits, b, tc)
    k = mx.arange(h.shape[2], dtype=mx.float32)
    w = mx.exp(-k / 4.0)
    p_d = mx.softmax(logits, axis=-1)
    pd_k = mx.take_along_axis(p_d, b["tk_ids"], axis=-1)  # [S,K,n,TOPK]
    l1 = mx.abs(pd_k - b["tk_p"]).sum(-1) + (1.0 - pd_k.sum(-1))
    # a draft id may repeat in tk_ids only when padded (p=0), harmless for L1
    av = b["aval"][:, :, None]  # padded anchors carry no loss
    wsum = w.sum() * mx.maximum(b["aval"].sum(), 1.0)
    l1 = l1 * av
    ce_m = (ce * w).sum() / wsum
    l1_m = (l1 * w).sum() / wsum
    loss = 0.1 * ce_m + 0.9 * l1_m
    metrics = {"ce": ce_m, "l1": l1_m}
    if c.confidence_head:
        conf = model.confidence_head(h, state if c.confidence_head_with_markov else None)
        tgt = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        eps = 1e-6
        bce = -(tgt * mx.log(conf + eps) + (1 - tgt) * mx.log(1 - conf + eps)) * av
        bce_m = (bce * w).sum() / wsum
        loss = loss + bce_m
        metrics["bce"] = bce_m
    return loss, metrics


# lineage -> loss(model, logits, h, state, batch, tc) -> (loss, metrics); logits, h and state
# are the predicting rows' draft logits, hidden states and Markov state (`blocks.block_logits`)
LOSSES = {"dflash": dflash_loss, "dflash2": dflash2_loss, "dspark": dspark_loss}


def loss_fn(model: DFlashModel, frozen: dict, b: dict, tc: TrainConfig):
    """The step's loss and metrics: the forward over every block of the step, the lineage's
    loss, and the accuracy of the drafter's greedy choice (every lineage reports it)."""
    logits, h, state = block_logits(model, frozen, b)
    loss, metrics = LOSSES[model.config.lineage](model, logits, h, state, b, tc)
    label = b["label"]
    valid = (label >= 0).astype(mx.float32)
    choice = draft_choice(model, mx.stop_gradient(logits), mx.stop_gradient(h), b["prev"])
    acc = ((choice == label).astype(mx.float32) * valid).sum() / mx.maximum(valid.sum(), 1)
    metrics["acc"] = acc
    return loss, metrics


def make_step(model: DFlashModel, opt: optim.Optimizer, frozen: dict, tc: TrainConfig):
    """-> (step(batch) -> (loss, metrics, grad norm), the state to evaluate after it): the
    loss's gradient, clipped to `tc.clip`, applied by `opt`; compiled with `tc.compile`."""
    lvg = nn.value_and_grad(model, lambda m, b: loss_fn(m, frozen, b, tc))
    state = [model.state, opt.state]

    def step_fn(b):
        (loss, metrics), grads = lvg(model, b)
        grads, norm = optim.clip_grad_norm(grads, tc.clip)
        opt.update(model, grads)
        return loss, metrics, norm

    if tc.compile:  # every step has one shape (Batcher pads anchors), so one compiled graph serves all
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)
    return step_fn, state
