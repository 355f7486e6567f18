"""The sharded step in rounds ([Note: the step in rounds], distamp/masters/rounds.py): each round of blocks
is stepped and its all-gather started before the next one. It must give what one step gives, bit
for bit, with torch's step hooks firing once per step; other optimizer classes step at once."""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

import distamp
from distamp.masters.rounds import round_step

STEPS = 6


class Net(nn.Module):
    """A norm layer (FP32 and whole under O2: stepped in the last round) between two linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 24)
        self.ln = nn.LayerNorm(24)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x):
        return self.fc2(self.ln(torch.tanh(self.fc1(x))))


class MyAdamW(torch.optim.AdamW):
    """A user's subclass: its step may do anything, so it is stepped at once."""


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5),
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=1e-2),
    "my-adamw": lambda groups: MyAdamW(groups, lr=1e-2, weight_decay=0.1),
}


def _train(rank, world, opt_name, level, shard, hook):
    model = Net()
    groups = [
        {"params": [model.fc1.weight, model.fc2.weight], "lr": 2e-2},
        {"params": [model.fc1.bias, *model.ln.parameters(), model.fc2.bias]},
    ]
    opt = OPTIMIZERS[opt_name](groups)
    model, opt = distamp.wrap(
        model,
        opt,
        opt_level=level,
        half_dtype=torch.bfloat16,
        shard_master_weights=shard,
        verbosity=0,
    )
    ddp = DDP(model, bucket_cap_mb=0.001)
    if hook:
        distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    calls = {"pre": 0, "post": 0, "global": 0}
    seen_in_post = []

    def pre(optimizer, args, kwargs):
        calls["pre"] += 1

    def post(optimizer, args, kwargs):
        calls["post"] += 1
        # The hooks see the optimizer whole, as after one step: every group's full params list.
        seen_in_post.append([len(g["params"]) for g in optimizer.param_groups])

    def global_pre(optimizer, args, kwargs):
        if optimizer is opt:
            calls["global"] += 1

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    handle = register_optimizer_step_pre_hook(global_pre)
    sizes = [len(g["params"]) for g in opt.param_groups]
    gen = torch.Generator().manual_seed(3)
    history = []
    try:
        for _ in range(STEPS):
            x = torch.randn(4 * world, 6, generator=gen)[rank * 4 : rank * 4 + 4]
            y = torch.randn(4 * world, 3, generator=gen)[rank * 4 : rank * 4 + 4]
            with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            history.append({k: v.detach().clone() for k, v in ddp.module.state_dict().items()})
    finally:
        handle.remove()
    state = opt.state_dict()["state"]
    return {
        "in_rounds": round_step(opt, opt._distamp.masters) is not None,
        "history": history,
        "calls": calls,
        "seen_in_post": seen_in_post,
        "sizes": sizes,
        "state_keys": sorted({k for per in state.values() for k in per}),
    }


def _sharded_and_replicated(rank, world, opt_name, level, hook):
    return {
        "sharded": _train(rank, world, opt_name, level, True, hook),
        "replicated": _train(rank, world, opt_name, level, False, False),
    }


def _assert_same_history(a, b, what):
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"{what}: {name} differs after step {step + 1}"


@pytest.mark.parametrize("shard_block", [4], indirect=True)
@pytest.mark.parametrize(
    "opt_name,world",
    [
        *[(name, 2) for name in ("sgd", "adamw", "adamw-fused", "adagrad", "rmsprop", "nadam")],
        *[(name, 3) for name in ("sgd", "adamw")],
    ],
)
def test_the_step_in_rounds_equals_one_replicated_step_bit_for_bit(shard_block, opt_name, world):
    """O2 with sharded masters in 4-element blocks (many rounds) against replicated masters (one
    step of the whole optimizer): the same weights after every step on every rank, the hooks
    fired once per step."""
    out = run_ranks(_sharded_and_replicated, world, opt_name, "O2", False)
    for r, result in enumerate(out):
        sharded, replicated = result["sharded"], result["replicated"]
        assert sharded["in_rounds"] and not replicated["in_rounds"]
        _assert_same_history(sharded["history"], replicated["history"], f"rank {r} {opt_name}")
        assert sharded["calls"] == {"pre": STEPS, "post": STEPS, "global": STEPS}
        assert sharded["seen_in_post"] == [sharded["sizes"]] * STEPS
        assert sharded["state_keys"] == replicated["state_keys"]
        _assert_same_history(sharded["history"], out[0]["sharded"]["history"], f"rank {r}")


def _in_rounds_and_at_once(rank, world, level):
    return {
        "rounds": _train(rank, world, "adamw", level, True, True),
        "once": _train(rank, world, "my-adamw", level, True, True),
    }


@pytest.mark.parametrize("shard_block", [4], indirect=True)
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_rounds_with_the_reduce_scatter_hook_and_the_overlapped_gather(shard_block, level):
    """Under distamp's reduce-scatter hook with the gather overlapped with the next forward (FP32
    weights sharded at O0, FP32 masters of half weights at O2): AdamW stepped in rounds against a
    subclass of it, which is stepped at once, bit for bit on every rank."""
    out = run_ranks(_in_rounds_and_at_once, 2, level)
    for r, result in enumerate(out):
        rounds, once = result["rounds"], result["once"]
        assert rounds["in_rounds"] and not once["in_rounds"]
        assert rounds["calls"] == {"pre": STEPS, "post": STEPS, "global": STEPS}
        _assert_same_history(rounds["history"], once["history"], f"rank {r} {level}")
        _assert_same_history(rounds["history"], out[0]["rounds"]["history"], "ranks")


@pytest.mark.parametrize("shard_block", [4], indirect=True)
def test_a_subclass_of_a_torch_optimizer_is_stepped_at_once(shard_block):
    """A user's subclass may keep state across parameters (one step counter, say): it is stepped
    once per step, not in rounds, and trains as the class it derives from."""
    out = run_ranks(_train, 2, "my-adamw", "O2", True, False)
    reference = run_ranks(_train, 2, "adamw", "O2", True, False)
    for mine, theirs in zip(out, reference, strict=True):
        assert not mine["in_rounds"] and theirs["in_rounds"]
        assert mine["calls"] == {"pre": STEPS, "post": STEPS, "global": STEPS}
        _assert_same_history(mine["history"], theirs["history"], "subclass vs AdamW")
