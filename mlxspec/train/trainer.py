"""Train DFlash / DSpark drafters for a frozen target, in MLX.

The whole method on one screen (nanoGPT's shape): cached target taps + labels come from
`data.prepare_shards`; each step samples windows and random anchors, runs every block
of every window in ONE drafter forward (one attention mask: a block sees the context
strictly before its anchor and its own rows, never other blocks), and applies the
lineage's loss. Embeddings and LM head are borrowed from the target and frozen.

Losses (k = 1-based draft index inside the block):
- DFlash: CE on the predicting rows, weight exp(-(k-1)/gamma).
- DSpark: 0.1*CE + 0.9*L1(p_draft, p_target) + BCE(confidence, 1 - 0.5*L1), weights
  exp(-(k-1)/4); Markov head teacher-forced on the label sequence.
Labels: "target" = the target's own argmax / distribution at each position (what greedy
verification accepts), or "corpus" = the raw next token (CE only).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import norm_scale, target_head_rows
from mlxspec.train.data import load_shards, taps_from_store


@dataclass
class TrainConfig:
    lineage: str = "dspark"  # dspark | dflash
    block_size: int = 8
    sample_from_anchor: bool = True
    layers: int = 1
    intermediate_size: int = 1536
    markov_rank: int = 32
    confidence_head: bool = True
    draft_vocab: int = 8192  # 0 = full target vocabulary
    mask_token_id: int = 16
    labels: str = "target"  # target | corpus
    steps: int = 2000
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 0.0  # DFlash CE decay; 0 -> 7 for block >= 16 else 4
    loss: str = "ce"  # ce: cross-entropy on the target's argmax | kl: soft cross-entropy on its top-k
    warm_start: bool = False  # drafter layers from the target's last layers, fc passing the deepest tap
    max_windows: int | None = None  # train on the first N windows of the data only (budget studies)
    seed: int = 0
    checkpoint_every: int = 250
    taps: list = field(default_factory=list)


def draft_vocabulary(shards: dict, vocab_size: int, n: int, always=()) -> np.ndarray:
    """The n target ids most often predicted by the target (top-1) on the training data."""
    counts = np.bincount(shards["topk_ids"][..., 0].ravel(), minlength=vocab_size)
    counts += np.bincount(shards["tokens"].ravel(), minlength=vocab_size)
    for t in always:
        counts[t] = counts.max() + 1
    ids = np.argsort(-counts, kind="stable")[:n]
    return np.sort(ids).astype(np.int32)


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
        draft_vocab_size=tc.draft_vocab or None,
        source_format="mlxspec-train",
        layout_reason="set explicitly by mlxspec train",
    )


class Batcher:
    """Samples windows and anchors; builds the block mask and label tensors (numpy)."""

    def __init__(self, shards: dict, tc: TrainConfig, t2d: np.ndarray, seed: int):
        self.s, self.tc, self.t2d = shards, tc, t2d
        self.rng = np.random.default_rng(seed)
        self.n, self.L = shards["tokens"].shape

    def __call__(self):
        tc, s, L = self.tc, self.s, self.L
        B, K, S = tc.block_size, tc.anchors_per_seq, tc.seqs_per_step
        first = 0 if tc.sample_from_anchor else 1
        n_pred = B - first
        idx = self.rng.choice(self.n, S, replace=False)
        # anchors a in [start, L - B - 1]: the block's predictions stay inside the window;
        # `start` > 1 keeps anchors in the target-generated part of generated shards
        starts = s["start"][idx] if "start" in s else np.ones(len(idx), np.int64)
        anchors = np.stack([np.sort(self.rng.choice(np.arange(max(1, st), L - B - 1), K, replace=False))
                            for st in starts])
        j = np.arange(B)
        pos = anchors[:, :, None] + j  # [S, K, B]
        toks = s["tokens"][idx]
        block_tok = np.full((S, K, B), tc.mask_token_id, np.int32)
        block_tok[:, :, 0] = np.take_along_axis(toks, anchors, 1)
        # mask [S, 1, K*B, L + K*B]
        ctx_ok = np.arange(L)[None, None, None, :] < anchors[:, :, None, None]  # [S,K,1,L]
        ctx_ok = np.broadcast_to(ctx_ok, (S, K, B, L)).reshape(S, K * B, L)
        blk = np.arange(K).repeat(B)
        blk_ok = np.broadcast_to(blk[:, None] == blk[None, :], (S, K * B, K * B))
        mask = np.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]
        # predicted positions q for predicting rows; label distribution comes from q-1
        rows = j[first:]
        q = anchors[:, :, None] + rows + (1 if tc.sample_from_anchor else 0)  # [S,K,n]
        src = q - 1
        win = np.arange(S)[:, None, None]
        if tc.labels == "corpus":
            lab_t = toks[win, q]
        else:
            lab_t = s["topk_ids"][idx][win, src, 0]
        # Markov teacher forcing: the token before q (the anchor at q-1 == a, else the label there)
        prev_t = np.where(src == anchors[:, :, None], toks[win, anchors[:, :, None].repeat(n_pred, 2)],
                          np.concatenate([lab_t[:, :, :1], lab_t[:, :, :-1]], axis=2))
        tk_ids = self.t2d[s["topk_ids"][idx][win, src]]  # [S,K,n,TOPK] draft ids (-1 = not in vocab)
        tk_p = s["topk_probs"][idx][win, src].astype(np.float32)
        tk_p = np.where(tk_ids >= 0, tk_p, 0.0)
        taps = s["taps"][idx]
        return dict(
            taps=taps_from_store(taps),
            block_tok=mx.array(block_tok.reshape(S, K * B)),
            pos=mx.array(pos.reshape(S, K * B)),
            mask=mx.array(mask),
            rows=mx.array(np.asarray(rows)),
            label=mx.array(self.t2d[lab_t]),
            prev=mx.array(prev_t.astype(np.int32)),
            tk_ids=mx.array(np.maximum(tk_ids, 0)),
            tk_p=mx.array(tk_p),
        )


def loss_fn(model: DFlashModel, frozen: dict, b: dict, tc: TrainConfig):
    c = model.config
    S, L, _ = b["taps"].shape
    B, K = tc.block_size, tc.anchors_per_seq
    ctx = model.context(b["taps"].astype(mx.float32))
    layer_kv = model.layer_context_kv(ctx, mx.broadcast_to(mx.arange(L)[None], (S, L)))
    emb = frozen["embed"][b["block_tok"]]
    if c.log_snr:
        emb = model.block_embeddings(emb.reshape(S * K, B, -1)).reshape(S, K * B, -1)
    h = model.hidden(emb, b["pos"], layer_kv, b["mask"])  # [S, K*B, H]
    h = h.reshape(S, K, B, -1)[:, :, b["rows"]]  # [S, K, n, H]
    logits = h @ frozen["head"].T  # [S, K, n, Vd]
    n = h.shape[2]
    k = mx.arange(n, dtype=mx.float32)
    label = b["label"]
    valid = (label >= 0).astype(mx.float32)
    state = None
    if c.markov_rank:
        state = model.markov_head.state(b["prev"])
        logits = logits + model.markov_head.block_bias(b["prev"], h)
    logits = logits.astype(mx.float32)
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
    metrics = {}
    if c.lineage == "dflash":
        gamma = tc.gamma or (7.0 if B >= 16 else 4.0)
        w = mx.exp(-k / gamma)
        loss = (ce * w).sum() / (valid * w).sum()
        metrics["ce"] = loss
    else:
        w = mx.exp(-k / 4.0)
        p_d = mx.softmax(logits, axis=-1)
        pd_k = mx.take_along_axis(p_d, b["tk_ids"], axis=-1)  # [S,K,n,TOPK]
        l1 = mx.abs(pd_k - b["tk_p"]).sum(-1) + (1.0 - pd_k.sum(-1))
        # a draft id may repeat in tk_ids only when padded (p=0), harmless for L1
        wsum = w.sum() * S * K
        ce_m = (ce * w).sum() / wsum
        l1_m = (l1 * w).sum() / wsum
        loss = 0.1 * ce_m + 0.9 * l1_m
        metrics.update(ce=ce_m, l1=l1_m)
        if c.confidence_head:
            conf = model.confidence_head(h, state if c.confidence_head_with_markov else None)
            tgt = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
            eps = 1e-6
            bce = -(tgt * mx.log(conf + eps) + (1 - tgt) * mx.log(1 - conf + eps))
            bce_m = (bce * w).sum() / wsum
            loss = loss + bce_m
            metrics["bce"] = bce_m
    acc = ((mx.argmax(logits, -1) == label).astype(mx.float32) * valid).sum() / mx.maximum(valid.sum(), 1)
    metrics["acc"] = acc
    return loss, metrics


def train(
    target,
    shards_dir: str,
    out_dir: str,
    tc: TrainConfig,
    resume: bool = True,
    log=print,
    force: bool = False,
) -> tuple[DFlashModel, DrafterConfig, dict]:
    """Train a drafter; checkpoints in out_dir/ckpt; returns (model, config, history).

    A checkpoint in out_dir is resumed only when its settings match `tc` (`check_out_dir`);
    a non-empty out_dir without one is refused unless `force`."""

    out = Path(out_dir)
    check_out_dir(out, tc, resume, force)
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    shards = load_shards(shards_dir, tc.max_windows)
    meta_path = Path(shards_dir) / "meta.json"
    if not tc.taps:
        tc.taps = json.loads(meta_path.read_text())["taps"] if meta_path.exists() else []
    V = target.info.vocab_size
    cfg = make_drafter_config(tc, target.info, target.config)
    if tc.draft_vocab:
        d_ids = draft_vocabulary(shards, V, tc.draft_vocab)
    else:
        d_ids = np.arange(V, dtype=np.int32)
    t2d = np.full(V, -1, np.int32)
    t2d[d_ids] = np.arange(len(d_ids), dtype=np.int32)
    mx.random.seed(tc.seed)
    model = DFlashModel(cfg)
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
    embed = target.embed(mx.arange(V)).astype(mx.float32)
    frozen = {"embed": embed, "head": _target_head(target)[mx.array(d_ids)]}
    mx.eval(frozen)
    model.freeze(keys=["d2t"], strict=False)

    def lr_at(step):
        if step < tc.warmup:
            return tc.lr * (step + 1) / tc.warmup
        p = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
        return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    opt = optim.AdamW(learning_rate=tc.lr, weight_decay=tc.weight_decay)
    start, history = 0, []
    ck = out / "ckpt" / "state.json"
    if resume and ck.exists():
        st = json.loads(ck.read_text())
        model.load_weights(str(out / "ckpt" / "model.safetensors"), strict=False)
        opt_state = mx.load(str(out / "ckpt" / "optimizer.safetensors"))
        from mlx.utils import tree_unflatten

        opt.state = tree_unflatten(list(opt_state.items()))
        start, history = st["step"], st["history"]
        log(f"resumed from step {start}")
    batcher = Batcher(shards, tc, t2d, tc.seed + start)
    lvg = nn.value_and_grad(model, lambda m, b: loss_fn(m, frozen, b, tc))

    def step_fn(b):
        (loss, metrics), grads = lvg(model, b)
        grads, norm = optim.clip_grad_norm(grads, tc.clip)
        opt.update(model, grads)
        return loss, metrics, norm

    rows_per_step = tc.seqs_per_step * tc.anchors_per_seq * tc.block_size
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, desc=f"train {tc.lineage}", unit="step")
    t0, ema = time.time(), None
    for step in bar:
        opt.learning_rate = lr_at(step)
        b = batcher()
        loss, metrics, norm = step_fn(b)
        mx.eval(model.parameters(), opt.state, loss, metrics)
        lv = float(loss)
        if not math.isfinite(lv):
            bar.close()
            raise MlxspecError(f"training diverged at step {step} (loss {lv}); the last checkpoint in {out / 'ckpt'} "
                               "is from before it: lower --lr, or check the --data store")
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        el = time.time() - t0
        rate = (step + 1 - start) * rows_per_step / max(el, 1e-9)
        bar.set_postfix(loss=f"{ema:.3f}", acc=f"{float(metrics['acc']):.2f}", rows_s=f"{rate:.0f}")
        if step % 25 == 0 or step == tc.steps - 1:
            history.append({"step": step, "loss": lv, **{k: float(v) for k, v in metrics.items()},
                            "lr": float(lr_at(step)), "elapsed_s": el})
        if (step + 1) % tc.checkpoint_every == 0 or step == tc.steps - 1:
            _checkpoint(out, model, opt, step + 1, history, tc, cfg)
    bar.close()
    return model, cfg, {"history": history, "train_config": asdict(tc), "draft_ids": d_ids}


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


def _target_head(target) -> mx.array:
    """The target's LM head, dense float32 (dequantized when the target is quantized)."""
    return target_head_rows(target, None)


def check_out_dir(out: Path, tc: TrainConfig, resume: bool, force: bool) -> None:
    """--out safety: resume only a checkpoint trained with the same settings (all but the
    step budget); refuse a non-empty directory holding none unless `force`."""
    state = out / "ckpt" / "state.json"
    if resume and state.exists():
        try:
            old = json.loads(state.read_text())["train_config"]
            assert isinstance(old, dict)
        except (ValueError, KeyError, TypeError, AssertionError, OSError):
            raise MlxspecError(f"{state}: the checkpoint state is unreadable; pass --no-resume --force to start over, "
                               "or a new --out") from None
        new = asdict(tc)
        diff = [k for k in new if k not in ("steps", "checkpoint_every") and (k != "taps" or new[k])
                and json.loads(json.dumps(new[k])) != old.get(k, new[k])]
        if diff:
            shown = ", ".join(f"{k} {old.get(k)!r} there, {new[k]!r} here" for k in diff[:4])
            raise MlxspecError(f"--out {out} holds a checkpoint of a different run ({shown}); pass the same settings "
                               "to resume it, --no-resume --force to start over, or a new --out")
        return
    if out.is_dir() and any(out.iterdir()) and not force:
        raise MlxspecError(f"--out {out}: the directory is not empty{' and holds no checkpoint to resume' if resume else ''}; "
                           "pass a new directory, or --force to overwrite it")


def _atomic(path: Path, write) -> None:
    """write(tmp_path) then rename over `path`: a crash never leaves a half-written file."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # savers go by the extension
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _checkpoint(out: Path, model, opt, step, history, tc, cfg):
    ck = out / "ckpt"
    _atomic(ck / "model.safetensors", model.save_weights)
    _atomic(ck / "optimizer.safetensors", lambda p: mx.save_safetensors(p, dict(tree_flatten(opt.state))))
    state = json.dumps({"step": step, "history": history, "train_config": asdict(tc), "drafter_config": cfg.to_dict()})
    _atomic(ck / "state.json", lambda p: Path(p).write_text(state))
