"""DDP communication hooks: FP16/BF16 gradient compression on NCCL and gloo, and ``register``."""

from .compress import (
    CompressState,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .register import register

__all__ = [
    "CompressState",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "register",
]
