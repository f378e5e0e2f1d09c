#!/usr/bin/env python3
"""What a speculative step costs the batched KV cache, per-row lengths vs left padding.

After a batched verify, rows keep different numbers of tokens. With per-row lengths
(`mlxspec.engine.batch_rows.RaggedKVCache`) the next block is scattered at each row's own length
(`put_along_axis`) and rollback is free. With mlx-lm's left-padded `BatchKVCache` rows share
one end slot, so every row that kept fewer tokens than the longest must be shifted right
(`dynamic_roll`, mlx-lm's own helper for that) before the next block. This times both for
SmolLM2-135M's shapes (30 layers x K and V, 3 KV heads x 64) at B = 8 and a 6-token block:

    .venv/bin/python scripts/bench_batch_cache.py
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

B, H, D, L, LAYERS = 8, 3, 64, 6, 30


def main():
    for S in (512, 2048):
        lens = mx.array([S // 2 - 37 * i for i in range(B)])
        shifts = mx.array([i % 5 for i in range(B)])  # tokens each row kept fewer than the longest

        def per_row_lengths(buf, new):
            idx = (lens[:, None] + mx.arange(L))[:, None, :, None]
            return mx.put_along_axis(buf, idx, new, axis=2)

        def left_padding(buf, new):
            buf[..., S - 64 : S - 64 + L, :] = new
            return dynamic_roll(buf, shifts[:, None], axis=2)

        for f in (per_row_lengths, left_padding):
            best = float("inf")
            for _ in range(2):
                bufs = [mx.zeros((B, H, S, D)) for _ in range(2 * LAYERS)]
                new = mx.ones((B, H, L, D))
                mx.eval(bufs, new)
                t = time.perf_counter()
                for _ in range(3):
                    bufs = [f(b, new) for b in bufs]
                    mx.eval(bufs)
                best = min(best, (time.perf_counter() - t) / 3)
            print(f"context slots {S:5d}  {f.__name__:16s} {best * 1000:8.1f} ms per step")


if __name__ == "__main__":
    main()
