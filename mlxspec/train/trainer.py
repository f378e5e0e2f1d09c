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
Data: a store on disk (`data.prepare_shards`, `regen`), or online (`online.OnlineCorpus`:
the target runs inside the loop on the next windows, no store; equal to a store of the same
windows read in order, `window_order="sequential"`).
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from mlxspec.drafters.config import DrafterConfig, Layout
from mlxspec.drafters.build import make_model
from mlxspec.drafters.model import DFlashModel
from mlxspec.errors import MlxspecError
from mlxspec.kernels.selector import teacher_scores
from mlxspec.targets.model import norm_scale
from mlxspec.train.blocks import block_logits, draft_choice
from mlxspec.train.data import load_shards, taps_from_store
from mlxspec.train.heldout import frozen_for, heldout_tau
from mlxspec.train.online import ONLINE_KIND


@dataclass
class TrainConfig:
    lineage: str = "dspark"  # dspark | dflash | dflash2
    selector_rank: int = 64  # dflash2: codebook rank
    selector_top_k: int = 8  # dflash2: candidates per row
    conv_group_size: int = 16  # dflash2: channels per dynamic conv coefficient
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
    anchors_per_seq: int = 0  # 0 = every valid anchor of a window (dense supervision)
    response_only: bool = True  # regenerated stores: anchors in the target's answer only
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
    compile: bool = False  # measured on CPU: no faster (4.4 vs 6.0 s per step, scripts/bench_train.py); for Metal
    init_from: str | None = None  # a drafter export to start from (same shape, or fewer layers: grown; its draft vocabulary is kept)
    train_new_only: bool = False  # with a grown init_from: only the new layers train (all the export had stays frozen)
    heldout: str | None = None  # a `train.heldout` store: held-out tau every `heldout_every` steps (budget curve)
    heldout_every: int = 0
    window_order: str = "random"  # random: windows drawn with replacement | sequential: in the store's order (online's)
    history_every: int = 25  # a history entry (loss, metrics, rates) every N steps
    taps: list = field(default_factory=list)


def parse_data_mix(data) -> list[tuple[str, float, int]]:
    """`--data DIR` or `DIR:W,DIR2:W2` (windows drawn from each store with probability
    proportional to W) -> [(dir, weight, first)]. `DIR@N` reads the store from its window N on
    (the first N were trained on before: a continuation on fresh windows only)."""
    if isinstance(data, (list, tuple)):
        return [(str(x[0]), float(x[1]), int(x[2]) if len(x) > 2 else 0) for x in data]
    out = []
    for part in str(data).split(","):
        d, sep, w = part.rpartition(":")
        if not sep or not d or not w.replace(".", "", 1).isdigit():
            d, w = part, "1"
        if float(w) <= 0:
            raise MlxspecError(f"--data {data!r}: a store's weight must be > 0, got {w!r} for {d!r}")
        first = 0
        if "@" in d and not Path(d).exists():  # (a directory whose own name holds '@' is a directory)
            d, _, n = d.rpartition("@")
            if not n.isdigit():
                raise MlxspecError(f"--data {data!r}: DIR@N takes the store's windows from N on; got {n!r} "
                                   f"after '@' (pass a window number, e.g. {d}@192)")
            first = int(n)
        out.append((d, float(w), first))
    return out


def draft_vocabulary(shards: dict, vocab_size: int, n: int, always=()) -> np.ndarray:
    """The n target ids most often predicted by the target (top-1) on the training data."""
    top1 = shards["topk_ids"]
    counts = np.bincount((top1 if top1.ndim == 2 else top1[..., 0]).ravel(), minlength=vocab_size)
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
        draft_vocab_size=(tc.draft_vocab or None) if tc.lineage != "dflash2" else None,
        conv_kernel_size=2 if tc.lineage == "dflash2" else 0,
        conv_group_size=tc.conv_group_size if tc.lineage == "dflash2" else 0,
        selector_rank=tc.selector_rank if tc.lineage == "dflash2" else 0,
        selector_top_k=tc.selector_top_k if tc.lineage == "dflash2" else 0,
        source_format="mlxspec-train",
        layout_reason="set explicitly by mlxspec train",
    )


class StoreWindows:
    """One store read in order: `take(cursor, n)` gives windows cursor .. cursor+n-1 modulo
    its length (the interface of `online.OnlineCorpus`)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays
        self.limit = len(arrays["tokens"])

    def __getitem__(self, k):
        return self.arrays[k]

    def take(self, cursor: int, n: int) -> dict[str, np.ndarray]:
        idx = np.asarray([(cursor + r) % self.limit for r in range(n)])
        return {k: np.asarray(v[idx]) for k, v in self.arrays.items()}


class Batcher:
    """Samples windows and anchors; builds the label tensors (numpy).

    `stores` is a list of (arrays, weight): each window of a step comes from store i with
    probability weight_i (`--data A:0.5,B:0.5`). With `window_order="sequential"` (one store)
    or an online source (anything with `take(cursor, n)`, `limit`), a step takes the next
    windows in order instead: `cursor` counts the windows taken, and `state()` / `restore()`
    carry it and the anchor sampler across a resume. Anchors of a window lie in its supervised
    range: [max(1, start), end - block] where a regenerated store (`train.regen`) gives
    `start` (the first response token) and `end` (one past its last valid token), and a
    corpus store the whole window. `anchors_per_seq` = 0 takes every valid anchor (dense
    supervision, as DeepSpec / SpecForge do); windows with fewer valid anchors than the
    step's K are padded with masked ones (`aval`), so every step has one shape."""

    def __init__(self, stores, tc: TrainConfig, t2d: np.ndarray, seed: int):
        self.source = None
        if hasattr(stores, "take"):
            self.source, stores = stores, []
        elif isinstance(stores, dict):
            stores = [(stores, 1.0)]
        if self.source is None and tc.window_order == "sequential":
            if len(stores) != 1:
                raise MlxspecError(f"window order sequential reads one store in order; got {len(stores)} stores "
                                   "(draw a mix at random, or train on one store)")
            self.source = StoreWindows(stores[0][0])
        self.stores = [s for s, _ in stores]
        w = np.asarray([float(x) for _, x in stores])
        self.p = w / w.sum() if len(w) else w
        self.tc, self.t2d = tc, t2d
        self.rng = np.random.default_rng(seed)
        self.cursor = 0
        self.L = (self.source if self.source is not None else self.stores[0])["tokens"].shape[1]
        self.B = tc.block_size
        self.K = tc.anchors_per_seq or max(1, self.L - self.B - 2)
        self.windows_read = 0
        self.seen: set = set()
        self.distinct_tokens = 0  # supervised positions of the distinct windows read so far

    def _range(self, s, i):
        L, B = self.L, self.B
        lo = max(1, int(s["start"][i])) if "start" in s and self.tc.response_only else 1
        end = int(s["end"][i]) if "end" in s else L
        return lo, max(lo, min(end - B + 1, L - B - 1))  # [lo, hi): rows' labels stay < end

    def state(self) -> dict:
        return {"cursor": self.cursor, "rng": self.rng.bit_generator.state}

    def restore(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self.rng.bit_generator.state = state["rng"]

    def _next_rows(self) -> list:
        """The step's windows in order (sequential / online): the next S after the cursor."""
        S = self.tc.seqs_per_step
        s = self.source.take(self.cursor, S)
        rows = []
        for r in range(S):
            lo, hi = self._range(s, r)
            rows.append((s, r, lo, hi))
            w = (self.cursor + r) % self.source.limit
            if w not in self.seen:
                self.seen.add(w)
                self.distinct_tokens += max(0, hi - lo)
        self.cursor += S
        return rows

    def __call__(self):
        tc, B, S = self.tc, self.B, self.tc.seqs_per_step
        layout = Layout(tc.sample_from_anchor, B)
        if self.source is not None:
            self.windows_read += S
            return self._build(self._next_rows(), layout)
        which = self.rng.choice(len(self.stores), S, p=self.p)
        rows = []
        for si in which:
            s = self.stores[si]
            for _ in range(8):  # a window with no valid anchor (an answer shorter than a block) is redrawn
                i = int(self.rng.integers(len(s["tokens"])))
                lo, hi = self._range(s, i)
                if hi > lo:
                    break
            rows.append((s, i, lo, hi))
            if (int(si), i) not in self.seen:
                self.seen.add((int(si), i))
                self.distinct_tokens += max(0, hi - lo)
        self.windows_read += S
        self.cursor += S
        return self._build(rows, layout)

    def _build(self, rows, layout):
        tc, L, B, K, S = self.tc, self.L, self.B, self.K, self.tc.seqs_per_step
        anchors = np.zeros((S, K), np.int64)
        aval = np.zeros((S, K), bool)
        for r, (_, _, lo, hi) in enumerate(rows):
            n = hi - lo
            if n <= 0:
                anchors[r] = 1
                continue
            pick = np.sort(self.rng.choice(np.arange(lo, hi), min(K, n), replace=False))
            anchors[r, : len(pick)] = pick
            anchors[r, len(pick):] = pick[-1]
            aval[r, : len(pick)] = True
        toks = np.stack([s["tokens"][i] for s, i, _, _ in rows])
        j = np.arange(B)
        pos = anchors[:, :, None] + j  # [S, K, B]
        block_tok = np.full((S, K, B), tc.mask_token_id, np.int32)
        block_tok[:, :, 0] = np.take_along_axis(toks, anchors, 1)
        # predicted positions q for predicting rows; label distribution comes from q-1
        q = anchors[:, :, None] + 1 + np.arange(layout.n_drafts)  # [S,K,n]: predicted positions
        src = q - 1
        win = np.arange(S)[:, None, None]
        topk_ids = np.stack([s["topk_ids"][i] for s, i, _, _ in rows])
        topk_p = np.stack([s["topk_probs"][i] for s, i, _, _ in rows])
        if tc.labels == "corpus":
            lab_t = toks[win, np.minimum(q, L - 1)]
        else:
            lab_t = topk_ids[win, src, 0]
        # Markov teacher forcing: the token before q (the anchor at q-1 == a, else the label there)
        n_pred = layout.n_drafts
        prev_t = np.where(src == anchors[:, :, None], toks[win, anchors[:, :, None].repeat(n_pred, 2)],
                          np.concatenate([lab_t[:, :, :1], lab_t[:, :, :-1]], axis=2))
        tk_ids = self.t2d[topk_ids[win, src]]  # [S,K,n,TOPK] draft ids (-1 = not in vocab)
        tk_p = topk_p[win, src].astype(np.float32)
        tk_p = np.where(tk_ids >= 0, tk_p, 0.0)
        label = np.where(aval[:, :, None], self.t2d[lab_t], -1)
        taps = np.stack([s["taps"][i] for s, i, _, _ in rows])
        return dict(
            taps=taps_from_store(taps),
            block_tok=mx.array(block_tok),
            pos=mx.array(pos.astype(np.int32)),
            anchors=mx.array(anchors.astype(np.int32)),
            label=mx.array(label.astype(np.int32)),
            prev=mx.array(prev_t.astype(np.int32)),
            tk_ids=mx.array(np.maximum(tk_ids, 0)),
            tk_p=mx.array(np.where(aval[:, :, None, None], tk_p, 0.0)),
            aval=mx.array(aval.astype(np.float32)),
        )


def loss_fn(model: DFlashModel, frozen: dict, b: dict, tc: TrainConfig):
    c = model.config
    B = tc.block_size
    logits, h, state = block_logits(model, frozen, b)
    n = h.shape[2]
    k = mx.arange(n, dtype=mx.float32)
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
    metrics = {}
    if c.lineage in ("dflash", "dflash2"):
        gamma = tc.gamma or (7.0 if B >= 16 else 4.0)
        w = mx.exp(-k / gamma)
        loss = (ce * w).sum() / mx.maximum((valid * w).sum(), 1e-6)
        metrics["ce"] = loss
        if c.lineage == "dflash2":
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
            loss = loss + sel_m
            metrics["selector_ce"] = sel_m
    else:
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
        metrics.update(ce=ce_m, l1=l1_m)
        if c.confidence_head:
            conf = model.confidence_head(h, state if c.confidence_head_with_markov else None)
            tgt = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
            eps = 1e-6
            bce = -(tgt * mx.log(conf + eps) + (1 - tgt) * mx.log(1 - conf + eps)) * av
            bce_m = (bce * w).sum() / wsum
            loss = loss + bce_m
            metrics["bce"] = bce_m
    choice = draft_choice(model, mx.stop_gradient(logits), mx.stop_gradient(h), b["prev"])
    acc = ((choice == label).astype(mx.float32) * valid).sum() / mx.maximum(valid.sum(), 1)
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
    stop_after: int | None = None,
) -> tuple[DFlashModel, DrafterConfig, dict]:
    """Train a drafter; checkpoints in out_dir/ckpt; returns (model, config, history).

    `shards_dir`: a store directory, a mix (`parse_data_mix`), or an online source
    (`online.OnlineCorpus`: the target runs in the loop, windows in order). A checkpoint in
    out_dir is resumed only when its settings match `tc` (`check_out_dir`) and, online, its
    data (the same plan of windows: it continues at the recorded cursor); a non-empty
    out_dir without one is refused unless `force`. `stop_after`: stop (and checkpoint)
    after that step, as if interrupted; a later call resumes."""

    out = Path(out_dir)
    online = hasattr(shards_dir, "take")
    if online:
        source = shards_dir
        if tc.taps and list(tc.taps) != list(source.taps):
            raise MlxspecError(f"online data: the source's taps {source.taps} differ from the run's {list(tc.taps)}")
        tc.taps, tc.window_order = list(source.taps), "sequential"  # online reads the windows in order
    check_out_dir(out, tc, resume, force)
    ck = out / "ckpt" / "state.json"
    ck_state = json.loads(ck.read_text()) if resume and ck.exists() else None
    ck_data = (ck_state or {}).get("data") or {}
    stores, n_windows, data_desc, vocab_sample = _open_data(shards_dir, tc, out, ck_state, ck_data)
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    cfg = make_drafter_config(tc, target.info, target.config)
    model, frozen, d_ids, t2d = _build_model(target, tc, cfg, out, ck_state, vocab_sample)

    def lr_at(step):
        if step < tc.warmup:
            return tc.lr * (step + 1) / tc.warmup
        p = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
        return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    opt = optim.AdamW(learning_rate=tc.lr, weight_decay=tc.weight_decay)
    start, history = 0, []
    if ck_state is not None:
        st = ck_state
        model.load_weights(str(out / "ckpt" / "model.safetensors"), strict=False)
        opt_state = mx.load(str(out / "ckpt" / "optimizer.safetensors"))
        from mlx.utils import tree_unflatten

        opt.state = tree_unflatten(list(opt_state.items()))
        start, history = st["step"], st["history"]
        log(f"resumed from step {start}")
    prior_blocks = float(history[-1].get("supervised_blocks", 0.0)) if history else 0.0
    prior_windows = start * tc.seqs_per_step
    prior_distinct = max([h.get("distinct_tokens", 0) for h in history] or [0])  # windows re-drawn after a resume count again
    prior_target = int(ck_data.get("target_tokens", 0))
    batcher = Batcher(stores, tc, t2d, tc.seed + start)
    if "cursor" in ck_data:  # continue the data where it stopped: the next unseen windows, the same anchor draws
        batcher.restore(ck_data)
    else:
        batcher.cursor = prior_windows
    end = tc.steps if stop_after is None else max(start, min(tc.steps, int(stop_after)))

    def data_state() -> dict:
        done = prior_target + (source.target_tokens if online else 0)
        return {"source": data_desc, **batcher.state(), "target_tokens": done}

    lvg = nn.value_and_grad(model, lambda m, b: loss_fn(m, frozen, b, tc))
    state = [model.state, opt.state]

    def step_fn(b):
        (loss, metrics), grads = lvg(model, b)
        grads, norm = optim.clip_grad_norm(grads, tc.clip)
        opt.update(model, grads)
        return loss, metrics, norm

    if tc.compile:  # every step has one shape (Batcher pads anchors), so one compiled graph serves all
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)
    blocks = 0.0
    bar = tqdm(range(start, end), initial=start, total=tc.steps, desc=f"train {tc.lineage}{' online' if online else ''}",
               unit="step")
    t0, ema = time.time(), None

    def heldout_point(step_done: int, el: float) -> None:
        ho = heldout_tau(model, frozen, tc.heldout)
        history.append({"step": step_done, "supervised_blocks": prior_blocks + blocks,
                        "distinct_tokens": prior_distinct + batcher.distinct_tokens, "elapsed_s": el,
                        "heldout": {c: {"tau": r["tau"], "tau_se": r["tau_se"], "per_prompt": r["per_prompt"],
                                        "row1": r["per_position_acceptance"][0],
                                        "acceptance": r["acceptance_rate"]} for c, r in ho.items()}})
        bar.write(f"step {step_done}: held-out tau " + ", ".join(f"{c} {r['tau']:.3f}" for c, r in ho.items()))

    if tc.heldout and tc.heldout_every and start == 0:
        heldout_point(0, 0.0)  # where the curve starts (random init, or --init-from's drafter)
    for step in bar:
        opt.learning_rate = lr_at(step)
        b = batcher()
        loss, metrics, norm = step_fn(b)
        mx.eval(state, loss, metrics)
        blocks += float(b["aval"].sum().item())
        lv = float(loss)
        if not math.isfinite(lv):
            bar.close()
            raise MlxspecError(f"training diverged at step {step} (loss {lv}); the last checkpoint in {out / 'ckpt'} "
                               "is from before it: lower --lr, or check the --data store")
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        el = time.time() - t0
        rate = blocks / max(el, 1e-9)
        passes = (prior_windows + batcher.windows_read) / n_windows
        extra = {}
        if online:  # the target's share: prefill tokens per second of target time
            extra["target_tok_s"] = source.target_tokens / max(source.target_seconds, 1e-9)
        bar.set_postfix(loss=f"{ema:.3f}", acc=f"{float(metrics['acc']):.2f}", blocks_s=f"{rate:.0f}",
                        passes=f"{passes:.2f}", **{k: f"{v:.0f}" for k, v in extra.items()})
        if step % tc.history_every == 0 or step == tc.steps - 1 or step == end - 1:
            history.append({"step": step, "loss": lv, **{k: float(v) for k, v in metrics.items()},
                            "lr": float(lr_at(step)), "elapsed_s": el, "blocks_per_s": rate,
                            "supervised_blocks": prior_blocks + blocks, "window_passes": passes,
                            "windows": batcher.cursor, **extra})
        measured = bool(tc.heldout and tc.heldout_every and ((step + 1) % tc.heldout_every == 0 or step == tc.steps - 1))
        if measured:
            heldout_point(step + 1, el)
        # a checkpoint at every held-out point too: a run stopped between points (a session's
        # end) resumes from the last point on the curve, not from the last checkpoint_every step
        if (step + 1) % tc.checkpoint_every == 0 or step == end - 1 or measured:
            _checkpoint(out, model, opt, step + 1, history, tc, cfg, data_state())
    bar.close()
    return model, cfg, {"history": history, "train_config": asdict(tc), "draft_ids": d_ids}


def _open_data(shards_dir, tc: TrainConfig, out: Path, ck_state, ck_data: dict):
    """The run's windows -> (stores: an online source or [(store, weight)], their count, the
    data description a checkpoint records, vocab_sample() for the draft vocabulary); refuses
    resuming a checkpoint on other data in one line. Fills tc.taps from the stores' meta."""
    online = hasattr(shards_dir, "take")
    if online:
        shards_dir.set_limit(tc.max_windows)
        want = json.loads(json.dumps(shards_dir.settings()))
        if ck_state is not None and ck_data.get("source") != want:
            had = ck_data.get("source") or {}
            diff = [k for k in want if had.get(k) != want[k]] if had.get("kind") == ONLINE_KIND else ["kind (a store)"]
            raise MlxspecError(f"--out {out} holds a checkpoint trained on other data ({', '.join(diff)}); pass the "
                               "same --tokens/--seq-len/--corpus/--seed to resume it, or a new --out")
        stores, n_windows, data_desc = shards_dir, shards_dir.limit, want
        vocab_sample = shards_dir.vocabulary_sample
    else:
        if (ck_data.get("source") or {}).get("kind") == ONLINE_KIND:
            raise MlxspecError(f"--out {out} holds a checkpoint of an online run; pass --online (and its data flags) "
                               "to resume it, or a new --out")
        mix = parse_data_mix(shards_dir)
        stores = [(load_shards(d, tc.max_windows, first=first), w) for d, w, first in mix]
        metas = [json.loads((Path(d) / "meta.json").read_text()) for d, *_ in mix if (Path(d) / "meta.json").exists()]
        if len({tuple(m["taps"]) for m in metas}) > 1 or len({s["tokens"].shape[1] for s, _ in stores}) > 1:
            raise MlxspecError(f"--data {shards_dir}: the stores were prepared with different taps or window lengths; "
                               "mix only stores of one target, taps and --seq-len")
        if not tc.taps:
            tc.taps = metas[0]["taps"] if metas else []
        n_windows = sum(len(s["tokens"]) for s, _ in stores)
        data_desc = {"kind": "store", "data": [d if not first else f"{d}@{first}" for d, _, first in mix]}

        def vocab_sample():
            return {k: np.concatenate([np.asarray(s[k][..., 0]) if k == "topk_ids" else np.asarray(s[k])
                                       for s, _ in stores]) for k in ("tokens", "topk_ids")}
    return stores, n_windows, data_desc, vocab_sample


def _build_model(target, tc: TrainConfig, cfg: DrafterConfig, out: Path, ck_state, vocab_sample):
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
        diff = [k for k in new if k not in ("steps", "checkpoint_every", "compile", "heldout", "heldout_every",
                                            "history_every") and (k != "taps" or new[k])
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


def _checkpoint(out: Path, model, opt, step, history, tc, cfg, data=None):
    ck = out / "ckpt"
    _atomic(ck / "model.safetensors", model.save_weights)
    _atomic(ck / "optimizer.safetensors", lambda p: mx.save_safetensors(p, dict(tree_flatten(opt.state))))
    state = json.dumps({"step": step, "history": history, "train_config": asdict(tc), "drafter_config": cfg.to_dict(),
                        "data": data})
    _atomic(ck / "state.json", lambda p: Path(p).write_text(state))
