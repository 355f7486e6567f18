"""Small collectives on whichever device the process group's backend needs."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist


def backend_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a collective on ``group`` takes its tensors on (CUDA for NCCL, else CPU)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> dist.Work | None:
    """Collective over ``group``: gather every rank's ``tensor`` (same size everywhere) end to end
    into ``output``. torch 2.13 names it ``all_gather_single`` and deprecates the older
    ``all_gather_into_tensor`` (torch 2.4-2.12 have only that)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def all_reduce_(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Collective over ``group``: in-place all-reduce of ``tensor``, moved to the backend's device
    and back when needed. ``group=None`` (not distributed) or a 1-rank group does nothing."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    device = backend_device(group)
    if tensor.device == device:
        dist.all_reduce(tensor, op=op, group=group)
    else:
        on_device = tensor.to(device)
        dist.all_reduce(on_device, op=op, group=group)
        tensor.copy_(on_device)
    return tensor


@contextlib.contextmanager
def checks_on_every_rank(
    what: str, group: dist.ProcessGroup | None, *, disabled: bool = False
) -> Iterator[None]:
    """Collective over ``group``: run the block's local checks, then raise on every rank if one
    raised (ValueError/TypeError) on any rank, or if ``disabled`` (``enabled=False``) differs
    between the ranks.

    A check that fails on one rank only (a half parameter, a stray optimizer parameter, a model on
    the meta device, on that rank alone) used to raise there while the other ranks waited in the
    next collective until the process group's timeout (30 minutes). One all-reduce of a flag; on a
    failure the messages are gathered. The failing rank raises its own error; the others raise
    ValueError naming it. ``disabled``: ``fully_shard(enabled=False)`` on some ranks only
    (``enabled=args.amp`` parsed per rank) sharded FP32 there and half elsewhere, and FSDP's
    collectives hung or aborted; it rides in the same all-reduce, as +d/-d. (``wrap(enabled=
    False)`` runs no collective at all, by design: see README.)"""
    error: Exception | None = None
    try:
        yield
    except (ValueError, TypeError) as exc:
        error = exc
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1, int(disabled), -int(disabled)])
    all_reduce_(flag, dist.ReduceOp.MAX, group)
    failed_anywhere, some_disabled, all_disabled = (int(v) for v in flag.tolist())
    parted = some_disabled != -all_disabled
    if not failed_anywhere and not parted:
        return
    message = None if error is None else f"{type(error).__name__}: {error}"
    messages: list[tuple[str | None, bool]] = [(None, False)] * dist.get_world_size(group)
    dist.all_gather_object(messages, (message, disabled), group=group)
    if parted:
        off = [dist.get_global_rank(group, r) for r, (_, d) in enumerate(messages) if d]
        raise ValueError(
            f"{what}: expected the same enabled on every rank, found enabled=False on ranks "
            f"{off} and True on the others (an enabled=... read per rank?); the disabled ranks "
            "would skip the collectives the others wait in"
        )
    if error is not None:
        raise error
    # By global rank (an audit: a subgroup's ranks were named by their place in it), one
    # message once for every rank that gave it (a review: a long one repeated per rank)
    by_message: dict[str, list[int]] = {}
    for r, (m, _) in enumerate(messages):
        if m is not None:
            by_message.setdefault(m, []).append(dist.get_global_rank(group, r))
    failed = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {m}"
        for m, ranks in by_message.items()
    )
    raise ValueError(f"{what} failed on another rank — {failed}")


def check_same_on_all_ranks(
    what: str, facts: Sequence[tuple[str, str]], group: dist.ProcessGroup | None
) -> None:
    """Collective over ``group``: raise ValueError on every rank unless ``facts`` agree everywhere.

    [Note: fail fast when ranks disagree] A rank configured differently (another opt_level, another
    model) would otherwise hang or corrupt the first mismatched collective. One all-reduce of a
    hash; only on a mismatch are the facts gathered to name the first difference.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    digest = hashlib.sha256(repr(list(facts)).encode()).digest()
    table = torch.zeros(world, dtype=torch.int64)
    table[rank] = int.from_bytes(digest[:7], "little")
    all_reduce_(table, dist.ReduceOp.SUM, group)
    if bool((table == table[0]).all()):
        return
    gathered: list[list[tuple[str, str]] | None] = [None] * world
    dist.all_gather_object(gathered, list(facts), group=group)
    reference = gathered[0]
    assert reference is not None
    for other_rank, other in enumerate(gathered):
        assert other is not None
        if other != reference:
            found = _first_difference(reference, other, other_rank)
            raise ValueError(
                f"{what}: the ranks disagree — {found}; every rank must run the same model and "
                "settings"
                + (
                    " (pipeline or model-parallel stages: pass process_group= the group of the "
                    "ranks holding the same stage, and decide skips over all stages with "
                    'torch.autocast and distamp.GradScaler: README, "Pipeline stages")'
                    if "parameter" in found
                    else ""
                )
            )


def _first_difference(
    reference: list[tuple[str, str]], other: list[tuple[str, str]], rank: int
) -> str:
    """Rank 0's facts against ``rank``'s, by name: a parameter one rank lacks is named as such
    (compared by position, one extra parameter paired every later fact with another one)."""
    mine, theirs = dict(reference), dict(other)
    lacking = [(0, k, mine[k], rank) for k in mine if k not in theirs]
    lacking += [(rank, k, theirs[k], 0) for k in theirs if k not in mine]
    if lacking:
        has, key, value, lacks = lacking[0]
        more = f" (and {len(lacking) - 1} more names on one rank only)" if len(lacking) > 1 else ""
        return f"rank {has} has {key}={value}, which rank {lacks} has not{more}"
    for key, value in mine.items():
        if theirs[key] != value:
            return f"rank 0 has {key}={value}, rank {rank} has {key}={theirs[key]}"
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:  # the same names and values in another order
            return f"rank 0 lists {a[0]} at position {i}, rank {rank} lists {b[0]} there"
    return f"rank 0 has {len(reference)} entries, rank {rank} has {len(other)}"


BROADCAST_BUCKET_BYTES = 32 << 20
"""Largest flat buffer :func:`broadcast_from_rank0_` sends at once (DDP's default bucket size)."""


def digest(value: torch.Tensor) -> str:
    """A hash of ``value``'s bits, to compare between ranks (with ``all_gather_object``)."""
    flat = value.detach().reshape(-1).cpu().contiguous()
    return hashlib.sha256(bytes(flat.clone().view(torch.uint8).untyped_storage())).hexdigest()


def broadcast_from_rank0_(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Collective over ``group``: every rank's ``tensors`` take the values of the group's rank 0.

    [Note: rank 0's weights are everyone's] DDP broadcasts rank 0's parameters and buffers when
    it is built, so a script that seeds each rank differently before building its model (nanoGPT
    does) still trains one model. ``distamp.wrap`` and ``distamp.fsdp.fully_shard`` run before
    that broadcast and capture state from the weights (FP32 masters, FSDP's shards), so they make
    rank 0's values everyone's first, the same way: in flat buckets per dtype. The tensors must
    have the same shapes and dtypes on every rank (checked before, by the wrap fingerprint).
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    device = backend_device(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    buckets: list[list[torch.Tensor]] = []
    for dtype, same in by_dtype.items():
        limit = max(1, BROADCAST_BUCKET_BYTES // torch.empty((), dtype=dtype).element_size())
        size = limit
        for tensor in same:
            if not buckets or size + tensor.numel() > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(tensor)
            size += tensor.numel()
    with torch.no_grad():
        for bucket in buckets:
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def short_order(order: list[str]) -> str:
    """A parameter order as a fact: whole when short; else its head and a digest, so that a
    1000-parameter mismatch reads as two lines, not 30,000 characters (an audit)."""
    if len(order) <= 8:
        return str(order)
    digest = hashlib.sha1("\n".join(order).encode()).hexdigest()[:10]
    return f"[{', '.join(map(repr, order[:4]))}, ...] ({len(order)} parameters, digest {digest})"
