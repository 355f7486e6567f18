"""hooks.register with sharded masters reduce-scatters the gradients into the shards.

The same training as the all-reduce path, bit for bit at 2 ranks (the sum of two addends is rounded
once either way) and within one wire-dtype rounding per step at 3 and 4 ranks; the bytes on the
wire are the reduce-scatter's; an inf on one rank only skips every rank; accumulation with and
without ``no_sync``, torch's clipping after ``distamp.unscale_``, frozen and FP32 parameters,
and checkpoints keep working.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import distamp
from distamp.hooks.zero import ZeroState
from tests.dist_harness import run_ranks

pytestmark = pytest.mark.xdist_group("multirank")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
            for _ in range(3)
        )
        self.head = nn.Linear(24, 40)
        self.unused = nn.Linear(24, 24)  # in the optimizer, never in the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randint(0, 40, (4, 6), generator=g)
    return x, torch.randint(0, 40, (4, 6), generator=g)


def _steps(ddp: DDP, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """The plain training loop: one batch per step, scale_loss, step, zero_grad."""
    for step in steps:
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()


def _train(
    rank: int,
    world: int,
    sharded: bool,
    *,
    steps: int = 6,
    half: torch.dtype = torch.bfloat16,
    micro: int = 1,
    no_sync: bool = True,
    inf_at: tuple[int, int] | None = None,
    torch_clip: bool = False,
    bucket_mb: float = 0.01,
    sgd: bool = False,
    overlap: bool = False,
    weight_norm: bool = False,
    late_hook: bool = False,
) -> dict:
    torch.manual_seed(0)
    model = Net()
    if weight_norm:  # the old API: computes the weight in a forward pre-hook
        for layer in [block[1] for block in model.blocks] + [model.head]:
            torch.nn.utils.weight_norm(layer)
    if sgd:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = distamp.wrap(
        model, opt, opt_level="O2", half_dtype=half, shard_master_weights=sharded, verbosity=0
    )
    ddp = DDP(model, bucket_cap_mb=bucket_mb, find_unused_parameters=True)
    state = distamp.hooks.register(ddp, opt, reduce_scatter=sharded, overlap_gather=overlap)
    seen: list[float] = []
    if late_hook:  # a logger's pre-hook, put first among the head's after register
        model.head.register_forward_pre_hook(
            lambda m, args: seen.append(m.weight.detach().double().sum().item()), prepend=True
        )
    losses = []
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(rank, step, m)
            sync = ddp.no_sync() if (no_sync and m < micro - 1) else _Null()
            with sync:
                loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
                losses.append(loss.item())
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
        if inf_at == (step, rank):
            model.blocks[1][1].weight.grad[0, 0] = float("inf")
        if torch_clip:
            distamp.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    s = distamp.stats(opt)
    return {
        "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "skipped": s.skipped_steps,
        "scale": s.loss_scales[0],
        "zero": isinstance(state, ZeroState),
        "scattered": getattr(state, "buckets_scattered", 0),
        "bytes": state.bytes_on_wire if state is not None else 0,
        "first_pre_hooks": [
            type(next(iter(m._forward_pre_hooks.values()))).__name__
            for m in (model.head, model.blocks[0][1])
        ]
        if weight_norm
        else [],
        "seen": seen,
    }


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _both(rank: int, world: int, kwargs: dict) -> dict:
    return {"rs": _train(rank, world, True, **kwargs), "ar": _train(rank, world, False, **kwargs)}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _close(a: dict, b: dict, atol: float) -> None:
    """Every weight of ``a`` within ``atol`` of ``b``'s. The 16-bit sums of the two paths are
    rounded in different orders; a bf16 weight then rounds to its neighbour now and then and the
    network drifts by a few ulps (measured: < 1e-3 after 6 SGD steps of lr 0.1). A wrong reduction
    (a missing division, a lost bucket) moves weights by ~1e-2 per step."""
    for name, x in a.items():
        diff = (x - b[name]).abs().max().item()
        assert diff <= atol, (name, diff)


BLOCKS = pytest.mark.parametrize(
    "shard_block", [None, 16], indirect=True, ids=["blocks-default", "blocks-16"]
)
"""Also with blocks of 16 elements: many rounds of block-cyclic shards, each bucket cut into
runs for every rank (see [Note: block-cyclic shards])."""


@BLOCKS
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_path_equals_the_all_reduce_path(world, shard_block):
    # SGD: a last-bit difference in a gradient stays a last-bit difference (Adam's normalized
    # step turns a gradient rounded to 0 on one path and 1e-9 on the other into a full lr step).
    out = run_ranks(_both, world, {"sgd": world > 2})
    for r in out:
        assert r["rs"]["zero"] and not r["ar"]["zero"]
        assert r["rs"]["scattered"] > 0
    # Every rank ends with the same weights.
    for r in out[1:]:
        assert _max_diff(r["rs"]["weights"], out[0]["rs"]["weights"]) == 0.0
    diff = _max_diff(out[0]["rs"]["weights"], out[0]["ar"]["weights"])
    if world == 2:
        assert diff == 0.0  # the sum of two addends is rounded once either way
    else:
        _close(out[0]["rs"]["weights"], out[0]["ar"]["weights"], 2e-3)
    # The reduce-scatter sends (N - 1)/N of each sharded bucket (its own part stays home: see
    # [Note: the own part stays home]); the all-reduce hook hands gloo every bucket whole.
    rs, ar = out[0]["rs"]["bytes"], out[0]["ar"]["bytes"]
    assert (world - 1) / world * ar <= rs < ar


@BLOCKS
def test_inf_on_one_rank_only_skips_every_rank(shard_block):
    out = run_ranks(_both, 2, {"inf_at": (2, 1), "half": torch.float16})
    for r in out:
        assert r["rs"]["skipped"] == r["ar"]["skipped"] == 1
        assert r["rs"]["scale"] == r["ar"]["scale"] == 2.0**15
    assert _max_diff(out[0]["rs"]["weights"], out[0]["ar"]["weights"]) == 0.0
    assert _max_diff(out[1]["rs"]["weights"], out[0]["rs"]["weights"]) == 0.0


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "every-micro-batch-synced"])
def test_accumulation_equals_the_all_reduce_path(no_sync):
    out = run_ranks(_both, 2, {"micro": 3, "no_sync": no_sync, "steps": 3, "sgd": not no_sync})
    rs, ar = out[0]["rs"]["weights"], out[0]["ar"]["weights"]
    if no_sync:
        assert _max_diff(rs, ar) == 0.0  # one reduction of the same local sums
    else:
        # The all-reduce path adds each micro-batch to the reduced sum so far, the reduce-scatter
        # path reduces the local sums at the last one: the same sum, rounded in bf16 elsewhere.
        _close(rs, ar, 2e-3)
    assert _max_diff(out[1]["rs"]["weights"], rs) == 0.0


def test_torch_clipping_after_unscale_clips_the_reduced_gradients():
    out = run_ranks(_both, 2, {"torch_clip": True})
    assert out[0]["rs"]["zero"]
    assert _max_diff(out[0]["rs"]["weights"], out[0]["ar"]["weights"]) == 0.0
    assert _max_diff(out[1]["rs"]["weights"], out[0]["rs"]["weights"]) == 0.0


def _overlapped(rank: int, world: int, kwargs: dict) -> dict:
    return {
        "overlap": _train(rank, world, True, overlap=True, **kwargs),
        "rs": _train(rank, world, True, **kwargs),
    }


@BLOCKS
@pytest.mark.parametrize("world", [2, 3])
def test_the_gather_overlapped_with_the_next_forward_trains_bit_for_bit_the_same(
    world, shard_block
):
    """overlap_gather: the step returns before the weights arrive and each module's forward waits
    for its own blocks. A module that ran on weights still in flight would change the loss."""
    out = run_ranks(_overlapped, world, {"steps": 5, "torch_clip": world == 2})
    for r in out:
        assert r["overlap"]["losses"] == r["rs"]["losses"]
        assert _max_diff(r["overlap"]["weights"], r["rs"]["weights"]) == 0.0
    assert _max_diff(out[-1]["overlap"]["weights"], out[0]["overlap"]["weights"]) == 0.0


@pytest.mark.parametrize("shard_block", [16], indirect=True, ids=["blocks-16"])
def test_the_overlapped_gather_is_waited_for_before_the_modules_own_pre_hooks(shard_block):
    """The old torch.nn.utils.weight_norm (and spectral_norm, prune) computes the weight in a
    forward pre-hook registered before wrap; distamp's wait ran after it, so it read weights
    still being gathered: off by up to 3.9e-3 after 6 steps, differently each run (an audit)."""
    out = run_ranks(_overlapped, 2, {"steps": 5, "weight_norm": True})
    for r in out:
        assert r["overlap"]["first_pre_hooks"] == ["_RoundWaiter", "_RoundWaiter"]
        assert r["overlap"]["losses"] == r["rs"]["losses"]
        assert _max_diff(r["overlap"]["weights"], r["rs"]["weights"]) == 0.0


@pytest.mark.parametrize("shard_block", [16], indirect=True, ids=["blocks-16"])
def test_a_pre_hook_prepended_after_register_still_sees_the_gathered_weights(shard_block):
    """A forward pre-hook registered with prepend=True after hooks.register went in front of
    distamp's wait and read the weights of before the step (an audit: off by the whole update,
    silently). Each wait is put first again when a step leaves its gather in flight."""
    out = run_ranks(_overlapped, 2, {"steps": 4, "late_hook": True})
    for r in out:
        assert len(r["overlap"]["seen"]) == 4
        assert r["overlap"]["seen"] == r["rs"]["seen"]
        assert r["overlap"]["losses"] == r["rs"]["losses"]


def _group_added_later(rank: int, world: int, overlap: bool) -> dict:
    """The head joins the optimizer after two steps (a new sharded group: no forward hook of
    overlap_gather knows it, so its gather must not be left in flight)."""
    torch.manual_seed(0)
    model = Net()
    head = list(model.head.parameters())
    body = [p for p in model.parameters() if all(p is not q for q in head)]
    opt = torch.optim.AdamW(body, lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=overlap)
    losses = []
    for step in range(5):
        if step == 2:
            before = model.head.weight.detach().float().clone()
            opt.add_param_group({"params": head, "lr": 2e-2})
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
        losses.append(loss.item())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "head": model.head.weight.detach().float().clone(), "before": before}


def _added_both(rank: int, world: int) -> dict:
    return {o: _group_added_later(rank, world, o) for o in (True, False)}


def test_a_group_added_after_register_is_gathered_before_the_next_forward():
    for r in run_ranks(_added_both, 2):
        assert r[True]["losses"] == r[False]["losses"]
        assert torch.equal(r[True]["head"], r[False]["head"])
        # the added group trains: three AdamW steps of lr 2e-2 move the head (~0.03 on average)
        assert (r[True]["head"] - r[True]["before"]).abs().mean() > 0.01


def test_an_inf_on_one_rank_only_skips_every_rank_with_the_gather_overlapped():
    out = run_ranks(_overlapped, 2, {"inf_at": (2, 1), "half": torch.float16})
    for r in out:
        assert r["overlap"]["skipped"] == r["rs"]["skipped"] == 1
        assert r["overlap"]["scale"] == 2.0**15
        assert r["overlap"]["losses"] == r["rs"]["losses"]
        assert _max_diff(r["overlap"]["weights"], r["rs"]["weights"]) == 0.0


def _overlap_run(rank: int, world: int, first: int, last: int, load: str, save: str) -> dict:
    """Steps [first, last) with overlap_gather, resuming from ``load`` and saving to ``save``
    right after the last step (while its gather may still be in flight)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    if load:
        distamp.load_checkpoint(load, model, opt)
    _steps(ddp, opt, rank, range(first, last))
    if save:
        distamp.save_checkpoint(save, model, opt)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@BLOCKS
def test_checkpoints_of_overlapped_steps_resume_bit_exact(tmp_path, shard_block):
    half = str(tmp_path / "half")
    straight = run_ranks(_overlap_run, 2, 0, 4, "", "")[0]
    run_ranks(_overlap_run, 2, 0, 2, "", half)
    resumed = run_ranks(_overlap_run, 2, 2, 4, half, "")[0]  # new processes
    assert _max_diff(resumed, straight) == 0.0


def test_overlap_gather_without_reduce_scatter_is_refused():
    out = run_ranks(_refused_overlap, 2)
    for message in out:
        assert "expected reduce_scatter=True" in message and "overlap_gather" in message


def _refused_overlap(rank: int, world: int) -> str:
    model = Net()
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    ddp = DDP(model, find_unused_parameters=True)
    try:
        distamp.hooks.register(ddp, opt, overlap_gather=True)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _against_fp32_reference(rank: int, world: int) -> dict:
    result = _train(rank, world, True, steps=4, bucket_mb=25)
    return result


def test_one_big_bucket_trains_like_a_single_process_fp32_run():
    out = run_ranks(_against_fp32_reference, 2)
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(4):
        opt.zero_grad()
        for rank in range(2):
            x, y = _batch(rank, step)
            loss = nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten()) / 2
            loss.backward()
        opt.step()
    want = ref.state_dict()
    for name, value in out[0]["weights"].items():
        # bf16 forward/backward against FP32: Adam's normalized steps (lr 1e-2) may differ by up
        # to ~2 lr where a gradient is tiny; on average they agree closely.
        diff = (value - want[name]).abs()
        assert diff.max().item() < 8e-2 and diff.mean().item() < 5e-3, (name, diff.max())
    assert out[0]["scattered"] > 0


def _refused(rank: int, world: int) -> str:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=False, verbosity=0)
    ddp = DDP(model)
    try:
        distamp.hooks.register(ddp, opt, reduce_scatter=True)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def test_reduce_scatter_without_sharded_masters_is_refused_on_every_rank():
    for message in run_ranks(_refused, 2):
        assert "reduce_scatter=True" in message and "not sharded" in message, message


def _one_rank(rank: int, world: int, level: str, reduce_scatter: bool) -> dict:
    """The README's N-rank recipe (reduce_scatter, overlap_gather; with FP32 weights sharded,
    16-bit updates) run by torchrun --nproc_per_node=1; or the same with the all-reduce hook."""
    import warnings

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard = {"shard_master_weights": True} if level == "O0" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **shard)
    ddp = DDP(model, find_unused_parameters=True)
    kwargs = {}
    if reduce_scatter:
        kwargs = {"reduce_scatter": True, "overlap_gather": True}
        if level == "O0":
            kwargs["gather_dtype"] = torch.bfloat16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = distamp.hooks.register(ddp, opt, **kwargs)
    _steps(ddp, opt, rank, range(3))
    return {
        "warnings": [str(w.message) for w in caught],
        "zero": isinstance(state, ZeroState),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


@pytest.mark.parametrize("level", ["O2", "O0"])
def test_the_n_rank_recipe_runs_on_one_rank_with_the_all_reduce_hook(level):
    """At one rank there is nothing to reduce-scatter or gather: register says so once and
    registers the all-reduce hook; training is bit for bit the all-reduce hook's."""
    recipe = run_ranks(_one_rank, 1, level, True)[0]
    plain = run_ranks(_one_rank, 1, level, False)[0]
    assert not recipe["zero"]
    assert any("one rank" in w and "reduce_scatter=True" in w for w in recipe["warnings"])
    assert not plain["warnings"]
    for name, value in plain["weights"].items():
        assert torch.equal(recipe["weights"][name], value), name


def _default_keeps_ddp_gradients(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)  # sharded by default
    ddp = DDP(model, find_unused_parameters=True)
    state = distamp.hooks.register(ddp, opt)
    x, y = _batch(rank, 0)
    loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    gathered = [torch.zeros_like(grads) for _ in range(world)]
    torch.distributed.all_gather(gathered, grads)
    return not isinstance(state, ZeroState) and all(torch.equal(g, grads) for g in gathered)


def test_by_default_every_rank_holds_the_reduced_gradients_after_backward():
    assert all(run_ranks(_default_keeps_ddp_gradients, 2))


class _Weights(nn.Module):
    """loss = sum(w * c): the gradient of ``w`` is exactly ``c`` (with the sign of its zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3000))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def _reduced_bits(rank: int, world: int, half: torch.dtype) -> dict:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(7 + rank)
    c = torch.randn(3000, generator=gen) * 10 ** torch.randint(-30, 30, (3000,), generator=gen)
    c[:4] = torch.tensor([-0.0, 0.0, -0.0, 3e38 if half == torch.bfloat16 else 6e4])
    c[4] = -0.0 if rank == 0 else 0.0  # -0 + 0 = +0; positions 0 and 2: -0 + -0 = -0
    c = c.to(half)
    model = _Weights()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = distamp.wrap(
        model, opt, opt_level="O2", half_dtype=half, loss_scale=1.0, verbosity=0
    )
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt, reduce_scatter=True)
    with distamp.scale_loss(ddp(c).float(), opt) as scaled:
        scaled.backward()
    distamp.unscale_(opt)  # the reduced gradients, gathered back into .grad
    got = model.w.grad.detach().clone()
    # What an all-reduce of the divided, cast gradients delivers (gloo sums the two addends).
    expected = (c.float() / world).to(half)
    dist.all_reduce(expected)
    return {"got": got.view(torch.int16), "expected": expected.view(torch.int16)}


@BLOCKS
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_the_reduced_gradients_are_the_all_reduce_s_bits_signed_zeros_and_range_ends_included(
    half, shard_block
):
    """At 2 ranks each shard's reduced gradient is bit for bit what gloo's all-reduce of the same
    divided, cast gradients gives: -0 + -0 = -0, -0 + 0 = +0, the largest finite values summed
    (overflow to inf), 60 decades of magnitudes (fp16's cast overflows and underflows too)."""
    for r in run_ranks(_reduced_bits, 2, half):
        got, expected = r["got"], r["expected"]
        nan = expected.view(half).isnan()  # inf - inf: a NaN either way, its sign bit may differ
        assert torch.equal(got.view(half).isnan(), nan)
        assert torch.equal(got[~nan], expected[~nan])


def _pool_after_steps(rank: int, world: int) -> dict:
    from distamp.hooks.compress import MAX_IN_FLIGHT

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(16)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model, bucket_cap_mb=0.001)  # a bucket per weight
    state = distamp.hooks.register(ddp, opt, reduce_scatter=True)
    pools = []
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        with distamp.scale_loss(ddp(x.bfloat16()).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        pools.append(len(state._free))
    me = opt._distamp.masters.rank
    return {
        "pools": pools,
        "buckets": state.buckets_scattered // 3,
        "pool": len(state._free),
        "lent": len(state._lent),
        "pool_bytes": sum(b.numel() for b in state._free),
        "longest": max(  # the longest buffer a bucket asked for, in bytes
            2 * max(sum(p.send_counts) - p.send_counts[me], p.recv_count * world)
            for plan in state._plans.values()
            for p in plan.pieces
        ),
        "max_in_flight": MAX_IN_FLIGHT,
        "staging": opt._distamp.masters.staging,
    }


def test_send_and_receive_buffers_exist_only_for_the_buckets_in_flight():
    from distamp.hooks.compress import GRAIN

    """[Note: buffers only in flight]: with a bucket per weight (many more buckets than may be in
    flight) the hook's pool ends up with at most two buffers (send, receive) per bucket in flight,
    none longer than the longest a bucket asked for (rounded up to the pool's grain), every one
    handed back: fewer buffers than buckets, and no more as buckets are added. O2 allocates no
    staging buffer."""
    for r in run_ranks(_pool_after_steps, 2):
        assert r["buckets"] > 2 * r["max_in_flight"], r
        assert r["lent"] == 0, r
        assert 0 < r["pool"] <= 2 * r["max_in_flight"], r
        assert r["pool_bytes"] <= 2 * r["max_in_flight"] * max(r["longest"], GRAIN), r
        assert r["staging"] is None, r
        # nothing kept from the first backward, whose buckets DDP rebuilds (a buffer of them
        # stayed until the second backward: the second forward's peak, an audit)
        assert r["pools"][0] == 0 and r["pools"][1] > 0, r


class _LateWork:
    """An all-gather that lands only at wait(): rank 0's, in the rebuild test."""

    def __init__(self, work, tmp, target):
        self.work, self.tmp, self.target = work, tmp, target

    def wait(self):
        self.work.wait()
        self.target.copy_(self.tmp)
        return True


class _Done:
    def wait(self):
        return True


def _rebuild_ddp(rank, world, rebuild):
    """Unfreezing's recipe: a new DDP (and its hook) after step(), while the overlapped gather is
    in flight. The timing that loses is fixed: rank 0's gather lands at wait(), rank 1's at once,
    so DDP's constructor broadcasts rank 0's stale weights over rank 1's fresh ones."""
    import distamp.masters.gather as gather

    real = gather.all_gather_single

    def timed(output, input, group=None, async_op=False):
        if not async_op:
            return real(output, input, group=group, async_op=False)
        if rank == 0:
            tmp = output.clone()
            return _LateWork(real(tmp, input.clone(), group=group, async_op=True), tmp, output)
        real(output, input, group=group, async_op=False)
        return _Done()

    gather.all_gather_single = timed
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)

    def make():
        ddp = DDP(model)
        return ddp, distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)

    ddp, _ = make()
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(5):
        if step == 3 and rebuild:
            ddp, _ = make()
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        loss = nn.functional.mse_loss(ddp(x).float(), y)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    return losses, weights


def test_a_ddp_rebuilt_while_the_gather_is_in_flight_gets_the_fresh_weights():
    """An audit's probe: rank 1 trained a step on rank 0's stale weights, silently."""
    straight = run_ranks(_rebuild_ddp, 2, False)
    rebuilt = run_ranks(_rebuild_ddp, 2, True)
    for rank in range(2):
        assert rebuilt[rank][0] == straight[rank][0], rank
        for name, value in straight[rank][1].items():
            assert torch.equal(rebuilt[rank][1][name], value), (rank, name)


def _threads_and_copies(rank, world, threads):
    """O0 sharded weights with 16-bit updates gathered under the next forward: right after each
    step, ``threads`` threads run an inference forward at once, and a deep copy is taken."""
    import threading

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O0", shard_master_weights=True, verbosity=0)
    ddp = DDP(model)
    state = distamp.hooks.register(
        ddp, opt, reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16
    )
    copies_match = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step * 7 + rank)
        loss = F.mse_loss(ddp(torch.randn(8, 64, generator=gen)), torch.zeros(8, 2))
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        if threads:
            barrier = threading.Barrier(threads)

            def infer(barrier=barrier):
                barrier.wait()
                with torch.no_grad():
                    model(torch.randn(2, 64))

            workers = [threading.Thread(target=infer) for _ in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(60)
        ema = copy.deepcopy(model)  # an EMA taken right after step(): the gather lands first
        state.finish_gather()
        pairs = zip(ema.parameters(), model.parameters(), strict=True)
        copies_match.append(all(torch.equal(a, b) for a, b in pairs))
    return [p.detach().clone() for p in model.parameters()], copies_match


def test_overlapped_update_gather_with_inference_threads_and_copies(monkeypatch):
    """Audits: forwards in several threads right after step() each applied the same gathered
    round of 16-bit updates (weights moved twice, ranks parted); deepcopy/torch.save of the model
    failed on the gather's process group, and a copy right after step() read half-gathered
    weights. Now the waits hold a lock, the copy finishes the gather first and owns none."""
    monkeypatch.setenv("DISTAMP_TEST_SHARD_BLOCK", "512")
    alone = run_ranks(_threads_and_copies, 2, 0)
    threaded = run_ranks(_threads_and_copies, 2, 6)
    for (weights, copies), (ref, _) in zip(threaded, alone, strict=True):
        assert copies == [True, True, True]
        for a, b in zip(weights, ref, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(threaded[0][0], threaded[1][0], strict=True):
        assert torch.equal(a, b)


def _background_evaluation(rank, world, evaluate):
    """O0 sharded weights with 16-bit updates gathered in rounds; a thread evaluates the model
    in a loop while the main thread trains (through every step())."""
    import threading

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 600), nn.ReLU(), nn.Linear(600, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O0", shard_master_weights=True, verbosity=0)
    ddp = DDP(model)
    distamp.hooks.register(
        ddp, opt, reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16
    )
    stop, probe = threading.Event(), torch.randn(16, 8)

    def evaluation():
        while not stop.is_set():
            with torch.no_grad():
                model(probe)
            model.state_dict()  # finishes the gather (an EMA's or a logger's habit)

    worker = threading.Thread(target=evaluation)
    if evaluate:
        worker.start()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(20):
        loss = F.mse_loss(ddp(torch.randn(16, 8, generator=gen)), torch.zeros(16, 4))
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    stop.set()
    if evaluate:
        worker.join(60)
    with torch.no_grad():
        model(probe)  # lands the last gather
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_an_evaluation_thread_running_through_step_leaves_training_as_it_was(monkeypatch):
    """The step computed each round's update in the FP32 scratch the other thread's forward
    applied the rounds gathered so far through: the update sent or applied was overwritten and
    the ranks parted, 3 runs in 3; a state_dict() there finished the gather while the step was
    still starting its rounds, which lost the later ones (audits)."""
    monkeypatch.setenv("DISTAMP_TEST_SHARD_BLOCK", "64")  # many rounds
    alone = run_ranks(_background_evaluation, 2, False)
    evaluated = run_ranks(_background_evaluation, 2, True)
    assert torch.equal(evaluated[0], evaluated[1])
    assert torch.equal(evaluated[0], alone[0]) and torch.equal(alone[0], alone[1])


def _never_synced(rank: int, world: int, level: str) -> str:
    """A step after a backward DDP never synced, with the reduce-scatter hook."""
    import torch.nn.functional as F

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"shard_master_weights": True} if level == "O0" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **extra)
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt, reduce_scatter=True)
    x, y = _batch(rank, 0)
    before = [p.detach().clone() for p in model.parameters()]
    with ddp.no_sync():  # every micro-batch of the step: the leftovers at an epoch's end
        loss = F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    try:
        opt.step()
    except RuntimeError as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        return str(exc) if unchanged else "raised after changing the weights"
    # (seen once in a full CI run, not reproduced since in thousands of tries: say what happened)
    stats = distamp.stats(opt)
    seen = [(n, p.grad is None) for n, p in model.named_parameters()][:3]
    return f"stepped: skipped={stats.last_step_skipped}, scales={stats.loss_scales}, {seen}"


@pytest.mark.parametrize("level", ["O2", "O0"])
def test_a_step_after_backwards_ddp_never_synced_is_refused_with_the_hook_too(level):
    """An audit: without the hook such a step is refused (the gradients differ between ranks);
    with reduce_scatter=True each shard stepped with its owner's own gradient, the ranks
    identical and the training wrong, silently."""
    for message in run_ranks(_never_synced, 2, level):
        assert "expected the model's gradients identical on every rank" in message, message
        assert "no_sync" in message


def _edit_before_step(rank: int, world: int, level: str, when: str, hook: str) -> object:
    """Zero the first block's gradients to keep it frozen (a script's habit), before or after
    distamp.unscale_; returns how far that block moved, or the error."""
    import torch.nn.functional as F

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = {"shard_master_weights": True} if level == "O0" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **extra)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=hook == "reduce-scatter")
    _steps(ddp, opt, rank, range(1))  # (DDP's first backward all-reduces: buckets not rebuilt)
    frozen = list(model.blocks[0].parameters())
    before = [p.detach().float().clone() for p in frozen]
    x, y = _batch(rank, 1)
    with distamp.scale_loss(F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten()), opt) as s:
        s.backward()
    if when == "after unscale_":
        distamp.unscale_(opt)
    for p in frozen:
        p.grad.zero_()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return max((p.float() - b).abs().max().item() for p, b in zip(frozen, before, strict=True))


@pytest.mark.parametrize("level", ["O2", "O0"])
def test_gradient_edits_before_unscale_are_refused_under_the_reduce_scatter_hook(level):
    """Under the reduce-scatter hook the model's .grad hold each rank's own gradient and the
    step reads the reduced FP32 shards: a gradient zeroed to freeze a layer before step() was
    lost and the layer moved (0.021), silently (an audit). Before unscale_ every rank refuses;
    after it the edit is taken, as with the all-reduce hook."""
    for message in run_ranks(_edit_before_step, 2, level, "before step", "reduce-scatter"):
        assert isinstance(message, str), message
        assert "expected the model's gradients untouched between backward and" in message
        assert "'blocks.0.1.weight'" in message or "on another rank" in message, message
    for moved in run_ranks(_edit_before_step, 2, level, "after unscale_", "reduce-scatter"):
        assert moved == 0.0
    for moved in run_ranks(_edit_before_step, 2, level, "before step", "all-reduce"):
        assert moved == 0.0  # (with a warning: the edit was made at the loss scale)


class _WhenWaited:
    """An all-gather that lands only when waited for: a slow link, made deterministic."""

    def __init__(self, real, args) -> None:
        self.real, self.args, self.done = real, args, False

    def wait(self, *args: object, **kwargs: object) -> bool:
        if not self.done:
            self.done = True
            self.real(*self.args, async_op=False)
        return True

    def is_completed(self) -> bool:
        return self.done


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(37, 32)
        self.layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 37)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(x)))


def _torch_attention(rank: int, world: int, overlap: bool) -> tuple[list, list]:
    import distamp.masters.gather as gather

    real = gather.all_gather_single

    def when_waited(output, input, group=None, async_op=False):
        if not async_op:
            return real(output, input, group=group, async_op=False)
        return _WhenWaited(real, (output, input, group))

    gather.all_gather_single = when_waited
    model = _Attention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=overlap)
    losses, evals = [], []
    xv = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(7))
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randint(0, 37, (4, 8), generator=g), torch.randint(0, 37, (4, 8), generator=g)
        loss = nn.functional.cross_entropy(ddp(x).float().reshape(-1, 37), y.reshape(-1))
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        model.eval()  # validation right after the step: the layer's inference fast path
        with torch.no_grad():
            evals.append(ddp(xv).float())
        model.train()
    return losses, evals


@pytest.mark.parametrize("shard_block", [64], indirect=True)
def test_torch_attention_waits_for_the_weights_it_reads_without_calling_their_modules(
    shard_block,
):
    """nn.MultiheadAttention reads out_proj's weight without calling out_proj, and the encoder
    layer's inference fast path reads every child's weight without calling any: under the
    overlapped gather both ran on half-gathered weights (an audit: losses apart from the second
    step, validation 0.047 off). Bit for bit the run without the overlap now."""
    plain = run_ranks(_torch_attention, 2, False)
    overlapped = run_ranks(_torch_attention, 2, True)
    for (losses, evals), (losses_o, evals_o) in zip(plain, overlapped, strict=True):
        assert losses_o == losses
        for a, b in zip(evals, evals_o, strict=True):
            assert torch.equal(a, b)


def _framework_backward(rank: int, world: int, level: str, hook: str) -> dict:
    """Hugging Face's Trainer and accelerate: backward outside scale_loss (no loss scale: bf16),
    then torch's clip_grad_norm_(model.parameters()) before step(), with nothing of distamp's
    in between."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"shard_master_weights": True} if level == "O0" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **extra)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    overlap = hook == "reduce-scatter, gather overlapped"
    distamp.hooks.register(ddp, opt, reduce_scatter=hook != "all-reduce", overlap_gather=overlap)
    norms, grads = [], []
    with warnings.catch_warnings():  # scale 1.0 is right in bf16: no "without scale_loss"
        warnings.filterwarnings("error", message=".*without distamp.scale_loss")
        for step in range(4):
            x, y = _batch(rank, step)
            F.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten()).backward()
            grads.append(model.head.weight.grad.detach().float().clone())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
            opt.step()
            opt.zero_grad()
    weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"norms": norms, "grads": grads, "weights": weights}


@pytest.mark.parametrize(
    ("level", "hook"),
    [
        ("O2", "reduce-scatter"),
        ("O0", "reduce-scatter"),
        ("O0", "reduce-scatter, gather overlapped"),
    ],
)
def test_a_framework_s_clipping_after_its_own_backward_clips_the_reduced_gradients(level, hook):
    """A backward outside scale_loss (the Trainer's, accelerate's, Lightning's) is not the
    script's own, so nothing can be refused in it: under the reduce-scatter hook the model's
    .grad kept each rank's own gradients, the framework's clip_grad_norm_(model.parameters())
    measured each rank's own norm and was lost (O0 sharded: trained unclipped, silently) or
    parted the ranks (O2). Such a backward now ends with the reduced gradients gathered into
    .grad, as DDP promises: the same training as the all-reduce hook, norms agreed on every
    rank. Bit for bit at 2 ranks (the sum of two addends is rounded once either way)."""
    rs = run_ranks(_framework_backward, 2, level, hook)
    ar = run_ranks(_framework_backward, 2, level, "all-reduce")
    for r in (0, 1):
        assert rs[r]["norms"] == ar[0]["norms"], (r, rs[r]["norms"], ar[0]["norms"])
        for got, want in zip(rs[r]["grads"], ar[0]["grads"], strict=True):
            assert torch.equal(got, want)
        assert _max_diff(rs[r]["weights"], ar[0]["weights"]) == 0.0


class _ReentrantTail(nn.Module):
    """A reentrant activation checkpoint over the later layers (older transformers' default
    under gradient_checkpointing_enable()): their gradients come from a nested backward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.tail = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return checkpoint(self.tail, self.inp(x), use_reentrant=True)


def _reentrant_framework_backward(rank: int, world: int, hook: str) -> dict:
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _ReentrantTail()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model, bucket_cap_mb=0.002)  # a bucket per layer: bucket 0 in the nested backward
    state = distamp.hooks.register(ddp, opt, reduce_scatter=hook == "reduce-scatter")
    gathers = []
    if hook == "reduce-scatter":
        masters = state.masters
        real = masters.gather_after_outside_backward
        masters.gather_after_outside_backward = lambda: (gathers.append(1), real())[1]
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "backward without distamp.scale_loss"
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            loss = F.mse_loss(ddp(x), y)
            if rank == 1:
                time.sleep(0.3)  # a slower data loader: the ranks reach backward apart
            loss.backward()
            grads.append([p.grad.float().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    return {"grads": grads, "gathers": len(gathers)}


def test_a_framework_backward_through_a_reentrant_checkpoint_gathers_once_after_every_bucket():
    """The end-of-backward gather was queued at the first reduce-scattered bucket: inside a
    reentrant checkpoint's nested backward it ran when that ended, before the later buckets,
    deciding from what gloo had delivered so far — the ranks parted and hung (an audit: 3 runs
    in 4), and it ran twice a step. Queued at the last bucket, as DDP queues its own."""
    rs = run_ranks(_reentrant_framework_backward, 2, "reduce-scatter", timeout=120)
    ar = run_ranks(_reentrant_framework_backward, 2, "all-reduce", timeout=120)
    for r in (0, 1):
        assert rs[r]["gathers"] == 3
        for got, want in zip(rs[r]["grads"], ar[0]["grads"], strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)


def _hook_buffers(rank, world, reduce_scatter):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = distamp.wrap(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        opt_level="O1",
        shard_master_weights=reduce_scatter,
        verbosity=0,
    )
    ddp = DDP(model)
    state = distamp.hooks.register(ddp, opt, reduce_scatter=reduce_scatter)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        with distamp.scale_loss(ddp(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    held = [t for t in (state._scratch, getattr(state, "_sum", None)) if t is not None]
    return [t.numel() for t in held], sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("world,reduce_scatter", [(2, False), (3, True)])
def test_a_small_models_hook_holds_buffers_of_its_size(world, reduce_scatter):
    """The hooks' FP32 scratch (1 MB) and the reduce-scatter's sum buffer (2 MB) had fixed
    sizes: sharding a model of 212 parameters raised each rank's memory (an audit)."""
    for held, n_params in run_ranks(_hook_buffers, world, reduce_scatter, timeout=120):
        assert held and all(numel <= n_params for numel in held), (held, n_params)


class _Boom(Exception):
    pass


class _FailedWork:
    """A collective that failed without moving any data (a peer lost)."""

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_exception(RuntimeError("injected: peer lost"))
        return future

    def wait(self) -> None:
        raise RuntimeError("injected: peer lost")


def _failed_bucket_then_on(rank: int, world: int, fail: str | None) -> dict:
    """A bucket's reduce fails once mid-backward (``fail``: in the hook's callback, or the
    collective itself); the script catches the error, drops that batch, and trains on, as it
    can under plain DDP. distamp's hook re-raised the failed future while waiting for room for a
    later bucket, mid-backward: DDP's reducer was left half-marked and the next forward failed
    an internal assert; a failed collective was never read: backward returned and the step took
    the receive buffer's stale values (audits)."""
    from unittest import mock

    import distamp.hooks.zero as zero

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=True, verbosity=0)
    ddp = DDP(model, bucket_cap_mb=1e-4, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    _steps(ddp, opt, rank, range(2))
    if fail:

        def boom(*args: object) -> None:
            raise _Boom("injected")

        x, y = _batch(rank, 2)
        if fail == "callback":
            patched = mock.patch.object(zero, "_copy_runs", boom)
        else:
            patched = mock.patch.object(
                torch.distributed, "all_to_all_single", lambda *a, **k: _FailedWork()
            )
        with patched:
            with pytest.raises(RuntimeError, match="injected"):
                loss = nn.functional.cross_entropy(ddp(x).float().flatten(0, 1), y.flatten())
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
        opt.zero_grad()
    _steps(ddp, opt, rank, range(3, 5))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fail", ["callback", "collective"])
def test_training_goes_on_after_a_failed_bucket_as_if_its_batch_was_dropped(fail):
    failed = run_ranks(_failed_bucket_then_on, 2, fail, timeout=120)
    dropped = run_ranks(_failed_bucket_then_on, 2, None, timeout=120)
    for got, want in zip(failed, dropped, strict=True):
        for name, value in want.items():
            assert torch.equal(got[name], value), name


def _second_backward_through_one_forward(rank: int, world: int, summed: bool) -> object:
    """A multi-task step: loss 0 through the encoder and a head, loss 1 reusing the encoder's
    output (retain_graph=True). DDP reduces once per forward; under the reduce-scatter hook the
    step read the first backward's shard gradients and loss 1's share of the encoder was
    dropped, silently (an audit: the run equalled one without loss 1)."""
    torch.manual_seed(0)
    encoder, head = nn.Linear(6, 8), nn.Linear(8, 3)
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
    (encoder, head), opt = distamp.wrap(
        [encoder, head], opt, opt_level="O0", shard_master_weights=True, num_losses=2,
        verbosity=0,
    )  # fmt: skip
    ddp_e, ddp_h = DDP(encoder), DDP(head)
    for ddp in (ddp_e, ddp_h):
        distamp.hooks.register(ddp, opt, reduce_scatter=True)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    features = ddp_e(x)
    first = ddp_h(features).pow(2).mean()
    second = features.pow(2).mean()
    try:
        if summed:
            with distamp.scale_loss(first + second, opt) as scaled:
                scaled.backward()
        else:
            with distamp.scale_loss(first, opt, loss_id=0) as scaled:
                scaled.backward(retain_graph=True)
            with distamp.scale_loss(second, opt, loss_id=1) as scaled:
                scaled.backward()
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_second_backward_through_one_ddp_forward_is_refused_on_every_rank():
    for message in run_ranks(_second_backward_through_one_forward, 2, False, timeout=120):
        assert message is not None and "one backward per DDP forward" in message, message
        assert "'models[0].weight'" in message and "retain_graph=True" in message, message
    assert run_ranks(_second_backward_through_one_forward, 2, True, timeout=120) == [None] * 2


def _outside_backward_then_block(
    rank: int, world: int, only: tuple[int, ...], reduce_scatter: bool = True
) -> str | None:
    """A framework's backward outside scale_loss, then a block, one step, under the reduce-
    scatter hook at O0 (scale 1.0): each rank stepped its own unreduced second gradient in the
    part it owns (an audit). On the ranks in ``only``; the others run that backward in a
    block (not under the reduce-scatter hook, which all-gathers after a backward outside the
    blocks: every rank must run the same script there)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (at O0's scale 1.0 a block after an outside backward is refused under this hook only)
    level = "O0" if reduce_scatter else "O2"
    model, opt = distamp.wrap(model, opt, opt_level=level, shard_master_weights=True, verbosity=0)
    ddp = DDP(model, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=reduce_scatter)
    (x1, y1), (x2, y2) = _batch(rank, 0), _batch(rank, 1)
    if rank in only:
        nn.functional.cross_entropy(ddp(x1).flatten(0, 1), y1.flatten()).backward()
    else:
        with distamp.scale_loss(
            nn.functional.cross_entropy(ddp(x1).flatten(0, 1), y1.flatten()), opt
        ) as scaled:
            scaled.backward()
    try:
        with distamp.scale_loss(
            nn.functional.cross_entropy(ddp(x2).flatten(0, 1), y2.flatten()), opt
        ) as scaled:
            scaled.backward()
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    ("only", "reduce_scatter"),
    [((0, 1), True), ((1,), False)],
    ids=["every-rank-reduce-scatter", "rank-1-only-all-reduce"],
)
def test_a_block_after_a_backward_outside_scale_loss_is_refused_under_the_reduce_scatter_hook(
    only, reduce_scatter
):
    """Refused at the step, on every rank together, naming the rank (an audit: refused at the
    block by the rank alone, whose peers then waited in DDP's collectives, a hang)."""
    for message in run_ranks(_outside_backward_then_block, 2, only, reduce_scatter, timeout=120):
        assert message is not None, "expected a refusal"
        assert message.startswith("optimizer.step(): expected the gradients pending"), message
        assert f"found on rank {only[-1]} gradients a backward outside" in message, message


def _outside_backward_cleared_by_the_module(rank: int, world: int, clear: bool) -> dict:
    """An outside backward, the module's zero_grad (not the optimizer's), a block, a step:
    the reduced gradients gathered for the outside backward stayed, and the step took the
    block's unreduced .grad as unscaled (an audit: |w| 9536 at O2)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = DDP(model, find_unused_parameters=True)
    distamp.hooks.register(ddp, opt, reduce_scatter=True)
    (x1, y1), (x2, y2) = _batch(rank, 0), _batch(rank, 1)
    if clear:
        nn.functional.cross_entropy(ddp(x1).float().flatten(0, 1), y1.flatten()).backward()
        model.zero_grad()
    with distamp.scale_loss(
        nn.functional.cross_entropy(ddp(x2).float().flatten(0, 1), y2.flatten()), opt
    ) as scaled:
        scaled.backward()
    opt.step()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def test_an_outside_backward_cleared_by_the_module_leaves_nothing_behind():
    cleared = run_ranks(_outside_backward_cleared_by_the_module, 2, True, timeout=120)
    alone = run_ranks(_outside_backward_cleared_by_the_module, 2, False, timeout=120)
    for got, want in zip(cleared, alone, strict=True):
        for name, value in want.items():
            assert torch.equal(got[name], value), name
