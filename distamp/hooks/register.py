"""``register(ddp_model, optimizer)``: the comm hook that fits the opt_level, bound to the scaler."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import backend_device, check_same_on_all_ranks
from ..config import HALF_DTYPES, disabled_properties
from ..masters.optimizer import AmpOptimizer, inner_optimizer
from ..masters.sharded import ShardedMasterParams
from .compress import CompressState, bf16_compress_hook, fp16_compress_hook
from .zero import ZeroState, zero_reduce_hook


def register(
    ddp_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dtype: torch.dtype | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    reduce_scatter: bool = False,
    overlap_gather: bool = False,
    gather_dtype: torch.dtype | None = None,
) -> CompressState:
    """Register distamp's compression hook on ``ddp_model`` for ``optimizer``'s opt_level.

    Picks the wire dtype: O0/O1 (FP32 gradients) are compressed to the half dtype — bf16 where
    that is fp16 but no loss scale lifts small gradients into fp16's range (O0's static 1.0);
    O2/O3 (half gradients) are reduced in the model's own dtype, overflow-safe;
    ``dtype=torch.float16`` sends a BF16 model's gradients as FP16 (3 more mantissa bits under
    loss scaling). If the process group
    cannot reduce that dtype, falls back to FP32 with one warning.

    ``reduce_scatter=True`` (sharded masters only: O2 at more than one rank, or O0/O1 wrapped with
    ``shard_master_weights=True``; at one rank it warns and registers the all-reduce hook, so a
    script written for N ranks runs on one unchanged) reduce-scatters each
    bucket into the ranks' FP32 shard gradients instead of all-reducing it (see [Note:
    reduce-scatter into the shards]): with the all-gather of the updated weights, the bytes of one
    all-reduce per step instead of 1.5. The model's ``.grad`` then keep each rank's own gradients
    (ZeRO-2), which is why it is not the default: DDP's promise that every rank holds the reduced
    gradients after backward holds only without it.

    ``overlap_gather=True`` (with ``reduce_scatter=True``) lets the step return before the updated
    weights are all-gathered: the next forward waits for each module's weights as it reaches it
    (see [Note: the gather overlaps the next forward]). ``state_dict()``/``load_state_dict()``
    and distamp's checkpoints wait by themselves; other reads of the weights outside forward
    (a weight norm logged after ``step()``, an EMA over ``model.parameters()``) need
    ``state.finish_gather()`` first.

    ``process_group``: the group the hook's collectives run on; default (and the only ranks
    accepted) DDP's — another group of the same ranks keeps the hook's traffic apart.

    ``gather_dtype=torch.bfloat16`` (FP32 weights sharded: O0/O1 wrapped with
    ``shard_master_weights=True``) all-gathers each step's weight updates rounded to bf16 instead
    of the FP32 weights: half the bytes of the gather, the FP32 weights still identical on every
    rank, each update rounded to bf16 as a bf16 gradient wire rounds the gradient (see [Note:
    16-bit updates of FP32 weights]). None (the default): the exact FP32 weights.

    A collective over the group (the arguments compared, the dtype probe). Returns the hook's
    state (bytes on the wire, buckets reduced); when ``optimizer`` was wrapped with
    ``enabled=False`` nothing is registered and an unused state comes back (its
    ``finish_gather()`` does nothing).
    """
    # torch.compile(DDP(model)): the compiled wrapper forwards register_comm_hook to the DDP
    # inside, as torch's own recipe registers through it (an audit: refused, "got
    # OptimizedModule", with advice the user had followed).
    inner = getattr(ddp_model, "_orig_mod", None)
    while type(ddp_model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        ddp_model, inner = inner, getattr(inner, "_orig_mod", None)
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"distamp.hooks.register: expected a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap with distamp.wrap, then DDP, then register (where "
            "a framework builds the DDP model, pass the one it built: accelerate's prepare() "
            "returns it, Hugging Face's Trainer holds it as trainer.model_wrapped once training "
            "begins)"
        )
    builtin = None if getattr(ddp_model, "_comm_hooks", None) else _builtin_comm_hook(ddp_model)
    if builtin:  # (a Python hook is named in DDP's logging data too: told apart above)
        raise RuntimeError(
            f"distamp.hooks.register: this DistributedDataParallel model already has torch's "
            f"built-in comm hook {builtin} (DDP allows one hook): expected a DDP without one — "
            "build DDP again and call distamp.hooks.register on it alone"
        )
    if getattr(ddp_model, "_comm_hooks", None):
        raise RuntimeError(
            "distamp.hooks.register: this DistributedDataParallel model already has a comm hook "
            "(DDP allows one); register once, right after constructing DDP — with two "
            "optimizers over one DDP model, one call with either of them: the hook reduces "
            "every bucket"
        )
    optimizer = inner_optimizer(optimizer) or optimizer  # an optimizer wrapper (apex's LARC)
    if disabled_properties(optimizer) is not None:
        # Registers nothing, as if distamp were not there; the state is returned all the same,
        # so a script calling state.finish_gather() runs with its "no amp" switch (an audit).
        return CompressState(process_group=ddp_model.process_group)
    if isinstance(optimizer, (list, tuple)):
        raise TypeError(
            f"distamp.hooks.register: expected one optimizer, found a {type(optimizer).__name__} "
            f"of {len(optimizer)}: DDP takes one comm hook per model. Pass the optimizer that "
            "steps this DDP model's parameters (the one wrap returned for them); with two "
            "optimizers over one DDP model, either one: the hook reduces every bucket"
        )
    if not isinstance(optimizer, AmpOptimizer):
        raise TypeError(
            f"distamp.hooks.register: optimizer ({type(optimizer).__name__}) was not returned by "
            "distamp.wrap: expected the optimizer from `model, optimizer = distamp.wrap(...)`; "
            "with torch.autocast and distamp.GradScaler (no wrap) register a plain hook instead: "
            "ddp_model.register_comm_hook(None, distamp.hooks.bf16_compress_hook) (or "
            "fp16_compress_hook)"
        )
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"distamp.hooks.register: dtype must be None, torch.float16, torch.bfloat16 or "
            f"torch.float32, got {dtype!r}"
        )
    st = optimizer._distamp
    props = st.group.props
    _refuse_half_delayed_params(ddp_model)
    in_ddp = {id(p) for p in ddp_model.parameters()}
    if st.masters.model_params and not any(id(p) in in_ddp for p in st.masters.model_params):
        # An audit: a DDP built on another model was accepted, the optimizer's own DDP reduced
        # in FP32 with no hook, and the forward waits went on the other model's modules.
        raise ValueError(
            "distamp.hooks.register: expected the DistributedDataParallel of the model this "
            f"optimizer steps, found a DDP of {type(ddp_model.module).__name__} holding none of "
            f"the optimizer's {len(st.masters.model_params)} parameters: pass the DDP built on "
            "the model distamp.wrap returned with this optimizer"
        )
    group = process_group if process_group is not None else ddp_model.process_group
    if process_group is not None and sorted(_ranks(process_group)) != sorted(
        _ranks(ddp_model.process_group)
    ):
        # An audit: replicas over [0, 1] and [2, 3], the hook given the world group: it
        # averaged the two replicas' gradients together, silently.
        raise ValueError(
            f"distamp.hooks.register: process_group: expected a group of the ranks DDP reduces "
            f"over (ranks {_ranks(ddp_model.process_group)}, DDP's process_group), found ranks "
            f"{_ranks(process_group)}: the hook would reduce over other ranks than DDP's "
            "(mixing in other replicas' gradients, or leaving some of DDP's ranks out). Leave "
            "process_group out (the hook uses DDP's), or pass another group of the same ranks"
        )
    # Arguments read per rank (reduce_scatter=(rank == 0)) hung the first backward: one rank
    # reduce-scattered while the other all-reduced (an audit).
    check_same_on_all_ranks(
        "distamp.hooks.register",
        [
            ("dtype", repr(dtype)),
            ("reduce_scatter", repr(reduce_scatter)),
            ("overlap_gather", repr(overlap_gather)),
            ("gather_dtype", repr(gather_dtype)),
        ],
        group,
    )
    # Left out of DDP's reduction on purpose: their gradients may differ between ranks (the
    # names are the DDP module's, which may hold the wrapped model: see ScalerGroup.ddp_ignored).
    ignored = set(getattr(ddp_model, "parameters_to_ignore", ()))
    st.group.hooked_ignored |= {
        id(p) for n, p in ddp_model.module.named_parameters() if n in ignored
    }
    # DDP puts delay_all_reduce_named_params on that list too, and reduces them itself: not
    # rank-local, nothing to warn about (see ScalerGroup.ddp_ignored; a review: it warned).
    st.group.ignored_at_wrap |= {id(p) for p in getattr(ddp_model, "_delay_all_reduce_params", ())}
    # DDP's reducer holds the parameters that required grad when it was built (just before).
    built = st.group.frozen_when_built = st.group.frozen_when_built or set()
    for p in ddp_model.parameters():
        if p.requires_grad:
            built.discard(id(p))
        else:
            built.add(id(p))
    # DDP reduces every gradient over wrap's ranks: the replica check runs at O0/O1 too.
    if st.group.process_group is not None and sorted(_ranks(group)) == sorted(
        _ranks(st.group.process_group)
    ):
        st.group.hooked_params |= frozenset(in_ddp)
    masters = st.masters
    sharded_over = masters.process_group if isinstance(masters, ShardedMasterParams) else None
    sharded = isinstance(masters, ShardedMasterParams) and masters.world > 1
    if sharded and not set(_ranks(sharded_over)) <= set(_ranks(group)):
        # An audit: wrap over the default group, DDP over per-rank subgroups. Each rank stepped
        # its shard with its own unreduced gradients and the gather stitched the shards
        # together: the ranks stayed identical, the training was wrong, nothing said so.
        raise ValueError(
            "distamp.hooks.register: expected the DDP model to reduce gradients over every rank "
            f"the FP32 masters are sharded over (ranks {_ranks(sharded_over)}, distamp.wrap's "
            f"process_group), found DDP's process group holding ranks {_ranks(group)}: each "
            "rank would step its shard with gradients the others never saw. Pass the same "
            "group to distamp.wrap(..., process_group=...) and to DistributedDataParallel"
        )
    if overlap_gather and not reduce_scatter:
        raise ValueError(
            "distamp.hooks.register(overlap_gather=True): expected reduce_scatter=True as well "
            "(the gather it overlaps is the second half of the reduce-scatter path), found "
            "reduce_scatter=False"
        )
    if reduce_scatter and dist.get_world_size(group) == 1:
        # A script written for N ranks, run on one (torchrun --nproc_per_node=1): there is
        # nothing to scatter or gather, and the all-reduce hook gives the same gradients.
        warnings.warn(
            "distamp.hooks.register(reduce_scatter=True): the DDP model's process group has one "
            "rank, so there is nothing to reduce-scatter or gather; registered the all-reduce "
            "hook instead (the same gradients)",
            stacklevel=2,
        )
        reduce_scatter = overlap_gather = False
    if reduce_scatter and not (sharded and _same_group(sharded_over, group)):
        where = (
            f"sharded over ranks {_ranks(sharded_over)} (distamp.wrap's process_group), the DDP "
            f"model reducing over ranks {_ranks(group)}"
            if sharded
            else "not sharded"
        )
        raise ValueError(
            "distamp.hooks.register(reduce_scatter=True): expected an optimizer whose FP32 masters "
            f"are sharded over the DDP model's process group (O2 at more than one rank with "
            f"shard_master_weights left on, or O0/O1 wrapped with shard_master_weights=True), "
            f"found masters {where} (opt_level {props.opt_level})"
        )
    if gather_dtype is not None:
        _check_gather_dtype(gather_dtype, masters, props.opt_level)
    if isinstance(masters, ShardedMasterParams) and any(masters.pending):
        # [Note: a DDP built while the gather is in flight] Building a new DDP after step()
        # (the unfreezing recipe) with overlap_gather: its constructor broadcasts rank 0's
        # parameters, read through module.parameters() (no hook of ours runs), while the step's
        # all-gather still writes into them on every rank — a rank could keep rank 0's stale
        # values (an audit's probe). Every rank has the gather in flight here (all stepped
        # alike): finish it, then gather the exact weights from the shards again.
        masters.finish_gather()
        masters.copy_to_model()
    wire = dtype or props.half_dtype
    if (
        dtype is None
        and wire == torch.float16
        and props.cast_model_type not in HALF_DTYPES
        and all(not s.dynamic and s.scale == 1.0 for s in st.group.scalers)
    ):
        # [Note: no fp16 wire without a loss scale] FP32 gradients (O0/O1) with a static scale
        # of 1 (O0's): fp16's range ends below 6e-8, and at 4 ranks an audit saw 39% of
        # gradients of magnitude ~6e-8 flushed to zero and the rest 34% off on CUDA, whose
        # "auto" half dtype is fp16, silently. bf16 keeps FP32's range (and reduces on NCCL
        # and gloo alike); dtype=torch.float16 still asks for fp16.
        wire = torch.bfloat16
    if not _can_reduce(wire, group):
        warnings.warn(
            f"distamp.hooks.register: the {dist.get_backend(group)} process group cannot "
            f"all-reduce {wire}; gradients are reduced in torch.float32 instead",
            stacklevel=2,
        )
        wire = torch.float32
    if gather_dtype is not None:
        assert isinstance(masters, ShardedMasterParams)
        masters.update_dtype = None if gather_dtype == torch.float32 else gather_dtype
    st.group.fp16_wire = wire == torch.float16
    if reduce_scatter:
        assert isinstance(masters, ShardedMasterParams)
        # See [Note: reduce-scatter into the shards].
        zero = ZeroState(process_group=group, wire_dtype=wire, masters=masters)
        masters.armed_grad_buffer()
        ddp_model.register_comm_hook(zero, zero_reduce_hook)
        masters.staging_hooks += 1
        if overlap_gather:
            masters.wait_in_forward(ddp_model.module)
            masters.overlap_gather = True
        return zero
    state = CompressState(process_group=group, wire_dtype=wire)
    st.group.fp16_all_reduce = wire == torch.float16
    hook: Any = bf16_compress_hook if wire == torch.bfloat16 else fp16_compress_hook
    ddp_model.register_comm_hook(state, hook)
    return state


def _refuse_half_delayed_params(ddp_model: nn.parallel.DistributedDataParallel) -> None:
    """DDP's ``delay_all_reduce_named_params`` keeps an FP32 gradient buffer whose views it assigns
    to the delayed parameters' ``.grad``: with half weights (O2/O3) torch fails in the first
    forward with "attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
    'BFloat16'" (a plain bf16 model too; an audit). Said here, with the names, instead."""
    delayed = {id(p) for p in getattr(ddp_model, "_delay_all_reduce_params", ())}
    half = [
        f"{name} ({p.dtype})"
        for name, p in ddp_model.module.named_parameters()
        if id(p) in delayed and p.dtype != torch.float32
    ]
    if half:
        raise ValueError(
            "distamp.hooks.register: DistributedDataParallel(delay_all_reduce_named_params=...) "
            "expects FP32 parameters (torch keeps their delayed gradients in an FP32 buffer), "
            f"found half parameters: {', '.join(half)}. Leave them out of "
            "delay_all_reduce_named_params, or train at O0/O1 (FP32 weights)"
        )


def _check_gather_dtype(dtype: torch.dtype, masters: object, opt_level: str) -> None:
    """``gather_dtype`` is for sharded FP32 weights, and bf16 (or float32: exact) only."""
    sharded = isinstance(masters, ShardedMasterParams)
    if not (isinstance(masters, ShardedMasterParams) and masters.fp32_weights):
        found = (
            "FP32 masters of half weights (gathered in the half dtype already)"
            if sharded
            else "weights that are not sharded"
        )
        raise ValueError(
            "distamp.hooks.register(gather_dtype=...): expected sharded FP32 weights (O0/O1 "
            f"wrapped with shard_master_weights=True), found opt_level {opt_level} with {found}"
        )
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            "distamp.hooks.register: gather_dtype must be torch.bfloat16 (16-bit updates) or "
            f"torch.float32 (exact weights), got {dtype!r}: an fp16 update of a weight would "
            "lose its small values (below 6e-5 fp16 has fewer mantissa bits)"
        )


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (None: the default group)."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """Do ``a`` and ``b`` hold the same ranks in the same order?"""
    if a is None or b is None:
        return a is b
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _can_reduce(dtype: torch.dtype, group: dist.ProcessGroup | None) -> bool:
    """Collective: can ``group`` all-reduce ``dtype``? Agreed on by every rank."""
    device = backend_device(group)
    try:
        probe = torch.ones(2, dtype=dtype, device=device)
        dist.all_reduce(probe, group=group)
        ok = bool((probe == dist.get_world_size(group)).all())
    except (RuntimeError, TypeError, ValueError):
        ok = False
    verdict = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    return int(verdict.item()) == 0


def _builtin_comm_hook(ddp_model: nn.parallel.DistributedDataParallel) -> str | None:
    """The built-in hook torch's ``_register_builtin_comm_hook`` registered, which leaves
    ``_comm_hooks`` empty (an audit: torch's bare "can only be called once" came after distamp's
    state had changed); read from DDP's logging data (private: None where it is not there)."""
    try:
        hook = ddp_model.logger._get_ddp_logging_data().strs_map.get("comm_hook")  # type: ignore[union-attr]
    except AttributeError:
        return None
    return str(hook) if hook else None
