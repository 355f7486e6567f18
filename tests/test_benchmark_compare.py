"""benchmarks/compare.py --quick as a smoke test: every configuration of the FP32-compute set trains
(its loss goes down) and lands in the table with its floor; over an emulated two-node cluster
(network namespaces, tc-shaped links) where this machine allows it, else on loopback. The timings
themselves are the benchmark's business, not the suite's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import FP32_CONFIGS  # noqa: E402


def can_build_a_cluster() -> bool:
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc", "nsenter"))


def test_quick_compare_trains_every_row_and_reports_the_floor(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "system-deps.sh"), "iproute2"], check=False)
    cluster = can_build_a_cluster()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--quick", "--compute", "fp32"]
    cmd += ["--out-dir", str(tmp_path)]
    if cluster:
        cmd += ["--nodes", "2", "--link", "1gbit"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stem = "compare-w1-2nodes-1gbit-quick" if cluster else "compare-w1-quick"
    summary = json.loads((tmp_path / f"{stem}.json").read_text())
    assert summary["compute"] == "fp32" and "GFLOP/s" in summary["why"]
    rows = {r["config"]: r for r in summary["rows"]}
    assert list(rows) == FP32_CONFIGS
    for name, row in rows.items():
        if name.startswith("DeepSpeed") and "skipped" in row:
            assert "deepspeed" in row["skipped"].lower()  # an optional extra
            continue
        assert "skipped" not in row, (name, row)
        assert row["median_s"] > 0 and row["final_loss"] < row["first_loss"], (name, row)
    # 16-bit rows put half the bytes of FP32 DDP on the wire.
    assert rows["distamp O0 + hook"]["wire_mb"] * 2 == rows["FP32 DDP"]["wire_mb"]
    # Sharded FP32 weights hold 12/N bytes per parameter of FP32 copies + AdamW state, not 8.
    for name in rows:
        if name.startswith("distamp O0 sharded"):
            assert rows[name]["held_mb"] < 0.8 * rows["distamp O0 + hook"]["held_mb"], name
    floor = summary["floor"]
    assert floor["floor_s"] == max(floor["compute_s"], floor["wire_s"]) > 0
    assert (floor["wire_s"] > 0) is cluster
    table = (tmp_path / f"{stem}.md").read_text()
    assert "| configuration | median step s |" in table and "vs floor" in table
    assert table.count("\n| ") == len(FP32_CONFIGS) + 1  # the header and one line per row
