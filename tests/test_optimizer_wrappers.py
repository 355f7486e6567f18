"""Optimizer wrappers that read gradients inside their own ``step`` (apex's LARC pattern) see the
true, unscaled gradients when handed to ``wrap`` (see [Note: optimizer wrappers])."""

import contextlib

import pytest
import torch
from dist_harness import run_ranks
from models import FrameworkOptimizer, GradProbe
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp


class TrustRatio:
    """A user's LARC-style wrapper: per-parameter trust ratio computed from the gradient norm in
    ``step``, then the inner optimizer's step. Not a torch.optim.Optimizer subclass (as apex's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, eta: float = 0.02) -> None:
        self.optim = optimizer
        self.eta = eta
        self.seen_grad_norms: list[float] = []

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def step(self):
        with torch.no_grad():
            for group in self.optim.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    grad_norm = torch.norm(p.grad)
                    self.seen_grad_norms.append(grad_norm.item())
                    p.grad.mul_(self.eta * torch.norm(p) / (grad_norm + 1e-8))
        self.optim.step()


G = torch.tensor([0.5, -1.0, 0.25, 2.0])


def _run(rank, world, level):
    model = GradProbe(4)
    nn.init.ones_(model.w)
    opt = TrustRatio(torch.optim.SGD(model.parameters(), lr=1.0))
    model, returned = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    assert returned is opt and isinstance(opt, TrustRatio)  # identity kept
    for _ in range(2):
        with distamp.scale_loss(model(G).float(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return {
        "norms": opt.seen_grad_norms,
        "w": model.w.detach().float(),
        "stats": distamp.stats(opt),
    }


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_wrapper_reads_unscaled_gradients_in_its_step(level):
    (r,) = run_ranks(_run, 1, level)
    assert r["norms"] == [pytest.approx(G.norm().item(), rel=1e-2)] * 2
    # each step moves w by eta * |w| along -g/|g|: the trust ratio saw the true gradient
    assert r["w"].norm().item() < 2.0 and r["stats"].steps == 2 and r["stats"].skipped_steps == 0


def _with_ddp_and_checkpoint(rank, world, directory):
    model = GradProbe(4)
    nn.init.ones_(model.w)
    opt = TrustRatio(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=False, verbosity=0)
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt)
    for _ in range(2):
        with distamp.scale_loss(ddp(G).float(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    distamp.save_checkpoint(directory, model, opt)
    saved = model.w.detach().clone()
    with distamp.scale_loss(ddp(G).float(), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    distamp.load_checkpoint(directory, model, opt)
    return torch.equal(model.w, saved)


def test_hooks_and_checkpoints_take_the_wrapper_the_user_holds(tmp_path):
    assert run_ranks(_with_ddp_and_checkpoint, 2, str(tmp_path / "ckpt")) == [True, True]


def _sharded(rank, world):
    out = {}
    model = GradProbe(4)
    opt = TrustRatio(torch.optim.SGD(model.parameters(), lr=1.0))
    try:
        distamp.wrap(model, opt, opt_level="O2", shard_master_weights=True, verbosity=0)
    except ValueError as exc:
        out["explicit"] = str(exc)
    model = GradProbe(4)
    opt = TrustRatio(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.warns(UserWarning, match="stay replicated") as record:
        model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    out["warning"] = str(record[0].message)
    out["master_bytes"] = distamp.stats(opt).master_bytes
    return out


def test_sharded_masters_refuse_a_wrapper_and_the_default_keeps_them_replicated():
    """A wrapper reads whole parameters in its step: shard_master_weights=True is refused, and the
    default (sharded at 2 ranks) keeps the masters replicated for it, saying so."""
    for out in run_ranks(_sharded, 2):
        assert "TrustRatio wraps an optimizer" in out["explicit"]
        assert "shard_master_weights=False" in out["explicit"]
        assert "TrustRatio is not among torch's per-parameter optimizers" in out["warning"]
        assert out["master_bytes"] == 4 * 4  # the whole FP32 master on every rank


class Lamb(torch.optim.Optimizer):
    """LAMB as its papers and timm write it: Adam's update scaled per parameter by the trust
    ratio ||w|| / ||update||, which needs the whole parameter (not a flat slice of a shard)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = state["m"] / (state["v"].sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.add_(update, alpha=-group["lr"] * float(trust))


def _lamb(rank, world, shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    opt = Lamb(model.parameters())
    with pytest.warns(UserWarning, match="Lamb") as record:
        model, opt = distamp.wrap(
            model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0
        )
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        loss = nn.functional.mse_loss(
            ddp(x[rank * 4 : rank * 4 + 4]).float(), y[rank * 4 : rank * 4 + 4]
        )
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return {
        "warning": str(record[0].message),
        "weights": [p.detach().float().clone() for p in model.parameters()],
        "master_bytes": distamp.stats(opt).master_bytes,
    }


def test_an_optimizer_that_reads_whole_parameters_keeps_replicated_masters_by_default():
    """LAMB's trust ratio on a flat slice of a shard is not LAMB: at 2 ranks O2's default keeps
    its masters replicated (every rank holds all of them and steps the same whole
    parameters, so the replicas agree bit for bit); an explicit True shards, with a warning."""
    default = run_ranks(_lamb, 2, None)
    for out in default:
        assert "Lamb is not among torch's per-parameter optimizers" in out["warning"]
        assert out["master_bytes"] == 4 * (6 * 32 + 32 + 32 * 3 + 3)
    for a, b in zip(default[0]["weights"], default[1]["weights"], strict=True):
        assert torch.equal(a, b)
    for out in run_ranks(_lamb, 2, True):
        assert "shard_master_weights=True with Lamb" in out["warning"]
        assert out["master_bytes"] < 4 * (6 * 32 + 32 + 32 * 3 + 3)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead, as users copy it: an Optimizer subclass around a base optimizer whose
    param_groups it shares (the same dicts), with slow weights in its own state."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self._base_optimizer = base
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state = {}
        self.alpha, self.k, self.steps = alpha, k, 0
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @torch.no_grad()
    def step(self, closure=None):
        self._base_optimizer.step()
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                slow = self.state.setdefault(p, {}).setdefault("slow", p.detach().clone())
                if self.steps % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)


@pytest.mark.parametrize("shard", [False, True])
def test_a_wrapper_sharing_its_param_groups_with_the_base_optimizer_trains_under_o2(shard):
    """Sharing the base optimizer's param_groups dicts is not keeping parameters elsewhere: the
    masters reach the base through them (wrap must not refuse it), and the model trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
    # Lookahead is not one of torch's per-parameter optimizers: sharding it is the user's call.
    warns = pytest.warns(UserWarning, match="with Lookahead") if shard else contextlib.nullcontext()
    with warns:
        model, opt = distamp.wrap(
            model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0
        )
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(8):
        loss = nn.functional.mse_loss(model(x).float(), y)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def _sparse_adam(rank, world):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    head = nn.Linear(4, 2)
    model = nn.Sequential(emb, head)
    out = {}
    try:
        distamp.wrap(
            model,
            [torch.optim.SparseAdam(emb.parameters()), torch.optim.AdamW(head.parameters())],
            opt_level="O2",
            shard_master_weights=True,
            verbosity=0,
        )
    except ValueError as exc:
        out["explicit"] = str(exc)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opts = [torch.optim.SparseAdam(model[0].parameters()), torch.optim.AdamW(model[1].parameters())]
    with pytest.warns(UserWarning) as record:
        distamp.wrap(model, opts, opt_level="O2", verbosity=0)
    out["warning"] = [str(r.message) for r in record if "per-parameter" in str(r.message)]
    return out


def test_sparse_adam_is_refused_sharded_and_the_warning_names_what_stays_replicated():
    for out in run_ranks(_sparse_adam, 2):
        assert "shard_master_weights=True with SparseAdam" in out["explicit"], out
        (warning,) = out["warning"]
        assert "SparseAdam is not among torch's per-parameter" in warning, warning
        assert "for every optimizer wrapped with it (2 in all" in warning, warning


class SAM(torch.optim.Optimizer):
    """davda54/sam's SAM, the widely copied shape: a base optimizer sharing its param_groups,
    stepped by ``second_step`` itself (outside ``step()``)."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm() for g in grads])) if grads else torch.tensor(0.0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * group["rho"] / (norm + 1e-12))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_base_optimizer_stepped_outside_step_is_refused_by_name(level):
    """SAM's second_step steps its base optimizer itself: no unscale, no skip decision, no copy of
    the FP32 masters into the model (an audit: O2's loss went to 7e28, O1's to NaN, silently).
    It raises, naming the attribute (a nested step inside step(), timm's Lookahead, passes:
    test_a_wrapper_sharing_its_param_groups_with_the_base_optimizer_trains_under_o2)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(16, 4)
    with distamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.first_step()
    with distamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    with pytest.raises(
        RuntimeError, match=r"optimizer\.base_optimizer\.step\(\) \(SGD inside SAM\) ran outside"
    ):
        opt.second_step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_framework_optimizer_holding_the_wrapped_one_is_taken_for_it(level):
    """scale_loss, clip_grad_norm_ and stats on accelerate's AcceleratedOptimizer said "was not
    returned by distamp.wrap" (an audit): the distamp optimizer it holds is used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, inner = distamp.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0
    )
    opt = FrameworkOptimizer(inner)
    x = torch.randn(16, 4)
    with distamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    norm = distamp.clip_grad_norm_(opt, 1e-3)
    assert torch.isfinite(norm) and norm > 1e-3
    opt.step()
    opt.zero_grad()
    assert distamp.stats(opt).steps == 1 and distamp.stats(opt) == distamp.stats(inner)


class ImitatingOptimizer:
    """Lightning Fabric's _FabricOptimizer, as fabric.setup builds it: its instance's class
    becomes a subclass of the held optimizer's own class (isinstance checks pass), and what its
    instance lacks is read from the held optimizer (``__getattr__``)."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type(
            "Fabric" + type(optimizer).__name__, (type(self), type(optimizer)), {}
        )

    @property
    def optimizer(self):
        return self._optimizer

    def state_dict(self):
        return self._optimizer.state_dict()

    def step(self, closure=None):
        return self._optimizer.step(closure)

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_framework_optimizer_imitating_the_wrapped_class_is_taken_for_it(level, tmp_path):
    """An audit: on Fabric's wrapper .state, distamp.stats and save_checkpoint raised KeyError
    'state' (distamp's state property read the wrapper's own __dict__)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, inner = distamp.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=0.1), opt_level=level, verbosity=0
    )
    opt = ImitatingOptimizer(inner)
    assert isinstance(opt, type(inner))
    with distamp.scale_loss(model(torch.randn(16, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    distamp.clip_grad_norm_(opt, 1.0)
    opt.step()
    opt.zero_grad()
    assert opt.state is inner.state and len(opt.state) == len(inner.state) > 0
    assert distamp.stats(opt).steps == 1 and distamp.stats(opt) == distamp.stats(inner)
    distamp.save_checkpoint(tmp_path / "ckpt", model, opt)
    distamp.load_checkpoint(tmp_path / "ckpt", model, opt)


def test_an_optimizer_a_framework_prepared_before_wrap_is_refused_naming_the_order():
    """accelerator.prepare(optimizer) before distamp.wrap: wrap took the AcceleratedOptimizer
    (an Optimizer whose __init__ never ran) and the first step failed with AttributeError
    '_optimizer_step_pre_hooks' deep inside distamp (an audit). Refused at wrap, nothing
    changed."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = FrameworkOptimizer(inner)
    with pytest.raises(ValueError, match=r"found a FrameworkOptimizer holding a SGD .* before"):
        distamp.wrap(model, prepared, opt_level="O2", verbosity=0)
    assert type(inner) is torch.optim.SGD and all(
        p.dtype == torch.float32 for p in model.parameters()
    )


def test_the_warning_for_a_wrapper_built_after_wrap_points_at_scale_loss():
    """It was reported at contextlib.py (scale_loss is a context manager): Python's default
    filter then showed it once for every call site of the process (an audit)."""
    import warnings

    class Slotted:  # a wrapper whose instances cannot change class
        __slots__ = ("optim",)

        def __init__(self, optim):
            self.optim = optim

        @property
        def param_groups(self):
            return self.optim.param_groups

        def step(self):
            return self.optim.step()

    model = torch.nn.Linear(4, 4)
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distamp.scale_loss(model(torch.randn(2, 4)).float().sum(), Slotted(opt)) as s:
            s.backward()
    (warning,) = [w for w in caught if "was built around the" in str(w.message)]
    assert warning.filename == __file__
