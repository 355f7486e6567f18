"""launch/multinode.sh across two hosts for real: two network namespaces joined by a veth pair, one
torchrun agent in each, gloo over the veth. The example trains across them and saves a checkpoint
(fixed node ranks), continues across them (elastic c10d rendezvous), then resumes on one host at
world size 1 — O2's sharded FP32 masters reshard from 2 ranks to 1.

Needs root (CAP_NET_ADMIN) and iproute2 (installed by scripts/system-deps.sh where apt-get can);
skips naming what is missing. The namespaces, and everything running in them, are removed when
the test ends, passed or failed."""

import os
import signal
import subprocess
from pathlib import Path

import netns
import pytest
from netns import Host

import distamp
from distamp import plot

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--size", "tiny", "--seq-len", "32", "--batch-size", "2", "--data-mb", "0.5"]
TINY += ["--opt-level", "O2", "--log-every", "2"]
ENV = {**os.environ, "SKIP_SETUP": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TIMEOUT_S = 240


@pytest.fixture
def two_hosts():
    with netns.two_hosts() as hosts:
        yield hosts


def on_hosts(tmp: Path, name: str, nodes: list[tuple[Host, list[str]]], train: list[str]) -> dict:
    """Run launch/multinode.sh on each host at once; each host's combined output."""
    procs = []
    for host, launch in nodes:
        log = open(tmp / f"{name}-{host.netns[-1]}.log", "w+")
        cmd = ["ip", "netns", "exec", host.netns, "bash", str(ROOT / "launch" / "multinode.sh")]
        cmd += [*launch, "--nproc", "1", "--", *train]
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=ENV,
            start_new_session=True,
        )
        procs.append((host, proc, log))
    outputs, failed = {}, []
    for host, proc, log in procs:
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for _, other, _ in procs:
                try:
                    os.killpg(other.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            code = "timeout"
        log.seek(0)
        outputs[host] = log.read()
        log.close()
        if code != 0:
            failed.append(f"--- {name} on {host.netns}: exit {code}\n{outputs[host][-4000:]}")
    assert not failed, "\n".join(failed)
    return outputs


def test_two_hosts_train_and_save_then_one_host_resumes_at_world_size_1(two_hosts, tmp_path):
    a, b = two_hosts
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    train = [*TINY, "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir), "--resume", "auto"]
    master = ["--nnodes", "2", "--master", a.addr]

    # Fixed membership: node ranks given, the store on host a; gloo on each host's veth.
    out = on_hosts(
        tmp_path,
        "static",
        [(a, [*master, "--node-rank", "0"]), (b, [*master, "--node-rank", "1"])],
        [*train, "--steps", "4"],
    )
    assert f"interface {a.iface} ({a.addr}) | backend gloo" in out[a]
    assert f"interface {b.iface} ({b.addr}) | backend gloo" in out[b]
    assert "world size 2" in out[a] and "step     4 | loss" in out[a], out[a]
    assert "GPT tiny" not in out[b] and "| loss" not in out[b]  # rank 1 prints nothing
    assert str(distamp.latest_checkpoint(ckpt)).endswith("step_000004")

    # Elastic: a c10d rendezvous hosted on a; both agents join and continue from step 4.
    rdzv = [*master, "--rdzv-id", f"job-{tmp_path.name}"]
    out = on_hosts(tmp_path, "elastic", [(a, rdzv), (b, rdzv)], [*train, "--steps", "6"])
    both = out[a] + out[b]
    assert "(this node)" in out[a] and "(this node)" not in out[b]
    assert "step_000004 (step 4)" in both and "world size 2" in both and "done: 6 steps" in both

    # Elastic, a worker killed: the rank on b dies at step 9; both agents restart their workers,
    # which meet again (they hung in init_process_group: the nodes' restart counts differ) and
    # resume from step 8.
    rdzv = [*master, "--rdzv-id", f"job2-{tmp_path.name}"]
    restart = [*train, "--steps", "10", "--save-every", "2", "--fail-at-step", "9"]
    out = on_hosts(tmp_path, "elastic restart", [(a, rdzv), (b, rdzv)], restart)
    both = out[a] + out[b]
    assert "injected failure at step 9" in both, both
    assert "step_000008 (step 8)" in both and "done: 10 steps" in both, both

    # One host alone: world size 1 loads the checkpoint two ranks wrote, and finishes.
    out = on_hosts(tmp_path, "single", [(b, [])], [*train, "--steps", "12"])
    assert "step_000010 (step 10)" in out[b] and "world size 1" in out[b]
    assert "done: 12 steps" in out[b], out[b]
    assert str(distamp.latest_checkpoint(ckpt)).endswith("step_000012")
    recorded = plot.read_run(run_dir)
    assert recorded.steps == list(range(1, 13))
    assert all(loss == loss and loss < 6.0 for loss in recorded.losses)  # finite, learning


def test_two_elastic_agents_on_one_machine_meet_over_loopback(tmp_path):
    """Trying the elastic job out on one machine (two "nodes" at --master 127.0.0.1): with an
    explicit is_host=1 on both agents the second failed to bind the store and the first waited
    out the 900 s rendezvous timeout (an audit). No namespaces needed."""
    run_dir = tmp_path / "run"
    train = [*TINY, "--steps", "2", "--run-dir", str(run_dir)]
    launch = ["--nnodes", "2", "--rdzv-id", "loopback", "--master", "127.0.0.1:29591"]
    procs = []
    for i in range(2):
        log = open(tmp_path / f"agent{i}.log", "w+")
        cmd = ["bash", str(ROOT / "launch" / "multinode.sh"), *launch, "--nproc", "1", "--"]
        procs.append(
            (
                subprocess.Popen(
                    [*cmd, *train],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=ENV,
                    start_new_session=True,
                ),
                log,
            )
        )
    outputs = []
    try:
        for proc, log in procs:
            code = proc.wait(timeout=TIMEOUT_S)
            log.seek(0)
            outputs.append(log.read())
            assert code == 0, outputs[-1][-4000:]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    assert sum("done: 2 steps" in out for out in outputs) == 1, outputs
    assert "world size 2" in "".join(outputs)


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (
            ["--nnodes", "0"],
            {},
            "--nnodes expects N or MIN:MAX (whole numbers >= 1, MIN <= MAX), got '0'",
        ),
        (["--nnodes", "2:1", "--rdzv-id", "j", "--master", "h"], {}, "got '2:1'"),
        (["--nnodes", "2", "--node-rank", "2", "--master", "h"], {}, "from 0 to 2 - 1"),
        (["--nproc", "two"], {}, "expected a whole number of ranks >= 1, got 'two'"),
        ([], {"OMP_NUM_THREADS": "abc"}, "OMP_NUM_THREADS: expected a whole number of threads"),
        (["--max-restarts", "-1"], {}, "--max-restarts expects a whole number >= 0, got '-1'"),
        (["--master", "127.0.0.1:99999"], {}, "a port number from 1 to 65535, got '99999'"),
        (
            ["--nnodes", "1:2", "--node-rank", "0"],
            {},
            "--nnodes 1:2 is a range (elastic membership): expected --rdzv-id ID with it",
        ),
        # the training script's own arguments: checked once, before torchrun starts a rank
        ([], {}, "--steps must be >= 1, got 0"),
        (["--", "--backend", "nccl"], {"NPROC": "64"}, "--backend nccl: expected a GPU per rank"),
    ],
    ids=[
        "nnodes-0",
        "min-above-max",
        "node-rank-past-the-end",
        "nproc-word",
        "omp-word",
        "max-restarts-negative",
        "port-past-65535",
        "range-with-node-rank",
        "training-argument",
        "nccl-without-gpus",
    ],
)
def test_launch_arguments_are_refused_by_name_before_anything_starts(args, env, says):
    """An audit: --nnodes 0 was reported as a missing --node-rank, --nnodes 2:1 and
    OMP_NUM_THREADS=abc reached torchrun (a traceback, or a rendezvous that never completes);
    later ones: --nnodes 1:2 with --node-rank waited for a node that cannot come, and --backend
    nccl without GPUs was refused once per rank and restarted by --max-restarts."""
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "multinode.sh"),
            *args,
            *([] if "--" in args else ["--"]),
            "--steps",
            "0" if says.startswith("--steps") else "1",
        ],
        capture_output=True,
        text=True,
        env={**ENV, **env},
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count(says) == 1, done.stderr  # once, not once per rank


def test_skip_setup_installs_nothing_and_a_python_without_torch_is_named(tmp_path):
    """SKIP_SETUP=1 is for nodes without the package index: scripts/test.sh still ran setup.sh's
    pip installs (an audit); and a launch on a Python without torch ended in a bare traceback."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')  # no torch, no pip, no ruff
    fake.chmod(0o755)
    env = {**ENV, "PYTHON": str(fake)}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh")], capture_output=True, text=True, env=env
    )
    assert done.returncode != 0  # the fake ruff failed: the script went past setup
    calls = log.read_text()
    assert "-m ruff check" in calls and "pip" not in calls, calls
    log.unlink()
    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "run.sh")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2, done.stderr
    assert f"expected torch importable by {fake}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "pip" not in log.read_text()


def test_a_master_port_in_use_is_refused_before_torchrun_starts():
    """Node rank 0 hosts the store on --master's port: one in use failed ~13 s later in a
    torchrun traceback (EADDRINUSE; an audit). No namespaces needed."""
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = ["bash", str(ROOT / "launch" / "multinode.sh"), "--nnodes", "1"]
        cmd += ["--master", f"127.0.0.1:{port}", "--", *TINY, "--steps", "2"]
        done = subprocess.run(
            cmd, env=ENV, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"127.0.0.1:{port}: expected the port free on node rank 0" in done.stderr, done.stderr
    assert "torch.distributed" not in done.stderr, done.stderr[-2000:]
