"""DDP's uneven inputs: distamp's optimizer.step() is a collective (the skip decision; with
sharded masters the all-gather of the updated weights), which DDP's ``join()`` does not shadow
for a rank that ran out of batches. ``ddp.join(throw_on_early_termination=True)`` (torch's
option) stops every rank together at the first step one rank lacks: no hang, the ranks' weights
and distamp's step counts identical, and the caught error is torch's."""

import pytest
import torch
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

pytestmark = pytest.mark.xdist_group("multirank")


def _uneven(rank, world, level, hook):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    ddp = DDP(model)
    if hook == "reduce-scatter":
        distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    elif hook == "all-reduce":
        distamp.hooks.register(ddp, opt)
    gen = torch.Generator().manual_seed(rank)
    batches = 5 if rank == 0 else 3  # rank 0 has two batches more
    stopped = ""
    try:
        with ddp.join(throw_on_early_termination=True):
            for _ in range(batches):
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                loss = nn.functional.mse_loss(ddp(x).float(), y)
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as exc:
        stopped = str(exc)
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}  # waits for a gather
    return stopped, distamp.stats(opt).steps, weights


@pytest.mark.parametrize(
    "level,hook", [("O2", "reduce-scatter"), ("O2", None), ("O1", "all-reduce")]
)
def test_join_with_throw_on_early_termination_stops_every_rank_at_the_same_step(level, hook):
    (stop0, steps0, w0), (stop1, steps1, w1) = run_ranks(_uneven, 2, level, hook, timeout=120)
    assert "exhausted" in stop0 and "exhausted" in stop1, (stop0, stop1)
    assert steps0 == steps1 == 3
    for name, value in w0.items():
        assert torch.equal(value, w1[name]), name
