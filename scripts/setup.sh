#!/usr/bin/env bash
# One-step set-up of mlxspec in ./.venv (Linux CPU/CUDA or macOS).
# On Linux it also installs Debian's OpenBLAS (MLX's CPU wheel links reference BLAS,
# ~60x slower matmul; mlxspec preloads OpenBLAS automatically when present) and the
# corpora `mlxspec train` reads by default (python3.11-doc reST sources, fortunes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRA=${MLXSPEC_EXTRA:-}
if [[ "$(uname)" == "Linux" ]]; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  if command -v apt-get >/dev/null; then
    need=()
    for p in libopenblas0-pthread python3.11-doc fortunes; do
      dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
    done
    if ((${#need[@]})); then
      echo "setup: installing ${need[*]} (apt)"
      $SUDO apt-get update -qq || true
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
    fi
  else
    echo "setup: warning: no apt-get; install OpenBLAS yourself and set MLXSPEC_OPENBLAS=/path/libopenblas.so" >&2
  fi
  EXTRA=${EXTRA:-cpu}
fi
[[ -d .venv ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
spec="."
[[ -n "$EXTRA" ]] && spec=".[$EXTRA,server,plot,test]" || spec=".[server,plot,test]"
.venv/bin/python -m pip install -q -e "$spec"
echo "setup: done. Run: .venv/bin/mlxspec generate --prompt \"...\""
