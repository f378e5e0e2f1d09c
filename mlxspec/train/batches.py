"""What each step trains on: the run's stores (`open_data`, a `--data` mix: `parse_data_mix`)
or its online source, and the `Batcher` that samples windows and anchors from them and builds
one step's label tensors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.drafters.config import Layout
from mlxspec.errors import MlxspecError
from mlxspec.train.config import TrainConfig
from mlxspec.train.data import load_shards, taps_from_store
from mlxspec.train.online import ONLINE_KIND


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


def open_data(shards_dir, tc: TrainConfig, out: Path, ck_state, ck_data: dict):
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
