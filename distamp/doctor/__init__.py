"""The precision doctor: what this machine can do, and the risks a model carries into half precision.

``python -m distamp.doctor`` prints the machine's facts (:func:`machine`); ``check(model,
opt_level=...)`` lists findings for one model (:func:`check`).
"""

from __future__ import annotations

import functools
import inspect
import io
import math
import os
import re
import tempfile
import textwrap
import time
import tokenize
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..casting import HF_FP32_ADVICE, hf_fp32_params, is_norm, plan_precision, resolve_fp32_modules
from ..config import check_opt_level, parse_half_dtype, resolve_properties


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
_TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm)


def check(
    model: nn.Module,
    opt_level: str = "O2",
    half_dtype: Any = "auto",
    device_type: str | None = None,
    keep_batchnorm_fp32: bool | None = None,
) -> list[Finding]:
    """The precision risks of ``model`` at ``opt_level`` (apex's levels), before wrapping it.
    ``keep_batchnorm_fp32``: as passed to ``wrap`` (True at O3: the norms stay FP32).

    * a normalization eps that rounds to 0 in the half dtype (LayerNorm eps=1e-12 in FP16: a norm
      computed there divides by ~0 for a constant input) — reported under O1 and O3, where a norm
      may run in the half dtype; O2 keeps norms FP32 (see :func:`kept_fp32`);
    * under O2, a module that looks like a norm layer (a float ``eps``, vector parameters) but is
      not one O2 recognizes, so it would run in the half dtype;
    * Linear/Conv/Embedding widths that are not multiples of 8 when the model is on a CUDA device
      (tensor cores need them; the matmul falls back to slower kernels);
    * modules that run in the half dtype without autocast's FP32 policy under O2/O3 and are known
      to overflow or lose precision: softmax, log-softmax and losses (large sums and exp).
    """
    level = check_opt_level(opt_level)
    device = device_type or next((p.device.type for p in model.parameters()), "cpu")
    half = parse_half_dtype(half_dtype, device)
    findings: list[Finding] = []
    ffts: dict[type, bool] = {}  # per class: its forward's source is read once (_calls_fft)
    info = torch.finfo(half)
    smallest = info.tiny * info.eps  # the least subnormal number
    for name, module in model.named_modules():
        eps = getattr(module, "eps", None)
        flushes = isinstance(eps, float) and eps > 0 and float(torch.tensor(eps, dtype=half)) == 0
        # torch's own norm kernels compute in FP32 inside (the eps is not rounded there), but the
        # backward of a constant input scales by 1/sqrt(eps), which must fit the half dtype with
        # some room (an audit: eps=1e-9 gave inf gradients in fp16, 1e-8 did not)
        inverse = eps**-0.5 if isinstance(eps, float) and eps > 0 else 0.0
        overflows = inverse > info.max / 4
        # O1 on CUDA: autocast runs torch's layer_norm/group_norm in FP32 (on CPU it does not)
        autocast_fp32 = level == "O1" and device == "cuda" and isinstance(module, _TORCH_NORMS)
        if (
            level in ("O1", "O3")
            and is_norm(module)
            and (flushes or overflows)
            and not autocast_fp32
        ):
            how = (
                [
                    f"it rounds to 0 in {half} (its smallest number is {smallest:.3g}): a norm "
                    f"computed in {half} (a custom norm class) divides by ~0 for a constant input"
                ]
                if flushes
                else []
            )
            if overflows:
                how.append(
                    f"1/sqrt(eps) = {inverse:.3g} leaves {half}'s range (largest "
                    f"{info.max:.3g}) in the backward of a (near-)constant input: inf/NaN "
                    "gradients"
                )
            findings.append(
                Finding(
                    module=name,
                    why=f"{type(module).__name__} eps={eps:g} is too small for {half}: "
                    + "; ".join(how)
                    + ".",
                    fix="use eps >= 1e-6 (1e-5 is common) or keep this layer FP32 (O2 keeps norms "
                    "FP32; keep_fp32_modules at any level).",
                )
            )
        own = [p for p in module.parameters(recurse=False)]
        looks_like_norm = isinstance(eps, float) and bool(own) and all(p.dim() == 1 for p in own)
        if level == "O2" and looks_like_norm and not is_norm(module):
            findings.append(
                Finding(
                    module=name,
                    why=(
                        f"{type(module).__name__} looks like a normalization layer (eps={eps:g}, "
                        f"vector parameters) but is not one O2 recognizes (a torch norm class, or "
                        f"a class named *norm*): it runs in {half}, its statistics too"
                        + (", and its eps rounds to 0 there." if flushes else ".")
                    ),
                    fix=f"keep it FP32: distamp.wrap(..., keep_fp32_modules=[{name!r}]).",
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
        if level in ("O2", "O3") and _calls_fft(module, ffts):
            findings.append(
                Finding(
                    module=name,
                    why=f"{type(module).__name__}.forward calls torch.fft (or stft), which gets "
                    f"{half} inputs under {level} (no autocast moves it to FP32 as under O1): "
                    "torch has no bf16 FFT kernel and no fp16 one on CPU ('Unsupported dtype').",
                    fix=f"keep it FP32: distamp.wrap(..., keep_fp32_modules=[{name!r}]), or "
                    "x.float() before the FFT inside it.",
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
    if level == "O3":
        findings += _cast_at_o3(model, half, norms_kept=bool(keep_batchnorm_fp32))
    if level in ("O2", "O3"):
        props = resolve_properties(level, device_type=device, half_dtype=half)
        found, listed = hf_fp32_params([model], plan_precision([model], props))
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            findings.append(
                Finding(
                    module="",
                    why=f"Hugging Face keeps {sorted(listed)} FP32 in half precision "
                    f"(_keep_in_fp32_modules); {level} casts them to {half}: {found[:3]}{more}.",
                    fix=HF_FP32_ADVICE + ".",
                )
            )
    return findings


def _cast_at_o3(model: nn.Module, half: torch.dtype, *, norms_kept: bool) -> list[Finding]:
    """What O3 casts that O2 keeps FP32: norm layers (their statistics: an audit measured fp16
    BatchNorm giving inf/NaN gradients in timm's EfficientNet where O2's did not) and tables of
    parameter-free modules (Llama's rotary inv_freq: cos off by 1.4 at position 4000 in bf16)."""
    props = resolve_properties("O2", device_type="cpu", half_dtype=half)
    names = {id(m): n or "<model>" for n, m in model.named_modules()}
    kept = [m for m in plan_precision([model], props).fp32_modules if id(m) in names]
    norms = [] if norms_kept else [names[id(m)] for m in kept if is_norm(m)]
    tables = [names[id(m)] for m in kept if not is_norm(m)]
    out = []
    for found, what in ((norms, "norm layers"), (tables, "parameter-free modules' buffers")):
        if found:
            listed = f"{found[:4]}{' and more' if len(found) > 4 else ''}"
            out.append(
                Finding(
                    module="",
                    why=f"O3 casts the {what} O2 keeps FP32 to {half}: {listed}"
                    + (
                        " (their mean and variance computed in the half dtype: they overflow "
                        "in fp16; BatchNorm's running statistics update in it too, their small "
                        "updates rounding away in bf16)."
                        if what == "norm layers"
                        else " (rotary and position tables lose the precision their angles need "
                        "at long positions)."
                    ),
                    fix="train O2, or keep them FP32 at O3: keep_batchnorm_fp32=True (norms), "
                    "keep_fp32_modules=[...] (any module).",
                )
            )
    return out


_FFT_CALL = re.compile(r"\b(?:fft|ifft|rfft|irfft|hfft|ihfft)(?:2|n)?\s*\(|\bstft\s*\(")
_FFT_NAMES = re.compile(r"^(?:fft_)?(?:fft|ifft|rfft|irfft|hfft|ihfft)(?:2|n)?$|^stft$")


def _calls_fft(module: nn.Module, sources: dict[type, bool]) -> bool:
    """Whether ``module`` runs an FFT: FNet's mixing, FFT convolutions, spectral layers (an audit:
    O2's first forward failed with torch's bare "Unsupported dtype BFloat16" and check said
    nothing). An attribute holding an FFT function (Hugging Face's FNet keeps
    ``partial(torch.fft.fftn, dim=(1, 2))``), or a call in the source of its class's ``forward``
    (inherited too; comments and strings left out; a call on an input cast to FP32 in place,
    ``fft2(x.float())``, is fine). ``sources`` caches the source's answer per class."""
    for value in vars(module).values():
        func = value.func if isinstance(value, functools.partial) else value
        try:  # a user's callable may raise anything from __getattr__ (a review)
            name = getattr(func, "__name__", "") if callable(func) else ""
        except Exception:
            continue
        if isinstance(name, str) and _FFT_NAMES.match(name):
            return True
    cls = type(module)
    if cls not in sources:
        sources[cls] = _forward_calls_fft(cls)
    return sources[cls]


def _forward_calls_fft(cls: type) -> bool:
    owner = next((k for k in cls.__mro__ if "forward" in vars(k)), None)
    if owner is None or owner.__module__.startswith("torch."):
        return False
    try:
        source = inspect.getsource(vars(owner)["forward"])
        tokens = tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline)
        code = " ".join(
            t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING)
        )
    except (OSError, TypeError, tokenize.TokenError, SyntaxError, IndentationError):
        return False
    for match in _FFT_CALL.finditer(code):
        depth, end = 1, match.end()
        while end < len(code) and depth:  # the first argument, to its comma or parenthesis
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            if code[end] == "," and depth == 1:
                break
            end += 1
        argument = code[match.end() : end]
        if not re.search(r"\.\s*float\s*\(\s*\)|float32|\.\s*double\s*\(", argument):
            return True
    return False


def kept_fp32(
    model: nn.Module,
    opt_level: str = "O2",
    half_dtype: Any = "auto",
    keep_fp32_modules: Any = None,
) -> list[str]:
    """The modules of ``model`` that ``wrap`` would keep FP32 at ``opt_level``: the norm layers it
    recognized (see [Note: recognizing norm layers] in casting.py), parameter-free modules with
    floating buffers (rotary tables), those of ``keep_fp32_modules``, and modules sharing a
    parameter with one of them. Changes nothing; look here for a norm class it did not recognize
    (then pass it in ``keep_fp32_modules``)."""
    device = next((p.device.type for p in model.parameters()), "cpu")
    props = resolve_properties(opt_level, device_type=device, half_dtype=half_dtype)
    plan = plan_precision([model], props, resolve_fp32_modules([model], keep_fp32_modules))
    names = {id(m): n or "<model>" for n, m in model.named_modules()}
    return [names[id(m)] for m in plan.fp32_modules if id(m) in names]


def matmul_gflops(dtype: torch.dtype, seconds: float, device: str = "cpu") -> float:
    """Measured GFLOP/s of a square matmul in ``dtype`` within about ``seconds``: the fastest of
    the products timed, since a busy machine only ever slows one down (an audit on a loaded
    2-core machine: the mean over the budget measured fp32 anywhere from 0.6 to 18 GFLOP/s, and
    the advice flipped with it). On a GPU the matrices are 4096 wide and ten products run between
    synchronizations (a 256-wide product there measures the kernel launch, not the arithmetic);
    on a CPU 256 wide, or 512 where that takes under 10 ms (timer resolution)."""
    cuda = torch.device(device).type == "cuda"
    n, per_sync = (4096, 10) if cuda else (256, 1)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    start = time.perf_counter()
    a @ b  # warm-up
    if not cuda and time.perf_counter() - start < 0.01:
        n = 512
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b
    if cuda:
        torch.cuda.synchronize(device)
    best, count, begin = float("inf"), 0, time.perf_counter()
    while True:
        start = time.perf_counter()
        for _ in range(per_sync):
            a @ b
        if cuda:
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        best = min(best, (now - start) / per_sync)
        count += per_sync
        if now - begin >= seconds and count >= 2:
            break
    return 2 * n**3 / best / 1e9


def compare_matmuls(
    dtypes: tuple[torch.dtype, ...],
    seconds: float,
    device: str = "cpu",
    rounds: int = 4,
    threads: int = 1,
) -> dict[str, float]:
    """:func:`matmul_gflops` of each dtype, in ``rounds`` interleaved turns within about
    ``seconds``, the best turn of each: load that comes and goes then slows every dtype's worst
    turns, not one dtype's whole measurement (an audit on a busy machine: three runs, three
    pieces of advice, each dtype timed in one stretch of its own).

    On the CPU with one thread (per core, as a training rank runs with ``--threads 1``): a
    product split over every core waits for the slowest, and with other processes holding a core
    every product stalled — an audit at a load of 5 on 2 cores measured fp32 at 2.1 GFLOP/s in
    three of five runs and the advice flipped; one thread gets whole time slices. ``threads``:
    another count, for a caller whose work runs on that many threads per process (the
    benchmark's ``--threads``: its "of peak" is against the rate its ranks can reach)."""
    best = dict.fromkeys((str(dt).removeprefix("torch.") for dt in dtypes), 0.0)
    per = max(0.005, seconds / (rounds * len(dtypes)))
    was = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(threads)
    try:
        for _ in range(rounds):
            for dt in dtypes:
                name = str(dt).removeprefix("torch.")
                best[name] = max(best[name], matmul_gflops(dt, per, device))
    finally:
        torch.set_num_threads(was)
    return best


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


def fastest_compute(flops: dict[str, float]) -> str:
    """ "bfloat16", "float16" or "float32": the dtype whose measured matmul is fastest (``flops``
    by dtype name, as :func:`compare_matmuls` gives them). Mixed precision pays off in compute
    only where a half dtype beats FP32; ``benchmarks/compare.py --compute auto`` uses this rule
    too (an audit: the doctor said "O1/O2 pay off" for a half matmul at 70% of FP32's, where
    the benchmark chose FP32)."""
    fastest = max(("float32", "bfloat16", "float16"), key=lambda d: flops.get(d, 0.0))
    return fastest if flops.get(fastest, 0.0) > flops.get("float32", 0.0) else "float32"


def cpu_advice(flops: dict[str, float], *, bf16_wire: bool) -> str:
    """What to train with on this CPU, from its measured matmul throughput (``flops`` by dtype
    name) and whether gloo reduces bf16 (``bf16_wire``)."""
    fp32, fp16, bf16 = flops["float32"], flops["float16"], flops["bfloat16"]
    measured = f"fp16 {fp16:.1f}, bf16 {bf16:.1f} vs fp32 {fp32:.1f} GFLOP/s"
    best = fastest_compute(flops)
    if best == "bfloat16":
        return (
            f"bf16 matmul is the fastest here ({measured}): O2 (or O1) with "
            "half_dtype=torch.bfloat16 (the CPU default) pays off"
        )
    if best == "float16":
        return (
            f"fp16 matmul is the fastest here ({measured}): O2 (or O1) with "
            "half_dtype=torch.float16 (with the dynamic loss scale) pays off"
        )
    wire = (
        '; across ranks keep a 16-bit wire and 1/N of the optimizer state: opt_level="O0", '
        "shard_master_weights=True and distamp.hooks.register(ddp, optimizer, "
        "reduce_scatter=True, overlap_gather=True, gather_dtype=torch.bfloat16) (what the "
        "example's --opt-level auto picks)"
        if bf16_wire
        else ""
    )
    return (
        f"no half dtype's matmul beats FP32 on this CPU ({measured}: no fp16 GEMM, no bf16 "
        f"units): compute in FP32 (O0){wire}; or use a GPU"
    )


def machine(seconds: float = 1.0) -> dict[str, Any]:
    """Facts about this machine: versions, backends, devices, measured matmul throughput (the
    CPU's, and the first GPU's where there is one: the device a run trains on)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds: expected a positive finite number, got {seconds!r}")
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    flops = compare_matmuls(dtypes, seconds)
    gpu_flops = compare_matmuls(dtypes, seconds, "cuda:0") if len(devices) > 1 else {}
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    gloo_reduces = reducible_dtypes("gloo") if backends["gloo"] else {}
    advice = [cpu_advice(flops, bf16_wire=gloo_reduces.get("bfloat16", False))]
    if gpu_flops:
        advice.append(
            f"cuda:0: fp16 {gpu_flops['float16'] / 1e3:.0f}, bf16 {gpu_flops['bfloat16'] / 1e3:.0f} "
            f"vs fp32 {gpu_flops['float32'] / 1e3:.0f} TFLOP/s: train there in O2 (half_dtype "
            "'auto' is fp16 on CUDA, with the dynamic loss scale; bf16 needs none to stay finite)"
        )
    return {
        "torch": str(torch.__version__),
        "devices": devices,
        "backends": backends,
        "matmul_gflops": flops,
        "gpu_matmul_gflops": gpu_flops,
        "gloo_reduces": gloo_reduces,
        "advice": advice,
    }


__all__ = [
    "Finding",
    "check",
    "cpu_advice",
    "fastest_compute",
    "kept_fp32",
    "machine",
    "matmul_gflops",
    "reducible_dtypes",
]
