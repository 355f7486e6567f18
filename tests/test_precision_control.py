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
