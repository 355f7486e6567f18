"""The bad-input matrix: each misuse raises the documented exception, names the problem, and
leaves the model and the optimizer exactly as they were (nothing lost)."""

import copy
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from asserts import assert_same as same
from torch import nn

import distamp
import distamp.fsdp
from distamp.checkpoint import CheckpointError


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def plain():
    model = net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class CachingSGD(torch.optim.Optimizer):
    """A third-party optimizer written like torch's LBFGS: it steps the list it kept at
    construction, not its param_groups."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self._params = [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        for p in self._params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.defaults["lr"])


def caching():
    model = net()
    return model, CachingSGD(model.parameters(), lr=0.1)


def wrapped(**kwargs):
    model, opt = plain()
    kwargs.setdefault("opt_level", "O2")
    model, opt = distamp.wrap(model, opt, verbosity=0, **kwargs)
    return model, opt


def stepped(**kwargs):
    """Wrapped, after one real step (so there is optimizer state and a loss scale to lose)."""
    model, opt = wrapped(**kwargs)
    backward(model, opt)
    opt.step()
    opt.zero_grad()
    return model, opt


def relaid():
    """Sharded masters after a step, then what model.to(memory_format=...) does to a parameter
    (the same values in new storage, laid out otherwise), then a backward. A plain copy in the
    same layout (model.to("cpu:0")) is put back: tests/test_sharded.py."""
    model, opt = stepped(shard_master_weights=True)
    model[0].weight.data = model[0].weight.data.t().contiguous().t()
    backward(model, opt)
    return model, opt


def backward(model, opt, loss_id=0):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with distamp.scale_loss(model(x).float().pow(2).mean(), opt, loss_id=loss_id) as scaled:
        scaled.backward()


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.copy(value)


def snapshot(model, opt):
    return {
        "model class": type(model),
        "model": _clone(model.state_dict()),
        "dtypes": [p.dtype for p in model.parameters()],
        "grads": [_clone(p.grad) for p in model.parameters()],
        "optimizer class": type(opt),
        "param ids": [[id(p) for p in g["params"]] for g in opt.param_groups],
        "optimizer": _clone(opt.state_dict()),
        "stats": _stats(opt),
    }


def _stats(opt):
    try:
        s = distamp.stats(opt)
    except TypeError:
        return None
    return (s.steps, s.skipped_steps, s.loss_scales, s.master_bytes)


def _save(tmp, model, opt, **kwargs):
    distamp.save_checkpoint(tmp / "ckpt", model, opt, **kwargs)
    return str(tmp / "ckpt")


def _other_shape_checkpoint(tmp):
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 9), nn.LayerNorm(9), nn.Linear(9, 2))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other, other_opt = distamp.wrap(other, other_opt, opt_level="O2", verbosity=0)
    return _save(tmp, other, other_opt)


def _O1_checkpoint(tmp):
    model, opt = wrapped(opt_level="O1")
    return _save(tmp, model, opt)


def _with_backward(made):
    model, opt = made
    backward(model, opt)
    return model, opt


def _frozen_last_layer():
    """O2, the last layer frozen and left out of the optimizer (progressive unfreezing)."""
    model = net()
    model[2].requires_grad_(False)
    opt = torch.optim.SGD([*model[0].parameters(), *model[1].parameters()], lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    model[2].requires_grad_(True)
    return model, opt


def _muon():
    model = net()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    return model, torch.optim.Muon(matrices, lr=0.02)


def _compiled():
    model = torch.compile(net(), backend="eager")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _built_before_to_empty():
    with torch.device("meta"):
        model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model, opt


def _with_a_view_parameter():
    model = net()
    model.view = nn.Parameter(model[0].weight.data[:2])  # shares the weight's storage
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _half(model, opt):
    return model.half(), opt


class Unwrappable(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))
        self.index = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)


# (name, make the objects, the misuse, exception, what the message must say)
def _data_parallel(module):
    """``nn.DataParallel(module)``, the module left on the CPU: where a GPU exists DataParallel
    moves it to cuda:0 itself (not distamp's doing; the check below compares values)."""
    wrapped = nn.DataParallel(module)
    module.cpu()
    return wrapped


MATRIX = [
    # -- wrap: wrong values and types
    (
        "O2 with an optimizer that steps its own list of parameters",
        caching,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2"),
        ValueError,
        r"keeps model parameter '0\.weight' in '_params' besides its param_groups.*nothing would "
        r"train",
    ),
    (
        "a sharded half weight re-laid out after wrap",
        relaid,
        lambda m, o, t: o.step(),
        ValueError,
        r"'0\.weight'.*no longer a view of the flat buffer.*before distamp\.wrap",
    ),
    (
        "opt_level '01'",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="01"),
        ValueError,
        r"did you mean 'O1'",
    ),
    (
        "opt_level not a string",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level=2),
        (TypeError, ValueError),
        r"opt_level",
    ),
    (
        "model not a Module",
        plain,
        lambda m, o, t: distamp.wrap("model", o),
        TypeError,
        r"models: expected a torch\.nn\.Module",
    ),
    (
        "optimizer not an Optimizer",
        plain,
        lambda m, o, t: distamp.wrap(m, [o, "adam"]),
        TypeError,
        r"optimizers\[1\]: expected a Optimizer|optimizers\[1\]",
    ),
    (
        "half parameters",
        lambda: _half(*plain()),
        lambda m, o, t: distamp.wrap(m, o),
        ValueError,
        r"parameter '0\.weight' has dtype torch\.float16, expected torch\.float32",
    ),
    (
        "foreign parameter in the optimizer",
        plain,
        lambda m, o, t: distamp.wrap(m, torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=1)),
        ValueError,
        r"is not a parameter of the model",
    ),
    (
        "a parameter twice in one param group",
        plain,
        lambda m, o, t: distamp.wrap(
            m, torch.optim.SGD([*m.parameters(), m[0].weight], lr=0.1), opt_level="O1"
        ),
        ValueError,
        r"parameter '0\.weight' appears twice, at param_groups\[0\]\['params'\]\[0\] and "
        r"param_groups\[0\]\['params'\]\[\d+\]",
    ),
    (
        "an optimizer built before model.to_empty",
        lambda: _built_before_to_empty(),
        lambda m, o, t: distamp.wrap(m, o),
        ValueError,
        r"is on the meta device and not a parameter of the model.*create the optimizer after",
    ),
    (
        "a parameter a view of another's storage, at O2",
        lambda: _with_a_view_parameter(),
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2"),
        ValueError,
        r"parameters '(view|0\.weight)' and '(view|0\.weight)' overlap in one storage .* "
        r"opt_level 'O2'",
    ),
    (
        "model under DataParallel",
        plain,
        lambda m, o, t: distamp.wrap(_data_parallel(m), o),
        ValueError,
        r"must be called before DistributedDataParallel/DataParallel/FSDP",
    ),
    (
        "negative loss scale",
        plain,
        lambda m, o, t: distamp.wrap(m, o, loss_scale=-1.0),
        ValueError,
        r"loss_scale",
    ),
    (
        "non-finite static loss scale",
        plain,
        lambda m, o, t: distamp.wrap(m, o, loss_scale=float("inf")),
        ValueError,
        r"loss_scale",
    ),
    (
        "loss scale string",
        plain,
        lambda m, o, t: distamp.wrap(m, o, loss_scale="dynamik"),
        ValueError,
        r"loss_scale",
    ),
    (
        "min_loss_scale > max_loss_scale",
        plain,
        lambda m, o, t: distamp.wrap(m, o, min_loss_scale=2.0**20, max_loss_scale=2.0**10),
        ValueError,
        r"min_loss_scale",
    ),
    (
        "num_losses 0",
        plain,
        lambda m, o, t: distamp.wrap(m, o, num_losses=0),
        ValueError,
        r"num_losses",
    ),
    (
        "half_dtype float32",
        plain,
        lambda m, o, t: distamp.wrap(m, o, half_dtype=torch.float32),
        ValueError,
        r"half_dtype",
    ),
    (
        "O1 + master_weights",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O1", master_weights=True),
        ValueError,
        r"O1.*master_weights|master_weights.*O1",
    ),
    (
        "O1 + keep_batchnorm_fp32",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O1", keep_batchnorm_fp32=True),
        ValueError,
        r"keep_batchnorm_fp32",
    ),
    (
        "O2 + patch_torch_functions",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2", patch_torch_functions=True),
        ValueError,
        r"patch_torch_functions",
    ),
    (
        "O1 + half cast_model_type",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O1", cast_model_type=torch.bfloat16),
        ValueError,
        r"cast_model_type",
    ),
    (
        "empty model",
        plain,
        lambda m, o, t: distamp.wrap(nn.Sequential(), o),
        ValueError,
        r"has no floating-point parameters",
    ),
    (
        "no floating parameters",
        plain,
        lambda m, o, t: distamp.wrap(Unwrappable(), None),
        ValueError,
        r"has no floating-point parameters",
    ),
    # -- wrap twice, wrong order
    (
        "model wrapped twice",
        wrapped,
        lambda m, o, t: distamp.wrap(m, None),
        ValueError,
        r"already wrapped",
    ),
    (
        "optimizer wrapped twice",
        wrapped,
        lambda m, o, t: distamp.wrap(net(), o),
        ValueError,
        r"already wrapped|not a parameter",
    ),
    # -- the step protocol
    (
        "step before any backward",
        wrapped,
        lambda m, o, t: o.step(),
        RuntimeError,
        r"no gradients were produced since the last step",
    ),
    (
        "step with a closure that runs no backward, on the gradients stepped already",
        stepped,
        lambda m, o, t: o.step(lambda: 0.0),
        RuntimeError,
        r"second step|no gradients were produced",
    ),
    (
        "clip_grad_norm_ before backward",
        stepped,
        lambda m, o, t: distamp.clip_grad_norm_(o, 1.0),
        RuntimeError,
        r"no distamp\.scale_loss",
    ),
    (
        "scale_loss with a loss that is not a tensor",
        stepped,
        lambda m, o, t: distamp.scale_loss(1.0, o).__enter__(),
        TypeError,
        r"expected the loss",
    ),
    (
        "scale_loss with an unwrapped optimizer",
        stepped,
        lambda m, o, t: distamp.scale_loss(
            torch.ones(()), torch.optim.SGD(net().parameters(), lr=1)
        ).__enter__(),
        TypeError,
        r"was not returned by distamp\.wrap",
    ),
    (
        "loss_id 2 with num_losses=2",
        lambda: stepped(num_losses=2),
        lambda m, o, t: distamp.scale_loss(torch.ones(()), o, loss_id=2).__enter__(),
        ValueError,
        r"loss_id must be in \[0, num_losses=2\), got 2",
    ),
    (
        "stats of an unwrapped optimizer",
        stepped,
        lambda m, o, t: distamp.stats(torch.optim.SGD(net().parameters(), lr=1)),
        TypeError,
        r"was not returned by distamp\.wrap",
    ),
    (
        "optimizer.load_state_dict without distamp's entry",
        stepped,
        lambda m, o, t: o.load_state_dict(torch.optim.SGD(net().parameters(), lr=1).state_dict()),
        ValueError,
        r"expected a state dict saved from a distamp-wrapped optimizer",
    ),
    (
        "hooks.register on a model that is not DDP",
        stepped,
        lambda m, o, t: distamp.hooks.register(m, o),
        (TypeError, ValueError),
        r"DistributedDataParallel",
    ),
    # -- checkpoints
    (
        "load a checkpoint of a model of another shape",
        stepped,
        lambda m, o, t: distamp.load_checkpoint(_other_shape_checkpoint(t), m, o),
        CheckpointError,
        r"'0\.weight' has shape \(9, 4\) in the checkpoint, \(8, 4\) in this model",
    ),
    (
        "load a checkpoint of another opt_level",
        stepped,
        lambda m, o, t: distamp.load_checkpoint(_O1_checkpoint(t), m, o),
        CheckpointError,
        r"saved with opt_level='O1', this run has opt_level='O2'",
    ),
    (
        "load a directory that is not a checkpoint",
        stepped,
        lambda m, o, t: distamp.load_checkpoint(t, m, o),
        CheckpointError,
        r"found no COMMIT file",
    ),
    (
        "save with extra that is not plain data",
        stepped,
        lambda m, o, t: distamp.save_checkpoint(t / "c", m, o, extra={"model": m}),
        CheckpointError,
        r"extra\['model'\]: expected plain data",
    ),
    (
        "save with an unwrapped optimizer",
        stepped,
        lambda m, o, t: distamp.save_checkpoint(t / "c", m, torch.optim.SGD(m.parameters(), lr=1)),
        CheckpointError,
        r"was not returned by distamp\.wrap",
    ),
    (
        "load_checkpoint(None) when latest_checkpoint found none",
        stepped,
        lambda m, o, t: distamp.load_checkpoint(distamp.latest_checkpoint(t), m, o),
        CheckpointError,
        r"got None \(latest_checkpoint\(root\) returns None",
    ),
    (
        "wrap with enabled given as a word other than True/False",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2", enabled="no"),
        ValueError,
        r"enabled: expected True or False.*got 'no'",
    ),
    (
        "wrap with a process_group that is not a ProcessGroup",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2", process_group="world"),
        TypeError,
        r"process_group: expected a torch\.distributed ProcessGroup.*got str 'world'",
    ),
    (
        "wrap with a backend object built by hand for a process_group",
        plain,
        lambda m, o, t: distamp.wrap(
            m,
            o,
            opt_level="O2",
            process_group=dist.ProcessGroupGloo(dist.FileStore(os.path.join(t, "store"), 1), 0, 1),
        ),
        TypeError,
        r"got ProcessGroupGloo .*\(a backend object: .*init_process_group and dist\.new_group",
    ),
    (
        "wrap with num_losses=True",
        plain,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2", num_losses=True),
        ValueError,
        r"num_losses: expected an int >= 1, got True",
    ),
    (
        "clip_grad_norm_ with max_norm as a string",
        lambda: _with_backward(stepped()),
        lambda m, o, t: distamp.clip_grad_norm_(o, "1"),
        ValueError,
        r"max_norm: expected a non-negative number, got '1'",
    ),
    (
        "add_param_group with (name, tensor) pairs into an optimizer without names",
        lambda: _frozen_last_layer(),
        lambda m, o, t: o.add_param_group({"params": [("2.weight", m[2].weight)]}),
        ValueError,
        r"expected a param group without parameter names.*found one with",
    ),
    (
        "shard_master_weights=True with Muon (whole 2-D matrices)",
        _muon,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O2", shard_master_weights=True),
        ValueError,
        r"shard_master_weights=True with Muon, which orthogonalizes each 2-D weight matrix",
    ),
    (
        "wrap a torch.compile'd model",
        _compiled,
        lambda m, o, t: distamp.wrap(m, o, opt_level="O1"),
        ValueError,
        r"torch\.compile'd module \(OptimizedModule\); distamp\.wrap must come before",
    ),
    # -- FSDP
    (
        "fsdp.fully_shard without a process group",
        plain,
        lambda m, o, t: distamp.fsdp.fully_shard(m, o),
        RuntimeError,
        r"initialized process group",
    ),
    (
        "fsdp.fully_shard with an unknown api",
        plain,
        lambda m, o, t: distamp.fsdp.fully_shard(m, o, api="fsdp3"),
        ValueError,
        r"'fsdp2' or 'fsdp1'",
    ),
]


def test_the_matrix_covers_at_least_25_misuses():
    assert len(MATRIX) >= 25
    assert len({name for name, *_ in MATRIX}) == len(MATRIX)


@pytest.mark.parametrize("name,make,misuse,exc,pattern", MATRIX, ids=[m[0] for m in MATRIX])
def test_misuse_raises_names_the_problem_and_loses_nothing(
    tmp_path, name, make, misuse, exc, pattern
):
    model, opt = make()
    before = snapshot(model, opt)
    with pytest.raises(exc) as info:
        misuse(model, opt, tmp_path)
    assert re.search(pattern, str(info.value)), f"{name}: {info.value}"
    same(snapshot(model, opt), before, name)


def test_disjoint_views_of_one_buffer_are_not_refused():
    """Parameters laid out in one flat buffer (an RNN's flattened weights on CUDA, a contiguous
    parameter buffer) share a storage but no element: wrap takes them at O2."""
    model = net()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    at = 0
    for module in model:
        for name, p in list(module.named_parameters()):
            setattr(module, name, nn.Parameter(flat[at : at + p.numel()].view_as(p)))
            at += p.numel()
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    with distamp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    # A fused weight's columns (strided views whose byte ranges interleave): no element shared,
    # taken (a review: refused as overlapping); columns that do share elements are refused.
    for cut, refused in (
        ((slice(0, 8), slice(8, 16)), False),
        ((slice(0, 10), slice(6, 16)), True),
    ):
        fused, model = torch.randn(8, 16), nn.Module()
        model.q, model.k = (nn.Parameter(fused[:, c]) for c in cut)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if refused:
            with pytest.raises(ValueError, match=r"'q' and 'k' overlap in one storage"):
                distamp.wrap(model, opt, opt_level="O2")
        else:
            distamp.wrap(model, opt, opt_level="O2")


def test_unscale_twice_is_refused_and_loses_nothing():
    model, opt = stepped()
    backward(model, opt)
    distamp.unscale_(opt)
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        distamp.unscale_(opt)
    same(snapshot(model, opt), before, "unscale_ twice")
    opt.step()  # the pending step still goes through
    assert distamp.stats(opt).steps == 2


def test_scale_loss_after_unscale_is_refused_and_loses_nothing():
    model, opt = stepped()
    backward(model, opt)
    distamp.unscale_(opt)
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) .* was already called"):
        backward(model, opt)
    same(snapshot(model, opt), before, "scale_loss after unscale_")


def test_a_refused_add_param_group_can_be_retried():
    """torch's own add_param_group runs after distamp's masters took the parameters: a group it
    refused left them "already held", and the corrected retry was refused too (an audit)."""
    model, opt = _frozen_last_layer()
    with pytest.raises(ValueError, match="without parameter names"):
        opt.add_param_group({"params": [("2.weight", model[2].weight)]})
    with pytest.warns(UserWarning, match="start from their half weights"):
        opt.add_param_group({"params": [model[2].weight, model[2].bias]})
    before = model[2].weight.detach().clone()
    backward(model, opt)
    opt.step()
    assert not torch.equal(model[2].weight, before)  # the retried group trains


def test_wrap_enabled_reads_flags_as_apex_configs_write_them():
    """``enabled="False"`` (a flag read from a config file) used to turn mixed precision on."""
    for off in (False, "False", "false", 0):
        model, opt = plain()
        out_model, _ = distamp.wrap(model, opt, opt_level="O2", enabled=off)
        assert out_model[0].weight.dtype == torch.float32, off
    model, opt = plain()
    out_model, _ = distamp.wrap(model, opt, opt_level="O2", enabled="True", verbosity=0)
    assert out_model[0].weight.dtype == torch.bfloat16


def test_backward_on_the_unscaled_loss_inside_scale_loss_warns():
    """apex users' slip: ``loss.backward()`` inside the block; step() then divides unscaled
    gradients by the loss scale (updates 65536x too small), silently until now."""
    model, opt = wrapped(opt_level="O1")
    x = torch.randn(3, 4)
    loss = model(x).float().pow(2).mean()
    with pytest.warns(UserWarning, match="not through the scaled loss"):
        with distamp.scale_loss(loss, opt):
            loss.backward()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right way warns nothing
        with distamp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            (scaled / 2).backward()


def test_bad_scaler_state_dicts_are_refused_before_anything_is_loaded():
    """GradScaler.load_state_dict set the scale, then raised a bare int() error on a bad
    growth_interval, and loaded factors its constructor refuses; amp.load_state_dict loaded
    loss_scaler0 before refusing loss_scaler1 (an audit)."""
    scaler = distamp.GradScaler("cpu", init_scale=8.0)
    for bad, message in (
        ({"scale": 1024.0, "_growth_tracker": 5, "growth_interval": "x"}, "growth_interval"),
        ({"scale": 1024.0, "_growth_tracker": "abc"}, "_growth_tracker"),
        ({"scale": 1024.0, "_growth_tracker": 0, "growth_factor": 0.5}, "growth_factor"),
        ({"scale": 1024.0, "_growth_tracker": 0, "backoff_factor": 4.0}, "backoff_factor"),
    ):
        with pytest.raises(ValueError, match=message):
            scaler.load_state_dict(bad)
        assert scaler.get_scale() == 8.0 and scaler.state_dict()["_growth_tracker"] == 0
    from distamp import amp

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O1", num_losses=2, verbosity=0)
    before = amp.state_dict()
    for bad in (
        {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}, "loss_scaler1": {"unskipped": 1}},
        {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}, "loss_scaler1": {"loss_scale": -1}},
        {
            "loss_scaler0": {"loss_scale": 8.0, "unskipped": "x"},
            "loss_scaler1": before["loss_scaler1"],
        },
    ):
        with pytest.raises(ValueError, match="amp.load_state_dict: loss_scaler"):
            amp.load_state_dict(bad)
        assert amp.state_dict() == before


def test_add_param_group_with_names_of_another_length_changes_nothing():
    """The masters took the parameters before torch's zip() of names failed: the corrected retry
    was refused as "already held by this optimizer" (an audit)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model[0].named_parameters(), lr=0.1)  # torch's named optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # model[1] is held by no optimizer yet: named, expected
        model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    new = list(model[1].parameters())
    with pytest.raises(ValueError, match="found 1 names for 2 parameters"):
        opt.add_param_group({"params": new, "param_names": ["1.weight"]})
    opt.add_param_group({"params": new, "param_names": ["1.weight", "1.bias"]})  # corrected
    assert len(opt.param_groups) == 2


def test_clip_grad_norm_takes_torchs_norm_types_and_refuses_others_before_unscaling():
    model = nn.Linear(2, 2)
    model, opt = distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0)
    with distamp.scale_loss(model(torch.ones(1, 2)).float().sum(), opt) as scaled:
        scaled.backward()
    with pytest.raises(ValueError, match="norm_type: expected a number or 'inf', got None"):
        distamp.clip_grad_norm_(opt, 1.0, norm_type=None)
    grad = model.weight.grad.clone()  # still scaled: nothing was unscaled by the refusal
    assert grad.abs().max() > 1000
    total = distamp.clip_grad_norm_(opt, 1e9, norm_type="inf")
    assert float(total) == float((grad / distamp.stats(opt).loss_scales[0]).abs().max())


def test_latest_checkpoint_given_a_checkpoint_returns_it_with_a_warning(tmp_path):
    """None sent the resume recipe training from scratch, silently (an audit)."""
    model, opt = stepped()
    distamp.save_checkpoint(tmp_path / "step_1", model, opt)
    with pytest.warns(UserWarning, match="is a checkpoint itself"):
        assert distamp.latest_checkpoint(tmp_path / "step_1") == str(tmp_path / "step_1")
    assert distamp.latest_checkpoint(tmp_path) == str(tmp_path / "step_1")
    with pytest.raises(TypeError, match="latest_checkpoint: root"):
        distamp.latest_checkpoint(3)


def test_arguments_of_the_wrong_type_are_named_by_the_function_that_takes_them(tmp_path):
    """Bare errors from pathlib and comparisons named neither function nor argument (an
    audit)."""
    model, opt = stepped()
    with pytest.raises(TypeError, match="save_checkpoint: directory: expected a str or path"):
        distamp.save_checkpoint(3, model, opt)
    with pytest.raises(TypeError, match="load_checkpoint: directory: expected a str or path"):
        distamp.load_checkpoint(3, model, opt)
    for kwargs, name in (
        ({"growth_factor": "2"}, "growth_factor"),
        ({"backoff_factor": "0.5"}, "backoff_factor"),
        ({"max_scale": "x"}, "max_scale"),
        ({"process_group": "x"}, "process_group"),
    ):
        with pytest.raises(TypeError, match=f"GradScaler: {name}: expected"):
            distamp.GradScaler("cpu", **kwargs)
    distamp.GradScaler("cpu", enabled=False, growth_factor="2")  # unchecked when off, as torch


def test_blocks_of_one_wrap_call_open_in_two_threads_at_once_are_refused():
    """Two models of one wrap call trained concurrently in two threads: one thread's backward
    was taken as the other's block reaching its optimizer, and a step was refused at random
    ("a block of loss_id=0 ... that did not list it", an audit). Now the second block to open
    while another thread's is open is refused, naming the cause; one wrap call per thread works."""
    import threading

    models = [net(), net()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = distamp.wrap(models, opts, opt_level="O1", num_losses=2, verbosity=0)
    opened, closing, refused = threading.Event(), threading.Event(), []

    def other_thread():
        with distamp.scale_loss(models[1](torch.randn(3, 4)).sum(), opts[1], loss_id=1) as s:
            opened.set()
            closing.wait(30)
            s.backward()
        opts[1].step()

    worker = threading.Thread(target=other_thread)
    worker.start()
    opened.wait(30)
    before = [p.detach().clone() for p in models[0].parameters()]
    with pytest.raises(RuntimeError, match=r"one at a time, found a block open in another thread"):
        with distamp.scale_loss(models[0](torch.randn(3, 4)).sum(), opts[0], loss_id=0):
            refused.append("entered")
    closing.set()
    worker.join(30)
    assert not refused and distamp.stats(opts[1]).steps == 1
    # nothing of this thread's was touched: its block opens and steps once the other closed
    with distamp.scale_loss(models[0](torch.randn(3, 4)).sum(), opts[0], loss_id=0) as s:
        s.backward()
    opts[0].step()
    assert distamp.stats(opts[0]).steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, models[0].parameters(), strict=True))


def test_a_block_closed_in_another_thread_is_recorded_and_counts_nothing_left_open():
    """A scale_loss block closed in another thread than it opened (a generator-driven train step
    closed from a worker): its close raised a KeyError, the step took gradients still at the
    loss scale (an update 65536 times too large), and every later block in another thread was
    refused (an audit)."""
    from concurrent.futures import ThreadPoolExecutor

    model, opt = distamp.wrap(
        *plain(), opt_level="O1", half_dtype=torch.float16, loss_scale=128.0, verbosity=0
    )
    reference = plain()[0]
    x = torch.randn(3, 4)
    block = distamp.scale_loss(model(x).float().sum(), opt)
    block.__enter__().backward()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(block.__exit__, None, None, None).result()
    opt.step()
    reference.zero_grad()
    reference(x).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9).step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)  # an O1 fp16 step
    opt.zero_grad()

    def another_step():
        with distamp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(another_step).result()  # nothing left counted open in the first thread
    assert distamp.stats(opt).steps == 2


@pytest.mark.parametrize("calls", ["one wrap call", "two wrap calls"])
def test_a_block_over_another_blocks_scaled_loss_is_refused(calls):
    """Nested blocks (an encoder's block around its head's): the inner scaled the outer's
    scaled loss again, an update 65536 times too large, silently (an audit)."""
    enc, head = net(), nn.Linear(2, 2)
    opt_e, opt_h = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (enc, head))
    if calls == "one wrap call":
        (enc, head), (opt_e, opt_h) = distamp.wrap(
            [enc, head], [opt_e, opt_h], opt_level="O1", num_losses=2, verbosity=0
        )
    else:
        enc, opt_e = distamp.wrap(enc, opt_e, opt_level="O1", verbosity=0)
        head, opt_h = distamp.wrap(head, opt_h, opt_level="O1", num_losses=2, verbosity=0)
    loss = head(enc(torch.randn(3, 4))).float().sum()
    with distamp.scale_loss(loss, opt_e) as outer:
        with pytest.raises(ValueError, match="found the scaled loss another scale_loss block"):
            with distamp.scale_loss(outer, opt_h, loss_id=1):
                pass
    # ... and one block listing both is the way (one call), its gradients unscaled at step.
    if calls == "one wrap call":
        opt_e.zero_grad()
        with distamp.scale_loss(loss, [opt_e, opt_h]) as scaled:
            scaled.backward()
        assert head.weight.grad.abs().max() > 1000  # still scaled until step()
