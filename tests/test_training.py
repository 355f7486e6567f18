"""Single-process training at each opt_level against an FP32 reference; optimizer state round trips."""

import io

import pytest
import torch
from models import data, mlp

import distamp


def train(model, opt, batches, *, amp=True, clip=None, sched=None, skip=(), skipped=None):
    """Train on ``batches``; ``skip``: steps the FP32 reference leaves out; ``skipped`` collects
    the steps distamp skipped."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if amp:
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            if clip is not None:
                distamp.clip_grad_norm_(opt, clip)
        else:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if i not in skip:
            opt.step()
        if skipped is not None and amp and distamp.stats(opt).last_step_skipped:
            skipped.append(i)
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def fp32_reference(batches, opt_cls=torch.optim.Adam, skip=(), **opt_kw):
    model = mlp()
    opt = opt_cls(model.parameters(), **opt_kw)
    losses = train(model, opt, batches, amp=False, skip=skip)
    return model, losses


def max_rel_err(model, ref):
    worst = 0.0
    for p, r in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        if p.is_floating_point():
            worst = max(worst, ((p.float() - r).norm() / r.norm().clamp_min(1e-12)).item())
    return worst


# Stated tolerance: after 50 Adam steps every weight tensor of the half model is within 2% (bf16,
# 8 mantissa bits) / 1.5% (fp16, 11 bits) relative L2 error of an FP32 run that skips the same steps
# (fp16's dynamic scale starts at 2**16 and backs off on real overflows), final loss within 5%.
@pytest.mark.parametrize(("half", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 1.5e-2)])
def test_o2_tracks_fp32_reference_for_50_steps(half, tol):
    batches = data(50, 16)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level="O2", half_dtype=half)
    skipped: list[int] = []
    losses = train(model, opt, batches, skipped=skipped)
    ref, ref_losses = fp32_reference(batches, lr=1e-2, skip=set(skipped))
    assert len(skipped) <= 3
    assert max_rel_err(model, ref) < tol
    assert abs(losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[-1] + 1e-3
    assert losses[-1] < 0.5 * losses[0]  # it learned
    s = distamp.stats(opt)
    assert (s.steps, s.skipped_steps) == (50, len(skipped))
    assert s.master_bytes == 4 * sum(
        p.numel() for n, p in model.named_parameters() if "1." not in n
    )


def test_enabled_false_is_bit_identical_to_plain_pytorch():
    batches = data(20, 8)
    ref, ref_losses = fp32_reference(batches, opt_cls=torch.optim.SGD, lr=0.05, momentum=0.9)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = distamp.wrap(model, opt, opt_level="O2", enabled=False)
    losses = train(model, opt, batches)
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    assert distamp.stats(opt).steps == 0  # a no-op


def test_o0_matches_fp32_exactly():
    batches = data(20, 8)
    ref, _ = fp32_reference(batches, lr=1e-2)
    model = mlp()
    model, opt = distamp.wrap(model, torch.optim.Adam(model.parameters(), lr=1e-2), opt_level="O0")
    train(model, opt, batches)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_masters_are_eager_exact_fp32_copies_and_own_the_param_groups():
    model = mlp()
    originals = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(
        [
            {"params": list(model[0].parameters()), "lr": 1e-3},
            {"params": list(model[3].parameters()), "lr": 5e-3, "weight_decay": 0.0},
        ]
    )
    model, opt = distamp.wrap(model, opt, opt_level="O2")
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-3]
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert all(m.dtype == torch.float32 for m in masters)
    assert [
        torch.equal(m, o)
        for m, o in zip(
            masters, [originals[0], originals[1], originals[4], originals[5]], strict=True
        )
    ] == [True] * 4
    assert model[0].weight.dtype == torch.bfloat16
    assert isinstance(opt, torch.optim.AdamW)


def test_state_dict_round_trip_resumes_bit_exactly():
    batches = data(30, 8)

    def fresh():
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return distamp.wrap(model, opt, opt_level="O2", half_dtype=torch.float16)

    model, opt = fresh()
    train(model, opt, batches)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt = fresh()
    train(model, opt, batches[:12])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, opt = fresh()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert distamp.stats(opt).steps == 12
    assert all(v["exp_avg"].dtype == torch.float32 for v in opt.state.values())
    train(model, opt, batches[12:])
    for a, b in zip(model.parameters(), straight, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("when", ["before_wrap", "after_wrap"])
def test_lr_scheduler_drives_the_wrapped_optimizer(when):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if when == "before_wrap":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        model, opt = distamp.wrap(model, opt, opt_level="O2")
    else:
        model, opt = distamp.wrap(model, opt, opt_level="O2")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    before = model[0].weight.detach().clone()
    train(model, opt, data(4, 4), sched=sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert distamp.stats(opt).steps == 4  # the distamp step ran, not the inner class's step
    assert not torch.equal(before, model[0].weight)


def test_clip_grad_norm_equals_torch_on_unscaled_fp32_grads():
    x, y = data(1, 16)[0]
    ref = mlp()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    model = mlp()
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1")
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    total = distamp.clip_grad_norm_(opt, 0.1)
    assert total.item() == pytest.approx(expected.item(), rel=2e-2)  # O1 computes in bf16
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped.item() == pytest.approx(0.1, rel=1e-3)


def test_unscale_then_step_uses_one_decision():
    model = mlp()
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    x, y = data(1, 4)[0]
    with distamp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    distamp.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        distamp.unscale_(opt)
    opt.step()
    assert distamp.stats(opt).steps == 1


def test_loading_fp32_weights_after_wrap_reaches_the_masters_unrounded():
    pretrained = mlp(seed=7)
    model = mlp()
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), opt_level="O2")
    model.load_state_dict(pretrained.state_dict())
    masters = [p for g in opt.param_groups for p in g["params"]]
    expected = [p for p in pretrained.parameters()]
    assert all(torch.equal(m, e) for m, e in zip(masters, expected, strict=True))
    train(model, opt, data(1, 4))  # lr 0: the step writes the masters back, unchanged
    assert torch.equal(model[0].weight, pretrained[0].weight.to(torch.bfloat16))


def _outside_then_block(opt_level, clear):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half = {"half_dtype": torch.float16} if opt_level != "O0" else {}
    model, opt = distamp.wrap(model, opt, opt_level=opt_level, verbosity=0, **half)
    (x1, y1), (x2, y2) = data(2, 4)
    dtype = next(model.parameters()).dtype
    mse = torch.nn.functional.mse_loss
    mse(model(x1.to(dtype)).float(), y1).backward()  # outside a block
    if clear == "set_to_none":
        opt.zero_grad()
    elif clear == "in place":
        model.zero_grad(set_to_none=False)
    with distamp.scale_loss(mse(model(x2.to(dtype)).float(), y2), opt) as scaled:
        scaled.backward()
    opt.step()
    return [p.detach().float().clone() for p in model.parameters()]


def test_a_block_after_a_backward_outside_scale_loss_in_one_step_is_refused():
    """The outside backward's gradients (scale 1.0) and the block's (the loss scale) were summed
    and divided by the scale at step(): the first backward's share shrank 65536-fold, silently
    (an audit). Cleared in between (zero_grad, also in place), the block trains as usual."""
    with pytest.raises(RuntimeError, match=r"^scale_loss: expected the gradients pending since"):
        _outside_then_block("O2", None)
    cleared = _outside_then_block("O2", "set_to_none")
    zeroed = _outside_then_block("O2", "in place")
    for a, b in zip(cleared, zeroed, strict=True):
        assert torch.equal(a, b)


def test_at_o0_a_backward_outside_scale_loss_then_a_block_sums_as_fp32_does():
    """O0's scale is 1.0: the sum is right, and not refused."""
    got = _outside_then_block("O0", None)
    torch.manual_seed(0)
    ref = mlp()
    (x1, y1), (x2, y2) = data(2, 4)
    torch.nn.functional.mse_loss(ref(x1), y1).backward()
    torch.nn.functional.mse_loss(ref(x2), y2).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for a, p in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(a, p.detach(), rtol=0, atol=1e-7)


def test_a_backward_outside_scale_loss_between_two_blocks_is_refused():
    """block, loss.backward(), block (or step) in one step: scale 1.0 added to the loss scale's,
    taken as a whole at step(): the outside share shrank 128-fold, silently (an audit)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(
        model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=128.0, verbosity=0
    )
    (x1, y1), (x2, y2) = data(2, 4)
    mse = torch.nn.functional.mse_loss
    for then in ("block", "step"):
        with distamp.scale_loss(mse(model(x1.half()).float(), y1), opt) as scaled:
            scaled.backward()
        mse(model(x2.half()).float(), y2).backward()
        with pytest.raises(RuntimeError, match=r"a backward outside this optimizer's scale_loss"):
            if then == "block":
                with distamp.scale_loss(mse(model(x1.half()).float(), y1), opt) as scaled:
                    scaled.backward()
            else:
                opt.step()
        # cleared: trains on (also zeroed in place by the module: an audit found it refused)
        if then == "block":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
    with distamp.scale_loss(mse(model(x1.half()).float(), y1), opt) as scaled:
        scaled.backward()
    opt.step()
    assert distamp.stats(opt).steps == 1


def test_a_sparse_gradient_cleared_in_place_after_an_outside_backward_is_not_refused():
    """The check for gradients an outside backward left read sparse ones with ne(), which sparse
    tensors lack: a crash where the gradients had been cleared (an audit)."""

    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(10, 4, sparse=True)
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, i):
            return self.lin(self.e(i))

    torch.manual_seed(0)
    model = Emb()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(
        model, opt, opt_level="O2", half_dtype=torch.float16, loss_scale=128.0, verbosity=0
    )
    i = torch.tensor([1, 2, 3])
    model(i).float().sum().backward()  # an inspection backward
    model.zero_grad(set_to_none=False)
    with distamp.scale_loss(model(i).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    model(i).float().sum().backward()  # not cleared: refused by name
    with pytest.raises(RuntimeError, match=r"^scale_loss: expected the gradients pending since"):
        with distamp.scale_loss(model(i).float().sum(), opt) as scaled:
            scaled.backward()
