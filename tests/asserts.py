"""Exact comparison of nested state (tensors, dicts, lists, numbers) with a path in failures, and
the error a step raises (what the refusal tests return from their ranks), and a backward
through scale_loss or plain."""

import torch

import distamp


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), (
            f"{path}: values differ (max {(a.float() - b.float()).abs().max()})"
        )
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def step_error(optimizer, exc=RuntimeError):
    """The message of the ``exc`` that ``optimizer.step()`` raises on this rank; None if it stepped."""
    try:
        optimizer.step()
    except exc as err:
        return str(err)
    return None


def backward(loss, optimizer=None, loss_id=0):
    """``loss.backward()`` through ``distamp.scale_loss`` when an optimizer is given, else plainly
    (a test's FP32 reference runs the same loop with ``optimizer=None``)."""
    if optimizer is None:
        loss.backward()
        return
    with distamp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
