"""opt_level presets, property overrides, and the overrides apex refused."""

import numpy as np
import pytest
import torch

import distamp
from distamp.config import Properties, resolve_properties


def props(level, **kw):
    return resolve_properties(level, device_type="cpu", **kw)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_presets_match_apex(half):
    o0, o1, o2, o3 = (props(lvl, half_dtype=half) for lvl in ("O0", "O1", "O2", "O3"))
    assert (o0.cast_model_type, o0.patch_torch_functions, o0.master_weights, o0.loss_scale) == (
        None,
        False,
        False,
        1.0,
    )
    assert (o1.cast_model_type, o1.patch_torch_functions, o1.master_weights, o1.loss_scale) == (
        None,
        True,
        False,
        "dynamic",
    )
    assert (o2.cast_model_type, o2.keep_batchnorm_fp32, o2.master_weights, o2.loss_scale) == (
        half,
        True,
        True,
        "dynamic",
    )
    assert (o3.cast_model_type, o3.keep_batchnorm_fp32, o3.master_weights, o3.loss_scale) == (
        half,
        False,
        False,
        1.0,
    )


def test_half_dtype_auto_is_autocast_default_for_the_device():
    assert props("O2").half_dtype == torch.bfloat16
    assert resolve_properties("O2", device_type="cuda").half_dtype == torch.float16
    assert props("O2", cast_model_type=torch.float16).half_dtype == torch.float16


def test_overrides_apply_on_top_of_the_level():
    p = props("O2", loss_scale="128.0", keep_batchnorm_fp32="False", master_weights=False)
    assert p.loss_scale == 128.0
    assert p.keep_batchnorm_fp32 is False
    assert p.master_weights is False
    assert props("O3", keep_batchnorm_fp32=True).keep_batchnorm_fp32 is True
    assert props("O1", loss_scale=64).loss_scale == 64.0
    assert props("O2", cast_model_outputs=torch.bfloat16).cast_model_outputs == torch.bfloat16


@pytest.mark.parametrize(
    ("level", "kw", "names"),
    [
        ("O1", {"cast_model_type": torch.float16}, ["O1", "cast_model_type"]),
        ("O1", {"keep_batchnorm_fp32": True}, ["O1", "keep_batchnorm_fp32"]),
        ("O1", {"master_weights": True}, ["O1", "master_weights"]),
        ("O1", {"master_weights": False}, ["O1", "master_weights must be None, got False"]),
        ("O2", {"patch_torch_functions": True}, ["O2", "patch_torch_functions"]),
        ("O0", {"patch_torch_functions": True}, ["O0", "patch_torch_functions"]),
        ("O3", {"patch_torch_functions": True}, ["O3", "patch_torch_functions"]),
    ],
)
def test_nonsensical_overrides_name_level_and_property(level, kw, names):
    with pytest.raises(ValueError) as err:
        props(level, **kw)
    for name in names:
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("given", "suggestion"), [("01", "'O1'"), ("o2", "'O2'"), ("3", "'O3'"), ("O4", None)]
)
def test_unknown_opt_level_suggests_the_right_one(given, suggestion):
    with pytest.raises(ValueError, match="opt_level") as err:
        props(given)
    assert repr(given) in str(err.value)
    if suggestion:
        assert f"did you mean {suggestion}" in str(err.value)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"loss_scale": -1.0}, "loss_scale"),
        ({"loss_scale": float("inf")}, "loss_scale"),
        ({"loss_scale": "lots"}, "loss_scale"),
        ({"loss_scale": 0}, "loss_scale"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, "min_loss_scale"),
        ({"num_losses": 0}, "num_losses"),
        ({"half_dtype": torch.float32}, "half_dtype"),
        ({"cast_model_type": torch.int8}, "cast_model_type"),
        ({"keep_batchnorm_fp32": "yes"}, "keep_batchnorm_fp32"),
        ({"max_loss_scale": float("nan")}, "max_loss_scale"),
        # audits: a bare "truth value of an array is ambiguous"; a bool count taken
        ({"loss_scale": np.array([1.0, 2.0])}, "loss_scale"),
        ({"loss_scale": 1e39}, "loss_scale: expected at most FP32's largest"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips"),
        ({"num_losses": 2.0}, "num_losses"),
    ],
)
def test_bad_values_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        props("O2", **kw)


def test_counts_take_numpy_and_tensor_integers_and_stay_ints():
    """An audit: ``np.int64(2)`` was refused as num_losses while LossScaler's intervals took
    it; held as Python ints (they go into checkpoints loaded with weights_only=True)."""
    p = props("O2", num_losses=np.int64(2), max_consecutive_skips=torch.tensor(7), verbosity=True)
    assert (p.num_losses, p.max_consecutive_skips, p.verbosity) == (2, 7, 1)
    assert all(type(v) is int for v in (p.num_losses, p.max_consecutive_skips, p.verbosity))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="max_loss_scale"):  # not torch's bare "ambiguous"
        distamp.wrap(
            model, opt, loss_scale=distamp.LossScaler(), max_loss_scale=torch.tensor([1.0, 2.0])
        )


def test_sharding_is_on_by_default_with_masters_and_several_ranks():
    assert props("O2", world_size=2).shard_master_weights is True
    assert props("O2", world_size=1).shard_master_weights is False
    assert props("O2", world_size=4, shard_master_weights=False).shard_master_weights is False
    assert props("O3", world_size=2).shard_master_weights is False  # no masters to shard
    # FP32 weights (O0/O1) are sharded only when asked for: apex's O0/O1 keep no masters.
    assert props("O0", world_size=2).shard_master_weights is False
    assert props("O1", world_size=2).shard_master_weights is False
    for level in ("O0", "O1"):
        chosen = props(level, world_size=2, shard_master_weights=True)
        assert chosen.shard_master_weights is True and chosen.master_weights is False
    # Half weights without FP32 masters have nothing FP32 to shard.
    with pytest.raises(ValueError, match="shard_master_weights=True needs FP32 values"):
        props("O3", world_size=2, shard_master_weights=True)
    with pytest.raises(ValueError, match="master_weights=False"):
        props("O2", world_size=2, master_weights=False, shard_master_weights=True)


def test_properties_are_frozen_plain_data():
    p = props("O2")
    with pytest.raises(AttributeError):
        p.opt_level = "O1"  # type: ignore[misc]
    plain = p.as_plain_dict()
    assert plain["cast_model_type"] == "torch.bfloat16"
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in plain.values())
    with pytest.raises(ValueError, match="opt_level"):
        Properties(opt_level="O9")
