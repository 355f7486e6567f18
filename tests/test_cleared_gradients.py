"""Gradients cleared outside ``optimizer.zero_grad()`` drop the pending ``scale_loss`` blocks.

Scripts discard a batch (a NaN loss, a gradient-norm spike) by clearing the gradients the way
they clear them every iteration: ``model.zero_grad()`` (apex's DCGAN, Hugging Face's Trainer) or
``p.grad = None``. The run must then equal one that never saw that batch, as it does with
``optimizer.zero_grad()`` and with torch.amp's GradScaler: no skipped step and no halved scale
afterwards, no refusal at the next ``scale_loss``. Single process and 2 gloo ranks (sharded
masters, distamp's reduce-scatter hook).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from asserts import step_error
from dist_harness import run_ranks
from models import mlp
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

BAD = 2  # the batch that is discarded


def _clear(how, model, opt):
    if how == "optimizer":
        opt.zero_grad()
    elif how == "model":
        model.zero_grad()
    else:
        for p in model.parameters():
            p.grad = None


def _batches(n, rows):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(n)
    ]


def _run(model, opt, forward, how, discard, spike, rank=0, per_rank=4):
    """Train 6 batches; batch BAD is discarded (a NaN loss, or a spike seen after unscale_)."""
    log = []
    for i, (x, y) in enumerate(_batches(6, per_rank * 2)):
        x = x[rank * per_rank : (rank + 1) * per_rank]
        y = y[rank * per_rank : (rank + 1) * per_rank]
        if i == BAD and discard is None:
            continue
        if i == BAD and discard in ("nan", "nan after unscale_"):
            x = x * float("nan")
        _clear(how, model, opt)
        loss = F.mse_loss(forward(x).float(), y)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if i == BAD and spike:
            distamp.unscale_(opt)  # looked at the norm, then threw the batch away
        if i == BAD:
            _clear(how, model, opt)
            continue
        opt.step()
        s = distamp.stats(opt)
        log.append((s.last_step_skipped, s.loss_scales[0]))
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]), log


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("how", ["optimizer", "model", "none"])
@pytest.mark.parametrize("discard", ["nan", "spike", "nan after unscale_"])
def test_discarded_batch_equals_a_run_without_it(level, how, discard):
    def train(how, discard):
        torch.manual_seed(0)
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
        return _run(model, opt, model, how, discard, discard != "nan")

    reference, ref_log = train("optimizer", None)  # never saw the batch
    weights, log = train(how, discard)
    assert log == ref_log
    assert all(not skipped and scale == 2.0**16 for skipped, scale in log)
    assert torch.equal(weights, reference)


def test_cleared_gradients_then_step_says_no_gradients():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    x, y = _batches(1, 4)[0]
    with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    model.zero_grad()
    with pytest.raises(RuntimeError, match="no gradients were produced since the last step"):
        opt.step()


def _ranks(rank, world, how, discard):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)  # sharded at 2 ranks
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt, reduce_scatter=True)
    weights, log = _run(model, opt, ddp, how, discard, False, rank=rank)
    return weights, log, distamp.stats(opt).master_bytes


@pytest.mark.xdist_group("multirank")
def test_discard_on_every_rank_with_sharded_masters_and_the_reduce_scatter_hook():
    reference = run_ranks(_ranks, 2, "optimizer", None)
    for how in ("model", "none"):
        results = run_ranks(_ranks, 2, how, "nan")
        for (weights, log, sharded_bytes), (ref_weights, ref_log, _) in zip(
            results, reference, strict=True
        ):
            assert log == ref_log and not any(skipped for skipped, _ in log)
            assert torch.equal(weights, ref_weights)
            assert sharded_bytes < sum(p.numel() * 4 for p in mlp().parameters())


def test_an_optimizer_whose_parameters_got_no_gradient_this_iteration_steps_as_a_no_op():
    """apex's multi-optimizer pattern with an auxiliary head used every other iteration: its
    optimizer has no gradient then, which is not a clearing (a regression found by an audit)."""
    body, head = mlp(), torch.nn.Linear(4, 4)
    o_body = torch.optim.SGD(body.parameters(), lr=0.1)
    o_head = torch.optim.SGD(head.parameters(), lr=0.1)
    [body, head], [o_body, o_head] = distamp.wrap(
        [body, head], [o_body, o_head], opt_level="O2", verbosity=0
    )
    before = [p.detach().clone() for p in head.parameters()]
    for i, (x, y) in enumerate(_batches(4, 4)):
        out = body(x).float()
        if i % 2:
            out = head(out).float()
        with distamp.scale_loss(F.mse_loss(out, y), [o_body, o_head]) as scaled:
            scaled.backward()
        if i == 0:
            assert float(distamp.clip_grad_norm_(o_head, 1.0)) == 0.0
        o_body.step()
        o_head.step()
        o_body.zero_grad()
        o_head.zero_grad()
    assert not all(torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))
    assert distamp.stats(o_head).skipped_steps == 0


def _discard_on_one_rank(rank, world, only_block):
    """Rank 0 throws a micro-batch away (and still has another), or rank 1 its only batch."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model)
    (x, y), (x2, y2) = _batches(2, 4)
    with ddp.no_sync() if not only_block else contextlib.nullcontext():
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
    if only_block and rank == 1:
        opt.zero_grad()  # this rank alone throws its only batch away (a NaN loss, say)
    if not only_block:
        if rank == 0:
            model.zero_grad()  # this rank alone throws the micro-batch away
        with distamp.scale_loss(F.mse_loss(ddp(x2).float(), y2), opt) as scaled:
            scaled.backward()
    return step_error(opt)


@pytest.mark.parametrize(
    ("only_block", "counts"),
    [(False, "found 1 on rank 0, 2 on rank 1."), (True, "found 1 on rank 0, 0 on rank 1.")],
)
def test_a_discard_on_one_rank_only_raises_on_every_rank_instead_of_hanging(only_block, counts):
    """The skip decision's all-reduce carried one flag per block: ranks with different block
    counts sent vectors of different lengths and gloo hung or aborted (an audit). A rank that
    discarded its only block found no gradients and raised alone, before the decision: the
    other waited in its all-reduce until the group's timeout (an audit). All raise now, at once."""
    for message in run_ranks(_discard_on_one_rank, 2, only_block, timeout=90):
        assert message is not None
        assert "same number of scale_loss blocks" in message and counts in message


def _discard_when_the_norm_is_not_finite(rank, world, level):
    """apex/nanoGPT's habit: skip the step yourself when the clipped norm is not finite. The
    loss is scaled up so that its scaled fp16 gradients overflow at the first loss scales (one
    rank's more than the other's), not at lower ones."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    model, opt = distamp.wrap(model, opt, opt_level=level, half_dtype=torch.float16, verbosity=0)
    forward = DDP(model) if world > 1 else model
    log = []
    for x, y in _batches(10, 4 * world):
        x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
        loss = F.mse_loss(forward(x).float(), y) * (400.0 if rank == world - 1 else 40.0)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        distamp.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        discard = not torch.isfinite(norm)
        if not discard:
            opt.step()
        opt.zero_grad()
        log.append((discard, distamp.stats(opt).loss_scales[0]))
    return log


@pytest.mark.parametrize("world", [1, 2])
def test_batches_discarded_for_overflow_back_the_scale_off(world):
    """The scale stayed at 2**16 and every batch was discarded, forever, silently (an audit):
    a discard whose loss was finite backs off as a skipped step would, on every rank alike,
    until the batches fit, and then training steps."""
    results = run_ranks(_discard_when_the_norm_is_not_finite, world, "O2", timeout=120)
    log = results[0]
    assert log[0][0] and not all(d for d, _ in log), log  # discards first, then steps
    # each discard halves the scale (as a skipped step would), each step keeps it
    discards = [sum(d for d, _ in log[: i + 1]) for i in range(len(log))]
    assert [s for _, s in log] == [2.0 ** (16 - n) for n in discards], log
    assert all(r == log for r in results), results


def test_discarding_overflowing_batches_forever_raises_naming_it():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O1", max_consecutive_skips=3, verbosity=0)
    with pytest.raises(distamp.NonFiniteGradientError, match=r"3 consecutive batches were disc"):
        for x, y in _batches(6, 4):
            with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
            model[0].weight.grad[0, 0] = float("inf")  # a backward that makes an inf
            distamp.unscale_(opt)
            opt.zero_grad()


def _two_models_of_one_loss(**kwargs):
    """Two models wrapped together, an optimizer each; every block is loss 0."""
    torch.manual_seed(0)
    a, b = mlp(), mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    return distamp.wrap([a, b], opts, opt_level="O1", verbosity=0, **kwargs)


def _blocks_of_both(a, b, oa, ob, x, y, overflow):
    """One block per optimizer; the models in ``overflow`` get an inf gradient and their
    optimizer unscaled (the skip decided), the others stay undecided."""
    for model, opt in ((a, oa), (b, ob)):
        with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        if any(model is m for m in overflow):
            model[0].weight.grad[0, 0] = float("inf")
            distamp.unscale_(opt)


@pytest.mark.parametrize("second", ["discards", "steps"])
def test_a_discard_by_two_optimizers_of_one_loss_backs_off_once(second):
    """Two models, two optimizers, each its own block of loss 0, both overflowing: discarding
    both (or one, the other stepping) halved the scale twice per batch, and the limit came at
    half of max_consecutive_skips (an audit)."""
    (a, b), (o1, o2) = _two_models_of_one_loss()
    scales = []
    for x, y in _batches(3, 4):
        _blocks_of_both(a, b, o1, o2, x, y, overflow=[a, b])
        o1.zero_grad()
        if second == "discards":
            o2.zero_grad()
        else:
            o2.step()
            o2.zero_grad()
        scales.append(distamp.stats(o1).loss_scales[0])
    assert scales == [2.0**15, 2.0**14, 2.0**13]


@pytest.mark.parametrize("b_does", ["steps clean", "discards undecided"])
def test_discards_of_one_optimizer_among_two_count_towards_the_limit(b_does):
    """One loss, two optimizers. A's batches overflow and are discarded every iteration; B
    steps clean (the carried backoff was never checked against max_consecutive_skips: the
    scale sank until B's gradients were 0), or is discarded too without being unscaled (the
    carried backoff was left pending: the scale never moved). Both raise at the limit now,
    each iteration backing off once."""
    (a, b), (oa, ob) = _two_models_of_one_loss(max_consecutive_skips=4)
    scales = []
    with pytest.raises(distamp.NonFiniteGradientError, match=r"4 consecutive batches"):
        for x, y in _batches(8, 4):
            _blocks_of_both(a, b, oa, ob, x, y, overflow=[a])
            oa.zero_grad()
            if b_does == "steps clean":
                ob.step()
            ob.zero_grad()
            scales.append(distamp.stats(oa).loss_scales[0])
    assert scales == [2.0**15, 2.0**14, 2.0**13], scales
