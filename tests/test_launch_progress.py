"""The example's progress, metrics and picture, the way a user sees them: a tqdm bar on a terminal,
plain lines in a log file, nothing from other ranks, runs/NAME/metrics.jsonl and metrics.png, and
``python -m distamp.plot`` redrawing it."""

import json
import math
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from distamp import plot

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_gpt.py"
TINY = ["--size", "tiny", "--seq-len", "32", "--batch-size", "2", "--data-mb", "0.5"]
TINY += ["--threads", "1", "--opt-level", "O0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
    ]


def run(cmd: list[str], cwd: Path, env: dict[str, str] = ENV) -> str:
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_help_explains_every_flag_with_its_default():
    for script in (SCRIPT, ROOT / "examples" / "train_gpt_fsdp.py"):
        text = run([sys.executable, str(script), "--help"], cwd=ROOT)
        # One entry per flag: from "  --flag" to the next entry, wrapped lines included.
        entries = re.split(r"\n  (?=--)", text.split("\n\n", 2)[2])[1:]
        flags = {e.split()[0].rstrip(",") for e in entries}
        assert {"--steps", "--progress", "--log-every", "--run-dir", "--plot-every"} <= flags
        for entry in entries:
            body = " ".join(entry.split())
            assert "default:" in body, f"{script.name}: {body}"


def test_log_file_gets_plain_lines_from_rank_0_metrics_and_picture(tmp_path):
    pytest.importorskip("matplotlib")
    run_dir, ckpt = tmp_path / "runs" / "lines", tmp_path / "ckpt"
    common = [str(SCRIPT), *TINY, "--run-dir", str(run_dir), "--ckpt-dir", str(ckpt)]
    out = run(
        [*torchrun(2), *common, "--steps", "6", "--log-every", "3", "--save-every", "4"], tmp_path
    )
    # stdout is a pipe: plain lines at --log-every and the last step, no bar, one rank speaking.
    steps = [int(m) for m in re.findall(r"^step +(\d+) \| loss", out, flags=re.M)]
    assert steps == [3, 6], out
    assert out.count("GPT tiny:") == 1 and "%|" not in out and "eta " in out
    assert f"picture: {run_dir / 'metrics.png'}" in out
    recorded = rows(run_dir)
    assert [r["step"] for r in recorded] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "loss_scale", "skipped", "skipped_steps", "tokens_per_s", "time"):
        assert key in recorded[0], key
    assert recorded[-1]["skipped"] == 0 and recorded[-1]["loss_scale"] == 1.0  # O0: static 1
    assert (run_dir / "metrics.png").read_bytes()[:8] == PNG_MAGIC

    # Resuming from step 4 keeps the history before it and replaces what came after.
    resume = ["--resume", str(ckpt / "step_000004"), "--steps", "8", "--log-every", "8"]
    out = run([*torchrun(2), *common, *resume], tmp_path)
    assert "(step 4)" in out
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert plot.read_run(run_dir).steps == list(range(1, 9))


def test_terminal_gets_one_tqdm_bar_with_loss_scale_skips_and_tokens_per_s(tmp_path):
    main, replica = pty.openpty()
    cmd = [*torchrun(2), str(SCRIPT), *TINY, "--steps", "5", "--run-dir", "none"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=replica, stderr=replica, cwd=tmp_path, env=ENV
    )
    os.close(replica)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    code = proc.wait(timeout=300)
    reader.join(timeout=30)
    os.close(main)
    screen = b"".join(chunks).decode(errors="replace")
    assert code == 0, screen[-5000:]
    final = [line for line in re.split(r"[\r\n]", screen) if "5/5" in line]
    assert final, screen[-3000:]
    for field in ("loss ", "scale 1", "skipped 0", "tok/s", "step/s", "100%|"):
        assert field in final[-1], (field, final[-1])
    assert screen.count("GPT tiny:") == 1
    assert not re.search(r"^step +\d+ \| loss", screen, flags=re.M)  # the bar replaces the lines


def test_without_matplotlib_the_run_says_how_to_install_it_and_goes_on(tmp_path):
    hidden = tmp_path / "no_matplotlib"
    hidden.mkdir()
    (hidden / "matplotlib.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(hidden), ENV.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    out = run(
        [sys.executable, str(SCRIPT), *TINY, "--steps", "2", "--run-dir", str(run_dir)],
        tmp_path,
        env,
    )
    assert "no plot: matplotlib is not installed: pip install matplotlib" in out
    assert "done: 2 steps" in out
    assert [r["step"] for r in rows(run_dir)] == [1, 2]
    assert not (run_dir / "metrics.png").exists()


def test_plot_cli_redraws_keeps_the_last_record_of_a_step_and_marks_skips(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "runs" / "fp16"
    run_dir.mkdir(parents=True)
    records = [
        {"step": s, "loss": 5.0 - 0.1 * s, "loss_scale": 2.0**16, "skipped": 0, "skipped_steps": []}
        for s in range(1, 6)
    ]
    records[2] |= {"loss_scale": 2.0**15, "skipped": 1, "skipped_steps": [3]}
    # A resumed attempt wrote step 5 again; a killed writer left half a line.
    records.append(records[4] | {"loss": 1.5, "tokens_per_s": 1000.0})
    lines = [json.dumps(r) for r in records] + ['{"step": 6, "lo']
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    recorded = plot.read_run(run_dir)
    assert recorded.steps == [1, 2, 3, 4, 5]
    assert recorded.losses[-1] == 1.5 and recorded.skipped_steps == [3]
    assert recorded.loss_scales[2] == 2.0**15

    done = subprocess.run(
        [sys.executable, "-m", "distamp.plot", str(run_dir)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert "5 recorded steps, 1 skipped" in done.stdout
    assert (run_dir / "metrics.png").read_bytes()[:8] == PNG_MAGIC
    assert plot.main([str(run_dir), "-o", str(tmp_path / "other.png")]) == 0
    assert (tmp_path / "other.png").read_bytes()[:8] == PNG_MAGIC
    # the metrics file itself names its run (an audit: "metrics.jsonl/metrics.jsonl does not exist")
    assert plot.main([str(run_dir / "metrics.jsonl"), "-o", str(tmp_path / "file.png")]) == 0
    assert (tmp_path / "file.png").read_bytes()[:8] == PNG_MAGIC
    # The format follows the suffix (an audit: -o loss.svg held PNG bytes)
    assert plot.main([str(run_dir), "-o", str(tmp_path / "loss.svg")]) == 0
    assert b"<svg" in (tmp_path / "loss.svg").read_bytes()[:400]
    # A record with a field that does not parse is left out like a half line
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 7, "loss": 1.0, "loss_scale": 1.0, "tokens_per_s": "x"}) + "\n")
    assert plot.read_run(run_dir).steps == [1, 2, 3, 4, 5]

    # Many records: a running mean is drawn over the raw losses.
    assert plot.running_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    # a NaN loss (a skipped step's) counts in no window: it used to blank the rest of the curve
    means = plot.running_mean([1.0, float("nan"), 3.0, 5.0, float("nan"), float("nan")], 2)
    assert means[:4] == [1.0, 3.0, 4.0, 5.0] and math.isnan(means[4])
    long_run = tmp_path / "runs" / "long"
    long_run.mkdir()
    lines = [json.dumps({"step": s, "loss": 1 / s, "loss_scale": 1.0}) for s in range(1, 81)]
    (long_run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert plot.plot_run(long_run).read_bytes()[:8] == PNG_MAGIC

    assert plot.main([str(tmp_path / "nothing")]) == 1
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    # an empty (or all-junk) metrics file: an error, not a blank picture and exit 0 (an audit)
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("not json\n")
    assert plot.main([str(empty)]) == 1 and not (empty / "metrics.png").exists()
    assert "metrics.jsonl: no records" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # -o a folder: said so, not a .partial's errno
        plot.main([str(run_dir), "-o", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "expected an image file, found a directory" in capsys.readouterr().err


def test_auto_opt_level_picks_the_machines_fastest_configuration_and_says_why_first(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from train_gpt import cpu_has_bf16, pick_opt_level

    level, why = pick_opt_level("auto", torch.device("cpu"), "auto", 2)
    if cpu_has_bf16():
        assert level == "O2" and "bf16 units" in why and "reduce-scattered" in why
    else:
        # FP32 compute, but a 16-bit wire and sharded state: not the plain FP32 baseline (what
        # it runs is held by test_shard_weights_flag_trains_like_fp32_and_resumes_bit_exact).
        assert level == "O0" and "no bf16 units" in why and "sharded" in why
        assert "reduce-scattered in bf16" in why and "updates gathered in bf16" in why
    assert pick_opt_level("O1", torch.device("cpu"), "auto", bf16_units=True) == ("O1", "")
    # asked for explicitly where 16-bit compute is slow: said (an audit: 2-3x slower, unsaid)
    level_o1, slow = pick_opt_level("O1", torch.device("cpu"), "auto", bf16_units=False)
    assert level_o1 == "O1" and "bf16 matmul runs ~100x slower than FP32" in slow, slow
    assert "fp16 matmul" in pick_opt_level("O2", torch.device("cpu"), "fp16", bf16_units=True)[1]
    assert pick_opt_level("O0", torch.device("cpu"), "fp16", bf16_units=False) == ("O0", "")
    assert "fp16 matmul" in pick_opt_level("auto", torch.device("cpu"), "fp16", 2)[1]
    cmd = [*torchrun(2), str(SCRIPT), *TINY[:-2], "--opt-level", "auto", "--steps", "2"]
    cmd += ["--run-dir", str(tmp_path / "run")]
    out = run(cmd, tmp_path)
    first = out.splitlines()[0]
    assert f"opt_level {level}{why}" in first, first
    # One rank (NPROC=1 bash launch/run.sh): nothing to shard, and auto does not ask for it.
    level, why = pick_opt_level("auto", torch.device("cpu"), "auto", 1)
    assert "sharded" not in why and "reduce-scattered" not in why
    cmd = [*torchrun(1), str(SCRIPT), *TINY[:-2], "--opt-level", "auto", "--steps", "2"]
    out = run([*cmd, "--run-dir", str(tmp_path / "one")], tmp_path)
    first = out.splitlines()[0]
    assert f"opt_level {level}{why}" in first and "world size 1" in first, first


def test_reduce_scatter_flag_trains_bit_for_bit_like_the_all_reduce_hook_and_resumes(tmp_path):
    """``--reduce-scatter`` (ZeRO's gradient path with the weight gather overlapped): at 2 ranks
    the same losses as the all-reduce hook, bit for bit, and a checkpoint of it resumes."""
    o2 = [str(SCRIPT), *TINY[:-2], "--opt-level", "O2", "--bucket-mb", "0.05", "--steps", "6"]
    losses = {}
    for name, flags in (("ar", []), ("rs", ["--reduce-scatter"])):
        run_dir = tmp_path / name
        ckpt = ["--ckpt-dir", str(tmp_path / f"ckpt-{name}"), "--save-every", "3"]
        run([*torchrun(2), *o2, *flags, *ckpt, "--run-dir", str(run_dir)], tmp_path)
        losses[name] = [r["loss"] for r in rows(run_dir)]
    assert len(losses["rs"]) == 6 and losses["rs"] == losses["ar"]
    resumed = tmp_path / "rs-resumed"
    resume = ["--resume", str(tmp_path / "ckpt-rs" / "step_000003"), "--reduce-scatter"]
    out = run([*torchrun(2), *o2, *resume, "--run-dir", str(resumed)], tmp_path)
    assert "(step 3)" in out
    assert [r["loss"] for r in rows(resumed) if r["step"] > 3] == losses["rs"][3:]


def test_shard_weights_flag_trains_like_fp32_and_resumes_bit_exact(tmp_path):
    """``--opt-level O0 --shard-weights``, what ``auto`` runs across ranks on a CPU without bf16
    units: FP32 weights and AdamW state sharded, gradients reduce-scattered in bf16, updates
    gathered in bf16. It trains like the FP32 baseline (explicit O0: FP32 on the wire) and a
    checkpoint of it resumes bit for bit."""
    o0 = [str(SCRIPT), *TINY, "--bucket-mb", "0.05", "--steps", "6"]
    losses = {}
    for name, flags in (("fp32", []), ("zero", ["--shard-weights"])):
        run_dir = tmp_path / name
        ckpt = ["--ckpt-dir", str(tmp_path / f"ckpt-{name}"), "--save-every", "3"]
        run([*torchrun(2), *o0, *flags, *ckpt, "--run-dir", str(run_dir)], tmp_path)
        losses[name] = [r["loss"] for r in rows(run_dir)]
    assert len(losses["zero"]) == 6 and losses["zero"][-1] < losses["zero"][0]
    # Stated tolerance: bf16 gradients and bf16 updates move a loss by < 1% over 6 steps.
    for a, b in zip(losses["zero"], losses["fp32"], strict=True):
        assert a == pytest.approx(b, rel=1e-2)
    resumed = tmp_path / "zero-resumed"
    resume = ["--resume", str(tmp_path / "ckpt-zero" / "step_000003"), "--shard-weights"]
    out = run([*torchrun(2), *o0, *resume, "--run-dir", str(resumed)], tmp_path)
    assert "(step 3)" in out
    assert [r["loss"] for r in rows(resumed) if r["step"] > 3] == losses["zero"][3:]
    # One rank, weights not sharded (what auto picks at world size 1): the checkpoint's flat
    # optimizer state is cut per parameter, and training goes on from step 3.
    alone = tmp_path / "zero-at-1"
    resume[-1:] = []
    out = run([*torchrun(1), *o0, *resume, "--run-dir", str(alone)], tmp_path)
    assert "(step 3)" in out and "world size 1" in out
    assert [r["step"] for r in rows(alone)] == [4, 5, 6]


def test_a_resume_with_more_steps_trains_on_the_new_schedule_from_its_first_step(tmp_path):
    """elastic.sh's "go on past the demo's steps": the first resumed step trained at the old
    schedule's final rate and the second jumped onto the new cosine, silently (an audit)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import lr_lambda

    base = [str(SCRIPT), *TINY, "--ckpt-dir", str(tmp_path / "ckpt"), "--lr", "1e-3"]
    run([*torchrun(1), *base, "--steps", "4", "--run-dir", str(tmp_path / "a")], tmp_path)
    more = ["--steps", "8", "--resume", "auto", "--run-dir", str(tmp_path / "b")]
    out = run([*torchrun(1), *base, *more], tmp_path)
    assert "note: --steps 8 differs from the checkpoint's run (4)" in out, out[-2000:]
    lrs = {r["step"]: r["lr"] for r in rows(tmp_path / "b")}
    assert sorted(lrs) == [5, 6, 7, 8]
    for step, lr in lrs.items():
        assert lr == pytest.approx(1e-3 * lr_lambda(8)(step - 1), rel=1e-9), (step, lrs)


def test_auto_is_one_level_for_the_whole_job_and_keeps_the_checkpoint_s(tmp_path):
    """Nodes of two CPU kinds picked O2 on some and O0 on others (wrap refused, blaming opt
    levels nobody chose), and a requeue onto another CPU kind could not load its checkpoint (an
    audit): auto now agrees over the job and keeps the level of the checkpoint it resumes."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from train_gpt import pick_opt_level

    cpu = torch.device("cpu")
    assert pick_opt_level("auto", cpu, "auto", 2, bf16_units=True)[0] == "O2"
    level, why = pick_opt_level("auto", cpu, "auto", 2, bf16_units=False)
    assert level == "O0" and "sharded" in why
    for saved, units in (("O2", True), ("O0", False)):
        level, why = pick_opt_level("auto", cpu, "auto", 2, bf16_units=units, resume_level=saved)
        assert level == saved and "as the checkpoint resumed from" in why, why
    for saved, units in (("O2", False), ("O0", True)):  # another CPU kind than the checkpoint's
        level, why = pick_opt_level("auto", cpu, "auto", 2, bf16_units=units, resume_level=saved)
        assert level == saved and "(auto: the level of the checkpoint resumed from" in why, why
        assert ("sharded" in why) == (saved == "O0"), why  # auto's O0 layout across ranks
        assert ("bf16 matmul runs ~100x slower" in why) == (saved == "O2"), why
    assert pick_opt_level("auto", cpu, "auto", 2, bf16_units=True, resume_level="O1") == (
        "O1",
        " (auto: the level of the checkpoint resumed from)",
    )
    assert pick_opt_level("O1", cpu, "auto", 2, bf16_units=True, resume_level="O2") == ("O1", "")


def _job_units(rank: int, world: int) -> bool:
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt

    train_gpt.cpu_has_bf16 = lambda: rank != 1  # rank 1's node has no bf16 units
    return train_gpt.job_has_bf16()


def test_the_job_has_bf16_units_only_where_every_node_has_them():
    from dist_harness import run_ranks

    assert run_ranks(_job_units, 3) == [False, False, False]


def test_keep_prunes_only_this_runs_intact_checkpoints_never_the_fresh_one(tmp_path):
    """An audit: --keep sorted every committed step_* by name, so a damaged newer checkpoint, or
    a later step of an earlier run in the same folder, counted among the newest and the fresh
    save was deleted right after it was written."""
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, str(SCRIPT), *TINY, "--run-dir", "none", "--ckpt-dir", str(ckpt)]
    run([*base, "--steps", "4", "--save-every", "2", "--keep", "1"], tmp_path)
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000004"]
    out = run(
        [*base, "--steps", "3", "--save-every", "3", "--keep", "1", "--resume", "none"], tmp_path
    )
    assert "holds 1 checkpoint(s) of an earlier run up to step 4" in out, out
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000003", "step_000004"]
    # a damaged newest checkpoint: resume skips it, and the next save prunes around it
    shard = next((ckpt / "step_000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    out = run(
        [*base, "--steps", "5", "--save-every", "5", "--keep", "1", "--resume", "auto"], tmp_path
    )
    assert "(step 3)" in out, out
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000004", "step_000005"]
    # a fresh run in the same folder never prunes the earlier run's checkpoints (an audit: its
    # --keep deleted an earlier run's lower step, as its own note promised it would not)
    run([*base, "--steps", "6", "--save-every", "6", "--keep", "1", "--resume", "none"], tmp_path)
    assert sorted(p.name for p in ckpt.glob("step_*")) == [
        "step_000004",
        "step_000005",
        "step_000006",
    ]


def test_a_run_whose_final_loss_is_not_finite_exits_non_zero_and_says_why(tmp_path):
    """An audit: a diverged run (NaN loss at the end) exited 0, so Slurm and CI saw success."""
    summary = tmp_path / "summary.json"
    cmd = [*torchrun(2), str(SCRIPT), *TINY, "--steps", "3", "--lr", "1e8", "--run-dir", "none"]
    done = subprocess.run(
        [*cmd, "--json", str(summary)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.count("error: the run diverged: expected a finite loss after step 3") == 1
    assert "found nan" in done.stderr, done.stderr[-2000:]
    assert json.loads(summary.read_text())["final_loss"] is None  # written before it leaves
    # The same run at a sane rate finishes with status 0 (run() asserts it) and a finite loss.
    run([*cmd[:-4], "--run-dir", "none", "--json", str(summary)], tmp_path)
    assert math.isfinite(json.loads(summary.read_text())["final_loss"])
