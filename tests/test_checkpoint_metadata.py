"""No pickle in a checkpoint: DCP's ``.metadata`` is written as plain data and read with
``weights_only=True`` (see [Note: no pickle in a checkpoint] in distamp/checkpoint/metadata.py)."""

import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

import distamp
from distamp.checkpoint import CheckpointError, consolidate
from distamp.checkpoint import files as ckfiles
from distamp.checkpoint import metadata as ckmeta


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return distamp.wrap(model, opt, opt_level="O2", verbosity=0)


def train_and_save(rank, world, directory):
    model, opt = build()
    torch.manual_seed(rank)
    for _ in range(2):
        loss = model(torch.randn(4, 6)).float().pow(2).mean()
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        for p in model.parameters():  # no DDP: average by hand, as the ranks must agree
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
    distamp.save_checkpoint(directory, model, opt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def load(rank, world, directory):
    model, opt = build()
    try:
        distamp.load_checkpoint(directory, model, opt)
    except CheckpointError as exc:
        return str(exc)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ck") / "step_2"
    states = run_ranks(train_and_save, 2, str(directory))
    return directory, states[0]


def test_every_file_but_dcps_tensor_files_loads_with_weights_only(saved):
    directory, _ = saved
    names = sorted(p.name for p in directory.iterdir())
    assert ".metadata" in names and "distamp.pt" in names, names
    for name in names:
        if name.endswith(".distcp") or name == ckfiles.COMMIT:
            continue  # DCP's tensor files (each tensor read with weights_only=True) / a text file
        torch.load(directory / name, weights_only=True)  # raises on anything but plain data
    saved_meta = torch.load(directory / ".metadata", weights_only=True)
    assert saved_meta["format"] == ckmeta.METADATA_FORMAT


def test_the_metadata_round_trips_and_still_reshards(saved, tmp_path):
    directory, state = saved
    meta = ckmeta.read(directory)
    assert ckmeta.decode(ckmeta.encode(meta)) == meta
    tensors = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert tensors and any(len(v.chunks) == 2 for v in tensors.values()), "sharded pieces"
    # Resharding reads the metadata: 2 ranks wrote it, 1 and 3 ranks load it.
    for world in (1, 3):
        for rank, loaded in enumerate(run_ranks(load, world, str(directory))):
            assert not isinstance(loaded, str), loaded
            for key, value in state.items():
                assert torch.equal(loaded[key], value), (world, rank, key)
    assert set(consolidate(directory)) == set(state)


class _Touch:
    """What a hostile pickle does when it is unpickled: here, create a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickled_metadata_is_refused_without_being_unpickled(saved, tmp_path):
    """Someone who can write the checkpoint rewrites .metadata as a pickle (what plain DCP
    writes, here with a payload) and the manifest's and COMMIT's hashes to match: loading and
    consolidating refuse it by name, and the payload never runs."""
    directory, _ = saved
    tampered = tmp_path / "tampered"
    marker = tmp_path / "payload-ran"
    shutil.copytree(directory, tampered)
    meta = ckmeta.read(directory)
    meta.planner_data = _Touch(marker)
    (tampered / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = torch.load(tampered / ckfiles.MANIFEST, weights_only=True)
    path = tampered / ".metadata"
    manifest["files"][".metadata"] = [path.stat().st_size, ckfiles.sha256_file(path)]
    (tampered / ckfiles.MANIFEST).unlink()
    (tampered / ckfiles.COMMIT).unlink()
    ckfiles.write_manifest_and_commit(tampered, manifest)

    for message in run_ranks(load, 2, str(tampered)):
        assert isinstance(message, str), "the tampered checkpoint loaded"
        assert "expected DCP metadata saved as plain data" in message, message
        assert "does not unpickle" in message, message
    with pytest.raises(CheckpointError, match=r"\.metadata: expected DCP metadata saved as plain"):
        consolidate(tampered)
    assert not marker.exists(), "the pickle's payload ran"


def test_decoding_builds_only_the_allowlisted_classes():
    index = ckmeta.encode(torch.distributed.checkpoint.metadata.MetadataIndex("w", torch.Size([0])))
    assert ckmeta.decode(index).fqn == "w"
    hostile = dict(index, **{"class": "Popen"})
    with pytest.raises(
        ValueError, match=r"expected one of \[.*'MetadataIndex'.*found class 'Popen'"
    ):
        ckmeta.decode(hostile)
    with pytest.raises(ValueError, match=r"expected a torch dtype name, found 'Tensor'"):
        ckmeta.decode({"t": "dtype", "v": "Tensor"})
    with pytest.raises(ValueError, match=r"MetadataIndex has no field\(s\) \['extra'\]"):
        ckmeta.decode(dict(index, v=dict(index["v"], extra=1)))
    with pytest.raises(TypeError, match=r"at metadata\[0\], found builtins\.object"):
        ckmeta.encode([object()])
    props = torch.distributed.checkpoint.metadata.TensorProperties(dtype=torch.bfloat16)
    again = ckmeta.decode(ckmeta.encode(props))
    assert dataclasses.astuple(again) == dataclasses.astuple(props)


def test_a_checkpoint_of_format_1_is_refused_by_name(saved, tmp_path):
    directory, _ = saved
    old = tmp_path / "old"
    shutil.copytree(directory, old)
    commit = old / ckfiles.COMMIT
    commit.write_text(commit.read_text().replace(ckfiles.FORMAT, "distamp.checkpoint/1"))
    with pytest.raises(CheckpointError, match=r"found 'distamp\.checkpoint/1': a checkpoint of an"):
        consolidate(old)


def _rewrite_hashes(directory, names):
    manifest = torch.load(directory / ckfiles.MANIFEST, weights_only=True)
    for name in names:
        path = directory / name
        manifest["files"][name] = [path.stat().st_size, ckfiles.sha256_file(path)]
    (directory / ckfiles.MANIFEST).unlink()
    (directory / ckfiles.COMMIT).unlink()
    ckfiles.write_manifest_and_commit(directory, manifest)


def test_a_bytes_entry_pointing_at_a_payload_is_refused_without_running_it(saved, tmp_path):
    """An audit's hostile checkpoint: plain-data metadata declaring one tensor key a DCP "bytes"
    entry (which DCP unpickles with weights_only=False) pointing at a pickle appended to a
    .distcp file, every hash rewritten to match. Refused by name; the payload never runs."""
    directory, _ = saved
    tampered = tmp_path / "bytes"
    marker = tmp_path / "payload-ran"
    shutil.copytree(directory, tampered)
    meta = ckmeta.read(directory)
    victim = next(iter(meta.state_dict_metadata))
    data_file = sorted(p.name for p in tampered.iterdir() if p.suffix == ".distcp")[0]
    offset = (tampered / data_file).stat().st_size
    payload = pickle.dumps(_Touch(marker))
    with open(tampered / data_file, "ab") as f:
        f.write(payload)
    encoded = ckmeta.encode(meta)
    fields = encoded["v"]
    for pair in fields["state_dict_metadata"]["v"]:
        if pair[0] == victim:
            pair[1] = {"t": "obj", "class": "BytesStorageMetadata", "v": {}}
    index = ckmeta.encode(torch.distributed.checkpoint.metadata.MetadataIndex(victim))
    info = {"relative_path": data_file, "offset": offset, "length": len(payload)}
    fields["storage_data"]["v"].append([index, {"t": "obj", "class": "_StorageInfo", "v": info}])
    (tampered / ".metadata").unlink()
    with open(tampered / ".metadata", "wb") as f:
        torch.save({"format": ckmeta.METADATA_FORMAT, "metadata": encoded}, f)
    _rewrite_hashes(tampered, [data_file, ".metadata"])

    for message in run_ranks(load, 2, str(tampered)):
        assert isinstance(message, str), "the tampered checkpoint loaded"
        assert "found class 'BytesStorageMetadata'" in message, message
    with pytest.raises(CheckpointError, match=r"found class 'BytesStorageMetadata'"):
        consolidate(tampered)
    assert not marker.exists(), "the pickle's payload ran"


def test_the_load_planner_refuses_to_unpickle():
    item = type(
        "Item", (), {"dest_index": torch.distributed.checkpoint.metadata.MetadataIndex("x")}
    )
    with pytest.raises(CheckpointError, match=r"non-tensor entry 'x'.*weights_only=False"):
        ckmeta.Planner().load_bytes(item, None)


def test_inspect_names_the_dtype_of_weights_stepped_without_masters():
    """O3 under FSDP shards its bf16 weights (no masters): inspect called them "FP32 weights"
    (an audit)."""
    from distamp.checkpoint.offline import _sharding

    o3 = {
        "shard_master_weights": True,
        "master_weights": False,
        "cast_model_type": "torch.bfloat16",
    }
    o0 = {"shard_master_weights": True, "master_weights": False, "cast_model_type": None}
    o2 = {"shard_master_weights": True, "master_weights": True, "cast_model_type": "torch.float16"}
    assert _sharding(o3, 2) == "bf16 weights and optimizer state over 2 ranks"
    assert _sharding(o0, 2) == "FP32 weights and optimizer state over 2 ranks"
    assert _sharding(o2, 2) == "FP32 masters and optimizer state over 2 ranks"


def test_inspect_counts_the_parameters_of_activation_checkpointed_blocks(tmp_path):
    """checkpoint_wrapper's parameters are named "_checkpoint_wrapped_module." inside, its state
    dict keys are not: inspect raised KeyError (an audit); consolidate and loads worked."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 2))
    model, opt = distamp.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0
    )
    distamp.save_checkpoint(tmp_path / "c", model, opt)
    summary = distamp.checkpoint.inspect(tmp_path / "c")
    assert summary["parameters"] == 4 * 8 + 8 + 8 * 2 + 2, summary
