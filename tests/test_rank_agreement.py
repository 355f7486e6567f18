"""Ranks configured differently fail fast at wrap, on every rank, naming the difference — no hang."""

import torch
from dist_harness import run_ranks
from models import mlp

import distamp


def _wrap(rank, world, per_rank):
    level, hidden = per_rank[rank]
    model = mlp(hidden=hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        distamp.wrap(model, opt, opt_level=level)
    except ValueError as err:
        return str(err), model[0].weight.dtype
    return None, model[0].weight.dtype


def test_different_opt_levels_are_named_on_every_rank():
    results = run_ranks(_wrap, 2, {0: ("O2", 16), 1: ("O1", 16)}, timeout=60)
    for message, dtype in results:
        assert message is not None
        assert "rank 0 has property opt_level='O2'" in message
        assert "rank 1 has property opt_level='O1'" in message
        assert dtype == torch.float32  # nothing was cast: the error came before any change


def test_different_parameter_shapes_are_named():
    results = run_ranks(_wrap, 3, {0: ("O2", 16), 1: ("O2", 16), 2: ("O2", 12)}, timeout=60)
    for message, _ in results:
        assert message is not None
        assert "rank 2 has models[0] parameter '0.weight'=(12, 8)" in message


def test_agreeing_ranks_wrap_normally():
    results = run_ranks(_wrap, 2, {0: ("O2", 16), 1: ("O2", 16)}, timeout=60)
    assert results == [(None, torch.bfloat16), (None, torch.bfloat16)]
