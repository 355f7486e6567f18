"""The master-weight optimizer: any ``torch.optim.Optimizer`` stepping FP32 masters, with the skip.

[Note: the optimizer keeps its identity] ``wrap`` gives the user's optimizer a generated subclass
of its own class (as it does for the model, see [Note: class-level forward]); ``param_groups`` then
hold the FP32 masters. The object the user holds, its ``param_groups`` dicts and any LR scheduler
built on it keep working, ``isinstance(opt, torch.optim.AdamW)`` stays true, and ``step`` is a
class-level method, never an attribute patched onto the instance.

[Note: why grads stay scaled until step()] Gradients are left scaled in the model's ``.grad``
between ``scale_loss`` blocks and unscaled once, at ``step()`` (or ``unscale_``). Unscaling at the
end of every backward (apex) needs the grads stashed and zeroed, which breaks DDP's ``no_sync``
accumulation (the stash never takes part in the all-reduce) and counts backward passes instead of
optimizer steps. Keeping them scaled makes k micro-batches equal one k-times-larger batch.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import required

from ..collectives import all_reduce_, check_same_on_all_ranks, short_order
from ..config import HALF_DTYPES, warn_from_caller
from ..forensics import NonFiniteGradientError, NonFiniteReport
from ..optstate import HELD, OptState
from .base import grad_versions, local_tensor
from .nonfinite import nonfinite_flag
from .rounds import PER_PARAMETER, round_step, step_in_rounds, unhooked_step, with_step_hooks
from .sharded import ShardedMasterParams

if TYPE_CHECKING:
    from ..scaler import Backward, ScalerGroup
    from .base import MasterWeights


class AmpOptimizerState:
    """What distamp keeps for one wrapped optimizer (``optimizer._distamp``)."""

    def __init__(self, group: ScalerGroup, index: int, masters: MasterWeights) -> None:
        self.group = group
        self.index = index
        self.masters = masters
        self.state = OptState.READY
        self.grad_scale: float | None = None
        """The loss scale the model's ``.grad`` currently carry; None when none are pending."""
        self.backwards: list[Backward] = []
        """The ``scale_loss`` blocks that produced gradients for this optimizer since its step."""
        self.seen_nonfinite: torch.Tensor | None = None
        """With per-block attribution: the grads were non-finite already at the last block's end."""
        self.seen_each: torch.Tensor | None = None
        """The same per parameter (see [Note: which block made a gradient non-finite])."""
        self.overflow: bool | None = None
        """The global decision, once made for the pending step."""
        self.decided_here = False
        """This optimizer's step made the decision (others sharing its losses reuse it)."""
        self.early_anywhere = False
        """The pending decision was taken by ``distamp.unscale_``/``clip_grad_norm_`` on some
        rank (see [Note: what the ranks' blocks are, and who decided early] in scaler.py)."""
        self.last_nonfinite: NonFiniteReport | None = None
        self.decision_report: NonFiniteReport | None = None
        """What the decision's all-reduce named for the pending step (see [Note: the evidence
        rides with the decision] in forensics.py)."""
        self.steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.warned_unscaled_step = False
        self.warned_lightning_clip = False
        self.inner_stepped = False
        self.grad_scaler: weakref.ref[Any] | None = None
        """The ``distamp.GradScaler`` that unscales and decides for this optimizer (O0/O1 without
        scale_loss): its scale is the one in use, and its skips are this optimizer's."""
        self.scaled_grads: list[tuple[Any, tuple[int, int] | None]] = []
        """(parameter, grad_version) of every model gradient at the end of the last scale_loss
        block: see [Note: scaled gradients touched before step()]."""
        self.scaled_sample: torch.Tensor | None = None
        """Under FSDP, ``scaled_grad_sample()`` at the end of that block (the same Note)."""
        self.outside_between_blocks = False
        """A backward outside every ``scale_loss`` block reached these gradients while a block's
        were pending (SCALED): scale 1.0 added to scaled ones, refused (see
        :func:`refuse_outside_backward`)."""
        self.outside_before_block = False
        """A block began on gradients a backward outside ``scale_loss`` left, with several
        ranks: refused at the step, by every rank together (see [Note: a backward outside
        scale_loss, then a block] in wrap.py)."""
        self.added_after_reduce: list[str] = []
        """Names of parameters whose ``.grad`` a backward added to after the reduce-scatter
        hook reduced them, since the last step: see [Note: a backward DDP does not reduce]."""
        self.warned_touched_scaled = False
        self.clipped_grads: list[tuple[nn.Parameter, tuple[int, int] | None]] | None = None
        """After ``distamp.clip_grad_norm_`` unscaled and clipped the masters' gradients alone
        (no ``unscale_`` before it): the model's gradients and their versions then, which an
        edit before ``step()`` moves (see :func:`_warn_if_edited_after_clip`)."""
        self.warned_edited_after_clip = False
        self.warned_shard_state_dict = False
        self.unscaled_shards: list[tuple[int, int] | None] | None = None
        """With sharded masters, grad_version of the shard slices right after a public unscale_
        (see [Note: clipping what param_groups hold] in sharded.py)."""
        self.warned_shards_touched = False
        self.unscaled_sample: torch.Tensor | None = None
        """A few shard gradient values right after that unscale_ (see ``shard_grad_sample``)."""
        self.stepped_grads: list[tuple[int, int] | None] | None = None
        """grad_version of every model gradient right after the last step(): see [Note: a second
        step() on the same gradients]."""
        self.backward_since_step = False
        """A backward accumulated into a model gradient since the last step() (set by
        :class:`BackwardSeen`; FSDP's sharded gradients are written by FSDP, not seen)."""
        self.outside_seen = False
        """Such a backward ran with no ``scale_loss`` block of the group open, since the last
        step or zero_grad: named when the ranks' block counts differ (a rank that discarded its
        batch must not be told it ran one outside, a review)."""
        self.delayed_unscale = False
        """The last ``scale_loss`` block listing this optimizer had ``delay_unscale=True``: apex's
        accumulation micro-batch, after which ``amp.master_params`` does not unscale."""
        self.watches_backward = False
        self.watched: set[int] = set()
        """ids of the parameters :func:`watch_backward` hooked."""
        self.param_dtypes: dict[int, torch.dtype] = {id(p): p.dtype for p in masters.model_params}
        """Each parameter's dtype as wrap left it (see :func:`_refuse_converted_params`)."""
        self.had_grads = False
        """Some model gradient existed when the last scale_loss block ended (see
        :func:`drop_cleared_gradients`)."""
        self.unlisted_loss: int | None = None
        """The pending gradients were written by a block of this loss that did not list this
        optimizer, and adopted at its scale (see [Note: a block that does not list an optimizer
        it reaches] in scaler.py)."""
        self.mixed_scales: tuple[int, float] | None = None
        """(loss_id, scale) of such a block that wrote into gradients pending at another scale."""
        self.adopted_grads: list[tuple[int, int] | None] | None = None
        """Each model gradient's identity and version when a block that did not list this
        optimizer left it (see :func:`drop_cleared_gradients`)."""
        self.warned_unlisted = False
        self.optimizer: Callable[[], torch.optim.Optimizer | None] = lambda: None
        """The wrapped optimizer (a weak reference, set by wrap)."""
        self.in_step = False
        """Inside ``step()``: an optimizer nested in the wrapped one may step (see
        :class:`NestedStepGuard`)."""
        self._held_cache: dict[tuple[int, int], list[float]] = {}
        self.inner_started = False
        """The step's pre-hooks passed and the inner optimizer's step began (see
        ``_step_and_copy``)."""
        self.interrupted_grads: list[tuple[int, int] | None] | None = None
        """The gradients' identities and versions when the step was interrupted."""
        self.interrupted = False
        """The last ``step()`` raised before the inner optimizer stepped (a step pre-hook: a
        KeyboardInterrupt, a user's check): see [Note: an interrupted step keeps its decision]."""
        self.refusing = False
        """This rank takes part in the skip decision only to raise with its peers (see
        ``_decide_with_no_blocks``): its gradients are not compared between ranks."""

    def settings(self) -> list[dict[str, list[float]]]:
        """Every param group's numeric settings (lr, betas, weight_decay, momentum, ...) by key,
        NaNs left out (one would never compare equal): what ranks must agree on. With replicated
        masters also what each group holds (count, elements, a hash of the shapes): ranks that
        added different parameters with ``add_param_group`` trained apart at O0/O1, silently
        (an audit; sharded masters compare the added parameters at the add, and hold shards of
        their own sizes per rank)."""
        opt = self.optimizer()
        out = []
        for group in opt.param_groups if opt is not None else []:
            numbers: dict[str, list[float]] = {}
            for key in sorted(k for k in group if k not in ("params", "param_names")):
                value = group[key]
                items = value if isinstance(value, (tuple, list)) else (value,)
                floats = [float(v) for v in items if isinstance(v, (bool, int, float))]
                numbers[key] = [v for v in floats if math.isfinite(v)]
            if not self.masters.sharded:
                numbers[HELD] = self._held(group["params"])
            out.append(numbers)
        return out

    def _held(self, params: list[torch.Tensor]) -> list[float]:
        """``[count, elements, shapes hash]`` of a param group's tensors (the last two modulo a
        prime: small next to the settings, so that the fingerprint's sum keeps their
        resolution), cached per list."""
        key = (id(params), len(params))
        cached = self._held_cache.get(key)
        if cached is None:
            shapes = zlib.crc32(repr([tuple(p.shape) for p in params]).encode())
            elements = sum(p.numel() for p in params)
            cached = [float(len(params)), float(elements % 65521), float(shapes % 65521)]
            if len(self._held_cache) > 64:  # lists replaced over and over: keep it small
                self._held_cache.clear()
            self._held_cache[key] = cached
        return cached

    def hyperparameter_fingerprint(self) -> torch.Tensor:
        """``[h, -h]``: a hash of :meth:`settings`, for the skip decision's MAX all-reduce to
        compare across ranks (see [Note: settings that part between ranks] in scaler.py)."""
        h = 0.0
        for g, numbers in enumerate(self.settings()):
            values = [v for key in numbers for v in numbers[key]]
            for i, v in enumerate(values):  # weights from the golden ratio: no two alike
                h += v * (1.0 + ((g * 97 + i + 1) * 0.6180339887498949) % 1.0)
        return torch.tensor([h, -h], dtype=torch.float64)

    def record_shard_grads(self) -> None:
        """What the shard gradients are right after unscale_ (or distamp's own clipping, which
        is the global one): see [Note: clipping what param_groups hold] in sharded.py."""
        self.unscaled_shards = self.masters.shard_grad_versions() or None
        if self.unscaled_shards is not None:
            self.unscaled_sample = self.masters.shard_grad_sample()

    def reset(self) -> None:
        """Back to READY: after a step, or when the gradients are zeroed."""
        self.state = OptState.READY
        self.interrupted = False
        self.interrupted_grads = None
        self.unlisted_loss = None
        self.mixed_scales = None
        self.adopted_grads = None
        self.grad_scale = None
        self.backwards = []
        self.seen_nonfinite = None
        self.seen_each = None
        self.overflow = None
        self.early_anywhere = False
        self.decision_report = None
        self.unscaled_shards = None
        self.had_grads = False
        self.clipped_grads = None
        self.added_after_reduce = []
        self.outside_between_blocks = False
        self.outside_before_block = False
        self.outside_seen = False
        self.masters.release_master_grads()


class _MasterKeyedState(defaultdict):
    """``optimizer.state`` of a wrapped optimizer: torch's ``defaultdict(dict)`` keyed by what
    ``param_groups`` hold, read by a model parameter too.

    [Note: optimizer.state read by a model parameter] With FP32 masters the state is keyed by
    the masters, and a script logging ``optimizer.state[p]["exp_avg"]`` for ``p`` in
    ``model.parameters()`` (as it does under torch) got an empty dict that the defaultdict
    kept under the model's half parameter: the next ``optimizer.state_dict()`` failed with a bare
    ``KeyError: <an id>`` far from the lookup (an audit). Replicated masters answer for their
    model parameter (``[]``, ``in``, ``get``); sharded ones hold a flat shard per group, so a
    model parameter's lookup raises, naming it and where its state is.
    """

    def __init__(self, held: dict[Any, Any], optimizer: AmpOptimizer) -> None:
        super().__init__(dict, held)
        self.optimizer = weakref.ref(optimizer)

    def __reduce__(self) -> Any:  # a copy is torch's plain defaultdict
        return (defaultdict, (dict,), None, None, iter(self.items()))

    def _key(self, key: Any) -> Any:
        """The key ``key`` stands for: its FP32 master, itself, or a KeyError (sharded)."""
        opt = self.optimizer()
        if opt is None or not isinstance(key, torch.Tensor):
            return key
        return opt._distamp.masters.state_key(key, opt._distamp.group.param_names)

    def __missing__(self, key: Any) -> Any:
        master = self._key(key)
        if master is key:
            return super().__missing__(key)
        return self[master]

    def __contains__(self, key: Any) -> bool:
        try:
            return super().__contains__(self._key(key))
        except KeyError:
            return False

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return super().get(self._key(key), default)
        except KeyError:
            return default


class AmpOptimizer(torch.optim.Optimizer):
    """Mixin placed in front of the user's optimizer class; see [Note: the optimizer keeps its identity]."""

    _distamp: AmpOptimizerState

    @property
    def state(self) -> Any:
        """See [Note: optimizer.state read by a model parameter]; torch's ``load_state_dict``
        puts a plain defaultdict back, taken over at the next read."""
        held = self.__dict__.get("state")
        if held is None:
            # A framework's wrapper that subclasses the optimizer's class and forwards what it
            # lacks (Lightning Fabric's _FabricOptimizer): .state, distamp.stats and
            # save_checkpoint raised KeyError 'state' on it (an audit).
            inner = inner_optimizer(self)
            if inner is None or inner is self:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute 'state'")
            return inner.state
        if type(held) is not _MasterKeyedState:
            held = self.__dict__["state"] = _MasterKeyedState(held, self)
        return held

    @state.setter
    def state(self, value: Any) -> None:
        self.__dict__["state"] = value

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """[Note: torch's GradScaler on masters] Where the optimizer steps FP32 masters (O2,
        sharded, distamp.fsdp) and the reader is torch's ``GradScaler.step`` (the one place it
        reads this, before it unscales or steps), distamp's refusal is raised: torch's scaler
        unscaled what param_groups hold — masters with no gradient yet — and distamp's step took
        the model's gradients, still scaled, as unscaled (an audit's O2 update was 1024x too
        large, after one warning). Any other read answers: Lightning reads it before clipping
        in bf16-mixed too, where no scaler exists (raising there refused a working script, an
        audit; a True sends its clipping to "not implemented for optimizers handling the
        unscaling"). The answer is the inner class's own value (a fused Adam's True)."""
        st = self.__dict__.get("_distamp")
        if st is not None and holds_masters(st) and _read_by_torch_scaler_step(sys._getframe(1)):
            refuse_external_scaler(st, "torch.amp.GradScaler")
        if "_step_supports_amp_scaling" in self.__dict__:
            return bool(self.__dict__["_step_supports_amp_scaling"])
        for klass in type(self).__mro__:
            if klass is not AmpOptimizer and "_step_supports_amp_scaling" in vars(klass):
                return bool(vars(klass)["_step_supports_amp_scaling"])
        return False

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        self.__dict__["_step_supports_amp_scaling"] = value

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Unscale, take the global skip decision, step the FP32 masters, refresh the model weights.

        A collective over the wrapped process group when distributed (one MAX all-reduce of the
        found-inf flags, none when another optimizer of the same losses already decided).
        """
        if not self.state:  # DCP's placeholder step runs only on an optimizer without state
            _refuse_dcp_state_dict(self._distamp, sys._getframe(1))
        loss = None
        if holds_masters(self._distamp) and _read_by_torch_scaler_step(sys._getframe(1), 6):
            # An optimizer wrapper that does not forward _step_supports_amp_scaling (apex's
            # LARC) hid the read: torch's scaler then unscaled the masters and this step took
            # the model's scaled gradients, a 1024x update (an audit). See [Note: torch's
            # GradScaler on masters].
            refuse_external_scaler(self._distamp, "torch.amp.GradScaler")
        if closure is not None:
            # torch.optim's contract: call it once with grad enabled, step, return its loss.
            # Lightning steps every optimizer this way (a no-op closure under manual
            # optimization; training_step + backward under automatic); refusing it locked
            # Lightning out (an audit). LBFGS, which calls it again, is refused at wrap.
            st = self._distamp
            if not st.warned_lightning_clip and not _steps_the_models_own_params(st):
                _warn_lightning_clip_over_masters(closure, st)
            with torch.enable_grad():
                loss = closure()
        st = self._distamp
        _refuse_converted_params(st)
        drop_cleared_gradients(st)
        # Stops at the first gradient: O(1) on a normal step.
        no_grads = all(p.grad is None for p in st.masters.model_params)
        if no_grads:
            _refuse_gradients_fsdp_still_holds(st)
            _refuse_fsdp_after_wrap(st)
        placeholder = False  # see _torch_state_init_step
        if st.state is OptState.READY:
            if no_grads:
                _decide_with_no_blocks(st)
                raise RuntimeError(
                    "optimizer.step() was called but no gradients were produced since the last "
                    "step: run backward on the loss inside `with distamp.scale_loss(loss, "
                    "optimizer) as scaled_loss:` first"
                )
            _refuse_a_second_step_on_the_same_gradients(st)
            placeholder = _torch_state_init_step(self)
            driver = st.grad_scaler() if st.grad_scaler is not None else None
            driven = driver is not None and driver.is_enabled()  # a disabled one scales nothing
            props = st.group.props
            # Scale 1.0 is right for bf16 (FP32's range) and O0: the warning fired on every
            # correct bf16 recipe of the Trainer, accelerate and Lightning (an audit).
            fp16 = props.half_dtype == torch.float16 and props.opt_level != "O0"
            if not st.warned_unscaled_step and not placeholder and not driven and fp16:
                _warn(
                    "optimizer.step() without distamp.scale_loss(): the gradients are taken as "
                    "unscaled (scale 1.0); use scale_loss so the dynamic loss scale applies. "
                    "If torch.amp.GradScaler drives this optimizer (scaler.step(optimizer)), "
                    "use distamp.GradScaler (the same API) instead: torch's decides each rank's "
                    "skip alone, and a rank that skips while the others step leaves their skip "
                    "decision's all-reduce unmatched (a hang, or gloo's 'collective mismatch')"
                )
                st.warned_unscaled_step = True
            st.grad_scale = 1.0
        _refuse_or_warn_unlisted(st)
        # see [Note: weights written after wrap]
        st.masters.take_written_weights(st.group.param_names)
        touched, scale = _scaled_grads_touched(st), st.grad_scale
        decided_early = st.state is OptState.UNSCALED
        if not decided_early:
            st.group.unscale_and_decide(st)
        _warn_if_scaled_grads_touched(st, touched, scale)
        _warn_if_edited_after_clip(st)
        st.group.update_finished_losses()  # see [Note: the scale moves at step()]
        _warn_if_shards_touched(st)
        modified = st.masters.take_modified_model_grads()
        assert st.overflow is not None
        # every rank alike: see [Note: what the ranks' blocks are, and who decided early]
        early = st.early_anywhere or (decided_early and st.group.process_group is None)
        edited = _edited_nonfinite(st, modified) if early and not st.overflow else None
        st.steps += not placeholder
        st.last_step_skipped = st.overflow or edited is not None
        st.in_step = True
        interrupted = False
        try:
            if edited is not None:
                st.skipped_steps += 1
                _after_edited_skip(st, edited)
            elif st.overflow:
                st.skipped_steps += 1
                st.group.after_skip(st)
            else:
                st.group.unscaled_skips = 0  # see ScalerGroup.after_skip
                try:
                    _step_and_copy(self, st)
                except BaseException:
                    if not st.inner_stepped:  # (no step was taken, or not all of it)
                        st.steps -= not placeholder
                        # a step pre-hook raised: nothing stepped (the inner step raising
                        # midway may have moved some weights: reset, as before)
                        interrupted = not st.inner_started
                    raise
        finally:
            st.in_step = False
            if interrupted:
                # [Note: an interrupted step keeps its decision] The gradients were unscaled
                # (FP32 ones in place) and decided; reset to READY, the next block added its
                # scaled gradients to those unscaled ones and the step divided the sum by the
                # scale again: the batch was lost, silently (an audit, 0.186 -> 2.8e-6). Left as
                # after unscale_: step() again steps them, zero_grad() drops them, and a
                # backward before either is refused, saying so.
                st.interrupted = True
                st.interrupted_grads = grad_versions(st.masters.model_params)
                st.last_step_skipped = False
            else:
                st.reset()
                st.masters.restored = False
                st.stepped_grads = grad_versions(st.masters.model_params)
                st.backward_since_step = False
                if st.watches_backward:  # parameters unfrozen since wrap (or the last step)
                    watch_backward(st, st.masters.model_params)
        return loss

    def __getattr__(self, name: str) -> Any:
        """Only reached for attributes the optimizer lacks: apex's internals that NVIDIA's
        scripts read are named with their replacement (an audit: a bare AttributeError naming
        the user's own optimizer class read like a bug in it)."""
        if name in ("_amp_stash", "_lazy_init_maybe_master_weights"):
            raise AttributeError(
                f"optimizer.{name} is apex's internal state, which distamp does not keep: the "
                "FP32 masters exist from wrap/amp.initialize, are read with "
                "amp.master_params(optimizer) and saved and restored by optimizer.state_dict() / "
                "load_state_dict (drop the script's own 'master params' save and restore)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Optimizer.profile_hook_step would wrap this method and fire step hooks twice (ours, then the
    # inner class's step, which is hooked already). Mark it as hooked so torch leaves it alone.
    step.hooked = True  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: torch pickles an optimizer as its defaults, state and param_groups only, so a
        copy lost the FP32 masters, the loss scalers and the process group (``copy.deepcopy``
        made an optimizer whose step raised AttributeError; ``pickle``/``torch.save`` of it failed
        with "not the same object as torch.optim.adamw.AdamW"; an audit)."""
        raise TypeError(
            f"pickling or copying the {type(self).__name__} that distamp.wrap returned: expected "
            "its optimizer.state_dict() (plain tensors with the FP32 masters and loss scales; "
            "restore with optimizer.load_state_dict) or distamp.save_checkpoint(path, model, "
            "optimizer), found the optimizer object itself, whose FP32 masters, loss scalers "
            "and process group a pickle or copy does not carry. A deepcopy of a module that "
            "holds the optimizer as an attribute (Lightning's EMA/WeightAveraging and "
            "StochasticWeightAveraging callbacks, copy.deepcopy(lightning_module)) lands here "
            "too: keep the optimizer off the module (return it from configure_optimizers, or "
            "hold it where the copy does not reach)"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add model parameters after wrap (apex supported it): they get FP32 masters, are unscaled
        and checked for inf/NaN like the others. Call it on every rank (with sharded masters the new
        group is laid out and sharded like the first ones)."""
        st: AmpOptimizerState | None = self.__dict__.get("_distamp")
        if st is None:  # torch's own constructor, before wrap
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set) or params is None:
            raise TypeError(
                "optimizer.add_param_group: expected param_group['params'] to be a tensor or a "
                f"list of tensors (ordered, the same on every rank), got {type(params).__name__}"
            )
        params = list(params)
        names = param_group.get("param_names")
        if params and all(isinstance(p, tuple) and len(p) == 2 for p in params):
            names = [name for name, _ in params]  # torch's named form: named_parameters()
            params = [param for _, param in params]
        if st.state is not OptState.READY:
            raise RuntimeError(
                "optimizer.add_param_group: gradients are pending from scale_loss (state "
                f"{st.state.value}); expected it between optimizer.step() and the next backward"
            )
        st.group.check_new_params(params, st)
        self._refuse_what_torch_refuses(param_group, named=names is not None)
        if names is not None and len(names) != len(params):  # before the masters take them
            raise ValueError(
                f"optimizer.add_param_group: expected one name per parameter in param_names, "
                f"found {len(names)} names for {len(params)} parameters"
            )
        if st.masters.sharded:
            # The new group is laid out flat in this order: ranks listing the same parameters in
            # another order (a list(set(...)) while unfreezing) would own other elements and
            # step apart silently (an audit), as wrap's own order check says.
            order = [st.group.param_names.get(id(p), "?") for p in params]
            check_same_on_all_ranks(
                "optimizer.add_param_group",
                [("new param group's parameter order", short_order(order))],
                st.group.process_group,
            )
        with_masters = st.group.props.master_weights
        rounded = [st.group.param_names[id(p)] for p in params if p.dtype in HALF_DTYPES]
        if rounded and with_masters:
            _warn(
                f"optimizer.add_param_group: the FP32 masters of {rounded[:3]}"
                f"{' and more' if len(rounded) > 3 else ''} start from their half weights: wrap "
                "cast them before they were in an optimizer. To keep them exact, hand them to the "
                "optimizer before wrap (frozen parameters are fine: they get masters and are "
                "stepped once they have gradients)"
            )
        # Without master weights (O3) the half parameters are stepped in half, like wrap's own.
        stepped = st.masters.add_group(params, fp32_masters=with_masters)
        if st.watches_backward:
            watch_backward(st, params)
        group = {**param_group, "params": stepped}
        if names is not None:  # one name per tensor stepped (a slice's says which elements)
            slice_names = getattr(st.masters, "slice_names", None)
            named = dict(zip(map(id, params), names, strict=True))
            group["param_names"] = slice_names(named) if slice_names else list(names)
        super().add_param_group(group)

    def _refuse_what_torch_refuses(self, param_group: dict[str, Any], *, named: bool) -> None:
        """torch's ``add_param_group`` runs last, after the masters took the parameters: what it
        would refuse is refused here first, or a corrected retry found them "already held by
        this optimizer" (an audit: (name, tensor) pairs into an optimizer built without names)."""
        named_before = any("param_names" in g for g in self.param_groups)
        if self.param_groups and named_before != named:
            have, got = ("with" if named_before else "without"), ("with" if named else "without")
            raise ValueError(
                f"optimizer.add_param_group: expected a param group {have} parameter names, as "
                f"the existing ones are (torch's rule), found one {got}: pass "
                + (
                    "named_parameters() pairs"
                    if named_before
                    else "the tensors, not (name, tensor) pairs"
                )
            )
        missing = [
            name
            for name, value in self.defaults.items()
            if value is required and name not in param_group
        ]
        if missing:
            raise ValueError(
                f"optimizer.add_param_group: expected a value of {missing} in the new param group "
                f"({type(self).__name__} has no default for them), found none"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the *model's* gradients (the param_groups hold the masters) and master grads."""
        st = self._distamp
        st.masters.zero_model_grads(set_to_none)
        super().zero_grad(set_to_none=set_to_none)
        if st.state is not OptState.READY:
            st.group.forget(st)
        st.reset()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"distamp"``: masters, scalers, step counters.

        Plain tensors and numbers only; loads with ``torch.load(weights_only=True)``. With sharded
        masters it holds this rank's shard (and says which): each rank saves and loads its own,
        at the same world size; :func:`distamp.save_checkpoint` writes one checkpoint for all.
        """
        st = self._distamp
        _refuse_dcp_state_dict(st, sys._getframe(1))
        # see [Note: weights written after wrap]
        st.masters.take_written_weights(st.group.param_names)
        shard = _shard_of(st)
        by_wrap = isinstance(st.masters, ShardedMasterParams)  # (FSDP's are FSDP's own habit)
        # Not before the first step: accelerate's prepare() round-trips the state dict then, and
        # used up the one-shot warning the real save (rank 0's, later) should give (an audit).
        trained = st.steps > 0 or st.skipped_steps > 0
        if (
            by_wrap
            and trained
            and shard is not None
            and shard["world_size"] > 1
            and not _read_by_accelerate_prepare(sys._getframe(1))
        ):
            _warn_state_dict_is_a_shard(st, shard)
        out = super().state_dict()
        out["distamp"] = {
            "masters": [m.detach().clone() for m in st.masters.master_tensors()],
            "steps": st.steps,
            "skipped_steps": st.skipped_steps,
            "scalers": [s.state_dict() for s in st.group.scalers],
            "properties": st.group.props.as_plain_dict(),
            "shard": shard,
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: inner state, FP32 masters, scalers, counters.

        With sharded masters a collective over the wrapped process group: every rank checks its
        state dict first and all of them raise, naming the rank, if one does not fit (nothing is
        changed then); the updated weights are gathered after.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("distamp", None)
        st = self._distamp
        if isinstance(st.masters, ShardedMasterParams):
            # The last step's gather still in flight (overlap_gather) applies its 16-bit update
            # to the shard when it lands: after the load, on top of the loaded masters (an
            # audit: a rollback kept the newer weights with the older moments, silently).
            st.masters.finish_gather()
        if extra is None and _steps_the_models_own_params(st):
            _check_inner_state(self, state_dict)
            super().load_state_dict(state_dict)
            _steps_from_torch_state(st, state_dict)
            _warn_scale_starts_afresh(st)
            return
        error = None
        try:
            if extra is not None and "shard" in extra and extra["shard"] is None:
                state_dict, extra = _whole_into_shards(self, state_dict, extra)
            _check_loadable(extra, st)
            _check_inner_state(self, state_dict)
        except ValueError as exc:
            error = str(exc)
        group = st.group.process_group
        if st.masters.sharded and group is not None and dist.get_world_size(group) > 1:
            errors: list[str | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(errors, error, group=group)
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed:
                raise ValueError("; ".join(f"rank {r}: {e}" for r, e in failed))
        elif error is not None:
            raise ValueError(error)
        assert extra is not None
        masters = st.masters.master_tensors()
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for mine, theirs in zip(masters, extra["masters"], strict=True):
                mine.copy_(theirs)
        for scaler, saved_scaler in zip(st.group.scalers, extra["scalers"], strict=True):
            scaler.load_state_dict(saved_scaler)
        st.steps = int(extra["steps"])
        st.skipped_steps = int(extra["skipped_steps"])
        st.masters.copy_to_model()
        st.masters.restored = True  # see [Note: loading weights into the masters]


def _warn_lightning_clip_over_masters(closure: Any, st: AmpOptimizerState) -> None:
    """Lightning's ``gradient_clip_val`` clips ``optimizer.param_groups`` inside the step's
    closure, before ``step()`` gives the masters their gradients: under O2 it clipped the FP32
    norm layers only, with sharded FP32 weights nothing — silently, the final weights 0.31 off
    FP32's with the same clip (an audit). Its closure (``partial(Precision._wrap_closure,
    module, ...)``) is read duck-typed, nothing of Lightning imported; warned once, unless the
    module overrides ``configure_gradient_clipping`` (the README's recipe)."""
    args = getattr(closure, "args", None)
    module = args[0] if isinstance(args, tuple) and args else None
    clip = getattr(getattr(module, "_trainer", None), "gradient_clip_val", None)
    if not clip or module is None:
        return
    owner = next(
        (c for c in type(module).__mro__ if "configure_gradient_clipping" in vars(c)), None
    )
    if owner is None or owner.__name__ != "LightningModule":
        return  # overridden: the user clips
    st.warned_lightning_clip = True
    # O2's FP32 norm layers are stepped as they are, sharded or not (an audit: "nothing" at O2).
    fp32_sharded = st.masters.sharded and not st.group.props.master_weights
    _warn(
        f"Lightning's gradient_clip_val={clip} clips optimizer.param_groups inside the step's "
        "closure, before step() gives the FP32 masters their gradients: it would clip "
        f"{'nothing (sharded FP32 weights)' if fp32_sharded else 'the FP32 norm layers only'}"
        ". Expected configure_gradient_clipping overridden in the LightningModule with "
        "torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val) (README, 'Inside "
        "Lightning'), and gradient_clip_val kept for it"
    )


def holds_masters(st: AmpOptimizerState) -> bool:
    """The optimizer's param_groups hold FP32 masters or shards that get their gradients only
    inside ``step()`` (O2, sharded masters, distamp.fsdp): a GradScaler's ``unscale_`` cannot
    reach the gradients it steps."""
    return st.masters.fsdp or st.group.props.master_weights or st.masters.sharded


def _read_by_torch_scaler_step(frame: Any, depth: int = 4) -> bool:
    """Whether ``frame``, or one of the few above it (an optimizer wrapper forwarding the read or
    the step), is an enabled torch ``GradScaler``'s ``step`` (a subclass's too: FSDP's
    ShardedGradScaler) about to drive an optimizer."""
    for _ in range(depth):
        if frame is None:
            return False
        scaler = frame.f_locals.get("self")
        if (
            frame.f_code.co_name in ("step", "_maybe_opt_step")
            and isinstance(scaler, torch.amp.GradScaler)
            and getattr(scaler, "_enabled", True)
        ):
            return True
        frame = frame.f_back
    return False


def _refuse_dcp_state_dict(st: AmpOptimizerState, frame: Any, depth: int = 4) -> None:
    """Raise when torch's ``get_state_dict``/``set_state_dict`` (read: a frame of
    ``torch.distributed.checkpoint.state_dict`` just above) drive an optimizer whose param_groups
    hold FP32 masters or shards, not the model's parameters: DCP maps optimizer state to the
    model's parameter names, and failed with a bare ``KeyError: 0`` inside torch (an audit).
    distamp.fsdp's optimizers step FSDP's own parameters: torch's idiom works there."""
    if st.masters.fsdp or not (st.group.props.master_weights or st.masters.sharded):
        return
    for _ in range(depth):
        if frame is None:
            return
        if frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict":
            what = (
                "FP32 master weights (opt_level O2)"
                if st.group.props.master_weights
                else "shards of the FP32 weights (shard_master_weights=True)"
            )
            raise RuntimeError(
                "torch.distributed.checkpoint.state_dict (get_state_dict/set_state_dict): "
                "expected an optimizer that steps the model's own parameters, which DCP maps "
                f"its state to by name; this one steps {what}, not the model's parameters. "
                "Save and load with distamp.save_checkpoint / distamp.load_checkpoint (DCP "
                "underneath, any world size), or wrap at O0/O1 without shard_master_weights"
            )
        frame = frame.f_back


def _read_by_accelerate_prepare(frame: Any, depth: int = 3) -> bool:
    """Whether ``frame`` or one just above it is accelerate's ``AcceleratedOptimizer.__init__``
    (read duck-typed), which round-trips this rank's state dict into its own optimizer: after a
    ``distamp.load_checkpoint`` before ``prepare`` that warned a rank-0 save could not be
    resumed, with nothing saved (an audit)."""
    for _ in range(depth):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and type(owner).__name__ == "AcceleratedOptimizer":
            return True
        frame = frame.f_back
    return False


def refuse_external_scaler(st: AmpOptimizerState, scaler: str) -> None:
    """Raise when ``scaler`` (torch's or distamp's GradScaler) drives an optimizer that
    :func:`holds_masters`: the same on every rank (wrap made every rank's optimizer alike)."""
    if st.masters.fsdp:
        # (an audit: the message below, about distamp.wrap and shard_master_weights, was false
        # for a model that never went through wrap)
        raise RuntimeError(
            f"{scaler}: this optimizer was made by distamp.fsdp.fully_shard (opt_level "
            f"{st.group.props.opt_level}), which scales its losses and decides the skip itself "
            "over FSDP's gradient shards; distamp.GradScaler drives the optimizers of "
            "torch.autocast scripts (torch's own fully_shard included) and of distamp.wrap at "
            "O0/O1/O3 with replicated weights. Expected "
            "`with distamp.scale_loss(loss, optimizer) as s: s.backward()` and "
            "`optimizer.step()` in place of the GradScaler calls"
        )
    if holds_masters(st):
        held = (
            "this rank's shard of the FP32 weights (shard_master_weights=True)"
            if st.masters.sharded and not st.group.props.master_weights
            else "FP32 master weights"
        )
        raise RuntimeError(
            f"{scaler}: this optimizer was wrapped by distamp.wrap (opt_level "
            f"{st.group.props.opt_level}): its param_groups hold {held}, which get "
            "their gradients inside optimizer.step(), and distamp scales its losses itself. "
            "Expected `with distamp.scale_loss(loss, optimizer) as s: s.backward()` and "
            "`optimizer.step()` in place of the GradScaler calls (or GradScaler with an unwrapped "
            "optimizer under torch.autocast)"
        )


def _steps_the_models_own_params(st: AmpOptimizerState) -> bool:
    """The optimizer steps the model's own FP32 parameters (FSDP's shards, or O0/O1 without
    sharded masters): torch's entries of a state dict then hold all of its state but the loss
    scale and distamp's counters."""
    return st.masters.fsdp or (not st.masters.sharded and not st.masters.master_tensors())


def _steps_from_torch_state(st: AmpOptimizerState, state_dict: dict[str, Any]) -> None:
    """The step counter taken from torch's own per-parameter ``step`` (Adam's family: the steps
    taken, the same on every rank) when a state dict holds torch's entries only. It stayed at 0:
    ``distamp.save_checkpoint`` records it as the checkpoint's step (without ``extra["step"]``),
    so the resumed run's checkpoints ranked below the older ones and ``latest_checkpoint``
    picked an old one (an audit). Skips before the save are not known (0)."""
    found = [
        float(entry["step"])
        for entry in state_dict.get("state", {}).values()
        if isinstance(entry, dict) and isinstance(entry.get("step"), (int, float, torch.Tensor))
    ]
    if found:
        st.steps, st.skipped_steps, st.last_step_skipped = int(max(found)), 0, False


def _warn_scale_starts_afresh(st: AmpOptimizerState) -> None:
    """[Note: a state dict with torch's entries only] torch.distributed.checkpoint's
    ``get_state_dict``/``set_state_dict`` (FSDP's idiom) keep only torch's entries of
    ``optimizer.state_dict()``, as does a plain or apex run's: under FSDP and at O0/O1 they were
    refused for the missing 'distamp' entry, although nothing of the optimizer's state was
    missing (an audit). They load; the loss scale starts afresh, the step counter from torch's
    own ``step`` entries where the optimizer keeps them (see :func:`_steps_from_torch_state`)."""
    dynamic = [s for s in st.group.scalers if s.dynamic]
    if dynamic:
        _warn(
            "optimizer.load_state_dict: the state dict holds torch's entries only (no 'distamp' "
            "entry: torch.distributed.checkpoint's get_state_dict/set_state_dict keep only "
            "those, as does a plain or apex run's optimizer.state_dict()). The optimizer state "
            f"is loaded; the dynamic loss scale starts again at {dynamic[0].scale:g} (it backs "
            "off within a few skipped steps if that is too high). distamp.save_checkpoint / "
            "load_checkpoint keep the scale"
        )


_TORCH_OPTIM_DIR = os.path.dirname(os.path.abspath(torch.optim.__file__))


def _warn(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside distamp and ``torch.optim``: with
    an LR scheduler torch wraps ``optimizer.step`` (torch/optim/lr_scheduler.py), and accelerate
    (so the Trainer too) ignores UserWarnings from that module — every warning of ``step()`` was
    silently dropped there, among them the one for a clip of still-scaled gradients that left
    an fp16 model untrained (an audit). A fixed stacklevel cannot know how many wrappers the
    caller added."""
    warn_from_caller(message, _TORCH_OPTIM_DIR)


def _edited_nonfinite(
    st: AmpOptimizerState, modified: list[nn.Parameter]
) -> NonFiniteReport | None:
    """[Note: gradients edited after unscale_] ``unscale_`` (and ``clip_grad_norm_``) decide the
    skip early, and the edits made after it are stepped (torch's clipping habit). An edit that
    made a gradient non-finite — ``g.div_(g.norm())`` of a zero gradient, a write on one rank —
    was stepped: NaN weights on that rank alone (the ranks parted), or, in a shard it owns, NaN
    masters the gather spread to every rank (an audit). So after an early decision the gradients
    about to be stepped are checked again, one more MAX all-reduce on that path only, and every
    rank skips together; the loss scale is left alone (no overflow of the scaled gradients).
    Returns the report, or None (go on).

    With sharded masters a rank steps only its shard, so an edit of a part another rank owns
    never reached a gradient it checks: an inf written on one rank was dropped silently, or
    its clip by an inf norm zeroed that rank's copies of the replicated parameters' gradients
    and the ranks parted (an audit). The model gradients edited since ``unscale_``
    (``modified``) are checked whole too."""
    grads = [local_tensor(g) for g in st.masters.step_grads()]
    if st.masters.sharded:
        grads += [p.grad for p in modified if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    flag = nonfinite_flag(grads, device)
    group = st.group
    local = bool(flag)
    nan = local and any(bool(torch.isnan(g._values() if g.is_sparse else g).any()) for g in grads)
    # the lowest rank holding one, with its own kind in the last base-3 digit (two slots MAX-
    # reduced apart paired rank 0's inf with rank 1's NaN, an audit)
    vector = torch.tensor(
        [float((group.world - group.rank) * 3 + (2 if nan else 1)) if local else 0.0],
        dtype=torch.float64,
        device=device,
    )
    if group.process_group is not None and group.world > 1:
        all_reduce_(vector, dist.ReduceOp.MAX, group.process_group)
    code, kind = divmod(int(vector.item()), 3)
    if not code:
        return None
    rank = group.world - code
    if group.process_group is not None and group.world > 1:
        rank = dist.get_global_rank(group.process_group, rank)
    return NonFiniteReport(
        param="(a gradient edited after distamp.unscale_)",
        rank=rank,
        kind="nan" if kind == 2 else "inf",
        after_unscale=True,
    )


def _after_edited_skip(st: AmpOptimizerState, report: NonFiniteReport) -> None:
    """A skip :func:`_edited_nonfinite` decided: reported, counted against
    ``max_consecutive_skips`` like the steps no loss scale can help."""
    st.last_nonfinite = report
    st.group.last_nonfinite = report
    st.group.total_skips += 1
    if st.group.props.verbosity >= 1 and st.group.rank == 0:
        _warn(f"distamp: skipping optimizer step: {report}")
    st.group.unscaled_skips += 1
    limit = st.group.props.max_consecutive_skips
    if st.group.unscaled_skips >= limit:
        raise NonFiniteGradientError(
            f"{st.group.unscaled_skips} consecutive optimizer steps were skipped: {report}. "
            "Look at what the script does to the gradients between distamp.unscale_ (or "
            "clip_grad_norm_) and step() (max_consecutive_skips sets this limit)"
        )


def _torch_state_init_step(optimizer: torch.optim.Optimizer) -> bool:
    """The placeholder step torch.distributed.checkpoint's ``get_state_dict`` runs on an
    optimizer with no state yet (zero gradients, every lr 0, to create the state it then maps
    by name): not a training step, so neither warned about nor counted (it used the one-time
    "step() without scale_loss" warning and counted a step; an audit)."""
    if optimizer.state:
        return False
    groups = optimizer.param_groups
    if not all(float(g["lr"]) == 0.0 for g in groups if "lr" in g):
        return False
    for group in groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                if param.requires_grad:
                    return False
                continue
            local = local_tensor(grad)
            if bool(local.any()):
                return False
    return True


def _shard_of(st: AmpOptimizerState) -> dict[str, int] | None:
    """Which shard of the masters a state dict holds (None: all of them, replicated)."""
    if not st.masters.sharded:
        return None
    group = st.group.process_group
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    # The block size fixes which elements a rank's shard holds ([Note: block-cyclic shards]).
    return {"rank": rank, "world_size": world, "block": int(getattr(st.masters, "block", 0))}


def _sharded_what(st: AmpOptimizerState) -> str:
    """What sharded masters hold: O2's FP32 masters, or O0/O1's own FP32 weights (an audit: the
    messages said "masters" at O0, which has none)."""
    return "FP32 masters" if st.group.props.master_weights else "FP32 weights"


def _warn_state_dict_is_a_shard(st: AmpOptimizerState, shard: dict[str, int]) -> None:
    """Once per optimizer: nanoGPT, timm, Lightning and accelerate save rank 0's state dict
    alone, and the other ranks' shards were lost unnoticed until the resume was refused (an
    audit)."""
    if st.warned_shard_state_dict:
        return
    st.warned_shard_state_dict = True
    if st.masters.fsdp:
        _warn(
            f"optimizer.state_dict() on rank {shard['rank']}: under FSDP it holds this rank's "
            f"shard of the parameters' optimizer state only (1 of {shard['world_size']}), so a "
            "checkpoint rank 0 saves alone cannot be resumed. Expected distamp.save_checkpoint("
            "path, model, optimizer) on every rank (any world size on resume), or every rank "
            "saving and loading its own state_dict at the same world size"
        )
        return
    why = (
        "sharded masters are O2's default across ranks"
        if st.group.props.master_weights
        else "shard_master_weights=True"
    )
    _warn(
        f"optimizer.state_dict() on rank {shard['rank']}: it holds this rank's shard of the "
        f"{_sharded_what(st)} and optimizer state only (1 of {shard['world_size']}; {why}), so "
        "a checkpoint rank 0 saves alone cannot be resumed: the "
        "other ranks' shards are not in it. Expected distamp.save_checkpoint(path, model, "
        "optimizer) on every rank (any world size on resume), or every rank saving and loading "
        "its own state_dict at the same world size, or wrap(..., shard_master_weights=False) "
        "(rank 0's is everyone's)"
    )


def _whole_into_shards(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], extra: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """See [Note: a whole state dict loaded into shards] in masters/sharded.py: a state dict of
    replicated masters, cut into this rank's shard when this optimizer's masters are sharded
    (O2/O3 masters of half weights; other layouts are left to the checks)."""
    masters = optimizer._distamp.masters  # type: ignore[attr-defined]
    if not isinstance(masters, ShardedMasterParams):
        return state_dict, extra
    saved = extra.get("masters")
    if not isinstance(saved, list) or not all(isinstance(t, torch.Tensor) for t in saved):
        return state_dict, extra
    if masters.fp32_weights and not saved:
        # O0/O1: the FP32 weights were their own masters (none saved); the shards are cut from
        # the model's weights (a model.load_state_dict after this one reaches them too: see
        # [Note: weights written after wrap])
        saved = [p.detach() for layout in masters.groups for p in layout.params]
    cut = masters.shard_whole_state(state_dict, saved, optimizer.param_groups)
    if cut is None:
        return state_dict, extra
    inner, shards = cut
    return inner, {**extra, "masters": shards, "shard": _shard_of(optimizer._distamp)}  # type: ignore[attr-defined]


def _check_loadable(extra: dict[str, Any] | None, st: AmpOptimizerState) -> None:
    where = "optimizer.load_state_dict"
    if extra is None:
        raise ValueError(
            f"{where}: expected a state dict saved from a distamp-wrapped optimizer (with a "
            "'distamp' entry), got one without it. Saved by apex or a plain run? Load it into "
            "the optimizer before distamp.wrap / amp.initialize, which keeps its state. Through "
            "torch.distributed.checkpoint.state_dict's get_optimizer_state_dict/"
            "set_optimizer_state_dict (FSDP's idiom)? They keep only torch's entries and drop "
            "the FP32 masters (replicated O2) and the loss scales: save and load with "
            "distamp.save_checkpoint/load_checkpoint (DCP files, any world size)"
        )
    mine, theirs = _shard_of(st), extra.get("shard")
    if "shard" in extra and mine != theirs:  # (state dicts of distamp 0.1 do not say)
        fsdp = st.masters.fsdp

        what = _sharded_what(st)

        def show(shard: dict[str, int] | None) -> str:
            if shard is None:
                return f"all {what} (replicated)"
            ranks = f"{shard['world_size']} rank{'s' if shard['world_size'] != 1 else ''}"
            if fsdp:  # FSDP's shards have no blocks
                return f"rank {shard['rank']}'s FSDP shard of {ranks}"
            blocks = f" in blocks of {shard['block']}" if "block" in shard else " (contiguous)"
            return f"rank {shard['rank']}'s shard of the {what} of {ranks}{blocks}"

        model = getattr(st.masters, "model", lambda: None)()
        # (FSDP1's flat shards: distamp's checkpoints refuse them, an audit found this advice
        # leading to that refusal)
        fsdp1 = type(model).__name__ == "FullyShardedDataParallel"
        raise ValueError(
            f"{where}: the state dict holds {show(theirs)}, this optimizer needs {show(mine)}: "
            "with sharded masters every rank saves and loads its own optimizer.state_dict() at "
            "the same world size; "
            + (
                "under api='fsdp1' that is the way (distamp's checkpoints hold FSDP2's shards: "
                "api='fsdp2' for one checkpoint at any world size)"
                if fsdp1
                else "use distamp.save_checkpoint/load_checkpoint (one checkpoint, any world size)"
            )
            + (
                ""
                if fsdp
                else ", or wrap with shard_master_weights=False to keep saving rank 0's "
                "optimizer.state_dict() for all ranks"
            )
        )
    saved_level = (extra.get("properties") or {}).get("opt_level")
    level = st.group.props.opt_level
    if saved_level is not None and saved_level != level:
        raise ValueError(
            f"{where}: the state dict was saved at opt_level {saved_level!r}, this optimizer is "
            f"wrapped at {level!r}: expected the same opt_level (distamp.save_checkpoint/"
            "load_checkpoint say what they can convert; consolidate gives FP32 weights)"
        )
    masters = st.masters.master_tensors()
    saved = extra["masters"]
    if len(saved) != len(masters):
        raise ValueError(
            f"{where}: expected {len(masters)} FP32 master tensors, found {len(saved)}"
        )
    for i, (m, t) in enumerate(zip(masters, saved, strict=True)):
        if m.shape != t.shape:
            raise ValueError(
                f"{where}: master {i} has shape {tuple(m.shape)} here, {tuple(t.shape)} in the "
                "state dict"
            )
    if len(extra["scalers"]) != len(st.group.scalers):
        raise ValueError(
            f"{where}: expected {len(st.group.scalers)} loss scalers (num_losses), found "
            f"{len(extra['scalers'])}"
        )
    # Everything is checked before anything is loaded: a refusal leaves the optimizer unchanged.
    for i, (scaler, saved_scaler) in enumerate(
        zip(st.group.scalers, extra["scalers"], strict=True)
    ):
        try:
            scaler.check_state(saved_scaler)
        except ValueError as exc:
            raise ValueError(f"{where}: loss scaler {i}: {exc}") from None
    for key in ("steps", "skipped_steps"):
        if isinstance(extra.get(key), bool) or not isinstance(extra.get(key), int):
            raise ValueError(f"{where}: expected an int for {key!r}, got {extra.get(key)!r}")


def _check_inner_state(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """torch.optim's own classes keep per-parameter state shaped like the parameter (exp_avg,
    momentum_buffer, ...): a saved tensor of another shape is refused here, before anything is
    loaded (torch would load it and fail at the next step)."""
    if not isinstance(opt, PER_PARAMETER):
        return
    mine = [p for g in opt.param_groups for p in g["params"]]
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
    if len(saved_ids) != len(mine):
        return  # torch's own check says so, before it changes anything
    by_id = dict(zip(saved_ids, mine, strict=True))
    for key, entry in (state_dict.get("state") or {}).items():
        param = by_id.get(key)
        if param is None or not isinstance(entry, dict):
            continue
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"optimizer.load_state_dict: state {name!r} of parameter {key} has shape "
                    f"{tuple(value.shape)}, expected {tuple(param.shape)} (the tensor this "
                    "optimizer steps there)"
                )


def unscale_now(st: AmpOptimizerState, api: str = "optimizer.step()") -> None:
    """Collective: unscale ``st``'s pending gradients, take the skip decision, and leave the model's
    gradients unscaled too (see [Note: unscale_ then torch's clip_grad_norm_])."""
    assert st.grad_scale is not None
    inv_scale = 1.0 / st.grad_scale
    st.group.unscale_and_decide(st, api)
    st.masters.expose_unscaled(inv_scale)
    st.record_shard_grads()


def inner_optimizer(obj: object) -> torch.optim.Optimizer | None:
    """``obj`` itself if it is an optimizer; the optimizer inside an optimizer wrapper such as
    apex's LARC (its ``optim`` attribute); the distamp optimizer inside a framework's optimizer
    subclass that holds it as ``optimizer`` (accelerate's AcceleratedOptimizer: refused by name
    before, an audit); else None."""
    if isinstance(obj, torch.optim.Optimizer):
        if isinstance(obj, AmpOptimizer) and "_distamp" in obj.__dict__:
            return obj
        # (Lightning Fabric's wrapper subclasses the optimizer's class, distamp's included, and
        # holds it as _optimizer; accelerate's holds it as optimizer)
        fields = obj.__dict__
        held = fields.get("_optimizer", fields.get("optimizer", getattr(obj, "optimizer", None)))
        return held if isinstance(held, AmpOptimizer) else obj
    inner = getattr(obj, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


class AmpOptimizerWrapper:
    """Mixin placed in front of an optimizer wrapper's class (apex's LARC pattern).

    [Note: optimizer wrappers] A wrapper such as LARC reads and rescales the gradients of its inner
    optimizer's ``param_groups`` in its own ``step`` and then calls the inner ``step``. Handed to
    ``wrap`` (apex's order), the inner optimizer is wrapped and the wrapper's ``step`` first
    unscales the pending gradients (and takes the skip decision), so what it reads is the true
    FP32 gradient the optimizer steps. The wrapper keeps its identity.
    """

    optim: torch.optim.Optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        st = getattr(self.optim, "_distamp", None)
        if st is not None and st.state is OptState.SCALED:
            unscale_now(st)
        return super().step(*args, **kwargs)  # type: ignore[misc]


def amp_optimizer_class(cls: type[torch.optim.Optimizer]) -> type[AmpOptimizer]:
    """A subclass of ``cls`` with :class:`AmpOptimizer` in front; same name, so reprs read as before."""
    return type(cls.__name__, (AmpOptimizer, cls), {"__module__": cls.__module__})


class NestedStepGuard:
    """Step pre-hook on an optimizer held inside the wrapped one and sharing its ``param_groups``
    (timm's Lookahead, SAM's ``base_optimizer``): it may step only inside the wrapped optimizer's
    ``step()``. SAM's ``second_step`` calls ``base_optimizer.step()`` itself: no unscale, no skip
    decision, no copy of the FP32 masters into the model — at O2 only the FP32 norm layers moved
    (by 1e3) and the loss went to 7e28, at O1 to NaN, silently (an audit). Holds the state
    weakly, as :class:`BackwardSeen` does."""

    def __init__(self, st: AmpOptimizerState, attr: str) -> None:
        self.st = weakref.ref(st)
        self.attr = attr

    def __call__(self, nested: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        st = self.st()
        if st is None or st.in_step:
            return
        outer = st.optimizer()
        name = type(outer).__name__ if outer is not None else "the wrapped optimizer"
        raise RuntimeError(
            f"optimizer.{self.attr}.step() ({type(nested).__name__} inside {name}) ran outside "
            f"optimizer.step(): expected the optimizer distamp.wrap returned to be stepped (its "
            "step() unscales the gradients, takes the skip decision every rank shares and copies "
            "the FP32 masters into the model, then steps the nested optimizer). Optimizers that "
            "step their base optimizer themselves in two phases (SAM's first_step/second_step) "
            "are not supported; a wrapper that calls the nested step() from its own step() "
            "(timm's Lookahead) is"
        )


def guard_nested_optimizers(opt: torch.optim.Optimizer, st: AmpOptimizerState) -> None:
    """Give every optimizer held in ``opt``'s attributes and sharing its param-group dicts a
    :class:`NestedStepGuard`."""
    shared = {id(g) for g in opt.param_groups}
    for attr, value in vars(opt).items():
        if (
            isinstance(value, torch.optim.Optimizer)
            and value is not opt
            and any(id(g) in shared for g in value.param_groups)
        ):
            value.register_step_pre_hook(NestedStepGuard(st, attr))


def backward_reached(st: AmpOptimizerState) -> None:
    """A backward reached this optimizer's gradients (:class:`BackwardSeen`, FSDP's
    ``UnshardedReached``): recorded, and whether it ran outside every block of the group."""
    st.backward_since_step = True
    if not any(o.masters.blocks_open for o in st.group.optimizers):
        st.outside_seen = True
        if st.state is OptState.SCALED:  # see [Note: a backward outside scale_loss, then a block]
            st.outside_between_blocks = True


class BackwardSeen:
    """Post-accumulate-grad hook on each trainable model parameter: a backward reached it.

    Holds the optimizer's state weakly: torch keeps tensor hooks in C++, where Python's garbage
    collector cannot see the cycle parameter -> hook -> state -> masters -> parameter, and every
    wrapped model and optimizer (its FP32 masters too) stayed alive after ``del`` (an audit:
    +32 MB per wrap of a 4M-parameter model at O2, in a sweep that wraps one per trial)."""

    def __init__(self, st: AmpOptimizerState) -> None:
        self.st = weakref.ref(st)

    def __call__(self, _: torch.Tensor) -> None:
        st = self.st()
        if st is not None:
            backward_reached(st)


def _refuse_or_warn_unlisted(st: AmpOptimizerState) -> None:
    """See [Note: a block that does not list an optimizer it reaches] in scaler.py. Every rank
    runs the same script, so every rank raises or warns alike."""
    index = _optimizer_index(st)
    if st.mixed_scales is not None:
        loss_id, scale = st.mixed_scales
        raise RuntimeError(
            f"optimizer.step(): expected every scale_loss block that reaches optimizer {index}'s "
            f"parameters to list it, found a block of loss_id={loss_id} (at loss scale "
            f"{scale:g}) that did not while its gradients were pending at another scale: they "
            "now hold a sum at two scales that cannot be unscaled. Pass every optimizer whose "
            f"parameters the loss reaches: scale_loss(loss, [..., optimizer {index}], "
            f"loss_id={loss_id}); clear these gradients (zero_grad) and train on"
        )
    if st.unlisted_loss is not None and not st.warned_unlisted:
        _warn(
            f"optimizer.step(): optimizer {index}'s gradients were written by a scale_loss block "
            f"of loss_id={st.unlisted_loss} that did not list it; they were taken at that block's "
            "loss scale. Pass every optimizer whose parameters the loss reaches "
            "(scale_loss(loss, [opt_a, opt_b])), or clear them (zero_grad) if they are not meant "
            "to be stepped (a GAN's discriminator after the generator's loss)"
        )
        st.warned_unlisted = True


OUTSIDE_BETWEEN, OUTSIDE_BEFORE = 1.0, 2.0
"""The kinds of backward outside ``scale_loss`` that :func:`refuse_outside_backward` names."""


def outside_backward(st: AmpOptimizerState) -> float:
    """Which kind of refused backward outside ``scale_loss`` this optimizer's gradients hold
    (0.0: none): a number, carried in the skip decision's all-reduce."""
    if st.outside_between_blocks:
        return OUTSIDE_BETWEEN
    return OUTSIDE_BEFORE if st.outside_before_block else 0.0


def refuse_outside_backward(api: str, kind: float, where: str = "") -> None:
    """[Note: a backward outside scale_loss, then a block] in wrap.py: a block, then a backward
    outside every block, in one step (at O2 fp16 the outside share shrank by the loss scale,
    silently, an audit), or such a backward, then a block. Raised at the next block with one
    rank; with several, at the step, by every rank together (an audit: one rank alone raising
    at its block or before the skip decision left the others waiting in DDP's or FSDP's
    collectives, or in the decision, a hang). ``where``: the rank's part, said after "found"."""
    if kind == OUTSIDE_BEFORE:
        raise RuntimeError(
            f"{api}: expected the gradients pending since the last step() to come from "
            f"scale_loss blocks only, found{where} gradients a backward outside scale_loss left "
            "(loss.backward(), a framework's backward: at scale 1.0) before a block's backward "
            "added gradients at the loss scale to them, a sum no unscale can undo. Run every "
            "backward of the step inside scale_loss (or none: step() takes an outside "
            "backward's gradients at scale 1.0), or clear them first (optimizer.zero_grad())"
        )
    raise RuntimeError(
        f"{api}: expected every backward between two steps inside distamp.scale_loss once one "
        f"was, found{where} a backward outside this optimizer's scale_loss blocks after one "
        "(loss.backward(), a framework's backward, a block of another distamp.wrap call, or a "
        "scale_loss's yielded loss's backward() run after its with block closed: "
        "gradients at another scale added to the block's, at its loss scale: a sum no "
        "unscale can undo). Run it inside scale_loss listing this optimizer too (one wrap "
        "call for models whose losses reach each other), or clear the gradients "
        "(optimizer.zero_grad()) and train on"
    )


def _optimizer_index(st: AmpOptimizerState) -> int:
    """This optimizer's position in its distamp.wrap call (for messages)."""
    return next((i for i, o in enumerate(st.group.optimizers) if o is st), 0)


def watch_backward(st: AmpOptimizerState, params: list[Any]) -> None:
    """See [Note: a second step() on the same gradients]: hook ``params`` (the trainable ones)."""
    hook = BackwardSeen(st)
    for param in params:
        if param.requires_grad and param.is_leaf and id(param) not in st.watched:
            param.register_post_accumulate_grad_hook(hook)
            st.watched.add(id(param))
    st.watches_backward = True


def drop_cleared_gradients(st: AmpOptimizerState) -> None:
    """[Note: gradients cleared outside optimizer.zero_grad()] ``optimizer.zero_grad()`` drops the
    pending ``scale_loss`` blocks with the gradients, but scripts also clear them with
    ``model.zero_grad()`` (apex's DCGAN, Hugging Face's Trainer) or ``p.grad = None``, for instance
    to discard a batch whose loss came out NaN. The blocks then stayed pending: the next clean
    step was skipped for that NaN and the scale halved, or the next ``scale_loss`` after an
    ``unscale_`` refused to run. Called where the next block, step or unscale begins: with every
    model gradient gone, nothing is pending, so the blocks are dropped as ``zero_grad`` drops
    them. O(1) while any gradient is there (the scan stops at the first).

    Gradients zeroed in place (``zero_grad(set_to_none=False)``) are not looked for in general
    (a scan of every value per block), except where a block that did not list this optimizer
    wrote them (apex's DCGAN: the generator's loss reaches the discriminator, whose gradients
    the script zeroes before its own blocks): found all zero since, they are dropped as cleared
    ones are — else the discriminator's next block ran at the lower of the two scales and its
    step warned that gradients it had cleared were taken at the generator's (an audit)."""
    if st.state is OptState.READY or not st.had_grads:
        return  # (an optimizer whose parameters got no gradient this iteration: nothing cleared)
    params = st.masters.model_params
    if any(p.grad is not None for p in params) and not (
        _zeroed_since(st, st.adopted_grads) or _zeroed_since(st, st.interrupted_grads)
    ):
        return
    st.group.forget(st)
    st.reset()  # releases the masters' and shards' gradients, as zero_grad does


def _zeroed_since(st: AmpOptimizerState, versions: list[tuple[int, int] | None] | None) -> bool:
    """See :func:`drop_cleared_gradients`: the gradients recorded in ``versions`` — the ones a
    block that did not list ``st`` left, or an interrupted step's (see [Note: an interrupted
    step keeps its decision]: ``model.zero_grad(set_to_none=False)`` after it refused every
    later block, an audit) — have all been written since, and every one is zero now (the same
    on every rank: each zeroes its own)."""
    if versions is None:
        return False
    params = st.masters.model_params
    if grad_versions(params) == versions:
        return False
    with torch.no_grad():
        return all(p.grad is None or not bool(local_tensor(p.grad).any()) for p in params)


def _decide_with_no_blocks(st: AmpOptimizerState) -> None:
    """A rank about to refuse a step() with no gradients (it ran no scale_loss block, or cleared
    its only one: a NaN loss discarded) must not raise alone: the ranks that have gradients wait
    in the skip decision's all-reduce until the group's timeout (an audit: 30 minutes, then a
    gloo error). It takes part with no blocks, so that the counts differ and every rank raises
    together, naming them (see [Note: a fixed-size decision vector] in scaler.py); when no rank
    has gradients, every rank goes on to the same refusal."""
    if st.group.world == 1:
        return
    st.grad_scale = 1.0
    st.refusing = True
    try:
        st.group.unscale_and_decide(st)
    finally:
        st.refusing = False
        st.reset()


def _refuse_gradients_fsdp_still_holds(st: AmpOptimizerState) -> None:
    """A step with no reduced gradient while FSDP still holds this step's gradients unreduced:
    ``set_requires_gradient_sync(False)`` left on for the last micro-batch. The step stepped
    nothing and counted itself, and the held gradients were added into the next step's, which
    then applied two windows at once — silently, as in torch (an audit)."""
    held = getattr(st.masters, "unreduced_grads", None)
    if held is None or not held():
        return
    raise RuntimeError(
        "optimizer.step(): expected the gradients reduced into the sharded parameters' .grad, "
        "found none there and FSDP still holding this step's gradients unreduced: "
        "set_requires_gradient_sync(False) was left on for the last micro-batch. Call "
        "model.set_requires_gradient_sync(True) before the last micro-batch's backward (the "
        "held gradients stay: a backward with sync on reduces them with its own)"
    )


def _refuse_converted_params(st: AmpOptimizerState) -> None:
    """[Note: dtypes changed after wrap] in casting.py: each forward reads two probes (the first
    cast and the first FP32 parameter); a submodule converted after wrap (``model.head.to(
    torch.bfloat16)`` at O1: half weights with no FP32 copy, trained silently; ``.float()`` at
    O2: torch's bare "mat1 and mat2 must have the same dtype") slipped past them (an audit).
    The step compares every parameter it steps, before anything changes. Parameters added
    later (``add_param_group``) are recorded at their first step."""
    if st.masters.fsdp:
        return  # (FSDP's sharded parameters are its own; their dtype is FSDP's business)
    _refuse_replaced_params(st)
    known = st.param_dtypes
    for param in st.masters.model_params:
        dtype = known.setdefault(id(param), param.dtype)
        if param.dtype != dtype:
            name = st.group.param_names.get(id(param), "?")
            raise RuntimeError(
                f"optimizer.step(): parameter {name!r} is {param.dtype}, but distamp.wrap left "
                f"it {dtype} (opt_level {st.group.props.opt_level}): expected no dtype conversion "
                "of a wrapped model or of its submodules (.float()/.half()/.to(dtype), "
                "load_state_dict(assign=True)); convert before wrap, or wrap a fresh model"
            )


def _refuse_replaced_params(st: AmpOptimizerState) -> None:
    """[Note: parameters replaced after wrap] ``model.load_state_dict(sd, assign=True)`` after
    wrap (in the dtypes wrap left: always at O1) puts new Parameter objects in the model; the
    optimizer and the masters kept stepping the old ones, the model's new ones gathered
    gradients, and training was a silent no-op — every step counted, none skipped (an audit).
    Each step reads the parameters at the two probe names (see [Note: dtypes changed after
    wrap] in casting.py) and, when one of its parameters holds no gradient, every parameter of
    the models: one of the optimizer's names now holding another object is named.
    (Read at step(), never in forward: ``torch.func.functional_call`` swaps tensors in for a
    call.)"""
    for model_ref, name, param_id in st.group.probe_params:
        model = model_ref()
        if model is not None:
            now = _parameter_at(model, name)
            if isinstance(now, nn.Parameter) and id(now) != param_id:
                _raise_replaced(st, _replaced_names(st, with_grad=False) or [name])
    # A module replaced elsewhere (a new head): its old parameters, which the optimizer holds,
    # get no gradient (an audit: a new head trained as a silent no-op while the other parameters
    # had gradients). Frozen ones never have one: left out, so that a frozen backbone held by
    # the optimizer does not walk the models' parameters at every step; an unused one does.
    if any(p.grad is None and p.requires_grad for p in st.masters.model_params):
        replaced = _replaced_names(st, with_grad=True)
        if replaced:
            _raise_replaced(st, replaced)


def _replaced_names(st: AmpOptimizerState, *, with_grad: bool) -> list[str]:
    """Names of this optimizer's parameters at wrap that hold another Parameter now (with a
    gradient, if ``with_grad``)."""
    held = {id(p) for p in st.masters.model_params}
    replaced = []
    for index, ref in enumerate(st.group.models):
        model = ref()
        for name, param in model.named_parameters() if model is not None else ():
            old = st.group.wrapped_params.get((index, name))
            if old in held and id(param) != old and (param.grad is not None or not with_grad):
                replaced.append(name)
    return replaced


def _parameter_at(model: nn.Module, name: str) -> object:
    prefix, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    return owner._parameters.get(leaf)


def _refuse_fsdp_after_wrap(st: AmpOptimizerState) -> None:
    fsdp = st.group.sharded_by_fsdp_after_wrap()
    if fsdp is not None:
        raise RuntimeError(
            f"optimizer.step(): the model was sharded with FSDP after distamp.wrap "
            f"(found {fsdp}), so its new sharded parameters are not the ones this "
            "optimizer steps; expected distamp.fsdp.fully_shard(model, optimizer, "
            "opt_level=...) on the FP32 model instead of wrap + fully_shard"
        )


def _raise_replaced(st: AmpOptimizerState, names: list[str]) -> None:
    _refuse_fsdp_after_wrap(st)  # (FSDP replaces every parameter: said in its own words)
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    raise RuntimeError(
        f"optimizer.step(): parameter(s) {', '.join(map(repr, names[:4]))}{more} of the wrapped "
        "model are other Parameter objects than the ones distamp.wrap gave this optimizer "
        "(replaced after wrap: model.load_state_dict(..., assign=True), a new nn.Parameter or "
        "submodule set on the model, Hugging Face's resize_token_embeddings); the optimizer "
        "would step the old ones and the model's would never change. Expected the parameters "
        "wrap saw: load with load_state_dict(sd) (no assign: it copies into them and reaches "
        "the masters) or distamp.load_checkpoint, and replace modules before wrap"
    )


def _refuse_a_second_step_on_the_same_gradients(st: AmpOptimizerState) -> None:
    """[Note: a second step() on the same gradients] A step() with no backward since the last one
    finds the gradients that step used, in whatever state it left them: under O2/O3 the model's
    half ``.grad`` still carry the loss scale (only their FP32 copies were unscaled), with the
    reduce-scatter hook they are this rank's own unreduced ones, after a skipped step they hold
    the inf. Taking them as fresh unscaled gradients made an audit's O2 update 65536x too large.
    torch's GradScaler refuses a second step() before update(); so does distamp, at every
    opt_level: gradients the last step() used, with no backward since, are refused by name.
    "No backward since" is seen by a post-accumulate-grad hook on every trainable parameter (an
    in-place touch such as logging a norm with clip_grad_norm_ changes a gradient's version, not
    the fact that no backward ran: an audit's logged norm let the 65536x step through a check
    of versions); the gradients the last step used are the same tensor objects. Under FSDP
    (whose sharded gradients no hook of a parameter sees) the versions still decide."""
    if st.stepped_grads is None:
        return
    now = grad_versions(st.masters.model_params)
    if st.watches_backward:
        same = [
            v is not None and w is not None and v[0] == w[0]
            for v, w in zip(now, st.stepped_grads, strict=False)
        ]
        # A parameter frozen at wrap and trainable now has no hook until the step after it was
        # unfrozen: its gradient's identity and version tell whether a backward reached it (an
        # audit: a backward reaching only unfrozen layers was refused as "no backward since").
        unwatched_moved = any(
            v is not None and v != w
            for p, v, w in zip(st.masters.model_params, now, st.stepped_grads, strict=False)
            if id(p) not in st.watched
        )
        stale = not st.backward_since_step and not unwatched_moved and any(same)
    else:
        stale = now == st.stepped_grads and any(v is not None for v in now)
    if stale and _zeroed_since(st, st.stepped_grads):
        # Zeroed in place since (zero_grad(set_to_none=False), of the optimizer or the model):
        # zero gradients carry no scale and are every rank's own zeros; FP32 code steps on them
        # (momentum and weight decay still move the weights: alternating updates), and so do
        # torch's GradScaler and apex. An audit found this refused as "called again".
        return
    if stale:
        # Not alone: another rank that did run a backward waits in the skip decision (an audit:
        # gradients zeroed with set_to_none=False on a rank without a batch; it raised here and
        # the others hung). Taking part with no blocks makes every rank raise together, naming
        # the counts; when every rank is here, all of them go on to this refusal.
        _decide_with_no_blocks(st)
        raise RuntimeError(
            "optimizer.step() was called again on the gradients the previous step() used (no "
            "backward since, the .grad not zeroed); expected a backward inside distamp.scale_loss "
            "before each step (torch.amp.GradScaler refuses a second step() before update() "
            "too). The previous step's gradients are not reusable: they may still carry the "
            f"loss scale (opt_level {st.group.props.opt_level}) or be this rank's unreduced ones"
        )


def _step_and_copy(optimizer: AmpOptimizer, st: AmpOptimizerState) -> None:
    """The inner optimizer's step over the masters, then the updated weights into the model,
    with the step hooks around both (see [Note: step hooks see the new weights] in rounds.py)."""
    st.inner_stepped = False  # set once the inner step returned (a pre-hook may raise first)
    st.inner_started = False  # set once the pre-hooks passed and the inner step began

    def started() -> None:
        st.inner_started = True

    in_rounds = round_step(optimizer, st.masters)
    if in_rounds is not None:  # see [Note: the step in rounds]
        step_in_rounds(optimizer, st.masters, in_rounds, started)  # type: ignore[arg-type]
        st.inner_stepped = True
        return
    step = unhooked_step(optimizer)
    if step is None:  # a torch that keeps its hooks elsewhere: its own runner fires them
        started()  # (no telling its hooks from its step: an exception resets, as before)
        super(AmpOptimizer, optimizer).step()
        st.inner_stepped = True
        st.masters.copy_to_model(after_step=True)
        return

    def step_then_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        started()
        step(*args, **kwargs)
        st.inner_stepped = True
        st.masters.copy_to_model(after_step=True)

    with_step_hooks(optimizer, step_then_copy)


def _warn_if_shards_touched(st: AmpOptimizerState) -> None:
    """See [Note: clipping what param_groups hold] in sharded.py: once per optimizer."""
    if st.unscaled_shards is None or st.warned_shards_touched:
        return
    if st.masters.shard_grad_versions() == st.unscaled_shards or st.unscaled_sample is None:
        return
    before, now = st.unscaled_sample, st.masters.shard_grad_sample()
    if now is None or now.shape != before.shape:
        return
    seen = (before != 0) & before.isfinite() & now.isfinite()
    if not bool(seen.any()):
        return
    ratio = now[seen] / before[seen]
    uniform = bool(((ratio - ratio[0]).abs() <= 1e-6 * ratio[0].abs()).all())
    if uniform and float(ratio[0]) != 1.0:  # every value times one factor: a norm clip
        st.warned_shards_touched = True
        _warn(
            "optimizer.step(): the gradients in optimizer.param_groups were scaled by one factor "
            "after unscale_, as a norm clip does; with sharded masters (shard_master_weights) "
            "they are this rank's shard of the model's, so a norm over them (clip_grad_norm_ "
            "over param_groups, amp.master_params) is this rank's, not the model's. Expected distamp.clip_grad_norm_(optimizer, max_norm), or torch's "
            "clip_grad_norm_ over model.parameters() after distamp.unscale_(optimizer)"
        )


def _scaled_grads_touched(st: AmpOptimizerState) -> bool | torch.Tensor:
    """[Note: scaled gradients touched before step()] distamp unscales at ``step()`` (or
    ``unscale_``), not when a scale_loss block ends (apex's O1 did), so a script that clips
    ``model.parameters()`` between the block and ``step()`` clips gradients still multiplied by
    the loss scale (an audit's apex O1 script: a norm of 5.9e4 clipped to 0.5, then unscaled by
    65536: an update 65536x too small, silently). A gradient modified in place or replaced since
    the last block ended, without ``unscale_``, is such a touch: warn once per optimizer.

    Under FSDP the answer is a device flag (see ``FSDPParams.scaled_grad_sample``), read after
    the skip decision, whose own host synchronization has made it ready: no second one."""
    if st.state is not OptState.SCALED or st.warned_touched_scaled or not st.scaled_grads:
        return False
    if st.grad_scale == 1.0:  # (a scale of 1: the gradients are their unscaled selves)
        return False
    params, versions = zip(*st.scaled_grads, strict=True)
    if grad_versions(params) != list(versions):
        return True
    if st.scaled_sample is None:
        return False
    now = st.masters.scaled_grad_sample()
    if now is None or now.shape != st.scaled_sample.shape:
        return True
    return (now != st.scaled_sample).any()


def _warn_if_edited_after_clip(st: AmpOptimizerState) -> None:
    """A model gradient edited after ``distamp.clip_grad_norm_`` (with no ``unscale_`` before
    it) does not reach the masters, which hold the unscaled, clipped gradients that step: the
    edit (a pruning mask, a frozen row zeroed) was dropped, silently (an audit). Said once per
    optimizer; ``unscale_`` first, then the edit and the clip, keeps it."""
    clipped, st.clipped_grads = st.clipped_grads, None
    if clipped is None or st.warned_edited_after_clip:
        return
    now = grad_versions(p for p, _ in clipped)
    edited = [p for (p, version), new in zip(clipped, now, strict=True) if new != version]
    if not edited:
        return
    st.warned_edited_after_clip = True
    names = [st.group.param_names.get(id(p), "?") for p in edited[:3]]
    # Any in-place touch counts, a norm logged through torch's clip_grad_norm_(..., inf) too (it
    # reads the scaled values): a sample of values missed a row or one element edited (an
    # audit), and a full comparison would cost a pass over every gradient at each clip.
    _warn(
        f"optimizer.step(): the .grad of {', '.join(map(repr, names))}"
        f"{' and others' if len(edited) > 3 else ''} changed after distamp.clip_grad_norm_, "
        "which unscaled and clipped the FP32 masters' gradients that step, not the model's "
        "(still multiplied by the loss scale): the edit is not in this step. Expected "
        "distamp.unscale_(optimizer) first — then the model's .grad hold the unscaled values, "
        "and edits before or after the clip reach the step"
    )


def _warn_if_scaled_grads_touched(
    st: AmpOptimizerState, touched: bool | torch.Tensor, scale: float | None
) -> None:
    """The warning of [Note: scaled gradients touched before step()], once per optimizer."""
    if bool(touched):
        st.warned_touched_scaled = True
        _warn(
            f"optimizer.step(): a gradient was modified after backward while still multiplied "
            f"by the loss scale ({scale or 1.0:g}) — clipping or rescaling model.parameters() "
            "between scale_loss and step() sees scaled values; expected distamp.unscale_("
            "optimizer) (apex scripts: amp.master_params(optimizer)) before touching them, "
            "or distamp.clip_grad_norm_(optimizer, max_norm)"
            + (
                ". With FP32 masters the tensors in optimizer.param_groups have no .grad "
                "until then: a loop over param_groups that edits .grad (NVIDIA's ConvNets "
                "divide it for accumulation) reached only the parameters kept FP32 — iterate "
                "amp.master_params(optimizer) instead"
                if st.group.props.master_weights and not st.masters.sharded
                else ""
            )
        )
