"""``find_nonfinite``: which module's forward first produced an inf/NaN (a debugging aid)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class NonFiniteModule:
    """The first module, in execution order, whose forward output held inf/NaN."""

    name: str
    """Qualified name of the module ("" for the model itself)."""
    type: str
    """Its class name."""
    kind: str
    """"nan" if an output held a NaN, else "inf"."""
    inputs_finite: bool
    """Whether all of its floating-point inputs were finite (False: the problem came from upstream
    or from the data)."""

    def __str__(self) -> str:
        where = f"module {self.name!r}" if self.name else "the model"
        source = "from finite inputs" if self.inputs_finite else "from inputs already non-finite"
        return f"{where} ({self.type}) produced {self.kind} {source}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _kind(tensors: list[torch.Tensor]) -> str | None:
    for t in tensors:
        if bool(torch.isnan(t).any()):
            return "nan"
    for t in tensors:
        if bool(torch.isinf(t).any()):
            return "inf"
    return None


def find_nonfinite(model: nn.Module, *args: Any, **kwargs: Any) -> NonFiniteModule | None:
    """Run one forward of ``model(*args, **kwargs)`` without gradients and return the first module
    whose output held inf/NaN, or None when every output was finite.

    Forward hooks are registered on every submodule for this call only and removed afterwards;
    buffers (BatchNorm statistics) and the random number generators are restored, so neither the
    model nor the run's later random draws are changed. Slow (one host sync per module): use it when a step was skipped and
    ``distamp.stats(optimizer).last_nonfinite`` does not tell enough.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_nonfinite: expected an nn.Module, got {type(model).__name__}")
    found: list[NonFiniteModule] = []
    names = {id(m): n for n, m in model.named_modules()}

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        if found:
            return
        kind = _kind(_tensors(output))
        if kind is not None:
            found.append(
                NonFiniteModule(
                    name=names.get(id(module), "?"),
                    type=type(module).__name__,
                    kind=kind,
                    inputs_finite=_kind(_tensors(inputs)) is None,
                )
            )

    # Post-order: a leaf's hook fires before its parent's, so the first report is the innermost.
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # BatchNorm statistics
    # Dropout draws from the RNGs: forked, so that the run's later masks are the ones it would
    # have drawn without this call (an audit: a call mid-run broke a bit-exact reproduction).
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    return found[0] if found else None
