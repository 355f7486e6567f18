"""The elastic example end to end: torchrun restarts a job whose rank was SIGKILLed, the script
resumes from distamp.latest_checkpoint, and the result equals an uninterrupted run bit for bit."""

import json
import os
import subprocess
import sys
import time
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
    assert sorted(p.name for p in (tmp_path / "interrupted").glob("step_*")) == [
        "step_000004",
        "step_000008",
    ]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and f"\nPPid:\t{pid}\n" in status:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


def test_workers_leave_when_torchrun_itself_is_killed(tmp_path):
    """torchrun's agent SIGKILLed (the OOM killer, kill -9): its workers kept training and
    saving into --ckpt-dir, racing the relaunch's --resume auto (an audit). They leave now."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(ROOT / "examples" / "train_gpt.py"), *ARGS[:2], "--steps", "100000", *ARGS[4:]]
    cmd += ["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    agent = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    workers: list[int] = []
    try:
        assert agent.stdout is not None
        for line in agent.stdout:  # the first progress line: the workers train
            if "step" in line and "loss" in line:
                break
        workers = _children(agent.pid)
        _kill_the_agent_and_see_its_workers_leave(agent, workers, within_s=30)
    finally:
        agent.kill()
        for pid in filter(_alive, workers):
            os.kill(pid, 9)


def _kill_the_agent_and_see_its_workers_leave(
    agent: subprocess.Popen, workers: list[int], within_s: float
) -> None:
    assert len(workers) == 2, workers
    agent.kill()
    agent.wait(timeout=30)
    deadline = time.monotonic() + within_s
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, workers)), "workers outlived their torchrun agent"


def _workers(agent: int) -> list[int]:
    """The agent's training ranks (not launch/common.sh's argument check)."""
    found = []
    for pid in _children(agent):
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train_gpt.py") for a in cmdline) and b"--check-args" not in cmdline:
            found.append(pid)
    return found


def test_workers_leave_when_torchrun_is_killed_while_they_start(tmp_path):
    """The agent SIGKILLed while its workers still import torch: they found the init process as
    their parent already, never saw the agent go, and waited out the store's timeout (an audit:
    8.5 minutes and counting). launch/ scripts name the agent (DISTAMP_LAUNCHER_PID)."""
    cmd = ["bash", str(ROOT / "launch" / "run.sh"), *ARGS[:2], "--steps", "100000", *ARGS[4:]]
    cmd += ["--run-dir", "none"]
    env = {**os.environ, "SKIP_SETUP": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    agent = subprocess.Popen(  # run.sh execs torchrun: this pid is the agent's
        cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = _workers(agent.pid)
            time.sleep(0.02)
        # at once: the workers have not imported torch yet
        _kill_the_agent_and_see_its_workers_leave(agent, workers, within_s=60)
    finally:
        agent.kill()
        for pid in filter(_alive, workers):
            os.kill(pid, 9)
