import os
import sys

import pytest
import torch

# The spawned ranks import test modules by name; make this folder importable for them.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

from dist_harness import SHARD_BLOCK_ENV  # noqa: E402


@pytest.fixture
def shard_block(request, monkeypatch):
    """Indirect parameter: elements per block of sharded masters in the ranks ``run_ranks``
    spawns (None: distamp's own). A few elements give tiny test models many rounds of blocks
    (see [Note: block-cyclic shards] in distamp/masters/layout.py)."""
    block = getattr(request, "param", None)
    if block is not None:
        monkeypatch.setenv(SHARD_BLOCK_ENV, str(block))
    return block
