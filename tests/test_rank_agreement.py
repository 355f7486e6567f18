"""Ranks configured differently fail fast at wrap, on every rank, naming the difference — no hang."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from asserts import backward, step_error
from dist_harness import run_ranks
from models import mlp

import distamp


def _wrap(rank, world, per_rank):
    level, hidden = per_rank[rank]
    model = mlp(hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        distamp.wrap(model, opt, opt_level=level)
    except ValueError as err:
        return str(err), model[0].weight.dtype
    return None, model[0].weight.dtype


def test_different_opt_levels_are_named_on_every_rank():
    results = run_ranks(_wrap, 2, {0: ("O2", 16), 1: ("O1", 16)}, timeout=60)
    for message, dtype in results:
        assert message is not None
        assert "rank 0 has property opt_level='O2'" in message
        assert "rank 1 has property opt_level='O1'" in message
        assert dtype == torch.float32  # nothing was cast: the error came before any change


def test_different_parameter_shapes_are_named():
    results = run_ranks(_wrap, 3, {0: ("O2", 16), 1: ("O2", 16), 2: ("O2", 12)}, timeout=60)
    for message, _ in results:
        assert message is not None
        assert "rank 2 has models[0] parameter '0.weight'=(12, 8)" in message


def test_agreeing_ranks_wrap_normally():
    results = run_ranks(_wrap, 2, {0: ("O2", 16), 1: ("O2", 16)}, timeout=60)
    assert results == [(None, torch.bfloat16), (None, torch.bfloat16)]


def _one_rank_fails_locally(rank, world, api, problem):
    """Rank 1 alone hands over something a local check (or the ranks' agreement) refuses."""
    import distamp.fsdp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1 and problem == "half parameter":
        model[0].bfloat16()
    if rank == 1 and problem == "stray parameter":
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    if rank == 1 and problem == "extra layer":
        model.append(torch.nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1 and problem == "frozen bias":
        model[0].bias.requires_grad_(False)
    if rank == 1 and problem == "meta model":
        model = mlp()
        model[0].to("meta")  # partly: distamp.fsdp takes a model wholly on the meta device
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {}
    if problem == "loss scaler":  # rank 1 starts at another scale
        kwargs["loss_scale"] = distamp.LossScaler(init_scale=1024.0 * (rank + 1))
    if problem == "numpy scaler":  # the same settings as other kinds of number: no difference
        growth = np.float32(2.0) if rank == 0 else torch.tensor(2)
        kwargs["loss_scale"] = distamp.LossScaler(init_scale=1024, growth_factor=growth)
    try:
        if api == "wrap":
            distamp.wrap(model, opt, opt_level="O2", verbosity=0, **kwargs)
        else:
            distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0, **kwargs)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("api", ["wrap", "fsdp"])
@pytest.mark.parametrize("problem", ["half parameter", "stray parameter", "meta model"])
def test_a_check_failing_on_one_rank_only_raises_on_every_rank(api, problem):
    """The failing rank raised while the other waited in the next collective until the process
    group's timeout (30 minutes; an audit killed both at 45 s): now both raise at once, the other
    rank naming the failing one and its message."""
    own, other = run_ranks(_one_rank_fails_locally, 2, api, problem, timeout=90)[::-1]
    expected = {
        "half parameter": "has dtype torch.bfloat16, expected torch.float32",
        "stray parameter": "is not a parameter of the model",
        "meta model": "is on the meta device"
        + (", expected real FP32 weights" if api == "wrap" else " and others are not"),
    }[problem]
    assert own is not None and expected in own
    assert other is not None and "failed on another rank — rank 1: ValueError" in other
    assert expected in other


def _wrap_in_order(rank, world, reverse_on):
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params[::-1] if rank in reverse_on else params, lr=0.1)
    try:
        distamp.wrap(model, opt, opt_level="O2", verbosity=0)  # sharded at 2 ranks
    except ValueError as err:
        return str(err)
    return None


def test_an_optimizer_listing_the_parameters_in_another_order_is_named():
    """Sharded masters lay the groups out flat in the optimizer's order: a rank listing the same
    parameters in another order owned other elements, and the ranks' weights drifted apart from
    the first step (an audit; nothing was raised, or later a misleading clipping error)."""
    for message in run_ranks(_wrap_in_order, 2, {1}, timeout=60):
        assert message is not None
        assert "optimizers[0] param_groups[0] parameter order" in message
        assert "'0:3.bias'" in message  # rank 1's list starts with the last parameter
    assert run_ranks(_wrap_in_order, 2, {0, 1}, timeout=60) == [None, None]


def _odd_state_on_rank_1(rank, world):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if rank == 1:  # a resume that loaded another rank's shard of the state, say
        opt.state[model[0].weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}
    try:
        distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    except ValueError as err:
        return str(err)
    return None


def test_optimizer_state_sharded_masters_cannot_cut_on_one_rank_raises_on_every_rank():
    """Rank 1 raised while rank 0's wrap returned and went on to its first collective (an audit
    of README's "raises on every rank")."""
    own, other = run_ranks(_odd_state_on_rank_1, 2, timeout=60)[::-1]
    assert own is not None and "optimizer state 'exp_avg'" in own and "shape (3,)" in own
    assert other is not None and "rank 1" in other


def _add_group_in_order(rank, world, reverse_on):
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params[:2], lr=0.1)
    distamp.wrap(model, opt, opt_level="O2", verbosity=0)  # sharded at 2 ranks
    later = params[2:]
    try:
        opt.add_param_group({"params": later[::-1] if rank in reverse_on else later})
    except ValueError as err:
        return str(err)
    return None


def test_add_param_group_in_another_order_on_one_rank_is_named():
    """Progressive unfreezing with list(set(...)): the new group laid out in another order on
    one rank, and the ranks stepped apart with no error (an audit)."""
    for message in run_ranks(_add_group_in_order, 2, {1}, timeout=60):
        assert message is not None and "new param group's parameter order" in message
    assert run_ranks(_add_group_in_order, 2, set(), timeout=60) == [None, None]


def _plateau_on_the_local_loss(rank, world, shard):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    for step in range(6):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        loss = F.mse_loss(ddp(x).float(), y)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        try:
            opt.step()
        except RuntimeError as err:
            return step, str(err)
        opt.zero_grad()
        sched.step(loss.item() if rank == 0 else 10.0 + step)  # rank 1's loss "plateaus"
    return None


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_settings_that_part_between_ranks_are_refused_on_every_rank(shard):
    """ReduceLROnPlateau stepped with each rank's own loss gave each rank its own lr: replicated
    weights drifted apart, sharded ones were stepped at two lrs — silently (an audit)."""
    results = run_ranks(_plateau_on_the_local_loss, 2, shard, timeout=90)
    assert results[0] is not None and results[0][0] == results[1][0], results
    for _, message in results:
        assert "settings (lr, betas" in message and "to be the same on every rank" in message
        # which setting, and every rank's value of it (an audit had to diff the ranks' logs)
        assert "param_groups[0]['lr'] (rank 0: 0.01, rank 1: 0.005)" in message, message


def _scale_loaded_on_rank_0(rank, world, level):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distamp import amp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.float16)
    ddp = DDP(model)
    if rank == 0:  # "load the checkpoint on rank 0", the scaler's state only
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 0}})
    weights = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with amp.scale_loss(ddp(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    error = step_error(opt)
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    return error, unchanged, distamp.stats(opt).loss_scales[0]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_loss_scales_that_differ_between_ranks_are_refused_on_every_rank(level):
    """amp.load_state_dict on rank 0 only: DDP averaged gradients scaled by 256 and 65536, each
    rank unscaled by its own, and at O1 the replicas parted silently (an audit)."""
    for rank, (error, unchanged, scale) in enumerate(
        run_ranks(_scale_loaded_on_rank_0, 3, level, timeout=90)
    ):
        assert error is not None, rank
        assert "expected every rank's loss scale" in error, error
        assert "loss 0's scale: rank 0 256, rank 1 65536, rank 2 65536" in error, error
        assert "on some ranks only" in error
        assert unchanged and scale == (256.0 if rank == 0 else 65536.0)


def _ddp_before_wrap(rank, world, level):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddp = DDP(model)  # an existing script's DDP line, with wrap added after it
    model, opt = distamp.wrap(model, opt, opt_level=level, shard_master_weights=False, verbosity=0)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
    with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
        scaled.backward()
    return step_error(opt)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_ddp_built_before_wrap_is_refused_with_replicated_weights(level):
    """O2/O3 cast the weights in place, so DDP's gradient hooks (on the FP32 weights) never
    fired: each rank stepped its own gradients and the replicas drifted apart (4.4e-2 after 3
    steps), silently (an audit). The skip decision's all-reduce compares a gradient sample."""
    for message in run_ranks(_ddp_before_wrap, 2, level, timeout=90):
        assert (
            message is not None and "DistributedDataParallel built before distamp.wrap" in message
        )
        assert "found them different (first: '0.weight')" in message, message


def _gradients_a_power_of_two_apart(rank, world, factor):
    """DDP built before wrap: each rank steps its own gradients, here rank 1's exactly
    ``factor`` times rank 0's (the same batch, the loss multiplied)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ddp = DDP(model)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=False, verbosity=0)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
    loss = F.mse_loss(ddp(x).float(), y) * (factor if rank == 1 else 1.0)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    return step_error(opt)


@pytest.mark.parametrize("factor", [2.0, -1.0, 0.5])
def test_gradients_that_differ_by_sign_or_a_power_of_two_are_told_apart(factor):
    """The hash multiplied the sign and exponent bits out modulo 2**23: gradients 2x or -1x
    another rank's hashed the same and the ranks parted silently (an audit)."""
    for message in run_ranks(_gradients_a_power_of_two_apart, 2, factor, timeout=90):
        assert message is not None and "found them different" in message, message


def _unused_under_default_ddp(rank, world, level, rs_hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    class WithSpare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(8, 2)
            self.spare = torch.nn.Linear(8, 2)  # forward never calls it

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = WithSpare()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level=level, shard_master_weights=True, verbosity=0)
    ddp = DDP(model)  # find_unused_parameters=False, torch's default
    if rs_hook:
        distamp.hooks.register(ddp, opt, reduce_scatter=True, gather_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
    with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
        scaled.backward()
    return step_error(opt)


@pytest.mark.parametrize(
    "level,rs_hook", [("O2", False), ("O0", True)], ids=["O2-sharded", "O0-reduce-scatter-hook"]
)
def test_a_parameter_forward_never_used_under_default_ddp_is_named_at_step(level, rs_hook):
    """Sharded masters compare the ranks' gradients at step(); DDP waiting for an unused
    parameter's gradient reduces none of the later buckets, and the message named a parameter
    forward did use, with causes that did not fit (an audit)."""
    for message in run_ranks(_unused_under_default_ddp, 2, level, rs_hook, timeout=90):
        assert message is not None and "'spare.weight', 'spare.bias'" in message, message
        assert "pass find_unused_parameters=True" in message, message
        # the other way to leave a used parameter without a gradient (an audit)
        assert "left out by backward(inputs=...)" in message, message


IGNORED = ["2.weight", "2.bias"]


def _batches(gen, world):
    return [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)) for _ in range(world)
    ]


def _ignored_reduced_by_hand(rank, world, level, kwargs):
    """DDP told to leave the head alone (the script reduces it itself, after unscale_)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kwargs)
    DDP._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batches = _batches(gen, world)
        x, y = batches[rank]
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        distamp.unscale_(opt)
        for name, param in model.named_parameters():
            if name in IGNORED:
                torch.distributed.all_reduce(param.grad)
                param.grad /= world
        opt.step()
        opt.zero_grad()
    return {k: v.float() for k, v in model.state_dict().items()}


def _fp32_reference(world):
    """One process, FP32, the ranks' batches together."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batches = _batches(gen, world)
        x, y = (torch.cat(t) for t in zip(*batches, strict=True))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize(
    "level,kwargs,tol",
    [
        ("O2", {"half_dtype": torch.float16}, 2e-3),
        ("O2", {"half_dtype": torch.float16, "shard_master_weights": False}, 2e-3),
        ("O3", {"half_dtype": torch.float16}, 1e-2),
        ("O0", {"shard_master_weights": True}, 1e-6),
    ],
    ids=["O2-sharded", "O2-replicated", "O3", "O0-sharded"],
)
@pytest.mark.parametrize("shard_block", [8], indirect=True)
def test_parameters_ddp_ignores_and_the_script_reduces_train_like_fp32(
    level, kwargs, tol, shard_block
):
    """Parameters named in DDP's ignore list hold each rank's own gradient until the script
    reduces them: distamp's check that the ranks' gradients agree refused every such script at
    O2/O3 and with sharded masters, on every rank, naming no parameter (an audit). Left out of
    the check, they train as one FP32 process over both ranks' batches (within ``tol``)."""
    expected = _fp32_reference(2)
    for weights in run_ranks(_ignored_reduced_by_hand, 2, level, kwargs, timeout=120):
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, atol=tol, rtol=0, msg=name)


@pytest.mark.parametrize("api", ["wrap", "fsdp"])
def test_a_parameter_one_rank_has_more_is_named_as_missing_on_the_other(api):
    """Compared by position, one extra layer paired rank 0's optimizer class with rank 1's new
    parameter ('rank 0 has optimizers[0] class=SGD, rank 1 has ... 'l3.weight''; an audit)."""
    for message in run_ranks(_one_rank_fails_locally, 2, api, "extra layer", timeout=60):
        assert message is not None
        assert "rank 1 has models[0] parameter '4.weight'=(4, 4)" in message
        assert "which rank 0 has not (and 1 more names on one rank only)" in message


@pytest.mark.parametrize("api", ["wrap", "fsdp"])
def test_a_parameter_frozen_on_one_rank_only_is_named(api):
    """Under FSDP the first backward aborted gloo ('Received data size doesn't match expected
    size', SIGABRT on one rank; an audit): the wrap-time agreement check did not read
    requires_grad."""
    for message in run_ranks(_one_rank_fails_locally, 2, api, "frozen bias", timeout=60):
        assert message is not None
        assert "rank 1 has models[0] parameter '0.bias'=(16,) torch.float32 frozen" in message


def _fsdp_enabled_on_rank_0_only(rank, world):
    import distamp.fsdp

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        distamp.fsdp.fully_shard(model, opt, opt_level="O2", enabled=rank == 0, verbosity=0)
    except ValueError as err:
        return str(err)
    return None


def test_fully_shard_enabled_on_some_ranks_only_is_named_on_every_rank():
    """``enabled=args.amp`` read per rank: FSDP sharded FP32 on one rank and half on the other,
    and its collectives aborted gloo (an audit)."""
    for message in run_ranks(_fsdp_enabled_on_rank_0_only, 2, timeout=60):
        assert message is not None and "found enabled=False on ranks [1]" in message, message


@pytest.mark.parametrize("api", ["wrap", "fsdp"])
def test_loss_scalers_set_apart_are_named_by_setting(api):
    """fully_shard compared no LossScaler setting: ranks starting at scales 1024 and 2048
    trained on, each unscaling the reduced gradients by its own (an audit); wrap compared them
    as one list of every setting, which the user had to diff. Numbers of other kinds (numpy's,
    a tensor) for the same values agree."""
    for message in run_ranks(_one_rank_fails_locally, 2, api, "loss scaler", timeout=60):
        assert message is not None
        assert "rank 0 has loss_scale=LossScaler(...) init_scale=1024.0" in message
        assert "rank 1 has loss_scale=LossScaler(...) init_scale=2048.0" in message
        assert "growth_factor" not in message  # only the setting that differs
    assert run_ranks(_one_rank_fails_locally, 2, api, "numpy scaler", timeout=60) == [None, None]


def _unscale_on_rank_0_only(rank, world, level, edit):
    """Rank 0 alone calls distamp.unscale_ (to log the unscaled norm: the master process's
    habit), then the same steps on every rank; with ``edit`` rank 0 makes a gradient NaN after
    its unscale_ at step 1. Returns the weights and the skipped flags per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    ddp = DDP(model)
    skipped = []
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        if rank == 0:
            distamp.unscale_(opt)
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
            if edit and step == 1:
                next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
        skipped.append(distamp.stats(opt).last_step_skipped)
    return [p.detach().float().clone() for p in model.parameters()], skipped


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_unscale_on_one_rank_only_trains_like_every_rank_stepping(level):
    """An audit: rank 0 alone calling distamp.unscale_ ran one more all-reduce at its step (the
    check of gradients edited after unscale_): O2's sharded ranks hung in different
    collectives, O1's aborted gloo. Every rank joins that check now; a NaN rank 0 wrote after
    its unscale_ skips the step on every rank."""
    for edit in (False, True):
        (w0, s0), (w1, s1) = run_ranks(_unscale_on_rank_0_only, 2, level, edit, timeout=90)
        assert s0 == s1 == [False, edit, False]
        for a, b in zip(w0, w1, strict=True):
            assert torch.equal(a, b)


def _loss_ids_per_rank(rank, world, level):
    """num_losses=2; at step 0 rank 1 passes loss_id=1 (its loss inf), rank 0 loss_id=0."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, num_losses=2, verbosity=0)
    loss = F.mse_loss(model(torch.randn(4, 8)).float(), torch.randn(4, 4))
    loss_id = rank
    with distamp.scale_loss(loss * (float("inf") if rank == 1 else 1.0), opt, loss_id=loss_id) as s:
        s.backward()
    return step_error(opt)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ranks_passing_different_loss_ids_are_named_on_every_rank(level):
    """An audit: rank 1's loss-1 block met rank 0's loss-0 block in one slot of the decision,
    each rank backed off another loss's scale, and the weights parted (0.052 after 3 steps)
    with no error (O1; O2 with sharded masters blamed clipping)."""
    for message in run_ranks(_loss_ids_per_rank, 2, level, timeout=90):
        assert message is not None and "same kinds of scale_loss blocks" in message, message
        assert "rank 0: loss_id 0 (optimizers [0]); rank 1: loss_id 1 (optimizers [0])" in message


def _verbose_on_rank_0(rank, world):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=1 if rank == 0 else 0)
    with distamp.scale_loss(model(torch.randn(4, 8)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    return distamp.stats(opt).steps


def test_verbosity_on_rank_0_only_is_not_a_disagreement():
    """An audit: `verbosity=1 if rank == 0 else 0` (log on the master process) was refused as
    ranks that disagree; it only gates this rank's own log lines."""
    assert run_ranks(_verbose_on_rank_0, 2, timeout=90) == [1, 1]


def _losses_in_another_order(rank, world):
    """num_losses=3 accumulated in one step, rank 0 in the order 0, 1, 2 and rank 1 in 2, 1, 0;
    loss 2 is inf on rank 1."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", num_losses=3, verbosity=0)
    for loss_id in [0, 1, 2] if rank == 0 else [2, 1, 0]:
        loss = F.mse_loss(model(torch.randn(4, 8)).float(), torch.randn(4, 4))
        bad = rank == 1 and loss_id == 2
        with distamp.scale_loss(loss * (float("inf") if bad else 1.0), opt, loss_id=loss_id) as s:
            s.backward()
    opt.step()
    stats = distamp.stats(opt)
    return stats.last_step_skipped, stats.loss_scales


def test_ranks_accumulating_the_same_losses_in_another_order_agree():
    """An audit: the check of the ranks' blocks read their order of first use, and refused
    ranks that ran the same losses in another order. The kinds are sorted now: every rank skips
    and backs off loss 2's scale alone."""
    for skipped, scales in run_ranks(_losses_in_another_order, 2, timeout=90):
        assert skipped and scales == (65536.0, 65536.0, 32768.0)


def _unscale_the_second_optimizer_on_rank_0(rank, world):
    torch.manual_seed(0)
    first, second = mlp(), mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    models, opts = distamp.wrap([first, second], opts, opt_level="O1", verbosity=0)
    loss = sum(F.mse_loss(m(torch.randn(4, 8)).float(), torch.randn(4, 4)) for m in models)
    with distamp.scale_loss(loss, opts) as scaled:
        scaled.backward()
    try:
        if rank == 0:
            distamp.unscale_(opts[1])
        opts[0].step()
        opts[1].step()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_unscale_of_another_optimizer_on_one_rank_only_is_named_on_every_rank():
    """An audit: rank 0 deciding optimizer 1 in unscale_ while rank 1 decided optimizer 0 in its
    step paired different decisions in one all-reduce; the ranks were told their schedulers or
    loss_ids differed (a hang before the early-check fix)."""
    for message in run_ranks(_unscale_the_second_optimizer_on_rank_0, 2, timeout=90):
        assert message is not None and "the skip decision of the same optimizer" in message
        assert "found optimizers 0 to 1 deciding at once" in message


def _added_apart(rank, world, level, kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[1].requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kwargs)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    model[1].requires_grad_(True)
    head = model[1].weight if rank == 0 else model[1].bias  # each rank its own choice
    opt.add_param_group({"params": [head]})
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # rebuilt after unfreezing
    backward(ddp(torch.randn(4, 8)).float().square().mean(), opt)
    return step_error(opt)


@pytest.mark.parametrize(
    "level,kwargs", [("O0", {}), ("O1", {}), ("O2", {"shard_master_weights": False})]
)
def test_ranks_adding_different_parameters_are_refused_at_the_step(level, kwargs):
    """Rank 0 added the head's weight, rank 1 its bias: at O0/O1 (no masters) each rank stepped
    its own parameters and the replicas parted, silently (an audit; sharded masters refused it
    at add_param_group, O2's replicated masters by the gradients they compare)."""
    for message in run_ranks(_added_apart, 2, level, kwargs, timeout=120):
        assert message is not None, level
        assert "params held (count, elements, shapes hash)" in message, message
        assert "add_param_group called with other parameters" in message, message


def _tensor_parallel(rank, world, api):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import distamp.fsdp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    parallelize_module(
        model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = model[0].weight.to_local().clone()
    try:
        if api == "wrap":
            distamp.wrap(model, opt, opt_level="O1")
        else:
            distamp.fsdp.fully_shard(model, opt, opt_level="O1")
    except ValueError as err:
        return str(err), torch.equal(model[0].weight.to_local(), local)
    return None, True


@pytest.mark.parametrize("api", ["wrap", "fully_shard"])
def test_tensor_parallel_parameters_are_refused_by_name_on_every_rank(api):
    """parallelize_module's DTensor parameters crashed inside torch's DTensor dispatch (wrap's
    broadcast, fully_shard's fingerprint); past that, the skip decision and the clip norm
    covered the data-parallel ranks only (an audit)."""
    for message, untouched in run_ranks(_tensor_parallel, 2, api, timeout=90):
        assert message is not None and untouched
        assert "parameter '0.weight' is a DTensor" in message, message
        assert "tensor parallelism (parallelize_module) is not supported" in message
        assert "distamp.GradScaler" in message
