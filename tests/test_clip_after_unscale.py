"""torch.amp's clipping habit under every opt_level: ``distamp.unscale_(opt);
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm); opt.step()`` clips what the
optimizer steps (see [Note: unscale_ then torch's clip_grad_norm_] in distamp/masters/base.py).

Two probes start at zero (loss = (a * g).sum() + (ln.weight * h).sum(), the LayerNorm weight
stays FP32 under O2): after one SGD(lr=1) step each weight is minus its clipped gradient, so
the weights' global norm must be ``max_norm`` and their direction the gradient's.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from models import GradProbe, data, mlp
from torch import nn

import distamp

MAX_NORM = 0.01


class Probes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = GradProbe(6)
        self.ln = nn.LayerNorm(4)
        nn.init.zeros_(self.ln.weight)

    def forward(self, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        # / 8, as a mean would: the upstream gradient 2**16 alone does not fit in FP16
        return (self.a(g) + (self.ln.weight * h).sum()) / 8


# Small enough that the scaled FP16 gradients (x 2**16) do not overflow: no step is skipped.
G = torch.tensor([1.0, -2.0, 0.5, 4.0, -0.25, 3.0]) / 16
H = torch.tensor([2.0, -1.0, 0.75, -3.0]) / 16


def _clip_step(rank, world, level, half, shard, modify):
    model = Probes()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kw = {"shard_master_weights": shard} if level == "O2" else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)
    with distamp.scale_loss(model(G, H).float(), opt) as scaled:
        scaled.backward()
    distamp.unscale_(opt)
    if modify == "clip":
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    else:  # any other change to the model's .grad after unscale_ reaches the step too
        model.a.w.grad = None
        total = torch.tensor(0.0)
    opt.step()
    return {
        "a": model.a.w.detach().float(),
        "ln": model.ln.weight.detach().float(),
        "total": total.float(),
    }


CASES = [
    ("O0", torch.bfloat16, False, 1),
    ("O1", torch.bfloat16, False, 1),
    ("O2", torch.bfloat16, False, 1),
    ("O2", torch.bfloat16, True, 2),
    ("O2", torch.float16, False, 1),
    ("O3", torch.bfloat16, False, 1),
]


@pytest.mark.parametrize(
    ("level", "half", "shard", "world"),
    CASES,
    ids=["O0", "O1", "O2-bf16", "O2-bf16-sharded-w2", "O2-fp16", "O3"],
)
def test_torch_clip_grad_norm_after_unscale_clips_what_the_optimizer_steps(
    level, half, shard, world
):
    full = torch.cat([G, H]) / 8
    for r in run_ranks(_clip_step, world, level, half, shard, "clip", timeout=120):
        # the norm torch measured is the true (unscaled) one
        assert r["total"].item() == pytest.approx(full.norm().item(), rel=1e-2)
        stepped = torch.cat([r["a"], r["ln"]])
        # Stated tolerance: half gradients and weights round to 2**-8 relative (BF16/FP16).
        assert stepped.norm().item() == pytest.approx(MAX_NORM, rel=1e-2)
        torch.testing.assert_close(stepped, -full * MAX_NORM / full.norm(), rtol=1e-2, atol=1e-4)


def _framework_clip_step(rank, world, shard):
    """Lightning's automatic optimization with configure_gradient_clipping overridden: backward
    outside scale_loss, then torch's clip over the model's parameters, then step()."""
    model = Probes()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    model(G, H).float().backward()
    refused = []
    for call in (distamp.unscale_, lambda o: distamp.clip_grad_norm_(o, MAX_NORM)):
        with pytest.raises(RuntimeError) as err:
            call(opt)
        refused.append(str(err.value))
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "step() without distamp.scale_loss()"
        opt.step()
    weights = torch.cat([model.a.w.detach().float(), model.ln.weight.detach().float()])
    return {"stepped": weights, "total": total.float(), "refused": refused}


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)], ids=["replicated", "sharded"])
def test_after_a_framework_backward_distamp_s_clip_points_to_torch_s_which_is_stepped(shard, world):
    """Lightning's gradient_clip_val clips param_groups before the masters have gradients; the
    README's route is torch's clip over model.parameters() in configure_gradient_clipping.
    distamp's unscale_/clip_grad_norm_ there said only "no scale_loss backward ran" though one
    had (an audit): they now say what to call instead, and that call is what steps."""
    full = torch.cat([G, H]) / 8
    for r in run_ranks(_framework_clip_step, world, shard, timeout=120):
        for message in r["refused"]:
            assert "A backward did run, outside scale_loss" in message, message
            assert "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)" in message
        assert r["total"].item() == pytest.approx(full.norm().item(), rel=1e-2)
        torch.testing.assert_close(
            r["stepped"], -full * MAX_NORM / full.norm(), rtol=1e-2, atol=1e-4
        )


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)], ids=["replicated", "sharded"])
def test_a_gradient_removed_after_unscale_is_not_stepped(shard, world):
    for r in run_ranks(_clip_step, world, "O2", torch.bfloat16, shard, "drop", timeout=120):
        assert torch.equal(r["a"], torch.zeros(6))
        torch.testing.assert_close(r["ln"], -H / 8)


def _edit_after_distamp_clip(rank, world, shard, unscale_first):
    model = Probes()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    with distamp.scale_loss(model(G, H).float(), opt) as scaled:
        scaled.backward()
    if unscale_first:
        distamp.unscale_(opt)
    total = distamp.clip_grad_norm_(opt, MAX_NORM)
    shown = model.ln.weight.grad.float().clone()
    model.a.w.grad.zero_()  # a pruning mask, a frozen row zeroed: after the clip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    said = [
        str(w.message) for w in caught if "changed after distamp.clip_grad_norm_" in str(w.message)
    ]
    return {
        "a": model.a.w.detach().float(),
        "ln": model.ln.weight.detach().float(),
        "total": total.float(),
        "shown": shown,
        "said": said,
    }


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)])
def test_a_gradient_edited_after_distamp_clip_following_unscale_reaches_the_step(shard, world):
    """unscale_, distamp.clip_grad_norm_, then an edit of a model .grad: the clip forgot the
    exposure and the edit was dropped, silently (an audit). Now the model's .grad show the
    clipped values and the edit is re-read at step()."""
    full = torch.cat([G, H]) / 8
    coef = MAX_NORM / full.norm()
    for r in run_ranks(_edit_after_distamp_clip, world, shard, True, timeout=120):
        assert torch.equal(r["a"], torch.zeros(6))  # the zeroed gradient stepped nothing
        torch.testing.assert_close(r["shown"], H / 8 * coef, rtol=1e-2, atol=1e-6)
        torch.testing.assert_close(r["ln"], -H / 8 * coef, rtol=1e-2, atol=1e-6)
        assert not r["said"]


def test_one_row_edited_after_distamp_clip_alone_is_said_at_step():
    """A row of an embedding's gradient zeroed after the clip (a frozen token): a comparison of
    sampled values missed it and the edit was dropped silently (an audit)."""
    model = nn.Embedding(1000, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    with distamp.scale_loss(model(torch.arange(0, 1000, 7)).float().pow(2).mean(), opt) as s:
        s.backward()
    distamp.clip_grad_norm_(opt, 1.0)
    model.weight.grad[7] = 0  # a token the batch used
    with pytest.warns(UserWarning, match=r"'weight' changed after distamp.clip_grad_norm_"):
        opt.step()


@pytest.mark.parametrize(("shard", "world"), [(False, 1), (True, 2)])
def test_a_gradient_edited_after_distamp_clip_alone_is_said_at_step(shard, world):
    """Without unscale_ the model's .grad still carry the loss scale and the masters hold what
    steps: an edit after the clip cannot reach it, and step() says so once."""
    for r in run_ranks(_edit_after_distamp_clip, world, shard, False, timeout=120):
        assert len(r["said"]) == 1 and "'a.w'" in r["said"][0], r["said"]
        assert "distamp.unscale_(optimizer) first" in r["said"][0]


def test_clipping_the_model_while_gradients_are_still_scaled_is_warned_about():
    """apex's O1 unscaled the model's gradients when scale_loss exited, so its scripts clip
    model.parameters() right there; distamp unscales at step(), and such a clip saw a norm
    65536x too large (an update 65536x too small, silently). step() now says so, once."""
    from distamp import amp

    for touch, warned in (("clip", True), ("unscale_ then clip", False), ("nothing", False)):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in data(3, 8):
                with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                    scaled.backward()
                if touch == "unscale_ then clip":
                    distamp.unscale_(opt)
                if touch != "nothing":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        messages = [str(w.message) for w in seen if "still multiplied" in str(w.message)]
        assert len(messages) == (1 if warned else 0), (touch, messages)


def test_step_warnings_reach_the_caller_through_an_lr_schedulers_wrapper():
    """An LR scheduler wraps optimizer.step (torch/optim/lr_scheduler.py), and accelerate (so the
    Trainer) ignores UserWarnings from that module: step()'s warnings — here the clip of scaled
    gradients that left an fp16 model untrained — were dropped (an audit). They are attributed
    to this file now."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O1", verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.optim.lr_scheduler")
        for x, y in data(2, 8):
            with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
    found = [w for w in seen if "still multiplied" in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__, [
        (w.filename, str(w.message)[:60]) for w in seen
    ]


def _clip_param_groups(rank, world, how):
    """Clipping what optimizer.param_groups hold, with sharded O2 masters and a LayerNorm that
    every rank steps whole (an audit: two ranks' LayerNorm weights parted silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    caught, step = [], 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            for x, y in data(3, 8, d_in=8, d_out=4, seed=rank):
                with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
                    scaled.backward()
                if how == "distamp":
                    distamp.clip_grad_norm_(opt, 0.05)
                else:
                    distamp.unscale_(opt)
                    params = (
                        model.parameters()
                        if how == "model"
                        else [p for g in opt.param_groups for p in g["params"]]
                    )
                    if how == "value":
                        torch.nn.utils.clip_grad_value_(
                            [p for g in opt.param_groups for p in g["params"]], 0.01
                        )
                    else:
                        torch.nn.utils.clip_grad_norm_(params, 0.05)
                opt.step()
                opt.zero_grad()
                step += 1
        except RuntimeError as exc:
            caught.append((step, str(exc)))
    messages = [str(w.message) for w in seen if "scaled by one factor" in str(w.message)]
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    return caught, messages, weights


def test_a_norm_over_sharded_param_groups_is_warned_about_and_parted_ranks_raise():
    for caught, messages, _ in run_ranks(_clip_param_groups, 2, "param_groups"):
        assert len(messages) == 1, messages  # once, at the first step
        assert caught and caught[0][0] == 1, caught  # the step after the ranks parted
        assert "['1.weight', '1.bias']) differ" in caught[0][1], caught
        assert "distamp.clip_grad_norm_(optimizer, max_norm)" in caught[0][1]


@pytest.mark.parametrize("how", ["distamp", "model", "value"])
def test_the_global_clipping_habits_stay_silent_under_sharded_masters(how):
    """distamp's clipping, torch's over model.parameters(), and an elementwise clip_grad_value_
    over param_groups (Lightning's "value" algorithm: exact on slices) neither warn nor part."""
    (caught0, messages0, w0), (caught1, messages1, w1) = run_ranks(_clip_param_groups, 2, how)
    assert caught0 == caught1 == [] and messages0 == messages1 == []
    for name, value in w0.items():
        assert torch.equal(value, w1[name]), name


def _write_inf_where_another_rank_steps(opt, model):
    """An inf in one gradient element this rank does not step (sharded masters: another rank's
    shard), else (replicated) in the first gradient."""
    masters = opt._distamp.masters
    if not masters.sharded:
        next(model.parameters()).grad.fill_(float("inf"))
        return
    for g in masters.groups:
        for index, param in enumerate(g.params):
            mine = {
                i for at, src, count, _ in g.pieces if at == index for i in range(src, src + count)
            }
            free = next((i for i in range(param.numel()) if i not in mine), None)
            if free is not None:
                param.grad.view(-1)[free] = float("inf")
                return
    raise AssertionError("this rank steps every element")


def _edit_after_unscale(rank, world, level, shard, hook, who):
    """Edits after unscale_ that make a gradient non-finite: one rank writes an inf, or every
    rank divides a zero gradient by its zero norm (0/0)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = {"shard_master_weights": shard} if shard is not None else {}
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kw)
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook:
        distamp.hooks.register(ddp, opt, reduce_scatter=shard is True)
    seen = []
    for step, (x, y) in enumerate(data(3, 8, seed=rank)):
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), y), opt) as scaled:
            scaled.backward()
        distamp.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == 1 and who == "one rank" and rank == 0:  # (sharded: in the part it steps)
            next(model.parameters()).grad.fill_(float("inf"))
        if step == 1 and who == "one rank, in another's part" and rank == 1:
            _write_inf_where_another_rank_steps(opt, model)
        if step == 1 and who == "an inf here, a NaN there":
            next(model.parameters()).grad.fill_(float("inf") if rank == 0 else float("nan"))
        if step == 1 and who == "every rank":
            grad = model[-1].bias.grad
            grad.zero_().div_(grad.norm())  # 0/0: NaN
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        stats = distamp.stats(opt)
        seen.append((stats.last_step_skipped, moved, str(stats.last_nonfinite)))
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return seen, weights


@pytest.mark.parametrize(
    "level,shard,hook",
    [("O1", None, False), ("O2", False, True), ("O2", True, True), ("O0", True, True)],
    ids=["O1", "O2-replicated", "O2-sharded", "O0-sharded"],
)
@pytest.mark.parametrize(
    "who", ["one rank", "one rank, in another's part", "every rank", "an inf here, a NaN there"]
)
def test_a_gradient_made_non_finite_after_unscale_skips_the_step_on_every_rank(
    level, shard, hook, who
):
    """An audit: the early decision of unscale_ stepped it — NaN weights on one rank (the ranks
    parted), or NaN FP32 masters the gather spread to every rank. Rank 0's inf and rank 1's NaN
    were reported as "a NaN on rank 0" (the rank and the kind reduced apart, an audit). With
    sharded masters an inf one rank wrote where another rank steps was dropped (an audit)."""
    results = run_ranks(_edit_after_unscale, 2, level, shard, hook, who)
    for seen, weights in results:
        assert [s[0] for s in seen] == [False, True, False], seen
        assert [s[1] for s in seen] == [True, False, True], seen
        assert "finite at distamp.unscale_" in seen[1][2]
        # the lowest rank whose stepped gradients held it (sharded: the owner of the bias)
        if who == "one rank, in another's part":
            assert "on rank 1" in seen[1][2], seen
        else:
            assert "on rank 0" in seen[1][2] or (who == "every rank" and shard)
        assert ("a NaN" if who == "every rank" else "an inf") in seen[1][2]
        assert torch.isfinite(weights).all()
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_grad_norm_takes_torchs_error_if_nonfinite_and_foreach(level):
    """torch's keywords gave a TypeError (an audit): foreach changes nothing, and
    error_if_nonfinite=True raises on an overflowed step's norm, as torch's clip does."""
    norms = []
    for foreach in (None, True):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
        x, y = data(1, 8)[0]
        with distamp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        norms.append(
            distamp.clip_grad_norm_(opt, 0.1, 2.0, error_if_nonfinite=True, foreach=foreach)
        )
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(norms[0]) and torch.equal(norms[0], norms[1])
    with distamp.scale_loss(F.mse_loss(model(x).float(), y) * 1e38, opt) as scaled:
        scaled.backward()  # overflows at the 2**16 scale
    with pytest.raises(RuntimeError, match=r"expected a finite total norm.*found inf"):
        distamp.clip_grad_norm_(opt, 0.1, error_if_nonfinite=True)
    assert torch.isinf(distamp.clip_grad_norm_(opt, 0.1))  # the default: no error
    opt.step()
    assert distamp.stats(opt).last_step_skipped


def test_lightnings_gradient_clip_val_over_masters_is_warned_once():
    """Lightning's gradient_clip_val clips optimizer.param_groups inside the step's closure,
    before step() gives the FP32 masters their gradients: under O2 only the norm layers were
    clipped, silently (an audit: 0.31 off FP32's weights). Lightning's closure is read
    duck-typed (``partial(Precision._wrap_closure, module, optimizer, closure)``; the real one
    was checked by hand, Lightning is not a test dependency); an override of
    configure_gradient_clipping (the README's recipe) is not warned about."""
    import functools
    import warnings

    class LightningModule(torch.nn.Module):  # stands for Lightning's base class
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **_):
            pass

    class Clipping(LightningModule):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **_):
            torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)

    class Trainer:
        gradient_clip_val = 0.5

    def messages(module_class, opt_level, **kwargs):
        module = module_class()
        module.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        module.net, opt = distamp.wrap(module.net, opt, opt_level=opt_level, verbosity=0, **kwargs)
        module._trainer = Trainer()

        def closure():
            loss = module.net(torch.randn(2, 4)).float().sum()
            loss.backward()
            return loss

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.step(functools.partial(lambda m, o, c: c(), module, opt, closure))
                opt.zero_grad()
        return [str(w.message) for w in caught if "gradient_clip_val" in str(w.message)]

    (message,) = messages(LightningModule, "O2")
    assert "gradient_clip_val=0.5 clips optimizer.param_groups" in message
    assert "the FP32 norm layers only" in message and "configure_gradient_clipping" in message
    assert messages(Clipping, "O2") == []
    assert messages(LightningModule, "O1") == []  # the optimizer steps the model's parameters
    # Sharded: O2's FP32 norm layers are still the model's own (clipped), O1's weights none (an
    # audit: O2 sharded was told "nothing").
    (message,) = messages(LightningModule, "O2", shard_master_weights=True)
    assert "the FP32 norm layers only" in message, message
    (message,) = messages(LightningModule, "O1", shard_master_weights=True)
    assert "clip nothing (sharded FP32 weights)" in message, message
