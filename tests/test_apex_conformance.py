"""Conformance with apex's own amp unit tests (apex/tests/L0/run_amp at the last commit with amp).

Each test says which apex test it follows. They are rewritten, not copied: CPU, tiny models, and
bf16 as the half dtype (fp16 only on tiny tensors). apex's tests hand amp.initialize a model holding
an FP16 parameter (``allow_incoming_model_not_fp32``); distamp refuses half parameters at wrap, so
here every model starts FP32 and the opt_level decides what is cast. apex tests that touch kernels
distamp does not have (multi_tensor_*, FusedSGD's CUDA kernel, RNN cell casts, the cast cache's
internals) have no counterpart; the behaviour a user sees through them is tested where it applies.
"""

from __future__ import annotations

import copy
import itertools
import random
import sys
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn

import distamp
from distamp import amp
from distamp.scaler import LossScaler

LEVELS = ("O0", "O1", "O2", "O3")
X = torch.ones(2)


def set_loss_scales(*scales: float) -> None:
    """apex's tests poke ``_amp_state.loss_scalers[i]._loss_scale``; amp.load_state_dict is the
    public way to do the same."""
    amp.load_state_dict(
        {f"loss_scaler{i}": {"loss_scale": s, "unskipped": 0} for i, s in enumerate(scales)}
    )


def close(actual: torch.Tensor, expected: torch.Tensor, half: bool) -> None:
    """Exact up to FP32 rounding; bf16 weights (O2/O3) leave bf16's relative precision."""
    tol = dict(rtol=2e-2, atol=2e-2) if half else dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


# -- amp.initialize: return shapes, opt_levels, overrides (apex's docstring and frontend) ------------


def test_initialize_returns_what_it_was_given_in_the_shape_it_was_given():
    def pair():
        m = nn.Linear(2, 2)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    (m, o) = pair()
    assert amp.initialize(m, o, verbosity=0) == (m, o)
    (m1, o1), (m2, o2) = pair(), pair()
    assert amp.initialize([m1, m2], [o1, o2], verbosity=0) == ([m1, m2], [o1, o2])
    m, o = pair()
    assert amp.initialize(m, [o], verbosity=0) == (m, [o])
    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    o = torch.optim.SGD([*m1.parameters(), *m2.parameters()], lr=0.1)
    assert amp.initialize([m1, m2], o, verbosity=0) == ([m1, m2], o)
    m = nn.Linear(2, 2)
    assert amp.initialize(m, opt_level="O2", verbosity=0) is m  # no optimizer: inference
    m, o = pair()
    weight = m.weight.detach().clone()
    assert amp.initialize(m, o, enabled=False) == (m, o)
    assert m.weight.dtype == torch.float32 and torch.equal(m.weight, weight)
    loss = m(X).sum()
    with amp.scale_loss(loss, o) as scaled:  # disabled: the loss itself, no scaling
        assert scaled is loss


@pytest.mark.parametrize(
    ("level", "weight", "norm", "masters", "scale"),
    [
        ("O0", torch.float32, torch.float32, torch.float32, 1.0),
        ("O1", torch.float32, torch.float32, torch.float32, 2.0**16),
        ("O2", torch.bfloat16, torch.float32, torch.float32, 2.0**16),
        ("O3", torch.bfloat16, torch.bfloat16, torch.bfloat16, 1.0),
    ],
)
def test_opt_level_defaults(level, weight, norm, masters, scale):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert (model[0].weight.dtype, model[1].weight.dtype) == (weight, norm)
    assert {p.dtype for p in amp.master_params(opt)} == {masters}
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale
    x = torch.randn(3, 4)
    loss = model(x).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss.float() * scale)  # apex: loss.float() * loss_scale
    if level != "O1":  # O2/O3 cast outputs back to FP32 (apex's output caster); O1 leaves them
        assert model(x).dtype == torch.float32


@pytest.mark.parametrize(
    ("overrides", "weight", "norm", "scale"),
    [
        (dict(opt_level="O2", keep_batchnorm_fp32="False"), torch.bfloat16, torch.bfloat16, 2**16),
        (dict(opt_level="O3", keep_batchnorm_fp32="True"), torch.bfloat16, torch.float32, 1.0),
        (dict(opt_level="O2", loss_scale="128.0"), torch.bfloat16, torch.float32, 128.0),
        (dict(opt_level="O3", loss_scale="dynamic"), torch.bfloat16, torch.bfloat16, 2**16),
        (dict(opt_level="O0", loss_scale="dynamic"), torch.float32, torch.float32, 2**16),
        (dict(opt_level="O1", loss_scale=128.0), torch.float32, torch.float32, 128.0),
        (dict(opt_level="O2", cast_model_type=False), torch.float32, torch.float32, 2**16),
        (dict(opt_level="O1", cast_model_type=False), torch.float32, torch.float32, 2**16),
        (dict(opt_level="O2", max_loss_scale=2.0**10), torch.bfloat16, torch.float32, 2**10),
    ],
)
def test_property_overrides_apex_accepts(overrides, weight, norm, scale):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, verbosity=0, **overrides)
    assert (model[0].weight.dtype, model[1].weight.dtype) == (weight, norm)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(opt_level="O1", master_weights=True), "master_weights"),
        (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
        (dict(opt_level="O1", cast_model_type=torch.float16), "cast_model_type"),
        (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions"),
        (dict(opt_level="01"), "letter O, not the digit zero"),
    ],
)
def test_overrides_apex_refuses_are_refused(overrides, match):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **overrides)


def test_half_weights_are_refused_where_apex_allowed_them_behind_a_flag():
    """apex's tests set _amp_state.allow_incoming_model_not_fp32 to hand over FP16 weights;
    distamp has no such switch: the opt_level decides what is cast."""
    model = nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match=r"expected torch\.float32"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")


# -- O1 casts (test_basic_casts.py, test_promotion.py): where torch.autocast agrees with apex -------


class Apply(nn.Module):
    """Runs ``fn`` on its inputs inside the wrapped forward, where O1's autocast is on."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, *args):
        return self.fn(*args)


def under_o1(fn):
    model = Apply(fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    return model


HALF, FLOAT, MATCH = "half", "float", "match"
LINEAR = nn.Linear(16, 16)
CONV = nn.Conv2d(4, 4, 3)


@pytest.mark.parametrize(
    ("name", "fn", "shape", "expect"),
    [
        ("linear", LINEAR, (4, 16), HALF),
        ("F.linear", lambda x: F.linear(x, LINEAR.weight, LINEAR.bias), (4, 16), HALF),
        ("conv2d", CONV, (2, 4, 6, 6), HALF),
        ("matmul method", lambda x: x.matmul(torch.randn(16, 16)), (16, 16), HALF),
        ("@ operator", lambda x: torch.randn(16, 16) @ x, (16, 16), HALF),
        ("mse_loss", lambda x: F.mse_loss(x, torch.randn(4, 16)), (4, 16), FLOAT),
        ("relu", F.relu, (4, 16), MATCH),
        ("batch_norm", nn.BatchNorm2d(4), (2, 4, 3, 3), MATCH),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_o1_casts_that_match_apex(name, fn, shape, expect, dtype):
    model = under_o1(fn)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    y = model(x)
    want = {HALF: torch.bfloat16, FLOAT: torch.float32, MATCH: dtype}[expect]
    assert y.dtype == want, name
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype  # gradients come back in the input's dtype


PAIRS = [(a, b) for a in (torch.float32, torch.bfloat16) for b in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(
    "fn",
    [torch.atan2, lambda x, y: x.atan2(y), torch.mul, lambda x, y: x.mul(y)],
    ids=["torch.atan2", "Tensor.atan2", "torch.mul", "Tensor.mul"],
)
@pytest.mark.parametrize(("xtype", "ytype"), PAIRS)
def test_o1_binary_ops_match_the_widest_input(fn, xtype, ytype):
    model = under_o1(fn)
    x = torch.randn(8, dtype=xtype, requires_grad=True)
    out = model(x, torch.randn(8, dtype=ytype))
    widest = torch.float32 if torch.float32 in (xtype, ytype) else torch.bfloat16
    assert out.dtype == widest
    out.float().sum().backward()
    assert x.grad.dtype == xtype


@pytest.mark.parametrize(("xtype", "ytype"), PAIRS)
def test_o1_inplace_add_keeps_self_dtype(xtype, ytype):
    model = under_o1(lambda x, y: x.add_(y))
    leaf = torch.randn(8, dtype=xtype, requires_grad=True)
    out = model(leaf.clone(), torch.randn(8, dtype=ytype))
    assert out.dtype == xtype
    out.float().sum().backward()
    assert leaf.grad.dtype == xtype


def test_o1_cat_matches_the_widest_input():
    model = under_o1(lambda *ts: torch.cat(ts))
    halves = [torch.randn(4, dtype=torch.bfloat16) for _ in range(5)]
    assert model(*halves, torch.randn(4)).dtype == torch.float32
    assert model(*halves, torch.randn(4, dtype=torch.bfloat16)).dtype == torch.bfloat16


# -- test_cache.py: train, eval under no_grad, weights changed in place, train again ----------------


class Whitelist(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(64, dtype=torch.float32).view(8, 8) / 64)

    @staticmethod
    def ops(x, w):
        return x.mm(w).mm(w).sum()

    def forward(self, x):
        return self.ops(x, self.weight)


class Blacklist(Whitelist):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(16, dtype=torch.float32).view(2, 8) / 16)

    @staticmethod
    def ops(x, w):
        return (x + torch.pow(w, 2) + torch.pow(w, 2)).sum()


class Promote(Blacklist):
    @staticmethod
    def ops(x, w):
        return ((x * w) * w).sum()


@pytest.mark.parametrize("module", [Whitelist, Blacklist, Promote])
def test_o1_weights_changed_between_steps_are_not_served_from_a_stale_cast(module):
    model = module()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.ones(2, 8)
    set_loss_scales(4.0)

    def training_step():
        model.weight.grad = None
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        grads = [p for p in amp.master_params(opt) if p.grad is not None]
        assert len(grads) == 1 and model.weight.grad.dtype == model.weight.dtype
        w = model.weight.detach().clone().requires_grad_()
        model.ops(x, w).backward()  # FP32 reference on a fresh tensor
        close(model.weight.grad, w.grad, half=True)
        opt.zero_grad()
        with torch.no_grad():
            model.weight -= 1.0

    training_step()
    with torch.no_grad():
        model(x)  # eval
    training_step()


# -- per-function precision: amp.half_function / float_function / promote_function ------------------


def dot_sum(x, w):
    return (x * w).sum(-1)


def cat_sum(tensors):
    return torch.cat(tensors).sum()


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("xtype", "ytype"), [(a, b) for a in ("f", "h") for b in ("f", "h")])
def test_decorators_follow_apex_cast_tables(half, xtype, ytype):
    """apex: half_function ALWAYS_HALF, float_function ALWAYS_FLOAT, promote_function the widest;
    gradients flow back in each input's own dtype."""
    dtypes = {"f": torch.float32, "h": half}
    widest = torch.float32 if "f" in (xtype, ytype) else half
    for decorator, want in (
        (amp.half_function, half),
        (amp.float_function, torch.float32),
        (amp.promote_function, widest),
    ):
        fn = decorator(dot_sum)
        x = torch.randn(2, 4, dtype=dtypes[xtype], requires_grad=True)
        w = torch.randn(4, dtype=dtypes[ytype], requires_grad=True)
        with torch.autocast("cpu", dtype=half):
            out = fn(x, w=w)  # keyword tensors are cast too
        assert out.dtype == want, decorator.__name__
        out.float().sum().backward()
        assert (x.grad.dtype, w.grad.dtype) == (x.dtype, w.dtype)
        # Outside autocast: half/promote run unchanged (apex without O1); float_function still
        # runs in FP32 (apex ran it so wherever O1 was on: a loss outside the model's forward).
        outside = torch.promote_types(x.dtype, w.dtype)
        if decorator is amp.float_function:
            outside = torch.float32
        assert fn(x.detach(), w.detach()).dtype == outside


def test_a_float_function_loss_outside_forward_runs_in_fp32_under_o1():
    """An audit's apex script: O1 fp16, the loss computed outside forward by a function decorated
    with @amp.float_function. fp16's sum of squares overflowed to inf (every step skipped);
    apex ran it in FP32 wherever it was called, and so does distamp now."""
    model = nn.Linear(4, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)

    @amp.float_function
    def energy(out):
        return out.pow(2).sum()

    out = model(torch.full((8, 4), 40.0))
    assert out.dtype == torch.float16
    loss = energy(out)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() > 65504  # the same sum in fp16 is inf


def test_decorators_cast_tensors_inside_a_list_argument():
    """apex's is_fp_tensor treats a list of floating tensors as one argument (cat-like functions)."""
    floats = [torch.randn(3), torch.randn(3)]
    halves = [t.bfloat16() for t in floats]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert amp.half_function(cat_sum)(floats).dtype == torch.bfloat16
        assert amp.float_function(cat_sum)(halves).dtype == torch.float32
        assert amp.promote_function(cat_sum)([halves[0], floats[1]]).dtype == torch.float32
        assert amp.promote_function(cat_sum)(halves).dtype == torch.bfloat16


class Scorer(nn.Module):
    """A model calling decorated functions in its forward, as apex's users did under O1."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)  # bf16 under O1
        probs = amp.float_function(F.softmax)(h, dim=-1)
        return probs, amp.half_function(dot_sum)(h.float(), h.float())


def test_decorated_functions_inside_an_o1_forward():
    model = Scorer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    probs, scores = model(torch.randn(3, 8))
    assert (probs.dtype, scores.dtype) == (torch.float32, torch.bfloat16)
    with amp.scale_loss(probs.sum() + scores.float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()


def test_register_functions_replace_a_function_of_the_users_module():
    me = sys.modules[__name__]
    original = me.dot_sum
    x, w = torch.randn(2, 4), torch.randn(4)
    try:
        amp.register_half_function(me, "dot_sum")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert me.dot_sum(x, w).dtype == torch.bfloat16
        me.dot_sum = original
        amp.register_float_function(me, "dot_sum")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert me.dot_sum(x.bfloat16(), w.bfloat16()).dtype == torch.float32
        me.dot_sum = original
        amp.register_promote_function(me, "dot_sum")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert me.dot_sum(x.bfloat16(), w).dtype == torch.float32
    finally:
        me.dot_sum = original
    # apex raised ValueError("No function named ...") for a name the module does not have.
    with pytest.raises(ValueError, match="no_such_function"):
        amp.register_half_function(me, "no_such_function")


# -- test_add_param_group.py ----------------------------------------------------------------------


class Pair(nn.Module):
    """apex's MyModel with both weights FP32 (distamp refuses half weights at initialize)."""

    def __init__(self, unique: float):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return (x * self.weight0.float() * self.weight1.float()).sum()


def zero(models, optimizer, how):
    if how == "none":
        for model in models:
            for p in model.parameters():
                p.grad = None
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        optimizer.zero_grad()


def add_param_group_run(level, zero_before_add, accumulate, how, amp_kwargs):
    """apex's sequence: one step on model0, add model1's params as a new group, two more steps."""
    m0, m1 = Pair(1), Pair(2)
    opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}], momentum=0.125)
    scaled = level is not None
    if scaled:
        [m0, m1], opt = amp.initialize([m0, m1], opt, opt_level=level, verbosity=0, **amp_kwargs)
        set_loss_scales(4.0)

    def backward(loss, retain=False):
        if not scaled:
            loss.backward(retain_graph=retain)
            return
        with amp.scale_loss(loss, opt) as s:
            s.backward(retain_graph=retain)

    zero([m0, m1], opt, how)
    backward(m0(X))
    opt.step()
    if zero_before_add:
        zero([m0, m1], opt, how)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "optimizer.add_param_group: the FP32 masters")
        opt.add_param_group({"params": m1.parameters(), "lr": 0.5})
    if not zero_before_add:
        zero([m0, m1], opt, how)
    for i in range(2):  # the second step checks the new params picked up their momentum
        if i:
            zero([m0, m1], opt, how)
        loss = m0(X) + m1(X)
        backward(loss, retain=accumulate)
        if accumulate:
            backward(loss)
        opt.step()
    return [p.detach().clone() for m in (m0, m1) for p in m.parameters()], opt


@pytest.mark.parametrize("how", ["none", "model", "optimizer"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("zero_before_add", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_add_param_group_after_initialize_apex_matrix(level, zero_before_add, accumulate, how):
    """apex's exact call: cast_model_type=False at every level (nothing cast), loss scale 4."""
    reference, _ = add_param_group_run(None, zero_before_add, accumulate, how, {})
    final, _ = add_param_group_run(
        level, zero_before_add, accumulate, how, {"cast_model_type": False}
    )
    for got, want in zip(final, reference, strict=True):
        close(got, want, half=False)


@pytest.mark.parametrize(
    "level",
    ["O2", "O3"],
)
def test_add_param_group_with_the_model_cast(level):
    """Default casting: the added half params get FP32 masters under O2 and train like FP32."""
    reference, _ = add_param_group_run(None, True, True, "optimizer", {})
    final, opt = add_param_group_run(level, True, True, "optimizer", {})
    for got, want in zip(final, reference, strict=True):
        close(got, want, half=True)
    masters = [p.dtype for p in opt.param_groups[1]["params"]]
    assert masters == [torch.float32 if level == "O2" else torch.bfloat16] * 2


def test_an_added_group_is_unscaled_and_its_inf_skips_the_step():
    m0, m1 = Pair(1), Pair(2)
    opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}])
    [m0, m1], opt = amp.initialize([m0, m1], opt, opt_level="O2", verbosity=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "optimizer.add_param_group: the FP32 masters")
        opt.add_param_group({"params": list(m1.parameters()), "lr": 0.5})
    with amp.scale_loss(m0(X) + m1(X), opt) as s:
        s.backward()
    new_masters = list(amp.master_params(opt))[2:]  # reading them unscales, as apex's clip habit
    for master, other in zip(new_masters, [m1.weight1, m1.weight0], strict=True):
        close(master.grad, other.float(), half=True)  # d(w0*w1)/dw0 = w1: unscaled, not 2**16 x
    before = [p.detach().clone() for p in new_masters]
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    opt.step()
    opt.zero_grad()
    with amp.scale_loss(m0(X) + m1(X), opt) as s:
        s.backward()
        m1.weight1.grad[0] = float("inf")
    opt.step()
    assert distamp.stats(opt).last_step_skipped
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    assert not any(torch.equal(b, p) for b, p in zip(before, new_masters, strict=True))  # 1st step


# -- test_multiple_models_optimizers_losses.py (and test_fused_sgd.py's matrix) ---------------------

# name: (param groups of each optimizer as (model, lr), momentum of each optimizer,
#        models in each loss, optimizers passed to each loss's scale_loss)
SCENARIOS = {
    "2models2losses1optimizer": ([[(0, 0.25), (1, 0.5)]], [0.125], [[0], [1]], [[0], [0]]),
    "3models2losses1optimizer": (
        [[(0, 0.25), (1, 0.5), (2, 0.125)]],
        [0.125],
        [[0, 2], [1, 2]],
        [[0], [0]],
    ),
    "2models2losses2optimizers": ([[(0, 0.25)], [(1, 0.5)]], [0.125, 0.25], [[0], [1]], [[0], [1]]),
    "3models2losses2optimizers": (
        [[(0, 0.25), (1, 1.0)], [(2, 0.5)]],
        [0.5, 0.25],
        [[0, 1], [2, 1]],
        [[0], [0, 1]],
    ),
}


def injections(scenario):
    """apex's loops: (iteration, backward, model, weight) of the one injected inf; None = clean."""
    _, _, loss_models, _ = SCENARIOS[scenario]
    out = [None]
    for it in (0, 1):
        for backward, models in enumerate(loss_models):
            out += [(it, backward, m, w) for m in models for w in ("weight0", "weight1")]
    return out


def multi_run(
    scenario,
    inject,
    *,
    level=None,
    cast=None,
    num_losses=1,
    how="optimizer",
    fused=False,
    inject_on_rank=None,
    rank=0,
    **options,
):
    """One run of apex's loop. ``level=None`` is the FP32 reference, which skips by hand exactly
    the optimizers apex expects to skip: those passed to the scale_loss of the overflowed loss.
    ``options`` go to amp.initialize (``keep_fp32_model=1`` keeps models[1] FP32)."""
    groups, momenta, loss_models, loss_opts = SCENARIOS[scenario]
    models = [Pair(u) for u in (1, 2, 3)][: 1 + max(m for ms in loss_models for m in ms)]
    opts = [
        torch.optim.SGD(
            [{"params": models[m].parameters(), "lr": lr} for m, lr in group],
            momentum=momentum,
            fused=fused,
        )
        for group, momentum in zip(groups, momenta, strict=True)
    ]
    iters = 2 if inject is None else 3
    skip = set() if inject is None else {(inject[0], o) for o in loss_opts[inject[1]]}
    master_grads = []
    if level is not None:
        kw = {} if cast is None else {"cast_model_type": cast}
        if "keep_fp32_model" in options:
            kw["keep_fp32_modules"] = [models[options.pop("keep_fp32_model")]]
        kw.update(options)
        models, opts = amp.initialize(
            models, opts, opt_level=level, num_losses=num_losses, verbosity=0, **kw
        )
        set_loss_scales(*(4.0, 16.0)[:num_losses])
    for i in range(iters):
        for opt in opts:
            zero(models, opt, how)
        losses = [sum(models[m](X) for m in ms) for ms in loss_models]
        for b, loss in enumerate(losses):
            chosen = [opts[o] for o in loss_opts[b]]
            hit = inject is not None and (i, b) == inject[:2]
            if level is None:
                loss.backward()
                continue
            with amp.scale_loss(loss, chosen, loss_id=b if num_losses == 2 else 0) as s:
                s.backward()
                if hit and inject_on_rank in (None, rank):
                    getattr(models[inject[2]], inject[3]).grad[0] = float("inf")
        if inject is None or i != inject[0]:
            master_grads.append(
                [p.grad.detach().clone() for o in opts for p in amp.master_params(o)]
            )
        for o, opt in enumerate(opts):
            if (i, o) not in skip or level is not None:
                opt.step()
    params = [p.detach().clone() for m in models for p in m.parameters()]
    masters = [p.detach().clone() for o in opts for p in amp.master_params(o)]
    if level is None:
        return MultiRun(params, masters, master_grads, None, None)
    skipped = [distamp.stats(o).skipped_steps for o in opts]
    scales = [s["loss_scale"] for s in amp.state_dict().values()]
    return MultiRun(params, masters, master_grads, skipped, scales)


class MultiRun(NamedTuple):
    params: list[torch.Tensor]
    masters: list[torch.Tensor]
    master_grads: list[list[torch.Tensor]]
    """The unscaled gradients amp.master_params held at each unskipped iteration."""
    skipped: list[int] | None
    """Skipped steps of each optimizer."""
    loss_scales: list[float] | None


def check_multi(scenario, inject, got, reference, half, sharded=False):
    """Skips as apex expects, the model as the FP32 reference; with replicated masters also the
    unscaled master gradients of every unskipped step and the masters themselves."""
    n_opts = len(SCENARIOS[scenario][0])
    want_skips = [0] * n_opts
    want_scales = [4.0, 16.0][: len(got.loss_scales)]  # as set_loss_scales left them
    if inject is not None:
        for o in SCENARIOS[scenario][3][inject[1]]:
            want_skips[o] = 1
        want_scales[inject[1] if len(want_scales) == 2 else 0] /= 2  # only the overflowed loss's
    assert got.skipped == want_skips, inject
    assert got.loss_scales == want_scales, inject
    for p, r in zip(got.params, reference.params, strict=True):
        close(p, r, half)
    if sharded:  # amp.master_params yields this rank's shard only
        return
    for step_grads, ref_step in zip(got.master_grads, reference.master_grads, strict=True):
        for g, r in zip(step_grads, ref_step, strict=True):
            close(g, r, half)
    for p, m in zip(got.params, got.masters, strict=True):
        assert torch.equal(p, m.to(p.dtype))  # the model holds its masters, rounded


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_multiple_models_optimizers_losses_apex_matrix(scenario, level, num_losses):
    """apex's exact call (cast_model_type=False); infs injected under O1/O2 as apex does, every
    injection with optimizer.zero_grad() and every third with the other two ways of zeroing."""
    cases = injections(scenario) if level in ("O1", "O2") else [None]
    for how in ("optimizer", "model", "none"):
        for inject in cases if how == "optimizer" else cases[::3]:
            reference = multi_run(scenario, inject, how=how)
            got = multi_run(
                scenario, inject, level=level, cast=False, num_losses=num_losses, how=how
            )
            check_multi(scenario, inject, got, reference, half=False)


@pytest.mark.parametrize("keep_fp32", [False, True], ids=["all_bf16", "model1_fp32"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_sgd"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_multiple_models_with_the_models_cast_to_bf16(scenario, fused, keep_fp32):
    """O2 with its default cast (FP32 masters), and torch's fused SGD in place of apex's FusedSGD.
    With models[1] kept FP32 an optimizer mixes parameters with masters and FP32 parameters that
    are their own masters, as apex's MyModel (one FP16, one FP32 weight) did."""
    options = {"keep_fp32_model": 1} if keep_fp32 else {}
    for inject in injections(scenario)[::3]:
        reference = multi_run(scenario, inject, fused=fused)
        got = multi_run(scenario, inject, level="O2", num_losses=2, fused=fused, **options)
        check_multi(scenario, inject, got, reference, half=True)


def _multi_on_ranks(rank, world, scenario, cases, shard):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [
            multi_run(
                scenario,
                inject,
                level="O2",
                num_losses=2,
                inject_on_rank=1,
                rank=rank,
                shard_master_weights=shard,
            )
            for inject in cases
        ]
    warned = any(
        "amp.master_params: the FP32 masters are sharded" in str(w.message) for w in caught
    )
    masters = [sum(m.numel() for m in run.masters) for run in runs]
    return runs, warned, masters


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_an_inf_on_one_rank_skips_the_same_optimizers_on_every_rank(shard):
    """apex decided per process; distamp's decision is global: rank 0 sees no inf and skips too.
    amp.initialize replicates the masters as apex did; sharding them is one option away."""
    scenario = "3models2losses2optimizers"
    cases = injections(scenario)[1::2]
    (runs0, warned0, numel0), (runs1, warned1, numel1) = run_ranks(
        _multi_on_ranks, 2, scenario, cases, shard
    )
    for inject, got0, got1 in zip(cases, runs0, runs1, strict=True):
        reference = multi_run(scenario, inject)
        for got in (got0, got1):
            check_multi(scenario, inject, got, reference, half=True, sharded=shard)
        for a, b in zip(got0.params, got1.params, strict=True):
            assert torch.equal(a, b)
    # Sharded, each rank's amp.master_params holds its part of the masters, and says so once.
    total = sum(p.numel() for p in multi_run(scenario, None).params)
    if shard:
        assert (warned0, warned1) == (True, True)
        assert [a + b for a, b in zip(numel0, numel1, strict=True)] == [total] * len(cases)
    else:
        assert (warned0, warned1) == (False, False)
        assert numel0 == numel1 == [total] * len(cases)


# -- test_checkpointing.py --------------------------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(6)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.bn1(F.relu(self.conv1(x * self.param)))


def conv_batches(n, scale=1.0):
    gen = torch.Generator().manual_seed(2809)
    return [torch.randn(4, 3, 8, 8, generator=gen) * scale for _ in range(n)]


def train_step(model, optimizer, x, loss_ids):
    optimizer.zero_grad()
    output = model(x)
    for idx in loss_ids:
        with amp.scale_loss(output.float().mean(), optimizer, loss_id=idx) as scaled:
            scaled.backward(retain_graph=True)
    optimizer.step()
    return output


def assert_fp32_state(state):
    for key, value in state.items():
        if "num_batches_tracked" not in key:
            assert value.dtype == torch.float32, key


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize(
    ("level", "amp_before_load"),
    [
        *[(level, before) for level in ("O0", "O1", "O2") for before in (True, False)],
        ("O3", True),
        ("O3", False),
    ],
)
def test_restoring(level, amp_before_load, num_losses):
    """Save after 3 of 6 steps, restore into a fresh model and optimizer (amp.initialize before or
    after loading, apex's two orders) and train on: the same outputs and the same state."""
    epochs, restore_at = 6, 3
    batches = conv_batches(epochs)
    torch.manual_seed(0)
    model = ConvBN()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=level, num_losses=2 * num_losses, verbosity=0
    )
    outputs = []
    for epoch, x in enumerate(batches):
        outputs.append(train_step(model, optimizer, x, range(num_losses)))
        if epoch == restore_at - 1:
            checkpoint = copy.deepcopy(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            )
    # apex checks here that the checkpoint's model state is FP32: see test_state_dict_is_fp32.
    restored = ConvBN()
    restored_opt = torch.optim.SGD(restored.parameters(), lr=1e-3, momentum=0.9)
    init = dict(opt_level=level, num_losses=2 * num_losses, verbosity=0)
    if amp_before_load:
        restored, restored_opt = amp.initialize(restored, restored_opt, **init)
    restored.load_state_dict(checkpoint["model"])
    restored_opt.load_state_dict(checkpoint["optimizer"])
    if not amp_before_load:
        if level == "O2":  # the masters will come from the loaded half weights: named
            with pytest.warns(UserWarning, match="has state already"):
                restored, restored_opt = amp.initialize(restored, restored_opt, **init)
        else:
            restored, restored_opt = amp.initialize(restored, restored_opt, **init)
    for epoch in range(restore_at, epochs):
        out = train_step(restored, restored_opt, batches[epoch], range(num_losses, 2 * num_losses))
        # Loaded before initialize, the optimizer is a plain torch one: distamp's FP32 masters
        # cannot reach it, and O2's masters restart from the half weights (as apex's did).
        if level == "O2" and not amp_before_load:
            close(out, outputs[epoch], half=True)
        else:
            assert_equal(out, outputs[epoch])
    for key, value in model.state_dict().items():
        if level == "O2" and not amp_before_load and "num_batches_tracked" not in key:
            close(restored.state_dict()[key], value, half=True)
        else:
            assert_equal(restored.state_dict()[key], value)


def assert_equal(a, b):
    assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_loss_scale_decrease(level):
    """Real fp16 overflows (inputs x 2**17) halve only the scale of the loss that overflowed."""
    decreases = [0, 1, 2]
    torch.manual_seed(0)
    model = ConvBN()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=level, num_losses=3, verbosity=0, half_dtype=torch.float16
    )
    initial = [s["loss_scale"] for s in amp.state_dict().values()]
    x = conv_batches(1, scale=2.0**17)[0][:1, :, :4, :4]
    for idx, n in enumerate(decreases):
        for _ in range(n):
            optimizer.zero_grad()
            with amp.scale_loss(model(x).float().mean(), optimizer, loss_id=idx) as scaled:
                scaled.backward()
            optimizer.step()
            assert distamp.stats(optimizer).last_step_skipped
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    for (key, scaler), factor, init in zip(state.items(), decreases, initial, strict=True):
        assert scaler == {"loss_scale": init / 2**factor, "unskipped": 0}, key


class Masked(nn.Linear):
    """A layer holding a floating buffer next to its weights (cast with them under O2)."""

    def __init__(self):
        super().__init__(4, 6)
        self.register_buffer("mask", torch.ones(6))

    def forward(self, x):
        return super().forward(x) * self.mask


@pytest.mark.parametrize(
    ("level", "make"),
    [
        ("O0", ConvBN),
        ("O1", ConvBN),
        ("O2", ConvBN),
        ("O2", Masked),
        ("O3", ConvBN),
    ],
)
def test_state_dict_is_fp32(level, make):
    """apex's O2StateDictHook: every cast tensor of model.state_dict() is FP32 (O2 and O3)."""
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    x = torch.randn(4, 3, 4, 4) if make is ConvBN else torch.randn(4, 4)
    train_step(model, optimizer, x, [0])
    assert_fp32_state(model.state_dict())


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_state_dict(level):
    """model.state_dict() is FP32 right after initialize (apex's O2 hook) and the model trains."""
    torch.manual_seed(0)
    model = ConvBN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    assert_fp32_state(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    data, target = torch.randn(10, 3, 4, 4, generator=gen), torch.randn(10, 6, 4, 4, generator=gen)
    losses = []
    for _ in range(11):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data).float(), target)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_amp_state_dict_restores_every_scaler_after_a_new_initialize():
    """apex could not test amp.load_state_dict in one script (its FIXME); distamp can."""
    model = Pair(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    set_loss_scales(4.0, 16.0)
    for _ in range(3):
        with amp.scale_loss(model(X), opt, loss_id=1) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    saved = amp.state_dict()
    assert saved == {
        "loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
        "loss_scaler1": {"loss_scale": 16.0, "unskipped": 3},
    }
    again = Pair(1)
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1)
    amp.initialize(again, again_opt, opt_level="O2", num_losses=2, verbosity=0)
    assert amp.state_dict() != saved
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved


def _loss_scalers_after_wrap(rank, world):
    model = Pair(1)
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    try:
        amp._amp_state.loss_scalers  # noqa: B018
    except AttributeError as exc:
        return str(exc)
    return None


def test_amp_state_loss_scalers_before_any_initialize_is_refused_by_name():
    """A script wrapped with distamp.wrap that logs apex's ``_amp_state.loss_scalers[0]`` got an
    empty list and a bare IndexError (an audit); apex has none before initialize. A fresh
    process: amp.initialize in this one leaves its scalers registered."""
    (said,) = run_ranks(_loss_scalers_after_wrap, 1)
    assert said is not None and "expected amp.initialize(...)" in said
    assert "distamp.stats(optimizer).loss_scales" in said


def test_amp_state_loss_scalers_read_and_set_as_apex_scripts_do():
    """apex-era scripts log ``amp._amp_state.loss_scalers[0].loss_scale()`` and set
    ``_loss_scale`` (NVIDIA's BERT starts at 2**20); the private attribute was missing (an
    audit). The scale set is the one the next step uses."""
    model = Pair(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    scalers = amp._amp_state.loss_scalers
    assert [s.loss_scale() for s in scalers] == [2.0**16, 2.0**16]
    scalers[1]._loss_scale = 2.0**20
    with amp.scale_loss(model(X), opt, loss_id=1) as scaled:
        assert scaled.item() == pytest.approx(model(X).item() * 2.0**20, rel=1e-2)
        scaled.backward()
    opt.step()
    assert amp._amp_state.loss_scalers[1]._loss_scale == 2.0**20
    assert amp._amp_state.loss_scalers[1]._unskipped == 1
    with pytest.raises(ValueError, match="expected a positive finite number, got 0"):
        scalers[0]._loss_scale = 0
    # numpy's and torch's numbers as the other settings take them (an audit: refused, in a
    # message that named a positive finite number); a bool is not a scale
    scalers[0]._loss_scale = np.float32(2.0**18)
    assert type(scalers[0].loss_scale()) is float and scalers[0].loss_scale() == 2.0**18
    scalers[0]._loss_scale = torch.tensor(2.0**17)
    assert scalers[0].loss_scale() == 2.0**17
    with pytest.raises(ValueError, match="expected a positive finite number, got True"):
        scalers[0]._loss_scale = True
    with pytest.raises(AttributeError, match="no attribute '_amp_stat'"):
        amp._amp_stat  # noqa: B018


# -- test_larc.py -----------------------------------------------------------------------------------


class LARC:
    """apex.parallel.LARC as its users hold it: a wrapper (not a torch.optim.Optimizer) that rescales
    each gradient by a trust ratio in its own step, then calls the inner optimizer's step."""

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps
        self.grad_norms: list[float] = []
        """What this step read, for the test."""

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self):
        self.optim.zero_grad()

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    def step(self):
        with torch.no_grad():
            decays = []
            for group in self.optim.param_groups:
                decay = group.get("weight_decay", 0)
                decays.append(decay)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param_norm, grad_norm = torch.norm(p), torch.norm(p.grad)
                    self.grad_norms.append(grad_norm.item())
                    if param_norm != 0 and grad_norm != 0:
                        lr = (
                            self.trust_coefficient
                            * param_norm
                            / (grad_norm + param_norm * decay + self.eps)
                        )
                        if self.clip:
                            lr = min(lr / group["lr"], 1)
                        p.grad += decay * p
                        p.grad *= lr
        self.optim.step()
        for group, decay in zip(self.optim.param_groups, decays, strict=True):
            group["weight_decay"] = decay


class Single(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return (x * self.weight0).sum()


def larc_run(level, steps=3, weight_decay=0.0, built_after=False):
    model = Single(1)
    inner = torch.optim.SGD(
        [{"params": model.parameters(), "lr": 0.25}], momentum=0.125, weight_decay=weight_decay
    )
    if built_after and level is not None:  # LARC around the optimizer initialize returned
        model, inner = amp.initialize(model, inner, opt_level=level, verbosity=0)
        optimizer = LARC(inner)
    else:
        optimizer = LARC(inner)
    if level is not None and not built_after:
        model, returned = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
        assert returned is optimizer
    for _ in range(steps):
        optimizer.zero_grad()
        if level is None:
            model(X).backward()
        else:
            with amp.scale_loss(model(X), optimizer) as scaled:
                scaled.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("built_after", [False, True], ids=["handed-to-initialize", "built-after"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
@pytest.mark.parametrize("level", LEVELS)
def test_larc_mixed_precision(level, weight_decay, built_after):
    """apex's test_larc only checks that a step runs; LARC must also read the unscaled gradients
    (a scaled one makes its trust ratio 2**16 times too small) and train as in FP32 — also built
    around the optimizer initialize returned (an audit: 8x too small at O1, no update at O2)."""
    model, optimizer = larc_run(level, weight_decay=weight_decay, built_after=built_after)
    ref_model, ref_opt = larc_run(None, weight_decay=weight_decay)
    half = level in ("O2", "O3")
    torch.testing.assert_close(
        torch.tensor(optimizer.grad_norms),
        torch.tensor(ref_opt.grad_norms),
        **(dict(rtol=2e-2, atol=0) if half else {}),
    )
    close(model.weight0, ref_model.weight0, half)


def test_larc_with_clipping_through_master_params():
    """apex scripts clip amp.master_params(optimizer) with the LARC wrapper they hold."""
    runs = []
    for level in (None, "O2"):
        model = Single(1)
        optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.25))
        if level is not None:
            model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
        for _ in range(2):
            optimizer.zero_grad()
            loss = 10 * model(X)
            if level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, optimizer) as scaled:
                    scaled.backward()
            norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
            optimizer.step()
        runs.append((norm, model.weight0.detach().float(), optimizer.grad_norms))
    (ref_norm, ref_weight, ref_seen), (norm, weight, seen) = runs
    close(norm, ref_norm, half=True)  # the unscaled norm, not 2**16 times it
    close(torch.tensor(seen), torch.tensor(ref_seen), half=True)  # LARC read the clipped grads
    close(weight, ref_weight, half=True)


def test_larc_step_is_skipped_on_overflow():
    model = Single(1)
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.25))
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    before = model.weight0.detach().clone()
    with amp.scale_loss(model(X), optimizer) as scaled:
        scaled.backward()
        model.weight0.grad[1] = float("nan")
    optimizer.step()
    assert torch.equal(model.weight0, before)
    assert distamp.stats(optimizer.optim).skipped_steps == 1


# -- test_update_scale_hysteresis.py: the dynamic scale update, with apex's kernel as reference -----


def apex_update(state, found_inf, growth, backoff, interval, hysteresis):
    """apex's update_scale_hysteresis kernel (csrc/update_scale_hysteresis.cu), in Python."""
    scale, growth_tracker, hysteresis_tracker = state
    if found_inf:
        hysteresis_tracker -= 1
        if hysteresis_tracker > 0:
            return scale, 0, hysteresis_tracker
        return scale * backoff, 0, hysteresis_tracker
    growth_tracker += 1
    if growth_tracker == interval:
        grown = scale * growth
        return (grown if grown <= torch.finfo(torch.float32).max else scale), 0, hysteresis
    return scale, growth_tracker, hysteresis


def run_both(pattern, init, growth, backoff, interval, hysteresis):
    ours = LossScaler(
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hysteresis,
        max_loss_scale=float("inf"),
    )
    theirs = (float(init), 0, hysteresis)
    for found_inf in pattern:
        ours.update(found_inf)
        theirs = apex_update(theirs, found_inf, growth, backoff, interval, hysteresis)
    return ours.scale, theirs[0]


SCALER_CASES = [
    (init, growth, backoff, interval, hysteresis)
    for init in (1.0, 1024.0, 65536.0)
    for growth in (2.0, 4.0)
    for backoff in (0.5, 0.25)
    for interval in (10, 100)
    for hysteresis in (1, 2, 10)
]


@pytest.mark.parametrize(("init", "growth", "backoff", "interval", "hysteresis"), SCALER_CASES)
def test_scale_update_matches_apex_within_the_hysteresis(
    init, growth, backoff, interval, hysteresis
):
    """Fewer than ``hysteresis`` infs leave the scale alone, ``hysteresis`` of them back off once,
    a clean step re-arms the hysteresis, and growth comes every ``interval`` clean steps."""
    rng = random.Random(f"{init}-{growth}-{backoff}-{interval}-{hysteresis}")
    pattern = [True] * (hysteresis - 1) + [False] * (interval - 1)
    assert run_both(pattern, init, growth, backoff, interval, hysteresis) == (init, init)
    pattern += [True] * hysteresis + [False] * (interval + rng.randint(0, 3 * interval))
    pattern += ([True] * (hysteresis - 1) + [False]) * 3
    ours, theirs = run_both(pattern, init, growth, backoff, interval, hysteresis)
    assert ours == theirs


@pytest.mark.parametrize("hysteresis", [2, 10])
def test_every_overflow_past_the_hysteresis_backs_off(hysteresis):
    extra = 7
    pattern = [True] * (hysteresis + extra)
    ours, theirs = run_both(pattern, 65536.0, 2.0, 0.5, 100, hysteresis)
    assert theirs == 65536.0 / 2 ** (1 + extra)
    assert ours == theirs
