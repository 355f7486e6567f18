"""The non-finite kernels: one fused pass that checks gradients for inf/NaN (and unscales them).

Every path that decides a skip (wrap's masters, FSDP, ``distamp.GradScaler``) checks through
:func:`check_and_unscale_`, so what counts as "non-finite" and how sparse or half gradients are
read is decided here once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch


def nonfinite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A float32 tensor holding 1.0 if any of ``tensors`` holds inf/NaN, else 0.0 (no host sync).

    Uses the fused check-and-unscale kernel with a factor of exactly 1.0: it rewrites each value
    with itself, and is 15x faster on CPU than the read-only max-abs norm (measured on 20M bf16
    values: 3.6 ms vs 58 ms); the L2 norm would be as fast but overflows on large finite values.
    """
    return check_and_unscale_(list(tensors), 1.0, device)


def nonfinite_each(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """A float32 vector on ``device``: 1.0 where that tensor holds inf/NaN (None: 0.0), no host
    sync. One check per tensor: what tells which blocks of several losses made which values
    non-finite (see ``ScalerGroup.finish_backward``)."""
    flags = [
        torch.zeros((), device=device) if t is None else check_and_unscale_([t], 1.0, device)[0]
        for t in tensors
    ]
    return torch.stack(flags) if flags else torch.zeros(0, device=device)


def check_and_unscale_(
    grads: list[torch.Tensor], inv_scale: float, device: torch.device
) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; a float32 flag on ``device``: any inf/NaN?

    Complex gradients are read as their real view (an audit: a complex parameter made every
    step raise, O0 included). Sparse COO gradients (``nn.Embedding(sparse=True)``) are read
    through their values, as torch's GradScaler does; an uncoalesced FP16 one is also checked coalesced, because summing the
    duplicate indices of scaled FP16 values is where such a gradient overflows.
    """
    dense: list[torch.Tensor] = []
    coalesced_copies: list[torch.Tensor] = []
    for grad in grads:
        if grad.is_sparse:
            if grad.dtype == torch.float16 and not grad.is_coalesced():
                coalesced_copies.append(grad.coalesce()._values())
            dense.append(grad._values())
        elif grad.is_complex():  # its real and imaginary parts (the kernel takes real dtypes)
            dense.append(torch.view_as_real(grad))
        else:
            dense.append(grad)
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for tensors, factor in ((dense, inv_scale), (coalesced_copies, 1.0)):
        for (dev, _), group in by_device_and_dtype(tensors).items():
            # 0-d, as torch's GradScaler makes them: (1,)-shaped ones beside DTensor gradients
            # (torch's FSDP2) made DTensor warn of an implicit replication (an audit)
            found = torch.zeros((), dtype=torch.float32, device=dev)
            inv = torch.full((), factor, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
            flag = torch.maximum(flag, found.to(device))
    return flag


def by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        out[(tensor.device, tensor.dtype)].append(tensor)
    return out
