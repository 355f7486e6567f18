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
    on_every_rank: bool = False
    """Every rank of the group held it non-finite: after DDP's all-reduce every rank holds the
    reduced gradient, so the rank it came from cannot be told (distamp's reduce-scatter hook keeps
    each rank's own gradient, which can)."""
    kind: str
    """"nan" if the gradient held a NaN, else "inf"."""
    loss_id: int | None = None
    """Set when the *loss itself* was non-finite (then ``param`` names the loss): not an overflow
    of the scaled gradients, so a smaller loss scale does not fix it."""

    def __str__(self) -> str:
        article = "an inf" if self.kind == "inf" else "a NaN"
        if self.loss_id is not None:
            return (
                f"the loss itself (loss_id {self.loss_id}) was {article} on rank {self.rank} — "
                "not a gradient overflow: a smaller loss scale does not fix it"
            )
        if self.on_every_rank:
            return (
                f"parameter {self.param!r} had {article} gradient on every rank (after the "
                "gradients' all-reduce every rank holds it: the rank it came from is not known)"
            )
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
    holders = table[:, 0] == best
    first_rank = int(holders.nonzero()[0, 0])
    return NonFiniteReport(
        param=named_grads[best][0],
        rank=first_rank,
        kind="nan" if int(table[first_rank, 1]) == 2 else "inf",
        on_every_rank=world > 1 and bool(holders.all()),
    )


def locate_nonfinite_loss(
    flags: Sequence[tuple[int, torch.Tensor]], group: dist.ProcessGroup | None
) -> NonFiniteReport | None:
    """Collective over ``group``: was a loss itself non-finite on some rank (lowest rank wins)?

    ``flags``: (loss_id, 0-d tensor 0 finite / 1 inf / 2 NaN) for the overflowed blocks of this
    step, the same list on every rank. Called only on skipped steps.
    """
    rank, world = 0, 1
    if group is not None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    table = torch.zeros(world, max(1, len(flags)), dtype=torch.int64)
    for j, (_, flag) in enumerate(flags):
        table[rank, j] = int(flag.item())
    all_reduce_(table, dist.ReduceOp.SUM, group)
    for r in range(world):
        for j, (loss_id, _) in enumerate(flags):
            kind = int(table[r, j])
            if kind:
                return NonFiniteReport(
                    param=f"loss {loss_id}",
                    rank=r,
                    kind="nan" if kind == 2 else "inf",
                    loss_id=loss_id,
                )
    return None
