"""The launch scripts' own handling, as users run them: ``--help`` answered without installing
first, and ``MASTER_PORT`` giving the one-node scripts (run.sh, run_fsdp.sh, elastic.sh) their
rendezvous port instead of torchrun --standalone's pick (launch/common.sh)."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--size", "tiny", "--seq-len", "32", "--batch-size", "2", "--data-mb", "0.5"]
TINY += ["--opt-level", "O0"]
ENV = {
    **os.environ,
    "SKIP_SETUP": "1",
    "PYTHON": sys.executable,
    "NPROC": "2",
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
}
ENV.pop("MASTER_PORT", None)
PORTS = iter(range(33430, 33440))  # this file's ports, one per launch


def launch(script: str, *args: str, env: dict[str, str] = ENV, cwd: Path = ROOT):
    return subprocess.run(
        ["bash", str(cwd / "launch" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def checkout_with_a_fake_setup(tmp_path: Path) -> Path:
    """The launch scripts and examples, with a scripts/setup.sh that only leaves a mark: the real
    one is a pip install (and re-points the machine's editable install)."""
    shutil.copytree(ROOT / "launch", tmp_path / "launch")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text("echo ran >> setup-ran\n")
    return tmp_path


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("run.sh", ["--help"]),
        ("run_fsdp.sh", ["-h"]),
        ("elastic.sh", ["--size", "tiny", "--help"]),
        ("multinode.sh", ["--", "--help"]),  # its own options' --help is answered before
    ],
)
def test_help_is_answered_without_running_setup(checkout_with_a_fake_setup, script, args):
    """An audit: ``bash launch/run.sh --help`` ran scripts/setup.sh, a pip install, first."""
    root = checkout_with_a_fake_setup
    env = {k: v for k, v in ENV.items() if k != "SKIP_SETUP"}
    env["MASTER_PORT"] = str(next(PORTS))  # multinode.sh's node rank 0 checks it is free
    done = launch(script, *args, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--check-args" in done.stdout and "usage:" in done.stdout  # the example's help
    assert not (root / "setup-ran").exists()


def test_without_help_setup_still_runs_first(checkout_with_a_fake_setup):
    root = checkout_with_a_fake_setup
    env = {k: v for k, v in ENV.items() if k != "SKIP_SETUP"}
    done = launch("run.sh", "--size", "nonsense", env=env, cwd=root)
    assert done.returncode == 2 and "invalid choice: 'nonsense'" in done.stderr, done.stderr
    assert (root / "setup-ran").read_text() == "ran\n"


@pytest.mark.parametrize("script", ["run.sh", "run_fsdp.sh", "elastic.sh"])
@pytest.mark.parametrize("port", ["http", "0", "65536", "-1", "29500x"])
def test_a_bad_master_port_is_one_message_and_exit_2(tmp_path, script, port):
    env = {**ENV, "MASTER_PORT": port, "CKPT": str(tmp_path)}
    done = launch(script, *TINY, "--run-dir", str(tmp_path / "run"), env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    message = f"MASTER_PORT: expected a port number from 1 to 65535, got '{port}'\n"
    assert done.stderr == message
    assert not (tmp_path / "run").exists()


def test_a_master_port_in_use_is_refused_before_torchrun(tmp_path):
    port = next(PORTS)
    with socket.socket() as held:
        held.bind(("", port))
        held.listen()
        done = launch(
            "run.sh", *TINY, "--run-dir", str(tmp_path), env={**ENV, "MASTER_PORT": str(port)}
        )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"MASTER_PORT: expected port {port} free on 127.0.0.1" in done.stderr
    assert "Traceback" not in done.stderr and "torch.distributed.run" not in done.stderr


def _listening(port: int) -> bool:
    """Whether a TCP socket of this machine listens on ``port`` (read, not connected to)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
@pytest.mark.parametrize("script", ["run.sh", "elastic.sh"])
def test_a_master_port_is_where_the_two_rank_run_meets(tmp_path, script):
    """elastic.sh with an injected failure: the restarted attempt meets at the same port."""
    port = next(PORTS)
    assert not _listening(port)
    env = {**ENV, "MASTER_PORT": str(port), "CKPT": str(tmp_path / "ckpt"), "FAIL_AT": "3"}
    args = [*TINY, "--steps", "4", "--log-every", "4"]
    args += ["--save-every", "2"] if script == "elastic.sh" else ["--run-dir", "none"]
    proc = subprocess.Popen(
        ["bash", str(ROOT / "launch" / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    seen = False
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen = seen or _listening(port)
        time.sleep(0.05)
    proc.kill()
    out = proc.communicate()[0]
    assert proc.returncode == 0, out[-3000:]
    assert seen, f"nothing listened on {port}"
    assert "world size 2" in out and "done: 4 steps" in out
    if script == "elastic.sh":
        assert "injected failure at step 3" in out and "(step 2)" in out
