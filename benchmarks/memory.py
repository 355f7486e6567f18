"""Where each configuration's peak RSS goes: one table, the rows of benchmarks/compare.py.

    python benchmarks/memory.py                       # W2 model, 2 ranks, the FP32-compute rows
    python benchmarks/memory.py --only "ZeroRedundancyOptimizer + torch fp16_compress_hook" \\
        "distamp O0 + hook"

Each configuration runs in its own spawned world (loopback, gloo), built by compare.py's own
``setup`` (same model, data, AdamW, DDP buckets), for ``--steps`` steps. Per rank 0 the table
gives the RSS before the model exists (the process: torch, gloo), the peak RSS, and what the live
tensors at the end account for, by owner: the model's weights, its gradients (DDP's buckets when
they are views into them), the optimizer state, distamp's FP32 shard copies, its FP32 shard
gradients, its staging buffer (16-bit updates and the hook's receive buffers), the comm hooks'
send/wire buffers and scratch. "rest" is the peak minus all of that: DDP's FP32 buckets (which
hold the gradients: 4 bytes per parameter in every DDP row; the step functions zero the
gradients with set_to_none, so "gradients" is what is left outside them), activations at their
peak, the second set of buckets while DDP rebuilds them after the first step, and what the
allocator keeps.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import resource
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare

from distamp.hooks import CompressState
from distamp.hooks.zero import ZeroState
from distamp.masters.sharded import ShardedMasterParams

ROWS = [
    c
    for c in compare.FP32_CONFIGS
    if not c.startswith(("floor", "FSDP2", "DeepSpeed")) and "overlapped gather" not in c
]
"""compare.py's FP32-compute rows that run under DDP here (no optional extras, no floor)."""
MB = 1e6


def _rss() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        to_local = getattr(t, "to_local", None)  # FSDP2's DTensors: the local shard
        local = to_local() if callable(to_local) else t
        storage = local.untyped_storage()
        if local.numel() and storage.nbytes():  # FSDP2 frees unsharded storages (size 0)
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _accounting(model: torch.nn.Module, opt: Any) -> dict[str, float]:
    params = list(model.parameters())
    out = {
        "weights": _bytes(p.data for p in params),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        # FSDP2: its FP32 shards are the weights here, not counted by compare._held as masters.
        "optimizer state": compare._held(opt),
    }
    masters = getattr(getattr(opt, "_distamp", None), "masters", None)
    if isinstance(masters, ShardedMasterParams):
        out["optimizer state"] -= masters.master_bytes()
        out["FP32 shard copies"] = masters.master_bytes() if masters.fp32_weights else 0
        out["FP32 masters (O2)"] = 0 if masters.fp32_weights else masters.master_bytes()
        out["FP32 shard gradients"] = _bytes([masters.grad_buffer])
        widened = [layout.widened for layout in masters.groups]
        out["staging + widened"] = _bytes([masters.staging, *widened])
    hooks: list[torch.Tensor] = []
    with warnings.catch_warnings():  # isinstance() on torch.distributed.reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        states = [o for o in gc.get_objects() if isinstance(o, CompressState)]
    for state in states:  # held by DDP's reducer: found through the garbage collector
        hooks += [*state._free, *state._lent.values(), state._scratch]
        if isinstance(state, ZeroState):
            hooks.append(state._sum)
    out["hook buffers"] = _bytes(hooks)
    return {k: v / MB for k, v in out.items()}


def worker(rank: int, world: int, rdzv: str, config: str, opts: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rdzv}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=opts["timeout"]),
    )
    base = _rss()
    torch.manual_seed(0)
    gpt = compare.GPT(compare.GPTConfig(block_size=opts["seq"], **compare.SIZES[opts["size"]]))
    step, opt, _, _ = compare.setup(config, gpt, opts, torch.device("cpu"), world, rank)
    data = compare.RandomWindows(
        compare.load_stdlib_bytes(int(opts["data_mb"] * 2**20)), opts["seq"], rank
    )
    for i in range(opts["steps"]):
        step(*data.batch(opts["batch"], torch.device("cpu"), i))
    row = {
        "config": config,
        "before model": base / MB,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB,
        **_accounting(gpt, opt),
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered[0]))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see [Note: exit without destructors] in compare.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=ROWS, help="configurations (compare.py's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1, help="per rank (1: W2's)")
    parser.add_argument("--bucket-mb", type=float, default=2.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--size", default="bench", choices=sorted(compare.SIZES))
    args = parser.parse_args()
    unknown = [c for c in args.only if c not in compare.CONFIGS]
    if unknown:
        parser.error(
            f"--only: unknown configuration(s) {unknown}; expected some of {compare.CONFIGS}"
        )
    opts = {
        "lr": 1e-3,
        "adamw": "default",
        "bucket_mb": args.bucket_mb,
        "batch": args.batch,
        "seq": 128,
        "size": args.size,
        "data_mb": 4.0,
        "steps": args.steps,
        "timeout": 600,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(args.only):
            out, rdzv = f"{tmp}/{i}.json", f"{tmp}/{i}.rdzv"
            ctx = mp.get_context("spawn")
            procs = [
                ctx.Process(target=worker, args=(r, args.world, rdzv, config, opts, out))
                for r in range(args.world)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(opts["timeout"])
            if not Path(out).exists():
                print(f"{config}: failed (exit codes {[p.exitcode for p in procs]})", flush=True)
                continue
            rows.append(json.loads(Path(out).read_text()))
            print(f"{config}: done", flush=True)
    columns = sorted({k for r in rows for k in r} - {"config", "before model", "peak"})
    columns = [c for c in _ORDER if c in columns] + [c for c in columns if c not in _ORDER]
    print(
        f"\nPeak RSS per rank and what the live tensors account for (MB; rank 0, {args.world} ranks, "
        f"batch {args.batch}x128, {args.bucket_mb:g} MB buckets, {args.steps} steps)\n"
    )
    head = ["configuration", "peak RSS", "before model", *columns, "rest"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        known = sum(r.get(c, 0.0) for c in columns)
        rest = r["peak"] - r["before model"] - known
        cells = [f"{r['peak']:.0f}", f"{r['before model']:.0f}"]
        cells += [f"{r[c]:.1f}" if c in r else "-" for c in columns] + [f"{rest:.0f}"]
        print(f"| {r['config']} | " + " | ".join(cells) + " |")


_ORDER = [
    "weights",
    "gradients",
    "optimizer state",
    "FP32 masters (O2)",
    "FP32 shard copies",
    "FP32 shard gradients",
    "staging + widened",
    "hook buffers",
]


if __name__ == "__main__":
    main()
