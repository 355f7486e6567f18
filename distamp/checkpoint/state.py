"""The canonical form of a wrapped model and optimizer: what a checkpoint holds, at any world size.

[Note: canonical checkpoint layout] A checkpoint does not store "rank r's shard": it stores the
state as it would be on one process, cut into pieces that DCP can reassemble at any world size.

* ``model.{i}.{key}`` — model ``i``'s ``state_dict`` (DDP's ``module.`` prefix stripped), plain
  tensors written once (DCP deduplicates replicated tensors across ranks).
* ``optim.{o}.g{g}.master`` — the FP32 masters of param group ``g`` of optimizer ``o``: the
  parameters that have a separate master, flattened and concatenated in group order (the flat
  layout of :mod:`distamp.masters.layout`, without its padding). ``optim.{o}.g{g}.state.{k}`` is the
  element-wise optimizer state ``k`` (Adam's ``exp_avg``, ...) in the same layout.
  With more than one rank these are DTensors sharded on dim 0 in ``torch.chunk`` pieces — exactly
  the ZeRO-1 partition, so each rank writes only its own shard. Replicated masters are written the
  same way (each rank writes its slice of the full tensor), so sharded and replicated checkpoints
  are interchangeable: a checkpoint saved sharded at 2 ranks loads replicated at 1 rank, and back.
* ``optim.{o}.p.{name}.{k}`` — tensor state of the parameters that are their own master (O0/O1,
  FP32 norm layers under O2), by parameter name.
* Everything that is not a large tensor — scalar optimizer state (Adam's ``step``), which
  parameters have state, the param groups' hyperparameters, the flat layouts (names and shapes,
  which is what resharding needs), properties, scalers, counters — goes into the manifest.

Loading allocates fresh buffers for the *current* layout, lets DCP fill them (it reads whatever
byte ranges overlap this rank's piece), and installs them only once everything was read, so a
failed load leaves the model and optimizer as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import disabled_properties
from ..masters.layout import SCALAR_STATE, detached_dense
from ..masters.optimizer import AmpOptimizer, AmpOptimizerState
from ..masters.replicated import MasterParams
from ..masters.sharded import ShardedMasterParams
from .files import CheckpointError


@dataclass(kw_only=True)
class FlatGroup:
    """One param group's parameters with separate FP32 masters, in the canonical flat layout."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    total: int
    sharded: ShardedMasterParams | None = None
    """Set when this rank holds a shard (then ``group`` indexes its layouts)."""
    group: int = 0
    masters: list[torch.Tensor] = field(default_factory=list)
    """Replicated: the FP32 master tensors, in layout order."""

    def piece(self, rank: int, world: int) -> tuple[int, int]:
        """[lo, hi) of the canonical tensor that ``rank`` holds in torch.chunk's partition."""
        size = max(1, -(-self.total // world))
        lo = min(rank * size, self.total)
        return lo, min(lo + size, self.total)


@dataclass(kw_only=True)
class GroupView:
    """One param group: its flat part (if any) and the parameters that are their own master."""

    flat: FlatGroup | None
    kept: list[tuple[str, torch.Tensor]]
    """(name, the tensor the inner optimizer steps) for parameters that are their own master."""


@dataclass(kw_only=True)
class OptimizerView:
    """How one optimizer's state maps onto the canonical keys."""

    index: int
    opt: torch.optim.Optimizer
    st: AmpOptimizerState | None
    """None when the optimizer was wrapped with ``enabled=False``."""
    groups: list[GroupView]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/DataParallel and ``torch.compile`` (in any nesting:
    ``torch.compile(DDP(model))`` is common), so that a checkpoint's names do not depend on how
    the model was run: one saved from the compiled model loads into the plain one and back."""
    while True:
        compiled = getattr(model, "_orig_mod", None)
        if type(model).__name__ == "OptimizedModule" and isinstance(compiled, nn.Module):
            model = compiled
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in (
            "DistributedDataParallel",
            "DataParallel",
        ):
            model = inner
            continue
        return model


def checkpoint_names(model: nn.Module) -> Callable[[str], str]:
    """The function giving a ``model`` state_dict key as checkpoints name it: without the
    ``_orig_mod`` segment of each block compiled one by one (``model.blocks[i] =
    torch.compile(model.blocks[i])``, torchtitan's way), as DCP's ``get_model_state_dict``
    names them, so that a checkpoint of such a model loads into the plain one, and back (an
    audit: the plain model's load was refused). Only where the module is torch.compile's
    wrapper: a module attribute of the user's that is named ``_orig_mod`` stays (a review)."""
    compiled = {name for name, m in model.named_modules(remove_duplicate=False) if _is_compiled(m)}
    if not compiled:
        return lambda key: key

    def name(key: str) -> str:
        parts = key.split(".")
        kept = [
            part
            for i, part in enumerate(parts)
            if not (part == "_orig_mod" and ".".join(parts[:i]) in compiled)
        ]
        return ".".join(kept)

    return name


def _is_compiled(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, "_orig_mod", None), nn.Module
    )


def model_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict(keep_vars=True)`` under the checkpoint's keys (:func:`checkpoint_names`)."""
    name = checkpoint_names(model)
    out: dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if out.setdefault(name(key), value) is not value:
            raise CheckpointError(
                f"model state_dict keys {key!r} and another one both read {name(key)!r} "
                "without torch.compile's '_orig_mod.': expected keys that differ by more than "
                "that"
            )
    return out


def live_state_dict(model: nn.Module) -> dict[str, Any]:
    """:func:`model_state` with every tensor in its live dtype (detached): under O2 the plain
    ``state_dict()`` reports half tensors as FP32 for apex compatibility, which would double the
    model's bytes in a checkpoint that holds the exact FP32 masters anyway."""
    return {
        k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in model_state(model).items()
    }


def param_names(models: list[nn.Module]) -> dict[int, str]:
    """id(param) -> qualified name, as ``distamp.wrap`` names them."""
    names: dict[int, str] = {}
    for i, model in enumerate(models):
        _name_params(model, i, len(models), model_state(model), names)
    return names


def _name_params(
    model: nn.Module, index: int, n_models: int, state: dict[str, Any], into: dict[int, str]
) -> None:
    """Name each parameter of ``model`` not named yet in ``into`` by its key in ``state`` (its
    ``state_dict(keep_vars=True)``; wrappers such as torch's CheckpointWrapper rename their
    children's keys in a state_dict post-hook, not in named_parameters)."""
    keyed: dict[int, str] = {}
    for key, value in state.items():
        if isinstance(value, nn.Parameter):
            keyed.setdefault(id(value), key)
    name = checkpoint_names(model)
    for pname, param in model.named_parameters():
        pname = keyed.get(id(param), name(pname))
        into.setdefault(id(param), pname if n_models == 1 else f"models[{index}].{pname}")


def model_entry(
    index: int, model: nn.Module, n_models: int, names: dict[int, str] | None = None
) -> dict[str, Any]:
    """The manifest's description of one model: state keys, parameters, tied aliases.

    ``names`` (:func:`param_names` of all the models) names a parameter two models share by the
    first model holding it, as the optimizers' flat layouts do: named per model, the second
    model's alias missed its FP32 master and ``consolidate`` gave it the half weight (an
    audit: an embedding shared by an encoder and a decoder at O2 came back rounded to bf16)."""
    canonical: dict[int, str] = dict(names or {})
    state = model_state(model)
    _name_params(model, index, n_models, state, canonical)
    name = checkpoint_names(model)
    aliases = {
        name(pname): canonical[id(param)]
        for pname, param in model.named_parameters(remove_duplicate=False)
    }
    for key, value in state.items():
        if isinstance(value, nn.Parameter) and id(value) in canonical:
            aliases[key] = canonical[id(value)]
    keys: dict[str, list[Any]] = {}
    for key, value in state.items():  # live_state_dict's values, undetached
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"model state_dict entry {key!r} is a {type(value).__name__}; expected tensors "
                "only (distamp checkpoints hold plain tensors)"
            )
        keys[key] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return {"keys": keys, "aliases": aliases}


def optimizer_views(
    optimizers: list[torch.optim.Optimizer], names: dict[int, str]
) -> list[OptimizerView]:
    """The canonical view of each optimizer; raises if one was not returned by ``distamp.wrap``."""
    views = []
    for o, opt in enumerate(optimizers):
        if isinstance(opt, AmpOptimizer):
            st: AmpOptimizerState | None = opt._distamp
        elif disabled_properties(opt) is not None:
            st = None
        else:
            raise CheckpointError(
                f"optimizers[{o}] ({type(opt).__name__}) was not returned by distamp.wrap: "
                "expected the optimizer(s) from `model, optimizer = distamp.wrap(model, optimizer)`"
            )
        views.append(OptimizerView(index=o, opt=opt, st=st, groups=_group_views(opt, st, names, o)))
    return views


def _name(names: dict[int, str], param: torch.Tensor, o: int) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise CheckpointError(
            f"optimizers[{o}] holds a parameter of shape {tuple(param.shape)} that is not in the "
            "model(s) passed to the checkpoint: pass every model the optimizer steps"
        ) from None


def _group_views(
    opt: torch.optim.Optimizer, st: AmpOptimizerState | None, names: dict[int, str], o: int
) -> list[GroupView]:
    masters = st.masters if st is not None else None
    out: list[GroupView] = []
    if isinstance(masters, ShardedMasterParams):
        for g, group in enumerate(opt.param_groups):
            layout = masters.groups[g]
            flat = None
            if layout.params:
                flat = FlatGroup(
                    names=[_name(names, p, o) for p in layout.params],
                    shapes=[tuple(p.shape) for p in layout.params],
                    total=layout.total,
                    sharded=masters,
                    group=g,
                )
            own = group["params"][len(masters.chunks[g]) :]
            out.append(GroupView(flat=flat, kept=[(_name(names, p, o), p) for p in own]))
        return out
    pairs: dict[int, tuple[nn.Parameter, bool]] = {}
    if isinstance(masters, MasterParams):
        for param, master, separate in zip(*masters.columns(), strict=True):
            pairs[id(master)] = (param, separate)
    for group in opt.param_groups:
        flat_params: list[tuple[nn.Parameter, torch.Tensor]] = []
        kept: list[tuple[str, torch.Tensor]] = []
        for tensor in group["params"]:
            param, separate = pairs.get(id(tensor), (tensor, False))
            if separate:
                flat_params.append((param, tensor))
            else:
                kept.append((_name(names, param, o), tensor))
        flat = None
        if flat_params:
            flat = FlatGroup(
                names=[_name(names, p, o) for p, _ in flat_params],
                shapes=[tuple(p.shape) for p, _ in flat_params],
                total=sum(p.numel() for p, _ in flat_params),
                masters=[m for _, m in flat_params],
            )
        out.append(GroupView(flat=flat, kept=kept))
    return out


def flat_starts(shapes: list[tuple[int, ...]]) -> list[int]:
    starts, offset = [], 0
    for shape in shapes:
        starts.append(offset)
        offset += numel(shape)
    return starts


def numel(shape: tuple[int, ...] | list[int]) -> int:
    """Number of elements of a tensor of ``shape`` (a manifest stores shapes as lists)."""
    return math.prod(int(d) for d in shape)


# -- reading the live state ---------------------------------------------------------------------


def flat_masters(flat: FlatGroup, rank: int, world: int) -> torch.Tensor:
    """This rank's piece of the canonical FP32 master tensor (a view where possible). Collective
    with sharded masters (see :meth:`ShardedMasterParams.to_canonical`)."""
    lo, hi = flat.piece(rank, world)
    if flat.sharded is not None:
        layout = flat.sharded.groups[flat.group]
        assert layout.shard_size == max(1, -(-flat.total // world)) or lo == hi
        shard = flat.sharded.shards[flat.group]
        return flat.sharded.to_canonical(flat.group, shard)[: hi - lo]
    full = torch.cat([m.detach().reshape(-1) for m in flat.masters])
    return full[lo:hi]


def flat_state(
    opt: torch.optim.Optimizer, flat: FlatGroup, rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]], list[bool | None]]:
    """This rank's piece of each element-wise state tensor, the per-parameter scalar state and
    which parameters have state at all (None where this rank holds no part of a parameter: its
    state lives on other ranks, see :func:`merge_flat_info`). With sharded masters the pieces are
    laid out like the shard (``shard_size`` long): :func:`canonical_piece` turns one into the
    canonical piece."""
    lo, hi = flat.piece(rank, world)
    n = len(flat.names)
    if flat.sharded is not None:
        layout = flat.sharded.groups[flat.group]
        chunks = flat.sharded.chunks[flat.group]
        device = flat.sharded.shards[flat.group].device
        has: list[bool | None] = [None] * n
        scalars: dict[str, list[Any]] = {}
        pieces: dict[str, torch.Tensor] = {}
        for (index, a, b), chunk in zip(layout.spans, chunks, strict=True):
            state = opt.state.get(chunk)
            has[index] = bool(state)
            for key, value in (state or {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and value.shape == chunk.shape
                ):
                    if key not in pieces:
                        pieces[key] = torch.zeros(
                            layout.shard_size, dtype=value.dtype, device=device
                        )
                    pieces[key][a:b] = detached_dense(value)
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    # A user's optimizer with fixed-size state (a (3,) history) on sharded
                    # masters: read back into other slices' places, silently (an audit).
                    raise CheckpointError(
                        f"optimizer state {key!r} of {flat.names[index]!r} is a tensor of shape "
                        f"{tuple(value.shape)} on a slice of shape {tuple(chunk.shape)}: "
                        "expected state shaped like its (sharded) parameter, or 0-dim scalars; "
                        f"{type(opt).__name__} keeps other state, so wrap it with "
                        "shard_master_weights=False"
                    )
                else:
                    scalars.setdefault(key, [None] * n)[index] = _plain_scalar(value)
        return pieces, scalars, has
    tensors_full: dict[str, list[torch.Tensor]] = {}
    scalars_out: dict[str, list[Any]] = {}
    has_state: list[bool | None] = [bool(opt.state.get(m)) for m in flat.masters]
    wide = elementwise_keys(opt, flat.masters)
    for i, master in enumerate(flat.masters):
        for key, value in opt.state.get(master, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == master.shape and key in wide:
                tensors_full.setdefault(key, [])
            else:
                scalars_out.setdefault(key, [None] * n)[i] = _plain_scalar(value)
    tensors = {}
    for key in tensors_full:
        pieces_full = []
        for master in flat.masters:
            value = opt.state.get(master, {}).get(key)
            pieces_full.append(
                detached_dense(value).reshape(-1)
                if isinstance(value, torch.Tensor) and value.shape == master.shape
                else torch.zeros(master.numel(), dtype=_state_dtype(opt, flat.masters, key))
            )
        tensors[key] = torch.cat(pieces_full)[lo:hi]
    return tensors, scalars_out, has_state


def elementwise_keys(opt: torch.optim.Optimizer, masters: list[torch.Tensor]) -> set[str]:
    """The state keys that are element-wise (shaped like their parameter). Decided on the masters
    with at least one dimension; a key seen only on 0-dim masters is element-wise unless it is
    one of torch's scalar keys (``step``)."""
    wide: set[str] = set()
    narrow: set[str] = set()
    for master in masters:
        for key, value in opt.state.get(master, {}).items():
            if master.dim() == 0:
                continue
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape:
                wide.add(key)
            else:
                narrow.add(key)
    for master in masters:
        if master.dim() == 0:
            for key, value in opt.state.get(master, {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and key not in narrow
                    and key not in SCALAR_STATE
                ):
                    wide.add(key)
    return wide


def canonical_piece(
    flat: FlatGroup, local: torch.Tensor | None, dtype: torch.dtype, rank: int, world: int
) -> torch.Tensor:
    """This rank's canonical piece of one element-wise state tensor from :func:`flat_state`'s
    ``local`` (zeros where this rank has none of it). Collective with sharded masters."""
    lo, hi = flat.piece(rank, world)
    if flat.sharded is None:
        return local if local is not None else torch.zeros(hi - lo, dtype=dtype)
    shard = flat.sharded.shards[flat.group]
    if local is None:
        local = torch.zeros(shard.numel(), dtype=dtype, device=shard.device)
    return flat.sharded.to_canonical(flat.group, local)[: hi - lo]


def present_keys(opt: torch.optim.Optimizer, flat: FlatGroup) -> dict[str, list[int]]:
    """Per element-wise state key, the parameters (indices in the group) this rank holds it for.

    [Note: state keys some parameters lack] A flat state tensor has a value for every element,
    zeros where a parameter has no such state; Adafactor keeps ``variance`` for vectors only
    (``row_var``/``col_var`` for matrices). Installed everywhere on load, every resume gave each
    matrix a full-size ``variance`` of zeros (4 bytes per element of state Adafactor exists to
    avoid; an audit). The manifest lists where each key was, and a load installs it only there."""
    present: dict[str, set[int]] = {}
    if flat.sharded is not None:
        layout = flat.sharded.groups[flat.group]
        for (index, _, _), chunk in zip(layout.spans, flat.sharded.chunks[flat.group], strict=True):
            for key, value in (opt.state.get(chunk) or {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.shape == chunk.shape:
                        present.setdefault(key, set()).add(index)
    else:
        wide = elementwise_keys(opt, flat.masters)
        for i, master in enumerate(flat.masters):
            for key, value in opt.state.get(master, {}).items():
                if key in wide and isinstance(value, torch.Tensor) and value.shape == master.shape:
                    present.setdefault(key, set()).add(i)
    return {k: sorted(v) for k, v in present.items()}


def partly_present(merged: dict[str, Any]) -> dict[str, list[int]]:
    """The merged ``present`` lists of the keys that some parameter with state lacks (the rest
    are everywhere: the manifest leaves them out)."""
    with_state = {i for i, h in enumerate(merged["has_state"]) if h}
    return {k: v for k, v in sorted(merged["present"].items()) if set(v) != with_state}


def installed_keys(saved_flat: dict[str, Any], i: int) -> list[str]:
    """The element-wise keys parameter ``i`` of a saved flat group had (see [Note: state keys
    some parameters lack]; a manifest without ``present`` had them everywhere)."""
    present = saved_flat.get("present", {})
    return [k for k in saved_flat["tensor_keys"] if k not in present or i in present[k]]


def merge_flat_info(infos: list[dict[Any, Any]]) -> dict[Any, Any]:
    """One view of every flat group's scalar state from each rank's :func:`flat_state` summary.

    With sharded masters a rank knows the state of the parameters it holds a part of only; the
    manifest (written by rank 0) needs all of them, and every rank must write the same state keys.
    ``infos``: per rank, ``{(o, g): {"scalars", "has_state", "dtypes"}}``.
    """
    merged: dict[Any, Any] = {}
    for info in infos:
        for key, part in info.items():
            into = merged.setdefault(
                key,
                {
                    "scalars": {},
                    "has_state": [None] * len(part["has_state"]),
                    "dtypes": {},
                    "present": {},
                },
            )
            into["dtypes"].update(part["dtypes"])
            for name, where in part["present"].items():
                into["present"][name] = sorted(set(into["present"].get(name, [])) | set(where))
            for i, has in enumerate(part["has_state"]):
                if into["has_state"][i] is None:
                    into["has_state"][i] = has
            for name, values in part["scalars"].items():
                slot = into["scalars"].setdefault(name, [None] * len(values))
                for i, value in enumerate(values):
                    if slot[i] is None:
                        slot[i] = value
    for part in merged.values():
        part["has_state"] = [bool(h) for h in part["has_state"]]
    return merged


def _state_dtype(opt: torch.optim.Optimizer, masters: list[torch.Tensor], key: str) -> torch.dtype:
    for master in masters:
        value = opt.state.get(master, {}).get(key)
        if isinstance(value, torch.Tensor):
            return value.dtype
    return torch.float32


def kept_state(
    opt: torch.optim.Optimizer, tensor: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(element-wise tensors, scalars) of the state of a parameter that is its own master."""
    tensors, scalars = {}, {}
    for key, value in opt.state.get(tensor, {}).items():
        if isinstance(value, torch.Tensor) and value.shape == tensor.shape and value.dim() > 0:
            tensors[key] = detached_dense(value)
        else:
            scalars[key] = _plain_scalar(value)
    return tensors, scalars


_BUILTIN_SCALARS = (bool, int, float, str)


def builtin_scalar(value: Any) -> Any:
    """``value`` as the exact builtin bool/int/float/str (None stays None), or ``NotImplemented``.

    A subclass (``numpy.float64`` is a float, an ``IntEnum`` an int, a ``str`` Enum a str) or a
    NumPy scalar (``np.float32(lr)``, ``np.int64(epoch)``) would be pickled as its own class,
    which ``torch.load(weights_only=True)`` refuses: the checkpoint was saved and then never
    loaded (an audit: ``extra={"best_acc": np.mean(accs)}``, an lr set from a NumPy schedule as
    BEiT's and ConvNeXt's loops do). Saved as the builtin value they stand for."""
    if value is None or type(value) in _BUILTIN_SCALARS:
        return value
    for kind in _BUILTIN_SCALARS:  # bool first: it is an int
        if isinstance(value, kind):
            return kind.__str__(value) if kind is str else kind(value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        item = value.item()
        if type(item) in _BUILTIN_SCALARS:
            return item
    return NotImplemented


def _plain_scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    scalar = builtin_scalar(value)
    if scalar is not NotImplemented:
        return scalar
    raise CheckpointError(
        f"optimizer state value of type {type(value).__name__} is not a tensor or a number; "
        "distamp checkpoints hold plain data only"
    )


def hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (lr, betas, weight_decay, ...) without its parameters (nor
    their names: with sharded masters they name this rank's slices, which another world size
    cuts differently; the loading optimizer keeps its own)."""
    out = []
    for g, group in enumerate(opt.param_groups):
        entry = {}
        for key, value in group.items():
            if key in ("params", "param_names"):
                continue
            entry[key] = check_plain(value, f"param_groups[{g}][{key!r}]")
        out.append(entry)
    return out


def plain_equal(a: Any, b: Any) -> bool:
    """Equality of plain data (see ``check_plain``), tensors compared by value, NaN equal to
    NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and (
                bool(torch.allclose(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True))
                if a.is_floating_point()
                else bool(torch.equal(a.cpu(), b.cpu()))
            )
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # (a best loss still NaN on every rank is the same value)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(plain_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(plain_equal, a, b))
    return type(a) is type(b) and a == b


def check_plain(value: Any, path: str) -> Any:
    """``value`` if it is plain data (what ``torch.load(weights_only=True)`` loads), else raise
    TypeError naming ``path``. Tensors are detached copies on the CPU."""
    scalar = builtin_scalar(value)
    if scalar is not NotImplemented:
        return scalar
    if is_dtensor(value):
        # Only this rank's shard is local: rank 0's alone would be saved, and comparing the
        # ranks' values failed inside torch ("Sharding propagation failed") naming nothing (an
        # audit: an FSDP-sharded EMA's state_dict, another optimizer's state_dict under FSDP).
        raise TypeError(
            f"{path}: expected plain data, found a DTensor (an FSDP-sharded tensor: each rank "
            "holds a shard); pass its module in the models list of save_checkpoint (sharded "
            "models are saved shard by shard), or a full copy "
            "(get_model_state_dict(..., options=StateDictOptions(full_state_dict=True)))"
        )
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [check_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = builtin_scalar(k) if isinstance(k, (str, int)) else None
            if type(key) not in (str, int, bool):
                raise TypeError(f"{path}: expected str or int keys, found {type(k).__name__} {k!r}")
            out[key] = check_plain(v, f"{path}[{k!r}]")
        return out
    raise TypeError(
        f"{path}: expected plain data (tensors, numbers, strings, lists, dicts), found "
        f"{type(value).__name__}; distamp checkpoints load with torch.load(weights_only=True)"
    )


def to_dtensor(local: torch.Tensor, total: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``local`` as this rank's piece of a (total,) DTensor sharded on dim 0 over ``group``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, local.device.type)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size([total]), stride=(1,)
    )


def is_dtensor(value: Any) -> bool:
    """True for a DTensor (FSDP2's sharded parameters and their optimizer state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)
