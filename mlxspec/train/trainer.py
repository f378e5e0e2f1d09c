"""Train DFlash / DSpark drafters for a frozen target, in MLX.

The whole method on one screen (nanoGPT's shape): cached target taps + labels come from
`data.prepare_shards`; each step samples windows and random anchors (`batches.Batcher`), runs
every block of every window in ONE drafter forward (one attention mask: a block sees the
context strictly before its anchor and its own rows, never other blocks), and applies the
lineage's loss (`step`: what differs per lineage is a loss and a forward; this loop is
shared). Embeddings and LM head are borrowed from the target and frozen.

Labels: "target" = the target's own argmax / distribution at each position (what greedy
verification accepts), or "corpus" = the raw next token (CE only).
Data: a store on disk (`data.prepare_shards`, `regen`), or online (`online.OnlineCorpus`:
the target runs inside the loop on the next windows, no store; equal to a store of the same
windows read in order, `window_order="sequential"`).
The drafter at step 0 comes from `start`; checkpoints and resuming from `checkpoint`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from tqdm import tqdm

from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.errors import MlxspecError
from mlxspec.train import checkpoint
from mlxspec.train.batches import Batcher, open_data
from mlxspec.train.config import TrainConfig
from mlxspec.train.heldout import heldout_tau
from mlxspec.train.start import build_model, make_drafter_config
from mlxspec.train.step import make_step


def lr_at(tc: TrainConfig, step: int) -> float:
    """Linear warm-up over `tc.warmup` steps, then cosine decay to 0.1 x `tc.lr` at `tc.steps`."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    p = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


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

    `shards_dir`: a store directory, a mix (`batches.parse_data_mix`), or an online source
    (`online.OnlineCorpus`: the target runs in the loop, windows in order). A checkpoint in
    out_dir is resumed only when its settings match `tc` (`checkpoint.check_out_dir`) and,
    online, its data (the same plan of windows: it continues at the recorded cursor); a
    non-empty out_dir without one is refused unless `force`. `stop_after`: stop (and
    checkpoint) after that step, as if interrupted; a later call resumes."""

    out = Path(out_dir)
    online = hasattr(shards_dir, "take")
    if online:
        source = shards_dir
        if tc.taps and list(tc.taps) != list(source.taps):
            raise MlxspecError(f"online data: the source's taps {source.taps} differ from the run's {list(tc.taps)}")
        tc.taps, tc.window_order = list(source.taps), "sequential"  # online reads the windows in order
    checkpoint.check_out_dir(out, tc, resume, force)
    ck_state = checkpoint.load_state(out, resume)
    ck_data = (ck_state or {}).get("data") or {}
    stores, n_windows, data_desc, vocab_sample = open_data(shards_dir, tc, out, ck_state, ck_data)
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    cfg = make_drafter_config(tc, target.info, target.config)
    model, frozen, d_ids, t2d = build_model(target, tc, cfg, out, ck_state, vocab_sample)

    opt = optim.AdamW(learning_rate=tc.lr, weight_decay=tc.weight_decay)
    start, history = 0, []
    if ck_state is not None:
        start, history = checkpoint.restore(out, model, opt, ck_state)
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

    step_fn, state = make_step(model, opt, frozen, tc)
    blocks = 0.0
    bar = tqdm(range(start, end), initial=start, total=tc.steps, desc=f"train {tc.lineage}{' online' if online else ''}",
               unit="step")
    t0, c0, ema = time.time(), time.process_time(), None
    # training CPU seconds (held-out evaluations excluded, as the EAGLE-3 trainer counts its minutes)
    prior_cpu = float(next((h["cpu_s"] for h in reversed(history) if "cpu_s" in h), 0.0))
    eval_cpu = [0.0]

    def cpu_s() -> float:
        return prior_cpu + time.process_time() - c0 - eval_cpu[0]

    def heldout_point(step_done: int, el: float) -> None:
        spent, e0 = cpu_s(), time.process_time()
        ho = heldout_tau(model, frozen, tc.heldout)
        eval_cpu[0] += time.process_time() - e0
        history.append({"step": step_done, "supervised_blocks": prior_blocks + blocks,
                        "distinct_tokens": prior_distinct + batcher.distinct_tokens, "elapsed_s": el,
                        "cpu_s": spent,
                        "heldout": {c: {"tau": r["tau"], "tau_se": r["tau_se"], "per_prompt": r["per_prompt"],
                                        "row1": r["per_position_acceptance"][0],
                                        "acceptance": r["acceptance_rate"]} for c, r in ho.items()}})
        bar.write(f"step {step_done}: held-out tau " + ", ".join(f"{c} {r['tau']:.3f}" for c, r in ho.items()))

    if tc.heldout and tc.heldout_every and start == 0:
        heldout_point(0, 0.0)  # where the curve starts (random init, or --init-from's drafter)
    for step in bar:
        opt.learning_rate = lr_at(tc, step)
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
                            "lr": float(lr_at(tc, step)), "elapsed_s": el, "cpu_s": cpu_s(),
                            "blocks_per_s": rate,
                            "supervised_blocks": prior_blocks + blocks, "window_passes": passes,
                            "windows": batcher.cursor, **extra})
        measured = bool(tc.heldout and tc.heldout_every and ((step + 1) % tc.heldout_every == 0 or step == tc.steps - 1))
        if measured:
            heldout_point(step + 1, el)
        # a checkpoint at every held-out point too: a run stopped between points (a session's
        # end) resumes from the last point on the curve, not from the last checkpoint_every step
        if (step + 1) % tc.checkpoint_every == 0 or step == end - 1 or measured:
            checkpoint.save(out, model, opt, step + 1, history, tc, cfg, data_state())
    bar.close()
    return model, cfg, {"history": history, "train_config": asdict(tc), "draft_ids": d_ids}
