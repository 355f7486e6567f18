"""Sharded FP32 masters (ZeRO-1) give the replicated result, on every rank, for any optimizer."""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

STEPS = 30


class Odd(nn.Module):
    """Uneven sizes: a 7-element parameter, a frozen one, a LayerNorm (stays FP32, replicated)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 13)
        self.seven = nn.Parameter(torch.randn(7) * 0.1)
        self.frozen = nn.Parameter(torch.randn(13), requires_grad=False)
        self.ln = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) + self.frozen
        h = h + F.pad(self.seven, (0, 6))
        return self.fc2(self.ln(h))


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
}


def make(opt_name, shard, world, clip=None, inject=None):
    model = Odd()
    groups = [
        {"params": [model.fc1.weight, model.fc1.bias, model.seven, model.frozen], "lr": 0.02},
        {"params": [*model.ln.parameters(), *model.fc2.parameters()]},
    ]
    opt = OPTIMIZERS[opt_name](groups)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    return model, opt


def train(rank, world, opt_name, shard, clip=None, inject=None):
    model, opt = make(opt_name, shard, world)
    ddp = DDP(model) if world > 1 else model
    gen = torch.Generator().manual_seed(5)
    history, norms, skipped = [], [], []
    for step in range(STEPS):
        x = torch.randn(4 * world, 6, generator=gen)[rank * 4 : rank * 4 + 4]
        y = torch.randn(4 * world, 3, generator=gen)[rank * 4 : rank * 4 + 4]
        with distamp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
            scaled.backward()
        if inject is not None and step == inject[0] and rank == inject[1]:
            model.fc1.weight.grad.view(-1)[inject[2]] = float("inf")
        if clip is not None:
            norms.append(distamp.clip_grad_norm_(opt, clip).item())
        opt.step()
        opt.zero_grad()
        skipped.append(distamp.stats(opt).last_step_skipped)
        history.append([p.detach().clone() for p in model.parameters()])
    s = distamp.stats(opt)
    return {
        "history": history,
        "skipped": skipped,
        "norms": norms,
        "master_bytes": s.master_bytes,
        "state_bytes": s.optimizer_state_bytes,
    }


def _all_modes(rank, world):
    return {
        (name, shard): train(rank, world, name, shard)
        for name in OPTIMIZERS
        for shard in (True, False)
    }


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def runs(request):
    return request.param, run_ranks(_all_modes, request.param)


pytestmark = pytest.mark.xdist_group("sharded")

# 34 elements are cast and sharded (fc1 78+13, seven 7 in group 0; fc2 39+3 in group 1); the
# LayerNorm's 26 stay FP32 and the frozen 13 stay out.
SHARDED_ELEMENTS = {0: 78 + 13 + 7, 1: 39 + 3}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_sharded_equals_replicated_on_every_rank_after_every_step(runs, opt_name):
    world, results = runs
    for rank_result in results:
        sharded, replicated = rank_result[(opt_name, True)], rank_result[(opt_name, False)]
        for step, (a, b) in enumerate(zip(sharded["history"], replicated["history"], strict=True)):
            for p, q in zip(a, b, strict=True):
                # the per-element arithmetic is the same: bit-identical
                assert torch.equal(p, q), (opt_name, step)
    for step in range(STEPS):  # every rank holds the same half weights after every step
        for other in results[1:]:
            for p, q in zip(
                results[0][(opt_name, True)]["history"][step],
                other[(opt_name, True)]["history"][step],
                strict=True,
            ):
                assert torch.equal(p, q)
    frozen = [name for name, _ in Odd().named_parameters()].index("frozen")
    final = results[0][(opt_name, True)]["history"][-1][frozen]
    assert torch.equal(final, Odd().frozen.to(torch.bfloat16))  # cast, never stepped


def test_each_rank_holds_one_shard_of_masters_and_state(runs):
    world, results = runs
    shard_elems = sum(-(-n // world) for n in SHARDED_ELEMENTS.values())
    for rank_result in results:
        assert rank_result[("adamw", True)]["master_bytes"] == 4 * shard_elems
        assert rank_result[("adamw", False)]["master_bytes"] == 4 * sum(SHARDED_ELEMENTS.values())
        # AdamW: exp_avg + exp_avg_sq of the shard and of the 26 replicated LayerNorm values,
        # plus one scalar step tensor per tensor stepped
        expected_state = 2 * 4 * (shard_elems + 26) + 4 * (2 + 2) + 0
        assert abs(rank_result[("adamw", True)]["state_bytes"] - expected_state) <= 16


def _inject(rank, world):
    # element 95 of fc1.weight's flat group range sits in rank 2's shard at world 3 (shard 33)
    return train(rank, world, "adamw", True, inject=(4, 2, 77))


def test_inf_in_an_element_only_rank_2_owns_skips_every_rank():
    results = run_ranks(_inject, 3)
    for r in results:
        assert [i for i, s in enumerate(r["skipped"]) if s] == [4]
    for p, q in zip(results[0]["history"][-1], results[2]["history"][-1], strict=True):
        assert torch.equal(p, q)


def _clip(rank, world):
    return train(rank, world, "sgd", True, clip=0.05)


def _clip_reference(rank, world):
    return train(rank, world, "sgd", False, clip=0.05)


def test_global_norm_clipping_equals_the_unsharded_norm():
    sharded = run_ranks(_clip, 3)
    replicated = run_ranks(_clip_reference, 1)[0]
    assert sharded[0]["norms"] == sharded[1]["norms"] == sharded[2]["norms"]
    assert len(replicated["norms"]) == STEPS
    # world 3 sees three times the data per step, so compare the sharded norm with the norm of
    # the replicated run at world 3 instead:
    replicated3 = run_ranks(_clip_reference_world, 3)[0]
    for a, b in zip(sharded[0]["norms"], replicated3["norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _clip_reference_world(rank, world):
    return train(rank, world, "sgd", False, clip=0.05)
