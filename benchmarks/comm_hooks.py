"""Gradient communication per step on 2 ranks: FP32 all-reduce vs distamp's FP16 and BF16 hooks.

    python benchmarks/comm_hooks.py [--world 2] [--params 20] [--rounds 7] [--json out.json]

A ~20M-parameter stack of Linear layers under DDP (25 MB buckets), one thread per rank, gloo on
CPU (NCCL when CUDA is there). Communication time per step = median time of a synchronized
backward minus median time of the same backward under ``no_sync`` (no communication), measured in
the same process, configurations interleaved round by round so drift favours none. Bytes on the
wire are counted by the hook's state (what it hands to the process group).
"""

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp
from distamp.hooks import CompressState

# name: (wire dtype or None for DDP's built-in all-reduce, dtype of the model's gradients)
CONFIGS = {
    "fp32 all-reduce (DDP default)": (None, torch.float32),
    "fp32 grads, distamp fp16_compress_hook": (torch.float16, torch.float32),
    "fp32 grads, distamp bf16_compress_hook": (torch.bfloat16, torch.float32),
    "bf16 grads (O2), distamp bf16 hook": (torch.bfloat16, torch.bfloat16),
}


def build(params_m: float, device: torch.device) -> nn.Module:
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world
    )
    models, states = {}, {}
    for name, (wire, grad_dtype) in CONFIGS.items():
        ddp = DDP(build(args.params, device).to(grad_dtype))
        if wire is not None:
            states[name] = CompressState(wire_dtype=wire)
            hook = (
                distamp.hooks.bf16_compress_hook
                if wire == torch.bfloat16
                else distamp.hooks.fp16_compress_hook
            )
            ddp.register_comm_hook(states[name], hook)
        models[name] = ddp
    inputs = {dt: torch.randn(8, 2048, device=device, dtype=dt) for _, dt in CONFIGS.values()}
    times: dict[str, dict[str, list[float]]] = {n: {"sync": [], "local": []} for n in CONFIGS}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and lets DDP rebuild its buckets)
        for name, ddp in models.items():
            x = inputs[CONFIGS[name][1]]
            for mode in ("sync", "local"):
                ddp.zero_grad()
                context = ddp.no_sync() if mode == "local" else contextlib.nullcontext()
                with context:  # DDP decides at forward time whether the backward syncs
                    loss = ddp(x).square().mean()
                    if cuda:
                        torch.cuda.synchronize()
                    dist.barrier()
                    start = time.perf_counter()
                    loss.backward()
                    if cuda:
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                if round_ > 0:
                    times[name][mode].append(elapsed)
    params = sum(p.numel() for p in models[next(iter(models))].parameters())
    rows = []
    for name, (wire, grad_dtype) in CONFIGS.items():
        sync = statistics.median(times[name]["sync"])
        local = statistics.median(times[name]["local"])
        wire_bytes = params * torch.tensor([], dtype=wire or grad_dtype).element_size()
        if name in states:
            counted = states[name].bytes_on_wire / (args.rounds + 1)
            assert counted == wire_bytes, (name, counted, wire_bytes)
        rows.append(
            {
                "config": name,
                "backward_s": sync,
                "backward_no_comm_s": local,
                "comm_s": max(sync - local, 0.0),
                "bytes_per_step": wire_bytes,
            }
        )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {"params": params, "world": world, "backend": dist.get_backend(), "rows": rows}, f
            )
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--params", type=float, default=20.0, help="millions of parameters")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(args.world, os.path.join(tmp, "rdzv"), args, out), nprocs=args.world)
        with open(out) as f:
            result = json.load(f)
    base = result["rows"][0]
    print(
        f"\n{result['params'] / 1e6:.1f}M parameters, {result['world']} ranks, {result['backend']}, "
        f"median of {args.rounds} rounds\n"
    )
    print(
        "| configuration | backward s | backward, no comm s | comm s/step | comm vs fp32 | MB on the wire/step | bytes vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(
            f"| {row['config']} | {row['backward_s']:.3f} | {row['backward_no_comm_s']:.3f} | "
            f"{row['comm_s']:.3f} | {row['comm_s'] / base['comm_s']:.2f}x | "
            f"{row['bytes_per_step'] / 1e6:.1f} | {row['bytes_per_step'] / base['bytes_per_step']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
