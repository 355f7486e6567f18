"""FSDP2 + distamp O2 vs FSDP2 + torch's MixedPrecisionPolicy + ShardedGradScaler, 2 ranks.

    python benchmarks/fsdp.py [--size bench] [--steps 8] [--rounds 2] [--json out.json]

Same GPT (examples/train_gpt.py), same data, same AdamW, bf16 (fp16 with --fp16); each
configuration runs in its own spawned world (so peak RSS is its own), rounds alternate A B A B so
machine drift favours neither. Reported: median step time (first 2 steps of a round excluded),
per-rank peak RSS, FP32 parameter shard + optimizer state bytes per rank, found-inf all-reduces
per step, final loss.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt import GPT, SIZES, GPTConfig, RandomWindows, load_stdlib_bytes

import distamp
import distamp.fsdp

CONFIGS = ["distamp.fsdp O2", "torch MixedPrecisionPolicy + ShardedGradScaler"]


def build(config: str, size: str, seq: int, half: torch.dtype):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=seq, **SIZES[size]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if config == CONFIGS[0]:
        model, opt = distamp.fsdp.fully_shard(
            model, opt, opt_level="O2", half_dtype=half, verbosity=0
        )
        return model, opt, None
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    inner = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half)
    for block in model.blocks:
        fully_shard(block, mp_policy=inner)
    root = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half, output_dtype=torch.float32)
    fully_shard(model, mp_policy=root)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, ShardedGradScaler(device="cpu", init_scale=2.0**16)


def state_bytes(model, opt) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    for per in opt.state.values():
        for v in per.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def worker(rank, world, init, config, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    half = torch.float16 if args["fp16"] else torch.bfloat16
    model, opt, scaler = build(config, args["size"], args["seq"], half)
    data = RandomWindows(load_stdlib_bytes(2**20), args["seq"], seed=rank)
    times, loss = [], torch.zeros(())
    for step in range(args["steps"]):
        start = time.perf_counter()
        x, y = data.batch(args["batch"], torch.device("cpu"), step)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        if scaler is None:
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)
    result = {
        "times": times[2:] or times,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "state_bytes": state_bytes(model, opt),
        "loss": loss.item(),
        "collectives_per_step": (
            opt._distamp.group.found_inf_collectives / args["steps"] if scaler is None else None
        ),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="bench")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    opts = {"size": args.size, "steps": args.steps, "batch": args.batch, "seq": args.seq}
    opts["fp16"] = args.fp16
    runs: dict[str, list] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="distamp-fsdp-bench-") as tmp:
        for r in range(args.rounds):
            for config in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                out = os.path.join(tmp, "out.json")
                init = os.path.join(tmp, f"rdzv-{r}-{CONFIGS.index(config)}")
                mp.spawn(worker, args=(args.world, init, config, opts, out), nprocs=args.world)
                runs[config].append(json.loads(Path(out).read_text()))
    half = "fp16" if args.fp16 else "bf16"
    print(
        f"\nGPT {args.size}, FSDP2 on {args.world} ranks (gloo), {half}, batch {args.batch}x"
        f"{args.seq}/rank, {args.steps} steps x {args.rounds} rounds\n"
    )
    print(
        "| configuration | median step s | spread s | peak RSS/rank MB | params+state/rank MB "
        "| found-inf all-reduces/step | final loss |"
    )
    print("|---|---|---|---|---|---|---|")
    table = {}
    for config, rounds in runs.items():
        times = [t for run in rounds for t in run[0]["times"]]
        med = statistics.median(times)
        spread = statistics.pstdev(times)
        rss = max(rank["peak_rss"] for run in rounds for rank in run) / 1e6
        held = max(rank["state_bytes"] for run in rounds for rank in run) / 1e6
        coll = rounds[0][0]["collectives_per_step"]
        loss = rounds[-1][0]["loss"]
        table[config] = {
            "median_s": med,
            "spread_s": spread,
            "peak_rss_mb": rss,
            "held_mb": held,
            "found_inf_allreduces": coll,
            "loss": loss,
        }
        print(
            f"| {config} | {med:.3f} | {spread:.3f} | {rss:.0f} | {held:.1f} | "
            f"{'1' if coll else 'per device (torch)'} | {loss:.4f} |"
        )
    a, b = (table[c]["median_s"] for c in CONFIGS)
    print(f"\ndistamp.fsdp O2 step time: {a / b:.2f}x torch's")
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
