"""Which parameter first held a non-finite gradient, on which rank, inf or NaN — for skipped steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_reduce_


@dataclass(frozen=True, kw_only=True)
class NonFiniteReport:
    """The first non-finite gradient of a skipped step (in parameter order, lowest rank first)."""

    param: str
    """Qualified name of the parameter whose gradient was non-finite."""
    rank: int
    """Lowest rank of the process group on which that gradient was non-finite."""
    kind: str
    """"nan" if the gradient held a NaN, else "inf"."""

    def __str__(self) -> str:
        article = "an inf" if self.kind == "inf" else "a NaN"
        return f"parameter {self.param!r} had {article} gradient on rank {self.rank}"


class NonFiniteGradientError(RuntimeError):
    """Raised instead of skipping forever: too many consecutive skips, or a skip at the floor."""


_NOT_FOUND = 2**62


def locate_nonfinite(
    named_grads: Sequence[tuple[str, torch.Tensor | None]],
    group: dist.ProcessGroup | None,
) -> NonFiniteReport | None:
    """Collective over ``group``: find the first non-finite gradient of ``named_grads`` on any rank.

    Called only on skipped steps (the decision is already identical on every rank, so every rank
    gets here together); costs one pass over the gradients and one small all-reduce.
    """
    index, kind = _NOT_FOUND, 0
    for i, (_, grad) in enumerate(named_grads):
        if grad is None:
            continue
        finite = torch.isfinite(grad)
        if not bool(finite.all()):
            index, kind = i, 2 if bool(torch.isnan(grad).any()) else 1
            break
    rank, world = 0, 1
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    table = torch.zeros(world, 2, dtype=torch.int64)
    table[rank, 0], table[rank, 1] = index, kind
    all_reduce_(table, dist.ReduceOp.SUM, group)
    best = int(table[:, 0].min())
    if best == _NOT_FOUND:
        return None
    first_rank = int((table[:, 0] == best).nonzero()[0, 0])
    return NonFiniteReport(
        param=named_grads[best][0],
        rank=first_rank,
        kind="nan" if int(table[first_rank, 1]) == 2 else "inf",
    )
