"""Expert parallelism: a parameter per rank (an expert) that DDP is told to ignore, beside
layers DDP replicates (an audit's findings: wrap gave every rank rank 0's expert, and sharded
masters stitched the ranks' experts into one)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from asserts import backward
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

EXPERT = ["expert.weight", "expert.bias"]


class Moe(nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        torch.manual_seed(100 + rank)  # each rank its own expert
        self.expert = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.expert(torch.relu(self.shared(x)))))


def _train(rank, world, level, kwargs, amp):
    model = Moe(rank)
    own = [model.expert.weight.detach().clone(), model.expert.bias.detach().clone()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, EXPERT)  # before wrap
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if amp:
        model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kwargs)
    after_wrap = [p.detach().float().clone() for p in (model.expert.weight, model.expert.bias)]
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        backward(F.mse_loss(ddp(x).float(), y), opt if amp else None)
        opt.step()
        opt.zero_grad()
    final = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    return own, after_wrap, final


@pytest.mark.parametrize(
    "level,kwargs,tol",
    [("O0", {}, 1e-6), ("O1", {}, 3e-2), ("O2", {"shard_master_weights": False}, 3e-2)],
    ids=["O0", "O1", "O2-replicated"],
)
def test_each_rank_keeps_its_own_expert_and_trains_it_as_plain_ddp(level, kwargs, tol):
    """wrap's broadcast of rank 0's weights left out nothing: rank 1 trained rank 0's expert
    (off by the two initial experts' gap, silently). Now the ignore list is kept out, as DDP
    keeps it out of its own broadcast: each rank trains its own, as plain FP32 DDP (``tol``)."""
    plain = run_ranks(_train, 2, level, kwargs, False, timeout=120)
    wrapped = run_ranks(_train, 2, level, kwargs, True, timeout=120)
    assert not torch.equal(plain[0][0][0], plain[1][0][0])  # the experts differ
    for rank in range(2):
        own, after_wrap, final = wrapped[rank]
        for a, b in zip(own, after_wrap, strict=True):
            torch.testing.assert_close(b, a, atol=1e-2, rtol=0)  # (O2: rounded to bf16)
        for name, value in plain[rank][2].items():
            torch.testing.assert_close(final[name], value, atol=tol, rtol=0, msg=name)


def _sharded_refused(rank, world):
    model = Moe(rank)
    DDP._set_params_and_buffers_to_ignore_for_model(model, EXPERT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    except ValueError as exc:
        return str(exc), model.shared.weight.dtype
    return None, model.shared.weight.dtype


def test_sharded_masters_refuse_experts_that_differ_between_ranks():
    """Each rank stepped its shard of the one flat buffer with its own expert's gradient, and the
    gather stitched the experts into one, on every rank, silently (an audit). Refused on every
    rank, naming the expert, before anything changes."""
    for rank, (message, dtype) in enumerate(run_ranks(_sharded_refused, 2, timeout=60)):
        assert message is not None and f"'expert.weight' (other on ranks [{1 - rank}])" in message
        assert "shard_master_weights=False" in message
        assert dtype == torch.float32


def _ignored_late(rank, world):
    model = Moe(0)  # the same expert everywhere: the script reduces it itself
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    DDP._set_params_and_buffers_to_ignore_for_model(model, EXPERT)
    ddp = DDP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with distamp.scale_loss(ddp(torch.randn(4, 8)).float().sum(), opt) as scaled:
                scaled.backward()
            distamp.unscale_(opt)
            for name, param in model.named_parameters():
                if name in EXPERT:
                    torch.distributed.all_reduce(param.grad)
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "ignore list after distamp.wrap" in str(w.message)]


def test_an_ignore_list_set_after_wrap_is_warned_about_once():
    """Named after wrap, the expert had already been given rank 0's values: said once, on rank
    0, naming the parameters and the order that keeps each rank's own."""
    warned, others = run_ranks(_ignored_late, 2, timeout=60)
    assert len(warned) == 1 and "['expert.bias', 'expert.weight']" in warned[0]
    assert "name them to the list before wrap" in warned[0]
    assert others == []


def _lists_differ(rank, world):
    model = Moe(0)
    DDP._set_params_and_buffers_to_ignore_for_model(model, EXPERT if rank == 0 else [])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_with_different_ignore_lists_are_refused_not_hung():
    """The refusal above gathers by the ignore list's names: a rank listing none skipped the
    gather while the other waited in it (a review). Every rank raises, naming the list."""
    for message in run_ranks(_lists_differ, 2, timeout=60):
        assert message is not None and "the ranks disagree" in message
        assert "DDP's ignore list=['expert.bias', 'expert.weight']" in message, message


def _ignored_buffer_resume(rank, world, directory):
    def make(value):
        model = Moe(rank)
        model.register_buffer("rb", torch.full((3,), value))
        DDP._set_params_and_buffers_to_ignore_for_model(model, [*EXPERT, "rb"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = distamp.wrap(model, opt, opt_level="O1", verbosity=0)
        return model, opt, DDP(model)  # broadcasts buffers, but not the ignored one

    model, opt, ddp = make(float(rank))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with distamp.scale_loss(ddp(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    distamp.save_checkpoint(directory, ddp, opt)
    again, again_opt, again_ddp = make(-1.0)
    distamp.load_checkpoint(directory, again_ddp, again_opt)
    return again.rb.tolist(), torch.equal(again.expert.weight, model.expert.weight)


def test_each_ranks_ignored_buffer_and_expert_resume_as_its_own(tmp_path):
    """A buffer on DDP's ignore list stays each rank's own under a DDP that broadcasts the
    others: it was left out of the rank files, and came back as rank 0's (a review)."""
    out = run_ranks(_ignored_buffer_resume, 2, str(tmp_path / "c"), timeout=120)
    assert out == [([0.0] * 3, True), ([1.0] * 3, True)]


def _resume_into_sharded(rank, world, directory):
    model = Moe(rank)
    DDP._set_params_and_buffers_to_ignore_for_model(model, EXPERT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=False, verbosity=0)
    ddp = DDP(model)
    with distamp.scale_loss(ddp(torch.randn(4, 8)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    distamp.save_checkpoint(directory, ddp, opt)
    fresh = Moe(0)  # the same start on every rank: sharded masters take it
    DDP._set_params_and_buffers_to_ignore_for_model(fresh, EXPERT)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = distamp.wrap(fresh, fresh_opt, opt_level="O2", verbosity=0)
    try:
        distamp.load_checkpoint(directory, DDP(fresh), fresh_opt)
    except distamp.checkpoint.CheckpointError as exc:
        return str(exc)
    return None


def test_each_ranks_own_experts_are_not_loaded_into_sharded_masters(tmp_path):
    """Loaded into sharded masters, a rank's own expert landed in whichever rank's shard held
    it, from whichever rank's copy DCP wrote (a review: rank 0 got rank 1's, silently)."""
    for message in run_ranks(_resume_into_sharded, 2, str(tmp_path / "c"), timeout=120):
        assert message is not None and "each rank's own FP32 masters" in message, message
        assert "shard_master_weights=False" in message
