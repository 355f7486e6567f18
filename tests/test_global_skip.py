"""The skip decision is global: an inf/NaN on one rank only makes every rank skip and back off.

Real gloo ranks under DDP; the non-finite value is written into one rank's gradient *after* DDP's
all-reduce, so no other rank can see it except through distamp's own flag reduction.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import data, mlp
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

PER_RANK = 4


def _train(rank, world, level, half, steps, plan, wrap_kw=None):
    """plan: {step: (rank, param_index, "inf"|"nan")}. Returns what every rank saw."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = distamp.wrap(
        model, opt, opt_level=level, half_dtype=half, verbosity=0, **(wrap_kw or {})
    )
    ddp = DDP(model)
    params = list(model.parameters())
    skipped, scales = [], []
    for step, (x, y) in enumerate(data(steps, PER_RANK * world)):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = F.mse_loss(ddp(x[mine]), y[mine])
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if step in plan and plan[step][0] == rank:
            _, index, kind = plan[step]
            params[index].grad.view(-1)[0] = float(kind)
        opt.step()
        opt.zero_grad()
        s = distamp.stats(opt)
        skipped.append(s.last_step_skipped)
        scales.append(s.loss_scales[0])
    s = distamp.stats(opt)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [p.detach().clone() for g in opt.param_groups for p in g["params"]],
        "skipped": skipped,
        "scales": scales,
        "report": s.last_nonfinite,
    }


def fp32_reference(world, steps, skip):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(data(steps, PER_RANK * world)):
        F.mse_loss(model(x), y).backward()
        if step not in skip:
            opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def assert_ranks_identical(results):
    first = results[0]
    for other in results[1:]:
        assert other["skipped"] == first["skipped"]
        assert other["scales"] == first["scales"]
        for a, b in zip(first["params"], other["params"], strict=True):
            assert torch.equal(a, b)  # the half weights (masters are sharded by default)


@pytest.mark.parametrize("world", [2, 3])
def test_inf_on_one_rank_only_makes_every_rank_skip_and_back_off(world):
    steps = 8
    plan = {3: (world - 1, 0, "inf"), 5: (0, 2, "nan")}
    results = run_ranks(_train, world, "O2", torch.bfloat16, steps, plan)
    assert_ranks_identical(results)
    skipped = results[0]["skipped"]
    assert [i for i, s in enumerate(skipped) if s] == [3, 5]
    scales = results[0]["scales"]
    assert scales[3] == scales[2] / 2 and scales[5] == scales[4] / 2
    assert scales[4] == scales[3]  # no back-off on a clean step
    report = results[0]["report"]
    assert (report.param, report.rank, report.kind) == ("1.weight", 0, "nan")
    # Stated tolerance against a single-process FP32 run on the whole batch, same steps skipped:
    # bf16 weights, 8 steps of SGD with momentum: 2% relative L2 per tensor.
    reference = fp32_reference(world, steps, skip={3, 5})
    for p, r in zip(results[0]["params"], reference, strict=True):
        assert ((p.float() - r).norm() / r.norm()).item() < 2e-2


@pytest.mark.parametrize("world", [2, 3])
def test_100_steps_with_random_faults_keep_ranks_bit_identical(world):
    rng = random.Random(world)
    plan = {
        step: (rng.randrange(world), rng.randrange(6), rng.choice(["inf", "-inf", "nan"]))
        for step in rng.sample(range(100), 15)
    }
    results = run_ranks(_train, world, "O2", torch.bfloat16, 100, plan)
    assert_ranks_identical(results)
    assert [i for i, s in enumerate(results[0]["skipped"]) if s] == sorted(plan)


def _hopeless(rank, world):
    try:
        _train(
            rank,
            world,
            "O2",
            torch.bfloat16,
            20,
            {i: (1, 2, "nan") for i in range(20)},
            wrap_kw={"max_consecutive_skips": 4},
        )
    except distamp.NonFiniteGradientError as err:
        return str(err)
    return None


def test_endless_overflow_stops_with_the_parameter_and_the_rank():
    messages = run_ranks(_hopeless, 2)
    assert messages[0] == messages[1]
    assert messages[0] is not None
    assert "4 consecutive optimizer steps were skipped" in messages[0]
    assert "'1.weight'" in messages[0] and "rank 1" in messages[0] and "NaN" in messages[0]


def _broken_weight(rank, world):
    """Rank 1's script writes inf into a weight: every later step skips on every rank."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0, max_consecutive_skips=3)
    ddp = DDP(model)
    if rank == 1:
        with torch.no_grad():
            model[3].weight[0, 0] = float("inf")
    try:
        for x, y in data(10, 8, seed=rank):
            with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    except distamp.NonFiniteGradientError as err:
        return str(err)
    return None


def test_a_non_finite_weight_on_one_rank_is_named_alike_on_every_rank():
    """An audit: only the rank holding it said the weights were non-finite; rank 0 (the log one
    reads) pointed at the forward pass and at an fp16 wire there was none of (bf16, no hook)."""
    messages = run_ranks(_broken_weight, 2)
    assert messages[0] is not None and messages[0] == messages[1]
    assert "parameter '3.weight' holds inf on rank 1" in messages[0], messages[0]
    assert "fp16 wire" not in messages[0]


def _floor(rank, world):
    try:
        _train(
            rank,
            world,
            "O2",
            torch.float16,
            6,
            {i: (0, 0, "inf") for i in range(6)},
            wrap_kw={"min_loss_scale": 2.0**14},
        )
    except distamp.NonFiniteGradientError as err:
        return str(err)
    return None


def test_skip_at_min_loss_scale_raises_on_every_rank():
    messages = run_ranks(_floor, 2)
    assert messages[0] == messages[1] and messages[0] is not None
    assert "minimum loss scale 16384" in messages[0]
    assert "'0.weight'" in messages[0] and "rank 0" in messages[0] and "inf" in messages[0]
    # the floor the user set may be the inf's cause (an audit: "lowering the loss scale does
    # not fix this" at min_loss_scale=16384, where a lower floor fixes an overflow)
    assert "lower min_loss_scale" in messages[0] and "does not fix" not in messages[0]


def _framework_backward(rank, world, faulty_steps):
    """The Trainer's, accelerate's, Lightning's backward: outside scale_loss (bf16, no loss
    scale), a NaN in rank 1's loss at ``faulty_steps``."""
    import warnings

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0, max_consecutive_skips=4)
    ddp = DDP(model)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "backward without distamp.scale_loss"
        try:
            for step, (x, y) in enumerate(data(12, PER_RANK * world)):
                mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                loss = F.mse_loss(ddp(x[mine]), y[mine])
                if rank == 1 and step in faulty_steps:
                    loss = loss * float("nan")
                loss.backward()
                opt.step()
                opt.zero_grad()
                skipped.append(distamp.stats(opt).last_step_skipped)
        except distamp.NonFiniteGradientError as err:
            return skipped, str(err)
    return skipped, None


def test_endless_skips_after_a_framework_backward_stop_too():
    """No scale_loss block, so no loss scaler counted the skips: a NaN on one rank every step
    skipped every step forever and the run ended "fine" having trained nothing (an audit). The
    group counts them against max_consecutive_skips; a step taken starts the count again."""
    for skipped, message in run_ranks(_framework_backward, 2, set(range(12))):
        assert skipped == [True] * 3, skipped
        assert message is not None and "4 consecutive optimizer steps were skipped" in message
        assert "outside distamp.scale_loss" in message and "NaN gradient" in message, message
    intermittent = {0, 1, 2, 4, 5, 6, 8, 9, 10}  # three in a row at most
    for skipped, message in run_ranks(_framework_backward, 2, intermittent):
        assert message is None, message
        assert [i for i, s in enumerate(skipped) if s] == sorted(intermittent)
