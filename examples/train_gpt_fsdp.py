"""Train the example GPT with FSDP2 and distamp: the opt_level becomes FSDP's mixed precision.

The model, data and schedule are train_gpt.py's; what differs is one call. Instead of
``distamp.wrap`` + DDP, ``distamp.fsdp.fully_shard(model, optimizer, opt_level=...)`` shards each
transformer block (and every LayerNorm, kept FP32 under O2) with ``torch.distributed.fsdp.
fully_shard`` and the opt_level's ``MixedPrecisionPolicy``; FSDP's sharded FP32 parameters are the
master weights, distamp adds the globally synchronized loss scaler, clipping on the global norm
and sharded checkpoints (which load at another world size).

    torchrun --standalone --nproc_per_node=2 examples/train_gpt_fsdp.py --size tiny --steps 20
    bash launch/run_fsdp.sh                          # the same, installing first
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_gpt import (
    GPT,
    SIZES,
    GPTConfig,
    HelpFormatter,
    Progress,
    RandomWindows,
    add_check_args,
    add_progress_arguments,
    check_ckpt_dir,
    check_progress_arguments,
    check_resume,
    check_run_dirs_free,
    continue_schedule,
    diverged,
    fp16_adam_eps,
    hold_run_dirs,
    job_has_bf16,
    leave_without_destructors,
    load_stdlib_bytes,
    lr_lambda,
    pick_opt_level,
    saved_precision,
    setup_distributed,
)

import distamp
import distamp.fsdp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--opt-level",
        choices=["auto", "O0", "O1", "O2", "O3"],
        default="auto",
        help="auto: O2, or O0 on a CPU without bf16 units",
    )
    parser.add_argument(
        "--half-dtype",
        choices=["auto", "bf16", "fp16"],
        default="auto",
        help="16-bit dtype; auto: bf16 on CPU, fp16 on CUDA",
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step/rank")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 turns it off")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--data-mb", type=float, default=4.0, help="MB of stdlib source to read")
    parser.add_argument("--ckpt-dir", type=Path, default=None, help="save a checkpoint at the end")
    parser.add_argument(
        "--resume",
        default="none",
        help="a checkpoint folder to start from; 'auto': the newest complete one in --ckpt-dir, "
        "if any; 'none'",
    )
    add_progress_arguments(parser, log_every=5, run_name="gpt-fsdp-SIZE")
    add_check_args(parser)
    args = parser.parse_args()
    for name in ("steps", "batch_size", "seq_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)) or not args.clip >= 0 or not args.data_mb > 0:
        parser.error(
            f"expected a finite --lr > 0, --clip >= 0 and --data-mb > 0, got --lr {args.lr}, "
            f"--clip {args.clip}, --data-mb {args.data_mb}"
        )
    if args.ckpt_dir is not None:  # before training, not at the save after it (an audit)
        check_ckpt_dir(parser, args.ckpt_dir)
    check_resume(parser, args)
    check_progress_arguments(parser, args, run_name=f"gpt-fsdp-{args.size}")
    return args


def main() -> int:
    args = parse_args()
    if args.check_args:
        return check_run_dirs_free(args)
    device, backend = setup_distributed()
    if backend is None:
        raise SystemExit("run under torchrun: FSDP needs a process group")
    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.locks = hold_run_dirs(args, rank, device)
    resume = args.resume if args.resume not in ("auto", "none") else None
    if args.resume == "auto" and args.ckpt_dir is not None:
        resume = distamp.latest_checkpoint(args.ckpt_dir)  # the newest *complete* one, or None
    resume_level, resume_half = saved_precision(resume)
    opt_level, why = pick_opt_level(
        args.opt_level,
        device,
        args.half_dtype,
        world,
        fsdp=True,
        bf16_units=job_has_bf16() if args.opt_level == "auto" else None,
        resume_level=resume_level,
        resume_half=resume_half,
    )
    if args.half_dtype == "auto" and resume_half is not None:
        args.half_dtype = resume_half  # the checkpoint's cast weights decide (see train_gpt.py)
    half = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16}[args.half_dtype]

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq_len, **SIZES[args.size])
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # The same param groups as examples/train_gpt.py (no weight decay on vectors), so that an O1
    # checkpoint of either example loads into the other.
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    fp16_adam_eps(optimizer, opt_level, args.half_dtype, device)
    model, optimizer = distamp.fsdp.fully_shard(  # distamp: FSDP2 with the opt_level's policy
        model, optimizer, opt_level=opt_level, half_dtype=half
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps))
    first = 1
    if resume is not None:
        extra = distamp.load_checkpoint(resume, model, optimizer)  # any world size
        scheduler.load_state_dict(extra["scheduler"])
        continue_schedule(scheduler, extra, args.steps, rank == 0)
        first = int(extra["step"]) + 1
        if first > args.steps:
            if rank == 0:
                print(
                    f"nothing to do: the checkpoint is at step {extra['step']} of --steps "
                    f"{args.steps} (raise --steps)",
                    flush=True,
                )
            dist.barrier()
            dist.destroy_process_group()
            return 0
    data = RandomWindows(load_stdlib_bytes(int(args.data_mb * 2**20)), args.seq_len, seed=rank)
    if rank == 0:
        # FSDP's FP32 parameter shards: the masters under O2, the weights themselves at O0/O1.
        fp32 = sum(
            local.numel() * local.element_size()
            for local in (p.to_local() for p in model.parameters())
            if local.dtype == torch.float32
        )
        print(
            f"GPT {args.size} under FSDP2: {n_params / 1e6:.2f}M params | world size {world} | "
            f"opt_level {opt_level}{why} | {fp32 / 1e6:.2f} MB of FP32 shards per rank",
            flush=True,
        )
        if resume is not None:
            print(f"resumed from {resume} (step {first - 1})", flush=True)
    progress = Progress(
        args,
        enabled=rank == 0,
        first_step=first,
        tokens_per_step=world * args.batch_size * args.seq_len,
        line_width=4,
    )
    times = []
    loss = torch.zeros(())
    for step in range(first, args.steps + 1):
        start = time.perf_counter()
        x, y = data.batch(args.batch_size, device, step)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        with distamp.scale_loss(loss, optimizer) as scaled:  # distamp
            scaled.backward()
        if args.clip > 0:
            distamp.clip_grad_norm_(optimizer, args.clip)  # the global norm over all shards
        optimizer.step()  # skipped on every rank together if any shard held inf/NaN
        optimizer.zero_grad()
        step_lr = scheduler.get_last_lr()[0]  # the rate this step trained at
        scheduler.step()
        times.append(time.perf_counter() - start)
        st = distamp.stats(optimizer)
        progress.step(step, st.last_step_skipped)
        record = step % args.metrics_every == 0 or step == args.steps
        line = step % args.log_every == 0 or step == args.steps
        if record or line:
            dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)
            values = dict(
                loss=loss.item(),
                loss_scale=st.loss_scales[0],
                skipped=st.skipped_steps,
                lr=step_lr,
                step_s=times[-1],
            )
            if record:
                progress.record(step, **values)
            if line:
                progress.line(step, **values)
    progress.close()
    if args.ckpt_dir is not None:
        path = args.ckpt_dir / f"step_{args.steps:06d}"
        distamp.save_checkpoint(
            path,
            model,
            optimizer,
            extra={"step": args.steps, "steps": args.steps, "scheduler": scheduler.state_dict()},
        )
        progress.print(f"saved {path}")
    if rank == 0 and times:
        print(
            f"done: final loss {loss.item():.4f} | median step {statistics.median(times) * 1e3:.1f} ms"
        )
    status = diverged(times, loss, args.steps, distamp.stats(optimizer), rank == 0)
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    leave_without_destructors(main())
