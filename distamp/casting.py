"""Casting models for an opt_level: half weights, FP32 norm layers, autocast inside ``forward``.

[Note: class-level forward] apex.amp replaced ``model.forward`` on the instance. That attribute is
lost or stale when a module is replicated (DataParallel copies ``__dict__`` but the bound method
still points at the original), and torch.autocast's state is thread-local, so a replica running in a
worker thread ran in FP32. distamp instead gives the wrapped module a generated subclass of its own
class whose ``forward`` enters autocast and casts inputs/outputs, then calls the original
``forward``. The policy is a class attribute, so anything that copies the module (DataParallel's
replicate, deepcopy, FSDP's own class swap, a thread pool) keeps it, and torch is never patched.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .config import HALF_DTYPES, Properties

NORM_TYPES: tuple[type[nn.Module], ...] = (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""torch's normalization classes (BatchNorm, InstanceNorm, LayerNorm, GroupNorm, RMSNorm)."""


def is_norm(module: nn.Module) -> bool:
    """Is ``module`` a normalization layer (kept FP32 under ``keep_batchnorm_fp32``)?

    [Note: recognizing norm layers] torch's classes (:data:`NORM_TYPES` and their subclasses,
    e.g. timm's ``LayerNorm2d``), and any module whose class name contains "norm" (any case) whose
    own parameters are all vectors or scalars (weight, bias, gain) and whose submodules hold no
    parameters: nanoGPT's ``LayerNorm(bias=False)``, Hugging Face's ``LlamaRMSNorm`` and
    ``T5LayerNorm``, apex's ``FusedLayerNorm``. The shape rule keeps out modules that merely have
    "Norm" in their name but hold matrices (``NormalizedLinear``, DiT's ``AdaLayerNorm`` with its
    projection). Anything else is kept FP32 by ``keep_fp32_modules``; ``distamp.doctor`` lists
    the modules recognized.
    """
    if isinstance(module, NORM_TYPES):
        return True
    if "norm" not in type(module).__name__.lower():
        return False
    if any(p.is_floating_point() and p.dim() > 1 for p in module.parameters(recurse=False)):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


@dataclass(frozen=True, kw_only=True)
class CastPolicy:
    """What the generated ``forward`` of a wrapped model does around the original one."""

    device_type: str
    """Device type passed to ``torch.autocast`` ("cpu", "cuda", ...)."""
    autocast_dtype: torch.dtype | None
    """Run forward under ``torch.autocast(device_type, autocast_dtype)``; None: no autocast."""
    input_dtype: torch.dtype | None
    """Floating-point inputs are cast to this dtype; None leaves them as they are."""
    output_dtype: torch.dtype | None
    """Floating-point outputs are cast to this dtype; None leaves them as they are."""


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor inside ``value`` to ``dtype`` (apex's applier).

    Walks lists, tuples, namedtuples, dicts and dataclasses; other objects with a ``.to()`` method
    (e.g. a batch object) get ``.to(dtype)``; integer tensors, strings, numbers and NumPy arrays
    pass through untouched.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: cast_floating(v, dtype) for k, v in value.items()})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: cast_floating(getattr(value, f.name), dtype)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if callable(getattr(value, "to", None)) and not isinstance(value, nn.Module):
        return value.to(dtype)
    return value


class AmpModule(nn.Module):
    """Mixin placed in front of a wrapped model's class; see [Note: class-level forward]."""

    _distamp_policy: ClassVar[CastPolicy]
    _distamp_properties: ClassVar[Properties]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = type(self)._distamp_policy
        if policy.input_dtype is not None:
            args = cast_floating(args, policy.input_dtype)
            kwargs = cast_floating(kwargs, policy.input_dtype)
        if policy.autocast_dtype is not None:
            with torch.autocast(policy.device_type, dtype=policy.autocast_dtype):
                output = super().forward(*args, **kwargs)
        else:
            output = super().forward(*args, **kwargs)
        if policy.output_dtype is not None:
            output = cast_floating(output, policy.output_dtype)
        return output


class FP32NormModule(nn.Module):
    """Mixin for normalization layers kept FP32 in a half model: inputs up, outputs back down."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        incoming = _first_floating_dtype(args)
        args = cast_floating(args, torch.float32)
        kwargs = cast_floating(kwargs, torch.float32)
        # Autocast (when the user runs one around a half model) would cast the norm back down.
        with torch.autocast(device_type_of(self, recurse=False), enabled=False):
            output = super().forward(*args, **kwargs)
        if incoming is not None and incoming != torch.float32:
            output = cast_floating(output, incoming)
        return output


def _first_floating_dtype(args: tuple[Any, ...]) -> torch.dtype | None:
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return arg.dtype
    return None


def _subclass(cls: type[nn.Module], mixin: type[nn.Module], attrs: dict[str, Any]) -> type:
    """A subclass of ``cls`` with ``mixin`` in front; same name so reprs read as before."""
    return type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, **attrs})


def device_type_of(model: nn.Module, recurse: bool = True) -> str:
    """The device type of the model's first parameter or buffer ("cpu" for an empty model)."""
    for param in model.parameters(recurse=recurse):
        return param.device.type
    for buffer in model.buffers(recurse=recurse):
        return buffer.device.type
    return "cpu"


def cast_policy(props: Properties, device_type: str) -> CastPolicy:
    """The forward-time casts the opt_level asks for."""
    input_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None
    if props.model_is_cast:
        input_dtype = props.cast_model_type
        # apex: "the user never needs to call .half()": outputs of a cast model come back FP32.
        output_dtype = props.cast_model_outputs or torch.float32
    else:
        output_dtype = props.cast_model_outputs
    return CastPolicy(
        device_type=device_type,
        autocast_dtype=props.half_dtype if props.patch_torch_functions else None,
        input_dtype=input_dtype,
        output_dtype=output_dtype,
    )


def resolve_fp32_modules(models: list[nn.Module], keep: Any) -> tuple[list[nn.Module], set[int]]:
    """``keep_fp32_modules`` (modules, or fnmatch patterns of qualified names) resolved against
    ``models``: (the matched modules, ids of every module in their subtrees).

    Raises ValueError naming an entry that matches nothing (a typo must not silently keep a
    layer in half precision).
    """
    if keep is None:
        return [], set()
    entries = [keep] if isinstance(keep, (str, nn.Module)) else list(keep)
    named = [
        (name if len(models) == 1 else f"models[{i}].{name}", module)
        for i, model in enumerate(models)
        for name, module in model.named_modules()
    ]
    chosen: dict[int, nn.Module] = {}
    for entry in entries:
        if isinstance(entry, nn.Module):
            hits = [m for _, m in named if m is entry]
        elif isinstance(entry, str):
            hits = [m for n, m in named if n and fnmatch.fnmatchcase(n, entry)]
        else:
            raise TypeError(
                f"keep_fp32_modules: expected modules or name patterns (str), got "
                f"{type(entry).__name__}"
            )
        if not hits:
            examples = ", ".join(repr(n) for n, _ in named[1:4])
            raise ValueError(
                f"keep_fp32_modules: {entry if isinstance(entry, str) else type(entry).__name__!r}"
                f" matched no module of the model(s); expected a submodule or a pattern of "
                f"qualified names such as {examples}"
            )
        for m in hits:
            chosen[id(m)] = m
    inside = {id(sub) for m in chosen.values() for sub in m.modules()}
    # Keep only the outermost chosen modules (a chosen module inside another is covered by it).
    nested = {id(sub) for m in chosen.values() for sub in m.modules() if sub is not m}
    return [m for k, m in chosen.items() if k not in nested], inside


def keep_fp32(module: nn.Module) -> None:
    """Give ``module`` the FP32 forward: inputs cast up, autocast off inside, outputs cast back."""
    if not isinstance(module, FP32NormModule):
        module.__class__ = _subclass(type(module), FP32NormModule, {})


def cast_model(
    model: nn.Module,
    props: Properties,
    device_type: str,
    fp32_modules: tuple[list[nn.Module], set[int]] = ([], set()),
) -> None:
    """Cast ``model`` in place for ``props`` and give it the autocast/cast ``forward``.

    Parameters keep their identity (only ``.data`` changes), so references held elsewhere stay
    valid; FP32 master copies must be taken before this is called. ``fp32_modules``
    (:func:`resolve_fp32_modules`) stay FP32, with autocast off inside them.
    """
    keep_top, keep_all = fp32_modules
    for module in keep_top:
        keep_fp32(module)
    target = props.cast_model_type
    if target in HALF_DTYPES:
        assert target is not None
        norm_classes: dict[type, type] = {}
        for module in model.modules():
            if id(module) in keep_all:
                continue
            if props.keep_batchnorm_fp32 and is_norm(module):
                cls = type(module)
                if cls not in norm_classes:
                    norm_classes[cls] = _subclass(cls, FP32NormModule, {})
                module.__class__ = norm_classes[cls]
                continue
            _cast_own_tensors(module, target)
    model.__class__ = _subclass(
        type(model),
        AmpModule,
        {"_distamp_policy": cast_policy(props, device_type), "_distamp_properties": props},
    )


def _cast_own_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
                if param.grad is not None:
                    param.grad = param.grad.to(dtype)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))


def is_wrapped(model: nn.Module) -> bool:
    """True when ``model`` went through :func:`distamp.wrap` already."""
    return isinstance(model, AmpModule)


def data_parallel_wrapper_name(model: nn.Module) -> str | None:
    """The class name of a DDP/DataParallel/FSDP wrapper found at or under ``model``, if any."""
    wrappers: list[type] = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - builds without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        wrappers.append(FSDPModule)
    except ImportError:  # pragma: no cover
        pass
    for name, module in model.named_modules():
        for wrapper in wrappers:
            if isinstance(module, wrapper):
                where = "the model" if not name else f"submodule {name!r}"
                return f"{wrapper.__name__} ({where})"
    return None
