"""Gradient accumulation: k micro-batches under DDP no_sync equal one k-times-larger batch, and the
loss scale stays fixed across the micro-batches; skip and scale update happen once, at step()."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import data, mlp
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

MICRO = 4
PER_MICRO = 2
STEPS = 6
INJECT = (3, 1)  # (step, micro-batch): rank 1 writes an inf into its local grad, before the sync


def _run(rank, world, level, accumulate):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kw = {"loss_scale": "dynamic"} if level == "O0" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kw)
    ddp = DDP(model)
    per_rank = MICRO * PER_MICRO
    used_scales, scales_after, skipped = [], [], []
    for step, (x, y) in enumerate(data(STEPS, per_rank * world)):
        x, y = (
            x[rank * per_rank : (rank + 1) * per_rank],
            y[rank * per_rank : (rank + 1) * per_rank],
        )
        chunks = list(zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)) if accumulate else [(x, y)]
        seen = []
        for micro, (xc, yc) in enumerate(chunks):
            last = micro == len(chunks) - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():
                loss = F.mse_loss(ddp(xc), yc) / len(chunks)
                with distamp.scale_loss(loss, opt) as scaled:
                    seen.append((scaled / loss.float()).item())
                    scaled.backward()
            inject = (step, micro if accumulate else 1) == INJECT
            if inject and rank == 1:
                model[0].weight.grad[0, 0] = float("inf")  # local only until the final sync
        used_scales.append(seen)
        opt.step()
        opt.zero_grad()
        s = distamp.stats(opt)
        scales_after.append(s.loss_scales[0])
        skipped.append(s.skipped_steps)
    return {
        "params": [p.detach().float().clone() for p in model.parameters()],
        "used": used_scales,
        "after": scales_after,
        "skipped": skipped,
    }


@pytest.mark.parametrize(("level", "tol"), [("O0", 1e-5), ("O2", 3e-2)])
def test_accumulating_micro_batches_equals_one_large_batch(level, tol):
    accumulated = run_ranks(_run, 2, level, True)
    large = run_ranks(_run, 2, level, False)
    acc = accumulated[0]
    # every rank agrees, bit for bit
    for a, b in zip(acc["params"], accumulated[1]["params"], strict=True):
        assert torch.equal(a, b)
    # the scale is fixed across the micro-batches of a step and changes only at step()
    for step, seen in enumerate(acc["used"]):
        assert len(set(seen)) == 1, f"step {step}: scales {seen}"
    step, _ = INJECT
    assert acc["used"][step + 1][0] == acc["used"][step][0] / 2
    assert acc["skipped"] == [0, 0, 0, 1, 1, 1]  # one skipped step, not one per backward
    assert acc["after"] == large[0]["after"]
    # Stated tolerance: relative L2 per tensor vs one large batch (O0: FP32 summation order only;
    # O2: bf16 gradients are accumulated in bf16 between micro-batches).
    for a, b in zip(acc["params"], large[0]["params"], strict=True):
        assert ((a - b).norm() / b.norm()).item() < tol


def _zeroed_in_place(rank, world, level, set_to_none):
    """DDP's recommended gradient_as_bucket_view=True with zero_grad(set_to_none=False): the grads
    are views of DDP's buckets, which torch's zero_grad zeroes without detaching in place."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    ddp = DDP(model, gradient_as_bucket_view=True)
    for x, y in data(3, 4 * world):
        per = x.shape[0] // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_zero_grad_in_place_on_ddp_bucket_views_trains_as_set_to_none(level):
    in_place = run_ranks(_zeroed_in_place, 2, level, False)
    to_none = run_ranks(_zeroed_in_place, 2, level, True)
    for name, value in to_none[0].items():
        assert torch.equal(in_place[0][name], value), name
        assert torch.equal(in_place[1][name], value), name
