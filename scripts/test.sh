#!/usr/bin/env bash
# The test command: install, lint, type-check, then the whole suite (multi-rank tests on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then  # nodes without the package index (README)
    bash scripts/setup.sh
fi
PY=${PYTHON:-python3}
LINTED=$(ls -d distamp tests examples benchmarks launch 2>/dev/null | tr '\n' ' ')
"$PY" -m ruff check $LINTED
"$PY" -m ruff format --check $LINTED
"$PY" -m mypy
# -n 2: two pytest workers on the two cores; each multi-rank test spawns its own gloo ranks.
"$PY" -m pytest -n 2 --dist loadgroup --durations=15 "$@"
