#!/usr/bin/env bash
# Installs everything distamp's example and tests need, on a fresh machine or an existing one.
# torch is pinned first: an unpinned requirement would pull the newest CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e '.[test]'
# CI only: the system packages the launch tests use (iproute2, a local Slurm), when missing and
# apt-get can install them; never fatal (those tests skip, naming what is missing).
if [[ "${CI:-}" == true ]]; then
    bash scripts/system-deps.sh
fi
