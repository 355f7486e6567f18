"""The files of a checkpoint directory: atomic commit, checksums, the manifest, rank agreement.

[Note: atomic checkpoints] Every rank writes into ``<directory>.incomplete-<owner>`` (see [Note: one
temporary folder per save]); once all ranks have finished, the files are hashed (each rank hashes
its share), rank 0 writes the manifest (``distamp.pt``) holding every file's size and SHA-256,
then ``COMMIT`` holding the manifest's own SHA-256, and renames the directory into place. A
directory is a checkpoint iff its ``COMMIT`` matches its manifest: a save killed at any point
leaves either the previous checkpoint or a ``.incomplete-*`` directory that
:func:`latest_checkpoint` ignores. Overwriting ``directory`` moves the old one to
``<directory>.old`` first and deletes it only after the rename, so a crash between the two
renames still leaves a complete checkpoint on disk.

[Note: verify before reading] On load, the files are hashed against the manifest before DCP opens
them. That catches truncation and flipped bytes with a message naming the file. No file of a
checkpoint is unpickled: ``distamp.pt`` and ``rng-*.pt`` load with ``weights_only=True``, DCP's
``.distcp`` files hold tensors that DCP reads with ``weights_only=True``, and its ``.metadata`` is
written and read as plain data (see [Note: no pickle in a checkpoint] in metadata.py).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

PathLike = str | os.PathLike[str]
"""A checkpoint directory, as a string or a path."""

FORMAT = "distamp.checkpoint/2"
"""/2: DCP's ``.metadata`` as plain data (/1 pickled it; not read)."""
MANIFEST = "distamp.pt"
COMMIT = "COMMIT"
INCOMPLETE = ".incomplete"
OLD = ".old"

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank, naming what is wrong."""


# -- agreement across ranks ---------------------------------------------------------------------


def agree(what: str, fn: Callable[[], T], group: dist.ProcessGroup | None) -> T:
    """Collective over ``group``: run ``fn`` here; raise :class:`CheckpointError` on every rank if
    it failed on any rank, naming the rank(s) and the error.

    A step that fails on one rank only (a missing file, a mismatched model) must never leave the
    other ranks waiting in the next collective: every fallible local step goes through here.
    """
    result: T | None = None
    error: str | None = None
    try:
        result = fn()
    except Exception as exc:  # every local failure must reach the other ranks
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise CheckpointError(f"{what}: {error}")
        return result  # type: ignore[return-value]
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {err}" for rank, err in failed)
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s) — {detail}")
    return result  # type: ignore[return-value]


# -- hashing ------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def data_files(directory: Path) -> list[str]:
    """The files of a checkpoint that the manifest lists (all but the manifest and COMMIT)."""
    return sorted(
        p.name for p in directory.iterdir() if p.is_file() and p.name not in (MANIFEST, COMMIT)
    )


def hash_share(directory: Path, rank: int, world: int) -> dict[str, list[Any]]:
    """{file: [size, sha256]} for this rank's share (every ``world``-th file) of the data files."""
    names = data_files(directory)
    return {
        n: [(directory / n).stat().st_size, sha256_file(directory / n)] for n in names[rank::world]
    }


def damaged_files(
    directory: Path, files: dict[str, list[Any]], *, hashed: bool = False
) -> list[str]:
    """The data files of a committed checkpoint that are missing or not the size its manifest
    records, each as "name (why)": a stat per file, no hashing (:func:`verify_share` hashes);
    ``hashed``: also every file whose SHA-256 differs from the manifest's (reads them all)."""
    bad = []
    for name, (size, digest) in sorted(files.items()):
        try:
            found = (directory / name).stat().st_size
        except FileNotFoundError:
            bad.append(f"{name} (missing)")
            continue
        if found != size:
            bad.append(f"{name} ({found} bytes, expected {size})")
        elif hashed and sha256_file(directory / name) != digest:
            bad.append(f"{name} (contents differ from the manifest's SHA-256)")
    return bad


def verify_share(directory: Path, files: dict[str, list[Any]], rank: int, world: int) -> None:
    """Check this rank's share of ``files`` against the disk; raise naming the first bad file."""
    present = set(data_files(directory))
    missing = sorted(set(files) - present)
    if missing:
        raise CheckpointError(f"{directory}: file(s) {missing} listed in the manifest are missing")
    for name in sorted(files)[rank::world]:
        size, digest = files[name]
        found = (directory / name).stat().st_size
        if found != size:
            raise CheckpointError(
                f"{directory / name}: expected {size} bytes, found {found} (truncated or altered)"
            )
        if sha256_file(directory / name) != digest:
            raise CheckpointError(
                f"{directory / name}: SHA-256 differs from the manifest (the file was altered)"
                + _another_beside(directory)
            )


def _another_beside(directory: Path) -> str:
    """Where a job that resumes with ``latest_checkpoint`` can go instead: an altered file that
    kept its size is found only by hashing, so ``latest_checkpoint`` (a stat per file) keeps
    choosing this one and every restart fails here (an audit)."""
    others = [path for _, path in list_checkpoints(directory.parent) if Path(path) != directory]
    if not others:
        return ""
    return (
        f"; another checkpoint beside it: {others[-1]} (the newest by step; move or delete "
        f"{directory.name} for latest_checkpoint to pick it)"
    )


# -- manifest and commit ------------------------------------------------------------------------


def write_manifest_and_commit(tmp: Path, manifest: dict[str, Any]) -> None:
    """Write ``distamp.pt`` then ``COMMIT`` (its hash) into ``tmp``, both fsynced."""
    path = tmp / MANIFEST
    with open(path, "wb") as f:
        torch.save(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / COMMIT, "w") as f:
        f.write(f"{FORMAT}\nsha256 {sha256_file(path)}\n")
        f.flush()
        os.fsync(f.fileno())


def commit_digest(directory: Path) -> str:
    """The manifest's SHA-256 as ``COMMIT`` records it (after :func:`read_manifest` checked it)."""
    return (directory / COMMIT).read_text().split()[2]


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint; raises :class:`CheckpointError` if there is none."""
    if not directory.is_dir():
        old = directory.with_name(directory.name + OLD)
        if (old / COMMIT).is_file():  # a save over it was stopped between its two renames
            raise CheckpointError(
                f"{directory}: no such checkpoint directory, but {old} holds the checkpoint a "
                f"save over it replaced and did not finish: load {old} "
                "(distamp.latest_checkpoint(folder) picks it too)"
            )
        what = (
            "a file, not a checkpoint directory"
            if directory.exists()
            else "no such checkpoint directory"
        )
        parent = directory.parent
        unfinished = (
            sorted(p.name for p in parent.glob(glob.escape(directory.name) + INCOMPLETE + "*"))
            if parent.is_dir() and not directory.exists()
            else []
        )
        if unfinished:  # a save to it was killed before its rename (an audit: not said)
            what += (
                f"; {parent / unfinished[0]} is the temporary folder of a save to it that did "
                "not finish: load the previous checkpoint (distamp.latest_checkpoint(folder) "
                "picks the newest committed one)"
            )
        raise CheckpointError(f"{directory}: {what}")
    commit = directory / COMMIT
    if is_temporary(directory.name):
        # Before the .metadata test: a save killed before its manifest was read as dcp.save's
        # folder, with advice to load it with torch (an unverified, uncommitted save; an audit).
        final = directory.with_name(directory.name.split(INCOMPLETE)[0])
        raise CheckpointError(
            f"{directory}: expected a committed distamp checkpoint, found the temporary folder "
            "of a save_checkpoint that did not finish (killed, or still running): "
            + (
                f"its files and {COMMIT} were written, its rename to {final} was not; once no "
                f"save is running, `mv {directory} {final}` to load it"
                if commit.is_file()
                else f"load the previous checkpoint ({final} if it exists; "
                "distamp.latest_checkpoint(folder) picks the newest committed one)"
            )
        )
    if not commit.is_file():
        if (directory / ".metadata").is_file() and not (directory / MANIFEST).exists():
            raise CheckpointError(
                f"{directory}: expected a distamp checkpoint (save_checkpoint's), found a "
                "torch.distributed.checkpoint folder (dcp.save's: a .metadata file, no "
                f"{MANIFEST}); load it with torch: get_state_dict(model, optimizer), dcp.load, "
                "set_state_dict (O0/O1 without sharded weights, or FSDP; see the README)"
            )
        inside = sorted(child.name for child in directory.iterdir() if (child / COMMIT).is_file())
        raise CheckpointError(
            f"{directory}: expected a committed distamp checkpoint, found no {COMMIT} file "
            + (
                f"but a folder of {len(inside)} checkpoint(s) ({inside[-1]}, ...): pass one of "
                "them (distamp.latest_checkpoint(folder) picks the newest)"
                if inside
                else "(the save did not finish, or this is not a distamp checkpoint)"
            )
        )
    lines = commit.read_text(errors="replace").split()
    if lines[:1] == ["distamp.checkpoint/1"]:
        raise CheckpointError(
            f"{commit}: expected format '{FORMAT}', found 'distamp.checkpoint/1': a checkpoint "
            "of an earlier distamp, whose DCP metadata is a pickle that this version does not "
            "unpickle (consolidate it with that version, then load the FP32 state dict)"
        )
    if len(lines) != 3 or lines[0] != FORMAT or lines[1] != "sha256":
        raise CheckpointError(
            f"{commit}: expected '{FORMAT}' and the manifest's SHA-256, found {lines[:3]!r}"
        )
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: the manifest {MANIFEST} is missing")
    if sha256_file(path) != lines[2]:
        raise CheckpointError(f"{path}: SHA-256 differs from {COMMIT} (the manifest was altered)")
    manifest = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: expected format {FORMAT!r}")
    return manifest


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """A checkpoint folder gone: a symbolic link itself unlinked (``rmtree`` refuses links)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def is_temporary(name: str) -> bool:
    """A save's temporary folder (``<name>.incomplete-<owner>``; an older distamp's: without
    the owner)."""
    return name.endswith(INCOMPLETE) or INCOMPLETE + "-" in name


def _process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, from /proc), "0" where unknown: with
    the pid it names one process, not a later one that reused the number."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{_process_start(os.getpid())}"


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: it exists
        pass
    return start == "0" or _process_start(pid) == start


def prepare_tmp(directory: Path) -> Path:
    """Rank 0: an empty temporary folder for this save, ``<directory>.incomplete-<host>-<pid>-
    <start>``, after removing those of killed saves.

    [Note: one temporary folder per save] All saves of a path once shared ``<directory>
    .incomplete``, each removing it as stale: two jobs saving one path at once deleted each
    other's files, hashed each other's, and committed a checkpoint whose manifest was one job's
    and whose tensors were the other's, silently (an audit). Now each save writes and hashes
    its own folder, named by the process that made it: one of this host whose process is gone
    (or is this one: an earlier save that raised) is a killed save's and is removed; one whose
    process still runs is a save in progress, and this save is refused, naming it. One of
    another host is left alone (whether it runs cannot be told from here): it is never read,
    and latest_checkpoint ignores it."""
    host = socket.gethostname()
    prefix = directory.name + INCOMPLETE
    for other in directory.parent.glob(glob.escape(prefix) + "*"):
        if other.name == prefix:  # an older distamp's, of a killed save
            remove(other)
            continue
        parts = other.name[len(prefix) + 1 :].rsplit("-", 2)
        if not other.name.startswith(prefix + "-") or len(parts) != 3 or parts[0] != host:
            continue
        pid, start = int(parts[1]) if parts[1].isdigit() else -1, parts[2]
        if pid == os.getpid() or pid < 0 or not _alive(pid, start):
            remove(other)
            continue
        raise CheckpointError(
            f"save_checkpoint: expected one save of {directory} at a time, found another in "
            f"progress: process {pid} on this host is writing {other} (if no such save runs, "
            "delete that folder)"
        )
    tmp = directory.with_name(f"{prefix}-{_owner()}")
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, directory: Path) -> None:
    """Rank 0: move the finished ``tmp`` into place; see [Note: atomic checkpoints]. An OSError
    raised here means ``tmp`` is not in place (and the previous copy, if any, is at ``directory``
    or its ``.old``)."""
    old = directory.with_name(directory.name + OLD)
    if directory.exists():
        if old.exists() or old.is_symlink():  # an earlier save's leftover: the older copy
            remove(old)
        os.rename(directory, old)
    # Else ``old`` may be the only complete copy (a save killed between its two renames): it
    # goes only once the new one is in place, so a second killed save still leaves one.
    os.rename(tmp, directory)
    # Committed: what fails from here on leaves the new checkpoint in place, and is said, not
    # raised (an audit: an .old folder another process held open on NFS raised "could not move
    # the finished ... into place", naming an .incomplete folder that no longer existed).
    try:
        fsync_dir(directory.parent)
        if old.exists() or old.is_symlink():
            remove(old)
    except OSError as exc:
        warnings.warn(
            f"save_checkpoint: {directory} is committed, but tidying up after it failed ({exc}): "
            f"the previous copy may be left at {old} (a later save of this path removes it)",
            stacklevel=4,
        )


def latest_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest committed checkpoint directly under ``root`` (highest step, then newest), or None.

    Directories of saves that did not finish (``*.incomplete-*``) and directories whose ``COMMIT``
    does not match their manifest are ignored; one whose data files are missing or cut short is
    skipped with a warning (the next newest is returned). Not a collective: any rank may call it.
    """
    if isinstance(root, bool) or not isinstance(root, (str, os.PathLike)):
        raise TypeError(
            f"latest_checkpoint: root: expected the folder holding the checkpoints (a str or "
            f"path), got {type(root).__name__} {root!r}"
        )
    intact = list_checkpoints(root, warn=True)
    if not intact and (Path(root) / COMMIT).is_file():
        # The checkpoint itself given for the folder holding them: None sent the README's resume
        # recipe training from scratch, silently (an audit).
        warnings.warn(
            f"latest_checkpoint: expected the folder holding the checkpoints, found {str(root)!r} "
            "is a checkpoint itself: returning it (pass its parent folder to choose the newest)",
            stacklevel=2,
        )
        return str(root)
    return intact[-1][1] if intact else None


def list_checkpoints(root: str | os.PathLike[str], *, warn: bool = False) -> list[tuple[int, str]]:
    """(step, directory) of every intact committed checkpoint directly under ``root``, oldest
    first (by step, then by commit time): what :func:`latest_checkpoint` chooses from, and what
    a script pruning old checkpoints may delete from (never a damaged or unfinished one it cannot
    tell the age of). Not a collective."""
    base = Path(root)
    if not base.is_dir():
        return []
    candidates: list[tuple[tuple[int, float, str], dict[str, Any]]] = []
    for child in base.iterdir():
        if not child.is_dir() or is_temporary(child.name):
            continue
        try:
            manifest = read_manifest(child)
            # Inside the try: a save committing over ``child`` renames it away at any moment
            # (an audit: FileNotFoundError from an evaluator polling the folder).
            key = (int(manifest.get("step", 0)), (child / COMMIT).stat().st_mtime, str(child))
        except (CheckpointError, OSError, RuntimeError, ValueError):
            continue
        candidates.append((key, manifest))
    # [Note: a damaged newest checkpoint] A job restarted with `--resume auto` (torchrun
    # --max-restarts, a Slurm requeue) would pick the same damaged checkpoint on every restart and
    # fail each time. Files missing or cut short after the commit are found here by size (no
    # hashing: an altered byte is still refused by load_checkpoint), and the newest intact
    # checkpoint before it is returned, with a warning naming what was skipped.
    intact: list[tuple[tuple[int, float, str], str]] = []
    damaged: list[tuple[tuple[int, float, str], list[str]]] = []
    for key, manifest in sorted(candidates, key=lambda c: c[0]):
        bad = damaged_files(Path(key[2]), manifest.get("files", {}))
        if bad and not (Path(key[2]) / COMMIT).is_file():
            continue  # renamed away meanwhile (a save replaced it), not damaged
        if bad:
            damaged.append((key, bad))
        else:
            intact.append((key, key[2]))
    if warn:  # the damaged ones newer than what latest_checkpoint returns: it skipped them
        newest = intact[-1][0] if intact else None
        for key, bad in reversed(damaged):
            if newest is None or key > newest:
                warnings.warn(
                    f"distamp.latest_checkpoint: skipped {key[2]}, committed but damaged since: "
                    f"{', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''}",
                    stacklevel=3,
                )
    return [(key[0], path) for key, path in intact]


@contextlib.contextmanager
def quiet_single_process(single: bool) -> Any:
    """DCP warns that it "assumes the intent" of a single process; here that is the intent."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def manifest_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


def apply_rank_tensors(dest: dict[str, Any], keys: list[str], path: Path) -> None:
    """Put one rank's tensors of its rank file (``path``) into ``dest`` (see [Note: buffers that
    differ between ranks] in api.py): a whole tensor by key, or ``key@start``, the stretch of a
    flat tensor that starts there (a replicated one, read whole)."""
    saved = torch.load(path, weights_only=True).get("buffers", {})
    for key in keys:
        value = saved.get(key)
        base, _, start = key.partition("@")
        target = dest[base]
        if start and type(target) is not torch.Tensor:
            # This run's masters are sharded: the stretch would land in whichever rank's shard
            # holds it, from whichever rank's copy DCP wrote (a review: rank 0 got rank 1's
            # expert, silently). As wrap refuses rank-local parameters in sharded masters:
            raise CheckpointError(
                f"{path.parent}: the checkpoint holds each rank's own FP32 masters of parameters "
                f"DDP ignores ({key.split('@')[0]}), saved with replicated masters; expected "
                "this run's masters replicated too (sharded ones cannot hold a rank's own "
                "expert): wrap with shard_master_weights=False"
            )
        size = value.numel() if isinstance(value, torch.Tensor) else 0
        into = target[int(start) : int(start) + size] if start else target
        if not isinstance(value, torch.Tensor) or value.shape != into.shape:
            raise CheckpointError(f"{path}: expected the rank's tensor {key!r}, found none")
        if start:
            into.copy_(value)
        else:
            dest[key] = value.to(target.dtype)
