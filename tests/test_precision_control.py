"""Per-module precision (keep_fp32_modules, autocast_exclude) and inputs of any shape."""

import collections
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import distamp


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(8, 8)

    def forward(self, x):
        self.seen = (x.dtype, torch.is_autocast_enabled("cpu"))
        return torch.softmax(self.score(x), dim=-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.attn = Attention()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.attn(self.inp(x)))


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("how", ["module", "pattern"])
def test_keep_fp32_modules_under_o2_and_o3(level, how):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = [model.attn] if how == "module" else ["att*"]
    model, opt = distamp.wrap(model, opt, opt_level=level, keep_fp32_modules=keep, verbosity=0)
    assert model.attn.score.weight.dtype == torch.float32
    assert model.inp.weight.dtype == torch.bfloat16 and model.out.weight.dtype == torch.bfloat16
    out = model(torch.randn(3, 4))
    assert model.attn.seen == (torch.float32, False)  # inputs cast up inside the kept module
    assert out.dtype == torch.float32
    with distamp.scale_loss(out.sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # the kept module is its own FP32 master; the others step through masters
    assert distamp.stats(opt).steps == 1


def test_keep_fp32_modules_pattern_that_matches_nothing_is_refused():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'atention' matched no module.*'inp'"):
        distamp.wrap(model, opt, opt_level="O2", keep_fp32_modules=["atention"])
    assert model.inp.weight.dtype == torch.float32  # nothing was cast


def test_keep_fp32_modules_of_another_type_is_refused_by_name():
    """An audit: keep_fp32_modules=3 failed with Python's bare "'int' object is not iterable"."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"keep_fp32_modules: expected a module.*got int \(3\)"):
        distamp.wrap(model, opt, opt_level="O2", keep_fp32_modules=3)
    assert model.inp.weight.dtype == torch.float32


def test_autocast_exclude_under_o1():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O1", verbosity=0)
    model(torch.randn(3, 4))
    assert model.attn.seen == (torch.bfloat16, True)  # autocast's half output of inp
    distamp.autocast_exclude(model.attn)
    model(torch.randn(3, 4))
    assert model.attn.seen == (torch.float32, False)
    half_model, _ = distamp.wrap(Net(), None, opt_level="O2", verbosity=0), None
    with pytest.raises(ValueError, match=r"keep_fp32_modules"):
        distamp.autocast_exclude(half_model.attn)


Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Batch:
    features: torch.Tensor
    ids: torch.Tensor
    name: str


class Movable:
    def __init__(self, t):
        self.t = t

    def to(self, dtype):
        return Movable(self.t.to(dtype))


class Echo(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, *args, **kwargs):
        self.got = (args, kwargs)
        return self.w.sum()


def test_inputs_of_any_shape_are_cast_under_o2():
    model = Echo()
    model = distamp.wrap(model, None, opt_level="O2", verbosity=0)
    array = np.ones(3, dtype=np.float32)
    model(
        {"x": torch.ones(2), "ids": torch.arange(3)},
        [torch.ones(2), (torch.ones(1), "text")],
        Pair(torch.ones(2), torch.arange(2)),
        Batch(torch.ones(2), torch.arange(2), "b"),
        Movable(torch.ones(2)),
        array,
        scale=torch.ones(1),
    )
    (d, lst, pair, batch, movable, arr), kw = model.got
    bf16 = torch.bfloat16
    assert d["x"].dtype == bf16 and d["ids"].dtype == torch.int64
    assert lst[0].dtype == bf16 and lst[1][0].dtype == bf16 and lst[1][1] == "text"
    assert isinstance(pair, Pair) and pair.a.dtype == bf16 and pair.b.dtype == torch.int64
    assert isinstance(batch, Batch) and batch.features.dtype == bf16 and batch.name == "b"
    assert batch.ids.dtype == torch.int64
    assert isinstance(movable, Movable) and movable.t.dtype == bf16
    assert arr is array and kw["scale"].dtype == bf16


class Probe(nn.Linear):
    """A Linear that records the dtype it computes in and whether autocast is on."""

    def forward(self, x):
        self.seen = (x.dtype, self.weight.dtype, torch.is_autocast_enabled("cpu"))
        return super().forward(x)


class Inner(nn.Module):
    """A kept block whose children are also called from outside it (``self.attn.q(x)``), as
    attention modules' parents do."""

    def __init__(self):
        super().__init__()
        self.q = Probe(8, 8)
        self.k = Probe(8, 8)

    def forward(self, x):
        return self.k(self.q(x))


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = Probe(4, 8)
        self.blocks = nn.ModuleList([Probe(8, 8) for _ in range(2)])
        self.attn = Inner()
        self.shared = nn.Sequential(self.attn, Probe(8, 8))  # attn reached by two names
        self.out = Probe(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        h = self.attn.q(h) + self.attn(h)  # a child of a kept module, called from outside it
        return self.out(self.shared(h))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("keep", [["blocks"], ["attn"], ["shared.0"], ["*"]])
def test_every_module_of_a_kept_subtree_runs_in_fp32(level, keep):
    """An audit: only the outermost kept module had the FP32 forward, so a kept ModuleList (never
    called), a kept module's child called from outside and a shared module named by its second
    name crashed O2 ("mat1 and mat2 must have the same dtype") or ran under O1's autocast."""
    x = torch.randn(3, 4)
    expected = Blocks()(x)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, keep_fp32_modules=keep, verbosity=0)
    out = model(x)
    kept = {"blocks": model.blocks, "attn": model.attn, "shared.0": model.attn, "*": model}
    for m in kept[keep[0]].modules():
        if isinstance(m, Probe):
            assert m.seen == (torch.float32, torch.float32, False), (keep, m.seen)
    assert torch.allclose(out.float(), expected, atol=0.05), (out, expected)
    with distamp.scale_loss(out.float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert distamp.stats(opt).steps == 1


def test_autocast_exclude_before_wrap_keeps_the_module_fp32_under_o2():
    """An audit: the module kept its FP32 forward but O2 cast its weights (a crash at the first
    forward); now it counts as kept."""
    model = Net()
    distamp.autocast_exclude(model.attn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    assert model.attn.score.weight.dtype == torch.float32
    assert model.inp.weight.dtype == torch.bfloat16
    out = model(torch.randn(3, 4))
    assert model.attn.seen == (torch.float32, False) and out.dtype == torch.float32


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux_loss: torch.Tensor | None = dataclasses.field(default=None, init=False)


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        out = Output(self.fc(x))
        out.aux_loss = out.logits.pow(2).mean()
        return out


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_an_output_dataclass_keeps_its_fields_set_after_construction(level):
    """An audit: rebuilt with dataclasses.replace, a field declared init=False came back as its
    default (the auxiliary loss was None)."""
    model, _ = distamp.wrap(WithAux(), None, opt_level=level, verbosity=0), None
    out = model(torch.randn(3, 4))
    assert out.aux_loss is not None and out.aux_loss.dtype == torch.float32
    assert out.logits.dtype == torch.float32


class Phase(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.z = nn.Parameter(torch.randn(4, dtype=torch.complex64))
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc((x * self.z).abs().to(x.dtype))


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_complex_parameter_trains_like_fp32(level):
    """An audit: the non-finite check handed complex gradients to a kernel for real dtypes, and
    every step raised, O0 included."""
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    reference = Phase()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    model = Phase()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0)
    with distamp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert model.z.dtype == torch.complex64
    tolerance = 0 if level == "O0" else 0.02
    assert (model.z.detach() - reference.z.detach()).abs().max() <= tolerance
