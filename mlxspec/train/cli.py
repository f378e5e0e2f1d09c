"""`mlxspec train`: prepare target taps once, train a drafter, export, evaluate."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from mlxspec.args import check_blas
from mlxspec.cache import cache_dir
from mlxspec.errors import MlxspecError
from mlxspec.evaluate import evaluate_drafter
from mlxspec.targets.load import load_target
from mlxspec.train.data import DEFAULT_SOURCES, prepare_generated_shards, prepare_shards
from mlxspec.train.export import export_all
from mlxspec.train.heldout import build_heldout, default_heldout_dir, target_name
from mlxspec.train.regen import QUESTION_SOURCES, TEMPS, kinds_for, prepare_regen_store
from mlxspec.train.batches import parse_data_mix
from mlxspec.train.config import TrainConfig
from mlxspec.train.trainer import train
from mlxspec.validate import MAX_BLOCK, check_float_arg, check_int_arg, check_output_dir, parse_float_list, writing

DEFAULT_TOKENS = "code=650000,prose=520000,fortunes=130000"


def add_train_args(p):
    p.add_argument("--model", "-m", default=None, help="target (default SmolLM2-135M-Instruct)")
    p.add_argument("--lineage", choices=("dspark", "dflash", "dflash2", "eagle3"), default="dspark",
                   help="dflash2: dynamic convs + path selector, bonus-anchor layout, full vocabulary (as z-lab); "
                        "eagle3: a chain drafter (one layer; --layers N adds plain layers) over three taps (default: the target's inputs of layers 2, "
                        "N//2, N-3), every position supervised plus training-time test, for --minutes")
    p.add_argument("--ttt-steps", type=int, default=7,
                   help="eagle3: chain steps unrolled in training (training-time test), loss weight 0.8^k")
    p.add_argument("--ttt-fraction", type=float, default=0.25,
                   help="eagle3: share of positions the unrolled steps run at each step (step 0 runs at all of them)")
    p.add_argument("--chat-weight", type=float, default=1.0,
                   help="eagle3: draw the windows of regenerated chat answers (a --data-mode regen store's "
                        "chat-* windows) this many times as often as the others")
    p.add_argument("--minutes", type=float, default=60.0,
                   help="eagle3: training budget in minutes of training time (resumable; the cosine decay spans it)")
    p.add_argument("--out", "-o", required=True, help="output directory (checkpoints, exports, report)")
    p.add_argument("--data", default=None,
                   help="data store directory (default: <cache>/shards/<model>-<mode>-...); prepared on first use. "
                        "To train on several stores: DIR:WEIGHT,DIR2:WEIGHT2 (windows drawn in proportion); DIR@N reads a "
                        "store from its window N on (continuing on windows not trained on yet)")
    p.add_argument("--corpus", action="append", default=None,
                   help="CATEGORY=GLOB (repeatable); default: stdlib code, Python docs prose, fortunes")
    p.add_argument("--tokens", default=None,
                   help=f"training tokens per category (default {DEFAULT_TOKENS}; generated tokens in "
                        "--data-mode generated); with an existing --data store, its own budget")
    p.add_argument("--data-mode", choices=("regen", "corpus", "generated"), default="corpus",
                   help="corpus: corpus windows, one batched prefill each, streamed and resumable (default; "
                        "fastest per token, ~10x cheaper than regen); regen: the target's own answers to chat "
                        "prompts built from the training split and its continuations of corpus prefixes, greedy "
                        "and at T=0.7, anchors on the answers only (what is served; resumable); generated: "
                        "corpus prefixes continued greedily (older, not resumable)")
    p.add_argument("--online", action="store_true",
                   help="no store: each step runs the target on the next corpus windows (prefill, taps, top-k: what "
                        "a store would hold) and trains on them; resumable at the next unseen window. A store costs "
                        "5.8 kB per token (SmolLM2), so for 1e8+ tokens on a GPU this is the way; it pays the "
                        "target's prefill on every pass over the windows, a store once (docs/training.md); eagle3: its "
                        "passes count in --minutes")
    p.add_argument("--window-order", choices=("random", "sequential"), default=None,
                   help="random: each window drawn at random from the store(s) (default offline); sequential: one "
                        "store read in order, each window once per pass (what --online does)")
    p.add_argument("--regen-windows", type=int, default=2048,
                   help="regen mode: answers to collect (one window of --seq-len tokens each)")
    p.add_argument("--regen-temps", default="0,0.7",
                   help="regen mode: the answer temperatures, comma-separated; each makes a chat and a "
                        "continuation kind, drawn in equal parts (default 0,0.7)")
    p.add_argument("--regen-questions", choices=QUESTION_SOURCES, default="corpus",
                   help="regen mode: where the chat questions come from: corpus (questions built from the "
                        "training split), self (the target asks them itself: its chat template sampled up to "
                        "the user turn), mixed (the two in turn); default corpus")
    p.add_argument("--data-seconds", type=float, default=None,
                   help="corpus mode: stop preparing data after this many seconds (rerun to resume)")
    p.add_argument("--data-batch", type=int, default=None,
                   help="windows per target forward while preparing data (default 16 corpus, 64 regen)")
    p.add_argument("--max-windows", type=int, default=None,
                   help="train on the first N windows of the data only (budget studies)")
    p.add_argument("--prefix-len", type=int, default=None,
                   help="generated mode: corpus prefix tokens (default: a quarter of --seq-len)")
    p.add_argument("--taps", default=None,
                   help="target layers (output of layer k) the drafter reads (default: five spread from layer 1 to "
                        "the third-to-last, e.g. 1,8,15,22,28 for SmolLM2's 30 layers, 1,5,9,13,16 for Gemma-3-270M's 18)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layout", choices=("anchor-first", "bonus-anchor"), default=None,
                   help="default: bonus-anchor for dflash2 (its published layout), anchor-first otherwise")
    p.add_argument("--layers", type=int, default=1,
                   help="drafter layers (eagle3: chain layers, the EAGLE-3 layer then plain Llama layers)")
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--markov-rank", type=int, default=32)
    p.add_argument("--no-confidence", action="store_true")
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (0 = full)")
    p.add_argument("--labels", choices=("target", "corpus"), default="target")
    p.add_argument("--loss", choices=("ce", "kl"), default=None,
                   help="ce: cross-entropy on the target's argmax (block lineages' default); kl: soft cross-entropy "
                        "on its stored top-k (eagle3's default)")
    p.add_argument("--warm-start", action="store_true",
                   help="start the drafter layers from the target's last layers (fc passes the deepest tap)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=0,
                   help="supervised blocks per window per step (0 = every valid position: dense, the default)")
    p.add_argument("--all-positions", action="store_true",
                   help="regen stores: anchors in the prompt as well as the answer (default: answer only)")
    p.add_argument("--init-from", default=None,
                   help="start from a drafter export (e.g. mlxspec/weights/smollm2-135m-dspark) with the same shape, "
                        "or with fewer layers than --layers: the drafter grows (new layers start as a copy of the "
                        "export's last with zero output projections, so step 0 drafts as the export)")
    p.add_argument("--train-new-only", action="store_true",
                   help="with a grown --init-from: train only the new layers (fc, the inherited layers, the "
                        "final norm and the heads stay as exported; lets the new layers take a higher --lr)")
    p.add_argument("--train-head", action="store_true",
                   help="eagle3: the head learns too (it starts as the target's rows at the draft ids and is "
                        "frozen without this flag), as EAGLE-3 and SpecForge train theirs")
    p.add_argument("--compile", action="store_true", help="mx.compile the training step (no faster on CPU, measured)")
    p.add_argument("--heldout-every", type=int, default=0,
                   help="every N steps (eagle3: every N minutes), held-out tau from the target's greedy answers to the held-out prompts "
                        "(train.heldout: equals the engine's full-block evaluation, ~15 s), into the report's history")
    p.add_argument("--heldout-prompts", type=int, default=8,
                   help="held-out prompts per category for --heldout-every (default 8; up to 16 code, 16 prose, 8 chat "
                        "exist: more prompts, a smaller standard error, and a history not comparable with 8)")
    p.add_argument("--heldout-tokens", type=int, default=64, help="tokens per held-out answer (default 64, at most 1024)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty --out that holds no checkpoint to resume (with --no-resume: start over)")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per category for the final evaluation (0 = skip)")
    p.add_argument("--prepare-only", action="store_true")


def default_taps(num_layers: int, n: int = 5) -> list[int]:
    """n target layers spread evenly from layer 1 to layer num_layers - 2 (rounded up): early,
    middle and late features, leaving the last layer, which mostly shapes the logits (and which
    the drafter loader refuses as a tap). Targets of at most n layers: every layer but the last."""
    if num_layers <= n:
        return list(range(num_layers - 1))
    span = num_layers - 3
    return sorted({1 + -(-i * span // (n - 1)) for i in range(n)})


def check_taps(taps: list[int], n_layers: int) -> None:
    """The drafter loader's rule (`mlxspec.drafters.load.validate_against_target`), at entry:
    every tap an intermediate layer of the target, 0..n_layers - 2. A drafter trained on the
    final layer's output would be refused when it is loaded."""
    shown = f"--taps {','.join(map(str, taps))}"
    if not taps:  # only the default of a 1-layer target
        raise MlxspecError(f"the target has {n_layers} layer: drafters tap intermediate layers and it has none; "
                           "train for a target with at least 2 layers")
    last = n_layers - 1
    for k in taps:
        if k > last:
            raise MlxspecError(f"{shown}: layer {k} is outside the target, which has {n_layers} layers (valid taps "
                               f"0..{last - 1}); pass layer numbers below {last}")
    if last in taps:
        raise MlxspecError(f"{shown}: layer {last} is the last layer of the target ({n_layers} layers); drafters tap "
                           "intermediate layers, not the final one (the drafter loader refuses such a drafter); "
                           f"pass layer numbers below {last}")


def _parse_temps(s: str) -> list[float]:
    """--regen-temps "0,0.7" -> [0.0, 0.7], checked by `kinds_for` (range, repeats)."""
    temps = parse_float_list("--regen-temps", s, "0,0.7")
    kinds_for(temps)
    return temps


def _parse_kv(s: str) -> dict:
    out = {}
    for part in s.split(","):
        k, _, v = part.partition("=")
        if not v:
            raise MlxspecError(f"--tokens expects CATEGORY=N[,..], got {s!r}")
        try:
            out[k.strip()] = int(v)
        except ValueError:
            raise MlxspecError(f"--tokens expects CATEGORY=N[,..] with integer N, got {s!r}") from None
        if out[k.strip()] < 1:
            raise MlxspecError(f"--tokens {s!r}: every token budget must be >= 1")
    return out


def check_train_args(a) -> None:
    """Range-check the train flags before minutes of loading and data preparation."""
    check_int_arg("--steps", a.steps, 1)
    check_int_arg("--block-size", a.block_size, 1, MAX_BLOCK)
    check_int_arg("--layers", a.layers, 1, 64)
    check_int_arg("--intermediate-size", a.intermediate_size, 1, 1 << 20)
    check_int_arg("--markov-rank", a.markov_rank, 0, 1 << 16)
    check_int_arg("--draft-vocab", a.draft_vocab, 0)
    check_int_arg("--seq-len", a.seq_len, 2)
    # --prefix-len: range-checked in every mode it is given in; it applies to generated windows only
    check_int_arg("--prefix-len", a.prefix_len, 1, a.seq_len - 1, allow_none=True)
    if a.data_mode == "generated":
        if a.prefix_len is None:
            a.prefix_len = max(1, a.seq_len // 4)
    elif a.prefix_len is not None:
        mode = "online corpus" if a.online else a.data_mode
        raise MlxspecError(f"--prefix-len {a.prefix_len} applies to --data-mode generated only ({mode} windows have "
                           "no corpus prefix); drop --prefix-len or pass --data-mode generated")
    check_int_arg("--regen-windows", a.regen_windows, 1)
    a.regen_temps = _parse_temps(a.regen_temps)
    if a.data_mode != "regen" and a.regen_questions != "corpus":
        raise MlxspecError(f"--regen-questions applies to --data-mode regen (the target answers questions there); "
                           f"drop it for --data-mode {a.data_mode}")
    if a.data_mode != "regen" and a.regen_temps != list(TEMPS):
        raise MlxspecError(f"--regen-temps applies to --data-mode regen (the target answers prompts there); drop it "
                           f"for --data-mode {a.data_mode}")
    check_int_arg("--heldout-every", a.heldout_every, 0)
    check_int_arg("--heldout-prompts", a.heldout_prompts, 1, 16)
    check_int_arg("--heldout-tokens", a.heldout_tokens, 1, 1024)  # each answer is generated whole, with taps
    if a.lineage == "dflash2" and a.layout == "anchor-first":
        raise MlxspecError("--lineage dflash2 --layout anchor-first: DFlash 2 files are bonus-anchor (z-lab's layout, "
                           "the only one its readers know); drop --layout")
    check_int_arg("--seqs-per-step", a.seqs_per_step, 1)
    check_float_arg("--chat-weight", a.chat_weight, 0.0, 1e3, lo_open=True)
    if a.chat_weight != 1.0 and a.lineage != "eagle3":
        raise MlxspecError(f"--chat-weight applies to --lineage eagle3 (the block trainers draw anchors, not "
                           f"windows); drop it for --lineage {a.lineage}")
    if a.train_head and a.lineage != "eagle3":
        raise MlxspecError(f"--train-head applies to --lineage eagle3 (the block drafters' heads are the target's); "
                           f"drop it for --lineage {a.lineage}")
    if a.chat_weight != 1.0 and a.online:
        raise MlxspecError("--chat-weight: --online reads corpus windows in order, none of them chat answers; "
                           "train from a --data-mode regen store, or drop --chat-weight")
    check_int_arg("--anchors-per-seq", a.anchors_per_seq, 0)
    check_int_arg("--warmup", a.warmup, 0)
    check_int_arg("--seed", a.seed, 0)
    check_int_arg("--data-batch", a.data_batch, 1, allow_none=True)
    check_int_arg("--eval-prompts", a.eval_prompts, 0)
    check_int_arg("--max-windows", a.max_windows, 1, allow_none=True)
    check_float_arg("--lr", a.lr, 0.0, 1.0, lo_open=True)
    check_float_arg("--data-seconds", a.data_seconds, 0.0, lo_open=True, allow_none=True)
    if a.taps is not None:
        parts = [x.strip() for x in str(a.taps).split(",")]
        if not all(x.lstrip("-").isdigit() for x in parts):
            raise MlxspecError(f"--taps {a.taps!r}: pass comma-separated layer numbers, e.g. 1,8,15")
        taps = [int(x) for x in parts]
        if len(set(taps)) != len(taps) or min(taps) < 0:
            raise MlxspecError(f"--taps {a.taps!r}: layer numbers must be distinct and >= 0")
    if a.tokens is not None:
        _parse_kv(a.tokens)
    if a.online:
        if a.data is not None:
            raise MlxspecError("--online: the target runs inside the training loop and keeps no store; drop --data")
        if a.prepare_only:
            raise MlxspecError("--online --prepare-only: online training prepares no store; drop one of them")
        if a.data_mode != "corpus":
            raise MlxspecError(f"--online --data-mode {a.data_mode}: online training reads corpus windows only; "
                               f"prepare a {a.data_mode} store and train from it, or drop --data-mode")
        if a.data_seconds is not None:
            raise MlxspecError("--online: --data-seconds bounds store preparation; online there is none, drop it")
        if a.window_order == "random":
            raise MlxspecError("--online --window-order random: online training reads the windows in order "
                               "(each once per pass); drop --window-order")


def cmd_train(a) -> int:
    check_train_args(a)
    check_output_dir("--out", a.out)  # before minutes of loading and data preparation
    if a.data and len(parse_data_mix(a.data)) == 1:
        check_output_dir("--data", parse_data_mix(a.data)[0][0])
    check_blas()
    target, tok = load_target(a.model)
    n_layers = target.info.num_layers
    if a.taps is None and a.lineage == "eagle3" and n_layers >= 6:
        from mlxspec.drafters.eagle3 import default_taps as eagle3_taps
        taps = eagle3_taps(n_layers)  # the references' default: inputs of layers 2, N//2, N-3
    elif a.taps is None and a.lineage == "eagle3":
        taps = default_taps(n_layers, 3)  # too shallow for the references' default
    else:
        taps = default_taps(n_layers) if a.taps is None else [int(x) for x in a.taps.split(",")]
    check_taps(taps, n_layers)
    budget = _parse_kv(a.tokens or DEFAULT_TOKENS)
    sources = None
    if a.corpus:
        sources = {}
        for c in a.corpus:
            k, _, g = c.partition("=")
            if not g:
                raise MlxspecError(f"--corpus expects CATEGORY=GLOB, got {c!r}")
            sources.setdefault(k, []).append(g)
        budget = {k: v for k, v in budget.items() if k in sources} or {k: 50_000 for k in sources}

    name = target_name(target)
    mix = parse_data_mix(a.data) if a.data else None
    if a.online:
        from mlxspec.train.online import OnlineCorpus

        data = OnlineCorpus(target, tok, taps, a.seq_len, budget, batch=a.data_batch or 16, sources=sources,
                            seed=a.seed)
    else:
        data = Path(mix[0][0]) if mix else (
            cache_dir() / "shards" / f"{name}-{a.data_mode}-L{a.seq_len}-t{'_'.join(map(str, taps))}")
    meta = {"taps": taps, "seq_len": a.seq_len, "budget": budget, "model": target.info.source,
            "sources": sources or DEFAULT_SOURCES, "mode": a.data_mode}
    if a.lineage == "eagle3" and not a.prepare_only and not a.online and all(
            (Path(d) / "meta.json").exists() for d in ([m[0] for m in mix] if mix else [data])):
        return _train_eagle3(a, target, tok, taps, mix, data)  # stores already there (possibly still growing)
    if a.online:
        pass  # no store: the trainer runs the target on each step's windows
    elif mix and len(mix) > 1:
        for d, *_ in mix:  # a mix trains on stores prepared before, each checked by the trainer
            if not (Path(d) / "meta.json").exists():
                raise MlxspecError(f"--data {a.data}: {d} holds no prepared store; prepare each store first "
                                   "(mlxspec train --prepare-only --data DIR ...)")
    elif a.data_mode == "regen":
        with writing("--data", data):
            prepare_regen_store(target, tok, data, taps, a.seq_len, windows=a.regen_windows, batch=a.data_batch or 64,
                                seed=a.seed, max_seconds=a.data_seconds, temps=a.regen_temps,
                                questions=a.regen_questions)
    elif a.data_mode == "corpus":
        stored = data / "meta.json"
        if stored.exists() and a.tokens is None:
            budget = json.loads(stored.read_text()).get("budget", budget)  # resume with the store's own budget
        if a.prepare_only or not stored.exists() or a.tokens is not None:
            with writing("--data", data):
                prepare_shards(target, tok, data, taps, a.seq_len, budget, batch=a.data_batch or 16,
                               sources=sources, max_seconds=a.data_seconds, seed=a.seed)
    elif not (data / "meta.json").exists():
        t0 = time.time()
        prepare_generated_shards(target, tok, data, taps, a.prefix_len, a.seq_len - a.prefix_len, budget,
                                 sources=sources)
        meta["prepare_s"] = time.time() - t0
        (data / "meta.json").write_text(json.dumps(meta, indent=1))
    elif json.loads((data / "meta.json").read_text())["taps"] != taps:
        raise MlxspecError(f"{data}: shards were prepared for other taps; pass --data to a new directory")
    if a.prepare_only:
        return 0
    if a.lineage == "eagle3":
        return _train_eagle3(a, target, tok, taps, mix, data)
    tc = TrainConfig(
        lineage=a.lineage, block_size=a.block_size,
        sample_from_anchor=(a.layout or ("bonus-anchor" if a.lineage == "dflash2" else "anchor-first")) == "anchor-first",
        layers=a.layers, intermediate_size=a.intermediate_size, markov_rank=a.markov_rank,
        confidence_head=not a.no_confidence, draft_vocab=a.draft_vocab, labels=a.labels, steps=a.steps,
        seqs_per_step=a.seqs_per_step, anchors_per_seq=a.anchors_per_seq, lr=a.lr, warmup=a.warmup,
        seed=a.seed, taps=taps, loss=a.loss or "ce", warm_start=a.warm_start, max_windows=a.max_windows,
        response_only=not a.all_positions, compile=a.compile, init_from=a.init_from, train_new_only=a.train_new_only,
        heldout_every=a.heldout_every, window_order="sequential" if a.online else (a.window_order or "random"),
    )
    if a.heldout_every:
        n, m = a.heldout_prompts, a.heldout_tokens
        tc.heldout = str(build_heldout(target, tok, taps, default_heldout_dir(target, taps, n, m), n_per_category=n,
                                       max_tokens=m))
    out = Path(a.out)
    t0 = time.time()
    with writing("--out", out):
        model, cfg, info = train(target, data if a.online else (mix or str(data)), str(out), tc,
                                 resume=not a.no_resume, force=a.force)
    train_s = time.time() - t0
    with writing("--out", out):
        paths = export_all(model, cfg, out, target=target)
    report = {"train_config": asdict(tc), "train_seconds_this_run": train_s,
              "history": info["history"], "exports": [str(p) for p in paths]}
    if a.eval_prompts:
        report["eval"] = evaluate_drafter(target, tok, paths[0], n_per_category=a.eval_prompts)
    with writing("--out", out):
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {', '.join(str(p) for p in paths)} and {out / 'report.json'}")
    return 0


def _train_eagle3(a, target, tok, taps, mix, data) -> int:
    from mlxspec.train.data import load_shards
    from mlxspec.train.eagle3 import Eagle3TrainConfig, check_chat_weight, train_eagle3

    check_int_arg("--ttt-steps", a.ttt_steps, 1, MAX_BLOCK)
    check_float_arg("--minutes", a.minutes, 0.0, 1e6, lo_open=True)
    check_float_arg("--ttt-fraction", a.ttt_fraction, 0.0, 1.0, lo_open=True)
    if a.init_from and not Path(a.init_from).exists():
        raise MlxspecError(f"--init-from {a.init_from}: no drafter export there; pass an EAGLE-3 export directory "
                           "(e.g. mlxspec/weights/smollm2-135m-eagle3)")
    if a.train_new_only and not a.init_from:
        raise MlxspecError("--train-new-only: trains the layers a grown --init-from export lacks; pass --init-from "
                           "EXPORT --layers N (more than the export's), or drop --train-new-only")
    dirs = [] if a.online else [(d, first) for d, _, first in mix] if mix else [(str(data), 0)]
    stores = data if a.online else []  # online: the corpus windows in order, the target run on each step's
    if a.online:
        data.set_limit(a.max_windows)
    for d, first in dirs:
        meta = json.loads((Path(d) / "meta.json").read_text())
        if list(meta.get("taps", [])) != list(taps):
            raise MlxspecError(f"--data {d}: prepared for taps {meta.get('taps')}, not {taps}; pass --taps "
                               f"{','.join(map(str, meta.get('taps', [])))} or a store for these taps")
        stores.append(load_shards(d, a.max_windows, first))

    if not a.online:
        check_chat_weight(stores, a.chat_weight)  # before the held-out store and the run are set up

    def reload():  # stores still being prepared by another process grow between checkpoints
        return [load_shards(d, a.max_windows, first) for d, first in dirs]
    tc = Eagle3TrainConfig(taps=list(taps), draft_vocab=a.draft_vocab, ttt_steps=a.ttt_steps, lr=a.lr,
                           ttt_fraction=a.ttt_fraction, chat_weight=a.chat_weight,
                           warmup=a.warmup, minutes=a.minutes, seqs_per_step=a.seqs_per_step, seq_len=a.seq_len,
                           seed=a.seed, loss=a.loss or "kl", init="target" if a.warm_start else "random",
                           init_from=a.init_from, train_head=a.train_head, layers=a.layers,
                           train_new_only=a.train_new_only,
                           heldout_minutes=max(a.heldout_every, 1) if a.heldout_every else 5.0)
    heldout = None
    if a.heldout_every:
        n, m = a.heldout_prompts, a.heldout_tokens
        heldout = str(build_heldout(target, tok, taps, default_heldout_dir(target, taps, n, m), n_per_category=n,
                                    max_tokens=m))
    with writing("--out", a.out):
        rep = train_eagle3(target, stores, a.out, tc, heldout, reload=None if a.online else reload)
    print(f"mlxspec train: eagle3 {rep['steps']} steps in {rep['minutes']:.1f} min; export {Path(a.out) / 'hf'}")
    return 0
