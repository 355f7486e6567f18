"""Ranks start from rank 0's weights, as with DDP: a script that seeds every rank differently before
building its model (nanoGPT: ``torch.manual_seed(1337 + rank)``) trains exactly the model that the
same script with one seed trains (see [Note: rank 0's weights are everyone's])."""

import pytest
import torch
from dist_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP
from user_models import GPTConfig, NanoGPT

import distamp
from distamp import amp

CASES = {
    "O1": dict(opt_level="O1"),
    "O2-replicated": dict(opt_level="O2", shard_master_weights=False),
    "O2-sharded": dict(opt_level="O2", shard_master_weights=True),
    "amp.initialize-O2": dict(opt_level="O2", api="amp"),
}


def _train(rank, world, case, per_rank_seed):
    kw = dict(CASES[case])
    api = kw.pop("api", "wrap")
    torch.manual_seed(1337 + rank if per_rank_seed else 1337)
    model = NanoGPT(GPTConfig())
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95))
    if api == "amp":
        model, opt = amp.initialize(model, opt, verbosity=0, **kw)
    else:
        model, opt = distamp.wrap(model, opt, verbosity=0, **kw)
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        idx = torch.randint(0, 61, (2, 16), generator=gen)
        _, loss = ddp(idx, idx)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _train_all(rank, world, per_rank_seed):
    return {case: _train(rank, world, case, per_rank_seed) for case in CASES}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_train_all, 2, True, timeout=240), run_ranks(_train_all, 2, False)


pytestmark = pytest.mark.xdist_group("rank0_weights")


@pytest.mark.parametrize("case", list(CASES))
def test_per_rank_seeds_train_the_same_model_as_one_seed(runs, case):
    seeded_per_rank, one_seed = runs
    for rank in range(2):
        for p, q in zip(seeded_per_rank[rank][case], one_seed[0][case], strict=True):
            assert torch.equal(p, q)


def _broadcast(rank, world):
    from distamp.collectives import broadcast_from_rank0_

    tensors = [
        torch.full((3,), float(rank)),
        torch.full((2, 2), rank, dtype=torch.int64),
        torch.full((5,), float(rank), dtype=torch.bfloat16),
    ]
    broadcast_from_rank0_(tensors, torch.distributed.group.WORLD)
    return tensors


def test_broadcast_from_rank0_covers_every_dtype():
    for tensors in run_ranks(_broadcast, 3):
        assert all(bool((t == 0).all()) for t in tensors)
        assert [t.dtype for t in tensors] == [torch.float32, torch.int64, torch.bfloat16]
