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
all-reduce's is (at 2 ranks the result is bit for bit the all-reduce's where the wire is the
gradients' own dtype; a wire other than a half model's own — an FP16 wire for BF16 gradients —
is summed into the FP32 shard without the all-reduce's second rounding, back into the bucket's
dtype: within one ulp of it, an audit), and an inf/NaN in any
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
    from ..masters.sharded import ShardedMasterParams

PIECE = 1 << 20
"""Elements of a bucket one all-to-all carries at most; several pieces are in flight at once
(gloo moves 8 pieces of 32 MB in 0.16 s at 1 Gbit/s, one all-to-all of it in 0.24 s)."""


Run = tuple[int, int, int]
"""(first element in the bucket buffer, count, first element in the masters' FP32 grad buffer)."""


@dataclass(frozen=True)
class _Piece:
    sends: list[list[Run]]
    """Per destination rank, the runs of the bucket sent to it, in order."""
    send_counts: list[int]
    """Elements sent to each rank."""
    recv_runs: list[Run]
    """The runs this rank owns in the piece (received from every rank, in this order)."""
    recv_count: int


@dataclass(frozen=True)
class _Plan:
    key: tuple[int, ...]
    """The bucket's parameters (ids) and the number of sharded groups the plan was made for."""
    pieces: list[_Piece]
    """Empty: the bucket is all-reduced (it holds something the masters do not shard)."""
    param_ids: frozenset[int]


@dataclass(kw_only=True)
class ZeroState(CompressState):
    """State of :func:`zero_reduce_hook`: the masters that own the shards, the cached plans."""

    masters: "ShardedMasterParams | None" = None
    """The sharded masters the reduced gradients are written into."""
    buckets_scattered: int = 0
    """Buckets reduce-scattered (the rest were all-reduced) since the hook was registered."""
    _plans: dict[int, _Plan] = field(default_factory=dict, repr=False)
    _sum: torch.Tensor | None = field(default=None, repr=False)
    """Where a piece's sum over more than two ranks goes: see :meth:`sum_buffer`."""
    _received: int = field(default=0, repr=False)
    """Elements of the masters' staging buffer the buckets of this backward received into."""
    _gather_queued: bool = field(default=False, repr=False)
    """This backward ends with the reduced gradients gathered into ``.grad``: see [Note: a
    backward distamp does not see]."""

    def finish_gather(self) -> None:
        """With ``overlap_gather``: wait until the weights the last step updated have all arrived
        in the model (needed only to read them outside forward; see [Note: the gather overlaps
        the next forward])."""
        if self.masters is not None:
            self.masters.finish_gather()

    def sum_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a piece's sum over more than two ranks goes before it is copied into the shard
        gradient: one per state, as long as the longest piece (the caller holds ``_lock``)."""
        if self._sum is None or self._sum.numel() < numel or self._sum.dtype != dtype:
            # as long as the longest piece so far (a small model's held a fixed 2 MB)
            self._sum = torch.empty(numel, dtype=dtype)
        return self._sum[:numel]


def zero_reduce_hook(
    state: ZeroState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: reduce-scatter the bucket into the owners' FP32 shard gradients.

    See [Note: reduce-scatter into the shards]. Returns the bucket unchanged (this rank's own
    gradients), so the model's ``.grad`` stay local; the reduced shard is what the optimizer steps.
    """
    masters = state.masters
    assert masters is not None and state.wire_dtype is not None
    idx = bucket.index()
    if idx == 0:  # DDP hands its buckets over in index order: a new backward
        state._received = 0
        state._gather_queued = False
    plan = _plan(state, masters, bucket)
    if plan.pieces and not masters.blocks_open:
        state._gather_queued = True  # queued at the last bucket: see _gather_when_backward_ends
    if bucket.is_last() and state._gather_queued:
        _gather_when_backward_ends(state, masters)
    if not plan.pieces:
        return _compress_hook(state, bucket, state.wire_dtype)
    # See [Note: buffers only in flight] in compress.py. With 16-bit updates of FP32 weights the
    # staging buffer exists anyway and receives (see [Note: one staging buffer for the two
    # halves] in masters/gather.py).
    state.wait_for_room(idx)
    buffer = bucket.buffer()
    wire = state.wire_dtype
    world, me = masters.world, masters.rank
    group = state.process_group
    # [Note: the own part stays home] What this rank owns of the bucket is divided and cast straight
    # into its own slot of the receive buffer: it never enters the send buffer or gloo (which
    # would copy it from one to the other), so the send buffer holds (N - 1)/N of the bucket.
    total_send = sum(sum(p.send_counts) - p.send_counts[me] for p in plan.pieces)
    send = state.take(total_send, wire, buffer.device)
    recv, pooled = _receive_buffer(state, masters, sum(p.recv_count * world for p in plan.pieces))
    works = []
    sent = received = 0
    for piece in plan.pieces:
        n = piece.recv_count
        n_send = sum(piece.send_counts) - piece.send_counts[me]
        out = send[sent : sent + n_send]
        # This piece's receive buffer: this rank's own part first, then every other rank's in
        # rank order (the all-to-all's output, one contiguous stretch).
        mine = recv[received : received + n * world]
        others = [runs for rank, runs in enumerate(piece.sends) if rank != me]
        with state._lock:
            scratch = state.scratch(buffer.device, buffer.numel())
            # piece.sends[me] is piece.recv_runs: the own part, in the order every rank sends it
            for runs, target in ((piece.recv_runs, mine), ([r for rs in others for r in rs], out)):
                at = 0
                for offset, count, _ in runs:
                    _divide_then_cast(
                        buffer[offset : offset + count],
                        world,
                        wire,
                        target[at : at + count],
                        keep_source=True,
                        scratch=scratch,
                    )
                    at += count
        work = dist.all_to_all_single(
            mine[n:],
            out,
            output_split_sizes=[0 if r == me else n for r in range(world)],
            input_split_sizes=[0 if r == me else c for r, c in enumerate(piece.send_counts)],
            group=group,
            async_op=True,
        )
        works.append(work)
        sent, received = sent + n_send, received + n * world
    state.record(send)
    with state._lock:
        state.buckets_scattered += 1
    grad_buffer = masters.armed_grad_buffer()

    def reduce(arrived: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            # A piece that failed raises here, so that DDP's finalize raises it from backward
            # (an audit: it was never read, backward returned, and the step took the receive
            # buffer's stale values as the reduced gradients)
            for piece in arrived.value():
                piece.wait()
            _reduce_into_shard()
        finally:
            state.give(send, *([recv] if pooled else []))
        return buffer

    def _reduce_into_shard() -> None:
        offset = 0
        for piece in plan.pieces:  # collect_all: every piece has arrived
            n = piece.recv_count
            if n:
                parts = recv[offset : offset + n * world].view(world, n)
                # One rounding to the wire dtype, as the all-reduce's sum (see the Note): torch
                # sums 16-bit values in FP32 and rounds the result once. Two addends: one add in
                # place, 9x faster than torch.sum over dim 0 (this runs in gloo's worker thread,
                # next to the backward) and, as gloo's sum, -0 + -0 = -0. More addends: into one
                # reused buffer, under the lock (two buckets' callbacks may run at once in gloo's
                # two threads).
                if world == 2:
                    summed = torch.add(parts[0], parts[1], out=parts[0])
                    _copy_runs(summed, piece.recv_runs, grad_buffer)
                else:
                    with state._lock:
                        summed = torch.sum(parts, dim=0, out=state.sum_buffer(n, wire))
                        _copy_runs(summed, piece.recv_runs, grad_buffer)
            offset += n * world
        masters.mark_reduced(plan.param_ids)

    fut: torch.futures.Future[Any] = torch.futures.collect_all([w.get_future() for w in works])
    done = fut.then(reduce)
    state._in_flight.append(done)
    return done


def _gather_when_backward_ends(state: ZeroState, masters: "ShardedMasterParams") -> None:
    """[Note: a backward distamp does not see] A backward run outside ``scale_loss`` is a
    framework's (Hugging Face's Trainer, accelerate's ``backward``, Lightning's automatic
    optimization), and what runs between it and ``step()`` is the framework's too: typically
    ``clip_grad_norm_(model.parameters())``, which must see DDP's promise, the reduced gradients
    in every rank's ``.grad``. Under this hook they held each rank's own: the clip measured each
    rank's norm and was lost (the step reads the shards) or parted the ranks, silently (an
    audit). Inside ``scale_loss`` the script is ours to refuse (see [Note: edits lost under the
    reduce-scatter hook]); outside it nothing can be refused, so such a backward ends with the
    reduced shards all-gathered into ``.grad`` (the bytes of half an all-reduce) and their
    versions recorded, as after ``distamp.unscale_``: ``step()`` takes what the framework
    changed. Run backward inside ``scale_loss`` to keep the reduce-scatter's saving.

    Queued on the autograd engine from the last bucket, just before DDP queues its own
    end-of-backward callback there (it waits for every bucket and writes their results into
    ``.grad``); our callback queues the gather, which so runs after DDP's. Not from the first
    bucket reduce-scattered: inside a reentrant activation checkpoint that bucket's callback
    belongs to the nested backward and ran when it ended, before the later buckets, deciding
    from what gloo had delivered so far: the ranks parted and hung (an audit). Every rank
    queues it: whether a bucket is reduce-scattered and whether a block is open are the same on
    every rank (the same buckets, the same script)."""
    state._gather_queued = True
    engine = torch.autograd.Variable._execution_engine

    def after_ddp() -> None:
        state._gather_queued = False
        masters.gather_after_outside_backward()

    engine.queue_callback(lambda: engine.queue_callback(after_ddp))


def _copy_runs(summed: torch.Tensor, runs: list[Run], grad_buffer: torch.Tensor) -> None:
    """The reduced values of one piece into their places in the FP32 shard gradient."""
    at = 0
    for _, count, dst in runs:
        grad_buffer[dst : dst + count].copy_(summed[at : at + count])
        at += count


def _receive_buffer(
    state: ZeroState, masters: "ShardedMasterParams", numel: int
) -> tuple[torch.Tensor, bool]:
    """(where a bucket receives every rank's part of what this rank owns, whether that buffer is
    the pool's): the next stretch of the masters' staging buffer when it holds 16-bit updates
    anyway (see [Note: one staging buffer for the two halves]), else a buffer from the pool (see
    [Note: buffers only in flight])."""
    assert state.wire_dtype is not None
    masters.finish_gather()  # the last step's gather has landed (the staging is free again)
    if masters.staging_hooks == 1 and masters.update_dtype is not None:
        room = masters.staging_room(state.wire_dtype)
        start = state._received
        if start + numel <= room.numel():  # always, by the Note's count
            state._received += numel
            return room[start : start + numel], False
    return state.take(numel, state.wire_dtype, masters._device()), True


def _plan(state: "ZeroState", masters: "ShardedMasterParams", bucket: dist.GradBucket) -> _Plan:
    """Which elements of ``bucket`` go to which rank, cached per bucket (DDP rebuilds its buckets
    once, after the first step; ``add_param_group`` adds a sharded group); no pieces when the
    bucket holds a parameter these masters do not shard, or a sparse gradient."""
    params = bucket.parameters()
    key = (*(id(p) for p in params), len(masters.groups))
    cached = state._plans.get(bucket.index())
    if cached is not None and cached.key == key:
        return cached
    if cached is not None and cached.key[:-1] != key[:-1]:
        # DDP rebuilt its buckets (once, after the first step): drop every plan and buffer of the
        # old layout, or the old buckets' buffers would stay allocated next to the new ones.
        state._plans.clear()
        with state._lock:
            state._free.clear()
    where = masters.flat_positions()
    buffer = bucket.buffer()
    if buffer.is_sparse or any(id(p) not in where for p in params):
        plan = _Plan(key=key, pieces=[], param_ids=frozenset())
        state._plans[bucket.index()] = plan
        return plan
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
        # Every rank owns part of every long enough parameter ([Note: block-cyclic shards]).
        for owner, a, count, pos in layout.owned(start, start + param.numel()):
            runs[owner].append((offset + a - start, count, masters.grad_offsets[group] + pos))
    longest = max(sum(n for _, n, _ in rs) for rs in runs)
    n_pieces = max(1, -(-longest // PIECE))
    cut = [_cut(rs, n_pieces) for rs in runs]
    pieces = []
    for k in range(n_pieces):
        sends = [parts[k] for parts in cut]
        mine = cut[masters.rank][k]
        pieces.append(
            _Piece(
                sends=sends,
                send_counts=[sum(n for _, n, _ in rs) for rs in sends],
                recv_runs=mine,
                recv_count=sum(n for _, n, _ in mine),
            )
        )
    plan = _Plan(key=key, pieces=pieces, param_ids=frozenset(key[:-1]))
    state._plans[bucket.index()] = plan
    return plan


def _cut(runs: list[Run], n_pieces: int) -> list[list[Run]]:
    """``runs`` cut into ``n_pieces`` consecutive parts of (nearly) equal element counts, splitting
    runs where needed. Every rank cuts every destination's runs the same way, so what rank s sends
    rank r in piece k is exactly what r expects from s in piece k."""
    total = sum(n for _, n, _ in runs)
    size = -(-total // n_pieces) if total else 0
    parts: list[list[Run]] = [[] for _ in range(n_pieces)]
    k, room = 0, size
    for offset, count, dst in runs:
        while count:
            if room == 0:
                k, room = k + 1, size
            take = min(count, room)
            parts[k].append((offset, take, dst))
            offset, count, dst, room = offset + take, count - take, dst + take, room - take
    return parts
