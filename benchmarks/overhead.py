"""Per-step host overhead: many tiny parameters, so Python and dispatch, not arithmetic, set the
step time. One table, the configurations measured side by side in interleaved rounds.

    python benchmarks/overhead.py                      # 1,000 parameters (250 Linear+LayerNorm)
    python benchmarks/overhead.py --layers 750 --rounds 15
    python benchmarks/overhead.py --quick               # the smoke test's sizes

Single process, one thread, CPU: FP32 (the floor), torch.autocast + torch.amp.GradScaler (what
distamp replaces), distamp.GradScaler under torch.autocast, and distamp.wrap at O0/O1/O2 with
``scale_loss``. Each configuration holds its own model (a stack of ``Linear(16, 16)`` +
``LayerNorm(16)``, 4 parameters per layer) and SGD with momentum; a round runs one step of each,
in turn, and the table gives each one's median step time and its ratio to FP32 and to torch's
autocast + GradScaler. What it measures is what a GPU run of a small-tensor model pays on the
host per step: the checks distamp adds (gradient versions, the skip decision, the master
copies) against torch's own.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import distamp

CONFIGS = [
    "FP32",
    "torch.autocast + torch.amp.GradScaler",
    "torch.autocast + distamp.GradScaler",
    "distamp O0",
    "distamp O1",
    "distamp O2",
]


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(16, 16), nn.LayerNorm(16)]
    return nn.Sequential(*blocks)


def build(config: str, layers: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step of ``config`` on its own model: (x, y) -> the loss."""
    model = _model(layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if config == "FP32":

        def plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return plain
    if config.startswith("torch.autocast"):
        scaler: torch.amp.GradScaler | distamp.GradScaler = (
            torch.amp.GradScaler("cpu") if "torch.amp" in config else distamp.GradScaler("cpu")
        )

        def autocast(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (model(x).float() - y).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss.detach()

        return autocast
    level = config.split()[1]
    model, opt = distamp.wrap(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)

    def wrapped(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = (model(x).float() - y).pow(2).mean()
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return wrapped


def run(layers: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    steps = {config: build(config, layers) for config in CONFIGS}
    x, y = torch.randn(2, 16), torch.randn(2, 16)
    for step in steps.values():
        for _ in range(warmup):
            step(x, y)
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for _ in range(rounds):  # interleaved: the machine's drift reaches every row alike
        for config, step in steps.items():
            start = time.perf_counter()
            step(x, y)
            times[config].append(time.perf_counter() - start)
    return times


def table(times: dict[str, list[float]], layers: int) -> str:
    medians = {config: statistics.median(t) for config, t in times.items()}
    floor, torch_amp = medians["FP32"], medians["torch.autocast + torch.amp.GradScaler"]
    rows = [
        f"Per-step time, {4 * layers} parameters of 16-256 elements, one process, one thread, "
        f"median of {len(times['FP32'])} interleaved rounds",
        "",
        "| configuration | median ms | spread ms | vs FP32 | vs torch autocast + GradScaler |",
        "|---|---|---|---|---|",
    ]
    for config, t in times.items():
        spread = (max(t) - min(t)) * 1e3
        rows.append(
            f"| {config} | {medians[config] * 1e3:.1f} | {spread:.1f} | "
            f"{medians[config] / floor:.2f}x | {medians[config] / torch_amp:.2f}x |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=250, help="Linear+LayerNorm pairs")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rounds, args.warmup = 5, 3, 1
    warnings.simplefilter("ignore")  # (bf16 on CPU: the doctor's advice, said once per wrap)
    print(table(run(args.layers, args.rounds, args.warmup), args.layers))


if __name__ == "__main__":
    main()
