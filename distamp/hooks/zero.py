"""The DDP comm hook for sharded masters: each bucket is reduce-scattered to the ranks that own it.

[Note: reduce-scatter into the shards] With sharded FP32 masters (ZeRO-1) a rank steps only its
shard, so it needs the reduced gradient of its shard only. An all-reduce delivers the whole reduced
gradient to every rank, and the updated weights are then all-gathered as well: 1.5x the bytes of an
all-reduce per step. This hook sends each rank exactly the elements of the bucket it owns (one
all-to-all per piece of the bucket, the pieces in flight together) and sums what it receives
straight into its FP32 shard gradient: the reduce-scatter half of an all-reduce, so reduce-scatter
+ all-gather move the bytes of one all-reduce. gloo's own ``reduce_scatter`` is slower than its
all-reduce (benchmarks/README figures); its all-to-all in pieces is not.

What stays the same: every addend is divided by the world size before it is cast to the wire dtype
(see [Note: divide before casting down]), the sum is rounded to the wire dtype once, as the
all-reduce's is (at 2 ranks the result is bit for bit the all-reduce's), and an inf/NaN in any
rank's bucket reaches the owner's shard gradient and so the skip decision (see [Note: inf/NaN are
never lost]). What changes: the model's ``.grad`` keep this rank's own (unreduced) gradients, as
with ZeRO-2 — ``distamp.unscale_`` gathers the reduced ones back into them for torch's clipping
habit (see [Note: unscale_ then torch's clip_grad_norm_]). A bucket holding a parameter these
masters do not shard (an FP32 norm layer under O2, another optimizer's parameter) is all-reduced
as before.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .compress import CompressState, _compress_hook, _divide_then_cast

if TYPE_CHECKING:
    from ..shard import ShardedMasterParams

PIECE = 1 << 20
"""Elements of a bucket one all-to-all carries at most; several pieces are in flight at once
(gloo moves 8 pieces of 32 MB in 0.16 s at 1 Gbit/s, one all-to-all of it in 0.24 s)."""


@dataclass(frozen=True)
class _Piece:
    send_index: torch.Tensor
    """Positions in the bucket buffer, grouped by destination rank."""
    send_counts: list[int]
    """Elements sent to each rank."""
    recv_count: int
    """Elements this rank owns in the piece (received from every rank)."""
    recv_index: torch.Tensor
    """Where those land in the masters' flat FP32 gradient buffer."""


@dataclass(frozen=True)
class _Plan:
    key: tuple[int, ...]
    pieces: list[_Piece]
    param_ids: frozenset[int]


@dataclass(kw_only=True)
class ZeroState(CompressState):
    """State of :func:`zero_reduce_hook`: the masters that own the shards, the cached plans."""

    masters: "ShardedMasterParams | None" = None
    """The sharded masters the reduced gradients are written into."""
    buckets_scattered: int = 0
    """Buckets reduce-scattered (the rest were all-reduced) since the hook was registered."""
    _plans: dict[int, _Plan | None] = field(default_factory=dict, repr=False)
    _buffers: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)

    def buffer(self, index: int, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable flat buffer per bucket and purpose (no allocation per step)."""
        buf = self._buffers.get((index, kind))
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[(index, kind)] = buf
        return buf


def zero_reduce_hook(
    state: ZeroState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: reduce-scatter the bucket into the owners' FP32 shard gradients.

    See [Note: reduce-scatter into the shards]. Returns the bucket unchanged (this rank's own
    gradients), so the model's ``.grad`` stay local; the reduced shard is what the optimizer steps.
    """
    masters = state.masters
    assert masters is not None and state.wire_dtype is not None
    plan = _plan(state, masters, bucket)
    if plan is None:
        return _compress_hook(state, bucket, state.wire_dtype)
    buffer = bucket.buffer()
    wire = state.wire_dtype
    world = masters.world
    group = state.process_group
    idx = bucket.index()
    total_send = sum(p.send_index.numel() for p in plan.pieces)
    send = state.buffer(idx, "send", total_send, wire)
    recv = state.buffer(idx, "recv", sum(p.recv_count * world for p in plan.pieces), wire)
    works = []
    sent = received = 0
    for piece in plan.pieces:
        n_send, n_recv = piece.send_index.numel(), piece.recv_count * world
        out = send[sent : sent + n_send]
        if buffer.dtype == wire:
            torch.index_select(buffer, 0, piece.send_index, out=out).div_(world)
        else:
            _divide_then_cast(buffer.index_select(0, piece.send_index), world, wire, out)
        work = dist.all_to_all_single(
            recv[received : received + n_recv],
            out,
            output_split_sizes=[piece.recv_count] * world,
            input_split_sizes=piece.send_counts,
            group=group,
            async_op=True,
        )
        works.append(work)
        sent, received = sent + n_send, received + n_recv
    state.record(send)
    with state._lock:
        state.buckets_scattered += 1
    grad_buffer = masters.armed_grad_buffer()

    def reduce(_: Any) -> torch.Tensor:
        offset = 0
        for piece in plan.pieces:  # collect_all: every piece has arrived
            n = piece.recv_count
            if n:
                parts = recv[offset : offset + n * world].view(world, n)
                # One rounding to the wire dtype, as the all-reduce's sum (see the Note).
                summed = parts.sum(0, dtype=torch.float32).to(wire).float()
                grad_buffer.index_copy_(0, piece.recv_index, summed)
            offset += n * world
        masters.mark_reduced(plan.param_ids)
        return buffer

    fut: torch.futures.Future[Any] = torch.futures.collect_all([w.get_future() for w in works])
    return fut.then(reduce)


def _plan(
    state: "ZeroState", masters: "ShardedMasterParams", bucket: dist.GradBucket
) -> "_Plan | None":
    """Which elements of ``bucket`` go to which rank, cached per bucket (DDP rebuilds its buckets
    once, after the first step); None when the bucket holds a parameter these masters do not
    shard, or a sparse gradient."""
    params = bucket.parameters()
    key = tuple(id(p) for p in params)
    cached = state._plans.get(bucket.index(), None)
    if cached is not None and cached.key == key:
        return cached
    where = masters.flat_positions()
    buffer = bucket.buffer()
    if buffer.is_sparse or any(id(p) not in where for p in params):
        state._plans[bucket.index()] = None
        return None
    # Each gradient's offset in the bucket's flat buffer.
    grads = bucket.gradients()
    base = buffer.data_ptr()
    size = buffer.element_size()
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(masters.world)]
    """Per destination rank: (bucket offset, count, position in the flat FP32 grad buffer)."""
    for param, grad in zip(params, grads, strict=True):
        offset = (grad.data_ptr() - base) // size
        group, start = where[id(param)]
        layout = masters.groups[group]
        lo, hi = start, start + param.numel()
        for r in range(masters.world):
            a, b = max(lo, r * layout.shard_size), min(hi, (r + 1) * layout.shard_size)
            if a < b:
                dst = masters.grad_offsets[group] + a - r * layout.shard_size
                runs[r].append((offset + a - lo, b - a, dst))
    per_rank = [_expand(rs) for rs in runs]
    longest = max(len(src) for src, _ in per_rank)
    n_pieces = max(1, -(-longest // PIECE))
    pieces = []
    for k in range(n_pieces):
        send_parts, counts = [], []
        for src, _ in per_rank:
            q = -(-len(src) // n_pieces)
            part = src[k * q : (k + 1) * q]
            send_parts.append(part)
            counts.append(len(part))
        mine_src, mine_dst = per_rank[masters.rank]
        q = -(-len(mine_src) // n_pieces)
        recv_index = mine_dst[k * q : (k + 1) * q]
        pieces.append(
            _Piece(
                send_index=torch.cat(send_parts),
                send_counts=counts,
                recv_count=len(recv_index),
                recv_index=recv_index,
            )
        )
    plan = _Plan(key=key, pieces=pieces, param_ids=frozenset(key))
    state._plans[bucket.index()] = plan
    return plan


def _expand(runs: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket positions, flat-grad positions) of the elements of ``runs``, in order."""
    if not runs:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    src = torch.cat([torch.arange(o, o + n) for o, n, _ in runs])
    dst = torch.cat([torch.arange(d, d + n) for _, n, d in runs])
    return src, dst
