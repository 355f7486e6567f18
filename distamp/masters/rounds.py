"""The sharded step in rounds: each round of blocks is stepped, then its all-gather starts at once.

[Note: the step in rounds] With sharded masters the updated weights are all-gathered after the
step, one round of blocks at a time (see [Note: block-cyclic shards] in layout.py). Stepping the
whole shard first leaves the wire idle for as long as the optimizer runs (AdamW over 8.4M FP32
values: ~40 ms on one CPU core), and the next forward waits for the first blocks until then. So
when the inner optimizer is one of torch's classes that step every parameter on its own,
``step()`` steps the shard round by round (round j: block j of every rank's shard, in every
group) and starts round j's all-gather before it steps round j + 1: the first blocks, which hold
the first layers the next forward needs, travel while the later ones are stepped.

The inner class's own step runs once per round, on the param groups narrowed to that round's
slices (parameters that stay whole, such as FP32 norm layers under O2, in the last round); every
slice is stepped exactly once, with its own state (its own ``step`` counter, see [Note: chunked
shards]), so the result is bit for bit that of one step. The step hooks registered on the
optimizer (and torch's global ones) fire once around all rounds, as torch fires them around one
step. Any other optimizer class — a subclass, a third-party optimizer, which may keep state across
parameters such as one step counter — is stepped once, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import optimizer as torch_optimizer

if TYPE_CHECKING:
    from .sharded import ShardedMasterParams

PER_PARAMETER = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""torch.optim classes whose step treats each parameter on its own, with per-parameter state only."""


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any] | None:
    """The step of the class distamp's optimizer is mixed into, without torch's hook runner (so
    that distamp runs the step hooks itself, around the copy of the weights into the model: see
    [Note: step hooks see the new weights]); None where torch keeps its hooks elsewhere."""
    from .optimizer import AmpOptimizer

    mro = type(optimizer).__mro__
    if AmpOptimizer not in mro or not all(
        hasattr(torch_optimizer, name)
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    ):
        return None
    own: Any = mro[mro.index(AmpOptimizer) + 1]
    step: Any = own.step
    # torch wraps the class's step with its hook runner (profile_hook_step) on first construction.
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def round_step(optimizer: torch.optim.Optimizer, masters: object) -> Callable[..., Any] | None:
    """The unhooked step of ``optimizer``'s own class when its shard can be stepped in rounds (see
    [Note: the step in rounds]); None when it is stepped at once."""
    rounds = getattr(masters, "gather_rounds", None)
    world = getattr(masters, "world", 1)
    if rounds is None or world < 2 or rounds() < 2:
        return None
    from .optimizer import AmpOptimizer

    mro = type(optimizer).__mro__
    if AmpOptimizer not in mro or mro[mro.index(AmpOptimizer) + 1] not in PER_PARAMETER:
        return None
    return unhooked_step(optimizer)


def with_step_hooks(
    optimizer: torch.optim.Optimizer, body: Callable[[tuple[Any, ...], dict[str, Any]], None]
) -> None:
    """``body(args, kwargs)`` inside the optimizer's step hooks and torch's global ones, as
    torch's ``profile_hook_step`` runs them around a step.

    [Note: step hooks see the new weights] With FP32 masters the step updates the masters, and
    the model's weights only when the masters are copied (or gathered) into them. torch's hook
    runner around the inner class's step fired the post-hooks before that copy: a post-hook
    reading ``model.parameters()`` (an EMA, a weight-norm logger) saw the weights of the step
    before, silently, on every path but the step in rounds (an audit: an EMA 9.4e-3 off the
    FP32 one). So distamp runs the hooks itself, with the copy inside ``body``. (With
    ``overlap_gather`` the gather is still in flight then: see its Note.)"""
    args: tuple[Any, ...] = (optimizer,)
    kwargs: dict[str, Any] = {}
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for pre_hook in chain(
            torch_optimizer._global_optimizer_pre_hooks.values(),
            optimizer._optimizer_step_pre_hooks.values(),
        ):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"optimizer step pre-hook {pre_hook}: expected None or a tuple "
                        f"(new_args, new_kwargs), got {result!r}"
                    )
                args, kwargs = result
        body(args, kwargs)
        optimizer._optimizer_step_code()
        for post_hook in chain(
            optimizer._optimizer_step_post_hooks.values(),
            torch_optimizer._global_optimizer_post_hooks.values(),
        ):
            post_hook(optimizer, args, kwargs)


def step_in_rounds(
    optimizer: torch.optim.Optimizer,
    masters: ShardedMasterParams,
    step: Callable[..., Any],
    started: Callable[[], None] = lambda: None,
) -> None:
    """Collective: step the shard round by round, starting each round's all-gather right after
    it (see [Note: the step in rounds]); ``step`` is the class's unhooked step."""
    groups = optimizer.param_groups
    full = [group["params"] for group in groups]
    where = masters.round_of_chunks()
    n = masters.gather_rounds()
    per_round: list[list[list[torch.Tensor]]] = [[[] for _ in groups] for _ in range(n)]
    for i, params in enumerate(full):
        for p in params:
            per_round[min(where.get(id(p), n - 1), n - 1)][i].append(p)

    def in_rounds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        started()  # the pre-hooks passed
        with masters.gathering(after_step=True):
            try:
                for j in range(n):
                    for group, params in zip(groups, per_round[j], strict=True):
                        group["params"] = params
                    step(*args, **kwargs)
                    masters.gather_round(j)
            finally:
                for group, params in zip(groups, full, strict=True):
                    group["params"] = params

    with_step_hooks(optimizer, in_rounds)
