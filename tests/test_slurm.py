"""launch/slurm.sbatch against a real Slurm: slurmctld and two slurmd daemons (nodes dn1 and dn2,
each in its own network namespace, see netns.py), munge for authentication, a minimal slurm.conf.

The job trains across both nodes with the rendezvous on the first node of $SLURM_JOB_NODELIST; it
is requeued (``scontrol requeue``) once its first checkpoint exists, and the requeued run resumes
from the newest checkpoint and finishes. Needs root and Debian's slurmctld/slurmd/slurm-client/
munge (scripts/system-deps.sh installs them where apt-get can); where Slurm cannot start here the
test skips with the error Slurm printed."""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import netns
import pytest
from netns import Host

import distamp
from distamp import plot

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["--size", "tiny", "--seq-len", "32", "--batch-size", "2", "--data-mb", "0.5"]
TRAIN += ["--opt-level", "O2", "--log-every", "4", "--save-every", "4", "--steps", "24"]
DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
START_TIMEOUT_S = 60
JOB_TIMEOUT_S = 300

SLURM_CONF = """\
ClusterName=distamptest
SlurmctldHost={host}({ctld_addr})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={state}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=dn1 NodeAddr={addr1} CPUs={cpus} RealMemory=1000 State=UNKNOWN
NodeName=dn2 NodeAddr={addr2} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=dn[1-2] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    head: Host
    conf: Path
    state: Path

    def run(self, *cmd: str, **kwargs) -> subprocess.CompletedProcess[str]:
        """A Slurm client command, from the first node's namespace (where slurmctld listens)."""
        env = {**os.environ, **kwargs.pop("env", {}), "SLURM_CONF": str(self.conf)}
        return subprocess.run(
            [*self.head.nsenter, *cmd], capture_output=True, text=True, env=env, **kwargs
        )

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def errors(self) -> str:
        """The error lines Slurm and munge logged, for a skip or a failure message."""
        lines = []
        for log in sorted((self.state / "log").glob("*")):
            lines += [f"{log.name}: {x}" for x in log.read_text().splitlines() if "error" in x]
        return "\n".join(lines[-12:]) or "(no error lines logged)"


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def slurm():
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root (slurmd starts jobs as any user)")
    subprocess.run(["bash", str(ROOT / "scripts" / "system-deps.sh")], check=False)
    missing = [d for d in DAEMONS if not (shutil.which(d) or Path(f"/usr/sbin/{d}").exists())]
    if missing:
        pytest.skip(f"Slurm is not installed and could not be installed: no {', '.join(missing)}")
    with netns.two_hosts() as (a, b):
        # A short path: the munge socket's must fit in 108 bytes.
        state = Path(tempfile.mkdtemp(prefix="dslurm-"))
        procs: list[subprocess.Popen] = []
        try:
            for sub in ("munge", "ctld", "spool/dn1", "spool/dn2", "log"):
                (state / sub).mkdir(parents=True)
            (state / "munge").chmod(0o711)
            key = state / "munge" / "munge.key"
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
            sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
            munge = [sbin("munged"), "-F", "--force", f"--socket={state}/munge/munge.sock"]
            munge += [f"--key-file={key}", f"--pid-file={state}/munge/munged.pid"]
            munge += [f"--log-file={state}/log/munged.log", f"--seed-file={state}/munge/seed"]
            procs.append(start(munge, state / "log" / "munged.out"))
            conf = state / "slurm.conf"
            conf.write_text(
                SLURM_CONF.format(
                    host=socket.gethostname().split(".")[0],
                    ctld_addr=a.addr,
                    addr1=a.addr,
                    addr2=b.addr,
                    state=state,
                    cpus=os.cpu_count() or 1,
                )
            )
            cluster = Cluster(head=a, conf=conf, state=state)
            time.sleep(0.5)  # the munge socket
            procs.append(
                start(
                    [*a.nsenter, sbin("slurmctld"), "-D", "-f", str(conf)],
                    state / "log" / "ctld.out",
                )
            )
            for host, node in ((a, "dn1"), (b, "dn2")):
                cmd = [*host.nsenter, sbin("slurmd"), "-D", "-N", node, "-f", str(conf)]
                procs.append(start(cmd, state / "log" / f"{node}.out"))
            deadline = time.monotonic() + START_TIMEOUT_S
            states = ""
            while time.monotonic() < deadline:
                states = cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
                if states.count("idle") == 2:
                    break
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.5)
            else:
                pytest.skip(f"Slurm did not bring up its 2 nodes ({states!r}):\n{cluster.errors()}")
            if states.count("idle") != 2:
                dead = [p.args for p in procs if p.poll() is not None]
                pytest.skip(f"Slurm cannot run here ({dead} exited):\n{cluster.errors()}")
            yield cluster
        finally:
            for proc in procs:
                with_group = proc.pid
                try:
                    os.killpg(with_group, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(with_group, signal.SIGKILL)
                    proc.wait()
            shutil.rmtree(state, ignore_errors=True)


def wait_for(cluster: Cluster, job_id: str, done, what: str) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    job: dict[str, str] = {}
    while time.monotonic() < deadline:
        job = cluster.job(job_id)
        if done(job):
            return job
        if job.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.25)
    raise AssertionError(f"job {job_id}: waiting for {what}, found {job}\n{cluster.errors()}")


def test_sbatch_trains_on_two_nodes_and_a_requeued_job_resumes(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = {"SKIP_SETUP": "1", "NPROC": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["RUN_DIR"] = str(run_dir)
    log = tmp_path / "slurm-%j.out"
    submitted = slurm.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        f"--output={log}",
        "launch/slurm.sbatch",
        *TRAIN,
        cwd=ROOT,
        env=env,
    )
    assert submitted.returncode == 0, submitted.stderr + slurm.errors()
    job_id = submitted.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job_id}.out"

    # Requeue it (what preemption or the time-limit signal does) once it has a checkpoint.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while distamp.latest_checkpoint(run_dir) is None:
        state = slurm.job(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, log.read_text())
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.25)
    requeued = slurm.run("scontrol", "requeue", job_id)
    assert requeued.returncode == 0, requeued.stderr

    def finished_after_requeue(job: dict[str, str]) -> bool:
        if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":
            slurm.run("scontrol", "update", f"jobid={job_id}", "starttime=now")  # no 2 min wait
        return job.get("JobState") == "COMPLETED" and job.get("Restarts") == "1"

    wait_for(slurm, job_id, finished_after_requeue, "the requeued run to complete")
    out = log.read_text()
    first, _, second = out.partition(f"job {job_id} (restart 1)")
    assert second, out
    # The first run: one torchrun agent per node, the rendezvous on dn1, gloo over each veth.
    head = slurm.head.addr
    assert f"nodes dn[1-2] | rendezvous dn1 ({head}:" in first, first
    assert f"elastic rendezvous {job_id}-0, nodes 2 | master {head}:" in first
    assert first.count("multinode.sh:") == 2 and "(this node)" in first
    assert "world size 2" in first
    # The requeued run resumes from the newest checkpoint and finishes.
    assert re.search(r"resumed from \S+/step_\d+ \(step \d+\)", second), second
    assert "world size 2" in second and "done: 24 steps" in second, second
    assert str(distamp.latest_checkpoint(run_dir)).endswith("step_000024")
    assert plot.read_run(run_dir).steps == list(range(1, 25))
    assert (run_dir / "metrics.png").is_file()
