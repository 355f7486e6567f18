#!/usr/bin/env bash
# The test command: install, lint, type-check, then the whole suite (multi-rank tests on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check distamp tests examples benchmarks
"$PY" -m ruff format --check distamp tests examples benchmarks
"$PY" -m mypy
# -n 2: two pytest workers on the two cores; each multi-rank test spawns its own gloo ranks.
"$PY" -m pytest -n 2 --durations=15 "$@"
