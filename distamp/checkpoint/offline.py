"""Checkpoints read without the ranks: ``consolidate`` (one FP32 state dict for inference or
export), ``consolidate_optimizer_state`` and ``inspect`` (what a checkpoint holds). None is a
collective: they read the files DCP wrote, whatever world size wrote them (see [Note: canonical
checkpoint layout] in state.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from . import files, metadata
from .files import CheckpointError, PathLike
from .state import flat_starts, installed_keys, numel


def _read_offline(directory: Path, dest: dict[str, Any]) -> None:
    """``dest`` read from the checkpoint's files, and tensors each rank saved of its own as rank
    0 saved them (a review: a parameter DDP ignores came out pieced from the ranks' copies)."""
    manifest = files.read_manifest(directory)
    files.verify_share(directory, manifest["files"], 0, 1)
    metadata.read(directory)  # a clear error before DCP's
    with files.quiet_single_process(True):
        dcp.load(
            dest,
            storage_reader=metadata.Reader(directory),
            planner=metadata.Planner(),
            no_dist=True,
        )
    keys = [k for k in manifest.get("rank_buffers", []) if k.split("@")[0] in dest]
    if keys:
        files.apply_rank_tensors(dest, keys, directory / "rng-0.pt")


def consolidate(directory: PathLike, model_index: int = 0) -> dict[str, torch.Tensor]:
    """One FP32 state dict of model ``model_index`` from a checkpoint, without the ranks.

    Parameters with FP32 masters get the master values (not the rounded half weights); other
    half entries are widened to FP32 (float64 ones stay float64); integer buffers stay as they
    are. A plain, unwrapped FP32 model loads it with ``load_state_dict``. Not a collective.
    """
    directory = Path(directory)
    manifest = files.read_manifest(directory)
    models = manifest["models"]
    _check_index("model_index", model_index, len(models), "model(s)")
    entry = models[model_index]
    dest: dict[str, Any] = {
        f"model.{model_index}.{k}": torch.empty(shape, dtype=files.manifest_dtype(dtype))
        for k, (shape, dtype) in entry["keys"].items()
    }
    where: dict[str, tuple[str, int, list[int]]] = {}
    for o, opt in enumerate(manifest["optimizers"]):
        for g, group in enumerate(opt["groups"]):
            flat = group["flat"]
            if flat is None:
                continue
            dest[f"optim.{o}.g{g}.master"] = torch.empty(flat["total"], dtype=torch.float32)
            starts = flat_starts([tuple(s) for s in flat["shapes"]])
            for name, start, shape in zip(flat["names"], starts, flat["shapes"], strict=True):
                where[name] = (f"optim.{o}.g{g}.master", start, shape)
    _read_offline(directory, dest)
    out: dict[str, torch.Tensor] = {}
    for key in entry["keys"]:
        value = dest[f"model.{model_index}.{key}"]
        canonical = entry["aliases"].get(key)
        if canonical is not None and canonical in where:
            flat_key, start, shape = where[canonical]
            n = numel(shape)
            out[key] = dest[flat_key][start : start + n].view(shape).clone()
        elif value.dtype in (torch.float16, torch.bfloat16):
            # half tensors widened; float64 kept (an audit: a float64 buffer came out rounded)
            out[key] = value.float()
        else:
            out[key] = value
    return out


def consolidate_optimizer_state(
    directory: PathLike, optimizer_index: int = 0
) -> dict[str, dict[str, Any]]:
    """Optimizer ``optimizer_index``'s state per parameter name, full-sized, without the ranks.

    ``{name: {"master": FP32 tensor (if separate), "exp_avg": ..., "step": ...}}`` — the same
    whatever world size or sharding the checkpoint was written with. Not a collective.
    """
    directory = Path(directory)
    manifest = files.read_manifest(directory)
    opts = manifest["optimizers"]
    _check_index("optimizer_index", optimizer_index, len(opts), "optimizer(s)")
    entry, o = opts[optimizer_index], optimizer_index
    dest: dict[str, Any] = {}
    for g, group in enumerate(entry["groups"]):
        flat = group["flat"]
        if flat is not None:
            dest[f"optim.{o}.g{g}.master"] = torch.empty(flat["total"], dtype=torch.float32)
            for k, d in flat["tensor_keys"].items():
                dest[f"optim.{o}.g{g}.state.{k}"] = torch.empty(
                    flat["total"], dtype=files.manifest_dtype(d)
                )
    for name, saved in entry["kept"].items():
        for k, d in saved["tensor_keys"].items():
            dest[f"optim.{o}.p.{name}.{k}"] = torch.empty(
                saved["shape"], dtype=files.manifest_dtype(d)
            )
    _read_offline(directory, dest)
    out: dict[str, dict[str, Any]] = {}
    for g, group in enumerate(entry["groups"]):
        flat = group["flat"]
        if flat is None:
            continue
        starts = flat_starts([tuple(s) for s in flat["shapes"]])
        for i, (name, start, shape) in enumerate(
            zip(flat["names"], starts, flat["shapes"], strict=True)
        ):
            n = numel(shape)
            per: dict[str, Any] = {
                "master": dest[f"optim.{o}.g{g}.master"][start : start + n].view(shape)
            }
            if flat["has_state"][i]:
                for k in installed_keys(flat, i):
                    per[k] = dest[f"optim.{o}.g{g}.state.{k}"][start : start + n].view(shape)
                for k, values in flat["scalars"].items():
                    if values[i] is not None:
                        per[k] = values[i]
            out[name] = per
    for name, saved in entry["kept"].items():
        if not saved["has_state"]:
            out[name] = {}
            continue
        per = {k: dest[f"optim.{o}.p.{name}.{k}"] for k in saved["tensor_keys"]}
        per |= dict(saved["scalars"])
        out[name] = per
    return out


def _check_index(what: str, index: int, saved: int, kind: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int):
        hint = ""
        if isinstance(index, (str, os.PathLike)):  # DeepSpeed's (checkpoint_dir, output_file) habit
            hint = (
                "; to write a file: torch.save(distamp.checkpoint.consolidate(DIR), OUT) or "
                "`python -m distamp.checkpoint consolidate DIR OUT`"
            )
        raise TypeError(
            f"{what}: expected an int index (0..{saved - 1}, {saved} {kind} saved), "
            f"got {type(index).__name__} {index!r}{hint}"
        )
    if not 0 <= index < saved:
        raise CheckpointError(
            f"{what}: expected 0..{saved - 1} ({saved} {kind} saved), got {index}"
        )


def _sharding(props: dict[str, Any], world: int, kind: str | None = None) -> str:
    """What the saving run sharded, in words (the checkpoint loads either way); ``kind``: the
    manifest's "data_parallel" (None from a distamp before it was recorded)."""
    if kind == "fsdp":
        return f"FSDP's parameters and optimizer state over {world} rank(s)"
    if not props.get("shard_master_weights") or world == 1:
        return "none (one copy of the optimizer state)"
    if props.get("master_weights"):
        what = "FP32 masters"
    else:  # no masters: the weights themselves are stepped (O3's half, O0/O1's FP32)
        cast = str(props.get("cast_model_type") or "torch.float32")
        what = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(cast, "FP32") + " weights"
    return f"{what} and optimizer state over {world} ranks"


def inspect(directory: PathLike, *, verify: bool = False) -> dict[str, Any]:
    """A summary of a checkpoint (what ``python -m distamp.checkpoint inspect`` prints).

    ``damaged`` lists data files missing or cut short (a stat each); ``verify`` also hashes every
    file against the manifest, as ``consolidate`` and ``load_checkpoint`` do."""
    directory = Path(directory)
    manifest = files.read_manifest(directory)
    props = manifest["properties"]
    params = 0
    for entry in manifest["models"]:
        counted = set()
        for key, canonical in entry["aliases"].items():
            if canonical in counted:
                continue
            counted.add(canonical)
            # A parameter's name may hold a wrapper's part the state dict's keys drop (torch's
            # checkpoint_wrapper: "_checkpoint_wrapped_module."; an audit: inspect raised
            # KeyError where consolidate and load_checkpoint worked)
            wrapped = "_checkpoint_wrapped_module."
            shape_key = next(
                (
                    k
                    for k in (
                        key,
                        canonical,
                        key.replace(wrapped, ""),
                        canonical.replace(wrapped, ""),
                    )
                    if k in entry["keys"]
                ),
                None,
            )
            if shape_key is not None:
                params += numel(entry["keys"][shape_key][0])
    sizes = {name: size for name, (size, _) in manifest["files"].items()}
    damaged = files.damaged_files(directory, manifest["files"], hashed=verify)
    return {
        "directory": str(directory),
        "step": manifest["step"],
        "world_size": manifest["world_size"],
        # a run wrapped with enabled=False trained plain FP32 (an audit: "O2 (half dtype bf16)")
        "opt_level": props.get("opt_level") if props.get("enabled", True) else "disabled",
        "half_dtype": None
        if props.get("opt_level") == "O0" or not props.get("enabled", True)
        else props.get("half_dtype"),
        "sharding": _sharding(props, manifest["world_size"], manifest.get("data_parallel")),
        "properties": props,
        "parameters": params,
        "optimizers": [
            {"class": o["class"], "steps": o["steps"], "skipped_steps": o["skipped_steps"]}
            for o in manifest["optimizers"]
        ],
        "loss_scales": [s["scale"] for s in manifest["scalers"]],
        "damaged": damaged,
        "bytes_on_disk": sum(sizes.values())
        + (directory / files.MANIFEST).stat().st_size
        + (directory / files.COMMIT).stat().st_size,
        "files": sizes,
        "distamp_version": manifest.get("distamp_version"),
        "torch_version": manifest.get("torch_version"),
        # save_checkpoint's extra (rank 0's): what a script needs before it can build the
        # model it loads into (nanoGPT's model_args; an audit had to read the manifest)
        "extra": manifest.get("extra"),
    }
