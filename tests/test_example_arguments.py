"""The example refuses contradictory or out-of-range flags by name, before any process group
(an audit's list: these used to fail deep inside torch, or were silently ignored)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_gpt import parse_args

BAD = {
    "negative threads": (["--threads", "-1"], "--threads must be >= 0"),
    "no data": (["--data-mb", "0"], "--data-mb must be > 0"),
    "negative lr": (["--lr=-1e-3"], "--lr must be a finite number > 0"),
    "infinite lr": (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    "negative fail-at-step": (["--fail-at-step", "-3"], "--fail-at-step must be >= 0"),
    "fail-at-step past the end": (
        ["--steps", "10", "--fail-at-step", "25"],
        "--fail-at-step 25: expected a step within --steps 10",
    ),
    "json a folder": (
        ["--json", str(Path(__file__).parent)],
        "expected a file path, found a folder",
    ),
    "json under a file": (["--json", str(Path(__file__) / "sum.json")], "found a file"),
    "reduce-scatter at O3": (["--reduce-scatter", "--opt-level", "O3"], "O3 has none"),
    "negative clip": (["--clip", "-1"], "--clip must be >= 0"),
    "negative weight decay": (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    "window longer than the data": (
        ["--seq-len", "600000", "--data-mb", "0.5"],
        "--seq-len 600000: expected fewer tokens per window than --data-mb 0.5",
    ),
    "reduce-scatter without a hook": (
        ["--reduce-scatter", "--no-comm-hook"],
        "--reduce-scatter is a comm hook",
    ),
    "shard-weights at O3": (["--shard-weights", "--opt-level", "O3"], "--shard-weights shards"),
    "negative save-every": (["--save-every", "-1"], "--save-every must be >= 0"),
    "clip nan": (["--clip", "nan"], "--clip must be >= 0, got nan"),
    "ckpt-dir a file": (["--ckpt-dir", __file__], "expected a directory, found a file"),
    "ckpt-dir under a file": (
        ["--ckpt-dir", str(Path(__file__) / "ckpt")],
        "expected a directory, found a file",
    ),
    "resume from a missing path": (
        ["--resume", "/nonexistent/step_000010"],
        "--resume /nonexistent/step_000010: expected 'auto', 'none' or a checkpoint folder, "
        "found nothing at that path",
    ),
    "resume from a file": (["--resume", __file__], "found a file"),
    "no steps": (["--steps", "0"], "--steps must be >= 1, got 0"),
    "negative plot-every": (["--plot-every", "-1"], "--plot-every must be >= 0, got -1"),
    "reduce-scatter at O1 unsharded": (
        ["--reduce-scatter", "--opt-level", "O1"],
        "add --shard-weights",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_flag_is_refused_by_name(name, capsys):
    argv, message = BAD[name]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_good_combinations_parse():
    assert parse_args(["--reduce-scatter", "--opt-level", "O1", "--shard-weights"]).shard_weights
    assert parse_args(["--keep", "0", "--clip", "0", "--threads", "0"]).keep == 0


def test_ckpt_dir_to_be_made_under_a_writable_folder_parses(tmp_path):
    assert parse_args(["--ckpt-dir", str(tmp_path / "runs" / "a")]).ckpt_dir is not None


@pytest.mark.parametrize("script", ["train_gpt.py", "train_gpt_fsdp.py"])
def test_check_args_refuses_a_bad_value_and_passes_a_good_one_without_a_process_group(script):
    """launch/common.sh's check_args runs this once before torchrun starts any rank. An audit:
    the FSDP example took --clip nan (clipping silently off: ``nan < 0`` is False)."""
    import os
    import subprocess

    path = Path(__file__).resolve().parents[1] / "examples" / script
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def check(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(path), *args, "--check-args"]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    bad = check("--clip", "nan")
    assert bad.returncode == 2 and "--clip" in bad.stderr and "nan" in bad.stderr, bad.stderr
    good = check("--steps", "3")
    assert good.returncode == 0 and not good.stdout, good.stdout + good.stderr
    if script == "train_gpt.py":  # exited 1 (a SystemExit with a message), not 2 (an audit)
        import torch

        if not torch.cuda.is_available():
            nccl = check("--backend", "nccl")
            assert nccl.returncode == 2 and "expected a GPU per rank" in nccl.stderr, nccl


def test_a_ckpt_dir_that_cannot_be_made_is_refused_before_training(tmp_path, capsys):
    """As root, os.access said /proc/x was writable: the run trained, then failed at its first
    save (an audit). The folder is made and written in (every rank at once: none removes it)."""
    with pytest.raises(SystemExit):
        parse_args(["--ckpt-dir", "/proc/distamp-ckpt"])
    assert "--ckpt-dir /proc/distamp-ckpt: expected a writable directory" in capsys.readouterr().err
    parse_args(["--ckpt-dir", str(tmp_path / "a" / "b"), "--run-dir", "none"])
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == []  # made, the probe gone


def test_an_uncommitted_step_folder_in_ckpt_dir_is_refused_before_training(tmp_path, capsys):
    """save_checkpoint refused it at step 3, after training up to it, and torchrun's restarts
    trained up to it again each time (an audit)."""
    (tmp_path / "step_000003").mkdir()
    (tmp_path / "step_000003" / "__0_0.distcp").write_bytes(b"cut short")
    (tmp_path / "step_000006").mkdir()  # empty: save_checkpoint takes it
    (tmp_path / "step_000009.incomplete-host-1-2").mkdir()  # a killed save's: cleaned at save
    with pytest.raises(SystemExit):
        parse_args(["--ckpt-dir", str(tmp_path), "--run-dir", "none"])
    err = capsys.readouterr().err
    assert "found ['step_000003'] without a COMMIT file" in err


def test_a_second_run_in_the_same_folder_is_refused_naming_the_first(tmp_path, capsys):
    """Two runs in one --ckpt-dir/--run-dir both ran to "done", pruning and overwriting each
    other's checkpoints and interleaving metrics.jsonl (an audit). Rank 0 holds a lock."""
    import argparse

    import torch
    from train_gpt import hold_run_dirs

    args = argparse.Namespace(ckpt_dir=tmp_path, run_dir=tmp_path)  # one folder for both
    first = hold_run_dirs(args, 0, torch.device("cpu"))
    assert len(first) == 1
    with pytest.raises(SystemExit) as stopped:
        hold_run_dirs(argparse.Namespace(ckpt_dir=None, run_dir=tmp_path), 0, torch.device("cpu"))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"--run-dir {tmp_path}: expected no other run using it, found pid {os.getpid()}" in err
    for lock in first:
        lock.close()
    again = hold_run_dirs(args, 0, torch.device("cpu"))  # released with its file
    assert len(again) == 1
    again[0].close()


@pytest.mark.parametrize("script", ["run.sh", "elastic.sh", "run_fsdp.sh"])
def test_the_launch_scripts_refuse_a_folder_in_use_before_torchrun(tmp_path, script):
    """An audit: the refusal came from inside the ranks, so run.sh exited with torchrun's 1 after
    a ChildFailedError traceback, and elastic.sh restarted it as a crash until the first run
    ended — then went on from that run's checkpoints, exit 0. --check-args tries the lock."""
    import argparse
    import subprocess

    import torch
    from train_gpt import hold_run_dirs

    root = Path(__file__).resolve().parents[1]
    held = hold_run_dirs(
        argparse.Namespace(ckpt_dir=tmp_path, run_dir=None), 0, torch.device("cpu")
    )
    env = {**os.environ, "SKIP_SETUP": "1", "PYTHON": sys.executable, "CKPT": str(tmp_path)}
    env["FAIL_AT"] = "0"
    flags = ["--size", "micro", "--steps", "4", "--run-dir", str(tmp_path / "run")]
    if script != "elastic.sh":
        flags += ["--ckpt-dir", str(tmp_path)]
    try:
        done = subprocess.run(
            ["bash", str(root / "launch" / script), *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for lock in held:
            lock.close()
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--ckpt-dir {tmp_path}: expected no other run using it, found pid {os.getpid()}" in (
        done.stderr
    )
    assert "ChildFailedError" not in done.stderr and "torch.distributed.run" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before anything ran


def test_a_checkpoint_the_flags_cannot_load_is_refused_before_training(tmp_path, capsys):
    """Trained with --opt-level O2 --half-dtype fp16, resumed with the defaults: auto kept O2
    but built bf16 weights, and every rank refused the checkpoint with exit code 1 — at every
    attempt under --max-restarts; --resume at the folder of checkpoints likewise (an audit).
    The checkpoint's half dtype is kept by auto; flags it cannot load with exit 2 at once."""
    import torch
    from train_gpt import GPT, SIZES, GPTConfig, pick_opt_level, saved_precision

    import distamp

    model = GPT(GPTConfig(block_size=16, **SIZES["micro"]))
    opt = torch.optim.AdamW(model.parameters())
    model, opt = distamp.wrap(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    with distamp.scale_loss(sum(p.float().sum() for p in model.parameters()), opt) as scaled:
        scaled.backward()
    opt.step()
    distamp.save_checkpoint(tmp_path / "step_000002", model, opt, extra={"step": 2})
    common = ["--ckpt-dir", str(tmp_path), "--run-dir", "none", "--size", "micro"]
    common += ["--seq-len", "16"]
    for flags, message in (
        (["--half-dtype", "bf16"], "holds fp16 weights (O2); expected --half-dtype fp16"),
        (["--opt-level", "O1"], "was saved at O2; expected --opt-level O2 (or auto"),
        (["--resume", str(tmp_path)], "expected a committed distamp checkpoint"),
        # another model: every rank failed in load_checkpoint, retried by --max-restarts
        (["--size", "tiny"], "the checkpoint resumed from"),
        (["--seq-len", "32"], "expected the run's sizes (--size micro --seq-len 16)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(common + flags)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, flags
    assert parse_args([*common, "--half-dtype", "fp16"]).half_dtype == "fp16"
    assert saved_precision(str(tmp_path / "step_000002")) == ("O2", "fp16")
    level, why = pick_opt_level(
        "auto",
        torch.device("cpu"),
        "auto",
        2,
        bf16_units=True,
        resume_level="O2",
        resume_half="fp16",
    )
    assert level == "O2" and "bf16 units" not in why, why
    assert "the level of the checkpoint resumed from" in why and "fp16 matmul runs" in why, why
