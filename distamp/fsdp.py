"""FSDP: the opt_level as FSDP's own mixed-precision policy, plus what FSDP lacks.

[Note: FSDP keeps the masters] FSDP already holds each rank's shard of the parameters in FP32 and
casts them to ``param_dtype`` for forward/backward; its sharded FP32 parameters *are* the master
weights, so distamp adds no second copy. :func:`fully_shard` turns the opt_level into FSDP's policy
(``MixedPrecisionPolicy`` for FSDP2, ``MixedPrecision`` for FSDP1) and adds what FSDP does not
have: the loss scaler whose skip decision is one MAX all-reduce of the local found-inf flags on
every code path (fused optimizers included, where torch's ShardedGradScaler skips the sync),
apex's opt_level semantics, ``stats``, clipping on the global norm, and the checkpoint functions.

[Note: FSDP units for FP32 norm layers] FSDP casts all parameters of one unit to one dtype, so
under O2 (``keep_batchnorm_fp32``) every normalization layer becomes its own FSDP unit with FP32
parameters (FSDP1 does the same for BatchNorm through ``_module_classes_to_ignore``). Its class
gets distamp's FP32-norm forward: inputs cast up, outputs cast back to the incoming dtype, so the
half layers around it see half tensors. The cost is one small all-gather per norm layer.

Order: build the FP32 model and its optimizer, then ``model, optimizer = distamp.fsdp.
fully_shard(model, optimizer, opt_level=...)``. The optimizer's ``param_groups`` are re-pointed at
FSDP's sharded parameters, so it keeps its identity (an LR scheduler built on it keeps working).
A model that FSDP wrapped already, or that ``distamp.wrap`` cast already, is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import casting
from .casting import NORM_TYPES, FP32NormModule
from .checks import check_models, check_optimizers, fingerprint
from .collectives import (
    all_reduce_,
    broadcast_from_rank0_,
    check_same_on_all_ranks,
    checks_on_every_rank,
)
from .config import (
    DISABLED_FSDP1_ATTR,
    HALF_DTYPES,
    Properties,
    mark_disabled,
    resolve_properties,
    warn_from_caller,
)
from .masters.base import ModelGrads, local_tensor
from .masters.clipping import norm_part, scale_to_max_norm_, total_norm
from .masters.nonfinite import check_and_unscale_
from .masters.optimizer import AmpOptimizer, AmpOptimizerState, backward_reached
from .scaler import ScalerGroup, scaler_facts, split_loss_scale

BlockSpec = Sequence[type[nn.Module] | nn.Module] | Callable[[nn.Module], bool] | None


class FSDPParams(ModelGrads):
    """FSDP's sharded parameters as their own masters (the MasterWeights interface of masters/base.py)."""

    sharded = True
    fsdp = True

    def __init__(
        self, params: list[nn.Parameter], process_group: dist.ProcessGroup | None, props: Properties
    ) -> None:
        self.model_params = params
        self.process_group = process_group
        self.props = props
        self.model: weakref.ref[nn.Module] | None = None
        """The sharded model (weak), for the gradients FSDP holds unreduced: see
        :meth:`rescale_grads_`."""
        self.backward_seen: Callable[[torch.Tensor], None] | None = None
        """The hook :meth:`watch_unsharded` puts on the unsharded parameters (see
        :class:`UnshardedReached`)."""
        self.watched: set[int] = set()
        """ids of the sharded parameters whose unsharded ones carry ``backward_seen``."""
        self.watched_directly: set[int] = set()
        """ids of the sharded parameters that carry it themselves."""

    def add_group(
        self, params: list[nn.Parameter], *, fp32_masters: bool = True
    ) -> list[torch.Tensor]:
        """``optimizer.add_param_group`` (progressive unfreezing): FSDP's sharded parameters of
        the model are their own masters, stepped as they are, unscaled and checked like the
        first ones."""
        self.model_params.extend(params)
        return list(params)

    def _local_grads(self) -> list[torch.Tensor]:
        return [local_tensor(p.grad) for p in self.model_params if p.grad is not None]

    def model_grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.model_params]

    def scaled_grad_sample(self) -> torch.Tensor | None:
        """The bits of the first few values of every local gradient shard: torch's foreach ops
        on DTensors (clip_grad_norm_'s default path) write the local shards without moving any
        version counter, so a clip of the still-scaled gradients went unwarned under FSDP (an
        audit: a norm of 44436 clipped to 1, an update 1e-5 of the right one, silently). Compared
        bit for bit, so a NaN sample equals itself."""
        samples = [g.reshape(-1)[:4].float() for g in self._local_grads()]
        return torch.cat(samples).view(torch.int32) if samples else None

    def after_cast(self) -> None:
        """FSDP casts for the forward itself."""

    def unscale_and_check(self, inv_scale: float) -> torch.Tensor:
        return check_and_unscale_(self._local_grads(), inv_scale, self._device())

    def check(self) -> torch.Tensor:
        """A 0/1 flag of non-finite gradients, reduced or still held by FSDP (several losses
        attribute each block's new non-finite values: see ``finish_backward``)."""
        grads = self._local_grads() + self.unreduced_grads()
        return check_and_unscale_(grads, 1.0, self._device())

    def check_each(self) -> torch.Tensor:
        """One flag for all (as :meth:`check`), not one per parameter: FSDP moves gradients from
        its unreduced buffers into the sharded ``.grad`` when it reduces, so a value one block
        made non-finite would look new in another parameter slot after the next block's reduce
        (see [Note: which block made a gradient non-finite] in scaler.py)."""
        return self.check()

    def step_grads(self) -> list[torch.Tensor]:
        return self._local_grads()

    def rescale_grads_(self, factor: float) -> None:
        """Pending gradients down to a new block's smaller scale (several losses): the sharded
        ``.grad`` and, under ``set_requires_gradient_sync(False)``, the unsharded gradients FSDP
        accumulates in its own buffers until it reduces them — missed, the reduced sum mixed two
        scales (an audit: weights off by 1e10)."""
        grads = self._local_grads() + self.unreduced_grads()
        if grads and factor != 1.0:
            with torch.no_grad():
                torch._foreach_mul_(grads, factor)

    def _param_groups(self) -> list[Any]:
        """FSDP2's param groups of every unit of the model. FSDP's internals: a torch whose
        layout is neither 2.11's nor 2.13's raises rather than leave gradients at an old scale or
        dtype."""
        model = self.model() if self.model is not None else None
        out: list[Any] = []
        for module in model.modules() if model is not None else ():
            state_of = getattr(module, "_get_fsdp_state", None)
            if state_of is None:
                continue
            state = state_of()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: one per mesh
            if groups is None and hasattr(state, "_fsdp_param_group"):  # torch 2.11: one or None
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            if groups is None:  # read none: the reduced sum would mix two scales, silently
                raise RuntimeError(
                    f"distamp: expected FSDP2's state of module {type(module).__name__} to hold "
                    "_fsdp_param_groups (torch 2.13) or _fsdp_param_group (torch 2.11), found "
                    f"neither in torch {torch.__version__}: the gradients it accumulates unreduced "
                    "under set_requires_gradient_sync(False) cannot be brought to a later loss's "
                    "scale. Sync every micro-batch, or use one loss scale (num_losses=1)."
                )
            out.extend(groups)
        return out

    def unreduced_grads(self) -> list[torch.Tensor]:
        """The gradients FSDP2 holds unsharded and unreduced (accumulation without sync): its
        FSDPParam objects' ``unsharded_accumulated_grad`` (reduce dtype) or their unsharded
        parameters' ``.grad``."""
        out: list[torch.Tensor] = []
        for param_group in self._param_groups():
            for fsdp_param in getattr(param_group, "fsdp_params", ()):
                held = getattr(fsdp_param, "unsharded_accumulated_grad", None)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (held, getattr(unsharded, "grad", None)):
                    if isinstance(grad, torch.Tensor):
                        out.append(local_tensor(grad))
        return out

    def before_backward(self) -> None:
        """[Note: a unit unfrozen after FSDP's first forward] FSDP2 fixes each unit's original
        and reduce dtypes once, at its lazy init, from the parameters that required grad then;
        a unit wholly frozen then (a backbone block, unfrozen later by ``requires_grad_(True)``
        and perhaps ``add_param_group``) keeps none, and its first backward failed inside torch
        ("attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype
        Float") at O2 (an audit; torch's own fully_shard with a MixedPrecisionPolicy fails
        alike). Before each backward, such a unit that has trainable parameters now has its
        dtypes set as its lazy init would have set them."""
        groups = self._param_groups()
        for param_group in groups:
            params = getattr(param_group, "fsdp_params", ())
            if getattr(param_group, "_orig_dtype", False) is None and any(
                fsdp_param.sharded_param.requires_grad for fsdp_param in params
            ):
                param_group._init_mp_dtypes()
        self.watch_unsharded(groups)

    def watch_unsharded(self, groups: list[Any]) -> None:
        """Put ``backward_seen`` on the unsharded parameter of each trainable sharded one the
        optimizer holds (see :class:`UnshardedReached`). FSDP2 makes it at a unit's first
        all-gather and keeps it (its storage is freed and refilled), so this runs as each block
        begins, after a forward, and hooks what it has not yet; a parameter still frozen, or a
        unit not yet gathered, is hooked at a later block."""
        if self.backward_seen is None:
            return
        trainable = [p for p in self.model_params if p.requires_grad]
        wanted = {id(p) for p in trainable}
        if wanted <= self.watched:
            return
        for param in trainable:
            # The sharded parameters themselves: a backward through them outside any forward
            # (an L2 penalty over model.parameters()) accumulates into them directly, where
            # FSDP only ever assigns their .grad (a review: such a penalty was divided by the
            # loss scale, silently).
            if id(param) not in self.watched_directly and param.is_leaf:
                param.register_post_accumulate_grad_hook(self.backward_seen)
                self.watched_directly.add(id(param))
        for param_group in groups:
            for fsdp_param in getattr(param_group, "fsdp_params", ()):
                sharded = getattr(fsdp_param, "sharded_param", None)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if id(sharded) not in wanted or id(sharded) in self.watched:
                    continue
                if not isinstance(unsharded, torch.Tensor):
                    continue
                if unsharded.requires_grad and unsharded.is_leaf:
                    unsharded.register_post_accumulate_grad_hook(self.backward_seen)
                    self.watched.add(id(sharded))

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Collective: the norm over every shard of every gradient, each shard counted once (FP32
        accumulation).

        A gradient's shards are summed over the mesh dimensions it is sharded on only: under
        HSDP (a 2-D mesh, replicated x sharded) the replicas hold the same shard, and summing
        over the whole world would count it once per replica.
        """
        inf_norm = math.isinf(norm_type)
        op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
        device = self._device()
        by_groups: dict[tuple[int, ...], tuple[list[Any], list[torch.Tensor]]] = {}
        for p in self.model_params:
            if p.grad is None:
                continue
            groups = self._shard_groups(p.grad)
            entry = by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))
            entry[1].append(local_tensor(p.grad))
        parts = [torch.zeros(1, dtype=torch.float32, device=device)]
        for groups, grads in by_groups.values():
            part = norm_part(grads, norm_type, device)
            for group in groups:
                all_reduce_(part, op, group)
            parts.append(part)
        total = total_norm(torch.cat(parts), norm_type)
        scale_to_max_norm_([g for _, grads in by_groups.values() for g in grads], total, max_norm)
        return total

    def _shard_groups(self, grad: torch.Tensor) -> list[Any]:
        """The process groups a gradient's shards are spread over (one per sharded mesh dim)."""
        mesh = getattr(grad, "device_mesh", None)
        if mesh is None:  # FSDP1: flat shards over the process group
            return [self.process_group]
        from torch.distributed.tensor import Shard

        return [
            mesh.get_group(dim)
            for dim, placement in enumerate(grad.placements)  # type: ignore[attr-defined]
            if isinstance(placement, Shard)
        ]

    def copy_to_model(self, *, after_step: bool = False) -> None:
        """The optimizer stepped FSDP's own parameters: nothing to copy."""

    def release_master_grads(self) -> None:
        """The gradients are FSDP's; zero_grad releases them."""

    def zero_model_grads(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad()`` also drops what FSDP2 accumulates unsharded and unreduced
        under ``set_requires_gradient_sync(False)`` (see :meth:`unreduced_grads`): a window
        discarded there (a NaN loss seen in the all-reduced loss) was added into the next step
        anyway, or skipped it, while DDP's ``no_sync`` discarded it exactly (an audit). A
        module's own ``zero_grad()`` is FSDP2's and leaves them, as torch's does."""
        super().zero_model_grads(set_to_none)
        for param_group in self._param_groups():
            for fsdp_param in getattr(param_group, "fsdp_params", ()):
                if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                    fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if isinstance(unsharded, torch.Tensor) and unsharded.grad is not None:
                    unsharded.grad = None

    def master_bytes(self) -> int:
        """FP32 shards held here when they stand in for master weights (O2), else 0. The FP32
        norm units' shards are FP32 weights computing in FP32, their own masters: 0, as wrap's
        O2 counts its FP32 norm layers (an audit: counted here, not there)."""
        if not self.props.master_weights:
            return 0
        model = self.model() if self.model is not None else None
        own = {
            id(p)
            for m in (_norm_units(model, self.props) if model is not None else ())
            for p in m.parameters(recurse=False)
        }
        return sum(
            local_tensor(p).numel() * local_tensor(p).element_size()
            for p in self.model_params
            if id(p) not in own
        )

    def master_tensors(self) -> list[torch.Tensor]:
        return []

    def load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, names: dict[int, str]
    ) -> None:
        """Weights load straight into FSDP's FP32 shards."""


def policy_kwargs(props: Properties, root: bool) -> dict[str, Any]:
    """The FSDP mixed-precision settings of an opt_level (``MixedPrecisionPolicy`` arguments).

    O2/O3: parameters gathered and gradients reduce-scattered in the half dtype (like DDP's O2
    hook), inputs cast to it; the root's outputs come back FP32 (or ``cast_model_outputs``).
    O0/O1: FP32 parameters and reductions; O1 runs the forward under autocast (distamp's
    class-level forward), as with DDP.
    """
    if props.cast_model_type in HALF_DTYPES:
        out: dict[str, Any] = {
            "param_dtype": props.cast_model_type,
            "reduce_dtype": props.cast_model_type,
            "cast_forward_inputs": True,
        }
        if root:
            out["output_dtype"] = props.cast_model_outputs or torch.float32
        return out
    return {"param_dtype": None, "reduce_dtype": None, "cast_forward_inputs": True}


def _blocks(model: nn.Module, blocks: BlockSpec) -> list[nn.Module]:
    """The modules that become FSDP units, innermost first (the root is added by the caller).

    FSDP2 requires a module's submodules to be sharded before it is (MoE experts in a
    ``ModuleList`` inside each transformer block: experts first, then the blocks), so the
    candidates are taken in post-order: every module after all of its descendants.
    """
    chosen: Callable[[nn.Module], bool]
    if blocks is None:
        in_lists = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
        chosen = lambda m: id(m) in in_lists and not isinstance(m, nn.ModuleList)  # noqa: E731
        if not in_lists:
            _warn_blocks_in_a_sequential(model)
    elif callable(blocks) and not isinstance(blocks, (list, tuple)):
        predicate = blocks  # a container it picks is passed over, as FSDP1's size policy does
        chosen = lambda m: not _container(m) and bool(predicate(m))  # noqa: E731
    else:
        classes = tuple(b for b in blocks if isinstance(b, type))
        ids = {id(b) for b in blocks if isinstance(b, nn.Module)}
        # A container named (blocks=[nn.ModuleList], a ModuleDict) stands for its children,
        # down to the first that are not containers (a review: a nested list gave no units).
        named = [
            m for m in model.modules() if _container(m) and (isinstance(m, classes) or id(m) in ids)
        ]
        while named:
            children = [c for m in named for c in m.children()]
            ids |= {id(c) for c in children}
            named = [c for c in children if _container(c)]
        chosen = lambda m: not _container(m) and (isinstance(m, classes) or id(m) in ids)  # noqa: E731
    out = [m for m in _post_order(model) if m is not model and chosen(m)]
    if blocks is not None and not out and (callable(blocks) or len(blocks) > 0):
        # A spec selecting nothing (a class imported from another model's file, a predicate
        # bug): the model was one unit, ZeRO-3's memory saving gone, silently (an audit).
        what = (
            getattr(blocks, "__name__", repr(blocks))
            if callable(blocks) and not isinstance(blocks, (list, tuple))
            else [getattr(b, "__name__", type(b).__name__) for b in blocks]
        )
        warn_from_caller(
            f"distamp.fsdp.fully_shard: blocks={what} selects no submodule of the model, so it "
            "is one unit and every forward gathers all of its weights; expected module classes "
            "the model holds (or modules of this model, or a predicate true for some): "
            "blocks=() keeps the model one unit, unwarned"
        )
    return out


def _container(module: nn.Module) -> bool:
    """An ``nn.ModuleList``/``nn.ModuleDict`` without a forward of its own, which FSDP2's
    ``fully_shard`` refuses ("containers that do not implement forward")."""
    return (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    )


def _check_blocks(blocks: object) -> BlockSpec:
    """``blocks`` as :func:`_blocks` takes it, refused by name before anything changes. A bare
    class (``blocks=Block`` for ``[Block]``) was called as a predicate, constructing a Block of
    every submodule; module objects (torch's ``fully_shard`` takes those: ``list(model.blocks)``,
    ``model.blocks``) failed inside isinstance or forward, after the model was cast (an audit).
    Classes and module objects are both taken now, a container standing for its children."""
    if blocks is None:
        return None
    if isinstance(blocks, type):
        if not issubclass(blocks, nn.Module):
            raise TypeError(
                f"distamp.fsdp.fully_shard: blocks: expected nn.Module classes, found the class "
                f"{blocks.__name__}"
            )
        return (blocks,)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return tuple(blocks)
    if isinstance(blocks, nn.Module):
        return (blocks,)
    if isinstance(blocks, (list, tuple)):
        for i, entry in enumerate(blocks):
            if not (
                (isinstance(entry, type) and issubclass(entry, nn.Module))
                or isinstance(entry, nn.Module)
            ):
                raise TypeError(
                    f"distamp.fsdp.fully_shard: blocks[{i}]: expected an nn.Module class (the "
                    f"blocks' type, [Block]) or a module of the model, found "
                    f"{type(entry).__name__} {entry!r:.60}"
                )
        return tuple(blocks)
    if callable(blocks):
        return blocks
    raise TypeError(
        f"distamp.fsdp.fully_shard: blocks: expected None, a list of nn.Module classes or modules, "
        f"or a function of a module returning True for each FSDP unit, found "
        f"{type(blocks).__name__} {blocks!r:.60}"
    )


def _warn_blocks_in_a_sequential(model: nn.Module) -> None:
    """Blocks in an ``nn.Sequential`` (timm's ViT ``blocks``, torchvision's ResNet layers) are not
    FSDP units by default: the model was one unit, every forward gathering all of its weights
    — the lowest-memory property lost, silently (an audit). Named, with ``blocks=``."""
    for name, seq in model.named_modules():
        kinds = {type(child) for child in seq.children()}
        if (
            isinstance(seq, nn.Sequential)
            and len(seq) > 1
            and len(kinds) == 1
            and any(True for _ in seq[0].parameters())
            and any(True for _ in seq[0].children())  # blocks, not a stack of Linear layers
        ):
            (kind,) = kinds
            warn_from_caller(
                f"distamp.fsdp.fully_shard: found no nn.ModuleList of blocks (the default FSDP "
                f"units), so the model is one unit and every forward gathers all of its "
                f"weights; {name or 'the model'!r} is an nn.Sequential of {len(seq)} "
                f"{kind.__name__}: expected blocks=[{kind.__name__}] to shard per block "
                "(blocks=() keeps the model one unit, unwarned)"
            )
            return


def _post_order(root: nn.Module) -> list[nn.Module]:
    """Every module under ``root`` once, each after all of its descendants."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack: list[tuple[nn.Module, bool]] = [(root, False)]
    while stack:
        module, expanded = stack.pop()
        if expanded:
            out.append(module)
            continue
        if id(module) in seen:
            continue
        seen.add(id(module))
        stack.append((module, True))
        stack.extend((child, False) for child in reversed(list(module.children())))
    return out


def _refuse_scalar_params(model: nn.Module) -> None:
    """torch's fully_shard refuses a 0-dim parameter (CLIP's ``logit_scale``) when it reaches the
    module holding it — the root, last, after the blocks were sharded: the model was left half
    sharded (an audit). Named before anything is sharded."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"distamp.fsdp.fully_shard: expected parameters of at least one dimension (FSDP2 "
            f"shards along dim 0 and refuses scalars), found 0-dim {scalars[:5]}"
            f"{' and more' if len(scalars) > 5 else ''}: make each a 1-element tensor, e.g. "
            "nn.Parameter(torch.tensor([value])), or use distamp.wrap + DDP"
        )


def _group_of_mesh(mesh: Any, process_group: dist.ProcessGroup | None, api: str) -> Any:
    """The group the scaler decides over: every rank of FSDP's mesh, which share its gradients.

    A mesh spanning other ranks than ``process_group`` was taken, and the ranks sharing FSDP's
    reduce-scatter decided apart: an inf on one rank skipped the step on half of them and their
    loss scales parted, the shards half-updated (an audit, a mesh per pair of ranks, nothing
    warned). A 1-D mesh without ``process_group`` brings its own group.
    """
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"distamp.fsdp.fully_shard: process_group: expected a torch.distributed ProcessGroup "
            f"or None, got {type(process_group).__name__} {process_group!r:.60}"
        )
    if mesh is not None and not hasattr(mesh, "get_group"):
        raise TypeError(
            f"distamp.fsdp.fully_shard: mesh: expected a DeviceMesh (init_device_mesh) or None, "
            f"got {type(mesh).__name__} {mesh!r:.60}"
        )
    group = process_group or dist.group.WORLD
    if mesh is None:
        return group
    if api != "fsdp2":
        raise ValueError(
            f"distamp.fsdp.fully_shard: mesh is for api='fsdp2', found api={api!r}; expected "
            "process_group=... for FullyShardedDataParallel"
        )
    # torch checks these inside fully_shard, after the model was cast and its classes swapped:
    # a retry with the right mesh then failed on the half-converted model (an audit).
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"distamp.fsdp.fully_shard: mesh: expected a 1-D (FSDP) or 2-D (HSDP) DeviceMesh, "
            f"found {mesh.ndim}-D shape {tuple(mesh.mesh.shape)}"
        )
    if mesh.ndim == 2 and not mesh.mesh_dim_names:
        raise ValueError(
            f"distamp.fsdp.fully_shard: mesh: expected a 2-D (HSDP) mesh with its dimensions "
            f"named, found shape {tuple(mesh.mesh.shape)} without mesh_dim_names: "
            'init_device_mesh(..., mesh_dim_names=("replicate", "shard"))'
        )
    mesh_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    group_ranks = sorted(dist.get_process_group_ranks(group))
    if mesh_ranks == group_ranks:
        return group
    if process_group is None and mesh.ndim == 1:
        return mesh.get_group()
    given = "process_group" if process_group is not None else "the default group (the world)"
    raise ValueError(
        f"distamp.fsdp.fully_shard: expected the mesh and the process group to span the same "
        f"ranks (the loss scaler's skip decision runs over the group, FSDP shares gradients over "
        f"the mesh); found mesh ranks {mesh_ranks} and {given} ranks {group_ranks}: pass "
        f"process_group= spanning the mesh's ranks"
    )


def fully_shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    opt_level: str = "O2",
    half_dtype: Any = "auto",
    blocks: BlockSpec = None,
    api: str = "fsdp2",
    mesh: Any = None,
    reshard_after_forward: bool = True,
    process_group: dist.ProcessGroup | None = None,
    **overrides: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Shard an FP32 ``model`` with FSDP at ``opt_level`` and make ``optimizer`` distamp's.

    ``blocks``: the submodules that become FSDP units (module classes, a predicate, or None for
    every element of every ``nn.ModuleList``, e.g. transformer layers); the root always is one.
    ``api``: "fsdp2" (``torch.distributed.fsdp.fully_shard``) or "fsdp1"
    (``FullyShardedDataParallel`` with ``use_orig_params=True``; it returns the wrapper, use the
    returned model). ``overrides``: the property overrides of :func:`distamp.wrap`
    (``loss_scale``, ``keep_batchnorm_fp32``, ``min_loss_scale``, ...). ``mesh``: FSDP2's
    ``DeviceMesh`` (a 2-D one for HSDP; default: one over ``process_group``); its ranks must be
    ``process_group``'s, over which the loss scaler decides (a 1-D mesh alone brings its group).
    Collective over the process group (default: the world).
    """
    if api not in ("fsdp2", "fsdp1"):
        raise ValueError(f"api: expected 'fsdp2' or 'fsdp1', got {api!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, AmpOptimizer) and optimizer._distamp.masters.fsdp:
        raise ValueError(  # (an audit: the message below told them to call this very function)
            "distamp.fsdp.fully_shard: this optimizer (and its model) went through "
            "distamp.fsdp.fully_shard already; expected it once per model: use the model and "
            "optimizer the first call returned"
        )
    wrapper = casting.data_parallel_wrapper_name(model)
    if wrapper is not None:
        raise ValueError(
            f"distamp.fsdp.fully_shard: the model is sharded or wrapped already ({wrapper}); "
            "expected the plain FP32 model: call distamp.fsdp.fully_shard(model, optimizer, "
            "opt_level=...) instead of torch's fully_shard/FSDP (it applies them with the "
            "opt_level's mixed-precision policy)"
        )
    if casting.is_wrapped(model) or isinstance(optimizer, AmpOptimizer):
        raise ValueError(
            "distamp.fsdp.fully_shard: the model or optimizer went through distamp.wrap "
            "already; with FSDP call distamp.fsdp.fully_shard on the FP32 model instead of wrap"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "distamp.fsdp.fully_shard: expected an initialized process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    _check_overrides(overrides)
    from .wrap import _enabled_flag

    enabled = _enabled_flag(overrides.pop("enabled", True))
    # FSDP shards the parameters themselves, and with them their FP32 values and optimizer state:
    # apex's "shard the masters" switch can only be on (or left to its default) here.
    if overrides.pop("shard_master_weights", None) is False:
        raise ValueError(
            "distamp.fsdp.fully_shard: shard_master_weights=False, but FSDP always shards the "
            "parameters, their FP32 masters and their optimizer state; expected True or no "
            "shard_master_weights (replicated masters: distamp.wrap + DistributedDataParallel)"
        )
    group = _group_of_mesh(mesh, process_group, api)
    world = dist.get_world_size(group)
    device_type = casting.device_type_of(model)
    on_meta = device_type == "meta"
    if on_meta:  # see [Note: meta-device models under FSDP]: the device they will be made on
        device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    # A check failing on one rank only must not leave the others waiting in the next collective.
    with checks_on_every_rank("distamp.fsdp.fully_shard", group, disabled=not enabled):
        template = None
        if "loss_scale" in overrides:
            (
                overrides["loss_scale"],
                overrides["min_loss_scale"],
                overrides["max_loss_scale"],
                template,
            ) = split_loss_scale(
                overrides["loss_scale"],
                overrides.get("min_loss_scale"),
                overrides.get("max_loss_scale", 2.0**24),
            )
        props = resolve_properties(
            opt_level,
            device_type=device_type,
            half_dtype=half_dtype,
            world_size=world,
            shard_master_weights=False,
            **overrides,
        )
        props = dataclasses.replace(props, shard_master_weights=world > 1)
        names = check_models([model], meta_ok=True)
        check_optimizers([optimizer], names, api="distamp.fsdp.fully_shard")
        if api == "fsdp2":
            _refuse_scalar_params(model)
        blocks = _check_blocks(blocks)
    check_same_on_all_ranks(
        "distamp.fsdp.fully_shard",
        fingerprint(props, [model], [optimizer]) + scaler_facts(template),
        group,
    )
    from .wrap import _states_of, _warn_about_eps

    if enabled:
        _warn_about_eps([optimizer], props, "distamp.fsdp.fully_shard")
    if on_meta and device_type == "cpu" and api == "fsdp2":  # (FSDP1 holds no DTensors)
        warnings.warn(
            "distamp.fsdp.fully_shard: a model on the meta device, sharded over CPU ranks: "
            "torch's DTensor random ops have no distributed RNG on CPU, so a random "
            "initialization after model.to_empty(device='cpu') draws every rank's shard from the "
            "same stream (the shards of a weight come out identical; torch warns 'DTensor random "
            "operators may not have complete support on cpu device mesh'). Expected on CPU: "
            "build the model on the CPU (not meta), or load its weights after to_empty",
            stacklevel=2,
        )
    old_names = {id(p): n for n, p in model.named_parameters()}
    # FSDP shards each rank's own weights: rank 0's become everyone's first, as DDP would do.
    # [Note: meta-device models under FSDP] torchtitan's habit for models larger than one rank:
    # build the model on the meta device, shard it, then ``model.to_empty(device=...)`` and
    # initialize the weights, each rank its own shard (on GPUs DTensor's random ops keep the
    # ranks' shards parts of one tensor; on CPU they do not: warned above). FSDP's sharded FP32
    # parameters are the masters here, so there is nothing to copy at this point: the policies,
    # the FP32 norm units and the scaler are set up on the meta parameters, to_empty keeps the
    # parameter objects (the optimizer's references stay valid), and the weights are whatever
    # the initialization writes — rank 0's are not broadcast (there are none yet).
    if not on_meta:
        broadcast_from_rank0_(_states_of([model], {}), group)

    def apply(module: nn.Module, properties: Properties) -> nn.Module:
        if api == "fsdp1":
            return _apply_fsdp1(module, properties, blocks, group)
        _apply_fsdp2(module, properties, blocks, mesh, group, device_type, reshard_after_forward)
        return module

    if not enabled:
        return _shard_disabled(
            model, optimizer, opt_level, props.num_losses, apply, device_type, group
        )

    if props.model_is_cast and not props.master_weights:
        # [Note: O3 under FSDP] O3 has no FP32 masters: the weights FSDP shards (and the
        # optimizer steps) are half, as wrap's O3 makes them. Left FP32, FSDP's sharded
        # parameters were FP32 masters by another name (an audit: FP32 parameters and AdamW
        # state under "O3", twice the bytes, and stats' master_bytes reported 0).
        casting.cast_tensors(model, casting.plan_precision([model], props))
    elif props.model_is_cast:
        # O2: FSDP's policy casts the parameters; the float buffers of modules with weights
        # (an additive attention mask, a position table) are cast with them here, as wrap's O2
        # casts them (the norm layers' and parameter-less modules' stay FP32). Left FP32, a
        # bf16 score plus an FP32 mask promoted to FP32 and met the next bf16 weight: "expected
        # scalar type Float but found BFloat16" at the first forward, under FSDP only (an audit).
        plan = casting.plan_precision([model], props)
        # The buffers cast with their module's weights are named, as wrap names them (an audit:
        # a position table stopped at 256 under FSDP, silently; torch's FSDP2 casts none).
        casting.warn_about_plan([model], plan, props, api="distamp.fsdp.fully_shard")
        casting.cast_tensors(model, dataclasses.replace(plan, cast_params=frozenset()))
    _set_forward_classes(model, props, device_type)
    model = apply(model, props)
    new_params = dict(model.named_parameters())
    new_params = {_strip_fsdp1(n): p for n, p in new_params.items()}
    _repoint_optimizer(optimizer, old_names, new_params)

    params = [p for g in optimizer.param_groups for p in g["params"]]
    masters = FSDPParams(params, group, props)
    masters.model = weakref.ref(model)
    scalers = ScalerGroup(props, group, {id(p): n for n, p in new_params.items()}, template)
    from .wrap import _make_amp_optimizer

    st = AmpOptimizerState(scalers, 0, masters)
    _make_amp_optimizer(optimizer, st)
    masters.backward_seen = UnshardedReached(st)
    return model, optimizer


class UnshardedReached:
    """[Note: a backward outside scale_loss under FSDP] ``distamp.wrap`` sees every backward
    through a post-accumulate-grad hook on each parameter (``BackwardSeen``). FSDP accumulates
    into its unsharded parameters and then assigns the sharded ``.grad``, which no such hook
    sees, so a ``loss.backward()`` after a ``scale_loss`` block and before ``step()`` added
    gradients at scale 1.0 to the block's at the loss scale, and the step divided the sum by
    it: that loss's share shrank 65536-fold at O2 fp16, with only a warning blaming clipping
    (an audit); and ``loss.backward()`` inside a block (apex's slip: updates 1/scale too
    small) went unwarned. This hook goes on the unsharded parameter FSDP2 keeps for each
    sharded one the optimizer holds (see :meth:`FSDPParams.watch_unsharded`), and does what
    ``BackwardSeen`` does: it records that a backward reached them, and marks one that runs
    while the optimizer's gradients are scaled and no block of its group is open, refused at
    the next block or the step. ``torch.autograd.grad`` (a gradient penalty) accumulates
    nothing and fires no such hook. (Hooks on the model's outputs, then on whatever each
    module held in its forward, missed a dataclass output and a parameter used functionally,
    mistook the input's or another optimizer's parameters for this one's, and cost every
    forward: reviews.) Holds the optimizer's state weakly (see ``BackwardSeen``)."""

    def __init__(self, st: AmpOptimizerState) -> None:
        self.st = weakref.ref(st)

    def __call__(self, _: torch.Tensor) -> None:
        st = self.st()
        if st is None:
            return
        backward_reached(st)


OVERRIDES = frozenset(
    {
        "enabled",
        "cast_model_type",
        "patch_torch_functions",
        "keep_batchnorm_fp32",
        "master_weights",
        "loss_scale",
        "cast_model_outputs",
        "num_losses",
        "verbosity",
        "min_loss_scale",
        "max_loss_scale",
        "max_consecutive_skips",
        "shard_master_weights",
    }
)
"""The property overrides of :func:`distamp.wrap` that :func:`fully_shard` takes."""


def _check_overrides(overrides: dict[str, Any]) -> None:
    """Refuse, by name, an override ``fully_shard`` does not take (an audit: a typo or wrap's
    ``keep_fp32_modules`` failed inside a private function, "resolve_properties() got an
    unexpected keyword argument")."""
    unknown = sorted(set(overrides) - OVERRIDES)
    if not unknown:
        return
    hint = ""
    if "keep_fp32_modules" in unknown:
        hint = (
            "; keep_fp32_modules is distamp.wrap's (DDP): FSDP casts all parameters of one unit "
            "to one dtype, and under FSDP only normalization layers become FP32 units "
            "(distamp.doctor.kept_fp32(model) lists the ones recognized); for another module "
            "kept FP32 use O1 (autocast) or distamp.wrap with DistributedDataParallel"
        )
    raise TypeError(
        f"distamp.fsdp.fully_shard: unexpected keyword argument(s) {', '.join(unknown)}; "
        f"expected opt_level, half_dtype, blocks, api, mesh, reshard_after_forward, "
        f"process_group or one of wrap's property overrides "
        f"({', '.join(sorted(OVERRIDES))}){hint}"
    )


def _shard_disabled(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str,
    num_losses: int,
    apply: Callable[[nn.Module, Properties], nn.Module],
    device_type: str,
    group: dist.ProcessGroup,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``enabled=False`` (DeepSpeed's ``"fp16": {"enabled": false}``, an AMP=0 switch): FSDP
    in FP32 with no mixed-precision policy, the optimizer torch's own (re-pointed at the
    sharded parameters), every other distamp call a pass-through, as ``wrap(enabled=False)``
    leaves DDP scripts. Ignored, it trained in fp16 with a loss scaler (an audit)."""
    old_names = {id(p): n for n, p in model.named_parameters()}
    model = apply(model, resolve_properties("O0", device_type=device_type))
    new_params = {_strip_fsdp1(n): p for n, p in model.named_parameters()}
    _repoint_optimizer(optimizer, old_names, new_params)
    disabled = resolve_properties(
        opt_level, device_type=device_type, enabled=False, num_losses=num_losses
    )
    mark_disabled(optimizer, disabled, group)
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # see DISABLED_FSDP1_ATTR
        setattr(optimizer, DISABLED_FSDP1_ATTR, weakref.ref(model))
    return model, optimizer


def _strip_fsdp1(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _set_forward_classes(model: nn.Module, props: Properties, device_type: str) -> None:
    """Class-level forwards: autocast (O1), FP32 norm layers (O2); FSDP does the casts."""
    if props.cast_model_type in HALF_DTYPES and props.keep_batchnorm_fp32:
        made: dict[type, type] = {}
        for module in model.modules():
            if casting.is_norm(module):
                cls = type(module)
                if cls not in made:
                    made[cls] = casting._subclass(cls, FP32NormModule, {})
                module.__class__ = made[cls]
    if props.patch_torch_functions:
        policy = casting.CastPolicy(
            device_type=device_type,
            autocast_dtype=props.half_dtype,
            input_dtype=None,
            output_dtype=props.cast_model_outputs,
        )
        model.__class__ = casting._subclass(
            type(model),
            casting.AmpModule,
            {"_distamp_policy": policy, "_distamp_properties": props},
        )
        casting.warn_about_instance_forward(model, props, "distamp.fsdp.fully_shard")


def _norm_units(model: nn.Module, props: Properties) -> list[nn.Module]:
    if props.cast_model_type in HALF_DTYPES and props.keep_batchnorm_fp32:
        return [
            m
            for m in model.modules()
            if casting.is_norm(m) and any(True for _ in m.parameters(recurse=False))
        ]
    return []


def _group_by_owner(norms: list[nn.Module], blocks: list[nn.Module]) -> list[list[nn.Module]]:
    """The norm layers grouped by the innermost block holding them (the rest: one group), so
    each block gathers its FP32 norm parameters in one collective rather than one per layer."""
    groups: dict[int, list[nn.Module]] = {}
    for norm in norms:
        owner = -1
        for i, block in enumerate(blocks):
            if any(m is norm for m in block.modules()):
                owner = i  # blocks come innermost first: the first match is the innermost
                break
        groups.setdefault(owner, []).append(norm)
    return list(groups.values())


def _apply_fsdp2(
    model: nn.Module,
    props: Properties,
    blocks: BlockSpec,
    mesh: Any,
    group: dist.ProcessGroup,
    device_type: str,
    reshard_after_forward: bool,
) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if mesh is None:
        mesh = DeviceMesh.from_group(group, device_type)
    # No input cast for norm units: their class-level forward casts up and back down itself.
    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    norms = _norm_units(model, props)
    # A norm layer picked as a block (blocks=[Block, RMSNorm], or a callable choosing every module
    # with parameters) is an FP32 unit already: sharding it twice is refused by torch.
    block_list = [b for b in _blocks(model, blocks) if not any(b is n for n in norms)]
    for group_of_norms in _group_by_owner(norms, block_list):
        torch_fully_shard(
            group_of_norms, mesh=mesh, mp_policy=fp32, reshard_after_forward=reshard_after_forward
        )
    inner = MixedPrecisionPolicy(**policy_kwargs(props, root=False))
    for block in block_list:
        torch_fully_shard(
            block, mesh=mesh, mp_policy=inner, reshard_after_forward=reshard_after_forward
        )
    torch_fully_shard(
        model,
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(**policy_kwargs(props, root=True)),
        reshard_after_forward=reshard_after_forward,
    )


def _apply_fsdp1(
    model: nn.Module, props: Properties, blocks: BlockSpec, group: dist.ProcessGroup
) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    chosen = {id(m) for m in _blocks(model, blocks)}
    on_cuda = dist.get_backend(group) == "nccl"  # (gloo: CPU tensors)
    mp = None
    if props.cast_model_type in HALF_DTYPES:
        half = props.cast_model_type
        mp = MixedPrecision(
            param_dtype=half,
            reduce_dtype=half,
            buffer_dtype=None,
            cast_forward_inputs=True,
            _module_classes_to_ignore=NORM_TYPES if props.keep_batchnorm_fp32 else (),
        )
    wrapped = FullyShardedDataParallel(
        model,
        process_group=group,
        # FSDP calls the policy with keywords (module=, recurse=, nonwrapped_numel=).
        auto_wrap_policy=functools.partial(
            lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in chosen
        ),
        mixed_precision=mp,
        use_orig_params=True,
        # (on CPU too: torch 2.13's FSDP1 runs there with device_id cpu, an audit)
        device_id=torch.cuda.current_device() if on_cuda else torch.device("cpu"),
    )
    if mp is not None:
        # FSDP1's MixedPrecision has no output dtype (FSDP2's output_dtype): the root's outputs
        # came back half, where wrap's O2 and FSDP2's are FP32 (or cast_model_outputs) (an
        # audit, once FSDP1 ran on CPU): cast by a forward hook of the wrapper, as FSDP2 does.
        dtype = props.cast_model_outputs or torch.float32
        wrapped.register_forward_hook(
            lambda _module, _args, out: casting.cast_floating(out, dtype), always_call=False
        )
    return wrapped


def _repoint_optimizer(
    optimizer: torch.optim.Optimizer,
    old_names: dict[int, str],
    new_params: dict[str, nn.Parameter],
) -> None:
    """Point ``param_groups`` at the sharded parameters FSDP created; shard existing state."""
    for group in optimizer.param_groups:
        replaced = []
        for param in group["params"]:
            new = new_params[old_names[id(param)]]
            state = optimizer.state.pop(param, None)
            if state:
                optimizer.state[new] = {
                    k: _shard_like(v, new)
                    if isinstance(v, torch.Tensor) and v.shape == param.shape
                    else v
                    for k, v in state.items()
                }
            replaced.append(new)
        group["params"] = replaced


def _shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor, equal on every rank) laid out like the sharded ``param``."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:  # FSDP1: orig params are flat views of this rank's shard
        raise ValueError(
            "distamp.fsdp.fully_shard(api='fsdp1'): the optimizer has state already; expected "
            "an optimizer without state (create it before its first step)"
        )
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.detach(), mesh, param.placements)  # type: ignore[attr-defined]
