"""DCP's checkpoint metadata as plain data: written with ``torch.save``, read with
``weights_only=True``.

[Note: no pickle in a checkpoint] DCP's ``FileSystemWriter`` pickles its ``Metadata`` (which
tensor pieces are where) into ``.metadata``, and its reader unpickles it with plain ``pickle``:
loading a checkpoint could run code. Every other file of a distamp checkpoint is plain data
(``distamp.pt``, ``rng-*.pt``: ``weights_only=True``; the tensors in DCP's ``.distcp`` files: DCP
reads each one with ``weights_only=True`` too; distamp puts nothing but tensors into DCP's state
dict). So the writer and reader here keep DCP's planning, resharding and data files as they are
and replace only the metadata's serialization: the ``Metadata`` tree is encoded into tagged
lists, dicts, strings and numbers; decoding builds only the DCP metadata classes named in
``_CLASSES`` (an allowlist) and torch's dtypes, layouts and memory formats, and accepts tensor
entries only: DCP unpickles a non-tensor ("bytes") entry with ``weights_only=False``, so one in
a tampered ``.metadata`` could point at a payload — refused, and the load planner refuses to
unpickle too (:class:`Planner`). A tampered checkpoint can fail to load, never run code.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from io import UnsupportedOperation
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from .files import CheckpointError

METADATA_FORMAT = "distamp.dcp-metadata/1"
METADATA_FILE = ".metadata"
"""DCP's own file name: the reader below is the only one that reads it."""

DCP_VERSION = "1.0.0"
"""The DCP metadata version torch 2.11-2.13 write (``CURRENT_DCP_VERSION``)."""

_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.StorageMeta,
        dcp_metadata.MetadataIndex,
        _StorageInfo,
    )
}
_ENUMS: dict[str, type] = {
    "dtype": torch.dtype,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
}


def encode(value: Any, where: str = "metadata") -> Any:
    """``value`` as nested lists, dicts of ``{"t": tag, ...}``, strings, numbers and None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Size):
        return {"t": "size", "v": list(value)}
    for tag, kind in _ENUMS.items():
        if isinstance(value, kind):
            return {"t": tag, "v": str(value).removeprefix("torch.")}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"t": "tuple", "v": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {
            "t": "dict",
            "v": [
                [encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()
            ],
        }
    name = type(value).__name__
    if _CLASSES.get(name) is type(value) and dataclasses.is_dataclass(value):
        fields = {
            f.name: encode(getattr(value, f.name), f"{where}.{f.name}")
            for f in dataclasses.fields(value)
        }
        return {"t": "obj", "class": name, "v": fields}
    raise TypeError(
        f"DCP metadata: expected plain data or one of {sorted(_CLASSES)} at {where}, "
        f"found {type(value).__module__}.{type(value).__qualname__}"
    )


def decode(value: Any, where: str = "metadata") -> Any:
    """The inverse of :func:`encode`; raises ``ValueError`` on anything it did not write."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict) or not isinstance(value.get("t"), str):
        raise ValueError(f"{where}: expected plain data or a tagged dict, found {type(value)}")
    tag, inner = value["t"], value.get("v")
    if tag == "size":
        return torch.Size(_ints(inner, where))
    if tag in _ENUMS:
        found = getattr(torch, inner, None) if isinstance(inner, str) else None
        if not isinstance(found, _ENUMS[tag]):
            raise ValueError(f"{where}: expected a torch {tag} name, found {inner!r}")
        return found
    if tag == "tuple" and isinstance(inner, list):
        return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(inner))
    if tag == "dict" and isinstance(inner, list):
        out = {}
        for pair in inner:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError(f"{where}: expected [key, value] pairs, found {pair!r}")
            key = decode(pair[0], f"{where} key")
            out[key] = decode(pair[1], f"{where}[{key!r}]")
        return out
    if tag == "obj" and isinstance(inner, dict):
        cls = _CLASSES.get(value.get("class"))  # type: ignore[arg-type]
        if cls is None:
            raise ValueError(
                f"{where}: expected one of {sorted(_CLASSES)}, found class {value.get('class')!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(inner) - known)
        if unknown:
            raise ValueError(
                f"{where}: {cls.__name__} has no field(s) {unknown} in this torch "
                f"(written by another torch version?)"
            )
        return cls(**{k: decode(v, f"{where}.{k}") for k, v in inner.items()})
    raise ValueError(f"{where}: unknown tag {tag!r}")


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ValueError(f"{where}: expected a list of ints, found {value!r}")
    return value


class Writer(dcp.FileSystemWriter):
    """DCP's file-system writer, its ``.metadata`` written as plain data (see the Note)."""

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[Any]]) -> None:
        # As FileSystemWriter.finish, less the pickle: rank 0 (the coordinator) only.
        metadata.version = DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        path = Path(self.path) / METADATA_FILE
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save({"format": METADATA_FORMAT, "metadata": encode(metadata)}, f)
            if self.sync_files:
                f.flush()
                try:
                    os.fsync(f.fileno())
                except (AttributeError, UnsupportedOperation):
                    os.sync()
        os.replace(tmp, path)


class Reader(dcp.FileSystemReader):
    """DCP's file-system reader for :class:`Writer`'s checkpoints: ``.metadata`` is loaded with
    ``weights_only=True`` and decoded from the allowlist (see the Note)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read(directory: Path) -> dcp_metadata.Metadata:
    """The decoded ``.metadata`` of a checkpoint directory; :class:`CheckpointError` if it is not
    plain data written by :class:`Writer`."""
    path = directory / METADATA_FILE
    try:
        if not zipfile.is_zipfile(path):  # torch.save's format; a pickle is not even opened
            raise ValueError("not a torch.save file")
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{path}: expected DCP metadata saved as plain data ({METADATA_FORMAT!r}, read "
            f"with torch.load(weights_only=True)), found a file that does not load that way "
            f"({type(exc).__name__}). A checkpoint of plain torch.distributed.checkpoint or of "
            "distamp before format distamp.checkpoint/2 holds a pickle there, which distamp "
            "does not unpickle"
        ) from exc
    if not isinstance(saved, dict) or saved.get("format") != METADATA_FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(f"{path}: expected format {METADATA_FORMAT!r}, found {found!r}")
    try:
        metadata = decode(saved.get("metadata"))
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: expected a DCP Metadata, found {type(metadata).__name__}")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointError(
                f"{path}: entry {key!r}: expected tensor metadata (distamp writes tensors only), "
                f"found {type(entry).__name__}"
            )
    return metadata


class Planner(DefaultLoadPlanner):
    """DCP's load planner, less the unpickling: distamp's state dicts hold tensors only, and the
    default planner's ``load_bytes`` runs ``torch.load(weights_only=False)`` on a byte entry —
    which a tampered ``.metadata`` could point at a payload (an audit's probe did). ``read``
    refuses such metadata first; this refuses the read itself too."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"DCP asked to unpickle a non-tensor entry {read_item.dest_index.fqn!r}: expected "
            "tensors only in a distamp checkpoint; refused (it would have run torch.load with "
            "weights_only=False)"
        )
