"""benchmarks/compare.py --quick as a smoke test: every configuration of the FP32-compute set trains
(its loss goes down) and lands in the table with its floor; over an emulated two-node cluster
(network namespaces, tc-shaped links) where this machine allows it, else on loopback. Every row of
the bf16-compute set trains too (loopback); --profile and benchmarks/memory.py write what they
promise. The timings themselves are the benchmark's business, not the suite's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import overhead  # noqa: E402
from compare import (  # noqa: E402
    BF16_CONFIGS,
    FP32_CONFIGS,
    GPT,
    SIZES,
    WIRE_CONFIGS,
    GPTConfig,
    _held,
    choose_compute,
    deepspeed_config,
    floors,
    markdown,
    parse_args,
    peak_rss,
    setup,
    split_by_size,
    summarize,
)


def can_build_a_cluster() -> bool:
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "tc", "nsenter"))


def run_benchmark(script: str, *args: str, timeout: float) -> str:
    """``python benchmarks/<script> <args>`` on one thread per rank; its stdout (it must succeed)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def assert_every_row_trained(rows: dict, configs: list[str]) -> None:
    """Every configuration has its row, in order, and trained: its loss went down (DeepSpeed, an
    optional extra, may be skipped for being absent; a "wire alone" row trains nothing: it has a
    time and the bytes of a 16-bit row)."""
    assert list(rows) == configs
    for name, row in rows.items():
        if name in WIRE_CONFIGS:
            assert row["median_s"] > 0 and row["wire_mb"] > 0 and row["held_mb"] == 0, row
            continue
        if name.startswith("DeepSpeed") and "skipped" in row:
            assert "deepspeed" in row["skipped"].lower()
            continue
        assert "skipped" not in row, (name, row)
        assert row["median_s"] > 0 and row["final_loss"] < row["first_loss"], (name, row)


def test_quick_compare_trains_every_row_and_reports_the_floor(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "system-deps.sh"), "iproute2"], check=False)
    cluster = can_build_a_cluster()
    args = ["--quick", "--compute", "fp32", "--out-dir", str(tmp_path), "--phases"]
    if cluster:
        args += ["--nodes", "2", "--link", "1gbit"]
    run_benchmark("compare.py", *args, timeout=600)
    stem = "compare-w1-2nodes-1gbit-quick" if cluster else "compare-w1-quick"
    summary = json.loads((tmp_path / f"{stem}.json").read_text())
    assert summary["compute"] == "fp32" and "GFLOP/s" in summary["why"]
    rows = {r["config"]: r for r in summary["rows"]}
    # On the emulated cluster, also the 16-bit rows' bytes moved alone (no compute).
    configs = FP32_CONFIGS + (WIRE_CONFIGS if cluster else [])
    assert_every_row_trained(rows, configs)
    # 16-bit rows put half the bytes of FP32 DDP on the wire.
    assert rows["distamp O0 + hook"]["wire_mb"] * 2 == rows["FP32 DDP"]["wire_mb"]
    for name in WIRE_CONFIGS if cluster else []:
        assert rows[name]["wire_mb"] == rows["distamp O0 + hook"]["wire_mb"], name
    # Sharded FP32 weights hold 12/N bytes per parameter of FP32 copies + AdamW state, not 8.
    for name in rows:
        if name.startswith("distamp O0 sharded"):
            assert rows[name]["held_mb"] < 0.8 * rows["distamp O0 + hook"]["held_mb"], name
    # The floor steps AdamW over 1/N of the parameters: half of FP32 DDP's state at 2 ranks.
    floor_row = rows["floor: FP32, no communication"]
    assert floor_row["held_mb"] == pytest.approx(rows["FP32 DDP"]["held_mb"] / 2, rel=0.05)
    floor = summary["floor"]
    assert floor["floor_s"] == max(floor["compute_s"], floor["wire_s"]) > 0
    assert (floor["wire_s"] > 0) is cluster
    table, phases_table = (tmp_path / f"{stem}.md").read_text().split("Where the time goes")
    assert "| configuration | median step s |" in table and "vs floor" in table
    assert table.count("\n| ") == len(configs) + 1  # the header and one line per row
    # --phases: every row that trained split its steps into phases on rank 0.
    timed = [r for r in rows.values() if "median_s" in r and r["config"] not in WIRE_CONFIGS]
    assert phases_table.count("\n| ") == len(timed) + 1
    for row in timed:
        ph = row["phases"]
        assert ph["forward"] > 0 and ph["backward"] > 0, row["config"]
        if row["config"].startswith("DeepSpeed"):  # no torch step hooks: step is in backward
            assert "step" not in ph, row["config"]
        else:
            assert ph["step"] > 0, row["config"]
        phases = ("other", "forward", "backward", "step")
        assert sum(ph.get(p, 0.0) for p in phases) <= 1.5 * row["median_s"]
        if cluster:  # bytes sent on the link: none without communication
            assert (ph["sent_mb"] > 0.1) is (not row["config"].startswith("floor")), row
            assert 0 <= ph["busy"] <= 1.2, row


ZERO3 = ["FSDP2 MixedPrecisionPolicy", "distamp O2 FSDP2 (distamp.fsdp.fully_shard)"]


def test_quick_compare_trains_every_row_of_the_bf16_set(tmp_path):
    """The bf16-compute set (what CPUs with bf16 units and GPUs run; tiny, since bf16 matmul is
    slow on CPUs without bf16 units): every row trains, and the ZeRO-3 rows, torch's FSDP2 and
    distamp's over it, count the same FP32 shards + AdamW state per rank (a DTensor's local
    shard, not its global size)."""
    run_benchmark(
        "compare.py", "--quick", "--compute", "bf16", "--out-dir", str(tmp_path), timeout=900
    )
    summary = json.loads((tmp_path / "compare-w1-quick.json").read_text())
    assert summary["compute"] == "bf16"
    rows = {r["config"]: r for r in summary["rows"]}
    assert_every_row_trained(rows, BF16_CONFIGS)
    # compare.py counts FSDP2's DTensors itself; distamp's row is distamp.stats.
    torch_row, distamp_row = (rows[name] for name in ZERO3)
    assert distamp_row["held_mb"] == pytest.approx(torch_row["held_mb"], rel=0.01)
    # O2 sharded: 12/N bytes per parameter, the replicated O2 rows 12, so half at 2 ranks.
    sharded = rows["distamp O2 sharded + reduce-scatter hook"]["held_mb"]
    assert sharded == pytest.approx(rows["distamp O2 replicated + hook"]["held_mb"] / 2, rel=0.02)


def test_phases_split_each_step_and_measure_the_link_against_its_rate():
    """benchmarks/phases.py: the marks its hooks take split each step into phases; bytes sent in
    each phase over what the link could send in it is how busy the link was."""
    import torch
    from phases import Phases
    from phases import markdown as phases_markdown

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ph = Phases(model, opt, None)  # no link: phases only
    for _ in range(3):
        ph.begin()
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ph.end()
    ph.stop()
    assert [p for p, _ in ph.steps[0]] == ["other", "forward", "backward", "step", "other", "end"]
    s = ph.summary(None)
    assert all(s[p] > 0 for p in ("forward", "backward", "step")) and "busy" not in s
    # A link that sent 125 MB in 1 s at 1 Gbit/s was busy all the time; half of that, half.
    ph.steps = [[("other", 0.0), ("forward", 0.25), ("backward", 0.5), ("step", 0.75),
                 ("other", 1.0), ("end", 1.0)]]  # fmt: skip
    ph.samples = [(0.0, 0), (0.5, 62_500_000), (1.0, 93_750_000)]
    s = ph.summary(1e9)
    assert s["forward_busy"] == pytest.approx(1.0) and s["other_busy"] == pytest.approx(1.0)
    assert s["backward_busy"] == pytest.approx(0.5) and s["step_busy"] == pytest.approx(0.5)
    assert s["sent_mb"] == pytest.approx(93.75) and s["busy"] == pytest.approx(0.75)
    # Work deferred past the last step (an overlapped gather) goes out after its window: the
    # bytes up to the flush count, per step (an audit: one gather per run was missing)
    ph.samples.append((2.0, 125_000_000))
    ph._flushed_at = 2.0
    assert ph.summary(1e9)["sent_mb"] == pytest.approx(125.0)
    # An optimizer without torch step hooks (DeepSpeed's): its step is counted in backward, and
    # the table says "-" for it, not 0 ms.
    unhooked = Phases(model, object(), None)
    unhooked.steps = [[("other", 0.0), ("forward", 0.25), ("backward", 0.5), ("end", 1.0)]]
    s = unhooked.summary(None)
    assert "step" not in s and s["backward"] == pytest.approx(0.5)
    table = phases_markdown([("DeepSpeed", s)], "1gbit")
    assert "| DeepSpeed | 250 | 250 | 500 | - | - | - | - | - | - | - |" in table
    assert "not measured separately" in table


def test_memory_table_accounts_for_what_each_row_holds():
    """benchmarks/memory.py, tiny: every row lands with its accounting, and what distamp's sharded
    O2 row holds per rank is the sharded layout (FP32 masters and shard gradients each half the
    FP32 weights, AdamW state twice the masters)."""
    rows = [
        "ZeroRedundancyOptimizer + torch fp16_compress_hook",
        "distamp O2 sharded + reduce-scatter hook",
    ]
    out = run_benchmark("memory.py", "--size", "tiny", "--steps", "2", "--only", *rows, timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    table = {
        cells[0]: dict(zip(head, cells, strict=True))
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    }
    assert list(table) == rows
    zero, sharded = (table[r] for r in rows)
    fp32_weights = float(zero["weights"])
    assert float(zero["optimizer state"]) == pytest.approx(fp32_weights, rel=0.05)  # 2 x 1/2
    assert float(sharded["weights"]) == pytest.approx(fp32_weights / 2, rel=0.05)  # bf16
    for column in ("FP32 masters (O2)", "FP32 shard gradients"):
        assert float(sharded[column]) == pytest.approx(fp32_weights / 2, rel=0.05), column
    assert float(sharded["optimizer state"]) == pytest.approx(fp32_weights, rel=0.05)
    for row in table.values():
        assert float(row["peak RSS"]) > float(row["before model"]) > 0


def test_overhead_table_has_every_configuration_and_each_trains():
    """benchmarks/overhead.py --quick: every configuration lands in the table with a positive
    time and its ratios, and each step function trains (its loss goes down)."""
    out = run_benchmark("overhead.py", "--quick", timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    names = [line.strip("|").split("|")[0].strip() for line in lines[1:]]
    assert names == overhead.CONFIGS
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[1]) > 0 and cells[3].endswith("x") and cells[4].endswith("x"), line
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    for config in overhead.CONFIGS:
        step = overhead.build(config, 2)
        first = float(step(x, y))
        for _ in range(20):
            last = float(step(x, y))
        assert last < first, (config, first, last)


def test_profile_writes_rank_0s_trace_and_op_table(tmp_path):
    """--profile: per row, torch.profiler's chrome trace of rank 0's timed steps and its ops by
    self CPU time per step, with distamp's named waits for the wire listed (or "none")."""
    row = "distamp O0 sharded + reduce-scatter hook + overlapped bf16-update gather"
    args = ["--quick", "--compute", "fp32", "--out-dir", str(tmp_path)]
    run_benchmark(
        "compare.py", *args, "--profile", str(tmp_path / "prof"), "--only", row, timeout=300
    )
    stem = (
        tmp_path / "prof" / "distamp_O0_sharded_reduce_scatter_hook_overlapped_bf16_update_gather"
    )
    trace = json.loads(Path(f"{stem}.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "Optimizer.step#AdamW.step" in names and "DistributedDataParallel.forward" in names
    table = Path(f"{stem}.txt").read_text()
    assert table.startswith(f"{row}: rank 0, 3 timed steps")
    ops = {
        line.split()[0]: float(line.split()[-3]) for line in table.splitlines() if "aten::" in line
    }
    assert ops["aten::mm"] > 0 and ops["aten::addmm"] > 0  # forward and backward matmuls
    assert "distamp's waits for the wire (ms per step):" in table


@pytest.mark.parametrize("world", [2, 3])
def test_floor_rows_step_one_nth_of_the_elements_on_every_rank(world):
    """The floor's optimizer runs over 1/N of the parameters' elements on every rank (within 5% of
    total/N on the tiny GPT), each parameter on exactly one rank, the same split on every rank. A
    strided split of the parameter list gave rank 0 every weight (~99% at 2 ranks)."""
    params = list(GPT(GPTConfig(block_size=32, **SIZES["tiny"])).parameters())
    shares = split_by_size(params, world)
    assert sorted(id(p) for share in shares for p in share) == sorted(id(p) for p in params)
    total = sum(p.numel() for p in params)
    for rank, share in enumerate(shares):
        assert sum(p.numel() for p in share) == pytest.approx(total / world, rel=0.05), rank
    assert [[id(p) for p in s] for s in split_by_size(params, world)] == [
        [id(p) for p in s] for s in shares
    ]


def test_a_flag_given_wins_over_quick_and_the_workload():
    """--quick and --workload fill only the flags left out; with none given, the documented
    defaults (--help, docs/benchmarks.md)."""
    keys = ("size", "seq", "batch", "steps", "warmup", "rounds", "lr")
    values = lambda args: tuple(getattr(args, k) for k in keys)  # noqa: E731
    assert values(parse_args([])) == ("bench", 128, 8, 8, 2, 2, 1e-3)
    assert values(parse_args(["--workload", "w2"])) == ("bench", 128, 1, 8, 2, 2, 1e-3)
    assert values(parse_args(["--workload", "w0"])) == ("micro", 16, 1, 8, 2, 2, 1e-3)
    assert values(parse_args(["--quick"])) == ("tiny", 32, 2, 3, 1, 1, 3e-3)
    given = ["--rounds", "2", "--steps", "5", "--batch", "1", "--size", "micro", "--lr", "1e-2"]
    assert values(parse_args(["--quick", *given])) == ("micro", 32, 1, 5, 1, 2, 1e-2)
    assert values(parse_args(["--workload", "w0", "--seq", "64"]))[:3] == ("micro", 64, 1)


def test_only_runs_a_row_once_and_a_compute_given_is_the_one_run():
    """Audits: --only naming a row twice ran it twice a round; --compute fp32 ran bf16 on a
    GPU. The rank's peak RSS is its own (VmHWM), not the launcher's carried across exec."""
    args = parse_args(["--only", "FP32 DDP", "FP32 DDP", "floor: FP32, no communication"])
    assert args.only == ["FP32 DDP", "floor: FP32, no communication"]
    for choice in ("fp32", "bf16"):
        chosen, why, peak = choose_compute(choice, 0.01)
        assert chosen == choice and "chosen with --compute" in why and peak > 0
    chosen, why, _ = choose_compute("auto", 0.01)
    assert chosen in ("fp32", "bf16") and "GFLOP/s" in why
    own = peak_rss()
    assert 10e6 < own < 100e9
    code = "import sys; sys.path.insert(0, 'benchmarks'); from compare import peak_rss; print(peak_rss())"
    ballast = bytearray(400 * 2**20)  # the launcher's peak, 400 MB above the child's own
    ballast[::4096] = b"x" * len(ballast[::4096])
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    del ballast
    assert int(child.stdout) < own + 300e6, (int(child.stdout), own)


@pytest.mark.parametrize(
    "flag,says",
    [
        (["--rounds", "0"], "--rounds: expected at least 1"),
        (["--steps", "0"], "--steps: expected at least 1"),
        (["--warmup", "-1"], "--warmup: expected at least 0"),
        # an audit: these ran (--world 0, --batch 0: every row failed, exit 0) or failed late
        (["--world", "0"], "--world: expected at least 1, got 0"),
        (["--batch", "0"], "--batch: expected at least 1, got 0"),
        (["--threads", "0"], "--threads: expected at least 1, got 0"),
        (["--nodes", "-2"], "--nodes: expected at least 0, got -2"),
        (["--nodes", "2", "--link", "fast"], "--link: expected a rate like 1gbit"),
        (["--lr", "nan"], "--lr: expected a finite number > 0, got nan"),
        (["--out-dir", __file__], "expected a folder (made if missing), found a file"),
        # an audit: every row ran, then the table could not be written / tc refused rate 0
        (["--out-dir", "/proc/distamp-bench"], "expected a folder this process can write"),
        (["--nodes", "2", "--link", "0gbit"], "--link: expected a rate of at least 8kbit"),
        (["--link", "junk"], "--link: expected a rate like 1gbit"),
        # an audit: --only ran a bf16 row under a header saying fp32 compute
        (
            ["--compute", "fp32", "--only", "distamp O2 sharded + reduce-scatter hook"],
            "--only: ['distamp O2 sharded + reduce-scatter hook'] compute in the other precision "
            "than fp32 (--compute); the rows for fp32 compute are ['FP32 DDP',",
        ),
        (
            ["--compute", "bf16", "--only", "FP32 DDP", "floor: FP32, no communication"],
            "--only: ['floor: FP32, no communication'] compute in the other precision than bf16",
        ),
        # the ZeRO rows were renamed when they got a 16-bit wire
        (
            ["--only", "ZeroRedundancyOptimizer"],
            "'ZeroRedundancyOptimizer' is now 'ZeroRedundancyOptimizer + torch fp16_compress_hook'",
        ),
    ],
)
def test_bad_values_are_refused_before_anything_runs(flag, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flag)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def _round(times: list[float]) -> list[dict]:
    """One round's gathered results of 2 ranks that trained."""
    one = {"params": 1000, "times": times, "first_loss": 5.0, "final_loss": 4.0}
    return [one | {"peak_rss": 1e8, "held_bytes": 8e3, "wire_bytes": 2e3} for _ in range(2)]


def test_a_row_is_made_of_the_rounds_that_ran_and_says_which_failed():
    """A round that failed (a world that hung twice, an exception the ranks reported), in any
    round, is left out of the row and counted in its note; the row is skipped, with the reasons,
    only when every round failed."""
    opts = {"batch": 2, "seq": 8, "world": 2}
    hung = [{"config": "x", "error": "failed twice (hung past 120 s (--timeout))"}]
    raised = [{"params": 1000, "error": "RuntimeError: boom"}] * 2
    late = summarize("x", [_round([1.0, 3.0]), hung], opts, peak=1.0)
    assert late["median_s"] == 2.0 and "1 of 2 rounds failed" in late["note"]
    early = summarize("x", [raised, _round([2.0])], opts, peak=1.0)
    assert early["median_s"] == 2.0 and "RuntimeError: boom (rank 0)" in early["note"]
    never = summarize("x", [raised, raised], opts, peak=1.0)
    assert never == {"config": "x", "skipped": "RuntimeError: boom (rank 0)"}
    rows = [late, never]
    table = markdown(rows, "header", floors(rows, 1000, 0, None))
    assert "no floor row" in table and "Floor: 0.000" not in table
    assert "| x | skipped: RuntimeError: boom (rank 0) |" in table
    assert "- x: 1 of 2 rounds failed: failed twice (hung past 120 s (--timeout))" in table


def test_the_rows_of_the_chosen_precision_and_the_wire_rows_are_accepted_with_it():
    only = ["distamp O0 + hook", "wire alone: 16-bit all-reduce per bucket"]
    assert parse_args(["--compute", "fp32", "--only", *only]).only == only
    assert parse_args(["--compute", "bf16", "--only", "FP32 DDP"]).only == ["FP32 DDP"]


def test_a_wire_alone_row_has_no_speed_up_over_fp32_ddp():
    """A "wire alone" row trains nothing: no tokens, no loss, and no speed-up over FP32 DDP (an
    audit: it read 10.62x)."""
    opts = {"batch": 2, "seq": 8, "world": 2}
    rows = [
        summarize("FP32 DDP", [_round([1.0])], opts, peak=1.0),
        summarize(WIRE_CONFIGS[0], [_round([0.1])], opts, peak=1.0),
    ]
    table = markdown(rows, "header", floors(rows, 1000, 2, 1e9))
    line = next(t for t in table.splitlines() if t.startswith(f"| {WIRE_CONFIGS[0]} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "-" and cells[5:7] == ["-", "-"] and cells[-1] == "-", cells
    assert "| FP32 DDP | 1.000 | 0.000 | 1.00x |" in table


def test_deepspeed_uses_the_ddp_rows_buckets():
    """DeepSpeed's buckets hold as many gradients as a DDP row's ``--bucket-mb`` bucket (DDP counts
    its bytes in the gradients' dtype), not its default 5e8 elements (an audit: one bucket), and it
    overlaps the reduction with the backward as DDP does."""
    opts = {"batch": 2, "bucket_mb": 2.0}
    for config, grad_bytes in (
        ("DeepSpeed ZeRO-1 bf16", 2),
        ("DeepSpeed ZeRO-1 bf16 communication", 4),
    ):
        zero = deepspeed_config(config, opts)["zero_optimization"]
        assert zero["stage"] == 1 and zero["overlap_comm"] is True, config
        elements = 2 * 2**20 // grad_bytes
        assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == elements, config
    assert deepspeed_config("DeepSpeed ZeRO-1 bf16", opts)["bf16"]["enabled"] is True
    assert deepspeed_config("DeepSpeed ZeRO-1 bf16 communication", opts)["bf16"]["enabled"] is False


def test_the_peak_is_measured_at_the_ranks_thread_count(monkeypatch):
    """With --threads N, "of peak" divides a rank's FLOP/s by the matmul rate at N threads (an
    audit: the doctor's one-thread rate), and the header says at how many."""
    import torch

    import distamp.doctor

    seen = []

    def fake(dtype, seconds, device="cpu"):
        seen.append(torch.get_num_threads())
        return 1.0

    monkeypatch.setattr(distamp.doctor, "matmul_gflops", fake)
    before = torch.get_num_threads()
    _, why, peak = choose_compute("fp32", 0.01, threads=3)
    assert peak == 1.0 and set(seen) == {3} and "this CPU at 3 thread(s)" in why
    assert torch.get_num_threads() == before
    seen.clear()
    choose_compute("fp32", 0.01)
    assert set(seen) == {1}


def _tiny_setup(config: str, world: int = 2, rank: int = 0, compute: str = "fp32"):
    import torch

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, **SIZES["tiny"]))
    opts = {"lr": 1e-3, "adamw": "default", "bucket_mb": 2.0, "compute": compute, "batch": 2}
    step, opt, wire, fsdp_masters = setup(config, model, opts, torch.device("cpu"), world, rank)
    x = torch.randint(0, 256, (2, 16))
    return model, step, opt, wire, fsdp_masters, (x, x.roll(-1, 1))


@pytest.mark.parametrize(
    "config", ["floor: FP32, no communication", "floor: autocast bf16, no communication"]
)
def test_a_floor_step_leaves_no_gradient_behind(config):
    """The floor steps 1/N of the parameters and clears every gradient (an audit: the other
    (N-1)/N kept accumulating, an add per step over them); the parameters it steps move, the others
    do not. No process group: the floor communicates nothing."""
    model, step, opt, wire, _, batch = _tiny_setup(config)
    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    assert 0 < len(stepped) < len(list(model.parameters())) and wire == 0
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for _ in range(2):
        step(*batch)
        assert all(p.grad is None for p in model.parameters())
    for name, p in model.named_parameters():
        assert (id(p) in stepped) is (not p.detach().equal(before[name])), name


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_zero_redundancy_optimizer_reduces_through_the_fp16_hook(one_rank_group, monkeypatch):
    """The ZeRO rows put gradients on a 16-bit wire as every other peer does (an audit: theirs was
    FP32), through torch's fp16_compress_hook as the DDP row does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []
    hook = default_hooks.fp16_compress_hook

    def counted(state, bucket):  # DDP checks a hook's parameter names
        calls.append(1)
        return hook(state, bucket)

    monkeypatch.setattr(default_hooks, "fp16_compress_hook", counted)
    for config in (FP32_CONFIGS[2], BF16_CONFIGS[3]):
        assert "ZeroRedundancyOptimizer + torch fp16_compress_hook" in config
        _, step, _, wire, fsdp_masters, batch = _tiny_setup(config, world=1)
        step(*batch)
        assert calls and wire == 2 and not fsdp_masters, config
        calls.clear()


def test_fsdp2_shards_are_masters_only_beside_16_bit_weights(one_rank_group):
    """FSDP2's sharded FP32 parameters count as masters in "opt state+masters" only where its
    MixedPrecisionPolicy computes with bf16 copies of them (param_dtype); with FP32 params they are
    the model's weights, not counted, as the DDP rows' are not (an audit: they were)."""
    rows = {
        "FSDP2 MixedPrecisionPolicy (FP32 params, bf16 reduce)": (False, 8),  # AdamW's 2 x FP32
        "FSDP2 MixedPrecisionPolicy": (True, 12),  # + the FP32 masters
    }
    for config, (masters, per_param) in rows.items():
        model, step, opt, _, fsdp_masters, batch = _tiny_setup(config, world=1)
        step(*batch)
        n = sum(p.numel() for p in model.parameters())
        assert fsdp_masters is masters, config
        # (+ AdamW's step counts, a scalar per parameter)
        assert _held(opt, fsdp_masters) == pytest.approx(per_param * n, rel=1e-3), config
