"""FSDP2 through distamp.fsdp.fully_shard: matches DDP + distamp, global skip, checkpoints, order."""

import dataclasses
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from asserts import assert_same, step_error
from dist_harness import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp
import distamp.fsdp
from distamp.checkpoint import consolidate, consolidate_optimizer_state

GLOBAL_BATCH = 12


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(nn.Module):
    """Transformer-like layout: an input layer, a ModuleList of blocks (the FSDP units), a head."""

    def __init__(self, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def batch(step, rank, world):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def build(mode, opt_level="O2", half=torch.bfloat16, d=16, fused=False):
    model = Net(d)
    kwargs = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)
    if mode in ("fsdp", "fsdp1"):
        api = "fsdp1" if mode == "fsdp1" else "fsdp2"
        model, opt = distamp.fsdp.fully_shard(
            model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, api=api
        )
        return model, model, opt
    extra = {} if opt_level == "O1" else {"shard_master_weights": False}
    model, opt = distamp.wrap(
        model, opt, opt_level=opt_level, half_dtype=half, verbosity=0, **extra
    )
    return model, DDP(model), opt


def fp32_weights(mode, model, opt):
    """Name -> FP32 weights (FSDP: its gathered FP32 shards; DDP: the FP32 masters)."""
    if mode in ("fsdp", "fsdp1"):
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return {k: v.clone() for k, v in full.items()}
    st = opt._distamp
    masters = dict(zip(map(id, st.masters.model_params), st.masters.masters, strict=True))
    return {n: masters[id(p)].detach().float().clone() for n, p in model.named_parameters()}


def train(rank, world, mode, opt_level, half, steps, d=16, fused=False, inf_at=None):
    model, train_model, opt = build(mode, opt_level, half, d, fused)
    skipped_here, weights_around_skip = [], None
    for step in range(steps):
        x, y = batch(step, rank, world)
        out = train_model(x)
        # O2 outputs come back FP32, as with DDP; O1's are autocast's (the half dtype).
        assert out.dtype == (torch.float32 if opt_level in ("O0", "O2", "O3") else half)
        with distamp.scale_loss(F.mse_loss(out, y), opt) as scaled:
            scaled.backward()
        if step == inf_at and rank == world - 1:
            local = model.blocks[1].fc.weight.grad
            local = local.to_local() if mode == "fsdp" else local  # (FSDP1's: a plain piece)
            assert local.numel() > 0
            local.view(-1)[0] = float("inf")  # this rank's shard only: no other rank sees it
            weights_around_skip = fp32_weights(mode, model, opt)
        elif step == inf_at:
            weights_around_skip = fp32_weights(mode, model, opt)
        distamp.clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad()
        if distamp.stats(opt).last_step_skipped:
            skipped_here.append(step)  # fp16 may also overflow at the initial scale of 2**16
            if step == inf_at:
                assert_same(fp32_weights(mode, model, opt), weights_around_skip, "skipped step")
    stats = distamp.stats(opt)
    return {
        "weights": fp32_weights(mode, model, opt),
        "skipped": skipped_here,
        "scale": stats.loss_scales[0],
        "master_bytes": stats.master_bytes,
        "state_bytes": stats.optimizer_state_bytes,
        "collectives": opt._distamp.group.found_inf_collectives,
        "report": str(stats.last_nonfinite),
        "param_dtypes": {p.dtype for g in opt.param_groups for p in g["params"]},
        "state_dtypes": {
            v.dtype
            for s in opt.state.values()
            for k, v in s.items()
            if k != "step" and v.is_floating_point()  # AdamW's step counter is FP32
        },
    }


@pytest.mark.parametrize(
    "world,opt_level,half,d",
    [
        (2, "O2", torch.bfloat16, 16),
        (4, "O2", torch.bfloat16, 16),
        (2, "O1", torch.bfloat16, 16),
        (2, "O2", torch.float16, 8),  # fp16 matmul is ~100x slower on CPU: a tiny model
    ],
    ids=["w2-O2-bf16", "w4-O2-bf16", "w2-O1-bf16", "w2-O2-fp16"],
)
def test_fsdp2_matches_ddp_with_distamp(world, opt_level, half, d):
    fsdp = run_ranks(train, world, "fsdp", opt_level, half, 30, d)
    ddp = run_ranks(train, world, "ddp", opt_level, half, 30, d)
    # Same arithmetic up to where the half-precision gradients are summed (FSDP reduce-scatters
    # in the half dtype, DDP's hook all-reduces in it): after 30 AdamW steps of lr 1e-2 with
    # clipping the FP32 weights agree within 5e-3 (measured: 1.4e-3 for O2 bf16 at 2 ranks).
    for name, value in ddp[0]["weights"].items():
        torch.testing.assert_close(fsdp[0]["weights"][name], value, atol=5e-3, rtol=0, msg=name)
    assert fsdp[0]["skipped"] == ddp[0]["skipped"] and fsdp[0]["scale"] == ddp[0]["scale"]
    for r in range(world):
        assert_same(fsdp[r]["weights"], fsdp[0]["weights"], f"rank {r}")
        assert fsdp[r]["collectives"] == 30  # one MAX all-reduce per step, on every rank
    if opt_level == "O2":
        net = Net(d)
        n = sum(p.numel() for p in net.parameters())
        norms = sum(
            p.numel() for m in net.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()
        )
        assert norms > 0
        # Each rank holds only its FP32 shard (FSDP's dim-0 shards, uneven rows rounded up) of
        # the weights computing in half; the FP32 norm units are their own masters and count 0,
        # as under wrap's O2 (an audit: counted here, not there).
        assert sum(r["master_bytes"] for r in fsdp) >= 4 * (n - norms)
        assert max(r["master_bytes"] for r in fsdp) < 4 * (n - norms)
        assert sum(r["master_bytes"] for r in fsdp) < 4 * (n - norms) + 4 * 16 * world
        # AdamW's two moments per shard element (and a step counter per parameter): the local
        # shard's bytes, not the DTensor's global size; the norms' state too.
        for r in fsdp:
            assert (
                2 * r["master_bytes"]
                <= r["state_bytes"]
                < 2 * r["master_bytes"] + 4 * 64 + 8 * norms
            )


def _fsdp1_checkpoint(rank, world, directory):
    model, _, opt = build("fsdp1", "O2", torch.bfloat16)
    x, y = batch(0, rank, world)
    with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    try:
        distamp.save_checkpoint(directory, model, opt)
    except ValueError as err:
        return str(err), os.path.exists(directory)
    return None, os.path.exists(directory)


def test_fsdp1_trains_on_cpu_as_fsdp2_does_and_its_checkpoint_is_refused(tmp_path):
    """api='fsdp1' was refused on CPU as "torch refuses CPU-only FSDP1", which torch 2.13 does
    not (an audit): FullyShardedDataParallel runs there with device_id cpu. The same arithmetic
    as FSDP2 (a bf16 reduce-scatter; the FP32 shards stepped), FP32 outputs at O2 as FSDP2's
    (they came back bf16: FSDP1's MixedPrecision has no output dtype), the same global skip on
    an inf in one rank's piece, exact at O0. distamp's checkpoints do not hold FSDP1's flat shards
    (the load of one failed on a size mismatch): refused on every rank, nothing written."""
    fsdp1 = run_ranks(train, 2, "fsdp1", "O2", torch.bfloat16, 10, 16, False, 3)
    fsdp2 = run_ranks(train, 2, "fsdp", "O2", torch.bfloat16, 10, 16, False, 3)
    for name, value in fsdp2[0]["weights"].items():  # (measured: 1.2e-7)
        torch.testing.assert_close(fsdp1[0]["weights"][name], value, atol=1e-5, rtol=0, msg=name)
    for r in fsdp1:
        assert r["skipped"] == [3] and r["scale"] == 2.0**15 and r["collectives"] == 10
        assert_same(r["weights"], fsdp1[0]["weights"], "ranks")
    exact = run_ranks(train, 2, "fsdp1", "O0", torch.bfloat16, 6)
    reference = run_ranks(train, 2, "ddp", "O0", torch.bfloat16, 6)
    for name, value in reference[0]["weights"].items():
        torch.testing.assert_close(exact[0]["weights"][name], value, atol=1e-6, rtol=0, msg=name)
    for message, written in run_ranks(_fsdp1_checkpoint, 2, str(tmp_path / "ckpt")):
        assert "found FullyShardedDataParallel (api='fsdp1')" in message and not written


def _disabled_clip_norm(rank, world, api, norm_type=2.0, inf_on_rank_1=False):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, api=api, enabled=False, verbosity=0)
    x, y = batch(0, rank, world)
    F.mse_loss(model(x), y).backward()
    if inf_on_rank_1:
        grads = [p.grad for p in opt.param_groups[0]["params"] if p.grad is not None]
        if rank == 1:
            next(g for g in grads if g.numel()).view(-1)[0] = float("inf")
        before = [g.clone() for g in grads]
        try:
            distamp.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
        except RuntimeError as err:  # torch's, the gradients untouched
            return str(err), all(torch.equal(a, b) for a, b in zip(before, grads, strict=True))
        return None, None
    return float(distamp.clip_grad_norm_(opt, 1e9, norm_type))


def test_clipping_with_fsdp1_disabled_uses_the_global_norm():
    """fully_shard(api='fsdp1', enabled=False): the optimizer holds flat views of each rank's
    shard, and torch's clip over them clipped each rank by its own norm (a review: 1.15 and
    1.86 where the model's norm is 2.18), silently."""
    for norm_type in (2.0, float("inf")):
        fsdp1 = run_ranks(_disabled_clip_norm, 2, "fsdp1", norm_type)
        fsdp2 = run_ranks(_disabled_clip_norm, 2, "fsdp2", norm_type)
        # (FSDP2's inf-norm came back a Partial(max) DTensor: each rank's own max, a review)
        assert fsdp1[0] == fsdp1[1] and fsdp2[0] == fsdp2[1], (fsdp1, fsdp2)
        assert fsdp1[0] == pytest.approx(fsdp2[0], rel=1e-6), (fsdp1, fsdp2)
    # error_if_nonfinite raises before anything is clipped (FSDP1's clip made rank 1's NaN)
    for message, untouched in run_ranks(_disabled_clip_norm, 2, "fsdp1", 2.0, True):
        assert message is not None and "is non-finite, so it cannot be clipped" in message
        assert untouched


def test_o3_under_fsdp_is_pure_half_like_wrap_o3():
    """[Note: O3 under FSDP] O3 has no masters: FSDP shards half weights and the optimizer
    steps them with half state, as wrap's O3 + DDP does (an audit found FP32 shards and FP32
    AdamW state under "O3"). LayerNorms are half too at O3 (keep_batchnorm_fp32=False)."""
    fsdp = run_ranks(train, 2, "fsdp", "O3", torch.bfloat16, 10)
    ddp = run_ranks(train, 2, "ddp", "O3", torch.bfloat16, 10)
    for result in fsdp + ddp:
        assert result["param_dtypes"] == {torch.bfloat16}, result["param_dtypes"]
        assert result["state_dtypes"] <= {torch.bfloat16}, result["state_dtypes"]
        assert result["master_bytes"] == 0
    # bf16 weights stepped by AdamW at lr 1e-2 from gradients summed in another order: they
    # agree within a few bf16 steps of the weights' size (measured: 7.8e-3 after 10 steps)
    for name, value in ddp[0]["weights"].items():
        got = fsdp[0]["weights"][name].float()
        torch.testing.assert_close(got, value.float(), atol=3e-2, rtol=0, msg=name)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "foreach-adamw"])
def test_inf_in_one_ranks_local_shard_skips_every_rank(fused):
    results = run_ranks(train, 2, "fsdp", "O2", torch.bfloat16, 6, 16, fused, 3)
    for r in results:
        assert r["skipped"] == [3]
        assert r["scale"] == 2.0**15
        assert r["collectives"] == 6
        # Read in the shards after FSDP's reduce-scatter: whose batch it came from is not known
        # (the report named the shard's owner as the rank that had it; an audit).
        assert r["report"] == (
            "parameter 'blocks.1.fc.weight' had an inf gradient in rank 1's shard after FSDP's "
            "reduce-scatter (the rank whose batch produced it is not known)"
        )
    assert_same(results[1]["weights"], results[0]["weights"], "ranks after the skip")


def shard_master_weights_option(rank, world):
    """fully_shard(..., shard_master_weights=True) as a DeepSpeed/ZeRO user would write it."""
    weights = {}
    for name, extra in {"default": {}, "True": {"shard_master_weights": True}}.items():
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = distamp.fsdp.fully_shard(
            model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0, **extra
        )
        for step in range(3):
            _step(model, opt, step, rank, world)
        weights[name] = fp32_weights("fsdp", model, opt)
    model = Net()
    try:
        distamp.fsdp.fully_shard(
            model, torch.optim.SGD(model.parameters(), lr=0.1), shard_master_weights=False
        )
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return weights, refused


def test_shard_master_weights_is_accepted_and_false_is_refused():
    for weights, refused in run_ranks(shard_master_weights_option, 2):
        assert_same(weights["True"], weights["default"], "shard_master_weights=True")
        assert "shard_master_weights=False" in refused and "always shards" in refused


def _scalar_parameter(rank, world):
    class Clip(nn.Module):  # CLIP's logit_scale
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.logit_scale = nn.Parameter(torch.tensor(2.0))

    model = Clip()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as caught:
        distamp.fsdp.fully_shard(model, opt, opt_level="O0")
    untouched = all(type(m) in (Clip, nn.ModuleList, nn.Linear) for m in model.modules())
    return str(caught.value), untouched


def test_a_scalar_parameter_is_named_before_anything_is_sharded():
    """torch's fully_shard refuses a 0-dim parameter at the module holding it, the root, after
    the blocks were sharded: the model was left half sharded (an audit)."""
    for message, untouched in run_ranks(_scalar_parameter, 2):
        assert "'logit_scale'" in message and "0-dim" in message, message
        assert untouched


def _blocks_selecting_nothing(rank, world, spec):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocks = {"class": [nn.GRU], "predicate": lambda m: False, "none on purpose": ()}[spec]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distamp.fsdp.fully_shard(model, opt, opt_level="O0", blocks=blocks)
    return [str(w.message) for w in caught if "selects no submodule" in str(w.message)]


@pytest.mark.parametrize("spec", ["class", "predicate", "none on purpose"])
def test_blocks_that_select_nothing_are_said(spec):
    """A class the model does not hold (imported from another model's file) or a predicate true
    for none left the model one unit, its memory saving gone, unwarned (an audit)."""
    for said in run_ranks(_blocks_selecting_nothing, 2, spec):
        if spec == "none on purpose":
            assert said == []
        else:
            assert len(said) == 1 and ("GRU" in said[0] or "lambda" in said[0]), said


def _outside_backward_then_block_under_fsdp(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(
        model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=128.0, blocks=()
    )
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x).float().sum().backward()  # outside scale_loss: no hook sees it under FSDP
    # at the step, every rank together (a rank refusing alone at its block would leave the
    # others in FSDP's collectives)
    with pytest.raises(RuntimeError, match=r"^optimizer.step\(\): expected the gradients pend"):
        with distamp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    opt.zero_grad()
    with distamp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    return distamp.stats(opt).steps


def _outside_backward_instead_of_a_block_on_one_rank(rank, world):
    model, _, opt = build("fsdp", "O2", torch.bfloat16)
    x, y = batch(0, rank, world)
    loss = F.mse_loss(model(x), y)
    if rank == 1:
        loss.backward()
    else:
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    return step_error(opt)


def test_a_rank_whose_only_backward_ran_outside_scale_loss_is_named_under_fsdp():
    """No hook sees a backward under FSDP: the rank was told it "ran no backward" (Join,
    discards; a review), where under DDP it is named as running it outside scale_loss."""
    for message in run_ranks(_outside_backward_instead_of_a_block_on_one_rank, 2):
        assert message is not None, "expected a refusal"
        assert "0 on rank 1 (which ran a backward outside scale_loss)" in message, message


def test_a_block_after_an_outside_backward_is_refused_under_fsdp():
    """The outside share (scale 1.0) was divided by the block's loss scale, silently (an
    audit): no backward hook watches FSDP's sharded gradients, so they are read."""
    assert run_ranks(_outside_backward_then_block_under_fsdp, 2) == [1, 1]


@dataclasses.dataclass
class _Out:
    """A plain dataclass output (pytree does not open it)."""

    logits: torch.Tensor


class _Residual(nn.Module):
    """``x + f(x)``: the input's own AccumulateGrad node is the nearest one to the output; the
    output a dataclass or a tensor."""

    def __init__(self, wrapped):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.wrapped = wrapped

    def forward(self, x):
        out = x + self.f(x)
        return _Out(out) if self.wrapped else out


def _block_then_outside_backward_under_fsdp(rank, world, then, penalty, wrapped):
    """A block, then a second loss's backward outside any block (or, ``penalty``, only
    ``torch.autograd.grad`` through the outputs to the input: nothing accumulated), then
    ``then``; ``wrapped``: the model returns a dataclass."""
    torch.manual_seed(0)
    model = _Residual(wrapped)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(
        model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=128.0, blocks=()
    )

    def out(x):
        y = model(x)
        return (y.logits if wrapped else y).float()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    with distamp.scale_loss(out(x).sum(), opt) as scaled:
        scaled.backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        penalty_term = 0.0
        if penalty:  # R1's: the input gradient's norm, added to the next block's loss
            leaf = x.detach().half().requires_grad_(True)  # its node next to the output's
            (grad,) = torch.autograd.grad(out(leaf).sum(), leaf, create_graph=True)
            penalty_term = grad.float().pow(2).mean()
        else:
            out(x).pow(2).sum().backward()  # outside scale_loss: no hook saw it
        try:
            if then == "step":
                opt.step()
            else:
                loss = out(x.detach()).pow(2).mean() + penalty_term
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
        except RuntimeError as err:
            return str(err), [str(w.message) for w in seen]
    return distamp.stats(opt).steps, [str(w.message) for w in seen]


@pytest.mark.parametrize(("then", "wrapped"), [("step", False), ("block", False), ("step", True)])
def test_a_backward_outside_the_blocks_after_one_is_refused_under_fsdp(then, wrapped):
    """An audit: the outside loss's gradients (scale 1.0) were added to the block's (scale 128)
    and the step divided the sum by 128, silently but for a warning that blamed clipping; under
    DDP a post-accumulate-grad hook refuses it, and FSDP's sharded gradients have none. Refused
    on every rank as under DDP, with no warning, whatever the model returns (a review: a hook on
    the outputs missed a dataclass)."""
    for error, said in run_ranks(_block_then_outside_backward_under_fsdp, 2, then, False, wrapped):
        # (at the step, every rank together: one rank alone refusing at its block left the
        # others in FSDP's collectives, an audit)
        assert error.startswith("optimizer.step(): expected every backward between two"), error
        assert "found on rank 1 a backward outside" in error, error
        assert said == [], said


def test_a_gradient_penalty_through_the_outputs_between_blocks_is_not_refused_under_fsdp():
    """torch.autograd.grad accumulates nothing: not refused (a review: with the input's node the
    nearest to the output, the check itself raised inside torch)."""
    for steps, said in run_ranks(_block_then_outside_backward_under_fsdp, 2, "block", True, False):
        assert steps == 1 and said == [], (steps, said)


class _BodyAndProbe(nn.Module):
    """A body the distamp optimizer steps, a probe head a plain optimizer steps, and a weight
    used only functionally (``F.linear``: its module's forward never runs)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.probe = nn.Linear(4, 1)
        self.holder = nn.Module()
        self.holder.w = nn.Parameter(torch.randn(4, 4) * 0.1)

    def forward(self, x):
        return F.linear(self.body(x), self.holder.w), self.probe(x), F.linear(x, self.holder.w)


def _outside_backwards_under_fsdp(rank, world, case):
    """``probe``: the probe's own loss backward outside the blocks (it reaches no parameter of
    the distamp optimizer); ``functional``: a loss through the functional weight only; ``slip``:
    ``loss.backward()`` inside the block (apex's slip)."""
    torch.manual_seed(0)
    model = _BodyAndProbe()
    held = [*model.body.parameters(), model.holder.w]
    opt = torch.optim.SGD(held, lr=0.1)
    model, opt = distamp.fsdp.fully_shard(
        model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=128.0, blocks=()
    )
    held = [p for group in opt.param_groups for p in group["params"]]
    probe_opt = torch.optim.SGD(model.probe.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    said = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            main, aux, functional = model(x)
            loss = main.float().pow(2).mean()
            if case == "l2 inside":  # an L2 penalty over the sharded parameters themselves
                loss = loss + sum(p.float().pow(2).sum().full_tensor() for p in held) * 1e-2
            with distamp.scale_loss(loss, opt) as scaled:
                (loss if case == "slip" else scaled).backward(retain_graph=True)
            if case == "l2 outside":
                (sum(p.float().pow(2).sum().full_tensor() for p in held) * 1e-2).backward()
            if case == "probe":
                aux.float().pow(2).mean().backward()
            elif case == "functional":
                functional.float().sum().backward()  # reaches holder.w alone
            try:
                opt.step()
            except RuntimeError as err:
                return str(err)
            said += [str(w.message) for w in seen]
        probe_opt.step()
        opt.zero_grad()
        probe_opt.zero_grad()
    return distamp.stats(opt).steps, said


@pytest.mark.parametrize("case", ["probe", "functional", "slip", "l2 inside", "l2 outside"])
def test_which_backwards_outside_the_blocks_fsdp_tells_apart(case):
    """Reviews: the probe head's own backward (no parameter of this optimizer) was refused, a
    weight used functionally escaped the check, ``loss.backward()`` inside a block gave
    updates 1/scale too small with no word (DDP's wrap warns), and an L2 penalty over the
    sharded parameters backpropagated outside the blocks was divided by the loss scale."""
    for result in run_ranks(_outside_backwards_under_fsdp, 2, case):
        if case in ("probe", "l2 inside"):
            assert result == (2, []), result
        elif case in ("functional", "l2 outside"):
            assert result.startswith("optimizer.step(): expected every backward"), result
        else:
            steps, said = result
            assert steps == 2 and said, result
            assert all("not through the scaled loss" in message for message in said), said


def _gan_with_a_frozen_discriminator(rank, world):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    kwargs = {"opt_level": "O2", "half_dtype": torch.float16, "loss_scale": 128.0, "blocks": ()}
    gen, opt_g = distamp.fsdp.fully_shard(gen, opt_g, **kwargs)
    disc, opt_d = distamp.fsdp.fully_shard(disc, opt_d, **kwargs)
    z = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        fake = gen(z)
        loss_d = disc(z + 1).float().mean() - disc(fake.detach()).float().mean()
        with distamp.scale_loss(loss_d, opt_d) as scaled:
            scaled.backward()
        disc.requires_grad_(False)  # the generator's loss reaches no discriminator gradient
        with distamp.scale_loss(-disc(fake).float().mean(), opt_g) as scaled:
            scaled.backward()
        disc.requires_grad_(True)
        opt_d.step()
        opt_g.step()
        opt_d.zero_grad()
        opt_g.zero_grad()
    return distamp.stats(opt_d).steps, distamp.stats(opt_g).steps


def test_a_gan_whose_frozen_discriminator_the_generators_block_runs_through_is_not_refused():
    """Two fully_shard calls: the generator's block between the discriminator's block and its
    step accumulates nothing into the frozen discriminator (a review: refused)."""
    assert run_ranks(_gan_with_a_frozen_discriminator, 2) == [(2, 2), (2, 2)]


# -- checkpoints ----------------------------------------------------------------------------------


def train_save_train(rank, world, directory, steps_before, steps_after):
    model, _, opt = build("fsdp")
    for step in range(steps_before):
        _step(model, opt, step, rank, world)
    distamp.save_checkpoint(directory, model, opt, extra={"step": steps_before})
    for step in range(steps_before, steps_before + steps_after):
        _step(model, opt, step, rank, world)
    return fp32_weights("fsdp", model, opt), _full_optimizer_state(model, opt)


def load_train(rank, world, directory, steps_after, resave=None):
    model, _, opt = build("fsdp")
    extra = distamp.load_checkpoint(directory, model, opt)
    if resave is not None:
        distamp.save_checkpoint(resave, model, opt, extra=extra)
    for step in range(extra["step"], extra["step"] + steps_after):
        _step(model, opt, step, rank, world)
    return fp32_weights("fsdp", model, opt), _full_optimizer_state(model, opt)


def _step(model, opt, step, rank, world):
    x, y = batch(step, rank, world)
    with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def _full_optimizer_state(model, opt):
    out = {}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"{name}.{k}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v
    return out


def test_fsdp_checkpoint_round_trip_and_reshard(tmp_path):
    directory = str(tmp_path / "ckpt")
    straight = run_ranks(train_save_train, 2, directory, 6, 4)[0]
    resumed = run_ranks(load_train, 2, directory, 4)[0]
    assert_same(resumed, straight, "resumed at the same world size")
    resaved = str(tmp_path / "at3")
    run_ranks(load_train, 3, directory, 2, resaved)
    assert_same(consolidate(resaved), consolidate(directory), "weights resharded 2 -> 3")
    assert_same(
        consolidate_optimizer_state(resaved), consolidate_optimizer_state(directory), "state 2 -> 3"
    )
    plain = Net()
    plain.load_state_dict(consolidate(directory))  # FSDP's FP32 shards, consolidated
    assert distamp.checkpoint.inspect(directory)["sharding"].startswith("FSDP's parameters")


# -- order ------------------------------------------------------------------------------------------


def wrong_orders(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # torch's fully_shard puts an unmeshed model on the GPU where there is one: keep it on the CPU.
    mesh = init_device_mesh("cpu", (world,))
    messages = {}
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    fully_shard(model, mesh=mesh)
    for name, call in {
        "fsdp then distamp.fsdp": lambda: distamp.fsdp.fully_shard(model, opt),
        "fsdp then wrap": lambda: distamp.wrap(model, opt, opt_level="O2"),
    }.items():
        try:
            call()
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    # (With FP32 norm layers torch's fully_shard itself refuses the mixed dtypes; without them it
    # shards the half model, and the first step names the mistake.)
    model, opt = distamp.wrap(model, opt, opt_level="O2", keep_batchnorm_fp32=False, verbosity=0)
    fully_shard(model, mesh=mesh)
    x, y = batch(0, rank, world)
    with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    try:
        opt.step()
        messages["wrap then fsdp"] = None
    except RuntimeError as exc:
        messages["wrap then fsdp"] = str(exc)
    model, _, opt = build("fsdp")
    x, y = batch(0, rank, world)
    try:
        with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt, loss_id=1):
            pass
        messages["loss_id past num_losses"] = None
    except ValueError as exc:
        messages["loss_id past num_losses"] = str(exc)
    model = Net()
    model, opt = distamp.fsdp.fully_shard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0
    )
    try:
        distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
        messages["fully_shard twice"] = None
    except ValueError as exc:
        messages["fully_shard twice"] = str(exc)
    return messages


def test_wrong_order_is_refused_clearly():
    messages = run_ranks(wrong_orders, 2)[0]
    assert "sharded or wrapped already (FSDPModule" in messages["fsdp then distamp.fsdp"]
    assert "distamp.fsdp.fully_shard" in messages["fsdp then wrap"]
    assert "sharded with FSDP after distamp.wrap" in messages["wrap then fsdp"]
    assert "pass num_losses to distamp.fsdp.fully_shard" in messages["loss_id past num_losses"]
    # (an audit: it said to call distamp.fsdp.fully_shard instead of torch's)
    assert "went through distamp.fsdp.fully_shard already" in messages["fully_shard twice"]


class _Positions(nn.Module):
    """A position table on a module with weights: cast with them under O2 (as wrap casts it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("pos", torch.arange(300.0))

    def forward(self, x):
        return self.lin(x)


def _lossy_buffer(rank, world):
    import warnings

    model = nn.Sequential(_Positions(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    return [str(w.message) for w in caught if "lost precision" in str(w.message)]


def test_a_buffer_fully_shard_casts_with_its_weights_is_named_as_wrap_names_it():
    """A position table stopped at 256 under FSDP O2 without a word, while wrap warns (an
    audit); the advice fits fully_shard, which takes no keep_fp32_modules."""
    (message,) = run_ranks(_lossy_buffer, 2)[0]
    assert message.startswith("distamp.fsdp.fully_shard: buffer(s) ['0.pos'] lost precision")
    assert "keep_fp32_modules" not in message and "train O1" in message


def _tied(tie):
    """Net with a second head, tied to the first (as HF's tie_word_embeddings) or not: the same
    state_dict keys, one parameter less when tied."""
    model = Net()
    model.head = nn.Linear(16, 3)
    if tie:
        model.head.weight = model.out.weight
    return model


def _another_model(rank, world, directory):
    model = _tied(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O3", verbosity=0)
    _step(model, opt, 0, rank, world)
    distamp.save_checkpoint(directory, model, opt)
    other = _tied(False)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other, opt2 = distamp.fsdp.fully_shard(other, opt2, opt_level="O3", verbosity=0)
    try:
        distamp.load_checkpoint(directory, other, opt2)
    except distamp.checkpoint.CheckpointError as err:
        return str(err)
    return None


def test_a_checkpoint_of_another_model_under_fsdp_says_so_without_keep_fp32_hints(tmp_path):
    """An audit: under FSDP the refusal called a cast bf16 head "stepped whole (kept FP32 or not
    cast)" and hinted at keep_fp32_modules, which fully_shard refuses."""
    messages = run_ranks(_another_model, 2, str(tmp_path / "ckpt"))
    assert messages[0] is not None and messages[0] == messages[1]
    assert "'head.weight' is absent in the checkpoint and present here" in messages[0], messages
    assert "another model than the one saved" in messages[0]
    assert "keep_fp32" not in messages[0] and "kept FP32" not in messages[0]


# -- the example ------------------------------------------------------------------------------------


def test_fsdp_example_trains_saves_and_resumes_at_another_world_size(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "train_gpt_fsdp.py"
    common = ["--size", "tiny", "--seq-len", "32", "--batch-size", "2", "--data-mb", "0.5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def torchrun(nproc, *args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={nproc}", str(script), *common, *args]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        return run.stdout

    import re

    def fp32_share(out, world):
        """The first line's FP32 shard size against 4 bytes per parameter / world (FSDP pads)."""
        params = float(re.search(r"([0-9.]+)M params", out).group(1)) * 1e6
        shards = float(re.search(r"([0-9.]+) MB of FP32 shards per rank", out).group(1)) * 1e6
        return shards / (4 * params / world)

    out = torchrun(2, "--steps", "3", "--opt-level", "O2", "--ckpt-dir", str(tmp_path))
    assert "under FSDP2" in out and "opt_level O2" in out and "saved" in out
    assert 0.98 < fp32_share(out, 2) < 1.05
    ckpt = tmp_path / "step_000003"
    # --resume auto: the newest complete checkpoint in --ckpt-dir, here at another world size
    out = torchrun(
        3, "--steps", "5", "--opt-level", "O2", "--ckpt-dir", str(tmp_path), "--resume", "auto"
    )
    assert f"resumed from {ckpt} (step 3)" in out
    assert "world size 3" in out and "step    5" in out and "done: final loss" in out
    assert 0.98 < fp32_share(out, 3) < 1.05
    # O1: FSDP's FP32 shards are the weights themselves (no masters), and the line says so too.
    out = torchrun(2, "--steps", "1", "--opt-level", "O1")
    assert 0.98 < fp32_share(out, 2) < 1.05
    # O3 in fp16 steps fp16 AdamW state, where eps 1e-8 is 0: the example sets 1e-4, as
    # train_gpt.py does (an audit: NaN from step 2, every step skipped, and exit code 0).
    micro = ["--size", "micro", "--seq-len", "16", "--steps", "3"]
    out = torchrun(2, *micro, "--opt-level", "O3", "--half-dtype", "fp16")
    final = float(re.search(r"done: final loss (\S+)", out).group(1))
    assert final == final and abs(final) < 100, out[-1500:]


def _two_losses_accumulated(rank, world, no_sync, nan_first):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    state = opt.state_dict()
    state["distamp"]["scalers"][1]["scale"] = 2.0**8  # loss 1 at a smaller scale than loss 0
    opt.load_state_dict(state)
    g = torch.Generator().manual_seed(rank)
    log = []
    for step in range(3):
        for micro in range(2):  # micro-batch 0: loss 0, 1: loss 1
            x = torch.randn(4, 8, generator=g)
            if nan_first and step == 1 and micro == 0:
                x = x * float("nan")
            model.set_requires_gradient_sync(not (no_sync and micro == 0))
            with distamp.scale_loss(model(x).float().pow(2).mean(), opt, loss_id=micro) as s:
                s.backward()
        opt.step()
        opt.zero_grad()
        stats = distamp.stats(opt)
        log.append((stats.last_step_skipped, stats.loss_scales))
    return log, [p.full_tensor().float() for p in model.parameters()]


@pytest.mark.parametrize("nan_first", [False, True])
def test_two_losses_at_two_scales_accumulated_without_sync_equal_syncing_each(nan_first):
    """FSDP accumulates unreduced gradients in its own buffers under
    set_requires_gradient_sync(False): a later loss at a smaller scale must rescale those too
    (missed: weights off by 1e10), and a NaN there belongs to its own loss's block."""
    synced = run_ranks(_two_losses_accumulated, 2, False, nan_first)
    unsynced = run_ranks(_two_losses_accumulated, 2, True, nan_first)
    for (log, weights), (ref_log, ref_weights) in zip(unsynced, synced, strict=True):
        assert log == ref_log
        for w, r in zip(weights, ref_weights, strict=True):
            torch.testing.assert_close(w, r, atol=2e-3, rtol=2e-3)  # bf16 reduced at other times
    if nan_first:
        assert synced[0][0][1] == (True, (32768.0, 256.0))  # only loss 0 backed off


# -- switches and habits an audit tried -----------------------------------------------------------


def _fp32_fsdp2(model):
    """torch's own FSDP2, FP32, the blocks then the root: what enabled=False must amount to."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def disabled_and_unknown_options(rank, world, directory):
    out = {}
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model, returned = distamp.fsdp.fully_shard(
        model, opt, opt_level="O2", half_dtype=torch.float16, enabled=False
    )
    out["same optimizer"] = returned is opt
    out["param dtypes"] = {p.dtype for p in model.parameters()}
    ref = _fp32_fsdp2(Net())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    for step in range(3):
        x, y = batch(step, rank, world)
        with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        distamp.clip_grad_norm_(opt, 1.0)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    full = StateDictOptions(full_state_dict=True)
    out["weights"] = get_model_state_dict(model, options=full)
    out["reference"] = get_model_state_dict(ref, options=full)
    out["stats steps"] = distamp.stats(opt).steps
    distamp.save_checkpoint(directory, model, opt, extra={"step": 3})
    model2 = Net()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, foreach=True)
    model2, opt2 = distamp.fsdp.fully_shard(model2, opt2, enabled="False")
    out["resumed step"] = distamp.load_checkpoint(directory, model2, opt2)["step"]
    out["resumed weights"] = get_model_state_dict(model2, options=full)
    for name, kwargs in {
        "keep_fp32_modules": {"keep_fp32_modules": ["out"]},
        "typo": {"opt_levle": "O1"},
    }.items():
        try:
            m = Net()
            distamp.fsdp.fully_shard(m, torch.optim.SGD(m.parameters(), lr=0.1), **kwargs)
            out[name] = None
        except TypeError as exc:
            out[name] = str(exc)
    return out


def test_enabled_false_is_torchs_fp32_fsdp2_and_unknown_options_are_refused_by_name(tmp_path):
    """An audit: enabled=False (DeepSpeed's "fp16": {"enabled": false}) was ignored and trained
    fp16 with a loss scaler; keep_fp32_modules or a typo failed inside a private function."""
    for out in run_ranks(disabled_and_unknown_options, 2, str(tmp_path / "ckpt")):
        assert out["same optimizer"] and out["param dtypes"] == {torch.float32}
        assert_same(out["weights"], out["reference"], "enabled=False against torch's FSDP2")
        assert out["stats steps"] == 0
        assert out["resumed step"] == 3
        assert_same(out["resumed weights"], out["weights"], "enabled=False checkpoint")
        assert "unexpected keyword argument(s) keep_fp32_modules" in out["keep_fp32_modules"]
        assert "only normalization layers become FP32 units" in out["keep_fp32_modules"]
        assert "unexpected keyword argument(s) opt_levle" in out["typo"]
        assert "max_loss_scale" in out["typo"]  # the accepted names are listed


def clip_while_scaled(rank, world, how):
    import warnings

    model, _, opt = build("fsdp", "O2", torch.float16, d=8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = batch(step, rank, world)
            with distamp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
                scaled.backward()
            if how == "unscale_ then clip":
                distamp.unscale_(opt)
            if how != "nothing":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in seen if "still multiplied" in str(w.message)]


@pytest.mark.parametrize("how", ["clip", "unscale_ then clip", "nothing"])
def test_clipping_fsdp_gradients_still_scaled_is_warned_about(how):
    """An audit: torch's clip_grad_norm_ writes FSDP2's DTensor gradients through foreach ops,
    which move no version counter, so the warning that catches it under DDP stayed silent (a
    norm of 44436 clipped: an update 1e-5 of the right one)."""
    for messages in run_ranks(clip_while_scaled, 2, how):
        assert len(messages) == (1 if how == "clip" else 0), (how, messages)


class _Gained(nn.Module):
    """A 1-element gain: at world 2 one rank's FSDP shard of it is empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return self.gain * self.fc(x)


def _clip_with_an_empty_shard(rank, world, norm_type):
    model = _Gained()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O0", verbosity=0)
    torch.manual_seed(1)
    x = torch.randn(2 * world, 4)[rank::world]
    with distamp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
    return float(distamp.clip_grad_norm_(opt, 1e9, norm_type))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clipping_with_a_ranks_empty_gradient_shard_gives_the_global_norm(norm_type):
    """The inf-norm of a rank's empty shard raised inside torch (no identity for max) while the
    other rank waited in the MAX all-reduce (an audit)."""
    reference = _Gained()
    torch.manual_seed(1)
    x = torch.randn(4, 4)
    reference(x[0::2]).pow(2).mean().mul(0.5).add(
        reference(x[1::2]).pow(2).mean().mul(0.5)
    ).backward()
    grads = [p.grad.reshape(-1) for p in reference.parameters()]
    expected = float(torch.linalg.vector_norm(torch.cat(grads), norm_type))
    for norm in run_ranks(_clip_with_an_empty_shard, 2, norm_type):
        assert norm == pytest.approx(expected, rel=1e-5)


def _unfreeze_a_frozen_unit(rank, world, add_group, steps=4, unfreeze_at=2):
    """blocks[1] (an FSDP unit of its own) frozen at the first forward, unfrozen at
    ``unfreeze_at``: handed to the optimizer then (``add_group``) or held by it from the start."""
    model = Net()
    frozen = list(model.blocks[1].parameters())
    for p in frozen:
        p.requires_grad_(False)
    held = [p for p in model.parameters() if add_group is False or p.requires_grad]
    opt = torch.optim.SGD(held, lr=0.1)  # linear in the gradients: no sign flip amplified
    if rank is not None:
        model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    for step in range(steps):
        if step == unfreeze_at:
            for p in model.blocks[1].parameters():
                p.requires_grad_(True)
            if add_group:
                opt.add_param_group({"params": list(model.blocks[1].parameters())})
        x, y = batch(step, rank or 0, world if rank is not None else 1)
        loss = F.mse_loss(model(x).float(), y)
        if rank is None:
            loss.backward()
        else:
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
    if rank is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in full.items()}


@pytest.mark.xdist_group("multirank")
@pytest.mark.parametrize("add_group", [True, False], ids=["add_param_group", "requires_grad"])
def test_a_unit_frozen_at_the_first_forward_trains_once_unfrozen(add_group):
    """FSDP2 fixes a unit's dtypes at its first forward from its trainable parameters; a unit
    wholly frozen then failed its first backward after unfreezing, inside torch, at O2 ("assign
    a gradient with dtype BFloat16 to a tensor with grad_dtype Float"; an audit). It now trains
    as the FP32 reference does (SGD, bf16 compute: within 2e-3 of it, updates ~1e-2)."""
    initial = dict(Net().state_dict())
    reference = _unfreeze_a_frozen_unit(None, 2, add_group)
    for got in run_ranks(_unfreeze_a_frozen_unit, 2, add_group):
        moved = (got["blocks.1.fc.weight"] - initial["blocks.1.fc.weight"]).abs().max()
        assert moved > 5e-3, "the unfrozen unit did not train"
        for name, ref in reference.items():
            assert torch.allclose(got[name], ref, atol=2e-3), name


def _sync_left_off(rank, world):
    model, _, opt = build("fsdp", opt_level="O0")
    for micro in range(2):
        model.set_requires_gradient_sync(False)  # forgotten: never back on for the last one
        x, y = batch(micro, rank, world)
        with distamp.scale_loss(F.mse_loss(model(x), y) / 2, opt) as scaled:
            scaled.backward()
    try:
        opt.step()
    except RuntimeError as err:
        return str(err), distamp.stats(opt).steps
    return None, distamp.stats(opt).steps


@pytest.mark.xdist_group("multirank")
def test_a_step_with_gradient_sync_left_off_is_refused_on_every_rank():
    """set_requires_gradient_sync(False) left on for the last micro-batch: the step found no
    reduced gradient, stepped nothing and counted itself, and the held gradients went into the
    next step's (two windows at once), silently (an audit)."""
    for message, steps in run_ranks(_sync_left_off, 2):
        assert message is not None and "set_requires_gradient_sync(True)" in message
        assert steps == 0


def _dcp_idiom(rank, world, directory, steps_before, steps_after):
    """torch's own checkpoint idiom under distamp.fsdp: get_state_dict + dcp.save, then on a
    fresh model and optimizer get_state_dict (its placeholder step) + dcp.load + set_state_dict."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, _, opt = build("fsdp")
    for step in range(steps_before):
        _step(model, opt, step, rank, world)
    if directory is None:  # the run straight through
        for step in range(steps_before, steps_before + steps_after):
            _step(model, opt, step, rank, world)
        return fp32_weights("fsdp", model, opt), None
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
    model, _, opt = build("fsdp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        msd, osd = get_state_dict(model, opt)  # an optimizer with no state: torch's placeholder
        counted = distamp.stats(opt).steps
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for step in range(steps_before, steps_before + steps_after):
        _step(model, opt, step, rank, world)
    messages = [str(w.message) for w in caught]
    return fp32_weights("fsdp", model, opt), (counted, messages, distamp.stats(opt).steps)


@pytest.mark.xdist_group("multirank")
def test_torch_dcp_state_dict_idiom_resumes_under_fsdp(tmp_path):
    """get_state_dict/set_state_dict keep only torch's entries of optimizer.state_dict(): the
    resume was refused for the missing 'distamp' entry although FSDP's FP32 shards hold all of
    the optimizer's state, and get_state_dict's placeholder step on the fresh optimizer was
    counted and used the one-time "step() without scale_loss" warning (an audit). It resumes bit
    for bit (the loss scale had not moved), warning that the scale starts afresh; the step count
    goes on from the optimizer's own."""
    straight = run_ranks(_dcp_idiom, 2, None, 2, 2)
    resumed = run_ranks(_dcp_idiom, 2, str(tmp_path / "dcp"), 2, 2)
    for (weights, _), (got, (counted, messages, steps)) in zip(straight, resumed, strict=True):
        assert_same(got, weights, "resumed through torch's DCP idiom")
        assert counted == 0, "get_state_dict's placeholder step was counted"
        # (it stayed 0 after the load, an audit: save_checkpoint then ranked the resumed run's
        # checkpoints below the older ones; taken from AdamW's own step now)
        assert steps == 4
        assert not [m for m in messages if "without distamp.scale_loss" in m], messages
        assert [m for m in messages if "starts again at" in m], messages


def _discard_a_window(rank, world, discard):
    """Two micro-batches per step accumulated without sync; at step 1 the first micro-batch is
    bad on rank 1 (x1000), seen in the all-reduced loss, and the window is discarded with
    optimizer.zero_grad() (``discard``), or never run at all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in (0, 1)]
        if step == 1 and not discard:
            continue
        for micro, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(micro == 1)
            loss = F.mse_loss(model(x.bfloat16()).float(), y) / 2
            if step == 1 and micro == 0 and rank == 1:
                loss = loss * 1000.0
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            seen = loss.detach().clone()
            torch.distributed.all_reduce(seen)
            if seen > 100:
                opt.zero_grad()
                break
        else:
            opt.step()
            opt.zero_grad()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.float().clone() for k, v in full.items()}


def test_a_window_discarded_with_zero_grad_under_fsdp_no_sync_leaves_no_trace():
    """FSDP2 keeps unsharded, unreduced gradients while sync is off; optimizer.zero_grad()
    left them, and the discarded micro-batch (finite, x1000) was added into the next step:
    0.02-0.03 off the run that never saw it, silently (an audit; DDP's no_sync was exact)."""
    discarded = run_ranks(_discard_a_window, 2, True)
    never = run_ranks(_discard_a_window, 2, False)
    assert_same(discarded[0], never[0], "the discarding run against the one that never saw it")


def _sharded_extra(rank, world, directory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    try:
        distamp.save_checkpoint(directory, model, opt, extra={"ema": model.state_dict()})
    except distamp.checkpoint.CheckpointError as err:  # every rank, each rank's reason
        return str(err)
    return "saved"


def test_a_sharded_tensor_in_extra_is_refused_by_its_key(tmp_path):
    """An FSDP-sharded EMA's state_dict in extra= failed inside torch ("Sharding propagation
    failed") naming nothing; only rank 0's shards would have been saved (an audit)."""
    for message in run_ranks(_sharded_extra, 2, str(tmp_path / "ckpt")):
        assert "extra['ema']" in message and "found a DTensor" in message, message


class _MaskedAttention(nn.Module):
    """A causal self-attention with its additive mask as a float buffer of a module that holds
    weights (GPT-2's and many custom models' habit)."""

    def __init__(self, d=8, t=4):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        mask = torch.full((t, t), float("-inf")).triu(1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + self.mask
        return self.out(scores.softmax(-1) @ v)


def _masked_attention(rank, world, how):
    torch.manual_seed(0)
    model = nn.Sequential(_MaskedAttention(), nn.LayerNorm(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "fsdp":
        model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O2", verbosity=0)
    else:
        model, opt = distamp.wrap(
            model, opt, opt_level="O2", shard_master_weights=False, verbosity=0
        )
        model = DDP(model)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = model(torch.randn(2, 4, 8, generator=g)).float().pow(2).mean()
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    inner = model.module if how == "ddp" else model
    return inner[0].mask.dtype, fp32_weights(how, inner, opt)


def test_o2_under_fsdp_casts_a_modules_float_buffers_with_its_weights_as_wrap_does():
    """A float buffer of a module with weights (an attention mask) is cast with them under O2 by
    wrap and, since an audit, by fully_shard: left FP32 under FSDP, the bf16 scores plus the
    mask promoted to FP32 and the next bf16 layer raised at the first forward."""
    fsdp = run_ranks(_masked_attention, 2, "fsdp")
    ddp = run_ranks(_masked_attention, 2, "ddp")
    assert fsdp[0][0] == ddp[0][0] == torch.bfloat16
    # the same bf16 arithmetic up to where the gradients are summed in bf16: 3 SGD steps
    # agree within a few bf16 steps of the weights
    for name, value in ddp[0][1].items():
        torch.testing.assert_close(fsdp[0][1][name], value, atol=1e-2, rtol=0, msg=name)


def _ddp_save_fsdp_load(rank, world, opt_level, saved, resaved):
    """Train O0/O1 under wrap + DDP with sharded FP32 weights and save; load that under
    fully_shard in the same processes, and save it again from there."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model, opt = distamp.wrap(model, opt, opt_level=opt_level, shard_master_weights=True)
    ddp = DDP(model)
    for step in range(3):
        x, y = batch(step, rank, world)
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    distamp.save_checkpoint(saved, ddp, opt)
    model, _, opt = build("fsdp", opt_level)
    distamp.load_checkpoint(saved, model, opt)
    distamp.save_checkpoint(resaved, model, opt)
    x, y = batch(3, rank, world)  # and it trains on from the loaded state (DTensors, FSDP's)
    with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert distamp.stats(opt).steps == 4 and distamp.stats(opt).skipped_steps == 0


@pytest.mark.parametrize("opt_level,world", [("O1", 2), ("O0", 3)])
def test_o0_o1_checkpoints_of_sharded_fp32_weights_load_under_fsdp(tmp_path, opt_level, world):
    """``shard_master_weights=True`` keeps O0/O1's optimizer state flat; such a checkpoint was
    refused under FSDP as "saved with distamp masters (DDP)", which O0/O1 have none of (an
    audit), while the README promised O1's load both ways. Weights and AdamW state arrive
    exactly (at another world size too)."""
    saved, resaved = str(tmp_path / "ddp"), str(tmp_path / "fsdp")
    run_ranks(_ddp_save_fsdp_load, world, opt_level, saved, resaved)
    assert_same(consolidate(resaved), consolidate(saved), "weights")
    state = consolidate_optimizer_state(saved)
    for name, per in state.items():  # the flat layout's FP32 copy is the weight (FSDP: no copy)
        assert torch.equal(per.pop("master"), consolidate(saved)[name]), name
    assert_same(consolidate_optimizer_state(resaved), state, "state")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x)


def _blocks_in_a_sequential(rank, world, blocks, layers=False):
    import warnings

    inner = (nn.Linear(8, 8) for _ in range(3)) if layers else (_Block() for _ in range(3))
    model = nn.Sequential(nn.Sequential(*inner), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distamp.fsdp.fully_shard(model, opt, opt_level="O0", blocks=blocks, verbosity=0)
    return [(str(w.message), w.filename) for w in caught if "no nn.ModuleList" in str(w.message)]


def test_blocks_in_a_sequential_are_named_with_blocks_to_pass():
    """timm's ViT holds its blocks in an nn.Sequential: the model was one FSDP unit, every
    forward gathering all of its weights, silently (an audit)."""
    ((message, filename),) = run_ranks(_blocks_in_a_sequential, 2, None)[0]
    assert "'0' is an nn.Sequential of 3 _Block: expected blocks=[_Block]" in message
    assert filename == __file__
    assert run_ranks(_blocks_in_a_sequential, 2, [_Block])[0] == []
    # a stack of layers is not blocks (the advice blocks=[Linear] would shard each one)
    assert run_ranks(_blocks_in_a_sequential, 2, None, True)[0] == []


def _units_for(rank, world, how):
    model = nn.Sequential(nn.Sequential(*(_Block() for _ in range(3))), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocks = {
        "class": _Block,
        "list of classes": [_Block],
        "modules": list(model[0]),
        "container": model[0],
        "int": 3,
        "names": ["_Block"],
    }[how]
    try:
        model, opt = distamp.fsdp.fully_shard(
            model, opt, opt_level="O2", blocks=blocks, verbosity=0
        )
    except TypeError as exc:
        untouched = all(
            type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters()
        )
        return str(exc), untouched
    return sum(hasattr(m, "_get_fsdp_state") for m in model.modules()), None


def test_blocks_takes_a_class_classes_or_modules_and_refuses_the_rest_before_changing_anything():
    """blocks=Block (for [Block]) built a Block of every submodule; module objects (torch's
    fully_shard takes those) failed inside isinstance or forward, and bad values after the model
    was cast (an audit)."""
    for how in ("class", "list of classes", "modules", "container"):
        units, _ = run_ranks(_units_for, 2, how)[0]
        assert units == 4, (how, units)  # three blocks and the root
    for how, expected in (
        ("int", "blocks: expected None, a list"),
        ("names", "blocks[0]: expected"),
    ):
        message, untouched = run_ranks(_units_for, 2, how)[0]
        assert expected in message and untouched, (how, message)


class _Listed(nn.Module):
    def __init__(self, nested=False):
        super().__init__()
        if nested:  # [Block, [Block, Block]]
            self.layers = nn.ModuleList([_Block(), nn.ModuleList([_Block(), _Block()])])
        else:
            self.layers = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            for block in layer if isinstance(layer, nn.ModuleList) else [layer]:
                x = block(x)
        return self.head(x)


def _units_in_a_list(rank, world, how):
    torch.manual_seed(0)
    model = _Listed(nested=how.startswith("nested"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocks = {
        # FSDP1's size-policy habit, recursing through the ModuleList that holds the blocks
        "predicate": lambda m: (
            len(list(m.children())) > 0 and sum(p.numel() for p in m.parameters()) >= 72
        ),
        "container class": [nn.ModuleList],
        "nested container object": [model.layers],
        "nested container class": [nn.ModuleList],
    }[how]
    model, opt = distamp.fsdp.fully_shard(model, opt, opt_level="O0", blocks=blocks, verbosity=0)
    loss = model(torch.randn(4, 8)).sum()
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    units = sorted(n for n, m in model.named_modules() if hasattr(m, "_get_fsdp_state"))
    return units


def test_a_container_blocks_selects_stands_for_its_children_or_is_passed_over():
    """A predicate true for the nn.ModuleList holding the blocks (FSDP1's size policy habit) or
    blocks=[nn.ModuleList] failed inside torch ("containers that do not implement forward")
    after the first blocks were sharded and the model cast (an audit): a predicate passes
    containers over (as FSDP1's size policy does), a class or module names its children."""
    for how in ("predicate", "container class"):
        units = run_ranks(_units_in_a_list, 2, how)[0]
        assert units == ["", "layers.0", "layers.1", "layers.2"], (how, units)
    for how in ("nested container object", "nested container class"):
        units = run_ranks(_units_in_a_list, 2, how)[0]
        assert units == ["", "layers.0", "layers.1.0", "layers.1.1"], (how, units)
