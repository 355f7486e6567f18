"""torch's optimizer step hooks under distamp: a post-hook (a user's EMA, a weight-norm logger)
reads the weights the step made, as with plain torch, on every path (see [Note: step hooks see
the new weights] in distamp/masters/rounds.py); a pre-hook reads the weights before it."""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import data, mlp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_post_hook

import distamp

CONFIGS = {
    "O1 (no masters)": dict(opt_level="O1"),
    "O2 replicated": dict(opt_level="O2"),
    "O2 sharded": dict(opt_level="O2", shard_master_weights=True),
    "O0 sharded FP32 weights": dict(opt_level="O0", shard_master_weights=True),
}


def _seen_by_hooks(rank, world, config):
    """Per step: (weights the pre-hook saw == the weights before step(), the post-hook's ==
    after step(), the global post-hook's == after step())."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, verbosity=0, **config)
    net = DDP(model) if world > 1 else model
    if world > 1:
        distamp.hooks.register(net, opt, reduce_scatter=config.get("shard_master_weights", False))
    seen: dict[str, list[torch.Tensor]] = {}

    def weights():
        return [p.detach().float().clone() for p in model.parameters()]

    opt.register_step_pre_hook(lambda *_: seen.__setitem__("pre", weights()))
    opt.register_step_post_hook(lambda *_: seen.__setitem__("post", weights()))

    def global_post(optimizer, *_):
        if optimizer is opt:
            seen["global"] = weights()

    handle = register_optimizer_step_post_hook(global_post)
    out = []
    try:
        for x, y in data(4, 8, seed=rank + 1):
            with distamp.scale_loss(F.mse_loss(net(x).float(), y), opt) as scaled:
                scaled.backward()
            before = weights()
            opt.step()
            after = weights()
            opt.zero_grad()
            moved = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
            out.append(
                (
                    moved,
                    all(map(torch.equal, seen["pre"], before)),
                    all(map(torch.equal, seen["post"], after)),
                    all(map(torch.equal, seen["global"], after)),
                )
            )
    finally:
        handle.remove()
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_post_hook_sees_the_stepped_weights_on_one_rank(name):
    """An audit: O2 and the sharded FP32 weights fired the post-hooks before the masters were
    copied into the model (an EMA kept in a post-hook lagged one step, 9.4e-3 off FP32's)."""
    for step, (moved, pre, post, glob) in enumerate(_seen_by_hooks(0, 1, CONFIGS[name])):
        assert moved, f"{name}: step {step} did not change the weights"
        assert pre, f"{name}: the pre-hook did not see the weights before step {step}"
        assert post, f"{name}: the post-hook saw other weights than step {step} left"
        assert glob, f"{name}: torch's global post-hook saw other weights than step {step} left"


def test_a_post_hook_sees_the_stepped_weights_across_ranks():
    """Two ranks, DDP with distamp's hooks: the model is small, so the sharded step is not the
    step in rounds (which ran the hooks in the right order already)."""
    for name in ("O2 replicated", "O2 sharded", "O0 sharded FP32 weights"):
        for rank, steps in enumerate(run_ranks(_seen_by_hooks, 2, CONFIGS[name])):
            for step, (moved, pre, post, glob) in enumerate(steps):
                assert moved and pre and post and glob, (name, rank, step, (pre, post, glob))


def test_a_step_pre_hook_that_raises_is_not_counted_as_a_step():
    """An audit: the update was not applied, yet stats().steps counted it."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    fail = [True]

    def pre(*_):
        if fail.pop():
            raise RuntimeError("a pre-hook failed")

    opt.register_step_pre_hook(pre)
    fail.insert(0, False)
    for _ in range(2):
        with distamp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        try:
            opt.step()
        except RuntimeError:
            pass
        opt.zero_grad()
    assert distamp.stats(opt).steps == 1


def _interrupted_run(level, after):
    """Two batches; the first step()'s pre-hook raises KeyboardInterrupt; then ``after``:
    "step" (step again), "zero_grad" (drop the batch), "backward" (the next batch's backward
    first). Returns (the weights after the second batch's step, a refusal or None, stats)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(2)]

    def backward(x):
        with distamp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()

    backward(batches[0])
    if after is not None:
        handle = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        handle.remove()
    refused = None
    if after in (None, "step"):
        opt.step()
        opt.zero_grad()
    elif after == "zero_grad":
        opt.zero_grad()
    elif after == "zero in place":  # the model's, in place: also drops the batch
        model.zero_grad(set_to_none=False)
    else:
        try:
            backward(batches[1])
        except RuntimeError as err:
            refused = str(err)
        opt.step()
        opt.zero_grad()
    backward(batches[1])
    opt.step()
    weights = [p.detach().float().clone() for p in model.parameters()]
    return weights, refused, distamp.stats(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_interrupted_step_keeps_its_decision(level):
    """A step pre-hook raising (a KeyboardInterrupt) after distamp had unscaled the FP32
    gradients in place reset the optimizer to READY: the next batch's scaled gradients were
    added to the unscaled ones and the step divided the sum by the scale again — the first
    batch was lost, silently (an audit: at O1, and O2's FP32 norm layers). Now step() again
    steps the first batch exactly as an uninterrupted step; zero_grad() drops it; a backward
    before either is refused, saying so."""
    clean, _, clean_stats = _interrupted_run(level, None)
    again, _, stats = _interrupted_run(level, "step")
    for a, b in zip(clean, again, strict=True):
        assert torch.equal(a, b)
    assert stats.steps == clean_stats.steps == 2
    dropped, _, _ = _interrupted_run(level, "zero_grad")
    assert not torch.equal(dropped[0], clean[0])
    # zeroed in place (was refused at every later block, an audit): the batch dropped as well
    zeroed, _, _ = _interrupted_run(level, "zero in place")
    for a, b in zip(dropped, zeroed, strict=True):
        assert torch.equal(a, b)
    stepped_after_refusal, refused, _ = _interrupted_run(level, "backward")
    assert refused is not None and "raised before it stepped" in refused, refused
    for a, b in zip(clean, stepped_after_refusal, strict=True):
        assert torch.equal(a, b)


def test_a_step_post_hook_that_raises_still_counts_the_step_it_follows():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    opt.register_step_post_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("post failed")))
    before = model.weight.detach().clone()
    with distamp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="post failed"):
        opt.step()
    assert not torch.equal(model.weight, before)
    assert distamp.stats(opt).steps == 1


def _interrupted_across_ranks(rank, world, config, interrupt):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, verbosity=0, **config)
    ddp = DDP(model)
    shard = config.get("shard_master_weights", False)
    state = distamp.hooks.register(ddp, opt, reduce_scatter=shard, overlap_gather=shard)
    for i, (x, y) in enumerate(data(3, 4, seed=10 + rank)):
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        if i == 1 and interrupt:  # every rank's pre-hook raises; each steps again
            handle = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError()))
            with pytest.raises(RuntimeError):
                opt.step()
            handle.remove()
        opt.step()
        opt.zero_grad()
    state.finish_gather()  # the last step's overlapped gather has landed
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["O2 sharded", "O0 sharded FP32 weights"])
def test_an_interrupted_step_stepped_again_is_the_uninterrupted_step_across_ranks(name):
    interrupted = run_ranks(_interrupted_across_ranks, 2, CONFIGS[name], True, timeout=120)
    clean = run_ranks(_interrupted_across_ranks, 2, CONFIGS[name], False, timeout=120)
    for rank in range(2):
        for a, b in zip(interrupted[rank], clean[rank], strict=True):
            assert torch.equal(a, b), name
