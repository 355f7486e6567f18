"""Which parameter first held a non-finite gradient, on which rank, inf or NaN — for skipped steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class NonFiniteReport:
    """The first non-finite gradient of a skipped step, lowest rank first, in the order the
    masters hold the parameters: the optimizer's, except that sharded masters (O2 at several
    ranks) list the cast weights before those kept FP32 (the norms), so one of each non-finite
    in one step names the cast one (an audit)."""

    param: str
    """Qualified name of the parameter whose gradient was non-finite."""
    rank: int
    """Lowest rank (global: ``dist.get_rank()``'s numbering, also under a process_group of
    some ranks) on which that gradient was non-finite."""
    on_every_rank: bool = False
    """Every rank of the group held it non-finite: after DDP's all-reduce every rank holds the
    reduced gradient, so the rank it came from cannot be told (distamp's reduce-scatter hook keeps
    each rank's own gradient, which can)."""
    kind: str
    """"nan" if the gradient held a NaN, else "inf"."""
    loss_id: int | None = None
    """Set when the *loss itself* was non-finite (then ``param`` names the loss): not an overflow
    of the scaled gradients, so a smaller loss scale does not fix it."""
    after_reduce: bool = False
    """Every rank's own gradient of ``param`` was finite; the non-finite values appeared where
    distamp's reduce-scatter hook summed them into the shards: the 16-bit wire overflowed
    (``rank`` is then the lowest rank whose shard holds them)."""
    origin: int | None = None
    """``on_every_rank``: the lowest rank whose *own* gradients (before DDP's all-reduce) held a
    non-finite value, where it was watched: at the steps after a skip whose origin was not known
    (see [Note: watching for the origin after a skip] in scaler.py)."""
    origin_next: bool = False
    """``on_every_rank`` without ``origin``: the next steps watch for it."""
    fp16_wire: bool = False
    """``on_every_rank`` with distamp's all-reduce hook in fp16: the sum may have overflowed on
    the wire (65504) with every rank's own gradient finite; which of the two is not known."""
    after_unscale: bool = False
    """The gradients were finite at ``unscale_`` and non-finite at ``step()``: an edit in between
    (``rank``: the lowest rank whose stepped gradients held it). Skipped on every rank, the loss
    scale unchanged."""
    in_fsdp_shard: bool = False
    """Under FSDP: the gradient was read in the ranks' shards after FSDP's reduce-scatter, so
    ``rank`` is the lowest rank whose *shard* held it; the rank whose batch produced it is not
    known (each rank's own gradient is never seen)."""

    def __str__(self) -> str:
        article = "an inf" if self.kind == "inf" else "a NaN"
        if self.loss_id is not None:
            return (
                f"the loss itself (loss_id {self.loss_id}) was {article} on rank {self.rank} — "
                "not a gradient overflow: a smaller loss scale does not fix it"
            )
        if self.after_unscale:
            return (
                f"a gradient held {article} value at step() on rank {self.rank}, finite at "
                "distamp.unscale_: an edit in between made it (clipping, a division by a zero "
                "norm, a write); the step is skipped on every rank, the loss scale unchanged"
            )
        if self.in_fsdp_shard:
            whose = "every rank's shard" if self.on_every_rank else f"rank {self.rank}'s shard"
            return (
                f"parameter {self.param!r} had {article} gradient in {whose} after FSDP's "
                "reduce-scatter (the rank whose batch produced it is not known)"
            )
        if self.after_reduce:
            return (
                f"parameter {self.param!r} had {article} gradient after its reduce-scatter, "
                "every rank's own gradient finite: the 16-bit wire overflowed (fp16 ends at "
                "65504; a bf16 wire keeps FP32's range)"
            )
        if self.on_every_rank and self.origin is not None:
            return (
                f"parameter {self.param!r} had {article} gradient on every rank after the "
                f"gradients' all-reduce; rank {self.origin} is the lowest rank whose own "
                "gradients held a non-finite value before it"
            )
        if self.on_every_rank:
            wire = (
                "; or the fp16 wire overflowed in that all-reduce, every rank's own gradient "
                "finite (fp16 ends at 65504; a bf16 wire keeps FP32's range)"
                if self.fp16_wire
                else ""
            )
            return (
                f"parameter {self.param!r} had {article} gradient on every rank (after the "
                f"gradients' all-reduce every rank holds it: the rank it came from is not "
                f"known{wire}{'; the next skipped steps name it' if self.origin_next else ''})"
            )
        if self.fp16_wire:  # one rank: its hook casts to fp16 all the same
            return (
                f"parameter {self.param!r} had {article} gradient on rank {self.rank} after the "
                "fp16 all-reduce hook: its own gradient, or the fp16 wire overflowed (fp16 "
                "ends at 65504; a bf16 wire keeps FP32's range)"
            )
        return f"parameter {self.param!r} had {article} gradient on rank {self.rank}"


class NonFiniteGradientError(RuntimeError):
    """Raised instead of skipping forever: too many consecutive skips, or a skip at the floor."""


EVIDENCE_SLOTS = 4
"""Slots of the skip decision's vector that carry the evidence (see :func:`local_evidence`)."""


def local_evidence(
    local_flag: torch.Tensor,
    loss_kinds: Sequence[torch.Tensor | None],
    count: int,
    named_grads: Callable[[], Sequence[tuple[str, torch.Tensor | None]]],
    rank: int,
    world: int,
    origin: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's evidence for the skip decision's MAX all-reduce: float64 [loss, grad, index,
    origin].

    [Note: the evidence rides with the decision] DESIGN asks for one small collective per step
    for the skip decision, skipped steps included; naming the first non-finite gradient used to
    cost one or two more all-reduces on every skipped step. Each value here is built so that the
    MAX over the ranks is the answer: ``loss`` is the first non-finite loss (lowest rank, then
    its first block: ``loss_kinds``, 0 finite / 1 inf / 2 NaN per ``scale_loss`` block), ``grad``
    the first non-finite gradient (lowest position among the ``count`` that ``named_grads()``
    lists, then lowest rank), each
    with its kind in the last base-3 digit; ``index`` is the highest first position over the
    ranks, which equals the lowest one exactly when every rank held it. A rank whose own flag is
    clean reads nothing (one host read of ``local_flag``; ``named_grads`` is not even called, so
    a clean step builds no list); float64 keeps the codes exact. ``origin`` (watched: nonzero
    when this rank's own gradients held a non-finite value before any reduction) gives
    ``world - rank``, whose MAX names the lowest such rank.
    """
    evidence = torch.tensor([0.0, 0.0, float(count), 0.0], dtype=torch.float64)
    if origin is not None and float(origin) > 0:
        evidence[3] = float(world - rank)
    if not float(local_flag.max()) > 0:
        return evidence
    blocks = max(1, len(loss_kinds))
    for j, kind in enumerate(loss_kinds):
        code = int(kind) if kind is not None else 0
        if code:
            evidence[0] = float(((world - 1 - rank) * blocks + (blocks - 1 - j)) * 3 + code)
            break
    for i, (_, grad) in enumerate(named_grads()):
        if grad is None:
            continue
        values = grad._values() if grad.is_sparse else grad
        if not bool(torch.isfinite(values).all()):
            code = 2 if bool(torch.isnan(values).any()) else 1
            evidence[1] = float(((count - i) * world + (world - 1 - rank)) * 3 + code)
            evidence[2] = float(i)
            break
    return evidence


def read_evidence(
    evidence: Sequence[float],
    loss_ids: Sequence[int],
    count: int,
    named_grads: Callable[[], Sequence[tuple[str, torch.Tensor | None]]],
    world: int,
    *,
    reduced_from: int | None = None,
    fsdp: bool = False,
    own_rank: int | None = None,
) -> NonFiniteReport | None:
    """The report the MAX-reduced :func:`local_evidence` of every rank names (None: nothing).
    ``named_grads()`` entries from ``reduced_from`` on are reduced gradients (see
    ``ShardedMasterParams.reduced_grads``); under ``fsdp`` every gradient is a shard FSDP
    reduced. ``own_rank``: where ranks list other parameters (distamp.GradScaler over a
    pipeline's stages), only the culprit rank names its own; None: every rank lists the same."""
    loss_code, grad_code, highest, origin = (int(v) for v in evidence)
    if loss_code:
        blocks = max(1, len(loss_ids))
        where, kind = divmod(loss_code, 3)
        rank_part, block_part = divmod(where, blocks)
        loss_id = loss_ids[blocks - 1 - block_part]
        return NonFiniteReport(
            param=f"loss {loss_id}",
            rank=world - 1 - rank_part,
            kind="nan" if kind == 2 else "inf",
            loss_id=loss_id,
        )
    if grad_code:
        where, kind = divmod(grad_code, 3)
        index_part, rank_part = divmod(where, world)
        index = count - index_part
        entries = named_grads()
        # Ranks may list different parameters (distamp.GradScaler over a pipeline's stages):
        # every rank decodes the same index, which only the rank that holds it can name; an
        # IndexError there raised on one rank while the others went on (an audit).
        culprit = world - 1 - rank_part
        mine = own_rank is None or own_rank == culprit  # ranks listing the same parameters
        name = (
            entries[index][0]
            if mine and 0 <= index < len(entries)
            else f"parameter #{index} of rank {culprit}'s optimizer"
        )
        everywhere = world > 1 and highest == index
        came_from = world - origin if everywhere and origin else None
        return NonFiniteReport(
            param=name,
            rank=world - 1 - rank_part if came_from is None else came_from,
            kind="nan" if kind == 2 else "inf",
            on_every_rank=everywhere,
            origin=came_from,
            after_reduce=reduced_from is not None and index >= reduced_from and not fsdp,
            in_fsdp_shard=fsdp,
        )
    return None
