"""Sharded checkpoints: bit-exact resume in new processes, resharding, atomicity, checks, CLI."""

import enum
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from asserts import assert_same
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp
import distamp.fsdp
from distamp.checkpoint import CheckpointError, consolidate, consolidate_optimizer_state

GLOBAL_BATCH = 12  # divisible by world sizes 1-4: every world size trains on the same samples


class Net(nn.Module):
    """Uneven sizes, a BatchNorm (FP32 under O2, integer buffer), a LayerNorm, optional dropout."""

    def __init__(self, dropout: float = 0.0, hidden: int = 13, big: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, hidden)
        self.seven = nn.Parameter(torch.randn(7) * 0.1)
        self.bn = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 3)
        # A large parameter that only makes the files big (the kill test needs a slow save).
        self.ballast = nn.Parameter(torch.zeros(big)) if big else None

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) + F.pad(self.seven, (0, self.fc1.out_features - 7))
        h = self.drop(self.bn(h))
        out = self.fc2(self.ln(h))
        if self.ballast is not None:
            out = out + 0.0 * self.ballast.sum()
        return out


def make(opt_level, shard=None, dropout=0.0, hidden=13, big=0):
    model = Net(dropout, hidden, big)
    groups = [
        {"params": [model.fc1.weight, model.fc1.bias, model.seven], "lr": 0.02},
        {"params": [p for n, p in model.named_parameters() if not n.startswith(("fc1", "seven"))]},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    kwargs = {} if opt_level == "O1" else {"shard_master_weights": shard}
    model, opt = distamp.wrap(model, opt, opt_level=opt_level, verbosity=0, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    return model, opt, sched


def batch(step, rank, world):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 3, generator=gen)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(model, opt, sched, rank, world, first, last, inf_at=None, ddp=None):
    """Steps [first, last) through ``ddp`` (a DDP built here by default; or the caller's: a DDP
    with its own options, a hook, an FSDP model); no scheduler when ``sched`` is None."""
    ddp = ddp if ddp is not None else DDP(model) if world > 1 else model
    for step in range(first, last):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(ddp(x), y)
        if step == inf_at and rank == world - 1:
            loss = loss * float("inf")  # one rank only: every rank must skip together
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return ddp


def snapshot(model, opt, sched):
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "stats": {
            k: getattr(distamp.stats(opt), k) for k in ("steps", "skipped_steps", "loss_scales")
        },
        "rng": torch.get_rng_state(),
    }


# -- bit-exact resume in new processes ----------------------------------------------------------

STEPS, SAVE_AT, INF_AT = 20, 10, 4


def straight(rank, world, opt_level, shard):
    model, opt, sched = make(opt_level, shard, dropout=0.2)
    train(model, opt, sched, rank, world, 0, STEPS, inf_at=INF_AT)
    return snapshot(model, opt, sched)


def first_half(rank, world, opt_level, shard, directory):
    model, opt, sched = make(opt_level, shard, dropout=0.2)
    ddp = train(model, opt, sched, rank, world, 0, SAVE_AT, inf_at=INF_AT)
    # The DDP wrapper as users hold it: its "module." prefix is not part of the checkpoint.
    distamp.save_checkpoint(
        directory, ddp, opt, extra={"step": SAVE_AT, "scheduler": sched.state_dict()}
    )


def straight_then_first_half(rank, world, opt_level, shard, directory):
    """The uninterrupted run, then (in the same processes: Net seeds the RNG) the run that saves
    at SAVE_AT."""
    expected = straight(rank, world, opt_level, shard)
    first_half(rank, world, opt_level, shard, directory)
    return expected


def second_half(rank, world, opt_level, shard, directory):
    model, opt, sched = make(opt_level, shard, dropout=0.2)
    extra = distamp.load_checkpoint(directory, model, opt)
    sched.load_state_dict(extra["scheduler"])
    train(model, opt, sched, rank, world, extra["step"], STEPS, inf_at=INF_AT)
    return snapshot(model, opt, sched)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "opt_level,shard", [("O1", None), ("O2", False), ("O2", True)], ids=["O1", "O2-rep", "O2-shard"]
)
def test_resume_is_bit_exact_in_new_processes(tmp_path, world, opt_level, shard):
    _resume_is_bit_exact(tmp_path, world, opt_level, shard)


@pytest.mark.parametrize("shard_block", [16], indirect=True, ids=["blocks-16"])
def test_resume_is_bit_exact_with_many_blocks_per_shard(tmp_path, shard_block):
    _resume_is_bit_exact(tmp_path, 2, "O2", True)


def _resume_is_bit_exact(tmp_path, world, opt_level, shard):
    directory = str(tmp_path / "ckpt")
    expected = run_ranks(straight_then_first_half, world, opt_level, shard, directory)
    resumed = run_ranks(second_half, world, opt_level, shard, directory)  # new processes
    for rank in range(world):
        assert_same(expected[rank], resumed[rank], f"rank {rank}")
    stats = expected[0]["stats"]
    assert stats["skipped_steps"] == 1 and stats["steps"] == STEPS  # the injected inf: skipped
    assert stats["loss_scales"] == (2.0**15,)


def rolled_back(rank, world, opt_level, shard, directory, rs_hook):
    """Train to SAVE_AT and save; then a backward whose loss is NaN on one rank (pending, never
    stepped: the script sees the NaN and rolls back); load; train on to STEPS."""
    model, opt, sched = make(opt_level, shard, dropout=0.2)
    ddp = DDP(model, gradient_as_bucket_view=True) if world > 1 else model
    if rs_hook:
        distamp.hooks.register(ddp, opt, reduce_scatter=True)
    train(model, opt, sched, rank, world, 0, SAVE_AT, inf_at=SAVE_AT - 1, ddp=ddp)
    distamp.save_checkpoint(directory, ddp, opt, extra={"scheduler": sched.state_dict()})
    assert distamp.stats(opt).last_step_skipped  # the inf of step SAVE_AT - 1
    x, y = batch(SAVE_AT, rank, world)
    loss = F.mse_loss(ddp(x), y) * (float("nan") if rank == world - 1 else 1.0)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    extra = distamp.load_checkpoint(directory, ddp, opt)  # drops the pending gradients
    assert distamp.stats(opt).last_step_skipped  # an audit: load reset it to False
    sched.load_state_dict(extra["scheduler"])
    train(model, opt, sched, rank, world, SAVE_AT, STEPS, inf_at=SAVE_AT - 1, ddp=ddp)
    return snapshot(model, opt, sched)


def straight_with(rank, world, opt_level, shard, rs_hook):
    model, opt, sched = make(opt_level, shard, dropout=0.2)
    ddp = DDP(model, gradient_as_bucket_view=True) if world > 1 else model
    if rs_hook:
        distamp.hooks.register(ddp, opt, reduce_scatter=True)
    train(model, opt, sched, rank, world, 0, STEPS, inf_at=SAVE_AT - 1, ddp=ddp)
    return snapshot(model, opt, sched)


@pytest.mark.parametrize(
    ("opt_level", "shard", "rs_hook"),
    [("O2", False, False), ("O2", True, True), ("O0", True, True)],
    ids=["O2-replicated", "O2-sharded-rs-hook", "O0-sharded-rs-hook"],
)
def test_load_drops_pending_gradients_to_roll_back_after_a_nan_loss(
    tmp_path, opt_level, shard, rs_hook
):
    """The docstring said load drops pending gradients; it refused them (an audit), so a script
    could not roll back to its last checkpoint after a NaN loss. Bit for bit with a run that
    never saw the NaN (the load restores the RNG the extra forward's dropout drew from)."""
    directory = str(tmp_path / "ckpt")
    want = run_ranks(straight_with, 2, opt_level, shard, rs_hook)
    got = run_ranks(rolled_back, 2, opt_level, shard, directory, rs_hook)
    for rank in range(2):
        assert_same(want[rank]["model"], got[rank]["model"], f"rank {rank}")
        assert want[rank]["stats"] == got[rank]["stats"]


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def bn_run(rank, world, how, directory, first, last, load):
    """Train steps [first, last) with rank-local BatchNorm statistics (FSDP never syncs buffers;
    DDP told not to broadcast them); load the checkpoint first, or save it at the end."""
    net = BatchNormNet()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    if how == "fsdp":
        model, opt = distamp.fsdp.fully_shard(net, opt, opt_level="O1", verbosity=0)
    else:
        net, opt = distamp.wrap(net, opt, opt_level="O2", verbosity=0)
        model = DDP(net, broadcast_buffers=False) if world > 1 else net
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if load:
            distamp.load_checkpoint(directory, model, opt)
    train(net, opt, None, rank, world, first, last, ddp=model)
    if not load and directory is not None:
        distamp.save_checkpoint(directory, model, opt)
    inner = model.module if isinstance(model, DDP) else model
    buffers = {k: v.detach().clone() for k, v in inner.named_buffers()}
    return buffers, [str(w.message) for w in caught if "buffers" in str(w.message)]


@pytest.mark.parametrize("how", ["ddp-no-broadcast", "fsdp"])
def test_buffers_that_differ_between_ranks_resume_as_each_ranks_own(tmp_path, how):
    """BatchNorm statistics are each rank's own under FSDP and DDP(broadcast_buffers=False); a
    resume gave every rank rank 0's (an audit: rank 1's running_mean 1.7e-2 off). Bit for bit at
    the same world size; at another one every rank gets rank 0's, with a warning naming them."""
    directory = str(tmp_path / "ckpt")
    straight = run_ranks(bn_run, 2, how, None, 0, 5, False)
    assert not torch.equal(straight[0][0]["bn.running_mean"], straight[1][0]["bn.running_mean"])
    run_ranks(bn_run, 2, how, directory, 0, 3, False)
    resumed = run_ranks(bn_run, 2, how, directory, 3, 5, True)
    for rank in range(2):
        assert_same(straight[rank][0], resumed[rank][0], f"rank {rank}")
        assert resumed[rank][1] == []
    if how == "fsdp":
        return
    ((_, warned),) = run_ranks(bn_run, 1, how, directory, 3, 3, True)
    assert len(warned) == 1 and "'bn.running_mean'" in warned[0], warned
    assert "every rank gets rank 0's" in warned[0]


def _ignored_run(rank, world, directory, level, resume):
    """fc2.weight left out of DDP's reduction (an expert per rank: it parts at the first step),
    before wrap; trained 2 steps and saved, then 2 more (or a fresh model resumed for them)."""
    model, opt, _ = make(level, shard=False)
    if resume:  # another rank-local start, overwritten by the load
        with torch.no_grad():
            model.fc2.weight.add_(1.0)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["fc2.weight"])
    ddp = DDP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if resume:
            distamp.load_checkpoint(directory, ddp, opt)
        else:
            train(model, opt, None, rank, world, 0, 2, ddp=ddp)
            distamp.save_checkpoint(directory, ddp, opt)
        at_save = model.fc2.weight.detach().float().clone()
        train(model, opt, None, rank, world, 2, 4, ddp=ddp)
    state = {k: v.float().clone() for k, v in model.state_dict().items()}
    said = [str(w.message) for w in caught if "held other values on each" in str(w.message)]
    return state, said, at_save


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_parameters_ddp_ignores_resume_as_each_ranks_own(tmp_path, level):
    """Unreduced (ignored) parameters differ between ranks by design (expert parallelism); the
    checkpoint kept one value of each, pieced from the ranks' replicated masters, so that not
    even rank 0 got its own back (an audit). Now each rank's weight, FP32 master and AdamW
    state go into its rank file: the resume continues each rank's own run, bit for bit; at
    another world size every rank gets rank 0's, said once."""
    directory = str(tmp_path / "c")
    straight = run_ranks(_ignored_run, 2, directory, level, False)
    resumed = run_ranks(_ignored_run, 2, directory, level, True)
    assert not torch.equal(straight[0][0]["fc2.weight"], straight[1][0]["fc2.weight"])
    for rank in range(2):
        assert_same(straight[rank][0], resumed[rank][0], f"rank {rank}")
        assert straight[rank][1] == resumed[rank][1] == []
    ((_, warned, loaded),) = run_ranks(_ignored_run, 1, directory, level, True)
    assert len(warned) == 1 and "['fc2.weight']" in warned[0], warned
    assert "every rank gets rank 0's" in warned[0]
    # rank 0's indeed, and offline too (a review: pieced from both ranks' copies)
    rank0 = straight[0][2]
    tol = 0 if level == "O1" else 8e-3  # (O2: the FP32 master, the weight is its bf16 rounding)
    torch.testing.assert_close(loaded, rank0, atol=tol, rtol=0)
    consolidated = distamp.checkpoint.consolidate(directory)["fc2.weight"]
    torch.testing.assert_close(consolidated, rank0, atol=tol, rtol=0)


# -- resharding ---------------------------------------------------------------------------------


def save_at(rank, world, directory, shard=None):
    model, opt, sched = make("O2", shard)
    model.bn.eval()  # batch statistics depend on the per-rank batch: not comparable across sizes
    train(model, opt, sched, rank, world, 0, 8)
    distamp.save_checkpoint(directory, model, opt, extra={"step": 8})


def load_resave_continue(rank, world, directory, resaved):
    model, opt, sched = make("O2")  # default sharding: replicated at 1 rank, sharded above
    model.bn.eval()
    extra = distamp.load_checkpoint(directory, model, opt)
    assert extra == {"step": 8}
    distamp.save_checkpoint(resaved, model, opt, extra=extra)
    train(model, opt, sched, rank, world, 8, 14)
    distamp.save_checkpoint(resaved + "-end", model, opt)
    return opt._distamp.masters.sharded


@pytest.mark.parametrize(
    "shard_block", [None, 16], indirect=True, ids=["blocks-default", "blocks-16"]
)
def test_reshard_on_load_at_other_world_sizes(tmp_path, shard_block):
    """The checkpoint's canonical layout does not depend on how the shards are laid out: with
    blocks of 16 elements every rank's shard is scattered over the flat buffer in many rounds
    (see [Note: block-cyclic shards]) and must still save and load as torch.chunk pieces."""
    saved = str(tmp_path / "w2")
    run_ranks(save_at, 2, saved)
    reference_weights = consolidate(saved)
    reference_state = consolidate_optimizer_state(saved)
    assert reference_state["fc1.weight"]["step"] == 8  # scalar state came through

    for world in (2, 1, 3, 4):
        resaved = str(tmp_path / f"w2-at{world}")
        assert run_ranks(load_resave_continue, world, saved, resaved)[0] == (world > 1)
        # Loaded then saved again at another world size: the same FP32 weights and state.
        assert_same(consolidate(resaved), reference_weights, f"weights at world {world}")
        assert_same(consolidate_optimizer_state(resaved), reference_state, f"state at {world}")
    # A checkpoint written replicated at 1 rank loads sharded at 3.
    run_ranks(load_resave_continue, 3, str(tmp_path / "w2-at1"), str(tmp_path / "w1-at3"))
    assert_same(consolidate(tmp_path / "w1-at3"), reference_weights, "weights 2 -> 1 -> 3")

    # Continuing training matches the world-2 continuation up to the reduction order: the bf16
    # gradients are summed in another order (their last bits differ), which after 6 AdamW steps
    # of lr 2e-2 leaves the FP32 masters within 1e-3 of each other (measured: 3.5e-4).
    reference_end = consolidate(tmp_path / "w2-at2-end")
    for run in ("w2-at1", "w2-at3", "w2-at4", "w1-at3"):
        end = consolidate(tmp_path / f"{run}-end")
        for key, value in reference_end.items():
            if value.is_floating_point():
                torch.testing.assert_close(end[key], value, atol=1e-3, rtol=0, msg=f"{key}, {run}")
            else:
                assert torch.equal(end[key], value), f"{key}, {run}"


# -- atomicity ----------------------------------------------------------------------------------


def killed_during_save(rank, world, root, side):
    model, opt, sched = make("O2", big=1 << 21)  # ~8 MB of masters, 16 MB of AdamW state
    train(model, opt, sched, rank, world, 0, 3)
    directory = os.path.join(root, "ckpt")
    distamp.save_checkpoint(directory, model, opt, extra={"step": 3})
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, side)
    train(model, opt, sched, rank, world, 3, 5)
    if rank == 1:

        def kill_when_writing():
            while not list(Path(root).glob("ckpt.incomplete-*/rng-1.pt")):
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_when_writing, daemon=True).start()
    distamp.save_checkpoint(directory, model, opt, extra={"step": 5})


def load_latest(rank, world, root):
    latest = distamp.latest_checkpoint(root)
    model, opt, sched = make("O2", big=1 << 21)
    extra = distamp.load_checkpoint(latest, model, opt)
    return latest, extra, {k: v.clone() for k, v in model.state_dict().items()}


def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path):
    root, side = str(tmp_path / "run"), str(tmp_path / "at3.pt")
    with pytest.raises(AssertionError, match=r"rank 1: no result \(exit code -9\)"):
        run_ranks(killed_during_save, 2, root, side, timeout=120)
    # The interrupted save's folder: rank 0 survives and removes it when it sees the failure
    # before the harness stops it; else it stays, as after a whole job killed.
    assert len(list((tmp_path / "run").glob("ckpt.incomplete-*"))) <= 1
    assert distamp.latest_checkpoint(root) == os.path.join(root, "ckpt")
    latest, extra, weights = run_ranks(load_latest, 2, root)[0]
    assert latest == os.path.join(root, "ckpt") and extra == {"step": 3}
    assert_same(weights, torch.load(side, weights_only=True))
    # The next save of that path, by other processes of this host, removes a killed one's.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(root) / f"ckpt.incomplete-{socket.gethostname()}-{dead.pid}-1"
    stale.mkdir(exist_ok=True)
    (stale / "rng-0.pt").write_bytes(b"partial")
    run_ranks(save_small, 2, os.path.join(root, "ckpt"))
    assert not stale.exists() and not list(Path(root).glob("*.incomplete*"))


def _save_on_a_full_disk(rank, world, root):
    """Rank 1's writes fail past 64 KB (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC), at a
    path with no checkpoint and at one with a checkpoint."""
    import resource

    model, opt, sched = make("O2", big=1 << 16)  # 256 KB of masters: past the limit
    train(model, opt, sched, rank, world, 0, 2)
    kept = os.path.join(root, "kept")
    distamp.save_checkpoint(kept, model, opt, extra={"step": 2})
    train(model, opt, sched, rank, world, 2, 3)
    messages = []
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not the signal's kill
    try:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, limit[1]))
        for name in ("new", "kept"):
            try:
                distamp.save_checkpoint(os.path.join(root, name), model, opt, extra={"step": 3})
                messages.append(None)
            except CheckpointError as exc:
                messages.append(str(exc))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    return messages


def test_a_save_that_fails_writing_removes_its_partial_folder_and_says_what_is_left(tmp_path):
    """An audit's full disk: the failed save left its partial folder (and the disk full: the
    example's step_NNNNNN paths never repeat, so no later save removed it), and said "a previous
    checkpoint ... is intact" where there had been none."""
    root = tmp_path / "run"
    for messages in run_ranks(_save_on_a_full_disk, 2, str(root)):
        new, kept = messages
        assert new is not None and f"there was no checkpoint at {root / 'new'} before" in new
        assert kept is not None and f"the previous checkpoint at {root / 'kept'} is intact" in kept
        assert "rank 1: " in new and "rank 0: " not in new, new
    assert sorted(p.name for p in root.iterdir()) == ["kept"]
    assert distamp.checkpoint.inspect(str(root / "kept"))["extra"] == {"step": 2}


def _save_failing_in(rank, world, root, where):
    """One rank's RNG write, or rank 0's manifest write, fails (a full disk there)."""
    from unittest import mock

    import distamp.checkpoint.api as api
    import distamp.checkpoint.files as files

    model, opt, sched = make("O2")
    train(model, opt, sched, rank, world, 0, 1)
    distamp.save_checkpoint(os.path.join(root, "kept"), model, opt, extra={"step": 1})

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    target = (api, "_save_rng") if where == "rng" else (files, "write_manifest_and_commit")
    with mock.patch.object(*target, full if where == "manifest" or rank == 1 else getattr(*target)):
        try:
            distamp.save_checkpoint(os.path.join(root, "kept"), model, opt, extra={"step": 2})
        except CheckpointError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize("where", ["rng", "manifest"])
def test_a_save_failing_before_or_after_the_tensors_says_what_is_left(tmp_path, where):
    """README: a failed save says whether a checkpoint is left at that path; only a failure
    writing the tensors said it (an audit: the RNG state's and the manifest's said nothing)."""
    root = tmp_path / "run"
    for message in run_ranks(_save_failing_in, 2, str(root), where):
        assert message is not None and "No space left on device" in message, message
        assert f"the previous checkpoint at {root / 'kept'} is intact" in message, message
    assert distamp.checkpoint.inspect(str(root / "kept"))["extra"] == {"step": 1}


def test_a_committed_save_whose_old_copy_cannot_be_removed_warns_and_succeeds(tmp_path):
    """The rename that commits had run; removing the previous copy then failed (a file of it
    held open on NFS) and the save raised "could not move ... into place", naming a folder that
    no longer existed (an audit)."""
    from unittest import mock

    import distamp.checkpoint.files as files

    model, opt, sched = make("O2")
    path = tmp_path / "ck"
    distamp.save_checkpoint(path, model, opt, extra={"step": 1})
    real = files.remove

    def busy(target):
        if str(target).endswith(files.OLD):
            raise OSError(16, "Device or resource busy")
        real(target)

    with mock.patch.object(files, "remove", busy):
        with pytest.warns(UserWarning, match=r"is committed, but tidying up after it failed"):
            distamp.save_checkpoint(path, model, opt, extra={"step": 2})
    assert distamp.checkpoint.inspect(str(path))["extra"] == {"step": 2}
    distamp.save_checkpoint(path, model, opt, extra={"step": 3})  # removes the leftover
    assert not (tmp_path / ("ck" + files.OLD)).exists()


def test_a_save_of_a_path_another_live_process_is_saving_is_refused_naming_it(tmp_path):
    """Two jobs saving one path shared one temporary folder, each removing the other's files:
    one committed a manifest of its own over the other's tensors, silently (an audit). Each
    save has a folder of its own now; one whose process runs is refused, naming it; one of
    another host is never read and is left alone."""
    import socket

    import distamp.checkpoint.files as files

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    other = subprocess.Popen(["sleep", "60"])
    try:
        owner = f"{socket.gethostname()}-{other.pid}-{files._process_start(other.pid)}"
        busy = tmp_path / f"c.incomplete-{owner}"
        busy.mkdir()
        (busy / "__0_0.distcp").write_bytes(b"the other job's tensors")
        with pytest.raises(CheckpointError, match=rf"another in progress: process {other.pid} "):
            distamp.save_checkpoint(tmp_path / "c", model, opt, extra={"step": 2})
        assert sorted(p.name for p in tmp_path.iterdir()) == [busy.name]  # nothing touched
    finally:
        other.kill()
        other.wait()
    foreign = tmp_path / "c.incomplete-elsewhere-7-123"
    foreign.mkdir()
    (foreign / "__1_0.distcp").write_bytes(b"another host's save")
    distamp.save_checkpoint(tmp_path / "c", model, opt, extra={"step": 2})  # busy's process died
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", foreign.name]
    assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "c")
    assert distamp.load_checkpoint(tmp_path / "c", *make("O2")[:2]) == {"step": 2}


# -- damaged files, other model, other opt_level --------------------------------------------------


def save_small(rank, world, directory):
    model, opt, sched = make("O2")
    train(model, opt, sched, rank, world, 0, 3)
    distamp.save_checkpoint(directory, model, opt, extra={"step": 3})


def try_loads(rank, world, cases):
    messages = {}
    for name, directory in cases.items():
        if name == "other model":
            model, opt, _ = make("O2", hidden=14)
        elif name == "other opt_level":
            model, opt, _ = make("O1")
        else:
            model, opt, _ = make("O2")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        master_before = opt.state_dict()
        try:
            distamp.load_checkpoint(directory, model, opt)
            messages[name] = None
        except CheckpointError as exc:
            messages[name] = str(exc)
        assert_same({k: v for k, v in model.state_dict().items()}, before, f"{name}: model")
        assert_same(opt.state_dict(), master_before, f"{name}: optimizer")
    return messages


def test_damaged_or_mismatched_checkpoint_fails_on_every_rank(tmp_path):
    good = tmp_path / "good"
    run_ranks(save_small, 2, str(good))

    def variant(name, damage):
        target = tmp_path / name.replace(" ", "_")
        shutil.copytree(good, target)
        damage(target)
        return str(target)

    def truncate(d):
        with open(d / "__1_0.distcp", "r+b") as f:
            f.truncate(os.path.getsize(d / "__1_0.distcp") // 2)

    def flip(name):
        def damage(d):
            data = bytearray((d / name).read_bytes())
            data[len(data) // 2] ^= 0x40
            (d / name).write_bytes(bytes(data))

        return damage

    cases = {
        "truncated shard": variant("truncated", truncate),
        "flipped byte": variant("flipped", flip("__0_0.distcp")),
        "altered manifest": variant("manifest", flip("distamp.pt")),
        "altered metadata": variant("metadata", flip(".metadata")),
        "no commit": variant("nocommit", lambda d: (d / "COMMIT").unlink()),
        "other model": str(good),
        "other opt_level": str(good),
        "dcp.save's folder": str(tmp_path / "dcp"),
    }
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    expected = {
        "truncated shard": r"__1_0\.distcp: expected \d+ bytes, found \d+",
        "flipped byte": r"__0_0\.distcp: SHA-256 differs .*; another checkpoint beside it: ",
        "altered manifest": r"distamp\.pt: SHA-256 differs from COMMIT",
        "altered metadata": r"\.metadata: SHA-256 differs",
        "no commit": r"found no COMMIT file",
        "other model": r"'fc1\.weight' has shape \(13, 6\) in the checkpoint, \(14, 6\) in this"
        r".*consolidate\(path\) gives them as plain FP32 tensors",
        "other opt_level": r"saved with opt_level='O2', this run has opt_level='O1'.*"
        r"strict=False",
        "dcp.save's folder": r"found a torch\.distributed\.checkpoint folder \(dcp\.save's",
    }
    results = run_ranks(try_loads, 2, cases, timeout=120)
    for rank, messages in enumerate(results):
        for name, pattern in expected.items():
            assert messages[name] is not None, f"rank {rank}: {name} loaded without an error"
            assert re.search(pattern, messages[name]), (rank, name, messages[name])


def test_extra_must_be_plain_data(tmp_path):
    model, opt, _ = make("O2")
    with pytest.raises(CheckpointError, match=r"extra\['hook'\]: expected plain data .* function"):
        distamp.save_checkpoint(tmp_path / "c", model, opt, extra={"hook": lambda: 0})
    assert sorted(tmp_path.iterdir()) == []


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tmp_path):
    """DeepSpeed's habit, save_checkpoint(save_dir) with the run's root folder, deleted every
    checkpoint and log in it (an audit): refused with nothing touched. A committed checkpoint
    and an empty folder are replaced as before."""
    model, opt, _ = make("O2")
    root = tmp_path / "run"
    distamp.save_checkpoint(root / "step_10", model, opt, extra={"step": 10})
    (root / "train_log.txt").write_text("step 10\n")
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(CheckpointError, match=r"expected .*run to be a new path.*step_10"):
        distamp.save_checkpoint(root, model, opt, extra={"step": 20})
    assert sorted(p.name for p in root.iterdir()) == before
    assert distamp.checkpoint.inspect(root / "step_10")["extra"] == {"step": 10}
    distamp.save_checkpoint(root / "step_10", model, opt, extra={"step": 11})  # a checkpoint
    assert distamp.checkpoint.inspect(root / "step_10")["extra"] == {"step": 11}
    (tmp_path / "empty").mkdir()
    distamp.save_checkpoint(tmp_path / "empty", model, opt)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointError, match="found a file: save to another path, or remove"):
        distamp.save_checkpoint(tmp_path / "a-file", model, opt)


class _Phase(enum.IntEnum):
    WARMUP = 3


class _Mode(str, enum.Enum):
    TRAIN = "train"


def test_numpy_scalars_and_subclasses_save_as_the_plain_values_they_stand_for(tmp_path):
    """``numpy.float64`` is a float, an ``IntEnum`` an int: saved as themselves they were pickled,
    and ``torch.load(weights_only=True)`` then refused the checkpoint on every resume (an
    audit: a metric from ``np.mean``, an lr set from a NumPy schedule as BEiT's loop does)."""
    np = pytest.importorskip("numpy")
    model, opt, _ = make("O2")
    batch_x, batch_y = batch(0, 0, 1)
    with distamp.scale_loss(F.mse_loss(model(batch_x).float(), batch_y), opt) as scaled:
        scaled.backward()
    opt.step()
    for group in opt.param_groups:
        group["lr"] = np.linspace(0.0, 1e-3, 10)[3]  # numpy.float64
    extra = {
        "best": np.mean([0.5, 0.7]),
        "epoch": np.int64(4),
        "seen": np.float32(0.25),
        "done": np.bool_(False),
        "phase": _Phase.WARMUP,
        "mode": _Mode.TRAIN,
        _Mode.TRAIN: [np.int32(1)],
    }
    distamp.save_checkpoint(tmp_path / "c", model, opt, extra=extra)
    model2, opt2, _ = make("O2")
    loaded = distamp.load_checkpoint(tmp_path / "c", model2, opt2)
    assert loaded == {
        "best": 0.6,
        "epoch": 4,
        "seen": 0.25,
        "done": False,
        "phase": 3,
        "mode": "train",
        "train": [1],
    }
    assert [type(loaded[k]) for k in ("best", "epoch", "done", "phase", "mode")] == [
        float,
        int,
        bool,
        int,
        str,
    ]
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 / 3)


# -- consolidate and the CLI ----------------------------------------------------------------------


def save_and_report(rank, world, directory):
    model, opt, sched = make("O2", True)
    train(model, opt, sched, rank, world, 0, 5)
    distamp.save_checkpoint(directory, model, opt)
    model.eval()
    x, _ = batch(0, 0, 1)
    masters = opt._distamp.masters
    return {
        "shards": [s.clone() for s in masters.shards],
        "layout": [[(r.start, r.numel) for r in g.ranges] for g in masters.groups],
        "total": [g.total for g in masters.groups],
        "names": [
            [opt._distamp.group.param_names[id(p)] for p in g.params] for g in masters.groups
        ],
        "output": model(x).detach(),
    }


def test_consolidate_cli_gives_a_plain_fp32_model(tmp_path):
    directory = tmp_path / "ckpt"
    ranks = run_ranks(save_and_report, 2, str(directory))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-m", "distamp.checkpoint", "inspect", str(directory)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    n_params = sum(p.numel() for p in Net().parameters())
    assert "world size   2" in out and "opt_level    O2" in out and "step         5" in out
    assert f"parameters   {n_params:,}" in out and "loss scales  65536" in out
    assert "sharded      FP32 masters and optimizer state over 2 ranks" in out
    target = tmp_path / "fp32.pt"
    subprocess.run(
        [sys.executable, "-m", "distamp.checkpoint", "consolidate", str(directory), str(target)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    into_a_folder = subprocess.run(
        [sys.executable, "-m", "distamp.checkpoint", "consolidate", str(directory), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    # a folder as OUT: a usage error, before the checkpoint is read (exit 2, as argparse's)
    assert into_a_folder.returncode == 2, into_a_folder.stderr
    assert "expected a file path, found a directory" in into_a_folder.stderr
    state = torch.load(target, weights_only=True)
    plain = Net()
    plain.load_state_dict(state)  # strict: every key, every shape
    # DeepSpeed's convert_zero_checkpoint_to_fp32_state_dict(dir, out) habit: told, not a bare error
    with pytest.raises(
        TypeError, match=r"model_index: expected an int .* got str 'x.pt'.*torch.save"
    ):
        consolidate(directory, "x.pt")
    with pytest.raises(TypeError, match=r"optimizer_index: expected an int .* got float 1.0$"):
        consolidate_optimizer_state(directory, 1.0)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())

    # The consolidated weights are the FP32 masters, bit for bit (not the bf16 weights).
    for g, total in enumerate(ranks[0]["total"]):
        flat = torch.cat([r["shards"][g] for r in ranks])[:total]
        for name, (start, numel) in zip(ranks[0]["names"][g], ranks[0]["layout"][g], strict=True):
            assert torch.equal(state[name].reshape(-1), flat[start : start + numel]), name
    plain.eval()
    x, _ = batch(0, 0, 1)
    # The wrapped model computes in bf16 from these masters rounded: close, not equal.
    torch.testing.assert_close(plain(x), ranks[0]["output"], atol=3e-2, rtol=3e-2)

    bad = subprocess.run(
        [sys.executable, "-m", "distamp.checkpoint", "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 1 and "no such checkpoint directory" in bad.stderr

    # A flipped byte keeps the size: --verify hashes it; --json exits 1 on damage too (an audit:
    # inspect saw only sizes, and --json returned 0 before the damage check).
    shard = next(directory.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    cli = [sys.executable, "-m", "distamp.checkpoint", "inspect", str(directory)]
    assert subprocess.run(cli, capture_output=True, env=env).returncode == 0  # sizes only
    flipped = subprocess.run([*cli, "--verify"], capture_output=True, text=True, env=env)
    assert flipped.returncode == 1 and "contents differ" in flipped.stderr, flipped.stderr
    as_json = subprocess.run([*cli, "--verify", "--json"], capture_output=True, env=env)
    assert as_json.returncode == 1


def test_consolidate_widens_half_entries_and_keeps_float64_ones(tmp_path):
    """A float64 buffer came out of consolidate as float32, rounded (an audit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    model.register_buffer("scale64", torch.tensor([1 + 1e-10], dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O0", verbosity=0)  # (O2 casts the buffer)
    distamp.save_checkpoint(tmp_path / "ckpt", model, opt)
    state = consolidate(tmp_path / "ckpt")
    assert state["scale64"].dtype == torch.float64 and state["scale64"].item() == 1 + 1e-10
    assert all(state[k].dtype == torch.float32 for k in ("0.weight", "1.weight", "1.bias"))


def test_consolidate_cli_leaves_no_truncated_file_behind(tmp_path):
    """A failed write left a truncated OUT.pt (torch.load: "failed finding central directory"),
    over a good one (an audit)."""
    import resource

    model, opt, _ = make("O2", big=1 << 16)  # 256 KB of weights: past the write limit below
    distamp.save_checkpoint(tmp_path / "ckpt", model, opt)
    out = tmp_path / "fp32.pt"
    cli = [sys.executable, "-m", "distamp.checkpoint", "consolidate", str(tmp_path / "ckpt")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([*cli, str(out)], env=env, check=True, capture_output=True)
    good = out.read_bytes()

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not the signal's kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 15, resource.RLIM_INFINITY))

    failed = subprocess.run(
        [*cli, str(out)], env=env, capture_output=True, text=True, preexec_fn=small_files
    )
    assert failed.returncode == 1 and f"cannot write OUT.pt {out}" in failed.stderr
    assert out.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt",
        "fp32.pt",
    ]


@pytest.mark.parametrize("stopped", ["before the manifest", "before the rename"])
def test_loading_a_killed_saves_temporary_folder_says_so(tmp_path, stopped):
    """A save killed before its manifest leaves DCP's .metadata without one: the load called it
    dcp.save's folder and advised loading it with torch (an audit); killed after its COMMIT,
    before the rename, the folder is whole and the message says how to use it."""
    import shutil

    from distamp.checkpoint.files import COMMIT, MANIFEST

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    distamp.save_checkpoint(tmp_path / "c", model, opt, extra={"step": 2})
    temporary = tmp_path / "c.incomplete-host-7-123"
    shutil.copytree(tmp_path / "c", temporary)
    if stopped == "before the manifest":
        (temporary / COMMIT).unlink()
        (temporary / MANIFEST).unlink()
        pattern = r"did not finish .*load the previous checkpoint \(.*/c if it exists"
    else:
        pattern = rf"{COMMIT} were written, its rename to .*/c was not; .*`mv "
    fresh, fresh_opt, _ = make("O2")
    with pytest.raises(CheckpointError, match=r"found the temporary folder of a save_checkpoint "):
        distamp.load_checkpoint(temporary, fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=pattern):
        distamp.load_checkpoint(temporary, fresh, fresh_opt)
    assert distamp.load_checkpoint(tmp_path / "c", fresh, fresh_opt) == {"step": 2}
    # The first save to a path, killed before its rename: loading the path names the folder.
    shutil.move(temporary, tmp_path / "d.incomplete-host-7-123")
    with pytest.raises(
        CheckpointError, match=r"no such checkpoint directory; .*d\.incomplete-host-7-123 is the"
    ):
        distamp.load_checkpoint(tmp_path / "d", fresh, fresh_opt)


def test_latest_checkpoint_orders_by_step_and_skips_incomplete(tmp_path):
    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    distamp.save_checkpoint(tmp_path / "a", model, opt, extra={"step": 7})
    distamp.save_checkpoint(tmp_path / "b", model, opt, extra={"step": 3})
    (tmp_path / "c.incomplete").mkdir()
    (tmp_path / "junk").mkdir()
    assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "a")
    assert distamp.latest_checkpoint(tmp_path / "nothing") is None
    # Overwriting a checkpoint replaces it whole.
    distamp.save_checkpoint(tmp_path / "a", model, opt, extra={"step": 1})
    assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c.incomplete", "junk"]


def test_latest_checkpoint_while_a_save_replaces_one_neither_raises_nor_warns(
    tmp_path, monkeypatch
):
    """An evaluator polling the folder while training commits over ``b``: the commit renames
    ``b`` away between the manifest read and the COMMIT stat (an audit: FileNotFoundError in 42
    of 2494 calls, and a spurious "damaged" warning)."""
    import distamp.checkpoint.files as files

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    distamp.save_checkpoint(tmp_path / "a", model, opt, extra={"step": 3})
    distamp.save_checkpoint(tmp_path / "b", model, opt, extra={"step": 7})
    real = files.read_manifest

    def read_then_replaced(child):
        manifest = real(child)
        if child.name == "b":
            os.rename(child, tmp_path / "b.old")  # what the commit of a save over b does
        return manifest

    monkeypatch.setattr(files, "read_manifest", read_then_replaced)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "a")


def test_two_saves_killed_in_a_row_leave_the_last_complete_checkpoint(tmp_path, monkeypatch):
    """A save that replaces ``a`` renames it to ``a.old`` and then its own files into ``a``;
    killed between the two, ``a.old`` is the only complete copy. The next save of ``a`` used to
    delete ``a.old`` first: killed there too, nothing was left (an audit's repro)."""
    import distamp.checkpoint.files as files

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    distamp.save_checkpoint(tmp_path / "a", model, opt, extra={"step": 2})
    real_rename = os.rename

    def killed_at_the_second_rename(src, dst):
        if files.INCOMPLETE in str(src):
            raise KeyboardInterrupt("killed")  # the process dies here
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", killed_at_the_second_rename)
    for attempt in range(2):
        with pytest.raises(KeyboardInterrupt):
            distamp.save_checkpoint(tmp_path / "a", model, opt, extra={"step": 3 + attempt})
        found = distamp.latest_checkpoint(tmp_path)
        assert found is not None, f"no complete checkpoint after killed save {attempt + 1}"
        assert distamp.checkpoint.inspect(found)["step"] == 2
    monkeypatch.setattr(files.os, "rename", real_rename)
    distamp.save_checkpoint(tmp_path / "a", model, opt, extra={"step": 5})
    assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "a")
    assert not (tmp_path / "a.old").exists()


def test_a_checkpoint_path_that_is_a_symbolic_link_is_saved_through_it(tmp_path):
    """Checkpoints on another volume behind a link: the first save replaced the link with a
    real folder and then failed removing the link as the old copy; every later save failed at
    that leftover and the resume looped at the first step (an audit)."""
    model, opt, sched = make("O2")
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir()
    run.mkdir()
    (scratch / "model").mkdir()
    (run / "model").symlink_to(scratch / "model")
    for step in (1, 2, 3):
        train(model, opt, sched, 0, 1, step - 1, step)
        assert distamp.save_checkpoint(run / "model", model, opt, extra={"step": step}) == str(
            run / "model"
        )
        assert (run / "model").is_symlink(), f"save {step} replaced the link"
        assert distamp.checkpoint.inspect(str(scratch / "model"))["step"] == step
        assert distamp.latest_checkpoint(run) == str(run / "model")
    assert sorted(p.name for p in run.iterdir()) == ["model"]
    assert sorted(p.name for p in scratch.iterdir()) == ["model"]
    # The leftover an earlier distamp made (a real folder at the path, the link as "model.old")
    # goes too.
    (run / "model").unlink()
    (run / "model.old").symlink_to(scratch / "model")
    distamp.save_checkpoint(run / "model", model, opt, extra={"step": 4})
    assert sorted(p.name for p in run.iterdir()) == ["model"]
    model2, opt2, _ = make("O2")
    assert distamp.load_checkpoint(run / "model", model2, opt2)["step"] == 4


# -- variants, in one process -----------------------------------------------------------------------


class HistoryOptimizer(torch.optim.Optimizer):
    """A user's optimizer with element-wise state and a fixed-size ``(3,)`` history per
    parameter: shaped like ``Net.fc2.bias``, element-wise there only (a Shampoo-style
    preconditioner shaped like a square weight is the same case)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["avg"] = torch.zeros_like(p)
                    state["hist"] = torch.zeros(3)
                state["avg"].mul_(0.5).add_(p.grad)
                state["hist"] = torch.cat([p.grad.norm().reshape(1), state["hist"][:2]])
                p.add_(state["avg"], alpha=-group["lr"])


def _fixed_size_state_sharded(rank, world, directory):
    model = Net()
    opt = HistoryOptimizer(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrap's: not one of torch's per-parameter optimizers
        model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=True)
    ddp = DDP(model)
    x, y = batch(0, rank, world)
    with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    try:
        distamp.save_checkpoint(directory, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_fixed_size_state_of_sharded_masters_is_refused_at_save(tmp_path):
    """A (3,) history per slice of sharded masters was saved and read back into other slices'
    places, silently (an audit): refused on every rank before anything is written."""
    for message in run_ranks(_fixed_size_state_sharded, 2, str(tmp_path / "c"), timeout=120):
        assert message is not None and "optimizer state 'hist' of " in message, message
        assert "is a tensor of shape (3,) on a slice of shape" in message, message
        assert "shard_master_weights=False" in message
    assert not (tmp_path / "c").exists()


def build_variant(variant):
    """(models, optimizers) as the user holds them after wrap, for one configuration."""
    if variant == "two models":
        torch.manual_seed(0)
        a, b = nn.Linear(6, 5), nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3))
        opts = [
            torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9),
            torch.optim.AdamW(b.parameters()),
        ]
        models, opts = distamp.wrap([a, b], opts, opt_level="O2", num_losses=2, verbosity=0)
        return models, opts
    model = Net()
    if variant == "adafactor":  # variance for vectors only, row_var/col_var for matrices
        opt = torch.optim.Adafactor(model.parameters(), lr=0.05)
        return distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    if variant == "history state":
        return distamp.wrap(
            model, HistoryOptimizer(model.parameters()), opt_level="O2", verbosity=0
        )
    if variant == "adagrad sharded":
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        return distamp.wrap(model, opt, opt_level="O2", shard_master_weights=True, verbosity=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = {
        "O0": {"opt_level": "O0"},
        "O3": {"opt_level": "O3"},
        "O2 fp16": {"opt_level": "O2", "half_dtype": torch.float16},
        "disabled": {"opt_level": "O2", "enabled": False},
    }[variant]
    return distamp.wrap(model, opt, verbosity=0, **kwargs)


def variant_steps(models, opts, first, last):
    models = models if isinstance(models, list) else [models]
    opts = opts if isinstance(opts, list) else [opts]
    for step in range(first, last):
        x, y = batch(step, 0, 1)
        if len(models) == 2:
            hidden = models[0](x)
            losses = [hidden.float().pow(2).mean(), F.mse_loss(models[1](hidden), y)]
            for loss_id, (loss, opt) in enumerate(zip(losses, opts, strict=True)):
                with distamp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                    scaled.backward(retain_graph=loss_id == 0)
        else:
            with distamp.scale_loss(F.mse_loss(models[0](x), y), opts[0]) as scaled:
                scaled.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(
    "variant",
    [
        "O0",
        "O3",
        "O2 fp16",
        "disabled",
        "two models",
        "adagrad sharded",
        "adafactor",
        "history state",
    ],
)
def test_round_trip_variants_in_one_process(tmp_path, variant):
    models, opts = build_variant(variant)
    variant_steps(models, opts, 0, 3)
    distamp.save_checkpoint(tmp_path / "c", models, opts, extra={"step": 3})
    expected = [
        {k: v.clone() for k, v in m.state_dict().items()}
        for m in (models if isinstance(models, list) else [models])
    ]
    variant_steps(models, opts, 3, 5)

    fresh_models, fresh_opts = build_variant(variant)
    assert distamp.load_checkpoint(tmp_path / "c", fresh_models, fresh_opts) == {"step": 3}
    fresh_list = fresh_models if isinstance(fresh_models, list) else [fresh_models]
    for model, state in zip(fresh_list, expected, strict=True):
        assert_same(model.state_dict(), state, variant)
    variant_steps(fresh_models, fresh_opts, 3, 5)
    for a, b in zip(
        opts if isinstance(opts, list) else [opts],
        fresh_opts if isinstance(fresh_opts, list) else [fresh_opts],
        strict=True,
    ):
        assert_same(b.state_dict(), a.state_dict(), f"{variant}: optimizer after 2 more steps")
    # The state keys of every parameter as saved (an audit: Adafactor's matrices gained a
    # full-size zero ``variance`` at every load).
    if variant == "adafactor":
        saved = consolidate_optimizer_state(tmp_path / "c")
        assert "variance" not in saved["fc1.weight"] and "row_var" in saved["fc1.weight"]
        assert "variance" in saved["fc1.bias"]
        for per in fresh_opts.state.values():
            assert "variance" not in per or "row_var" not in per, sorted(per)
    if variant == "history state":  # (an audit: saved, committed, and never loadable again)
        saved = consolidate_optimizer_state(tmp_path / "c")
        assert all(per["hist"].shape == (3,) for per in saved.values()), saved
    consolidated = consolidate(tmp_path / "c")
    reference = fresh_list[0].state_dict()
    assert set(consolidated) == set(reference)
    assert all(v.dtype == torch.float32 for v in consolidated.values() if v.is_floating_point())


def test_latest_checkpoint_skips_a_newest_checkpoint_damaged_after_its_commit(tmp_path):
    """`--resume auto` under torchrun --max-restarts or a Slurm requeue calls latest_checkpoint on
    every restart: a newest checkpoint cut short or missing a file after its commit must not be
    picked again and again; the newest intact one is, with a warning naming what was skipped.
    inspect says so too, and a save stopped between its two renames points at ``<dir>.old``."""
    from distamp.checkpoint import offline

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    distamp.save_checkpoint(tmp_path / "step_10", model, opt, extra={"step": 10})
    distamp.save_checkpoint(tmp_path / "step_20", model, opt, extra={"step": 20})
    shard = next(p for p in sorted((tmp_path / "step_20").iterdir()) if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.warns(UserWarning, match=rf"skipped .*step_20.*{shard.name} \(\d+ bytes, expected"):
        assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "step_10")
    assert offline.inspect(tmp_path / "step_20")["damaged"] == [
        f"{shard.name} ({shard.stat().st_size} bytes, expected {shard.stat().st_size + 10})"
    ]
    assert offline.inspect(tmp_path / "step_10")["damaged"] == []
    shard.unlink()
    with pytest.warns(UserWarning, match=rf"{shard.name} \(missing\)"):
        assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "step_10")
    (tmp_path / "step_10").rename(tmp_path / "latest.old")
    with pytest.raises(distamp.CheckpointError, match=r"latest\.old holds the checkpoint"):
        distamp.load_checkpoint(tmp_path / "latest", model, opt)


def _load_per_rank(rank, world, root):
    model, opt, sched = make("O2")
    for step in (1, 2):
        train(model, opt, sched, rank, world, step - 1, step)
        distamp.save_checkpoint(Path(root) / f"step_{step}", model, opt, extra={"step": step})
    before = [p.detach().clone() for p in model.parameters()]
    try:
        distamp.load_checkpoint(Path(root) / f"step_{rank + 1}", model, opt)  # rank 1: the other
    except CheckpointError as err:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        return str(err), unchanged
    return None, None


def test_ranks_handed_different_checkpoints_are_refused_on_every_rank(tmp_path):
    """Each rank loaded its own (another step of the same run) and the ranks stepped apart."""
    for message, unchanged in run_ranks(_load_per_rank, 2, str(tmp_path), timeout=120):
        assert message is not None and unchanged
        assert "expected every rank to load the same checkpoint" in message
        assert "rank 0: " in message and "step_1 (step 1" in message
        assert "rank 1: " in message and "step_2 (step 2" in message


def test_a_failed_write_raises_checkpoint_error_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    """A disk error inside DCP's write surfaced as DCP's own exception, so code catching
    CheckpointError around a save missed it (an audit)."""
    from distamp.checkpoint import metadata

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 1)
    distamp.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"step": 1})

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metadata.Writer, "write_data", full_disk)
    with pytest.raises(
        CheckpointError,
        match=r"writing the tensors .* failed \(rank 0: OSError: \[Errno 28\] No space left on device\)",
    ):
        distamp.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"step": 2})
    monkeypatch.undo()
    assert distamp.load_checkpoint(tmp_path / "ckpt", model, opt) == {"step": 1}


def test_a_failed_read_raises_checkpoint_error_and_changes_nothing(tmp_path, monkeypatch):
    """DCP raises its CheckpointException, a BaseException: ``except Exception`` let it through."""
    from distamp.checkpoint import metadata

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 1)
    distamp.save_checkpoint(tmp_path / "ckpt", model, opt)
    train(model, opt, sched, 0, 1, 1, 2)
    before = [p.detach().clone() for p in model.parameters()]

    def bad_disk(self, plan, planner):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(metadata.Reader, "read_data", bad_disk)
    with pytest.raises(CheckpointError, match=r"reading the shards failed: rank 0: OSError"):
        distamp.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_a_checkpoint_of_other_kept_fp32_modules_is_refused_naming_the_parameter(tmp_path):
    """Same parameters, another form (an FP32 master in the checkpoint, kept FP32 here): the
    error said only "other parameters", naming none (an audit)."""

    def build(**kwargs):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return distamp.wrap(model, opt, opt_level="O2", verbosity=0, **kwargs)

    model, opt = build()
    with distamp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    distamp.save_checkpoint(tmp_path / "c", model, opt)
    other, other_opt = build(keep_fp32_modules=["0"])
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(
        CheckpointError, match=r"parameter '0\.weight' is with FP32 masters in the "
    ):
        distamp.load_checkpoint(tmp_path / "c", other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


@pytest.mark.parametrize("change", ["split moved", "groups swapped"])
def test_a_parameter_in_another_param_group_than_saved_is_named_with_both_groups(tmp_path, change):
    """nanoGPT's decay / no-decay split built otherwise on resume: the error said the parameter
    was absent and hinted at keep_fp32_modules (an audit)."""

    def build(groups):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
        params = list(model.parameters())
        opt = torch.optim.AdamW([{"params": [params[i] for i in g]} for g in groups], lr=1e-2)
        return distamp.wrap(model, opt, opt_level="O2", verbosity=0)

    model, opt = build([[0, 1, 2, 3], [4, 5]])
    with distamp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    distamp.save_checkpoint(tmp_path / "c", model, opt)
    groups, pattern = {
        "split moved": ([[0, 1], [2, 3, 4, 5]], r"'1\.weight' is in param_groups\[0\] in the "),
        "groups swapped": ([[4, 5], [0, 1, 2, 3]], r"'2\.weight' is in param_groups\[1\] in the "),
    }[change]
    here = {"split moved": 1, "groups swapped": 0}[change]
    other, other_opt = build(groups)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(
        CheckpointError, match=pattern + rf"checkpoint and in param_groups\[{here}\]"
    ):
        distamp.load_checkpoint(tmp_path / "c", other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


class _LogitScale(nn.Module):
    """CLIP/SigLIP's habit: a 0-dim trainable parameter (Adam's exp_avg for it is 0-dim too,
    shaped like its parameter and like Adam's 0-dim step counter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.logit_scale


def _logit_scale_run(rank, world, directory, shard, load, steps=2, stepped_before=False):
    torch.manual_seed(0)
    model = _LogitScale()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if stepped_before:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    ddp = DDP(model) if world > 1 else model
    if load:
        distamp.load_checkpoint(directory, model, opt)
    first = 2 if load else 0  # a resume goes on with the batches the straight run had next
    for step in range(first, first + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        with distamp.scale_loss(ddp(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    if not load:
        distamp.save_checkpoint(directory, model, opt)
    return [p.detach().float().clone() for p in model.parameters()]


def test_a_zero_dim_parameter_resumes_and_reshards(tmp_path):
    """Adam's 0-dim step counter and a 0-dim parameter's 0-dim exp_avg were told apart by shape
    alone: replicated checkpoints saved 'step' as element-wise state and never loaded again;
    sharded slices kept exp_avg 0-dim for a (1,) slice and Adam crashed (an audit)."""
    # world 1 (replicated): save after 2 steps, resume 2 more == 4 straight, bit for bit
    straight = run_ranks(_logit_scale_run, 1, str(tmp_path / "s"), None, False, 4)[0]
    run_ranks(_logit_scale_run, 1, str(tmp_path / "a"), None, False)
    resumed = run_ranks(_logit_scale_run, 1, str(tmp_path / "a"), None, True)[0]
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    # the same checkpoint resharded at world 2 (sharded masters), and a world-2 one back to 1
    for params in run_ranks(_logit_scale_run, 2, str(tmp_path / "a"), True, True):
        assert all(p.isfinite().all() for p in params)
    run_ranks(_logit_scale_run, 2, str(tmp_path / "b"), True, False)
    run_ranks(_logit_scale_run, 1, str(tmp_path / "b"), None, True)
    # an optimizer that stepped before wrap, its state sliced into the shards
    run_ranks(_logit_scale_run, 2, str(tmp_path / "c"), True, False, 2, True)


class EmptyPrompt(nn.Module):
    """A zero-element parameter first (nn.Embedding(0, d): no prompt tokens this run)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.prompt = nn.Parameter(torch.zeros(0, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.cat([self.prompt, x])).float()


def _empty_parameter(rank, world, kwargs, directory, load_only):
    model = EmptyPrompt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, verbosity=0, **kwargs)
    if load_only:
        distamp.load_checkpoint(directory, model, opt)
        return {k: v.float() for k, v in model.state_dict().items()}
    ddp = train(model, opt, None, rank, world, 0, 2)
    distamp.save_checkpoint(directory, ddp, opt)
    return {k: v.float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "kwargs",
    [{"opt_level": "O2"}, {"opt_level": "O0", "shard_master_weights": True}, {"opt_level": "O1"}],
    ids=["O2", "O0-shard", "O1"],
)
def test_a_zero_element_parameter_trains_saves_and_reshards(tmp_path, kwargs):
    """wrap's broadcast read a bucket that was never made (IndexError) when the first parameter
    had no elements, and sharded masters took its data_ptr() of 0 for a replaced storage at the
    first step (an audit)."""
    directory = str(tmp_path / "ckpt")
    saved = run_ranks(_empty_parameter, 2, kwargs, directory, False, timeout=120)
    (loaded,) = run_ranks(_empty_parameter, 1, kwargs, directory, True, timeout=120)
    assert saved[0]["prompt"].shape == (0, 6)
    for name, value in saved[0].items():
        assert torch.equal(loaded[name], value), name


def _per_rank_extra_and_paths(rank, world, root, case):
    model = EmptyPrompt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O0", verbosity=0)
    if case == "paths":  # a path built from a per-rank value (a timestamp)
        try:
            distamp.save_checkpoint(os.path.join(root, f"run-{rank}"), model, opt)
        except CheckpointError as exc:
            return str(exc)
        return None
    import warnings

    directory = os.path.join(root, "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a save every few steps: warned once
            distamp.save_checkpoint(directory, model, opt, extra={"epoch": 3, "loader": 7 + rank})
    back = distamp.load_checkpoint(directory, model, opt)
    return back, [str(w.message) for w in caught if "extra" in str(w.message)]


def test_a_per_rank_extra_warns_and_ranks_saving_apart_are_named(tmp_path):
    """A per-rank extra came back as rank 0's on every rank, silently; ranks saving to different
    paths failed with a bare FileNotFoundError (an audit)."""
    results = run_ranks(_per_rank_extra_and_paths, 2, str(tmp_path), "extra")
    for rank, (back, warned) in enumerate(results):
        assert back == {"epoch": 3, "loader": 7}  # rank 0's, as documented
        if rank == 0:  # once, from rank 0 (every rank at every save repeated it: an audit)
            assert len(warned) == 1 and "found ['loader'] different" in warned[0], warned
        else:
            assert warned == [], warned
    messages = run_ranks(_per_rank_extra_and_paths, 2, str(tmp_path), "paths")
    for message in messages:
        assert message is not None and "expected every rank to save to the folder rank 0" in message
        assert re.search(r"run-1\.incomplete-\S+ from rank 1", message), message
        # both folders named (the message gave only rank 1's)
        assert re.search(r"rank 0 saves to \S+run-0, rank 1 to \S+run-1\b", message), message


@pytest.mark.parametrize("saved_enabled", [False, True])
def test_a_checkpoint_saved_with_the_other_enabled_is_refused_saying_so(tmp_path, saved_enabled):
    """apex's `enabled=args.amp` toggled between runs was told about FSDP layouts or loss
    scaler counts (an audit)."""

    def make(enabled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return distamp.wrap(model, opt, opt_level="O2", enabled=enabled, verbosity=0)

    distamp.save_checkpoint(tmp_path / "ckpt", *make(saved_enabled))
    info = distamp.checkpoint.inspect(tmp_path / "ckpt")
    assert info["opt_level"] == ("O2" if saved_enabled else "disabled")
    with pytest.raises(
        CheckpointError, match=f"saved with distamp.wrap\\(..., enabled={saved_enabled}\\)"
    ):
        distamp.load_checkpoint(tmp_path / "ckpt", *make(not saved_enabled))


def _shared_embedding(rank, world, directory):
    torch.manual_seed(0)
    emb = nn.Embedding(20, 8)
    enc, dec = nn.Sequential(emb, nn.Linear(8, 8)), nn.Sequential(emb, nn.Linear(8, 8))
    opt = torch.optim.SGD([*enc.parameters(), *dec[1].parameters()], lr=0.1)
    [enc, dec], opt = distamp.wrap([enc, dec], opt, opt_level="O2", verbosity=0)
    x = torch.randint(0, 20, (4, 3))
    with distamp.scale_loss((enc(x).float().sum() + dec(x).float().sum()) * 1e-3, opt) as s:
        s.backward()
    opt.step()
    distamp.save_checkpoint(directory, [enc, dec], opt)
    return opt.param_groups[0]["params"][0].detach().clone()  # the embedding's FP32 master


def test_consolidate_gives_a_parameter_two_models_share_its_fp32_master_in_both(tmp_path):
    """seq2seq's shared embedding: model 1's alias was named per model and missed the master,
    so it came back rounded to bf16 (an audit)."""
    master = run_ranks(_shared_embedding, 1, str(tmp_path / "ckpt"))[0]
    for index in (0, 1):
        weight = consolidate(tmp_path / "ckpt", index)["0.weight"]
        assert torch.equal(weight, master.view_as(weight)), index


class CheckpointedBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.GELU()) for _ in range(2)))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def _ac_train_and_save(directory, wrapped) -> None:
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = CheckpointedBlocks()
    if wrapped:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            check_fn=lambda m: isinstance(m, nn.Sequential) and len(m) == 2,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    train(model, opt, None, 0, 1, 0, 3)
    distamp.save_checkpoint(directory, model, opt)


def test_activation_checkpoint_wrappers_do_not_rename_the_checkpoint_or_lose_the_masters(tmp_path):
    """torch's CheckpointWrapper strips ``_checkpoint_wrapped_module.`` from state_dict keys but
    not from named_parameters: the manifest's aliases missed, consolidate gave the bf16 weights
    instead of the FP32 masters (9.5e-4 off), and loading into the unwrapped model was refused
    (an audit). Named by state_dict key now, the two checkpoints are the same."""
    _ac_train_and_save(tmp_path / "plain", False)
    _ac_train_and_save(tmp_path / "wrapped", True)
    plain, wrapped = consolidate(tmp_path / "plain"), consolidate(tmp_path / "wrapped")
    assert sorted(plain) == sorted(wrapped)
    for key in plain:
        assert torch.equal(plain[key], wrapped[key]), key
    # Not bf16 values: the FP32 masters.
    assert not torch.equal(wrapped["head.weight"], wrapped["head.weight"].bfloat16().float())
    # The wrapped run's checkpoint loads into the plain model, masters and all.
    net = CheckpointedBlocks()
    net, opt = distamp.wrap(net, torch.optim.AdamW(net.parameters()), opt_level="O2", verbosity=0)
    distamp.load_checkpoint(tmp_path / "wrapped", net, opt)
    distamp.save_checkpoint(tmp_path / "again", net, opt)
    again = consolidate(tmp_path / "again")
    for key in plain:
        assert torch.equal(plain[key], again[key]), key


def test_a_group_added_after_wrap_and_not_added_again_before_load_is_named(tmp_path):
    """The refusal said only "2 param group(s) in the checkpoint, 1 here" (an audit)."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
        return (model, *distamp.wrap(model, opt, opt_level="O2", verbosity=0)[1:])

    model, opt = make()
    opt.add_param_group({"params": list(model[1].parameters())})
    with distamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    distamp.save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fresh_opt = make()
    with pytest.raises(
        CheckpointError,
        match=r"2 param group\(s\) in the checkpoint, 1 here.*"
        r"must be added again, in the same order",
    ):
        distamp.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)


def test_a_model_with_a_layer_more_or_less_is_told_every_key(tmp_path):
    """An audit: the refusal named the first key that differs only ('4.weight'), not its bias
    nor the other layers; torch's load_state_dict lists them all."""
    from distamp import CheckpointError

    def make(layers):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
        return distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)

    distamp.save_checkpoint(tmp_path / "ckpt", *make(2))
    with pytest.raises(CheckpointError) as more:
        distamp.load_checkpoint(tmp_path / "ckpt", *make(3))
    assert "this model has '2.weight'" in str(more.value), more.value
    assert "this model has '2.bias'" in str(more.value), more.value
    with pytest.raises(CheckpointError) as less:
        distamp.load_checkpoint(tmp_path / "ckpt", *make(1))
    assert "the checkpoint has '1.weight', this model does not" in str(less.value), less.value
    assert "the checkpoint has '1.bias'" in str(less.value), less.value


@pytest.mark.filterwarnings("error:get_state and legacy")  # numpy's own, from probing (a review)
def test_numpy_on_another_bit_generator_saves_and_loads_without_its_state(tmp_path):
    """np.random.set_bit_generator(PCG64): every save failed with a bare "too many values to
    unpack", and a load into such a process failed after the weights were replaced (an audit).
    Both now go through, numpy's state left out and said so; torch's RNG is restored."""
    import numpy as np

    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    saved_generator = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.PCG64(3))
        torch.manual_seed(7)
        with pytest.warns(UserWarning, match="numpy's global RNG runs another bit generator"):
            distamp.save_checkpoint(tmp_path / "pcg", model, opt)
        expected = torch.rand(3)
        np.random.set_bit_generator(saved_generator)
        torch.manual_seed(7)
        distamp.save_checkpoint(tmp_path / "mt", model, opt)  # numpy's state saved
        np.random.set_bit_generator(np.random.PCG64(3))
        fresh, fresh_opt, _ = make("O2")
        with pytest.warns(UserWarning, match="the saved MT19937 state is not restored"):
            distamp.load_checkpoint(tmp_path / "mt", fresh, fresh_opt)
        assert torch.equal(torch.rand(3), expected)
        fresh, fresh_opt, _ = make("O2")
        distamp.load_checkpoint(tmp_path / "pcg", fresh, fresh_opt)
        assert torch.equal(torch.rand(3), expected)
        assert_same(dict(fresh.named_parameters()), dict(model.named_parameters()))
    finally:
        np.random.set_bit_generator(saved_generator)


def _rng_at_another_world(rank, world, path):
    model, opt, sched = make("O2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distamp.load_checkpoint(path, model, opt)
    return [str(w.message) for w in caught if "RNG states" in str(w.message)]


def test_loading_at_another_world_size_says_the_rng_is_not_restored(tmp_path):
    """Each rank silently kept its own RNG (identical dropout masks on every rank after a
    model built under one seed; an audit): rank 0 says so, with what to do."""
    model, opt, sched = make("O2")
    train(model, opt, sched, 0, 1, 0, 2)
    distamp.save_checkpoint(tmp_path / "c", model, opt)
    first, second = run_ranks(_rng_at_another_world, 2, str(tmp_path / "c"))
    assert len(first) == 1 and "saved at 1 ranks, loaded at 2" in first[0], first
    assert "torch.manual_seed(seed + rank)" in first[0] and second == []


# -- sparse gradients ---------------------------------------------------------------------------


def _sparse_resume(rank, world, directory, level):
    def make():
        torch.manual_seed(0)
        model = nn.ModuleDict({"emb": nn.Embedding(16, 4, sparse=True), "head": nn.Linear(4, 2)})
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return distamp.wrap(model, opt, opt_level=level, verbosity=0)

    def steps(model, opt, first, last):
        for step in range(first, last):
            ids = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(step))
            out = model["head"](model["emb"](ids)).float()
            with distamp.scale_loss(F.mse_loss(out, torch.ones(6, 2)), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    steps(model, opt, 0, 2)
    distamp.save_checkpoint(directory, model, opt)
    steps(model, opt, 2, 4)
    again, again_opt = make()
    distamp.load_checkpoint(directory, again, again_opt)
    steps(again, again_opt, 2, 4)
    return [[p.detach().float().clone() for p in m.parameters()] for m in (model, again)]


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_sparse_momentum_saves_and_resumes(tmp_path, level):
    """SGD's momentum for nn.Embedding(sparse=True) is a sparse tensor: DCP could not write it
    ("Cannot access storage of SparseTensorImpl") and O2's flat masters could not reshape it (an
    audit). Saved dense, which SGD takes back: the resumed run continues the straight one (at
    O3, whose momentum is bf16, within a bf16 rounding: the dense add rounds otherwise)."""
    ((straight, resumed),) = run_ranks(_sparse_resume, 1, str(tmp_path / "c"), level)
    for a, b in zip(straight, resumed, strict=True):
        torch.testing.assert_close(b, a, atol=2e-2 if level == "O3" else 1e-6, rtol=0)


# -- torch's own checkpoint idiom ---------------------------------------------------------------


def _dcp_get_state_dict(rank, world, level, shard, trained):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, _ = make(level, shard=shard)
    if trained:
        train(model, opt, None, rank, world, 0, 1)
    try:
        get_state_dict(model, opt)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("level,shard,world", [("O2", None, 2), ("O2", False, 1), ("O0", True, 2)])
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
def test_dcp_get_state_dict_over_masters_is_refused_by_name(level, shard, world, trained):
    """DCP maps optimizer state to the model's parameter names; over FP32 masters or shards it
    failed with a bare "KeyError: 0" inside torch, or (fresh: its placeholder step) distamp's
    "no gradients" (an audit). Refused, naming what the optimizer steps and what to use."""
    for message in run_ranks(_dcp_get_state_dict, world, level, shard, trained, timeout=120):
        assert message is not None and "expected an optimizer that steps the model's own" in message
        assert "distamp.save_checkpoint" in message
        what = "FP32 master weights" if level == "O2" else "shards of the FP32 weights"
        assert what in message, message
