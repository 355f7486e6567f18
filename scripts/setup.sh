#!/usr/bin/env bash
# Installs everything distamp's example and tests need, on a fresh machine or an existing one.
# torch is pinned first: an unpinned requirement would pull the newest CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
# The project, unless this very checkout is installed already with the test extra: every launch
# sources this, and reinstalling each time needed the package index at every start and re-pointed
# a global editable install at whichever checkout launched last (an audit). -I: not the working
# directory's distamp, the installed one.
if ! "$PY" -I - "$PWD" <<'EOF' 2>/dev/null; then
import sys
from importlib.util import find_spec
from pathlib import Path
if not all(find_spec(m) for m in ("pytest", "xdist", "mypy", "ruff")):  # the [test] extra
    sys.exit(1)
spec = find_spec("distamp")
here = Path(sys.argv[1]).resolve()
sys.exit(0 if spec and spec.origin and Path(spec.origin).resolve().parents[1] == here else 1)
EOF
    "$PY" -m pip install --quiet --disable-pip-version-check -e '.[test]'
fi
# CI only: the system packages the launch tests use (iproute2, a local Slurm), when missing and
# apt-get can install them; never fatal (those tests skip, naming what is missing).
if [[ "${CI:-}" == true ]]; then
    bash scripts/system-deps.sh
fi
