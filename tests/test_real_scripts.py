"""Training loops shaped like the ones users copy, with distamp's three lines added.

``nanogpt_train`` follows nanoGPT's train.py: a per-rank seed before the model is built, a
``get_batch`` drawing offsets from the global RNG, gradient accumulation with
``model.require_backward_grad_sync``, a cosine learning rate written into the param groups,
``unscale_`` then ``torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)``,
``zero_grad(set_to_none=True)``, checkpoints at an interval and resume. ``llama_train`` follows a
Hugging Face-style loop (``outputs = model(input_ids, labels=labels); outputs["loss"]``). Each
runs at world 2 under O1 and O2 (nanoGPT also with the reduce-scatter hook) and is compared with the same script in plain FP32 (no distamp).
"""

import math
import os
import warnings

import pytest
import torch
from asserts import assert_same
from dist_harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP
from user_models import GPTConfig, LlamaConfig, NanoGPT, TinyLlama

import distamp

pytestmark = pytest.mark.xdist_group("real_scripts")

# nanoGPT's knobs, scaled down
MAX_ITERS = 8
GRAD_ACCUM = 2
BATCH = 2
BLOCK = 16
LEARNING_RATE = 2e-2
MIN_LR = 2e-3
WARMUP = 2
GRAD_CLIP = 1.0


def _dataset():
    gen = torch.Generator().manual_seed(42)
    # a learnable stream: repeated random phrases
    phrases = torch.randint(0, 61, (8, 12), generator=gen)
    order = torch.randint(0, 8, (400,), generator=gen)
    return phrases[order].reshape(-1)


def _get_lr(it):
    if it < WARMUP:
        return LEARNING_RATE * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / (MAX_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


def nanogpt_train(rank, world, level, out_dir, stop, resume, save_at):
    """nanoGPT's train.py, DDP branch, with distamp added (``level=None``: plain FP32)."""
    seed_offset = rank
    torch.manual_seed(1337 + seed_offset)
    data = _dataset()

    def get_batch():
        ix = torch.randint(len(data) - BLOCK, (BATCH,))
        x = torch.stack([data[i : i + BLOCK] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])
        return x, y

    model = NanoGPT(GPTConfig(block_size=BLOCK))
    optimizer = model.configure_optimizers(0.1, LEARNING_RATE, (0.9, 0.95))
    if level is not None:
        # "O2-rs": O2 with the reduce-scatter hook (hooks.register(..., reduce_scatter=True));
        # "O2-ov": that, with the weight gather overlapped with the next forward; "O0-zo": FP32
        # weights sharded (shard_master_weights=True), that path with bf16 updates gathered.
        opt_level = level.split("-")[0]
        shard = {"shard_master_weights": True} if level == "O0-zo" else {}
        model, optimizer = distamp.wrap(model, optimizer, opt_level=opt_level, verbosity=0, **shard)
    iter_num = 0
    state_at_start = None
    if resume:
        extra = distamp.load_checkpoint(distamp.latest_checkpoint(out_dir), model, optimizer)
        iter_num = extra["iter_num"]
        state_at_start = _state(model, optimizer)
    model = DDP(model)
    if level is not None and level.endswith(("-rs", "-ov")):
        overlap = level.endswith("-ov")
        distamp.hooks.register(model, optimizer, reduce_scatter=True, overlap_gather=overlap)
    if level == "O0-zo":
        distamp.hooks.register(
            model, optimizer, reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16
        )
    raw_model = model.module
    X, Y = get_batch()
    losses = []
    while iter_num < stop:
        lr = _get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(GRAD_ACCUM):
            model.require_backward_grad_sync = micro_step == GRAD_ACCUM - 1
            logits, loss = model(X, Y)
            loss = loss / GRAD_ACCUM
            X, Y = get_batch()
            if level is None:
                loss.backward()
            else:
                with distamp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
        if GRAD_CLIP != 0.0:
            if level is not None:
                distamp.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * GRAD_ACCUM)
        iter_num += 1
        if level is not None and iter_num == save_at:
            saved_state = _state(raw_model, optimizer)
            distamp.save_checkpoint(
                os.path.join(out_dir, f"ckpt_{iter_num}"),
                raw_model,
                optimizer,
                extra={"iter_num": iter_num},
            )
    return {
        "losses": losses,
        "params": [v.detach().float().clone() for v in raw_model.state_dict().values()],
        "saved_state": saved_state if save_at is not None else None,
        "state_at_start": state_at_start,
    }


def _state(model, optimizer):
    """Weights, FP32 masters and optimizer state, as this rank holds them."""
    masters = optimizer._distamp.masters.master_tensors()
    inner = [
        {k: v.clone() for k, v in optimizer.state.get(p, {}).items()}
        for group in optimizer.param_groups
        for p in group["params"]
    ]
    stats = distamp.stats(optimizer)
    return {
        # through state_dict(), as nanoGPT reads them (it waits for an overlapped gather)
        "params": [v.detach().clone() for v in model.state_dict().values()],
        "masters": [m.detach().clone() for m in masters],
        "optimizer": inner,
        "counters": (stats.steps, stats.skipped_steps, stats.loss_scales),
    }


def llama_train(rank, world, level):
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if level is not None:
        # "O1-zo": O1 with its FP32 weights sharded, reduce-scattered, bf16 updates gathered
        # while the next forward runs (RMSNorm, rotary tables and all).
        shard = {"shard_master_weights": True} if level == "O1-zo" else {}
        opt_level = level.split("-")[0]
        model, optimizer = distamp.wrap(model, optimizer, opt_level=opt_level, verbosity=0, **shard)
    model = DDP(model)
    if level == "O1-zo":
        distamp.hooks.register(
            model, optimizer, reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16
        )
    gen = torch.Generator().manual_seed(10 + rank)
    phrases = torch.randint(0, 53, (4, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(MAX_ITERS):
        input_ids = phrases[torch.randint(0, 4, (BATCH,), generator=gen)]
        outputs = model(input_ids, labels=input_ids)
        if level is None:
            outputs["loss"].backward()
        else:
            with distamp.scale_loss(outputs["loss"], optimizer) as scaled_loss:
                scaled_loss.backward()
            distamp.clip_grad_norm_(optimizer, 1.0)
        if level is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs["loss"].item())
    return losses


def _first_runs(rank, world, root):
    out = {"fp32": nanogpt_train(rank, world, None, None, MAX_ITERS, False, None)}
    for level in ("O1", "O2", "O2-rs", "O2-ov", "O0-zo"):
        out[level] = nanogpt_train(
            rank, world, level, os.path.join(root, level), MAX_ITERS, False, MAX_ITERS // 2
        )
    out["llama"] = {level: llama_train(rank, world, level) for level in (None, "O1", "O2", "O1-zo")}
    return out


def _resumed_runs(rank, world, root):
    return {
        level: nanogpt_train(rank, world, level, os.path.join(root, level), MAX_ITERS, True, None)
        for level in ("O1", "O2", "O2-rs", "O2-ov", "O0-zo")
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("real_scripts"))
    first = run_ranks(_first_runs, 2, root, timeout=400)
    resumed = run_ranks(_resumed_runs, 2, root, timeout=300)  # new processes, as after a restart
    return first, resumed


@pytest.mark.parametrize("level", ["O1", "O2", "O2-rs", "O2-ov", "O0-zo"])
def test_nanogpt_script_trains_like_fp32(runs, level):
    first, _ = runs
    fp32, amp = first[0]["fp32"]["losses"], first[0][level]["losses"]
    assert fp32[-1] < fp32[0] * 0.95 and amp[-1] < amp[0] * 0.95  # it learns
    # Stated tolerance: BF16 compute changes each loss by well under 3% over 8 iterations.
    for a, b in zip(amp, fp32, strict=True):
        assert a == pytest.approx(b, rel=0.03)


@pytest.mark.parametrize("level", ["O1", "O2", "O2-rs", "O2-ov", "O0-zo"])
def test_nanogpt_script_ranks_agree_and_resume_exactly(runs, level):
    first, resumed = runs
    for rank in range(2):
        for p, q in zip(first[rank][level]["params"], first[0][level]["params"], strict=True):
            assert torch.equal(p, q)  # per-rank seeds, yet one model
        # The processes restart from the checkpoint: weights, masters, optimizer state and
        # counters are exactly those saved ...
        assert_same(resumed[rank][level]["state_at_start"], first[rank][level]["saved_state"])
        # ... and training goes on. (nanoGPT prefetches a batch before its loop, so after a
        # restart its data stream is one batch further on than in the straight run: close, not
        # bit-identical. Bit-exact resume of data and all is tested in test_checkpoint.py.)
        for a, b in zip(
            resumed[rank][level]["losses"],
            first[rank][level]["losses"][MAX_ITERS // 2 :],
            strict=True,
        ):
            assert a == pytest.approx(b, rel=0.05)


@pytest.mark.parametrize("level", ["O1", "O2", "O1-zo"])
def test_llama_script_trains_like_fp32(runs, level):
    first, _ = runs
    fp32, amp = first[0]["llama"][None], first[0]["llama"][level]
    assert fp32[-1] < fp32[0] * 0.9
    for a, b in zip(amp, fp32, strict=True):
        assert a == pytest.approx(b, rel=0.03)


def _rank0_saves_optimizer(rank, world, path, shard):
    """nanoGPT's own checkpoint habit: rank 0 torch.saves optimizer.state_dict(), every rank
    loads that one file."""
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(block_size=BLOCK))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    model, optimizer = distamp.wrap(
        model, optimizer, opt_level="O2", shard_master_weights=shard, verbosity=0
    )
    # accelerate's prepare() round-trips the state dict before any step: that used up the
    # one-shot warning, and the real save below said nothing (an audit)
    optimizer.load_state_dict(optimizer.state_dict())
    idx = torch.randint(0, 61, (2, BLOCK))
    _, loss = model(idx, idx)
    with distamp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()

    class AcceleratedOptimizer:  # accelerate's, duck-typed: prepare() after a load_checkpoint
        def __init__(self, optimizer):
            optimizer.load_state_dict(optimizer.state_dict())  # its device placement

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is saved: no warning (an audit: it warned)
        AcceleratedOptimizer(optimizer)
    warned = []
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.save({"optimizer": optimizer.state_dict()}, path)
        warned = [str(w.message) for w in caught if "optimizer.state_dict()" in str(w.message)]
    torch.distributed.barrier()
    checkpoint = torch.load(path, weights_only=True)
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
    except ValueError as exc:
        return str(exc), warned
    return "loaded", warned


def test_rank0_optimizer_state_dict_is_refused_on_every_rank_with_sharded_masters(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    results = run_ranks(_rank0_saves_optimizer, 2, path, True, timeout=120)
    for message, _ in results:  # no hang, no silent mix of shards: every rank raises, naming rank 1
        assert "rank 1: optimizer.load_state_dict: the state dict holds rank 0's shard" in message
        assert "distamp.save_checkpoint" in message
    # ... and the save itself says so, when the other shards can still be saved (an audit)
    (warned,) = results[0][1]
    assert "holds this rank's shard" in warned and "cannot be resumed" in warned, warned
    replicated = run_ranks(_rank0_saves_optimizer, 2, path, False, timeout=120)
    assert replicated == [("loaded", []), ("loaded", [])]
