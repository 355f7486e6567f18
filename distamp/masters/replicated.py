"""Replicated FP32 masters: every rank holds an FP32 copy of every half parameter (apex's O2).

Used at one rank, and at more than one with ``shard_master_weights=False``; the sharded ones are in
``sharded.py``. Parameters that are FP32 already (O0/O1, norm layers under O2) are their own
masters: no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import HALF_DTYPES
from .base import (
    ModelGrads,
    bit_hash,
    grad_samples,
    merge_loaded,
    strided_sample,
    written_through_data,
)
from .clipping import norm_operands, scale_to_max_norm_
from .nonfinite import check_and_unscale_


@dataclass
class _Samples:
    """Sampled views of one device's and weight dtype's weights and of their masters."""

    params: list[nn.Parameter]
    weights: list[torch.Tensor]
    masters: list[torch.Tensor]


def _in_memory_order(
    weight: torch.Tensor, master: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """1-D views of ``weight`` and ``master``, element by element the same positions: their
    dimensions ordered by the weight's strides (a channels_last weight, whose master keeps its
    format, is dense in that order). None when either is not dense so: a copy would not see
    later writes. Only contiguous weights were sampled, and a channels_last critic's
    ``p.data.clamp_`` never reached its masters (an audit: 1.8 against the clip's 0.01)."""
    strides = weight.stride()
    order = sorted(range(weight.dim()), key=lambda d: (-strides[d], d))
    views = weight.permute(order), master.permute(order)
    if not all(v.is_contiguous() for v in views):
        return None
    return views[0].view(-1), views[1].view(-1)


class MasterParams(ModelGrads):
    """The (model parameter, FP32 master) pairs of one optimizer, replicated on every rank.

    A model parameter that stays FP32 (O0/O1, norm layers under O2) is its own master; only
    parameters that are cast to a half dtype get a separate FP32 copy.
    """

    sharded = False

    def __init__(self, model_params: list[nn.Parameter], masters: list[torch.Tensor]) -> None:
        assert len(model_params) == len(masters)
        self.model_params = model_params
        self.masters = masters
        self.separate = [m is not p for p, m in zip(model_params, masters, strict=True)]
        self.weight_versions: list[int] = []
        """Each weight's version counter after the masters last wrote it: see [Note: weights
        written after wrap] in base.py."""
        self._samples: tuple[tuple[int, ...], list[_Samples]] = ((), [])
        """The sampled views :meth:`_take_writes_through_data` compares, keyed by the storages
        they view (made again when a ``.data`` or a master is replaced, or a group added)."""

    @classmethod
    def take(
        cls, optimizer: torch.optim.Optimizer, cast_ids: set[int] | frozenset[int]
    ) -> MasterParams:
        """Replace the params in ``optimizer.param_groups`` that will be cast by FP32 copies.

        Must run before the model is cast, so the masters hold the exact FP32 values.
        """
        model_params: list[nn.Parameter] = []
        masters: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            new_params = []
            for param in group["params"]:
                # Frozen parameters in the optimizer get masters too: unfrozen later, they train
                # from exact FP32 values (grad None means never stepped, as in torch).
                if id(param) in cast_ids:
                    master = param.detach().clone(memory_format=torch.preserve_format)
                    master.requires_grad_(True)
                    if param in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(param)
                else:
                    master = param
                model_params.append(param)
                masters.append(master)
                new_params.append(master)
            group["params"] = new_params
        return cls(model_params, masters)

    def unscale_and_check(self, inv_scale: float) -> torch.Tensor:
        """Put ``grad * inv_scale`` in FP32 on the masters; return a 0/1 flag of non-finite grads."""
        grads: list[torch.Tensor] = []
        widened: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for param, master, separate in zip(
            self.model_params, self.masters, self.separate, strict=True
        ):
            grad = param.grad
            if grad is None:
                if separate:
                    master.grad = None
                continue
            if not separate:
                grads.append(grad)
            elif grad.layout == torch.strided and grad.is_contiguous() and not grad.is_complex():
                widened.setdefault(grad.device, []).append((master, grad))
            else:
                master.grad = grad.detach().to(torch.float32)
                grads.append(master.grad)
        for device, pairs in widened.items():
            # One FP32 buffer per device and one foreach copy into views of it, not a new tensor
            # per parameter (~5 us each: 1,000 small ones cost ~5 ms a step, an audit).
            flat = torch.empty(sum(g.numel() for _, g in pairs), dtype=torch.float32, device=device)
            views, at = [], 0
            for _, grad in pairs:
                views.append(flat[at : at + grad.numel()].view(grad.shape))
                at += grad.numel()
            with torch.no_grad():
                torch._foreach_copy_(views, [grad for _, grad in pairs])
            for (master, _), view in zip(pairs, views, strict=True):
                master.grad = view
            grads += views
        return check_and_unscale_(grads, inv_scale, self._device())

    def after_cast(self) -> None:
        """Remember the cast weights' versions (the sharded version re-lays the weights out)."""
        self._record_weights()

    def _record_weights(self) -> None:
        self.weight_versions = [
            p._version if s else -1 for p, s in zip(self.model_params, self.separate, strict=True)
        ]

    def take_written_weights(self, names: dict[int, str] | None = None) -> None:
        """See [Note: weights written after wrap] in base.py. A weight whose shape changed
        (``.data`` replaced by a larger tensor: Hugging Face's ``resize_token_embeddings``) is
        refused by name: it failed in a reshape deep inside ("shape '[64, 32]' is invalid for
        input of size 2560", an audit), where sharded masters name it."""
        for i, (p, m, s) in enumerate(
            zip(self.model_params, self.masters, self.separate, strict=True)
        ):
            if s and p.shape != m.shape:
                raise ValueError(
                    f"parameter {(names or {}).get(id(p), f'<param {i}>')!r} has shape "
                    f"{tuple(p.shape)}, its FP32 master {tuple(m.shape)}: its storage was "
                    "replaced after distamp.wrap (an assignment to .data; Hugging Face's "
                    "resize_token_embeddings). Expected such changes before distamp.wrap: resize "
                    "the model first, then wrap it"
                )
        if len(self.weight_versions) == len(self.model_params):  # (a group added since: new)
            for p, s, version in zip(
                self.model_params, self.separate, self.weight_versions, strict=True
            ):
                if s and p._version != version:
                    self.load_value(p, p.detach(), written=True)
            self._take_writes_through_data()
        self._record_weights()

    def _take_writes_through_data(self) -> None:
        """See [Note: writes through .data] in base.py. The sampled views are made once (per
        storage) and compared with one ``cat`` per device and dtype and one host read: made per
        parameter at every step they cost ~40 us a parameter, a fifth of an O2 step over 1,600
        small tensors (an audit)."""
        groups = self._sample_views()
        if not groups:
            return
        with torch.no_grad():
            differs = [
                written_through_data(
                    torch.cat(g.weights), torch.cat(g.masters).to(g.weights[0].device)
                )
                for g in groups
            ]
            anywhere = torch.stack([d.any().to(groups[0].weights[0].device) for d in differs])
        if not bool(anywhere.any()):
            return
        for group, differ in zip(groups, differs, strict=True):
            at = 0
            for p, w in zip(group.params, group.weights, strict=True):
                if bool(differ[at : at + w.numel()].any()):
                    self.load_value(p, p.detach(), written=True)
                at += w.numel()

    def _sample_views(self) -> list[_Samples]:
        """The cached sampled views of each separate, strided weight and its master, by the
        weight's device and dtype and the master's device."""
        pairs = [
            (p, m)
            for p, m, s in zip(self.model_params, self.masters, self.separate, strict=True)
            if s
        ]
        key = tuple(t.data_ptr() for pair in pairs for t in pair)
        if key == self._samples[0]:
            return self._samples[1]
        by_kind: dict[tuple[torch.device, torch.dtype, torch.device], _Samples] = {}
        for p, m in pairs:
            if not (p.numel() and p.layout == torch.strided):
                continue
            flat = _in_memory_order(p.detach(), m.detach())
            if flat is None:
                continue
            group = by_kind.setdefault((p.device, p.dtype, m.device), _Samples([], [], []))
            group.params.append(p)
            group.weights.append(strided_sample(flat[0]))
            group.masters.append(strided_sample(flat[1]))
        self._samples = (key, list(by_kind.values()))
        return self._samples[1]

    def replica_fingerprint(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> torch.Tensor | None:
        """``[0, 0, hg, -hg, hl, -hl]`` (the layout of ``ShardedMasterParams.
        replica_fingerprint``, no weights to compare; ``hl``: see :meth:`take_load_hash`):
        ``hg`` hashes the first values of every model gradient, identical on
        every rank once DDP's all-reduce made them. A DDP built before wrap (O2/O3 cast the
        weights in place: DDP's gradient hooks, on the FP32 weights, never fired), over another
        group than wrap's, or none at all left each rank stepping its own gradients and the
        replicas drifted apart, silently (an audit: 4.4e-2 after 3 steps). None when no weight
        is cast (O0, O1) unless ``hooked``: DDP built before wrap works there, and ranks that
        train apart without DDP are plain torch's semantics, as they are for an uncast model;
        but a DDP given to ``distamp.hooks.register`` over wrap's ranks reduces every gradient,
        so one it does not reduce (frozen when DDP was built, trained later) is refused there
        too (an audit: the ranks parted by 4e-2 in two steps at O0/O1, silently). ``ignored``:
        the parameters DDP was told to leave alone (see ``ScalerGroup.ddp_ignored``);
        ``hooked``: those of such DDPs (``ScalerGroup.hooked_params``)."""
        if not hooked and not self._cast():
            return None
        sampled = grad_samples(self.grads_compared(ignored, hooked=hooked))
        device = next((t.device for t in sampled), torch.device("cpu"))
        loads = self.take_load_hash(ignored, device)  # see [Note: a load on some ranks only]
        return torch.cat([torch.zeros(2, device=device), bit_hash(sampled, device), loads])

    def grads_compared(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> list[nn.Parameter]:
        """The parameters whose gradients :meth:`replica_fingerprint` compares between ranks:
        all but ``ignored`` where weights are cast, else those of ``hooked``."""
        cast = self._cast()
        return [p for p in self.model_params if id(p) not in ignored and (cast or id(p) in hooked)]

    def _cast(self) -> bool:
        """Is any weight this optimizer steps in a half dtype (O2/O3)?"""
        return any(p.dtype in HALF_DTYPES for p in self.model_params)

    def step_grads(self) -> list[torch.Tensor]:
        """The unscaled gradients the inner optimizer steps."""
        grads = [
            m.grad if s else p.grad
            for p, m, s in zip(self.model_params, self.masters, self.separate, strict=True)
        ]
        return [g for g in grads if g is not None]

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip :meth:`step_grads` to ``max_norm``; no collective: the reduced gradients (and so
        their norm) are identical on every rank."""
        grads = self.step_grads()
        if not grads:
            return torch.tensor(0.0)
        # torch's own norm, so a script clipping with torch.nn.utils.clip_grad_norm_ (apex's
        # recipe, on amp.master_params) and one using distamp.clip_grad_norm_ agree bit for bit.
        total = torch.nn.utils.get_total_norm(norm_operands(grads), norm_type)
        scale_to_max_norm_(grads, total, max_norm)
        return total

    def master_tensors(self) -> list[torch.Tensor]:
        """The tensors a state dict saves as masters (the separate FP32 copies)."""
        return [m for m, s in zip(self.masters, self.separate, strict=True) if s]

    def load_value(
        self, param: nn.Parameter, value: torch.Tensor, *, written: bool = False
    ) -> None:
        """See [Note: loading weights into the masters] and [Note: weights written after wrap]."""
        index = self._index().get(id(param))
        if index is None or not self.separate[index]:
            return
        if not written and self.own_weight_back(param, value):
            return
        master = self.masters[index]
        with torch.no_grad():
            merged = merge_loaded(master, value.to(master.device), param.dtype, written=written)
            master.copy_(merged)

    def _index(self) -> dict[int, int]:
        """id(model parameter) -> its position (rebuilt when a group is added)."""
        cached: dict[int, int] | None = getattr(self, "_position", None)
        if cached is None or len(cached) != len(self.model_params):
            cached = {id(p): i for i, p in enumerate(self.model_params)}
            self._position = cached
        return cached

    def state_key(self, key: torch.Tensor, names: dict[int, str]) -> torch.Tensor:
        """A model parameter's FP32 master, whose state the optimizer keeps."""
        index = self._index().get(id(key))
        return self.masters[index] if index is not None and self.separate[index] else key

    def separate_params(self) -> list[nn.Parameter]:
        return [p for p, s in zip(self.model_params, self.separate, strict=True) if s]

    def reload_master_grads(self, params: list[nn.Parameter]) -> None:
        index = self._index()
        for param in params:
            master = self.masters[index[id(param)]]
            master.grad = None if param.grad is None else param.grad.detach().to(torch.float32)

    def add_group(
        self, params: list[nn.Parameter], *, fp32_masters: bool = True
    ) -> list[torch.Tensor]:
        """Masters for a param group added after wrap: FP32 copies of the half parameters
        (``fp32_masters=False``, O3: none, the half parameters are stepped themselves). Their
        versions are recorded as the masters are made: left out, the next step's check of
        weights written after wrap skipped every parameter, and a write between
        ``add_param_group`` and that step was undone (an audit: progressive unfreezing)."""
        out: list[torch.Tensor] = []
        recorded = len(self.weight_versions) == len(self.model_params)
        for param in params:
            master: torch.Tensor = param
            if fp32_masters and param.dtype in HALF_DTYPES:
                master = param.detach().to(torch.float32)
                master.requires_grad_(True)
            self.model_params.append(param)
            self.masters.append(master)
            self.separate.append(master is not param)
            if recorded:
                self.weight_versions.append(param._version if master is not param else -1)
            out.append(master)
        return out

    def copy_to_model(self, *, after_step: bool = False) -> None:
        """Refresh the half model weights from the masters after a step."""
        pairs = [(p, m) for p, m, s in zip(*self.columns(), strict=True) if s]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        self._record_weights()

    def release_master_grads(self) -> None:
        for master, separate in zip(self.masters, self.separate, strict=True):
            if separate:
                master.grad = None
        self.exposed = {}  # the model gradients unscale_ exposed are gone with them

    def master_bytes(self) -> int:
        return sum(
            m.numel() * m.element_size()
            for m, s in zip(self.masters, self.separate, strict=True)
            if s
        )

    def columns(self) -> tuple[list[nn.Parameter], list[torch.Tensor], list[bool]]:
        """(model params, masters, whether each master is a separate FP32 copy)."""
        return self.model_params, self.masters, self.separate
