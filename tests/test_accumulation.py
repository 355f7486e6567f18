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
