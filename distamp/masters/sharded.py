"""Sharded FP32 master weights (ZeRO stage 1): each rank holds and steps 1/N of the masters.

[Note: flat padded shards] For each param group, the parameters that are cast to the half dtype
are laid end to end in one flat buffer (in ``param_groups`` order, identical on every rank), padded
to a multiple of the world size, and cut into N equal shards of S elements; a parameter may
straddle shards (DeepSpeed/Megatron do the same). Which elements rank r owns is set by [Note:
block-cyclic shards]: blocks of every stretch of the buffer, not one contiguous range, so every
DDP bucket has a part on every rank. A rank holds the FP32 masters and the optimizer state of
exactly what it owns, as one flat tensor per group, so any element-wise ``torch.optim`` optimizer
(SGD, Adam/AdamW, Adagrad, RMSprop, ...) steps it unchanged and keeps its per-group
lr/weight_decay. Parameters that stay FP32 (normalization layers under O2) are few and small: they
stay whole and replicated, stepped identically on every rank. Frozen parameters
(``requires_grad=False``) are left out.

[Note: gradient path] Without a comm hook the gradients reach the shard through DDP's all-reduce
and a local slice: it works with any DDP configuration. With ``distamp.hooks.register(...,
reduce_scatter=True)`` the hook reduce-scatters each bucket straight into the owners' FP32 shard
gradients (see [Note: reduce-scatter into the shards] in hooks/zero.py): Megatron's reduce-scatter
+ all-gather, the bytes of one all-reduce per step instead of 1.5x, built from gloo's all-to-all
because gloo's own reduce_scatter is slower than its all-reduce (measured in
benchmarks/sharded_optimizer.py). After the step, the updated shard is cast to the half dtype and
one all-gather per block writes every rank's blocks into the model's weights, which are views into
a flat half buffer, so nothing is copied after the gather; with ``overlap_gather=True`` the next
forward waits for them module by module (see [Note: the gather overlaps the next forward]).

[Note: sharded FP32 weights] O0 and O1 keep the model's weights FP32, so apex gives them no
masters. ``shard_master_weights=True`` shards them anyway (ZeRO-1 for FP32 training, off unless
asked for): the same layout and gradient path, with the FP32 weights themselves in the flat buffer
(``flat_half`` is FP32 then). Each rank holds the FP32 copy and the optimizer state of its shard
and steps only that (the optimizer's work and state are 1/N); the updated shard is all-gathered
straight from the masters, exactly, so every rank holds the same FP32 weights. The gather moves
FP32 — twice the bytes of a half one — so over a slow link this saves memory and optimizer time,
not wire time; with a 16-bit reduce-scatter (``hooks.register(..., reduce_scatter=True)``) a step
moves 1.5x the bytes of a 16-bit all-reduce.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import all_reduce_
from ..config import HALF_DTYPES
from .base import (
    WRITE_SAMPLES,
    ModelGrads,
    bit_hash,
    grad_samples,
    grad_versions,
    merge_loaded,
    written_through_data,
)
from .clipping import norm_part, scale_to_max_norm_, total_norm
from .gather import WeightGather
from .layout import BLOCK, GroupLayout, Interval, ParamRange, slice_state
from .nonfinite import check_and_unscale_, nonfinite_flag


class ShardedMasterParams(WeightGather, ModelGrads):
    """The FP32 master shards of one optimizer; the interface of ``replicated.MasterParams``."""

    sharded = True

    def __init__(
        self,
        replicated: list[nn.Parameter],
        process_group: dist.ProcessGroup | None,
        *,
        fp32_weights: bool = False,
    ) -> None:
        self.fp32_weights = fp32_weights
        """The model's weights are FP32 and are what is sharded (O0/O1, see [Note: sharded FP32
        weights]); else they are half and the shards are their FP32 masters (O2)."""
        self.groups: list[GroupLayout] = []
        self.shards: list[torch.Tensor] = []
        """Per group, this rank's flat FP32 masters (the chunks share their storage)."""
        self.chunks: list[list[torch.Tensor]] = []
        """Per group, the leaf tensors the inner optimizer steps: slices of the shard."""
        self.shard_grads: list[torch.Tensor | None] = []
        self.replicated = replicated
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world = dist.get_world_size(process_group) if process_group is not None else 1
        self.model_params: list[nn.Parameter] = list(replicated)
        self.cast_flags: list[list[bool]] = []
        """Per optimizer group, in its parameters' original order: sharded (True) or stepped
        whole; what :meth:`shard_whole_state` needs to read a whole state dict."""
        self.grad_buffer: torch.Tensor | None = None
        """With distamp's reduce-scatter hook: every group's FP32 shard gradient, one persistent
        buffer (see [Note: reduce-scatter into the shards])."""
        self.grad_offsets: list[int] = []
        """Where each group's shard gradient starts in ``grad_buffer``."""
        self.reduced: set[int] = set()
        """ids of the parameters whose shard gradient the hook wrote since the last step."""
        self.fresh: set[int] = set()
        """Those of ``reduced`` written since :meth:`take_fresh_reductions` (a block's end)."""
        self.block = BLOCK
        """Elements per block of every group's shard ([Note: block-cyclic shards])."""
        self.write_samples: dict[int, tuple[tuple[int, int], tuple[torch.Tensor, ...]]] = {}
        """Per group: (the layout it was made for, the sampled positions of
        :meth:`_write_samples`)."""
        self.overlap_gather = False
        """Set by ``hooks.register(..., overlap_gather=True)``: see [Note: the gather overlaps
        the next forward]."""
        self.left_in_flight = False
        """A step's gather was left to land during the next forward (see
        :meth:`_reattach_copies`)."""
        self.waiters: list[Any] = []
        """The handles of the forward pre-hooks that wait for the gather (see
        :meth:`~distamp.masters.gather.WeightGather.end_gather`)."""
        self.copied_in_flight: set[int] = set()
        """ids of the weights found replaced (``.data = ...``) when such a gather was finished:
        taken while it was in flight, they are refused (see :meth:`_reattach_copies`)."""
        self.update_dtype: torch.dtype | None = None
        """Set by ``hooks.register(..., gather_dtype=torch.bfloat16)`` with FP32 weights: see
        [Note: 16-bit updates of FP32 weights]."""
        self.pending_updates = False
        """The gathers in flight carry updates (added to the weights as each round arrives)."""
        self.watched_groups = 0
        """Groups whose modules wait in forward (a group added later is gathered at once)."""
        self.pending: list[list[Any]] = []
        """Per group, the all-gather works of the last step not waited for yet, one per round."""
        self.waited: list[int] = []
        """Per group, how many rounds of ``pending`` have been waited for."""
        self.gather_lock = threading.RLock()
        """Held while waiting for (and applying) gathered rounds, and while a gather's rounds
        are started: forwards in several threads wait together (see
        ``WeightGather.wait_rounds``), and none finishes a gather still being started."""
        self.launching = False
        """Between ``begin_gather`` and ``end_gather``: see ``WeightGather.finish_gather``."""
        self.staging: torch.Tensor | None = None
        """Bytes shared by the 16-bit updates and the reduce-scatter hook: see [Note: one staging
        buffer for the two halves]."""
        self.staging_hooks = 0
        """Reduce-scatter hooks registered on these masters (the staging is shared with one)."""
        """ids of the parameters the DDP model of a reduce-scatter hook ignores (not reduced)."""

    @classmethod
    def take(
        cls,
        optimizer: torch.optim.Optimizer,
        cast_ids: set[int] | frozenset[int],
        process_group: dist.ProcessGroup | None,
        *,
        fp32_weights: bool = False,
    ) -> ShardedMasterParams:
        """Replace each group's cast parameters by this rank's flat FP32 shard of them.

        Must run before the model is cast, so the masters hold the exact FP32 values. Frozen
        parameters are sharded too (see ``MasterParams.take``); optimizer state that exists
        already (Adagrad creates its sums in its constructor) is cut into the slices.
        ``fp32_weights``: ``cast_ids`` are FP32 weights that stay FP32 (O0/O1).
        """
        out = cls([], process_group, fp32_weights=fp32_weights)
        for param_group in optimizer.param_groups:
            params = list(param_group["params"])
            sharded = [p for p in params if id(p) in cast_ids]
            kept = [p for p in params if id(p) not in cast_ids]
            states = [optimizer.state.pop(p, {}) for p in sharded]
            chunks = out._new_group(sharded, states, optimizer)
            out.cast_flags.append([id(p) in cast_ids for p in params])
            out.replicated += kept
            param_group["params"] = [*chunks, *kept]
            if "param_names" in param_group:  # torch's named optimizers: one name per tensor
                named = dict(zip(map(id, params), param_group["param_names"], strict=True))
                param_group["param_names"] = out.slice_names(named)
        out.model_params = [p for g in out.groups for p in g.params] + out.replicated
        return out

    def shard_whole_state(
        self, state_dict: dict[str, Any], masters: list[torch.Tensor], current: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """[Note: a whole state dict loaded into shards] ``optimizer.state_dict()`` of replicated
        masters (saved at one rank, or with ``shard_master_weights=False``) holds every FP32
        master (O0/O1: the model's weights are) and every parameter's whole state: this rank's
        shard of them is cut here, as
        ``take`` cuts an optimizer's state at wrap (nanoGPT trained on one GPU and resumed on
        N: refused before, an audit). Returns the inner state dict in this layout and the shards,
        or None when ``state_dict`` is not a whole state of this layout (the usual checks then
        say why). ``current``: the optimizer's param_groups (for their ``param_names``)."""
        groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(saved_state, dict):
            return None
        if len(groups) != len(self.groups) or len(self.cast_flags) != len(self.groups):
            return None
        if len(masters) != sum(len(layout.params) for layout in self.groups):
            return None
        out_groups: list[dict[str, Any]] = []
        out_state: dict[int, Any] = {}
        shards: list[torch.Tensor] = []
        used = next_id = 0
        layouts = zip(self.groups, self.cast_flags, groups, strict=True)
        for g, (layout, flags, saved) in enumerate(layouts):
            ids = list(saved.get("params", ()))
            if len(ids) != len(flags) or sum(flags) != len(layout.params):
                return None
            cast = [i for i, f in zip(ids, flags, strict=True) if f]
            kept = [i for i, f in zip(ids, flags, strict=True) if not f]
            whole = masters[used : used + len(cast)]
            used += len(cast)
            if any(m.shape != p.shape for m, p in zip(whole, layout.params, strict=True)):
                return None
            shard = torch.zeros_like(self.shards[g])
            for index, src, count, dst in layout.pieces:
                shard[dst : dst + count].copy_(whole[index].detach().reshape(-1)[src : src + count])
            shards.append(shard)
            new_ids = []
            for index, a, b in layout.spans:
                state = saved_state.get(cast[index])
                if state:
                    offset = layout.param_offset(index, a)
                    out_state[next_id] = slice_state(state, layout.params[index], offset, b - a, g)
                new_ids.append(next_id)
                next_id += 1
            for i in kept:
                if i in saved_state:
                    out_state[next_id] = saved_state[i]
                new_ids.append(next_id)
                next_id += 1
            group = {**saved, "params": new_ids}
            if "param_names" in current[g]:
                group["param_names"] = list(current[g]["param_names"])
            else:
                group.pop("param_names", None)
            out_groups.append(group)
        return {**state_dict, "state": out_state, "param_groups": out_groups}, shards

    def slice_names(self, named: dict[int, str]) -> list[str]:
        """Names for the last group's ``param_groups`` entry (its slices, then the parameters it
        keeps whole; see ``take``): a slice is named after its parameter and the elements it
        holds, ``"0.weight[128:256]"``, so ``zip(param_names, params)`` stays true."""
        layout = self.groups[-1]
        out = []
        for index, a, b in layout.spans:
            first = layout.param_offset(index, a)
            out.append(f"{named.get(id(layout.params[index]), '?')}[{first}:{first + b - a}]")
        kept = [p for p in self.replicated if id(p) in named]
        return out + [named[id(p)] for p in kept]

    def _new_group(
        self,
        sharded: list[nn.Parameter],
        states: list[dict[str, Any]],
        optimizer: torch.optim.Optimizer | None,
    ) -> list[torch.Tensor]:
        """Lay ``sharded`` out as a new group; this rank's shard, its slices and their state."""
        g = len(self.groups)
        layout = GroupLayout(sharded, g, self.world, self.rank, self.block)
        shard = torch.zeros(layout.shard_size, dtype=torch.float32, device=_device(sharded))
        with torch.no_grad():
            for index, src, count, dst in layout.pieces:
                shard[dst : dst + count].copy_(
                    sharded[index].detach().reshape(-1)[src : src + count]
                )
        chunks = [shard[a:b].detach().requires_grad_(True) for _, a, b in layout.spans]
        for (index, a, b), chunk in zip(layout.spans, chunks, strict=True):
            if optimizer is not None and states[index]:
                optimizer.state[chunk] = slice_state(
                    states[index], sharded[index], layout.param_offset(index, a), b - a, g
                )
        self.groups.append(layout)
        self.shards.append(shard)
        self.chunks.append(chunks)
        self.shard_grads.append(None)
        return chunks

    def after_cast(self) -> None:
        """Lay each group's half parameters out as views into one flat buffer (the gather target)."""
        for layout in self.groups:
            self._lay_out(layout)

    def _lay_out(self, layout: GroupLayout) -> None:
        if not layout.params or layout.flat_half is not None:
            return
        dtype = layout.params[0].dtype
        flat = torch.zeros(layout.padded, dtype=dtype, device=layout.params[0].device)
        with torch.no_grad():
            for r, p in zip(layout.ranges, layout.params, strict=True):
                view = flat[r.start : r.start + r.numel].view(r.shape)
                view.copy_(p.data)
                p.data = view
        layout.flat_half = flat
        layout.seen_versions = [p._version for p in layout.params]

    def add_group(
        self, params: list[nn.Parameter], *, fp32_masters: bool = True
    ) -> list[torch.Tensor]:
        """A param group added after wrap: its half parameters become a new sharded group (FP32
        masters from their half values), the others are stepped whole on every rank."""
        shardable = {torch.float32} if self.fp32_weights else HALF_DTYPES
        fp32_masters = fp32_masters or self.fp32_weights
        sharded = [p for p in params if fp32_masters and p.dtype in shardable]
        kept = [p for p in params if not (fp32_masters and p.dtype in shardable)]
        chunks = self._new_group(sharded, [{} for _ in sharded], None)
        self.cast_flags.append([fp32_masters and p.dtype in shardable for p in params])
        self._lay_out(self.groups[-1])
        if self.grad_buffer is not None:  # the reduce-scatter hook writes the new group's too
            self.armed_grad_buffer()
        self.replicated += kept
        self.model_params = [p for g in self.groups for p in g.params] + self.replicated
        return [*chunks, *kept]

    # -- what the step needs ---------------------------------------------------------------------

    def check_each(self) -> torch.Tensor:
        """One 0/1 flag per model parameter: does its gradient hold inf/NaN? With the
        reduce-scatter hook a reduced parameter's model ``.grad`` keeps this rank's own gradient
        and the reduced sum lives in the FP32 shard gradient: non-finite values another rank
        contributed show only there, so they are read too (else the per-block attribution of
        several losses sees them first at step() and blames every block of the step)."""
        each = super().check_each()
        if not self.reduced:
            return each
        pieces = self._reduced_pieces()
        for i, param in enumerate(self.model_params):
            if id(param) in pieces:
                found = nonfinite_flag(pieces[id(param)], self._device())[0]
                each[i] = torch.maximum(each[i], found)
        return each

    def _reduced_pieces(self) -> dict[int, list[torch.Tensor]]:
        """id(parameter) -> the slices of this rank's FP32 shard gradient that the
        reduce-scatter hook summed for it."""
        pieces: dict[int, list[torch.Tensor]] = {}
        for g, layout in enumerate(self.groups):
            flat_grad = self.shard_grads[g]
            if flat_grad is None:
                continue
            for index, _src, count, dst in layout.pieces:
                if id(layout.params[index]) in self.reduced:
                    key = id(layout.params[index])
                    pieces.setdefault(key, []).append(flat_grad[dst : dst + count])
        return pieces

    def reduced_grads(self, names: dict[int, str]) -> list[tuple[str, torch.Tensor | None]]:
        """Per model parameter, the slices of this rank's FP32 shard gradient the reduce-scatter
        hook summed for it (None elsewhere); none without the hook. A 16-bit wire that
        overflowed leaves every rank's own gradient finite and its inf only here: a skip then
        named no parameter at all (an audit). Only read when explaining a skip."""
        if not self.staging_hooks:
            return []
        pieces = self._reduced_pieces()
        return [
            (
                names.get(id(p), f"<param {i}>"),
                torch.cat(pieces[id(p)]) if id(p) in pieces else None,
            )
            for i, p in enumerate(self.model_params)
        ]

    def n_reduced_grads(self) -> int:
        """len(:meth:`reduced_grads`) without building it (the same on every rank)."""
        return len(self.model_params) if self.staging_hooks else 0

    def unscale_and_check(self, inv_scale: float) -> torch.Tensor:
        """Fill this rank's FP32 shard grads from the model grads, unscaled; flag non-finite ones.

        The flag covers every gradient this rank holds, not only its shard: a non-finite value
        written on one rank outside the range it owns must still skip the step everywhere (the
        skip decision reduces the flags with MAX, see [Note: one decision for all ranks]). That
        costs one read-only pass over the local half gradients. A slice whose parameter has no
        gradient gets none (see [Note: chunked shards]).
        """
        grads: list[torch.Tensor] = []
        for g, layout in enumerate(self.groups):
            if layout.params:
                grads.append(self._fill_shard_grad(g, layout.params))
        grads += [p.grad for p in self.replicated if p.grad is not None]
        flag = check_and_unscale_(grads, inv_scale, self._device())
        outside = [p.grad for g in self.groups for p in g.params if p.grad is not None]
        return torch.maximum(flag, nonfinite_flag(outside, self._device()))

    def _reattach_copies(self) -> None:
        """A weight whose storage was replaced by a copy of the same dtype, shape and device
        (``model.to("cpu:0")``, which accelerate's ``prepare`` and Hugging Face's Trainer call on
        a CPU model: torch copies for an explicit index) is put back into its slice of the flat
        buffer, its values merged into the masters as a write (values still equal to the master
        rounded keep it). Refused before, at the first step of every 2-rank accelerate / Trainer
        run on CPU (an audit); other replacements are still refused by :meth:`check_views`.

        Not once a step's gather was left in flight (``overlap_gather``): a copy taken then may
        hold half-gathered weights, each rank its own new shard and the others' old ones, and
        putting it back overwrote the gathered values (an audit: off by 2e-3, silently); the
        copy is refused by name as before. A copy before the first such step (accelerate's
        ``prepare``) is put back, and so is one taken after ``finish_gather()`` (magnitude
        pruning, an EMA swapped in through ``.data``: refused forever before, an audit)."""
        if self.left_in_flight:
            return
        for flat, r, p in self._not_in_place():
            if id(p) in self.copied_in_flight:
                continue  # taken while the gather was in flight: check_views refuses it
            same_kind = p.dtype == flat.dtype and p.device == flat.device
            if not (same_kind and tuple(p.shape) == r.shape and p.is_contiguous()):
                continue  # another dtype, device or memory format: check_views names it
            view = flat[r.start : r.start + r.numel].view(r.shape)
            with torch.no_grad():
                view.copy_(p.detach())
            p.data = view
            self.load_value(p, p.detach(), written=True)

    def landed_after_flight(self) -> None:
        """See :meth:`_reattach_copies`: the weights replaced while the gather was in flight."""
        self.copied_in_flight = {id(p) for _, _, p in self._not_in_place()}

    def _not_in_place(self) -> Iterator[tuple[torch.Tensor, ParamRange, nn.Parameter]]:
        """(flat buffer, range, parameter) of each sharded weight that is no longer the
        contiguous view of its slice that :meth:`after_cast` made it."""
        for layout in self.groups:
            flat = layout.flat_half
            if flat is None:
                continue
            base, size = flat.data_ptr(), flat.element_size()
            for r, p in zip(layout.ranges, layout.params, strict=True):
                if p.numel() == 0:  # data_ptr() of an empty tensor is 0
                    continue
                same = p.data_ptr() == base + r.start * size and p.dtype == flat.dtype
                if not (same and p.is_contiguous()):
                    yield flat, r, p

    def check_views(self, names: dict[int, str]) -> None:
        """Every sharded weight must still be the view of its group's flat buffer that
        :meth:`after_cast` made it, or the all-gather of the updated weights misses it and it
        silently stops training. A conversion after ``wrap`` (``model.to(memory_format=...)``,
        ``.to(dtype)``, an assignment to ``.data``) gives it new storage: refused, by name, before
        the step changes anything."""
        for _, _, p in self._not_in_place():
            raise ValueError(
                f"parameter {names.get(id(p), '?')!r} ({tuple(p.shape)}, {p.dtype}) is no "
                "longer a view of the flat buffer the sharded masters all-gather the updated "
                "weights into: its storage was replaced after distamp.wrap (by "
                "model.to(memory_format=...), .to(dtype/device) or an assignment to .data), "
                "so it would stop training. Expected such conversions before distamp.wrap "
                "(sharded masters keep the weights contiguous, so a channels_last format is "
                "not kept), or shard_master_weights=False"
                + (
                    "; with overlap_gather a copy after the first step is refused too (it "
                    "may hold half-gathered weights): move the model before training"
                    if self.left_in_flight or id(p) in self.copied_in_flight
                    else ""
                )
            )

    def _fill_shard_grad(
        self, g: int, params: list[nn.Parameter], *, keep_reduced: bool = True
    ) -> torch.Tensor:
        """Copy the gradients of ``params`` (of group ``g``) into the group's FP32 shard grad;
        with ``keep_reduced``, not those the reduce-scatter hook wrote already."""
        layout = self.groups[g]
        flat_grad = self.shard_grads[g]
        if flat_grad is None:
            flat_grad = torch.zeros_like(self.shards[g])
            self.shard_grads[g] = flat_grad
        wanted = {id(p) for p in params}
        with torch.no_grad():
            for index, src, count, dst in layout.pieces:
                param = layout.params[index]
                if id(param) not in wanted or (keep_reduced and id(param) in self.reduced):
                    continue
                grad = param.grad
                if grad is None:
                    flat_grad[dst : dst + count].zero_()
                    continue
                dense = grad.to_dense() if grad.is_sparse else grad
                flat_grad[dst : dst + count].copy_(dense.reshape(-1)[src : src + count])
        for (index, a, b), chunk in zip(layout.spans, self.chunks[g], strict=True):
            param = layout.params[index]
            if id(param) in wanted:
                chunk.grad = None if param.grad is None else flat_grad[a:b]
        return flat_grad

    def separate_params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def reload_master_grads(self, params: list[nn.Parameter]) -> None:
        for g, layout in enumerate(self.groups):
            mine = [p for p in params if any(p is q for q in layout.params)]
            if mine:
                self._fill_shard_grad(g, mine, keep_reduced=False)

    def step_grads(self) -> list[torch.Tensor]:
        """The unscaled gradients the inner optimizer steps (this rank's part)."""
        grads = [c.grad for chunks in self.chunks for c in chunks if c.grad is not None]
        return grads + [p.grad for p in self.replicated if p.grad is not None]

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Collective: global norm over every rank's shard (replicated params counted once)."""
        shard_grads = [c.grad for chunks in self.chunks for c in chunks if c.grad is not None]
        replicated = [p.grad for p in self.replicated if p.grad is not None]
        device = self._device()
        inf_norm = math.isinf(norm_type)
        counted = shard_grads + (replicated if self.rank == 0 else [])
        local = norm_part(counted, norm_type, device)
        op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
        all_reduce_(local, op, self.process_group)
        total = total_norm(local, norm_type)
        scale_to_max_norm_(shard_grads + replicated, total, max_norm)
        return total

    def release_master_grads(self) -> None:
        for chunks in self.chunks:
            for chunk in chunks:
                chunk.grad = None
        self.reduced = set()
        self.fresh = set()
        if self.grad_buffer is None:
            self.shard_grads = [None] * len(self.shards)
        self.exposed = {}  # the model gradients unscale_ exposed are gone with them

    # -- distamp's reduce-scatter hook (distamp/hooks/zero.py) -----------------------------------

    def flat_positions(self) -> dict[int, tuple[int, int]]:
        """id(model parameter) -> (group, its first element in the group's flat layout)."""
        return {
            id(layout.params[r.index]): (r.group, r.start)
            for layout in self.groups
            for r in layout.ranges
        }

    def state_key(self, key: torch.Tensor, names: dict[int, str]) -> torch.Tensor:
        """A model parameter has no state of its own here: a KeyError saying where it is."""
        if id(key) not in self.flat_positions():
            return key
        raise KeyError(
            f"optimizer.state[{names.get(id(key), 'a model parameter')!r}]: with sharded FP32 "
            f"masters the optimizer state is kept for this rank's slices of the parameters "
            f"(the tensors in optimizer.param_groups[i]['params']), not per model parameter; "
            f"expected one of those as the key (an optimizer built from named_parameters() "
            f"names them in param_groups[i]['param_names'], e.g. 'fc.weight[0:128]')"
        )

    def armed_grad_buffer(self) -> torch.Tensor:
        """The persistent FP32 buffer that holds every group's shard gradient (made once, grown
        when a group is added: the groups already there keep their offsets and what the hook
        wrote; the groups' shard gradients become views into it)."""
        total = sum(s.numel() for s in self.shards)
        if self.grad_buffer is None or self.grad_buffer.numel() != total:
            old = self.grad_buffer
            self.grad_buffer = torch.zeros(total, dtype=torch.float32, device=self._device())
            if old is not None:
                self.grad_buffer[: old.numel()].copy_(old)
            self.grad_offsets, offset = [], 0
            for s in self.shards:
                self.grad_offsets.append(offset)
                offset += s.numel()
            self.shard_grads = [
                self.grad_buffer[o : o + s.numel()]
                for o, s in zip(self.grad_offsets, self.shards, strict=True)
            ]
        return self.grad_buffer

    def mark_reduced(self, param_ids: frozenset[int]) -> None:
        """The hook wrote the reduced shard gradients of these parameters."""
        self.reduced |= param_ids
        self.fresh |= param_ids

    def take_fresh_reductions(self) -> AbstractSet[int]:
        """The ids the hook reduced since the last call (see [Note: a backward DDP does not
        reduce])."""
        fresh, self.fresh = self.fresh, set()
        return fresh

    def expose_unscaled(self, inv_scale: float) -> None:
        """See [Note: unscale_ then torch's clip_grad_norm_]. Collective when the reduce-scatter
        hook is in use: the model's ``.grad`` hold this rank's own gradients then, so the reduced,
        unscaled shards are all-gathered into them (once per ``unscale_``, only when it is called)."""
        # ``reduced`` is the same on every rank (DDP's buckets are), so all skip or all gather.
        if not self.reduced or self.world == 1:
            super().expose_unscaled(inv_scale)
            return
        self._gather_reduced_grads(inv_scale)

    def gather_after_outside_backward(self) -> None:
        """Collective, at the end of a backward run outside ``scale_loss`` under the reduce-scatter
        hook: see [Note: a backward distamp does not see]."""
        if self.reduced and self.world > 1:
            self._gather_reduced_grads(None)

    def _gather_reduced_grads(self, inv_scale: float | None) -> None:
        """The reduced shard gradients all-gathered into the model's ``.grad`` of the parameters
        the hook reduced; the others of the sharded groups (all-reduced by DDP) multiplied by
        ``inv_scale`` unless None. Records the versions ``step()`` compares (edits are taken)."""
        with torch.no_grad():
            for g, layout in enumerate(self.groups):
                grad = self.shard_grads[g]
                if not layout.params or layout.flat_half is None or grad is None:
                    continue
                if inv_scale is None and not any(id(p) in self.reduced for p in layout.params):
                    continue
                full = torch.empty_like(layout.flat_half)
                for work in self._gather(layout, grad.to(full.dtype), full):
                    work.wait()
                for r, p in zip(layout.ranges, layout.params, strict=True):
                    if p.grad is None:
                        continue
                    if id(p) in self.reduced:
                        p.grad.copy_(full[r.start : r.start + r.numel].view(r.shape))
                    elif inv_scale is not None:
                        p.grad.mul_(inv_scale)
        params = self.separate_params()
        self.exposed = dict(zip(map(id, params), grad_versions(params), strict=True))

    def master_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)

    # -- what param_groups hold: this rank's shard ---------------------------------------------

    # [Note: clipping what param_groups hold] With sharded masters ``optimizer.param_groups`` hold
    # this rank's shard slices and the parameters every rank steps whole (FP32 norm layers under
    # O2). A norm over them (``clip_grad_norm_`` over param_groups, Lightning's and mmengine's
    # habit, apex's ``amp.master_params``) is this rank's, not the model's: each rank clips by
    # another coefficient, so the shards are clipped wrongly and the whole-stepped parameters
    # leave each other — an audit's two ranks held different LayerNorm weights after 3 steps,
    # silently. Two guards: ``step()`` warns once when the shard gradients were all multiplied by
    # one factor after ``unscale_`` (a norm clip; an elementwise change such as clip_grad_value_
    # is exact and not warned about: a sample of the values tells them apart), and
    # the skip decision's all-reduce carries a fingerprint of the whole-stepped parameters (two
    # more numbers in the same collective), so ranks that parted raise, every one of them, at
    # the next step instead of training apart.

    def take_written_weights(self, names: dict[int, str] | None = None) -> None:
        """See [Note: weights written after wrap] in base.py: this rank's pieces of each written
        weight (every rank holds the same weights). The gathers write the flat buffer, not the
        parameters' own version counters, so only writes through the parameters count."""
        self.finish_gather()  # what the last step gathers has landed
        self._reattach_copies()
        for layout in self.groups:
            if layout.flat_half is None:
                continue
            now = [p._version for p in layout.params]
            for param, before, after in zip(layout.params, layout.seen_versions, now, strict=True):
                if before != after:
                    self.load_value(param, param.detach(), written=True)
            layout.seen_versions = now
        self._take_writes_through_data()

    def _take_writes_through_data(self) -> None:
        """See [Note: writes through .data] in base.py: this rank's pieces (sampled) against its
        shard; a weight whose sample differs is merged as a write. Every rank checks its own
        pieces (the ranks' weights are the same; each merges what it owns). Also with 16-bit
        updates: once the gather has landed (take_written_weights waits for it) the owner's
        shard is its pieces of the weights exactly (see ``_apply_updates``). One host read for
        every group (it was one per group, an audit)."""
        found: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for g, layout in enumerate(self.groups):
            flat, shard = layout.flat_half, self.shards[g]
            if flat is None or not layout.params:
                continue
            flat_at, shard_at, owner = self._write_samples(g)
            if not flat_at.numel():
                continue
            with torch.no_grad():
                found.append((g, written_through_data(flat[flat_at], shard[shard_at]), owner))
        if not found:
            return
        anywhere = torch.stack([differ.any().to(found[0][1].device) for _, differ, _ in found])
        if not bool(anywhere.any()):
            return
        for g, differ, owner in found:
            if not bool(differ.any()):
                continue
            layout = self.groups[g]
            for index in sorted({int(i) for i in owner[differ].tolist()}):
                param = layout.params[index]
                self.load_value(param, param.detach(), written=True)

    def _write_samples(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions in group ``g``'s flat weights, the same in its shard, the parameter index)
        of the sampled values of this rank's pieces, made once per layout."""
        layout = self.groups[g]
        key = (id(layout.flat_half), len(layout.pieces))
        cached = self.write_samples.get(g)
        if cached is not None and cached[0] == key:
            return cached[1][0], cached[1][1], cached[1][2]
        by_param: dict[int, list[tuple[int, int, int]]] = {}
        for index, src, count, dst in layout.pieces:
            by_param.setdefault(index, []).append((src, count, dst))
        flat_at: list[int] = []
        shard_at: list[int] = []
        owner: list[int] = []
        for index, pieces in by_param.items():
            total = sum(count for _, count, _ in pieces)
            step = max(1, total // WRITE_SAMPLES)
            start = layout.ranges[index].start
            k = 0  # the k-th element of this parameter's pieces, in order
            for src, count, dst in pieces:
                first = (-k) % step  # the first multiple of step at or after k, within the piece
                for i in range(first, count, step):
                    if (k + i) // step >= WRITE_SAMPLES:
                        break
                    flat_at.append(start + src + i)
                    shard_at.append(dst + i)
                    owner.append(index)
                k += count
        device = self._device()
        made = [
            torch.tensor(v, dtype=torch.long, device=device) for v in (flat_at, shard_at, owner)
        ]
        self.write_samples[g] = (key, tuple(made))
        return made[0], made[1], made[2]

    def shard_grad_versions(self) -> list[tuple[int, int] | None]:
        return grad_versions(chunk for chunks in self.chunks for chunk in chunks)

    def shard_grad_sample(self) -> torch.Tensor | None:
        """The first few gradient values of every slice (FP32, a copy): what tells a norm clip
        (every value times one factor) from an elementwise change such as clip_grad_value_."""
        parts = [
            chunk.grad.detach().reshape(-1)[:4].float()
            for chunks in self.chunks
            for chunk in chunks
            if chunk.grad is not None
        ]
        return torch.cat(parts) if parts else None

    def replica_fingerprint(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> torch.Tensor | None:
        """``[hw, -hw, hg, -hg, hl, -hl]``: bit hashes of what must be identical on every rank of
        the masters' group, as float32 numbers a MAX all-reduce can compare (equal everywhere iff
        max(h) == -max(-h)): ``hw`` of the parameters every rank steps whole, ``hg`` of the first
        elements of every sharded weight's gradient when DDP's all-reduce made them (no
        reduce-scatter hook), ``hl`` of the values loaded since (see ``take_load_hash``). A DDP
        over a subgroup of wrap's group left them different: each
        rank stepped its shard with its own subgroup's gradients and the gather stitched the
        shards together, the ranks identical and the training wrong, silently (an audit).
        None at one rank. ``ignored``: the parameters DDP was told to leave alone (see
        ``ScalerGroup.ddp_ignored``): each shard steps with its owner's gradient there, as the
        README says."""
        if self.world < 2:
            return None
        kept = [p.detach().reshape(-1) for p in self.replicated if p.is_floating_point()]
        sampled = grad_samples(self.grads_compared(ignored))
        device = next((t.device for t in (*kept, *sampled)), torch.device("cpu"))
        loads = self.take_load_hash(ignored, device)  # see [Note: a load on some ranks only]
        return torch.cat([bit_hash(kept, device), bit_hash(sampled, device), loads])

    def grads_compared(
        self, ignored: frozenset[int], *, hooked: frozenset[int] = frozenset()
    ) -> list[nn.Parameter]:
        """The parameters whose gradients :meth:`replica_fingerprint` compares between ranks."""
        params = [p for layout in self.groups for p in layout.params]
        # Under the reduce-scatter hook the model's .grad stay each rank's own where the hook
        # reduced; elsewhere they are what the shard steps, and must agree: a step after
        # backwards that DDP never synced (every micro-batch under no_sync) stepped each shard
        # with its owner's own gradient, the ranks identical, the training wrong, silently (an
        # audit). ``reduced`` and the ignored parameters are alike everywhere.
        return [p for p in params if id(p) not in self.reduced and id(p) not in ignored]

    def master_tensors(self) -> list[torch.Tensor]:
        """The tensors a state dict saves as this rank's masters (the shards)."""
        return list(self.shards)

    def load_value(
        self, param: nn.Parameter, value: torch.Tensor, *, written: bool = False
    ) -> None:
        """This rank's piece of a value loaded into ``param``; see [Note: loading weights into
        the masters] and [Note: weights written after wrap]."""
        if not written and self.own_weight_back(param, value):
            return
        flat_value = value.detach().reshape(-1)
        with torch.no_grad():
            for g, src, count, dst in self._pieces_of().get(id(param), []):
                piece = self.shards[g][dst : dst + count]
                loaded = flat_value[src : src + count].to(piece.device)
                piece.copy_(merge_loaded(piece, loaded, param.dtype, written=written))

    def _pieces_of(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """id(model parameter) -> (group, first element in it, count, first element in the
        shard) of each piece this rank holds (rebuilt when a group is added)."""
        cached: dict[int, list[tuple[int, int, int, int]]] | None = getattr(self, "_where", None)
        if cached is None or getattr(self, "_where_groups", -1) != len(self.groups):
            cached = {}
            for g, layout in enumerate(self.groups):
                for index, src, count, dst in layout.pieces:
                    cached.setdefault(id(layout.params[index]), []).append((g, src, count, dst))
            self._where, self._where_groups = cached, len(self.groups)
        return cached

    def layout(self) -> list[list[ParamRange]]:
        """Per group, where each parameter lives in the flat buffer (what resharding needs)."""
        return [list(g.ranges) for g in self.groups]

    # -- the canonical checkpoint layout (distamp/checkpoint/state.py) ---------------------------

    def to_canonical(self, g: int, local: torch.Tensor) -> torch.Tensor:
        """Collective: ``local`` (a tensor laid out like group ``g``'s shard) in the contiguous
        canonical layout: this rank's ``torch.chunk`` piece of the padded flat buffer (see [Note:
        canonical checkpoint layout] and [Note: block-cyclic shards]). ``local`` itself with one
        round."""
        layout = self.groups[g]
        if len(layout.rounds) == 1 or self.world == 1:
            return local
        sends = [layout.canonical_intervals(self.rank, q) for q in range(self.world)]
        recvs = [layout.canonical_intervals(r, self.rank) for r in range(self.world)]
        return self._exchange(local, sends, recvs)

    def from_canonical(self, g: int, piece: torch.Tensor) -> torch.Tensor:
        """Collective: the inverse of :meth:`to_canonical` (``piece`` holds ``shard_size``
        elements of the canonical layout; returns a tensor laid out like the shard)."""
        layout = self.groups[g]
        if len(layout.rounds) == 1 or self.world == 1:
            return piece
        swap = [
            [(b, n, a) for a, n, b in layout.canonical_intervals(r, self.rank)]
            for r in range(self.world)
        ]
        recvs = [
            [(b, n, a) for a, n, b in layout.canonical_intervals(self.rank, q)]
            for q in range(self.world)
        ]
        return self._exchange(piece, swap, recvs)

    def _exchange(
        self, local: torch.Tensor, sends: list[list[Interval]], recvs: list[list[Interval]]
    ) -> torch.Tensor:
        """Collective: send ``local[src : src + n]`` to rank q for each (src, n, _) of
        ``sends[q]``; returns a tensor like ``local`` with what rank r sent written at ``dst`` for
        each (_, n, dst) of ``recvs[r]`` (both in the same order on the two sides; the rest is 0)."""
        send = torch.cat([local[a : a + n] for runs in sends for a, n, _ in runs])
        recv = torch.empty(
            sum(n for runs in recvs for _, n, _ in runs), dtype=local.dtype, device=local.device
        )
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[sum(n for _, n, _ in runs) for runs in recvs],
            input_split_sizes=[sum(n for _, n, _ in runs) for runs in sends],
            group=self.process_group,
        )
        out = torch.zeros_like(local)
        at = 0
        for runs in recvs:
            for _, n, dst in runs:
                out[dst : dst + n] = recv[at : at + n]
                at += n
        return out


def _device(params: Sequence[nn.Parameter]) -> torch.device:
    for p in params:
        return p.device
    return torch.device("cpu")
