"""Tiny models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class NormMLP(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear -> LayerNorm -> Linear: one of each norm kind."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        return self.head(self.ln(self.fc2(h)))


def mlp(d_in: int = 8, hidden: int = 16, d_out: int = 4, seed: int = 0) -> nn.Module:
    """A plain MLP with a LayerNorm, deterministic weights for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, d_out)
    )


def data(steps: int, batch: int, d_in: int = 8, d_out: int = 4, seed: int = 1):
    """``steps`` (x, y) regression batches from a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, d_out, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, d_in, generator=gen)
        out.append((x, x @ teacher + 0.1 * torch.randn(batch, d_out, generator=gen)))
    return out


class GradProbe(nn.Module):
    """loss = (w * g).sum(): the gradient of w is exactly g, whatever g a rank chooses."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.w * g).sum()


class FrameworkOptimizer(torch.optim.Optimizer):
    """accelerate's AcceleratedOptimizer (apex's LARC alike), as it holds the optimizer it is
    given: an Optimizer subclass with the wrapped one as ``optimizer``, its param_groups and
    state forwarded, nothing else (no ``_step_supports_amp_scaling``)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)
