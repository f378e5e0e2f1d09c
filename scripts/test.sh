#!/usr/bin/env bash
# Run the test suite with the fast BLAS preloaded (Linux) and no model-hub access.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
lib=$(.venv/bin/python -m mlxspec.blas || true)
if [[ -n "$lib" ]]; then export LD_PRELOAD="$lib${LD_PRELOAD:+ $LD_PRELOAD}"; fi
exec .venv/bin/python -m pytest -q "$@"
