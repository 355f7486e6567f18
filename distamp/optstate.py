"""Where a wrapped optimizer is between two steps: torch.amp.GradScaler's per-optimizer state machine.

Read by the optimizer (``step``/``zero_grad``), the loss scaler (which moves it) and the public
functions (``unscale_``, ``clip_grad_norm_``), so it lives apart from all of them.
"""

from __future__ import annotations

import enum


class OptState(enum.Enum):
    """Where an optimizer is between two steps (torch.amp.GradScaler's state machine)."""

    READY = "ready"
    """No scaled gradients pending since the last step."""
    SCALED = "scaled"
    """``scale_loss`` produced gradients that are still multiplied by the loss scale."""
    UNSCALED = "unscaled"
    """``unscale_`` ran: gradients are true gradients and the skip decision is made."""


HELD = "params held (count, elements, shapes hash)"
"""The pseudo-setting ``AmpOptimizerState.settings`` compares across ranks for what a param group
holds (replicated masters), named in the optimizer's refusal of parted settings."""
