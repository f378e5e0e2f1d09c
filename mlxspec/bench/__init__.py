"""`mlxspec bench`: mlx_lm vs mlxspec autoregressive vs mlxspec speculative, in ONE process.

Configurations, each run on the same prompts at each temperature:
- `mlx_lm AR`: mlx_lm's own `stream_generate` on the same weights, written once as an MLX
  directory (`convert_to_mlx`; dense float32 on the CPU, where mlxspec computes dense
  float32; the quantized repack on Metal/CUDA) and cached under the mlxspec cache dir;
- `mlxspec AR`: `generate_steps` without a drafter;
- one row per drafter (`--draft`, default: the shipped DSpark and DFlash drafters) and for
  `--draft-simple`: `generate_steps` with that drafter.

Numbers (all measured in the run):
- tokens/s: per prompt, (generated tokens - 1) / time from the first token (the prefill's)
  to the last, i.e. prefill excluded; median over `--repeats`; then the mean over the
  prompts of the category ("all": over every prompt). Generation stops at EOS (both
  engines; `--ignore-eos` always generates `--max-tokens`);
- x AR: tokens/s over mlxspec AR's (same temperature, same category);
- tau (tokens per target forward, bonus included), acceptance, per-position acceptance,
  mean verify length, draft / verify share of the step time: merged over prompts and repeats;
- ideal speedup = tau * t(1) / t(mean verify length), t(L) the time of one target forward
  over L tokens, measured here (`measure_verify_sps`) at the mean context of the run
  (mean prompt length + max_tokens / 2); efficiency = measured speedup / ideal;
- peak memory: `mx.get_peak_memory()`, reset per (configuration, temperature); resident
  weights included (each configuration holds only its own models).

The package: `settings` (flags, checks), `runners` (the engines, timing), `summary` (rows),
`report` (Markdown, plots), `run` (the command).
"""

from mlxspec.bench.run import cmd_bench
from mlxspec.bench.runners import BackgroundLoad, mlx_lm_dir
from mlxspec.bench.settings import add_bench_args

__all__ = ["BackgroundLoad", "add_bench_args", "cmd_bench", "mlx_lm_dir"]
