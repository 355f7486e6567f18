"""distamp's sharded checkpoint vs torch.save of the consolidated state on rank 0, 2 ranks.

    python benchmarks/checkpoint.py [--world 2] [--params 20] [--repeats 3] [--json out.json]

A ~20M-parameter model under O2 (bf16 weights, sharded FP32 masters, AdamW state) after one step.
Both methods save the same things (FP32 masters, optimizer state, the model's weights in their own
dtype: bf16 under O2) with fsync:

* distamp: ``save_checkpoint`` (each rank writes its shard through DCP; atomic commit, SHA-256 of
  every file) and ``load_checkpoint`` (verifies the hashes, each rank reads its shard);
* baseline: what ZeroRedundancyOptimizer.consolidate_state_dict + torch.save do: gather every
  shard of masters and state to rank 0, ``torch.save`` there; load: ``torch.load`` on rank 0,
  broadcast the full tensors, each rank keeps its shard.

Save and load are timed on every rank (max over ranks), repeats interleaved, medians reported;
bytes are what each rank wrote. ``--dir DIR`` writes into a new folder inside DIR
(``distamp-bench-*``) and removes only that folder.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import distamp

WIDTH = 2048


def build(params_m: float) -> nn.Module:
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Create AdamW state without a bf16 forward (slow on CPUs without bf16 matmul)."""
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(p.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # step() without scale_loss: scale 1.0, as intended here
        opt.step()
    opt.zero_grad()


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def baseline_save(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Collective: the shards of the masters and AdamW state gathered to rank 0, saved there with
    the model's weights as the model holds them. ``model.state_dict()`` is not what it holds under
    O2: it reports the bf16 weights as FP32 (apex's convention), which would save the FP32 weights
    twice (they are the masters) where distamp's checkpoint saves the bf16 ones."""
    masters = opt._distamp.masters
    rank, world = dist.get_rank(), dist.get_world_size()
    tensors = {"master": list(masters.shards)}
    for key in ("exp_avg", "exp_avg_sq"):
        tensors[key] = [torch.cat([opt.state[c][key] for c in chunks]) for chunks in masters.chunks]
    full: dict[str, list[torch.Tensor]] = {}
    for key, shards in tensors.items():
        full[key] = []
        for shard in shards:
            out = [torch.empty_like(shard) for _ in range(world)] if rank == 0 else None
            dist.gather(shard, out, dst=0)
            if rank == 0:
                full[key].append(torch.cat(out))
    if rank == 0:
        weights = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
        state = {"model": weights, "optimizer": full}
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


def baseline_load(path: Path, opt: torch.optim.Optimizer) -> None:
    masters = opt._distamp.masters
    rank = dist.get_rank()
    state = torch.load(path, weights_only=True) if rank == 0 else None
    for g, layout in enumerate(masters.groups):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            full = state["optimizer"][key][g] if rank == 0 else torch.empty(layout.padded)
            dist.broadcast(full, src=0)
            # rank-major, as baseline_save gathered it (not the flat parameter order)
            mine = full[rank * layout.shard_size : (rank + 1) * layout.shard_size]
            if key == "master":
                masters.shards[g].copy_(mine)
    masters.copy_to_model()


def worker(rank: int, world: int, init: str, root: str, params_m: float, repeats: int, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = build(params_m)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Sharded at every world size, one rank included (O2 replicates its masters there): the
    # baseline gathers shards, and the comparison is of sharded checkpoints.
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0, shard_master_weights=True)
    one_step(model, opt)
    base = Path(root)
    results: dict[str, list[float]] = {k: [] for k in ("ds", "dl", "bs", "bl")}
    for i in range(repeats):
        directory = base / f"distamp-{i}"
        results["ds"].append(timed(lambda d=directory: distamp.save_checkpoint(d, model, opt)))
        results["dl"].append(timed(lambda d=directory: distamp.load_checkpoint(d, model, opt)))
        path = base / f"baseline-{i}.pt"
        results["bs"].append(timed(lambda p=path: baseline_save(p, model, opt)))
        results["bl"].append(timed(lambda p=path: baseline_load(p, opt)))
    dist.barrier()
    if rank == 0:
        ckpt = base / "distamp-0"
        per_rank = [
            sum(
                f.stat().st_size
                for f in ckpt.iterdir()
                if f.name in (f"__{r}_0.distcp", f"rng-{r}.pt")
            )
            for r in range(world)
        ]
        shared = sum(
            f.stat().st_size
            for f in ckpt.iterdir()
            if f.name in (".metadata", "distamp.pt", "COMMIT")
        )
        per_rank[0] += shared
        summary = {
            "world": world,
            "params": n_params,
            "repeats": repeats,
            "distamp": {
                "save_s": statistics.median(results["ds"]),
                "load_s": statistics.median(results["dl"]),
                "bytes_per_rank": per_rank,
            },
            "baseline": {
                "save_s": statistics.median(results["bs"]),
                "load_s": statistics.median(results["bl"]),
                "bytes_per_rank": [(base / "baseline-0.pt").stat().st_size] + [0] * (world - 1),
            },
        }
        Path(out).write_text(json.dumps(summary, indent=2))
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--params", type=float, default=20.0, help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="write into a new folder inside DIR, removed at the end (default: a temp dir)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distamp-bench-") as tmp:
        if args.dir is None:
            root = Path(tmp) / "ckpt"
            root.mkdir()
        else:  # a folder of its own inside the user's: the user's files are never touched
            args.dir.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(dir=args.dir, prefix="distamp-bench-"))
        out, rdzv = os.path.join(tmp, "summary.json"), os.path.join(tmp, "rdzv")
        try:
            mp.spawn(
                worker,
                args=(args.world, rdzv, str(root), args.params, args.repeats, out),
                nprocs=args.world,
            )
        finally:
            if args.dir is not None:
                shutil.rmtree(root)
        summary = json.loads(Path(out).read_text())
    mb = 1e6
    d, b = summary["distamp"], summary["baseline"]
    print(
        f"\n{summary['params'] / 1e6:.1f}M params, O2 (bf16 weights, FP32 masters + AdamW state "
        f"sharded), world {summary['world']}, gloo, medians of {summary['repeats']}\n"
    )
    print("| method | save s | load s | MB written per rank | MB in all |")
    print("|---|---|---|---|---|")
    for name, r in (("distamp save/load_checkpoint", d), ("torch.save on rank 0 (gathered)", b)):
        per = " / ".join(f"{x / mb:.1f}" for x in r["bytes_per_rank"])
        print(
            f"| {name} | {r['save_s']:.3f} | {r['load_s']:.3f} | {per} | "
            f"{sum(r['bytes_per_rank']) / mb:.1f} |"
        )
    print(
        f"\ndistamp vs baseline: save {d['save_s'] / b['save_s']:.2f}x the time, load "
        f"{d['load_s'] / b['load_s']:.2f}x, largest file per rank "
        f"{max(d['bytes_per_rank']) / max(b['bytes_per_rank']):.2f}x"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
