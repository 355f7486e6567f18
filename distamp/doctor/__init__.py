"""The precision doctor: what this machine can do, and the risks a model carries into half precision.

``python -m distamp.doctor`` prints the machine's facts (:func:`machine`); ``check(model,
opt_level=...)`` lists findings for one model (:func:`check`).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..casting import is_norm
from ..config import check_opt_level, parse_half_dtype


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One risk found in a model."""

    module: str
    """Qualified name of the module ("" for the model itself)."""
    why: str
    """What goes wrong, and when."""
    fix: str
    """What to change."""

    def __str__(self) -> str:
        return f"{self.module or '<model>'}: {self.why} Fix: {self.fix}"


_WIDTHS: dict[type, tuple[str, ...]] = {
    nn.Linear: ("in_features", "out_features"),
    nn.Embedding: ("embedding_dim",),
    nn.Conv2d: ("in_channels", "out_channels"),
}
_RISKY_IN_HALF = (nn.Softmax, nn.LogSoftmax, nn.CrossEntropyLoss, nn.MSELoss, nn.NLLLoss)


def check(
    model: nn.Module,
    opt_level: str = "O2",
    half_dtype: Any = "auto",
    device_type: str | None = None,
) -> list[Finding]:
    """The precision risks of ``model`` at ``opt_level`` (apex's levels), before wrapping it.

    * normalization eps below the half dtype's smallest normal number (LayerNorm eps=1e-12 under
      FP16 rounds to 0: division by ~0 for a constant input) — reported when that norm would run
      in FP16 or its eps is stored there;
    * Linear/Conv/Embedding widths that are not multiples of 8 when the model is on a CUDA device
      (tensor cores need them; the matmul falls back to slower kernels);
    * modules that run in the half dtype without autocast's FP32 policy under O2/O3 and are known
      to overflow or lose precision: softmax, log-softmax and losses (large sums and exp).
    """
    level = check_opt_level(opt_level)
    device = device_type or next((p.device.type for p in model.parameters()), "cpu")
    half = parse_half_dtype(half_dtype, device)
    findings: list[Finding] = []
    tiny = torch.finfo(half).tiny
    for name, module in model.named_modules():
        eps = getattr(module, "eps", None)
        if level != "O0" and is_norm(module) and isinstance(eps, float) and 0 < eps < tiny:
            findings.append(
                Finding(
                    module=name,
                    why=(
                        f"{type(module).__name__} eps={eps:g} is below {half}'s smallest normal "
                        f"number {tiny:.3g}: in {half} it flushes to 0, and a constant input "
                        "divides by ~0 (inf/NaN)."
                    ),
                    fix=f"use eps >= {tiny * 16:.0e} (1e-5 is common) or keep this layer FP32 "
                    "(keep_batchnorm_fp32=True, the O2 default, or keep_fp32_modules).",
                )
            )
        if device == "cuda" and isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
            dims = _WIDTHS.get(type(module), ())
            odd = [f"{d}={getattr(module, d)}" for d in dims if getattr(module, d) % 8]
            if odd:
                findings.append(
                    Finding(
                        module=name,
                        why=f"{', '.join(odd)} not a multiple of 8: tensor cores are not used "
                        "for this layer's half-precision matmul.",
                        fix="pad the dimension to a multiple of 8 (vocabulary sizes too).",
                    )
                )
        if level in ("O2", "O3") and isinstance(module, _RISKY_IN_HALF):
            findings.append(
                Finding(
                    module=name,
                    why=f"{type(module).__name__} runs in {half} under {level} (no autocast "
                    "policy moves it to FP32): exp and large sums overflow or lose precision.",
                    fix=f"keep it FP32: distamp.wrap(..., keep_fp32_modules=[{name!r}]), or "
                    "compute it on model outputs (which O2 returns in FP32).",
                )
            )
    return findings


def matmul_gflops(dtype: torch.dtype, seconds: float, device: str = "cpu") -> float:
    """Measured GFLOP/s of a square matmul in ``dtype`` within about ``seconds``."""
    n = 256
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while True:
        a @ b
        count += 1
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 2:
            break
    return 2 * n**3 * count / elapsed / 1e9


def reducible_dtypes(backend: str = "gloo") -> dict[str, bool]:
    """Which dtypes an all-reduce on ``backend`` accepts, tried in a one-rank group of its own
    (skipped when a process group already exists: it is not ours to replace)."""
    out: dict[str, bool] = {}
    if dist.is_initialized():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                try:
                    dist.all_reduce(torch.ones(4, dtype=dtype))
                    out[str(dtype).removeprefix("torch.")] = True
                except (RuntimeError, ValueError):
                    out[str(dtype).removeprefix("torch.")] = False
        finally:
            dist.destroy_process_group()
    return out


def machine(seconds: float = 1.0) -> dict[str, Any]:
    """Facts about this machine: versions, backends, devices, measured matmul throughput."""
    per = max(0.01, seconds / 3)
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    flops = {
        str(dt).removeprefix("torch."): matmul_gflops(dt, per)
        for dt in (torch.float32, torch.float16, torch.bfloat16)
    }
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    advice = []
    fp32, fp16, bf16 = flops["float32"], flops["float16"], flops["bfloat16"]
    if fp16 < fp32 / 2 and bf16 < fp32 / 2:
        advice.append(
            f"neither half dtype has a fast matmul on this CPU (fp16 {fp16:.1f}, bf16 {bf16:.1f} "
            f"vs fp32 {fp32:.1f} GFLOP/s: no fp16 GEMM, no bf16 units): train in FP32 (O0) "
            "here, or use a GPU"
        )
    elif fp16 < fp32 / 2:
        advice.append(
            f"fp16 matmul runs at {fp16:.1f} GFLOP/s, {fp32 / max(fp16, 1e-9):.0f}x slower than "
            f"fp32 (no fp16 GEMM on this CPU), bf16 at {bf16:.1f}: use bf16 "
            "(half_dtype=torch.bfloat16, the CPU default)"
        )
    elif bf16 < fp32 / 2:
        advice.append(f"bf16 matmul is slow here ({bf16:.1f} GFLOP/s): use fp16")
    else:
        advice.append("half-precision matmul is fast here: O1/O2 pay off")
    return {
        "torch": str(torch.__version__),
        "devices": devices,
        "backends": backends,
        "matmul_gflops": flops,
        "gloo_reduces": reducible_dtypes("gloo") if backends["gloo"] else {},
        "advice": advice,
    }


__all__ = ["Finding", "check", "machine", "matmul_gflops", "reducible_dtypes"]
