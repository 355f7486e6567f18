"""Sharded FP32 masters (ZeRO-1) give the replicated result, on every rank, for any optimizer."""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

STEPS = 30


class Odd(nn.Module):
    """Uneven sizes: a 7-element parameter, a frozen one, a LayerNorm (stays FP32, replicated)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 13)
        self.seven = nn.Parameter(torch.randn(7) * 0.1)
        self.frozen = nn.Parameter(torch.randn(13), requires_grad=False)
        self.ln = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) + self.frozen
        h = h + F.pad(self.seven, (0, 6))
        return self.fc2(self.ln(h))


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05),
}


def make(opt_name, shard, world, clip=None, inject=None):
    model = Odd()
    groups = [
        {"params": [model.fc1.weight, model.fc1.bias, model.seven, model.frozen], "lr": 0.02},
        {"params": [*model.ln.parameters(), *model.fc2.parameters()]},
    ]
    opt = OPTIMIZERS[opt_name](groups)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    return model, opt


def train(rank, world, opt_name, shard, clip=None, inject=None):
    model, opt = make(opt_name, shard, world)
    ddp = DDP(model) if world > 1 else model
    gen = torch.Generator().manual_seed(5)
    history, norms, skipped = [], [], []
    for step in range(STEPS):
        x = torch.randn(4 * world, 6, generator=gen)[rank * 4 : rank * 4 + 4]
        y = torch.randn(4 * world, 3, generator=gen)[rank * 4 : rank * 4 + 4]
        with distamp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
            scaled.backward()
        if inject is not None and step == inject[0] and rank == inject[1]:
            model.fc1.weight.grad.view(-1)[inject[2]] = float("inf")
        if clip is not None:
            norms.append(distamp.clip_grad_norm_(opt, clip).item())
        opt.step()
        opt.zero_grad()
        skipped.append(distamp.stats(opt).last_step_skipped)
        history.append([p.detach().clone() for p in model.parameters()])
    s = distamp.stats(opt)
    return {
        "history": history,
        "skipped": skipped,
        "norms": norms,
        "master_bytes": s.master_bytes,
        "state_bytes": s.optimizer_state_bytes,
    }


def _all_modes(rank, world):
    return {
        (name, shard): train(rank, world, name, shard)
        for name in OPTIMIZERS
        for shard in (True, False)
    }


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def runs(request):
    return request.param, run_ranks(_all_modes, request.param)


pytestmark = pytest.mark.xdist_group("sharded")

# Cast and sharded: fc1 78+13, seven 7 and the frozen 13 in group 0 (a frozen parameter in the
# optimizer gets a master, so it trains once unfrozen); fc2 39+3 in group 1. The LayerNorm's 26
# stay FP32.
SHARDED_ELEMENTS = {0: 78 + 13 + 7 + 13, 1: 39 + 3}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_sharded_equals_replicated_on_every_rank_after_every_step(runs, opt_name):
    _sharded_equals_replicated(*runs, opt_name)


@pytest.mark.parametrize("shard_block", [4], indirect=True, ids=["blocks-4"])
def test_sharded_equals_replicated_with_many_blocks_per_shard(shard_block):
    """Blocks of 4 elements: every parameter is spread over all three ranks, round after round
    (see [Note: block-cyclic shards]); the arithmetic is still the replicated one."""
    results = run_ranks(_all_modes, 3)
    for opt_name in OPTIMIZERS:
        _sharded_equals_replicated(3, results, opt_name)


def _sharded_equals_replicated(world, results, opt_name):
    for rank_result in results:
        sharded, replicated = rank_result[(opt_name, True)], rank_result[(opt_name, False)]
        for step, (a, b) in enumerate(zip(sharded["history"], replicated["history"], strict=True)):
            for p, q in zip(a, b, strict=True):
                # the per-element arithmetic is the same: bit-identical
                assert torch.equal(p, q), (opt_name, step)
    for step in range(STEPS):  # every rank holds the same half weights after every step
        for other in results[1:]:
            for p, q in zip(
                results[0][(opt_name, True)]["history"][step],
                other[(opt_name, True)]["history"][step],
                strict=True,
            ):
                assert torch.equal(p, q)
    frozen = [name for name, _ in Odd().named_parameters()].index("frozen")
    final = results[0][(opt_name, True)]["history"][-1][frozen]
    assert torch.equal(final, Odd().frozen.to(torch.bfloat16))  # cast, never stepped


def _stepped_in_shard(world, rank):
    """(elements, parameters) with optimizer state in ``rank``'s shards: the parameters that get
    gradients (the frozen one never does, so it never gets state)."""
    groups = [[(78, True), (13, True), (7, True), (13, False)], [(39, True), (3, True)]]
    elements = params = 0
    for sizes in groups:
        size = -(-sum(n for n, _ in sizes) // world)
        lo, hi, start = rank * size, (rank + 1) * size, 0
        for n, stepped in sizes:
            a, b = max(start, lo), min(start + n, hi)
            if a < b and stepped:
                elements, params = elements + b - a, params + 1
            start += n
    return elements, params


def test_each_rank_holds_one_shard_of_masters_and_state(runs):
    world, results = runs
    shard_elems = sum(-(-n // world) for n in SHARDED_ELEMENTS.values())
    for rank, rank_result in enumerate(results):
        assert rank_result[("adamw", True)]["master_bytes"] == 4 * shard_elems
        assert rank_result[("adamw", False)]["master_bytes"] == 4 * sum(SHARDED_ELEMENTS.values())
        # AdamW: exp_avg + exp_avg_sq of the stepped part of the shard and of the 26 replicated
        # LayerNorm values, plus one 4-byte step per stepped parameter slice and LayerNorm tensor
        elements, slices = _stepped_in_shard(world, rank)
        expected_state = 2 * 4 * (elements + 26) + 4 * (slices + 2)
        assert rank_result[("adamw", True)]["state_bytes"] == expected_state


def _inject(rank, world):
    # element 95 of fc1.weight's flat group range sits in rank 2's shard at world 3 (shard 33)
    return train(rank, world, "adamw", True, inject=(4, 2, 77))


def test_inf_in_an_element_only_rank_2_owns_skips_every_rank():
    results = run_ranks(_inject, 3)
    for r in results:
        assert [i for i, s in enumerate(r["skipped"]) if s] == [4]
    for p, q in zip(results[0]["history"][-1], results[2]["history"][-1], strict=True):
        assert torch.equal(p, q)


def _clip(rank, world):
    return train(rank, world, "sgd", True, clip=0.05)


def _clip_reference(rank, world):
    return train(rank, world, "sgd", False, clip=0.05)


def test_global_norm_clipping_equals_the_unsharded_norm():
    sharded = run_ranks(_clip, 3)
    replicated = run_ranks(_clip_reference, 3)[0]  # unsharded FP32 master grads, torch's norm
    assert sharded[0]["norms"] == sharded[1]["norms"] == sharded[2]["norms"]
    assert len(sharded[0]["norms"]) == STEPS
    # Stated tolerance: the shards' sums of squares are added in another order: 1e-5 relative.
    for a, b in zip(sharded[0]["norms"], replicated["norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


class Tiny(nn.Module):
    """A 7-element parameter alone in its group: at world size 4 the shards are 2 elements and
    the last rank's shard is half padding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.seven = nn.Parameter(torch.randn(7))
        self.fc = nn.Linear(7, 2)

    def forward(self, x):
        return self.fc(x * self.seven)


def _variants(rank, world):
    out = {}
    for name, kw in {"fused": {"fused": True}, "foreach": {"foreach": True}}.items():
        for shard in (True, False):
            model = Tiny()
            groups = [
                {"params": [model.seven], "lr": 0.05},
                {"params": list(model.fc.parameters())},
            ]
            opt = torch.optim.AdamW(groups, lr=1e-2, **kw)
            model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard)
            ddp = DDP(model)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(10):
                loss = ddp(torch.randn(3, 7, generator=gen)).square().mean()
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
            out[(name, shard)] = [p.detach().clone() for p in model.parameters()]
    return out


def test_fused_and_foreach_adamw_and_a_mostly_padding_shard():
    results = run_ranks(_variants, 4)
    for name in ("fused", "foreach"):
        for rank_result in results:
            for p, q in zip(rank_result[(name, True)], rank_result[(name, False)], strict=True):
                # fused/foreach kernels may group the arithmetic differently per tensor size:
                # stated tolerance one bf16 ulp
                assert torch.allclose(p.float(), q.float(), rtol=2**-7, atol=0), name
            for p, q in zip(rank_result[(name, True)], results[0][(name, True)], strict=True):
                assert torch.equal(p, q)


def _moved_to_an_indexed_cpu(rank, world, opt_level, move):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(
        model, opt, opt_level=opt_level, shard_master_weights=True, verbosity=0
    )
    before = model[0].weight.data_ptr()
    if move:
        model.to("cpu:0")  # what accelerate's prepare and HF's Trainer do on a CPU machine
        assert model[0].weight.data_ptr() != before  # torch copied: the views were lost
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("opt_level", ["O0", "O2"])
def test_a_copy_to_the_same_device_after_wrap_trains_as_without_it(opt_level):
    """model.to("cpu:0") copies every weight out of the flat buffer the gathers write into:
    refused at the first step of every 2-rank accelerate / Trainer run on CPU (an audit). The
    copies go back into their slices (the FP32 masters kept): bit for bit the run without it."""
    moved = run_ranks(_moved_to_an_indexed_cpu, 2, opt_level, True)
    plain = run_ranks(_moved_to_an_indexed_cpu, 2, opt_level, False)
    for a, b in zip(moved, plain, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def _copied_with_the_gather_in_flight(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = distamp.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0
    )
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=True)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for step in range(2):
        if step == 1:
            model.to("cpu:0")  # the first step's gather may still be landing
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        try:
            opt.step()
        except ValueError as err:
            return str(err)
        opt.zero_grad()
    return None


def test_a_copy_taken_while_the_overlapped_gather_lands_is_refused():
    """Put back, a copy taken with the gather in flight overwrote the gathered weights with
    half-gathered ones (an audit: 2e-3 off, silently); it is refused by name, as before."""
    for message in run_ranks(_copied_with_the_gather_in_flight, 2):
        assert message is not None and "'0.weight'" in message, message
        assert "with overlap_gather a copy after the first step is refused" in message


def _pruned_after_the_gather(rank, world, overlap):
    """Magnitude pruning between steps through ``.data`` (after ``finish_gather()``, as the
    README asks under overlap_gather); FP32 weights: the same arithmetic with or without the
    overlap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O0", shard_master_weights=True, verbosity=0)
    ddp = DDP(model)
    state = distamp.hooks.register(ddp, opt, reduce_scatter=True, overlap_gather=overlap)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        with distamp.scale_loss(
            F.mse_loss(ddp(torch.randn(4, 8, generator=gen)), torch.zeros(4, 4)), opt
        ) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            state.finish_gather()
            weight = model[2].weight
            weight.data = weight.data * (weight.detach().abs() > 0.1)
    state.finish_gather()
    return [p.detach().clone() for p in model.parameters()]


def test_a_weight_replaced_after_the_overlapped_gather_landed_is_taken_as_a_write():
    """``w.data = w.data * mask`` after ``finish_gather()``: with overlap_gather it was refused
    at every later step, as if taken while the gather was in flight (an audit)."""
    overlapped = run_ranks(_pruned_after_the_gather, 2, True)
    plain = run_ranks(_pruned_after_the_gather, 2, False)
    for a, b in zip(overlapped, plain, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def _sparse_embedding(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, sparse=True), nn.Linear(8, 4))
    model, opt = distamp.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0
    )
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 20, (6,), generator=gen)
        with distamp.scale_loss(ddp(tokens).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_sparse_embedding_gradients_pass_the_gradient_comparison():
    """The decision's sample of the gradients read a sparse gradient with reshape: every step
    raised (an audit); sparse gradients are left out of the sample."""
    a, b = run_ranks(_sparse_embedding, 2)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _state_by_model_param(rank, world, shard):
    model = Odd()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    ddp = DDP(model)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + rank))
        with distamp.scale_loss(ddp(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    weight = model.fc1.weight
    found: dict = {"in": weight in opt.state, "get": opt.state.get(weight) is not None}
    try:
        state = opt.state[weight]  # a torch user's exp_avg logging
        found["keys"] = sorted(state)
        found["exp_avg"] = state["exp_avg"].dtype, tuple(state["exp_avg"].shape)
    except KeyError as err:
        found["error"] = str(err)
    found["state_dict"] = sorted(opt.state_dict()["state"])  # not poisoned by the lookup
    return found


@pytest.mark.parametrize("shard", [False, True])
def test_optimizer_state_read_by_a_model_parameter(shard):
    """``optimizer.state[p]["exp_avg"]`` for ``p`` in ``model.parameters()``: under O2 the state
    is the masters', so torch's defaultdict handed back ``{}`` and kept it under the half
    parameter, and the next ``optimizer.state_dict()`` died on a bare ``KeyError: <id>`` (an
    audit). Replicated masters answer for their parameter; sharded ones say where it is."""
    for found in run_ranks(_state_by_model_param, 2, shard, timeout=90):
        assert found["state_dict"] and all(isinstance(k, int) for k in found["state_dict"])
        if shard:
            assert not found["in"] and not found["get"]
            assert "optimizer.state['fc1.weight']: with sharded FP32 masters" in found["error"]
        else:
            assert found["in"] and found["get"]
            assert found["keys"] == ["exp_avg", "exp_avg_sq", "step"]
            assert found["exp_avg"] == (torch.float32, (13, 6))


class _TwoGroups(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 40)
        self.norm = nn.LayerNorm(40)  # FP32 at O2: stepped whole, beside the shards
        self.b = nn.Linear(40, 4)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


def _whole_state_resume(rank, world, directory, how, level="O2"):
    model = _TwoGroups()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is d for d in decay)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    shard = {"shard_master_weights": world > 1} if level == "O1" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **shard)
    trained = DDP(model) if world > 1 else model
    steps = range(3) if how == "save" else range(3, 5)
    if how == "torch.load":  # nanoGPT's resume: rank 0's whole state dict, on every rank
        saved = torch.load(f"{directory}/ckpt.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    elif how == "load_checkpoint":
        distamp.load_checkpoint(f"{directory}/dcp", model, opt)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        per = 8 // world
        mine = slice(rank * per, (rank + 1) * per)
        with distamp.scale_loss(F.mse_loss(trained(x[mine]).float(), y[mine]), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    if how == "save":
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{directory}/ckpt.pt"
        )
        distamp.save_checkpoint(f"{directory}/dcp", model, opt)
        return None
    return {k: v.float().clone() for k, v in model.state_dict().items()}, distamp.stats(opt).steps


@pytest.mark.parametrize(
    "shard_block,level", [(None, "O2"), (4, "O2"), (4, "O1")], indirect=["shard_block"]
)
def test_a_whole_optimizer_state_dict_resumes_into_sharded_masters(tmp_path, shard_block, level):
    """Trained at one rank (replicated masters), saved nanoGPT's way (torch.save of
    optimizer.state_dict()), resumed at two with sharded masters: refused before ("the state
    dict holds all FP32 masters"), now each rank cuts its shard of the masters and of AdamW's
    state, and trains on bit for bit as the same resume through load_checkpoint."""
    run_ranks(_whole_state_resume, 1, str(tmp_path), "save", level)
    via_torch = run_ranks(_whole_state_resume, 2, str(tmp_path), "torch.load", level)
    via_dcp = run_ranks(_whole_state_resume, 2, str(tmp_path), "load_checkpoint", level)
    for (weights, steps), (reference, ref_steps) in zip(via_torch, via_dcp, strict=True):
        assert steps == ref_steps == 5
        for name, value in reference.items():
            assert torch.equal(weights[name], value), name
