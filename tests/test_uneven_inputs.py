"""DDP's uneven inputs: distamp's optimizer.step() is a collective (the skip decision; with
sharded masters the all-gather of the updated weights), which DDP's ``join()`` does not shadow
for a rank that ran out of batches. ``ddp.join(throw_on_early_termination=True)`` (torch's
option) stops every rank together at the first step one rank lacks: no hang, the ranks' weights
and distamp's step counts identical, and the caught error is torch's."""

import contextlib

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


def _join_with_zero_or_uneven_window(rank, world, case):
    """Nothing discarded, yet the ranks ran different numbers of blocks before a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    if case == "zero-join":
        # torch's Join([ddp, ZeroRedundancyOptimizer]) steps the optimizer on the rank that ran
        # out of batches (its join hook), with no backward there
        from torch.distributed.algorithms.join import Join
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        model, opt = distamp.wrap(model, opt, opt_level="O1", verbosity=0)
        ddp = DDP(model)
        context = Join([ddp, opt])
        windows = [1] * (3 if rank == 0 else 2)
    else:  # rank 0 accumulates 3 micro-batches per step, rank 1 two
        model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
        ddp = DDP(model)
        context = contextlib.nullcontext()
        windows = [3 if rank == 0 else 2]
    gen = torch.Generator().manual_seed(rank)
    try:
        with context:
            for window in windows:
                for micro in range(window):
                    last = micro == window - 1  # DDP syncs the last backward of the window
                    with contextlib.nullcontext() if last else ddp.no_sync():
                        loss = ddp(torch.randn(4, 8, generator=gen)).float().square().mean()
                        with distamp.scale_loss(loss, opt) as scaled:
                            scaled.backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("case", ["zero-join", "uneven-window"])
def test_ranks_with_different_block_counts_are_told_the_cause_that_fits(case):
    """Both used to be told "a rank that discards a batch" (an audit); the refusal itself is
    right (the decision pairs the ranks' blocks one by one), the explanation now fits."""
    for message in run_ranks(_join_with_zero_or_uneven_window, 2, case, timeout=120):
        assert message is not None and "same number of scale_loss blocks" in message
        if case == "zero-join":
            assert "found 1 on rank 0, 0 on rank 1" in message, message  # (each rank's)
            assert "uneven inputs" in message and "throw_on_early_termination" in message
        else:
            assert "found 3 on rank 0, 2 on rank 1" in message, message
            assert "Uneven accumulation windows" in message


def _a_rank_without_a_batch(rank, world, set_to_none):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    # No DDP (its all-reduce would wait for rank 1's backward): the same batch on both ranks
    # keeps their gradients equal, as the skip decision checks
    x = torch.randn(3, 4)
    for it in range(2):
        if not (it == 1 and rank == 1):  # rank 1 has no batch in the second iteration
            with distamp.scale_loss(model(x).float().sum(), opt) as scaled:
                scaled.backward()
        try:
            opt.step()
        except RuntimeError as exc:
            return it, str(exc)
        opt.zero_grad(set_to_none=set_to_none)
    return None


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_rank_without_a_batch_raises_with_the_others(set_to_none):
    """With the gradients zeroed in place (set_to_none=False) the rank without a batch found
    the last step's gradients and raised alone; the other waited in the skip decision until the
    timeout (an audit). Either way every rank raises at once, naming the counts."""
    for result in run_ranks(_a_rank_without_a_batch, 2, set_to_none, timeout=120):
        assert result is not None and result[0] == 1, result
        assert "same number of scale_loss blocks" in result[1], result[1]
