"""Sharded FP32 master weights (ZeRO stage 1): each rank holds and steps 1/N of the masters.

[Note: flat padded shards] For each param group, the parameters that are cast to the half dtype
are laid end to end in one flat buffer (in ``param_groups`` order, identical on every rank), padded
to a multiple of the world size, and cut into N equal shards; a parameter may straddle two shards
(DeepSpeed/Megatron do the same). Rank r owns elements ``[r*S, (r+1)*S)`` of every group: its FP32
masters and the optimizer state of exactly that range. The inner optimizer's group then holds one
flat FP32 tensor per group, so any element-wise ``torch.optim`` optimizer (SGD, Adam/AdamW, Adagrad,
RMSprop, ...) steps it unchanged and keeps its per-group lr/weight_decay. Parameters that stay FP32
(normalization layers under O2) are few and small: they stay whole and replicated, stepped
identically on every rank. Frozen parameters (``requires_grad=False``) are left out.

[Note: gradient path] The gradients reach the shard through DDP's all-reduce (or distamp's comm
hook) and a local slice. Megatron's reduce-scatter + all-gather moves 2x the data of a step
instead of 3x, but on gloo reduce_scatter is slower than all_reduce (measured in
benchmarks/sharded_optimizer.py), and the all-reduce path works with any DDP configuration;
distamp takes the slice. After the step, the updated shard is cast to the half dtype and one
all-gather per group writes every rank's shard into the model's weights, which are views into a
flat half buffer laid out like the shards, so nothing is copied after the gather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce_
from .nonfinite import check_and_unscale_, nonfinite_flag
from .optim import ModelGrads

CHUNK = 1 << 18
"""Largest slice of a shard the inner optimizer steps as one tensor; see [Note: chunked shards]."""


@dataclass(frozen=True, kw_only=True)
class ParamRange:
    """Where one parameter lives in its group's flat buffer."""

    group: int
    """Index of the param group."""
    index: int
    """Position of the parameter in the group's flat layout."""
    start: int
    """First element in the group's flat buffer."""
    numel: int
    """Number of elements."""
    shape: tuple[int, ...]
    """The parameter's shape."""


class _Group:
    """One param group's flat layout and this rank's shard of it."""

    def __init__(self, params: list[nn.Parameter], group_index: int, world: int, rank: int) -> None:
        self.params = params
        self.ranges: list[ParamRange] = []
        offset = 0
        for i, p in enumerate(params):
            self.ranges.append(
                ParamRange(
                    group=group_index, index=i, start=offset, numel=p.numel(), shape=tuple(p.shape)
                )
            )
            offset += p.numel()
        self.total = offset
        self.shard_size = max(1, math.ceil(offset / world))
        self.padded = self.shard_size * world
        self.lo = rank * self.shard_size
        self.hi = self.lo + self.shard_size
        # (param index, first element in the param, count, first element in the shard)
        self.pieces: list[tuple[int, int, int, int]] = []
        for r in self.ranges:
            a, b = max(r.start, self.lo), min(r.start + r.numel, self.hi)
            if a < b:
                self.pieces.append((r.index, a - r.start, b - a, a - self.lo))
        self.flat_half: torch.Tensor | None = None
        self.send: torch.Tensor | None = None


class ShardedMasterParams(ModelGrads):
    """The FP32 master shards of one optimizer; same interface as :class:`optim.MasterParams`."""

    sharded = True

    def __init__(
        self,
        groups: list[_Group],
        shards: list[torch.Tensor],
        chunks: list[list[torch.Tensor]],
        replicated: list[nn.Parameter],
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self.groups = groups
        self.shards = shards
        """Per group, this rank's flat FP32 masters (the chunks share their storage)."""
        self.chunks = chunks
        """Per group, the leaf tensors the inner optimizer steps: slices of the shard."""
        self.shard_grads: list[torch.Tensor | None] = [None] * len(shards)
        self.replicated = replicated
        self.process_group = process_group
        self.model_params: list[nn.Parameter] = [p for g in groups for p in g.params] + replicated
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.world = dist.get_world_size(process_group) if process_group is not None else 1

    @classmethod
    def take(
        cls,
        optimizer: torch.optim.Optimizer,
        cast_ids: set[int],
        process_group: dist.ProcessGroup | None,
    ) -> ShardedMasterParams:
        """Replace each group's cast parameters by this rank's flat FP32 shard of them.

        Must run before the model is cast, so the masters hold the exact FP32 values.
        """
        world = dist.get_world_size(process_group) if process_group is not None else 1
        rank = dist.get_rank(process_group) if process_group is not None else 0
        groups: list[_Group] = []
        shards: list[torch.Tensor] = []
        all_chunks: list[list[torch.Tensor]] = []
        replicated: list[nn.Parameter] = []
        for g, param_group in enumerate(optimizer.param_groups):
            sharded = [p for p in param_group["params"] if id(p) in cast_ids and p.requires_grad]
            kept = [p for p in param_group["params"] if not (id(p) in cast_ids and p.requires_grad)]
            layout = _Group(sharded, g, world, rank)
            shard = torch.zeros(layout.shard_size, dtype=torch.float32, device=_device(sharded))
            with torch.no_grad():
                for index, src, count, dst in layout.pieces:
                    shard[dst : dst + count].copy_(
                        sharded[index].detach().reshape(-1)[src : src + count]
                    )
            # [Note: chunked shards] The inner optimizer steps the shard as slices of at most
            # CHUNK elements that share its storage: element-wise optimizers make several passes
            # per tensor, and a slice that stays in cache runs them 2-3x faster on CPU than one
            # flat tensor (AdamW on 10M values: 23 ms vs 63 ms).
            chunks = (
                [
                    shard[a : a + CHUNK].detach().requires_grad_(True)
                    for a in range(0, shard.numel(), CHUNK)
                ]
                if sharded
                else []
            )
            state = _shard_state([optimizer.state.pop(p, {}) for p in sharded], layout, shard)
            for a, chunk in zip(range(0, shard.numel(), CHUNK), chunks, strict=True):
                if state:
                    optimizer.state[chunk] = {
                        k: v[a : a + chunk.numel()].clone()
                        if isinstance(v, torch.Tensor) and v.shape == shard.shape
                        else v
                        for k, v in state.items()
                    }
            groups.append(layout)
            shards.append(shard)
            all_chunks.append(chunks)
            replicated += kept
            param_group["params"] = [*chunks, *kept]
        return cls(groups, shards, all_chunks, replicated, process_group)

    def after_cast(self) -> None:
        """Lay each group's half parameters out as views into one flat buffer (the gather target)."""
        for layout in self.groups:
            if not layout.params:
                continue
            dtype = layout.params[0].dtype
            flat = torch.zeros(layout.padded, dtype=dtype, device=layout.params[0].device)
            with torch.no_grad():
                for r, p in zip(layout.ranges, layout.params, strict=True):
                    view = flat[r.start : r.start + r.numel].view(r.shape)
                    view.copy_(p.data)
                    p.data = view
            layout.flat_half = flat
            layout.send = torch.empty(layout.shard_size, dtype=dtype, device=flat.device)

    # -- what the step needs ---------------------------------------------------------------------

    def unscale_and_check(self, inv_scale: float) -> torch.Tensor:
        """Fill this rank's FP32 shard grads from the model grads, unscaled; flag non-finite ones.

        The flag covers every gradient this rank holds, not only its shard: a non-finite value
        written on one rank outside the range it owns must still skip the step everywhere (the
        skip decision reduces the flags with MAX, see [Note: one decision for all ranks]). That
        costs one read-only pass over the local half gradients.
        """
        grads: list[torch.Tensor] = []
        for i, (layout, shard) in enumerate(zip(self.groups, self.shards, strict=True)):
            if not layout.params:
                continue
            flat_grad = torch.zeros_like(shard)
            for index, src, count, dst in layout.pieces:
                grad = layout.params[index].grad
                if grad is not None:
                    flat_grad[dst : dst + count].copy_(grad.reshape(-1)[src : src + count])
            for a, chunk in zip(range(0, shard.numel(), CHUNK), self.chunks[i], strict=True):
                chunk.grad = flat_grad[a : a + chunk.numel()]
            self.shard_grads[i] = flat_grad
            grads.append(flat_grad)
        grads += [p.grad for p in self.replicated if p.grad is not None]
        flag = check_and_unscale_(grads, inv_scale, self._device())
        outside = [p.grad for g in self.groups for p in g.params if p.grad is not None]
        return torch.maximum(flag, nonfinite_flag(outside, self._device()))

    def step_grads(self) -> list[torch.Tensor]:
        """The unscaled gradients the inner optimizer steps (this rank's part)."""
        grads = [g for g in self.shard_grads if g is not None]
        return grads + [p.grad for p in self.replicated if p.grad is not None]

    def clip_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Collective: global norm over every rank's shard (replicated params counted once)."""
        shard_grads = [g for g in self.shard_grads if g is not None]
        replicated = [p.grad for p in self.replicated if p.grad is not None]
        device = self._device()
        inf_norm = math.isinf(norm_type)
        local = torch.zeros(1, dtype=torch.float32, device=device)
        for grads, count_here in ((shard_grads, True), (replicated, self.rank == 0)):
            if not grads or not count_here:
                continue
            norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
            part = norms.max() if inf_norm else norms.pow(norm_type).sum()
            local = torch.maximum(local, part.reshape(1)) if inf_norm else local + part
        op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
        all_reduce_(local, op, self.process_group)
        total = local[0] if inf_norm else local[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g in shard_grads + replicated:
                g.mul_(coef.to(g.device))
        return total

    def copy_to_model(self) -> None:
        """Collective: cast this rank's updated shard down and all-gather every group's shards."""
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        with torch.no_grad():
            for layout, shard in zip(self.groups, self.shards, strict=True):
                if layout.flat_half is None or layout.send is None:
                    continue
                layout.send.copy_(shard)
                if self.process_group is None or self.world == 1:
                    layout.flat_half.copy_(layout.send)
                else:
                    gather(layout.flat_half, layout.send, group=self.process_group)

    def release_master_grads(self) -> None:
        for chunks in self.chunks:
            for chunk in chunks:
                chunk.grad = None
        self.shard_grads = [None] * len(self.shards)

    def master_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.shards)

    def master_tensors(self) -> list[torch.Tensor]:
        """The tensors a state dict saves as this rank's masters (the shards)."""
        return list(self.shards)

    def load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, names: dict[int, str]
    ) -> None:
        """Take this rank's shard of weights loaded into the model (FP32 values stay unrounded)."""
        with torch.no_grad():
            for layout, shard in zip(self.groups, self.shards, strict=True):
                for index, src, count, dst in layout.pieces:
                    p = layout.params[index]
                    value = state_dict.get(prefix + names.get(id(p), ""))
                    if isinstance(value, torch.Tensor) and value.numel() == p.numel():
                        shard[dst : dst + count].copy_(value.reshape(-1)[src : src + count])

    def layout(self) -> list[list[ParamRange]]:
        """Per group, where each parameter lives in the flat buffer (what resharding needs)."""
        return [list(g.ranges) for g in self.groups]


def _shard_state(
    states: list[dict[str, Any]], layout: _Group, shard: torch.Tensor
) -> dict[str, Any]:
    """Merge per-parameter optimizer state that exists before wrap (Adagrad creates its sums in
    its constructor) into the state of this rank's flat shard."""
    if not any(states):
        return {}
    merged: dict[str, Any] = {}
    for key in states[0]:
        values: list[Any] = [st.get(key) for st in states]
        first = values[0]
        if all(
            isinstance(v, torch.Tensor) and v.shape == p.shape
            for v, p in zip(values, layout.params, strict=True)
        ):
            flat = torch.zeros_like(shard, dtype=first.dtype)
            for index, src, count, dst in layout.pieces:
                flat[dst : dst + count].copy_(values[index].reshape(-1)[src : src + count])
            merged[key] = flat
        elif all(_same_scalar(v, first) for v in values):
            merged[key] = first.clone() if isinstance(first, torch.Tensor) else first
        else:
            raise ValueError(
                f"shard_master_weights: optimizer state {key!r} differs between parameters of "
                f"param group {layout.ranges[0].group if layout.ranges else 0} and cannot be "
                "sharded; wrap before the first step"
            )
    return merged


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.numel() == 1 and b.numel() == 1 and bool(a == b)
    return a == b


def _device(params: Sequence[nn.Parameter]) -> torch.device:
    for p in params:
        return p.device
    return torch.device("cpu")
