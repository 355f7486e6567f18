"""LossScaler: dynamic or static loss scale of one loss, and the global found-inf decision.

[Note: one decision for all ranks] Each rank checks the gradients it holds for inf/NaN and the
flags are reduced with MAX over the process group before anything is decided, so every rank skips
or steps the same optimizer step and updates the scale identically — also when the non-finite value
exists on one rank only (a local fault, or sharded gradients that no other rank sees). The scale is
a Python float, identical on all ranks by construction; it only changes inside :meth:`update`.
There is no local shortcut, not even when a comm hook has just made the reduced gradients
identical: a parameter DDP does not reduce (ignored, or frozen when DDP was built and unfrozen
since) breaks "identical after the all-reduce", and a rank that decided alone would skip while the
others step, then wait alone in the next collective. One small MAX all-reduce per step (a few
dozen float64s: the flags, the evidence naming a culprit, and the ranks' agreement checks) is
cheap.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import threading
import warnings
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .collectives import all_reduce_
from .config import (
    FP32_MAX,
    as_int,
    as_number,
    check_positive_finite,
    check_scale_bounds,
    parse_loss_scale,
)
from .forensics import (
    EVIDENCE_SLOTS,
    NonFiniteGradientError,
    NonFiniteReport,
    local_evidence,
    read_evidence,
)
from .masters.base import any_nonzero, bit_hash, grad_samples, grad_versions, local_tensor
from .optstate import HELD, OptState

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    from torch import nn

    from .config import Properties
    from .masters.optimizer import AmpOptimizerState

logger = logging.getLogger("distamp")

INIT_SCALE = 2.0**16
MIN_SCALE = 2.0**-100
"""The dynamic scale's floor when ``min_loss_scale`` sets none (apex's default): ``1 / scale``
multiplies the gradients in FP32, so it must stay finite (2**128 is not). Without it a skip now
and then (a bad batch every few steps: never 2000 clean steps in a row to grow back) halved the
scale to 2**-128 and the step crashed in torch ("value cannot be converted to type float
without overflow") instead of raising :class:`NonFiniteGradientError` (an audit)."""
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScaler:
    """The loss scale of one loss: static, or dynamic with growth, backoff, hysteresis and bounds."""

    def __init__(
        self,
        loss_scale: float | str = "dynamic",
        *,
        init_scale: float | None = None,
        growth_factor: float = GROWTH_FACTOR,
        backoff_factor: float = BACKOFF_FACTOR,
        growth_interval: int = GROWTH_INTERVAL,
        hysteresis: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
        consecutive_hysteresis: bool = True,
    ) -> None:
        if (
            type(consecutive_hysteresis).__module__ == "numpy"
            and str(getattr(consecutive_hysteresis, "dtype", "")) == "bool"
        ):  # numpy's bool (an audit)
            consecutive_hysteresis = bool(consecutive_hysteresis)
        if not isinstance(consecutive_hysteresis, bool):
            raise ValueError(
                f"consecutive_hysteresis: expected True or False, got {consecutive_hysteresis!r}"
            )
        # Python floats and ints whatever number was given: the scale and these settings go into
        # state dicts and checkpoints (weights_only=True) and the ranks' fingerprint (a review:
        # an np.float32 growth_factor made the scale an np.float32, a checkpoint unloadable).
        growth = as_number(growth_factor)
        if growth is None or not 1.0 < growth < float("inf"):
            raise ValueError(f"growth_factor: expected a finite number > 1, got {growth_factor!r}")
        backoff = as_number(backoff_factor)
        if backoff is None or not 0.0 < backoff < 1.0:
            raise ValueError(f"backoff_factor: expected in (0, 1), got {backoff_factor!r}")
        growth_factor, backoff_factor = growth, backoff
        interval, left = as_int(growth_interval), as_int(hysteresis)
        if interval is None or interval < 1:
            raise ValueError(f"growth_interval: expected an int >= 1, got {growth_interval!r}")
        if left is None or left < 1:
            raise ValueError(f"hysteresis: expected an int >= 1, got {hysteresis!r}")
        growth_interval, hysteresis = interval, left
        if init_scale is not None:
            init_scale = check_positive_finite("init_scale", init_scale)
        loss_scale = parse_loss_scale(loss_scale)  # (as wrap's: a numeric string too)
        if loss_scale != "dynamic" and init_scale is not None:
            # (an audit: ignored silently; which of the two scales did the user mean?)
            raise ValueError(
                f"init_scale: expected it only with a dynamic loss scale (where the scale starts), "
                f"found init_scale={init_scale:g} with the static loss_scale={loss_scale:g}: pass "
                "one of them (LossScaler(init_scale=...) is dynamic)"
            )
        if loss_scale != "dynamic":
            if 1.0 / float(loss_scale) > FP32_MAX:
                # (an audit: accepted here, the first step crashed inside torch converting
                # 1 / scale to FP32)
                raise ValueError(
                    f"loss_scale: expected a static scale whose inverse is a finite FP32 number "
                    f"(at least {MIN_SCALE:g}, 2**-100, is safe), got {float(loss_scale):g}"
                )
        # Held as floats (an audit: an int cap or floor made the scale an int after a growth,
        # a backoff or a load); checked here, not only at wrap (an audit: True started at 1.0).
        min_loss_scale, max_loss_scale = check_scale_bounds(min_loss_scale, max_loss_scale)
        if loss_scale == "dynamic" and init_scale is not None and init_scale > max_loss_scale:
            raise ValueError(
                f"init_scale: expected at most max_loss_scale ({max_loss_scale:g}), got "
                f"{init_scale:g}: the scale never exceeds max_loss_scale (apex's default 2**24); "
                "pass a larger max_loss_scale (float('inf') for none, as DeepSpeed and torch.amp)"
            )
        self.settings: dict[str, Any] = {
            "loss_scale": loss_scale,
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
            "hysteresis": hysteresis,
            "min_loss_scale": min_loss_scale,
            "max_loss_scale": max_loss_scale,
            "consecutive_hysteresis": consecutive_hysteresis,
        }
        """The constructor's arguments: what :meth:`fresh` builds another scaler from."""
        self.dynamic = loss_scale == "dynamic"
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        """True: a clean step refills the hysteresis (DeepSpeed's ``consecutive_hysteresis:
        true``); False: only a growth does (DeepSpeed's default and Megatron's, so an overflow
        every other step still walks the scale down). apex has no hysteresis (``hysteresis=1``,
        where both are the same)."""
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        if self.dynamic:
            # apex: the default start (2**16) is capped by max_loss_scale; an explicit
            # init_scale above it was refused above
            scale = min(INIT_SCALE if init_scale is None else init_scale, max_loss_scale)
            if scale < MIN_SCALE:
                # (an audit: raised silently, where update(new_scale=) and a load say it)
                warnings.warn(
                    f"init_scale {scale:g} is below the dynamic scale's floor 2**-100 (1 / scale "
                    f"must stay a finite FP32 number): starting at {MIN_SCALE:g}",
                    stacklevel=3,
                )
            # never below the floor: 1 / scale must stay a finite FP32 number
            scale = float(max(scale, min_loss_scale or 0.0, MIN_SCALE))
        else:
            scale = float(loss_scale)
        self.scale: float = scale
        self.clean_steps = 0
        """Consecutive steps without overflow since the last scale change."""
        self.hysteresis_left = hysteresis
        self.consecutive_skips = 0
        self.last_overflow = False
        """The last update was an overflow (apex's ``_has_overflow`` of this loss)."""
        self.skipped_at_floor = False
        """The last overflow happened when the scale could not back off any further."""

    def fresh(self) -> LossScaler:
        """A new scaler with this one's settings and none of its state: ``wrap(...,
        loss_scale=LossScaler(...))`` gives each loss one (see :func:`split_loss_scale`)."""
        settings = dict(self.settings)
        return LossScaler(settings.pop("loss_scale"), **settings)

    @property
    def at_floor(self) -> bool:
        """True when a dynamic scale cannot back off any further (a static scale has no floor:
        apex ignores ``min_loss_scale`` without dynamic scaling)."""
        return self.dynamic and self.scale <= self.floor

    @property
    def floor(self) -> float:
        """The lowest scale a dynamic scaler backs off to: ``min_loss_scale``, never below
        :data:`MIN_SCALE`."""
        return max(self.min_loss_scale or 0.0, MIN_SCALE)

    def rounded(self, scale: float) -> float:
        """A new scale as this scaler keeps it: a Python float, as apex's (see
        ``distamp.GradScaler``'s, which keeps torch's FP32)."""
        return scale

    def update(self, overflow: bool) -> None:
        """Advance the scale by one optimizer step; ``overflow`` must be the global decision."""
        self.last_overflow = overflow
        if overflow:
            self.consecutive_skips += 1
            self.clean_steps = 0
            self.skipped_at_floor = self.at_floor
            if not self.dynamic:
                return
            # Hysteresis (DeepSpeed, Megatron): the first `hysteresis - 1` overflows in a
            # row are tolerated; from then on every overflow backs off, until a clean step.
            self.hysteresis_left = max(0, self.hysteresis_left - 1)
            if self.hysteresis_left == 0:
                backed_off = max(self.scale * self.backoff_factor, self.floor)
                self.scale = self.rounded(backed_off)
            return
        self.consecutive_skips = 0
        self.clean_steps += 1  # also for a static scale: apex's _unskipped counts its steps
        if not self.dynamic:
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        # `==`, as apex's and torch's scalers: a count already past the interval (the interval
        # lowered, or a tracker loaded from a longer one) waits for the next backoff, as there.
        if self.clean_steps == self.growth_interval:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            # Capped at max_loss_scale; a scale above it (loaded from torch's uncapped GradScaler)
            # is kept, never lowered by a growth step.
            grown = self.rounded(
                min(self.scale * self.growth_factor, max(self.max_loss_scale, self.scale))
            )
            # Growth never makes the scale non-finite, whatever max_loss_scale is: the scale
            # multiplies an FP32 loss, so it stays a finite FP32 number (at most 2**127).
            if grown <= FP32_MAX:
                self.scale = grown

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only; loads with ``torch.load(weights_only=True)``."""
        return {
            "dynamic": self.dynamic,
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "consecutive_skips": self.consecutive_skips,
        }

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` unless :meth:`load_state_dict` would load ``state`` (changes
        nothing: callers check every part of a state before loading any)."""
        expected = {"dynamic", "scale", "clean_steps", "hysteresis_left", "consecutive_skips"}
        if not isinstance(state, dict) or set(state) != expected:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"loss scaler state: expected keys {sorted(expected)}, got {found}")
        if bool(state["dynamic"]) != self.dynamic:
            raise ValueError(
                f"loss scaler state: saved with a {'dynamic' if state['dynamic'] else 'static'} "
                f"loss scale, loading into a {'dynamic' if self.dynamic else 'static'} one"
            )
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scaler state: expected a positive finite scale, got {scale}")
        for key in ("clean_steps", "hysteresis_left", "consecutive_skips"):
            if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
                raise ValueError(
                    f"loss scaler state: expected a count >= 0 for {key!r}, got {state[key]!r}"
                )

    def set_loaded_scale(self, saved: float, source: str, stacklevel: int = 2) -> None:
        """Take a loss scale from outside (a checkpoint, apex's ``amp.load_state_dict``), brought
        inside this run's settings with a warning naming both: ``source`` says whose scale."""
        if self.dynamic:
            # (an audit: a saved 2**-130, below the floor, loaded silently and the next step
            # crashed in torch)
            scale = min(max(saved, self.floor), self.max_loss_scale)
            bound = (
                "max_loss_scale"
                if saved > self.max_loss_scale
                else "min_loss_scale"
                if self.min_loss_scale is not None and self.min_loss_scale >= MIN_SCALE
                else "the floor 2**-100"
            )
        else:
            scale, bound = float(self.settings["loss_scale"]), "static loss_scale"
        if scale != saved:
            warnings.warn(
                f"loss scaler: {source} loss scale {saved:g} is outside this run's "
                f"settings ({bound} {scale:g}): using {scale:g}",
                stacklevel=stacklevel + 1,
            )
        self.scale = scale

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; refuses a static/dynamic mismatch.

        The settings are this run's: a resume with a lower ``max_loss_scale`` (or a higher
        ``min_loss_scale``, a smaller ``hysteresis``, another static scale) kept the saved scale
        outside them — above the cap for good, or below the floor, where the first overflow
        raised "skipped at the minimum loss scale" naming a scale never used (an audit). The
        saved state is brought inside this run's settings, with a warning naming both."""
        self.check_state(state)
        self.set_loaded_scale(float(state["scale"]), "the checkpoint's", stacklevel=3)
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = min(int(state["hysteresis_left"]), self.hysteresis)
        self.consecutive_skips = int(state["consecutive_skips"])


def split_loss_scale(
    loss_scale: object, min_loss_scale: float | None, max_loss_scale: float
) -> tuple[Any, float | None, float, LossScaler | None]:
    """``wrap``'s ``loss_scale`` may be a :class:`LossScaler`: the settings apex's arguments do not
    reach (hysteresis, growth_interval, growth and backoff factors, init_scale: DeepSpeed's
    ``hysteresis``, ``loss_scale_window``, ``initial_scale_power``). Returns the plain
    ``loss_scale``, ``min_loss_scale`` and ``max_loss_scale`` the properties record, and the
    scaler each loss gets a fresh copy of (None for a plain ``loss_scale``)."""
    if not isinstance(loss_scale, LossScaler):
        return loss_scale, min_loss_scale, max_loss_scale, None
    # (as a number first: a tensor's != raised torch's bare "Boolean value of Tensor ... is
    # ambiguous", an audit)
    if min_loss_scale is not None or as_number(max_loss_scale) != 2.0**24:
        raise ValueError(
            "loss_scale=LossScaler(...): expected min_loss_scale and max_loss_scale on the "
            f"LossScaler, found them passed to wrap too (min_loss_scale={min_loss_scale}, "
            f"max_loss_scale={max_loss_scale}); pass them in one place"
        )
    plain = "dynamic" if loss_scale.dynamic else float(loss_scale.settings["loss_scale"])
    return plain, loss_scale.min_loss_scale, loss_scale.max_loss_scale, loss_scale


def scaler_facts(template: LossScaler | None) -> list[tuple[str, str]]:
    """What must be equal on every rank of ``wrap``'s or ``fully_shard``'s ``loss_scale=
    LossScaler(...)``, one fact per setting, always all of them ("none" without a LossScaler),
    so the facts line up rank by rank and a disagreement names the setting (an audit: one fact
    of every setting left the user to diff two 300-character lists; fully_shard compared none,
    and ranks with init_scale 1024 and 2048 trained on, their scales apart)."""
    settings = template.settings if template is not None else {}
    return [
        (f"loss_scale=LossScaler(...) {key}", repr(settings[key]) if settings else "none")
        for key in SCALER_SETTINGS
    ]


SCALER_SETTINGS = tuple(inspect.signature(LossScaler).parameters)
"""The keys of :attr:`LossScaler.settings` (its constructor's arguments), in order."""


FLAG_SLOTS = 8
"""Slots for the blocks' flags in the skip decision's all-reduce (see [Note: a fixed-size
decision vector])."""


def all_reduce_max_(flags: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Collective over ``group`` (when distributed): element-wise MAX of ``flags`` across ranks."""
    return all_reduce_(flags, dist.ReduceOp.MAX, group)


@dataclass(eq=False)
class Backward:
    """One ``scale_loss`` block: which loss, which optimizers, and whether it overflowed."""

    loss_id: int
    users: list[AmpOptimizerState]
    flag: torch.Tensor | None = None
    """Local 0/1: gradients became non-finite during this backward (when attribution is on)."""
    overflow: bool | None = None
    """The global decision, once taken at the first step of one of ``users``."""
    loss_kind: torch.Tensor | None = None
    """0-d int: 0 the loss was finite, 1 inf, 2 NaN (read only on skipped steps: no host sync)."""
    report: NonFiniteReport | None = None
    """What the decision named, for every optimizer the block skips (not only the one whose
    step decided it)."""
    early: bool = False
    """Decided by ``distamp.unscale_``/``clip_grad_norm_`` on some rank (see [Note: gradients
    edited after unscale_] in masters/optimizer.py)."""


def _kind(block: Backward) -> tuple[int, tuple[int, ...]]:
    return block.loss_id, tuple(sorted(u.index for u in block.users))


def _kinds(blocks: list[Backward]) -> list[tuple[int, tuple[int, ...]]]:
    """The kinds of ``blocks`` (loss, optimizers), sorted: what :func:`_slots_by_kind` maps to
    slots, so what every rank must agree on (not their order: ranks accumulating losses 0, 1, 2
    and 2, 1, 0 map them alike)."""
    return sorted({_kind(b) for b in blocks})


def _slots_by_kind(blocks: list[Backward]) -> list[int]:
    """Each block's slot in the decision vector: one per kind of block (its loss and the set of
    optimizers it was passed with), in sorted order, folded into FLAG_SLOTS only past
    FLAG_SLOTS kinds (see [Note: a fixed-size decision vector]). Every rank ran the same kinds
    of blocks (their count and kinds are checked in the same all-reduce), so every rank maps
    them alike."""
    slot = {kind: i % FLAG_SLOTS for i, kind in enumerate(_kinds(blocks))}
    return [slot[_kind(b)] for b in blocks]


class _OriginWatch:
    """A gradient hook feeding one optimizer's flag of ``ScalerGroup.origin_watches`` (see
    [Note: watching for the origin after a skip]); holds the group weakly, as BackwardSeen
    holds its optimizer."""

    def __init__(self, group: ScalerGroup, key: int) -> None:
        self.group = weakref.ref(group)
        self.key = key

    def __call__(self, grad: torch.Tensor) -> None:
        group = self.group()
        watched = group.origin_watches.get(self.key) if group is not None else None
        if watched is not None:
            watch = watched[0]
            values = grad._values() if grad.is_sparse else grad
            watch.logical_or_(~torch.isfinite(local_tensor(values)).all().to(watch.device))


class ScalerGroup:
    """The loss scalers of one :func:`distamp.wrap` call and the per-step skip decision.

    [Note: who skips] apex's multiple-models/optimizers/losses semantics: an optimizer skips iff a
    ``scale_loss`` block it took part in since its last step overflowed (non-finite gradients
    appeared in the gradients of that block's optimizers, on any rank). With one optimizer and one
    loss that is just "its gradients are non-finite"; with several, each block's new non-finite
    values are attributed to it at the end of the block (a read-only pass, no host sync). A loss's
    scaler is updated once per step: when every block of that loss has been decided.
    """

    def __init__(
        self,
        props: Properties,
        process_group: dist.ProcessGroup | None,
        param_names: dict[int, str],
        template: LossScaler | None = None,
    ) -> None:
        self.props = props
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.param_names = param_names
        self.scalers = [
            template.fresh()
            if template is not None
            else LossScaler(
                props.loss_scale,
                min_loss_scale=props.min_loss_scale,
                max_loss_scale=props.max_loss_scale,
            )
            for _ in range(props.num_losses)
        ]
        self.optimizers: list[AmpOptimizerState] = []
        self.frozen_at_wrap: set[int] = set()
        """ids of the parameters frozen when wrap ran (before any DDP of the model)."""
        self.frozen_when_built: set[int] | None = None
        """ids of the parameters frozen when DDP was built, as ``hooks.register`` (called right
        after building DDP, and again after rebuilding it) saw them: DDP's reducer never reduces
        them, even once they train (see _refuse_parted_replicas). None: no DDP registered, not
        known (a DDP built apart from wrap may have been rebuilt since: a review)."""
        self._open: list[Backward] = []
        """Blocks whose loss scaler has not been updated yet."""
        self.warned_extra_keys: set[tuple[Any, ...]] = set()
        """save_checkpoint's ``extra`` keys found different across ranks, warned about once."""
        self._discarded_overflow: dict[int, NonFiniteReport | None] = {}
        """Losses whose discarded blocks overflowed while other blocks of theirs stayed open (and
        what the decision named): their one update this step is an overflow, counted towards
        max_consecutive_skips (see [Note: a batch discarded after an overflow])."""
        self.total_skips = 0
        self.loss_skips = 0
        """Skips whose loss itself was non-finite (logged on their own count)."""
        self.warned_low_scale: set[int] = set()
        """Losses whose fp16 scale fell below 1, said once (see :meth:`_say_low_scale`)."""
        self.unscaled_skips = 0
        """Consecutive skips after backwards outside ``scale_loss`` (no loss scaler counts them:
        see :meth:`after_skip`); a step taken resets it."""
        self.last_nonfinite: NonFiniteReport | None = None
        self.found_inf_collectives = 0
        """All-reduces issued for the skip decision (at most one per optimizer step)."""
        self.block_threads: dict[int, int] = {}
        """Thread ident -> scale_loss blocks open there (see wrap.py's _enter_block_thread)."""
        self.block_lock = threading.Lock()
        self.models: list[weakref.ref[nn.Module]] = []
        """The models of the wrap call (weak: to explain misuse in error messages, and to read
        DDP's ignore list, see :meth:`ddp_ignored`)."""
        self.probe_params: list[tuple[weakref.ref[nn.Module], str, int]] = []
        """(model, name, parameter) of the dtype probes an optimizer holds, as wrap left them:
        see [Note: parameters replaced after wrap] in masters/optimizer.py."""
        self.wrapped_params: dict[tuple[int, str], int] = {}
        """(model index, name) -> id of the parameter an optimizer held there at wrap."""
        self.hooked_ignored: set[int] = set()
        """ids DDP ignores, as ``distamp.hooks.register`` found them on the DDP it was given."""
        self.hooked_params: frozenset[int] = frozenset()
        """ids of the parameters of the DDPs ``distamp.hooks.register`` was given over this
        group's ranks: their all-reduce leaves those gradients identical on every rank, compared
        at O0/O1 too (see ``ReplicatedMasterParams.replica_fingerprint``)."""
        self.fp16_all_reduce = False
        """distamp's compress hook all-reduces in fp16 (see ``NonFiniteReport.fp16_wire``)."""
        self.fp16_wire = False
        """A distamp hook sends fp16 (all-reduce or reduce-scatter): sums may overflow there."""
        self._ignored: tuple[tuple[int, ...], frozenset[int]] = ((), frozenset())
        self.origin_watches: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        """id(optimizer state) -> (whether this rank's own gradients of its parameters held a
        non-finite value, the hooks that feed it): set after a skip of that optimizer whose
        report could not name the rank (see [Note: watching for the origin after a skip])."""
        self.ignored_at_wrap: frozenset[int] = frozenset()
        """ids on DDP's ignore list when wrap ran: left out of wrap's broadcast of rank 0's
        values (the others, named later, were not: see :meth:`ddp_ignored`)."""

    def ddp_ignored(self) -> frozenset[int]:
        """ids of the parameters DDP leaves out of its reduction because the script named them
        (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``): their
        gradients may differ between ranks, as with plain DDP (the script reduces them itself,
        or not). The replica check leaves them out: it refused every such script at O2/O3 and
        with sharded masters (an audit). Read from the wrapped models at each decision (the
        list may be set after wrap), recomputed only when it changes; with those
        ``distamp.hooks.register`` read from the DDP it was given (whose module may hold the
        wrapped model, under other names)."""
        lists = [
            getattr(model, "_ddp_params_and_buffers_to_ignore", None)
            for model in (ref() for ref in self.models)
        ]
        key = (*(id(names) for names in lists if names), len(self.hooked_ignored))
        if key != self._ignored[0]:
            ids = set(self.hooked_ignored)
            for ref, names in zip(self.models, lists, strict=True):
                model = ref()
                if model is not None and names:
                    named = set(names)
                    ids |= {id(p) for n, p in model.named_parameters() if n in named}
            self._ignored = (key, frozenset(ids))
            late = sorted(self.param_names.get(i, "?") for i in ids - self.ignored_at_wrap)
            if late and self.world > 1 and self.rank == 0:
                warnings.warn(
                    f"parameters {late[:4]}{' and more' if len(late) > 4 else ''} were named to "
                    "DDP's ignore list after distamp.wrap, which gave every rank rank 0's values "
                    "of them (as DDP does for the parameters it reduces); where they must differ "
                    "between ranks (an expert per rank), name them to the list before wrap",
                    stacklevel=2,
                )
                self.ignored_at_wrap |= ids
        return self._ignored[1]

    def _watch_origin(self, st: AmpOptimizerState | None, device: torch.device | None) -> None:
        """[Note: watching for the origin after a skip] After DDP's all-reduce every rank holds
        the summed gradient, so a non-finite one names no rank (DESIGN asks for the rank; an
        audit: a NaN made on rank 1 read "on every rank ... not known", pointing at the fp16
        wire). Watching each rank's own gradients costs a pass over them per backward, so it
        starts only after such a skip of an optimizer (``device``: a fresh watch of ``st``
        there; None: ``st``'s ends; ``st`` None: every one ends, at a NonFiniteGradientError):
        a hook on each of its trainable parameters checks the gradient its backward produced,
        before it is accumulated and before DDP sees it (the accumulated one may hold an earlier
        backward's reduced sum: a review), and its next decisions name the lowest rank whose own
        held a non-finite value (local_evidence). One flag per optimizer: another optimizer's
        gradients, or its clean step, neither marks nor ends it (a review)."""
        keys = list(self.origin_watches) if st is None else [id(st)]
        if device is None:
            for key in keys:
                for handle in self.origin_watches.pop(key, (None, []))[1]:
                    handle.remove()
            return
        assert st is not None
        old = self.origin_watches.get(id(st))
        hooks = old[1] if old is not None else []
        if not hooks:
            hook = _OriginWatch(self, id(st))
            hooks = [p.register_hook(hook) for p in st.masters.model_params if p.requires_grad]
        self.origin_watches[id(st)] = (torch.zeros((), dtype=torch.bool, device=device), hooks)

    def _origin_of(self, involved: list[AmpOptimizerState]) -> torch.Tensor | None:
        """Whether this rank's own gradients of ``involved`` held a non-finite value, where any of
        them is watched (see [Note: watching for the origin after a skip]); None: none is."""
        if not self.origin_watches:
            return None
        flags = [self.origin_watches[id(u)][0] for u in involved if id(u) in self.origin_watches]
        return torch.stack(flags).any() if flags else None

    def nonfinite_weight(self) -> str | None:
        """The first parameter of the wrapped models holding inf/NaN on this rank, as "name
        holds inf", or None (only when explaining an error: it reads every weight)."""
        for ref in self.models:
            model = ref()
            for name, param in model.named_parameters() if model is not None else ():
                local = local_tensor(param)
                if local.numel() and not bool(torch.isfinite(local).all()):
                    kind = "NaN" if bool(torch.isnan(local).any()) else "inf"
                    return f"parameter {name!r} holds {kind}"
        return None

    def nonfinite_weight_anywhere(self) -> str | None:
        """:meth:`nonfinite_weight` of the lowest rank that has one, "... on rank R", the same on
        every rank (an audit: only the rank holding it said so; rank 0's log, the one read,
        pointed at the forward pass). Collective: called where every rank raises together."""
        local = self.nonfinite_weight()
        if self.process_group is None or self.world == 1:
            return local
        found: list[str | None] = [None] * self.world
        dist.all_gather_object(found, local, group=self.process_group)
        for rank, what in enumerate(found):
            if what:
                return f"{what} on rank {dist.get_global_rank(self.process_group, rank)}"
        return None

    def added_after_wrap(self, param: torch.Tensor) -> str | None:
        """The name ``param`` has in a wrapped model now, if wrap never saw it."""
        for ref in self.models:
            model = ref()
            for name, other in model.named_parameters() if model is not None else ():
                if other is param:
                    return name
        return None

    def sharded_by_fsdp_after_wrap(self) -> str | None:
        """The FSDP wrapper found in a model wrapped by ``distamp.wrap``, if one was applied later."""
        from .casting import data_parallel_wrapper_name

        for ref in self.models:
            model = ref()
            name = data_parallel_wrapper_name(model) if model is not None else None
            if name is not None and ("FSDP" in name or name.startswith("FullySharded")):
                return name
        return None

    def check_new_params(self, params: list[Any], st: AmpOptimizerState) -> None:
        """Refuse parameters for ``add_param_group`` that wrap would have refused."""
        held = {
            id(p): i for i, other in enumerate(self.optimizers) for p in other.masters.model_params
        }
        where = "optimizer.add_param_group"
        for k, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"{where}: params[{k}]: expected a tensor, got {type(param).__name__}"
                )
            name = self.param_names.get(id(param))
            if name is None:
                later_fsdp = self.sharded_by_fsdp_after_wrap()  # refused at backward, by name
                added = None if later_fsdp else self.added_after_wrap(param)
                if added is not None:  # (an audit: timm's reset_classifier after wrap)
                    raise ValueError(
                        f"{where}: parameter {added!r} was added to the model after distamp.wrap "
                        "(a module replaced, e.g. timm's reset_classifier or a new head): "
                        "expected the parameters wrap saw — wrap decides each one's precision "
                        "and FP32 master. Replace the module before building the optimizer and "
                        "calling wrap"
                    )
                fsdp = any(o.masters.fsdp for o in self.optimizers)
                raise ValueError(
                    f"{where}: params[{k}] (shape {tuple(param.shape)}, dtype {param.dtype}) is "
                    "not a parameter of the model(s) passed to distamp.wrap: expected parameters "
                    "of the wrapped model(s) (a module that was not one of them — a new head, a "
                    "loss with weights — is passed to wrap with the model: "
                    "wrap([model, head], optimizer))"
                    + (
                        " (after distamp.fsdp.fully_shard, read them from the sharded model: "
                        "FSDP replaced the parameter objects)"
                        if fsdp
                        else ""
                    )
                )
            if id(param) in held:
                owner = self.optimizers[held[id(param)]]
                which = "this optimizer" if owner is st else f"optimizers[{held[id(param)]}]"
                raise ValueError(
                    f"{where}: parameter {name!r} is already held by {which}: expected each "
                    "parameter in one param group of one optimizer"
                )
            if any(other is param for other in params[:k]):
                raise ValueError(f"{where}: parameter {name!r} appears twice in the new group")

    @property
    def attribute_per_backward(self) -> bool:
        """Several optimizers or losses: attribute non-finite values to blocks as they appear."""
        return len(self.optimizers) > 1 or self.props.num_losses > 1

    # -- backward --------------------------------------------------------------------------------

    def prepare_backward(self, loss_id: int, states: list[AmpOptimizerState]) -> float:
        """Pick the scale the backward of ``loss_id`` runs at; returns it.

        [Note: several losses, several scales] Gradients stay scaled until step() (see [Note: why
        grads stay scaled until step()]), so all contributions to one optimizer's gradients must
        carry the same scale. When a loss with a different scale joins gradients already pending,
        the backward runs at the smaller of the two and the pending gradients are rescaled down
        to it by a power of two (exact, never an overflow). With ``num_losses == 1`` this never
        happens.
        """
        self.refuse_wrapped_before_init()
        scale = self.scalers[loss_id].scale
        pending = [st.grad_scale for st in states if st.grad_scale is not None]
        if pending:
            scale = min(scale, *pending)
        for st in states:
            st.masters.before_backward()
            if st.grad_scale is not None and st.grad_scale != scale:
                st.masters.rescale_grads_(scale / st.grad_scale)
                st.grad_scale = scale
        return scale

    def finish_backward(
        self,
        loss_id: int,
        states: list[AmpOptimizerState],
        scale: float,
        loss: torch.Tensor | None = None,
    ) -> None:
        """Record the ``scale_loss`` block that just ran its backward at ``scale``."""
        block = Backward(loss_id, list(states))
        if loss is not None:
            value = local_tensor(loss.detach())  # (loss_parallel's loss is a DTensor)
            block.loss_kind = torch.where(
                torch.isnan(value).any(), 2, torch.where(torch.isinf(value).any(), 1, 0)
            )
        attribute = self.attribute_per_backward
        for st in states:
            st.grad_scale = scale
            st.state = OptState.SCALED
            st.backwards.append(block)
            st.had_grads = st.had_grads or any(p.grad is not None for p in st.masters.model_params)
            if attribute:
                # [Note: which block made a gradient non-finite] Per parameter: a block is
                # flagged when some gradient is non-finite now that was finite at the end of
                # every earlier block. One flag per optimizer masked every block after the first
                # non-finite one (an audit: loss 1 overflowing in other parameters of an
                # optimizer loss 0 had overflowed already did not back loss 1's scale off, nor
                # skip the other optimizer loss 1 was passed with). A later block that makes an
                # already non-finite gradient non-finite again cannot be told apart without a
                # copy of every gradient per block (apex's stash): it is not flagged. Under FSDP
                # one flag stands for all (its reduce moves gradients between buffers).
                each = st.masters.check_each()
                seen = st.seen_each
                if seen is None or seen.shape != each.shape:
                    seen = torch.zeros_like(each)
                new = (each * (1 - seen)).amax(dim=0, keepdim=True) if each.numel() else None
                if new is not None:
                    block.flag = new if block.flag is None else torch.maximum(block.flag, new)
                st.seen_each = torch.maximum(seen, each)
                now = (
                    each.amax(dim=0, keepdim=True)
                    if each.numel()
                    else torch.zeros(1, device=each.device)
                )
                previous = st.seen_nonfinite
                st.seen_nonfinite = now if previous is None else torch.maximum(previous, now)
        # Any backward (also one whose loss another optimizer was passed with) may add to any
        # pending gradients: refresh every optimizer's record (see [Note: scaled gradients
        # touched before step()]).
        for other in self.optimizers:
            fresh = other.masters.take_fresh_reductions()
            if other.state is OptState.SCALED and not other.warned_touched_scaled:
                other.added_after_reduce += self._added_after_reduce(other, fresh)
                params = other.masters.model_params
                other.scaled_grads = list(zip(params, grad_versions(params), strict=True))
                other.scaled_sample = other.masters.scaled_grad_sample()
        self._open.append(block)

    def reached_unlisted(
        self, reached: list[AmpOptimizerState], loss_id: int, scale: float
    ) -> None:
        """[Note: a block that does not list an optimizer it reaches] ``scale_loss(loss, opt_a)``
        whose backward also writes gradients of ``opt_b``'s parameters (one wrap of two
        optimizers; an encoder stepped by one and a head by the other, the critic loss reaching
        the actor's trunk, a GAN's generator loss reaching the discriminator) left them
        multiplied by the loss scale while ``opt_b`` took them as unscaled: a head moved 844
        instead of 0.013, silently (an audit). A GAN clears the discriminator's gradients
        before using them, so nothing is refused here: an optimizer with no pending gradients
        adopts them at the block's scale (a later clear drops them as any clear does; its step
        warns that they were taken so); one whose pending gradients carry another scale now
        holds a sum at two scales that nothing can undo, and its ``step()`` refuses it."""
        for st in reached:
            if st.state is OptState.READY:
                st.grad_scale, st.state, st.had_grads = scale, OptState.SCALED, True
                st.unlisted_loss = loss_id
                st.adopted_grads = grad_versions(st.masters.model_params)
            elif st.state is OptState.UNSCALED or st.grad_scale != scale:
                st.mixed_scales = (loss_id, scale)

    def forget(self, st: AmpOptimizerState) -> None:
        """``st`` dropped its gradients (zero_grad) before its step: its blocks lose it as a user,
        and a block no optimizer stepped on is dropped, decided or not — a batch discarded after
        ``unscale_`` leaves the loss scale as it was (see [Note: the scale moves at step()])."""
        for block in st.backwards:
            if st in block.users:
                block.users.remove(st)
        dropped = [b for b in self._open if not b.users]
        self._open = [b for b in self._open if b.users]
        self._back_off_for_discarded(dropped)
        self.update_finished_losses()

    def _back_off_for_discarded(self, dropped: list[Backward]) -> None:
        """[Note: a batch discarded after an overflow] The scale stays where it was for a batch
        thrown away after ``unscale_`` (a spiked norm, a NaN loss), as torch.amp's does without
        ``update()``. But a batch whose *scaled* gradients overflowed (its loss finite, on every
        rank: the decision's evidence says) is the scale's fault: the apex/nanoGPT habit ``if
        not isfinite(clip_grad_norm_(...)): zero_grad(); continue`` then discarded every batch
        at a scale that never backed off, forever, silently (an audit; apex backed off when the
        block ended). Such a discard backs off, and counts towards max_consecutive_skips —
        once per step: while other blocks of the loss are open (a second optimizer's), their
        update, at their step or discard, carries it (an audit: two optimizers discarding one
        loss's batch halved its scale twice)."""
        overflowed = {
            b.loss_id: b.report
            for b in dropped
            if b.overflow is not None
            and bool(b.overflow)
            and (b.report is None or b.report.loss_id is None)
        }
        # A loss carrying an earlier discard whose last open blocks went undecided too (both
        # optimizers' batches dropped, one never unscaled): the carried backoff lands now (an
        # audit: left pending, the scale never moved and the endless loop was back).
        carried = {b.loss_id for b in dropped if b.loss_id in self._discarded_overflow}
        for j in sorted(set(overflowed) | carried):
            report = overflowed.get(j) or self._discarded_overflow.get(j)
            if any(b.loss_id == j for b in self._open):
                self._discarded_overflow[j] = report
                continue
            self._discarded_overflow.pop(j, None)
            self.scalers[j].update(True)
            self._refuse_discarding_forever(j, report)

    def _refuse_discarding_forever(self, j: int, report: NonFiniteReport | None) -> None:
        """max_consecutive_skips (and the floor) for loss ``j`` after a discarded overflow: the
        same decision on every rank, so every rank raises."""
        scaler = self.scalers[j]
        if scaler.consecutive_skips < self.props.max_consecutive_skips and not (
            scaler.skipped_at_floor
        ):
            return
        self._watch_origin(None, None)  # (a caller that catches it and reloads pays no more)
        raise NonFiniteGradientError(
            f"loss {j}: {scaler.consecutive_skips} consecutive batches were discarded or "
            "skipped (gradients cleared after the skip decision) with overflowing gradients "
            f"and a finite loss: {report or 'non-finite gradients'}; the loss scale is "
            f"{scaler.scale:g}. Lowering it does not fix this: look for a NaN/inf produced by "
            "the forward or backward pass (max_consecutive_skips / min_loss_scale set this "
            "limit)"
        )

    def refuse_wrapped_before_init(self) -> None:
        """Wrapped with no process group up (a LightningModule's ``__init__``, a script that
        builds the model first), trained across ranks: every rank decided its skips alone (a NaN
        on one rank: that rank skipped, the others stepped, the replicas drifted apart), the
        masters stayed replicated and no rank-agreement check ran — silently (an audit). Every
        rank raises here, at its first scale_loss or step, with no collective."""
        if self.process_group is not None:
            self.refuse_destroyed_group()
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size()
        if world > 1:
            raise RuntimeError(
                f"distamp: expected distamp.wrap to be called after "
                f"torch.distributed.init_process_group, found it wrapped with no process group "
                f"while the default group now has {world} ranks (this is rank {dist.get_rank()}): "
                "each rank would decide its skips alone and the replicas would drift apart. Call "
                "wrap after init_process_group (Lightning: in configure_model(), not __init__; "
                "accelerate and Hugging Face's Trainer: after Accelerator(...) or "
                "TrainingArguments(...), which create the group); "
                "for a model each rank trains alone, pass process_group=a one-rank group "
                "(dist.new_subgroups(group_size=1)[0])"
            )

    def refuse_destroyed_group(self, what: str = "distamp") -> None:
        """A notebook or sweep that destroys the process group and initializes a new one, then
        steps (or saves) the model wrapped on the old group got torch's "Process group <object at
        0x...> is not initialized in the world group map" (an audit): named here instead."""
        if self.process_group is None:
            return
        try:
            dist.get_backend(self.process_group)
        except (ValueError, RuntimeError) as err:
            raise RuntimeError(
                f"{what}: expected the process group distamp.wrap trained this model on to be "
                "alive, found it destroyed (torch.distributed.destroy_process_group() since "
                "wrap); a wrapped model and optimizer stay bound to their group: after "
                "init_process_group again, wrap a freshly built model and optimizer (and "
                "load_checkpoint into them to continue)"
            ) from err

    # -- step ------------------------------------------------------------------------------------

    def unscale_and_decide(self, st: AmpOptimizerState, api: str = "optimizer.step()") -> None:
        """Collective (see [Note: one decision for all ranks]): unscale, then decide the skip.
        ``api``: the call that asked, for the errors.

        One MAX all-reduce of one flag per undecided block of ``st``; none when every block was
        decided by another optimizer's step already.
        """
        assert st.grad_scale is not None
        self.refuse_wrapped_before_init()
        from .masters.optimizer import outside_backward, refuse_outside_backward

        outside = outside_backward(st)
        if outside and (self.process_group is None or self.world == 1):
            refuse_outside_backward(api, outside)  # (with several ranks: all together, below)
        st.masters.check_views(self.param_names)  # before anything changes
        edited = self._edited_reduced_grads(st)  # before unscaling touches anything
        added = st.added_after_reduce
        own = st.masters.unscale_and_check(1.0 / st.grad_scale)
        undecided = [b for b in st.backwards if b.overflow is None]
        st.decided_here = bool(undecided) or not st.backwards
        if undecided or not st.backwards:
            flags = [self._block_flag(b, st, own) for b in undecided] if undecided else [own]
            # [Note: a fixed-size decision vector] One slot per kind of block (its loss and the
            # optimizers it was passed with), FLAG_SLOTS of them, then the number of blocks as
            # +n and -n. Blocks of one kind share a slot at no cost: a loss backs off, and an
            # optimizer skips, when any block of theirs overflowed. One slot per block, folded
            # by index, made the ninth block share the first's: an accumulation of 8 micro-
            # batches of loss 0 plus an overflowing loss 1 backed loss 0 off and skipped
            # optimizers loss 1 never touched (an audit). Only more than FLAG_SLOTS kinds fold
            # (a skip then covers kinds i and i + FLAG_SLOTS). The length never depends on this
            # rank's blocks: ranks that ran a different number of scale_loss blocks since the
            # last step (one rank discarded a micro-batch) used to send vectors of different
            # lengths, and gloo hung or aborted; now every rank reads both counts and raises
            # together.
            device = own.device
            slots = torch.zeros(FLAG_SLOTS, dtype=torch.float64, device=device)
            slot_of = _slots_by_kind(undecided) if undecided else [0]
            for slot, flag in zip(slot_of, flags, strict=True):
                slots[slot] = torch.maximum(slots[slot], flag.to(device)[0])
            count = float(len(undecided))
            parts = [slots, torch.tensor([count, -count], dtype=torch.float64, device=device)]
            # See [Note: the evidence rides with the decision] in forensics.py.
            involved = [st]
            for block in undecided:
                involved += [u for u in block.users if u not in involved]
            # Every rank's own gradients first, then what the reduce-scatter hook summed into
            # the shards: the MAX names a rank's own non-finite gradient before any reduced one
            # (which every owner of a piece holds), and a reduced one only when every rank's own
            # were finite (the 16-bit wire overflowed).
            n_local = sum(len(u.masters.model_params) for u in involved)
            n_params = n_local + sum(u.masters.n_reduced_grads() for u in involved)

            def named() -> list[tuple[str, torch.Tensor | None]]:
                local = [i for u in involved for i in u.masters.named_grads(self.param_names)]
                return local + [
                    i for u in involved for i in u.masters.reduced_grads(self.param_names)
                ]

            loss_kinds = [b.loss_kind for b in undecided]
            evidence_here = local_evidence(
                slots,
                loss_kinds,
                n_params,
                named,
                self.rank,
                self.world,
                self._origin_of(involved),
            )
            parts.append(evidence_here.to(device))
            # 2: gradients a backward added after DDP reduced them; 1: edited before unscale_
            code = 2.0 if added else float(bool(edited))
            parts.append(torch.tensor([code], dtype=torch.float64, device=device))
            if self.process_group is not None:  # see [Note: settings that part between ranks]
                parts.append(st.hyperparameter_fingerprint().to(device))
            replicas = None
            loaded = [p for p, _ in st.masters.loads]  # (named if the ranks' loads differ)
            if self.process_group is not None and self.world > 1:
                replicas = st.masters.replica_fingerprint(
                    self.ddp_ignored(), hooked=self.hooked_params
                )
                if replicas is not None:
                    parts.append(replicas.to(device, torch.float64))
            # [Note: what the ranks' blocks are, and who decided early] Last, more: 1 if
            # this rank decides in distamp.unscale_/clip_grad_norm_ (every rank then checks the
            # gradients edited after it at step(), a collective: a rank alone in it, the others
            # gone on to the gather, hung or aborted — an audit, rank 0 unscaling to log the
            # norm), and the kinds of blocks (loss, optimizers) as +h/-h: a rank whose block of
            # loss 1 met another's block of loss 0 in one slot backed off another loss's scale
            # than its peers, and the ranks parted silently (an audit).
            # The optimizer deciding, too: a rank deciding another optimizer than its peers in
            # this collective (unscale_ of the second of two optimizers on one rank only) was
            # blamed on schedulers or loss_ids (an audit).
            early = float(api != "optimizer.step()")
            tail: list[float] = []
            if self.process_group is not None:
                kinds = float(zlib.crc32(repr(_kinds(undecided)).encode()))
                # last, 1 on a rank taking part only to refuse (see _decide_with_no_blocks):
                # the others raise with it, where they would have gone on to the step's
                # collectives alone (an audit: a second step() on gradients zeroed in place on
                # one rank only stepped there and hung, or parted the replicas)
                refusing = float(st.refusing)
                # and a backward outside scale_loss here: its kind and this rank, MAX-reduced
                # (see refuse_outside_backward)
                here = outside * self.world + self.rank if outside else 0.0
                # and the loss scales with what moves them next, +s/-s (see
                # _refuse_parted_loss_scales)
                sc = self._scales_hash()
                tail = [early, kinds, -kinds, float(st.index), -float(st.index), refusing, here]
                tail += [sc, -sc]
                parts.append(torch.tensor(tail, dtype=torch.float64, device=device))
            vector = torch.cat(parts)
            if self.process_group is not None:
                all_reduce_max_(vector, self.process_group)
                self.found_inf_collectives += 1
            values = vector.tolist()
            if tail:
                values, tail = values[: -len(tail)], values[-len(tail) :]
                early = tail[0]
            if tail and tail[3] != -tail[4]:
                self._refuse_different_deciders(st, api, tail[3], -tail[4])
            if tail and tail[6] > 0:  # a backward outside scale_loss, here or on another rank
                kind, at = divmod(int(tail[6]), self.world)
                assert self.process_group is not None
                rank = dist.get_global_rank(self.process_group, at)
                refuse_outside_backward(api, float(kind), f" on rank {rank}")
            if values[FLAG_SLOTS] != -values[FLAG_SLOTS + 1]:
                self._refuse_different_block_counts(st, count, values[FLAG_SLOTS : FLAG_SLOTS + 2])
            if tail and tail[1] != -tail[2]:
                self._refuse_different_block_kinds(st, undecided, api)
            # (after the counts: a rank with no blocks at all is told by them, more precisely)
            if tail and tail[5] > 0 and not st.refusing:
                raise RuntimeError(
                    f"{api}: expected every rank of distamp.wrap's process_group to step on "
                    "gradients of its own new backward, found another rank refusing this step "
                    "(a second step() there on the gradients its previous step used, or no "
                    "gradients at all): this rank raises with it rather than step alone. The "
                    "usual cause: one rank's loop differs (an extra step(), a zero_grad on "
                    "some ranks only, a batch skipped)"
                )
            st.early_anywhere = early > 0
            for block in undecided:
                block.early = early > 0
            # (an edit that made a gradient non-finite is seen: the step is skipped, nothing lost)
            skipping = any(values[i] > 0 for i in range(FLAG_SLOTS))
            changed = values[FLAG_SLOTS + 2 + EVIDENCE_SLOTS]
            if changed > 1 and not skipping:
                self._refuse_added_after_reduce(added, api)
            if changed > 0 and not skipping:
                self._refuse_edited_reduced_grads(edited, api)
            if self.process_group is not None:
                at = FLAG_SLOTS + 3 + EVIDENCE_SLOTS
                self._refuse_parted_settings(st, values[at], values[at + 1])
            if replicas is not None:
                self._refuse_different_loads(values[-2:], loaded, api)
            if tail and tail[7] != -tail[8]:  # (before the replicas, which it parts)
                self._refuse_parted_loss_scales(api)
            if replicas is not None:
                # An inf/NaN on one rank's gradients parts them too: the step is skipped then.
                # A rank about to refuse the step does not compare them: under the reduce-
                # scatter hook a second step() found each rank's own unreduced ones and was
                # refused as "gradients different", its real cause unsaid (an audit).
                check = not skipping and not st.refusing
                self._refuse_parted_replicas(st, values[-6:-2], check_grads=check, api=api)
            evidence = values[FLAG_SLOTS + 2 : FLAG_SLOTS + 2 + EVIDENCE_SLOTS]
            report = read_evidence(
                evidence,
                [b.loss_id for b in undecided],
                n_params,
                named,
                self.world,
                reduced_from=n_local,
                fsdp=st.masters.fsdp,
            )
            if report is not None and self.world > 1:
                # The evidence counts ranks within wrap's process_group: named as the global
                # rank (an audit, two groups of 2 at world 4: "rank 1" meant global rank 3).
                group = self.process_group

                def global_rank(r: int) -> int:
                    return r if group is None else dist.get_global_rank(group, r)

                report = dataclasses.replace(
                    report,
                    rank=global_rank(report.rank),
                    origin=None if report.origin is None else global_rank(report.origin),
                    fp16_wire=self.fp16_all_reduce and report.on_every_rank,
                )
            elif report is not None and self.fp16_all_reduce:
                # one rank: the hook still casts its gradients to FP16 (an audit: a finite
                # gradient the wire overflowed was named the rank's own)
                report = dataclasses.replace(report, fp16_wire=True)
            watch = (
                report is not None
                and report.on_every_rank
                and report.loss_id is None
                and not st.masters.fsdp  # (FSDP's gradients: only their shards are seen)
                and self.world > 1
            )
            if watch or self.origin_watches:  # (nothing to do on a clean run)
                for u in involved:  # (a block listing several optimizers decides them together)
                    self._watch_origin(u, device if watch else None)
            if watch and report is not None:
                report = dataclasses.replace(report, origin_next=True)
            st.decision_report = report
            for block in undecided:
                block.report = report
            result = [values[slot] > 0 for slot in slot_of]
            if not st.backwards:
                st.overflow = result[0]
            for block, overflow in zip(undecided, result, strict=False):
                block.overflow = overflow
        if st.backwards:
            st.overflow = any(bool(b.overflow) for b in st.backwards)
            st.early_anywhere = any(b.early for b in st.backwards)
        st.state = OptState.UNSCALED

    def _added_after_reduce(self, st: AmpOptimizerState, fresh: AbstractSet[int]) -> list[str]:
        """[Note: a backward DDP does not reduce] DDP reduces once per forward: a second backward
        through one DDP forward (``retain_graph=True``; a GAN's generator loss through the
        output the discriminator's loss went through; a second loss reusing an encoder's
        output) adds to ``.grad`` with no comm hook run. On the all-reduce path the ranks'
        gradients then part and the step is refused (the replica check); under the reduce-
        scatter hook the step reads the shard gradients the first backward's hook wrote, and
        the rest was dropped, silently (an audit: the run equalled one without the second
        loss). So at each block's end, a parameter the hook reduced in an earlier block, not
        in this one, whose ``.grad`` changed since that block's end is named; the step is
        refused on every rank. A second backward inside one block is not seen."""
        return self._reduced_grads_changed(st, skip=fresh)

    def _edited_reduced_grads(self, st: AmpOptimizerState) -> list[str]:
        """Names of the parameters the reduce-scatter hook reduced whose model ``.grad`` was
        modified in place or replaced after their block's backward, before ``unscale_``.

        [Note: edits lost under the reduce-scatter hook] There the model's ``.grad`` keeps this
        rank's own gradient and the reduced sum lives in the FP32 shard gradient the step uses:
        a gradient zeroed to freeze a layer, or an FP32 script's own
        ``clip_grad_norm_(model.parameters())`` before ``step()``, changed nothing the step
        read, silently (an audit: a "frozen" layer moved, the clipping was ignored). After
        ``distamp.unscale_`` the model's ``.grad`` are the reduced gradients and edits are
        taken (see ``take_modified_model_grads``); before it, every rank refuses."""
        if st.warned_touched_scaled:
            return []  # (after the touched warning the recorded versions are not refreshed)
        return self._reduced_grads_changed(st)

    def _reduced_grads_changed(
        self, st: AmpOptimizerState, skip: AbstractSet[int] = frozenset()
    ) -> list[str]:
        """Names of the parameters the reduce-scatter hook reduced (but those in ``skip``) whose
        ``.grad`` changed since the last block's end (a .grad set to None is honoured: the
        parameter is not stepped)."""
        reduced = st.masters.reduced
        if not reduced or not st.scaled_grads:
            return []
        params = [p for p, _ in st.scaled_grads]
        return [
            self.param_names.get(id(p), "?")
            for (p, version), now in zip(st.scaled_grads, grad_versions(params), strict=True)
            if id(p) in reduced and id(p) not in skip and now is not None and now != version
        ]

    def _named_on_this_rank(self, names: list[str]) -> str:
        """Where a refusal's parameters are: a few of this rank's, or another rank's."""
        if not names:
            return "on another rank"
        more = " and more" if len(names) > 3 else ""
        return f"on this rank (rank {self.rank}): {names[:3]}{more}"

    def _refuse_added_after_reduce(self, added: list[str], api: str) -> None:
        """See [Note: a backward DDP does not reduce]: every rank raises."""
        where = self._named_on_this_rank(added)
        raise RuntimeError(
            f"{api}: expected one backward per DDP forward under distamp.hooks.register(..., "
            f"reduce_scatter=True), found gradients added after DDP reduced them {where}: a "
            "second backward through one DDP forward (retain_graph=True; a GAN's generator "
            "loss through the output the discriminator's loss went through; a second loss "
            "reusing an output another loss's backward went through). DDP reduces once per "
            "forward, so the step would read the first backward's gradients and drop the rest. "
            "Sum the losses into one backward (their scale_loss blocks into one), detach what "
            "the second loss reuses, or run the forward again for it"
        )

    def _refuse_edited_reduced_grads(self, edited: list[str], api: str) -> None:
        """See [Note: edits lost under the reduce-scatter hook]: every rank raises."""
        where = self._named_on_this_rank(edited)
        raise RuntimeError(
            f"{api}: expected the model's gradients untouched between backward and "
            f"distamp.unscale_ under distamp.hooks.register(..., reduce_scatter=True), found "
            f"some modified {where}. With the reduce-scatter hook a parameter's .grad holds "
            "this rank's own gradient and the step reads the reduced sum from the FP32 shards, "
            "so the edit (zeroing a frozen layer's gradient, clipping model.parameters()) would "
            "be lost. Call distamp.unscale_(optimizer) first (the .grad are then the reduced "
            "gradients, and edits to them are taken), or use distamp.clip_grad_norm_(optimizer, "
            "max_norm); to freeze a layer, set requires_grad=False or its .grad to None"
        )

    def _refuse_different_block_counts(
        self, st: AmpOptimizerState, mine: float, seen: list[float]
    ) -> None:
        """See [Note: a fixed-size decision vector]: every rank raises, naming the counts and
        the causes that fit them (an audit: a rank out of batches under torch's Join was told
        it had discarded one)."""
        low, high = -seen[1], seen[0]
        if low == 0:
            why = (
                "A rank that ran no backward but steps: uneven inputs (one rank out of batches: "
                "torch's Join, or ZeroRedundancyOptimizer's join hook, steps the optimizer there "
                "with nothing to step; distamp's optimizer is not Joinable — give every rank the "
                "same number of batches, DistributedSampler(drop_last=True), or stop all ranks at "
                "the first that runs out with ddp.join(throw_on_early_termination=True)), or a "
                "rank that discarded its only batch (then every rank must discard it)"
            )
        else:
            why = (
                "Uneven accumulation windows (ranks that run different numbers of micro-batches "
                "per step: the skip decision pairs the ranks' blocks one by one — give every rank "
                "the same window), or a rank that discarded a batch (cleared the gradients after "
                "its backward) alone"
            )
        counts = f"between {low:g} and {high:g} (this rank, {self.rank}: {mine:g})"
        if self.process_group is not None:  # every rank is here (the counts are all-reduced)
            group = self.process_group
            # (count, a backward outside scale_loss instead of blocks: an audit's rank running
            # loss.backward() where the others ran a block was told of Join and discards)
            # (with blocks too: refused before the counts, naming the rank) Under FSDP no hook
            # sees a backward: its gradients are read (an audit: "ran no backward")
            held = [p.grad for p in st.masters.model_params if p.grad is not None]
            reached = st.outside_seen or (st.masters.fsdp and any_nonzero(held))
            outside = bool(reached and not st.backwards)
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (mine, outside), group=group)
            counts = ", ".join(
                f"{c:g} on rank {dist.get_global_rank(group, r)}"
                + (" (which ran a backward outside scale_loss)" if o else "")
                for r, (c, o) in enumerate(gathered)
            )
            if any(o for _, o in gathered):
                why = (
                    "A rank whose backward ran outside scale_loss (loss.backward(), a "
                    f"framework's) where the others ran scale_loss blocks: run it inside "
                    f"scale_loss on every rank. Or: {why[:1].lower()}{why[1:]}"
                )
        raise RuntimeError(
            f"optimizer.step(): expected every rank to have run the same number of scale_loss "
            f"blocks for this optimizer since its last step, found {counts}. {why}. A discard "
            "must be decided from a value all ranks agree on (an all-reduced loss, distamp.clip_grad_norm_'s "
            "global norm), as the skip decision is shared"
        )

    def _refuse_different_deciders(
        self, st: AmpOptimizerState, api: str, high: float, low: float
    ) -> None:
        """See [Note: what the ranks' blocks are, and who decided early]."""
        raise RuntimeError(
            f"{api} (optimizer {st.index} of distamp.wrap's, rank {self.rank}): expected every "
            f"rank to take the skip decision of the same optimizer in this collective, found "
            f"optimizers {low:g} to {high:g} deciding at once: distamp.unscale_ or "
            "clip_grad_norm_ of one optimizer on some ranks only, while the others stepped "
            "another first. Each optimizer's decision is one all-reduce of every rank: call "
            "unscale_/clip_grad_norm_ of an optimizer on every rank, or on some ranks only for "
            "the optimizer the others step first"
        )

    def _refuse_different_block_kinds(
        self, st: AmpOptimizerState, undecided: list[Backward], api: str
    ) -> None:
        """See [Note: what the ranks' blocks are, and who decided early]: every rank read the
        same reduced numbers and is here; one more collective names each rank's blocks."""
        assert self.process_group is not None
        mine = [f"loss_id {loss} (optimizers {list(users)})" for loss, users in _kinds(undecided)]
        seen: list[Any] = [None] * self.world
        dist.all_gather_object(seen, mine, group=self.process_group)
        ranks = dist.get_process_group_ranks(self.process_group)
        listed = "; ".join(f"rank {ranks[r]}: {', '.join(k) or 'none'}" for r, k in enumerate(seen))
        raise RuntimeError(
            f"{api}: expected every rank to have run the same kinds of scale_loss blocks (loss_id "
            f"and optimizers) since this optimizer's last step, "
            f"found {listed}. Each loss has its own scale, decided for every rank together: a "
            "rank whose loss 1 met another's loss 0 backs off another scale than its peers and "
            "the ranks part. Pass the same loss_id on every rank (an auxiliary loss some ranks "
            "skip: compute it everywhere, times 0 where it does not apply)"
        )

    def _scale_state(self) -> list[tuple[float, int, int]]:
        """Each loss's scale and what moves it next: equal on every rank, as the decisions are."""
        return [(sc.scale, sc.clean_steps, sc.hysteresis_left) for sc in self.scalers]

    def _scales_hash(self) -> float:
        """A hash of :meth:`_scale_state`, exact in float64, alike in every process."""
        return float(zlib.crc32(repr(self._scale_state()).encode()))

    def _refuse_parted_loss_scales(self, api: str) -> None:
        """Loss scales that differ between ranks (``amp.load_state_dict`` on rank 0 only): DDP
        averaged gradients scaled by different factors and each rank unscaled by its own, so
        at O1 the replicas parted silently, and elsewhere the replica check blamed the
        gradients (an audit). Collective (every rank read the same hashes): names each rank's."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        gathered: list[Any] = [None] * len(ranks)
        dist.all_gather_object(gathered, self._scale_state(), group=group)
        parted = []
        for j in range(len(self.scalers)):
            for k, what in enumerate(("scale", "steps since its last change", "hysteresis left")):
                seen = [state[j][k] for state in gathered]
                if len(set(seen)) > 1:
                    shown = ", ".join(
                        f"rank {r} {v:g}" for r, v in list(zip(ranks, seen, strict=True))[:8]
                    )
                    parted.append(f"loss {j}'s {what}: {shown}")
        raise RuntimeError(
            f"{api}: expected every rank's loss scale (and the state that moves it) to be the "
            f"same, found {'; '.join(parted[:4]) or 'them different'} (raised on rank "
            f"{dist.get_rank()}): the ranks' gradients were scaled by different factors. The "
            "usual cause: amp.load_state_dict, load_checkpoint's scaler state or a loss scale "
            "set by hand on some ranks only — load or set it on every rank"
        )

    def _refuse_parted_settings(self, st: AmpOptimizerState, high: float, neg_low: float) -> None:
        """[Note: settings that part between ranks] DDP keeps the ranks' gradients equal, not
        their optimizers' settings: a scheduler stepped with each rank's own loss
        (ReduceLROnPlateau on a local loss) gives each rank its own lr, and the replicas drifted
        apart silently — or, with sharded masters, each shard was stepped at another lr while
        the gathered weights stayed equal (an audit). Two more numbers in the decision's
        all-reduce compare the settings; every rank reads the same result, so all raise."""
        if high == -neg_low:
            return
        # Every rank is here (all read the same reduced numbers): one more collective names
        # the settings that differ and each rank's value of them.
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        gathered: list[Any] = [None] * len(ranks)
        dist.all_gather_object(gathered, st.settings(), group=group)
        found = []
        if len({len(groups) for groups in gathered}) > 1:
            counts = ", ".join(f"rank {r}: {len(g)}" for r, g in zip(ranks, gathered, strict=True))
            found.append(f"different numbers of param groups ({counts})")
        for g, settings in enumerate(gathered[0]):
            for key in settings:
                seen = [groups[g].get(key) if g < len(groups) else None for groups in gathered]
                if any(value != seen[0] for value in seen):
                    shown = ", ".join(
                        f"rank {r}: {v[0] if v is not None and len(v) == 1 else v}"
                        for r, v in list(zip(ranks, seen, strict=True))[:8]
                    )
                    found.append(f"param_groups[{g}][{key!r}] ({shown})")
        raise RuntimeError(
            "optimizer.step(): expected the optimizer's settings (lr, betas, momentum, "
            "weight_decay, ... of every param group) to be the same on every rank, found "
            f"{'; '.join(found[:4]) or 'them different'} (raised on rank {self.rank}). The "
            "usual cause: a scheduler stepped with a value of each rank's own (ReduceLROnPlateau "
            "on the local loss) — step it with a value every rank agrees on (an all-reduced "
            "loss); or a setting changed on some ranks only"
            + (
                "; for what the param groups hold: optimizer.add_param_group called with other "
                "parameters (or on some ranks only) — call it with the same ones on every rank"
                if any(HELD in item for item in found)
                else ""
            )
        )

    def _first_parted_grad(self, st: AmpOptimizerState, group: dist.ProcessGroup | None) -> str:
        """Every rank is here (all read the same reduced numbers): one more collective finds the
        first parameter whose gradient differs between ranks, as " (first: 'name')"."""
        params = st.masters.grads_compared(self.ddp_ignored(), hooked=self.hooked_params)
        device = next((p.device for p in params), torch.device("cpu"))
        mine = torch.stack(
            [bit_hash(grad_samples([p]), device)[0] for p in params]
            or [torch.zeros((), device=device)]
        )
        both = torch.cat([mine, -mine])
        all_reduce_max_(both, group)
        parted = (both[: len(mine)] != -both[len(mine) :]).nonzero()
        if not params or not len(parted):
            return ""
        return f" (first: {self.param_names.get(id(params[int(parted[0])]), '?')!r})"

    def _refuse_different_loads(
        self, hashes: list[float], loaded: Sequence[torch.Tensor], api: str
    ) -> None:
        """See [Note: a load on some ranks only] in masters/base.py: every rank read the same
        reduced numbers, so every rank raises."""
        if hashes[0] == -hashes[1]:
            return
        names = [self.param_names.get(id(p), "?") for p in loaded]
        mine = f"{names[:4]}{' and more' if len(names) > 4 else ''}" if names else "nothing"
        raise RuntimeError(
            f"{api}: expected every rank to load the same weights since the last step, found "
            f"loads that differ between the ranks (this rank, {self.rank}, loaded {mine}): a "
            "model.load_state_dict on some ranks only, or of different values. Each rank's FP32 "
            "masters took its own, and sharded masters would have stitched the ranks' pieces "
            "together. Load on every rank (DistributedDataParallel broadcasts rank 0's weights "
            "only when it is built, not after), or on rank 0 before distamp.wrap, which "
            "broadcasts rank 0's FP32 weights; then zero_grad and train on"
        )

    def _refuse_parted_replicas(
        self, st: AmpOptimizerState, hashes: list[float], *, check_grads: bool, api: str
    ) -> None:
        """See [Note: clipping what param_groups hold] in masters/sharded.py and
        ``ShardedMasterParams.replica_fingerprint``: every rank reads the same reduced numbers,
        so every rank raises."""
        weights_differ = hashes[0] != -hashes[1]
        if check_grads and hashes[2] != -hashes[3]:
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            first = self._first_parted_grad(st, group)
            # A parameter forward did not use, under DDP's default find_unused_parameters=False:
            # DDP waits for its gradient and reduces neither its bucket nor any later one; the
            # parted gradient named above is another bucket's (an audit hunted a wrap-order bug).
            no_grad = [p for p in st.masters.model_params if p.grad is None]
            missing = [self.param_names.get(id(p), "?") for p in no_grad if p.requires_grad]
            # Frozen before DDP was built is harmless; frozen after, DDP still waits for them.
            # Unknown without hooks.register: those frozen at wrap (DDP comes after wrap).
            built = self.frozen_when_built
            if built is None:
                built = self.frozen_at_wrap
            frozen = [
                self.param_names.get(id(p), "?")
                for p in no_grad
                if not p.requires_grad and id(p) not in built
            ]
            unfrozen = [
                self.param_names.get(id(p), "?")
                for p in st.masters.model_params
                if p.grad is not None and self.frozen_when_built and id(p) in built
            ]
            if unfrozen:  # (an audit: progressive unfreezing was told about other parameters)
                first += (
                    f"; parameters trained now that were frozen when DDP was built "
                    "(requires_grad=False at distamp.wrap / distamp.hooks.register): "
                    f"{', '.join(map(repr, unfrozen[:4]))}"
                    f"{' and more' if len(unfrozen) > 4 else ''} — DDP's reducer never reduces "
                    "them: rebuild DDP after unfreezing (and call distamp.hooks.register again)"
                )
            if missing:
                first += (
                    f"; parameters with no gradient on this rank: "
                    f"{', '.join(map(repr, missing[:4]))}{' and more' if len(missing) > 4 else ''}"
                    " — unused in forward under DDP built with find_unused_parameters=False, they "
                    "leave their bucket and every later one unreduced: pass "
                    "find_unused_parameters=True to DDP (or use every parameter); or left out "
                    "by backward(inputs=...) / torch.autograd.grad, which DDP does not support "
                    "(DDP waits for every parameter's gradient, whatever find_unused_parameters "
                    "says): run backward over all parameters, or build DDP over the subset"
                )
            if frozen:  # (an audit: frozen after DDP was built, another parameter was named)
                first += (
                    f"; parameters frozen now (requires_grad=False): "
                    f"{', '.join(map(repr, frozen[:4]))}{' and more' if len(frozen) > 4 else ''}"
                    " — if frozen after DDP was built, DDP still waits for their gradients and "
                    "leaves their bucket and every later one unreduced: rebuild DDP after "
                    "freezing, or pass find_unused_parameters=True"
                )
            raise RuntimeError(
                f"{api}: expected the model's gradients identical on every rank of "
                f"distamp.wrap's process_group (ranks {dist.get_process_group_ranks(group)}), as "
                f"DDP's all-reduce leaves them, found them different{first}: each rank would "
                "step with "
                "gradients the others never saw and the ranks' weights would part. The usual "
                "causes: DistributedDataParallel built before distamp.wrap (O2/O3 cast the "
                "weights in place, so DDP's gradient hooks never fire: wrap first, then DDP); a "
                "DDP over another process group than wrap's (pass the same group to "
                "distamp.wrap(..., process_group=...) and to DDP); no DDP (no all-reduce) at "
                "all; a step after backwards DDP never synced (every micro-batch under "
                "ddp.no_sync(), or require_backward_grad_sync left False: sync the last one); a "
                "second backward through one DDP forward (retain_graph=True, a GAN's generator "
                "loss reusing the output the discriminator's loss went through: DDP reduces the "
                "first backward after a forward only — run the forward again); or "
                "a parameter DDP does not reduce (frozen when DDP was built: rebuild DDP "
                "after unfreezing; one you meant DDP to leave alone: name it with "
                "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model before "
                "building DDP, and distamp leaves it out of this check too — where DDP wraps a "
                "container of the wrapped model, name them on that container and call "
                "distamp.hooks.register(ddp, optimizer), which reads DDP's own list); or a comm "
                "hook that does not average every gradient every step (torch's "
                "post_localSGD_hook past start_localSGD_iter: local SGD steps each rank on its "
                "own gradients; use it at O0/O1, whose weights are their own masters). Ranks "
                "that train apart on purpose: wrap with process_group=a one-rank group "
                "(dist.new_subgroups(group_size=1)[0])"
            )
        if not weights_differ:
            return
        kept = getattr(st.masters, "replicated", [])
        names = [self.param_names.get(id(p), "?") for p in kept[:3]]
        raise RuntimeError(
            "the ranks' copies of the parameters every rank steps whole under sharded masters "
            f"({names}{' and more' if len(kept) > 3 else ''}) differ: expected them identical "
            "on every rank, as wrap made them. The usual causes: clipping by a norm over "
            "optimizer.param_groups (or amp.master_params): with sharded masters they hold this "
            "rank's shard, so each rank clipped by its own norm — clip with "
            "distamp.clip_grad_norm_(optimizer, max_norm), or torch's clip_grad_norm_ over "
            "model.parameters() after distamp.unscale_(optimizer), or wrap with "
            "shard_master_weights=False; or hyperparameters that differ between ranks (lr, "
            "betas, weight_decay: a scheduler such as ReduceLROnPlateau stepped with each "
            "rank's own loss) — step it with a value every rank agrees on (an all-reduced loss); "
            "or a DDP built over another process group than distamp.wrap's process_group"
        )

    def _block_flag(
        self, block: Backward, st: AmpOptimizerState, own: torch.Tensor
    ) -> torch.Tensor:
        flag = block.flag.to(own.device) if block.flag is not None else torch.zeros_like(own)
        if block.loss_kind is not None:
            # [Note: a non-finite loss skips] An inf/NaN loss skips the step even when its
            # gradients came out finite: once the dynamic scale has backed off far enough, the
            # scaled gradients of an inf loss underflow to exact zeros, which would "step" on
            # nothing forever instead of reaching max_consecutive_skips and its error.
            flag = torch.maximum(flag, (block.loss_kind > 0).to(flag.dtype).to(own.device))
        for user in block.users:
            # Non-finite values that appeared after the block ended (written by hand, or by a
            # collective) belong to every block of that optimizer.
            now = own if user is st else user.masters.check().to(own.device)
            if user.seen_nonfinite is not None:
                now = now * (1 - user.seen_nonfinite.to(own.device))
            flag = torch.maximum(flag, now)
        return flag

    def update_finished_losses(self) -> None:
        """Update each loss's scaler once all of its open blocks are decided.

        [Note: the scale moves at step()] Called by ``step()`` (and when gradients are dropped),
        not where the decision is made: ``unscale_`` (or ``clip_grad_norm_``, apex's
        ``master_params``) decides early, and a script may still discard that batch (a spiked
        norm, a NaN loss) by clearing the gradients; torch.amp's scaler moves only at
        ``update()``, and so the scale here moves only for blocks an optimizer stepped or
        skipped on (DESIGN: the skip decision and the scale update happen at step())."""
        for loss_id, scaler in enumerate(self.scalers):
            mine = [b for b in self._open if b.loss_id == loss_id]
            if mine and all(b.overflow is not None for b in mine):
                discarded = loss_id in self._discarded_overflow
                report = self._discarded_overflow.pop(loss_id, None)
                scaler.update(discarded or any(bool(b.overflow) for b in mine))
                self._open = [b for b in self._open if b.loss_id != loss_id]
                if discarded:
                    # (an audit: carried to a clean optimizer's step, the limit was never
                    # checked, and the scale sank until that optimizer's gradients were 0)
                    self._refuse_discarding_forever(loss_id, report)

    def _say_low_scale(self, loss_ids: list[int]) -> None:
        """Once per loss, when an fp16 dynamic scale backs off below 1: a run of batches whose
        loss itself was inf/NaN (which no scale fixes) halved it every time, apex's and torch's
        way, and never 2000 clean steps let it grow back; below 1 the fp16 gradients underflow
        to 0 and every later step was "clean" and trained nothing, silently (an audit: 40 bad
        batches left the scale at 3e-8 and the loss at 9.9 against 0.51)."""
        if self.props.half_dtype != torch.float16 or self.props.verbosity < 1 or self.rank != 0:
            return
        for j in loss_ids:
            scaler = self.scalers[j]
            if not scaler.dynamic or scaler.scale >= 1.0 or j in self.warned_low_scale:
                continue
            self.warned_low_scale.add(j)
            logger.warning(
                "distamp: loss %d's scale fell below 1 (now %g) after %d skipped steps, %d of "
                "them with a non-finite loss itself, which a smaller scale does not fix; below 1 "
                "fp16 gradients underflow to 0 and training stalls while the scale grows back "
                "once per %d clean steps. Expected a loss scale >= 1: fix what makes the loss "
                "non-finite (drop such a batch before backward), or set a floor with "
                "wrap(..., min_loss_scale=1.0) (DeepSpeed's and Megatron's default)",
                j,
                scaler.scale,
                self.total_skips,
                self.loss_skips,
                scaler.growth_interval,
            )

    def after_skip(self, st: AmpOptimizerState) -> None:
        """After a skip this optimizer decided: log what the decision named, stop a hopeless loop."""
        if not st.decided_here:
            # Its blocks were decided at another optimizer's step (one block listing both): the
            # report is that decision's (an audit found None here while the culprit was ours).
            st.last_nonfinite = next(
                (b.report for b in st.backwards if b.overflow and b.report is not None), None
            )
            return
        self.total_skips += 1
        overflowed = [b for b in st.backwards if b.overflow]
        report = st.decision_report
        self.last_nonfinite = report
        st.last_nonfinite = report
        loss_ids = sorted({b.loss_id for b in overflowed})
        scales = ", ".join(f"{self.scalers[j].scale:g}" for j in loss_ids) or "unchanged"
        what = str(report) if report is not None else "non-finite gradients"
        loss_itself = report is not None and report.loss_id is not None
        # A non-finite loss is counted apart, so that the first one is logged at once even after
        # many overflow skips; both are rate-limited (a NaN loss every step logged every step).
        self.loss_skips += loss_itself
        if (
            self.props.verbosity >= 1
            and self.rank == 0
            and _rate_limited(self.loss_skips if loss_itself else self.total_skips)
        ):
            logger.warning(
                "distamp: skipping optimizer step (%d skipped so far): %s; loss scale now %s",
                self.total_skips,
                what,
                scales,
            )
        self._say_low_scale(loss_ids)
        limit = self.props.max_consecutive_skips
        if not st.backwards:
            # A framework's backward (the Trainer's, accelerate's, Lightning's automatic
            # optimization) opens no block, so no loss scaler counted its skips: an inf on one
            # rank skipped every step forever and the run "finished" having trained nothing (an
            # audit). Counted here, against the same limit.
            self.unscaled_skips += 1
            if self.unscaled_skips >= limit:
                self._watch_origin(None, None)
                raise NonFiniteGradientError(
                    f"{self.unscaled_skips} consecutive optimizer steps were skipped after "
                    f"backwards outside distamp.scale_loss (no loss scale to lower): {what}. Look "
                    "for a NaN/inf produced by the forward pass or the loss itself "
                    "(max_consecutive_skips sets this limit)"
                )
        for j in loss_ids:
            scaler = self.scalers[j]
            if scaler.consecutive_skips >= limit or scaler.skipped_at_floor:
                reason = (
                    f"{scaler.consecutive_skips} consecutive optimizer steps were skipped"
                    if scaler.consecutive_skips >= limit
                    else f"a step was skipped at the minimum loss scale {scaler.floor:g}"
                )
                if not scaler.dynamic:
                    reason += f" with a static loss scale of {scaler.scale:g}"
                broken = self.nonfinite_weight_anywhere()
                fsdp = any(o.masters.fsdp for o in self.optimizers)
                if fsdp and self.props.half_dtype == torch.float16:
                    wire = (
                        ", or, with an fp16 half_dtype (FSDP reduce-scatters in it), gradients "
                        "past fp16's range (65504) in the reduction — half_dtype=torch.bfloat16 "
                        "keeps FP32's range"
                    )
                elif not fsdp and self.fp16_wire:
                    wire = (
                        ", or, under a comm hook with an fp16 wire, gradients past fp16's "
                        "range (65504) that were finite before the wire — a bf16 wire "
                        "(distamp.hooks.register(..., dtype=torch.bfloat16)) keeps FP32's range"
                    )
                else:  # (an audit: the fp16-wire hint with a bf16 model and no hook)
                    wire = ""
                where = (
                    f"the weights themselves are non-finite ({broken}): something wrote them — "
                    "an earlier step without FP32 masters (e.g. O3 fp16, an optimizer eps that "
                    "rounds to 0 in fp16 divides by 0) or the script (a write to the weights, an "
                    "edit between unscale_ and step()) — so every forward after it fails"
                    if broken
                    else f"look for a NaN/inf produced by the forward pass or the loss itself{wire}"
                )
                # A scale held up (a static one, or a dynamic one at a min_loss_scale the user
                # set) may itself be why a finite gradient overflowed (an audit: told "lowering
                # the loss scale does not fix this" at min_loss_scale=16384)
                held = "a static scale" if not scaler.dynamic else None
                if scaler.dynamic and scaler.skipped_at_floor and scaler.floor > MIN_SCALE:
                    held = "the floor min_loss_scale"
                if loss_itself:  # (the report of a non-finite loss says so itself: not twice)
                    advice = where[:1].upper() + where[1:]
                elif held is not None and scaler.scale > 1.0 and not broken:
                    lower = "lower it" if held == "a static scale" else "lower min_loss_scale"
                    advice = (
                        f"At {held} an inf gradient may be the scale's own overflow of a "
                        f'finite one ({lower}, or use loss_scale="dynamic" with no floor, '
                        f"to tell); otherwise {where}"
                    )
                else:
                    advice = f"Lowering the loss scale does not fix this; {where}"
                self._watch_origin(None, None)
                raise NonFiniteGradientError(
                    f"loss {j}: {reason}: {what}. {advice} (max_consecutive_skips / "
                    "min_loss_scale set this limit)"
                )


def _rate_limited(count: int) -> bool:
    """Log the first 10 skips, then every power of two."""
    return count <= 10 or (count & (count - 1)) == 0
