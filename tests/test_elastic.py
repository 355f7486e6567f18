"""The elastic example end to end: torchrun restarts a job whose rank was SIGKILLed, the script
resumes from distamp.latest_checkpoint, and the result equals an uninterrupted run bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import distamp
from distamp.checkpoint import consolidate, consolidate_optimizer_state

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--size", "tiny", "--steps", "8", "--save-every", "4", "--seq-len", "32"]
ARGS += ["--batch-size", "2", "--data-mb", "0.5", "--log-every", "8", "--threads", "1"]


def torchrun(tmp: Path, name: str, *extra: str) -> dict:
    summary = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [*extra, str(ROOT / "examples" / "train_gpt.py"), *ARGS]
    cmd += ["--ckpt-dir", str(tmp / name), "--json", str(summary)]
    if extra:
        cmd += ["--fail-at-step", "6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"stdout": run.stdout, **json.loads(summary.read_text())}


def test_killed_rank_restarts_and_resumes_bit_exactly(tmp_path):
    interrupted = torchrun(tmp_path, "interrupted", "--max-restarts=1")
    assert "injected failure at step 6" in interrupted["stdout"]
    assert (
        "resumed from" in interrupted["stdout"] and "step_000004 (step 4)" in interrupted["stdout"]
    )
    assert interrupted["first_step"] == 5
    straight = torchrun(tmp_path, "straight")
    assert straight["first_step"] == 1
    assert interrupted["final_loss"] == straight["final_loss"]
    a = distamp.latest_checkpoint(tmp_path / "interrupted")
    b = distamp.latest_checkpoint(tmp_path / "straight")
    assert (
        a is not None and b is not None and a.endswith("step_000008") and b.endswith("step_000008")
    )
    weights_a = consolidate(a)
    for key, value in consolidate(b).items():
        assert torch.equal(weights_a[key], value), key
    state_a, state_b = consolidate_optimizer_state(a), consolidate_optimizer_state(b)
    for name, per in state_b.items():
        for k, v in per.items():
            other = state_a[name][k]
            assert torch.equal(other, v) if isinstance(v, torch.Tensor) else other == v, (name, k)
    # --keep 2: older checkpoints were removed after each save.
    assert sorted(p.name for p in (tmp_path / "interrupted").iterdir()) == [
        "step_000004",
        "step_000008",
    ]
