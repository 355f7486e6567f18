"""``wrap()``, ``scale_loss()``, ``stats()``, ``unscale_()`` and ``clip_grad_norm_()``."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import casting
from .checks import (
    as_list,
    as_optimizer_list,
    check_models,
    check_no_aliased_params,
    check_optimizers,
    check_params_read_from_groups,
    fingerprint,
    module_names,
    same_shape,
)
from .collectives import (
    all_reduce_,
    broadcast_from_rank0_,
    check_same_on_all_ranks,
    checks_on_every_rank,
    digest,
)
from .config import (
    DISABLED_FSDP1_ATTR,
    HALF_DTYPES,
    Properties,
    check_opt_level,
    disabled_properties,
    mark_disabled,
    parse_bool,
    resolve_properties,
    warn_from_caller,
)
from .forensics import NonFiniteReport
from .masters.base import MasterWeights, any_nonzero, grad_versions, local_tensor
from .masters.clipping import norm_part
from .masters.layout import check_sliceable
from .masters.optimizer import (
    OUTSIDE_BEFORE,
    OUTSIDE_BETWEEN,
    AmpOptimizer,
    AmpOptimizerState,
    AmpOptimizerWrapper,
    amp_optimizer_class,
    drop_cleared_gradients,
    guard_nested_optimizers,
    inner_optimizer,
    refuse_outside_backward,
    unscale_now,
    watch_backward,
)
from .masters.replicated import MasterParams
from .masters.rounds import PER_PARAMETER
from .masters.sharded import ShardedMasterParams
from .optstate import OptState
from .scaler import LossScaler, ScalerGroup, scaler_facts, split_loss_scale

"""Attribute naming the Properties on an optimizer that went through ``wrap(enabled=False)``."""


@dataclass(frozen=True, kw_only=True)
class AmpStats:
    """What :func:`stats` reports about one wrapped optimizer on this rank."""

    steps: int
    """``optimizer.step()`` calls since wrap (or since the loaded state), skipped ones included."""
    skipped_steps: int
    """Steps skipped because a gradient was inf/NaN on some rank."""
    last_step_skipped: bool
    """Whether the most recent ``step()`` was skipped."""
    loss_scales: tuple[float, ...]
    """The current scale of each loss (``num_losses`` entries)."""
    master_bytes: int
    """Bytes of FP32 master weights held by this rank: its shard when sharded (also the FP32 copies
    of sharded O0/O1 weights), 0 when the weights are their own masters (O0/O1 unsharded, O3)."""
    optimizer_state_bytes: int
    """Bytes of optimizer state (e.g. Adam's moments) held by this rank."""
    last_nonfinite: NonFiniteReport | None = None
    """The first non-finite gradient of the last skipped step, when one was found."""


def wrap(
    models: Any,
    optimizers: Any = None,
    *,
    opt_level: str = "O1",
    enabled: bool = True,
    half_dtype: Any = "auto",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | LossScaler | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    shard_master_weights: bool | None = None,
    process_group: dist.ProcessGroup | None = None,
    max_consecutive_skips: int = 50,
    keep_fp32_modules: Any = None,
) -> Any:
    """Prepare FP32 model(s) and optimizer(s) for mixed precision at ``opt_level`` (apex.amp.initialize).

    Call it before DistributedDataParallel/FSDP. The models are cast in place and keep their
    identity; the optimizers keep their identity and step FP32 master weights from now on. A single
    model/optimizer in gives a single one out, lists give lists in the same order; with
    ``optimizers=None`` only the model(s) are returned. ``enabled=False`` returns the inputs
    untouched and makes every other distamp call a no-op. ``keep_fp32_modules`` (submodules, or
    fnmatch patterns of their qualified names such as ``"blocks.*.attn.softmax"``) stay FP32
    under every opt_level, with autocast off inside and their inputs cast up and outputs back.
    """
    model_list, _ = as_list(models, nn.Module, "models")
    given, _ = ([], False) if optimizers is None else as_optimizer_list(optimizers)
    opt_list = [o for o in map(inner_optimizer, given) if o is not None]
    device_type = casting.device_type_of(model_list[0]) if model_list else "cpu"
    enabled = _enabled_flag(enabled)
    group = _check_process_group(process_group)
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    world_size = dist.get_world_size(group) if group is not None else 1
    if not enabled:
        check_opt_level(opt_level)
        props = resolve_properties(
            opt_level, device_type=device_type, enabled=False, num_losses=num_losses
        )
        for opt in opt_list:
            mark_disabled(opt, props, group)
        return same_shape(model_list, models, given, optimizers, optimizers is None)

    # Every rank learns of a check that failed on one rank only (instead of waiting for it).
    with checks_on_every_rank("distamp.wrap", group):
        loss_scale, min_loss_scale, max_loss_scale, template = split_loss_scale(
            loss_scale, min_loss_scale, max_loss_scale
        )
        props = resolve_properties(
            opt_level,
            device_type=device_type,
            half_dtype=half_dtype,
            cast_model_type=cast_model_type,
            patch_torch_functions=patch_torch_functions,
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            master_weights=master_weights,
            loss_scale=loss_scale,
            cast_model_outputs=cast_model_outputs,
            num_losses=num_losses,
            verbosity=verbosity,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            shard_master_weights=shard_master_weights,
            world_size=world_size,
            max_consecutive_skips=max_consecutive_skips,
        )
        names = check_models(model_list, casts=props.model_is_cast)
        check_optimizers(opt_list, names)
        wrappers = [o for o in given if not isinstance(o, torch.optim.Optimizer)]
        if props.shard_master_weights:
            props = _shard_or_replicate(props, given, explicit=shard_master_weights is not None)
        if props.shard_master_weights:
            check_sliceable(opt_list)
        fp32_modules = casting.resolve_fp32_modules(model_list, keep_fp32_modules)
        plan = casting.plan_precision(model_list, props, fp32_modules)
        facts = fingerprint(props, model_list, opt_list) + scaler_facts(template)
        facts.append(("keep_fp32_modules", str(sorted(module_names(model_list, fp32_modules[0])))))
        facts.append(
            ("FP32 modules", str(sorted(module_names(model_list, list(plan.fp32_modules)))))
        )
        cast_ids = _master_ids(plan, props, opt_list)
        check_params_read_from_groups(opt_list, cast_ids, names)  # before anything changes
        check_no_aliased_params(
            model_list,
            names,
            plan.cast_params | cast_ids,
            "sharding the FP32 weights into one flat buffer"
            if props.shard_master_weights
            else f"opt_level {props.opt_level!r}",
        )
        if plan.half_dtype is not None or cast_ids:
            _refuse_script_modules(model_list, props)
        rank_local = ddp_ignored_tensors(model_list)
        # (the same on every rank, as DDP needs: _refuse_rank_local_in_shards gathers by them)
        facts.append(("DDP's ignore list", str(sorted(rank_local.values()))))
    check_same_on_all_ranks("distamp.wrap", facts, group)
    if props.shard_master_weights:
        _refuse_rank_local_in_shards(rank_local, opt_list, group)
    broadcast_from_rank0_(_states_of(model_list, rank_local), group)
    casting.warn_about_plan(model_list, plan, props)
    _warn_about_eps(opt_list, props)
    _warn_about_state_before_wrap(opt_list, props)
    if opt_list and props.master_weights:
        _warn_about_cast_params_no_optimizer_holds(model_list, plan, props, opt_list, names)
    if props.shard_master_weights:
        strided = [
            names[id(p)]
            for m in model_list
            for p in m.parameters()
            if id(p) in cast_ids and not p.is_contiguous()
        ]
        if strided:
            warn_from_caller(
                f"distamp.wrap: sharded masters keep the weights as contiguous views of one flat "
                f"buffer, so {strided[:3]}{' and others' if len(strided) > 3 else ''} lose their "
                "strides (a memory format such as channels_last, a transposed layout): their "
                "forward kernels round differently from a replicated run's (within an ulp), and "
                'with channels_last inputs DDP warns "Grad strides do not match bucket view '
                'strides" (a copy per gradient); shard_master_weights=False keeps them',
            )
    masters: list[MasterWeights] = [
        ShardedMasterParams.take(opt, cast_ids, group, fp32_weights=not props.master_weights)
        if props.shard_master_weights
        else MasterParams.take(opt, cast_ids)
        for opt in opt_list
    ]
    cast_names = _cast_names(model_list, plan)
    for model in model_list:
        casting.cast_model(model, props, device_type, plan)
        # What each forward compares: see [Note: dtypes changed after wrap] in casting.py.
        model._distamp_dtype_probes = casting.dtype_probes(model)
    for master in masters:
        master.after_cast()
    for opt in opt_list:
        _recast_half_state(inner_optimizer(opt) or opt)
    scalers = ScalerGroup(props, group, names, template)
    scalers.models = [weakref.ref(m) for m in model_list]
    scalers.ignored_at_wrap = frozenset(rank_local)
    scalers.frozen_at_wrap = {
        id(p) for m in model_list for p in m.parameters() if not p.requires_grad
    }
    held = {id(p) for master in masters for p in master.model_params}
    for index, model in enumerate(model_list):
        named = dict(model.named_parameters())
        scalers.wrapped_params.update(
            {(index, n): id(p) for n, p in named.items() if id(p) in held}
        )
        # ids, not weak references: torch.utils.swap_tensors (model.to() and load_state_dict
        # under torch.__future__.set_swap_module_params_on_conversion(True)) refuses a tensor
        # with a weakref (an audit); the masters hold the parameters, so the ids stay theirs
        scalers.probe_params += [
            (weakref.ref(model), n, id(named[n]))
            for n, _ in model._distamp_dtype_probes
            if n in named and id(named[n]) in held
        ]
    _register_state_hooks(
        model_list, plan, scalers, cast_names, cast_ids, sharded=props.shard_master_weights
    )
    for index, (opt, master) in enumerate(zip(opt_list, masters, strict=True)):
        state = AmpOptimizerState(scalers, index, master)
        _make_amp_optimizer(opt, state)
        watch_backward(state, master.model_params)
    for wrapper in wrappers:
        wrapper.__class__ = _wrapper_class(type(wrapper))
    if optimizers is None and props.master_weights:
        _warn_at_first_gradient_without_masters(model_list, props, names)
    return same_shape(model_list, models, given, optimizers, optimizers is None)


def _refuse_script_modules(models: list[nn.Module], props: Properties) -> None:
    """A TorchScript submodule takes no state-dict or forward hooks, which half weights and
    masters need: wrap failed with torch's bare "register_state_dict_post_hook is not
    supported on ScriptModules", naming no module (an audit). Named here, before any change."""
    for model in models:
        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                where = "sharded FP32 weights" if props.shard_master_weights else "half weights"
                raise ValueError(
                    f"distamp.wrap: expected plain nn.Modules at opt_level={props.opt_level!r} "
                    f"with {where}, found a TorchScript module at {name or '(the model)'!r} "
                    f"({type(module).__name__}): it takes no state-dict or forward hooks, which "
                    "distamp needs there. Script it after training (or keep it outside the "
                    "wrapped model), or train O0/O1 with shard_master_weights=False"
                )


def _warn_at_first_gradient_without_masters(
    models: list[nn.Module], props: Properties, names: dict[int, str]
) -> None:
    """Wrapped at O2 without an optimizer (apex's inference form), then trained: the optimizer
    built afterwards (by hand, or by Hugging Face's Trainer when ``optimizers=`` is not passed)
    stepped the half weights, with no FP32 masters — at lr 1e-5 most bf16 updates rounded away
    — silently (an audit). One hook on the first trainable half weight warns at the first
    gradient and removes itself; inference never fires it."""
    param = next(
        (p for m in models for p in m.parameters() if p.requires_grad and p.dtype in HALF_DTYPES),
        None,
    )
    if param is None:
        return
    handles: list[Any] = []

    def warn(_: torch.Tensor) -> None:
        for handle in handles:
            handle.remove()
        warnings.warn(
            f"distamp.wrap(model, opt_level={props.opt_level!r}) was given no optimizer, and "
            f"{names.get(id(param), 'a parameter')!r} (cast to {props.half_dtype}) now receives "
            "gradients: expected the optimizer passed to wrap (`model, optimizer = "
            "distamp.wrap(model, optimizer, ...)`), which keeps the FP32 masters; an optimizer "
            "built afterwards steps the half weights directly, with no FP32 masters (small "
            "updates round away). Hugging Face's Trainer: pass optimizers=(optimizer, "
            "scheduler) wrapped with the model",
            stacklevel=2,
        )

    handles.append(param.register_post_accumulate_grad_hook(warn))


def _enabled_flag(value: object) -> bool:
    """``enabled`` read as the properties' flags are (apex's configs write "False"), never by
    truthiness: ``enabled="False"`` turned mixed precision on (an audit)."""
    if type(value) is int and value in (0, 1):
        return bool(value)  # enabled=int(os.environ["AMP"])
    if value is None or value not in (True, False, "True", "true", "False", "false"):
        raise ValueError(f"distamp.wrap: enabled: expected True or False, got {value!r}")
    return parse_bool("enabled", value) is True


def _check_process_group(group: object) -> dist.ProcessGroup | None:
    """``process_group``: None or a group this rank belongs to (torch's own errors named neither)."""
    if group is None:
        return None
    ranks = ""
    if isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0:
        ranks = f" (ranks {dist.get_process_group_ranks(group)})"
    if ranks or group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"distamp.wrap: process_group: rank {dist.get_rank()} is not a member of the given "
            f"group{ranks}; expected a group holding this rank (dist.new_group returns a "
            "placeholder on the ranks outside it: wrap only on the group's ranks)"
        )
    if not isinstance(group, dist.ProcessGroup):
        backend = (
            " (a backend object: torch.distributed's collectives take the ProcessGroup that "
            "init_process_group and dist.new_group return, not a backend built by hand)"
            if type(group).__name__.startswith("ProcessGroup")  # ProcessGroupGloo, ...Nccl
            else ""
        )
        raise TypeError(
            "distamp.wrap: process_group: expected a torch.distributed ProcessGroup (from "
            f"dist.new_group) or None for the default group, got {type(group).__name__} "
            f"{group!r}{backend}"
        )
    return group


def _shard_or_replicate(props: Properties, given: list[Any], *, explicit: bool) -> Properties:
    """The sharding decision, given the optimizers.

    [Note: which optimizers shard] Sharded masters hand the optimizer flat slices of this rank's
    shard (pieces of several parameters end to end, a parameter cut between ranks), so sharded
    training equals replicated training only for a step that treats every element on its own.
    torch's per-parameter optimizers (``PER_PARAMETER``: SGD, Adam/AdamW, Adagrad, ...) do; LAMB
    and LARS (a trust ratio per parameter), Adafactor (factored moments), NovoGrad (a norm per
    layer), timm's ``caution`` variants and optimizer wrappers such as apex's LARC read whole
    parameters and would train differently, and differently on each rank, without a word. So by
    default any other optimizer keeps replicated masters (a warning says so); an explicit
    ``shard_master_weights=True`` shards anyway (the user vouches for an element-wise step), with
    a warning, except for a wrapper, which cannot be stepped on slices at all.
    """
    others = [o for o in given if not isinstance(o, PER_PARAMETER)]
    if not others:
        return props
    name = type(others[0]).__name__
    all_names = sorted({type(o).__name__ for o in others})
    if explicit:
        sparse = [o for o in others if isinstance(o, torch.optim.SparseAdam)]
        if sparse:
            raise ValueError(
                "distamp.wrap: shard_master_weights=True with SparseAdam, which steps sparse "
                "gradients only, but sharded masters hand it dense flat slices of this rank's "
                "shard; expected shard_master_weights=False (or None) with SparseAdam"
            )
        muon = getattr(torch.optim, "Muon", None)
        if muon is not None and any(isinstance(o, muon) for o in others):
            raise ValueError(
                "distamp.wrap: shard_master_weights=True with Muon, which orthogonalizes each "
                "2-D weight matrix whole, but sharded masters hand it 1-D flat slices of this "
                "rank's shard; expected shard_master_weights=False (or None) with Muon"
            )
        if not isinstance(others[0], torch.optim.Optimizer):
            raise ValueError(
                f"distamp.wrap: {name} wraps an optimizer and reads per-parameter gradients in "
                "its step, but sharded masters cut parameters into flat slices; expected "
                "shard_master_weights=False with an optimizer wrapper"
            )
        warn_from_caller(
            f"distamp.wrap: shard_master_weights=True with {name}, which is not one of torch's "
            "per-parameter optimizers: its step sees flat slices of this rank's shard, not whole "
            "parameters, which trains like replicated masters only if it treats every element "
            "on its own (LAMB, LARS, Adafactor do not)",
        )
        return props
    warn_from_caller(
        f"distamp.wrap: {' and '.join(all_names)} {'is' if len(all_names) == 1 else 'are'} not "
        "among torch's per-parameter optimizers, so a step may read whole parameters (norms, "
        "trust ratios, factored moments, sparse gradients) that sharded masters would cut into "
        "flat slices; the FP32 masters and optimizer state stay replicated on every rank, for "
        f"every optimizer wrapped with {'it' if len(all_names) == 1 else 'them'} "
        f"({len(given)} in all; shard_master_weights=True shards them if each step treats "
        "every element on its own)",
    )
    return dataclasses.replace(props, shard_master_weights=False)


def _master_ids(
    plan: casting.PrecisionPlan, props: Properties, optimizers: list[torch.optim.Optimizer]
) -> frozenset[int]:
    """ids of the parameters whose FP32 values the optimizer steps apart from the model: the
    cast ones with master weights (O2), every FP32 one when FP32 weights are sharded (O0/O1 with
    ``shard_master_weights=True``, see [Note: sharded FP32 weights]), else none."""
    if props.master_weights:
        return frozenset(plan.cast_params)
    if props.shard_master_weights:
        return frozenset(
            id(p)
            for opt in optimizers
            for group in opt.param_groups
            for p in group["params"]
            if p.dtype == torch.float32
        )
    return frozenset()


def _wrapper_class(cls: type) -> type:
    if issubclass(cls, AmpOptimizerWrapper):
        return cls
    return type(cls.__name__, (AmpOptimizerWrapper, cls), {"__module__": cls.__module__})


def _unscale_before_wrapper_steps(wrapper: Any) -> None:
    """A wrapper (apex's LARC) built around the optimizer wrap returned, then handed to
    scale_loss: give it the class wrap gives a wrapper handed to it (see [Note: optimizer
    wrappers]), so its ``step`` reads unscaled gradients. Missed, LARC's trust ratio came from
    gradients 2**16 times too large at O1 and from no gradients at all at O2 (the masters get
    theirs in step()): updates 8x too small, or none, silently (an audit)."""
    if isinstance(wrapper, AmpOptimizerWrapper):
        return
    try:
        wrapper.__class__ = _wrapper_class(type(wrapper))
    except TypeError:  # a class whose instances cannot change class (slots, extension types)
        warn_from_caller(
            f"scale_loss: the optimizer wrapper {type(wrapper).__name__} was built around the "
            "optimizer distamp.wrap returned, and its step() may read gradients still multiplied "
            "by the loss scale; expected the wrapper handed to distamp.wrap (apex's order: "
            "wrapper first, then initialize)",
        )


def _states_of(models: list[nn.Module], rank_local: dict[int, str]) -> list[torch.Tensor]:
    """Every parameter and buffer of ``models`` once (tied ones once), in a fixed order, but the
    ones DDP's ignore list names (``rank_local``): DDP leaves those as each rank has them (an
    expert per rank), and so does wrap's broadcast (an audit: every rank got rank 0's expert)."""
    seen: set[int] = set(rank_local)
    out: list[torch.Tensor] = []
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(tensor.data)
    return out


def ddp_ignored_tensors(models: list[nn.Module]) -> dict[int, str]:
    """id -> name of the parameters and buffers named to DDP's ignore list
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``) on ``models``."""
    out: dict[int, str] = {}
    for model in models:
        names = set(getattr(model, "_ddp_params_and_buffers_to_ignore", None) or ())
        if names:
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name in names:
                    out.setdefault(id(tensor), name)
    return out


def _refuse_rank_local_in_shards(
    rank_local: dict[int, str], opts: list[torch.optim.Optimizer], group: dist.ProcessGroup | None
) -> None:
    """Collective when a parameter DDP ignores is stepped: refuse sharded masters where such
    parameters hold other values on other ranks (experts). Each rank steps its shard of the
    one flat buffer, and the gather stitched one rank's expert into another's, silently (an
    audit); where the values agree (a replicated layer the script reduces itself) it works."""
    stepped = {id(p) for opt in opts for g in opt.param_groups for p in g["params"]}
    named = sorted((name, i) for i, name in rank_local.items() if i in stepped)
    if not named or group is None or dist.get_world_size(group) == 1:
        return
    tensors = {id(t): t for opt in opts for g in opt.param_groups for t in g["params"]}
    mine = {name: digest(tensors[i]) for name, i in named}
    seen: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    apart = [
        (name, [r for r, other in enumerate(seen) if other and other.get(name) != d])
        for name, d in mine.items()
    ]
    apart = [(name, ranks) for name, ranks in apart if ranks]
    if apart:
        listed = ", ".join(f"{name!r} (other on ranks {ranks})" for name, ranks in apart[:4])
        raise ValueError(
            f"distamp.wrap: parameters DDP was told to ignore hold other values on other ranks "
            f"than on rank {dist.get_rank(group)}: {listed}{' and more' if len(apart) > 4 else ''}"
            "; expected the same values on every rank with shard_master_weights=True (each rank "
            "steps 1/N of one flat FP32 buffer, which cannot hold a rank's own expert): pass "
            "shard_master_weights=False, or keep rank-local parameters in an optimizer of their "
            "own, wrapped with shard_master_weights=False"
        )


def _warn_about_state_before_wrap(
    optimizers: list[torch.optim.Optimizer], props: Properties
) -> None:
    """nanoGPT's resume order loads the optimizer's state dict right after building it, before
    wrap would go: torch's own ``load_state_dict`` drops the ``"distamp"`` entry (the FP32
    masters, loss scalers, step counters), and the masters are then taken from the weights the
    model loaded, rounded to the half dtype when saved at O2. Nothing fails; the run resumes
    less exactly (an audit). State before wrap is otherwise rare (converting a running FP32
    job), so it is named."""
    if not props.master_weights:
        return
    for i, opt in enumerate(optimizers):
        if any(_stepped_state(state) for state in opt.state.values()):
            warn_from_caller(
                f"distamp.wrap: optimizers[{i}] has state already ({len(opt.state)} "
                "parameters): if it was loaded from a state dict distamp saved, load that after "
                "wrap instead (or use distamp.load_checkpoint) — torch's own load_state_dict "
                "drops its FP32 masters, loss scalers and step counters. State from a run "
                "without distamp (a plain FP32 checkpoint) belongs here, before wrap: then "
                "ignore this",
            )


def _stepped_state(state: Any) -> bool:
    """State a step or a load made, not a constructor (Adagrad's sums start with step 0)."""
    if not isinstance(state, dict) or not state:
        return False
    step = state.get("step")
    return step is None or float(step) > 0


def _warn_about_eps(
    optimizers: list[torch.optim.Optimizer], props: Properties, what: str = "distamp.wrap"
) -> None:
    """Without FP32 masters the optimizer steps fp16 weights with fp16 state: an ``eps`` below
    fp16's smallest subnormal (6e-8; Adam's default 1e-8) is 0 there, and Adam divides by 0 as
    soon as a squared gradient underflows (seen on a GPT-2 under O3: every weight inf by step 2)."""
    if props.master_weights or props.cast_model_type != torch.float16:
        return
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            eps = group.get("eps")
            if isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=torch.float16) == 0:
                warn_from_caller(
                    f"{what}: optimizer {i} param_groups[{g}]['eps'] = {eps:g} rounds to 0 in "
                    f"float16, which opt_level {props.opt_level} steps the weights in (no FP32 "
                    "masters): expected eps >= 6e-8 (1e-4 is common for fp16 Adam), or O2 (FP32 "
                    "masters), or bf16",
                )
                return


def _warn_about_cast_params_no_optimizer_holds(
    models: list[nn.Module],
    plan: casting.PrecisionPlan,
    props: Properties,
    optimizers: list[torch.optim.Optimizer],
    names: dict[int, str],
) -> None:
    """Masters are the FP32 copies of the parameters an optimizer steps; a cast parameter no
    optimizer holds (fine-tuning's ``AdamW(p for p in model.parameters() if p.requires_grad)``
    over a frozen backbone) keeps only its half value, and a consolidated checkpoint widens that
    back to "FP32": a weight never trained came back changed, without a word (an audit; apex's
    O2 drops them the same way). Parameters frozen but passed to the optimizer keep masters."""
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    seen: set[int] = set()
    lost = []
    for model in models:
        for param in model.parameters():
            if id(param) in plan.cast_params and id(param) not in held and id(param) not in seen:
                seen.add(id(param))
                lost.append(names.get(id(param), "?"))
    if lost:
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
        warn_from_caller(
            f"distamp.wrap(opt_level={props.opt_level!r}): parameter(s) {lost[:3]}{more} are "
            f"cast to {plan.half_dtype} but held by no optimizer passed to wrap, so no FP32 "
            "master keeps their FP32 values (a consolidated checkpoint widens the rounded "
            "ones). Expected every parameter in an optimizer (frozen ones too: they get masters "
            "and are not stepped), or their modules in keep_fp32_modules to keep them FP32; "
            "if the rounded values are fine (a frozen backbone), ignore this",
        )


def _no_scalers() -> None:
    return None


class _LoadIntoMasters:
    """``load_state_dict`` pre-hook of a module whose parameters have FP32 masters; see [Note:
    loading weights into the masters]. Registered on every such module, so loading a submodule
    (``model.blocks[0].load_state_dict(...)``) reaches the masters too."""

    def __init__(self, scalers: ScalerGroup, cast: frozenset[int]) -> None:
        self.scalers: Callable[[], ScalerGroup | None] = weakref.ref(scalers)
        self.cast = cast

    def __getstate__(self) -> dict[str, Any]:
        """A pickled or deep-copied model belongs to no optimizer (see [Note: pickling a wrapped
        model] in casting.py): its copy of the hook loads into nothing."""
        return {"cast": frozenset()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.scalers = _no_scalers
        self.cast = state["cast"]

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        scalers = self.scalers()
        if scalers is None:
            return
        for st in scalers.optimizers:
            # A gather still in flight (overlap_gather) would land on top of the loaded values.
            if isinstance(st.masters, ShardedMasterParams):
                st.masters.finish_gather()
        for name, param in module._parameters.items():
            if param is None or id(param) not in self.cast:
                continue
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                several = scalers.process_group is not None and scalers.world > 1
                for st in scalers.optimizers:
                    st.masters.load_value(param, value)
                    if several:  # see [Note: a load on some ranks only] in masters/base.py
                        st.masters.note_load(param, value)


class _HalfAsFP32StateDict:
    """``state_dict`` post-hook of a module holding cast tensors: they are reported as FP32
    (apex's O2 state-dict hook), so ``torch.save(model.state_dict())`` is a checkpoint a plain
    FP32 model loads. ``keep_vars=True`` (the live tensors themselves) is left alone.

    With sharded masters (``unshare``) the weights are views of one flat buffer per param group
    (the gather's target); each is reported as its own copy, as O2's widened ones are. Views of
    one storage are what savers take for tied weights: accelerate's ``save_state``/``save_model``
    (safetensors) kept one of an O1 model's 41 weights with only a log line, and its
    ``load_state`` then failed in safetensors (an audit); ``torch.save`` of one weight wrote the
    whole buffer.

    The cast tensors are known by their names in each module, taken before the cast: casting a
    buffer replaces it by a new tensor (BatchNorm's running stats under O3), so ids would miss it.

    [Note: a copy's state dict is live] torch's ``state_dict()`` hands out detached tensors that
    share storage with the module, and EMAs rely on it: timm's ``ModelEmaV2``/``ModelEmaV3``
    write ``ema.state_dict()`` in place. A deep or pickled copy of an O2 model (an EMA built after
    wrap) used to widen its own cast tensors too, so every EMA update landed in a throwaway FP32
    copy and the EMA never moved (an audit; nothing warned). A copy owns no masters and is not
    the model apex's recipe checkpoints, so it reports its live half tensors: an EMA kept in it
    moves (in the half dtype; an FP32 EMA is built before wrap, see the README).
    """

    def __init__(self, names: frozenset[str], copies: _WidenedCopies, *, unshare: bool) -> None:
        self.names = names
        """This module's cast tensors."""
        self.copies = copies
        """Shared by every module of one wrap: tied tensors widen to one FP32 copy."""
        self.unshare = unshare
        """Copy parameters that are views of a larger buffer (sharded masters' flat layout)."""

    def __getstate__(self) -> dict[str, Any]:
        """A deep or pickled copy widens nothing: see [Note: a copy's state dict is live]."""
        return {"names": frozenset(), "unshare": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.names = state["names"]
        self.unshare = state.get("unshare", False)
        self.copies = _WidenedCopies()

    def __call__(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        for name in self.names:
            live = module._parameters.get(name, module._buffers.get(name))
            value = state_dict.get(prefix + name)
            if (
                isinstance(value, torch.Tensor)
                and value is not live
                and value.dtype in (torch.float16, torch.bfloat16)
            ):
                state_dict[prefix + name] = self.copies.widen(state_dict, value, torch.float32)
        if not self.unshare:
            return
        for name, live in module._parameters.items():
            value = state_dict.get(prefix + name)
            if (
                isinstance(value, torch.Tensor)
                and live is not None
                and value is not live
                and value.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
                and value.untyped_storage().nbytes() > value.numel() * value.element_size()
            ):
                state_dict[prefix + name] = self.copies.widen(state_dict, value, value.dtype)


class _WidenedCopies:
    """The copies ``state_dict()`` calls made (FP32 ones of half tensors, and of views of a
    sharded layout's flat buffer), per destination, by the storage they copy.

    Tied tensors (an embedding and its ``lm_head``, T5's four aliases of ``shared``) are one
    tensor in torch's state dict, which ``torch.save`` writes once and ``save_pretrained`` knows
    as tied. Each module's post-hook widening its own alias made one FP32 copy per alias instead
    (an audit: a T5 O2 checkpoint 14% larger, GPT-2 saved ``lm_head.weight`` beside ``wte``).
    The copies are kept only while their destination lives (torch's is an OrderedDict, weakly
    referenced), one cache per destination under a lock (a review: two threads' calls reset
    each other's, and tied weights came out as two copies); a plain ``dict`` destination gets
    a copy per alias. A cached copy is refreshed at every hit (a destination passed again).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()  # _forget may run inside widen (a collected cycle)
        self.caches: dict[int, tuple[weakref.ref[Any], dict[tuple[Any, ...], torch.Tensor]]] = {}

    def widen(
        self, state_dict: dict[str, Any], value: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``value`` as a tensor of ``dtype`` of its own (one per storage and shape)."""
        try:
            ref = weakref.ref(state_dict, self._forget)
        except TypeError:  # a plain dict: no weak reference, so no sharing
            return value.to(dtype, copy=True)
        key = (
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
            value.dtype,
            dtype,
        )
        with self.lock:
            entry = self.caches.get(id(state_dict))
            if entry is None or entry[0]() is not state_dict:
                entry = self.caches[id(state_dict)] = (ref, {})
            copies = entry[1]
            copy = copies.get(key)
            if copy is None:
                copy = copies[key] = value.to(dtype, copy=True)
            else:
                # Refreshed: a destination passed again (whole, from a submodule holding a tied
                # alias, under another prefix) holds the copy of its last call, and a step, a
                # .data write or the user's own edit of the copy since is seen by no version
                # counter (reviews: stale weights); within one call it copies the same values.
                with torch.no_grad():
                    copy.copy_(value)
            return copy

    def _forget(self, ref: weakref.ref[Any]) -> None:
        """A destination is gone: drop its copies with it."""
        with self.lock:
            for ident, (other, _) in list(self.caches.items()):
                if other is ref:
                    del self.caches[ident]


def _recast_half_state(optimizer: torch.optim.Optimizer) -> None:
    """State of parameters stepped in half (no masters: O3) follows them to the half dtype, as
    torch's ``load_state_dict`` casts it (apex recast it by reloading the optimizer's own state
    dict): a momentum buffer from before wrap must not stay FP32 next to half weights."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.dtype not in HALF_DTYPES or param not in optimizer.state:
                continue
            state = optimizer.state[param]
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    state[key] = value.to(param.dtype)


def _cast_names(models: list[nn.Module], plan: casting.PrecisionPlan) -> dict[int, frozenset[str]]:
    """id(module) -> the names of its own tensors the plan casts (call before casting)."""
    cast = plan.cast_params | plan.cast_buffers
    out: dict[int, frozenset[str]] = {}
    for model in models:
        for module in model.modules():
            own = [*module._parameters.items(), *module._buffers.items()]
            names = frozenset(n for n, t in own if t is not None and id(t) in cast)
            if names:
                out[id(module)] = names
    return out


def _register_state_hooks(
    models: list[nn.Module],
    plan: casting.PrecisionPlan,
    scalers: ScalerGroup,
    cast_names: dict[int, frozenset[str]],
    master_ids: frozenset[int],
    *,
    sharded: bool,
) -> None:
    load = _LoadIntoMasters(scalers, master_ids) if master_ids else None
    copies = _WidenedCopies()
    for model in models:
        for module in model.modules():
            own_params = [t for t in module._parameters.values() if t is not None]
            names = cast_names.get(id(module), frozenset()) if plan.half_dtype else frozenset()
            # Every module with parameters when sharded: a param group added later is laid out too.
            if names or (sharded and own_params):
                hook = _HalfAsFP32StateDict(names, copies, unshare=sharded)
                module.register_state_dict_post_hook(hook)
            if load is not None and any(id(t) in master_ids for t in own_params):
                module.register_load_state_dict_pre_hook(load)


def _make_amp_optimizer(opt: torch.optim.Optimizer, state: AmpOptimizerState) -> None:
    opt.__class__ = amp_optimizer_class(type(opt))
    opt._distamp = state  # type: ignore[attr-defined]
    state.optimizer = weakref.ref(opt)
    guard_nested_optimizers(opt, state)
    state.group.optimizers.append(state)
    # An LR scheduler built before wrap stored a wrapper of the *old* class's step on the instance
    # (lr_scheduler.patch_track_step_called); rebuild it around the new class's step.
    instance_step = opt.__dict__.get("step")
    if instance_step is not None and getattr(instance_step, "_wrapped_by_lr_sched", False):
        opt.__dict__["step"] = _scheduler_tracked_step(opt)


def _scheduler_tracked_step(opt: torch.optim.Optimizer) -> Any:
    import weakref

    opt_ref = weakref.ref(opt)

    def step(*args: Any, **kwargs: Any) -> Any:
        target = opt_ref()
        assert target is not None
        target._opt_called = True  # type: ignore[attr-defined]
        return type(target).step(target, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def autocast_exclude(module: nn.Module) -> nn.Module:
    """Run ``module`` (a submodule of an O0/O1 model) without autocast, its inputs cast to FP32 and
    its outputs back to the incoming dtype. Under O2/O3 (half weights) pass the module to
    ``wrap(..., keep_fp32_modules=[...])`` instead, so that it is never cast."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"autocast_exclude: expected an nn.Module, got {type(module).__name__}")
    half = [
        n
        for n, p in module.named_parameters()
        if p.is_floating_point() and p.dtype != torch.float32
    ]
    if half:
        raise ValueError(
            f"autocast_exclude: parameter {half[0]!r} of this module is already "
            f"{dict(module.named_parameters())[half[0]].dtype}; expected FP32 weights (O0/O1). "
            "Under O2/O3 use distamp.wrap(..., keep_fp32_modules=[module]) so it is never cast"
        )
    casting.keep_fp32(module)
    return module


# -- per-step API -------------------------------------------------------------------------------


def _states(optimizers: Any, what: str) -> tuple[list[AmpOptimizerState], Properties | None]:
    """The distamp states of ``optimizers``; ([], props) when they were wrapped with enabled=False."""
    given = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not given:
        raise ValueError(f"{what}: expected at least one optimizer, got an empty list")
    opts = [inner_optimizer(o) or o for o in given]
    for wrapper, opt in zip(given, opts, strict=True):
        if getattr(wrapper, "optim", None) is opt and isinstance(opt, AmpOptimizer):
            _unscale_before_wrapper_steps(wrapper)
    disabled = [disabled_properties(o) for o in opts]
    if all(d is not None for d in disabled):
        return [], disabled[0]
    states = []
    for i, opt in enumerate(opts):
        if not isinstance(opt, AmpOptimizer):
            raise TypeError(
                f"{what}: optimizer {i} ({type(opt).__name__}) was not returned by distamp.wrap "
                "or distamp.fsdp.fully_shard: expected the optimizer(s) from `model, optimizer = "
                "distamp.wrap(model, optimizer)` (under FSDP, `distamp.fsdp.fully_shard(model, "
                "optimizer, ...)`: build the optimizer before it and keep the one it returns, "
                "not one built on the sharded model afterwards)"
            )
        states.append(opt._distamp)
    groups = {id(st.group) for st in states}
    if len(groups) > 1:
        raise ValueError(
            f"{what}: the optimizers come from different distamp.wrap calls; expected optimizers "
            "wrapped together (their losses share one set of loss scalers): "
            "distamp.wrap([models], [optimizers]); under FSDP, where one fully_shard call takes "
            "one model and one optimizer, shard the models' parent module with one optimizer "
            "holding a param group per model"
        )
    return states, None


def _refuse_nonfinite_fsdp1_norm(
    params: list[torch.Tensor], norm_type: float, group: dist.ProcessGroup
) -> None:
    """Collective: torch's ``error_if_nonfinite`` over FSDP1's flat shards, whose clip has no
    such option: the global norm from each rank's, then torch's error (gradients untouched)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    part = norm_part(grads, norm_type, device)
    all_reduce_(part, dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group)
    if not bool(torch.isfinite(part).all()):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )


def _refuse_a_list(optimizer: object, api: str) -> None:
    """``unscale_``, ``clip_grad_norm_`` and ``stats`` take one optimizer (``scale_loss`` takes a
    list: a loss may reach several); a list failed with Python's "too many values to unpack"
    (an audit)."""
    if isinstance(optimizer, (list, tuple)):
        hint = (
            "; for one norm over several optimizers: distamp.unscale_ each, then "
            "torch.nn.utils.clip_grad_norm_ over all their models' parameters"
            if api == "clip_grad_norm_"
            else ""
        )
        raise TypeError(
            f"{api}: expected one optimizer, got a {type(optimizer).__name__} of "
            f"{len(optimizer)}; call it on each{hint}"
        )


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
    delay_unscale: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * scale``; call ``backward()`` on it inside the block (apex.amp.scale_loss).

    Gradients stay scaled until ``optimizer.step()`` (see [Note: why grads stay scaled until
    step()]), so several blocks before one step accumulate correctly, also under DDP ``no_sync``;
    the skip decision and the scale update happen once, in ``step()``. ``delay_unscale`` is
    accepted for apex compatibility: distamp always delays unscaling to ``step()``.
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"scale_loss: expected the loss as a torch.Tensor, got {type(loss).__name__}"
        )
    if getattr(loss, "_distamp_scaled", False):
        # (an audit: a block over another block's scaled loss scaled it twice, 65536x, silently)
        raise ValueError(
            "scale_loss: expected an unscaled loss, found the scaled loss another scale_loss "
            "block yielded (nested blocks scale it twice): list every optimizer the loss reaches "
            "in one block, scale_loss(loss, [optimizer_a, optimizer_b])"
        )
    states, disabled = _states(optimizers, "scale_loss")
    if disabled is not None:
        yield loss
        return
    group = states[0].group
    if isinstance(loss_id, bool) or not hasattr(loss_id, "__index__"):
        raise TypeError(
            f"scale_loss: expected loss_id as an int, got {type(loss_id).__name__} ({loss_id!r})"
        )
    loss_id = operator.index(loss_id)  # numpy's and torch's integers too, as apex indexed with it
    if not 0 <= loss_id < group.props.num_losses:
        raise ValueError(
            f"scale_loss: loss_id must be in [0, num_losses={group.props.num_losses}), got "
            f"{loss_id!r}; pass num_losses to "
            f"{'distamp.fsdp.fully_shard' if states[0].masters.fsdp else 'distamp.wrap'} "
            "to use more losses"
        )
    for st in states:
        drop_cleared_gradients(st)
        if st.state is OptState.UNSCALED and st.interrupted:
            raise RuntimeError(
                "scale_loss: the last step() of this optimizer raised before it stepped (an "
                "exception from a step pre-hook): its gradients are unscaled and its skip "
                "decision made; expected step() again to step them, or zero_grad() to drop the "
                "batch, before the next backward"
            )
        if st.state is OptState.UNSCALED:
            raise RuntimeError(
                "scale_loss: unscale_() (or clip_grad_norm_, or amp.master_params() after a block "
                "without delay_unscale=True) was already called on this optimizer since the last "
                "step(); expected step() before the next backward"
            )
        _refuse_after_outside_backward(st, group.scalers[loss_id].scale)
    opener = _enter_block_thread(group)
    try:
        scale = group.prepare_backward(loss_id, states)
        scaled = loss.float() * scale
        scaled._distamp_scaled = True  # type: ignore[attr-defined]  # refused as a block's loss
        watch = scaled.requires_grad and scale != 1.0 and all(map(_sees_backward, states))
        through_scaled: list[bool] = []
        if watch:
            scaled.register_hook(lambda _: through_scaled.append(True))
    except BaseException:
        _leave_block_thread(group, opener)
        raise
    # The group's other optimizers: does this block's backward reach them too (see [Note: a block
    # that does not list an optimizer it reaches] in scaler.py)?
    others = [o for o in group.optimizers if o not in states and _sees_backward(o)]
    before = [st.backward_since_step for st in (*states, *others)]
    for st in (*states, *others):
        st.backward_since_step = False
    for st in states:
        st.masters.blocks_open += 1
        st.delayed_unscale = bool(delay_unscale)
    try:
        yield scaled
    except BaseException:
        reached, foreign = _close_block(states, others, before, opener)
        if reached:
            # [Note: a block that raised after its backward] A backward that ran (wholly, or
            # until a hook raised) left gradients at ``scale`` in .grad; a script that catches
            # the error and steps anyway (the "log the OOM, go on" habit) had them taken as
            # unscaled: an update 65536 times too large (an audit). They are recorded as this
            # block's, so step() unscales them; zero_grad() discards them as usual.
            group.finish_backward(loss_id, states, scale, loss)
            group.reached_unlisted(foreign, loss_id, scale)
        raise
    reached, foreign = _close_block(states, others, before, opener)
    if watch and reached and not through_scaled:
        # An apex user's slip: ``loss.backward()`` inside the block. Its gradients are not
        # scaled, and step() divides them by the scale: updates 2**16 times too small, silently.
        warnings.warn(
            "scale_loss: a backward inside the block reached the model's parameters, but not "
            "through the scaled loss it yielded; expected `with distamp.scale_loss(loss, "
            "optimizer) as scaled_loss: scaled_loss.backward()`. A backward on `loss` itself "
            f"gives gradients that step() divides by the loss scale ({scale:g}): updates that "
            "much too small",
            stacklevel=3,
        )
    group.finish_backward(loss_id, states, scale, loss)
    group.reached_unlisted(foreign, loss_id, scale)


def _sees_backward(st: Any) -> bool:
    """Whether a hook records each backward that reaches ``st``'s parameters: ``BackwardSeen``
    (wrap) or, under FSDP, ``UnshardedReached`` on the unsharded ones it has hooked."""
    return bool(st.watches_backward or (st.masters.fsdp and getattr(st.masters, "watched", None)))


def _refuse_after_outside_backward(st: Any, scale: float) -> None:
    """[Note: a backward outside scale_loss, then a block] A backward outside ``scale_loss``
    (``loss.backward()``, a framework's) leaves gradients at scale 1.0, which ``step()`` takes
    as they are; a block after it in the same step adds gradients at the loss scale, and the
    step divides the sum by it: the first backward's share shrank 65536-fold at O2, and under
    the reduce-scatter hook a rank's own unreduced gradient was stepped (audits: silently
    wrong updates). No unscale can undo such a sum, so the block is refused before its
    backward, on every rank alike (the same script). Gradients cleared since (``zero_grad``,
    also in place) are not refused, nor a block at scale 1.0 (O0's) where each rank's
    gradients are the reduced ones (no reduce-scatter hook): the sum is right there. A backward
    outside the blocks between two of them (``st.outside_between_blocks``) is refused here and
    at the step. Under FSDP no hook sees a backward: its gradients are read instead."""
    # With several ranks the refusal waits for the step, where every rank raises together.
    several = st.group.process_group is not None and st.group.world > 1
    if st.outside_between_blocks:
        if any_nonzero([p.grad for p in st.masters.model_params if p.grad is not None]):
            if several:
                return
            refuse_outside_backward("scale_loss", OUTSIDE_BETWEEN)
        # cleared since (the module's zero_grad in place, an audit): nothing pending is kept
        st.group.forget(st)
        st.reset()
    if st.state is not OptState.READY or (st.watches_backward and not st.backward_since_step):
        return
    if scale == 1.0 and not st.masters.reduced:
        return
    if not any_nonzero([p.grad for p in st.masters.model_params if p.grad is not None]):
        # Cleared since (the module's zero_grad, .grad = None): what the reduce-scatter hook
        # gathered for that backward goes with them (an audit: its shard gradients were
        # stepped with the block's own unreduced .grad, |w| 9536 at O2)
        if st.masters.reduced:
            st.masters.release_master_grads()
        return
    if several:
        st.outside_before_block = True
        return
    refuse_outside_backward("scale_loss", OUTSIDE_BEFORE)


def _enter_block_thread(group: ScalerGroup) -> int:
    """Count a block open in this thread (returned: the block may close in another), refusing
    one while another thread has a block of the same wrap call open: blocks attribute each
    backward through flags their optimizers share, so two models of one call trained in two
    threads at once had one thread's backward taken as the other's block reaching its
    optimizer, and a step refused at random (an audit)."""
    here = threading.get_ident()
    with group.block_lock:
        others = [t for t in group.block_threads if t != here]
        if others:
            raise RuntimeError(
                "scale_loss: expected the scale_loss blocks of one distamp.wrap call to run one "
                f"at a time, found a block open in another thread (thread {others[0]}) as this "
                "one opens: models trained concurrently in threads need one distamp.wrap call "
                "each (each then has its own loss scale and skip decisions)"
            )
        group.block_threads[here] = group.block_threads.get(here, 0) + 1
    return here


def _leave_block_thread(group: ScalerGroup, opener: int) -> None:
    """The block ``opener`` opened is closed (in whichever thread: a generator's block closed
    from a worker thread raised a KeyError and its backward went unrecorded, an audit)."""
    with group.block_lock:
        left = group.block_threads.pop(opener, 1) - 1
        if left > 0:
            group.block_threads[opener] = left


def _close_block(
    states: list[Any], others: list[Any], before: list[bool], opener: int
) -> tuple[bool, list[Any]]:
    """A ``scale_loss`` block ended: whether its backward reached its optimizers, which of the
    others it reached, and each optimizer's "backward since step" flag restored with it."""
    for st in states:
        st.masters.blocks_open -= 1
    _leave_block_thread(states[0].group, opener)
    reached = any(st.backward_since_step for st in states)
    foreign = [o for o in others if o.backward_since_step]
    for st, seen in zip((*states, *others), before, strict=True):
        st.backward_since_step = st.backward_since_step or seen
    return reached, foreign


def unscale_(optimizer: torch.optim.Optimizer) -> None:
    """Unscale the pending gradients of ``optimizer`` now and make the step's skip decision.

    A collective over the wrapped process group (see ``optimizer.step``). Use it before inspecting
    or clipping gradients; ``step()`` then uses the decision without another collective.
    """
    _refuse_a_list(optimizer, "unscale_")
    states, disabled = _states(optimizer, "unscale_")
    if disabled is not None:
        return
    (st,) = states
    drop_cleared_gradients(st)
    if st.state is OptState.UNSCALED:
        raise RuntimeError(
            "unscale_() has already been called on this optimizer since the last step()"
        )
    if st.state is OptState.READY:
        if _grad_scaler_unscaled(st, optimizer):
            raise RuntimeError(
                "distamp.unscale_(): expected a scale_loss() backward to unscale, found this "
                "optimizer's gradients unscaled already by distamp.GradScaler.unscale_() (the "
                "GradScaler drives it: scale/unscale_/step/update are the scaler's); clip with "
                "distamp.clip_grad_norm_(optimizer, max_norm) or torch.nn.utils.clip_grad_norm_"
            )
        raise RuntimeError(
            "unscale_() was called but no distamp.scale_loss() backward ran on this optimizer since "
            "the last step(); expected `with distamp.scale_loss(loss, optimizer) as s: "
            "s.backward()` first" + _after_framework_backward(st)
        )
    unscale_now(st, "distamp.unscale_()")


def _grad_scaler_unscaled(st: Any, optimizer: torch.optim.Optimizer) -> bool:
    """A ``distamp.GradScaler`` drives this optimizer and unscaled its gradients this
    iteration (``scaler.unscale_(optimizer)``): the model's ``.grad`` are the true ones."""
    scaler = st.grad_scaler() if st.grad_scaler is not None else None
    if scaler is None:
        return False
    if not scaler.is_enabled():  # (`enabled=use_amp` off: torch's recipe clips at scale 1)
        return True
    return bool(scaler.unscaled((optimizer, inner_optimizer(optimizer))))


def _after_framework_backward(st: Any) -> str:
    """What to do instead, when a backward outside ``scale_loss`` (a framework's, or one a
    ``distamp.GradScaler`` scaled) did run."""
    if not st.backward_since_step:
        return ""
    scaler = st.grad_scaler() if st.grad_scaler is not None else None
    if scaler is not None and scaler.is_enabled():  # (it stepped this optimizer before)
        return (
            ". A backward did run, outside scale_loss: distamp.GradScaler drives this "
            "optimizer, so its gradients are still multiplied by the scaler's scale "
            f"({scaler.get_scale():g}); call scaler.unscale_(optimizer) first, then clip"
        )
    return (
        ". A backward did run, outside scale_loss. If distamp.GradScaler scaled its loss "
        "(scaler.scale(loss).backward()), call scaler.unscale_(optimizer) first: then this "
        "clips the unscaled gradients (they are still multiplied by the scale). If it was a "
        "framework's (Lightning's automatic "
        "optimization, accelerate's, the Trainer's): its gradients are unscaled already (scale "
        "1.0) and in the model's .grad, so clip them with torch.nn.utils.clip_grad_norm_("
        "model.parameters(), max_norm) (in Lightning, override configure_gradient_clipping so); "
        "step() takes what the clip changed"
    )


def clip_grad_norm_(
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the unscaled gradients the optimizer will step to a global norm of ``max_norm``.

    Unscales first when :func:`unscale_` was not called. Returns the total norm before clipping
    (inf/NaN when the step will be skipped; nothing is clipped then). With replicated masters the
    reduced gradients are identical on every rank, so the norm needs no collective.
    ``error_if_nonfinite`` and ``foreach`` are torch's (a torch habit passed them and got a
    TypeError): ``error_if_nonfinite=True`` raises on a non-finite norm, whose step would be
    skipped; ``foreach`` changes nothing (distamp's clipping uses its own fused kernels).
    """
    _refuse_a_list(optimizer, "clip_grad_norm_")
    states, disabled = _states(optimizer, "clip_grad_norm_")
    if disabled is not None:
        inner = inner_optimizer(optimizer) or optimizer
        fsdp1 = getattr(inner, DISABLED_FSDP1_ATTR, lambda: None)()
        params = [p for g in inner.param_groups for p in g["params"]]
        if fsdp1 is not None:  # the global norm: see DISABLED_FSDP1_ATTR
            if error_if_nonfinite:  # before anything is clipped, as torch (a review)
                _refuse_nonfinite_fsdp1_norm(params, norm_type, fsdp1.process_group)
            return fsdp1.clip_grad_norm_(max_norm, norm_type)
        norm = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
        )
        # FSDP2's inf-norm is a DTensor, Partial(max): each rank's own max until reduced (a
        # review: 1.02 on one rank, 0.83 on the other); the global norm, as everywhere else
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm
    (st,) = states
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() != 1:
        raise ValueError(
            f"clip_grad_norm_: max_norm: expected a number or a 1-element tensor, got a tensor "
            f"of shape {tuple(max_norm.shape)}"
        )
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float, torch.Tensor))
        or not float(max_norm) >= 0
    ):
        raise ValueError(
            f"clip_grad_norm_: max_norm: expected a non-negative number, got {max_norm!r}"
        )
    try:  # torch takes 'inf' and '2' too; checked before anything is unscaled (an audit)
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(
            f"clip_grad_norm_: norm_type: expected a number or 'inf', got {norm_type!r}"
        ) from None
    drop_cleared_gradients(st)
    if st.state is OptState.SCALED:
        st.group.unscale_and_decide(st, "distamp.clip_grad_norm_()")
    elif st.state is OptState.READY:
        if _grad_scaler_unscaled(st, optimizer):
            # torch's recipe with distamp.GradScaler (O0/O1/O3: no masters; the gradients are
            # the model's, DDP's reduced ones, identical on every rank): clip them as torch does
            held = inner_optimizer(optimizer) or optimizer
            scaler = st.grad_scaler() if st.grad_scaler is not None else None
            skip, own_part = scaler.decision((optimizer, held)) if scaler else (False, False)
            if skip:  # the step will be skipped: nothing clipped, as on distamp's own path
                if error_if_nonfinite:
                    _nonfinite_norm(float("inf"), norm_type)
                return torch.tensor(float("inf"))
            if own_part:
                # (an audit: each pipeline stage clipped to its own norm, silently)
                raise RuntimeError(
                    "clip_grad_norm_: expected the ranks of distamp.GradScaler's decision to "
                    "hold the same parameters and gradients (DDP replicas), found them holding "
                    "different ones (pipeline stages, model-parallel parts, or gradients DDP did "
                    "not reduce): the norm here would be this "
                    "rank's part only. Clip to the global norm yourself: each rank's "
                    "torch.nn.utils.get_total_norm(grads) squared, all-reduced (SUM) over a "
                    "group holding each part once (the pipeline's stages), and the square root "
                    "of the sum to torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)"
                )
            params = [p for g in held.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
            )
        raise RuntimeError(
            "clip_grad_norm_() was called but no distamp.scale_loss() backward ran on this "
            "optimizer since the last step()" + _after_framework_backward(st)
        )
    if st.overflow:
        if error_if_nonfinite:
            _nonfinite_norm(float("inf"), norm_type)
        return torch.tensor(float("inf"))
    exposed = bool(getattr(st.masters, "exposed", None))
    st.masters.take_modified_model_grads()
    total = st.masters.clip_(max_norm, norm_type)
    if error_if_nonfinite:  # float() waits for the norm: only when asked (no sync otherwise)
        _nonfinite_norm(float(total), norm_type)
    if st.unscaled_shards is not None:  # its own clipping of the shards is the global one
        st.record_shard_grads()
    if exposed:  # (distamp.unscale_ first: the model's .grad show what steps)
        st.masters.expose_clipped(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    elif st.masters.separate_params():
        # still scaled and unclipped: an edit now would not reach the masters (said at step)
        params = st.masters.separate_params()
        st.clipped_grads = list(zip(params, grad_versions(params), strict=True))
    return total


def _nonfinite_norm(total: float, norm_type: float) -> None:
    """``clip_grad_norm_(..., error_if_nonfinite=True)``: refuse a non-finite norm."""
    if not math.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: expected a finite total norm (error_if_nonfinite=True), found "
            f"{total} (order {norm_type}): the gradients overflowed, and optimizer.step() "
            "skips this step and lowers the loss scale; under a dynamic loss scale an overflow "
            "is expected now and then: leave error_if_nonfinite=False (torch's default)"
        )


def stats(optimizer: torch.optim.Optimizer) -> AmpStats:
    """This rank's counters, loss scales and memory for a wrapped optimizer."""
    _refuse_a_list(optimizer, "stats")
    states, disabled = _states(optimizer, "stats")
    if disabled is not None:
        return AmpStats(
            steps=0,
            skipped_steps=0,
            last_step_skipped=False,
            loss_scales=(1.0,) * disabled.num_losses,
            master_bytes=0,
            optimizer_state_bytes=_state_bytes(inner_optimizer(optimizer) or optimizer),
        )
    (st,) = states
    driver = st.grad_scaler() if st.grad_scaler is not None else None
    return AmpStats(
        steps=st.steps,
        skipped_steps=st.skipped_steps,
        last_step_skipped=st.last_step_skipped,
        loss_scales=tuple(  # under distamp.GradScaler its scale is the one in use
            s.scale if driver is None else float(driver.get_scale()) for s in st.group.scalers
        ),
        master_bytes=st.masters.master_bytes(),
        optimizer_state_bytes=_state_bytes(inner_optimizer(optimizer) or optimizer),
        last_nonfinite=st.last_nonfinite,
    )


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (of a DTensor, FSDP2's, its local shard)."""
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local = local_tensor(value)
                total += local.numel() * local.element_size()
    return total
