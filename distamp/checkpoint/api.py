"""``save_checkpoint``, ``load_checkpoint``, ``consolidate``: sharded checkpoints on DCP.

See [Note: canonical checkpoint layout] (state.py) for what is stored and
[Note: atomic checkpoints] (files.py) for how it is committed.
"""

from __future__ import annotations

import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import distribute_tensor

from ..collectives import digest
from ..config import disabled_group, disabled_properties
from ..masters.layout import detached_dense, slice_state
from ..masters.optimizer import inner_optimizer
from ..masters.sharded import ShardedMasterParams
from ..optstate import OptState
from ..wrap import ddp_ignored_tensors
from . import files, metadata
from .files import CheckpointError, PathLike, agree
from .state import (
    FlatGroup,
    GroupView,
    OptimizerView,
    canonical_piece,
    check_plain,
    checkpoint_names,
    flat_masters,
    flat_starts,
    flat_state,
    hyperparameters,
    installed_keys,
    is_dtensor,
    kept_state,
    live_state_dict,
    merge_flat_info,
    model_entry,
    model_state,
    optimizer_views,
    param_names,
    partly_present,
    plain_equal,
    present_keys,
    to_dtensor,
    unwrap_model,
)

COMPARED_PROPERTIES = (
    "opt_level",
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
    "num_losses",
)
"""Properties a checkpoint must share with the run that loads it (sharding and world size may
differ: see [Note: canonical checkpoint layout])."""


class _Target:
    """The models and optimizers of one save/load call, and their process group."""

    def __init__(self, model: Any, optimizer: Any, what: str) -> None:
        raw_models = list(model) if isinstance(model, (list, tuple)) else [model]
        given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        raw_opts = [inner_optimizer(o) or o for o in given]  # optimizer wrappers: their inner one
        for i, m in enumerate(raw_models):
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"{what}: model[{i}]: expected an nn.Module, got {type(m).__name__}"
                )
        for i, o in enumerate(raw_opts):
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(
                    f"{what}: optimizer[{i}]: expected a torch.optim.Optimizer, got {type(o).__name__}"
                )
        if not raw_models or not raw_opts:
            raise ValueError(f"{what}: expected at least one model and one optimizer")
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for r in raw_models for m in r.modules()):
            # (an audit, once FSDP1 ran on CPU: each rank's optimizer state of FSDP1's flat
            # shards is an uneven 1-D piece per parameter, saved as if replicated; the load of
            # the very checkpoint failed with "Size mismatch between saved ... and current")
            raise ValueError(
                f"{what}: expected a model under FSDP2 (distamp.fsdp.fully_shard's default "
                "api), DDP or neither, found FullyShardedDataParallel (api='fsdp1'): distamp's "
                "checkpoints do not hold FSDP1's flat-parameter shards. Use api='fsdp2' to "
                "checkpoint with distamp (it reshards at any world size), or save and load each "
                "rank's own model and optimizer.state_dict() at the same world size"
            )
        self.models = [unwrap_model(m) for m in raw_models]
        self.synced_buffers = [_broadcasts_buffers(m) for m in raw_models]
        self.names = param_names(self.models)
        self.views = optimizer_views(raw_opts, self.names)
        for view in self.views:  # the weights a step is still gathering (overlap_gather)
            if view.st is not None and isinstance(view.st.masters, ShardedMasterParams):
                view.st.masters.finish_gather()
        groups = {id(v.st.group) for v in self.views if v.st is not None}
        if len(groups) > 1:
            raise ValueError(
                f"{what}: the optimizers come from different distamp.wrap calls; expected the "
                "optimizers of one wrap call (save each wrap call in its own checkpoint)"
            )
        first = next((v.st for v in self.views if v.st is not None), None)
        self.scaler_group = first.group if first is not None else None
        if self.scaler_group is not None:
            self.scaler_group.refuse_destroyed_group(what)
            self.props = self.scaler_group.props.as_plain_dict()
            self.pg = self.scaler_group.process_group
        else:
            disabled = disabled_properties(self.views[0].opt)
            assert disabled is not None  # a view without distamp state was wrapped disabled
            self.props = disabled.as_plain_dict()
            self.pg = disabled_group(self.views[0].opt)
            if self.pg is None and dist.is_available() and dist.is_initialized():
                self.pg = dist.group.WORLD
        self.world = dist.get_world_size(self.pg) if self.pg is not None else 1
        self.rank = dist.get_rank(self.pg) if self.pg is not None else 0
        # A load drops pending gradients (_install_optimizer zeroes them): rolling back to the
        # last checkpoint after a NaN loss is its use (an audit: it refused, and the docstring
        # said they were dropped). A save would leave them out of the checkpoint: refused —
        # except gradients only adopted from a block that did not list the optimizer (see
        # [Note: a block that does not list an optimizer it reaches]): a GAN's generator loss
        # leaves them in the discriminator after its step, every iteration, and apex's DCGAN
        # loop saved there (an audit: refused with the two wrapped together, not apart).
        for view in self.views if what == "save_checkpoint" else ():
            st = view.st
            if st is None or st.state is OptState.READY:
                continue
            if st.unlisted_loss is not None and not st.backwards and st.state is OptState.SCALED:
                continue
            raise RuntimeError(
                f"{what}: optimizers[{view.index}] has gradients pending from scale_loss "
                f"(state {st.state.value}); expected a checkpoint between optimizer.step() "
                "and the next backward (call step() or zero_grad() first)"
            )

    def distributed(self) -> bool:
        return self.pg is not None and self.world > 1

    def piece_tensor(self, local: torch.Tensor, total: int) -> torch.Tensor:
        """What DCP gets for one canonical flat tensor: a DTensor over the group, or the tensor."""
        if self.distributed():
            assert self.pg is not None
            return to_dtensor(local, total, self.pg)
        return local


# -- save ---------------------------------------------------------------------------------------


def _check_path(directory: object, api: str) -> None:
    """pathlib's "expected str, bytes or os.PathLike object, not int" named neither the function
    nor the argument (an audit)."""
    if isinstance(directory, bool) or not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"{api}: directory: expected a str or path of the checkpoint folder, got "
            f"{type(directory).__name__} {directory!r:.60}"
        )


def save_checkpoint(
    directory: PathLike, model: Any, optimizer: Any, *, extra: dict[str, Any] | None = None
) -> str:
    """Collective over the wrapped optimizer's process group: write a sharded checkpoint.

    Each rank writes its shard of the FP32 masters and optimizer state; the model weights,
    loss scalers, step counters, properties, per-rank RNG states and ``extra`` (rank 0's: plain
    data such as the epoch, the data position, ``scheduler.state_dict()``) go along. The
    directory appears only once every rank has finished (an existing one is replaced), so a crash
    leaves the previous checkpoint intact. Returns the directory.
    """
    _check_path(directory, "save_checkpoint")
    target = _Target(model, optimizer, "save_checkpoint")
    for view in target.views:  # see [Note: weights written after wrap] in masters/base.py
        if view.st is not None:
            view.st.masters.take_written_weights(view.st.group.param_names)
    given = Path(directory)
    # [Note: a checkpoint path that is a symbolic link] (checkpoints on another volume) The save
    # goes where the link points, its temporary and old copies beside the target, and the link
    # stays: committed over the link, the new folder replaced it and rmtree refused the link as
    # the old copy, so every later save failed (an audit).
    directory = Path(os.path.realpath(given)) if given.is_symlink() else given
    pg = target.pg
    plain_extra = agree("save_checkpoint: extra", lambda: check_plain(extra or {}, "extra"), pg)
    if target.distributed():
        _warn_if_extra_differs(plain_extra, target, pg)
    made = agree("save_checkpoint: preparing", lambda: _prepare(directory, target.rank), pg)
    rank0_path = os.path.abspath(directory)
    if target.distributed():  # its name (see [Note: one temporary folder per save])
        box = [(made, rank0_path)]
        dist.broadcast_object_list(box, group=pg, group_src=0)
        made, rank0_path = box[0]
    assert made is not None
    # This rank's own path, rank 0's suffix: ranks given different paths are named by _see_tmp.
    tmp = directory.with_name(directory.name + made)
    agree(
        "save_checkpoint: the folder rank 0 made",
        lambda: _see_tmp(tmp, target.rank, directory, rank0_path),
        pg,
    )

    local_info = agree("save_checkpoint: reading optimizer state", lambda: _flat_info(target), pg)
    infos: list[Any] = [local_info]
    if target.distributed():
        infos = [None] * target.world
        dist.all_gather_object(infos, local_info, group=pg)
    info = merge_flat_info(infos)
    state_dict, manifest = agree(
        "save_checkpoint: collecting state", lambda: _collect(target, plain_extra, info), pg
    )
    own = _apart_between_ranks(target)
    manifest["rank_buffers"] = sorted(own)
    try:
        shares = _write_into(tmp, directory, target, state_dict, own, pg)
    except BaseException as exc:
        # Every rank is past its writes (each step above fails on all ranks alike): the partial
        # folder goes. Left, it held the disk a full-disk failure had filled, and the example's
        # step_NNNNNN paths never repeat, so no later save of the same path removed it (an audit).
        if target.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _say_what_is_left(exc, directory)
        raise

    def finish() -> None:
        if target.rank != 0:
            return
        manifest["files"] = {k: v for s in shares for k, v in s.items()}
        try:
            files.write_manifest_and_commit(tmp, manifest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # no manifest: nothing to load (see above)
            raise
        try:
            files.commit(tmp, directory)
        except OSError as exc:
            old = directory.with_name(directory.name + files.OLD)
            previous = (
                f"; the previous checkpoint is at {old}"
                if (old / files.COMMIT).is_file() and not (directory / files.COMMIT).is_file()
                else ""
            )
            raise CheckpointError(
                f"save_checkpoint: could not move the finished {tmp} into place as {directory} "
                f"({exc}): expected no other save of that path at the same time (another job "
                f"or host committed one meanwhile?); this save is left complete in {tmp}"
                f"{previous}"
            ) from exc

    try:
        agree("save_checkpoint: committing", finish, pg)
    except CheckpointError as exc:
        if f"left complete in {tmp}" not in str(exc):  # (the rename's own says where it is)
            _say_what_is_left(exc, directory)
        raise
    return str(given)


def _say_what_is_left(exc: BaseException, directory: Path) -> None:
    """A failed save's CheckpointError says what is at ``directory`` now, wherever it failed
    (writing the RNG state, hashing, the manifest: an audit found only the tensors' failure
    saying it, as the README promises). Raised on every rank alike (``agree``)."""
    if not isinstance(exc, CheckpointError) or "nothing was committed" in str(exc):
        return
    exc.args = (f"{exc}; {_what_is_left(directory)}", *exc.args[1:])


def _what_is_left(directory: Path) -> str:
    return "nothing was committed and the partial folder is removed; " + (
        f"the previous checkpoint at {directory} is intact"
        if (directory / files.COMMIT).is_file()
        else f"there was no checkpoint at {directory} before"
    )


def _write_into(
    tmp: Path, directory: Path, target: _Target, state_dict: dict[str, Any], own: Any, pg: Any
) -> list[Any]:
    """Every rank: the RNG state, the tensors and their hashes into ``tmp``; each rank's share
    of the manifest's file list."""
    agree("save_checkpoint: writing RNG state", lambda: _save_rng(tmp, target.rank, own), pg)
    try:
        with files.quiet_single_process(not target.distributed()):
            dcp.save(
                state_dict,
                storage_writer=metadata.Writer(tmp, sync_files=True, single_file_per_rank=True),
                process_group=pg,
                no_dist=not target.distributed(),
            )
    except (Exception, dcp.api.CheckpointException) as exc:  # a BaseException, not an Exception
        # DCP gathers the ranks' failures: every rank raises here alike.
        raise CheckpointError(
            f"save_checkpoint: writing the tensors into {tmp} failed ({_dcp_failures(exc)}); "
            + _what_is_left(directory)
        ) from exc
    share = agree(
        "save_checkpoint: hashing", lambda: files.hash_share(tmp, target.rank, target.world), pg
    )
    shares: list[Any] = [share]
    if target.distributed():
        shares = [None] * target.world
        dist.all_gather_object(shares, share, group=pg)
    return shares


WEIGHTS_ALONE = (
    "or carry its weights alone into another model or configuration (a fine-tune): "
    "distamp.checkpoint.consolidate(path) gives them as plain FP32 tensors by name, for "
    "model.load_state_dict(weights, strict=False) before wrap"
)


def _dcp_failures(exc: BaseException) -> str:
    """DCP's CheckpointException as "rank R: Type: message" per failed rank (its own str is
    every rank's whole traceback)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return f"{type(exc).__name__}: {exc}"
    parts = []
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) and failure else failure  # (exc, tb)
        parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
    return "; ".join(parts)


def _warn_if_extra_differs(extra: dict[str, Any], target: _Target, pg: Any) -> None:
    """Only rank 0's ``extra`` is saved: a per-rank value (a data loader's position) came back as
    rank 0's on every rank, silently (an audit). Every rank warns, naming the keys."""
    gathered: list[Any] = [None] * target.world
    dist.all_gather_object(gathered, extra, group=pg)
    keys = sorted({k for e in gathered for k in e}, key=str)
    differ = [
        k for k in keys if any(not plain_equal(e.get(k), gathered[0].get(k)) for e in gathered)
    ]
    # Rank 0 only, once per key set and wrap: every rank at every save repeated it (an audit:
    # nanoGPT's best_val_loss; DCP's own warning filters reset Python's once-per-line memory).
    group = target.scaler_group
    seen = getattr(group, "warned_extra_keys", None) if group is not None else None
    if differ and target.rank == 0 and (seen is None or tuple(differ) not in seen):
        if seen is not None:
            seen.add(tuple(differ))
        warnings.warn(
            f"save_checkpoint: extra is saved once, from rank 0; expected it the same on every "
            f"rank, found {differ[:4]}{' and more' if len(differ) > 4 else ''} different: "
            "every rank gets rank 0's back from load_checkpoint. Reduce a per-rank metric "
            "across ranks first (a validation loss: dist.all_reduce), keep per-rank state under "
            "a key per rank (extra={'loader': {rank: state, ...}} gathered with "
            "all_gather_object), or in a file of its own. A value only rank 0 computes "
            "(nanoGPT's best_val_loss: only rank 0 evaluates) is right as it is: ignore this",
            stacklevel=3,
        )


def _see_tmp(tmp: Path, rank: int, mine: Path, rank0_path: str) -> None:
    """Every rank must reach the folder rank 0 made: ranks saving to different paths (one built
    from a timestamp) or to disks they do not share failed with a bare FileNotFoundError on
    the first file (an audit). Waits briefly: a shared filesystem may show it late."""
    for _ in range(50):
        if tmp.is_dir():
            return
        time.sleep(0.1)
    raise CheckpointError(
        f"save_checkpoint: expected every rank to save to the folder rank 0 made, found no "
        f"{tmp} from rank {rank} ({os.path.realpath(tmp)}); rank 0 saves to {rank0_path}, rank "
        f"{rank} to {os.path.abspath(mine)}: "
        "the ranks must pass the same path, "
        "on a filesystem they share (a path built from a per-rank value — a timestamp, the "
        "hostname — differs between ranks)"
    )


def _prepare(directory: Path, rank: int) -> str | None:
    """Rank 0 creates the empty temporary directory and returns its name's suffix after the
    checkpoint's own; the others wait for it in ``agree``.

    An existing ``directory`` is replaced only when it is a committed checkpoint or empty: a
    DeepSpeed habit, ``save_checkpoint(save_dir)`` with the run's root folder, deleted every
    earlier checkpoint and log in it (an audit)."""
    if rank == 0:
        if directory.exists() and not (directory / files.COMMIT).is_file():
            inside = sorted(c.name for c in directory.iterdir()) if directory.is_dir() else None
            found = "a file" if inside is None else f"a folder holding {inside[:4]}"
            if inside is None or inside:
                hint = (
                    "save to another path, or remove that file"  # (no subfolder of a file, an audit)
                    if inside is None
                    else "the path names the checkpoint itself, not a folder of them (DeepSpeed's "
                    f"save_dir); save into a subfolder such as {directory / 'step_100'}"
                )
                raise CheckpointError(
                    f"save_checkpoint: expected {directory} to be a new path, an empty folder or "
                    f"a committed distamp checkpoint (it is replaced), found {found}: {hint}"
                )
        directory.parent.mkdir(parents=True, exist_ok=True)
        return files.prepare_tmp(directory).name[len(directory.name) :]
    return None


def _flat_info(target: _Target) -> dict[tuple[int, int], dict[str, Any]]:
    """This rank's summary of each flat group's state, for :func:`merge_flat_info`."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for view in target.views:
        for g, gv in enumerate(view.groups):
            if gv.flat is not None:
                tensors, scalars, has_state = flat_state(
                    view.opt, gv.flat, target.rank, target.world
                )
                out[(view.index, g)] = {
                    "scalars": scalars,
                    "has_state": has_state,
                    "present": present_keys(view.opt, gv.flat),
                    "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()},
                }
    return out


def _collect(
    target: _Target, extra: Any, info: dict[tuple[int, int], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP state dict (this rank's pieces) and the manifest (identical on every rank)."""
    rank, world = target.rank, target.world
    sd: dict[str, Any] = {}
    models = []
    for i, model in enumerate(target.models):
        entry = model_entry(i, model, len(target.models), target.names)
        models.append(entry)
        for key, value in live_state_dict(model).items():
            # A plain tensor: rank 0's copy only (buffers such as BatchNorm statistics may differ
            # between ranks, DDP takes rank 0's, DCP's dedup would write an arbitrary rank's).
            # A DTensor (an FSDP-sharded parameter): every rank writes its shard.
            if rank == 0 or is_dtensor(value):
                sd[f"model.{i}.{key}"] = value.detach()
    optimizers = []
    for view in target.views:
        o, opt = view.index, view.opt
        groups = []
        kept_entries: dict[str, Any] = {}
        for g, gv in enumerate(view.groups):
            flat_entry = None
            if gv.flat is not None:
                flat = gv.flat
                sd[f"optim.{o}.g{g}.master"] = target.piece_tensor(
                    flat_masters(flat, rank, world), flat.total
                )
                tensors, _, _ = flat_state(opt, flat, rank, world)
                merged = info[(o, g)]
                for key, dtype in merged["dtypes"].items():
                    # zeros where no part of this rank's shard has that state yet
                    local = canonical_piece(
                        flat, tensors.get(key), files.manifest_dtype(dtype), rank, world
                    )
                    sd[f"optim.{o}.g{g}.state.{key}"] = target.piece_tensor(local, flat.total)
                flat_entry = {
                    "names": flat.names,
                    "shapes": [list(s) for s in flat.shapes],
                    "total": flat.total,
                    "tensor_keys": dict(sorted(merged["dtypes"].items())),
                    "scalars": merged["scalars"],
                    "has_state": merged["has_state"],
                    "present": partly_present(merged),
                }
            for name, tensor in gv.kept:
                tensors, scalars = kept_state(opt, tensor)
                for key, value in tensors.items():
                    sd[f"optim.{o}.p.{name}.{key}"] = value
                kept_entries[name] = {
                    "tensor_keys": {
                        k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()
                    },
                    "scalars": scalars,
                    "has_state": bool(opt.state.get(tensor)),
                    "shape": list(tensor.shape),
                }
            groups.append({"flat": flat_entry, "kept": [name for name, _ in gv.kept]})
        st = view.st
        optimizers.append(
            {
                "class": type(opt).__name__,
                "hyper": hyperparameters(opt),
                "groups": groups,
                "kept": kept_entries,
                "steps": st.steps if st is not None else 0,
                "skipped_steps": st.skipped_steps if st is not None else 0,
                "last_step_skipped": bool(st is not None and st.last_step_skipped),
            }
        )
    scalers = (
        [s.state_dict() for s in target.scaler_group.scalers]
        if target.scaler_group is not None
        else []
    )
    step = extra.get("step") if isinstance(extra, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        step = optimizers[0]["steps"]
    from .. import __version__

    manifest = {
        "format": files.FORMAT,
        "distamp_version": __version__,
        "torch_version": str(torch.__version__),
        "step": step,
        "world_size": world,
        "properties": target.props,
        # who sharded: FSDP's parameters or distamp's masters (what inspect shows; DDP's and
        # FSDP's O2 checkpoints do not load each other)
        "data_parallel": "fsdp"
        if any(type(v.st.masters).__name__ == "FSDPParams" for v in target.views if v.st)
        else "ddp",
        "models": models,
        "optimizers": optimizers,
        "scalers": scalers,
        "extra": extra,
    }
    return sd, manifest


def _broadcasts_buffers(model: nn.Module) -> bool:
    """Whether ``model`` (or a DDP inside ``torch.compile``) is a DDP that broadcasts rank 0's
    buffers at every forward, which makes any other rank's buffers moot."""
    while True:
        if type(model).__name__ == "DistributedDataParallel":
            # torch 2.13 renamed broadcast_buffers (still a property) forward_sync_buffers
            synced = getattr(model, "forward_sync_buffers", None)
            return bool(getattr(model, "broadcast_buffers", False) if synced is None else synced)
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return False
        model = inner


def _apart_between_ranks(target: _Target) -> dict[str, torch.Tensor]:
    """Collective (one all-gather of digests): this rank's tensors whose values differ between
    the ranks, by their key in the checkpoint (``key@start``: the stretch of a flat tensor that
    starts there): buffers, and the parameters DDP ignores with their masters and optimizer
    state.

    [Note: buffers that differ between ranks] The checkpoint holds rank 0's plain tensors, and
    every rank loads them. Where buffers are rank-local — BatchNorm statistics under FSDP (which
    never syncs buffers) or ``DDP(broadcast_buffers=False)`` — a resume gave every rank rank 0's
    statistics (an audit: rank 1's running_mean 1.7e-2 off the uninterrupted run's), breaking
    the bit-exact resume. So the ranks compare a digest of each buffer, and each rank writes
    the ones that differ into its own rank file, restored at the same world size; at another
    world size every rank takes rank 0's, with a warning naming them. Of a DDP that broadcasts
    buffers only those on its ignore list (its next forward hands out rank 0's of the others).

    Parameters DDP was told to ignore may differ too (expert parallelism: each rank its own
    experts). The checkpoint held one value of each — with replicated masters pieced from the
    ranks' copies, so that not even rank 0 got its own back (an audit) — so their tensors that
    differ go into the rank files too: the weight, its FP32 master, its optimizer state
    (sharded masters refuse such parameters, at wrap and at load)."""
    if not target.distributed():
        return {}
    buffers: dict[str, torch.Tensor] = {}
    for i, (model, synced) in enumerate(zip(target.models, target.synced_buffers, strict=True)):
        # By identity, under their state_dict keys (a CheckpointWrapper renames those); where
        # DDP broadcasts buffers, the ones on its ignore list only (it leaves them alone: a
        # review found a rank-local one resumed as rank 0's)
        ids = {id(b) for b in model.buffers()}
        if synced:
            ids &= set(ddp_ignored_tensors([model]))
        for key, value in model_state(model).items():
            if id(value) in ids and not is_dtensor(value):
                buffers[f"model.{i}.{key}"] = value.detach()
    ignored = target.scaler_group.ddp_ignored() if target.scaler_group is not None else set()
    # The parameters DDP ignores by each of their tensors: their FP32 masters and optimizer
    # state may differ where the weights do not yet (a fine-tune's small steps in bf16; a review)
    candidates = buffers | _rank_local_params(target, set(ignored))
    digests = {k: digest(v) for k, v in candidates.items()}
    seen: list[Any] = [None] * target.world
    dist.all_gather_object(seen, digests, group=target.pg)
    return {k: v for k, v in candidates.items() if any(o.get(k) != digests[k] for o in seen)}


def _rank_local_params(target: _Target, ids: set[int]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of the parameters ``ids`` (see [Note: buffers that differ
    between ranks]): the model's, the FP32 masters' stretch of a flat tensor, the state."""
    out: dict[str, torch.Tensor] = {}
    named = {i: n for i, n in target.names.items() if i in ids}
    for i, model in enumerate(target.models):
        for key, value in model_state(model).items():
            if id(value) in ids:
                out[f"model.{i}.{key}"] = value.detach()
    mine = set(named.values())
    for view in target.views:
        o = view.index
        for g, gv in enumerate(view.groups):
            for name, tensor in gv.kept:
                if name in mine:
                    for k, v in kept_state(view.opt, tensor)[0].items():
                        out[f"optim.{o}.p.{name}.{k}"] = v
            flat = gv.flat
            if flat is None or flat.sharded is not None:  # (sharded: refused at wrap)
                continue
            starts = flat_starts(flat.shapes)
            for name, master, start in zip(flat.names, flat.masters, starts, strict=True):
                if name not in mine:
                    continue
                out[f"optim.{o}.g{g}.master@{start}"] = master.detach().reshape(-1)
                for k, v in view.opt.state.get(master, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == master.shape and v.dim() > 0:
                        out[f"optim.{o}.g{g}.state.{k}@{start}"] = detached_dense(v).reshape(-1)
    return out


def _save_rng(tmp: Path, rank: int, buffers: dict[str, torch.Tensor]) -> None:
    """This rank's file: its RNG states, and its buffers that differ from other ranks' (see
    [Note: buffers that differ between ranks])."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if buffers:
        state["buffers"] = {key: value.detach().cpu().clone() for key, value in buffers.items()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    version, internal, gauss = random.getstate()
    state["python"] = {
        "version": version,
        "state": torch.tensor(internal, dtype=torch.int64),
        "gauss": gauss,
    }
    try:
        import numpy as np

        if np.random.get_state(legacy=False)["bit_generator"] != "MT19937":
            raise _NotMT19937  # another bit generator (np.random.set_bit_generator)
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    except ImportError:
        pass
    except _NotMT19937:
        # (an audit: every save failed with a bare "too many values to unpack")
        warnings.warn(
            "save_checkpoint: numpy's global RNG runs another bit generator than MT19937 "
            "(np.random.set_bit_generator): its state is not saved (the torch and Python RNG "
            "states are); expected MT19937 for numpy's to be restored on resume",
            stacklevel=3,
        )
    with open(tmp / f"rng-{rank}.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


class _NotMT19937(Exception):
    """numpy's global RNG is not the legacy MT19937 state that is saved."""


def _read_rng(directory: Path, rank: int) -> dict[str, Any]:
    """This rank's RNG file, read (and numpy's state checked) before anything is installed: a
    failure after the weights were replaced lost the model the user had (an audit)."""
    state = torch.load(directory / f"rng-{rank}.pt", weights_only=True)
    if "numpy" in state:
        try:
            import numpy as np

            if np.random.get_state(legacy=False)["bit_generator"] != "MT19937":
                warnings.warn(
                    "load_checkpoint: numpy's global RNG runs another bit generator than "
                    "MT19937 (np.random.set_bit_generator): the saved MT19937 state is not "
                    "restored into it (the torch and Python RNG states are)",
                    stacklevel=4,
                )
                del state["numpy"]
        except ImportError:
            del state["numpy"]
    return dict(state)


def _load_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    if "numpy" in state:
        try:
            import numpy as np

            npst = state["numpy"]
            np.random.set_state(
                (
                    npst["kind"],
                    npst["keys"].numpy().astype("uint32"),
                    npst["pos"],
                    npst["has_gauss"],
                    npst["cached"],
                )
            )
        except ImportError:
            pass


# -- load ---------------------------------------------------------------------------------------


def _same_checkpoint_on_every_rank(
    directory: Path, manifest: dict[str, Any], group: dist.ProcessGroup | None
) -> None:
    """Every rank must load one checkpoint: ranks handed different ones (another step of the
    same run) loaded each its own and stepped apart from there (an audit). Compared by the
    manifest's hash in ``COMMIT``, not the path: node-local copies may sit at other paths."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = (files.commit_digest(directory), str(directory), manifest.get("step"))
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, mine, group=group)
    if any(other[0] != seen[0][0] for other in seen):
        detail = "; ".join(
            f"rank {rank}: {path} (step {step}, manifest {digest[:12]})"
            for rank, (digest, path, step) in enumerate(seen)
        )
        raise CheckpointError(
            f"load_checkpoint: expected every rank to load the same checkpoint, found {detail}"
        )


def load_checkpoint(directory: PathLike | None, model: Any, optimizer: Any) -> dict[str, Any]:
    """Collective over the wrapped optimizer's process group: restore a checkpoint; return ``extra``.

    Works at any world size (DCP reads each rank's piece of the canonical tensors), sharded or
    replicated. The files are verified against the manifest first, and the model and the
    properties are compared with the checkpoint's: any difference raises
    :class:`CheckpointError` on every rank, naming it, before anything is changed. Pending
    gradients are dropped. RNG states are restored when the world size is the one saved. The
    param groups' settings (lr, weight_decay, betas, ...) are the checkpoint's, as with torch's
    ``optimizer.load_state_dict``: to resume at another lr, set it after loading.
    """
    if directory is None:
        raise CheckpointError(
            "load_checkpoint: expected a checkpoint directory, got None (latest_checkpoint(root) "
            "returns None when root holds no complete checkpoint: start fresh in that case)"
        )
    _check_path(directory, "load_checkpoint")
    target = _Target(model, optimizer, "load_checkpoint")
    directory = Path(directory)
    pg = target.pg
    manifest = agree("load_checkpoint", lambda: files.read_manifest(directory), pg)
    _same_checkpoint_on_every_rank(directory, manifest, pg)
    agree("load_checkpoint", lambda: _check_compatible(manifest, target), pg)
    agree(
        "load_checkpoint: verifying files",
        lambda: files.verify_share(directory, manifest["files"], target.rank, target.world),
        pg,
    )
    agree("load_checkpoint: reading the metadata", lambda: metadata.read(directory), pg)
    dest, install = agree(
        "load_checkpoint: preparing buffers", lambda: _destination(manifest, target), pg
    )
    try:
        with files.quiet_single_process(not target.distributed()):
            dcp.load(
                dest,
                storage_reader=metadata.Reader(directory),
                planner=metadata.Planner(),
                process_group=pg,
                no_dist=not target.distributed(),
            )
    except (Exception, dcp.api.CheckpointException) as exc:  # see save_checkpoint
        raise CheckpointError(
            f"load_checkpoint: {directory}: reading the shards failed: {_dcp_failures(exc)}"
        ) from exc
    agree(
        "load_checkpoint: this rank's buffers",
        lambda: _own_buffers_into(dest, manifest, directory, target),
        pg,
    )
    same_world = manifest["world_size"] == target.world
    rng: dict[str, Any] = {}
    if same_world:
        rng = agree("load_checkpoint: RNG state", lambda: _read_rng(directory, target.rank), pg)
    elif target.rank == 0:  # (an audit: every rank kept the RNG it had, unwarned)
        warnings.warn(
            f"load_checkpoint: the checkpoint was saved at {manifest['world_size']} ranks, "
            f"loaded at {target.world}: the ranks' RNG states (torch, Python, numpy) are not "
            "restored, each rank keeps its own; seed each rank after load_checkpoint where its "
            "randomness (dropout, augmentation) must differ, e.g. torch.manual_seed(seed + rank)",
            stacklevel=3,
        )
    install(dest)
    for view in target.views:
        if view.st is not None:
            view.st.masters.copy_to_model()  # collective when sharded
            view.st.masters.restored = True  # see [Note: loading weights into the masters]
    if same_world:
        _load_rng(rng)
    extra = manifest.get("extra") or {}
    return extra if isinstance(extra, dict) else {"extra": extra}


def _check_compatible(manifest: dict[str, Any], target: _Target) -> None:
    saved = manifest["properties"]
    was, now = saved.get("enabled", True), target.props.get("enabled", True)
    if was != now:
        # apex's `enabled=args.amp` toggled between runs: the other differences (a preset's
        # cast_model_type, FSDP-like layouts, loss scalers) were named instead (an audit).
        raise CheckpointError(
            f"the checkpoint was saved with distamp.wrap(..., enabled={was}) "
            f"({'mixed precision' if was else 'plain FP32 training, distamp off'}), this run has "
            f"enabled={now}: expected the same; resume with enabled={was}, or load its weights "
            "alone (distamp.checkpoint.consolidate) into a freshly wrapped model"
        )
    for key in COMPARED_PROPERTIES:
        if saved.get(key) != target.props.get(key):
            # (half_dtype= sets cast_model_type at O2/O3: name what the user passed too)
            also = " (wrap's half_dtype)" if key == "cast_model_type" else ""
            raise CheckpointError(
                f"the checkpoint was saved with {key}={saved.get(key)!r}{also}, this run has "
                f"{key}={target.props.get(key)!r}; wrap (under FSDP: distamp.fsdp.fully_shard) "
                f"with the same opt_level and properties, {WEIGHTS_ALONE}"
            )
    if len(manifest["models"]) != len(target.models):
        raise CheckpointError(
            f"expected {len(manifest['models'])} model(s) as saved, got {len(target.models)}"
        )
    for i, (entry, model) in enumerate(zip(manifest["models"], target.models, strict=True)):
        mine = model_entry(i, model, len(target.models))["keys"]
        theirs = entry["keys"]
        where = "model" if len(target.models) == 1 else f"models[{i}]"
        # Every difference at once, as torch's load_state_dict lists them (an audit: a layer
        # more named only its weight, and the next try its bias)
        differences = [
            *(f"the checkpoint has {k!r}, this model does not" for k in theirs if k not in mine),
            *(f"this model has {k!r}, the checkpoint does not" for k in mine if k not in theirs),
            *(
                f"{k!r} has shape {tuple(theirs[k][0])} in the checkpoint, {tuple(mine[k][0])} "
                "in this model"
                for k in theirs
                if k in mine and list(mine[k][0]) != list(theirs[k][0])
            ),
        ]
        if differences:
            listed = "; ".join(differences[:8])
            more = f" (and {len(differences) - 8} more)" if len(differences) > 8 else ""
            raise CheckpointError(
                f"{where}: {listed}{more}: expected the model it was saved from (the same "
                f"parameters, the same sizes); {WEIGHTS_ALONE}"
            )
    if len(manifest["optimizers"]) != len(target.views):
        raise CheckpointError(
            f"expected {len(manifest['optimizers'])} optimizer(s) as saved, got {len(target.views)}"
        )
    for entry, view in zip(manifest["optimizers"], target.views, strict=True):
        o = view.index
        if entry["class"] != type(view.opt).__name__:
            raise CheckpointError(
                f"optimizers[{o}]: the checkpoint holds {entry['class']} state, this optimizer "
                f"is a {type(view.opt).__name__}"
            )
        if len(entry["groups"]) != len(view.groups):
            raise CheckpointError(
                f"optimizers[{o}]: {len(entry['groups'])} param group(s) in the checkpoint, "
                f"{len(view.groups)} here: expected the optimizer as saved — groups added with "
                "optimizer.add_param_group after wrap must be added again, in the same order, "
                "before load_checkpoint"
            )
        _refuse_moved_between_groups(o, entry["groups"], view.groups)
        for g, (saved_group, gv) in enumerate(zip(entry["groups"], view.groups, strict=True)):
            saved_flat = saved_group["flat"]
            mine_flat = (
                None if gv.flat is None else (gv.flat.names, [list(s) for s in gv.flat.shapes])
            )
            theirs_flat = (
                None if saved_flat is None else (saved_flat["names"], saved_flat["shapes"])
            )
            if _converted(saved_group, gv, view) is not None:
                # FP32 weights, sharded on one side only: same parameters, other form.
                theirs_names = (saved_flat["names"] if saved_flat else []) + saved_group["kept"]
                mine_names = (gv.flat.names if gv.flat else []) + [n for n, _ in gv.kept]
                if sorted(theirs_names) != sorted(mine_names):
                    raise CheckpointError(
                        f"optimizers[{o}].param_groups[{g}] holds other parameters than in the "
                        "checkpoint; expected the same parameters in the same order"
                    )
                continue
            if (mine_flat is None) != (theirs_flat is None) and view.st is not None:
                fsdp_here = type(view.st.masters).__name__ == "FSDPParams"
                raise CheckpointError(
                    f"optimizers[{o}]: the checkpoint was saved "
                    f"{'with distamp masters (DDP)' if fsdp_here else 'from an FSDP model'} and "
                    f"this run {'shards with FSDP' if fsdp_here else 'uses distamp masters (DDP)'}"
                    "; expected the same data-parallel kind on both sides (or use `python -m "
                    "distamp.checkpoint consolidate` to get plain FP32 weights)"
                )
            mine_kept = [n for n, _ in gv.kept]
            if mine_flat != theirs_flat or saved_group["kept"] != mine_kept:
                raise CheckpointError(
                    f"optimizers[{o}].param_groups[{g}] holds other parameters than in the "
                    "checkpoint; expected the same parameters in the same order: "
                    + _group_difference(
                        mine_flat,
                        theirs_flat,
                        mine_kept,
                        saved_group["kept"],
                        fsdp=view.st is not None and type(view.st.masters).__name__ == "FSDPParams",
                    )
                )
    if len(manifest["scalers"]) != (
        len(target.scaler_group.scalers) if target.scaler_group is not None else 0
    ):
        raise CheckpointError(
            f"expected {len(manifest['scalers'])} loss scaler(s) (num_losses) as saved"
        )


def _refuse_moved_between_groups(
    o: int, saved: list[dict[str, Any]], here: list[GroupView]
) -> None:
    """A parameter in another param group than when saved (the decay / no-decay split built
    otherwise, the groups in another order) is named with both groups. Compared group by group
    it read as absent, with a hint at keep_fp32_modules (an audit)."""
    saved_at = {
        name: g
        for g, group in enumerate(saved)
        for name in (group["flat"]["names"] if group["flat"] else []) + group["kept"]
    }
    for g, gv in enumerate(here):
        for name in (gv.flat.names if gv.flat else []) + [n for n, _ in gv.kept]:
            if saved_at.get(name, g) != g:
                raise CheckpointError(
                    f"optimizers[{o}]: parameter {name!r} is in param_groups[{saved_at[name]}] "
                    f"in the checkpoint and in param_groups[{g}] here; expected the param "
                    "groups built as when saving (the same split, in the same order)"
                )


def _group_difference(
    mine_flat: tuple[list[str], Any] | None,
    theirs_flat: tuple[list[str], Any] | None,
    mine_kept: list[str],
    theirs_kept: list[str],
    *,
    fsdp: bool = False,
) -> str:
    """The first difference between a param group here and in the checkpoint, in words. Under
    FSDP every parameter is its own master: present or absent, nothing about keep_fp32_modules
    (an audit: "stepped whole (kept FP32 or not cast)" of a cast bf16 head, and a hint at an
    argument fully_shard refuses)."""
    flat = {
        "here": mine_flat[0] if mine_flat else [],
        "saved": theirs_flat[0] if theirs_flat else [],
    }
    kept = {"here": mine_kept, "saved": theirs_kept}
    where = {
        side: {
            **dict.fromkeys(flat[side], "present" if fsdp else "with FP32 masters"),
            **dict.fromkeys(
                kept[side], "present" if fsdp else "stepped whole (kept FP32 or not cast)"
            ),
        }
        for side in ("here", "saved")
    }
    for name in [*where["saved"], *where["here"]]:
        saved, here = where["saved"].get(name), where["here"].get(name)
        if saved != here:
            why = (
                "another model than the one saved (an untied head, a layer more or less?)"
                if fsdp
                else "other keep_fp32_modules, keep_batchnorm_fp32 or parameters than when it "
                "was saved?"
            )
            return (
                f"parameter {name!r} is {saved or 'absent'} in the checkpoint and "
                f"{here or 'absent'} here ({why})"
            )
    for what, names in (("with FP32 masters", flat), ("stepped whole", kept)):
        if names["here"] != names["saved"]:
            return (
                f"the parameters {what} come in another order: {names['saved'][:4]} saved, "
                f"{names['here'][:4]} here"
            )
    shapes = [side[1] if side else None for side in (theirs_flat, mine_flat)]
    return f"the shapes differ: {shapes[0]} saved, {shapes[1]} here"


def _converted(saved_group: dict[str, Any], gv: GroupView, view: OptimizerView) -> str | None:
    """How a param group of FP32 weights is converted on load, or None when it is not.

    [Note: sharded and unsharded FP32 weights load each other] O0/O1 keep optimizer state per
    parameter (``optim.{o}.p.{name}.{k}``), or flat (``optim.{o}.g{g}.state.{k}``) when wrapped
    with ``shard_master_weights=True``. Either loads into the other, at any world size: "unflatten"
    reads the flat tensors whole and cuts each parameter's state out of them, "flatten" reads each
    parameter's state whole and cuts this rank's slices of it. The FP32 copies come with the
    model's weights (they are the same values).
    """
    st = view.st
    if st is None or st.group.props.master_weights:
        return None
    saved_flat = saved_group["flat"]
    if saved_flat is not None and gv.flat is None:
        # Also into FSDP's sharded parameters (O0/O1 keep no masters there either): refused as
        # "saved with distamp masters (DDP)", which O0/O1 have none of (an audit).
        return "unflatten"
    if type(st.masters).__name__ == "FSDPParams":
        return None
    if saved_flat is None and gv.flat is not None and gv.flat.sharded is not None:
        return "flatten"
    return None


def _destination(manifest: dict[str, Any], target: _Target) -> tuple[dict[str, Any], Any]:
    """Fresh buffers for everything this rank reads, and the function that installs them."""
    rank, world = target.rank, target.world
    dest: dict[str, Any] = {}
    for i, (entry, model) in enumerate(zip(manifest["models"], target.models, strict=True)):
        live = live_state_dict(model)
        for key, (shape, dtype) in entry["keys"].items():
            dest[f"model.{i}.{key}"] = (
                torch.empty_like(live[key], dtype=files.manifest_dtype(dtype))
                if is_dtensor(live[key])
                else torch.empty(shape, dtype=files.manifest_dtype(dtype))
            )
    local_bufs: dict[str, torch.Tensor] = {}
    reshuffle: list[tuple[str, ShardedMasterParams, int]] = []
    """The sharded buffers DCP fills in the canonical layout, to lay out like the shards."""
    for entry, view in zip(manifest["optimizers"], target.views, strict=True):
        o = view.index
        for g, (saved_group, gv) in enumerate(zip(entry["groups"], view.groups, strict=True)):
            flat = gv.flat
            how = _converted(saved_group, gv, view)
            if how == "unflatten":  # each rank reads the flat state whole
                for k, d in saved_group["flat"]["tensor_keys"].items():
                    total = saved_group["flat"]["total"]
                    dest[f"optim.{o}.g{g}.state.{k}"] = torch.zeros(
                        total, dtype=files.manifest_dtype(d)
                    )
            elif how == "flatten":  # each rank reads the state of every parameter it has part of
                assert flat is not None and flat.sharded is not None
                held = {index for index, *_ in flat.sharded.groups[flat.group].pieces}
                for index, (name, shape) in enumerate(zip(flat.names, flat.shapes, strict=True)):
                    if index not in held:
                        continue
                    for k, d in entry["kept"][name]["tensor_keys"].items():
                        dest[f"optim.{o}.p.{name}.{k}"] = torch.empty(
                            shape, dtype=files.manifest_dtype(d), device=_flat_device(flat)
                        )
            elif flat is not None:
                saved_flat = saved_group["flat"]
                keys = {"master": torch.float32} | {
                    f"state.{k}": files.manifest_dtype(d)
                    for k, d in saved_flat["tensor_keys"].items()
                }
                for key, dtype in keys.items():
                    name = f"optim.{o}.g{g}.{key}"
                    device = _flat_device(flat)
                    if flat.sharded is not None:
                        lo, hi = flat.piece(rank, world)
                        size = flat.sharded.groups[flat.group].shard_size
                        buf = torch.zeros(size, dtype=dtype, device=device)
                        local_bufs[name] = buf
                        reshuffle.append((name, flat.sharded, flat.group))
                        dest[name] = target.piece_tensor(buf[: hi - lo], flat.total)
                    else:
                        buf = torch.zeros(flat.total, dtype=dtype, device=device)
                        local_bufs[name] = buf
                        dest[name] = buf
            for name, tensor in gv.kept:
                if name not in entry["kept"]:  # "unflatten": its state is in the flat tensors
                    continue
                for key, dtype in entry["kept"][name]["tensor_keys"].items():
                    dest[f"optim.{o}.p.{name}.{key}"] = (
                        torch.empty_like(tensor, dtype=files.manifest_dtype(dtype))
                        if is_dtensor(tensor)
                        else torch.empty(
                            tensor.shape, dtype=files.manifest_dtype(dtype), device=tensor.device
                        )
                    )

    def install(loaded: dict[str, Any]) -> None:
        for name, sharded, g in reshuffle:  # collective, in the same order on every rank
            local_bufs[name] = sharded.from_canonical(g, local_bufs[name])
        with torch.no_grad():
            for i, model in enumerate(target.models):
                prefix = f"model.{i}."
                named = checkpoint_names(model)
                keys = {named(k): k for k in model.state_dict(keep_vars=True)}
                model.load_state_dict(
                    {keys[k[len(prefix) :]]: v for k, v in loaded.items() if k.startswith(prefix)},
                    strict=True,
                )
            for entry, view in zip(manifest["optimizers"], target.views, strict=True):
                _install_optimizer(entry, view, loaded, local_bufs)
            if target.scaler_group is not None:
                for scaler, saved in zip(
                    target.scaler_group.scalers, manifest["scalers"], strict=True
                ):
                    scaler.load_state_dict(saved)

    return dest, install


def _own_buffers_into(
    dest: dict[str, Any], manifest: dict[str, Any], directory: Path, target: _Target
) -> None:
    """Replace rank 0's values of the buffers that differed between the ranks at save with this
    rank's own (same world size), or warn that every rank gets rank 0's (see [Note: buffers
    that differ between ranks])."""
    keys = [k for k in manifest.get("rank_buffers", []) if k.split("@")[0] in dest]
    if not keys:
        return
    other_world = manifest["world_size"] != target.world
    files.apply_rank_tensors(dest, keys, directory / f"rng-{0 if other_world else target.rank}.pt")
    names = sorted({k.split(".", 2)[2] for k in keys if k.startswith("model.")})
    names = names or ["the FP32 masters and optimizer state of parameters DDP ignores"]
    if other_world and target.rank == 0:
        warnings.warn(
            f"load_checkpoint: {names[:4]}{' and more' if len(names) > 4 else ''} (buffers, "
            "or parameters DDP ignores and their masters and optimizer state) held other values "
            f"on each of the {manifest['world_size']} ranks that saved them; at world size "
            f"{target.world} every rank gets rank 0's",
            stacklevel=3,
        )


def _flat_device(flat: FlatGroup) -> torch.device:
    if flat.sharded is not None:
        return flat.sharded.shards[flat.group].device
    return flat.masters[0].device


def _install_optimizer(
    entry: dict[str, Any],
    view: OptimizerView,
    loaded: dict[str, Any],
    local_bufs: dict[str, torch.Tensor],
) -> None:
    o, opt = view.index, view.opt
    opt.zero_grad(set_to_none=True)
    opt.state.clear()
    for group, hyper in zip(opt.param_groups, entry["hyper"], strict=True):
        for key, value in hyper.items():
            group[key] = value
    for g, (saved_group, gv) in enumerate(zip(entry["groups"], view.groups, strict=True)):
        flat = gv.flat
        how = _converted(saved_group, gv, view)
        if how == "unflatten":
            _unflatten_state(opt, o, g, saved_group["flat"], dict(gv.kept), loaded)
        elif how == "flatten":
            assert flat is not None and flat.sharded is not None
            _flatten_state(opt, o, entry["kept"], flat.sharded, flat.group, flat.names, loaded)
        elif flat is not None:
            saved_flat = saved_group["flat"]
            prefix = f"optim.{o}.g{g}."
            states = {k: local_bufs[prefix + "state." + k] for k in saved_flat["tensor_keys"]}
            has_state = saved_flat["has_state"]
            if flat.sharded is not None:
                shard = flat.sharded.shards[flat.group]
                shard.copy_(local_bufs[prefix + "master"])
                layout = flat.sharded.groups[flat.group]
                for (index, a, b), chunk in zip(
                    layout.spans, flat.sharded.chunks[flat.group], strict=True
                ):
                    if not has_state[index]:
                        continue
                    per = {k: states[k][a:b].clone() for k in installed_keys(saved_flat, index)}
                    for k, values in saved_flat["scalars"].items():
                        if values[index] is not None:
                            per[k] = _clone(values[index])
                    opt.state[chunk] = per
            else:
                full = local_bufs[prefix + "master"]
                for i, (master, start) in enumerate(
                    zip(flat.masters, flat_starts(flat.shapes), strict=True)
                ):
                    n = master.numel()
                    master.copy_(full[start : start + n].view(master.shape))
                    if not has_state[i]:
                        continue
                    per = {
                        k: states[k][start : start + n].view(master.shape).clone()
                        for k in installed_keys(saved_flat, i)
                    }
                    for k, values in saved_flat["scalars"].items():
                        if values[i] is not None:
                            per[k] = _clone(values[i])
                    opt.state[master] = per
        for name, tensor in gv.kept:
            saved = entry["kept"].get(name)
            if saved is None or not saved["has_state"]:  # None: "unflatten" did it
                continue
            per = {k: loaded[f"optim.{o}.p.{name}.{k}"].clone() for k in saved["tensor_keys"]}
            per |= {k: _clone(v) for k, v in saved["scalars"].items()}
            opt.state[tensor] = per
    st = view.st
    if st is not None:
        st.steps = int(entry["steps"])
        st.skipped_steps = int(entry["skipped_steps"])
        # Absent from checkpoints saved before it was kept (an audit: stats() lost it).
        st.last_step_skipped = bool(entry.get("last_step_skipped", False))
        st.reset()


def _unflatten_state(
    opt: torch.optim.Optimizer,
    o: int,
    g: int,
    saved_flat: dict[str, Any],
    kept: dict[str, torch.Tensor],
    loaded: dict[str, Any],
) -> None:
    """Per-parameter state of FP32 weights from a checkpoint that kept it flat (see [Note: sharded
    and unsharded FP32 weights load each other])."""
    starts = flat_starts([tuple(s) for s in saved_flat["shapes"]])
    for i, (name, start) in enumerate(zip(saved_flat["names"], starts, strict=True)):
        if not saved_flat["has_state"][i]:
            continue
        tensor = kept[name]
        n = tensor.numel()
        per = {
            k: loaded[f"optim.{o}.g{g}.state.{k}"][start : start + n]
            .view(tensor.shape)
            .to(tensor.device)
            .clone()
            for k in installed_keys(saved_flat, i)
        }
        if is_dtensor(tensor):  # FSDP: this rank's part of each, laid out as the parameter
            per = {
                k: distribute_tensor(
                    v,
                    tensor.device_mesh,  # type: ignore[attr-defined]
                    tensor.placements,  # type: ignore[attr-defined]
                    src_data_rank=None,
                )
                for k, v in per.items()
            }
        for k, values in saved_flat["scalars"].items():
            if values[i] is not None:
                per[k] = _clone(values[i])
        opt.state[tensor] = per


def _flatten_state(
    opt: torch.optim.Optimizer,
    o: int,
    saved_kept: dict[str, Any],
    sharded: ShardedMasterParams,
    g: int,
    names: list[str],
    loaded: dict[str, Any],
) -> None:
    """This rank's slices of the state of FP32 weights from a checkpoint that kept it per
    parameter, and its FP32 copies from the weights just loaded into the model (see [Note:
    sharded and unsharded FP32 weights load each other])."""
    layout, shard = sharded.groups[g], sharded.shards[g]
    for index, src, count, dst in layout.pieces:
        shard[dst : dst + count].copy_(layout.params[index].detach().reshape(-1)[src : src + count])
    for (index, a, b), chunk in zip(layout.spans, sharded.chunks[g], strict=True):
        saved = saved_kept[names[index]]
        if not saved["has_state"]:
            continue
        full = {k: loaded[f"optim.{o}.p.{names[index]}.{k}"] for k in saved["tensor_keys"]}
        full |= {k: _clone(v) for k, v in saved["scalars"].items()}
        param = layout.params[index]
        opt.state[chunk] = slice_state(full, param, layout.param_offset(index, a), b - a, g)


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
