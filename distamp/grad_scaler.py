"""``distamp.GradScaler``: torch.amp.GradScaler's API, with the found-inf synchronized across ranks.

[Note: a GradScaler that agrees across ranks] torch's ``GradScaler`` decides to skip from the
gradients this rank sees; a non-finite value that exists on one rank only (written after the
all-reduce, or in a shard only that rank holds) makes that rank skip while the others step, and
their weights and scales drift apart silently. It also refuses FP16 gradients, and passes the
scale into fused optimizers so that their in-kernel unscale bypasses any synchronization. This
class keeps the API (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``, ``state_dict``,
``load_state_dict``, ``is_enabled``) and changes the three things: ``unscale_`` unscales every
gradient itself (FP16 ones too) and reduces the found-inf flag with MAX over the process group —
one all-reduce per optimizer per iteration, on every path, fused optimizers included (they then
step on unscaled gradients); and the scale grows through :class:`distamp.LossScaler`, capped at
``max_scale`` and never to inf.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .collectives import all_reduce_
from .config import as_int, as_number, check_positive_finite
from .forensics import (
    EVIDENCE_SLOTS,
    NonFiniteGradientError,
    NonFiniteReport,
    local_evidence,
    read_evidence,
)
from .masters.base import bit_hash, grad_samples
from .masters.nonfinite import check_and_unscale_
from .masters.optimizer import inner_optimizer, refuse_external_scaler
from .scaler import MIN_SCALE, LossScaler

EVIDENCE_COUNT = 1 << 30
"""The parameter count the evidence is coded with: the same on every rank (ranks may hold
different optimizers: a pipeline's stages), far above any optimizer's, exact in float64."""


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class GradScaler:
    """Drop-in for ``torch.amp.GradScaler`` whose skip decision is the same on every rank.

    ``process_group``: the group the found-inf flag is reduced over (default: the world, when
    torch.distributed is initialized; no collective otherwise). ``device`` is accepted for
    torch's signature (``GradScaler("cuda")``); the flag lives wherever the gradients are.
    ``max_consecutive_skips``: raise :class:`distamp.NonFiniteGradientError` (naming the
    parameter, rank and inf or NaN) after this many skipped iterations in a row, or at a skip at
    the scale's floor (2**-100), instead of skipping forever; default: the ``wrap`` setting of
    an optimizer it steps, else 50 (DESIGN, semantics 3).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        max_scale: float = 2.0**24,
        process_group: dist.ProcessGroup | None = None,
        max_consecutive_skips: int | None = None,
    ) -> None:
        if max_consecutive_skips is not None:
            skips = as_int(max_consecutive_skips)
            if skips is None or skips < 1:
                raise ValueError(
                    f"max_consecutive_skips: expected an int >= 1 or None, got "
                    f"{max_consecutive_skips!r}"
                )
            max_consecutive_skips = skips
        # Any real number, as torch takes (numpy's, a one-element tensor: a review), held as a
        # Python float: the scale and these go into state dicts loaded with weights_only=True.
        # (At most FP32's largest: torch holds the scale in FP32, an audit's 1e39 became inf.)
        init_scale = check_positive_finite("init_scale", init_scale)
        checked = {"max_scale": max_scale}
        if enabled:  # torch checks the factors only when enabled
            checked |= {"growth_factor": growth_factor, "backoff_factor": backoff_factor}
        numbers: dict[str, float] = {}
        for name, value in checked.items():  # a bare comparison TypeError named neither (an audit)
            number = as_number(value)
            if number is None:
                raise TypeError(
                    f"GradScaler: {name}: expected a number, got {type(value).__name__} {value!r}"
                )
            numbers[name] = number
        max_scale = numbers["max_scale"]
        growth_factor = numbers.get("growth_factor", growth_factor)
        backoff_factor = numbers.get("backoff_factor", backoff_factor)
        if not max_scale > 0:
            raise ValueError(f"GradScaler: max_scale: expected a positive number, got {max_scale}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"GradScaler: process_group: expected a torch.distributed ProcessGroup or None, "
                f"got {type(process_group).__name__} {process_group!r:.60}"
            )
        if enabled and growth_factor <= 1.0:
            # torch's type and message (scripts written for torch.amp catch AssertionError)
            raise AssertionError(
                f"The growth factor must be > 1.0. (growth_factor={growth_factor})"
            )
        if enabled and backoff_factor >= 1.0:
            raise AssertionError(
                f"The backoff factor must be < 1.0. (backoff_factor={backoff_factor})"
            )
        if not enabled:  # torch checks the factors only when enabled (a disabled one never
            growth, backoff = as_number(growth_factor), as_number(backoff_factor)  # uses them)
            growth_factor = growth if growth is not None and growth > 1.0 else 2.0
            backoff_factor = backoff if backoff is not None and 0.0 < backoff < 1.0 else 0.5
        self._device = device
        self._enabled = bool(enabled)
        self._scaler = _TorchScale(
            "dynamic",
            init_scale=_fp32(init_scale),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            max_loss_scale=max(max_scale, float(init_scale)),
            min_loss_scale=MIN_SCALE,
        )
        self._group = process_group
        self._per_optimizer: dict[int, tuple[_Stage, bool]] = {}
        self._own_parts: set[int] = set()
        """Optimizers whose last decision found the ranks holding other parameters (a
        pipeline's stages): their gradients' norm is each rank's part (see :meth:`decision`)."""
        self._order: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = (
            weakref.WeakKeyDictionary()
        )
        """Each optimizer's place in the order this scaler first stepped them: the same on every
        rank that steps the same optimizers in the same order (see :meth:`unscale_`)."""
        self._stepped = 0
        """How many optimizers this scaler has stepped: the next one's place. Counted, not the
        dictionary's length, which shrinks as optimizers are freed (at other times on other
        ranks: an audit's replaced optimizer took a live one's place)."""
        self._max_consecutive_skips = max_consecutive_skips
        self._limits: list[int] = []  # of the wrapped optimizers stepped this iteration
        self._reports: list[NonFiniteReport] = []  # of this iteration's skips

    # -- the torch.amp.GradScaler API ---------------------------------------------------------------

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scaler.scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._scaler.growth_factor

    def get_backoff_factor(self) -> float:
        return self._scaler.backoff_factor

    def get_growth_interval(self) -> int:
        return self._scaler.growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        self._scaler.growth_factor = _checked("new_factor", new_factor, low=1.0)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._scaler.backoff_factor = _checked("new_factor", new_factor, low=0.0, high=1.0)

    def set_growth_interval(self, new_interval: int) -> None:
        interval = as_int(new_interval)  # (numpy's, a one-element tensor: as torch takes)
        if interval is None or interval < 1:
            raise ValueError(
                f"GradScaler.set_growth_interval: expected an int >= 1, got {new_interval!r}"
            )
        self._scaler.growth_interval = interval

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or lists/tuples/dicts of them) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            # torch multiplies by its 0-dim FP32 scale tensor: a 0-dim half loss is promoted to
            # FP32 (a Python float would keep it half, and an FP16 loss * 2**16 overflows)
            scale = torch.tensor(self._scaler.scale, dtype=torch.float32, device=outputs.device)
            return outputs * scale
        if isinstance(outputs, dict):
            return {k: self.scale(v) for k, v in outputs.items()}
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            return map(self.scale, outputs)  # torch returns a lazy map for other iterables
        raise ValueError(
            f"GradScaler.scale: outputs must be a Tensor or an iterable of Tensors, got "
            f"{type(outputs).__name__}"
        )

    def unscaled(self, optimizers: tuple[object, ...]) -> bool:
        """Whether :meth:`unscale_` (or a step) took one of ``optimizers`` (the one handed to
        this scaler, or the distamp optimizer inside it) since the last :meth:`update`."""
        return any(
            self._per_optimizer.get(id(o), (_Stage.READY, False))[0] is not _Stage.READY
            for o in optimizers
        )

    def decision(self, optimizers: tuple[object, ...]) -> tuple[bool, bool]:
        """(skip, the ranks hold other parameters) of the last :meth:`unscale_` of one of
        ``optimizers`` since :meth:`update`; (False, False) when none."""
        for o in optimizers:
            if id(o) in self._per_optimizer:
                return self._per_optimizer[id(o)][1], id(o) in self._own_parts
        return False, False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale and decide, on every rank alike, whether
        they are finite. Collective over the process group (one MAX all-reduce)."""
        if not self._enabled:
            st = _distamp_state(optimizer)
            if st is not None:  # (distamp.clip_grad_norm_ after it clips: scale 1, an audit)
                st.grad_scaler = weakref.ref(self)
            return
        stage, _ = self._per_optimizer.get(id(optimizer), (_Stage.READY, False))
        if stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Expected one unscale_ per optimizer per iteration (distamp.GradScaler: torch's "
                "message)"
            )
        if stage is _Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). Expected update() in between "
                "(distamp.GradScaler: torch's message)"
            )
        _refuse_master_weights(optimizer)
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        device = grads[0].device if grads else torch.device("cpu")
        flag = check_and_unscale_(grads, 1.0 / self._scaler.scale, device)
        group = self._process_group()
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
        st = _distamp_state(optimizer)

        which = f"{type(optimizer).__name__} #{len(self._per_optimizer)}"  # this iteration's

        def named() -> list[tuple[str, torch.Tensor | None]]:
            return _named_grads(optimizer, st, which)

        # One count on every rank, whatever each rank's optimizer holds (the evidence is coded
        # with it, and MAX-reduced: see forensics.local_evidence).
        count = EVIDENCE_COUNT
        evidence = local_evidence(flag, [], count, named, rank, world)
        # [found inf, this rank has no gradient, which gradient]: one MAX all-reduce decides
        # all three on every rank (see [Note: the evidence rides with the decision]).
        listed = float(sum(len(g["params"]) for g in optimizer.param_groups))
        # [Note: which optimizer each rank decides] Each rank's optimizer in this collective, as
        # +n/-n of the order this scaler first stepped it: rank 0 alone unscaling its second
        # optimizer (to log its norm) paired that decision with the other ranks' first
        # optimizer's, and the ranks skipped different optimizers, their weights parting
        # silently (an audit). The order of the steps, not the parameters, tells them apart:
        # ranks holding different optimizers (a pipeline's stages, FSDP's shards) step theirs in
        # the same order, and an early unscale_ of the optimizer every rank steps next (one not
        # stepped yet takes the next place) pairs with it. The first iteration of a script that
        # unscales another one early is refused at its next collective.
        order = float(self._order.get(optimizer, self._stepped))
        # The shapes too: ranks listing as many parameters (a pipeline's stages of two each) are
        # not listing the same ones (an audit: rank 0 named its own parameter's shape for rank
        # 1's culprit)
        shapes = _shapes_hash(optimizer) if group is not None else 0.0
        sizes = torch.tensor(
            [order, -order, listed, -listed, shapes, -shapes], dtype=torch.float64, device=device
        )
        # [Note: one scale on every rank] The ranks share the skip decision, not the scale:
        # init_scale 2.0 on one rank and 4.0 on another (or growth intervals apart, an update(
        # new_scale) or load_state_dict on some ranks only) unscaled DDP's averaged gradients
        # by different factors and the replicas parted silently (an audit). The scale and a
        # hash of the settings that move it ride in this collective as MAX and -MIN.
        known = self._agreement() if group is not None else (0.0, 0.0)
        agree = torch.tensor(
            [known[0], -known[0], known[1], -known[1]], dtype=torch.float64, device=device
        )
        # And the first values of each gradient, hashed: equal on DDP's replicas (its all-reduce
        # leaves them bit-identical), not on a pipeline's stages of the same shapes, which only
        # this tells from replicas (a review: each such stage clipped to its own norm)
        if group is not None:
            params = [p for group_ in optimizer.param_groups for p in group_["params"]]
            held = bit_hash(grad_samples(params), device).double()
        else:
            held = torch.zeros(2, dtype=torch.float64, device=device)
        flags = torch.cat(
            [
                flag.double(),
                torch.full_like(flag, float(not grads)).double(),
                evidence.to(device),
                agree,
                held,
                sizes,  # MAX and -MIN of the order and the parameter counts: equal everywhere?
            ]
        )
        if group is not None:
            all_reduce_(flags, dist.ReduceOp.MAX, group)
        values = flags.tolist()
        found_inf, none = values[0] > 0, values[1] > 0
        first, last = -values[-5], values[-6]
        if first != last:
            raise RuntimeError(
                "GradScaler.unscale_: expected every rank to decide the same optimizer in this "
                f"collective, found the optimizer this scaler stepped #{int(first) + 1} on some "
                "ranks "
                f"and #{int(last) + 1} on others (this rank: {type(optimizer).__name__} "
                f"#{int(order) + 1}). A rank that calls scaler.unscale_(optimizer) on an "
                "optimizer the others unscale later (at their scaler.step) pairs its skip "
                "decision with another optimizer's, and the ranks would skip different "
                "optimizers. Call unscale_ on every rank, or on none, for each optimizer, in "
                "the same order"
            )
        at = 2 + EVIDENCE_SLOTS
        if values[at] != -values[at + 1] or values[at + 2] != -values[at + 3]:
            assert group is not None  # (zeros without one)
            self._refuse_parted_scales(group)
        if none:
            # torch raises at step() ("No inf checks were recorded for this optimizer"); every
            # rank raises here together instead of one waiting in the next collective.
            where = "this rank" if not grads else "another rank"
            raise AssertionError(
                f"No inf checks were recorded for this optimizer: expected gradients to unscale, "
                f"found none on {where} (run backward on the scaled loss first)"
            )
        self._per_optimizer[id(optimizer)] = (_Stage.UNSCALED, found_inf)
        same_params = values[-4] == -values[-3] and values[-2] == -values[-1]
        if not same_params or values[-8] != -values[-7]:  # (other gradients: see `held`)
            self._own_parts.add(id(optimizer))
        report = read_evidence(
            values[2 : 2 + EVIDENCE_SLOTS],
            [],
            count,
            named,
            world,
            # where the ranks list other parameters (a pipeline's stages), only the culprit
            # names its own; where they list the same (DDP), every rank names it
            own_rank=None if same_params else rank,
        )
        if report is not None:
            if group is not None and world > 1:  # named by the global rank
                report = dataclasses.replace(report, rank=dist.get_global_rank(group, report.rank))
            self._reports.append(report)
        if st is not None:
            self._limits.append(st.group.props.max_consecutive_skips)
            st.last_nonfinite = report if found_inf else None
            # wrap's O0/O1 optimizer: the scale and the skips are ours (an audit: step() warned
            st.grad_scaler = weakref.ref(self)  # "without scale_loss")

    def _settings(self) -> dict[str, float]:
        """The scale and the settings that move it: equal on every rank (see [Note: one scale
        on every rank])."""
        sc = self._scaler
        return {
            "scale": sc.scale,
            "growth_factor": sc.growth_factor,
            "backoff_factor": sc.backoff_factor,
            "growth_interval": sc.growth_interval,
            "max_scale": sc.max_loss_scale,
        }

    def _agreement(self) -> tuple[float, float]:
        """(the scale, a hash of the other settings), exact in float64 (numbers hash alike in
        every process)."""
        settings = self._settings()
        return settings.pop("scale"), float(hash(tuple(settings.values())) % 2**52)

    def _refuse_parted_scales(self, group: dist.ProcessGroup) -> None:
        """Collective (every rank found the same disagreement): name what differs, per rank."""
        mine = self._settings()
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        parted = [
            f"{key}: "
            + ", ".join(
                f"rank {dist.get_global_rank(group, r)} {g[key]:g}" for r, g in enumerate(gathered)
            )
            for key in mine
            if len({g[key] for g in gathered}) > 1
        ]
        raise RuntimeError(
            "GradScaler.unscale_: expected every rank's GradScaler to hold the same scale and "
            "settings (the ranks skip or step together, and one scale keeps their replicas "
            f"equal), found them different: {'; '.join(parted)}. The usual cause: init_scale, "
            "growth_interval or a factor computed per rank, or update(new_scale), "
            "load_state_dict or a set_*() call on some ranks only"
        )

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` unless a gradient was inf/NaN on any rank."""
        if not self._enabled:
            st = _distamp_state(optimizer)
            if st is not None:  # stats reports the scale in use, 1.0 (an audit: wrap's 65536)
                st.grad_scaler = weakref.ref(self)
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "GradScaler.step: Closure use is not currently supported if GradScaler is "
                "enabled (as in torch): expected step(optimizer) after backward, found a closure"
            )
        stage, _ = self._per_optimizer.get(id(optimizer), (_Stage.READY, False))
        if stage is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Expected update() in "
                "between (distamp.GradScaler: torch's message)"
            )
        if optimizer not in self._order:
            self._order[optimizer] = self._stepped
            self._stepped += 1
        if stage is _Stage.READY:
            self.unscale_(optimizer)
        _, found_inf = self._per_optimizer[id(optimizer)]
        result = None if found_inf else optimizer.step(*args, **kwargs)
        st = _distamp_state(optimizer)
        if found_inf and st is not None:  # distamp.stats counts the skip it never saw
            st.steps += 1
            st.skipped_steps += 1
            st.last_step_skipped = True
        self._per_optimizer[id(optimizer)] = (_Stage.STEPPED, found_inf)
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off if any optimizer skipped this iteration, else count towards growth."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor) and (
                new_scale.numel() != 1 or new_scale.requires_grad
            ):
                raise AssertionError(
                    "GradScaler.update: new_scale should be a float or a 1-element tensor with "
                    f"requires_grad=False, got shape {tuple(new_scale.shape)} with "
                    f"requires_grad={new_scale.requires_grad}"
                )
            # numpy's and tensors too, at most FP32's largest (an audit: 1e39 became inf, and
            # every later step was skipped; np.array([8.]) raised numpy's bare TypeError)
            value = check_positive_finite("GradScaler.update: new_scale", new_scale)
            self._scaler.scale = _fp32(_at_least_the_floor(value, "GradScaler.update: new_scale"))
        elif not self._per_optimizer:
            raise AssertionError(
                "No inf checks were recorded prior to update: expected scaler.step(optimizer) "
                "(or unscale_) since the last update(), found none"
            )
        else:
            overflow = any(found for _, found in self._per_optimizer.values())
            self._scaler.update(overflow)
            if overflow:
                self._refuse_skipping_forever()
        self._per_optimizer = {}
        self._own_parts = set()
        self._limits, self._reports = [], []

    def _refuse_skipping_forever(self) -> None:
        """Semantics 3 on this path too: a persistent NaN skipped every iteration, halving the
        scale until ``1 / scale`` left FP32's range and torch's "value cannot be converted to
        type float without overflow" ended the run 144 iterations later, naming nothing (an
        audit). Every rank reads the same decisions, so every rank raises."""
        limit = self._max_consecutive_skips or min(self._limits, default=50)
        scaler = self._scaler
        if scaler.consecutive_skips < limit and not scaler.skipped_at_floor:
            return
        reason = (
            f"{scaler.consecutive_skips} consecutive iterations were skipped"
            if scaler.consecutive_skips >= limit
            else f"an iteration was skipped at the scale's floor {scaler.scale:g}"
        )
        what = str(self._reports[0]) if self._reports else "non-finite gradients"
        self._per_optimizer, self._limits, self._reports = {}, [], []
        raise NonFiniteGradientError(
            f"GradScaler: {reason}: {what}. Lowering the scale does not fix this; look for a "
            "NaN/inf produced by the forward pass or the loss itself "
            "(GradScaler(max_consecutive_skips=...) sets this limit)"
        )

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's keys: plain numbers (``torch.load(weights_only=True)``)."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scaler.scale,
            "growth_factor": self._scaler.growth_factor,
            "backoff_factor": self._scaler.backoff_factor,
            "growth_interval": self._scaler.growth_interval,
            "_growth_tracker": self._scaler.clean_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "GradScaler.load_state_dict: the state dict is empty: it was saved from a "
                "disabled GradScaler"
            )
        missing = {"scale", "_growth_tracker"} - set(state_dict)
        if missing:
            raise ValueError(
                f"GradScaler.load_state_dict: expected torch.amp.GradScaler keys, missing "
                f"{sorted(missing)}"
            )

        # Every entry is read and checked before any is set (an audit: a bad growth_interval
        # raised a bare int() error with the scale already loaded; factors the constructor
        # refuses loaded silently).
        def number(key: str) -> float:
            value = as_number(state_dict[key])  # (numpy's too, as torch loads: an audit)
            if value is None:
                raise ValueError(
                    f"GradScaler.load_state_dict: {key}: expected a number, got "
                    f"{type(state_dict[key]).__name__} {state_dict[key]!r}"
                )
            return value

        scale = check_positive_finite("GradScaler.load_state_dict: scale", state_dict["scale"])
        tracker = number("_growth_tracker")
        if tracker < 0 or tracker != int(tracker):
            raise ValueError(
                f"GradScaler.load_state_dict: _growth_tracker: expected a count >= 0, got {tracker}"
            )
        settings: dict[str, float] = {}
        for key, low, high in (
            ("growth_factor", 1.0, float("inf")),
            ("backoff_factor", 0.0, 1.0),
            ("growth_interval", 0.0, float("inf")),
        ):
            if key in state_dict:
                value = number(key)
                if not low < value < high or (key == "growth_interval" and value != int(value)):
                    raise ValueError(
                        f"GradScaler.load_state_dict: {key}: expected a value in ({low:g}, "
                        f"{high:g}){' (an int)' if key == 'growth_interval' else ''}, got {value:g}"
                    )
                settings[key] = value
        self._scaler.scale = _fp32(_at_least_the_floor(scale, "GradScaler.load_state_dict: scale"))
        self._scaler.clean_steps = int(tracker)
        for key, value in settings.items():
            setattr(self._scaler, key, int(value) if key == "growth_interval" else value)

    def __getstate__(self) -> dict[str, Any]:
        if self._per_optimizer:
            raise AssertionError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, or "
                "at the end after scaler.update(); found optimizers unscaled or stepped since"
            )
        if self._group is not None:
            raise TypeError(
                "GradScaler: a GradScaler holding a process_group cannot be pickled (a process "
                "group belongs to one process); pickle state_dict() instead"
            )
        state = self.__dict__.copy()
        state["_order"] = None  # the optimizers stay here; a copy starts its own order
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._order, self._stepped = weakref.WeakKeyDictionary(), 0

    def __getattr__(self, name: str) -> Any:
        """Only for names not found otherwise: torch's private attributes, which scripts copied
        from torch.amp read (``scaler._scale.item()`` in a log line), say what to use instead
        (an audit: a bare AttributeError)."""
        instead = _TORCH_PRIVATE.get(name)
        if instead is None:
            raise AttributeError(f"'GradScaler' object has no attribute {name!r}")
        raise AttributeError(
            f"GradScaler.{name}: expected one of torch.amp.GradScaler's public methods, found "
            f"its private attribute {name!r}, which distamp.GradScaler does not have (it keeps "
            f"the scale as a Python float, the same on every rank): use {instead}"
        )

    def _process_group(self) -> dist.ProcessGroup | None:
        if self._group is not None:
            return self._group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None


_TORCH_PRIVATE = {
    "_scale": "get_scale() (a float; torch.tensor(scaler.get_scale()) for a tensor)",
    "_get_scale_async": "get_scale()",
    "_growth_tracker": "state_dict()['_growth_tracker']",
    "_init_scale": "get_scale() before the first update, or state_dict()['scale']",
    "_init_growth_tracker": "state_dict()['_growth_tracker']",
    "_growth_factor": "get_growth_factor()",
    "_backoff_factor": "get_backoff_factor()",
    "_growth_interval": "get_growth_interval()",
    "_per_optimizer_states": "nothing: the per-optimizer stage is internal",
    "_lazy_init_scale_growth_tracker": "nothing: distamp's scale needs no lazy initialization",
    "_check_scale_growth_tracker": "get_scale()",
}
"""torch.amp.GradScaler's private attributes scripts read, and what to use instead."""


def _at_least_the_floor(scale: float, what: str) -> float:
    """A scale set from outside, raised to :data:`MIN_SCALE` with a warning: below it ``1 /
    scale`` is no FP32 number, and the next step crashed inside torch (an audit: a state dict
    of torch's scaler saved at 2**-130)."""
    if scale >= MIN_SCALE:
        return scale
    warnings.warn(
        f"{what} {scale:g} is below the scale's floor 2**-100 (1 / scale must stay a finite "
        f"FP32 number): using {MIN_SCALE:g}",
        stacklevel=3,
    )
    return MIN_SCALE


def _shapes_hash(optimizer: torch.optim.Optimizer) -> float:
    """A hash of the shapes ``optimizer`` lists, in order, the same on every rank listing the
    same (tuples of ints hash alike in every process; exact in float64 below 2**52). A CRC of
    their repr cost ~5 ms a call at 5000 parameters, half of unscale_ (an audit)."""
    shapes = tuple(p.shape for g in optimizer.param_groups for p in g["params"])
    return float(hash(shapes) % 2**52)


def _fp32(value: float) -> float:
    """``value`` rounded to FP32, as torch's scaler stores it (a 0-dim FP32 tensor)."""
    return torch.tensor(float(value), dtype=torch.float32).item()


class _TorchScale(LossScaler):
    """[Note: torch's FP32 scale] torch.amp.GradScaler keeps its scale in an FP32 tensor: every
    value set (``init_scale``, ``update(new_scale)``, ``load_state_dict``) and every growth or
    backoff is rounded to FP32 (its kernel multiplies in double, then stores FP32). Kept as a
    Python float, a growth factor of 1.1 gave 3.630000000000001 where torch has 3.6299999 and
    the weights parted from torch's in the 8th digit (an audit); with powers of two (the
    defaults) both are exact."""

    def rounded(self, scale: float) -> float:
        return _fp32(scale)


def _checked(name: str, value: float, *, low: float, high: float = float("inf")) -> float:
    number = as_number(value)  # (numpy's, a one-element tensor: as torch takes, an audit)
    if number is None or not low < number < high:
        raise ValueError(
            f"GradScaler: {name} expected a number in ({low:g}, {high:g}), got {value!r}"
        )
    return number


def _named_grads(
    optimizer: torch.optim.Optimizer, st: Any, which: str
) -> list[tuple[str, torch.Tensor | None]]:
    """(name, grad) of the optimizer's parameters in order: the model's names for an optimizer
    ``wrap`` returned, else their place in ``param_groups`` of the ``which``-th optimizer
    unscaled this iteration."""
    names = st.group.param_names if st is not None else {}
    return [
        (
            names.get(id(p))
            or f"{which} param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})",
            p.grad,
        )
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    ]


def _distamp_state(optimizer: torch.optim.Optimizer) -> Any:
    """The distamp state of an optimizer ``wrap`` returned (None for a plain one)."""
    inner = inner_optimizer(optimizer)
    return getattr(inner, "_distamp", None)


def _refuse_master_weights(optimizer: torch.optim.Optimizer) -> None:
    """A half-migrated script: ``distamp.wrap(..., opt_level="O2")`` added, GradScaler kept. The
    optimizer's param_groups then hold FP32 masters, which get gradients only inside distamp's
    own step, so the scaler found none and said "run backward first" after a backward. Raised on
    every rank alike (wrap made every rank's optimizer the same), before any collective."""
    st = _distamp_state(optimizer)
    if st is not None:
        refuse_external_scaler(st, "GradScaler")
