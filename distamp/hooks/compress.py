"""DDP communication hooks that all-reduce gradients in FP16 or BF16, overflow-safe, on any backend.

[Note: divide before casting down] torch's ``fp16_compress_hook`` casts the bucket to FP16 and then
divides by the world size: a gradient that only fits after the division (every rank holding 5e4:
the FP16 *sum* overflows; or one rank holding 1e5) comes back inf. distamp divides in the bucket's
own precision (FP32 for FP32 grads) *first* and casts the quotient, so every addend is ``g / N``
and the sum is the mean: the result is finite wherever every ``g / N`` and every partial sum of
them fits in the wire dtype — the mean alone does not promise it: at N = 3, -1.5e5, 1.5e5, 1.5e5
(mean 5e4) come back inf when the ring adds the two positive quotients first (an audit); torch's
cast-first hook returns inf there whatever the order, as soon as one |g| exceeds FP16's range.
Why not FSDP2's split (divide by ~sqrt(N) before, the rest after): its partial sums are
``sqrt(N)`` times the mean and overflow first. The price of full pre-division is at the bottom of
FP16's range: ``g / N`` reaches the subnormals ``log2(N)`` bits sooner. 1e-6 at N = 8 is 2.1
subnormal ulps (6e-8) per addend — nonzero, about 5% off (measured in tests/test_hooks.py); with a
loss scale (O1/O2 fp16 start at 2**16) real gradients sit far above that range. BF16 has FP32's
range, so neither end is a concern there.

[Note: inf/NaN are never lost] Dividing or casting never turns a non-finite value finite, and a
finite value too large for the wire dtype becomes inf on the cast (no clamping), so an overflow on
any rank reaches every rank's reduced gradients and the loss scaler skips the step everywhere.
"""

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_IN_FLIGHT = 4
"""Buckets whose reduction may be in flight at once; see [Note: buffers only in flight]."""

GRAIN = 1 << 16
"""Bytes a pooled wire buffer's length is rounded up to, so that buckets of nearly the same length
(DDP's, cut at parameter boundaries) share buffers."""

STRETCH = 1 << 18
"""Elements an FP32 bucket is divided in at a time on its way to a 16-bit wire (1 MB of FP32
quotients, which stay in cache until they are cast)."""

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
"""A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``."""


@dataclass(kw_only=True)
class CompressState:
    """State of distamp's compression hooks (pass as ``state`` to ``register_comm_hook``)."""

    process_group: dist.ProcessGroup | None = None
    """Group to all-reduce over; None: the default (world) group."""
    wire_dtype: torch.dtype | None = None
    """dtype on the wire; None: the hook's own (fp16 or bf16). FP32 turns compression off."""
    buckets_reduced: int = 0
    """Buckets all-reduced since the hook was registered."""
    bytes_on_wire: int = 0
    """Bytes handed to the process group since the hook was registered."""
    wire_dtypes_seen: set[torch.dtype] = field(default_factory=set)
    """Every dtype handed to the process group."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _free: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Wire buffers no bucket is using (see [Note: buffers only in flight]); reused, not
    allocated per step: a fresh allocation costs page faults that take longer than the cast
    itself on CPU (measured: 36 ms vs 8.5 ms for 21M values)."""
    _lent: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    """id(what :meth:`take` returned) -> the buffer it is a view of."""
    _in_flight: deque[torch.futures.Future[Any]] = field(default_factory=deque, repr=False)
    """The futures of this backward's buckets not yet seen done, oldest first."""
    _scratch: torch.Tensor | None = field(default=None, repr=False)
    """The FP32 quotients of one stretch of a bucket on their way to the wire dtype: see
    :func:`_divide_then_cast`."""
    _backwards: int = field(default=0, repr=False)
    """Backwards begun since the hook was registered (counted at bucket 0)."""

    def finish_gather(self) -> None:
        """Nothing to wait for: the all-reduce hooks gather no weights. Here so that a script
        written for ``register(..., overlap_gather=True)`` (which calls it before reading the
        weights outside forward) also runs where ``register`` fell back to this hook: one
        rank, replicated masters."""

    def __post_init__(self) -> None:
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"CompressState.wire_dtype: expected one of {WIRE_DTYPES} or None, "
                f"got {self.wire_dtype!r}"
            )

    # [Note: buffers only in flight] A bucket's 16-bit wire buffer (the reduce-scatter hook's send
    # and receive buffers) is needed from its turn in backward until its reduction has come
    # back; buffers of one per bucket, kept, would hold a 16-bit copy of the model each. So
    # buckets take them from a pool and give them back from their callback, and no more than
    # MAX_IN_FLIGHT buckets are in flight: the hook of the next one first waits for the oldest.
    # Where the wire is slower than the backward (the case that fills the pool) that wait costs
    # nothing: the backward would end before the wire anyway; four buckets in flight keep it busy.

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A free buffer's first ``numel`` elements as ``dtype`` (the shortest that is long
        enough; a new one, rounded up to a multiple of ``GRAIN`` bytes, when none is); hand it
        back with :meth:`give`."""
        size = numel * dtype.itemsize
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= size and b.device == device]
            if fits:
                whole = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            else:
                whole = torch.empty(-(-size // GRAIN) * GRAIN, dtype=torch.uint8, device=device)
            view = whole[:size].view(dtype)
            self._lent[id(view)] = whole
        return view

    def give(self, *views: torch.Tensor) -> None:
        """Buffers from :meth:`take` whose bucket is done with them. One more than twice as long
        as what it served is dropped, and so is the longest when more than two per bucket in
        flight are free: the pool holds what the buckets of now need, no more. Nothing is kept
        from the first backward: DDP rebuilds its buckets after it, and a 16 MB buffer of the
        first step's buckets stayed until the second backward re-planned, raising the peak of
        the second forward by as much (an audit of the sharded row's peak RSS)."""
        with self._lock:
            keep = self._backwards > 1
            for view in views:
                whole = self._lent.pop(id(view))
                if keep and whole.numel() <= 2 * max(view.numel() * view.element_size(), GRAIN):
                    self._free.append(whole)
            while len(self._free) > 2 * MAX_IN_FLIGHT:
                self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))

    def wait_for_room(self, index: int) -> None:
        """Bucket ``index``'s turn (see [Note: buffers only in flight]): wait until fewer than
        ``MAX_IN_FLIGHT`` buckets are in flight. Bucket 0 starts a new backward: DDP waited for
        every bucket of the last one."""
        if index == 0:
            self._in_flight.clear()
            self._backwards += 1
        while self._in_flight and (
            self._in_flight[0].done() or len(self._in_flight) >= MAX_IN_FLIGHT
        ):
            # Backward stalls here while the wire lags (named for torch.profiler).
            with torch.autograd.profiler.record_function("distamp: wait for a bucket in flight"):
                future = self._in_flight.popleft()
                try:
                    future.wait()  # releases the GIL: the callbacks run meanwhile
                except Exception:
                    # A bucket that failed is DDP's to report: its finalize raises the error
                    # once and resets the reducer. Raised here, mid-backward, it left the
                    # reducer half-marked and the next forward failed an internal assert where
                    # plain DDP trains on (an audit: a caught error, the batch skipped).
                    pass

    def scratch(self, device: torch.device, numel: int) -> torch.Tensor:
        """The reusable FP32 stretch :func:`_divide_then_cast` divides a bucket of ``numel``
        elements into (one per state, as long as the longest bucket up to ``STRETCH``: a small
        model's hook held a fixed 1 MB; the caller holds ``_lock``)."""
        want = min(STRETCH, max(numel, 1))
        scratch = self._scratch
        if scratch is None or scratch.device != device or scratch.numel() < want:
            self._scratch = scratch = torch.empty(want, dtype=torch.float32, device=device)
        return scratch

    def record(self, tensor: torch.Tensor) -> None:
        with self._lock:  # DDP may run hooks from its autograd threads
            self.buckets_reduced += 1
            self.bytes_on_wire += tensor.numel() * tensor.element_size()
            self.wire_dtypes_seen.add(tensor.dtype)


def _group_of(state: object) -> dist.ProcessGroup | None:
    if state is None:
        return None
    if isinstance(state, dist.ProcessGroup):
        return state
    group = getattr(state, "process_group", None)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"comm hook state: expected None, a ProcessGroup or an object with a process_group "
            f"attribute, got process_group of type {type(group).__name__}"
        )
    return group


def _divide_then_cast(
    buffer: torch.Tensor,
    world: int,
    wire: torch.dtype,
    out: torch.Tensor | None,
    *,
    keep_source: bool = False,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """``buffer / world`` in at least the buffer's precision, then cast to ``wire`` (into ``out``).

    See [Note: divide before casting down]. A same-dtype bucket is divided in place (its contents
    are replaced by the reduced result anyway), so it is reduced with no copy at all;
    ``keep_source`` leaves ``buffer`` as it is and writes the quotient into ``out`` (the
    reduce-scatter hook sends a gathered copy and keeps the bucket). An FP32 bucket on a 16-bit
    wire is divided into ``scratch`` (an FP32 stretch, reused) and cast from there, a stretch at a
    time: the same bits as dividing the whole bucket, then casting, with no FP32 temporary the
    size of the bucket (``torch.div(..., out=<16-bit>)`` allocates one per call; a stretch that
    stays in cache also makes it 1.6x faster on CPU). A half buffer sent in the other half dtype
    (BF16 grads on an FP16 wire) goes through FP32 so the division is rounded once.
    """
    if buffer.dtype == wire:
        if keep_source and out is not None:
            return torch.div(buffer, world, out=out)
        return buffer.div_(world) if not keep_source else buffer / world
    if buffer.dtype == torch.float32:
        if out is None:
            out = torch.empty_like(buffer, dtype=wire)
        if scratch is None:
            return torch.div(buffer, world, out=out)
        step = scratch.numel()
        for at in range(0, buffer.numel(), step):
            n = min(step, buffer.numel() - at)
            torch.div(buffer[at : at + n], world, out=scratch[:n])
            out[at : at + n].copy_(scratch[:n])
        return out
    if wire != torch.float32:
        source = buffer.float().div_(world)
    else:
        source = buffer / world if keep_source else buffer.div_(world)
    return source.to(wire) if out is None else out.copy_(source)


def _compress_hook(
    state: object, bucket: dist.GradBucket, default_wire: torch.dtype
) -> torch.futures.Future[torch.Tensor]:
    group = _group_of(state)
    wire = getattr(state, "wire_dtype", None) or default_wire
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    sparse_fp16 = (
        buffer.is_sparse and buffer.device.type == "cpu" and torch.float16 in (wire, buffer.dtype)
    )
    if sparse_fp16:
        # gloo sums sparse tensors with torch's sparse add, which has no FP16 kernel on CPU
        # ("cadd_sparse" not implemented for 'Half'): reduce the sparse bucket in FP32 (gloo's
        # sparse all-reduce gathers the touched rows; compressing them saves little), also an
        # O2/O3 FP16 model's own (an audit: backward failed inside torch, as plain DDP does).
        wire = torch.float32
    # A sparse bucket (nn.Embedding(sparse=True)) cannot be cut into the pool's stretches: it
    # takes the plain path (an audit: CompressState crashed in backward with aten::as_strided).
    pool = (
        state
        if isinstance(state, CompressState) and buffer.dtype != wire and not buffer.is_sparse
        else None
    )
    if pool is not None:
        pool.wait_for_room(bucket.index())
        out = pool.take(buffer.numel(), wire, buffer.device)
        with pool._lock:
            compressed = _divide_then_cast(
                buffer, world, wire, out, scratch=pool.scratch(buffer.device, buffer.numel())
            )
    elif sparse_fp16:
        compressed = buffer.float().div_(world)
    else:
        compressed = _divide_then_cast(buffer, world, wire, None)
    if isinstance(state, CompressState):
        state.record(compressed)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            reduced = fut.value()[0]
            if reduced is not buffer:
                buffer.copy_(reduced)
        finally:
            if pool is not None:
                pool.give(compressed)
        return buffer

    done = fut.then(decompress)
    if pool is not None:
        pool._in_flight.append(done)
    return done


# The names must differ from torch's: DDP refuses a hook *named* bf16_compress_hook unless the
# build has CUDA and NCCL, although gloo reduces bf16 fine.
def distamp_fp16_compress_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mean of the gradients over the group, FP16 on the wire, overflow-safe.

    ``state``: None (default group), a ProcessGroup, or a :class:`CompressState`. Works on NCCL
    and gloo; see [Note: divide before casting down].
    """
    return _compress_hook(state, bucket, torch.float16)


def distamp_bf16_compress_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mean of the gradients over the group, BF16 on the wire, on NCCL and gloo."""
    return _compress_hook(state, bucket, torch.bfloat16)


fp16_compress_hook = distamp_fp16_compress_hook
bf16_compress_hook = distamp_bf16_compress_hook


def _compress_wrapper(hook: CommHook, wire: torch.dtype, name: str) -> CommHook:
    def wrapper(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        world = dist.get_world_size(_group_of(state))
        # See [Note: divide before casting down]: the bucket is divided by the world size in its
        # own precision before the cast, and the wrapped hook divides again (torch's convention),
        # so the result is multiplied back in FP32. Cast first (torch's order), a gradient whose
        # mean fits came back inf/NaN and the step was skipped (an audit: 1e5 and -9e4 on two
        # ranks). A value beyond the wire's range still becomes inf, never clamped (see [Note:
        # inf/NaN are never lost]). The price: g / N**2 meets FP16's subnormals 2 log2(N) bits
        # sooner than g (loss scaling keeps real gradients far above).
        bucket.set_buffer(_divide_then_cast(buffer, world, wire, None, keep_source=True))
        if isinstance(state, CompressState):
            state.record(bucket.buffer())
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            buffer.copy_(fut.value().float().mul_(world) if world > 1 else fut.value())
            return buffer

        return fut.then(decompress)

    wrapper.__name__ = wrapper.__qualname__ = f"{name}({getattr(hook, '__name__', 'hook')})"
    return wrapper


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run another DDP comm hook (e.g. PowerSGD) on the bucket cast to FP16, then cast back."""
    return _compress_wrapper(hook, torch.float16, "distamp_fp16_compress_wrapper")


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """Run another DDP comm hook on the bucket cast to BF16 (on NCCL and gloo), then cast back."""
    return _compress_wrapper(hook, torch.bfloat16, "distamp_bf16_compress_wrapper")
