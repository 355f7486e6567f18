"""apex's multiple models / optimizers / losses matrix: only the optimizers of an overflowed loss skip.

O0 with a dynamic loss scale keeps the weights FP32; power-of-two scaling is exact, so the wrapped
run must equal a hand-computed FP32 reference (same steps skipped) bit for bit.
"""

import itertools

import pytest
import torch
from asserts import backward
from dist_harness import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

STEPS = 5
INJECT_AT = 2

# name: (models per optimizer, models per loss, optimizers passed to each loss's scale_loss)
SCENARIOS = {
    "2models2losses1optimizer": ([[0, 1]], [[0], [1]], [[0], [0]]),
    "2models2losses2optimizers": ([[0], [1]], [[0], [1]], [[0], [1]]),
    "3models2losses2optimizers": ([[0, 1], [2]], [[0, 1], [2, 1]], [[0], [0, 1]]),
    "3models2losses2optimizers_both": ([[0, 1], [2]], [[0, 2], [1, 2]], [[0, 1], [0, 1]]),
    "2models2losses2optimizers_shared": ([[0], [1]], [[0], [0, 1]], [[0], [0, 1]]),
}


def make_models(n):
    torch.manual_seed(0)
    return [nn.Linear(4, 3) for _ in range(n)]


def optimizers_for(models, layout):
    return [
        torch.optim.SGD([p for m in ms for p in models[m].parameters()], lr=0.1, momentum=0.5)
        for ms in layout
    ]


def losses(models, per_loss, x):
    return [sum((models[m](x) ** 2).mean() for m in ms) for ms in per_loss]


def run(scenario, num_losses, which_backward, which_model, *, amp, how_to_zero="optimizer"):
    opt_layout, per_loss, opts_per_loss = SCENARIOS[scenario]
    n_models = 1 + max(itertools.chain.from_iterable(opt_layout))
    models = make_models(n_models)
    opts = optimizers_for(models, opt_layout)
    if amp:
        models, opts = distamp.wrap(
            models, opts, opt_level="O0", loss_scale="dynamic", num_losses=num_losses, verbosity=0
        )
    skip = expected_skips(scenario, which_backward, which_model)
    scales = []
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    for step in range(STEPS):
        for loss_index, loss in enumerate(losses(models, per_loss, x)):
            chosen = [opts[o] for o in opts_per_loss[loss_index]]
            loss_id = loss_index if num_losses == 2 else 0
            inject = step == INJECT_AT and loss_index == which_backward
            if amp:
                with distamp.scale_loss(loss, chosen, loss_id=loss_id) as scaled:
                    scaled.backward()
                    if inject:
                        models[which_model].weight.grad[0, 0] = float("inf")
            else:
                loss.backward()
        for o, opt in enumerate(opts):
            if amp or not (step == INJECT_AT and o in skip):
                opt.step()
        for model in models:  # apex's test zeroes all three ways
            if how_to_zero == "optimizer":
                pass
            elif how_to_zero == "model":
                model.zero_grad()
            else:
                for p in model.parameters():
                    p.grad = None
        if how_to_zero == "optimizer":
            for opt in opts:
                opt.zero_grad()
        if amp:
            scales.append(distamp.stats(opts[0]).loss_scales)
    stats = [distamp.stats(opt) for opt in opts] if amp else None
    return models, stats, scales


def expected_skips(scenario, which_backward, which_model):
    """Hand-computed as in apex's tests: an optimizer skips iff it was passed to the scale_loss
    block whose backward overflowed, whatever the loss_id (num_losses only picks the scalers)."""
    _, per_loss, opts_per_loss = SCENARIOS[scenario]
    if which_model not in per_loss[which_backward]:
        return set()
    return set(opts_per_loss[which_backward])


CASES = [
    (scenario, num_losses, which_backward, which_model)
    for scenario, (layout, per_loss, _) in SCENARIOS.items()
    for num_losses in (1, 2)
    for which_backward in (0, 1)
    for which_model in per_loss[which_backward]
]


@pytest.mark.parametrize("how_to_zero", ["optimizer", "model", "none"])
@pytest.mark.parametrize(("scenario", "num_losses", "which_backward", "which_model"), CASES)
def test_only_optimizers_of_the_overflowed_loss_skip(
    scenario, num_losses, which_backward, which_model, how_to_zero
):
    models, stats, scales = run(
        scenario, num_losses, which_backward, which_model, amp=True, how_to_zero=how_to_zero
    )
    reference, _, _ = run(scenario, num_losses, which_backward, which_model, amp=False)
    skip = expected_skips(scenario, which_backward, which_model)
    assert [s.skipped_steps for s in stats] == [int(o in skip) for o in range(len(stats))]
    for model, ref in zip(models, reference, strict=True):
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, r)
    # The scale of the overflowed loss backs off once, at the step; with num_losses=2 the other
    # loss keeps its scale.
    before, after = scales[INJECT_AT - 1], scales[INJECT_AT]
    overflowed = which_backward if num_losses == 2 else 0
    for loss_id in range(num_losses):
        factor = 0.5 if loss_id == overflowed else 1.0
        assert after[loss_id] == before[loss_id] * factor


def test_loss_id_out_of_range_is_refused():
    models = make_models(1)
    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    model, opt = distamp.wrap(models[0], opt, opt_level="O2", num_losses=2)
    loss = model(torch.randn(2, 4)).sum()
    with pytest.raises(ValueError, match=r"loss_id must be in \[0, num_losses=2\), got 2"):
        with distamp.scale_loss(loss, opt, loss_id=2):
            pass
    # apex indexed its scalers with loss_id: numpy's and torch's integers worked there (an audit:
    # np.int64(1) got "must be in [0, 2), got np.int64(1)"); a bool or float is not an index
    np = pytest.importorskip("numpy")
    for index in (np.int64(1), torch.tensor(1)):
        with distamp.scale_loss(model(torch.randn(2, 4)).sum(), opt, loss_id=index) as scaled:
            scaled.backward()
    assert distamp.stats(opt).loss_scales == (2.0**16, 2.0**16)
    for bad in (True, 1.0):
        with pytest.raises(
            TypeError, match=rf"expected loss_id as an int, got {type(bad).__name__}"
        ):
            with distamp.scale_loss(loss, opt, loss_id=bad):
                pass


class _Pair(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return ((x * self.weight0.float()) * self.weight1.float()).sum()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize(
    ("overflowing", "scales"), [((0, 1), [2.0, 8.0]), ((0,), [2.0, 16.0]), ((1,), [4.0, 8.0])]
)
def test_each_overflowed_loss_backs_off_also_when_another_already_did(
    opt_level, overflowing, scales
):
    """[Note: which block made a gradient non-finite] apex's two-losses-one-optimizer case with
    both losses overflowing in one step (each in its own parameters): both scales back off, as
    apex's (each checks only the gradients its own backward made). One flag per optimizer
    masked loss 1's overflow behind loss 0's (an audit: scales [2, 16])."""
    m0, m1 = _Pair(1), _Pair(2)
    opt = torch.optim.SGD([{"params": m0.parameters()}, {"params": m1.parameters()}], lr=0.25)
    (m0, m1), opt = distamp.wrap(
        [m0, m1], opt, opt_level=opt_level, num_losses=2, half_dtype=torch.bfloat16, verbosity=0
    )
    group = opt._distamp.group
    group.scalers[0].scale, group.scalers[1].scale = 4.0, 16.0
    x = torch.ones(2)
    for loss_id, model in enumerate((m0, m1)):
        with distamp.scale_loss(model(x), opt, loss_id=loss_id) as scaled:
            scaled.backward()
            if loss_id in overflowing:
                model.weight0.grad[0] = float("inf")
    opt.step()
    assert distamp.stats(opt).last_step_skipped
    assert [s.scale for s in group.scalers] == scales


@pytest.mark.parametrize("num_losses", [1, 2])
def test_an_optimizer_skips_when_its_loss_overflowed_in_another_optimizers_parameters(num_losses):
    """DESIGN 4: loss 0 -> [o0] overflows; loss 1 -> [o0, o1] overflows too, in o0's parameters
    only. o1 took part in an overflowed loss: it skips, and loss 1's scale backs off (an audit:
    o1 stepped, as o0 already held a non-finite gradient when loss 1's block ended)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    o0, o1 = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    (a, b), (o0, o1) = distamp.wrap(
        [a, b],
        [o0, o1],
        opt_level="O2",
        num_losses=num_losses,
        half_dtype=torch.bfloat16,
        verbosity=0,
    )
    x = torch.randn(2, 4)
    with distamp.scale_loss(a(x).float().sum(), o0, loss_id=0) as scaled:
        scaled.backward()
        a.weight.grad[0, 0] = float("inf")
    with distamp.scale_loss((a(x) * b(x)).float().sum(), [o0, o1], loss_id=num_losses - 1) as s:
        s.backward()
        a.bias.grad[0] = float("inf")
    before = b.weight.detach().clone()
    o0.step()
    o1.step()
    assert distamp.stats(o0).last_step_skipped and distamp.stats(o1).last_step_skipped
    assert torch.equal(b.weight, before)
    assert distamp.stats(o1).loss_scales[-1] == 2.0**15  # loss 1 backed off from 2**16


def _overflow_in_loss_0_on_rank_1(rank, world, reduce_scatter):
    torch.manual_seed(0)
    a, b = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)), nn.Linear(8, 1)
    o_a, o_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    (a, b), (o_a, o_b) = distamp.wrap([a, b], [o_a, o_b], opt_level="O2", num_losses=2, verbosity=0)
    d_a, d_b = DDP(a), DDP(b)
    distamp.hooks.register(d_a, o_a, reduce_scatter=reduce_scatter)
    distamp.hooks.register(d_b, o_b, reduce_scatter=reduce_scatter)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    hidden = d_a(x).float()
    if rank == 1:  # a gradient overflow in loss 0's backward, on one rank only
        hidden.register_hook(lambda g: g * float("inf"))
    with distamp.scale_loss(hidden.pow(2).mean(), o_a, loss_id=0) as scaled:
        scaled.backward()
    with distamp.scale_loss(d_b(d_a(x)).float().mean(), [o_a, o_b], loss_id=1) as scaled:
        scaled.backward()
    before = b.weight.detach().clone()
    o_a.step()
    o_b.step()
    moved = not torch.equal(before, b.weight)
    return (
        distamp.stats(o_a).last_step_skipped,
        distamp.stats(o_b).last_step_skipped,
        moved,
        (distamp.stats(o_a).loss_scales),
    )


@pytest.mark.xdist_group("multirank")
@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["all-reduce", "reduce-scatter"])
def test_only_the_overflowed_loss_backs_off_with_either_hook_and_an_inf_on_one_rank(
    reduce_scatter,
):
    """With the reduce-scatter hook a rank's model .grad keeps its own gradient, the reduced sum
    lives in its FP32 shard: rank 0 first saw rank 1's inf at step(), and blamed every block of
    the step — loss 1 backed off and optimizer B (whose losses were finite) skipped (an audit)."""
    for rank, result in enumerate(run_ranks(_overflow_in_loss_0_on_rank_1, 2, reduce_scatter)):
        assert result == (True, False, True, (2.0**15, 2.0**16)), (rank, result)


def _nine_blocks(rank, world, accumulate):
    """A backbone optimizer and a head optimizer: the main loss (loss 0, both optimizers) over
    ``accumulate`` micro-batches (DDP's no_sync but the last), then a regularizer on the
    backbone alone (loss 1, the backbone's optimizer), which is inf on the last rank at step 1."""
    import contextlib

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    backbone = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, [backbone, head] = distamp.wrap(
        model, [backbone, head], opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
    )
    ddp = DDP(model) if world > 1 else model
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(3):
        for k in range(accumulate):
            sync = k == accumulate - 1 or world == 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = ddp(torch.randn(4, 8, generator=g)).pow(2).mean() / accumulate
                with distamp.scale_loss(loss, [backbone, head], loss_id=0) as scaled:
                    scaled.backward()
        aux = model[0].weight.pow(2).sum() * 1e-4  # each rank's own: not through DDP
        if step == 1 and rank == world - 1:
            aux = aux * float("inf")
        with distamp.scale_loss(aux, backbone, loss_id=1) as scaled:
            scaled.backward()
        backbone.step()
        head.step()
        backbone.zero_grad()
        head.zero_grad()
        out.append(
            (
                distamp.stats(backbone).skipped_steps,
                distamp.stats(head).skipped_steps,
                tuple(distamp.stats(backbone).loss_scales),
            )
        )
    return out


@pytest.mark.xdist_group("multirank")
@pytest.mark.parametrize("accumulate", [7, 9])
@pytest.mark.parametrize("world", [1, 2])
def test_many_blocks_of_one_loss_do_not_share_a_flag_with_another_loss(world, accumulate):
    """The decision vector's 8 flag slots were filled one per block, folded by index: the ninth
    block (the overflowing loss 1) shared the first's slot (loss 0), so loss 0 backed off too and
    the head's optimizer, which loss 1 never touched, skipped (an audit). Blocks of one loss and
    one set of optimizers now share one slot; only the backbone's optimizer skips, only loss 1's
    scale halves, on every rank."""
    skipped = (1, 0, (2.0**16, 2.0**15))  # (backbone's skips, head's skips, scales)
    expected = [(0, 0, (2.0**16, 2.0**16)), skipped, skipped]
    for rank, result in enumerate(run_ranks(_nine_blocks, world, accumulate)):
        assert result == expected, (rank, accumulate, result)


# -- a block that does not list an optimizer its backward reaches ---------------------------------


def _enc_head(amp: bool, steps: int = 3):
    """An encoder stepped by one optimizer, a head by another; scale_loss lists only the
    encoder's (an audit: the head moved 844 instead of 0.013)."""
    torch.manual_seed(0)
    enc, head = nn.Linear(4, 8), nn.Linear(8, 2)
    oe = torch.optim.SGD(enc.parameters(), lr=0.1)
    oh = torch.optim.SGD(head.parameters(), lr=0.1)
    if amp:
        [enc, head], [oe, oh] = distamp.wrap(
            [enc, head], [oe, oh], opt_level="O0", loss_scale="dynamic", verbosity=0
        )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        oe.zero_grad()
        oh.zero_grad()
        loss = head(enc(torch.randn(16, 4, generator=g))).pow(2).mean()
        backward(loss, oe if amp else None)
        oe.step()
        oh.step()
    return [p.detach().clone() for p in (*enc.parameters(), *head.parameters())]


def test_gradients_of_an_optimizer_the_block_did_not_list_are_taken_at_its_scale():
    """O0 with a dynamic scale: power-of-two scaling is exact, so bit for bit FP32's."""
    with pytest.warns(UserWarning, match="optimizer 1's gradients were written by a scale_loss"):
        got = _enc_head(amp=True)
    for a, b in zip(got, _enc_head(amp=False), strict=True):
        assert torch.equal(a, b)


def _gan(amp: bool, steps: int = 3, set_to_none: bool = True):
    """The GAN habit: the generator's loss reaches the discriminator, whose gradients are
    cleared before its own backward (apex's DCGAN zeroes them in place); nothing to warn about."""
    torch.manual_seed(0)
    G, D = nn.Linear(3, 4), nn.Linear(4, 1)
    oG = torch.optim.SGD(G.parameters(), lr=0.1)
    oD = torch.optim.SGD(D.parameters(), lr=0.1)
    if amp:
        [G, D], [oG, oD] = distamp.wrap(
            [G, D], [oG, oD], opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
        )
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        D.zero_grad(set_to_none=set_to_none)
        fake = G(torch.randn(8, 3, generator=g))
        real = torch.randn(8, 4, generator=g)
        backward(D(fake.detach()).mean() - D(real).mean(), oD if amp else None, 0)
        oD.step()
        G.zero_grad()
        backward(-D(fake).mean(), oG if amp else None, 1)  # reaches D's parameters too
        oG.step()
    return [p.detach().clone() for p in (*G.parameters(), *D.parameters())]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_gan_whose_generator_loss_reaches_the_discriminator_trains_as_fp32_without_warnings(
    set_to_none,
):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gan(amp=True, set_to_none=set_to_none)
    for a, b in zip(got, _gan(amp=False, set_to_none=set_to_none), strict=True):
        assert torch.equal(a, b)


def test_a_block_that_adds_at_another_scale_to_pending_gradients_is_refused_at_step():
    """Actor-critic, two losses at two scales: the critic's loss (loss 1, listing only the
    critic's optimizer) reaches the actor's trunk, whose loss-0 gradients are pending at
    another scale: a sum at two scales, which nothing can unscale (the audit's trunk moved
    0.126 off, silently)."""
    torch.manual_seed(0)
    trunk, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    oa = torch.optim.SGD(trunk.parameters(), lr=0.1)
    oc = torch.optim.SGD(critic.parameters(), lr=0.1)
    [trunk, critic], [oa, oc] = distamp.wrap(
        [trunk, critic], [oa, oc], opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
    )
    state = oa.state_dict()
    state["distamp"]["scalers"][1]["scale"] = 2.0**8  # loss 1 at another scale than loss 0
    oa.load_state_dict(state)
    h = trunk(torch.randn(8, 4))
    with distamp.scale_loss(h.pow(2).mean(), oa, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with distamp.scale_loss(critic(h).mean(), oc, loss_id=1) as scaled:
        scaled.backward()
    oc.step()  # the critic's own gradients: one scale, stepped
    with pytest.raises(RuntimeError, match="loss_id=1 .* did not while its gradients were pending"):
        oa.step()


def test_a_gan_saves_after_the_generator_step_with_the_discriminator_holding_adopted_grads(
    tmp_path,
):
    """apex's DCGAN loop saves after ``optG.step()``; the generator's loss left gradients in the
    discriminator, adopted (its optimizer not listed), and save_checkpoint refused "gradients
    pending from scale_loss" with G and D wrapped together — not apart (an audit). They are
    dropped as any clear drops them; the optimizer's own pending gradients are still refused."""
    torch.manual_seed(0)
    G, D = nn.Linear(3, 4), nn.Linear(4, 1)
    oG, oD = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (G, D))
    [G, D], [oG, oD] = distamp.wrap([G, D], [oG, oD], opt_level="O2", num_losses=2, verbosity=0)
    g = torch.Generator().manual_seed(2)
    D.zero_grad()
    fake = G(torch.randn(8, 3, generator=g))
    backward(
        D(fake.detach()).float().mean() - D(torch.randn(8, 4, generator=g)).float().mean(), oD, 0
    )
    oD.step()
    G.zero_grad()
    backward(-D(fake).float().mean(), oG, 1)  # reaches D's parameters too
    oG.step()
    distamp.save_checkpoint(tmp_path / "step_1", [G, D], [oG, oD])
    saved = [p.detach().float().clone() for p in (*G.parameters(), *D.parameters())]
    backward(D(fake.detach()).float().mean(), oD, 0)  # D's own block: pending, refused
    with pytest.raises(RuntimeError, match=r"optimizers\[1\] has gradients pending"):
        distamp.save_checkpoint(tmp_path / "step_2", [G, D], [oG, oD])
    distamp.load_checkpoint(tmp_path / "step_1", [G, D], [oG, oD])
    for a, b in zip(saved, (*G.parameters(), *D.parameters()), strict=True):
        assert torch.equal(a, b.detach().float())
