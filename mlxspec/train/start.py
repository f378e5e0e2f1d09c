"""Where a run starts: the drafter's config from the run's settings (`make_drafter_config`),
its draft vocabulary (`draft_vocabulary`), and its weights at step 0 (`build_model`: the
lineage's initialisation, `--init-from` grown by `grow_layers`, `--warm-start` from the
target's last layers)."""

from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxspec.drafters.build import make_model
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import norm_scale
from mlxspec.train.config import TrainConfig
from mlxspec.train.heldout import frozen_for


def make_drafter_config(tc: TrainConfig, target_info, target_cfg: dict) -> DrafterConfig:
    h = target_info.hidden_size
    heads = int(target_cfg["num_attention_heads"])
    return DrafterConfig(
        hidden_size=h,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.layers,
        num_attention_heads=heads,
        num_key_value_heads=int(target_cfg.get("num_key_value_heads") or heads),
        head_dim=int(target_cfg.get("head_dim") or h // heads),
        block_size=tc.block_size,
        target_layer_ids=list(tc.taps),
        mask_token_id=tc.mask_token_id,
        vocab_size=target_info.vocab_size,
        sample_from_anchor=tc.sample_from_anchor,
        rms_norm_eps=float(target_cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(target_cfg.get("rope_theta", 10000.0)),
        markov_rank=tc.markov_rank if tc.lineage == "dspark" else 0,
        confidence_head=tc.confidence_head and tc.lineage == "dspark",
        draft_vocab_size=(tc.draft_vocab or None) if tc.lineage != "dflash2" else None,
        conv_kernel_size=2 if tc.lineage == "dflash2" else 0,
        conv_group_size=tc.conv_group_size if tc.lineage == "dflash2" else 0,
        selector_rank=tc.selector_rank if tc.lineage == "dflash2" else 0,
        selector_top_k=tc.selector_top_k if tc.lineage == "dflash2" else 0,
        source_format="mlxspec-train",
        layout_reason="set explicitly by mlxspec train",
    )


def draft_vocabulary(shards: dict, vocab_size: int, n: int, always=()) -> np.ndarray:
    """The n target ids most often predicted by the target (top-1) on the training data."""
    top1 = shards["topk_ids"]
    counts = np.bincount((top1 if top1.ndim == 2 else top1[..., 0]).ravel(), minlength=vocab_size)
    counts += np.bincount(shards["tokens"].ravel(), minlength=vocab_size)
    for t in always:
        counts[t] = counts.max() + 1
    ids = np.argsort(-counts, kind="stable")[:n]
    return np.sort(ids).astype(np.int32)


def build_model(target, tc: TrainConfig, cfg: DrafterConfig, out: Path, ck_state, vocab_sample):
    """The drafter at step 0 -> (model, frozen target tensors, draft ids, target-to-draft
    map): initialised per lineage, started from --init-from (grown when it is shallower),
    its draft vocabulary fixed (the export's, the checkpoint's, or drawn from the data)."""
    V = target.info.vocab_size
    init = None
    if tc.init_from:
        from mlxspec.drafters.load import load_drafter

        init, icfg = load_drafter(tc.init_from, target.info, log=io.StringIO())
        # (the block size is no parameter: a block-8 drafter can start a block-4 one)
        # (a shallower export grows: `grow_layers`; a deeper one would drop trained layers)
        mismatch = [k for k in ("lineage", "intermediate_size", "markov_rank",
                                "target_layer_ids", "sample_from_anchor", "draft_vocab_size")
                    if getattr(icfg, k) != getattr(cfg, k)]
        if icfg.num_hidden_layers > cfg.num_hidden_layers:
            mismatch.append("num_hidden_layers")
        if mismatch:
            raise MlxspecError(f"--init-from {tc.init_from}: its {', '.join(f'{k} {getattr(icfg, k)!r}' for k in mismatch)} "
                               f"differ from this run's ({', '.join(f'{getattr(cfg, k)!r}' for k in mismatch)}); "
                               "pass matching flags (--layers may exceed the export's: the drafter grows)")
    inherited = icfg.num_hidden_layers if init is not None else 0
    if tc.train_new_only and not (init is not None and inherited < cfg.num_hidden_layers):
        raise MlxspecError("--train-new-only trains the layers a drafter grows by: pass --init-from an export with "
                           f"fewer layers than --layers {cfg.num_hidden_layers}")
    if init is not None and cfg.draft_vocab_size:
        d_ids = (np.asarray(init.d2t) + np.arange(cfg.draft_vocab_size)).astype(np.int32)
    elif cfg.draft_vocab_size and ck_state is not None:  # the checkpoint's own (its store may have grown since)
        d2t = mx.load(str(out / "ckpt" / "model.safetensors"))["d2t"]
        d_ids = (np.asarray(d2t) + np.arange(cfg.draft_vocab_size)).astype(np.int32)
    elif cfg.draft_vocab_size:
        d_ids = draft_vocabulary(vocab_sample(), V, tc.draft_vocab)
    else:
        d_ids = np.arange(V, dtype=np.int32)
    t2d = np.full(V, -1, np.int32)
    t2d[d_ids] = np.arange(len(d_ids), dtype=np.int32)
    mx.random.seed(tc.seed)
    model = make_model(cfg)
    if cfg.lineage == "dflash2":
        # convs start as the identity (tap 0 = 1, dynamic part ~0), the selector as the logits alone
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = np.zeros(conv.base_kernel.shape, np.float32)
                base[:, 0] = 1.0
                conv.base_kernel = mx.array(base)
                conv.kernel_projection.weight = conv.kernel_projection.weight * 0.01
        cs = model.candidate_selector
        cs.predecessor_codebook = mx.random.normal(cs.predecessor_codebook.shape) * 0.02
        cs.successor_codebook = mx.random.normal(cs.successor_codebook.shape) * 0.02
    # small init for the heads that start the drafter off as "no correction"
    if cfg.markov_rank:
        model.markov_head.markov_w1.weight = mx.random.normal(model.markov_head.markov_w1.weight.shape) * 0.02
        model.markov_head.markov_w2.weight = mx.zeros(model.markov_head.markov_w2.weight.shape)
    # Start the final norm at the target's own: logits through the borrowed head are then
    # at the target's scale from step 0. (A smaller start, e.g. 0.1x, looks gentler, CE
    # ~ln V instead of ~70 nats at step 0, but Adam grows a norm weight by ~lr per step:
    # measured, 0.1x had only reached 0.18x after 500 steps, capping every logit.)
    # (norm_scale: Gemma's norms multiply by 1 + weight, the drafter's by weight)
    model.norm.weight = norm_scale(target.model.model.norm, cfg.hidden_size)
    if tc.warm_start:
        warm_start_from_target(model, target, tc.taps)
    if cfg.draft_vocab_size:
        model.d2t = mx.array(d_ids - np.arange(len(d_ids), dtype=np.int32))
    if init is not None:
        mine = dict(tree_flatten(model.parameters()))
        model.load_weights([(k, v.astype(mx.float32)) for k, v in tree_flatten(init.parameters())
                            if k in mine and k not in ("lm_head.weight",)], strict=False)
        grow_layers(model, inherited)
    frozen = frozen_for(target, model)  # the target's embeddings and head rows at the draft ids (d2t)
    model.freeze(keys=["d2t"], strict=False)
    if tc.train_new_only:  # everything the export had stays as exported: only the new layers learn
        model.freeze()
        for layer in model.layers[inherited:]:
            layer.unfreeze()
    return model, frozen, d_ids, t2d


def grow_layers(model: DFlashModel, inherited: int) -> None:
    """A drafter deeper than the export it starts from: each new layer starts as a copy of
    the export's last layer with its output projections (attention o_proj, MLP down_proj) at
    zero, so it adds nothing to the residual stream and the grown drafter drafts exactly as
    the export did at step 0; training then opens the new layers from a useful start (their
    q/k/v already read the context) rather than from noise."""
    if not 0 < inherited < len(model.layers):
        return
    last = dict(tree_flatten(model.layers[inherited - 1].parameters()))
    for layer in model.layers[inherited:]:
        layer.load_weights([(k, mx.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v)
                            for k, v in last.items()])


def warm_start_from_target(model: DFlashModel, target, taps: list) -> None:
    """Start the drafter as the target's top: drafter layer i = target layer L - n + i
    (the layers that feed the final norm and head), q/k norms at 1 (the target has none),
    fc passing the deepest tap through and hidden_norm = the first copied layer's input
    norm, so the context K/V start as that layer's own K/V over the target's hidden states.
    Only for drafters whose layer shapes equal the target's (checked)."""
    inner = target.model.model
    n = len(model.layers)
    src_layers = inner.layers[len(inner.layers) - n:]
    for dl, tl in zip(model.layers, src_layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = getattr(tl.self_attn, name).weight
            if getattr(dl.self_attn, name).weight.shape != w.shape:
                raise ValueError(f"warm start: drafter {name} {getattr(dl.self_attn, name).weight.shape} "
                                 f"differs from the target's {w.shape}")
            getattr(dl.self_attn, name).weight = w.astype(mx.float32)
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(tl.mlp, name).weight
            if getattr(dl.mlp, name).weight.shape != w.shape:
                raise ValueError(f"warm start: drafter mlp.{name} {getattr(dl.mlp, name).weight.shape} "
                                 f"differs from the target's {w.shape}")
            getattr(dl.mlp, name).weight = w.astype(mx.float32)
        H = dl.input_layernorm.weight.shape[0]
        dl.input_layernorm.weight = norm_scale(tl.input_layernorm, H)
        dl.post_attention_layernorm.weight = norm_scale(tl.post_attention_layernorm, H)
        dl.self_attn.q_norm.weight = mx.ones_like(dl.self_attn.q_norm.weight)
        dl.self_attn.k_norm.weight = mx.ones_like(dl.self_attn.k_norm.weight)
    H = model.fc.weight.shape[0]
    deepest = int(np.argmax(taps))
    fc = np.zeros(model.fc.weight.shape, np.float32)
    fc[:, deepest * H:(deepest + 1) * H] = np.eye(H, dtype=np.float32)
    model.fc.weight = mx.array(fc)
    model.hidden_norm.weight = src_layers[0].input_layernorm.weight.astype(mx.float32)
