"""Recurrent-state rollback: "replay" vs "capture" (mlxspec/targets/rollback.py), measured.

A random-weight Qwen3.5 (Gated DeltaNet + attention, mlx-lm's own classes) verifies a block of
L tokens after a prompt and is rolled back to keep 1..L of them; per strategy this prints the
median time of verify + rollback (evaluated), and of the verify alone.

    LD_PRELOAD=$(.venv/bin/python -m mlxspec.blas) .venv/bin/python scripts/bench_rollback.py [--hidden 1024] [--layers 8] [--block 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from mlx_lm.utils import _get_classes

    from mlxspec.targets.model import Target, trim_cache

    d = a.hidden
    cfg = dict(model_type="qwen3_5", hidden_size=d, num_hidden_layers=a.layers, intermediate_size=3 * d,
               num_attention_heads=d // 128, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
               vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=True,
               full_attention_interval=4, linear_num_value_heads=d // 64, linear_num_key_heads=d // 128,
               linear_key_head_dim=128, linear_value_head_dim=64, linear_conv_kernel_dim=4)
    mc, ac = _get_classes(config=cfg)
    mx.random.seed(0)
    target = Target(mc(ac.from_dict(cfg)), cfg)
    mx.eval(target.model.parameters())
    prompt = mx.random.randint(0, 32000, (1, a.prompt))
    block = mx.random.randint(0, 32000, (1, a.block))
    print(f"qwen3_5 hidden={d} layers={a.layers} ({a.layers - a.layers // 4} Gated DeltaNet), block={a.block}, "
          f"prompt={a.prompt}, device={mx.default_device()}")
    for mode in ("replay", "capture"):
        target.recurrent_rollback = mode
        verify, total = [], []
        for _ in range(a.repeats + 1):
            for keep in range(1, a.block + 1):
                cache = target.make_cache()
                mx.eval(target(prompt, cache, logits="last")[0], [c.state for c in cache])
                trim_cache(cache, 0)
                t0 = time.perf_counter()
                lg, _ = target(block, cache)
                mx.eval(lg, [c.state for c in cache])
                t1 = time.perf_counter()
                trim_cache(cache, a.block - keep)
                mx.eval([c.state for c in cache])
                t2 = time.perf_counter()
                verify.append(t1 - t0)
                total.append(t2 - t0)
        skip = a.block  # first round is warm-up
        v, t = statistics.median(verify[skip:]), statistics.median(total[skip:])
        print(f"{mode:8s} verify {v * 1e3:7.2f} ms   verify+rollback {t * 1e3:7.2f} ms   rollback {(t - v) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
