#!/usr/bin/env bash
# Run the test suite with the fast BLAS preloaded (Linux) and no model-hub access.
# The first command on a fresh clone too: without a working .venv it runs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import mlxspec, pytest, xdist" >/dev/null 2>&1; then
  echo "test: no working .venv (mlxspec, pytest and pytest-xdist not importable); running scripts/setup.sh first" >&2
  scripts/setup.sh
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
lib=$(.venv/bin/python -m mlxspec.blas || true)
if [[ -n "$lib" ]]; then export LD_PRELOAD="$lib${LD_PRELOAD:+ $LD_PRELOAD}"; fi
# two workers (pytest-xdist; MLXSPEC_TEST_WORKERS=0 runs in one process): most tests wait on one core's
# forward or on a subprocess, so two halve the wall time on this 2-core machine (11.5 against 23.5 min)
exec .venv/bin/python -m pytest -q -n "${MLXSPEC_TEST_WORKERS:-2}" --durations=25 "$@"  # the slowest 25 listed: the suite must stay under ~20 min
