"""What every kind of masters shares: the interface the step needs, the model side of the grads.

:class:`MasterWeights` is what :class:`~distamp.masters.optimizer.AmpOptimizer` and the loss scaler
call; :class:`ModelGrads` implements its model-side half (the model's ``.grad``: the non-finite
check that only reads, zeroing, the unscaled view ``unscale_`` leaves for torch's clipping). The
replicated masters (``replicated.py``), the sharded ones (``sharded.py``) and FSDP's
(``distamp/fsdp.py``) build on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Protocol

import torch
from torch import nn

from .nonfinite import nonfinite_each, nonfinite_flag


class MasterWeights(Protocol):
    """What the optimizer and the scaler need from its masters, replicated or sharded."""

    sharded: bool
    fsdp: bool
    model_params: list[nn.Parameter]
    restored: bool
    loads: tuple[tuple[nn.Parameter, torch.Tensor], ...]
    blocks_open: int

    @property
    def reduced(self) -> AbstractSet[int]: ...

    def take_fresh_reductions(self) -> AbstractSet[int]: ...

    def after_cast(self) -> None: ...
    def model_grads(self) -> list[torch.Tensor | None]: ...
    def unscale_and_check(self, inv_scale: float) -> torch.Tensor: ...
    def check_views(self, names: dict[int, str]) -> None: ...
    def check(self) -> torch.Tensor: ...
    def check_each(self) -> torch.Tensor: ...
    def step_grads(self) -> list[torch.Tensor]: ...
    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor: ...
    def copy_to_model(self, *, after_step: bool = False) -> None: ...
    def release_master_grads(self) -> None: ...
    def zero_model_grads(self, set_to_none: bool) -> None: ...
    def rescale_grads_(self, factor: float) -> None: ...
    def master_bytes(self) -> int: ...
    def master_tensors(self) -> list[torch.Tensor]: ...
    def named_grads(self, names: dict[int, str]) -> list[tuple[str, torch.Tensor | None]]: ...
    def reduced_grads(self, names: dict[int, str]) -> list[tuple[str, torch.Tensor | None]]: ...
    def n_reduced_grads(self) -> int: ...
    def expose_unscaled(self, inv_scale: float) -> None: ...
    def expose_clipped(self, coef: torch.Tensor) -> None: ...
    def separate_params(self) -> list[nn.Parameter]: ...
    def take_modified_model_grads(self) -> list[nn.Parameter]: ...
    def shard_grad_versions(self) -> list[tuple[int, int] | None]: ...
    def shard_grad_sample(self) -> torch.Tensor | None: ...
    def scaled_grad_sample(self) -> torch.Tensor | None: ...
    def take_written_weights(self, names: dict[int, str] | None = None) -> None: ...
    def replica_fingerprint(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> torch.Tensor | None: ...
    def grads_compared(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> list[nn.Parameter]: ...
    def add_group(
        self, params: list[nn.Parameter], *, fp32_masters: bool = True
    ) -> list[torch.Tensor]: ...
    def before_backward(self) -> None: ...
    def note_load(self, param: nn.Parameter, value: torch.Tensor) -> None: ...
    def load_value(
        self, param: nn.Parameter, value: torch.Tensor, *, written: bool = False
    ) -> None: ...
    def state_key(self, key: torch.Tensor, names: dict[int, str]) -> torch.Tensor: ...


class ModelGrads:
    """What replicated and sharded masters share: the model side of the gradients."""

    model_params: list[nn.Parameter]
    fsdp = False
    """FSDP's sharded parameters are their own masters (distamp/fsdp.py): the messages differ."""
    restored = False
    """The optimizer restored the masters (``load_state_dict``, ``load_checkpoint``) since the
    last step: see [Note: loading weights into the masters]."""
    reduced: AbstractSet[int] = frozenset()
    """ids of the parameters a reduce-scatter hook summed into shards this step (sharded.py)."""
    loads: tuple[tuple[nn.Parameter, torch.Tensor], ...] = ()
    """(parameter, a sample of the value) of each ``load_state_dict`` into a weight with an FP32
    master since the last skip decision: see [Note: a load on some ranks only]."""
    blocks_open = 0
    """``scale_loss`` blocks of this optimizer open now: a backward outside them is a framework's
    (see [Note: a backward distamp does not see] in hooks/zero.py)."""

    def state_key(self, key: torch.Tensor, names: dict[int, str]) -> torch.Tensor:
        """The optimizer-state key a lookup by ``key`` stands for (see [Note: optimizer.state
        read by a model parameter] in optimizer.py): ``key`` itself here (FSDP's parameters
        are their own masters)."""
        return key

    def release_master_grads(self) -> None:
        raise NotImplementedError

    def note_load(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """[Note: a load on some ranks only] ``model.load_state_dict(pretrained)`` on rank 0
        only, after DDP was built (DDP broadcasts when it is built, not after), or after wrap on
        rank 0 with DDP's broadcast to bring it to the others: in plain torch the ranks part
        (or are mended by DDP); here each rank took its own value into its masters, and sharded
        masters then stitched rank 0's loaded pieces to the others' initial ones, the ranks
        identical and the model a silent mixture (an audit: 106 of 128 elements pretrained).
        A sample of each loaded value goes into the next skip decision's all-reduce (two more
        numbers), where ranks that loaded differently raise together, naming the weights."""
        sample = strided_sample(value.detach().reshape(-1)).float().to(param.device)
        self.loads = (*self.loads, (param, sample.clone()))

    def take_load_hash(self, ignored: AbstractSet[int], device: torch.device) -> torch.Tensor:
        """``[h, -h]`` of the loads since the last call (see :meth:`note_load`), which it
        forgets; the parameters DDP leaves alone (``ignored``) may differ between ranks."""
        samples = [sample for p, sample in self.loads if id(p) not in ignored]
        self.loads = ()
        return bit_hash([t.to(device) for t in samples], device)

    def before_backward(self) -> None:
        """Called as a ``scale_loss`` block begins (FSDP's masters refresh its units' dtypes)."""

    def scaled_grad_sample(self) -> torch.Tensor | None:
        """What else than version counters tells that the gradients were written between a
        scale_loss block and step() (see [Note: scaled gradients touched before step()]): nothing
        for plain tensors, whose counters every in-place write moves."""
        return None

    def model_grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.model_params]

    def check(self) -> torch.Tensor:
        """A 0/1 flag: does any model gradient hold inf/NaN? (Reads only.)"""
        return nonfinite_flag([g for g in self.model_grads() if g is not None], self._device())

    def check_each(self) -> torch.Tensor:
        """One 0/1 flag per model parameter: does its gradient hold inf/NaN? (Reads only.)"""
        return nonfinite_each(self.model_grads(), self._device())

    def zero_model_grads(self, set_to_none: bool) -> None:
        for param in self.model_params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:  # as torch's zero_grad: a DDP bucket view cannot be detached in place
                if param.grad.grad_fn is not None:
                    param.grad.detach_()
                else:
                    param.grad.requires_grad_(False)
                param.grad.zero_()
        self.release_master_grads()

    def check_views(self, names: dict[int, str]) -> None:
        """Raise if a model parameter no longer shares the storage the masters write into (only
        sharded masters keep the weights as views: see ``ShardedMasterParams.check_views``)."""

    def rescale_grads_(self, factor: float) -> None:
        grads = [p.grad for p in self.model_params if p.grad is not None]
        if grads and factor != 1.0:
            with torch.no_grad():
                torch._foreach_mul_(grads, factor)

    def named_grads(self, names: dict[int, str]) -> list[tuple[str, torch.Tensor | None]]:
        return [(names.get(id(p), f"<param {i}>"), p.grad) for i, p in enumerate(self.model_params)]

    def reduced_grads(self, names: dict[int, str]) -> list[tuple[str, torch.Tensor | None]]:
        """Gradients a reduce-scatter hook summed into shards (sharded.py); none here."""
        return []

    def n_reduced_grads(self) -> int:
        return 0

    def take_fresh_reductions(self) -> AbstractSet[int]:
        """ids a reduce-scatter hook reduced since the last call (sharded.py); none here."""
        return frozenset()

    def shard_grad_versions(self) -> list[tuple[int, int] | None]:
        """grad_version of each tensor the optimizer steps that is a shard, not a whole
        parameter (see [Note: clipping what param_groups hold] in sharded.py); none here."""
        return []

    def replica_fingerprint(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> torch.Tensor | None:
        """See [Note: clipping what param_groups hold] in sharded.py; None: nothing to compare."""
        return None

    def grads_compared(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> list[nn.Parameter]:
        """The parameters whose gradients :meth:`replica_fingerprint` compares between ranks."""
        return []

    def shard_grad_sample(self) -> torch.Tensor | None:
        """See [Note: clipping what param_groups hold] in sharded.py; None: no shards here."""
        return None

    def take_written_weights(self, names: dict[int, str] | None = None) -> None:
        """See [Note: weights written after wrap]: no separate masters here, nothing to take."""

    # -- the model's gradients after unscale_ (torch.amp's clipping habit) -------------------------

    def separate_params(self) -> list[nn.Parameter]:
        """Model parameters whose gradient is copied into a separate FP32 master gradient."""
        return []

    def expose_unscaled(self, inv_scale: float) -> None:
        """After a public ``unscale_``: the model's half gradients hold unscaled values too.

        [Note: unscale_ then torch's clip_grad_norm_] torch.amp's habit is ``scaler.unscale_(opt);
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); scaler.step(opt)``. Under O2 the
        optimizer steps FP32 master gradients, so clipping the model's ``.grad`` would do nothing
        and measure a norm ``scale`` times too large. So ``unscale_`` unscales the model's half
        gradients as well (a power-of-two multiply: exact in BF16; in FP16 values below its range
        flush towards zero, as they would in torch.amp), records each one's version counter, and
        ``step()`` (and ``distamp.clip_grad_norm_``) re-reads the master gradient of every
        parameter whose ``.grad`` was modified, replaced or removed since. Untouched gradients keep
        their exact FP32 master values. ``step()`` without ``unscale_`` never pays for this.
        """
        params = [p for p in self.separate_params() if p.grad is not None]
        with torch.no_grad():
            dense = [p.grad for p in params if p.grad is not None and not p.grad.is_sparse]
            if dense and inv_scale != 1.0:
                torch._foreach_mul_(dense, inv_scale)
            for p in params:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad.mul_(inv_scale)
        params = self.separate_params()
        self.exposed = dict(zip(map(id, params), grad_versions(params), strict=True))

    def expose_clipped(self, coef: torch.Tensor) -> None:
        """After ``distamp.clip_grad_norm_`` on gradients :meth:`expose_unscaled` exposed: the
        model's gradients take the clip too, and their versions are recorded again, so an edit
        after the clip (a pruning mask, a frozen row zeroed) is re-read at ``step()`` as one
        after ``unscale_`` is (an audit: the clip forgot the exposure and such edits were
        dropped, silently)."""
        params = [p for p in self.separate_params() if p.grad is not None]
        with torch.no_grad():
            dense = [p.grad for p in params if p.grad is not None and not p.grad.is_sparse]
            if dense:
                torch._foreach_mul_(dense, coef.to(dense[0].device))
            for p in params:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad.mul_(coef.to(p.grad.device))
        params = self.separate_params()
        self.exposed = dict(zip(map(id, params), grad_versions(params), strict=True))

    def take_modified_model_grads(self) -> list[nn.Parameter]:
        """See [Note: unscale_ then torch's clip_grad_norm_]: re-read modified model gradients;
        returns the parameters whose gradients were."""
        exposed = getattr(self, "exposed", None)
        if not exposed:
            return []
        self.exposed = {}
        params = self.separate_params()
        changed = [
            p
            for p, version in zip(params, grad_versions(params), strict=True)
            if exposed.get(id(p)) != version
        ]
        if changed:
            self.reload_master_grads(changed)
        return changed

    def reload_master_grads(self, params: list[nn.Parameter]) -> None:
        """Master gradients of ``params`` from their (already unscaled) model gradients."""
        raise NotImplementedError

    def add_group(
        self, params: list[nn.Parameter], *, fp32_masters: bool = True
    ) -> list[torch.Tensor]:
        """The tensors the inner optimizer steps for a new param group of model ``params``."""
        raise ValueError(
            "optimizer.add_param_group: expected an optimizer wrapped by distamp.wrap; this one "
            f"keeps its masters in {type(self).__name__}, which cannot add parameters after wrap"
        )

    def load_value(
        self, param: nn.Parameter, value: torch.Tensor, *, written: bool = False
    ) -> None:
        """A value loaded into ``param`` (``load_state_dict``; ``written``: written in place, see
        [Note: weights written after wrap]) reaches its FP32 master, if any."""

    def own_weight_back(self, param: nn.Parameter, value: torch.Tensor) -> bool:
        """Is ``value``, loaded into ``param``, this model's own weight coming back after the
        optimizer restored the masters?

        [Note: loading weights into the masters] Weights loaded into an O2 model after wrap (a
        pretrained FP32 checkpoint, into the model or any submodule) must reach the FP32 masters
        unrounded, or the next step writes the old weights back. But a state dict of this very model
        holds only the half weights (or apex's FP32 copies of them), and loading it after the optimizer
        (``optimizer.load_state_dict`` first, which writes the restored masters rounded into the
        model, then ``model.load_state_dict``) must not round the exact masters just restored. So a
        load keeps the masters only when the optimizer restored them since the last step and the
        loaded tensor equals the model's current weight everywhere; any other load replaces the
        masters of that weight whole and exactly. It used to be decided element by element (a
        loaded value equal to the master rounded kept the master), and an audit loaded a pretrained
        checkpoint bf16 represents exactly (a model released in bf16) again after a few small
        steps: every value those steps had moved by less than half a bf16 step kept its trained
        master (251 of 256). Whole weights, which every rank holds, also make sharded masters
        decide alike on every rank.
        """
        if not self.restored:
            return False
        value = value.detach()
        return value.shape == param.shape and torch.equal(value.float(), param.detach().float())

    def _device(self) -> torch.device:
        for param in self.model_params:
            return param.device
        return torch.device("cpu")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer state), or the
    tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def any_nonzero(grads: list[torch.Tensor]) -> bool:
    """Whether any of ``grads`` (dense, sparse COO, or DTensors' local shards) holds a non-zero
    value: one host read for all of them."""
    flags = []
    for grad in grads:
        grad = local_tensor(grad)
        values = grad.coalesce()._values() if grad.is_sparse else grad
        flags.append(values.ne(0).any())
    if not flags:
        return False
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).any())


@torch.compiler.disable  # a host-side read: traced, one recompile per parameter (an audit:
def grad_versions(  # Dynamo's recompile limit); one entry through its wrapper per list, ~1.6 us
    params: Iterable[torch.Tensor],  # each: per parameter, ~5 ms of a step over 3,000 (an audit)
) -> list[tuple[int, int] | None]:
    """Identity and version counter of each parameter's ``.grad`` (None where it has none)."""
    out: list[tuple[int, int] | None] = []
    for param in params:
        grad = param.grad
        out.append(None if grad is None else (id(grad), grad._version))
    return out


def grad_samples(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The first few values of every parameter's gradient (views in its dtype, which
    :func:`bit_hash` widens once; zeros for none, or a sparse one, whose rows come in any order):
    what must be identical on every rank after DDP's all-reduce, for the skip decision's
    all-reduce to compare (see ``ShardedMasterParams.replica_fingerprint``)."""
    out = []
    for p in params:
        g = p.grad
        if g is None or g.layout != torch.strided:
            out.append(torch.zeros(min(4, p.numel()), device=p.device))
        else:
            out.append(local_tensor(g).reshape(-1)[:4])  # (a DTensor's: its own shard's)
    return out


def bit_hash(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[h, -h]``, a hash of the bits of ``tensors`` (as float32); zeros for none."""
    if not tensors:
        return torch.zeros(2, dtype=torch.float32, device=device)
    with torch.no_grad():
        # one cat (promoting a mix of dtypes to FP32 exactly), one widening: not one per tensor
        bits = torch.cat(tensors).float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        position = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        # The sign and exponent folded into the low 23 bits by an odd factor: multiplied as
        # they were, they vanished modulo 2**23, and gradients 2x or -1x another rank's hashed
        # the same (an audit: ranks parted silently). int64 arithmetic wraps the same way on
        # every rank; 23 bits are exact in float32.
        mixed = (bits & 0x7FFFFF) + 8191 * (bits >> 23)
        h = torch.remainder((mixed * (2 * position + 1)).sum(), 1 << 23).to(torch.float32)
    return torch.stack([h, -h])


WRITE_SAMPLES = 32
"""Values of each weight (of each piece a rank holds, when sharded) compared with its master at
every step: see [Note: writes through .data]."""


def written_through_data(weights: torch.Tensor, masters: torch.Tensor) -> torch.Tensor:
    """Which sampled ``weights`` differ from their ``masters`` rounded to the weights' dtype
    (NaN equals NaN): a bool tensor.

    [Note: writes through .data] ``p.data.clamp_(-c, c)`` after ``optimizer.step()`` (WGAN's
    weight clipping, the apex-era habit), ``p.data.copy_(averaged)``, ``emb.weight.data[pad]
    .zero_()``: ``.data`` is a tensor with a version counter of its own, so these writes do not
    move the parameter's counter that [Note: weights written after wrap] reads, and the masters
    wrote the old values back at the next step: the model's weights looked clipped while the
    FP32 masters, which are what trains, grew without bound (an audit: 1.6 after 3 steps of a
    0.01 clip), silently. So every step also compares a sample of each weight with its master
    rounded (:data:`WRITE_SAMPLES` values, strided over the weight: a clip or copy changes most
    of them; a write of a few elements between the samples is still missed) and merges a
    weight whose sample differs element by element, as a counted write. With 16-bit updates of
    FP32 weights the owner takes the weights plus the rounded updates as its master, so there
    too the two are equal once the step's gather has landed (an audit: that mode was left out,
    and a clamp never reached the masters)."""
    with torch.no_grad():
        rounded = masters.to(weights.dtype)
        return (weights != rounded) & ~(torch.isnan(weights) & torch.isnan(rounded))


def strided_sample(flat: torch.Tensor) -> torch.Tensor:
    """At most :data:`WRITE_SAMPLES` values of the 1-D ``flat``, evenly strided (a view)."""
    step = max(1, flat.numel() // WRITE_SAMPLES)
    return flat[::step][:WRITE_SAMPLES]


# Never traced: a compiled ``optimizer.step`` (torch's recipe) let Inductor fold the round trip
# ``master.to(half).to(value.dtype)`` away, every element then compared as written and the FP32
# masters were replaced by the half weights each step, silently (an audit).
@torch.compiler.disable
def merge_loaded(
    master: torch.Tensor, value: torch.Tensor, half: torch.dtype, *, written: bool
) -> torch.Tensor:
    """The master after ``value`` was loaded into its half parameter (``written``: written in
    place; else loaded by ``load_state_dict``, which already left the model's own weights out:
    see ``ModelGrads.own_weight_back``).

    [Note: weights written after wrap] The same holds for weights written in place after wrap
    without load_state_dict: a classifier head re-initialized (``nn.init.zeros_``,
    ``reset_parameters()``), a LoRA merged into its base weight, ``weight.copy_(...)``. The masters
    would write the old values back at the next step (apex's O2 did; an audit found the writes
    undone). So the masters remember the version counter of every half weight (of each group's
    flat buffer, when sharded) after their own last write, and ``step()`` (and a checkpoint's
    save) first merges any weight whose counter moved, element by element: a write may touch
    part of a weight (a new token's embedding row), so values that still equal the master
    rounded keep it, the others replace it.
    """
    value = value.detach().reshape(master.shape)
    if not written:
        return value.to(master.dtype)
    own_weight = value == master.to(half).to(value.dtype)
    return torch.where(own_weight, master, value.to(master.dtype))
