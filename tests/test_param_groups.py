"""Which parameters the optimizer steps, and how: groups added after wrap, parameters without a
gradient this step, parameters frozen at wrap and unfrozen later, per-tensor scalar state.

Most checks use ``GradProbe`` (loss = (w * g).sum(), so the gradient of w is exactly g) with
values exactly representable in BF16: the expected weights are then exact numbers, not a
tolerance. SGD(lr=1) with g = 2**-12 moves w by 2**-12 per step: 64 steps take 1.0 to
1 - 2**-6 = 0.984375, which BF16 represents; stepping the BF16 weight itself (no FP32 master)
never moves it (2**-12 is below half of BF16's spacing at 1.0).
"""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import GradProbe, NormMLP
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

pytestmark = pytest.mark.xdist_group("param_groups")

TINY = 2.0**-12
STEPS = 64


class TwoProbes(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.a = GradProbe(n)
        self.b = GradProbe(n)
        nn.init.ones_(self.a.w)
        nn.init.ones_(self.b.w)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return self.a(g) + self.b(g)


def _step(model, opt, g):
    with distamp.scale_loss(model(g).float(), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


# -- add_param_group after wrap ----------------------------------------------------------------


def _added_group(rank, world, level, shard, inject):
    model = TwoProbes()
    model.b.w.requires_grad_(False)  # progressive unfreezing: b joins the optimizer later
    opt = torch.optim.SGD(model.a.parameters(), lr=1.0)
    model, opt = distamp.wrap(model, opt, opt_level=level, shard_master_weights=shard, verbosity=0)
    g = torch.full((3,), TINY)
    _step(model, opt, g)
    model.b.w.requires_grad_(True)
    with (
        pytest.warns(UserWarning, match="start from their half weights")
        if level == "O2"
        else (_no_warning())
    ):
        opt.add_param_group({"params": [model.b.w], "lr": 1.0})
    skipped = []
    for step in range(STEPS + 1):
        with distamp.scale_loss(model(g).float(), opt) as scaled:
            scaled.backward()
        if inject and step == 3 and rank == world - 1:
            model.b.w.grad[1] = float("inf")  # in the added group, on one rank only
        opt.step()
        opt.zero_grad()
        skipped.append(distamp.stats(opt).last_step_skipped)
    return {
        "a": model.a.w.detach().float(),
        "b": model.b.w.detach().float(),
        # what the optimizer steps for b: its FP32 master (this rank's slices when sharded)
        "b_master": torch.cat([t.detach().reshape(-1) for t in opt.param_groups[1]["params"]]),
        "skipped": skipped,
        "scale": distamp.stats(opt).loss_scales[0],
    }


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    ("level", "shard", "world"),
    [("O1", False, 1), ("O2", False, 1), ("O2", False, 2), ("O2", True, 2)],
    ids=["O1", "O2", "O2-replicated-w2", "O2-sharded-w2"],
)
def test_an_added_group_gets_masters_is_unscaled_and_skips_with_the_others(level, shard, world):
    results = run_ranks(_added_group, world, level, shard, True, timeout=120)
    for r in results:
        # one skipped step (the inf in the added group on one rank): 64 clean steps of 2**-12
        assert r["skipped"].count(True) == 1 and r["skipped"][3]
        assert r["scale"] == 2.0**15
        model_dtype = torch.float32 if level == "O1" else torch.bfloat16
        expected_a = torch.full((3,), 1.0 - (STEPS + 1) * TINY).to(model_dtype).float()
        assert torch.equal(r["a"], expected_a)
        # unscaled (not 2**16 times the step) and accumulated in FP32 (a BF16 weight stepped
        # by 2**-12 would never move)
        assert torch.equal(r["b"], torch.full((3,), 1.0 - STEPS * TINY))
        master = r["b_master"]
        assert master.dtype == torch.float32
        assert torch.equal(master, torch.full_like(master, 1.0 - STEPS * TINY))


def _add_refused(rank, world):
    model = TwoProbes()
    opt = torch.optim.SGD(model.a.parameters(), lr=1.0)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    stranger = nn.Parameter(torch.ones(3))
    errors = []
    for group in ({"params": [model.a.w]}, {"params": [stranger]}, {"params": {model.b.w}}):
        try:
            opt.add_param_group(group)
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    model.b = GradProbe(3).to(torch.bfloat16)  # a head replaced after wrap (reset_classifier)
    try:
        opt.add_param_group({"params": [model.b.w]})
    except ValueError as exc:
        errors.append(str(exc))
    model.b = GradProbe(3)
    _step(model, opt, torch.ones(3))  # nothing was lost: training goes on
    return errors


def test_add_param_group_refuses_what_wrap_would_refuse():
    (errors,) = run_ranks(_add_refused, 1)
    assert len(errors) == 4
    assert "'a.w' is already held by this optimizer" in errors[0]
    assert "not a parameter of the model(s) passed to distamp.wrap" in errors[1]
    assert "fully_shard" not in errors[1]  # (no FSDP here)
    assert "got set" in errors[2]
    # timm's reset_classifier after wrap: the parameter is the model's, added later (an audit:
    # it was called "not a parameter of the model(s)", with a hint about FSDP)
    assert "parameter 'b.w' was added to the model after distamp.wrap" in errors[3]
    assert "before building the optimizer and calling wrap" in errors[3]


# -- parameters without a gradient this step ---------------------------------------------------


class Experts(nn.Module):
    """A router-free MoE: step k uses expert k % 3 only; the others get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(5, 6)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.out(torch.relu(self.experts[expert](self.inp(x))))


def _experts(rank, world, opt_name, shard):
    model = Experts()
    opt = {
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.1),
    }[opt_name](model.parameters())
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    ddp = DDP(model, find_unused_parameters=True)
    gen = torch.Generator().manual_seed(rank)
    history = []
    for step in range(7):
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 2, generator=gen)
        with distamp.scale_loss(F.mse_loss(ddp(x, step % 3), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_parameters_without_a_gradient_are_not_moved_sharded_equals_replicated(opt_name):
    sharded = run_ranks(_experts, 2, opt_name, True, timeout=120)
    replicated = run_ranks(_experts, 2, opt_name, False, timeout=120)
    names = [n for n, _ in Experts().named_parameters()]
    for rank in range(2):
        for step, (a, b) in enumerate(zip(sharded[rank], replicated[rank], strict=True)):
            for name, p, q in zip(names, a, b, strict=True):
                assert torch.equal(p, q), (step, name)
    # expert 1 is used at steps 1 and 4 only: weight decay and momentum leave it alone elsewhere
    e1 = names.index("experts.1.weight")
    hist = sharded[0]
    assert torch.equal(hist[2][e1], hist[1][e1]) and torch.equal(hist[3][e1], hist[1][e1])
    assert not torch.equal(hist[4][e1], hist[3][e1])


# -- frozen at wrap, unfrozen later --------------------------------------------------------------


def _unfrozen(rank, world, shard):
    model = TwoProbes()
    model.b.w.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # b is in the optimizer, frozen
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    g = torch.full((3,), TINY)
    for _ in range(5):
        _step(model, opt, g)
    frozen_after = model.b.w.detach().clone()
    model.b.w.requires_grad_(True)
    for _ in range(STEPS):
        _step(model, opt, g)
    return {"frozen_after": frozen_after, "b": model.b.w.detach().float()}


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)], ids=["replicated", "sharded"])
def test_a_parameter_frozen_at_wrap_trains_with_an_fp32_master_once_unfrozen(shard, world):
    for r in run_ranks(_unfrozen, world, shard, timeout=120):
        assert torch.equal(r["frozen_after"].float(), torch.ones(3))  # no gradient: not moved
        assert torch.equal(r["b"], torch.full((3,), 1.0 - STEPS * TINY))


# -- scalar optimizer state is per tensor ------------------------------------------------------


def _adagrad(rank, world, shard):
    # more than two of distamp.masters.layout.BLOCK elements: the shard is stepped in several slices
    model = GradProbe(2**19 + 5)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.5)  # state made here
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        g = torch.randn(2**19 + 5, generator=gen).bfloat16()
        _step(model, opt, g)
    return model.w.detach().clone()


def test_each_slice_of_a_sharded_master_counts_its_own_steps():
    """Adagrad's lr_decay reads the per-tensor ``step``: slices sharing one step tensor decayed
    the learning rate once per slice per step."""
    (replicated,) = run_ranks(_adagrad, 1, False)
    (sharded,) = run_ranks(_adagrad, 1, True)
    assert torch.equal(sharded, replicated)


def _named(rank, world):
    model = NormMLP()
    opt = torch.optim.AdamW(model.fc1.named_parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    added = [*model.ln.named_parameters(), ("fc2.weight", model.fc2.weight)]
    opt.add_param_group({"params": added})
    return [
        list(zip(g["param_names"], [p.numel() for p in g["params"]], strict=True))
        for g in opt.param_groups
    ]


def _span(name):
    first, last = name[name.index("[") + 1 : -1].split(":")
    return int(last) - int(first)


def test_named_param_groups_stay_parallel_to_what_is_stepped():
    """torch's named optimizers (AdamW(model.named_parameters())): param_names holds one name per
    tensor in params; with sharded masters a slice is named after its parameter and elements, a
    parameter stepped whole (the FP32 LayerNorm under O2) by its own name."""
    ranks = run_ranks(_named, 2)
    for first, second in ranks:
        assert all("[" in n and _span(n) == numel for n, numel in first), first
        assert ("weight", 16) in second and ("bias", 16) in second, second
        slices = [(n, k) for n, k in second if n.startswith("fc2.weight")]
        assert slices and all(_span(n) == k for n, k in slices), second
    # Between them the ranks' slices cover fc1 (16 x 8 weight, 16 bias) exactly once.
    held = [(n.split("[")[0], k) for first, _ in ranks for n, k in first]
    assert sum(k for n, k in held if n == "weight") == 128
    assert sum(k for n, k in held if n == "bias") == 16
