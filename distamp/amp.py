"""``from distamp import amp``: a drop-in for the deleted ``apex.amp`` module.

A script that uses apex's public API and changes only ``from apex import amp`` to ``from distamp
import amp`` runs unchanged: ``amp.initialize``, ``amp.scale_loss``, ``amp.state_dict``/``amp.load_state_dict``,
``amp.master_params``, ``amp.disable_casts``, the ``half_function``/``float_function``/
``promote_function`` decorators and ``register_*_function``. Everything runs on :func:`distamp.wrap`, so it is correct across DDP
ranks (one skip decision for all) where apex was not.

[Note: the apex registry] apex kept its loss scalers in a module-level ``_amp_state``, and
``amp.state_dict()`` takes no argument. To keep that call shape, this module — and only this
module; the rest of distamp has no module-level state — remembers the scalers of the most recent
``amp.initialize`` in ``_REGISTRY``. Two ``initialize`` calls in one process replace each other's
entry, as in apex; use :func:`distamp.wrap` and ``optimizer.state_dict()`` to hold several.

Differences from apex that a script can notice: gradients are unscaled at ``optimizer.step()``
(or when :func:`master_params` is called, which is where apex scripts clip; on every rank: it takes
the global skip decision), not at the end of the ``scale_loss`` block — so under O2 the FP32 masters
in ``optimizer.param_groups`` have no ``.grad`` until then: a script that edits gradients there
(NVIDIA's ConvNets divide them for accumulation) iterates ``amp.master_params(optimizer)``
instead; apex's private state (``_amp_stash``, ``_has_overflow`` aside, ...) is refused by name; masters are replicated
(``shard_master_weights=False``) as apex's were; ``register_*_function`` refuses torch's own
modules (distamp never patches torch) and says what to write instead. tests/test_apex_conformance.py
holds apex's own amp tests rewritten against this module.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from . import casting
from .config import check_positive_finite
from .masters.optimizer import AmpOptimizer, inner_optimizer
from .optstate import OptState
from .scaler import LossScaler, ScalerGroup
from .wrap import scale_loss as _scale_loss
from .wrap import unscale_, wrap

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, ScalerGroup | None] = {}
"""The scalers of the latest ``initialize`` given an optimizer (see [Note: the apex registry]);
None when it made none (``enabled=False``); a call without an optimizer leaves it."""


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | LossScaler | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    **distamp_options: Any,
) -> Any:
    """apex's ``amp.initialize``: same arguments, same return shapes; runs :func:`distamp.wrap`.

    ``distamp_options`` are passed on (``half_dtype``, ``process_group``, ...); masters are
    replicated unless ``shard_master_weights=True`` is given.
    """
    distamp_options.setdefault("shard_master_weights", False)
    result = wrap(
        models,
        optimizers,
        opt_level=opt_level,
        enabled=enabled,
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
        **distamp_options,
    )
    # The scalers of this call become amp.state_dict()'s (none when it was disabled); a call
    # without an optimizer (a frozen teacher for distillation) makes none and leaves the earlier
    # call's in place: it cleared them, and the student's checkpoint lost its scale (an audit).
    # Optimizer wrappers (apex's LARC) are looked through (an audit: their scalers were never
    # found).
    inners = [
        inner_optimizer(o) or o
        for o in (optimizers if isinstance(optimizers, (list, tuple)) else [optimizers])
        if o is not None
    ]
    if inners:
        _REGISTRY.clear()
        _REGISTRY["group"] = next(
            (o._distamp.group for o in inners if isinstance(o, AmpOptimizer)), None
        )
    return result


def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Any:
    """apex's ``amp.scale_loss`` (``model`` and ``delay_overflow_check`` are accepted and unused)."""
    return _scale_loss(loss, optimizers, loss_id=loss_id, delay_unscale=delay_unscale)


_APEX_INTERNALS = {
    "_has_overflow": "distamp.stats(optimizer).last_step_skipped",
    "_overflow_buf": "distamp.stats(optimizer).last_step_skipped (the skip is decided in step())",
    "update_scale": "nothing: the scale moves in optimizer.step()",
    "_amp_stash": "amp.master_params(optimizer) for the FP32 masters (in optimizer.state_dict())",
    "_lazy_init_maybe_master_weights": (
        "nothing: the FP32 masters exist from initialize and come back with "
        "optimizer.load_state_dict (drop the 'master params' restore)"
    ),
    "opt_properties": "the arguments given to amp.initialize (distamp keeps them per optimizer)",
    "handle": "amp.scale_loss / amp.disable_casts (no handle object)",
}
"""apex internals that NVIDIA's DeepLearningExamples read, and what to write instead (an audit:
bare AttributeErrors naming the user's own optimizer class)."""


def _apex_internal(owner: str, name: str) -> AttributeError:
    if name in _APEX_INTERNALS:
        return AttributeError(
            f"{owner}.{name} is apex's internal state, which distamp.amp does not keep: "
            f"expected {_APEX_INTERNALS[name]}"
        )
    return AttributeError(f"{owner} has no attribute {name!r}")


class _ScalerView:
    """One of apex's ``amp._amp_state.loss_scalers``, as scripts read and set it: ``loss_scale()``,
    ``_loss_scale`` (NVIDIA's BERT sets it to start at 2**20), ``_unskipped`` and ``_has_overflow``
    (whether the last step was skipped). Other attributes are refused, not stored on a view that
    is thrown away."""

    __slots__ = ("_group", "_scaler")

    def __init__(self, scaler: LossScaler, group: ScalerGroup) -> None:
        self._scaler = scaler
        self._group = group

    def __getattr__(self, name: str) -> Any:
        raise _apex_internal("amp._amp_state.loss_scalers[i]", name)

    @property
    def _has_overflow(self) -> bool:
        """apex's flag after a step: this loss overflowed at its last update (NVIDIA's BERT counts
        skipped steps with it). Per loss, as apex's: any optimizer's skip set every loss's (an
        audit, DCGAN's three losses)."""
        return self._scaler.last_overflow

    def loss_scale(self) -> float:
        return self._scaler.scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler.scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        # (numpy's and tensor numbers too, held as a float: an audit)
        scale = check_positive_finite("amp._amp_state.loss_scalers[i]._loss_scale", value)
        if self._scaler.dynamic:  # kept inside min/max_loss_scale, as a loaded scale is
            self._scaler.set_loaded_scale(scale, "the _loss_scale set,", stacklevel=3)
        else:  # apex's static scaler takes the value set
            self._scaler.scale = scale

    @property
    def _unskipped(self) -> int:
        return self._scaler.clean_steps


class _AmpStateView:
    """apex's private ``amp._amp_state``, read-only but for the scale: ``loss_scalers`` of the
    latest ``initialize`` (empty with ``enabled=False``; refused before one, as apex has none
    then — a script wrapped with ``distamp.wrap`` got an empty list and an IndexError)."""

    @property
    def loss_scalers(self) -> list[_ScalerView]:
        if "group" not in _REGISTRY:  # no initialize yet: said by __getattr__, asked next
            raise AttributeError("loss_scalers")
        group = _REGISTRY["group"]
        return [_ScalerView(s, group) for s in group.scalers] if group is not None else []

    def __getattr__(self, name: str) -> Any:
        # (also reached when the property above raised: Python then asks __getattr__)
        if name == "loss_scalers":
            raise AttributeError(
                "amp._amp_state.loss_scalers: expected amp.initialize(...) to have run in this "
                "process, found none (a model wrapped with distamp.wrap: read its scales with "
                "distamp.stats(optimizer).loss_scales)"
            )
        raise _apex_internal("amp._amp_state", name)


def __getattr__(name: str) -> Any:
    """``amp._amp_state``: apex-era scripts log (and set) the scale through it (an audit)."""
    if name == "_amp_state":
        return _AmpStateView()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The FP32 tensors ``optimizer`` steps, with their *unscaled* gradients (after a block with
    ``delay_unscale=True``, as under apex, their gradients are not brought up to date).

    apex unscaled into the masters when ``scale_loss`` ended, and scripts clip here:
    ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)``. distamp unscales
    (and takes the global skip decision, a collective: call it on every rank) when this is first
    called after a backward. An optimizer wrapper (apex's LARC) gives its inner optimizer's masters.
    """
    inner = inner_optimizer(optimizer)
    if isinstance(inner, AmpOptimizer):
        if inner._distamp.masters.sharded:
            warnings.warn(
                "amp.master_params: the FP32 masters are sharded across ranks "
                "(shard_master_weights=True), so this rank yields only its shard and a norm over "
                "them is this rank's alone; clip with distamp.clip_grad_norm_(optimizer, max_norm) "
                "(the global norm), or leave shard_master_weights off as apex did",
                stacklevel=2,
            )
        if inner._distamp.state is OptState.SCALED and not inner._distamp.delayed_unscale:
            # After a block with delay_unscale=True (apex's accumulation micro-batch) apex left
            # the masters' gradients alone; unscaling here decided the step mid-accumulation and
            # the next scale_loss refused to run (an audit: a norm logged per micro-batch).
            unscale_(inner)
    return iter([p for group in optimizer.param_groups for p in group["params"]])


_NOT_INITIALIZED = (
    "{call}: amp.initialize was not called in this process, so it {then}; the loss scale of "
    "distamp.wrap's optimizer is saved and restored by optimizer.state_dict() / "
    "load_state_dict() (and distamp.save_checkpoint)"
)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """apex's ``amp.state_dict()``: ``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}}``.

    The FP32 masters are in ``optimizer.state_dict()`` (apex lost them); save both.
    """
    out = destination if destination is not None else {}
    if "group" not in _REGISTRY:
        warnings.warn(
            _NOT_INITIALIZED.format(call="amp.state_dict()", then="returns {}"), stacklevel=2
        )
        return out
    group = _REGISTRY["group"]
    if group is None:
        return out
    for i, scaler in enumerate(group.scalers):
        out[f"loss_scaler{i}"] = {"loss_scale": scaler.scale, "unskipped": scaler.clean_steps}
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """Restore :func:`state_dict`'s output into the scalers of the latest ``initialize``."""
    if "group" not in _REGISTRY:
        if not state:  # what amp.state_dict() gave without initialize: nothing to restore
            warnings.warn(
                _NOT_INITIALIZED.format(call="amp.load_state_dict({})", then="loads nothing"),
                stacklevel=2,
            )
            return
        raise RuntimeError(
            "amp.load_state_dict: expected amp.initialize(model, optimizer, ...) to be called "
            f"first (apex's order: initialize, then load the model, optimizer and amp state); "
            f"found no initialize in this process, and {sorted(state)} to load"
        )
    group = _REGISTRY["group"]
    if group is None:  # initialize(enabled=False) or without optimizers: no scalers, a no-op
        if state:
            warnings.warn(
                f"amp.load_state_dict: the latest amp.initialize made no loss scalers "
                f"(enabled=False, or no optimizer), so {sorted(state)} are not loaded",
                stacklevel=2,
            )
        return
    if len(state) != len(group.scalers):
        raise ValueError(
            f"amp.load_state_dict: expected {len(group.scalers)} loss scaler(s) (num_losses), "
            f"found {len(state)}: {sorted(state)}"
        )
    # Every scaler's entry is checked before any is loaded (an audit: loss_scaler0 was loaded,
    # then loss_scaler1 refused; a missing loss_scale was a bare KeyError).
    loaded: list[tuple[float, int]] = []
    for i in range(len(group.scalers)):
        key = f"loss_scaler{i}"
        if key not in state:
            raise ValueError(f"amp.load_state_dict: expected key {key!r}, found {sorted(state)}")
        entry = state[key]
        if not isinstance(entry, dict) or "loss_scale" not in entry:
            found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(
                f"amp.load_state_dict: {key}: expected apex's {{'loss_scale': ..., "
                f"'unskipped': ...}}, found {found}"
            )
        scale, unskipped = entry["loss_scale"], entry.get("unskipped", 0)
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = scale.item()
        if isinstance(unskipped, torch.Tensor) and unskipped.numel() == 1:
            unskipped = unskipped.item()
        if (
            isinstance(scale, bool)
            or not isinstance(scale, numbers.Real)
            or not (0 < float(scale) < float("inf"))
        ):
            raise ValueError(
                f"amp.load_state_dict: {key}: expected a positive finite loss_scale, got {scale!r}"
            )
        if (
            isinstance(unskipped, bool)
            or not isinstance(unskipped, numbers.Integral)
            or int(unskipped) < 0
        ):
            raise ValueError(
                f"amp.load_state_dict: {key}: expected unskipped as a count >= 0, got {unskipped!r}"
            )
        loaded.append((float(scale), int(unskipped)))
    for i, (scaler, (scale, unskipped)) in enumerate(zip(group.scalers, loaded, strict=True)):
        if scaler.dynamic:  # the bounds optimizer.load_state_dict keeps (called before this)
            scaler.set_loaded_scale(scale, f"amp.load_state_dict's loss_scaler{i}", stacklevel=3)
        else:  # apex's static scaler takes the loaded value (apex's own tests set it so)
            scaler.scale = scale
        scaler.clean_steps = unskipped


# -- per-function precision -----------------------------------------------------------------------


def _first_tensor(values: Any) -> torch.Tensor | None:
    """The first tensor among ``values``, looking where the model's input cast looks (lists,
    tuples, mappings, dataclasses, batch objects: see ``casting.tensors_in``)."""
    return next(casting.tensors_in(tuple(values)), None)


def _autocast_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The device type whose autocast is on, judged from the first tensor argument."""
    tensor = _first_tensor((*args, *kwargs.values()))
    if tensor is None:
        return None
    device = tensor.device.type
    return device if torch.is_autocast_enabled(device) else None


def _widest(values: Any) -> torch.dtype | None:
    widest: torch.dtype | None = None
    for tensor in casting.tensors_in(tuple(values)):
        if tensor.is_floating_point():
            # torch's promotion: fp16 with bf16 is FP32 (an audit: the first 16-bit one won, so
            # the result depended on the order of the arguments)
            dtype = tensor.dtype
            widest = dtype if widest is None else torch.promote_types(widest, dtype)
    return widest


def _cast_call(fn: F, pick: Callable[[str, tuple[Any, ...]], torch.dtype | None]) -> F:
    """``fn`` wrapped: under autocast, its floating inputs cast to ``pick(device, inputs)`` and
    autocast off inside; outside autocast (or when ``pick`` gives None) ``fn`` runs unchanged."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = _autocast_device(args, kwargs)
        dtype = pick(device, (*args, *kwargs.values())) if device is not None else None
        if device is None or dtype is None:
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            # the model's input walk: namedtuples rebuilt field by field, mapping types kept
            # (an audit: a namedtuple argument raised TypeError, a defaultdict became a dict)
            return fn(*casting.cast_floating(args, dtype), **casting.cast_floating(kwargs, dtype))

    return wrapper  # type: ignore[return-value]


def half_function(fn: F) -> F:
    """Run ``fn`` in the autocast half dtype when autocast is on (O1): its floating inputs are cast
    to it. Outside autocast ``fn`` runs unchanged."""
    return _cast_call(fn, lambda device, _: torch.get_autocast_dtype(device))


def float_function(fn: F) -> F:
    """Run ``fn`` in FP32: under autocast (O1) inputs cast up and autocast off inside; outside it
    half inputs are cast up too (a loss function computed outside the model's forward on its
    half outputs: apex ran it in FP32 wherever it was called, and an fp16 sum of squares
    overflows). FP32 inputs run unchanged."""
    under_autocast = _cast_call(fn, lambda _device, _inputs: torch.float32)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _autocast_device(args, kwargs) is None and _has_half((*args, *kwargs.values())):
            return fn(
                *casting.cast_floating(args, torch.float32),
                **casting.cast_floating(kwargs, torch.float32),
            )
        return under_autocast(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _has_half(values: Any) -> bool:
    half = (torch.float16, torch.bfloat16)
    return any(t.dtype in half for t in casting.tensors_in(tuple(values)))


def promote_function(fn: F) -> F:
    """Under autocast, cast ``fn``'s floating inputs to the widest floating dtype among them."""
    return _cast_call(fn, lambda _device, inputs: _widest(inputs))


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """apex's ``with amp.disable_casts():``: no automatic casting inside the block — O1's
    autocast is off there on every device type it was on, also inside the forward of a wrapped
    model called in the block — so ops run in their inputs' dtypes, as in apex."""
    token = casting.CASTS_OFF.set(True)  # see [Note: casts turned off around a call]
    try:
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):
                if device == "cpu" or torch.cuda.is_available():
                    # cache off: the mark a recomputation finds (see casting.casts_off)
                    stack.enter_context(torch.autocast(device, enabled=False, cache_enabled=False))
            yield
    finally:
        casting.CASTS_OFF.reset(token)


def _register(module: Any, name: str, decorator: Callable[[F], F], what: str) -> None:
    module_name = getattr(module, "__name__", type(module).__name__)
    if module_name == "torch" or module_name.startswith("torch."):
        raise ValueError(
            f"amp.{what}({module_name}, {name!r}): distamp never patches torch itself; expected "
            f"a module of your own. Call the wrapped function instead, e.g. "
            f"`{name} = amp.{what.replace('register_', '')}({module_name}.{name})` and use "
            f"`{name}(...)` where you called `{module_name}.{name}(...)`"
        )
    if not hasattr(module, name):  # apex raised ValueError("No function named ...") here too
        raise ValueError(f"amp.{what}: expected a function named {name!r} in {module_name}")
    original = getattr(module, name)
    if not callable(original):
        raise TypeError(
            f"amp.{what}: expected {module_name}.{name} to be a function, found "
            f"{type(original).__name__}"
        )
    setattr(module, name, decorator(original))


def register_half_function(module: Any, name: str) -> None:
    """Replace ``module.name`` (a function of *your* module) by ``half_function`` of it."""
    _register(module, name, half_function, "register_half_function")


def register_float_function(module: Any, name: str) -> None:
    """Replace ``module.name`` (a function of *your* module) by ``float_function`` of it."""
    _register(module, name, float_function, "register_float_function")


def register_promote_function(module: Any, name: str) -> None:
    """Replace ``module.name`` (a function of *your* module) by ``promote_function`` of it."""
    _register(module, name, promote_function, "register_promote_function")


# -- what apex had that no longer makes sense ---------------------------------------------------------


def init(*args: Any, **kwargs: Any) -> None:
    """apex's old ``amp.init()`` (pre-``initialize`` API): refused with what to write instead."""
    raise RuntimeError(
        "amp.init() is the old apex API that apex itself replaced; write "
        "`model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
        "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`"
    )


class FP16_Optimizer:
    """apex's ``FP16_Optimizer``: refused with what to write instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "FP16_Optimizer is not supported: write `model, optimizer = amp.initialize(model, "
            "optimizer, opt_level='O2')` (FP32 master weights inside the optimizer, dynamic loss "
            "scale) and `with amp.scale_loss(loss, optimizer) as scaled_loss: "
            "scaled_loss.backward()`"
        )


__all__ = [
    "FP16_Optimizer",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
