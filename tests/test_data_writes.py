"""Weights written through ``.data`` after ``step()`` reach the FP32 masters (see [Note: writes
through .data] in distamp/masters/base.py).

WGAN's weight clipping, ``for p in critic.parameters(): p.data.clamp_(-c, c)`` after
``optimizer.step()``, against the same script in plain FP32 torch: the masters used to keep the
unclipped values and train on from them, silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp
from tests.asserts import backward
from tests.dist_harness import run_ranks

pytestmark = pytest.mark.xdist_group("multirank")

CLIP = 0.01


def _critic_run(
    rank: int, world: int, level: str, shard: bool, updates: bool = False
) -> list[torch.Tensor]:
    """The weights right after each step (before that step's clamp), flattened."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in critic.parameters():
            p.clamp_(-CLIP, CLIP)
    opt = torch.optim.RMSprop(critic.parameters(), lr=2e-3)
    if level != "fp32":
        critic, opt = distamp.wrap(
            critic, opt, opt_level=level, shard_master_weights=shard, verbosity=0
        )
    model = DDP(critic) if world > 1 else critic
    if updates:  # 16-bit updates of the FP32 weights: the reduce-scatter hook's gather_dtype
        distamp.hooks.register(model, opt, reduce_scatter=True, gather_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7 + rank)
    after_step = []
    for _ in range(6):
        x = torch.randn(16, 8, generator=g)
        real = torch.randn(16, 8, generator=g) + 1.0
        dtype = next(critic.parameters()).dtype
        loss = (model(x.to(dtype)).float().mean() - model(real.to(dtype)).float().mean()) * 10
        backward(loss, None if level == "fp32" else opt)
        opt.step()
        opt.zero_grad()
        after_step.append(torch.cat([p.detach().float().reshape(-1) for p in critic.parameters()]))
        for p in critic.parameters():
            p.data.clamp_(-CLIP, CLIP)
    return after_step


def _both(rank: int, world: int, level: str, shard: bool, updates: bool = False) -> dict:
    return {
        "ref": _critic_run(rank, world, "fp32", False),
        "amp": _critic_run(rank, world, level, shard, updates),
    }


@pytest.mark.parametrize(
    ("level", "shard", "world", "atol"),
    [("O2", False, 1, 5e-3), ("O2", True, 2, 5e-3), ("O0", True, 2, 0.0)],
    ids=["O2-replicated", "O2-sharded-w2", "O0-sharded-w2"],
)
def test_weight_clipping_through_data_reaches_the_masters(level, shard, world, atol):
    """Tolerance: bf16 weights and forward (O2) leave the weights within 3.4e-3 of FP32's here
    (RMSprop's first steps amplify rounding); O0 trains in FP32, bit for bit. Without the clamp
    reaching the masters they were 2e-2 off after the 2nd step, 8e-2 after the 6th (the masters
    trained on unclipped)."""
    out = run_ranks(_both, world, level, shard)
    for r in out:
        for step, (got, want) in enumerate(zip(r["amp"], r["ref"], strict=True)):
            diff = (got - want).abs().max().item()
            assert diff <= atol, (step, diff)


def test_weight_clipping_through_data_reaches_the_masters_under_16_bit_updates():
    """``gather_dtype=torch.bfloat16``: every rank adds the bf16-rounded updates to its FP32
    weights and the owner takes the result as its master, so after the gather the masters equal
    the weights again and a clamp through ``.data`` is seen (an audit: this mode skipped the
    check, and the masters trained unclipped: 2e-2 off after the 2nd step, growing).
    Tolerance: the updates rounded to bf16 (RMSprop's first steps are ~2e-2, 8 bits of
    mantissa: 3e-5 a step; measured 9.4e-5 after 3 steps), which RMSprop's next steps amplify
    (measured 5.8e-3 after the 5th; 1.5e-3 without any clamp)."""
    out = run_ranks(_both, 2, "O0", True, True)
    for r in out:
        for step, (got, want) in enumerate(zip(r["amp"], r["ref"], strict=True)):
            diff = (got - want).abs().max().item()
            assert diff <= (2e-4 if step < 3 else 1e-2), (step, diff)


@pytest.mark.parametrize("through", ["data", "no_grad"])
def test_a_channels_last_weights_clip_through_data_reaches_the_replicated_masters(through):
    """Only contiguous weights were sampled: a channels_last critic (whose replicated masters
    keep the format) clamped through .data trained unclipped, its masters at 0.45 after three
    steps of a 0.01 clip (an audit)."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 1, 3))
    critic = critic.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(critic.parameters(), lr=0.5)
    critic, opt = distamp.wrap(critic, opt, opt_level="O2", verbosity=0)
    assert not critic[0].weight.is_contiguous()  # kept channels_last
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        backward(critic(x.bfloat16()).float().pow(2).mean() * 100, opt)
        opt.step()
        opt.zero_grad()
        for p in critic.parameters():
            if through == "data":
                p.data.clamp_(-CLIP, CLIP)
            else:
                with torch.no_grad():
                    p.clamp_(-CLIP, CLIP)
    opt.state_dict()  # takes the written weights, as step() does
    masters = opt.state_dict()["distamp"]["masters"]
    assert max(float(m.abs().max()) for m in masters) <= CLIP + 1e-4


def test_a_weight_resized_after_wrap_is_refused_by_name_with_replicated_masters():
    """Hugging Face's resize_token_embeddings after wrap (the embedding's .data replaced by a
    larger tensor): replicated masters failed in a reshape deep inside, naming nothing (an
    audit); sharded ones named it already."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    model[0].weight.data = torch.zeros(12, 4, dtype=model[0].weight.dtype)
    with distamp.scale_loss(model(torch.tensor([1, 11])).float().sum(), opt) as scaled:
        scaled.backward()
    with pytest.raises(ValueError, match=r"parameter '0\.weight' has shape \(12, 4\), its FP32 "):
        opt.step()


def test_a_write_through_a_replaced_data_is_still_taken():
    """The sampled views compared at each step are made once per storage (made per parameter at
    every step they cost a fifth of an O2 step over many small tensors, an audit): a weight
    whose ``.data`` was replaced (same dtype and shape) and then written through ``.data`` is
    compared on its new storage, and the masters take the write. (lr 0 after the replacement:
    views left on the old storage would equal the masters and miss the write.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    for step in range(4):
        backward(model(torch.randn(4, 8)).float().pow(2).mean(), opt)
        opt.step()
        opt.zero_grad()
        if step == 0:
            model[0].weight.data = model[0].weight.data.clone()  # a new storage
            for group in opt.param_groups:
                group["lr"] = 0.0
        if step == 2:
            model[0].weight.data.fill_(0.25)  # through .data: no version bump
    master = opt.param_groups[0]["params"][0]
    assert torch.equal(master.detach(), torch.full_like(master, 0.25))


@pytest.mark.parametrize("how", [".data", "no_grad"])
@pytest.mark.parametrize("which", ["added", "held"])
def test_a_write_between_add_param_group_and_the_next_step_is_taken(how, which):
    """Progressive unfreezing: the parameters added by add_param_group had no recorded versions,
    so the next step's check of weights written after wrap skipped every parameter, and a write
    made between add_param_group and that step (a halved weight) was undone by the replicated
    masters, silently (an audit). lr 0: the weight must stay exactly as written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.0)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    for step in range(2):
        backward(model(torch.randn(4, 8)).float().pow(2).mean(), opt)
        opt.step()
        opt.zero_grad()
        if step == 0:
            opt.add_param_group({"params": list(model[0].parameters())})
            weight = (model[0] if which == "added" else model[2]).weight
            written = (weight.detach().float() * 0.5).to(weight.dtype)
            if how == ".data":
                weight.data.mul_(0.5)
            else:
                with torch.no_grad():
                    weight.mul_(0.5)
    assert torch.equal(weight.detach(), written)
