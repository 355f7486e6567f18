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

import contextvars
import copy
import dataclasses
import fnmatch
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from .config import Properties, warn_from_caller

CASTS_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("distamp_casts_off", default=False)
"""[Note: casts turned off around a call] True inside apex's ``with amp.disable_casts():``. apex's
O1 patched torch's functions, so a block around a model call ran the whole forward uncast; distamp
enters autocast inside ``forward``, which would turn it back on. The wrapped forward reads this
flag instead. Scoped to the block and to its thread or task, like torch.autocast's own state;
the variable itself is never rebound."""

NORM_TYPES: tuple[type[nn.Module], ...] = (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""torch's normalization classes (BatchNorm, InstanceNorm, LayerNorm, GroupNorm, RMSNorm)."""


def is_norm(module: nn.Module) -> bool:
    """Is ``module`` a normalization layer (kept FP32 under ``keep_batchnorm_fp32``)?

    [Note: recognizing norm layers] torch's classes (:data:`NORM_TYPES` and their subclasses,
    e.g. timm's ``LayerNorm2d``), and any module whose class name contains "norm" (any case) whose
    own parameters are all vectors or scalars (weight, bias, gain; also shaped for broadcasting,
    ``(1, C, 1, 1)``: diffusion models' channel norms, an audit found them cast) and whose
    submodules hold no parameters: nanoGPT's ``LayerNorm(bias=False)``, Hugging Face's ``LlamaRMSNorm`` and
    ``T5LayerNorm``, apex's ``FusedLayerNorm``. The shape rule keeps out modules that merely have
    "Norm" in their name but hold matrices (``NormalizedLinear``, DiT's ``AdaLayerNorm`` with its
    projection). Anything else is kept FP32 by ``keep_fp32_modules``; ``distamp.doctor`` lists
    the modules recognized.
    """
    if isinstance(module, NORM_TYPES):
        return True
    if "norm" not in type(module).__name__.lower():
        return False
    if any(
        p.is_floating_point() and sum(size > 1 for size in p.shape) > 1
        for p in module.parameters(recurse=False)
    ):
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


def cast_floating(
    value: Any, dtype: torch.dtype, *, saturate: bool = False, _seen: frozenset[int] = frozenset()
) -> Any:
    """Cast every floating-point tensor inside ``value`` to ``dtype`` (apex's applier).

    Walks lists, tuples, namedtuples, mappings (their type kept: a defaultdict stays one),
    dataclasses, and the attributes of other objects with a ``.to()`` method (a batch object: see
    [Note: batch objects]); integer tensors, strings, numbers and NumPy arrays pass through untouched. ``saturate``: see
    :func:`saturating_cast`.
    """
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.dtype == dtype:
            return value
        if saturate and torch.finfo(dtype).max < torch.finfo(value.dtype).max:
            return saturating_cast(value, dtype)
        return value.to(dtype)
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(
            *(cast_floating(v, dtype, saturate=saturate, _seen=_seen) for v in value)
        )
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype, saturate=saturate, _seen=_seen) for v in value)
    if isinstance(value, Mapping):
        cast = {
            k: cast_floating(v, dtype, saturate=saturate, _seen=_seen) for k, v in value.items()
        }
        # A plain dict (forward's **kwargs) needs no copy, which torch.compile's fullgraph refused.
        if type(value) is dict:
            return cast
        if isinstance(value, MutableMapping):
            # A copy keeps the type and what it carries (a defaultdict's factory, a batch
            # object's attributes); item by item, since some forbid update() (HF's ModelOutput).
            # A shallow copy of a mapping that keeps its items in an attribute (a
            # MutableMapping over self._data) shares them with the caller's: the writes reached
            # the caller's batch, whose targets came back bf16-rounded (an audit). Seen, undone,
            # and built anew from the cast items instead.
            held = dict(value.items())
            for own_storage in (False, True):
                out = copy.copy(value)
                fields = getattr(out, "__dict__", None)
                if own_storage and isinstance(fields, dict):
                    # the copy's containers its own (its items' dict), the rest still shared
                    for name, attr in list(fields.items()):
                        if isinstance(attr, (dict, list)):
                            fields[name] = copy.copy(attr)
                for k, v in cast.items():
                    out[k] = v
                if all(value[k] is held[k] for k in cast):
                    return out
                for k, v in held.items():
                    value[k] = v
            try:  # (a copy that still shares: built anew; an audit lost the type to a dict)
                return type(value)(cast)  # type: ignore[call-arg]
            except TypeError:  # (apex's dict)
                return cast
        try:
            return type(value)(cast)  # type: ignore[call-arg]
        except TypeError:  # a read-only mapping that cannot be built from a dict: apex's dict
            return cast
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A copy with every field cast: dataclasses.replace dropped the fields declared
        # init=False (set after construction: an auxiliary loss came back None, an audit).
        # One met again inside its own fields (a tree node's .parent) is kept as it is.
        if id(value) in _seen:
            return value
        inner = _seen | {id(value)}
        instance: Any = value
        out = copy.copy(instance)
        for f in dataclasses.fields(instance):
            if hasattr(value, f.name):
                object.__setattr__(
                    out,
                    f.name,
                    cast_floating(getattr(value, f.name), dtype, saturate=saturate, _seen=inner),
                )
        return out
    if callable(getattr(value, "to", None)) and not isinstance(value, nn.Module):
        return _cast_batch_object(value, dtype, saturate=saturate, seen=_seen)
    return value


def tensors_in(value: Any, _seen: frozenset[int] = frozenset()) -> Iterator[torch.Tensor]:
    """The tensors :func:`cast_floating` would reach inside ``value``, in its order: lists,
    tuples, namedtuples, mapping values, dataclass fields, and the ``__dict__`` of other objects
    with a ``.to()`` method (an audit: apex's function helpers looked into lists, tuples and
    dicts only, and ran a function given a dataclass batch uncast)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return
    elif id(value) in _seen:  # (a back-reference: a tree node's .parent, an audit)
        return
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, _seen | {id(value)})
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item, _seen | {id(value)})
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name, None), _seen | {id(value)})
    elif callable(getattr(value, "to", None)) and not isinstance(value, nn.Module):
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict):
            for item in fields.values():
                yield from tensors_in(item, _seen | {id(value)})


def _cast_batch_object(
    value: Any, dtype: torch.dtype, *, saturate: bool, seen: frozenset[int]
) -> Any:
    """[Note: batch objects] apex hands an object with a ``.to()`` method (a script's batch class)
    ``.to(dtype)``. The usual helper passes its arguments to every tensor it holds, so the token
    ids and labels arrived as bf16, rounded (999 -> 1000): a forward that took ``.long()`` of
    them trained on the wrong tokens, silently (an audit). A copy with the floating tensors of
    its ``__dict__`` cast (the dataclass walk above) leaves them alone; an object without one
    (``__slots__``), or that cannot be copied, still gets its own ``.to(dtype)``. An object
    met again inside its own attributes (a parent link) is kept as it is: the walk recursed
    without end there (an audit)."""
    if id(value) in seen:
        return value
    seen = seen | {id(value)}
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and fields:
        try:
            out = copy.copy(value)
        except Exception:  # (a copy refused: the object's own to() below)
            out = value
        if out is not value and isinstance(getattr(out, "__dict__", None), dict):
            for key, field in fields.items():
                out.__dict__[key] = cast_floating(field, dtype, saturate=saturate, _seen=seen)
            return out
    return value.to(dtype)


def saturating_cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` with finite values beyond ``dtype``'s range rounded to its largest
    finite value instead of to inf; inf and NaN stay as they are.

    [Note: inputs cast down saturate] O2/O3 cast a model's floating inputs to the half dtype
    (apex's casts). An FP32 additive attention mask filled with ``finfo(float32).min`` (Hugging
    Face's own, and its users' 4D masks) became -inf even in bf16; a fully masked (padding) row's
    softmax then gave NaN, which spread through the sequence: NaN losses every step where FP32
    and a plain ``model.to(bfloat16)`` trained (an audit). In fp16 a ``-1e9`` mask did the same.
    Saturated, the mask keeps what it means (HF builds its half masks from ``finfo(half).min``).
    Real infs (a causal mask of ``float("-inf")``) are kept: their meaning is theirs.
    """
    big = torch.finfo(dtype).max
    return torch.where(tensor.isinf(), tensor, tensor.clamp(-big, big)).to(dtype)


def casts_off(device_type: str) -> bool:
    """Inside ``amp.disable_casts()``, or in a recomputation of a call made there.

    [Note: casts off in a recomputation] ``torch.utils.checkpoint`` recomputes a forward during
    backward, outside the block, restoring only torch's own autocast state: the recomputation
    ran in bf16 (reentrant: gradients 4.4e-3 off the forward's FP32; non-reentrant: a
    CheckpointError about dtypes, an audit). So the block also enters ``torch.autocast(
    enabled=False, cache_enabled=False)``, which the checkpoint restores, and autocast disabled
    with its cache off *during a backward* (where recomputations run) counts as the block.
    Outside a backward that pairing is no mark: torch turns the cache off globally in
    ``make_fx`` and the TorchScript ONNX exporter, and ``torch.set_autocast_cache_enabled(False)``
    is public — O1 went silently FP32 there (an audit)."""
    if CASTS_OFF.get():
        return True
    if _graph_task_id() == -1:  # not inside a backward: no recomputation
        return False
    return not torch.is_autocast_enabled(device_type) and not torch.is_autocast_cache_enabled()


def _graph_task_id() -> int:
    """The autograd engine's current graph task, -1 outside a backward."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return 0 if current is None else int(current())  # unknown: keep the recomputation mark


class AmpModule(nn.Module):
    """Mixin placed in front of a wrapped model's class; see [Note: class-level forward]."""

    _distamp_policy: ClassVar[CastPolicy]
    _distamp_properties: ClassVar[Properties]

    def __prepare_scriptable__(self) -> nn.Module:
        """torch.jit.script calls this first: refuse in words instead of TorchScript's "Compiled
        functions can't take variable number of arguments" pointing at this file (an audit)."""
        raise RuntimeError(
            f"torch.jit.script: expected a plain module, found {type(self).__name__} wrapped by "
            "distamp (its forward casts and enters autocast in Python, which TorchScript cannot "
            "compile): use torch.jit.trace, torch.export.export or torch.compile on it, or "
            "script a plain model loaded with its weights (model.state_dict(), or "
            "distamp.checkpoint.consolidate for FP32 ones)"
        )

    def forward(self, user_forward: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """The model's ``forward`` (``user_forward``, the class's: see [Note: a class-level mixin
        for ABC-first models]) with the opt_level's casts and autocast around it."""
        policy = type(self)._distamp_policy
        probes = self.__dict__.get("_distamp_dtype_probes")
        input_dtype = policy.input_dtype
        if probes and self.__dict__.get("_distamp_copy"):
            input_dtype = _copy_input_dtype(self, probes, input_dtype)
        elif probes:
            check_dtypes(self, probes)
        if input_dtype is not None:
            # See [Note: inputs cast down saturate].
            args = cast_floating(args, input_dtype, saturate=True)
            if kwargs:
                kwargs = cast_floating(kwargs, input_dtype, saturate=True)
        # torch.compile does not trace a context variable: a compiled forward keeps its autocast
        # (amp.disable_casts around a compiled call does not reach inside it).
        off = not torch.compiler.is_compiling() and casts_off(policy.device_type)
        if policy.autocast_dtype is not None and not off:
            with torch.autocast(policy.device_type, dtype=policy.autocast_dtype):
                output = user_forward(self, *args, **kwargs)
        else:
            output = user_forward(self, *args, **kwargs)
        if policy.output_dtype is not None:
            output = cast_floating(output, policy.output_dtype)
        return output


def dtype_probes(model: nn.Module) -> tuple[tuple[str, torch.dtype], ...]:
    """(name, dtype) of the model's first cast parameter and first parameter kept FP32, as wrap
    left them: what :func:`check_dtypes` compares at every forward."""
    probes: dict[bool, tuple[str, torch.dtype]] = {}
    for name, param in model.named_parameters():
        if param.is_floating_point():
            probes.setdefault(param.dtype == torch.float32, (name, param.dtype))
    return tuple(probes.values())


def _copy_input_dtype(
    model: nn.Module, probes: tuple[tuple[str, torch.dtype], ...], cast_to: torch.dtype | None
) -> torch.dtype | None:
    """[Note: a converted copy] A deep or pickled copy of a wrapped model (an EMA, a model saved
    with ``torch.save(model)``) owns no masters, so converting it is the user's business:
    ``copy.float()`` for an FP32 evaluation, ``.half()`` for an export. Refused before as if it
    were the wrapped model ("convert before wrap"), and its forward went on casting inputs to
    the half dtype of wrap (an audit). Its inputs follow its own cast weights' dtype now."""
    if cast_to is None:
        return None
    for name, dtype in probes:
        if dtype == cast_to:
            found = _probe_dtype(model, name)
            return cast_to if found is None else found
    return cast_to


def check_dtypes(model: nn.Module, probes: tuple[tuple[str, torch.dtype], ...]) -> None:
    """[Note: dtypes changed after wrap] ``model.float()``/``.half()``/``.to(dtype)`` or
    ``load_state_dict(..., assign=True)`` after wrap changes the weights' dtypes behind distamp's
    back: O2's forward then failed deep inside with torch's "mat1 and mat2 must have the same
    dtype", and O1's ``model.bfloat16()`` trained bf16 weights without a word. One dtype read per
    probe per forward says so at once."""
    for name, dtype in probes:
        found = _probe_dtype(model, name)
        if found is None:  # the parameter was removed: nothing to compare
            continue
        if found != dtype:
            props = getattr(type(model), "_distamp_properties", None)
            raise RuntimeError(
                f"distamp: parameter {name!r} is {found}, but distamp.wrap left it {dtype} "
                f"(opt_level {props.opt_level if props else '?'}): expected no dtype "
                "conversion of a wrapped model (model.float()/.half()/.to(dtype), "
                "load_state_dict(assign=True), a `.data =` of another dtype: re-initialize "
                "in place with nn.init, or assign `.data = t.to(p.dtype)`); convert before "
                "wrap, or wrap a fresh model "
                "(torch.func.functional_call: pass tensors in the dtypes wrap left, e.g. "
                "{k: v.to(p.dtype) for ...} over model.named_parameters())"
            )


def _probe_dtype(model: nn.Module, name: str) -> torch.dtype | None:
    """The dtype of whatever tensor sits at ``name`` now: a parameter, or the plain tensor
    ``torch.func.functional_call`` swaps in for the call (``get_parameter`` refused that one as
    "not an nn.Parameter", and the check was skipped: an audit got torch's bare "mat1 and mat2
    must have the same dtype" for FP32 tensors passed to an O2 model)."""
    prefix, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    found = getattr(owner, leaf, None)
    return found.dtype if isinstance(found, torch.Tensor) else None


class FP32NormModule(nn.Module):
    """Mixin for modules kept FP32 in a half model: inputs up, autocast off, outputs back down.

    Outputs go back to the dtype of the first floating-point input; a module that takes none (an
    embedding, a rotary table indexed by positions) returns ``_distamp_output_dtype``, the model's
    half dtype under O2/O3 (None under O0/O1: its outputs stay FP32 and autocast handles them).

    The inputs are cast up rather than handed to torch's mixed-dtype kernels: ``F.layer_norm`` of a
    bf16 input with FP32 weight and bias runs 2x faster on CPU, but in torch 2.13 its weight and
    bias gradients were off by up to 6.0 where the float64 reference reached 86 (8x128x512, measured;
    this path: 6e-5).
    """

    _distamp_output_dtype: ClassVar[torch.dtype | None] = None

    def forward(self, user_forward: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        first = _first_floating(args, kwargs)
        incoming = first.dtype if first is not None else type(self)._distamp_output_dtype
        # FP32 in the wrapped model (check_dtypes holds it there); a converted copy's own dtype
        # (see [Note: a converted copy]).
        own = next(
            (p.dtype for p in self._parameters.values() if p is not None and p.is_floating_point()),
            torch.float32,
        )
        args = cast_floating(args, own)
        if kwargs:
            kwargs = cast_floating(kwargs, own)
        device = first.device.type if first is not None else device_type_of(self)
        # Autocast (when the user runs one around a half model) would cast the module back down.
        # Entered only when one runs: ~9 us a call otherwise, ~2 ms of a step over 250 norm layers
        # (an audit).
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                output = user_forward(self, *args, **kwargs)
        else:
            output = user_forward(self, *args, **kwargs)
        if incoming is not None and incoming != own:
            output = cast_floating(output, incoming)
        return output


def _first_floating(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return arg
    return None


def _subclass(cls: type[nn.Module], mixin: type[nn.Module], attrs: dict[str, Any]) -> type:
    """A subclass of ``cls`` with ``mixin`` in front; same name so reprs read as before.

    [Note: pickling a wrapped model] pickle stores a class by module and name, which lead to the
    user's class, not this one, so ``torch.save(model)`` and handing the model to a spawned
    process failed ("not the same object as __main__.Net"). Instances of the generated class
    pickle as "make this subclass again from (cls, mixin, attrs), then set the state"; the
    copy runs the same forward (deepcopy takes the same road).
    """
    namespace = {
        "__module__": cls.__module__,
        "__reduce_ex__": _reduce_generated,
        "_distamp_made_from": (cls, mixin, attrs),
        **attrs,
    }
    if "forward" in mixin.__dict__:
        namespace["forward"] = _forward_with_signature(mixin.forward, cls)
    return type(cls.__name__, (_mixin_for(cls, mixin), cls), namespace)


def _mixin_for(cls: type[nn.Module], mixin: type[nn.Module]) -> type:
    """``mixin``, or where ``cls`` derives from a class without a ``__dict__`` before
    ``nn.Module`` (``class Base(ABC, nn.Module)``, torch's QAT fake-quantize modules), a subclass
    of that class and ``mixin``.

    [Note: a class-level mixin for ABC-first models] Python lets ``__class__`` be assigned only
    between classes whose chains of ``__base__`` end alike: the generated class's runs through
    the mixin to ``object``, the model's through ``ABC`` ("__class__ assignment: 'Net' object
    layout differs from 'Net'" at wrap, at every opt_level; an audit). Led by that class the
    mixin's chain ends as the model's. The mixin may then follow the model's class in the order
    methods are looked up: the generated class's forward calls the mixin's with the model's
    class's forward, which the mixin calls instead of ``super().forward``."""
    anchor: type = cls
    while anchor.__base__ is not None and anchor.__base__.__dictoffset__ != 0:
        anchor = anchor.__base__
    base: Any = anchor.__base__
    if base is None or base is object:
        return mixin
    if base is typing.Generic:  # class Net(Generic[T], nn.Module): bare Generic is refused
        base = typing.Generic[typing.TypeVar("T")]
    return types.new_class(
        mixin.__name__, (base, mixin), exec_body=lambda ns: ns.update(__module__=mixin.__module__)
    )


def _forward_with_signature(mixin_forward: Any, cls: type[nn.Module]) -> Any:
    """``mixin_forward`` around ``cls.forward`` (read at each call), under its signature and doc.

    Hugging Face's Trainer keeps only the dataset columns named in
    ``inspect.signature(model.forward)``; the mixin's ``(*args, **kwargs)`` made it drop them
    all ("The batch received was empty"; an audit)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return mixin_forward(self, cls.forward, *args, **kwargs)

    user_forward = cls.forward
    forward.__doc__ = getattr(user_forward, "__doc__", None)
    forward.__qualname__ = getattr(user_forward, "__qualname__", "forward")
    try:
        forward.__signature__ = inspect.signature(user_forward)  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin or a callable without one: keep *args
        pass
    return forward


def _reduce_generated(self: nn.Module, protocol: Any) -> Any:
    """See [Note: pickling a wrapped model]."""
    made = type(self).__dict__.get("_distamp_made_from")
    # A gather still in flight (overlap_gather) lands first: the copy (an EMA made right after
    # step()) must not read half-gathered weights. Found by duck type: masters/gather.py's hook.
    for hook in list(getattr(self, "_state_dict_pre_hooks", {}).values()):
        before_copy = getattr(hook, "before_copy", None)
        if callable(before_copy):
            before_copy()
    reduced = object.__reduce_ex__(self, protocol)
    if made is None or not isinstance(reduced, tuple):  # a class derived from ours (FSDP's)
        return reduced
    state = reduced[2] if len(reduced) > 2 else None
    if isinstance(state, dict) and "_distamp_dtype_probes" in state:
        state = {**state, "_distamp_copy": True}  # see [Note: a converted copy]
    return (_rebuild_generated, made, state, *reduced[3:])


def _rebuild_generated(cls: type[nn.Module], mixin: type[nn.Module], attrs: dict[str, Any]) -> Any:
    """See [Note: pickling a wrapped model]: an empty instance of the generated subclass."""
    made: Any = _subclass(cls, mixin, attrs)
    return made.__new__(made)


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
    if isinstance(keep, (str, nn.Module)):
        entries = [keep]
    elif isinstance(keep, Iterable):
        entries = list(keep)
    else:  # (an audit: 3 failed inside, "'int' object is not iterable")
        raise TypeError(
            f"keep_fp32_modules: expected a module, a name pattern (str) or a list of them, got "
            f"{type(keep).__name__} ({keep!r})"
        )
    named = [
        (name if len(models) == 1 else f"models[{i}].{name}", module)
        for i, model in enumerate(models)
        # every name a module is reached by (a shared module, an alias attribute): each is real
        for name, module in model.named_modules(remove_duplicate=False)
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


def keep_fp32(
    module: nn.Module,
    output_dtype: torch.dtype | None = None,
    classes: dict[tuple[type, torch.dtype | None], type] | None = None,
) -> None:
    """Give ``module`` the FP32 forward (:class:`FP32NormModule`); ``classes`` reuses one
    generated class per (class, output dtype) within one wrap call."""
    if isinstance(module, FP32NormModule):
        return
    cache = classes if classes is not None else {}
    key = (type(module), output_dtype)
    if key not in cache:
        cache[key] = _subclass(
            type(module), FP32NormModule, {"_distamp_output_dtype": output_dtype}
        )
    module.__class__ = cache[key]


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    """Which tensors of the wrapped models are cast to the half dtype and which modules run in FP32.

    [Note: one precision decision per tensor] Decided once, per parameter and per buffer (not per
    module), before anything is cast; ``cast_model`` and the FP32 masters both read this plan. A
    tensor shared by several modules (a tied embedding and LM head) gets one answer: FP32 as soon
    as one of its modules is kept FP32, and every module holding it then runs in FP32 too (a half
    module would otherwise receive an FP32 weight and fail in its forward).

    Under O2 (``keep_batchnorm_fp32``) these stay FP32: ``keep_fp32_modules``; normalization
    layers (see [Note: recognizing norm layers]) with their parameters and statistics; and the
    floating buffers of modules that hold no parameters at all, such as rotary-embedding tables
    (``inv_freq``, cos/sin caches) and sinusoidal position tables. Such tables are derived
    constants whose precision matters (RoPE's ``inv_freq`` in bf16 rotates by up to 0.18 rad wrong
    at distance 1024); keeping them FP32 is what FSDP2 and Hugging Face's ``from_pretrained(dtype=
    ...)`` do. Their module runs in FP32 and returns the incoming dtype, so the half layers around
    it see half tensors. Buffers of modules that hold parameters are cast with them (apex's
    behaviour: masks such as Swin's ``attn_mask`` meet half activations there); ``wrap`` warns
    when such a cast changed a buffer's values. O3 (``keep_batchnorm_fp32=False``) casts
    everything.

    One exception to the norm rule: the two norms of a ``nn.TransformerEncoderLayer`` are cast
    with it. Its inference fast path (eval mode, no grad; ``nn.TransformerEncoder`` with a padding
    mask turns the batch into a nested tensor for it) reads them straight from the layer into one
    fused kernel together with the layer's linear weights, bypassing their forward, and that
    kernel needs one dtype: with FP32 norms in a bf16 layer it raises "expected scalar type Float
    but found BFloat16". Cast with the layer they are what apex's O2 makes of every LayerNorm.
    """

    half_dtype: torch.dtype | None
    """The dtype the cast tensors take; None when nothing is cast (O0/O1)."""
    cast_params: frozenset[int]
    """ids of the parameters cast to ``half_dtype``."""
    cast_buffers: frozenset[int]
    """ids of the floating-point buffers cast to ``half_dtype``."""
    fp32_modules: tuple[nn.Module, ...]
    """The outermost modules whose forward runs in FP32."""
    shared: tuple[tuple[str, str, str], ...] = ()
    """(parameter, FP32 module, module made FP32 because it shares that parameter)."""


def _is_buffer_holder(module: nn.Module) -> bool:
    """A module with floating buffers and no parameters anywhere below it (a rotary table)."""
    if any(True for _ in module.parameters()):
        return False
    return any(b.is_floating_point() for b in module.buffers())


def plan_precision(
    models: list[nn.Module],
    props: Properties,
    fp32_modules: tuple[list[nn.Module], set[int]] = ([], set()),
) -> PrecisionPlan:
    """The :class:`PrecisionPlan` of ``models`` at ``props``; see [Note: one precision decision
    per tensor]. ``fp32_modules`` is :func:`resolve_fp32_modules`'s result."""
    keep_top, _ = fp32_modules
    chosen: dict[int, nn.Module] = {id(m): m for m in keep_top}
    # A module given the FP32 forward before wrap (``distamp.autocast_exclude``) casts its
    # inputs up: its weights must stay FP32 too (an audit: cast by O2, it crashed at the first
    # forward on "mat1 and mat2 must have the same dtype").
    covered = {id(sub) for m in keep_top for sub in m.modules()}
    for model in models:
        for module in model.modules():  # pre-order: an outer one covers its subtree
            if isinstance(module, FP32NormModule) and id(module) not in covered:
                chosen[id(module)] = module
                covered.update(id(sub) for sub in module.modules())
    target = props.cast_model_type if props.model_is_cast else None
    if target is None:
        return PrecisionPlan(
            half_dtype=None,
            cast_params=frozenset(),
            cast_buffers=frozenset(),
            fp32_modules=tuple(chosen.values()),
        )
    names = {
        id(m): (n if len(models) == 1 else f"models[{i}].{n}") or "<model>"
        for i, model in enumerate(models)
        for n, m in model.named_modules()
    }
    inside: set[int] = {id(s) for m in chosen.values() for s in m.modules()}

    def keep(module: nn.Module) -> None:
        chosen[id(module)] = module
        inside.update(id(s) for s in module.modules())

    all_modules = [m for model in models for m in model.modules()]
    fused = {  # read by the layer's fused inference kernel: one dtype with it (see the Note)
        id(norm)
        for m in all_modules
        if isinstance(m, nn.TransformerEncoderLayer)
        for norm in (m.norm1, m.norm2)
    }
    if props.keep_batchnorm_fp32:
        for module in all_modules:  # pre-order: an outer match covers its subtree
            if id(module) in inside or id(module) in fused:
                continue
            if is_norm(module) or _is_buffer_holder(module):
                keep(module)
    owners: dict[int, list[nn.Module]] = {}
    params: dict[int, torch.Tensor] = {}
    for module in all_modules:
        for p in module._parameters.values():
            if p is not None and p.is_floating_point():
                owners.setdefault(id(p), []).append(module)
                params[id(p)] = p
    param_names: dict[int, str] = {}
    for i, model in enumerate(models):
        for n, p in model.named_parameters():
            param_names.setdefault(id(p), n if len(models) == 1 else f"models[{i}].{n}")
    shared: list[tuple[str, str, str]] = []
    for pid, mods in owners.items():
        kept_by = next((m for m in mods if id(m) in inside), None)
        if kept_by is None:
            continue
        for module in mods:
            if id(module) in inside:
                continue
            if any(True for c in module.children() for _ in c.parameters()):
                raise ValueError(
                    f"parameter {param_names.get(pid, '?')!r} is shared by "
                    f"{names.get(id(kept_by), '?')!r}, which is kept FP32, and "
                    f"{names.get(id(module), '?')!r}, which holds half-precision submodules: "
                    "expected one precision per parameter; list "
                    f"{names.get(id(module), '?')!r} in keep_fp32_modules too, or untie them"
                )
            keep(module)
            shared.append(
                (param_names.get(pid, "?"), names.get(id(kept_by), "?"), names.get(id(module), "?"))
            )
    fp32_params = {pid for pid, mods in owners.items() if any(id(m) in inside for m in mods)}
    buffer_owners: dict[int, list[nn.Module]] = {}
    for module in all_modules:
        for b in module._buffers.values():
            if b is not None and b.is_floating_point():
                buffer_owners.setdefault(id(b), []).append(module)
    return PrecisionPlan(
        half_dtype=target,
        cast_params=frozenset(pid for pid in owners if pid not in fp32_params),
        cast_buffers=frozenset(
            bid for bid, mods in buffer_owners.items() if not any(id(m) in inside for m in mods)
        ),
        fp32_modules=tuple(chosen.values()),
        shared=tuple(shared),
    )


def cast_tensors(model: nn.Module, plan: PrecisionPlan) -> None:
    """Cast the parameters and buffers of ``model`` that ``plan`` casts, in place (parameters
    keep their identity: only ``.data`` changes)."""
    if plan.half_dtype is None:
        return
    cast: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is None or id(param) not in plan.cast_params:
                    continue
                if param.dtype != plan.half_dtype:
                    param.data = param.data.to(plan.half_dtype)
                    if param.grad is not None:
                        param.grad = param.grad.to(plan.half_dtype)
            for name, buffer in module._buffers.items():
                if buffer is None or id(buffer) not in plan.cast_buffers:
                    continue
                if id(buffer) not in cast:
                    cast[id(buffer)] = buffer.to(plan.half_dtype)
                module._buffers[name] = cast[id(buffer)]


def cast_model(model: nn.Module, props: Properties, device_type: str, plan: PrecisionPlan) -> None:
    """Cast ``model`` in place as ``plan`` says and give it the autocast/cast ``forward``.

    Parameters keep their identity (only ``.data`` changes), so references held elsewhere stay
    valid; FP32 master copies must be taken before this is called. The plan's FP32 modules that
    belong to ``model`` get the FP32 forward.
    """
    classes: dict[tuple[type, torch.dtype | None], type] = {}
    mine = {id(m) for m in model.modules()}
    for module in plan.fp32_modules:
        if id(module) in mine:
            keep_fp32(module, plan.half_dtype, classes)
            # [Note: the whole kept subtree runs in FP32] Every module inside a kept one gets the
            # FP32 forward too: a kept ModuleList is never called, a kept module's child may be
            # called by another module (``self.attn.q(x)`` from the parent, a block shared with
            # a half one), and each then ran its FP32 weights on half inputs ("mat1 and mat2
            # must have the same dtype") or under O1's autocast (an audit). Called from inside
            # the kept module they cast nothing (their inputs are FP32 already).
            for sub in module.modules():
                if sub is not module:
                    keep_fp32(sub, None, classes)
    cast_tensors(model, plan)
    model.__class__ = _subclass(
        type(model),
        AmpModule,
        {"_distamp_policy": cast_policy(props, device_type), "_distamp_properties": props},
    )
    warn_about_instance_forward(model, props, "distamp.wrap")


def warn_about_instance_forward(model: nn.Module, props: Properties, api: str) -> None:
    """A ``forward`` set on the instance (a user's patch, accelerate's ``convert_outputs_to_fp32``)
    is what Python calls, not the class-level forward distamp gives the model: O1 trained in plain
    FP32, silently (an audit)."""
    if "forward" in model.__dict__ and (props.patch_torch_functions or props.model_is_cast):
        warn_from_caller(
            f"{api}: model.forward is set on the instance ({model.__dict__['forward']!r:.80}), "
            "so Python calls it instead of the forward distamp gives the model's class: "
            f"{'autocast' if props.patch_torch_functions else 'the input casts'} of "
            f"{props.opt_level} do not run in it. Delete it before wrapping (del model.forward) "
            "and put what it did in the class's forward, or call the wrapped forward from it "
            "(type(model).forward(model, ...))"
        )


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


def _warn_about_hf_fp32_modules(models: list[nn.Module], plan: PrecisionPlan, api: str) -> None:
    """Hugging Face keeps some modules FP32 in a half model (``_keep_in_fp32_modules``: T5's
    ``wo``, MoE routers); O2 casts them like the rest, silently (an audit: T5's ``wo`` overflowed
    in fp16, HF's clamp hid it, the loss drifted)."""
    found, listed = hf_fp32_params(models, plan)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        warn_from_caller(
            f"{api}: Hugging Face keeps {sorted(listed)} FP32 in half precision "
            f"(_keep_in_fp32_modules), cast to {plan.half_dtype} here: {found[:3]}{more}. "
            + HF_FP32_ADVICE
        )


HF_FP32_ADVICE = (
    "In fp16 they may overflow (T5's wo). O1 keeps every weight FP32; bf16 has FP32's range. "
    "keep_fp32_modules keeps them FP32 at O2, but their FP32 outputs then flow on: where the "
    "caller casts up before such a module (T5 before wo), the residual stream turns FP32 and "
    "the half layers after the next norm refuse it"
)


def hf_fp32_params(models: list[nn.Module], plan: PrecisionPlan) -> tuple[list[str], set[str]]:
    """The parameters ``plan`` casts that Hugging Face's ``_keep_in_fp32_modules`` lists, and
    the listed names that matched."""
    found: list[str] = []
    listed: set[str] = set()
    for model in models:
        names = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(
            getattr(model, "_keep_in_fp32_modules_strict", None) or ()
        )
        names = {n for n in names if isinstance(n, str)}
        if not names:
            continue
        for name, param in model.named_parameters():
            if id(param) in plan.cast_params and names & set(name.split(".")):
                found.append(name)
                listed |= names & set(name.split("."))
    return found, listed


def warn_about_plan(
    models: list[nn.Module],
    plan: PrecisionPlan,
    props: Properties,
    api: str = "distamp.wrap",
) -> None:
    """Warn once about what the plan decided that a user would not expect (``api``: the call
    that cast, also ``distamp.fsdp.fully_shard``, which takes no keep_fp32_modules)."""
    keep = "list its module in keep_fp32_modules" if api == "distamp.wrap" else "train O1"
    for param, kept_by, module in plan.shared:
        warn_from_caller(
            f"{api}: parameter {param!r} is shared by {kept_by!r}, which stays FP32, and "
            f"{module!r}: one precision per parameter, so {module!r} runs in FP32 too",
        )
    if plan.half_dtype is None or not props.keep_batchnorm_fp32:
        return
    _warn_about_hf_fp32_modules(models, plan, api)
    cast = [  # the buffers cast with their module's parameters, by name
        (f"{prefix}{'.' if prefix else ''}{name}", buf)
        for model in models
        for prefix, module in model.named_modules()
        for name, buf in module._buffers.items()
        if buf is not None and id(buf) in plan.cast_buffers
    ]
    lossy = [n for n, b in cast if not torch.equal(b.to(plan.half_dtype).to(b.dtype), b)]
    scalars = [n for n, b in cast if b.dim() == 0]
    if scalars:  # (an audit: a step counter cast unchanged at 0 stopped at 256, no warning)
        integers = round(2 / torch.finfo(plan.half_dtype).eps)  # 256 in bf16, 2048 in fp16
        warn_from_caller(
            f"{api}: scalar buffer(s) {scalars[:3]}"
            f"{f' and {len(scalars) - 3} more' if len(scalars) > 3 else ''} cast to "
            f"{plan.half_dtype} with their module's parameters: a counter or running total "
            f"there stops counting exactly past {integers} (x += 1 stays at {integers}). If one "
            f"is, hold it in a module without parameters (kept FP32), {keep}, or make it an "
            "integer buffer",
        )
    if lossy:
        more = f" and {len(lossy) - 3} more" if len(lossy) > 3 else ""
        warn_from_caller(
            f"{api}: buffer(s) {lossy[:3]}{more} lost precision when cast to "
            f"{plan.half_dtype} with their module's parameters. If one is a derived table "
            "(rotary inv_freq or cos/sin, position encodings), keep it FP32: hold it in a module "
            "without parameters (distamp keeps those FP32, as Hugging Face's rotary embedding "
            f"does) or {keep}",
        )
