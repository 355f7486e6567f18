"""Gradient clipping by a global norm, written once for every kind of masters.

Replicated masters, sharded masters and FSDP's shards differ only in *which* gradients a rank holds
and over which process groups their partial norms are summed; the arithmetic (FP32 accumulation, the
``max_norm / (total + 1e-6)`` coefficient capped at 1, inf-norm as a max) lives here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def norm_operands(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` as tensors a norm kernel takes: a sparse gradient (``nn.Embedding(sparse=True)``)
    as its coalesced values — duplicate indices summed first — since torch's norms have no
    sparse kernel (an audit: clip_grad_norm_ failed inside torch with replicated masters)."""
    return [g.coalesce().values() if g.is_sparse else g for g in grads]


def norm_part(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """This rank's contribution to the norm of ``grads``: a (1,) FP32 tensor holding the largest
    norm (inf-norm) or the sum of ``norm ** norm_type`` (reduce it with MAX or SUM)."""
    # Empty operands (FSDP's shard of a parameter smaller than the world: a 1-element gain) add
    # nothing; torch has no inf-norm of an empty tensor, and the rank raised while its peers
    # waited in the MAX all-reduce (an audit). 0 is the identity of both reductions.
    operands = [g for g in norm_operands(grads) if g.numel()]
    if not operands:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in operands])
    part = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    return part.reshape(1).to(device)


def total_norm(parts: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm from reduced :func:`norm_part` values (one or several, e.g. one per mesh group)."""
    if math.isinf(norm_type):
        return parts.max()
    return parts.sum().pow(1.0 / norm_type)


def scale_to_max_norm_(
    grads: Sequence[torch.Tensor], total: torch.Tensor, max_norm: float
) -> torch.Tensor:
    """Multiply ``grads`` in place so their norm ``total`` becomes at most ``max_norm``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            if g.is_sparse:  # no sparse _foreach kernel
                g.mul_(coef.to(g.device))
            else:
                by_device.setdefault(g.device, []).append(g)
        for device, same in by_device.items():
            torch._foreach_mul_(same, coef.to(device))
    return coef
