"""distamp.fsdp.fully_shard on layouts users bring: MoE experts in a ModuleList inside each block
(sharded innermost first), a norm class of the user's own (Llama's RMSNorm) kept FP32, an HSDP 2-D
mesh whose clipping counts each shard once, per-rank seeds that end as rank 0's model, and a model
built on the meta device (torchtitan's habit), materialized after sharding."""

import pytest
import torch
import torch.nn.functional as F
from asserts import assert_same
from dist_harness import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from user_models import LlamaRMSNorm

import distamp
import distamp.fsdp

GLOBAL_BATCH = 8


class MoEBlock(nn.Module):
    """A dense mixture of experts: every expert runs, weighted by a router (all get gradients)."""

    def __init__(self, d, n_experts=3):
        super().__init__()
        self.norm = LlamaRMSNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(n_experts)])

    def forward(self, x):
        h = self.norm(x)
        gates = torch.softmax(self.router(h).float(), dim=-1).to(h.dtype)
        out = sum(gates[..., i : i + 1] * e(h) for i, e in enumerate(self.experts))
        return x + out


class MoENet(nn.Module):
    def __init__(self, d=16, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList([MoEBlock(d) for _ in range(2)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def batch(step, rank, world):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 3, generator=gen)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def full_weights(model):
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in full.items()}


def materialize(model):
    """torchtitan's habit after sharding a meta-device model: ``to_empty``, then every rank writes
    its own shard — here of the weights MoENet(seed=1337) starts from (as a loaded checkpoint
    would be)."""
    from torch.distributed.tensor import distribute_tensor

    model.to_empty(device="cpu")
    reference = dict(MoENet(seed=1337).named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference[name].detach()
            param.to_local().copy_(
                distribute_tensor(full, param.device_mesh, param.placements).to_local()
            )


def moe_run(rank, world, mode, per_rank_seed=False, steps=6):
    if mode == "fsdp, meta device":
        with torch.device("meta"):
            model = MoENet()
    else:
        model = MoENet(seed=1337 + rank if per_rank_seed else 1337)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norm_dtypes = []
    model.blocks[0].norm.register_forward_hook(
        lambda m, args, out: norm_dtypes.append((m.weight.dtype, args[0].dtype, out.dtype))
    )
    if mode == "fsdp, meta device":
        # On CPU ranks a random init after to_empty would give every rank the same shard
        # (torch's DTensor RNG is GPU-only): said at fully_shard (an audit); loading is fine.
        with pytest.warns(UserWarning, match="draws every rank's shard from the same stream"):
            model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
        materialize(model)
    elif mode.startswith("fsdp"):
        model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    if mode.startswith("fsdp"):
        train_model = model
        units = [type(m).__name__ for m in model.blocks[0].experts]
    else:
        model, opt = distamp.wrap(
            model, opt, opt_level="O2", shard_master_weights=False, verbosity=0
        )
        train_model, units = DDP(model), []
    for step in range(steps):
        x, y = batch(step, rank, world)
        with distamp.scale_loss(F.mse_loss(train_model(x), y), opt) as scaled:
            scaled.backward()
        distamp.clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad()
    if mode.startswith("fsdp"):
        weights = full_weights(model)
    else:
        st = opt._distamp
        masters = dict(zip(map(id, st.masters.model_params), st.masters.masters, strict=True))
        weights = {n: masters[id(p)].detach().float().clone() for n, p in model.named_parameters()}
    return {"weights": weights, "norm_dtypes": norm_dtypes[-1], "units": units}


def moe_runs(rank, world):
    return {
        "fsdp": moe_run(rank, world, "fsdp"),
        "fsdp, seeded per rank": moe_run(rank, world, "fsdp", per_rank_seed=True),
        "ddp": moe_run(rank, world, "ddp"),
        "fsdp, meta device": moe_run(rank, world, "fsdp, meta device"),
    }


@pytest.fixture(scope="module")
def moe():
    """One world of 2 ranks runs the three trainings (a spawn costs more than a training)."""
    return run_ranks(moe_runs, 2)


pytestmark = pytest.mark.xdist_group("fsdp_layouts")


def test_moe_experts_inside_blocks_are_sharded_innermost_first_and_match_ddp(moe):
    fsdp = [r["fsdp"] for r in moe]
    ddp = [r["ddp"] for r in moe]
    # Each expert is its own FSDP unit (FSDP2 makes the class "FSDP<Linear>").
    assert all(u.startswith("FSDP") for u in fsdp[0]["units"]), fsdp[0]["units"]
    # The user's RMSNorm class keeps an FP32 weight (it casts its bf16 input up inside) and
    # hands bf16 on to the experts.
    assert fsdp[0]["norm_dtypes"] == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert ddp[0]["norm_dtypes"] == (torch.float32, torch.bfloat16, torch.bfloat16)
    # bf16 arithmetic reduced differently (reduce-scatter vs all-reduce): 6 AdamW steps of lr
    # 1e-2 agree within 5e-3.
    for name, value in ddp[0]["weights"].items():
        torch.testing.assert_close(fsdp[0]["weights"][name], value, atol=5e-3, rtol=0, msg=name)
    assert_same(fsdp[1]["weights"], fsdp[0]["weights"], "rank 1")


def test_per_rank_seeds_shard_rank_0s_model(moe):
    # nanoGPT seeds every rank differently before building the model: FSDP would shard a mix of
    # every rank's initial weights; fully_shard takes rank 0's first, as DDP does.
    for r in range(2):
        assert_same(
            moe[r]["fsdp, seeded per rank"]["weights"], moe[0]["fsdp"]["weights"], f"rank {r}"
        )


def test_a_model_built_on_the_meta_device_trains_as_the_materialized_one(moe):
    """Built on the meta device, sharded, then ``to_empty`` and each rank's shard written: the
    optimizer's references survive to_empty, the norm stays an FP32 unit, and training is bit for
    bit that of the same weights built in memory (nothing is broadcast: there is nothing yet)."""
    for r in range(2):
        meta = moe[r]["fsdp, meta device"]
        assert meta["norm_dtypes"] == (torch.float32, torch.bfloat16, torch.bfloat16)
        assert_same(meta["weights"], moe[0]["fsdp"]["weights"], f"rank {r}")


def _partly_meta(rank, world):
    model = MoENet()
    model.out.to("meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(
        ValueError, match=r"parameter 'out.weight' is on the meta device and others"
    ):
        distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    with torch.device("meta"):
        model = MoENet() if rank == 1 else None
    model = model or MoENet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"parameter 'inp.weight'.*\(meta device\)") as info:
        distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    return str(info.value)


def test_a_model_partly_on_the_meta_device_or_on_one_rank_only_is_refused():
    for message in run_ranks(_partly_meta, 2):
        assert "rank 1" in message, message


def _unfreeze(rank, world, late):
    """Progressive unfreezing: the optimizer starts with the head; the blocks join at step 3 by
    ``add_param_group`` (``late``), or are in their own group from the start with no gradient
    (None: AdamW leaves them alone) until step 3 — the same arithmetic by another path."""
    model = MoENet(seed=1337)
    head = [p for n, p in model.named_parameters() if not n.startswith("blocks")]
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks")]
    groups = [{"params": head}] + ([] if late else [{"params": blocks, "lr": 3e-3}])
    opt = torch.optim.AdamW(groups, lr=1e-2)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    stale = None
    if late and rank == 0:
        try:
            opt.add_param_group({"params": blocks[:1]})  # the objects from before fully_shard
        except ValueError as exc:
            stale = str(exc)
    for step in range(6):
        if step == 3 and late:
            sharded = [p for n, p in model.named_parameters() if n.startswith("blocks")]
            opt.add_param_group({"params": sharded, "lr": 3e-3})
        x, y = batch(step, rank, world)
        with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        if step < 3:
            for p in model.blocks.parameters():
                p.grad = None
        opt.step()
        opt.zero_grad()
    return full_weights(model), len(opt.param_groups), distamp.stats(opt).steps, stale


def test_add_param_group_after_fully_shard_unfreezes_like_a_group_held_from_the_start():
    late = run_ranks(_unfreeze, 2, True)
    early = run_ranks(_unfreeze, 2, False)
    for r in range(2):
        assert late[r][1:3] == early[r][1:3] == (2, 6)
        assert_same(late[r][0], early[r][0], f"rank {r}")
    start = MoENet(seed=1337).state_dict()
    assert not torch.equal(late[0][0]["blocks.0.router.weight"], start["blocks.0.router.weight"])
    assert "FSDP replaced the parameter objects" in late[0][3]


def hsdp_run(rank, world, steps=3):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = MoENet(seed=1337)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O0", mesh=mesh, verbosity=0)
    norms = []
    for step in range(steps):
        x, y = batch(step, rank, world)
        with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        norms.append(float(distamp.clip_grad_norm_(opt, 0.05)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "weights": full_weights(model)}


def reference_run(steps=3):
    model = MoENet(seed=1337)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(steps):
        x, y = batch(step, 0, 1)
        F.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    return {
        "norms": norms,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def test_hsdp_clipping_counts_each_shard_once():
    results = run_ranks(hsdp_run, 4)
    ref = reference_run()
    for r in results:
        # Replicated twice: counting each shard per replica would give sqrt(2) times the norm.
        torch.testing.assert_close(r["norms"], ref["norms"], rtol=1e-5, atol=0)
        for name, value in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


class NormedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class NormedNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([NormedBlock(d) for _ in range(2)])
        self.norm = LlamaRMSNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _blocks_naming_norms(rank, world, spec):
    model = NormedNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    blocks = {
        "default": None,
        "classes with the norm": [NormedBlock, LlamaRMSNorm],
        "every module with parameters": lambda m: any(True for _ in m.parameters(recurse=False)),
    }[spec]
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", blocks=blocks, verbosity=0)
    losses = []
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 3, generator=gen)
    for _ in range(4):  # one batch, so the loss must fall
        loss = F.mse_loss(model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4])
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("spec", ["classes with the norm", "every module with parameters"])
def test_blocks_that_name_norm_layers_train_like_the_default(spec):
    """Under O2 the norm layers are FP32 units of their own; ``blocks`` naming them too made
    torch refuse the second fully_shard ("can only be applied to a module once"), leaving the
    model half-sharded. They are left to their FP32 units now, and train as the default does."""
    default = run_ranks(_blocks_naming_norms, 2, "default")
    assert run_ranks(_blocks_naming_norms, 2, spec) == default
    assert default[0][-1] < default[0][0]


def _o3_fp16_eps(rank, world):
    model = MoENet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # eps=1e-8: 0 in fp16
    with pytest.warns(UserWarning, match=r"fully_shard: optimizer 0 param_groups\[0\]\['eps'\]"):
        distamp.fsdp.fully_shard(model, opt, opt_level="O3", half_dtype=torch.float16, verbosity=0)


def test_o3_fp16_with_an_eps_that_rounds_to_zero_is_warned_about_as_wrap_does():
    """FSDP's O3 steps fp16 weights with fp16 AdamW state: eps=1e-8 is 0 there and every weight
    was inf after the first step, with no warning (wrap gives one; an audit)."""
    run_ranks(_o3_fp16_eps, 2)


def _torch_state_dict_helpers(rank, world):
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = MoENet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    x, y = batch(0, rank, world)
    with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    state = get_optimizer_state_dict(model, opt)
    state = torch.utils._pytree.tree_map(
        lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state
    )  # (its tensors are the optimizer's own: zeroed below otherwise)
    saved = {
        k: v.to_local().clone()
        for k, v in opt.state[opt.param_groups[0]["params"][0]].items()
        if isinstance(v, torch.Tensor) and hasattr(v, "to_local")
    }
    for group_state in opt.state.values():
        for value in group_state.values():
            if hasattr(value, "to_local"):
                value.to_local().zero_()
    with pytest.warns(UserWarning, match="starts again at") as caught:
        set_optimizer_state_dict(model, opt, state)
    restored = opt.state[opt.param_groups[0]["params"][0]]
    return len(caught), all(torch.equal(restored[k].to_local(), v) for k, v in saved.items())


def test_torch_s_optimizer_state_dict_helpers_load_under_fsdp():
    """FSDP's idiom get/set_optimizer_state_dict keeps only torch's entries: refused for the
    missing 'distamp' entry (once with advice that pointed to wrap), although FSDP's FP32 shards
    hold all of the optimizer's state (an audit). It loads, warning that the scale starts
    afresh."""
    for warned, restored in run_ranks(_torch_state_dict_helpers, 2):
        assert warned and restored


def _mesh_per_pair(rank, world):
    """Two jobs of two ranks each, FSDP meshed per pair; rank 3 alone overflows at step 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    refused = ""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:  # a world mesh, the scaler over the pair: the ranks sharing gradients would decide apart
        distamp.fsdp.fully_shard(
            model, opt, opt_level="O1", mesh=init_device_mesh("cpu", (4,)), process_group=pair
        )
    except ValueError as err:
        refused = str(err)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mesh = DeviceMesh.from_group(pair, "cpu")  # no process_group: the mesh's group decides
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O1", mesh=mesh, verbosity=0)
    skipped = []
    for step in range(2):
        out = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(rank)))
        if step == 1 and rank == 3:
            out.register_hook(lambda g: g.index_fill(1, torch.tensor([2]), float("inf")))
        with distamp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        skipped.append(distamp.stats(opt).last_step_skipped)
    return refused, skipped, distamp.stats(opt).loss_scales


def test_a_mesh_decides_over_its_own_ranks_and_one_unlike_the_group_is_refused():
    """FSDP shares gradients over the mesh, the scaler decided over the process group without
    checking they match (an audit: a world mesh with a group per pair, and rank 3's inf made
    ranks 2-3 skip while 0-1 stepped inside one FSDP job, its shards half-updated and the loss
    scales parted). A mismatch is refused; a mesh per pair alone decides per pair."""
    results = run_ranks(_mesh_per_pair, 4, timeout=120)
    for refused, _, _ in results:
        assert "expected the mesh and the process group to span the same ranks" in refused
        assert "mesh ranks [0, 1, 2, 3]" in refused
    assert [r[1] for r in results] == [[False, False]] * 2 + [[False, True]] * 2
    assert results[0][2] == results[1][2] and results[2][2] == results[3][2]
    assert results[2][2][0] == results[0][2][0] / 2


def _unnamed_hsdp_mesh(rank, world, level):
    """torch's own HSDP habit gone wrong: a 2-D mesh without mesh_dim_names, then the retry."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="without mesh_dim_names") as refused:
        distamp.fsdp.fully_shard(model, opt, opt_level=level, mesh=init_device_mesh("cpu", (2, 2)))
    untouched = [type(m) for m in model.modules()] == classes and all(
        p.dtype == torch.float32 and type(p) is nn.Parameter for p in model.parameters()
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level=level, mesh=mesh, verbosity=0)
    with distamp.scale_loss(model(torch.randn(2, 8)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    return str(refused.value), untouched


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_2d_mesh_without_dim_names_is_refused_before_anything_changes(level):
    """torch refused it inside fully_shard, after distamp had cast the model and swapped its
    classes: the retry with a named mesh then failed on the half-converted model (an audit)."""
    for message, untouched in run_ranks(_unnamed_hsdp_mesh, 4, level, timeout=180):
        assert 'mesh_dim_names=("replicate", "shard")' in message and untouched, message
