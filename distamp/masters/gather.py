"""The all-gather of the updated weights after a sharded step: in rounds, overlapped, or 16-bit.

After the step each rank holds the updated FP32 masters of its shard only; every rank needs the
whole model's weights for the next forward. :class:`WeightGather` (a part of
:class:`~distamp.masters.sharded.ShardedMasterParams`) all-gathers them one round of blocks at a
time into the model's flat half buffer ([Note: block-cyclic shards] in layout.py), lets the next
forward wait module by module ([Note: the gather overlaps the next forward]) and, for FP32
weights, may send each step's update in bf16 instead of the weights:

[Note: 16-bit updates of FP32 weights] ``hooks.register(..., gather_dtype=torch.bfloat16)`` makes
that gather 16-bit while every rank keeps identical FP32 weights: after the step the owner of each
element sends its update, new - old (computed in FP32), rounded once to bf16, and
every rank, the owner included, adds that same rounded update to its FP32 weight; the owner then
takes the result as its FP32 copy, so copy and weight never part. A step moves the bytes of one
16-bit all-reduce, as under O2. What it costs: each step's update is rounded to bf16 (a relative
error of at most 2**-8 of the update, the rounding a bf16 gradient wire already puts on the
gradient, and unbiased), never the weight itself; the optimizer state is untouched. bf16, not
fp16: bf16 keeps 8 mantissa bits down to 1e-38, where fp16 loses them below 6e-5 (small updates).
Loaded values (checkpoints, ``load_state_dict``) are always gathered exactly.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import all_gather_single

if TYPE_CHECKING:
    from .layout import GroupLayout


SUBTREE_READERS = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
"""torch modules whose forward reads their children's weights without calling the children:
under the overlapped gather they wait for their whole subtree's blocks."""


class WeightGather:
    """The gather half of the sharded masters (mixed into ``ShardedMasterParams``)."""

    groups: list[GroupLayout]
    shards: list[torch.Tensor]
    chunks: list[list[torch.Tensor]]
    process_group: dist.ProcessGroup | None
    rank: int
    world: int
    overlap_gather: bool
    left_in_flight: bool
    update_dtype: torch.dtype | None
    pending_updates: bool
    watched_groups: int
    waiters: list[Any]
    pending: list[list[Any]]
    waited: list[int]
    launching: bool
    staging: torch.Tensor | None
    gather_lock: threading.RLock

    if TYPE_CHECKING:  # defined by the class this is mixed into

        def _device(self) -> torch.device: ...
        def flat_positions(self) -> dict[int, tuple[int, int]]: ...

    def copy_to_model(self, *, after_step: bool = False) -> None:
        """Collective: cast this rank's updated shard down and all-gather every group's shards.

        One all-gather per block (see [Note: block-cyclic shards]), all in flight together (gloo
        gathers 32 MB at 1 Gbit/s in 0.14 s as 8 pieces, in 0.19 s as one collective). The step's
        own call (``after_step``) returns without waiting when ``overlap_gather`` is set (see
        [Note: the gather overlaps the next forward]) and sends 16-bit updates when
        ``update_dtype`` is (see [Note: 16-bit updates of FP32 weights]); any other call (a
        loaded state) gathers the exact values. The step in rounds (rounds.py) makes the
        same calls, one round at a time between the rounds it steps.
        """
        with self.gathering(after_step=after_step):
            for j in range(self.gather_rounds()):
                self.gather_round(j)

    @contextlib.contextmanager
    def gathering(self, *, after_step: bool) -> Iterator[None]:
        """:meth:`begin_gather`, the body's :meth:`gather_round` calls, then :meth:`end_gather`
        (not after an exception), under ``gather_lock`` throughout (see :meth:`finish_gather`)."""
        with self.gather_lock:
            self.begin_gather(after_step=after_step)
            try:
                yield
            finally:
                self.launching = False
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
        new one (16-bit updates when ``after_step`` and ``update_dtype`` say so). Called by
        :meth:`gathering`, which holds ``gather_lock`` until :meth:`end_gather`."""
        self.finish_gather()
        self.pending_updates = after_step and self.update_dtype is not None and self.world > 1
        self.pending = [[] for _ in self.groups]
        self.waited = [0] * len(self.groups)
        self.launching = True
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
                    # FP32 round (no temporary per round). Under the lock the caller holds: a
                    # forward in another thread (an evaluation thread running through step())
                    # applied the rounds gathered so far through the same FP32 round, and
                    # overwrote this one's difference: the ranks parted (an audit).
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
                    all_gather_single(
                        target[start : start + length * self.world],
                        send,
                        group=self.process_group,
                        async_op=True,
                    )
                )

    def end_gather(self, *, after_step: bool) -> None:
        """After the last :meth:`gather_round`: wait for the gather, unless it is the step's and
        may overlap the next forward (then only for the groups no forward hook waits for)."""
        self.launching = False
        if not (after_step and self.overlap_gather):
            self.finish_gather()
            return
        self.left_in_flight = True
        # A forward pre-hook registered with prepend=True after hooks.register (a weight logger,
        # a hook library) went in front of the wait and read the weights of before the step (an
        # audit): each wait is put first again, once per step (a no-op while it is first).
        for handle in self.waiters:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks and next(iter(hooks)) != handle.id:
                hooks.move_to_end(handle.id, last=False)
        for g in range(self.watched_groups, len(self.pending)):
            self.wait_rounds(g, len(self.pending[g]))

    def finish_gather(self) -> None:
        """Wait for every all-gather of the last step still in flight.

        Called while the step is still starting its rounds (a ``state_dict()`` in a step hook,
        or in another thread — which the gather lock, held from ``begin_gather`` to
        ``end_gather``, makes wait until then), it waits for the rounds started so far and
        keeps the gather going: resetting it there lost the later rounds' works (an IndexError,
        or rounds never applied on one rank: the ranks parted, an audit)."""
        with self.gather_lock:
            for g, works in enumerate(self.pending):
                self.wait_rounds(g, len(works))
            if self.launching:
                return
            self.pending, self.waited = [], []
            if self.left_in_flight:
                self.left_in_flight = False
                self.landed_after_flight()

    def landed_after_flight(self) -> None:
        """Called once a gather left in flight has landed (sharded.py records the weights
        replaced meanwhile)."""

    def wait_rounds(self, g: int, rounds: int) -> None:
        """Wait for the all-gathers of the first ``rounds`` rounds of group ``g`` (if in flight).

        Under ``gather_lock``: forwards running in several threads (inference in a thread pool
        right after ``step()``) reached the same round together, each waited and each added
        the round's 16-bit updates, so the weights moved twice or more and the ranks parted
        (an audit)."""
        with self.gather_lock:
            if g >= len(self.pending):
                return
            works = self.pending[g]
            for j in range(self.waited[g], min(rounds, len(works))):
                # named for torch.profiler: the forward (or the step) waits for the wire here;
                # not in a torch.jit.trace, whose check traces twice and found the name in the
                # first graph only ("Graphs differed across invocations"; an audit)
                named = (
                    contextlib.nullcontext()
                    if torch.jit.is_tracing()
                    else torch.autograd.profiler.record_function(
                        "distamp: wait for the weight gather"
                    )
                )
                with named:
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
        module's forward than its own, a global forward pre-hook — torch runs those before any
        module's own) must call the hook state's ``finish_gather()`` first — which is why it
        is opt-in. Each wait runs first among its module's forward pre-hooks, also those
        registered later with ``prepend=True``.
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
            if isinstance(sub, SUBTREE_READERS):
                # torch's attention reads out_proj's weight without calling it, and the encoder
                # and decoder layers' inference fast path reads every child's weight without
                # calling any: each ran on half-gathered weights (an audit: losses apart from
                # the step after the first, 0.047 in validation). They wait for their subtree.
                owned.setdefault(id(sub), []).extend(sub.parameters())
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
                # First among the module's pre-hooks: the old weight_norm/spectral_norm and prune
                # compute the weight in one registered before wrap, and read half-gathered
                # weights when this wait ran after them (a race, found by an audit).
                waiter = _outside_compile(_RoundWaiter)(self, needed)
                handle = sub.register_forward_pre_hook(waiter, prepend=True)
                handles.append(handle)
                self.waiters.append(handle)
            # Its own state_dict (``model.blocks[0].state_dict()``) reads whole weights too.
            own = any(p is not None and id(p) in where for p in sub._parameters.values())
            if sub is not module and (needed or own):
                handles.append(
                    sub.register_state_dict_pre_hook(_outside_compile(_FinishGather)(self))
                )
        self.watched_groups = len(self.groups)
        handles.append(module.register_state_dict_pre_hook(_outside_compile(_FinishGather)(self)))
        handles.append(
            module.register_load_state_dict_pre_hook(_outside_compile(_FinishGather)(self))
        )
        return handles

    def _gather(self, layout: GroupLayout, mine: torch.Tensor, full: torch.Tensor) -> list[Any]:
        """Collective: start all-gathering every rank's ``mine`` (one shard) into ``full`` (the
        group's padded flat layout), one block at a time; the works to wait for."""
        works = []
        for j, (pos, length) in enumerate(layout.rounds):
            # Round j's blocks lie end to end, rank 0 first: one tensor, no staging copy.
            start = layout.flat_start(0, j)
            works.append(
                all_gather_single(
                    full[start : start + length * self.world],
                    mine[pos : pos + length],
                    group=self.process_group,
                    async_op=True,
                )
            )
        return works


class _RoundWaiter:
    """Forward pre-hook: wait for the gathered rounds a module's weights lie in.

    [Note: the gather hooks in copies and under torch.compile] A deep or pickled copy of the
    model (an EMA, ``torch.save(model)``) owns no gather: its copy of a hook waits for nothing
    (copying the gather failed on its process group: "cannot pickle 'ProcessGroup'", an audit).
    torch.compile runs the hooks outside the graph (``torch.compiler.disable``, applied by
    :func:`_outside_compile` when the hooks are registered, so that importing distamp does not
    import Dynamo): traced, the wait was specialized on each round index and recompiled per
    round until Dynamo's recompile limit; the wait is a graph break either way, so
    ``fullgraph=True`` does not go with overlap_gather.
    """

    def __init__(self, masters: WeightGather | None, needed: dict[int, int]) -> None:
        self.masters, self.needed = masters, needed

    def __reduce__(self) -> tuple[Any, ...]:
        return (_RoundWaiter, (None, {}))

    def __call__(self, *_: Any) -> None:
        if self.masters is None:
            return
        for g, rounds in self.needed.items():
            self.masters.wait_rounds(g, rounds)


class _FinishGather:
    """state_dict / load_state_dict pre-hook: every gathered weight has arrived (see [Note: the
    gather hooks in copies and under torch.compile])."""

    def __init__(self, masters: WeightGather | None) -> None:
        self.masters = masters

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FinishGather, (None,))

    def __call__(self, *_: Any, **__: Any) -> None:
        if self.masters is not None:
            self.masters.finish_gather()

    def before_copy(self) -> None:
        """A copy of the model is about to read its weights (see ``casting._reduce_generated``)."""
        self()


@functools.cache
def _outside_compile(cls: type[Any]) -> type[Any]:
    """``cls`` with its ``__call__`` run outside torch.compile's graph (see [Note: the gather
    hooks in copies and under torch.compile]); made once per class, on first use."""
    # (the reason is what Dynamo prints under fullgraph=True: its own hint said to remove the
    # disable from distamp's hook, an audit)
    waits = torch.compiler.disable(cls.__call__, reason=FULLGRAPH_REASON)
    return type(cls.__name__, (cls,), {"__call__": waits})


FULLGRAPH_REASON = (
    "distamp: hooks.register(..., overlap_gather=True) waits for the updated weights' "
    "all-gather in a forward pre-hook run outside the compiled graph, which "
    "torch.compile(fullgraph=True) does not allow: compile without fullgraph=True, or register "
    "with overlap_gather=False"
)
