"""A run's checkpoint in `out/ckpt`: the drafter's weights, the optimizer state and
`state.json` (step, history, settings, drafter config, the data's cursor), each written
atomically (`save`), read back on resume (`load_state`, `restore`), and the `--out` checks
before a run starts (`check_out_dir`)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxspec.errors import MlxspecError
from mlxspec.train.config import TrainConfig


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


def save(out: Path, model, opt, step: int, history: list, tc: TrainConfig, cfg, data: dict | None = None):
    """The checkpoint after `step` steps, file by file atomically (a crash keeps the last one whole
    per file; state.json, written last, names the step the weights are from)."""
    ck = out / "ckpt"
    _atomic(ck / "model.safetensors", model.save_weights)
    _atomic(ck / "optimizer.safetensors", lambda p: mx.save_safetensors(p, dict(tree_flatten(opt.state))))
    state = json.dumps({"step": step, "history": history, "train_config": asdict(tc), "drafter_config": cfg.to_dict(),
                        "data": data})
    _atomic(ck / "state.json", lambda p: Path(p).write_text(state))


def load_state(out: Path, resume: bool) -> dict | None:
    """The checkpoint's state.json when resuming one, else None."""
    ck = out / "ckpt" / "state.json"
    return json.loads(ck.read_text()) if resume and ck.exists() else None


def restore(out: Path, model, opt, state: dict) -> tuple[int, list]:
    """The checkpoint's weights and optimizer state into `model` and `opt` -> (step, history)."""
    model.load_weights(str(out / "ckpt" / "model.safetensors"), strict=False)
    opt.state = tree_unflatten(list(mx.load(str(out / "ckpt" / "optimizer.safetensors")).items()))
    return state["step"], state["history"]
