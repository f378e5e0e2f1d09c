"""`TrainConfig`: every setting of a training run (a checkpoint records it and resumes only
under the same settings, `checkpoint.check_out_dir`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
