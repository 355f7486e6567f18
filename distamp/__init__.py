"""distamp: apex.amp-style mixed precision for PyTorch DDP/FSDP, correct across ranks.

model, optimizer = distamp.wrap(model, optimizer, opt_level="O2")   # before DDP/FSDP
with distamp.scale_loss(loss, optimizer) as scaled_loss:
    scaled_loss.backward()
optimizer.step()                                                    # skipped on every rank together
"""

from . import amp, checkpoint, debug, doctor, fsdp, hooks
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Properties
from .forensics import NonFiniteGradientError, NonFiniteReport
from .grad_scaler import GradScaler
from .scaler import LossScaler
from .wrap import (
    AmpStats,
    autocast_exclude,
    clip_grad_norm_,
    scale_loss,
    stats,
    unscale_,
    wrap,
)

__version__ = "0.1.0"

__all__ = [
    "AmpStats",
    "CheckpointError",
    "GradScaler",
    "LossScaler",
    "NonFiniteGradientError",
    "NonFiniteReport",
    "Properties",
    "__version__",
    "amp",
    "autocast_exclude",
    "checkpoint",
    "clip_grad_norm_",
    "debug",
    "doctor",
    "fsdp",
    "hooks",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "scale_loss",
    "stats",
    "unscale_",
    "wrap",
]
