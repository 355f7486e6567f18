"""ZeRO-1 for FP32 weights: O0/O1 wrapped with ``shard_master_weights=True``.

Each rank holds the FP32 copy and the optimizer state of its shard of the weights and steps only
that; the updated weights are all-gathered (see [Note: sharded FP32 weights] in distamp/masters/sharded.py).
Held against the unsharded run of the same opt_level (bit for bit: the same element-wise
arithmetic), against the 16-bit all-reduce hook (bit for bit at 2 ranks), against a global skip
on an inf on one rank only, and through checkpoints at other world sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp
from distamp.checkpoint import consolidate, consolidate_optimizer_state
from tests.asserts import assert_same
from tests.dist_harness import run_ranks

pytestmark = pytest.mark.xdist_group("multirank")


class Net(nn.Module):
    """An embedding tied to the head, LayerNorms, a frozen parameter, a parameter in the
    optimizer that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
            for _ in range(2)
        )
        self.frozen = nn.Parameter(torch.randn(24) * 0.1, requires_grad=False)
        self.head = nn.Linear(24, 40, bias=False)
        self.head.weight = self.emb.weight  # tied, as in GPT-2
        self.unused = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.frozen
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return torch.randint(0, 40, (4, 6), generator=g), torch.randint(0, 40, (4, 6), generator=g)


def _make(level: str, sharded: bool, opt_name: str = "adamw", half=torch.bfloat16):
    model = Net()
    groups = [
        {"params": [model.emb.weight, model.frozen, *model.blocks[0].parameters()], "lr": 2e-2},
        {"params": [*model.blocks[1].parameters(), *model.unused.parameters()]},
    ]
    opt = OPTIMIZERS[opt_name](groups)
    kwargs = {"shard_master_weights": True} if sharded else {}
    return distamp.wrap(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kwargs)


def _train(
    rank: int,
    world: int,
    level: str,
    sharded: bool,
    *,
    opt_name: str = "adamw",
    hook: str = "none",
    steps: int = 5,
    half: torch.dtype = torch.bfloat16,
    inf_at: tuple[int, int] | None = None,
    torch_clip: bool = False,
    clip: float | None = None,
    bucket_view: bool = False,
) -> dict:
    """``hook``: "none" (DDP's FP32 all-reduce), "ar" (distamp's 16-bit all-reduce hook), "rs"
    (reduce-scatter into the shards, the gather overlapped with the next forward);
    ``bucket_view``: DDP's ``gradient_as_bucket_view`` (the ``.grad`` are views into its buckets)."""
    model, opt = _make(level, sharded, opt_name, half)
    ddp = DDP(
        model, bucket_cap_mb=0.01, find_unused_parameters=True, gradient_as_bucket_view=bucket_view
    )
    state = None
    if hook == "ar":
        state = distamp.hooks.register(ddp, opt)
    elif hook == "rs":
        state = distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    history, losses, norms = [], [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
        losses.append(loss.item())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if inf_at == (step, rank):
            model.blocks[1][1].weight.grad[0, 0] = float("inf")
        if torch_clip:
            distamp.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if clip is not None:
            norms.append(distamp.clip_grad_norm_(opt, clip).item())
        opt.step()
        opt.zero_grad()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    s = distamp.stats(opt)
    return {
        "history": history,
        "losses": losses,
        "norms": norms,
        "dtypes": {str(p.dtype) for p in model.parameters()},
        "skipped": s.skipped_steps,
        "scale": s.loss_scales[0],
        "master_bytes": s.master_bytes,
        "state_bytes": s.optimizer_state_bytes,
        "bytes": getattr(state, "bytes_on_wire", 0),
    }


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# Parameters in the optimizer, by group (the tied head is the embedding): every one is FP32, so
# every one is sharded, LayerNorms included.
BLOCK_ELEMENTS = (24 + 24) + (24 * 48 + 48) + (48 * 24 + 24)  # LayerNorm, two Linears
GROUP_ELEMENTS = (40 * 24 + 24 + BLOCK_ELEMENTS, BLOCK_ELEMENTS + 24 * 24 + 24)


def _sharded_and_not(rank: int, world: int, level: str) -> dict:
    return {
        (name, sharded): _train(rank, world, level, sharded, opt_name=name)
        for name in OPTIMIZERS
        for sharded in (True, False)
    }


@pytest.mark.parametrize(
    "level,world,shard_block",
    [("O0", 1, None), ("O0", 2, None), ("O0", 3, None), ("O0", 3, 4), ("O1", 3, 4)],
    indirect=["shard_block"],
    ids=["O0-world1", "O0-world2", "O0-world3", "O0-world3-blocks-4", "O1-world3-blocks-4"],
)
def test_sharded_fp32_weights_train_bit_for_bit_like_unsharded(level, world, shard_block):
    """The same element-wise arithmetic on slices of the weights: identical weights after every
    step, on every rank, for SGD with momentum, AdamW and Adagrad; the weights stay FP32; each rank
    holds 1/N of the FP32 copies and of the optimizer state."""
    out = run_ranks(_sharded_and_not, world, level)
    for name in OPTIMIZERS:
        for rank, result in enumerate(out):
            sharded, plain = result[(name, True)], result[(name, False)]
            assert sharded["dtypes"] == {"torch.float32"}
            for step, (a, b) in enumerate(zip(sharded["history"], plain["history"], strict=True)):
                assert _max_diff(a, b) == 0.0, (name, rank, step)
            assert _max_diff(sharded["history"][-1], out[0][(name, True)]["history"][-1]) == 0.0
            # The weights moved (a no-op step would also be "equal").
            first = sharded["history"][0]["blocks.0.1.weight"]
            assert (sharded["history"][-1]["blocks.0.1.weight"] - first).abs().max() > 1e-3
            # Memory: this rank's FP32 copies are its shard, ceil(total / N) per group.
            assert sharded["master_bytes"] == 4 * sum(-(-n // world) for n in GROUP_ELEMENTS)
            assert plain["master_bytes"] == 0  # unsharded O0/O1: the weights are their own
        if world > 1 and name != "sgd" and shard_block is None:
            # Element-wise state (Adam's two moments, Adagrad's sum) is split between the ranks
            # (with blocks of 4 elements every slice also carries its own 4-byte step count).
            total = sum(r[(name, True)]["state_bytes"] for r in out)
            assert total < 1.1 * out[0][(name, False)]["state_bytes"], name
            assert max(r[(name, True)]["state_bytes"] for r in out) < (
                1.2 * out[0][(name, False)]["state_bytes"] / world
            ), name
    frozen = out[0][("adamw", True)]["history"][-1]["frozen"]
    assert torch.equal(frozen, Net().frozen)  # in the optimizer, never stepped


def _rs_and_ar(rank: int, world: int, level: str, opt_name: str, torch_clip: bool) -> dict:
    kw = {"opt_name": opt_name, "torch_clip": torch_clip}
    # Each side once with DDP's grads as views into its buckets (what a fast script asks for).
    return {
        "rs": _train(rank, world, level, True, hook="rs", bucket_view=world == 2, **kw),
        "ar": _train(rank, world, level, False, hook="ar", bucket_view=world == 3, **kw),
    }


@pytest.mark.parametrize("level", ["O0", "O1"])
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_with_overlapped_gather_equals_the_16bit_all_reduce_hook(level, world):
    """Gradients reduce-scattered in bf16 into the shards, FP32 weights gathered while the next
    forward runs, against distamp's bf16 all-reduce hook on unsharded weights: bit for bit at 2
    ranks (the sum of two addends is rounded once either way; torch's clipping after unscale_
    included; DDP's gradient_as_bucket_view on one side); at 3 ranks the bf16 sums are rounded in another order: within 2e-3 after 5 SGD
    steps (a wrong reduction moves weights by ~1e-2 per step)."""
    opt_name = "adamw" if world == 2 else "sgd"
    out = run_ranks(_rs_and_ar, world, level, opt_name, world == 2)
    for r in out:
        assert _max_diff(r["rs"]["history"][-1], out[0]["rs"]["history"][-1]) == 0.0
    rs, ar = out[0]["rs"], out[0]["ar"]
    diff = _max_diff(rs["history"][-1], ar["history"][-1])
    if world == 2:
        assert rs["losses"] == ar["losses"]
        assert diff == 0.0
    else:
        assert diff <= 2e-3
    # The gradients went out in bf16, reduce-scattered: no more bytes than the 16-bit all-reduce.
    assert 0 < rs["bytes"] <= ar["bytes"]


def _clipped(rank: int, world: int) -> dict:
    kw = {"opt_name": "sgd", "clip": 0.05, "hook": "none"}
    return {sharded: _train(rank, world, "O0", sharded, **kw) for sharded in (True, False)}


def test_clip_grad_norm_uses_the_global_norm_across_the_shards():
    """distamp.clip_grad_norm_ on sharded FP32 weights: every rank gets the same global norm, the
    unsharded one up to the order of the shards' sums of squares (stated tolerance: 1e-5
    relative), and the clipped steps land within 1e-6 of the unsharded ones."""
    out = run_ranks(_clipped, 3)
    assert out[0][True]["norms"] == out[1][True]["norms"] == out[2][True]["norms"]
    assert len(out[0][True]["norms"]) == 5 and min(out[0][True]["norms"]) > 0.05  # it clipped
    for a, b in zip(out[0][True]["norms"], out[0][False]["norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert _max_diff(out[0][True]["history"][-1], out[0][False]["history"][-1]) < 1e-6


def _inf(rank: int, world: int) -> dict:
    kw = {"half": torch.float16, "steps": 4}
    return {
        "rs": _train(rank, world, "O1", True, hook="rs", inf_at=(2, 1), **kw),
        "ar": _train(rank, world, "O1", False, hook="ar", inf_at=(2, 1), **kw),
        "clean": _train(rank, world, "O1", True, hook="rs", **kw),
    }


def test_an_inf_on_one_rank_only_skips_every_rank():
    """O1 with fp16 (dynamic loss scale): an inf written into rank 1's gradient of a weight rank
    0 owns part of skips the step on both ranks and halves the scale, as unsharded. (This model's
    fp16 gradients also overflow by themselves at the first scale: the run without the inf is the
    baseline.)"""
    out = run_ranks(_inf, 2)
    for r in out:
        assert r["rs"]["skipped"] == r["ar"]["skipped"] == r["clean"]["skipped"] + 1
        assert r["rs"]["scale"] == r["ar"]["scale"] == r["clean"]["scale"] / 2
        assert _max_diff(r["rs"]["history"][2], r["rs"]["history"][1]) == 0.0  # skipped: unchanged
        assert _max_diff(r["clean"]["history"][2], r["clean"]["history"][1]) > 0.0
        assert _max_diff(r["rs"]["history"][-1], r["ar"]["history"][-1]) == 0.0
    assert _max_diff(out[1]["rs"]["history"][-1], out[0]["rs"]["history"][-1]) == 0.0


# -- checkpoints ------------------------------------------------------------------------------


def _run(
    rank: int,
    world: int,
    first: int,
    last: int,
    load: str,
    save: str,
    gather_dtype: torch.dtype | None = None,
    hook: str = "rs",
    sharded: bool = True,
) -> dict:
    """Steps [first, last) of O0 (weights sharded unless ``sharded=False``). ``hook``: "rs"
    (reduce-scatter, overlapped gather), "ar" (the bf16 all-reduce hook, the gather after the
    step) or "none" (DDP's FP32 all-reduce: sharded and unsharded train bit for bit alike)."""
    model, opt = _make("O0", sharded)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True) if world > 1 else model
    if world > 1 and hook != "none":
        rs = hook == "rs"
        distamp.hooks.register(
            ddp, opt, reduce_scatter=rs, overlap_gather=rs, gather_dtype=gather_dtype
        )
    if load:
        distamp.load_checkpoint(load, model, opt)
    for step in range(first, last):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    if save:
        distamp.save_checkpoint(save, model, opt, extra={"step": last})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("gather", [None, torch.bfloat16], ids=["fp32-gather", "bf16-updates"])
def test_resume_in_new_processes_is_bit_exact(tmp_path, gather):
    half = str(tmp_path / "half")
    straight = run_ranks(_run, 2, 0, 4, "", "", gather)
    run_ranks(_run, 2, 0, 2, "", half, gather)
    resumed = run_ranks(_run, 2, 2, 4, half, "", gather)  # new processes
    for rank in range(2):
        assert _max_diff(resumed[rank], straight[rank]) == 0.0


def test_a_checkpoint_loads_at_other_world_sizes(tmp_path):
    """Saved by 2 ranks, loaded by 1 and by 3 and saved again: the same FP32 weights and
    optimizer state (the canonical layout does not depend on the world size)."""
    saved = str(tmp_path / "w2")
    run_ranks(_run, 2, 0, 3, "", saved)
    weights, state = consolidate(saved), consolidate_optimizer_state(saved)
    assert state["blocks.0.1.weight"]["step"] == 3
    for world in (1, 3):
        again = str(tmp_path / f"w2-at{world}")
        run_ranks(_run, world, 3, 3, saved, again)
        assert_same(consolidate(again), weights, f"weights at world {world}")
        assert_same(consolidate_optimizer_state(again), state, f"state at world {world}")


def _without_copies(state: dict) -> dict:
    return {name: {k: v for k, v in per.items() if k != "master"} for name, per in state.items()}


@pytest.mark.parametrize("saved_sharded", [True, False], ids=["sharded->plain", "plain->sharded"])
def test_sharded_and_unsharded_fp32_weights_load_each_others_checkpoints(tmp_path, saved_sharded):
    """[Note: sharded and unsharded FP32 weights load each other]: a checkpoint of O0 with sharded
    weights resumes unsharded (at 2 ranks and at 1), and back at 3 ranks; the state comes through
    unchanged, and training goes on bit for bit as if nothing had been switched (2 ranks)."""
    saved = str(tmp_path / "saved")
    straight = run_ranks(_run, 2, 0, 5, "", "", None, "none", saved_sharded)
    run_ranks(_run, 2, 0, 3, "", saved, None, "none", saved_sharded)
    weights, state = consolidate(saved), consolidate_optimizer_state(saved)
    other = not saved_sharded
    resumed = run_ranks(_run, 2, 3, 5, saved, "", None, "none", other)
    for rank in range(2):
        assert _max_diff(resumed[rank], straight[rank]) == 0.0
    for world in (1, 3):
        again = str(tmp_path / f"at{world}")
        run_ranks(_run, world, 3, 3, saved, again, None, "none", other)
        assert_same(consolidate(again), weights, f"weights at world {world}")
        # (A sharded checkpoint also lists each parameter's FP32 copy, which is its weight.)
        assert_same(_without_copies(consolidate_optimizer_state(again)), _without_copies(state))


# -- what users do to the weights and the optimizer -------------------------------------------


def _user_habits(rank: int, world: int, sharded: bool) -> dict:
    """``model.load_state_dict`` after wrap reaches the sharded FP32 copies, and a param group
    added with ``add_param_group`` is sharded and trained."""
    model = Net()
    later = list(model.blocks[1].parameters())
    first = [p for p in model.parameters() if all(p is not q for q in later)]
    opt = torch.optim.SGD(first, lr=0.1, momentum=0.9)
    kw = {"shard_master_weights": True} if sharded else {}
    model, opt = distamp.wrap(model, opt, opt_level="O0", verbosity=0, **kw)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    if sharded:
        distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    else:
        distamp.hooks.register(ddp, opt, dtype=torch.bfloat16)
    torch.manual_seed(7)
    loaded = {k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()}
    loaded["head.weight"] = loaded["emb.weight"]  # tied: one tensor under two names
    model.load_state_dict(loaded)

    def step(n: int) -> None:
        x, y = _batch(rank, n)
        loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()

    for group in opt.param_groups:
        group["lr"] = 0.0
    step(0)  # lr 0: the step writes the sharded copies back; they must be the loaded values
    after_load = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for group in opt.param_groups:
        group["lr"] = 0.1
    opt.add_param_group({"params": later, "lr": 0.05})
    before = model.blocks[1][1].weight.detach().clone()
    for n in range(1, 4):
        step(n)
    return {
        "after_load": after_load,
        "loaded": loaded,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "moved": (model.blocks[1][1].weight - before).abs().max().item(),
        "groups": len(getattr(opt._distamp.masters, "groups", [])),
    }


def _habits_both(rank: int, world: int) -> dict:
    return {sharded: _user_habits(rank, world, sharded) for sharded in (True, False)}


def test_load_state_dict_reaches_the_shards_and_an_added_group_is_sharded():
    out = run_ranks(_habits_both, 2)
    for r in out:
        sharded, plain = r[True], r[False]
        assert _max_diff(sharded["after_load"], sharded["loaded"]) == 0.0
        assert sharded["groups"] == 2  # the added group was laid out as a second sharded group
        assert sharded["moved"] > 1e-4  # and it trains ...
        # ... exactly as unsharded O0 with the bf16 all-reduce hook (2 ranks: bit for bit).
        assert _max_diff(sharded["final"], plain["final"]) == 0.0
        assert _max_diff(sharded["final"], out[0][True]["final"]) == 0.0


# -- 16-bit updates (hooks.register(..., gather_dtype=torch.bfloat16)) ------------------------


def _updates(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, gather in (("exact", None), ("bf16", torch.bfloat16)):
        directory = f"{root}/{name}"
        weights = _run(rank, world, 0, 20, "", directory, gather)
        out[name] = weights
    # The same 16-bit updates after the bf16 all-reduce hook (no reduce-scatter, no overlap).
    out["bf16-ar"] = _run(rank, world, 0, 20, "", "", torch.bfloat16, "ar")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_updates_keep_identical_fp32_weights_close_to_the_exact_gather(tmp_path, world):
    """[Note: 16-bit updates of FP32 weights]: half the bytes of the FP32 gather; every rank holds
    the same FP32 weights, each owner's FP32 copy is exactly the weight every rank holds (the
    checkpoint's copies are the model's weights, bit for bit), and 20 AdamW steps (lr 2e-2/1e-2)
    end within 5e-3 of the exact gather (measured 1.1e-3 after 30 steps; each update is rounded
    to bf16, 2**-8 relative, never the weight)."""
    out = run_ranks(_updates, world, str(tmp_path))
    for r in out:
        for name in ("exact", "bf16"):
            assert _max_diff(r[name], out[0][name]) == 0.0  # one model on every rank
            assert r[name]["blocks.0.1.weight"].dtype == torch.float32
    for name in ("exact", "bf16"):
        copies = consolidate(tmp_path / name)
        assert _max_diff({k: copies[k] for k in out[0][name]}, out[0][name]) == 0.0, name
    diff = _max_diff(out[0]["bf16"], out[0]["exact"])
    assert 0.0 < diff < 5e-3
    # Without the reduce-scatter hook: the same at 2 ranks (one rounding of a two-addend sum
    # either way); at 3 the bf16 sums round in another order, which 20 AdamW steps (normalized:
    # a gradient rounded to ~0 on one path takes a full lr step on the other) turn into < 5e-2
    # (measured 2.0e-2; a lost or doubled bucket moves weights by ~lr = 1e-2 per step).
    for r in out:
        assert _max_diff(r["bf16-ar"], out[0]["bf16-ar"]) == 0.0
    ar_diff = _max_diff(out[0]["bf16-ar"], out[0]["bf16"])
    assert ar_diff == 0.0 if world == 2 else ar_diff < 5e-2


def _refused_gather(rank: int, world: int) -> dict:
    messages = {}
    for name, level, sharded, dtype in (
        ("O2", "O2", True, torch.bfloat16),
        ("unsharded O0", "O0", False, torch.bfloat16),
        ("fp16", "O0", True, torch.float16),
    ):
        model, opt = _make(level, sharded)
        ddp = DDP(model, find_unused_parameters=True)
        try:
            distamp.hooks.register(ddp, opt, reduce_scatter=sharded, gather_dtype=dtype)
            messages[name] = "not refused"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def test_gather_dtype_is_refused_where_it_does_not_apply():
    for messages in run_ranks(_refused_gather, 2):
        assert "expected sharded FP32 weights" in messages["O2"]
        assert "gathered in the half dtype already" in messages["O2"]
        assert "not sharded" in messages["unsharded O0"]
        assert "must be torch.bfloat16" in messages["fp16"] and "float16" in messages["fp16"]


def _backward(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One forward and backward through ``scale_loss`` (the gradients for the next step)."""
    with distamp.scale_loss(
        nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten()), opt
    ) as s:
        s.backward()


def _load_submodule_right_after_step(
    rank: int, world: int, gather: torch.dtype | None, level: str = "O0"
) -> dict:
    """A step returns with its gather in flight (overlap_gather); loading one block's weights
    right then must win over the gather still arriving (the weights and the FP32 copies alike)."""
    model, opt = _make(level, True)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True, gather_dtype=gather)
    x, y = _batch(rank, 0)
    _backward(ddp, opt, x, y)
    opt.step()
    opt.zero_grad()
    torch.manual_seed(3)
    block = model.blocks[0]
    loaded = {k: torch.randn_like(v) for k, v in block.state_dict().items()}
    block.load_state_dict(loaded)  # the submodule only: the root's own pre-hook does not run
    for group in opt.param_groups:
        group["lr"] = 0.0
    _backward(ddp, opt, x, y)
    opt.step()  # lr 0: writes the FP32 copies back into the weights
    live = block.state_dict(keep_vars=True)
    return {
        "block": {k: v.detach().clone() for k, v in block.state_dict().items()},
        # O2: the bf16 weights hold the loaded FP32 values rounded once (its state_dict reports
        # them as FP32; the FP32 masters hold the loaded values, rewritten by the lr-0 step).
        "loaded": {k: v.to(live[k].dtype).float() for k, v in loaded.items()},
    }


@pytest.mark.parametrize(
    "level,gather",
    [("O0", None), ("O0", torch.bfloat16), ("O2", None)],
    ids=["O0-fp32-gather", "O0-bf16-updates", "O2"],
)
def test_loading_a_submodule_while_the_gather_is_in_flight_keeps_the_loaded_weights(level, gather):
    for r in run_ranks(_load_submodule_right_after_step, 2, gather, level):
        assert _max_diff(r["block"], r["loaded"]) == 0.0


def _read_submodule_right_after_step(rank: int, world: int) -> dict:
    """``block.state_dict()`` right after step() (the bf16 updates still in flight: they reach
    the weights only when waited for) reads the updated weights, as the root's does."""
    model, opt = _make("O0", True)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    state = distamp.hooks.register(
        ddp, opt, reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16
    )
    before = {k: v.clone() for k, v in model.blocks[1].state_dict().items()}
    x, y = _batch(rank, 0)
    _backward(ddp, opt, x, y)
    opt.step()
    right_after = {k: v.clone() for k, v in model.blocks[1].state_dict().items()}
    state.finish_gather()
    settled = {k: v.clone() for k, v in model.blocks[1].state_dict().items()}
    return {"before": before, "right_after": right_after, "settled": settled}


def test_a_submodule_state_dict_right_after_step_waits_for_the_gather():
    for r in run_ranks(_read_submodule_right_after_step, 2):
        assert _max_diff(r["right_after"], r["settled"]) == 0.0
        assert _max_diff(r["settled"], r["before"]) > 0.0  # the step moved them


class Gains(nn.Module):
    """Per-channel gains in an nn.ParameterList, read in this module's forward: the list itself is
    never called, so no forward hook of its own can wait for its weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 24)
        self.gains = nn.ParameterList([nn.Parameter(torch.ones(24)) for _ in range(2)])
        self.biases = nn.ParameterDict({"out": nn.Parameter(torch.zeros(40))})
        self.head = nn.Linear(24, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * self.gains[0] * self.gains[1]
        return self.head(h) + self.biases["out"]


def _gains(rank: int, world: int, overlap: bool) -> list[float]:
    model = Gains()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O0", shard_master_weights=True, verbosity=0)
    ddp = DDP(model, bucket_cap_mb=0.01)
    distamp.hooks.register(
        ddp, opt, reduce_scatter=True, overlap_gather=overlap, gather_dtype=torch.bfloat16
    )
    losses = []
    x, y = _batch(rank, 0)  # one batch, learned step by step
    for _ in range(4):
        loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        losses.append(loss.item())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return losses


def _gains_both(rank: int, world: int) -> dict:
    return {overlap: _gains(rank, world, overlap) for overlap in (True, False)}


@pytest.mark.parametrize("shard_block", [16], indirect=True, ids=["blocks-16"])
def test_parameters_in_a_parameter_list_are_waited_for_by_the_module_that_reads_them(shard_block):
    """nn.ParameterList / nn.ParameterDict (never called themselves): with the gather overlapped,
    the module holding them waits for their weights, so the losses are those of the waiting path
    bit for bit (the bf16 updates reach the weights only when waited for: a forward reading them
    early would compute with the old gains). Blocks of 16 elements put the gains in rounds of
    their own, after the embedding's."""
    for r in run_ranks(_gains_both, 2):
        assert r[True] == r[False]
        assert r[True][-1] < r[True][0]


class Detour(nn.Module):
    """A middle layer that forward takes on some steps only, registered last: its weights lie at
    the end of the layout, so a forward that skips it leaves their gather in flight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 24)
        self.head = nn.Linear(24, 40)
        self.detour = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor, take_detour: bool) -> torch.Tensor:
        h = self.emb(x)
        return self.head(torch.tanh(self.detour(h)) if take_detour else h)


def _detour(rank: int, world: int, overlap: bool) -> dict:
    model = Detour()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O0", shard_master_weights=True, verbosity=0)
    ddp = DDP(model, bucket_cap_mb=0.001, find_unused_parameters=True)
    state = distamp.hooks.register(
        ddp, opt, reduce_scatter=True, overlap_gather=overlap, gather_dtype=torch.bfloat16
    )
    losses = []
    x, y = _batch(rank, 0)  # one batch, learned step by step
    for step in range(6):
        loss = nn.functional.cross_entropy(ddp(x, step % 3 == 0).flatten(0, 1), y.flatten())
        losses.append(loss.item())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    state.finish_gather()
    masters = state.masters
    return {
        "losses": losses,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "buckets": state.buckets_scattered,
        "received into staging": state._received,
        "elements reduced": sum(
            p.recv_count * world for plan in state._plans.values() for p in plan.pieces
        ),
        "staging bytes": masters.staging.numel(),
        "layout elements": sum(g.padded for g in masters.groups),
    }


def _detour_both(rank: int, world: int) -> dict:
    return {overlap: _detour(rank, world, overlap) for overlap in (True, False)}


@pytest.mark.parametrize("shard_block", [16], indirect=True, ids=["blocks-16"])
def test_the_hook_waits_for_updates_a_forward_did_not_wait_for_before_reusing_their_buffer(
    shard_block,
):
    """[Note: one staging buffer for the two halves]: the reduce-scatter hook receives into the
    buffer the last step's 16-bit updates arrived in. A forward that skips a layer leaves that
    layer's updates in flight; the hook waits for them (and adds them to the weights) before it
    receives there, so the overlapped path trains bit for bit like the waiting one — and no bucket
    gets a receive buffer of its own (one staging buffer of 2 bytes per element of the layout)."""
    for r in run_ranks(_detour_both, 2):
        assert r[True]["losses"] == r[False]["losses"]
        assert _max_diff(r[True]["weights"], r[False]["weights"]) == 0.0
        assert r[True]["losses"][-1] < r[True]["losses"][0]
        for overlap in (True, False):
            assert r[overlap]["buckets"] >= 6 * 3  # several buckets, each reduce-scattered
            # every bucket of the last backward received into the staging buffer, none elsewhere
            assert r[overlap]["received into staging"] == r[overlap]["elements reduced"] > 0
            assert r[overlap]["staging bytes"] == 2 * r[overlap]["layout elements"]


def _state_dict_storage(rank: int, world: int) -> dict:
    """``model.state_dict()`` after a step, as savers that drop tensors sharing storage see it."""
    out = {}
    for level in ("O1", "O2"):
        model, opt = _make(level, True)
        ddp = DDP(model, find_unused_parameters=True)
        x, y = _batch(rank, 0)
        _backward(ddp, opt, x, y)
        opt.step()
        opt.zero_grad()
        reused = model.state_dict()
        _backward(ddp, opt, x, y)
        opt.step()
        opt.zero_grad()
        model.state_dict(destination=reused)  # a destination passed again after the next step
        reused["blocks.0.1.weight"].zero_()  # the user's own edit of a copy (pruning) ...
        with torch.no_grad():
            model.blocks[1][1].weight.data.mul_(0.5)  # ... and a .data write (no _version move)
        model.state_dict(destination=reused)  # ... then asked again, no step between
        sd = model.state_dict()
        live = dict(model.named_parameters(remove_duplicate=False))
        ema = copy.deepcopy(model)
        ema_sd = ema.state_dict()
        ema_sd["blocks.0.1.weight"].add_(1.0)  # timm's ModelEmaV2 writes ema.state_dict() in place
        out[level] = {
            # Distinct storages, each no larger than its tensor (accelerate/safetensors keep one
            # of the tensors that share a storage and drop the rest).
            "storages": len({v.untyped_storage().data_ptr() for v in sd.values()}),
            "distinct": len({id(v) for v in sd.values()}),
            "oversized": sorted(
                k
                for k, v in sd.items()
                if v.untyped_storage().nbytes() > v.numel() * v.element_size()
            ),
            "tied": sd["emb.weight"] is sd["head.weight"],
            "diff": max((sd[k] - live[k].float()).abs().max().item() for k in live),
            "reused": max((reused[k] - live[k].float()).abs().max().item() for k in live),
            "dtypes": {v.dtype for v in sd.values()},
            "keep_vars": all(model.state_dict(keep_vars=True)[k] is p for k, p in live.items()),
            "ema_live": (ema.blocks[0][1].weight.float() - model.blocks[0][1].weight.float())
            .min()
            .item(),
        }
    return out


def test_state_dict_tensors_are_their_own_copies_with_ties_kept():
    """Sharded weights are views of one flat buffer; ``state_dict()`` reports each as its own
    copy (an audit: accelerate's ``save_state`` kept 1 of an O1 BERT's 41 weights), the tied
    embedding and head as one tensor, ``keep_vars=True`` the parameters themselves, and a deep
    copy (an EMA) its live tensors."""
    for r in run_ranks(_state_dict_storage, 2):
        for level, got in r.items():
            assert got["oversized"] == [], level
            assert got["storages"] == got["distinct"], level
            assert got["tied"] and got["diff"] == 0.0 and got["keep_vars"], level
            assert got["reused"] == 0.0, level  # (a review: the last step's copies came back)
            assert got["dtypes"] == {torch.float32}, level
            assert got["ema_live"] == pytest.approx(1.0, abs=1e-2), level
