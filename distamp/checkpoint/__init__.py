"""Sharded checkpoints: save at one world size, resume at any, consolidate to one FP32 file.

``python -m distamp.checkpoint inspect DIR`` / ``consolidate DIR OUT.pt`` are the command line.
"""

from .api import load_checkpoint, save_checkpoint
from .files import CheckpointError, latest_checkpoint, list_checkpoints
from .offline import consolidate, consolidate_optimizer_state, inspect

__all__ = [
    "CheckpointError",
    "consolidate",
    "consolidate_optimizer_state",
    "inspect",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
