"""Weights loaded after wrap always reach the FP32 masters, unrounded: into the whole model, into a
submodule, and in either order with the optimizer (see [Note: loading weights into the masters])."""

import copy

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import data, mlp
from torch import nn
from user_models import GPTConfig, NanoGPT

import distamp


def _masters_of(opt, model, name):
    """The FP32 master values of parameter ``name`` that this rank holds (flat)."""
    masters = opt._distamp.masters
    param = dict(model.named_parameters())[name]
    if not masters.sharded:
        for p, m, separate in zip(*masters.columns(), strict=True):
            if p is param:
                assert separate
                return m.detach().reshape(-1)
    pieces = []
    for layout, shard in zip(masters.groups, masters.shards, strict=True):
        for index, src, count, dst in layout.pieces:
            if layout.params[index] is param:
                pieces.append((src, shard[dst : dst + count]))
    return pieces


def _build(shard, seed=0):
    torch.manual_seed(seed)
    model = NanoGPT(GPTConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a step only copies masters to the model
    return distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)


def _step(model, opt, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 61, (2, 16), generator=gen)
    _, loss = model(idx, idx)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def _submodule_load(rank, world, shard):
    model, opt = _build(shard)
    torch.manual_seed(7)
    pretrained = NanoGPT(GPTConfig())  # other FP32 weights
    name = "transformer.h.0.mlp.c_fc.weight"
    block_state = pretrained.transformer.h[0].state_dict()
    model.transformer.h[0].load_state_dict(block_state)
    _step(model, opt)  # lr 0: the step writes the masters back into the model
    loaded = block_state["mlp.c_fc.weight"]
    return {
        "model": model.transformer.h[0].mlp.c_fc.weight.detach().clone(),
        "expected": loaded.to(torch.bfloat16),
        "masters": _masters_of(opt, model, name),
        "loaded": loaded.reshape(-1),
    }


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)], ids=["replicated", "sharded"])
def test_loading_a_submodule_reaches_the_masters_unrounded(shard, world):
    covered = 0
    for r in run_ranks(_submodule_load, world, shard, timeout=120):
        assert torch.equal(r["model"], r["expected"])  # the step did not write old weights back
        masters, loaded = r["masters"], r["loaded"]
        if isinstance(masters, torch.Tensor):  # replicated: the whole FP32 master
            assert torch.equal(masters, loaded)
            covered = loaded.numel()
            continue
        for src, piece in masters:  # sharded: this rank's pieces of it
            assert torch.equal(piece, loaded[src : src + piece.numel()])
            covered += piece.numel()
    assert covered == r["loaded"].numel()


def _reload_after_small_steps(rank, world, shard):
    """A pretrained state dict bf16 represents exactly (a model released in bf16, upcast), loaded
    again after a few small steps (a trial restarted, a rollback)."""
    torch.manual_seed(7)
    pretrained = {k: v.bfloat16().float() for k, v in NanoGPT(GPTConfig()).state_dict().items()}
    model = NanoGPT(GPTConfig())
    model.load_state_dict(pretrained)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    for seed in range(3):
        _step(model, opt, seed)
    model.load_state_dict(pretrained)
    names = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight"]
    return {name: (_masters_of(opt, model, name), pretrained[name].reshape(-1)) for name in names}


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)], ids=["replicated", "sharded"])
def test_reloading_bf16_representable_weights_after_small_steps_reaches_every_master(shard, world):
    """An audit: element by element, every value the small steps had moved by less than half a
    bf16 step was taken for the model's own weight and kept its trained master (251 of 256).
    A load is decided per weight now (see [Note: loading weights into the masters])."""
    compared = dict.fromkeys(
        ["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight"], 0
    )
    for result in run_ranks(_reload_after_small_steps, world, shard):
        for name, (masters, loaded) in result.items():
            pieces = [(0, masters)] if not shard else masters  # a rank may hold none of it
            for src, piece in pieces:
                assert torch.equal(piece.reshape(-1), loaded[src : src + piece.numel()]), name
                compared[name] += piece.numel()
    for name, count in compared.items():
        assert count == result[name][1].numel(), name  # every element, on some rank


def _resume(rank, world, shard, order):
    model, opt = _build(shard)
    model.train()
    for step in range(3):
        _step(model, opt, step)
    opt.param_groups[0]["lr"] = 0.05
    for step in range(3, 5):
        _step(model, opt, step)
    model_state = copy.deepcopy(model.state_dict())  # FP32 copies of the half weights (apex)
    opt_state = copy.deepcopy(opt.state_dict())
    for step in range(5, 9):
        _step(model, opt, step)
    straight = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = _build(shard, seed=1)  # other initial weights: everything must come back
    if order == "optimizer-first":
        opt2.load_state_dict(opt_state)
        model2.load_state_dict(model_state)
    else:
        model2.load_state_dict(model_state)
        opt2.load_state_dict(opt_state)
    for step in range(5, 9):
        _step(model2, opt2, step)
    return straight, [p.detach().clone() for p in model2.parameters()]


@pytest.mark.parametrize("order", ["optimizer-first", "model-first"])
@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)], ids=["replicated", "sharded"])
def test_resuming_from_state_dicts_in_either_order_is_bit_exact(shard, world, order):
    for straight, resumed in run_ranks(_resume, world, shard, order, timeout=120):
        for p, q in zip(straight, resumed, strict=True):
            assert torch.equal(p, q)


def test_state_dict_of_an_o2_model_is_fp32_and_loads_into_a_plain_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    assert model[0].weight.dtype == torch.bfloat16  # the model itself stays half
    assert model.state_dict(keep_vars=True)["0.weight"] is model[0].weight
    plain.load_state_dict(state)
    x = torch.randn(3, 4)
    torch.testing.assert_close(plain(x), model(x), rtol=2e-2, atol=2e-2)
    assert F.mse_loss(plain(x), model(x)).item() < 1e-3


def _written_in_place(rank, world, shard, hook):
    """Fine-tuning habits that write weights in place after wrap: a head re-initialized, a
    weight scaled (a LoRA merged into its base), one copied into; lr 0, so a step only writes
    the masters back into the model (an audit: O2 wrote the old weights back)."""
    model, opt = _build(shard)
    net = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(model)
        if hook:
            distamp.hooks.register(net, opt, reduce_scatter=True, overlap_gather=True)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 61, (2, 16), generator=gen)

    def step():
        _, loss = net(idx, idx)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()

    step()
    if hook:  # the overlapped gather must land before the weights are written
        opt._distamp.masters.finish_gather()
    with torch.no_grad():
        nn.init.zeros_(model.lm_head.weight)
        model.transformer.h[0].attn.c_attn.weight.mul_(0.5)
        fc = model.transformer.h[0].mlp.c_fc.weight
        fc.copy_(torch.full_like(fc, 0.25))
    written = {k: v.detach().clone() for k, v in model.named_parameters()}
    step()
    step()
    model.state_dict()  # waits for a gather in flight
    for name, before in written.items():
        assert torch.equal(dict(model.named_parameters())[name].detach(), before), name
    return True


@pytest.mark.parametrize(
    ("shard", "world", "hook"), [(False, 1, False), (True, 2, False), (True, 2, True)]
)
def test_weights_written_in_place_after_wrap_reach_the_masters(shard, world, hook):
    assert run_ranks(_written_in_place, world, shard, hook) == [True] * world


def _rollback_while_gathering(rank, world, opt_level):
    """optimizer.load_state_dict right after a step whose bf16-update gather is still in flight
    (a rollback after a bad step): the gather landed after the load, on top of the loaded
    masters, and the rank kept the newer weights with the older moments (an audit)."""
    model = mlp(8, 32, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model, opt = distamp.wrap(
        model, opt, opt_level=opt_level, shard_master_weights=True, verbosity=0
    )
    net = nn.parallel.DistributedDataParallel(model)
    distamp.hooks.register(
        net, opt, reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16
    )
    batches = data(2, 4 * world)

    def step(i):
        x, y = batches[i]
        loss = F.mse_loss(net(x[rank * 4 : rank * 4 + 4]).float(), y[rank * 4 : rank * 4 + 4])
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()

    step(0)
    saved = opt.state_dict()  # (waits for the gather)
    weights = [p.detach().clone() for p in model.parameters()]
    step(1)  # its gather left in flight
    opt.load_state_dict(saved)
    masters = opt.state_dict()["distamp"]["masters"]
    same_masters = all(
        torch.equal(a, b) for a, b in zip(masters, saved["distamp"]["masters"], strict=True)
    )
    same_weights = all(
        torch.equal(a, p.detach()) for a, p in zip(weights, model.parameters(), strict=True)
    )
    return same_masters, same_weights


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_loading_an_optimizer_state_while_a_gather_is_in_flight_restores_it(opt_level):
    assert run_ranks(_rollback_while_gathering, 2, opt_level) == [(True, True)] * 2


def test_optimizer_state_loaded_before_wrap_is_named():
    """nanoGPT's resume order: optimizer.load_state_dict(ckpt["optimizer"]) right after the
    optimizer is built, before wrap. torch drops the saved "distamp" entry (FP32 masters,
    scalers); nothing failed, the run resumed from half-rounded masters (an audit)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = mlp()
    saved_model, saved_opt = distamp.wrap(
        saved, torch.optim.AdamW(saved.parameters(), lr=1e-3), opt_level="O2", verbosity=0
    )
    x, y = data(1, 4)[0]
    with distamp.scale_loss(F.mse_loss(saved_model(x), y), saved_opt) as scaled:
        scaled.backward()
    saved_opt.step()
    state = saved_opt.state_dict()
    assert "distamp" in state
    opt.load_state_dict(state)  # torch's own: the "distamp" entry is ignored
    with pytest.warns(
        UserWarning, match=r"optimizers\[0\] has state already .* load that after wrap"
    ):
        distamp.wrap(model, opt, opt_level="O2", verbosity=0)


def _load_on_some_ranks(rank, world, level, kwargs, when, loaders):
    """``model.load_state_dict(pretrained)`` on the ranks in ``loaders``, before or after DDP;
    the refusal's message, else the weights after three steps (lr 0: the loaded values)."""
    pretrained = {k: v.clone() for k, v in mlp(seed=5).state_dict().items()}
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kwargs)
    if when == "before DDP" and rank in loaders:
        model.load_state_dict(pretrained)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if when == "after DDP" and rank in loaders:
        model.load_state_dict(pretrained)
    try:
        for x, y in data(3, 8, seed=rank):
            with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as err:
        return str(err)
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("level", "kwargs"),
    [("O2", {}), ("O2", {"shard_master_weights": False}), ("O0", {"shard_master_weights": True})],
    ids=["O2-sharded", "O2-replicated", "O0-sharded"],
)
@pytest.mark.parametrize("when", ["after DDP", "before DDP"])
def test_a_load_on_some_ranks_only_is_refused_on_every_rank(level, kwargs, when):
    """[Note: a load on some ranks only] Rank 0 alone loading pretrained weights after DDP
    (which broadcasts only when built) made the sharded masters a silent mixture of rank 0's
    loaded pieces and the others' initial ones (an audit: 106 of 128 elements), and replicated
    masters part between the ranks; before DDP, its broadcast of the half weights left rank 1's
    masters rounded. Refused at the step, on every rank, naming the weights; loads on every
    rank train on."""
    for message in run_ranks(_load_on_some_ranks, 2, level, kwargs, when, (0,), timeout=120):
        assert isinstance(message, str), "expected a refusal"
        assert "expected every rank to load the same weights" in message, message
        assert "'0.weight'" in message or "loaded nothing" in message, message
    both = run_ranks(_load_on_some_ranks, 2, level, kwargs, when, (0, 1), timeout=120)
    assert not isinstance(both[0], str), both[0]
    pretrained = list(mlp(seed=5).parameters())
    for a, b, want in zip(*both, pretrained, strict=True):
        assert torch.equal(a, b)  # the loaded weights (lr 0), the same on both ranks
        torch.testing.assert_close(a, want.detach(), atol=4e-3, rtol=0)  # (bf16 at O2)
