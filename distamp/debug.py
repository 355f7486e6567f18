"""``find_nonfinite``: which module's forward first produced an inf/NaN (a debugging aid)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .casting import tensors_in


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
    """Whether all of its floating-point inputs were finite (False: the problem came from upstream,
    from the data, or from a tensor of ``nonfinite_tensors``)."""
    nonfinite_tensors: tuple[str, ...] = ()
    """The model's parameters and buffers that held inf/NaN before the forward, by name: a
    parameter a parent's own forward uses directly (ViT's ``pos_embed``, a layer-scale
    ``gamma``) is seen by no module hook, and the first module to output its NaN was named as
    if its inputs came from upstream (an audit)."""

    def __str__(self) -> str:
        where = f"module {self.name!r}" if self.name else "the model"
        source = "from finite inputs" if self.inputs_finite else "from inputs already non-finite"
        held = ""
        if self.nonfinite_tensors:
            names = list(self.nonfinite_tensors[:4])
            more = " and more" if len(self.nonfinite_tensors) > 4 else ""
            held = f"; the model's own tensors held non-finite values before it ran: {names}{more}"
        return f"{where} ({self.type}) produced {self.kind} {source}{held}"


def _tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point (and complex) tensors in ``value``, wherever a model's forward takes
    or returns them (containers, ModelOutput, dataclasses: the input cast's walk)."""
    return [t for t in tensors_in(value) if t.is_floating_point() or t.is_complex()]


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
    ``distamp.stats(optimizer).last_nonfinite`` does not tell enough. A DDP (or DataParallel)
    model runs the module it wraps, so one rank may call it alone; a model FSDP shards gathers
    its weights in forward (a collective): call it on every rank.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_nonfinite: expected an nn.Module, got {type(model).__name__}")
    # DDP's forward broadcasts buffers (a collective): the usual call, on the rank that skipped,
    # aborted the job (an audit). The module it wraps runs alone, and names stay the model's own.
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    found: list[NonFiniteModule] = []
    names = {id(m): n for n, m in model.named_modules()}
    held = tuple(
        name
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if (tensor.is_floating_point() or tensor.is_complex()) and _kind([tensor.detach()])
    )

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if found:
            return
        kind = _kind(_tensors(output))
        if kind is not None:
            found.append(
                NonFiniteModule(
                    name=names.get(id(module), "?"),
                    type=type(module).__name__,
                    kind=kind,
                    # keyword inputs too (an attention mask: an audit said "from finite inputs")
                    inputs_finite=_kind(_tensors((args, kwargs))) is None,
                    nonfinite_tensors=held,
                )
            )

    # Post-order: a leaf's hook fires before its parent's, so the first report is the innermost.
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    saved = _save_buffers(model)
    # Dropout draws from the RNGs: forked, so that the run's later masks are the ones it would
    # have drawn without this call (an audit: a call mid-run broke a bit-exact reproduction).
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        _restore_buffers(saved)
    return found[0] if found else None


_SavedBuffers = list[tuple[nn.Module, dict[str, Any], set[str], dict[str, torch.Tensor]]]


def _save_buffers(model: nn.Module) -> _SavedBuffers:
    """Each module's buffers as they are (the tensors, their values, which are persistent)."""
    return [
        (
            m,
            dict(m._buffers),
            set(m._non_persistent_buffers_set),
            {n: b.detach().clone() for n, b in m._buffers.items() if b is not None},
        )
        for m in model.modules()
    ]


def _restore_buffers(saved: _SavedBuffers) -> None:
    """Put back what :func:`_save_buffers` saw: the values of buffers written in place (BatchNorm
    statistics), and the tensors themselves where a forward registered a buffer anew or
    dropped one (a lazily made cache, a rotary cache grown to the sequence length: an audit
    found a copy_ into the grown one raising, and the model kept its shape)."""
    with torch.no_grad():
        for module, buffers, non_persistent, values in saved:
            for name, tensor in values.items():
                buffers[name].copy_(tensor)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
