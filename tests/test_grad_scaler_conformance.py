"""distamp.GradScaler against torch's own grad-scaling behaviour (test/test_torch.py's device-generic
``test_grad_scaling_*``), rewritten for ours: the same training recipes (plain, clipping scaled
grads, clipping after ``unscale_``, gradient penalty, accumulation, two models and losses) give
the same weights and scales as ``torch.amp.GradScaler`` bit for bit and match an unscaled control;
sparse gradients are unscaled through their values; the setters exist; misuse raises where torch
raises. Deliberate difference (README): FP16 gradients are unscaled instead of refused.
"""

import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

INIT_SCALE = 128.0


def models_and_data(n_models=1, seed=0):
    """torch's scaling case: Linear(8, 8) x 2 models per recipe, SGD, 4 batches of 8x8."""
    torch.manual_seed(seed)
    models = [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(n_models)]
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in models]
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(4)
    ]
    return models, opts, batches


MAX_NORM = 0.2


def one_model(scaler, scaled, skip_iter, make_loss=None, before_step=None):
    """torch's one-model recipe: scaled (an inf injected at ``skip_iter``, which the scaler must
    skip) or as the unscaled control that skips the same step. ``make_loss(model, x, y, scaler)``
    and ``before_step(model, opt, scaler)`` get the scaler only in the scaled run."""
    (model,), (opt,), batches = models_and_data()
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        active = scaler if scaled else None
        loss = make_loss(model, x, y, active) if make_loss else F.mse_loss(model(x), y)
        (scaler.scale(loss) if scaled else loss).backward()
        if scaled and i == skip_iter:
            model[1].weight.grad.fill_(float("inf"))
        if before_step is not None:
            before_step(model, opt, active)
        if scaled:
            scaler.step(opt)
            scaler.update()
        elif i != skip_iter:
            opt.step()
    return [model]


def plain(scaler, scaled, skip_iter):
    return one_model(scaler, scaled, skip_iter)


def clipping(scaler, scaled, skip_iter):
    def clip(model, opt, scaler):
        # Clipping the scaled gradients: the threshold scaled too (torch's recipe).
        threshold = MAX_NORM * (scaler.get_scale() if scaler else 1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), threshold, error_if_nonfinite=False)

    return one_model(scaler, scaled, skip_iter, before_step=clip)


def clipping_separate_unscale(scaler, scaled, skip_iter):
    def clip(model, opt, scaler):
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=False)

    return one_model(scaler, scaled, skip_iter, before_step=clip)


def penalty(scaler, scaled, skip_iter):
    def penalized(model, x, y, scaler):
        loss = F.mse_loss(model(x), y)
        params = list(model.parameters())
        if scaler is not None:
            grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            grads = [g / scaler.get_scale() for g in grads]  # the penalty sees true gradients
        else:
            grads = torch.autograd.grad(loss, params, create_graph=True)
        return loss + sum(g.pow(2).sum() for g in grads).sqrt()

    return one_model(scaler, scaled, skip_iter, make_loss=penalized)


def accumulation(scaler, scaled, skip_iter, every=2):
    (model,), (opt,), batches = models_and_data()
    for i, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(x), y) / every
        if scaled:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if (i + 1) % every == 0:
            if scaled:
                if i == skip_iter:
                    model[1].weight.grad.fill_(float("inf"))
                scaler.step(opt)
                scaler.update()
            elif i != skip_iter:
                opt.step()
            opt.zero_grad()
    return [model]


def multiple(scaler, scaled, skip_iter):
    models, opts, batches = models_and_data(n_models=2)
    for i, (x, y) in enumerate(batches):
        for opt in opts:
            opt.zero_grad()
        out0, out1 = models[0](x), models[1](x)
        loss0 = F.mse_loss(0.3 * out0 + 0.7 * out1, y)
        loss1 = F.mse_loss(0.6 * out0 - 0.4 * out1, y)
        if scaled:
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            if i == skip_iter:
                models[1][1].weight.grad.fill_(float("inf"))
            scaler.unscale_(opts[0])  # one optimizer unscaled by hand, the other in step()
            scaler.step(opts[0])
            scaler.step(opts[1])
            scaler.update()
        else:
            loss0.backward(retain_graph=True)
            loss1.backward()
            opts[0].step()  # each optimizer decides alone: only the one with the inf skips
            if i != skip_iter:
                opts[1].step()
    return models


RECIPES = {
    "plain": (plain, 3, 1),
    "clipping": (clipping, 3, 1),
    "clipping_separate_unscale": (clipping_separate_unscale, 3, 1),
    "penalty": (penalty, 3, 1),
    "accumulation": (accumulation, 1, 1),
    "multiple": (multiple, 3, 1),
}


def scalers():
    kw = dict(init_scale=INIT_SCALE, growth_factor=2.0, growth_interval=1)
    return distamp.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_matches_torch_bit_for_bit_and_the_unscaled_control(name):
    recipe, unskipped, skipped = RECIPES[name]
    skip_iter = 2 if name != "accumulation" else 3
    ours, theirs = scalers()
    ours_models = recipe(ours, True, skip_iter)
    torch_models = recipe(theirs, True, skip_iter)
    control = recipe(None, False, skip_iter)
    # torch's assertion: the scale grew once per clean step and backed off once per skip.
    assert ours.get_scale() == theirs.get_scale() == INIT_SCALE * 2.0**unskipped * 0.5**skipped
    assert ours.state_dict() == theirs.state_dict()
    for m_ours, m_torch, m_control in zip(ours_models, torch_models, control, strict=True):
        for a, b, c in zip(
            m_ours.parameters(), m_torch.parameters(), m_control.parameters(), strict=True
        ):
            assert torch.equal(a, b), name
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_factors_and_scales_that_are_not_powers_of_two_round_like_torchs_fp32_scale():
    """torch keeps the scale in an FP32 tensor: 1.1 ** k, a backoff of 0.3, ``update(0.1)``,
    ``init_scale=1000.1`` are each rounded to FP32 (an audit: ours kept float64 and the weights
    parted from torch's in the 8th digit). (Before its first use torch's ``get_scale`` reports
    the value as given: its FP32 tensor is made lazily; ours rounds it at once.)"""
    runs = []
    for make in (distamp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu", init_scale=1000.1, growth_factor=1.1, backoff_factor=0.3)
        scaler.set_growth_interval(1)
        scaler.scale(torch.ones(()))  # torch makes its FP32 scale here
        seen = [scaler.get_scale()]
        models = plain(scaler, True, skip_iter=2)
        seen.append(scaler.get_scale())
        scaler.update(0.1)
        seen.append(scaler.get_scale())
        models += plain(scaler, True, skip_iter=1)
        seen.append(scaler.get_scale())
        back = make("cpu")
        back.scale(torch.ones(()))
        back.load_state_dict({**scaler.state_dict(), "scale": 1234.567})
        seen.append(back.get_scale())
        runs.append(
            (seen, scaler.state_dict(), [p.detach() for m in models for p in m.parameters()])
        )
    (seen, state, params), (t_seen, t_state, t_params) = runs
    assert seen == t_seen and state == t_state, (seen, t_seen)
    assert seen[0] != 1000.1  # rounded, as torch's
    for a, b in zip(params, t_params, strict=True):
        assert torch.equal(a, b)


def test_disabled_scaler_is_transparent_like_torch():
    scaler = distamp.GradScaler(enabled=False)
    x = torch.ones(2)
    assert scaler.scale(x) is x and scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})  # a no-op, as in torch
    models = plain(scaler, True, skip_iter=-1)
    control = plain(None, False, skip_iter=-1)
    for a, b in zip(models[0].parameters(), control[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_scale_takes_what_torch_takes():
    ours, theirs = scalers()
    t = torch.full((2,), 3.0)
    for scaler in (ours, theirs):
        out = scaler.scale([t, (t, [t])])
        assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
        assert torch.equal(out[1][1][0], t * INIT_SCALE)
        lazy = scaler.scale(x for x in (t, t))  # any other iterable: a lazy map, as torch does
        assert [torch.equal(v, t * INIT_SCALE) for v in lazy] == [True, True]
        with pytest.raises(ValueError, match="must be a Tensor or an iterable of Tensors"):
            scaler.scale(3.0)


def test_setters_change_the_next_updates_like_torch():
    ours, theirs = scalers()
    for scaler in (ours, theirs):
        scaler.set_growth_factor(4.0)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_interval(2)
        assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)
        assert scaler.get_growth_interval() == 2
        plain(scaler, True, skip_iter=0)  # backoff, then 3 clean steps at interval 2
    assert ours.get_scale() == theirs.get_scale() == INIT_SCALE * 0.25 * 4.0
    assert ours.state_dict() == theirs.state_dict()
    with pytest.raises(ValueError, match="expected an int >= 1, got 0"):
        ours.set_growth_interval(0)
    with pytest.raises(ValueError, match=r"new_factor expected a number in \(0, 1\), got 1.5"):
        ours.set_backoff_factor(1.5)


def test_growth_interval_lowered_below_the_tracker_waits_like_torch():
    """torch grows only when ``tracker + 1 == growth_interval``: an interval lowered below the
    tracker waits for the next backoff (an audit: ours grew at once)."""
    sequences = []
    for make in (distamp.GradScaler, torch.amp.GradScaler):
        scaler = make("cpu", init_scale=8.0, growth_interval=5)
        param = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([param], lr=0.0)
        seen = []
        for it in range(8):
            scaler.scale(param.sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if it == 2:
                scaler.set_growth_interval(2)
            seen.append(scaler.get_scale())
        sequences.append((seen, scaler.state_dict()))
    assert sequences[0] == sequences[1]
    assert sequences[0][0] == [8.0] * 8


def test_state_dict_is_interchangeable_with_torchs():
    ours, theirs = scalers()
    plain(theirs, True, skip_iter=1)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == ours.state_dict()
    with pytest.raises(RuntimeError, match="saved from a disabled GradScaler"):
        ours.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())


def one_backward(scaler):
    (model,), (opt,), batches = models_and_data()
    x, y = batches[0]
    scaler.scale(F.mse_loss(model(x), y)).backward()
    return model, opt


@pytest.mark.parametrize("kind", ["distamp", "torch"])
def test_misuse_raises_where_torch_raises(kind):
    """With torch's messages from their first character (README: an audit found words put
    before them)."""

    def make():
        return distamp.GradScaler("cpu") if kind == "distamp" else torch.amp.GradScaler("cpu")

    scaler = make()
    model, opt = one_backward(scaler)
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError,
        match="^"
        + re.escape(
            "unscale_() has already been called on this optimizer since the last update()."
        ),
    ):
        scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="pickled at the beginning of an iteration"):
        pickle.dumps(scaler)
    scaler.step(opt)
    with pytest.raises(
        RuntimeError,
        match="^" + re.escape("step() has already been called since the last update()."),
    ):
        scaler.step(opt)
    with pytest.raises(
        RuntimeError, match="^" + re.escape("unscale_() is being called after step().")
    ):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)
    empty = make()
    empty.scale(torch.ones(1))  # torch asserts on a scaler that never scaled anything
    bare = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        empty.step(bare)
    for bad in (torch.ones(2), torch.ones(1, requires_grad=True)):
        with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
            empty.update(bad)
    empty.update(torch.tensor(4.0))
    assert empty.get_scale() == 4.0
    # Pickled between iterations: a copy that goes on from the same scale (DataLoader workers,
    # copy.deepcopy of a trainer).
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == scaler.get_scale()


def sparse_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {"emb": nn.Embedding(12, 6, sparse=True).to(dtype), "head": nn.Linear(6, 3).to(dtype)}
    )


def sparse_loop(model, opt_params, scaler, steps=4, inject=None, rank=0, ddp=None):
    """nn.Embedding(sparse=True) trained by SGD (sparse and dense grads in one optimizer)."""
    opt = torch.optim.SGD(opt_params, lr=0.5)
    gen = torch.Generator().manual_seed(7)
    skipped = []
    for step in range(steps):
        idx = torch.randint(0, 12, (2, 8, 5), generator=gen)[rank]
        y = torch.randn(2, 8, 3, generator=gen)[rank]
        run = ddp if ddp is not None else (lambda i: model["head"](model["emb"](i).sum(1)))
        loss = F.mse_loss(run(idx).float(), y)
        scaler.scale(loss).backward()
        if inject is not None and step == inject and rank == 1:
            model["emb"].weight.grad._values().view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(
            all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        )
    return skipped


def test_sparse_gradients_are_unscaled_through_their_values_as_torch_does():
    ours, theirs = scalers()
    results = []
    for scaler in (ours, theirs):
        model = sparse_model()
        skipped = sparse_loop(model, model.parameters(), scaler, inject=None)
        results.append((model, skipped))
    (m_ours, s_ours), (m_torch, s_torch) = results
    assert s_ours == s_torch == [False] * 4
    for a, b in zip(m_ours.parameters(), m_torch.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours.get_scale() == theirs.get_scale() == INIT_SCALE * 2**4


def test_uncoalesced_fp16_sparse_gradient_that_overflows_when_summed_is_found():
    # torch's test_grad_scaling_unscale_sparse: each value is finite, but the duplicates of one
    # index sum past FP16's max; the optimizer would coalesce them into an inf.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]])  # (0, 2) twice
    for values, expect in (([16.0, 32.0, 64.0], False), ([64000.0, 32.0, 64000.0], True)):
        p = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
        p.grad = torch.sparse_coo_tensor(
            i, torch.tensor(values, dtype=torch.float16), (2, 3), check_invariants=True
        )
        opt = torch.optim.SGD([p], lr=1.0)
        scaler = distamp.GradScaler(init_scale=4.0)
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        assert (scaler.get_scale() == 2.0) is expect
        assert torch.equal(p.detach(), before) is expect
        if not expect:
            coalesced = torch.sparse_coo_tensor(
                i, torch.tensor(values), (2, 3), check_invariants=True
            ).to_dense()
            assert torch.equal(p.detach().float(), -coalesced / 4.0)


def ddp_sparse(rank, world):
    model = sparse_model()
    ddp = DDP(_Sparse(model))
    skipped = sparse_loop(
        model, model.parameters(), distamp.GradScaler(), inject=2, rank=rank, ddp=ddp
    )
    return {"skipped": skipped, "params": [p.detach().clone() for p in model.parameters()]}


class _Sparse(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner["head"](self.inner["emb"](idx).sum(1))


def test_sparse_gradients_under_ddp_with_an_inf_on_one_rank_skip_everywhere():
    results = run_ranks(ddp_sparse, 2)
    for r in results:
        assert r["skipped"] == [False, False, True, False]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_o1_wrap_trains_a_sparse_embedding_like_fp32():
    def train(opt_level):
        model = sparse_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if opt_level is not None:
            model, opt = distamp.wrap(
                model, opt, opt_level=opt_level, half_dtype=torch.float16, verbosity=0
            )
        gen = torch.Generator().manual_seed(7)
        for _ in range(3):
            idx = torch.randint(0, 12, (8, 5), generator=gen)
            y = torch.randn(8, 3, generator=gen)
            loss = F.mse_loss(model["head"](model["emb"](idx).sum(1)).float(), y)
            if opt_level is None:
                loss.backward()
            else:
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = train("O1")
    reference, _ = train(None)
    assert distamp.stats(opt).skipped_steps == 0
    # fp16 autocast in the head: the embedding's sparse update agrees to half precision.
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O3"])
def test_clip_grad_norm_counts_and_scales_a_sparse_gradient_with_replicated_masters(opt_level):
    """distamp.clip_grad_norm_ failed inside torch (no sparse linalg_vector_norm) with
    replicated masters — one rank, O3, SparseAdam — while sharded masters clipped (an audit).
    The norm counts the sparse gradient's coalesced values (duplicate indices summed) and the
    clip scales it as the dense ones."""
    model = sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = distamp.wrap(model, opt, opt_level=opt_level, verbosity=0)
    idx = torch.tensor([[1, 1, 2, 5, 1], [2, 3, 3, 0, 11]])  # repeated rows: uncoalesced
    loss = F.mse_loss(model["head"](model["emb"](idx).sum(1)).float(), torch.ones(2, 3))
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    distamp.unscale_(opt)
    grads = [p.grad for p in model.parameters()]
    assert grads[0].is_sparse and not grads[0].is_coalesced()
    dense = [(g.to_dense() if g.is_sparse else g).double() for g in grads]
    expected = torch.cat([g.reshape(-1) for g in dense]).norm()
    max_norm = float(expected) / 4
    total = distamp.clip_grad_norm_(opt, max_norm)
    tol = 1e-2 if opt_level == "O3" else 1e-5  # O3: bf16 gradients, a bf16 norm (as torch's)
    torch.testing.assert_close(total.double(), expected, rtol=tol, atol=0)
    coef = max_norm / (float(total) + 1e-6)
    for g, before in zip(grads, dense, strict=True):
        after = (g.to_dense() if g.is_sparse else g).double()
        torch.testing.assert_close(after, before * coef, rtol=tol, atol=1e-7)
    opt.step()


def _sparse_register(rank, world, opt_level, kwargs=None):
    model = sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = distamp.wrap(model, opt, opt_level=opt_level, verbosity=0, **(kwargs or {}))
    ddp = DDP(_Sparse(model))
    distamp.hooks.register(ddp, opt)  # a CompressState: O0/O1 buckets are FP32 on a bf16 wire
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        idx = torch.randint(0, 12, (8 * world, 5), generator=gen)
        y = torch.randn(8 * world, 3, generator=gen)
        mine = slice(rank * 8, (rank + 1) * 8)
        loss = F.mse_loss(ddp(idx[mine]).float(), y[mine])
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "opt_level,kwargs",
    [
        ("O0", None),
        ("O1", None),
        # An FP16 model's sparse bucket: gloo's sparse sum has no FP16 kernel on the CPU
        # ("cadd_sparse" not implemented for 'Half', in backward: an audit), reduced in FP32.
        ("O2", {"half_dtype": torch.float16, "loss_scale": 128.0}),
        ("O3", {"half_dtype": torch.float16}),
    ],
    ids=["O0", "O1", "O2-fp16", "O3-fp16"],
)
def test_register_reduces_a_sparse_embedding_like_fp32(opt_level, kwargs):
    """An audit: hooks.register at O0/O1 crashed in backward on a sparse bucket
    (aten::as_strided on SparseCPU: the pooled path cut it into stretches)."""
    results = run_ranks(_sparse_register, 2, opt_level, kwargs)
    reference = sparse_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        idx = torch.randint(0, 12, (16, 5), generator=gen)
        y = torch.randn(16, 3, generator=gen)
        F.mse_loss(reference["head"](reference["emb"](idx).sum(1)), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a, b)
    # a bf16 wire (and O1's bf16 autocast): within bf16's resolution of the FP32 reference
    for a, b in zip(results[0], reference.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), atol=3e-2, rtol=3e-2)


def test_the_default_device_scales_wherever_the_gradients_are():
    """``distamp.GradScaler()`` (torch's default device, "cuda") scales CPU gradients too: the
    whole migration from ``torch.amp.GradScaler("cuda")`` is the class name, also on CPU
    machines, where torch's disables itself with a warning."""
    assert distamp.GradScaler().is_enabled()
    assert distamp.GradScaler("cuda").is_enabled()


@pytest.mark.parametrize("kwargs", [{"growth_factor": 1.0}, {"backoff_factor": 1.0}])
def test_bad_factors_raise_torchs_error_and_only_when_enabled(kwargs):
    """README: the scaler raises where torch raises, with torch's messages; it raised ValueError
    with its own (an audit). A disabled scaler takes them, as torch's does."""
    with pytest.raises(AssertionError) as theirs:
        torch.amp.GradScaler("cpu", **kwargs)
    with pytest.raises(AssertionError) as ours:
        distamp.GradScaler(**kwargs)
    assert str(ours.value).startswith(str(theirs.value))
    torch.amp.GradScaler("cpu", enabled=False, **kwargs)
    assert not distamp.GradScaler(enabled=False, **kwargs).is_enabled()
