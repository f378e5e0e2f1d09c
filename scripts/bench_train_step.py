"""Seconds per training step in one process, old trainer vs new (issue 22's throughput table).

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=$(python -m mlxspec.blas) python scripts/bench_train_step.py new ANCHORS BLOCK [STORE] [compile]
    git worktree add /tmp/old c5462ec && ... bench_train_step.py old 16 8 STORE /tmp/old/mlxspec/train/trainer.py

One window per step (4 for the old trainer), 3 timed steps after building the batch; prints the
step times and supervised blocks per second (0 anchors = every valid anchor).
"""
import importlib.util, time, sys
import mlx.core as mx, mlx.nn as nn, numpy as np
from functools import partial
from mlxspec.targets.load import load_target
from mlxspec.train import trainer as new
from mlxspec.train.data import load_shards
from mlxspec.targets.model import target_head_rows
old = None
if sys.argv[1] == "old":  # the trainer file of an older checkout (e.g. a git worktree), imported beside this one
    spec = importlib.util.spec_from_file_location("old_trainer", sys.argv[5])
    old = importlib.util.module_from_spec(spec); sys.modules["old_trainer"] = old; spec.loader.exec_module(old)
t, _ = load_target(None)
shards = load_shards(sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "compile" else "runs/corpus1-smollm2")
V = t.info.vocab_size
which = sys.argv[1]
tcn = new.TrainConfig(taps=[1,8,15,22,28], anchors_per_seq=int(sys.argv[2]), block_size=int(sys.argv[3]), seqs_per_step=1)
cfg = new.make_drafter_config(tcn, t.info, t.config)
d_ids = new.draft_vocabulary(shards, V, 8192)
t2d = np.full(V, -1, np.int32); t2d[d_ids] = np.arange(len(d_ids))
model = new.DFlashModel(cfg)
frozen = {"embed": t.embed(mx.arange(V)).astype(mx.float32), "head": target_head_rows(t, None)[mx.array(d_ids)]}
mx.eval(frozen)
if which == "old":
    tco = old.TrainConfig(taps=[1,8,15,22,28], anchors_per_seq=int(sys.argv[2]), block_size=int(sys.argv[3]))
    bat = old.Batcher(shards, tco, t2d, 0); lf = lambda m, b: old.loss_fn(m, frozen, b, tco)
else:
    bat = new.Batcher([(shards, 1.0)], tcn, t2d, 0); lf = lambda m, b: new.loss_fn(m, frozen, b, tcn)
import mlx.optimizers as optim
opt = optim.AdamW(1e-4)
lvg = nn.value_and_grad(model, lf)
state = [model.state, opt.state]
def step(b):
    (l, m), g = lvg(model, b)
    opt.update(model, g)
    return l
if "compile" in sys.argv[4:]:
    step = partial(mx.compile, inputs=state, outputs=state)(step)
ts = []
for i in range(3):
    b = bat(); mx.eval(b)
    t0 = time.perf_counter(); l = step(b); mx.eval(state, l); ts.append(time.perf_counter() - t0)
blk = float(b["aval"].sum()) if "aval" in b else 16; print(which, sys.argv[2:], [round(x, 2) for x in ts], "blocks", blk, "blocks_s", round(blk / min(ts), 1))
