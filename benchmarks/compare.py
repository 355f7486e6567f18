"""distamp against its peers on one model, side by side: one command, one table.

    python benchmarks/compare.py                   # W1: GPT bench (16M), batch 8x128/rank, 2 ranks
    python benchmarks/compare.py --workload w2     # W2: batch 1x128/rank (communication-bound)
    python benchmarks/compare.py --workload w0     # W0: host-bound (64 tiny parameters)
    python benchmarks/compare.py --quick           # tiny sizes, a smoke run (under 3 minutes)
    python benchmarks/compare.py --plot            # also a PNG bar chart (needs matplotlib)
    python benchmarks/compare.py --workload w2 --nodes 2 --link 1gbit   # an emulated cluster
    python benchmarks/compare.py --workload w2 --nodes 2 --phases      # + where each step goes

Precision by capability: every configuration computes in the precision that is fastest here —
bf16 where the CPU has bf16 units (or on a GPU), FP32 otherwise (bf16 matmul then runs at ~1/100
of FP32's speed); a 16-bit wire is used everywhere. The table's header says which, with the
matmul GFLOP/s measured in the same run. ``--nodes N --link RATE`` runs each rank group in its own
network namespace ("node", benchmarks/cluster.py) behind a link shaped with tc to RATE in both
directions, one torchrun agent per node (static rendezvous on node 0, env:// variables, gloo on
that link): what gradient traffic costs between machines, which loopback hides.

Every configuration trains examples/train_gpt.py's GPT on the same data for the same steps, on
``--world`` ranks (gloo on CPU, NCCL on GPUs), each in its own spawned world so its peak RSS is its
own; rounds alternate the order of the configurations so machine drift favours none. The table:
median step time and its spread, speed-up over FP32 DDP, tokens/s, achieved FLOP/s (6 x params x
tokens) as a fraction of the compute dtype's matmul peak measured in the same run (on the CPU at
the ranks' ``--threads``), peak RSS and optimizer state (+ FP32 masters beside 16-bit weights) per
rank, the gradients' volume at the wire dtype ("grad MB on wire/step":
parameters x bytes of the dtype the row reduces in; not the bytes each rank sends, which depend on
the collective: a ring all-reduce sends 2 (N-1)/N of it, ``--phases`` measures what was sent),
first and final loss. The floor is ``max(compute floor, wire floor)``: the compute floor is the
"floor" row (each rank, no communication, forward+backward and the optimizer over 1/N of the
parameters' elements, :func:`split_by_size`), the wire floor the bytes of a 16-bit ring
all-reduce of the gradients over the link rate (emulated cluster only). On the emulated cluster two more rows measure what gloo and the link make of that
floor: the bytes a 16-bit step moves, moved alone (no compute, no optimizer) — one all-reduce per
DDP bucket, or distamp's all-to-all per bucket and all-gather per block. ``--phases`` adds a
second table: each step of rank 0 split into forward, backward, step and the rest, and how busy
the link is in each (benchmarks/phases.py). A row that raises reports its exception (not retried:
it would raise again); a world that crashes or hangs past ``--timeout`` is run once more; rounds
that failed are left out of the row and counted in its note. Results go to ``--out-dir`` as JSON
and Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_gpt import GPT, SIZES, GPTConfig, RandomWindows, load_stdlib_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import cluster, kill_inside, rate_bits_per_s
from phases import Phases
from phases import markdown as phases_markdown

import distamp
import distamp.fsdp
import distamp.masters.layout
from distamp.collectives import all_gather_single
from distamp.doctor import compare_matmuls, fastest_compute

BF16_CONFIGS = [
    "FP32 DDP",
    "torch.autocast + DDP",
    "torch.autocast + DDP + torch fp16_compress_hook",
    "torch.autocast + ZeroRedundancyOptimizer + torch fp16_compress_hook",
    "FSDP2 MixedPrecisionPolicy",
    "DeepSpeed ZeRO-1 bf16",
    "distamp O1 + hook",
    "distamp O2 replicated + hook",
    "distamp O2 sharded + reduce-scatter hook",
    "distamp O2 sharded + reduce-scatter hook + overlapped gather",
    "distamp O2 FSDP2 (distamp.fsdp.fully_shard)",
    "floor: pure bf16, no communication",
    "floor: autocast bf16, no communication",
]
"""Where bf16 compute is fast (bf16 units, GPUs)."""
FP32_CONFIGS = [
    "FP32 DDP",
    "DDP + torch fp16_compress_hook",
    "ZeroRedundancyOptimizer + torch fp16_compress_hook",
    "FSDP2 MixedPrecisionPolicy (FP32 params, bf16 reduce)",
    "DeepSpeed ZeRO-1 bf16 communication",
    "distamp O0 + hook",
    "distamp O0 sharded + reduce-scatter hook + overlapped gather",
    "distamp O0 sharded + reduce-scatter hook + overlapped bf16-update gather",
    "floor: FP32, no communication",
]
"""Where only FP32 compute is fast: mixed precision can still shrink the wire and the state."""
WIRE_CONFIGS = [
    "wire alone: 16-bit all-reduce per bucket",
    "wire alone: 16-bit reduce-scatter per bucket + all-gather per block",
]
"""On the emulated cluster: the gradient bytes of a 16-bit row moved by gloo with nothing else
running, as DDP's hooks move them or as distamp's sharded path does (see :func:`wire_alone`)."""
CONFIGS = list(dict.fromkeys(BF16_CONFIGS + FP32_CONFIGS + WIRE_CONFIGS))
RENAMED = {
    "ZeroRedundancyOptimizer": "ZeroRedundancyOptimizer + torch fp16_compress_hook",
    "torch.autocast + ZeroRedundancyOptimizer": (
        "torch.autocast + ZeroRedundancyOptimizer + torch fp16_compress_hook"
    ),
}
"""Rows renamed (an audit: ZeRO was the only peer on an FP32 wire), for ``--only``'s refusal."""

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _held(opt: Any, fsdp_masters: bool = False) -> int:
    """Bytes of optimizer state (and FP32 masters) this rank holds. ``fsdp_masters``: FSDP2's
    sharded FP32 parameters are masters, an FP32 copy beside the 16-bit weights it computes with
    (its MixedPrecisionPolicy has a param_dtype); without one they are the model's weights, not
    counted, as the DDP and ZeRO rows' FP32 weights are not (an audit: they were counted)."""
    if opt is None:  # a "wire alone" row
        return 0
    if isinstance(opt, distamp.masters.optimizer.AmpOptimizer):
        s = distamp.stats(opt)
        return s.master_bytes + s.optimizer_state_bytes
    # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim, DeepSpeed in .optimizer
    # (whose params are DeepSpeed's flat FP32 partitions: its masters).
    inner = getattr(opt, "optim", None) or getattr(opt, "optimizer", None) or opt
    total = 0
    if inner is not opt and hasattr(opt, "optimizer"):
        for group in inner.param_groups:
            total += sum(p.numel() * p.element_size() for p in group["params"])
    # FSDP2's sharded FP32 parameters, where it computes with 16-bit copies of them.
    for group in inner.param_groups if inner is opt and fsdp_masters else ():
        for p in group["params"]:
            if hasattr(p, "to_local") and p.dtype == torch.float32:
                local = p.to_local()
                total += local.numel() * local.element_size()
    for per in inner.state.values():
        for v in per.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def setup(
    config: str, model: nn.Module, opts: dict[str, Any], device: torch.device, world: int, rank: int
):
    """(step function, optimizer, bytes per gradient element at the wire dtype: 4 FP32, 2 a 16-bit
    reduction, 0 none, whether the optimizer's FSDP2 parameters are FP32 masters: see
    :func:`_held`). Every row builds the same AdamW (``--adamw``: torch's default implementation,
    foreach or fused) and every DDP row (and DeepSpeed) the same buckets (``--bucket-mb``)."""
    lr = opts["lr"]
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[opts["adamw"]]
    adamw = functools.partial(torch.optim.AdamW, lr=lr, **impl)
    # Every DDP row: the .grad are views into the buckets (no copy into them and back per step).
    ddp_of = functools.partial(DDP, bucket_cap_mb=opts["bucket_mb"], gradient_as_bucket_view=True)
    dtype = torch.bfloat16
    autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731

    def plain_step(
        train: nn.Module, opt: torch.optim.Optimizer, cast: bool, every_grad: bool = False
    ) -> Step:
        """``every_grad``: clear the gradients of every parameter of ``train``, not only those of
        ``opt`` (the floor's, which steps 1/N of them: an audit found the rest accumulating)."""

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if cast:
                with autocast():
                    logits = train(x)
            else:
                logits = train(x)
            loss = _loss(logits, y)
            loss.backward()
            opt.step()
            if every_grad:
                train.zero_grad(set_to_none=True)
            else:
                opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    def distamp_step(train: nn.Module, opt: torch.optim.Optimizer) -> Step:
        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = _loss(train(x), y)
            with distamp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    # The torch peers, in FP32 compute or under torch.autocast (the same setup either way).
    cast = config.startswith("torch.autocast + ")
    base = config.removeprefix("torch.autocast + ")
    if base in ("FP32 DDP", "DDP"):
        opt = adamw(model.parameters())
        return plain_step(ddp_of(model), opt, cast), opt, 4, False
    if base == "DDP + torch fp16_compress_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = ddp_of(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = adamw(model.parameters())
        return plain_step(ddp, opt, cast), opt, 2, False
    if base == "ZeroRedundancyOptimizer + torch fp16_compress_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # The 16-bit wire every other peer uses (an audit: ZeRO's all-reduce was FP32), the same
        # hook as the DDP + fp16_compress_hook row.
        ddp = ddp_of(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr, **impl
        )
        return plain_step(ddp, opt, cast), opt, 2, False
    if base.startswith("FSDP2 MixedPrecisionPolicy"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 compute: bf16 parameters in forward/backward, FP32 outputs; else FP32 parameters.
        param_dtype = None if "FP32 params" in base else dtype
        inner = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=inner)
        root = MixedPrecisionPolicy(param_dtype, dtype, torch.float32 if param_dtype else None)
        fully_shard(model, mp_policy=root)
        opt = adamw(model.parameters())
        # With a param_dtype its FP32 shards are masters beside the bf16 compute weights.
        return plain_step(model, opt, False), opt, 2, param_dtype is not None
    if config.startswith("DeepSpeed"):
        import deepspeed  # an optional extra: '.[bench]'

        # DeepSpeed reads the launcher's variables, which spawned (not torchrun) ranks lack.
        for key, value in (("LOCAL_RANK", rank), ("RANK", rank), ("WORLD_SIZE", world)):
            os.environ.setdefault(key, str(value))

        opt = adamw(model.parameters())
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=deepspeed_config(config, opts)
        )

        def ds_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = _loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return ds_step, opt, 2, False
    if config.startswith("distamp O2 FSDP2"):
        # distamp's ZeRO-3: FSDP2 with the opt_level as its policy (the transformer blocks and
        # each FP32 norm layer its own unit), distamp's scaler and global skip.
        opt = adamw(model.parameters())
        model, opt = distamp.fsdp.fully_shard(
            model, opt, opt_level="O2", half_dtype=dtype, verbosity=0
        )
        return distamp_step(model, opt), opt, 2, False
    if config.startswith("distamp"):
        level = config.split()[1]  # "distamp O2 sharded + reduce-scatter hook" -> "O2"
        opt = adamw(model.parameters())
        # O2 shards by default across ranks; O0/O1 shard their FP32 weights when asked for.
        sharded = "sharded" in config
        kwargs = {"shard_master_weights": sharded} if level == "O2" or sharded else {}
        model, opt = distamp.wrap(
            model, opt, opt_level=level, half_dtype=dtype, verbosity=0, **kwargs
        )
        ddp = ddp_of(model)
        distamp.hooks.register(
            ddp,
            opt,
            reduce_scatter="reduce-scatter" in config,
            overlap_gather="overlapped" in config,
            gather_dtype=dtype if "bf16-update gather" in config else None,
        )
        return distamp_step(ddp, opt), opt, 2, False
    if config.startswith("wire alone"):
        n_params = sum(p.numel() for p in model.parameters())
        # DDP sizes its buckets in the gradients' dtype: FP32 where the compute is (O0, autocast
        # rows), bf16 under O2 (an audit: bf16-sized buckets mirrored the FP32 rows with half as
        # many messages, twice as large)
        grad_bytes = 2 if opts["compute"] == "bf16" else 4
        step = wire_alone(config, n_params, opts["bucket_mb"] * 2 / grad_bytes, device, world)
        return step, None, 2, False
    if config.startswith("floor"):
        if "pure" in config:
            model.to(dtype)
        opt = adamw(split_by_size(list(model.parameters()), world)[rank])
        # Every gradient is cleared each step, not only the 1/N this rank steps.
        return plain_step(model, opt, "autocast" in config, every_grad=True), opt, 0, False
    raise ValueError(f"unknown configuration {config!r}")


def deepspeed_config(config: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed rows' configuration: ZeRO stage 1 on gloo, bf16 weights and compute where
    bf16 is fast ("ZeRO-1 bf16"), else FP32 compute with its 16-bit communication option
    (communication_data_type). Its buckets are the DDP rows' (an audit: DeepSpeed's default,
    5e8 elements, put every gradient in one bucket): ``--bucket-mb`` of the gradients in their
    dtype, as DDP's bucket_cap_mb counts them (bf16 under "ZeRO-1 bf16", else FP32; the
    bucket holds the gradients before communication_data_type casts them for the wire), so each
    bucket holds as many gradients as a DDP row's and sends as many bytes as a DDP row with a
    16-bit hook. The same size for the all-gather of the updated partitions; the reduction
    overlaps the backward (overlap_comm), as DDP's does."""
    bf16 = config == "DeepSpeed ZeRO-1 bf16"
    bucket = int(opts["bucket_mb"] * 2**20) // (2 if bf16 else 4)  # elements
    return {
        "train_micro_batch_size_per_gpu": opts["batch"],
        "zero_optimization": {
            "stage": 1,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": True,
        },
        "communication_data_type": "bf16",
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31,
    }


def split_by_size(params: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """``params`` dealt to ``world`` ranks so that each rank steps ~1/N of the elements (the floor
    rows' optimizer "over 1/N of the parameters"): largest first, each onto the rank holding the
    fewest elements so far (ties: the lowest rank), so every rank computes the same split. A
    strided split (``params[rank::world]``) is not one: weights and biases alternate in a model's
    parameters, so at 2 ranks rank 0 stepped every weight, ~99% of the elements."""
    shares: list[list[torch.Tensor]] = [[] for _ in range(world)]
    sizes = [0] * world
    for p in sorted(params, key=lambda p: -p.numel()):  # stable: equal sizes keep their order
        rank = sizes.index(min(sizes))
        shares[rank].append(p)
        sizes[rank] += p.numel()
    return shares


def wire_alone(
    config: str, n_params: int, bucket_mb: float, device: torch.device, world: int
) -> Step:
    """A step that moves what a 16-bit data-parallel step of ``n_params`` gradients moves, and
    nothing else: bf16 buckets of ``bucket_mb`` (of bf16: the caller converts DDP's bucket size
    in the gradients' dtype) all in flight at once, each all-reduced (DDP with
    a 16-bit hook) or all-to-all'ed so that every rank receives its 1/N (distamp's reduce-scatter
    hook), then, for the latter, the all-gather of the updated weights in blocks of
    ``distamp.masters.layout.BLOCK`` elements per rank. Returns a zero "loss"."""
    bucket = max(world, int(bucket_mb * 2**20) // 2 // world * world)  # bf16 elements
    shard = -(-n_params // world)
    grads = torch.zeros(shard * world, dtype=torch.bfloat16, device=device)
    received = torch.empty_like(grads)
    weights = torch.empty_like(grads)
    block = distamp.masters.layout.BLOCK
    scatter = "reduce-scatter" in config

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        works = []
        for at in range(0, grads.numel(), bucket):
            piece = slice(at, min(at + bucket, grads.numel()))
            if scatter:
                works.append(dist.all_to_all_single(received[piece], grads[piece], async_op=True))
            else:
                works.append(dist.all_reduce(grads[piece], async_op=True))
        for work in works:
            work.wait()
        if scatter:
            works = [
                all_gather_single(
                    weights[at * world : (at + n) * world], grads[at : at + n], None, async_op=True
                )
                for at, n in ((a, min(block, shard - a)) for a in range(0, shard, block))
            ]
            for work in works:
                work.wait()
        return torch.zeros(())

    return step


def train(
    step: Step,
    opt: Any,
    model: nn.Module,
    config: str,
    opts: dict[str, Any],
    device: torch.device,
    rank: int,
    fsdp_masters: bool = False,
) -> dict[str, Any]:
    """Collective over the world: one row's warm-up and timed steps on this rank; its times,
    losses, peak RSS, the state it holds and, with ``--phases``, its phases."""
    result: dict[str, Any] = {}
    data = RandomWindows(load_stdlib_bytes(int(opts["data_mb"] * 2**20)), opts["seq"], rank)
    times, losses = [], []
    phases = None
    if opts.get("phases") and opt is not None:
        phases = Phases(model, opt, os.environ.get("GLOO_SOCKET_IFNAME"))
    # [Note: steps timed back to back] One barrier before the timed steps, none between them:
    # a step's time runs from the end of the previous one to its own end (its batch included),
    # so work a configuration defers past step() (an all-gather still in flight, waited for
    # in the next forward) is counted in the step that waits for it. A barrier per step would
    # wait for that work outside the timed window.
    profiler = None
    if opts.get("profile") and rank == 0:  # torch.profiler over rank 0's timed steps
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    start = time.perf_counter()
    for i in range(opts["warmup"] + opts["steps"]):
        if i == opts["warmup"]:
            dist.barrier()
            if profiler is not None:
                profiler.start()
            start = time.perf_counter()
        timed = i >= opts["warmup"]
        if phases is not None and timed:
            phases.begin()
        x, y = data.batch(opts["batch"], device, i)
        loss = step(x, y)
        losses.append(float(loss))
        if device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if phases is not None and timed:
            phases.end()
        if timed:
            times.append(end - start)
        start = end
    if phases is not None:
        dist.barrier()  # after the last step's deferred gather, as the warm-up's before the first
        phases.flushed()
        phases.stop()
        result["phases"] = phases.summary(opts.get("link_bits"))
    if profiler is not None:
        profiler.stop()
        write_profile(profiler, Path(opts["profile"]), config, opts["steps"])
    return result | {
        "times": times,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "peak_rss": peak_rss(),
        "held_bytes": _held(opt, fsdp_masters),
    }


def peak_rss() -> int:
    """This process's own peak resident memory in bytes: ``VmHWM``, not ``getrusage``'s
    ``ru_maxrss``, which a spawned rank inherits from the launcher's peak across fork+exec (an
    audit: a rank of 342 MB read 1150 with a 1.1 GB parent)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: the bound


def worker(
    rank: int, world: int, rdzv: str | None, config: str, opts: dict[str, Any], out: str
) -> None:
    """One rank of one configuration; ``rdzv``: a file:// rendezvous, or None for torchrun's
    env:// variables (the emulated cluster)."""
    use_cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(opts["threads"])
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method="env://" if rdzv is None else f"file://{rdzv}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=opts["timeout"]),
    )
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=opts["seq"], **SIZES[opts["size"]])).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {"config": config, "params": n_params}
    try:
        step, opt, wire, fsdp_masters = setup(config, model, opts, device, world, rank)
        result |= train(step, opt, model, config, opts, device, rank, fsdp_masters)
        result["wire_bytes"] = wire * n_params
    except ImportError as exc:
        result["skipped"] = f"{type(exc).__name__}: {exc} (pip install -e '.[bench]')"
    except NotImplementedError as exc:
        result["skipped"] = str(exc)
    except Exception as exc:
        # [Note: a row's exception is its result] Reported in the gathered results, the row says
        # why it failed (a crashed world says only its exit codes), and it is not run again: an
        # exception raised on every rank would be raised again. One raised on some ranks only
        # leaves the others waiting in a collective: the world hangs and is retried as a hang.
        traceback.print_exc()
        message = str(exc).strip().splitlines()
        result["error"] = type(exc).__name__ + (f": {message[0]}" if message else "")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()
    # [Note: exit without destructors] Freeing DDP's reducer drops the last reference to the gloo
    # process group, whose destructor joins gloo's worker threads while holding the GIL; a worker
    # still destroying a finished collective that owns a Python tensor waits for the GIL: the
    # process never exits (seen about once in ten worlds, py-spy: ~ProcessGroupGloo joining,
    # ~AsyncAllgatherWork in gil_scoped_acquire). The results are written: leave without them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_profile(profiler: Any, directory: Path, config: str, steps: int) -> None:
    """``--profile``: rank 0's trace of the timed steps (chrome://tracing, Perfetto) and its ops
    by self CPU time per step, distamp's waits for the wire included (the last round's stay)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / re.sub(r"[^A-Za-z0-9]+", "_", config).strip("_")
    profiler.export_chrome_trace(f"{stem}.trace.json")
    events = profiler.key_averages()
    lines = [f"{config}: rank 0, {steps} timed steps; ms per step, by self CPU time", ""]
    lines.append(f"{'op':<64} {'self ms':>9} {'total ms':>9} {'calls':>7}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:40]:
        lines.append(
            f"{e.key[:64]:<64} {e.self_cpu_time_total / 1e3 / steps:>9.2f} "
            f"{e.cpu_time_total / 1e3 / steps:>9.2f} {e.count / steps:>7.1f}"
        )
    waits = [e for e in events if e.key.startswith("distamp: wait")]
    lines += ["", "distamp's waits for the wire (ms per step):"]
    lines += [f"  {e.key}: {e.cpu_time_total / 1e3 / steps:.1f}" for e in waits] or ["  none"]
    Path(f"{stem}.txt").write_text("\n".join(lines) + "\n")


def run_world(fn: Any, world: int, config: str, opts: dict[str, Any], prefix: str) -> Any:
    """Spawn ``world`` ranks of ``fn`` and return rank 0's gathered results. A world that crashes
    or hangs past the deadline (seen rarely with gloo between spawns) is killed and run again
    once; a second failure becomes a failed round instead of stopping the comparison (an exception
    the ranks report is a result, not a failure: see [Note: a row's exception is its result])."""
    ctx = mp.get_context("spawn")
    error = ""
    for attempt in range(2):
        out, rdzv = f"{prefix}-{attempt}.json", f"{prefix}-{attempt}.rdzv"
        procs = [
            ctx.Process(target=fn, args=(r, world, rdzv, config, opts, out)) for r in range(world)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + opts["timeout"]
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            hung = [p for p in procs if p.is_alive()]
        finally:  # also when the comparison itself is stopped (SIGINT, SIGTERM)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if not hung and all(p.exitcode == 0 for p in procs) and os.path.exists(out):
            return json.loads(Path(out).read_text())
        if hung:
            error = f"hung past {opts['timeout']:.0f} s (--timeout)"
        else:
            error = f"exit codes {[p.exitcode for p in procs]}"
        print(f"{config}: attempt {attempt + 1} failed ({error})", flush=True)
    return [{"config": config, "error": f"failed twice ({error})"}]


def run_cluster(nodes: list[Any], world: int, config: str, opts: dict[str, Any], prefix: str):
    """``world`` ranks of one configuration over the emulated cluster's ``nodes``: a torchrun
    agent per node (static rendezvous on node 0), gloo on the node's shaped link. Rank 0's
    gathered results; a crash or hang is retried once, then becomes a failed round. A failed or
    hung attempt is killed whole: see [Note: stopping an agent and its ranks]."""
    per_node = world // len(nodes)
    opts_file = f"{prefix}.opts.json"
    Path(opts_file).write_text(json.dumps(opts))
    error = ""
    for attempt in range(2):
        out = f"{prefix}-{attempt}.json"
        port = str(29400 + (os.getpid() + attempt) % 500)
        cmds: list[tuple[list[str], dict[str, str], str]] = []
        agents: list[subprocess.Popen[bytes]] = []
        logs: list[Any] = []
        for i, node in enumerate(nodes):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.iface, "OMP_NUM_THREADS": "1"}
            cmd = [
                *node.enter,
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(nodes)}",
                f"--node_rank={i}",
                f"--nproc_per_node={per_node}",
                f"--master_addr={nodes[0].addr}",
                f"--master_port={port}",
                str(Path(__file__).resolve()),
                "--worker",
                config,
                "--opts-file",
                opts_file,
                "--result",
                out,
            ]
            cmds.append((cmd, env, f"{prefix}-{attempt}-node{i}.log"))
        hung, clean = False, False
        try:
            for cmd, env, path in cmds:
                log = open(path, "w")
                logs.append(log)
                # [Note: stopping an agent and its ranks] Each agent leads a session of its own,
                # so its process group can be killed whole; torchrun starts every rank in a
                # session of its own too, so the ranks are then killed by their node (every
                # process in its network namespace). Killing the agent alone orphaned its ranks
                # beside the next attempt and the next rows.
                agent = subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=log, start_new_session=True
                )
                agents.append(agent)
            deadline = time.monotonic() + opts["timeout"]
            for agent in agents:
                try:
                    agent.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    hung = True
                    break
            clean = not hung and all(a.returncode == 0 for a in agents)
        finally:  # also when the comparison itself is stopped (SIGINT, SIGTERM)
            if not clean:
                for agent in agents:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
                for node in nodes:
                    kill_inside(node)
            for log in logs:
                log.close()
        if clean and os.path.exists(out):
            return json.loads(Path(out).read_text())
        if hung:
            error = f"hung past {opts['timeout']:.0f} s (--timeout)"
        else:
            said = [s for s in Path(cmds[0][2]).read_text().splitlines() if s.strip(" =")]
            error = f"exit codes {[a.returncode for a in agents]}"
            error += f": {said[-1].strip()[-200:]}" if said else ""
        print(f"{config}: attempt {attempt + 1} failed ({error})", flush=True)
    return [{"config": config, "error": f"failed twice ({error})"}]


def why_failed(run: list[dict[str, Any]]) -> str | None:
    """Why one round of a row has no times, or None: it has them. A rank's exception names the
    rank (it may be one rank's only); a skip (an optional extra missing) is every rank's."""
    for rank, r in enumerate(run):
        if "times" in r:
            continue
        if "skipped" in r:
            return r["skipped"]
        return f"{r['error']} (rank {rank})" if len(run) > 1 else r["error"]
    return None


def summarize(config: str, rounds: list[list[dict[str, Any]]], opts: dict[str, Any], peak: float):
    """A configuration's row from the rounds that ran: a round that failed (in any round, on any
    rank) is left out and counted in the row's ``note``; the row is skipped, with the reasons,
    only when every round failed."""
    done = [run for run in rounds if why_failed(run) is None]
    reasons = list(dict.fromkeys(r for r in map(why_failed, rounds) if r is not None))
    if not done:
        return {"config": config, "skipped": "; ".join(reasons)}
    first = done[0][0]
    times = [t for run in done for t in run[0]["times"]]
    median = statistics.median(times)
    tokens = opts["batch"] * opts["seq"] * opts["world"]
    flops_per_rank = 6 * first["params"] * opts["batch"] * opts["seq"]
    note: dict[str, str] = {}
    if len(done) < len(rounds):
        failed = len(rounds) - len(done)
        note["note"] = f"{failed} of {len(rounds)} rounds failed: {'; '.join(reasons)}"
    return {
        "config": config,
        "median_s": median,
        "spread_s": statistics.pstdev(times) if len(times) > 1 else 0.0,
        "tokens_per_s": tokens / median,
        "peak_fraction": flops_per_rank / median / 1e9 / peak,
        "peak_rss_mb": max(r["peak_rss"] for run in done for r in run) / 1e6,
        "held_mb": max(r["held_bytes"] for run in done for r in run) / 1e6,
        "wire_mb": first["wire_bytes"] / 1e6,
        "first_loss": statistics.fmean(r["first_loss"] for r in done[-1]),
        "final_loss": statistics.fmean(r["final_loss"] for r in done[-1]),
        **({"phases": done[-1][0]["phases"]} if "phases" in done[-1][0] else {}),
        **note,
    }


def floors(
    rows: list[dict[str, Any]], params: int, nodes: int, link_bits: float | None
) -> dict[str, Any]:
    """The compute floor (the fastest "floor" row; None without one), the wire floor (a 16-bit
    ring all-reduce of the gradients between ``nodes`` over the link: 2 (N-1)/N x 2 bytes x
    params; 0 on loopback) and their max (0: neither)."""
    compute = min(
        (r["median_s"] for r in rows if r["config"].startswith("floor") and "median_s" in r),
        default=None,
    )
    wire = 0.0
    if link_bits and nodes > 1:
        wire = 2 * (nodes - 1) / nodes * 2 * params * 8 / link_bits
    return {"compute_s": compute, "wire_s": wire, "floor_s": max(compute or 0.0, wire)}


def markdown(rows: list[dict[str, Any]], header: str, floor: dict[str, Any]) -> str:
    """The table, with the floor above it and each row's note (rounds that failed) below it."""
    base = next(
        (r["median_s"] for r in rows if r["config"] == "FP32 DDP" and "median_s" in r), None
    )
    if floor["compute_s"] is None:
        wire = f"; wire floor {floor['wire_s']:.3f} s" if floor["wire_s"] else ""
        said = f"Floor: no floor row (the compute floor was not measured){wire}."
    else:
        said = (
            f"Floor: {floor['floor_s']:.3f} s = max(compute floor {floor['compute_s']:.3f} s, "
            f"wire floor {floor['wire_s']:.3f} s)."
        )
    lines = [
        header,
        "",
        said,
        "",
        "| configuration | median step s | spread s | vs FP32 DDP | vs floor | tokens/s | of peak | "
        "peak RSS/rank MB | opt state+masters/rank MB | grad MB on wire/step | loss first -> final |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['config']} | skipped: {r['skipped']} ||||||||||")
            continue
        alone = r["config"].startswith("wire alone")  # no tokens, no loss, no speed-up
        speed = f"{base / r['median_s']:.2f}x" if base and not alone else "-"
        to_floor = f"{r['median_s'] / floor['floor_s']:.2f}x" if floor["floor_s"] else "-"
        loss = "-" if alone else f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}"
        rate = "- | -" if alone else f"{r['tokens_per_s']:.0f} | {r['peak_fraction']:.1%}"
        lines.append(
            f"| {r['config']} | {r['median_s']:.3f} | {r['spread_s']:.3f} | {speed} | {to_floor} | "
            f"{rate} | {r['peak_rss_mb']:.0f} | "
            f"{r['held_mb']:.1f} | {r['wire_mb']:.1f} | {loss} |"
        )
    lines += [
        "",
        '"grad MB on wire/step": the gradients at the wire dtype (parameters x its bytes), not '
        "the bytes each rank sends.",
    ]
    notes = [f"- {r['config']}: {r['note']}" for r in rows if "note" in r]
    if notes:
        lines += ["", "Rounds left out:", "", *notes]
    return "\n".join(lines) + "\n"


def choose_compute(choice: str, seconds: float, threads: int = 1) -> tuple[str, str, float]:
    """("bf16" or "fp32", why, that dtype's matmul GFLOP/s per rank measured now, on the CPU at
    ``threads`` threads: the ranks' ``--threads``, so that "of peak" is against the rate a rank
    can reach; an audit: a one-thread peak under ranks of several threads). ``auto`` is the
    doctor's rule (:func:`distamp.doctor.fastest_compute` over interleaved turns): a half dtype
    only where it beats FP32. A choice given is honoured on a GPU too (an audit: every --compute
    ran bf16 there)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flops = compare_matmuls((torch.float32, torch.bfloat16), seconds, device, threads=threads)
    fp32, bf16 = flops["float32"], flops["bfloat16"]
    where = "the GPU" if device == "cuda" else f"this CPU at {threads} thread(s)"
    measured = f"bf16 matmul {bf16:.1f} GFLOP/s vs FP32 {fp32:.1f} on {where}"
    if choice == "auto":
        choice = "bf16" if fastest_compute(flops) == "bfloat16" else "fp32"
        why = (
            "bf16 is the fastest: bf16 compute"
            if choice == "bf16"
            else (
                "no faster half matmul: FP32 compute is fastest, mixed precision keeps a 16-bit "
                "wire and sharded state"
            )
        )
    else:
        why = "chosen with --compute"
    return choice, f"{measured} ({why})", bf16 if choice == "bf16" else fp32


def plot(rows: list[dict[str, Any]], path: Path, floor: dict[str, Any]) -> str:
    """A bar per row that ran; the rows that did not are named under the bars and in the line
    returned (a chart without them would read as a comparison they lost no part in)."""
    left_out = [r["config"] for r in rows if "median_s" not in r]
    missing = f"; not plotted (failed or skipped): {', '.join(left_out)}" if left_out else ""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install -e '.[bench]'){missing}"
    done = [r for r in rows if "median_s" in r]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(done) + 1))
    ax.barh(
        [r["config"] for r in done],
        [r["median_s"] for r in done],
        xerr=[  # not below 0 s (the spread is a deviation around the median)
            [min(r["spread_s"], r["median_s"]) for r in done],
            [r["spread_s"] for r in done],
        ],
    )
    ax.invert_yaxis()
    if floor["floor_s"]:
        ax.axvline(floor["floor_s"], color="tab:red", linestyle="--")
        ax.text(floor["floor_s"], -0.6, f" floor {floor['floor_s']:.3f} s", color="tab:red")
    xlabel = "median step time (s), lower is better"
    if left_out:
        xlabel += "\n" + textwrap.fill(
            f"not plotted (failed or skipped): {', '.join(left_out)}", 110
        )
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}{missing}"


DEFAULTS: dict[str, Any] = {
    "size": "bench",
    "seq": 128,
    "steps": 8,
    "warmup": 2,
    "rounds": 2,
    "lr": 1e-3,
}
"""What a flag left out means (its help's "default:") where neither the workload nor ``--quick``
sets it; the batch is the workload's."""
WORKLOADS: dict[str, dict[str, Any]] = {
    "w0": {"size": "micro", "seq": 16, "batch": 1},  # compute next to nothing: the host work left
    "w1": {"batch": 8},
    "w2": {"batch": 1},
}
"""What each ``--workload`` sets, for the flags not given."""
QUICK: dict[str, Any] = {
    "size": "tiny",
    "seq": 32,
    "batch": 2,
    "steps": 3,
    "warmup": 1,
    "rounds": 1,
    "lr": 3e-3,
}
"""What ``--quick`` sets (over the workload's), for the flags not given: a flag given always
wins."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with every flag left out filled from ``--quick``, the workload or the
    defaults (in that order), and checked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload",
        choices=["w0", "w1", "w2"],
        default="w1",
        help="w1: batch 8 per rank (compute-bound); w2: batch 1 (communication); w0: the GPT's 64 "
        "parameters at width 32, batch 1x16 (host-bound: each row's per-step Python, kernel "
        "launches and syncs, what a launch-bound GPU run pays) (default: w1)",
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="(default: bench; w0: micro)"
    )
    parser.add_argument("--seq", type=int, default=None, help="(default: 128; w0: 16)")
    parser.add_argument(
        "--batch", type=int, default=None, help="sequences per rank (default: w1 8, w2 1)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per round (default: 8)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="(default: 2)")
    parser.add_argument("--rounds", type=int, default=None, help="(default: 2)")
    parser.add_argument("--world", type=int, default=2, help="ranks in all (default: 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads/rank (default: 1)")
    parser.add_argument("--lr", type=float, default=None, help="(default: 1e-3)")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="DDP's bucket_cap_mb for every DDP row (default: 25, DDP's own)",
    )
    parser.add_argument(
        "--adamw",
        choices=["default", "foreach", "fused"],
        default="default",
        help="AdamW implementation of every row (default: torch's default for the device)",
    )
    parser.add_argument(
        "--compute",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="compute precision of every row; auto: the faster matmul here (default: auto)",
    )
    parser.add_argument(
        "--nodes", type=int, default=0, help="emulated nodes (network namespaces); 0: loopback"
    )
    parser.add_argument(
        "--link", default="1gbit", help="each node's link rate with --nodes (default: 1gbit)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="a subset of the configurations")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: size tiny, seq 32, batch 2, 3 steps, 1 warm-up, 1 round, lr 3e-3, for "
        "each of these flags not given",
    )
    parser.add_argument("--plot", action="store_true")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each step's phases on rank 0 and, with --nodes, how busy its link is",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write torch.profiler's trace and op table of rank 0's timed steps per row into this "
        "directory (profiling slows the steps: the table's times are then not comparable)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per world")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one rank, under torchrun
    parser.add_argument("--opts-file", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    for key, value in {
        **DEFAULTS,
        **WORKLOADS[args.workload],
        **(QUICK if args.quick else {}),
    }.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    checks = (
        ("rounds", 1),
        ("steps", 1),
        ("warmup", 0),
        ("world", 1),
        ("batch", 1),
        ("seq", 1),
        ("threads", 1),
        ("nodes", 0),
    )
    for flag, least in checks:  # (all before anything runs: an audit's --world 0 "ran", exit 0)
        if getattr(args, flag) < least:
            parser.error(f"--{flag}: expected at least {least}, got {getattr(args, flag)}")
    for flag in ("lr", "bucket_mb", "timeout"):
        value = getattr(args, flag)
        if value is not None and not (value > 0 and value < float("inf")):
            parser.error(f"--{flag.replace('_', '-')}: expected a finite number > 0, got {value}")
    try:  # (also without --nodes: a typo there was ignored silently, an audit)
        rate_bits_per_s(args.link)
    except ValueError as exc:
        parser.error(str(exc))
    for flag in ("out_dir", "profile"):
        path = getattr(args, flag)
        if path is not None and path.exists() and not path.is_dir():
            parser.error(
                f"--{flag.replace('_', '-')} {path}: expected a folder (made if missing), "
                "found a file"
            )
        if path is not None:  # (an audit: every row ran, then writing the table failed)
            try:
                path.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError as exc:
                parser.error(
                    f"--{flag.replace('_', '-')} {path}: expected a folder this process can "
                    f"write (made if missing), found {exc.strerror or exc}"
                )
    if args.nodes and args.world % args.nodes:
        parser.error(f"--world {args.world} is not a multiple of --nodes {args.nodes}")
    if args.only:  # a name given twice ran twice a round (an audit)
        args.only = list(dict.fromkeys(args.only))
    unknown = [c for c in args.only or () if c not in CONFIGS]
    if unknown:
        renamed = [f"{c!r} is now {RENAMED[c]!r}" for c in unknown if c in RENAMED]
        said = f" ({'; '.join(renamed)})" if renamed else ""
        parser.error(
            f"--only: unknown configuration(s) {unknown}{said}; expected some of {CONFIGS}"
        )
    if args.compute != "auto" and (wrong := other_precision(args.only, args.compute)):
        parser.error(wrong)
    return args


def other_precision(only: list[str] | None, compute: str) -> str | None:
    """Why ``--only`` names rows of the other compute precision than ``compute`` ("bf16" or
    "fp32"), or None: they don't (an audit: --compute fp32 ran a bf16 row under a header saying
    fp32). The wire-alone rows (no compute) fit either."""
    rows = BF16_CONFIGS if compute == "bf16" else FP32_CONFIGS
    wrong = [c for c in only or () if c not in rows and c not in WIRE_CONFIGS]
    if not wrong:
        return None
    return (
        f"--only: {wrong} compute in the other precision than {compute} (--compute); the rows "
        f"for {compute} compute are {rows + WIRE_CONFIGS}"
    )


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def warm_deepspeed_ops(timeout: float = 900.0) -> None:
    """DeepSpeed's first ``initialize`` on a CPU JIT-compiles its shared-memory comm op (~1 min
    on 2 cores, longer beside other work): inside a row it ran past ``--timeout``, and the build
    killed there left torch's extension ``lock`` file behind, on which every later DeepSpeed row
    waited forever (seen on a fresh machine). Built here once, in one process, before any row
    (cached in ~/.cache/torch_extensions: later runs take no time). Absent DeepSpeed: nothing."""
    code = (
        "from deepspeed.accelerator import get_accelerator\n"
        "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
        "b is None or b.load()\n"
    )
    try:
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print(f"compare.py: DeepSpeed's op build ran past {timeout:.0f} s", file=sys.stderr)


def main() -> int:
    """The comparison's exit code: 1 when no row trained (every one failed or was skipped)."""
    args = parse_args()
    if args.worker is not None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        opts = json.loads(Path(args.opts_file).read_text())
        worker(rank, world, None, args.worker, opts, args.result)
        return 0
    # [Note: a signal runs the cleanup] SIGTERM (timeout, kill, a CI's cancel) and SIGHUP end the
    # process without unwinding: the emulated cluster's namespaces, its ranks and the temporary
    # directory stayed behind. Raised as SystemExit, the finally blocks and context managers run
    # as they do for Ctrl-C. A signal ignored when the comparison started (nohup) stays ignored.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _exit_on_signal)
    link_bits = rate_bits_per_s(args.link) if args.nodes else None
    torch.set_num_threads(args.threads)
    compute, why, peak = choose_compute(args.compute, 0.2 if args.quick else 1.0, args.threads)
    if args.compute == "auto" and (wrong := other_precision(args.only, compute)):
        print(f"compare.py: error: {wrong} (chosen by --compute auto: {why})", file=sys.stderr)
        return 2
    configs = args.only or [
        *(BF16_CONFIGS if compute == "bf16" else FP32_CONFIGS),
        *(WIRE_CONFIGS if args.nodes else []),
    ]
    opts = {
        "size": args.size,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "lr": args.lr,
        "adamw": args.adamw,
        "bucket_mb": args.bucket_mb,
        "world": args.world,
        "data_mb": 0.5 if args.quick else 4.0,
        "timeout": args.timeout or (120.0 if args.quick else 900.0),
        "phases": args.phases,
        "profile": str(args.profile.resolve()) if args.profile else None,
        "link_bits": link_bits,
        "compute": compute,
    }
    if any(c.startswith("DeepSpeed") for c in configs):
        warm_deepspeed_ops()
    runs: dict[str, list[Any]] = {c: [] for c in configs}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="distamp-compare-"))
        nodes = stack.enter_context(cluster(args.nodes, args.link)) if args.nodes else None
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for i, config in enumerate(order):
                prefix = f"{tmp}/{r}-{i}"
                if nodes is None:
                    got = run_world(worker, args.world, config, opts, prefix)
                else:
                    got = run_cluster(nodes, args.world, config, opts, prefix)
                runs[config].append(got)
                print(f"round {r + 1}/{args.rounds}: {config} done", flush=True)
    rows = [summarize(c, runs[c], opts, peak) for c in configs]
    device = "CUDA/NCCL" if torch.cuda.is_available() else "CPU/gloo"
    with torch.device("meta"):  # the ranks' model, counted here: whether or not a row ran
        params = sum(
            p.numel() for p in GPT(GPTConfig(block_size=args.seq, **SIZES[args.size])).parameters()
        )
    floor = floors(rows, params, args.nodes, link_bits)
    where = (
        f"{args.nodes} emulated nodes, each link {args.link} both ways"
        if args.nodes
        else "loopback"
    )
    header = (
        f"GPT {args.size} ({params / 1e6:.1f}M params), workload {args.workload}: "
        f"batch {args.batch}x{args.seq} per rank, {args.world} ranks ({device}, {where}, "
        f"{args.threads} thread(s)/rank), {args.steps} steps x {args.rounds} rounds, "
        f'{datetime.date.today()}. Compute: {compute} — {why}; "of peak" is against that '
        f"matmul rate, measured in this run."
    )
    table = markdown(rows, header, floor)
    if args.phases:
        traced = [(r["config"], r["phases"]) for r in rows if "phases" in r]
        table += (
            "\nWhere the time goes (rank 0, last round, median ms per step; see "
            "benchmarks/phases.py):\n\n"
            + phases_markdown(traced, args.link if args.nodes else None)
        )
    print("\n" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    net = f"-{args.nodes}nodes-{args.link}" if args.nodes else ""
    stem = f"compare-{args.workload}{net}{'-quick' if args.quick else ''}"
    (args.out_dir / f"{stem}.md").write_text(table)
    summary = {
        "options": opts,
        "compute": compute,
        "why": why,
        "peak_gflops": peak,
        "nodes": args.nodes,
        "link": args.link if args.nodes else None,
        "floor": floor,
        "rows": rows,
    }
    (args.out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        print(plot(rows, args.out_dir / f"{stem}.png", floor))
    if all("skipped" in r for r in rows):
        print("compare.py: no configuration trained (see the table's reasons)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
