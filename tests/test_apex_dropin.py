"""``from distamp import amp``: an apex.amp script runs with only the import changed, and matches
the same training written on distamp.wrap."""

import copy
import dataclasses
import io

import pytest
import torch
import torch.nn.functional as F
from models import data, mlp
from torch import nn

import distamp
from distamp import (
    NonFiniteGradientError,
    amp,  # the one line an apex script changes
)

STEPS = 12


def apex_script(opt_level, steps=STEPS):
    """Written from apex's documented API (initialize, scale_loss, master_params, state_dict)."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    for x, y in data(steps, 8):
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def distamp_script(opt_level, steps=STEPS):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = distamp.wrap(model, optimizer, opt_level=opt_level, verbosity=0)
    for x, y in data(steps, 8):
        with distamp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
            scaled_loss.backward()
        distamp.clip_grad_norm_(optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_apex_save_lines_after_distamp_wrap_warn_and_resume_keeps_the_scale(monkeypatch):
    """A script moved to distamp.wrap that kept apex's ``"amp": amp.state_dict()`` save line and
    its ``amp.load_state_dict`` resume line: both say where the scale is (the optimizer's state
    dict) and neither fails at resume; the scale comes back through optimizer.load_state_dict."""
    monkeypatch.setattr(distamp.amp, "_REGISTRY", {})  # a process that never ran amp.initialize
    model, optimizer = distamp_script("O2", steps=3)
    optimizer._distamp.group.scalers[0].set_loaded_scale(1024.0, "test")
    with pytest.warns(UserWarning, match=r"amp.initialize was not called.*optimizer.state_dict"):
        saved_amp = amp.state_dict()
    assert saved_amp == {}
    checkpoint = {"optimizer": optimizer.state_dict(), "amp": saved_amp}
    model2 = mlp()
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    model2, optimizer2 = distamp.wrap(model2, optimizer2, opt_level="O2", verbosity=0)
    optimizer2.load_state_dict(checkpoint["optimizer"])
    with pytest.warns(UserWarning, match=r"amp.load_state_dict\(\{\}\).*loads nothing"):
        amp.load_state_dict(checkpoint["amp"])
    assert distamp.stats(optimizer2).loss_scales == (1024.0,)
    with pytest.raises(RuntimeError, match=r"found no initialize.*loss_scaler0"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})
    assert distamp.stats(optimizer2).loss_scales == (1024.0,)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_apex_script_matches_distamp_wrap(opt_level):
    a_model, a_opt = apex_script(opt_level)
    b_model, b_opt = distamp_script(opt_level)
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    for p, q in zip(amp.master_params(a_opt), amp.master_params(b_opt), strict=True):
        assert torch.equal(p, q)


def test_amp_state_dict_checkpoint_round_trip_apex_style():
    model, optimizer = apex_script("O2", steps=4)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
        buffer,
    )
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 4}}
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    # apex's documented restore order: initialize, then load model, optimizer, amp.
    model2 = mlp()
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    model2, optimizer2 = amp.initialize(model2, optimizer2, opt_level="O2", verbosity=0)
    model2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    for p, q in zip(amp.master_params(optimizer), amp.master_params(optimizer2), strict=True):
        assert torch.equal(p, q)  # the FP32 masters came back (apex lost them)
    assert amp.state_dict() == checkpoint["amp"]


def test_multiple_models_optimizers_losses_with_num_losses():
    def run(api):
        torch.manual_seed(0)
        a, b = nn.Linear(4, 6), nn.Linear(6, 2)
        oa = torch.optim.SGD(a.parameters(), lr=0.1)
        ob = torch.optim.SGD(b.parameters(), lr=0.1)
        if api == "apex":
            [a, b], [oa, ob] = amp.initialize(
                [a, b], [oa, ob], opt_level="O1", num_losses=2, verbosity=0
            )
            scale = amp.scale_loss
        else:
            [a, b], [oa, ob] = distamp.wrap(
                [a, b], [oa, ob], opt_level="O1", num_losses=2, verbosity=0
            )
            scale = distamp.scale_loss
        for x, y in data(5, 8, d_in=4, d_out=2):
            h = a(x)
            with scale(h.float().pow(2).mean(), oa, loss_id=0) as s0:
                s0.backward(retain_graph=True)
            with scale(F.mse_loss(b(h).float(), y), [oa, ob], loss_id=1) as s1:
                s1.backward()
            oa.step()
            ob.step()
            oa.zero_grad()
            ob.zero_grad()
        return [p.detach().clone() for p in (*a.parameters(), *b.parameters())]

    for p, q in zip(run("apex"), run("distamp"), strict=True):
        assert torch.equal(p, q)
    assert set(amp.state_dict()) == {"loss_scaler0", "loss_scaler1"}


def gelu_sum(x, w):
    return (x @ w).sum(-1)


def test_function_decorators_under_o1():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, w = torch.randn(2, 4), torch.randn(4, 4)
    half = amp.half_function(gelu_sum)
    single = amp.float_function(gelu_sum)
    promote = amp.promote_function(gelu_sum)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert half(x, w).dtype == torch.bfloat16
        assert single(x.bfloat16(), w.bfloat16()).dtype == torch.float32
        assert promote(x.bfloat16(), w).dtype == torch.float32
    assert half(x, w).dtype == torch.float32  # outside autocast: unchanged
    import sys

    me = sys.modules[__name__]
    original = me.gelu_sum
    amp.register_half_function(me, "gelu_sum")
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert me.gelu_sum(x, w).dtype == torch.bfloat16
    finally:
        me.gelu_sum = original


def test_function_decorators_take_namedtuples_and_mapping_types_and_promote_as_torch():
    """A namedtuple argument raised "missing 1 required positional argument", a defaultdict
    arrived as a plain dict, and promote_function gave the first 16-bit dtype of fp16 and bf16
    (an audit): the helpers now walk inputs as the model's forward does, and promote as torch."""
    import collections

    pair_type = collections.namedtuple("Pair", "a b")

    def matmul(p):
        return p.a @ p.b

    def with_default(d):
        return d["a"].sum() + len(d["missing"])

    pair = pair_type(torch.randn(2, 2), torch.randn(2, 2))
    half16, bf16 = torch.randn(2, 2).half(), torch.randn(2, 2).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert amp.half_function(matmul)(pair).dtype == torch.bfloat16
        assert amp.float_function(matmul)(pair).dtype == torch.float32
        assert amp.promote_function(matmul)(pair).dtype == torch.float32
        batch = collections.defaultdict(list, a=torch.randn(2))
        assert amp.half_function(with_default)(batch).dtype == torch.bfloat16
        add = amp.promote_function(torch.add)
        assert add(half16, bf16).dtype == add(bf16, half16).dtype == torch.float32
        # a dataclass batch: its tensors were not seen, and the function ran uncast (an audit)
        seen = []

        def first(b):
            seen.append(b.x.dtype)
            return b.x

        amp.half_function(first)(Holder(torch.randn(2)))
        amp.float_function(first)(Holder(torch.randn(2).bfloat16()))
    assert seen == [torch.bfloat16, torch.float32]
    amp.float_function(first)(Holder(torch.randn(2).half()))  # outside autocast: FP32
    assert seen[-1] == torch.float32


@dataclasses.dataclass
class Holder:
    x: torch.Tensor


@dataclasses.dataclass
class Node:
    x: torch.Tensor
    parent: "Node | None" = None
    children: list = dataclasses.field(default_factory=list)


def test_function_helpers_and_the_input_cast_take_a_dataclass_with_a_back_reference():
    """A tree node whose child points back at it: the walk of dataclasses recursed without end
    (RecursionError) where the helpers used to pass it through (an audit)."""
    root = Node(torch.ones(2))
    child = Node(torch.ones(2), parent=root)
    root.children.append(child)
    assert amp.float_function(lambda n: n.x * 2)(child).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert amp.half_function(lambda n: n.x.dtype)(child) == torch.bfloat16
    cast = distamp.casting.cast_floating(child, torch.bfloat16)
    assert cast.x.dtype == torch.bfloat16 and cast.parent.x.dtype == torch.bfloat16
    assert child.x.dtype == torch.float32 and root.x.dtype == torch.float32


class PartlyFP32(nn.Module):
    """apex's documented use of disable_casts: one computation inside forward kept out of O1."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with amp.disable_casts():
            exact = h.float() @ self.b.weight.t()
        return h, exact


def test_disable_casts_turns_o1s_casting_off_inside_the_block_only():
    model = PartlyFP32()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    h, exact = model(torch.randn(2, 4))
    assert h.dtype == torch.bfloat16 and exact.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with amp.disable_casts():
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")  # back on after the block
    with amp.disable_casts():  # outside autocast: nothing to turn off
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_disable_casts_around_a_call_runs_the_whole_forward_uncast():
    """apex's flag was global, so a block around the model's call ran all of forward in FP32;
    distamp's forward enters autocast itself and must not turn it back on there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fp32 = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.randn(3, 4)
    with amp.disable_casts():
        out = model(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, fp32(x))  # FP32 weights, FP32 math: exactly the unwrapped model
    assert model(x).dtype == torch.bfloat16  # on again after the block


def test_what_apex_had_that_no_longer_makes_sense_says_what_to_write():
    with pytest.raises(
        ValueError, match=r"never patches torch itself.*amp\.half_function\(torch\.einsum\)"
    ):
        amp.register_half_function(torch, "einsum")
    with pytest.raises(RuntimeError, match=r"amp\.initialize\(model, optimizer, opt_level='O1'\)"):
        amp.init()
    with pytest.raises(RuntimeError, match=r"amp\.initialize\(model, optimizer, opt_level='O2'\)"):
        amp.FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_apex_checkpoint_recipe_with_amp_disabled_is_a_no_op():
    """apex's recipe saves ``amp.state_dict()`` and loads it after the same ``initialize``; with
    ``enabled=False`` there are no scalers: an empty state loads as a no-op, a saved one is
    ignored with a warning (apex printed one)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", enabled=False, verbosity=0)
    saved = amp.state_dict()
    assert saved == {}
    amp.load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"made no loss scalers.*loss_scaler0"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0}})


@pytest.mark.parametrize(
    "opt_level,kwargs",
    [("O3", {"min_loss_scale": 1.0}), ("O2", {"loss_scale": 128.0, "min_loss_scale": 512.0})],
)
def test_a_static_scale_skips_an_overflow_whatever_min_loss_scale_says(opt_level, kwargs):
    """A script that always passes min_loss_scale (DeepSpeed's default 1) and switches to a
    static scale stopped at its first overflow with "skipped at the minimum loss scale" (an
    audit); apex ignores min_loss_scale without dynamic scaling."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    for step, (x, y) in enumerate(data(2, 8)):
        with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
            scaled_loss.backward()
        if step == 0:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert distamp.stats(optimizer).skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _driven_to_scale_2():
    """An O2 run whose overflows took the scale down to 2, saved by apex's recipe."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    for x, y in data(15, 8):
        loss = F.mse_loss(model(x).float(), y) * float("inf")  # every step overflows
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "amp": amp.state_dict(),
    }


def test_amp_load_state_dict_keeps_this_runs_loss_scale_bounds():
    """apex's resume order loads the optimizer, then ``amp.load_state_dict``: the latter wrote the
    saved scale back under the min_loss_scale the former had enforced, and the first overflow
    raised "skipped at the minimum loss scale 1024" at scale 2; one above max_loss_scale stayed
    above it (an audit). Both go through the same bounds now, as does ``_loss_scale``."""
    saved = _driven_to_scale_2()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", verbosity=0, min_loss_scale=1024.0
    )
    model.load_state_dict(saved["model"])
    with pytest.warns(UserWarning, match="checkpoint's loss scale 2 .*min_loss_scale 1024"):
        optimizer.load_state_dict(saved["optimizer"])
    with pytest.warns(UserWarning, match="loss_scaler0 loss scale 2 .*min_loss_scale 1024"):
        amp.load_state_dict(saved["amp"])
    assert distamp.stats(optimizer).loss_scales == (1024.0,)
    x, y = next(iter(data(1, 8)))
    with amp.scale_loss(F.mse_loss(model(x).float(), y) * float("inf"), optimizer) as scaled_loss:
        scaled_loss.backward()
    with pytest.raises(NonFiniteGradientError, match="minimum loss scale 1024"):
        optimizer.step()  # at the floor in use now, as the message says

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", verbosity=0, max_loss_scale=2.0**10
    )
    with pytest.warns(UserWarning, match="max_loss_scale 1024"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**20, "unskipped": 0}})
    with pytest.warns(UserWarning, match="_loss_scale set, loss scale 2.*max_loss_scale 1024"):
        amp._amp_state.loss_scalers[0]._loss_scale = 2.0**21
    assert distamp.stats(optimizer).loss_scales == (2.0**10,)


def test_o1_casts_with_autocasts_cache_turned_off_outside_disable_casts():
    """``torch.set_autocast_cache_enabled(False)`` (public) and ``make_fx`` (which turns the cache
    off while it traces) read as ``amp.disable_casts()``: O1's forward ran in FP32 and its traced
    graph had no bf16 (an audit). Only a recomputation during backward reads that mark now."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model = nn.Sequential(nn.Linear(8, 4))
    model, _ = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    x = torch.randn(2, 8)
    assert model(x).dtype == torch.bfloat16
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        assert model(x).dtype == torch.bfloat16
    finally:
        torch.set_autocast_cache_enabled(was)
    assert "bfloat16" in make_fx(model)(x).code
    with amp.disable_casts():
        assert model(x).dtype == torch.float32


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_disable_casts_reaches_the_recomputation_of_an_activation_checkpoint(reentrant):
    """torch.utils.checkpoint recomputes the forward in backward, outside the block: it ran in
    bf16 (reentrant: gradients 4.4e-3 off; non-reentrant: a CheckpointError about dtypes, an
    audit). The gradients are now those of the same call without the checkpoint, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    def grads(checkpointed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        x = torch.randn(6, 8, requires_grad=True)
        with amp.disable_casts():
            out = checkpoint(model, x, use_reentrant=reentrant) if checkpointed else model(x)
        assert out.dtype == torch.float32
        out.square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    for got, want in zip(grads(True), grads(False), strict=True):
        assert torch.equal(got, want)


def test_nvidia_scripts_apex_internals_are_read_or_named():
    """NVIDIA's DeepLearningExamples read apex internals: BERT counts steps with
    ``loss_scalers[0]._has_overflow`` (an AttributeError, an audit); the others got bare
    AttributeErrors naming the user's optimizer class, and a write to a scaler view was kept on a
    throw-away object."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    overflowed = []
    for step, (x, y) in enumerate(data(3, 8)):
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        overflowed.append(amp._amp_state.loss_scalers[0]._has_overflow)
    assert overflowed == [False, True, False]
    scaler = amp._amp_state.loss_scalers[0]
    with pytest.raises(AttributeError, match=r"_overflow_buf"):
        scaler._overflow_buf = torch.zeros(1)
    with pytest.raises(AttributeError, match=r"update_scale is apex's internal.*step\(\)"):
        scaler.update_scale()
    with pytest.raises(AttributeError, match=r"amp._amp_state.handle is apex's internal"):
        amp._amp_state.handle  # noqa: B018
    for name in ("_amp_stash", "_lazy_init_maybe_master_weights"):
        with pytest.raises(AttributeError, match=rf"optimizer.{name} is apex's internal state"):
            getattr(optimizer, name)
    with pytest.raises(AttributeError, match=r"'SGD' object has no attribute 'nothing'"):
        optimizer.nothing  # noqa: B018


def test_editing_param_groups_gradients_under_o2_names_master_params():
    """NVIDIA's ConvNets divide every ``param_groups`` gradient for accumulation: under O2 the
    FP32 masters have no .grad before step(), so only the FP32-kept norm layers were divided,
    and the warning blamed something else (an audit). It names the loop and the fix now."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    x, y = next(iter(data(1, 8)))
    with amp.scale_loss(F.mse_loss(model(x).float(), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                param.grad /= 2
    with pytest.warns(UserWarning, match=r"iterate amp.master_params\(optimizer\) instead"):
        optimizer.step()


def test_master_params_between_delayed_micro_batches_leaves_the_accumulation_alone():
    """apex's accumulation (delay_unscale=True on all micro-batches but the last) with a norm
    logged per micro-batch over amp.master_params: it unscaled after the first micro-batch and
    every later scale_loss refused, naming unscale_ (an audit). As under apex, it does not
    unscale after a delayed block; the result equals the same run without the logging."""

    def train(log_norms):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        batches = data(6, 4)
        for i, (x, y) in enumerate(batches):
            last = i % 3 == 2
            with amp.scale_loss(F.mse_loss(model(x).float(), y), opt, delay_unscale=not last) as s:
                s.backward()
            if log_norms or last:
                norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e9)
                assert torch.isfinite(norm)
            if last:
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(True), train(False), strict=True):
        assert torch.equal(a, b)


def test_a_block_that_raises_after_its_backward_leaves_its_gradients_scaled():
    """The "log the error, go on" habit: a backward inside scale_loss, then the block raises,
    the script catches it and steps. The gradients (at the loss scale) were taken as unscaled:
    an update 65536 times too large (an audit). They are the block's now: step() unscales them,
    and the step equals the same one without the error."""

    def train(fail):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
        x, y = data(1, 4)[0]
        try:
            with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
                if fail:
                    raise RuntimeError("a logging call failed")
        except RuntimeError:
            pass
        opt.step()
        return [p.detach().clone() for p in model.parameters()], distamp.stats(opt)

    (failed, stats), (clean, _) = train(True), train(False)
    assert not stats.last_step_skipped
    for a, b in zip(failed, clean, strict=True):
        assert torch.equal(a, b)


def test_warnings_of_amp_initialize_point_at_the_callers_line():
    """wrap's warnings used a fixed stacklevel: through amp.initialize they were reported at
    distamp/amp.py (an audit), and Python's once-per-location filter keyed them there."""
    import warnings

    model = mlp()
    opt = torch.optim.SGD(list(model.parameters())[2:], lr=0.1)  # the first layer left out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    (warning,) = [w for w in caught if "held by no optimizer" in str(w.message)]
    assert warning.filename == __file__


def test_a_teacher_initialized_without_an_optimizer_keeps_the_students_scalers():
    """Distillation: the student with its optimizer, then a frozen teacher alone. The teacher's
    call cleared the student's scalers: amp.state_dict() came back {} and apex's resume failed
    (an audit)."""
    student = mlp()
    student, opt = amp.initialize(
        student, torch.optim.SGD(student.parameters(), lr=0.1), opt_level="O1", verbosity=0
    )
    teacher = amp.initialize(mlp(), opt_level="O1", verbosity=0)
    assert isinstance(teacher, nn.Module)
    assert set(amp.state_dict()) == {"loss_scaler0"}
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**16


def test_a_larc_wrapped_optimizer_has_its_scalers_in_amp_state():
    """apex's LARC wraps the optimizer it returns: amp.state_dict() was {} and
    _amp_state.loss_scalers empty (an audit)."""

    class LARC:  # apex.parallel.LARC's shape: the wrapped optimizer in .optim
        def __init__(self, optimizer):
            self.optim = optimizer

        @property
        def param_groups(self):
            return self.optim.param_groups

        def step(self):
            return self.optim.step()

    model = mlp()
    model, opt = amp.initialize(
        model, LARC(torch.optim.SGD(model.parameters(), lr=0.1)), opt_level="O2", verbosity=0
    )
    assert set(amp.state_dict()) == {"loss_scaler0"}
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**16


def test_has_overflow_is_per_loss_as_apexs():
    """DCGAN's three losses: an overflow of one loss set every loss's _has_overflow (an audit)."""
    a, b = nn.Linear(4, 6), nn.Linear(6, 2)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O1", num_losses=2, verbosity=0)
    x = torch.randn(3, 4)
    with amp.scale_loss(a(x).float().sum(), oa, loss_id=0) as s0:
        s0.backward()
    with amp.scale_loss(b(torch.randn(3, 6)).float().sum() * float("inf"), ob, loss_id=1) as s1:
        s1.backward()
    oa.step()
    ob.step()
    scalers = amp._amp_state.loss_scalers
    assert [s._has_overflow for s in scalers] == [False, True]
    assert [s.loss_scale() for s in scalers] == [2.0**16, 2.0**15]


def test_a_static_scale_counts_its_clean_steps_in_unskipped():
    """apex's _unskipped counted every step of a static scaler; it stayed 0 (an audit)."""
    model = mlp()
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O3", verbosity=0
    )
    for x, y in data(3, 4):
        with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert amp._amp_state.loss_scalers[0]._unskipped == 3


def test_a_loss_with_parameters_outside_the_model_says_to_pass_it_too():
    """CenterLoss' centers in the optimizer: apex stepped them unwrapped; distamp refuses, and
    the message said only "another copy of the model?" (an audit)."""
    model, centers = mlp(), nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.SGD([*model.parameters(), centers], lr=0.1)
    with pytest.raises(ValueError, match=r"\[model, criterion\], optimizer\)"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
