"""Sharded vs replicated FP32 masters (O2, AdamW) vs ZeroRedundancyOptimizer + autocast, 2 ranks.

    python benchmarks/sharded_optimizer.py [--world 2] [--params 20] [--steps 6] [--json out.json]

Memory: each configuration runs in its own spawned world; per rank it reports the bytes of FP32
masters + optimizer state that rank holds (tensor bytes, from ``distamp.stats`` or the optimizer's
state) and the growth of the process's resident memory (RSS) from just before the optimizer's first
step to just after it, against the ZeRO-1 formula 12 bytes/param / N for Adam (4 master + 8 state).
Time: all configurations in one world, steps interleaved so drift favours none; median step time.
Also times the two gradient paths on this backend: all_reduce of the bf16 gradients vs
reduce_scatter into 1/N (see [Note: gradient path] in distamp/masters/sharded.py).
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp

CONFIGS = ["distamp O2 sharded", "distamp O2 replicated", "autocast + ZeroRedundancyOptimizer"]
WIDTH = 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(params_m: float) -> nn.Module:
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(layers)]
    )


def setup(config: str, params_m: float):
    model = build(params_m)
    if config == "autocast + ZeroRedundancyOptimizer":
        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        return ddp, opt, True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shard = config == "distamp O2 sharded"
    model, opt = distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    ddp = DDP(model)
    distamp.hooks.register(ddp, opt)
    return ddp, opt, False


def step(ddp, opt, autocast: bool, x, y) -> None:
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(ddp(x).float(), y)
        loss.backward()
        opt.step()
    else:
        loss = F.mse_loss(ddp(x), y)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    opt.zero_grad()


def held_bytes(opt, autocast: bool) -> int:
    if not autocast:
        s = distamp.stats(opt)
        return s.master_bytes + s.optimizer_state_bytes
    return sum(
        v.numel() * v.element_size()
        for st in opt.optim.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def init(rank: int, world: int, rdzv: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)


def memory_worker(rank, world, rdzv, config, params_m, out):
    init(rank, world, rdzv)
    ddp, opt, autocast = setup(config, params_m)
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    before = rss_bytes()
    step(ddp, opt, autocast, x, y)
    grown = rss_bytes() - before
    params = sum(p.numel() for p in ddp.module.parameters())
    result = {"held": held_bytes(opt, autocast), "rss_growth": grown, "params": params}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


def time_worker(rank, world, rdzv, params_m, steps, out):
    init(rank, world, rdzv)
    runs = {c: setup(c, params_m) for c in CONFIGS}
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    times = {c: [] for c in CONFIGS}
    for i in range(steps + 1):
        for config, (ddp, opt, autocast) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step(ddp, opt, autocast, x, y)
            if i > 0:
                times[config].append(time.perf_counter() - start)
    # the two gradient paths, on the gradients of the benchmark model in bf16
    n = sum(p.numel() for p in runs[CONFIGS[0]][0].module.parameters())
    n -= n % world
    grads, out_shard = torch.randn(n).bfloat16(), torch.empty(n // world, dtype=torch.bfloat16)
    paths = {"all_reduce": [], "reduce_scatter": []}
    for _ in range(steps):
        for name in paths:
            dist.barrier()
            start = time.perf_counter()
            if name == "all_reduce":
                dist.all_reduce(grads)
            else:
                reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
                reduce_scatter(out_shard, grads)
            paths[name].append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "median_s": {c: statistics.median(t) for c, t in times.items()},
                    "spread_s": {c: max(t) - min(t) for c, t in times.items()},
                    "paths_s": {k: statistics.median(v) for k, v in paths.items()},
                },
                f,
            )
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


def spawn(fn, world, *args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(fn, args=(world, os.path.join(tmp, "rdzv"), *args, out), nprocs=world)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--params", type=float, default=20.0, help="millions of parameters")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    memory = {c: spawn(memory_worker, args.world, c, args.params) for c in CONFIGS}
    timing = spawn(time_worker, args.world, args.params, args.steps)
    params = memory[CONFIGS[0]][0]["params"]
    formula = 12 * params / args.world
    print(f"\n{params / 1e6:.1f}M parameters, AdamW, {args.world} ranks, gloo, bf16\n")
    print(
        "| configuration | masters + optimizer state held per rank (MB) | vs ZeRO-1 formula "
        "12 B/param/N | RSS growth over the first step (MB) | median step s | spread s |"
    )
    print("|---|---|---|---|---|---|")
    for c in CONFIGS:
        held = max(r["held"] for r in memory[c])
        rss = max(r["rss_growth"] for r in memory[c])
        print(
            f"| {c} | {held / 1e6:.1f} | {held / formula:.3f}x | {rss / 1e6:.1f} | "
            f"{timing['median_s'][c]:.3f} | {timing['spread_s'][c]:.3f} |"
        )
    paths = timing["paths_s"]
    print(
        f"\ngradient path on gloo, {params / 1e6:.1f}M bf16 gradients: all_reduce "
        f"{paths['all_reduce']:.3f} s, reduce_scatter {paths['reduce_scatter']:.3f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "memory": memory, "timing": timing}, f, indent=2)


if __name__ == "__main__":
    main()
