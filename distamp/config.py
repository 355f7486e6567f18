"""opt_level presets (apex.amp's O0-O3), the resolved :class:`Properties`, and override validation."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import sys
import warnings
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

OPT_LEVELS = ("O0", "O1", "O2", "O3")
HALF_DTYPES = (torch.float16, torch.bfloat16)

DISABLED_ATTR = "_distamp_disabled"
"""Attribute ``wrap(..., enabled=False)`` sets on each optimizer: its resolved Properties. Every
other distamp call reads it (through :func:`disabled_properties`) and becomes a no-op."""
DISABLED_GROUP_ATTR = "_distamp_disabled_group"
"""Beside it: the process group that call named (``process_group``, or ``fully_shard``'s mesh),
which the checkpoint functions run over (an audit: they ran over the whole world, and groups
that saved apart crashed, a one-rank group's save waited for ranks that never came)."""
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP32_MAX = torch.finfo(torch.float32).max
"""The largest loss scale a loss may be multiplied by, or a setting may name (the scaled loss is
FP32)."""

LossScale = float | Literal["dynamic"]


@dataclass(frozen=True, kw_only=True)
class Properties:
    """The fully resolved mixed-precision settings of one :func:`distamp.wrap` call."""

    opt_level: str
    """The apex opt_level these properties started from ("O0".."O3")."""
    enabled: bool = True
    """False turns every distamp call into a no-op."""
    half_dtype: torch.dtype = torch.bfloat16
    """The reduced-precision dtype used by autocast (O1) or by the model's weights (O2/O3)."""
    cast_model_type: torch.dtype | None = None
    """dtype the model's floating parameters and buffers are cast to; None leaves them FP32."""
    patch_torch_functions: bool = False
    """Run the model's forward under ``torch.autocast`` (O1). Torch itself is never patched."""
    keep_batchnorm_fp32: bool | None = None
    """Keep normalization layers (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm) in FP32."""
    master_weights: bool = False
    """The optimizer steps FP32 copies of the half-precision weights."""
    loss_scale: LossScale = 1.0
    """A static loss scale, or "dynamic"."""
    cast_model_outputs: torch.dtype | None = None
    """dtype floating outputs of the model are cast to; None: FP32 when the model is cast, else as is."""
    num_losses: int = 1
    """Number of losses, each with its own loss scaler (``scale_loss(..., loss_id=i)``)."""
    verbosity: int = 1
    """0 silences distamp's log lines; 1 logs skipped steps on rank 0, rate-limited."""
    min_loss_scale: float | None = None
    """Floor of the dynamic loss scale; a skip at the floor raises instead of looping."""
    max_loss_scale: float = 2.0**24
    """Cap of the dynamic loss scale (also caps its initial value 2**16)."""
    shard_master_weights: bool = False
    """Each rank holds only its shard of the FP32 masters and of the optimizer state. With FP32
    model weights (O0, O1; only when asked for) the shard is of the weights themselves: each rank
    steps 1/N of them and the updated weights are all-gathered (see [Note: sharded FP32 weights])."""
    max_consecutive_skips: int = 50
    """Consecutive skipped steps after which distamp raises instead of skipping on."""

    def __post_init__(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise ValueError(f"opt_level: expected one of {OPT_LEVELS}, got {self.opt_level!r}")
        if self.half_dtype not in HALF_DTYPES:
            raise ValueError(f"half_dtype: expected one of {HALF_DTYPES}, got {self.half_dtype}")
        for name in ("cast_model_type", "cast_model_outputs"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(f"{name}: expected None or one of {_FLOAT_DTYPES}, got {value!r}")
        # Python ints whatever integer was given (numpy's, a one-element integer tensor), as the
        # loss-scale settings below (an audit: np.int64(2) was refused here, taken by LossScaler)
        for name, low in (("num_losses", 1), ("verbosity", 0), ("max_consecutive_skips", 1)):
            given = getattr(self, name)
            # (verbosity=True/False: a log switch, apex's habit; a bool count is a mistake)
            value = int(given) if name == "verbosity" and isinstance(given, bool) else as_int(given)
            if value is None or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {given!r}")
            object.__setattr__(self, name, value)
        # Held as Python floats, whatever number was given (numpy's, a tensor): the properties go
        # into state dicts and checkpoints, which load with weights_only=True, and into the
        # ranks' fingerprint (a review: np.float32 made a checkpoint that could not be loaded).
        # float("inf"): no cap (DeepSpeed's and torch.amp's); growth still stops at FP32's largest
        floor, cap = check_scale_bounds(self.min_loss_scale, self.max_loss_scale)
        object.__setattr__(self, "min_loss_scale", floor)
        object.__setattr__(self, "max_loss_scale", cap)
        if self.loss_scale != "dynamic":
            object.__setattr__(
                self, "loss_scale", check_positive_finite("loss_scale", self.loss_scale)
            )

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts to overflows."""
        return self.loss_scale == "dynamic"

    @property
    def model_is_cast(self) -> bool:
        """True when the model's weights are cast to a half dtype (O2, O3)."""
        return self.cast_model_type in HALF_DTYPES

    def as_plain_dict(self) -> dict[str, Any]:
        """The properties as strings, numbers and bools (for checkpoints and fingerprints)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, torch.dtype) else value
        return out


# apex.amp's presets. "half" stands for the resolved half dtype.
_PRESETS: dict[str, dict[str, Any]] = {
    "O0": dict(
        cast_model_type=torch.float32,
        patch_torch_functions=False,
        keep_batchnorm_fp32=None,
        master_weights=False,
        loss_scale=1.0,
    ),
    "O1": dict(
        cast_model_type=None,
        patch_torch_functions=True,
        keep_batchnorm_fp32=None,
        master_weights=None,
        loss_scale="dynamic",
    ),
    "O2": dict(
        cast_model_type="half",
        patch_torch_functions=False,
        keep_batchnorm_fp32=True,
        master_weights=True,
        loss_scale="dynamic",
    ),
    "O3": dict(
        cast_model_type="half",
        patch_torch_functions=False,
        keep_batchnorm_fp32=False,
        master_weights=False,
        loss_scale=1.0,
    ),
}


def check_opt_level(opt_level: object) -> str:
    """Return ``opt_level`` if it names an apex opt_level, else raise with a suggestion."""
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    if isinstance(opt_level, (str, int)):
        digits = str(opt_level).strip().lstrip("0oO")
        guess = f"O{digits}" if digits else "O0"
        if guess in OPT_LEVELS:
            hint = (
                f" — did you mean {guess!r}? The prefix is the letter O, not the digit zero"
                if str(opt_level).startswith("0")
                else f" — did you mean {guess!r}?"
            )
    raise ValueError(f"opt_level: expected one of {', '.join(OPT_LEVELS)}, got {opt_level!r}{hint}")


def parse_half_dtype(half_dtype: object, device_type: str) -> torch.dtype:
    """Resolve ``half_dtype`` ("auto" = torch.autocast's default for ``device_type``)."""
    aliases = {
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if half_dtype == "auto":
        return (
            torch.get_autocast_dtype(device_type)
            if device_type in ("cpu", "cuda")
            else (torch.bfloat16)
        )
    if isinstance(half_dtype, str) and half_dtype in aliases:
        return aliases[half_dtype]
    if half_dtype in HALF_DTYPES:
        assert isinstance(half_dtype, torch.dtype)
        return half_dtype
    raise ValueError(
        f'half_dtype: expected "auto", torch.float16 or torch.bfloat16, got {half_dtype!r}'
    )


def parse_loss_scale(loss_scale: object) -> LossScale:
    """Accept "dynamic", a number, or a numeric string (apex's command-line habit)."""
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return "dynamic"
    number = as_number(loss_scale)
    if number is not None:
        value = number
    elif isinstance(loss_scale, str):
        try:
            value = float(loss_scale)
        except ValueError:
            raise ValueError(
                f'loss_scale: expected "dynamic" or a positive number, got {loss_scale!r}'
            ) from None
    else:
        raise ValueError(f'loss_scale: expected "dynamic" or a positive number, got {loss_scale!r}')
    return check_positive_finite("loss_scale", value)


def parse_bool(name: str, value: object) -> bool | None:
    """apex accepted "True"/"False" strings for its boolean properties; so do we."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "true"):
        return True
    if value in ("False", "false"):
        return False
    raise ValueError(f"{name}: expected True, False or None, got {value!r}")


def as_number(value: object) -> float | None:
    """``value`` as a float when it is a real number — Python's, numpy's (``np.float32(128)``,
    ``np.int64``) or a one-element torch tensor — and not a bool; else None (an audit: numpy
    and torch scalars were refused, and ``10**400`` raised a bare OverflowError)."""
    value = _one_element(value)
    if value is None or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def as_int(value: object) -> int | None:
    """``value`` as an int when it is an integer — Python's, numpy's or a one-element integer
    torch tensor (torch.amp.GradScaler takes ``growth_interval=torch.tensor(2000)``) — and not a
    bool; else None. A float, even 2000.0, is not an integer (torch refuses it too)."""
    value = _one_element(value)
    return int(value) if isinstance(value, numbers.Integral) else None


def _one_element(value: object) -> object:
    """A one-element torch tensor or numpy array as its Python number, other numbers as they are,
    and None for bools (Python's, numpy's, bool tensors), complex and anything else with more or
    fewer than one element (an audit: ``np.array([1., 2.])`` raised numpy's bare "truth value of
    an array is ambiguous" naming no setting, and ``np.array(128.)`` was refused where a 0-d
    tensor was taken)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return value.item()
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):  # numpy's scalars, arrays
        if getattr(value, "size", 1) != 1 or value.dtype.kind not in "iuf":
            return None
        return value.item()  # type: ignore[attr-defined]
    if isinstance(value, bool):
        return None
    return value


def check_scale_bounds(
    min_loss_scale: object, max_loss_scale: object
) -> tuple[float | None, float]:
    """``min_loss_scale`` (None: no floor) and ``max_loss_scale`` (``float("inf")``: no cap) as
    floats, checked: positive, the floor finite and not above the cap (wrap's properties and
    LossScaler's alike)."""
    cap = as_number(max_loss_scale)
    if cap is None or math.isnan(cap) or not cap > 0:
        raise ValueError(
            f"max_loss_scale: expected a positive number (float('inf') for no cap), got "
            f"{max_loss_scale!r}"
        )
    if min_loss_scale is None:
        return None, cap
    floor = check_positive_finite("min_loss_scale", min_loss_scale)
    if floor > cap:
        raise ValueError(
            f"min_loss_scale must be <= max_loss_scale, got min_loss_scale={floor:g} > "
            f"max_loss_scale={cap:g}"
        )
    return floor, cap


def check_positive_finite(name: str, value: object) -> float:
    """A loss scale's setting: a positive finite real number (not a bool), as a float."""
    number = as_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        hint = ""
        if name == "loss_scale" and number == 0:
            hint = (
                ' (DeepSpeed\'s "loss_scale": 0 means dynamic: loss_scale="dynamic", or a '
                "distamp.LossScaler(...) with its settings: README, Migrating from DeepSpeed)"
            )
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}{hint}")
    if number > FP32_MAX:
        # (an audit: loss_scale=1e39 was taken, every scaled loss was inf, and the run ended
        # blaming the forward pass after max_consecutive_skips skipped steps)
        raise ValueError(
            f"{name}: expected at most FP32's largest number ({FP32_MAX:.6g}: the scale "
            f"multiplies FP32 losses, and a larger one is inf there), got {value!r}"
        )
    return number


def resolve_properties(
    opt_level: object,
    *,
    device_type: str,
    enabled: bool = True,
    half_dtype: object = "auto",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: object = None,
    keep_batchnorm_fp32: object = None,
    master_weights: object = None,
    loss_scale: object = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    shard_master_weights: object = None,
    world_size: int = 1,
    max_consecutive_skips: int = 50,
) -> Properties:
    """Apply user overrides on top of an opt_level preset, refusing the nonsensical ones as apex does."""
    level = check_opt_level(opt_level)
    explicit_masters = master_weights
    if cast_model_type is False:  # apex: False means "do not cast the model"
        cast_model_type = torch.float32
    patch_torch_functions = parse_bool("patch_torch_functions", patch_torch_functions)
    keep_batchnorm_fp32 = parse_bool("keep_batchnorm_fp32", keep_batchnorm_fp32)
    master_weights = parse_bool("master_weights", master_weights)
    shard_master_weights = parse_bool("shard_master_weights", shard_master_weights)

    if cast_model_type is not None and cast_model_type not in _FLOAT_DTYPES:
        raise ValueError(
            f"cast_model_type: expected None or one of {_FLOAT_DTYPES}, got {cast_model_type!r}"
        )
    # An explicit half cast_model_type picks the half dtype when half_dtype is left on "auto".
    if half_dtype == "auto" and cast_model_type in HALF_DTYPES:
        assert cast_model_type is not None
        half = cast_model_type
    else:
        half = parse_half_dtype(half_dtype, device_type)
        if cast_model_type in HALF_DTYPES and cast_model_type != half:
            raise ValueError(
                f"cast_model_type={cast_model_type} contradicts half_dtype={half}; "
                "pass only one of them or make them equal"
            )

    # [Note: apex's refusals] These combinations raised (or warned) in apex.amp's Properties; they
    # describe a different opt_level than the one named, so we refuse them with the level named.
    if level == "O1":
        if cast_model_type not in (None, torch.float32):
            raise ValueError(
                f"opt_level O1 keeps the model's weights FP32 and casts inside torch functions "
                f"(autocast), so cast_model_type must be None or torch.float32, got "
                f"{cast_model_type}; use opt_level O2 or O3 to cast the weights"
            )
        if keep_batchnorm_fp32 is not None:
            raise ValueError(
                f"opt_level O1 runs normalization in FP32 through autocast already, so "
                f"keep_batchnorm_fp32 must be None, got {keep_batchnorm_fp32}"
            )
        if master_weights is not None:  # apex refuses False too ("value is not None")
            raise ValueError(
                f"opt_level O1 keeps the model's weights FP32, so master_weights must be None, "
                f"got {master_weights} (there is nothing to keep a master copy of; apex refuses "
                "any value); use opt_level O2 for FP32 masters"
            )
    elif patch_torch_functions:
        raise ValueError(
            f"patch_torch_functions=True (run forward under torch.autocast) is only valid with "
            f"opt_level O1, got opt_level {level}"
        )

    preset = dict(_PRESETS[level])
    if preset["cast_model_type"] == "half":
        preset["cast_model_type"] = half
    chosen: dict[str, Any] = {}
    for name, value in (
        ("cast_model_type", cast_model_type),
        ("patch_torch_functions", patch_torch_functions),
        ("keep_batchnorm_fp32", keep_batchnorm_fp32),
        ("master_weights", master_weights),
    ):
        chosen[name] = preset[name] if value is None else value
    chosen["loss_scale"] = (
        preset["loss_scale"] if loss_scale is None else parse_loss_scale(loss_scale)
    )
    if chosen["cast_model_type"] == torch.float32:
        chosen["cast_model_type"] = None  # FP32 models are left as they are
    model_is_cast = chosen["cast_model_type"] in HALF_DTYPES
    if chosen["master_weights"] and not model_is_cast:
        if parse_bool("master_weights", explicit_masters):
            warnings.warn(
                f"master_weights=True is ignored with opt_level {level} and the model not cast: "
                "its weights stay FP32, so they are their own master copy",
                stacklevel=3,
            )
        chosen["master_weights"] = False
    if chosen["keep_batchnorm_fp32"] and not model_is_cast:
        chosen["keep_batchnorm_fp32"] = None  # nothing is cast, so nothing to keep FP32
    masters = bool(chosen["master_weights"])
    if shard_master_weights and not masters and model_is_cast:
        raise ValueError(
            f"shard_master_weights=True needs FP32 values to shard: FP32 master weights, or "
            f"FP32 model weights (O0, O1); found opt_level {level} with the model cast to "
            f"{chosen['cast_model_type']} and master_weights={chosen['master_weights']} (use "
            "opt_level O2 for FP32 masters)"
        )
    shard = (masters and world_size > 1) if shard_master_weights is None else shard_master_weights
    return Properties(
        opt_level=level,
        enabled=enabled,
        half_dtype=half,
        cast_model_type=chosen["cast_model_type"],
        patch_torch_functions=bool(chosen["patch_torch_functions"]),
        keep_batchnorm_fp32=chosen["keep_batchnorm_fp32"],
        master_weights=masters,
        loss_scale=chosen["loss_scale"],
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
        verbosity=verbosity,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        shard_master_weights=shard,
        max_consecutive_skips=max_consecutive_skips,
    )


def disabled_properties(optimizer: object) -> Properties | None:
    """The Properties ``optimizer`` was wrapped with under ``enabled=False``; None otherwise."""
    return getattr(optimizer, DISABLED_ATTR, None)


def mark_disabled(optimizer: object, props: Properties, group: Any) -> None:
    """What ``enabled=False`` leaves on ``optimizer``: see ``DISABLED_ATTR``."""
    setattr(optimizer, DISABLED_ATTR, props)
    setattr(optimizer, DISABLED_GROUP_ATTR, group)


DISABLED_FSDP1_ATTR = "_distamp_disabled_fsdp1"
"""Beside them, under ``fully_shard(api="fsdp1", enabled=False)``: a weak reference to the
``FullyShardedDataParallel`` model, whose own ``clip_grad_norm_`` clips by the global norm (the
optimizer holds flat views of this rank's shard: torch's clip over them used each rank's own
norm, an audit)."""


def disabled_group(optimizer: object) -> Any:
    """The process group ``optimizer`` was wrapped on under ``enabled=False`` (None: none named
    and none initialized then)."""
    return getattr(optimizer, DISABLED_GROUP_ATTR, None)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def warn_from_caller(message: str, *skipped_dirs: str) -> None:
    """``warnings.warn`` attributed to the first frame outside distamp (and ``skipped_dirs``):
    the user's line. A fixed stacklevel pointed into distamp whenever another of its functions
    was in between (``amp.initialize`` runs ``wrap``: an audit saw wrap's warnings reported at
    distamp/amp.py), and Python's default filter then keyed them to distamp's line."""
    prefixes = tuple(d + os.sep for d in (_PACKAGE_DIR, *skipped_dirs))
    frame = sys._getframe(1)
    level = 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(prefixes)
        or frame.f_code.co_filename == contextlib.__file__  # scale_loss is a context manager
    ):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, stacklevel=level)
