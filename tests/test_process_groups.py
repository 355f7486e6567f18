"""wrap(process_group=...) on subgroups: two data-parallel groups in one world of 4, strided as
tensor x data parallelism lays them out ({0, 2} and {1, 3}: a rank's place in its group is not
its global rank). Each group decides, scales, shards and checkpoints on its own."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from asserts import step_error
from dist_harness import run_ranks
from models import data, mlp
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

STEPS, PER_RANK, FAULT_STEP = 6, 4, 3


def reference(seed, skip_step):
    """FP32, one process, the group's whole batch; skips the step the group skipped."""
    model = mlp(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(data(STEPS, 2 * PER_RANK, seed=seed)):
        F.mse_loss(model(x), y).backward()
        if step != skip_step:
            opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def two_groups(rank, world, opt_level, hook, ckpt_root):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    group, seed = groups[rank % 2], 10 + rank % 2
    place = dist.get_rank(group)
    model = mlp(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # fp16 at O1/O2, so that the dynamic loss scale moves (bf16's is 1.0, static)
    kwargs = (
        {"shard_master_weights": True}
        if opt_level == "O0"
        else {"half_dtype": torch.float16, "loss_scale": distamp.LossScaler(init_scale=1024.0)}
    )
    model, opt = distamp.wrap(
        model, opt, opt_level=opt_level, verbosity=0, process_group=group, **kwargs
    )
    ddp = DDP(model, process_group=group)
    if hook:
        distamp.hooks.register(ddp, opt, reduce_scatter=hook == "rs", process_group=group)
    skipped, saved = [], None
    directory = os.path.join(ckpt_root, f"group{rank % 2}")
    for step, (x, y) in enumerate(data(STEPS, 2 * PER_RANK, seed=seed)):
        mine = slice(place * PER_RANK, (place + 1) * PER_RANK)
        loss = F.mse_loss(ddp(x[mine]), y[mine])
        if step == FAULT_STEP and rank == 2:  # one rank of one group only
            loss = loss * float("inf")
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        skipped.append(distamp.stats(opt).last_step_skipped)
        if step == 1:  # both groups save at once, each over its own group
            distamp.save_checkpoint(directory, model, opt)
            saved = [p.detach().float().clone() for p in model.parameters()]
    final = [p.detach().float().clone() for p in model.parameters()]
    scales = distamp.stats(opt).loss_scales
    distamp.load_checkpoint(directory, model, opt)
    reloaded = all(
        torch.equal(p.float(), s) for p, s in zip(model.parameters(), saved, strict=True)
    )
    return skipped, final, scales, reloaded


@pytest.mark.parametrize(
    ("opt_level", "hook", "tol"),
    [("O2", "rs", 1e-2), ("O1", "plain", 1e-2), ("O0", "rs", 1e-3)],
)
def test_two_strided_data_parallel_groups_train_skip_and_checkpoint_apart(
    tmp_path, opt_level, hook, tol
):
    """An inf on rank 2 skips that step in group {0, 2} only (its fp16 loss scale backs off,
    the other group's does not); each group matches its own FP32 reference (fp16 tolerance,
    a 16-bit wire for sharded O0); both groups save and load their own checkpoint at the same time."""
    results = run_ranks(two_groups, 4, opt_level, hook, str(tmp_path))
    for rank, (skipped, final, scales, reloaded) in enumerate(results):
        faulty = rank % 2 == 0
        assert skipped == [faulty and s == FAULT_STEP for s in range(STEPS)], (rank, skipped)
        if opt_level != "O0":
            assert scales == (512.0 if faulty else 1024.0,), (rank, scales)
        ref = reference(10 + rank % 2, FAULT_STEP if faulty else None)
        error = max((a - b).abs().max().item() for a, b in zip(final, ref, strict=True))
        assert error < tol, (rank, error)
        assert reloaded, rank
    for a, b in ((0, 2), (1, 3)):
        for p, q in zip(results[a][1], results[b][1], strict=True):
            assert torch.equal(p, q), (a, b)


def _disabled_groups(rank, world, how, ckpt_root):
    """``enabled=False`` (an --amp off switch) in two strided groups, each saving and loading
    its own checkpoint over its own group; then a model only rank 0 trains, saved by rank 0
    alone over a one-rank group."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    solo = dist.new_group([0])
    group, seed = groups[rank % 2], 10 + rank % 2
    model = mlp(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if how == "wrap":
        model, opt = distamp.wrap(model, opt, enabled=False, process_group=group)
        trained = DDP(model, process_group=group)
    else:
        trained, opt = distamp.fsdp.fully_shard(model, opt, enabled=False, process_group=group)
    ((x, y),) = data(1, 4, seed=seed + rank)
    F.mse_loss(trained(x), y).backward()
    opt.step()
    opt.zero_grad()
    directory = os.path.join(ckpt_root, f"group{rank % 2}")
    distamp.save_checkpoint(directory, trained, opt, extra={"group": rank % 2})
    saved = [p.detach().clone() for p in trained.parameters()]
    with torch.no_grad():
        for p in trained.parameters():
            p.zero_()
    extra = distamp.load_checkpoint(directory, trained, opt)
    reloaded = all(torch.equal(p, s) for p, s in zip(trained.parameters(), saved, strict=True))
    solo_saved = None
    if rank == 0:
        probe = mlp(seed=3)
        probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
        probe, probe_opt = distamp.wrap(probe, probe_opt, enabled=False, process_group=solo)
        distamp.save_checkpoint(os.path.join(ckpt_root, "solo"), probe, probe_opt)
        solo_saved = sorted(os.listdir(os.path.join(ckpt_root, "solo")))
    dist.barrier()
    return extra, reloaded, solo_saved


@pytest.mark.parametrize("how", ["wrap", "fully_shard"])
def test_checkpoints_of_a_disabled_wrap_run_over_its_process_group(tmp_path, how):
    """An audit: under enabled=False the checkpoint functions ran over the whole world: two
    groups saving apart crashed ("the folder rank 0 made failed"), and rank 0 saving a model
    only it trains waited for the other ranks until the timeout."""
    results = run_ranks(_disabled_groups, 4, how, str(tmp_path), timeout=150)
    for rank, (extra, reloaded, solo_saved) in enumerate(results):
        assert extra == {"group": rank % 2} and reloaded, (rank, extra)
        assert (solo_saved is not None) == (rank == 0)
    assert results[0][2], results[0][2]


def _ddp_over_own_subgroup(rank, world):
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    model = mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)  # sharded over WORLD
    ddp = DDP(model, process_group=own)
    try:
        distamp.hooks.register(ddp, opt)
    except ValueError as err:
        return str(err)
    return None


def test_register_refuses_a_ddp_that_reduces_over_fewer_ranks_than_the_shards():
    """wrap over the default group (masters sharded over both ranks), DDP over per-rank groups:
    each rank stepped its shard with its own unreduced gradients and the gather stitched the
    shards together — identical ranks, wrong training, no word (an audit)."""
    for rank, message in enumerate(run_ranks(_ddp_over_own_subgroup, 2, timeout=90)):
        assert message is not None
        assert "sharded over (ranks [0, 1]" in message and f"holding ranks [{rank}]" in message


def _wrapped_before_init(rank, world, init_file):
    """Wrap with no process group (a LightningModule's __init__), then the group comes up."""
    dist.destroy_process_group()
    model = mlp()
    model, opt = distamp.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0
    )
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x, y = data(1, 4)[0]
    out = {}
    for attempt in ("scale_loss", "step"):
        try:
            if attempt == "scale_loss":
                with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
            else:
                F.mse_loss(model(x).float(), y).backward()  # no scale_loss: straight to step()
                opt.step()
        except RuntimeError as err:
            out[attempt] = str(err)
        opt.zero_grad()
    return out


def test_wrap_before_init_process_group_raises_on_every_rank_at_the_first_backward(tmp_path):
    """Each rank decided its skips alone (a NaN on one rank: it skipped, the other stepped, the
    replicas drifted), silently (an audit). Every rank raises, at scale_loss and at step()."""
    for out in run_ranks(_wrapped_before_init, 2, str(tmp_path / "second-rendezvous")):
        for attempt in ("scale_loss", "step"):
            assert "expected distamp.wrap to be called after" in out[attempt], out
            assert "default group now has 2 ranks" in out[attempt]


def _ddp_on_subgroups_without_register(rank, world, opt_level):
    """wrap over the default group (FP32 weights or masters sharded over all 4 ranks), DDP over
    {0, 1} and {2, 3} with each pair's own data, no hooks.register (which refuses this)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = mlp()
    model, opt = distamp.wrap(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level=opt_level,
        shard_master_weights=True,
        verbosity=0,
    )
    ddp = DDP(model, process_group=pairs[rank // 2])
    x, y = data(1, 4, seed=rank // 2)[0]
    with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
        scaled.backward()
    return step_error(opt)


@pytest.mark.parametrize("opt_level", ["O0", "O2"])
def test_ddp_over_subgroups_of_the_sharded_group_is_refused_at_the_first_step(opt_level):
    """Each rank stepped its shard with its own pair's gradients and the gather stitched the
    shards together: every rank identical, the training a mix of both pairs', nothing said (an
    audit). The decision's all-reduce compares a sample of the gradients: every rank raises."""
    for message in run_ranks(_ddp_on_subgroups_without_register, 4, opt_level, timeout=180):
        assert message is not None and "expected the model's gradients identical" in message
        assert "ranks [0, 1, 2, 3]" in message and "another process group" in message


def _register_with_another_group_than_ddps(rank, world, opt_level, case="hook-group"):
    """Two replicas, over {0, 1} and {2, 3}: wrap and DDP on the pair, the hook given the world
    (``case="ddp-world"``: wrap on the pair, DDP over the world, the reduce-scatter hook)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    model = mlp()
    model, opt = distamp.wrap(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level=opt_level,
        process_group=pair,
        verbosity=0,
    )
    ddp = DDP(model, process_group=pair if case == "hook-group" else None)
    try:
        if case == "hook-group":
            distamp.hooks.register(ddp, opt, process_group=dist.group.WORLD)
        else:
            distamp.hooks.register(ddp, opt, reduce_scatter=True)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_hook_group_other_than_ddps_is_refused(opt_level):
    """The hook all-reduced over all 4 ranks: the two replicas' gradients averaged together,
    silently (an audit)."""
    results = run_ranks(_register_with_another_group_than_ddps, 4, opt_level, timeout=180)
    for rank, message in enumerate(results):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert message is not None and f"(ranks {pair}, DDP's process_group)" in message, message
        assert "found ranks [0, 1, 2, 3]" in message, message


def test_reduce_scatter_over_another_group_than_the_shards_names_both():
    """An audit: the refusal said "another process group" without naming either."""
    results = run_ranks(_register_with_another_group_than_ddps, 4, "O2", "ddp-world", timeout=180)
    for rank, message in enumerate(results):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert message is not None and f"sharded over ranks {pair}" in message, message
        assert "reducing over ranks [0, 1, 2, 3]" in message, message
