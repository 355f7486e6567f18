"""Tensor parallelism (DTensor parameters from ``parallelize_module``): distamp's ``wrap`` and
``fully_shard`` refuse it by name (tests/test_rank_agreement.py); ``distamp.GradScaler`` over
torch's own TP + FSDP2 skips on every rank of the dp x tp mesh together, as README says."""

import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn

import distamp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def net():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def batches(steps):
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(8, 8, generator=gen)
    return [(x, x @ target) for x in (torch.randn(8, 8, generator=gen) for _ in range(steps))]


def reference(steps, skipped):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(steps)):
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        if step != skipped:
            opt.step()
    return model.state_dict()


def _tp_fsdp_grad_scaler(rank, world, steps, inf_at):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = net()
    plan = {f"{i}.fc1": ColwiseParallel() for i in range(2)}
    plan.update({f"{i}.fc2": RowwiseParallel() for i in range(2)})
    parallelize_module(model, mesh["tp"], plan)
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = distamp.GradScaler("cpu")
    dp = mesh["dp"].get_local_rank()
    for step, (x, y) in enumerate(batches(steps)):
        x, y = x[dp * 4 : (dp + 1) * 4], y[dp * 4 : (dp + 1) * 4]
        scaler.scale((model(x) - y).pow(2).mean()).backward()
        if step == inf_at and rank == 1:  # one rank's TP slice of one gradient
            model[0].fc1.weight.grad.to_local().view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    state = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    dist.barrier()
    return state, scaler.get_scale()


def test_grad_scaler_over_tp_and_fsdp2_skips_on_every_rank_together():
    steps, inf_at = 3, 1
    expected = reference(steps, skipped=inf_at)
    for rank, (state, scale) in enumerate(
        run_ranks(_tp_fsdp_grad_scaler, 4, steps, inf_at, timeout=180)
    ):
        assert scale == 32768.0, (rank, scale)  # one backoff, on every rank
        for key, value in expected.items():
            # FP32 with a power-of-two scale: the dp x tp sums differ from one process's order
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=(rank, key))
