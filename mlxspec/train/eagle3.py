"""EAGLE-3 training: every position supervised in one pass, plus training-time test (TTT).

Step 0 runs the drafter over every pair (taps at i, token x_{i+1}) of a window at once, causal,
exactly as drafting fills its cache. Step k >= 1 (TTT) re-runs the layer at every position on
its own step k-1 output with the next true token x_{i+k+1}, at RoPE position i+k; its queries
see the step-0 keys of pairs 0..i and the keys of steps 1..k at position i only. That is what
a chain step at anchor i+1 sees in `engine.eagle3.Eagle3Drafter` (the committed pairs and the
chain's own earlier rows), so the per-step argmax of one TTT pass is the greedy chain a drafter
proposes at every anchor whose earlier drafts were right: the held-out evaluation
(`heldout_lengths`) replays decoding from it.

Labels: step k at position i predicts x_{i+k+2}, the target's next token after position i+k+1:
its stored top-k distribution (soft cross-entropy over the draft vocabulary, `loss="kl"`) or
its argmax (`loss="ce"`), weighted 0.8^k (EAGLE-3). The embedding (the target's) stays frozen;
fc, the layer and the final norm learn, and the head (started as the target's rows at the draft ids)
with `train_head`, as EAGLE-3 and SpecForge train theirs; frozen otherwise.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from mlxspec.drafters.eagle3 import Eagle3Config, Eagle3Model
from mlxspec.errors import MlxspecError
from mlxspec.targets.model import norm_scale, target_head_rows
from mlxspec.train.online import VOCAB_WINDOWS  # an in-order source's first windows choose the draft vocabulary
from mlxspec.validate import check_float_arg


@dataclass
class Eagle3TrainConfig:
    taps: list
    draft_vocab: int = 8192
    ttt_steps: int = 7
    step_decay: float = 0.8
    loss: str = "kl"  # kl: soft CE on the target's top-k; ce: its argmax
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    minutes: float = 60.0  # training budget in CPU minutes (cosine decay over it)
    seqs_per_step: int = 4
    ttt_fraction: float = 0.25  # positions the unrolled steps (>= 1) run at, drawn afresh each step
    seq_len: int = 256
    init: str = "target"  # target: the layer from the target's last layer; random
    init_from: str | None = None  # an EAGLE-3 export to continue from (its weights and draft vocabulary)
    seed: int = 0
    heldout_minutes: float = 5.0
    save_minutes: float = 3.0
    chat_weight: float = 1.0  # windows of regenerated chat answers (source "chat-*") are drawn this much more often
    train_head: bool = False  # the head learns too (started from the target's rows at the draft ids)
    layers: int = 1  # chain layers: the EAGLE-3 layer, then plain Llama layers (docs/training.md)
    train_new_only: bool = False  # with init_from a shallower export: only the layers it lacks learn


def _load_start(target, tc: Eagle3TrainConfig):
    """The EAGLE-3 export `tc.init_from`, read against the target: same taps and shape, or one line."""
    from mlxspec.drafters.load import load_drafter

    model, cfg = load_drafter(tc.init_from, target.info, log=io.StringIO())
    if not isinstance(cfg, Eagle3Config):
        raise MlxspecError(f"--init-from {tc.init_from}: is a {cfg.lineage} drafter; --lineage eagle3 continues an "
                           "EAGLE-3 export")
    if list(cfg.target_layer_ids) != list(tc.taps):
        raise MlxspecError(f"--init-from {tc.init_from}: taps layer outputs {list(cfg.target_layer_ids)}, not {list(tc.taps)}; "
                           f"pass --taps {','.join(map(str, cfg.target_layer_ids))}")
    if cfg.num_hidden_layers > tc.layers:
        raise MlxspecError(f"--init-from {tc.init_from}: has {cfg.num_hidden_layers} chain layers, more than --layers "
                           f"{tc.layers}; pass --layers {cfg.num_hidden_layers} (or more: the drafter grows)")
    if tc.train_new_only and cfg.num_hidden_layers == tc.layers:
        raise MlxspecError(f"--train-new-only: --init-from {tc.init_from} already has {tc.layers} chain layer(s), "
                           f"so no layer is new; pass --layers {tc.layers + 1} to grow it, or drop --train-new-only")
    return model, cfg


# ----------------------------------------------------------------------------- the forward

def ttt_hidden(model: Eagle3Model, emb_table: mx.array, taps: mx.array, tokens: mx.array, steps: int,
               sel: mx.array | None = None) -> list:
    """taps [B, L, T*TH] and tokens [B, L] of B windows -> the last layer's pre-norm outputs of
    steps 0..steps-1: step 0 at every pair position [B, L-1, H], steps >= 1 at the positions
    `sel` ([m] ints; all when None) [B, m, H] (module docstring).

    A chain step at position i depends only on the step-0 keys of pairs <= i and on its own
    earlier steps at i (in every layer), so the unrolled steps can run on a subset of positions:
    step 0 (all positions, the keys every step needs) is what costs, the rest scales with len(sel)."""
    B, L = tokens.shape
    n = L - 1
    pos = mx.arange(n)
    h_in = model.fuse(taps[:, :n])
    tok_pad = mx.concatenate([tokens, mx.zeros((B, steps), tokens.dtype)], axis=1)
    outs = []
    kv0 = [None] * len(model.layers)  # per layer: step 0's keys and values at every position
    extra = [([], []) for _ in model.layers]  # per layer: steps 1..k's keys and values at the query positions
    for k in range(steps):
        qpos = pos if (k == 0 or sel is None) else sel
        emb = emb_table[tok_pad[:, qpos + k + 1]].astype(h_in.dtype)
        for j, layer in enumerate(model.layers):
            x, res = layer.attn_input(emb, h_in) if j == 0 else layer.attn_input(h)
            attn = layer.self_attn
            rep = attn.n_heads // attn.n_kv
            q, kk, vv = attn.qkv(x, qpos + k)
            kk, vv = mx.repeat(kk, rep, axis=1), mx.repeat(vv, rep, axis=1)
            if k == 0:
                kv0[j] = (kk, vv)
            else:
                extra[j][0].append(kk)
                extra[j][1].append(vv)
            o = _attend(q * attn.scale, *kv0[j], *extra[j], qpos, pos)
            h = layer.finish(res, attn.out(o))
        outs.append(h)
        h_in = model.feedback(h)
        if k == 0 and sel is not None:
            h_in = h_in[:, sel]
    return outs


def _attend(q: mx.array, K0: mx.array, V0: mx.array, extra_k: list, extra_v: list, qpos: mx.array,
            pos: mx.array) -> mx.array:
    """Scaled queries [B, h, m, d] at qpos over step 0's keys at pos (causal) and, at their own
    position, the keys of the earlier unrolled steps -> attention outputs [B, h, m, d]."""
    n = K0.shape[2]
    s0 = mx.where(qpos[:, None] >= pos[None], q @ K0.transpose(0, 1, 3, 2), -1e30)
    if not extra_k:
        return mx.softmax(s0, axis=-1, precise=True) @ V0
    sd = mx.stack([(q * kj).sum(-1) for kj in extra_k], axis=-1)  # [B, h, m, k]
    p = mx.softmax(mx.concatenate([s0, sd], axis=-1), axis=-1, precise=True)
    o = p[..., :n] @ V0
    for i, vj in enumerate(extra_v):
        o = o + p[..., n + i : n + i + 1] * vj
    return o


def loss_fn(model: Eagle3Model, frozen: dict, b: dict, tc: Eagle3TrainConfig):
    """Weighted per-step loss over every valid position; metrics: per-step accuracy (argmax of
    the draft logits = the target's argmax, counted where the argmax is in the draft vocabulary)."""
    outs = ttt_hidden(model, frozen["embed"], b["taps"], b["tokens"], tc.ttt_steps, b.get("sel"))
    B, L = b["tokens"].shape
    n = L - 1
    total, wsum, accs = mx.array(0.0), 0.0, []
    for k, h in enumerate(outs):
        i = (mx.arange(n) if k == 0 or b.get("sel") is None else b["sel"])[None]
        z = model.norm(h) @ (model.lm_head.weight if tc.train_head else frozen["head"]).T  # [B, n, Vd]
        lab = i + k + 1  # the target position whose next-token distribution is the label
        valid = (lab < b["end"][:, None]) & (lab >= b["lo"][:, None])
        labc = mx.minimum(lab, L - 1)
        rows = mx.arange(B)[:, None]
        ids = b["topk_ids"][rows, labc]  # [B, n, K]
        d = frozen["t2d"][ids]  # draft ids, -1 outside the draft vocabulary
        logp = z - mx.logsumexp(z, axis=-1, keepdims=True)
        if tc.loss == "kl":
            p = b["topk_probs"][rows, labc] * (d >= 0)
            p = p / mx.maximum(p.sum(-1, keepdims=True), 1e-6)
            ce = -(p * mx.take_along_axis(logp, mx.maximum(d, 0), axis=-1)).sum(-1)
            ok = valid & (p.sum(-1) > 0)
        else:
            d0 = d[..., 0]
            ce = -mx.take_along_axis(logp, mx.maximum(d0, 0)[..., None], axis=-1)[..., 0]
            ok = valid & (d0 >= 0)
        okf = ok.astype(mx.float32)
        w = tc.step_decay ** k
        total = total + w * (ce * okf).sum() / mx.maximum(okf.sum(), 1.0)
        wsum += w
        hit = (mx.argmax(z, axis=-1) == d[..., 0]) & ok
        accs.append(hit.sum() / mx.maximum(okf.sum(), 1.0))
    return total / wsum, mx.stack(accs)


# ----------------------------------------------------------------------------- held-out

def heldout_lengths(model: Eagle3Model, frozen: dict, steps: int):
    """-> accepted(tokens, taps, lo, hi, end): accepted drafts at every anchor a in [lo, hi) of a
    greedy continuation, from one teacher-forced TTT pass (module docstring): the chain from
    anchor a is the per-step argmax at pair a-1, accepted while it equals tokens[a+1+k]."""
    def accepted(tokens: np.ndarray, taps: mx.array, lo: int, hi: int, end: int) -> np.ndarray:
        L = len(tokens)
        anchors = np.arange(lo, hi)
        sel = np.maximum(anchors - 1, 0)  # the pair (taps at a-1, anchor) drafts from anchor a
        outs = ttt_hidden(model, frozen["embed"], taps[None], mx.array(tokens[None].astype(np.int32)), steps,
                          mx.array(sel.astype(np.int32)))
        outs[0] = outs[0][:, mx.array(sel.astype(np.int32))]
        pred = mx.stack([mx.argmax(model.norm(h) @ frozen["head"].T, axis=-1)[0] for h in outs])  # [steps, m]
        got = frozen["d_ids"][np.asarray(pred)].T  # [anchors, steps]
        q = anchors[:, None] + 1 + np.arange(steps)  # the position draft k of anchor a predicts
        truth = np.where(q < end, tokens[np.minimum(q, L - 1)], -1)
        ok = (got == truth) & (truth >= 0)
        return np.cumprod(ok, axis=1).sum(axis=1)
    return accepted


def frozen_for_eagle3(target, model: Eagle3Model) -> dict:
    """What `heldout_lengths` borrows: the target's embedding, the drafter's head, the draft ids."""
    c = model.config
    V = target.info.vocab_size
    d_ids = (np.asarray(model.d2t) + np.arange(c.draft_vocab_size)).astype(np.int64) if c.reduced_vocab \
        else np.arange(V)
    head = model.lm_head.weight.astype(mx.float32) if c.has_lm_head else target_head_rows(target, mx.array(d_ids))
    f = {"embed": target.embed(mx.arange(V)).astype(mx.float32), "head": head, "d_ids": d_ids}
    mx.eval(f["embed"], f["head"])
    return f


# ----------------------------------------------------------------------------- set-up

def draft_vocabulary(topk_ids: np.ndarray, vocab: int, n: int) -> np.ndarray:
    """The n target ids most often the target's argmax in the data (sorted ids): the draft vocabulary."""
    counts = np.bincount(np.asarray(topk_ids[..., 0]).reshape(-1), minlength=vocab)[:vocab].astype(np.float64)
    counts += 1e-3 * np.bincount(np.asarray(topk_ids).reshape(-1), minlength=vocab)[:vocab]  # ties: any top-k
    return np.sort(np.argsort(-counts, kind="stable")[:n])


def make_config(target, tc: Eagle3TrainConfig, draft_vocab: int) -> Eagle3Config:
    """An EAGLE-3 drafter of `tc.layers` chain layers, each shaped like one of the target's."""
    c, info = target.config, target.info
    H = info.hidden_size
    heads = int(c.get("num_attention_heads") or max(H // 64, 1))
    return Eagle3Config(
        hidden_size=H, intermediate_size=int(c.get("intermediate_size") or 4 * H), num_hidden_layers=tc.layers,
        num_attention_heads=heads, num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or H // heads), vocab_size=info.vocab_size,
        draft_vocab_size=draft_vocab, target_hidden_size=H, target_layer_ids=tuple(tc.taps),
        file_layer_ids=tuple(t + 1 for t in tc.taps), rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
        rope_theta=float(c.get("rope_theta") or 10000.0), max_drafts=tc.ttt_steps, source_format="mlxspec-train")


def init_from_target(model: Eagle3Model, target, taps: list) -> None:
    """Start where the target ends: the layer's hidden half of q/k/v, o, the MLP and the norms
    from the target's last layer, fc passing the deepest tap, the final norm the target's."""
    last = target.inner.layers[-1]
    H = model.config.hidden_size
    from mlxspec.targets.model import dense_weight

    layer = model.layers[0]
    a, ta = layer.self_attn, last.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        w = dense_weight(getattr(ta, name))
        cur = getattr(a, name).weight
        if w.shape[0] != cur.shape[0]:
            return  # a target with other attention shapes: keep the random init
        getattr(a, name).weight = mx.concatenate([cur[:, :H] * 0.5, w], axis=1)
    a.o_proj.weight = dense_weight(ta.o_proj)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, name).weight = dense_weight(getattr(last.mlp, name))
    layer.input_layernorm.weight = norm_scale(last.input_layernorm, H)
    layer.hidden_norm.weight = norm_scale(last.input_layernorm, H)
    layer.post_attention_layernorm.weight = norm_scale(last.post_attention_layernorm, H)
    model.norm.weight = norm_scale(target.inner.norm, H)
    n = len(taps)
    fc = mx.zeros((H, n * H))
    fc = mx.concatenate([fc[:, : (n - 1) * H], mx.eye(H)], axis=1) + model.fc.weight * 0.1
    model.fc.weight = fc


def grow_from_target(model: Eagle3Model, target, first: int) -> None:
    """Layers first.. (plain Llama layers) start as copies of the target's last layer with zero
    output projections (o_proj, down_proj): each passes its input through unchanged, so the
    drafter drafts as it did without them until they learn."""
    from mlxspec.targets.model import dense_weight

    last, H = target.inner.layers[-1], model.config.hidden_size
    for layer in model.layers[first:]:
        a, ta = layer.self_attn, last.self_attn
        shapes_match = all(dense_weight(getattr(ta, nm)).shape == getattr(a, nm).weight.shape
                           for nm in ("q_proj", "k_proj", "v_proj"))
        if shapes_match:
            for nm in ("q_proj", "k_proj", "v_proj"):
                getattr(a, nm).weight = dense_weight(getattr(ta, nm))
            for nm in ("gate_proj", "up_proj"):
                getattr(layer.mlp, nm).weight = dense_weight(getattr(last.mlp, nm))
            layer.input_layernorm.weight = norm_scale(last.input_layernorm, H)
            layer.post_attention_layernorm.weight = norm_scale(last.post_attention_layernorm, H)
        a.o_proj.weight = mx.zeros_like(a.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


# ----------------------------------------------------------------------------- the loop

def _n_windows(stores) -> int:
    if isinstance(stores, list):
        return sum(len(s["tokens"]) for s in stores)
    return int(getattr(stores, "limit", 0))


def _batch(tokens, taps, topk_ids, topk_probs, ends, L: int) -> dict:
    """A training batch from window arrays [n, >= L, ...] (taps as stored; ends: each window's
    valid length, None: all of it)."""
    from mlxspec.train.data import taps_from_store

    ends = [min(int(e), L) for e in ends] if ends is not None else [L] * len(tokens)
    return {"tokens": mx.array(np.asarray(tokens)[:, :L].astype(np.int32)),
            "taps": taps_from_store(np.asarray(taps)[:, :L]),
            "topk_ids": mx.array(np.asarray(topk_ids)[:, :L].astype(np.int32)),
            "topk_probs": mx.array(np.asarray(topk_probs)[:, :L].astype(np.float32)),
            "end": mx.array(ends), "lo": mx.array([0] * len(ends)), "positions": float(sum(e - 1 for e in ends))}


def chat_windows(store: dict) -> np.ndarray:
    """Which windows of a store hold regenerated chat answers (source "chat-*"; a store without
    sources holds none)."""
    if "source" not in store:
        return np.zeros(len(store["tokens"]), bool)
    return np.char.startswith(np.asarray(store["source"]).astype(str), "chat")


def check_chat_weight(stores: list[dict], weight: float) -> None:
    """--chat-weight: finite and > 0, and only where some store holds chat answers (else one line)."""
    check_float_arg("--chat-weight", weight, 0.0, 1e3, lo_open=True)
    if weight != 1.0 and not any(chat_windows(s).any() for s in stores):
        raise MlxspecError(f"--chat-weight {weight:g}: no --data store holds chat answers (only --data-mode regen "
                           "stores do); prepare one, or drop --chat-weight")


class Windows:
    """Random windows of one or more stores: tokens, taps, labels and the supervised range."""

    cursor = None  # windows are drawn, not read in order: nothing to resume from

    def __init__(self, stores: list[dict], seq_len: int, seed: int, chat_weight: float = 1.0):
        self.L, self.chat_weight = seq_len, float(chat_weight)
        self.reload(stores, seed)

    def reload(self, stores: list[dict], seed: int) -> None:
        self.stores = stores
        self.rng = np.random.default_rng(seed)
        sizes = np.array([len(s["tokens"]) for s in stores], np.float64)
        self.p = sizes / sizes.sum()
        self.w = None  # per-window draw weights, only where chat windows weigh more (or less) than the rest
        check_chat_weight(stores, self.chat_weight)
        if self.chat_weight != 1.0:
            w = np.concatenate([np.where(chat_windows(s), self.chat_weight, 1.0) for s in stores])
            self.w = w / w.sum()
            self.first = np.cumsum([0] + [len(s["tokens"]) for s in stores])

    def _draw(self) -> tuple[dict, int]:
        if self.w is None:
            s = self.stores[self.rng.choice(len(self.stores), p=self.p)]
            return s, int(self.rng.integers(len(s["tokens"])))
        g = int(self.rng.choice(len(self.w), p=self.w))
        i = int(np.searchsorted(self.first, g, side="right")) - 1
        return self.stores[i], g - int(self.first[i])

    def __call__(self, n: int) -> dict:
        rows = []
        for _ in range(n):
            s, w = self._draw()
            end = int(s["end"][w]) if "end" in s else s["tokens"].shape[1]
            rows.append((s, w, end))
        L = min(self.L, min(r[0]["tokens"].shape[1] for r in rows))
        return _batch(*(np.stack([np.asarray(r[0][k][r[1], :L]) for r in rows])
                        for k in ("tokens", "taps", "topk_ids", "topk_probs")), [r[2] for r in rows], L)


class StoreInOrder:
    """One store's windows read in order (modulo its size), the way `OnlineCorpus` gives its
    own: `take`, `limit` and `topk_sample`."""

    def __init__(self, store: dict):
        self.store, self.limit = store, len(store["tokens"])

    def take(self, cursor: int, n: int) -> dict:
        idx = [(cursor + r) % self.limit for r in range(n)]
        return {k: np.asarray(self.store[k][idx]) for k in ("tokens", "taps", "topk_ids", "topk_probs", "end")
                if k in self.store}

    def topk_sample(self) -> np.ndarray:
        return np.asarray(self.store["topk_ids"][: min(self.limit, VOCAB_WINDOWS)])


class InOrder:
    """Windows cursor, cursor + 1, ... of one source (`OnlineCorpus.take`: --online runs the
    target over them as they come; `StoreInOrder.take`: a store read in order), as `Windows` gives
    them. The cursor is checkpointed, so a resumed run reads the next unseen windows."""

    def __init__(self, take, seq_len: int, seed: int, cursor: int = 0):
        self.take, self.L, self.cursor = take, seq_len, int(cursor)
        self.rng = np.random.default_rng(seed)

    def reload(self, stores, seed: int) -> None:  # an in-order source does not grow under the run
        pass

    def __call__(self, n: int) -> dict:
        a = self.take(self.cursor, n)
        self.cursor += n
        L = min(self.L, a["tokens"].shape[1])
        return _batch(a["tokens"], a["taps"], a["topk_ids"], a["topk_probs"], a.get("end"), L)


def _save_atomic(path: Path, arrays: dict) -> None:
    tmp = path.with_name(path.stem + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays)
    os.replace(tmp, path)


def train_eagle3(target, stores, out: str | Path, tc: Eagle3TrainConfig, heldout: str | None = None,
                 log=print, reload=None, stop_after: int | None = None) -> dict:
    """Train (or resume) an EAGLE-3 drafter for `minutes` of this process's CPU time (data
    loading included; one BLAS thread makes it the wall time of an idle core); returns the report.

    stores: a list of stores (windows drawn at random), or an in-order source
    (`train.online.OnlineCorpus` for --online, whose target passes count in the minutes; or
    `StoreInOrder(store)`), read from the checkpointed cursor. stop_after: stop after that many
    steps in all (tests; the budget still sets the learning-rate schedule).

    out/: checkpoint.safetensors + optimizer.safetensors + state.json (resumable at any save),
    history.json (loss, per-step accuracy and held-out points against CPU-minutes), hf/ (the
    speculators export, rewritten at every held-out point)."""
    from mlxspec.drafters.load import save_drafter
    from mlxspec.train.heldout import heldout_tau

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_p = out / "state.json"
    state = json.loads(state_p.read_text()) if state_p.exists() else None
    V = target.info.vocab_size
    in_order = not isinstance(stores, list)
    source = stores if in_order else None
    if state and in_order and hasattr(source, "settings") and state.get("source") != source.settings():
        raise MlxspecError(f"{out}: holds a run trained on other online data; pass a new --out or the same "
                           "--tokens, --corpus, --seq-len and --seed")
    if state:
        d_ids = np.array(state["d_ids"], np.int64)
        if state["config"]["taps"] != list(tc.taps):
            raise MlxspecError(f"{out}: holds a run with taps {state['config']['taps']}, not {list(tc.taps)}; pass a "
                               "new --out or the same taps")
        was_layers = int(state["config"].get("layers", 1))
        if was_layers != tc.layers:
            raise MlxspecError(f"{out}: holds a run of {was_layers} chain layer(s), not --layers {tc.layers}; pass a "
                               f"new --out or --layers {was_layers}")
        if bool(state["config"].get("train_new_only", False)) != tc.train_new_only:
            was = "with" if state["config"].get("train_new_only") else "without"
            raise MlxspecError(f"{out}: holds a run trained {was} --train-new-only; pass a new --out or resume it "
                               f"{was} --train-new-only")
        if bool(state["config"].get("train_head", False)) != tc.train_head:
            was = "with" if state["config"].get("train_head") else "without"
            raise MlxspecError(f"{out}: holds a run trained {was} --train-head; pass a new --out or resume it "
                               f"{was} --train-head")
    elif tc.init_from:
        start, start_cfg = _load_start(target, tc)
        d_ids = np.arange(start_cfg.draft_vocab_size, dtype=np.int64)
        if start_cfg.reduced_vocab:
            d_ids = d_ids + np.asarray(start.d2t, np.int64)
    else:
        samples = [source.topk_sample()] if in_order else \
            [np.asarray(s["topk_ids"][: min(len(s["topk_ids"]), 512)]) for s in stores]
        d_ids = draft_vocabulary(np.concatenate([a.reshape(-1, a.shape[-1]) for a in samples]), V,
                                 min(tc.draft_vocab or V, V))
    cfg = make_config(target, tc, len(d_ids))
    mx.random.seed(tc.seed)
    model = Eagle3Model(cfg)
    model.lm_head.weight = target_head_rows(target, mx.array(d_ids.astype(np.int32)))
    if cfg.reduced_vocab:
        model.d2t = mx.array((d_ids - np.arange(len(d_ids))).astype(np.int32))
    t2d = np.full(V, -1, np.int32)
    t2d[d_ids] = np.arange(len(d_ids), dtype=np.int32)
    frozen = {**frozen_for_eagle3(target, model), "t2d": mx.array(t2d)}
    if tc.init_from and not state:
        # exports are float16/bfloat16; training (AdamW state, the loss over taps of ~1e3) is float32
        model.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                            for k, v in tree_flatten(start.parameters())], strict=False)
        grow_from_target(model, target, start_cfg.num_hidden_layers)
    elif tc.init == "target" and not state:
        init_from_target(model, target, tc.taps)
        grow_from_target(model, target, 1)
    if not tc.train_head:
        model.lm_head.freeze()
    grown = int(state.get("grown_from", 0)) if state else start_cfg.num_hidden_layers if tc.init_from else 0
    if tc.train_new_only:  # only the layers the export lacked (and the head, with train_head)
        model.freeze()
        for layer in model.layers[grown:]:
            layer.unfreeze()
        if tc.train_head:
            model.lm_head.unfreeze()
    if cfg.reduced_vocab:
        model.freeze(keys=["d2t"], recurse=False)
    opt = optim.AdamW(learning_rate=tc.lr, weight_decay=0.0)
    history, step, seconds = [], 0, 0.0
    if state:
        model.load_weights(str(out / "checkpoint.safetensors"), strict=False)
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(out / "optimizer.safetensors")).items()))
        history, step, seconds = state["history"], state["step"], state["seconds"]
        log(f"mlxspec train: resumed {out} at step {step} ({seconds / 60:.1f} min)")
    log(f"mlxspec train: eagle3 taps={list(tc.taps)} draft_vocab={len(d_ids)} ttt_steps={tc.ttt_steps} "
        f"loss={tc.loss} windows={_n_windows(stores)}{' read in order' if in_order else ''}")
    if in_order:
        windows = InOrder(source.take, tc.seq_len, tc.seed + step, (state or {}).get("cursor", 0))
    else:
        windows = Windows(stores, tc.seq_len, tc.seed + step, tc.chat_weight)
    if state and state.get("rng"):  # the draws continue where the checkpoint stopped: a resumed run is the same run
        windows.rng.bit_generator.state = state["rng"]
    mx.eval(model.parameters())
    grad_fn = nn.value_and_grad(model, lambda m, b: loss_fn(m, frozen, b, tc))
    budget = tc.minutes * 60

    def lr_at(sec: float) -> float:
        warm = min(1.0, (step + 1) / max(tc.warmup, 1))
        f = min(sec / budget, 1.0)
        return tc.lr * warm * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * f)))

    def checkpoint():
        params = dict(tree_flatten(model.parameters()))  # frozen layers too (--train-new-only); d2t and
        params.pop("d2t", None)  # a frozen head (the target's rows) are rebuilt from d_ids on resume
        if not tc.train_head:
            params.pop("lm_head.weight", None)
        _save_atomic(out / "checkpoint.safetensors", params)
        _save_atomic(out / "optimizer.safetensors", dict(tree_flatten(opt.state)))
        tmp = state_p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": asdict(tc), "d_ids": d_ids.tolist(), "history": history, "step": step,
                                   "grown_from": grown,
                                   "seconds": seconds, "cursor": windows.cursor, "rng": windows.rng.bit_generator.state,
                                   "source": source.settings() if hasattr(source, "settings") else None}))
        os.replace(tmp, state_p)
        (out / "history.json").write_text(json.dumps({"config": asdict(tc), "history": history}, indent=1))

    def evaluate():
        if tc.train_head:  # the held-out replay drafts with the head as it is now
            frozen["head"] = model.lm_head.weight.astype(mx.float32)
        ho = heldout_tau(model, frozen, heldout, lengths=heldout_lengths(model, frozen, tc.ttt_steps),
                         n_drafts=tc.ttt_steps)
        point = {"step": step, "minutes": seconds / 60, "heldout": {
            c: {"tau": r["tau"], "tau_se": r["tau_se"], "row1": r["per_position_acceptance"][0],
                "acceptance": r["acceptance_rate"], "per_position": r["per_position_acceptance"]}
            for c, r in ho.items()}}
        history.append(point)
        log(f"step {step} ({seconds / 60:.1f} min): held-out " + ", ".join(
            f"{c} tau {r['tau']:.3f} row1 {r['row1']:.3f}" for c, r in point["heldout"].items()))
        save_drafter(model, replace(cfg, max_drafts=tc.ttt_steps), out / "hf", "speculators-eagle3", target=target)

    if heldout and not history:
        evaluate()
    last_eval, last_save = seconds, seconds
    bar = tqdm(total=int(budget), initial=int(min(seconds, budget)), unit="s", desc="eagle3 train", disable=None)
    run_loss, run_acc, pos_done = None, None, 0.0

    def train_point() -> dict:  # the running loss and accuracy, after the step just taken
        return {"step": step, "minutes": seconds / 60, "loss": run_loss, "train_acc": run_acc.tolist(),
                "positions_per_s": b["positions"] / dt, "lr": float(opt.learning_rate)}

    while seconds < budget and (stop_after is None or step < stop_after):
        t0, c0 = time.perf_counter(), time.process_time()
        b = windows(tc.seqs_per_step)
        if tc.ttt_fraction < 1:
            n = b["tokens"].shape[1] - 1
            m = max(1, int(round(n * tc.ttt_fraction)))
            b["sel"] = mx.array(np.sort(windows.rng.choice(n, m, replace=False)).astype(np.int32))
        opt.learning_rate = lr_at(seconds)
        (loss, acc), grads = grad_fn(model, b)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss, acc)
        dt = time.perf_counter() - t0
        seconds += time.process_time() - c0  # CPU time: the curve and the budget do not stretch on a busy machine
        step += 1
        pos_done += b["positions"]
        run_loss = float(loss) if run_loss is None else 0.95 * run_loss + 0.05 * float(loss)
        a = np.asarray(acc)
        run_acc = a if run_acc is None else 0.95 * run_acc + 0.05 * a
        bar.update(int(seconds) - bar.n if int(seconds) > bar.n else 0)
        bar.set_postfix(loss=f"{run_loss:.3f}", acc1=f"{run_acc[0]:.3f}", pos_s=f"{b['positions'] / dt:.0f}")
        if step % 20 == 0:
            history.append(train_point())
        if heldout and seconds - last_eval >= tc.heldout_minutes * 60:
            evaluate()
            last_eval = seconds
        if seconds - last_save >= tc.save_minutes * 60:
            checkpoint()
            last_save = seconds
            if reload is not None:  # windows a concurrent preparation finished since
                windows.reload(reload(), tc.seed + step)
    bar.close()
    if run_loss is not None and not (history and history[-1].get("step") == step and "loss" in history[-1]):
        history.append(train_point())  # the curve ends at the last step (a run under 20 steps has one too)
    if heldout and (not history or history[-1].get("step") != step or "heldout" not in history[-1]):
        evaluate()
    checkpoint()
    save_drafter(model, replace(cfg, max_drafts=tc.ttt_steps), out / "hf", "speculators-eagle3", target=target)
    return {"steps": step, "minutes": seconds / 60, "history": history}
