"""distamp.GradScaler: torch.amp.GradScaler's API, one decision on every rank, FP16 gradients."""

import gc
import inspect
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import FrameworkOptimizer, data, mlp
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp


def torch_amp_script(rank, world, scaler_kind, fused=False, inject=None, steps=8):
    """A torch.amp + DDP script; the only change for distamp is the GradScaler line."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    ddp = DDP(model) if world > 1 else model
    scaler = distamp.GradScaler() if scaler_kind == "distamp" else torch.amp.GradScaler("cpu")
    skipped = []
    for step, (x, y) in enumerate(data(steps, 4 * world)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]).float(), y[rank * 4 : rank * 4 + 4])
        scaler.scale(loss).backward()
        if inject is not None and step == inject and rank == world - 1:
            model[0].weight.grad.view(-1)[0] = float("inf")  # after the all-reduce: this rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(
            all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        )
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "scale": scaler.get_scale(),
        "skipped": skipped,
        "state": scaler.state_dict(),
    }


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_inf_on_one_rank_only_makes_every_rank_skip(fused):
    results = run_ranks(torch_amp_script, 2, "distamp", fused, 3)
    for r in results:
        assert r["skipped"] == [s == 3 for s in range(8)]
        assert r["scale"] == 2.0**15
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    # torch's own scaler: the rank with the inf skips alone, the ranks drift apart.
    torch_results = run_ranks(torch_amp_script, 2, "torch", fused, 3)
    assert torch_results[0]["skipped"][3] is False and torch_results[1]["skipped"][3] is True
    assert not all(
        torch.equal(a, b)
        for a, b in zip(torch_results[0]["params"], torch_results[1]["params"], strict=True)
    )


def test_same_result_as_torch_scaler_without_faults():
    ours = torch_amp_script(0, 1, "distamp")
    theirs = torch_amp_script(0, 1, "torch")
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(a, b)
    assert ours["state"] == {
        k: (v if not isinstance(v, torch.Tensor) else v.item()) for k, v in theirs["state"].items()
    }


def test_fp16_gradients_work_where_torch_raises():
    def run(scaler):
        model = mlp().half()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = data(1, 4)[0]
        scaler.scale(F.mse_loss(model(x.half()).float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        return model

    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        run(torch.amp.GradScaler("cpu"))
    model = run(distamp.GradScaler())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def clean_steps(scaler, opt, n):
    """``n`` iterations whose gradients are all zeros: every one counts towards growth."""
    for _ in range(n):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        scaler.step(opt)
        scaler.update()


def test_growth_never_reaches_inf_and_state_round_trips():
    scaler = distamp.GradScaler(init_scale=2.0**120, growth_interval=1, max_scale=float("inf"))
    opt = torch.optim.SGD(mlp().parameters(), lr=0.0)
    clean_steps(scaler, opt, 20)
    assert scaler.get_scale() == 2.0**127  # the largest power of two below float32's inf
    other = distamp.GradScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
        scaler.unscale_(opt)


def test_a_loaded_scale_above_the_cap_is_kept_not_lowered_by_growth():
    """torch's GradScaler has no cap; a state dict from it with a scale above distamp's
    max_scale (2**24) loads as is, and a growth step must not turn into a back-off."""
    scaler = distamp.GradScaler(growth_interval=1)
    state = torch.amp.GradScaler("cpu", init_scale=2.0**26).state_dict()
    scaler.load_state_dict(state)
    opt = torch.optim.SGD(mlp().parameters(), lr=0.0)
    clean_steps(scaler, opt, 3)
    assert scaler.get_scale() == 2.0**26


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_wrapped_o2_optimizer_with_a_grad_scaler_says_what_to_write(level):
    """A half-migrated script: wrap(..., "O2") added, the GradScaler calls kept. O2's optimizer
    steps FP32 masters that get gradients only in its own step(): named, not "run backward
    first". O3 has no masters: the scaler unscales the half gradients it steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    scaler = distamp.GradScaler()
    x, y = next(iter(data(1, 4)))
    scaler.scale(F.mse_loss(model(x).float(), y)).backward()
    if level == "O2":
        with pytest.raises(
            RuntimeError, match=r"wrapped by distamp.wrap \(opt_level O2\).*scale_loss"
        ):
            scaler.step(opt)
        assert all(p.grad is not None for p in model.parameters())  # nothing lost
    else:  # distamp.GradScaler is what the "without scale_loss" warning advises: none
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(opt)
        scaler.update()


def _torch_scaler_on_masters(rank, world, kwargs):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, verbosity=0, **kwargs)
    train = DDP(model) if world > 1 else model
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = next(iter(data(1, 4, seed=rank)))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(F.mse_loss(train(x.to(next(model.parameters()).dtype)).float(), y)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not "taken as unscaled (scale 1.0)"
        with pytest.raises(RuntimeError) as caught:
            scaler.step(opt)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return str(caught.value), unchanged, hasattr(opt, "found_inf")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"opt_level": "O2", "half_dtype": torch.float16},
        {"opt_level": "O2", "half_dtype": torch.bfloat16},
        {"opt_level": "O1", "shard_master_weights": True},
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_torch_grad_scaler_on_a_wrapped_optimizer_with_masters_is_refused_by_name(kwargs, world):
    """A half-migrated torch.amp script (wrap O2 added, torch's GradScaler kept): torch unscaled
    the masters (no gradients yet), distamp's step took the model's scaled half gradients as
    unscaled, a 1024x update after one warning (an audit); sharded O1 met torch's "No inf checks
    were recorded". Now refused by name before anything changes, on every rank."""
    for message, unchanged, left in run_ranks(_torch_scaler_on_masters, world, kwargs):
        assert message.startswith("torch.amp.GradScaler: this optimizer was wrapped by distamp")
        assert "distamp.scale_loss(loss, optimizer)" in message, message
        assert unchanged and not left


def test_a_framework_asking_whether_a_wrapped_o2_optimizer_unscales_itself_gets_an_answer():
    """Lightning reads _step_supports_amp_scaling before its clipping, in bf16-mixed too where no
    scaler exists: the refusal raised from the read broke `hasattr` and a working bf16-mixed
    fit with gradient_clip_val (an audit). Only torch's GradScaler.step is refused."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    assert getattr(opt, "_step_supports_amp_scaling", True) is False
    assert hasattr(opt, "_step_supports_amp_scaling")
    inspect.getmembers(opt)
    # ...and torch's scaler driving it still meets the refusal (a subclass's inherited step too)

    class Scaler(torch.amp.GradScaler):
        pass

    scaler = Scaler("cpu", init_scale=4.0)
    x, y = next(iter(data(1, 4)))
    scaler.scale(F.mse_loss(model(x.half()).float(), y)).backward()
    with pytest.raises(RuntimeError, match=r"^torch.amp.GradScaler: this optimizer was wrapped"):
        scaler.step(opt)


@pytest.mark.parametrize("enabled", [True, False])
def test_torch_grad_scaler_through_a_wrapper_that_hides_the_attribute_is_refused(enabled):
    """The wrapper answered no _step_supports_amp_scaling of its own: torch's scaler unscaled
    the masters (no gradients) and distamp's step took the model's scaled gradients, a 1024x
    update, silently (an audit). A disabled scaler just steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled)
    x, y = next(iter(data(1, 4)))
    loss = F.mse_loss(model(x.half()).float(), y)
    if enabled:
        scaler.scale(loss).backward()
        with pytest.raises(RuntimeError, match=r"^torch.amp.GradScaler: this optimizer was wrap"):
            scaler.step(FrameworkOptimizer(opt))
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    else:
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        scaler.step(FrameworkOptimizer(opt))
        assert distamp.stats(opt).steps == 1


def test_torch_grad_scaler_on_a_wrapped_o1_optimizer_still_steps_fused_or_not():
    """Without masters torch's scaler unscales the model's own FP32 gradients, as before; a fused
    optimizer keeps its own _step_supports_amp_scaling (torch hands it grad_scale/found_inf)."""
    for fused in (False, True):
        torch.manual_seed(0)
        model = mlp()
        ref = mlp()
        ref.load_state_dict(model.state_dict())
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1, fused=fused)
        model, opt = distamp.wrap(model, opt, opt_level="O0", verbosity=0)
        assert opt._step_supports_amp_scaling is fused
        for net, o in ((model, opt), (ref, ref_opt)):
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            for x, y in data(2, 4):
                scaler.scale(F.mse_loss(net(x), y)).backward()
                scaler.step(o)
                scaler.update()
                o.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b), fused


def test_a_wrapped_o1_optimizer_driven_by_distamp_grad_scaler_reports_its_skips_and_scale():
    """An audit (nanoGPT migrated with wrap O1 and distamp.GradScaler): step() warned "without
    distamp.scale_loss ... use distamp.GradScaler", and distamp.stats missed the scaler's skip
    and showed 65536 while the scale in use was 32768."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O1", verbosity=0)
    scaler = distamp.GradScaler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step, (x, y) in enumerate(data(3, 4)):
            loss = F.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            stats = distamp.stats(opt)
            assert stats.last_step_skipped == (step == 1), step
            assert stats.loss_scales == (scaler.get_scale(),)
    assert (stats.steps, stats.skipped_steps) == (3, 1)
    assert scaler.get_scale() == 2.0**15


def _clip_with_distamp_under_grad_scaler(rank, world, level):
    """distamp.GradScaler's loop with distamp.clip_grad_norm_ after scaler.unscale_ (DDP at
    world 2), and the same loop without distamp; the weights after 3 steps, the norms and the
    message a clip before scaler.unscale_ gives."""
    torch.manual_seed(0)
    plain = mlp()
    model = mlp()
    model.load_state_dict(plain.state_dict())
    weights = []
    for kind in ("distamp", "torch"):
        net = model if kind == "distamp" else plain
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if kind == "distamp":
            net, opt = distamp.wrap(net, opt, opt_level=level, verbosity=0)
        ddp = DDP(net) if world > 1 else net
        scaler = distamp.GradScaler() if kind == "distamp" else torch.amp.GradScaler("cpu")
        norms = []
        for x, y in data(3, 4, seed=rank):
            scaler.scale(F.mse_loss(ddp(x).float(), y)).backward()
            scaler.unscale_(opt)
            if kind == "distamp":
                norms.append(float(distamp.clip_grad_norm_(opt, 0.05)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        weights.append(([p.detach().float().clone() for p in net.parameters()], norms))
        if kind == "distamp":  # the clip before unscale_, at the next iteration
            scaler.scale(F.mse_loss(ddp(x).float(), y)).backward()
            try:
                distamp.clip_grad_norm_(opt, 0.05)
                refused = ""
            except RuntimeError as exc:
                refused = str(exc)
            opt.zero_grad()
    return weights, refused


@pytest.mark.parametrize("world", [1, 2])
def test_distamp_clipping_after_grad_scaler_unscale_clips_the_unscaled_gradients(world):
    """An audit (a sweep of configurations): after scaler.unscale_(optimizer),
    distamp.clip_grad_norm_ refused with advice meant for a framework's backward at scale 1.0 —
    followed, it clipped gradients still multiplied by the scale. It clips the unscaled ones now,
    as torch's clip_grad_norm_ after torch's GradScaler.unscale_; before scaler.unscale_ it says
    to call that first."""
    for [(ours, our_norms), (theirs, their_norms)], refused in run_ranks(
        _clip_with_distamp_under_grad_scaler, world, "O0"
    ):
        assert our_norms == pytest.approx(their_norms, rel=1e-6) and our_norms[0] > 0.05
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert "distamp.GradScaler drives this optimizer" in refused
        assert "call scaler.unscale_(optimizer) first" in refused


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_disabled_grad_scaler_on_a_wrapped_optimizer_reports_scale_one(half):
    """``GradScaler(enabled=args.fp16)`` switched off: the gradients are taken at scale 1.0, so
    stats says 1.0 (an audit: wrap's unused 65536); at fp16 that is unscaled fp16 training,
    which step() still warns about."""
    model = mlp()
    model, opt = distamp.wrap(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level="O1",
        half_dtype=half,
        verbosity=0,
    )
    scaler = distamp.GradScaler(enabled=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for x, y in data(2, 4):
            scaler.scale(F.mse_loss(model(x).float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert distamp.stats(opt).loss_scales == (1.0,)
    assert distamp.stats(opt).steps == 2
    unscaled = [w for w in seen if "without distamp.scale_loss" in str(w.message)]
    assert len(unscaled) == (1 if half == torch.float16 else 0), [str(w.message) for w in seen]


def _persistent_nan_on_one_rank(rank, world, wrapped):
    """torch.amp + DDP, or wrap O1 + DDP, with distamp.GradScaler; the last rank's first
    weight gradient is NaN at every iteration (after the all-reduce: that rank only)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapped:
        model, opt = distamp.wrap(model, opt, opt_level="O1", max_consecutive_skips=5, verbosity=0)
        scaler = distamp.GradScaler()
    else:
        scaler = distamp.GradScaler(max_consecutive_skips=5)
    ddp = DDP(model)
    iterations = 0
    try:
        for x, y in data(8, 4):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not wrapped):
                loss = F.mse_loss(ddp(x).float(), y)
            scaler.scale(loss).backward()
            if rank == world - 1:
                model[0].weight.grad.view(-1)[0] = float("nan")
            scaler.step(opt)
            iterations += 1
            scaler.update()
            opt.zero_grad()
    except distamp.NonFiniteGradientError as exc:
        return iterations, str(exc), scaler.get_scale()
    return iterations, "", scaler.get_scale()


@pytest.mark.parametrize("wrapped", [False, True], ids=["torch.amp", "wrap O1"])
def test_a_persistent_nan_on_one_rank_raises_on_every_rank_naming_it(wrapped):
    """Semantics 3 on the GradScaler path (an audit): 144 skips, the scale halved to 2**-128,
    then torch's "value cannot be converted to type float without overflow", naming nothing."""
    results = run_ranks(_persistent_nan_on_one_rank, 2, wrapped, timeout=120)
    name = (
        "'0.weight'"
        if wrapped
        else r"\"SGD #0 param_groups\[0\]\['params'\]\[0\] \(shape \(16, 8\)\)\""
    )
    for iterations, message, scale in results:
        assert iterations == 5, results
        assert re.search(
            rf"5 consecutive iterations were skipped: parameter {name} had a NaN "
            r"gradient on rank 1",
            message,
        ), message
        assert scale == 2.0**11


def _clip_stages_or_a_skipped_step(rank, world, case):
    """distamp.clip_grad_norm_ after scaler.unscale_ on a wrapped O1 optimizer: "stages", each
    rank its own stage wrapped over its own one-rank group (a pipeline's habit), one GradScaler
    over the world; "skip", DDP replicas with an inf on rank 1 only."""
    torch.manual_seed(rank if case == "same stages" else 0)
    stage = torch.nn.Linear(4, 4) if case != "stages" or rank == 0 else torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    own = torch.distributed.new_group([0]), torch.distributed.new_group([1])
    group = own[rank] if "stages" in case else None
    stage, opt = distamp.wrap(stage, opt, opt_level="O1", process_group=group, verbosity=0)
    model = DDP(stage) if case == "skip" else stage
    scaler = distamp.GradScaler()
    weights = [p.detach().clone() for p in stage.parameters()]
    scaler.scale(model(torch.randn(2, 4)).float().sum()).backward()
    if case == "skip" and rank == 1:
        stage.weight.grad.view(-1)[0] = float("inf")
    scaler.unscale_(opt)
    try:
        norm = float(distamp.clip_grad_norm_(opt, 0.01))
    except RuntimeError as exc:
        return str(exc)
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, stage.parameters(), strict=True))
    return norm, unchanged, scaler.get_scale()


def test_clipping_under_grad_scaler_refuses_a_stage_norm_and_returns_inf_for_a_skip():
    """Audits: each pipeline stage clipped to its own norm (the global one 4.45, each stage's
    3.14: the weights drifted, silently); on a step every rank skips, a rank with finite
    gradients returned their finite norm where distamp's own path returns inf."""
    for case in ("stages", "same stages"):  # (stages of one shape: told by their gradients)
        for message in run_ranks(_clip_stages_or_a_skipped_step, 2, case, timeout=90):
            assert isinstance(message, str), message
            assert "found them holding different ones (pipeline stages" in message, message
            assert "torch.nn.utils.clip_grads_with_norm_" in message
    for norm, unchanged, scale in run_ranks(_clip_stages_or_a_skipped_step, 2, "skip"):
        assert norm == float("inf") and unchanged and scale == 32768.0


def _stages_of_other_sizes(rank, world):
    """A pipeline's stages under one GradScaler over the world: rank 0's optimizer holds 2
    parameters, rank 1's 6; rank 1's fifth gradient is NaN at every iteration."""
    torch.manual_seed(rank)
    stage = torch.nn.Linear(4, 4)
    if rank == 1:
        stage = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    scaler = distamp.GradScaler(max_consecutive_skips=2)
    try:
        for _ in range(3):
            scaler.scale(stage(torch.randn(2, 4)).sum()).backward()
            if rank == 1:
                list(stage.parameters())[4].grad.view(-1)[0] = float("nan")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    except distamp.NonFiniteGradientError as exc:
        return str(exc)
    return None


def test_ranks_whose_optimizers_hold_other_parameter_counts_raise_together():
    """The evidence was coded with each rank's own count: rank 0 raised IndexError decoding it
    while rank 1 went on to its next collective (an audit)."""
    first, second = run_ranks(_stages_of_other_sizes, 2, timeout=120)
    assert second is not None, second
    assert "SGD #0 param_groups[0]['params'][4] (shape (4, 4))" in second, second
    assert "on rank 1" in second, second
    assert first is not None and "parameter #4 of rank 1's optimizer" in first, first


def _stages_of_one_size(rank, world):
    """Two pipeline stages holding 2 parameters each, of other shapes; rank 1's first gradient
    is NaN."""
    torch.manual_seed(rank)
    stage = torch.nn.Linear(8, 16) if rank == 0 else torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    scaler = distamp.GradScaler(max_consecutive_skips=1)
    scaler.scale(stage(torch.randn(2, stage.in_features)).sum()).backward()
    if rank == 1:
        stage.weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    with pytest.raises(distamp.NonFiniteGradientError) as caught:
        scaler.update()
    return str(caught.value)


def test_ranks_whose_optimizers_hold_as_many_other_parameters_name_the_culprit_alike():
    """Equal counts were taken for the same parameters: rank 0 named its own first parameter's
    shape (16, 8) for rank 1's culprit (an audit)."""
    first, second = run_ranks(_stages_of_one_size, 2, timeout=120)
    assert "(shape (4, 16))" in second and "on rank 1" in second, second
    assert "parameter #0 of rank 1's optimizer" in first and "(16, 8)" not in first, first


def _two_optimizers_one_scaler(rank, world, early, inf=True, steps=2, replace_at=None):
    """Two same-shaped models, one GradScaler. ``early`` (0, 1 or None): the optimizer rank 0
    alone unscales first (to log its norm), from iteration ``replace_at or 0`` on; ``inf``: an
    inf in the second optimizer's gradients on rank 1 only; ``replace_at``: o0 replaced by a new
    optimizer then, rank 0 keeping the old one alive (a logger's reference), rank 1 freeing it."""
    m0, m1 = mlp(seed=0), mlp(seed=1)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.05)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.05)
    d0, d1 = DDP(m0), DDP(m1)
    scaler = distamp.GradScaler(init_scale=1024.0)
    kept = []
    try:
        for it, (x, y) in enumerate(data(steps, 8 * world)):
            if it == replace_at:
                if rank == 0:
                    kept.append(o0)
                o0 = torch.optim.SGD(m0.parameters(), lr=0.05)
                gc.collect()
            x, y = x[rank::world], y[rank::world]
            scaler.scale(F.mse_loss(d0(x), y)).backward()
            scaler.scale(F.mse_loss(d1(x), y)).backward()
            if inf and rank == 1:
                m1[0].weight.grad[0, 0] = float("inf")
            if early is not None and it >= (replace_at or 0) and rank == 0:
                scaler.unscale_((o0, o1)[early])
            scaler.step(o0)
            scaler.step(o1)
            scaler.update()
            o0.zero_grad()
            o1.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return [p.detach().clone() for p in (*m0.parameters(), *m1.parameters())]


def test_a_rank_unscaling_another_optimizer_than_its_peers_is_refused_on_every_rank():
    """Rank 0's early unscale_ of the second optimizer paired its decision with rank 1's first
    optimizer: rank 0 skipped o0 and stepped o1, rank 1 the reverse, and the ranks' weights
    parted silently (an audit)."""
    for message in run_ranks(_two_optimizers_one_scaler, 2, 1, timeout=120):
        assert isinstance(message, str), "expected a refusal"
        assert "expected every rank to decide the same optimizer" in message, message
        assert "stepped #1 on some ranks and #2 on others" in message, message


def test_a_rank_unscaling_the_first_optimizer_alone_is_fine():
    """The same early unscale_ of the optimizer every rank decides first pairs with it: the
    ranks skip the same (the second) optimizer and stay identical."""
    first, second = run_ranks(_two_optimizers_one_scaler, 2, 0, timeout=120)
    assert not isinstance(first, str) and not isinstance(second, str), (first, second)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_an_optimizer_replaced_mid_training_keeps_the_order_on_every_rank():
    """The order came from a weak dictionary's length, which shrank when an optimizer was freed
    (at other times on other ranks): a kept reference on one rank was refused as a mismatch,
    and a replaced optimizer took a live one's place, letting a real mismatch through (an
    audit)."""
    first, second = run_ranks(_two_optimizers_one_scaler, 2, None, False, 4, 2, timeout=120)
    assert not isinstance(first, str) and not isinstance(second, str), (first, second)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    for message in run_ranks(_two_optimizers_one_scaler, 2, 1, False, 4, 2, timeout=120):
        assert isinstance(message, str) and "stepped #2 on some ranks and #3" in message, message


def test_a_scale_set_below_the_floor_is_raised_to_it_with_a_warning():
    """A torch scaler's state saved at 2**-130 loaded silently, and the next step crashed inside
    torch: 1 / scale is no FP32 number (an audit)."""
    scaler = distamp.GradScaler()
    with pytest.warns(UserWarning, match=r"below the scale's floor 2\*\*-100"):
        scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=2.0**-130).state_dict())
    assert scaler.get_scale() == 2.0**-100
    with pytest.warns(UserWarning, match=r"below the scale's floor"):
        scaler.update(2.0**-130)
    assert scaler.get_scale() == 2.0**-100
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(iter(data(1, 4)))
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.step(opt)  # a finite 1 / scale
    scaler.update()


def test_the_scale_stops_at_a_floor_whose_inverse_is_finite():
    """Skips between clean iterations (no run of max_consecutive_skips) halved the scale past
    2**-127, where 1 / scale overflows FP32: the skip at the floor raises instead."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = distamp.GradScaler(init_scale=2.0**-97)
    with pytest.raises(distamp.NonFiniteGradientError, match=r"skipped at the scale's floor"):
        for step, (x, y) in enumerate(data(40, 4)):
            loss = F.mse_loss(model(x), y) * (float("inf") if step % 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            assert scaler.get_scale() >= 2.0**-100
    assert scaler.get_scale() == 2.0**-100


def _grad_scaler_on_sharded_fp32_weights(rank, world):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O1", shard_master_weights=True, verbosity=0)
    scaler = distamp.GradScaler()
    x, y = next(iter(data(1, 4)))
    scaler.scale(F.mse_loss(DDP(model)(x).float(), y)).backward()
    try:
        scaler.unscale_(opt)
    except RuntimeError as err:
        return str(err)
    return None


def test_a_grad_scaler_on_sharded_fp32_weights_says_what_to_write():
    """O1 with shard_master_weights=True: its param_groups hold this rank's shard slices, which
    get their gradients in step() — the scaler said "run backward on the scaled loss first"
    right after that backward (an audit); now the by-name refusal, as for O2's masters."""
    for message in run_ranks(_grad_scaler_on_sharded_fp32_weights, 2, timeout=90):
        assert message is not None and "this rank's shard of the FP32 weights" in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scale_promotes_a_half_loss_to_fp32_as_torch_does(dtype):
    """torch multiplies by its 0-dim FP32 scale: a 0-dim FP16 loss of 3 comes out as 196608.0
    in FP32; a Python float multiplier kept it FP16 (inf)."""
    loss = torch.tensor(3.0, dtype=dtype)
    ours = distamp.GradScaler().scale(loss)
    theirs = torch.amp.GradScaler("cpu").scale(loss)
    assert ours.dtype == theirs.dtype == torch.float32 and float(ours) == float(theirs) == 196608.0


def _torch_fsdp2(rank, world):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = distamp.GradScaler()
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DTensor's "implicitly creating a replicated DTensor"
        for step in range(3):
            loss = model(torch.randn(4, 8) + rank).pow(2).mean()
            scaler.scale(loss).backward()
            if step == 1 and rank == world - 1:
                model[0].weight.grad.to_local().view(-1)[0] = float("inf")  # this shard only
            before = model[0].weight.detach().full_tensor().clone()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            skipped.append(torch.equal(before, model[0].weight.detach().full_tensor()))
    return skipped, scaler.get_scale()


def test_with_torchs_fsdp2_an_inf_in_one_ranks_shard_skips_every_rank_without_warnings():
    """torch's fully_shard with distamp.GradScaler in place of torch's: the found-inf flag and the
    inverse scale were (1,)-shaped beside DTensor gradients, and DTensor warned of an implicit
    replication at every step (an audit)."""
    for skipped, scale in run_ranks(_torch_fsdp2, 2):
        assert skipped == [False, True, False] and scale == 2.0**15


def _grad_scaler_on_distamp_fsdp(rank, world):
    import distamp.fsdp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O1", verbosity=0)
    scaler = distamp.GradScaler()
    x, y = data(1, 4)[0]
    scaler.scale(F.mse_loss(model(x).float(), y)).backward()
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        return str(exc)
    return "stepped"


def test_a_grad_scaler_on_an_optimizer_distamp_fsdp_made_says_what_to_write():
    """An audit (a sweep over distamp.fsdp): refused with the message for distamp.wrap's
    sharded FP32 weights, which named shard_master_weights the script never passed."""
    for message in run_ranks(_grad_scaler_on_distamp_fsdp, 2):
        assert "made by distamp.fsdp.fully_shard (opt_level O1)" in message, message
        assert "distamp.scale_loss(loss, optimizer)" in message
        assert "shard_master_weights" not in message


def test_distamp_clipping_after_a_disabled_grad_scalers_unscale_clips_at_scale_one():
    """An audit: with `GradScaler(enabled=use_amp)` off, distamp.clip_grad_norm_ after
    scaler.unscale_ was refused at every iteration, saying to call scaler.unscale_ first."""
    torch.manual_seed(0)
    model = mlp()
    model, opt = distamp.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    scaler = distamp.GradScaler(enabled=False)
    for x, y in data(2, 4):
        scaler.scale(F.mse_loss(model(x).float(), y)).backward()
        scaler.unscale_(opt)
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        assert float(distamp.clip_grad_norm_(opt, 0.01)) == pytest.approx(float(expected))
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        assert float(total) == pytest.approx(0.01, rel=1e-3)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_torchs_private_scaler_attributes_say_what_to_use_instead():
    """``scaler._scale.item()`` in a log line copied from torch.amp: an AttributeError that names
    the public method (an audit: a bare one); other missing names stay plain AttributeErrors."""
    scaler = distamp.GradScaler("cpu")
    with pytest.raises(AttributeError, match=r"_scale.*use get_scale\(\)"):
        _ = scaler._scale
    with pytest.raises(AttributeError, match=r"use get_growth_interval\(\)"):
        _ = scaler._growth_interval
    assert not hasattr(scaler, "_growth_tracker")
    with pytest.raises(AttributeError, match=r"has no attribute 'nonsense'$"):
        _ = scaler.nonsense
    assert scaler.get_scale() == 65536.0


def test_numpy_and_tensor_settings_are_taken_as_torch_takes_them(tmp_path):
    """A review: ``GradScaler(init_scale=np.float32(1024))`` (torch takes it) was refused; held
    as floats, so the state dict loads with weights_only=True."""
    import numpy as np

    scaler = distamp.GradScaler(
        "cpu",
        init_scale=np.float32(1024),
        growth_factor=torch.tensor(2.0),
        backoff_factor=np.float64(0.5),
        growth_interval=np.int64(1),
    )
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2048.0 and type(scaler.get_scale()) is float
    torch.save(scaler.state_dict(), tmp_path / "scaler.pt")
    state = torch.load(tmp_path / "scaler.pt", weights_only=True)
    assert state["scale"] == 2048.0 and state["growth_factor"] == 2.0
    with pytest.raises(TypeError, match=r"growth_factor: expected a number, got str"):
        distamp.GradScaler("cpu", growth_factor="2")


def _scalers_set_per_rank(rank, world, settings):
    """DDP with a distamp.GradScaler made from this rank's ``settings``: the message of a
    refusal, else the weights after four steps."""
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = distamp.GradScaler("cpu", **settings[rank])
    try:
        for x, y in data(4, 8, seed=rank):
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    except RuntimeError as err:
        return str(err)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (({"init_scale": 2.0}, {"init_scale": 4.0}), "scale: rank 0 2, rank 1 4"),
        (
            ({"growth_interval": 1}, {"growth_interval": 2}),
            "growth_interval: rank 0 1, rank 1 2",
        ),
    ],
    ids=["init_scale", "growth_interval"],
)
def test_scalers_set_apart_on_the_ranks_are_refused_on_every_rank(settings, named):
    """The ranks shared the skip decision, not the scale: init_scale 2.0 and 4.0 unscaled DDP's
    averaged gradients by different factors and the replicas parted silently (an audit;
    torch's has the same hole, and makes no promise of agreement)."""
    for message in run_ranks(_scalers_set_per_rank, 2, settings, timeout=120):
        assert isinstance(message, str), "expected a refusal"
        assert "expected every rank's GradScaler to hold the same scale" in message, message
        assert named in message, message


def test_the_same_settings_as_other_kinds_of_number_agree():
    import numpy as np

    settings = ({"init_scale": np.float32(2.0)}, {"init_scale": torch.tensor(2)})
    first, second = run_ranks(_scalers_set_per_rank, 2, settings, timeout=120)
    assert not isinstance(first, str), first
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_setters_and_loads_take_numpy_and_tensor_numbers_as_torch_does(tmp_path):
    """An audit: the constructor took them (a review), the setters, load_state_dict and an
    integer tensor growth_interval did not; a scale past FP32's largest was refused as inf, a
    value never passed."""
    import numpy as np

    scaler = distamp.GradScaler("cpu", growth_interval=torch.tensor(2000))
    assert scaler.get_growth_interval() == 2000
    scaler.set_growth_factor(np.float32(3.0))
    scaler.set_backoff_factor(torch.tensor(0.25))
    scaler.set_growth_interval(np.int64(100))
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (3.0, 0.25)
    assert scaler.get_growth_interval() == 100
    scaler.load_state_dict(
        {"scale": np.float32(1024), "_growth_tracker": np.int64(3), "growth_interval": 7}
    )
    torch.save(scaler.state_dict(), tmp_path / "scaler.pt")
    state = torch.load(tmp_path / "scaler.pt", weights_only=True)
    assert (state["scale"], state["_growth_tracker"], state["growth_interval"]) == (1024.0, 3, 7)
    with pytest.raises(ValueError, match=r"init_scale: expected at most FP32's.*got 1e\+39"):
        distamp.GradScaler("cpu", init_scale=1e39)
    with pytest.raises(ValueError, match="set_growth_interval: expected an int >= 1"):
        scaler.set_growth_interval(100.0)
    # (a review: update and load_state_dict took 1e39, inf in FP32, and every later step was
    # skipped with the forward pass blamed; np.array([8.]) raised numpy's bare TypeError)
    scaler.update(np.array([8.0]))
    assert scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match=r"update: new_scale: expected at most FP32's largest"):
        scaler.update(1e39)
    with pytest.raises(ValueError, match=r"load_state_dict: scale: expected at most FP32's"):
        scaler.load_state_dict({"scale": 1e39, "_growth_tracker": 0})
    assert scaler.get_scale() == 8.0  # nothing changed
