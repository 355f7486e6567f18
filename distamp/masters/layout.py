"""Where each element of a param group lives: the flat padded layout and its block-cyclic shards.

See [Note: flat padded shards] in sharded.py; [Note: block-cyclic shards] below says which rank
owns which elements, and :meth:`GroupLayout.canonical_intervals` how they map to the contiguous
layout checkpoints keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BLOCK = 1 << 18
"""Elements of one block of a shard; see [Note: block-cyclic shards]."""

Interval = tuple[int, int, int]
"""(first element in the source tensor, count, first element in the destination tensor)."""


@dataclass(frozen=True, kw_only=True)
class ParamRange:
    """Where one parameter lives in its group's flat buffer."""

    group: int
    """Index of the param group."""
    index: int
    """Position of the parameter in the group's flat layout."""
    start: int
    """First element in the group's flat buffer."""
    numel: int
    """Number of elements."""
    shape: tuple[int, ...]
    """The parameter's shape."""


class GroupLayout:
    """One param group's flat layout and this rank's shard of it."""

    def __init__(
        self, params: list[nn.Parameter], group_index: int, world: int, rank: int, block: int
    ) -> None:
        self.params = params
        self.world, self.rank = world, rank
        self.ranges: list[ParamRange] = []
        offset = 0
        for i, p in enumerate(params):
            self.ranges.append(
                ParamRange(
                    group=group_index, index=i, start=offset, numel=p.numel(), shape=tuple(p.shape)
                )
            )
            offset += p.numel()
        self.total = offset
        self.shard_size = max(1, math.ceil(offset / world))
        self.padded = self.shard_size * world
        # [Note: block-cyclic shards] Each rank's shard is cut into blocks of BLOCK elements
        # (the last one shorter). Round j lays block j of every rank end to end in the flat
        # buffer, rank 0 first: rank r owns flat elements [j*N*BLOCK + r*b_j, ... + b_j) with
        # b_j = len(block j), and holds them at [j*BLOCK, j*BLOCK + b_j) of its shard. So every
        # stretch of N*BLOCK consecutive elements is owned by all ranks in equal parts: a DDP
        # bucket (a run of consecutive parameters) is reduce-scattered to every rank at once and
        # both directions of every link carry data (with contiguous ZeRO-1 shards a bucket belongs
        # to one rank and its gradient flows one way while the other direction idles: measured
        # 0.24 s against 0.16 s for 32 MB between two 1 Gbit/s nodes). Each rank owns at most
        # ceil(total / N) elements, the same shards and padding as contiguous ZeRO-1; with one
        # round (a shard of at most BLOCK elements, or one rank) it is exactly contiguous ZeRO-1.
        # Checkpoints keep the contiguous canonical layout: see :meth:`ShardedMasterParams.to_canonical`.
        self.block = block
        self.rounds: list[tuple[int, int]] = [
            (a, min(self.block, self.shard_size - a)) for a in range(0, self.shard_size, self.block)
        ]
        """(first element in the shard, length) of each block, the same on every rank."""
        # (param index, first element in the param, count, first element in the shard)
        self.pieces: list[tuple[int, int, int, int]] = []
        for r in self.ranges:
            for owner, a, count, pos in self.owned(r.start, r.start + r.numel):
                if owner == rank:
                    self.pieces.append((r.index, a - r.start, count, pos))
        # [Note: chunked shards] The inner optimizer steps the shard as slices that share its
        # storage, one per piece: inside one parameter and one block. Inside one parameter: a
        # parameter without a gradient is skipped by torch's optimizers (no weight decay, no
        # momentum), and so must every slice of it be; and each slice keeps its own scalar state
        # (Adam's and Adagrad's ``step``), which then counts that parameter's steps, as with
        # replicated masters — sharded equals replicated bit for bit. Inside one block (at most
        # BLOCK elements): element-wise optimizers make several passes per tensor, and a slice that
        # stays in cache runs them 2-3x faster on CPU than one flat tensor (AdamW on 10M values:
        # 23 ms vs 63 ms). The padding at the end of the last shard belongs to no slice and is
        # never stepped.
        self.spans: list[tuple[int, int, int]] = [
            (index, dst, dst + count) for index, _, count, dst in self.pieces
        ]
        """(param index, first, last + 1 element in the shard) of each slice, in shard order."""
        self.flat_half: torch.Tensor | None = None
        self.seen_versions: list[int] = []
        """Each weight's version counter after the masters last wrote or read it (see [Note:
        weights written after wrap] in base.py; the gathers write the flat buffer, not the
        parameters' own counters)."""
        self.updates: torch.Tensor | None = None
        """With 16-bit updates of FP32 weights: every rank's updates of the last step, laid out
        like ``flat_half`` (this rank's own are written in place and gathered from there)."""
        self.flat_offset = 0
        """Where this group's flat layout starts in the masters' staging buffer (see [Note: one
        staging buffer for the two halves])."""
        self.widened: torch.Tensor | None = None
        """With 16-bit updates: FP32 room for one round, reused: this rank's updates before they
        are rounded, every rank's widened before they are added (no FP32 temporary per round:
        the allocator would keep them)."""

    def flat_start(self, rank: int, block: int) -> int:
        """First element in the flat buffer of block ``block`` of ``rank``'s shard."""
        pos, length = self.rounds[block]
        return pos * self.world + rank * length

    def owned(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(owner rank, first flat element, count, first element in the owner's shard) of the
        parts of flat elements ``[lo, hi)``, in flat order."""
        out = []
        span = self.block * self.world
        for j in range(min(lo // span, len(self.rounds) - 1), len(self.rounds)):
            pos, length = self.rounds[j]
            if pos * self.world >= hi:
                break
            for owner in range(self.world):
                start = self.flat_start(owner, j)
                a, b = max(lo, start), min(hi, start + length)
                if a < b:
                    out.append((owner, a, b - a, pos + a - start))
        return out

    def param_offset(self, index: int, shard_pos: int) -> int:
        """The element of parameter ``index`` at position ``shard_pos`` of this rank's shard."""
        for j, (pos, length) in enumerate(self.rounds):
            if pos <= shard_pos < pos + length:
                flat = self.flat_start(self.rank, j) + shard_pos - pos
                return flat - self.ranges[index].start
        raise IndexError(f"position {shard_pos} is outside the shard ({self.shard_size})")

    def canonical_intervals(self, holder: int, piece_of: int) -> list[Interval]:
        """What of ``holder``'s shard lies in the contiguous canonical piece of rank ``piece_of``
        (``[piece_of*S, (piece_of+1)*S)`` of the padded flat buffer): (shard position, count,
        position in the piece), in flat order."""
        size = self.shard_size
        lo, hi = piece_of * size, (piece_of + 1) * size
        out = []
        for j, (pos, length) in enumerate(self.rounds):
            start = self.flat_start(holder, j)
            a, b = max(lo, start), min(hi, start + length)
            if a < b:
                out.append((pos + a - start, b - a, a - lo))
        return out


def check_sliceable(optimizers: list[Any]) -> None:
    """Refuse optimizer state :func:`slice_state` cannot cut, before anything is changed: wrap
    runs this among its checks on every rank, so a rank whose state alone is odd (a resume that
    loaded another rank's state) makes every rank raise, not that rank alone (an audit)."""
    for opt in optimizers:
        for g, group in enumerate(opt.param_groups):
            for param in group["params"]:
                for key, value in opt.state.get(param, {}).items():
                    _check_state_entry(key, value, param, g)


def _check_state_entry(key: str, value: Any, param: nn.Parameter, group: int) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() == 1:
        return
    if value.shape == param.shape and value.dim() > 0:
        return
    raise ValueError(
        f"shard_master_weights: optimizer state {key!r} of a parameter of param group "
        f"{group} has shape {tuple(value.shape)}, expected the parameter's shape "
        f"{tuple(param.shape)} or a scalar: sharded masters need an element-wise "
        "optimizer; wrap with shard_master_weights=False"
    )


SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})
"""Scalar per-parameter state of torch.optim's classes: what a 0-dim parameter's 0-dim state is
when it is not element-wise."""


def detached_dense(value: torch.Tensor) -> torch.Tensor:
    """``value`` detached, and dense where it is sparse: SGD's momentum for a sparse gradient
    (``nn.Embedding(sparse=True)``) is a sparse tensor, which DCP cannot write nor a flat buffer
    hold (an audit: such a checkpoint failed at every opt_level). torch's optimizers take the
    dense buffer back: ``buf.mul_(m).add_(sparse_grad)`` moves the same rows."""
    return value.detach().to_dense() if value.layout != torch.strided else value.detach()


def slice_state(
    state: dict[str, Any], param: nn.Parameter, start: int, count: int, group: int
) -> dict[str, Any]:
    """The part of one parameter's optimizer state that belongs to a slice of it.

    Element-wise state (shaped like the parameter) is cut; scalar state (``step``) is copied, one
    tensor per slice (a shared one would be advanced once per slice).
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        if (
            isinstance(value, torch.Tensor)
            and value.shape == param.shape
            and (value.dim() > 0 or key not in SCALAR_STATE)
        ):  # a 0-dim parameter's element-wise state is 0-dim too: its slice is (1,)
            out[key] = detached_dense(value).reshape(-1)[start : start + count].clone()
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.detach().clone()
        elif isinstance(value, torch.Tensor):
            _check_state_entry(key, value, param, group)
        else:
            out[key] = value
    return out
