"""Sharded FP32 master weights (ZeRO stage 1): each rank holds and steps 1/N of the masters.

[Note: flat padded shards] For each param group, the parameters that are cast to the half dtype
are laid end to end in one flat buffer (in ``param_groups`` order, identical on every rank), padded
to a multiple of the world size, and cut into N equal shards of S elements; a parameter may
straddle shards (DeepSpeed/Megatron do the same). Which elements rank r owns is set by [Note:
block-cyclic shards]: blocks of every stretch of the buffer, not one contiguous range, so every
DDP bucket has a part on every rank. A rank holds the FP32 masters and the optimizer state of
exactly what it owns, as one flat tensor per group, so any element-wise ``torch.optim`` optimizer
(SGD, Adam/AdamW, Adagrad, RMSprop, ...) steps it unchanged and keeps its per-group
lr/weight_decay. Parameters that stay FP32 (normalization layers under O2) are few and small: they
stay whole and replicated, stepped identically on every rank. Frozen parameters
(``requires_grad=False``) are left out.

[Note: gradient path] Without a comm hook the gradients reach the shard through DDP's all-reduce
and a local slice: it works with any DDP configuration. With ``distamp.hooks.register(...,
reduce_scatter=True)`` the hook reduce-scatters each bucket straight into the owners' FP32 shard
gradients (see [Note: reduce-scatter into the shards] in hooks/zero.py): Megatron's reduce-scatter
+ all-gather, the bytes of one all-reduce per step instead of 1.5x, built from gloo's all-to-all
because gloo's own reduce_scatter is slower than its all-reduce (measured in
benchmarks/sharded_optimizer.py). After the step, the updated shard is cast to the half dtype and
one all-gather per block writes every rank's blocks into the model's weights, which are views into
a flat half buffer, so nothing is copied after the gather; with ``overlap_gather=True`` the next
forward waits for them module by module (see [Note: the gather overlaps the next forward]).

[Note: sharded FP32 weights] O0 and O1 keep the model's weights FP32, so apex gives them no
masters. ``shard_master_weights=True`` shards them anyway (ZeRO-1 for FP32 training, off unless
asked for): the same layout and gradient path, with the FP32 weights themselves in the flat buffer
(``flat_half`` is FP32 then). Each rank holds the FP32 copy and the optimizer state of its shard
and steps only that (the optimizer's work and state are 1/N); the updated shard is all-gathered
straight from the masters, exactly, so every rank holds the same FP32 weights. The gather moves
FP32 — twice the bytes of a half one — so over a slow link this saves memory and optimizer time,
not wire time; with a 16-bit reduce-scatter (``hooks.register(..., reduce_scatter=True)``) a step
moves 1.5x the bytes of a 16-bit all-reduce.

[Note: 16-bit updates of FP32 weights] ``hooks.register(..., gather_dtype=torch.bfloat16)`` makes
that gather 16-bit while every rank keeps identical FP32 weights: after the step the owner of each
element sends its update, new - old (computed in FP32), rounded once to bf16, and
every rank, the owner included, adds that same rounded update to its FP32 weight; the owner then
takes the result as its FP32 copy, so copy and weight never part. A step moves the bytes of one
16-bit all-reduce, as under O2. What it costs: each step's update is rounded to bf16 (a relative
error of at most 2**-9 of the update, the rounding a bf16 gradient wire already puts on the
gradient, and unbiased), never the weight itself; the optimizer state is untouched. bf16, not
fp16: bf16 keeps 8 mantissa bits down to 1e-38, where fp16 loses them below 6e-5 (small updates).
Loaded values (checkpoints, ``load_state_dict``) are always gathered exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .clipping import norm_part, scale_to_max_norm_, total_norm
from .collectives import all_reduce_
from .config import HALF_DTYPES
from .nonfinite import check_and_unscale_, nonfinite_flag
from .optim import ModelGrads, _grad_version, merge_loaded

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


class _Group:
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


class ShardedMasterParams(ModelGrads):
    """The FP32 master shards of one optimizer; same interface as :class:`optim.MasterParams`."""

    sharded = True

    def __init__(
        self,
        replicated: list[nn.Parameter],
        process_group: dist.ProcessGroup | None,
        *,
        fp32_weights: bool = False,
    ) -> None:
        self.fp32_weights = fp32_weights
        """The model's weights are FP32 and are what is sharded (O0/O1, see [Note: sharded FP32
        weights]); else they are half and the shards are their FP32 masters (O2)."""
        self.groups: list[_Group] = []
        self.shards: list[torch.Tensor] = []
        """Per group, this rank's flat FP32 masters (the chunks share their storage)."""
        self.chunks: list[list[torch.Tensor]] = []
        """Per group, the leaf tensors the inner optimizer steps: slices of the shard."""
        self.shard_grads: list[torch.Tensor | None] = []
        self.replicated = replicated
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.model_params: list[nn.Parameter] = list(replicated)
        self.grad_buffer: torch.Tensor | None = None
        """With distamp's reduce-scatter hook: every group's FP32 shard gradient, one persistent
        buffer (see [Note: reduce-scatter into the shards])."""
        self.grad_offsets: list[int] = []
        """Where each group's shard gradient starts in ``grad_buffer``."""
        self.reduced: set[int] = set()
        """ids of the parameters whose shard gradient the hook wrote since the last step."""
        self.block = BLOCK
        """Elements per block of every group's shard ([Note: block-cyclic shards])."""
        self.overlap_gather = False
        """Set by ``hooks.register(..., overlap_gather=True)``: see [Note: the gather overlaps
        the next forward]."""
        self.update_dtype: torch.dtype | None = None
        """Set by ``hooks.register(..., gather_dtype=torch.bfloat16)`` with FP32 weights: see
        [Note: 16-bit updates of FP32 weights]."""
        self.pending_updates = False
        """The gathers in flight carry updates (added to the weights as each round arrives)."""
        self.watched_groups = 0
        """Groups whose modules wait in forward (a group added later is gathered at once)."""
        self.pending: list[list[Any]] = []
        """Per group, the all-gather works of the last step not waited for yet, one per round."""
        self.waited: list[int] = []
        """Per group, how many rounds of ``pending`` have been waited for."""
        self.staging: torch.Tensor | None = None
        """Bytes shared by the 16-bit updates and the reduce-scatter hook: see [Note: one staging
        buffer for the two halves]."""
        self.staging_hooks = 0
        """Reduce-scatter hooks registered on these masters (the staging is shared with one)."""

    @classmethod
    def take(
        cls,
        optimizer: torch.optim.Optimizer,
        cast_ids: set[int] | frozenset[int],
        process_group: dist.ProcessGroup | None,
        *,
        fp32_weights: bool = False,
    ) -> ShardedMasterParams:
        """Replace each group's cast parameters by this rank's flat FP32 shard of them.

        Must run before the model is cast, so the masters hold the exact FP32 values. Frozen
        parameters are sharded too (see ``MasterParams.take``); optimizer state that exists
        already (Adagrad creates its sums in its constructor) is cut into the slices.
        ``fp32_weights``: ``cast_ids`` are FP32 weights that stay FP32 (O0/O1).
        """
        out = cls([], process_group, fp32_weights=fp32_weights)
        for param_group in optimizer.param_groups:
            params = list(param_group["params"])
            sharded = [p for p in params if id(p) in cast_ids]
            kept = [p for p in params if id(p) not in cast_ids]
            states = [optimizer.state.pop(p, {}) for p in sharded]
            chunks = out._new_group(sharded, states, optimizer)
            out.replicated += kept
            param_group["params"] = [*chunks, *kept]
        out.model_params = [p for g in out.groups for p in g.params] + out.replicated
        return out

    def _new_group(
        self,
        sharded: list[nn.Parameter],
        states: list[dict[str, Any]],
        optimizer: torch.optim.Optimizer | None,
    ) -> list[torch.Tensor]:
        """Lay ``sharded`` out as a new group; this rank's shard, its slices and their state."""
        g = len(self.groups)
        layout = _Group(sharded, g, self.world, self.rank, self.block)
        shard = torch.zeros(layout.shard_size, dtype=torch.float32, device=_device(sharded))
        with torch.no_grad():
            for index, src, count, dst in layout.pieces:
                shard[dst : dst + count].copy_(
                    sharded[index].detach().reshape(-1)[src : src + count]
                )
        chunks = [shard[a:b].detach().requires_grad_(True) for _, a, b in layout.spans]
        for (index, a, b), chunk in zip(layout.spans, chunks, strict=True):
            if optimizer is not None and states[index]:
                optimizer.state[chunk] = slice_state(
                    states[index], sharded[index], layout.param_offset(index, a), b - a, g
                )
        self.groups.append(layout)
        self.shards.append(shard)
        self.chunks.append(chunks)
        self.shard_grads.append(None)
        return chunks

    def after_cast(self) -> None:
        """Lay each group's half parameters out as views into one flat buffer (the gather target)."""
        for layout in self.groups:
            self._lay_out(layout)

    def _lay_out(self, layout: _Group) -> None:
        if not layout.params or layout.flat_half is not None:
            return
        dtype = layout.params[0].dtype
        flat = torch.zeros(layout.padded, dtype=dtype, device=layout.params[0].device)
        with torch.no_grad():
            for r, p in zip(layout.ranges, layout.params, strict=True):
                view = flat[r.start : r.start + r.numel].view(r.shape)
                view.copy_(p.data)
                p.data = view
        layout.flat_half = flat

    def add_group(
        self, params: list[nn.Parameter], *, fp32_masters: bool = True
    ) -> list[torch.Tensor]:
        """A param group added after wrap: its half parameters become a new sharded group (FP32
        masters from their half values), the others are stepped whole on every rank."""
        shardable = {torch.float32} if self.fp32_weights else HALF_DTYPES
        fp32_masters = fp32_masters or self.fp32_weights
        sharded = [p for p in params if fp32_masters and p.dtype in shardable]
        kept = [p for p in params if not (fp32_masters and p.dtype in shardable)]
        chunks = self._new_group(sharded, [{} for _ in sharded], None)
        self._lay_out(self.groups[-1])
        if self.grad_buffer is not None:  # the reduce-scatter hook writes the new group's too
            self.armed_grad_buffer()
        self.replicated += kept
        self.model_params = [p for g in self.groups for p in g.params] + self.replicated
        return [*chunks, *kept]

    # -- what the step needs ---------------------------------------------------------------------

    def unscale_and_check(self, inv_scale: float) -> torch.Tensor:
        """Fill this rank's FP32 shard grads from the model grads, unscaled; flag non-finite ones.

        The flag covers every gradient this rank holds, not only its shard: a non-finite value
        written on one rank outside the range it owns must still skip the step everywhere (the
        skip decision reduces the flags with MAX, see [Note: one decision for all ranks]). That
        costs one read-only pass over the local half gradients. A slice whose parameter has no
        gradient gets none (see [Note: chunked shards]).
        """
        grads: list[torch.Tensor] = []
        for g, layout in enumerate(self.groups):
            if layout.params:
                grads.append(self._fill_shard_grad(g, layout.params))
        grads += [p.grad for p in self.replicated if p.grad is not None]
        flag = check_and_unscale_(grads, inv_scale, self._device())
        outside = [p.grad for g in self.groups for p in g.params if p.grad is not None]
        return torch.maximum(flag, nonfinite_flag(outside, self._device()))

    def _fill_shard_grad(
        self, g: int, params: list[nn.Parameter], *, keep_reduced: bool = True
    ) -> torch.Tensor:
        """Copy the gradients of ``params`` (of group ``g``) into the group's FP32 shard grad;
        with ``keep_reduced``, not those the reduce-scatter hook wrote already."""
        layout = self.groups[g]
        flat_grad = self.shard_grads[g]
        if flat_grad is None:
            flat_grad = torch.zeros_like(self.shards[g])
            self.shard_grads[g] = flat_grad
        wanted = {id(p) for p in params}
        with torch.no_grad():
            for index, src, count, dst in layout.pieces:
                param = layout.params[index]
                if id(param) not in wanted or (keep_reduced and id(param) in self.reduced):
                    continue
                grad = param.grad
                if grad is None:
                    flat_grad[dst : dst + count].zero_()
                    continue
                dense = grad.to_dense() if grad.is_sparse else grad
                flat_grad[dst : dst + count].copy_(dense.reshape(-1)[src : src + count])
        for (index, a, b), chunk in zip(layout.spans, self.chunks[g], strict=True):
            param = layout.params[index]
            if id(param) in wanted:
                chunk.grad = None if param.grad is None else flat_grad[a:b]
        return flat_grad

    def separate_params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def reload_master_grads(self, params: list[nn.Parameter]) -> None:
        for g, layout in enumerate(self.groups):
            mine = [p for p in params if any(p is q for q in layout.params)]
            if mine:
                self._fill_shard_grad(g, mine, keep_reduced=False)

    def step_grads(self) -> list[torch.Tensor]:
        """The unscaled gradients the inner optimizer steps (this rank's part)."""
        grads = [c.grad for chunks in self.chunks for c in chunks if c.grad is not None]
        return grads + [p.grad for p in self.replicated if p.grad is not None]

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Collective: global norm over every rank's shard (replicated params counted once)."""
        shard_grads = [c.grad for chunks in self.chunks for c in chunks if c.grad is not None]
        replicated = [p.grad for p in self.replicated if p.grad is not None]
        device = self._device()
        inf_norm = math.isinf(norm_type)
        counted = shard_grads + (replicated if self.rank == 0 else [])
        local = norm_part(counted, norm_type, device)
        op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
        all_reduce_(local, op, self.process_group)
        total = total_norm(local, norm_type)
        scale_to_max_norm_(shard_grads + replicated, total, max_norm)
        return total

    def copy_to_model(self, *, after_step: bool = False) -> None:
        """Collective: cast this rank's updated shard down and all-gather every group's shards.

        One all-gather per block (see [Note: block-cyclic shards]), all in flight together (gloo
        gathers 32 MB at 1 Gbit/s in 0.14 s as 8 pieces, in 0.19 s as one collective). The step's
        own call (``after_step``) returns without waiting when ``overlap_gather`` is set (see
        [Note: the gather overlaps the next forward]) and sends 16-bit updates when
        ``update_dtype`` is (see [Note: 16-bit updates of FP32 weights]); any other call (a
        loaded state) gathers the exact values. The step in rounds (distamp/rounds.py) makes the
        same calls, one round at a time between the rounds it steps.
        """
        self.begin_gather(after_step=after_step)
        for j in range(self.gather_rounds()):
            self.gather_round(j)
        self.end_gather(after_step=after_step)

    def gather_rounds(self) -> int:
        """Rounds of blocks of the longest group: how many :meth:`gather_round` calls a gather
        makes (round j of every group that has one)."""
        return max((len(g.rounds) for g in self.groups if g.flat_half is not None), default=0)

    def round_of_chunks(self) -> dict[int, int]:
        """id(chunk the inner optimizer steps) -> the round of blocks it lies in."""
        return {
            id(chunk): a // layout.block
            for layout, chunks in zip(self.groups, self.chunks, strict=True)
            for (_, a, _), chunk in zip(layout.spans, chunks, strict=True)
        }

    def begin_gather(self, *, after_step: bool) -> None:
        """Wait for the last gather still in flight; the next :meth:`gather_round` calls start a
        new one (16-bit updates when ``after_step`` and ``update_dtype`` say so)."""
        self.finish_gather()
        self.pending_updates = after_step and self.update_dtype is not None and self.world > 1
        self.pending = [[] for _ in self.groups]
        self.waited = [0] * len(self.groups)
        if not self.pending_updates:
            return
        assert self.update_dtype is not None
        room = self.staging_room(self.update_dtype)
        for layout in self.groups:
            if layout.flat_half is None:
                continue
            start = layout.flat_offset
            layout.updates = room[start : start + layout.padded]
            if layout.widened is None:
                widest = max(length for _, length in layout.rounds) * self.world
                layout.widened = torch.empty(
                    widest, dtype=torch.float32, device=layout.flat_half.device
                )

    def staging_room(self, dtype: torch.dtype) -> torch.Tensor:
        """The staging buffer as ``dtype``: one element per element of every group's flat layout.

        [Note: one staging buffer for the two halves] With 16-bit updates of FP32 weights the
        step gathers every rank's updates into a 16-bit copy of the flat layout, which lives until
        the next forward has added them; the reduce-scatter hook receives every rank's part of
        each bucket, which lives from its bucket's turn in backward until the reduced gradient is
        in the shard. Their lives never overlap (the hook first waits for any gather still in
        flight, and the step comes after every bucket is reduced), and both fit in one element per
        element of the layout (the hook receives N times what this rank owns of each bucket: at
        most N shards), so they share one buffer: a 16-bit copy of the model less per rank (31.9
        MB for the 16M-parameter GPT of benchmarks/compare.py). Without 16-bit updates there is
        no staging buffer: the hook's receive buffers come from its pool (see [Note: buffers
        only in flight] in hooks/compress.py).
        """
        numel = 0
        for layout in self.groups:
            layout.flat_offset = numel
            numel += layout.padded if layout.flat_half is not None else 0
        size = numel * dtype.itemsize
        if self.staging is None or self.staging.numel() < size:
            self.staging = torch.empty(size, dtype=torch.uint8, device=self._device())
        return self.staging[:size].view(dtype)

    def gather_round(self, j: int) -> None:
        """Collective: start all-gathering round ``j`` of every group that has one (its blocks
        must be stepped already). Round j's blocks lie end to end, rank 0 first: one all-gather
        into one slice of the target, no staging copy."""
        with torch.no_grad():
            for g, (layout, shard) in enumerate(zip(self.groups, self.shards, strict=True)):
                if layout.flat_half is None or j >= len(layout.rounds):
                    continue
                pos, length = layout.rounds[j]
                start, mine = layout.flat_start(0, j), layout.flat_start(self.rank, j)
                own = slice(mine, mine + length)  # this rank's place in the gather target
                single = self.process_group is None or self.world == 1
                # Each rank's part is written straight into its own place in the target and
                # gathered from there (an in-place all-gather: no send buffer), except FP32
                # weights gathered exactly, which are sent from the shard itself.
                if self.pending_updates:
                    assert layout.updates is not None and layout.widened is not None
                    # new - old in FP32, then rounded once to update_dtype, through the reused
                    # FP32 round (no temporary per round)
                    difference = layout.widened[:length]
                    torch.sub(shard[pos : pos + length], layout.flat_half[own], out=difference)
                    send, target = layout.updates[own].copy_(difference), layout.updates
                elif layout.flat_half.dtype != torch.float32:  # half weights: the cast shard
                    send = layout.flat_half[own].copy_(shard[pos : pos + length])
                    target = layout.flat_half
                else:
                    send, target = shard[pos : pos + length], layout.flat_half
                    if single:
                        target[own].copy_(send)
                if single:  # one rank: its round is all of the round, in place already
                    continue
                self.pending[g].append(
                    dist.all_gather_single(
                        target[start : start + length * self.world],
                        send,
                        group=self.process_group,
                        async_op=True,
                    )
                )

    def end_gather(self, *, after_step: bool) -> None:
        """After the last :meth:`gather_round`: wait for the gather, unless it is the step's and
        may overlap the next forward (then only for the groups no forward hook waits for)."""
        if not (after_step and self.overlap_gather):
            self.finish_gather()
            return
        for g in range(self.watched_groups, len(self.pending)):
            self.wait_rounds(g, len(self.pending[g]))

    def finish_gather(self) -> None:
        """Wait for every all-gather of the last step still in flight."""
        for g, works in enumerate(self.pending):
            self.wait_rounds(g, len(works))
        self.pending, self.waited = [], []

    def wait_rounds(self, g: int, rounds: int) -> None:
        """Wait for the all-gathers of the first ``rounds`` rounds of group ``g`` (if in flight)."""
        if g >= len(self.pending):
            return
        works = self.pending[g]
        for j in range(self.waited[g], min(rounds, len(works))):
            # named for torch.profiler: the forward (or the step) waits for the wire here
            with torch.autograd.profiler.record_function("distamp: wait for the weight gather"):
                works[j].wait()
            if self.pending_updates:
                self._apply_updates(g, j)
            self.waited[g] = j + 1

    def _apply_updates(self, g: int, j: int) -> None:
        """Round ``j`` of group ``g``'s updates has arrived: every rank adds the same rounded
        updates to its FP32 weights, and the owner takes the result as its FP32 copy."""
        layout, shard = self.groups[g], self.shards[g]
        assert layout.flat_half is not None and layout.updates is not None
        assert layout.widened is not None
        pos, length = layout.rounds[j]
        start, end = layout.flat_start(0, j), layout.flat_start(0, j) + length * self.world
        mine = layout.flat_start(self.rank, j)
        with torch.no_grad():
            # A mixed-dtype add_ would widen the updates into a fresh FP32 tensor per round.
            widened = layout.widened[: end - start].copy_(layout.updates[start:end])
            layout.flat_half[start:end].add_(widened)
            shard[pos : pos + length].copy_(layout.flat_half[mine : mine + length])

    def wait_in_forward(self, module: nn.Module) -> list[Any]:
        """See [Note: the gather overlaps the next forward]: forward pre-hooks on every submodule
        of ``module`` that holds sharded parameters, which wait for the rounds those parameters
        lie in, and a state_dict pre-hook that waits for all. Returns the hook handles.

        [Note: the gather overlaps the next forward] (``hooks.register(..., overlap_gather=True)``,
        Megatron's ``overlap_param_gather``) The step starts the all-gather of the updated weights
        and returns; the next forward waits, module by module, only for the blocks holding that
        module's weights, so the gather of the later layers runs while the first ones compute (the
        layout is in parameter order, which is roughly the order forward uses them). Until then
        the model's half weights are being written: code that reads them other than through a
        module's forward, a module's ``state_dict()``/``load_state_dict()`` or distamp's
        checkpoints (a weight norm logged right after ``step()``, a weight used by another
        module's forward than its own) must call the hook state's ``finish_gather()`` first —
        which is why it is opt-in.
        """
        where = self.flat_positions()
        handles = []
        # nn.ParameterList/ParameterDict are never called: their parameters are read in the
        # forward of the module that holds them, so that module waits for them.
        used_by: dict[int, nn.Module] = {}
        for holder in module.modules():
            for child in holder.children():
                if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
                    used_by.setdefault(id(child), holder)
        owned: dict[int, list[nn.Parameter]] = {}
        for sub in module.modules():
            target = used_by.get(id(sub), sub)
            owned.setdefault(id(target), []).extend(
                p for p in sub._parameters.values() if p is not None
            )
        for sub in module.modules():
            needed: dict[int, int] = {}
            for param in owned.get(id(sub), []):
                if id(param) not in where:
                    continue
                g, start = where[id(param)]
                layout = self.groups[g]
                last = (start + param.numel() - 1) // (layout.block * self.world)
                needed[g] = max(needed.get(g, 0), min(last, len(layout.rounds) - 1) + 1)
            if needed:
                handles.append(sub.register_forward_pre_hook(_RoundWaiter(self, needed)))
            # Its own state_dict (``model.blocks[0].state_dict()``) reads whole weights too.
            own = any(p is not None and id(p) in where for p in sub._parameters.values())
            if sub is not module and (needed or own):
                handles.append(sub.register_state_dict_pre_hook(_FinishGather(self)))
        self.watched_groups = len(self.groups)
        handles.append(module.register_state_dict_pre_hook(_FinishGather(self)))
        handles.append(module.register_load_state_dict_pre_hook(_FinishGather(self)))
        return handles

    def _gather(self, layout: _Group, mine: torch.Tensor, full: torch.Tensor) -> list[Any]:
        """Collective: start all-gathering every rank's ``mine`` (one shard) into ``full`` (the
        group's padded flat layout), one block at a time; the works to wait for."""
        works = []
        for j, (pos, length) in enumerate(layout.rounds):
            # Round j's blocks lie end to end, rank 0 first: one tensor, no staging copy.
            start = layout.flat_start(0, j)
            works.append(
                dist.all_gather_single(
                    full[start : start + length * self.world],
                    mine[pos : pos + length],
                    group=self.process_group,
                    async_op=True,
                )
            )
        return works

    def release_master_grads(self) -> None:
        for chunks in self.chunks:
            for chunk in chunks:
                chunk.grad = None
        self.reduced = set()
        if self.grad_buffer is None:
            self.shard_grads = [None] * len(self.shards)

    # -- distamp's reduce-scatter hook (distamp/hooks/zero.py) -----------------------------------

    def flat_positions(self) -> dict[int, tuple[int, int]]:
        """id(model parameter) -> (group, its first element in the group's flat layout)."""
        return {
            id(layout.params[r.index]): (r.group, r.start)
            for layout in self.groups
            for r in layout.ranges
        }

    def armed_grad_buffer(self) -> torch.Tensor:
        """The persistent FP32 buffer that holds every group's shard gradient (made once, grown
        when a group is added: the groups already there keep their offsets and what the hook
        wrote; the groups' shard gradients become views into it)."""
        total = sum(s.numel() for s in self.shards)
        if self.grad_buffer is None or self.grad_buffer.numel() != total:
            old = self.grad_buffer
            self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=self._device())
            if old is not None:
                self.grad_buffer[: old.numel()].copy_(old)
            self.grad_offsets, offset = [], 0
            for s in self.shards:
                self.grad_offsets.append(offset)
                offset += s.numel()
            self.shard_grads = [
                self.grad_buffer[o : o + s.numel()]
                for o, s in zip(self.grad_offsets, self.shards, strict=True)
            ]
        return self.grad_buffer

    def mark_reduced(self, param_ids: frozenset[int]) -> None:
        """The hook wrote the reduced shard gradients of these parameters."""
        self.reduced |= param_ids

    def expose_unscaled(self, inv_scale: float) -> None:
        """See [Note: unscale_ then torch's clip_grad_norm_]. Collective when the reduce-scatter
        hook is in use: the model's ``.grad`` hold this rank's own gradients then, so the reduced,
        unscaled shards are all-gathered into them (once per ``unscale_``, only when it is called)."""
        # ``reduced`` is the same on every rank (DDP's buckets are), so all skip or all gather.
        if not self.reduced or self.world == 1:
            super().expose_unscaled(inv_scale)
            return
        with torch.no_grad():
            for g, layout in enumerate(self.groups):
                grad = self.shard_grads[g]
                if not layout.params or layout.flat_half is None or grad is None:
                    continue
                full = torch.empty_like(layout.flat_half)
                for work in self._gather(layout, grad.to(full.dtype), full):
                    work.wait()
                for r, p in zip(layout.ranges, layout.params, strict=True):
                    if p.grad is None:
                        continue
                    if id(p) in self.reduced:
                        p.grad.copy_(full[r.start : r.start + r.numel].view(r.shape))
                    else:
                        p.grad.mul_(inv_scale)
        self.exposed = {id(p): _grad_version(p) for p in self.separate_params()}

    def master_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)

    def master_tensors(self) -> list[torch.Tensor]:
        """The tensors a state dict saves as this rank's masters (the shards)."""
        return list(self.shards)

    def load_value(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """This rank's piece of a value loaded into ``param``; see [Note: loading weights into
        the masters]."""
        flat_value = value.detach().reshape(-1)
        with torch.no_grad():
            for g, src, count, dst in self._pieces_of().get(id(param), []):
                piece = self.shards[g][dst : dst + count]
                loaded = flat_value[src : src + count].to(piece.device)
                piece.copy_(merge_loaded(piece, loaded, param.dtype))

    def _pieces_of(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """id(model parameter) -> (group, first element in it, count, first element in the
        shard) of each piece this rank holds (rebuilt when a group is added)."""
        cached: dict[int, list[tuple[int, int, int, int]]] | None = getattr(self, "_where", None)
        if cached is None or getattr(self, "_where_groups", -1) != len(self.groups):
            cached = {}
            for g, layout in enumerate(self.groups):
                for index, src, count, dst in layout.pieces:
                    cached.setdefault(id(layout.params[index]), []).append((g, src, count, dst))
            self._where, self._where_groups = cached, len(self.groups)
        return cached

    def layout(self) -> list[list[ParamRange]]:
        """Per group, where each parameter lives in the flat buffer (what resharding needs)."""
        return [list(g.ranges) for g in self.groups]

    # -- the canonical checkpoint layout (distamp/checkpoint/state.py) ---------------------------

    def to_canonical(self, g: int, local: torch.Tensor) -> torch.Tensor:
        """Collective: ``local`` (a tensor laid out like group ``g``'s shard) in the contiguous
        canonical layout: this rank's ``torch.chunk`` piece of the padded flat buffer (see [Note:
        canonical checkpoint layout] and [Note: block-cyclic shards]). ``local`` itself with one
        round."""
        layout = self.groups[g]
        if len(layout.rounds) == 1 or self.world == 1:
            return local
        sends = [layout.canonical_intervals(self.rank, q) for q in range(self.world)]
        recvs = [layout.canonical_intervals(r, self.rank) for r in range(self.world)]
        return self._exchange(local, sends, recvs)

    def from_canonical(self, g: int, piece: torch.Tensor) -> torch.Tensor:
        """Collective: the inverse of :meth:`to_canonical` (``piece`` holds ``shard_size``
        elements of the canonical layout; returns a tensor laid out like the shard)."""
        layout = self.groups[g]
        if len(layout.rounds) == 1 or self.world == 1:
            return piece
        swap = [
            [(b, n, a) for a, n, b in layout.canonical_intervals(r, self.rank)]
            for r in range(self.world)
        ]
        recvs = [
            [(b, n, a) for a, n, b in layout.canonical_intervals(self.rank, q)]
            for q in range(self.world)
        ]
        return self._exchange(piece, swap, recvs)

    def _exchange(
        self, local: torch.Tensor, sends: list[list[Interval]], recvs: list[list[Interval]]
    ) -> torch.Tensor:
        """Collective: send ``local[src : src + n]`` to rank q for each (src, n, _) of
        ``sends[q]``; returns a tensor like ``local`` with what rank r sent written at ``dst`` for
        each (_, n, dst) of ``recvs[r]`` (both in the same order on the two sides; the rest is 0)."""
        send = torch.cat([local[a : a + n] for runs in sends for a, n, _ in runs])
        recv = torch.empty(
            sum(n for runs in recvs for _, n, _ in runs), dtype=local.dtype, device=local.device
        )
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[sum(n for _, n, _ in runs) for runs in recvs],
            input_split_sizes=[sum(n for _, n, _ in runs) for runs in sends],
            group=self.process_group,
        )
        out = torch.zeros_like(local)
        at = 0
        for runs in recvs:
            for _, n, dst in runs:
                out[dst : dst + n] = recv[at : at + n]
                at += n
        return out


class _RoundWaiter:
    """Forward pre-hook: wait for the gathered rounds a module's weights lie in."""

    def __init__(self, masters: ShardedMasterParams, needed: dict[int, int]) -> None:
        self.masters, self.needed = masters, needed

    def __call__(self, *_: Any) -> None:
        for g, rounds in self.needed.items():
            self.masters.wait_rounds(g, rounds)


class _FinishGather:
    """state_dict / load_state_dict pre-hook: every gathered weight has arrived."""

    def __init__(self, masters: ShardedMasterParams) -> None:
        self.masters = masters

    def __call__(self, *_: Any, **__: Any) -> None:
        self.masters.finish_gather()


def slice_state(
    state: dict[str, Any], param: nn.Parameter, start: int, count: int, group: int
) -> dict[str, Any]:
    """The part of one parameter's optimizer state that belongs to a slice of it.

    Element-wise state (shaped like the parameter) is cut; scalar state (``step``) is copied, one
    tensor per slice (a shared one would be advanced once per slice).
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
            out[key] = value.detach().reshape(-1)[start : start + count].clone()
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.detach().clone()
        elif isinstance(value, torch.Tensor):
            raise ValueError(
                f"shard_master_weights: optimizer state {key!r} of a parameter of param group "
                f"{group} has shape {tuple(value.shape)}, expected the parameter's shape "
                f"{tuple(param.shape)} or a scalar: sharded masters need an element-wise "
                "optimizer; wrap with shard_master_weights=False"
            )
        else:
            out[key] = value
    return out


def _device(params: Sequence[nn.Parameter]) -> torch.device:
    for p in params:
        return p.device
    return torch.device("cpu")
