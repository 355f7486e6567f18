"""Misuse gets a clear error naming the problem, and loses nothing (model and optimizer unchanged)."""

import copy
import warnings

import pytest
import torch
from asserts import step_error
from dist_harness import run_ranks
from models import NormMLP, mlp
from torch import nn

import distamp


def snapshot(model, opt):
    return (
        type(model),
        type(opt),
        copy.deepcopy(model.state_dict()),
        [[p for p in g["params"]] for g in opt.param_groups],
        [p.dtype for p in model.parameters()],
    )


def assert_unchanged(before, model, opt):
    cls_m, cls_o, state, groups, dtypes = before
    assert type(model) is cls_m and type(opt) is cls_o
    for (k, v), (k2, v2) in zip(state.items(), model.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    assert [[p for p in g["params"]] for g in opt.param_groups] == groups
    assert [p.dtype for p in model.parameters()] == dtypes


def fresh():
    model = NormMLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kw", "exc", "pattern"),
    [
        ({"opt_level": "01"}, ValueError, "did you mean 'O1'"),
        ({"opt_level": "O5"}, ValueError, "opt_level"),
        ({"opt_level": "O1", "master_weights": True}, ValueError, "O1.*master_weights"),
        ({"opt_level": "O2", "loss_scale": -4}, ValueError, "loss_scale"),
        ({"opt_level": "O2", "loss_scale": float("nan")}, ValueError, "loss_scale"),
        (
            {"opt_level": "O2", "min_loss_scale": 8.0, "max_loss_scale": 4.0},
            ValueError,
            "min_loss_scale",
        ),
        ({"opt_level": "O2", "half_dtype": torch.float64}, ValueError, "half_dtype"),
        ({"opt_level": "O2", "num_losses": 0}, ValueError, "num_losses"),
    ],
)
def test_bad_wrap_arguments(kw, exc, pattern):
    model, opt = fresh()
    before = snapshot(model, opt)
    with pytest.raises(exc, match=pattern):
        distamp.wrap(model, opt, **kw)
    assert_unchanged(before, model, opt)


def test_half_parameters_are_refused_by_name():
    model, opt = fresh()
    model.fc2.half()
    before = snapshot(model, opt)
    with pytest.raises(
        ValueError, match=r"'fc2.weight' has dtype torch.float16, expected torch.float32"
    ):
        distamp.wrap(model, opt, opt_level="O2")
    assert_unchanged(before, model, opt)


def test_a_float64_parameter_is_refused_with_advice_of_its_own():
    """The half-weights advice ("do not call .half()") did not fit a float64 parameter kept on
    purpose (an audit)."""
    model, opt = fresh()
    model.fc2.double()
    with pytest.raises(ValueError, match=r"'fc2.weight' has dtype torch.float64.*keep it as a buf"):
        distamp.wrap(model, opt, opt_level="O0")


def test_a_module_shared_with_a_model_wrapped_before_points_to_one_call():
    """Two models sharing a submodule, wrapped in two calls at O2: the first cast the shared
    weights, so the second finds them half. The message said only "do not call .half()", which
    the user never did (an audit); it names the one-call form, which works."""
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b[1].parameters(), lr=0.1)
    distamp.wrap(a, opt_a, opt_level="O2", verbosity=0)
    with pytest.raises(
        ValueError, match=r"'0.weight' has dtype .*wrap the models that share it in one call"
    ):
        distamp.wrap(b, opt_b, opt_level="O2", verbosity=0)
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    opts = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b[1].parameters(), lr=0.1)]
    (a, b), _ = distamp.wrap([a, b], opts, opt_level="O2", verbosity=0)
    assert a[0].weight is b[0].weight and a[0].weight.dtype == torch.bfloat16


def test_optimizer_with_foreign_parameters_is_refused():
    model, _ = fresh()
    stranger = nn.Linear(3, 3)
    opt = torch.optim.SGD(list(model.parameters()) + list(stranger.parameters()), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]\['params'\]\[10\].*shape \(3, 3\).*not a parameter"
    ):
        distamp.wrap(model, opt, opt_level="O2")
    assert_unchanged(before, model, opt)


@pytest.mark.parametrize("outer", ["O2", "O3"])
def test_a_wrapped_submodule_under_a_casting_wrap_is_refused_by_name(outer):
    """Accepted, then the submodule's first forward blamed model.half() or
    load_state_dict(assign=True), which the script never called (an audit)."""
    teacher = distamp.wrap(nn.Linear(4, 4), opt_level="O1")
    student = nn.Sequential(nn.Linear(4, 4), teacher)
    opt = torch.optim.SGD(student[0].parameters(), lr=0.1)
    before = copy.deepcopy(student.state_dict())
    with pytest.raises(ValueError, match=r"found '1' wrapped .*Wrap the plain FP32 model once"):
        distamp.wrap(student, opt, opt_level=outer)
    for key, value in student.state_dict().items():
        assert torch.equal(value, before[key]) and value.dtype == torch.float32, key
    # Under O1, which casts no weight, the held teacher keeps working (its own forward).
    model, _ = distamp.wrap(student, opt, opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16  # O1: autocast's output


def test_a_cast_wrapped_submodule_under_o1_is_named_as_wrapped_not_as_half():
    """An O2 teacher held by a model wrapped at O1 was told not to call .half() (an audit)."""
    teacher = distamp.wrap(nn.Linear(4, 4), opt_level="O2")
    with pytest.raises(ValueError, match=r"'1.weight' has dtype .* belongs to '1', wrapped"):
        distamp.wrap(nn.Sequential(nn.Linear(4, 4), teacher), opt_level="O1")


def test_a_lazy_module_is_refused_by_name_before_its_first_forward():
    """torch's "Can't access the shape of an uninitialized parameter ... load_state_dict" came
    out of wrap's checks (an audit)."""
    model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"'0.weight' is uninitialized \(a lazy module.*forward"):
        distamp.wrap(model, opt_level="O2")
    model(torch.randn(2, 5))  # materialized: wrap takes it
    assert distamp.wrap(model, opt_level="O2")(torch.randn(2, 5)).dtype == torch.float32


def test_wrapping_twice_is_refused():
    model, opt = fresh()
    model, opt = distamp.wrap(model, opt, opt_level="O2")
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="already wrapped"):
        distamp.wrap(model, opt, opt_level="O2")
    other = NormMLP()
    with pytest.raises(ValueError, match="optimizer was already wrapped"):
        distamp.wrap(other, opt, opt_level="O2")
    assert_unchanged(before, model, opt)
    copy_ = copy.deepcopy(model)  # an EMA built after wrap: the message says what happened
    with pytest.raises(ValueError, match="or is a copy of a wrapped model.*copy the FP32 model"):
        distamp.wrap(copy_, torch.optim.SGD(copy_.parameters(), lr=0.1), opt_level="O2")
    with pytest.raises(ValueError, match="more than once"):
        distamp.wrap([other, other], opt_level="O2")


def test_data_parallel_model_is_refused():
    model, opt = fresh()
    dp = nn.DataParallel(model)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"before DistributedDataParallel.*found DataParallel"):
        distamp.wrap(dp, opt, opt_level="O2")
    assert_unchanged(before, model, opt)


def _wrap_after_ddp(rank, world):
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        distamp.wrap(ddp, opt, opt_level="O2")
    except ValueError as err:
        return str(err), model[0].weight.dtype
    return None, None


def test_wrap_after_ddp_is_refused():
    ((message, dtype),) = run_ranks(_wrap_after_ddp, 1)
    assert "distamp.wrap (or amp.initialize, which runs it) must be called before" in message
    assert "found DistributedDataParallel (the model)" in message
    assert dtype == torch.float32


def test_model_without_floating_parameters_is_refused():
    class Empty(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ValueError, match="no floating-point parameters"):
        distamp.wrap(Empty(), opt_level="O2")


def test_wrong_types_are_refused():
    with pytest.raises(TypeError, match="models: expected a torch.nn.Module"):
        distamp.wrap("model", opt_level="O2")
    model, _ = fresh()
    with pytest.raises(TypeError, match="optimizers: expected a torch.optim.Optimizer"):
        distamp.wrap(model, {"lr": 1}, opt_level="O2")


def test_scale_loss_with_an_unwrapped_optimizer_is_refused():
    model, opt = fresh()
    loss = model(torch.randn(4, 8)).sum()
    with pytest.raises(TypeError, match="was not returned by distamp.wrap"):
        with distamp.scale_loss(loss, opt):
            pass


def _trained_once():
    model, opt = fresh()
    model, opt = distamp.wrap(model, opt, opt_level="O2")
    return model, opt


def test_step_before_backward_is_refused():
    model, opt = _trained_once()
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="no gradients were produced"):
        opt.step()
    assert_unchanged(before, model, opt)
    with pytest.raises(RuntimeError, match="no distamp.scale_loss"):
        distamp.unscale_(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_with_a_closure_runs_it_once_and_returns_its_loss(level):
    """torch.optim's contract (Lightning steps every optimizer so; refused before, an audit):
    the closure runs once with grad enabled, its backward is the step's, its loss comes back;
    the result equals the closure's body written before step(). A closure without backward
    (Lightning's manual optimization) after a scale_loss block steps that block's gradients."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    runs = []
    for style in ("inline", "closure", "noop-closure"):
        torch.manual_seed(0)
        model, opt = fresh()
        model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)

        def closure(model=model, opt=opt):
            assert torch.is_grad_enabled()
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            return loss

        with torch.no_grad():  # Lightning's optimizer_step runs under no_grad
            if style == "inline":
                with torch.enable_grad():
                    expected = closure()
                returned = opt.step()
                assert returned is None
            elif style == "closure":
                returned = opt.step(closure)
            else:
                with torch.enable_grad():
                    expected = closure()
                returned = opt.step(lambda: None)
                assert returned is None
        if style == "closure":
            assert torch.is_tensor(returned) and returned.requires_grad
        assert distamp.stats(opt).steps == 1 and not distamp.stats(opt).last_step_skipped
        runs.append([p.detach().clone() for p in model.parameters()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)
    del expected


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_lbfgs_is_refused_at_wrap_saying_why(level):
    model = NormMLP()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5)
    before = snapshot(model, opt)
    with pytest.raises(
        ValueError, match=r"found LBFGS, which re-evaluates the loss through a clos"
    ):
        distamp.wrap(model, opt, opt_level=level, verbosity=0)
    assert_unchanged(before, model, opt)


def test_backward_after_unscale_is_refused():
    model, opt = _trained_once()
    loss = model(torch.randn(4, 8)).sum()
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    distamp.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        with distamp.scale_loss(model(torch.randn(4, 8)).sum(), opt):
            pass


def test_loading_optimizer_state_of_another_model_is_refused():
    model, opt = _trained_once()
    small = mlp(hidden=5)
    small, small_opt = distamp.wrap(
        small, torch.optim.SGD(small.parameters(), lr=0.1), opt_level="O2"
    )
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="master tensors|shape"):
        opt.load_state_dict(small_opt.state_dict())
    assert_unchanged(before, model, opt)
    plain = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'distamp' entry"):
        opt.load_state_dict(plain.state_dict())


def test_optimizers_from_different_wrap_calls_cannot_share_a_loss():
    m1, o1 = _trained_once()
    m2, o2 = _trained_once()
    loss = m1(torch.randn(4, 8)).sum() + m2(torch.randn(4, 8)).sum()
    with pytest.raises(ValueError, match="different distamp.wrap calls"):
        with distamp.scale_loss(loss, [o1, o2]):
            pass


# -- optimizers and layouts that would silently stop the half weights from training -----------


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 2)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def _zero_or_layout(rank, world, case):
    import warnings

    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank if case == "zero" else 0)  # per-rank seeds: wrap's broadcast would show
    model = ConvNet()
    if case == "zero":
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2
        )
        before = snapshot(model, opt)
        try:
            distamp.wrap(model, opt, opt_level="O2", verbosity=0)
        except ValueError as exc:
            assert_unchanged(before, model, opt)
            return str(exc)
        return "accepted"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "channels_last before wrap":
        model = model.to(memory_format=torch.channels_last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    if case == "channels_last after wrap":
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model)
    start = model.conv.weight.detach().clone()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    with distamp.scale_loss(ddp(x).float().square().mean(), opt) as scaled:
        scaled.backward()
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    moved = (model.conv.weight.float() - start.float()).abs().max().item()
    return [str(w.message) for w in caught], moved


def test_zero_redundancy_optimizer_under_o2_is_refused_before_anything_changes():
    """ZeRO keeps its own list of parameters and shards them itself; under O2 it would step the
    half weights, which distamp's masters then overwrite (the model did not train, silently)."""
    for message in run_ranks(_zero_or_layout, 2, "zero"):
        assert "ZeroRedundancyOptimizer" in message and "nothing would train" in message
        assert "torch.optim.AdamW(...)" in message, message


def test_a_weight_re_laid_out_after_wrap_is_refused_by_name_at_the_first_step():
    """model.to(memory_format=channels_last) after wrap gives the conv weight new storage, which
    the sharded masters' all-gather no longer writes: it used to stop training silently."""
    for message in run_ranks(_zero_or_layout, 2, "channels_last after wrap"):
        assert "'conv.weight'" in message and "before distamp.wrap" in message, message


def test_channels_last_before_wrap_trains_and_the_lost_format_is_said():
    for messages, moved in run_ranks(_zero_or_layout, 2, "channels_last before wrap"):
        assert moved > 0
        assert any("['conv.weight']" in m and "channels_last" in m for m in messages), messages


def _step_twice(level, hook=None, rank=0, world=1):
    torch.manual_seed(0)
    model = NormMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    train = model
    if hook is not None:
        train = nn.parallel.DistributedDataParallel(model)
        distamp.hooks.register(train, opt, reduce_scatter=hook == "reduce-scatter")
    # Each rank its own batch: under the reduce-scatter hook the .grad left are each rank's own,
    # and the refusal's collective compared them and blamed "gradients different" (an audit).
    x = torch.randn(4, NormMLP().fc1.in_features, generator=torch.Generator().manual_seed(rank))
    with distamp.scale_loss(train(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    after_one = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"step\(\) was called again on the gradients the prev"):
        opt.step()
    # A norm logged in place in between (an audit's bypass of a check of versions) changes nothing.
    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    with pytest.raises(RuntimeError, match=r"step\(\) was called again on the gradients the prev"):
        opt.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, after_one[key]), key
    # After a new backward it steps again as before.
    with distamp.scale_loss(train(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    return distamp.stats(opt).steps


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_second_step_on_the_same_gradients_is_refused(level):
    """An audit's O2 second step() took the model's still-scaled half grads as unscaled: an
    update 65536x too large. GradScaler refuses a second step() before update(); so do we."""
    assert _step_twice(level) == 2


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("zeroed_by", ["optimizer", "model"])
def test_a_step_on_gradients_zeroed_in_place_steps_as_fp32_does(level, zeroed_by):
    """Alternating updates: zero_grad(set_to_none=False), then step() with no backward for this
    optimizer. FP32 code (and torch's GradScaler, and apex) step on the zeros — momentum and
    weight decay still move the weights; it was refused as "called again" (an audit)."""
    torch.manual_seed(0)
    ref = NormMLP()
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    model, opt = distamp.wrap(model, opt, opt_level=level, loss_scale=1.0, verbosity=0)
    x = torch.randn(4, NormMLP().fc1.in_features)
    for net, o in ((model, opt), (ref, ref_opt)):
        for it in range(3):
            if it != 1:  # no backward in the second iteration
                loss = net(x).float().pow(2).mean()
                if o is opt:
                    with distamp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                else:
                    loss.backward()
            o.step()
            (o if zeroed_by == "optimizer" else net).zero_grad(set_to_none=False)
    tol = 0 if level == "O0" else 2e-2
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.float(), b, atol=tol, rtol=tol), (a, b)
    assert distamp.stats(opt).steps == 3


def _zeroed_on_one_rank_only(rank, world, level, hook):
    torch.manual_seed(0)
    model = NormMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    train = nn.parallel.DistributedDataParallel(model)
    if hook is not None:
        distamp.hooks.register(train, opt, reduce_scatter=hook == "reduce-scatter")
    x = torch.randn(4, NormMLP().fc1.in_features, generator=torch.Generator().manual_seed(rank))
    with distamp.scale_loss(train(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    if rank == 0:
        model.zero_grad(set_to_none=False)
    return step_error(opt)


@pytest.mark.parametrize("level,hook", [("O1", None), ("O2", None), ("O2", "reduce-scatter")])
def test_a_second_step_after_zeroing_on_one_rank_only_raises_on_every_rank(level, hook):
    """Rank 0 zeroed in place (its step on zeros goes on), rank 1 did not (its second step is
    refused): rank 0 stepped alone into the sharded step's collectives and hung, or at O1
    the replicas parted (an audit). Every rank raises together now."""
    zeroed, stale = run_ranks(_zeroed_on_one_rank_only, 2, level, hook, timeout=90)
    assert zeroed is not None and "found another rank refusing this step" in zeroed, zeroed
    assert stale is not None and "called again on the gradients" in stale, stale


def _step_twice_on_ranks(rank, world, hook):
    return _step_twice("O2", hook, rank, world)


@pytest.mark.parametrize(
    "hook,world", [("all-reduce", 2), ("reduce-scatter", 2), ("reduce-scatter", 3)]
)
def test_a_second_step_is_refused_on_every_rank_with_hooks(hook, world):
    assert run_ranks(_step_twice_on_ranks, world, hook) == [2] * world


def _trained(level, lr):
    torch.manual_seed(0)
    model = NormMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    for _ in range(2):
        with distamp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize(
    ("damage", "pattern"),
    [
        ("other opt_level", r"saved at opt_level 'O0', this optimizer is wrapped at 'O2'"),
        ("bad scale", r"loss scaler 0: loss scaler state: expected a positive finite scale"),
        ("bad count", r"expected a count >= 0 for 'clean_steps', got -3"),
        ("bad state shape", r"state 'exp_avg' of parameter \d+ has shape \(3,\), expected"),
    ],
)
def test_optimizer_load_state_dict_refuses_before_changing_anything(damage, pattern):
    """An audit's refused load had replaced the inner state first (lr 1e-3 -> 0.5, Adam's step
    2 -> 5): now every part is checked before any is loaded."""
    model, opt = _trained("O2", 1e-3)
    if damage == "other opt_level":
        other = _trained("O0", 0.5)[1].state_dict()
    else:
        other = _trained("O2", 0.5)[1].state_dict()
        if damage == "bad state shape":
            last = max(other["state"])
            other["state"][last]["exp_avg"] = torch.zeros(3)
        else:
            other["distamp"]["scalers"][0].update(
                {"scale": -1.0} if damage == "bad scale" else {"clean_steps": -3}
            )
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(other)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["distamp"]["scalers"] == before["distamp"]["scalers"]
    for mine, theirs in zip(after["distamp"]["masters"], before["distamp"]["masters"], strict=True):
        assert torch.equal(mine, theirs)
    for key, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(after["state"][key][name], value), (key, name)


def _step_after_the_group_is_replaced(rank, world, init_file):
    import torch.distributed as dist

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    with distamp.scale_loss(model(torch.randn(2, 8)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    dist.destroy_process_group()  # a notebook or sweep starting over
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    messages = []
    for use in (
        lambda: distamp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt).__enter__(),
        lambda: distamp.save_checkpoint(init_file + ".ck", model, opt),
    ):
        try:
            use()
        except RuntimeError as err:
            messages.append(str(err))
    return messages


def test_a_model_wrapped_on_a_destroyed_process_group_says_so(tmp_path):
    """After destroy_process_group() and a new init_process_group, stepping or saving the old
    wrapped model raised torch's "Process group <object at 0x...> is not initialized in the
    world group map" (an audit)."""
    for messages in run_ranks(_step_after_the_group_is_replaced, 2, str(tmp_path / "init2")):
        assert len(messages) == 2, messages
        for message in messages:
            assert "found it destroyed (torch.distributed.destroy_process_group()" in message, (
                message
            )
        assert messages[1].startswith("save_checkpoint:")


@pytest.mark.parametrize("level", ["O2", "O3-masters"])
def test_a_model_wrapped_without_its_optimizer_warns_at_its_first_gradient(level):
    """O2 without an optimizer is apex's inference form; trained with an optimizer built
    afterwards (Hugging Face's Trainer does so when optimizers= is not passed) it stepped the
    half weights with no FP32 masters, silently (an audit). Inference stays quiet."""
    torch.manual_seed(0)
    kwargs = {"opt_level": "O2"} if level == "O2" else {"opt_level": "O3", "master_weights": True}
    model = distamp.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), verbosity=0, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(torch.randn(2, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with pytest.warns(UserWarning, match="was given no optimizer, and '0.weight'") as caught:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert len([w for w in caught if "no optimizer" in str(w.message)]) == 1  # once
    assert "optimizers=(optimizer, scheduler)" in str(caught[0].message)


def test_a_model_wrapped_with_its_optimizer_does_not_warn_of_missing_masters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with distamp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
            scaled.backward()
        opt.step()


class _WithScripted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.Tanh()))

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    "kwargs,where",
    [
        ({"opt_level": "O2"}, "half weights"),
        ({"opt_level": "O0", "shard_master_weights": True}, "sharded FP32 weights"),
    ],
)
def test_a_torchscript_submodule_is_refused_by_name_where_hooks_are_needed(kwargs, where):
    """torch's bare "register_state_dict_post_hook is not supported on ScriptModules" named no
    module (an audit); O0/O1 with whole FP32 weights need no hooks and keep working."""
    model = _WithScripted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=f"with {where}, found a TorchScript module at 'b'"):
        distamp.wrap(model, opt, verbosity=0, **kwargs)
    assert model.a.weight.dtype == torch.float32  # nothing changed
    for level in ("O0", "O1"):
        model = _WithScripted()
        distamp.wrap(
            model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0
        )


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_layers_unfrozen_after_wrap_step_without_a_false_second_step_refusal(level, set_to_none):
    """Progressive unfreezing, backward outside scale_loss (Lightning's automatic optimization,
    the Trainer): only the parameters trainable at wrap were watched for a backward, so a
    backward reaching only later-unfrozen ones was refused as "no backward since" (an audit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    model.requires_grad_(False)
    model[2].requires_grad_(True)  # phase 1: the head only
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    moved = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the step takes gradients made outside scale_loss)
        for step in range(5):
            if step == 2:  # phase 2: the rest, the head frozen
                model.requires_grad_(True)
                model[2].requires_grad_(False)
            before = model[0].weight.detach().float().clone()
            model(torch.randn(4, 6)).float().square().mean().backward()
            opt.step()
            moved.append(bool((model[0].weight.float() != before).any()))
            opt.zero_grad(set_to_none=set_to_none)
    assert moved == [False, False, True, True, True]


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_submodule_converted_after_wrap_is_named_by_the_step(half):
    """The forward's two probes missed a submodule converted alone: O1 trained a bf16 head with
    no FP32 copy, silently (an audit). The step names it before changing anything."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3), nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O1", verbosity=0)
    model[3].to(half)  # the last layer: not one of the forward's probes
    loss = model(torch.randn(4, 6)).float().square().mean()  # (autocast runs it in half)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    before = model[0].weight.detach().clone()
    with pytest.raises(
        RuntimeError, match=f"parameter '3.weight' is {half}, but distamp.wrap left"
    ):
        opt.step()
    assert torch.equal(model[0].weight, before)


def test_a_torch_only_state_dict_loads_where_the_optimizer_steps_the_models_own_weights():
    """At O1 the optimizer steps the model's FP32 parameters, so torch's entries of a state dict
    (a plain run's, or what torch.distributed.checkpoint's get/set_state_dict keep) hold all of
    its state but the loss scale: it loads, warning that the scale starts afresh (it was refused
    for the missing 'distamp' entry; an audit). At O2 (separate FP32 masters) it still is."""
    torch.manual_seed(0)
    plain_model = mlp()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    plain_model(torch.randn(4, 8)).sum().backward()
    plain.step()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = distamp.wrap(model, opt, opt_level="O1")
    with pytest.warns(UserWarning, match="starts again at 65536"):
        opt.load_state_dict(plain.state_dict())
    loaded = [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"]]
    expected = [plain.state[p]["momentum_buffer"] for p in plain.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(loaded, expected, strict=True))


def test_one_optimizer_apis_given_a_list_say_so():
    """unscale_, clip_grad_norm_ and stats take one optimizer; a list (natural, since scale_loss
    takes one) failed with "too many values to unpack" (an audit)."""
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    _, [oa, ob] = distamp.wrap([a, b], [oa, ob], opt_level="O0", verbosity=0)
    for call in (
        lambda: distamp.unscale_([oa, ob]),
        lambda: distamp.clip_grad_norm_([oa, ob], 1.0),
        lambda: distamp.stats([oa, ob]),
    ):
        with pytest.raises(TypeError, match="expected one optimizer, got a list of 2; call it on"):
            call()
