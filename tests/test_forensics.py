"""Forensics: a NaN in the loss itself is named as such; find_nonfinite; a long fp16 soak with
random faults on random ranks keeps every rank bit-identical and does not leak."""

import logging
import os
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import GradProbe, data, mlp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp


def nan_loss_then_overflow(rank, world):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model)
    reports = []
    for step, (x, y) in enumerate(data(6, 4 * world)):
        loss = F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])
        if step == 2 and rank == 1:
            loss = loss * float("nan")  # the loss itself, on one rank
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if step == 4 and rank == 0:
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")  # grad overflow
        opt.step()
        opt.zero_grad()
        reports.append(
            distamp.stats(opt).last_nonfinite if distamp.stats(opt).last_step_skipped else None
        )
    return reports


def test_nan_in_the_loss_itself_is_reported_as_such_on_every_rank():
    for reports in run_ranks(nan_loss_then_overflow, 2):
        assert [r is not None for r in reports] == [False, False, True, False, True, False]
        loss_report, grad_report = reports[2], reports[4]
        assert loss_report.loss_id == 0 and loss_report.rank == 1 and loss_report.kind == "nan"
        assert "the loss itself (loss_id 0) was a NaN on rank 1" in str(loss_report)
        assert "a smaller loss scale does not fix it" in str(loss_report)
        assert grad_report.loss_id is None and grad_report.rank == 0
        assert grad_report.param == "0.weight" and grad_report.kind == "inf"


def test_an_inf_loss_with_finite_gradients_skips_and_ends_in_the_error():
    """An inf loss whose gradients are finite (what an inf loss's gradients become once the
    dynamic scale has backed off until they underflow to zeros, seen with fp16 O1) is skipped
    like an overflow, so max_consecutive_skips ends it with the error naming the loss, instead
    of steps on zero gradients forever."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0, max_consecutive_skips=3)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(1, 4)[0]
    with pytest.raises(distamp.NonFiniteGradientError, match="the loss itself .* an inf") as err:
        for _ in range(3):
            loss = F.mse_loss(model(x), y) + torch.tensor(float("inf"))  # d(inf const) = 0
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
            opt.step()
            opt.zero_grad()
    # said once, not twice (an audit: "... does not fix it. Lowering the loss scale does not fix
    # this; ...")
    assert "does not fix" in str(err.value) and "Lowering" not in str(err.value), err.value
    assert distamp.stats(opt).skipped_steps == 3
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)  # never stepped


def _o2_ddp(reduce_scatter):
    """An O2 mlp under DDP (with distamp's reduce-scatter hook when asked): model, opt, ddp."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model)
    if reduce_scatter:
        distamp.hooks.register(ddp, opt, reduce_scatter=True)
    return model, opt, ddp


def nan_grad_on_rank_1(rank, world, reduce_scatter):
    model, opt, ddp = _o2_ddp(reduce_scatter)
    last = list(model.parameters())[-1]
    if rank == 1:
        last.register_hook(lambda g: g * float("nan"))  # before DDP reduces it
    x, y = data(1, 4 * world)[0]
    with distamp.scale_loss(F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[:4]), opt) as scaled:
        scaled.backward()
    opt.step()
    return distamp.stats(opt).last_nonfinite


def test_the_rank_a_nan_came_from_is_named_or_said_to_be_unknown():
    """With the reduce-scatter hook each rank keeps its own gradient: rank 1 is named. Through
    DDP's all-reduce every rank holds the NaN: the report says so instead of naming rank 0."""
    for report in run_ranks(nan_grad_on_rank_1, 2, True):
        assert report.rank == 1 and not report.on_every_rank
        assert "gradient on rank 1" in str(report), str(report)
    for report in run_ranks(nan_grad_on_rank_1, 2, False):
        assert report.on_every_rank and report.kind == "nan"
        assert "on every rank" in str(report) and "is not known" in str(report), str(report)


def nan_grads_then_clean(rank, world, register, culprit, micro=1):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0, max_consecutive_skips=4)
    ddp = DDP(model)
    if register:
        distamp.hooks.register(ddp, opt)  # the all-reduce hook: every rank holds the sum
    fault = {"on": rank == culprit}
    list(model.parameters())[-1].register_hook(lambda g: g * float("nan") if fault["on"] else g)
    reports, watching = [], []
    for step, (x, y) in enumerate(data(5, 4 * world)):
        for m in range(micro):  # synced micro-batches: the 2nd adds to a reduced NaN sum
            fault["on"] = rank == culprit and step < 2 and m == 0
            loss = F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[:4])
            with distamp.scale_loss(loss, opt) as sc:
                sc.backward()
        opt.step()
        opt.zero_grad()
        stats = distamp.stats(opt)
        reports.append(str(stats.last_nonfinite) if stats.last_step_skipped else None)
        watching.append(id(opt._distamp) in opt._distamp.group.origin_watches)
    fault["on"] = rank == culprit
    with pytest.raises(distamp.NonFiniteGradientError) as err:
        for x, y in data(4, 4 * world):
            with distamp.scale_loss(F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[:4]), opt) as sc:
                sc.backward()
            opt.step()
            opt.zero_grad()
    return reports, watching, str(err.value)


@pytest.mark.parametrize(
    "register,micro",
    [(False, 1), (True, 1), (False, 2)],
    ids=["DDP's all-reduce", "distamp's hook", "two synced backwards"],
)
@pytest.mark.parametrize("culprit", [0, 1])
def test_the_steps_after_a_skip_name_the_rank_the_nan_came_from(register, micro, culprit):
    """Through an all-reduce every rank holds the NaN, and the rank was "not known" (an audit:
    the error after max_consecutive_skips named no rank, where DESIGN asks for it). After such a
    skip each rank watches its own gradients before DDP sees them: the next skips, and the
    error, name the culprit; a clean step ends the watch."""
    for reports, watching, error in run_ranks(
        nan_grads_then_clean, 2, register, culprit, micro, timeout=120
    ):
        assert reports[0] is not None and "is not known" in reports[0], reports
        assert "the next skipped steps name it" in reports[0]
        assert (
            reports[1] is not None and f"rank {culprit} is the lowest rank whose own" in reports[1]
        )
        assert reports[2:] == [None, None, None]
        assert watching == [True, True, False, False, False]
        assert f"rank {culprit} is the lowest rank whose own" in error, error


def _origin_with_two_optimizers(rank, world, interleaved):
    models = [mlp(seed=1), mlp(seed=2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    models, opts = distamp.wrap(models, opts, opt_level="O2", num_losses=2, verbosity=0)
    ddps = [DDP(m) for m in models]
    step = {"n": 0}
    list(models[0].parameters())[-1].register_hook(  # rank 1's NaN, every step
        lambda g: g * float("nan") if rank == 1 else g
    )
    list(models[1].parameters())[-1].register_hook(  # rank 0's, at step 1 only
        lambda g: g * float("nan") if rank == 0 and step["n"] == 1 and interleaved else g
    )
    reports = []
    for n, (x, y) in enumerate(data(3, 4)):
        step["n"] = n
        for i in (0, 1) if interleaved else ():  # every backward, then every step
            with distamp.scale_loss(F.mse_loss(ddps[i](x), y), opts[i], loss_id=i) as scaled:
                scaled.backward()
        for i in (0, 1):
            if not interleaved:  # each optimizer's backward and step in turn
                with distamp.scale_loss(F.mse_loss(ddps[i](x), y), opts[i], loss_id=i) as scaled:
                    scaled.backward()
            opts[i].step()
            opts[i].zero_grad()
        reports.append(str(distamp.stats(opts[0]).last_nonfinite))
    return reports


@pytest.mark.parametrize("interleaved", [False, True], ids=["in turn", "backwards first"])
def test_each_optimizers_origin_watch_is_its_own(interleaved):
    """The watch was one per wrap: the second optimizer's clean step ended the one the first
    optimizer's skip started, and the rank was never named; its gradients marked the first's
    watch too, and rank 0 was named for rank 1's NaN (reviews)."""
    for reports in run_ranks(_origin_with_two_optimizers, 2, interleaved, timeout=120):
        assert "not known" in reports[0], reports
        assert all("rank 1 is the lowest rank whose own" in r for r in reports[1:]), reports


def _origin_in_a_block_of_two_optimizers(rank, world):
    models = [mlp(seed=1), mlp(seed=2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    models, opts = distamp.wrap(models, opts, opt_level="O2", verbosity=0)
    ddps = [DDP(m) for m in models]
    list(models[1].parameters())[-1].register_hook(  # the second optimizer's, rank 1 only
        lambda g: g * float("nan") if rank == 1 else g
    )
    reports = []
    for x, y in data(2, 4):
        loss = F.mse_loss(ddps[0](x), y) + F.mse_loss(ddps[1](x), y)
        with distamp.scale_loss(loss, opts) as scaled:  # one block decides both
            scaled.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        reports.append(str(distamp.stats(opts[1]).last_nonfinite))
    return reports


def test_a_block_of_two_optimizers_watches_both():
    """One decision covers every optimizer a block lists, but the watch went on the first one's
    parameters only, and a NaN in the second's was never traced to its rank (a review)."""
    for reports in run_ranks(_origin_in_a_block_of_two_optimizers, 2, timeout=120):
        assert "not known" in reports[0], reports
        assert "rank 1 is the lowest rank whose own" in reports[1], reports


def _origin_in_a_subgroup(rank, world):
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0, process_group=group)
    ddp = DDP(model, process_group=group)
    list(model.parameters())[-1].register_hook(lambda g: g * float("nan") if rank == 3 else g)
    reports = []
    for x, y in data(2, 4):
        with distamp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        reports.append(distamp.stats(opt).last_nonfinite)
    return reports


def test_the_origin_is_named_as_a_global_rank_under_a_process_group():
    """Counted within wrap's process_group, the rank is said as dist.get_rank() numbers it."""
    out = run_ranks(_origin_in_a_subgroup, 4, timeout=120)
    assert out[0] == out[1] == [None, None]
    for first, second in out[2:]:
        assert first.origin is None and first.on_every_rank
        assert second.origin == second.rank == 3 and "rank 3 is the lowest" in str(second)


def collectives_per_step(rank, world, reduce_scatter):
    """All-reduces issued inside optimizer.step() on a clean, a grad-overflow and a NaN-loss
    step, with what the skipped steps named; faults on rank 1 only (rank 0 holds no evidence)."""
    import torch.distributed as dist

    model, opt, ddp = _o2_ddp(reduce_scatter)
    last = list(model.parameters())[-1]
    fault = {"grad": False}
    last.register_hook(lambda g: g * float("inf") if fault["grad"] else g)
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    out = []
    for step, (x, y) in enumerate(data(3, 4 * world)):
        fault["grad"] = step == 1 and rank == 1
        loss = F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])
        if step == 2 and rank == 1:
            loss = loss * float("nan")
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        calls.clear()
        dist.all_reduce = counting
        try:
            opt.step()
        finally:
            dist.all_reduce = real
        opt.zero_grad()
        stats = distamp.stats(opt)
        out.append((len(calls), stats.last_step_skipped, stats.last_nonfinite))
    return out


@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_one_small_collective_per_step_also_on_skipped_steps(reduce_scatter):
    """DESIGN 1: exactly one small collective per optimizer step for the skip decision; the
    report of a skipped step (which loss or parameter, rank, inf or NaN) rides in it instead of
    costing one or two more all-reduces."""
    names = [n for n, _ in mlp().named_parameters()]
    for clean, overflow, nan_loss in run_ranks(collectives_per_step, 2, reduce_scatter):
        assert clean == (1, False, None)
        assert overflow[:2] == (1, True) and nan_loss[:2] == (1, True)
        grad_report, loss_report = overflow[2], nan_loss[2]
        assert grad_report.param == names[-1] and grad_report.kind in ("inf", "nan")
        if reduce_scatter:  # each rank keeps its own gradient: the rank is known
            assert grad_report.rank == 1 and not grad_report.on_every_rank
        else:
            assert grad_report.on_every_rank
        assert loss_report.loss_id == 0 and loss_report.rank == 1 and loss_report.kind == "nan"


def test_nan_loss_is_logged_at_once_on_rank_0(caplog):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=1)
    x, y = data(1, 4)[0]
    with caplog.at_level(logging.WARNING, logger="distamp"):
        with distamp.scale_loss(F.mse_loss(model(x), y) * float("nan"), opt) as scaled:
            scaled.backward()
        opt.step()
    assert any("the loss itself (loss_id 0) was a NaN" in r.getMessage() for r in caplog.records)


def test_a_nan_loss_every_step_is_logged_rate_limited(caplog):
    """DESIGN 3: rate-limited. A NaN loss on every step was logged on every step: now the first
    at once, then as the overflow skips are (the first 10, then every power of two)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(
        model, opt, opt_level="O2", verbosity=1, max_consecutive_skips=1000, loss_scale=1.0
    )
    x, y = data(1, 4)[0]
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for _ in range(40):
            with distamp.scale_loss(F.mse_loss(model(x), y) * float("nan"), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    logged = [r for r in caplog.records if "the loss itself" in r.getMessage()]
    assert len(logged) == 12  # skips 1-10, 16, 32


def test_an_fp16_scale_backed_off_below_one_is_said_once(caplog):
    """40 batches of inf loss halved the scale to 3e-8; the fp16 gradients then underflowed to 0
    and every later step was "clean" and trained nothing, silently (an audit)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=1)
    x, y = data(1, 4)[0]
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for _ in range(20):  # 2**16 -> 2**-4
            loss = F.mse_loss(model(x.half()).float(), y) * float("inf")
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    said = [r.getMessage() for r in caplog.records if "scale fell below 1" in r.getMessage()]
    assert len(said) == 1, said
    assert "(now 0.5) after 17 skipped steps, 17 of them with a non-finite loss" in said[0]
    assert "min_loss_scale=1.0" in said[0]


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_find_nonfinite_names_the_first_module_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), Log(), nn.Linear(4, 1)
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 3)
    rng = torch.get_rng_state()
    found = distamp.debug.find_nonfinite(model, x)
    # the dropout's draws did not move the run's RNG (an audit: later masks changed)
    assert torch.equal(torch.get_rng_state(), rng)
    assert found is not None and found.name == "3" and found.type == "Log"
    assert found.kind == "nan" and found.inputs_finite
    assert "module '3' (Log) produced nan from finite inputs" in str(found)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm statistics restored
    assert distamp.debug.find_nonfinite(nn.Linear(3, 1), torch.randn(2, 3)) is None


class _PosEmbed(nn.Module):  # ViT's way: a parameter the model's own forward adds
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(3))
        self.proj = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.proj(self.drop(x + self.pos))


def test_find_nonfinite_names_a_parameter_the_models_own_forward_uses():
    """A NaN in a parameter used between the submodules was blamed on the next module, "from
    inputs already non-finite", with finite data (an audit): the tensors are named too."""
    model = _PosEmbed()
    with torch.no_grad():
        model.pos[1] = float("nan")
    found = distamp.debug.find_nonfinite(model, torch.randn(2, 3))
    assert found is not None and found.name == "drop" and not found.inputs_finite
    assert found.nonfinite_tensors == ("pos",)
    assert "the model's own tensors held non-finite values before it ran: ['pos']" in str(found)


# -- soak -------------------------------------------------------------------------------------------

SOAK_STEPS = 1000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(rank, world, steps):
    model = mlp(d_in=8, hidden=8, d_out=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt)
    faults = random.Random(7)  # the same plan on every rank
    gen = torch.Generator().manual_seed(11 + rank)
    params = list(model.parameters())
    rss_after_warmup = None
    for step in range(steps):
        x = torch.randn(4, 8, generator=gen)
        y = torch.randn(4, 4, generator=gen)
        with distamp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
            scaled.backward()
        if faults.random() < 0.05:  # ~50 faults, each on one random rank, inf or NaN
            victim, kind = faults.randrange(world), faults.choice(["inf", "nan"])
            index = faults.randrange(len(params))
            if rank == victim:
                params[index].grad.view(-1)[0] = float(kind)
        opt.step()
        opt.zero_grad()
        if step == steps // 5:
            rss_after_warmup = _rss()
    s = distamp.stats(opt)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in opt._distamp.masters.master_tensors()],
        "scale": s.loss_scales[0],
        "skipped": s.skipped_steps,
        "rss_growth": _rss() / rss_after_warmup - 1.0,
    }


def test_soak_1000_fp16_steps_random_faults_world_4_bit_identical_and_flat_memory():
    results = run_ranks(soak, 4, SOAK_STEPS, timeout=600)
    first = results[0]
    growth = max(r["rss_growth"] for r in results)
    print(
        f"soak: {SOAK_STEPS} steps x 4 ranks, {first['skipped']} skipped, RSS growth {growth:.2%}"
    )
    assert first["skipped"] >= 30  # the faults really fired (and fp16's own overflows)
    for rank, r in enumerate(results):
        assert r["scale"] == first["scale"] and r["skipped"] == first["skipped"], rank
        for a, b in zip(r["params"], first["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: parameters differ"
        # Memory flat after warm-up: resident size grew by less than 5% over 800 steps.
        assert r["rss_growth"] < 0.05, f"rank {rank}: RSS grew {r['rss_growth']:.1%}"
    assert all(torch.isfinite(p).all() for p in first["params"])


def test_o3_fp16_adam_eps_is_flagged_at_wrap_and_inf_weights_are_named_in_the_error():
    """O3 fp16 steps fp16 weights with fp16 Adam state: eps=1e-8 is 0 there, and a gradient whose
    square underflows (1e-5) divides by 0 and writes inf weights (an audit's tiny GPT-2 under O3
    fp16: NaN from step 1). wrap warns about the eps; the error at the skip limit says the weights
    themselves are non-finite, not "look at the forward"."""
    model = GradProbe(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['eps'\] = 1e-08 rounds to 0"):
        model, opt = distamp.wrap(
            model, opt, opt_level="O3", half_dtype=torch.float16, max_consecutive_skips=3
        )
    g = torch.full((4,), 1e-5, dtype=torch.float16)
    with pytest.raises(distamp.NonFiniteGradientError, match=r"parameter 'w' holds inf"):
        for _ in range(10):
            with distamp.scale_loss(model(g), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    assert distamp.stats(opt).skipped_steps == 3  # the step that wrote inf, then 3 skips


def test_adam_eps_of_1e_4_or_fp32_masters_are_not_flagged():
    for level, eps in (("O3", 1e-4), ("O2", 1e-8)):
        model = GradProbe(4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            distamp.wrap(model, opt, opt_level=level, half_dtype=torch.float16, verbosity=0)


def wire_overflow(rank, world):
    """FP32 compute, FP32 weights sharded, gradients reduce-scattered over an fp16 wire: every
    rank's own gradient is finite (~1e6) and past fp16's range."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    model, opt = distamp.wrap(
        model, opt, opt_level="O0", shard_master_weights=True, half_dtype=torch.float16, verbosity=0
    )
    ddp = DDP(model)
    # (an fp16 wire asked for: with no loss scale, O0's default wire is bf16)
    distamp.hooks.register(ddp, opt, torch.float16, reduce_scatter=True)
    x, y = data(1, 4 * world)[0]
    loss = F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[:4] * 1e6)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    opt.step()
    return finite, distamp.stats(opt).last_step_skipped, distamp.stats(opt).last_nonfinite


@pytest.mark.parametrize("shard_block", [4], indirect=True)
def test_a_wire_overflow_in_the_reduce_scatter_is_named_as_one(shard_block):
    """The inf lives only in the FP32 shard gradients the hook summed into: the skip named no
    parameter, and the final error blamed the forward pass (an audit). Each rank's own
    gradients are read first (a rank's own inf is still named with its rank, above)."""
    names = [n for n, _ in mlp().named_parameters()]
    for finite, skipped, report in run_ranks(wire_overflow, 2):
        assert finite and skipped
        assert report is not None and report.after_reduce and report.param == names[0], report
        assert "every rank's own gradient finite: the 16-bit wire overflowed" in str(report)


def fp16_all_reduce_overflow(rank, world):
    """As wire_overflow, through the all-reduce hook: every rank's own gradient is finite, the
    reduced one is not, and each rank holds only the reduced one."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    model, opt = distamp.wrap(
        model, opt, opt_level="O0", shard_master_weights=False, half_dtype=torch.float16
    )
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt, torch.float16)
    x, y = data(1, 4 * world)[0]
    loss = F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), y[:4] * 1e6)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return distamp.stats(opt).last_step_skipped, distamp.stats(opt).last_nonfinite


@pytest.mark.parametrize("world", [1, 2])
def test_a_skip_after_an_fp16_all_reduce_says_the_wire_may_have_overflowed(world):
    """The reduce-scatter hook can tell a wire overflow from a rank's own inf; after the
    all-reduce hook every rank holds the sum only, and the report said "on every rank" as if a
    rank's gradient had been non-finite (an audit). At one rank the hook casts all the same,
    and the report named the rank's own gradient (an audit)."""
    for skipped, report in run_ranks(fp16_all_reduce_overflow, world):
        assert skipped and report is not None and report.fp16_wire, report
        assert report.on_every_rank == (world > 1)
        wire = "or the fp16 wire overflowed"
        assert wire in str(report), str(report)


def _inf_in_a_subgroup(rank, world):
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    group = groups[rank // 2]
    model = GradProbe(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O0", process_group=group, verbosity=0)
    ddp = DDP(model, process_group=group)
    with distamp.scale_loss(ddp(torch.ones(4)), opt) as scaled:
        scaled.backward()
    if rank == 3:
        model.w.grad[0] = float("inf")  # after the reduce: global rank 3 only
    opt.step()
    return distamp.stats(opt).last_step_skipped, distamp.stats(opt).last_nonfinite


def test_the_rank_named_under_a_process_group_of_some_ranks_is_the_global_one():
    """Two data-parallel groups of 2 at world 4: an inf on global rank 3 was reported as
    "on rank 1" (its rank within the group), a rank of the other group that had none (an
    audit)."""
    results = run_ranks(_inf_in_a_subgroup, 4)
    assert [skipped for skipped, _ in results] == [False, False, True, True]
    for _, report in results[2:]:
        assert report is not None and report.rank == 3 and "on rank 3" in str(report), report


def test_every_optimizer_a_skipped_block_listed_gets_the_report():
    """One scale_loss block listing two optimizers: the second to step skipped on the
    decision the first one's step took, and its stats said nothing (last_nonfinite None) while
    the culprit was its own parameter (an audit)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 2)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [oa, ob] = distamp.wrap([a, b], [oa, ob], opt_level="O0", verbosity=0)
    with distamp.scale_loss(b(a(torch.randn(2, 4))).sum(), [oa, ob]) as scaled:
        scaled.backward()
    b.weight.grad[0, 0] = float("nan")
    with warnings.catch_warnings():
        # (a gradient written at a loss scale of 1 is its unscaled self: nothing to warn about)
        warnings.simplefilter("error")
        oa.step()
        ob.step()
    for opt in (oa, ob):
        stats = distamp.stats(opt)
        assert stats.last_step_skipped and stats.last_nonfinite is not None
        assert stats.last_nonfinite.param == "models[1].weight", stats.last_nonfinite


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x, *, mask):
        return self.q(x) + mask


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attn()
        self.out = nn.Linear(4, 2)

    def forward(self, x, mask=None):
        return self.out(self.attn(x, mask=mask))


class _Rotary(nn.Module):
    """A cache grown to the sequence length (older Hugging Face rotary embeddings), and one
    made at the first forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos", torch.ones(4, 4), persistent=False)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > self.cos.shape[0]:
            self.register_buffer("cos", torch.ones(x.shape[0], 4), persistent=False)
        if not hasattr(self, "made"):
            self.register_buffer("made", torch.ones(1))
        return self.lin(x) * self.cos[: x.shape[0]] * self.made


def test_find_nonfinite_reads_keyword_inputs_and_puts_back_buffers_a_forward_made_or_grew():
    """An attention mask passed by keyword held the NaN: "from finite inputs" sent the user to
    the wrong module; a rotary cache grown in forward (or made there) crashed the buffer restore
    and the report was lost, the model left changed (an audit)."""
    mask = torch.zeros(2, 4)
    mask[0, 0] = float("nan")
    found = distamp.debug.find_nonfinite(_Masked(), torch.randn(2, 4), mask=mask)
    assert found is not None and found.name == "attn" and not found.inputs_finite, found
    rotary = _Rotary()
    cos = rotary.cos
    assert distamp.debug.find_nonfinite(rotary, torch.randn(8, 4)) is None
    assert rotary.cos is cos and rotary.cos.shape == (4, 4)
    assert not hasattr(rotary, "made") and "made" not in dict(rotary.named_buffers())
    assert "cos" not in rotary.state_dict()  # still not persistent


def _find_nonfinite_on_one_rank(rank, world):
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    if rank == 0:
        x[0, 0] = float("inf")
        found = distamp.debug.find_nonfinite(model, x)  # on rank 0 alone: no collective
        assert found is not None and found.name == "0", found
    dist_barrier()
    return True


def dist_barrier():
    torch.distributed.barrier()


def test_find_nonfinite_on_a_ddp_model_runs_on_one_rank_alone():
    """DDP's forward broadcasts its buffers: called on the rank that skipped, it aborted the job
    (an audit). The module DDP wraps runs instead, and the names are the model's own."""
    assert run_ranks(_find_nonfinite_on_one_rank, 2, timeout=120) == [True, True]
