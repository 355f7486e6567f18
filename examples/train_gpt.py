"""Train a small GPT on the Python standard library's own source code with distamp and DDP.

A complete, copyable example: a decoder-only transformer over bytes (vocab 256), AdamW with a
warm-up + cosine schedule, gradient accumulation under DDP ``no_sync``, optional clipping, and
distamp's opt_levels O0-O3. The three distamp lines are marked ``# distamp``.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --opt-level O2 --size small
    python examples/train_gpt.py --size tiny --steps 20          # one process, no process group

The backend is NCCL when CUDA is available (one GPU per rank, picked by LOCAL_RANK), else gloo.
Rank 0 shows a tqdm bar when stdout is a terminal (plain lines every --log-every steps in a log
file), records every step in runs/gpt-SIZE/metrics.jsonl and draws runs/gpt-SIZE/metrics.png at
the end (``python -m distamp.plot runs/gpt-SIZE`` redraws it). Other ranks print nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distamp
from distamp.checkpoint.files import COMMIT, is_temporary

WARMUP_STEPS_EXCLUDED = 3
"""Steps left out of the timing statistics (allocator, thread pools and DDP buckets warm up)."""


# -- model --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Byte-level tokens."""
    block_size: int = 128
    """Longest sequence the learned position embedding covers."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Width of the residual stream."""


RUN_LOCK = ".distamp-run.lock"
"""Held by rank 0 in --ckpt-dir and --run-dir while a run uses them (see hold_run_dirs)."""

SIZES: dict[str, dict[str, int]] = {
    "micro": dict(n_layer=5, n_embd=32, n_head=4),  # ~70K: bench's 64 parameters, tiny ones
    "tiny": dict(n_layer=4, n_embd=128, n_head=4),  # ~0.8M parameters
    "small": dict(n_layer=4, n_embd=320, n_head=5),  # ~5M
    "bench": dict(n_layer=5, n_embd=512, n_head=8),  # ~16M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Pre-norm decoder-only transformer; the output projection shares the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the stream's variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of the next byte at every position: (batch, seq) int64 -> (batch, seq, 256)."""
        seq = idx.shape[1]
        if seq > self.cfg.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.cfg.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


# -- data ---------------------------------------------------------------------------------------


def load_stdlib_bytes(max_bytes: int) -> torch.Tensor:
    """The standard library's .py sources, in sorted path order, up to ``max_bytes``, as uint8.

    Deterministic for a given Python installation, and present on every machine that runs this.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
    )
    chunks: list[bytes] = []
    total = 0
    for path in files:
        text = path.read_bytes()
        chunks.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class RandomWindows:
    """Random (input, target) windows of a token stream; each rank draws its own with its seed."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"{tokens.numel()} tokens is too few for windows of {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.generator = torch.Generator()

    def batch(
        self, size: int, device: torch.device, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``index``: a function of (seed, index) only, so a resumed run draws the
        batches it would have drawn without the interruption."""
        high = self.tokens.numel() - self.seq_len - 1
        self.generator.manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(high, (size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets].long().to(device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


# -- training -----------------------------------------------------------------------------------


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every flag's default, unless its help text says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    model = parser.add_argument_group("model and precision")
    model.add_argument(
        "--opt-level",
        choices=["auto", "O0", "O1", "O2", "O3"],
        default="auto",
        help="distamp opt_level; auto: O2, or on a CPU without bf16 units (bf16 matmul ~100x "
        "slower there) O0 with, across ranks, the FP32 weights and optimizer state sharded and "
        "a bf16 wire (--shard-weights)",
    )
    model.add_argument(
        "--half-dtype",
        choices=["auto", "bf16", "fp16"],
        default="auto",
        help="16-bit dtype of O1-O3; auto: bf16 on CPU, fp16 on CUDA",
    )
    model.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="model size: micro ~70K, tiny ~0.8M, small ~5M, bench ~16M parameters",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=50, help="optimizer steps in all")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch/rank")
    train.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    train.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    train.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 turns it off")
    train.add_argument("--seed", type=int, default=0, help="model and data seed")
    train.add_argument("--data-mb", type=float, default=4.0, help="MB of stdlib source to read")
    dist_group = parser.add_argument_group("processes and communication")
    dist_group.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)"
    )
    dist_group.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process group backend under torchrun; auto: nccl when CUDA is available, else gloo",
    )
    dist_group.add_argument(
        "--comm-hook",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce gradients in a 16-bit dtype with distamp.hooks.register (not at an "
        "explicit --opt-level O0 without --shard-weights)",
    )
    dist_group.add_argument(
        "--reduce-scatter",
        action="store_true",
        help="O2 with sharded masters (or --shard-weights): reduce-scatter the gradients into "
        "the shards and overlap the all-gather of the updated weights with the next forward "
        "(ZeRO's gradient path; each rank's .grad then holds its own gradients)",
    )
    dist_group.add_argument(
        "--shard-weights",
        action="store_true",
        help="O0/O1: shard the FP32 weights and optimizer state across ranks (ZeRO-1; "
        "shard_master_weights=True); with the comm hook their gradients are reduce-scattered "
        "in bf16 and the updates gathered in bf16",
    )
    dist_group.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="DDP's bucket_cap_mb (default: 25, DDP's own; 2-4 overlap better on slow links)",
    )
    out = add_progress_arguments(parser, log_every=10, run_name="gpt-SIZE")
    out.add_argument("--json", type=Path, default=None, help="rank 0 writes a summary here")
    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--ckpt-dir", type=Path, default=None, help="save sharded checkpoints under this folder"
    )
    ckpt.add_argument(
        "--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)"
    )
    ckpt.add_argument(
        "--resume",
        default="auto",
        help="'auto': the newest complete checkpoint in --ckpt-dir, if any (what a requeued or "
        "restarted job wants); 'none'; or a checkpoint path. Any world size",
    )
    ckpt.add_argument(
        "--keep", type=int, default=2, help="checkpoints kept in --ckpt-dir (0: all of them)"
    )
    ckpt.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        help="fault injection: the last rank kills itself (SIGKILL) at this step, on a job's "
        "first attempt (TORCHELASTIC_RESTART_COUNT 0: with torchrun --max-restarts the restart "
        "resumes; without, the job ends there); 0: never",
    )
    add_check_args(parser)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("threads", "keep", "clip", "weight_decay", "bucket_mb", "save_every"):
        if not getattr(args, name) >= 0:  # NaN too
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.ckpt_dir is not None:
        check_ckpt_dir(parser, args.ckpt_dir)
    check_resume(parser, args)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.fail_at_step < 0:
        parser.error(f"--fail-at-step must be >= 0 (0: never), got {args.fail_at_step}")
    if args.fail_at_step > args.steps:
        parser.error(
            f"--fail-at-step {args.fail_at_step}: expected a step within --steps {args.steps} "
            "(0: never; launch/elastic.sh sets it from FAIL_AT, default 25)"
        )
    if args.json is not None:
        if args.json.is_dir():
            parser.error(f"--json {args.json}: expected a file path, found a folder")
        check_ckpt_dir(parser, args.json.parent, flag="--json's folder")
    if not args.data_mb > 0:
        parser.error(f"--data-mb must be > 0, got {args.data_mb}")
    if args.seq_len + 1 > args.data_mb * 2**20:
        parser.error(
            f"--seq-len {args.seq_len}: expected fewer tokens per window than --data-mb "
            f"{args.data_mb} holds ({int(args.data_mb * 2**20)} bytes)"
        )
    if args.reduce_scatter and not args.comm_hook:
        parser.error("--reduce-scatter is a comm hook: it cannot go with --no-comm-hook")
    if args.shard_weights and args.opt_level in ("O2", "O3"):
        parser.error(
            f"--shard-weights shards FP32 weights (O0/O1); --opt-level {args.opt_level} has "
            + ("FP32 masters, sharded across ranks already" if args.opt_level == "O2" else "none")
        )
    if args.reduce_scatter and args.opt_level == "O3":
        parser.error("--reduce-scatter needs sharded FP32 masters; --opt-level O3 has none")
    if args.reduce_scatter and args.opt_level in ("O0", "O1") and not args.shard_weights:
        parser.error(
            f"--reduce-scatter with --opt-level {args.opt_level} needs sharded FP32 weights: "
            "add --shard-weights"
        )
    check_progress_arguments(parser, args, run_name=f"gpt-{args.size}")
    return args


def add_check_args(parser: argparse.ArgumentParser) -> None:
    """--check-args: the launch scripts validate the arguments once, before torchrun starts any
    rank (launch/common.sh's check_args)."""
    parser.add_argument(
        "--check-args",
        action="store_true",
        help="check the arguments and exit (0: they are fine, 2: refused, as argparse does); "
        "the locks of --run-dir and --ckpt-dir (another run using them) are tried only with "
        "DISTAMP_CHECK_RUN_LOCKS=1 in the environment, as launch/run.sh, run_fsdp.sh and "
        "elastic.sh set it, not when given by hand",
    )


def check_resume(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--resume is 'auto', 'none' or an existing checkpoint folder, checked before any process
    group or model: a typo used to fail only in load_checkpoint. The checkpoint it names (or
    auto finds) is read, and an --opt-level or --half-dtype it cannot be loaded with refused:
    both failed on every rank with exit code 1 (an audit), which torchrun --max-restarts and a
    Slurm requeue retried."""
    resume = args.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        parser.error(
            f"--resume {resume}: expected 'auto', 'none' or a checkpoint folder, found "
            + ("a file" if Path(resume).exists() else "nothing at that path")
        )
    if resume == "none" or (resume == "auto" and args.ckpt_dir is None):
        return
    try:
        path = find_resume(args)
        if path is None:
            return
        info = distamp.checkpoint.inspect(path)
    except distamp.checkpoint.CheckpointError as exc:
        parser.error(f"--resume {resume}: {exc}")
    level, half = precision_of(info)
    if level is not None and args.opt_level not in ("auto", level):
        parser.error(
            f"--opt-level {args.opt_level}: the checkpoint resumed from ({path}) was saved at "
            f"{level}; expected --opt-level {level} (or auto, which keeps it), or --resume none"
        )
    if half is not None and args.half_dtype not in ("auto", half):
        parser.error(
            f"--half-dtype {args.half_dtype}: the checkpoint resumed from ({path}) holds {half} "
            f"weights ({level}); expected --half-dtype {half} (or auto, which keeps it), or "
            "--resume none"
        )
    saved = info.get("parameters")
    built = gpt_parameters(args.size, args.seq_len)
    if saved and saved != built:
        # (an audit: another --size/--seq-len passed here and failed on every rank in
        # load_checkpoint, retried by torchrun --max-restarts)
        fits = [f"--size {size} --seq-len {seq_len}" for size, seq_len in sizes_holding(saved)]
        parser.error(
            f"--size {args.size} --seq-len {args.seq_len}: builds a model of {built:,} "
            f"parameters, the checkpoint resumed from ({path}) holds {saved:,}; expected the "
            f"run's sizes ({' or '.join(fits) or 'another model than this example builds'}), "
            "or --resume none"
        )


def gpt_parameters(size: str, seq_len: int) -> int:
    """The parameters of ``GPT`` at ``--size``/``--seq-len``, counted on the meta device."""
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=seq_len, **SIZES[size]))
    return sum(p.numel() for p in model.parameters())


def sizes_holding(count: int) -> list[tuple[str, int]]:
    """The (--size, --seq-len) pairs whose model has ``count`` parameters (the position table
    grows by n_embd per position), --seq-len at most 8192 (an arithmetic match of another size
    at 23,701 positions is no suggestion)."""
    found = []
    for size in SIZES:
        one, per = gpt_parameters(size, 1), SIZES[size]["n_embd"]
        seq_len = 1 + (count - one) // per
        if count >= one and (count - one) % per == 0 and seq_len <= 8192:
            found.append((size, seq_len))
    return found


def check_ckpt_dir(parser: argparse.ArgumentParser, path: Path, flag: str = "--ckpt-dir") -> None:
    """--ckpt-dir (and --run-dir) must be a directory this process can write (made if missing),
    checked before training: an audit found a file or a read-only path refused only at the first
    save, after every step had run (--run-dir: a traceback after the model was built). It is made
    and a file written in it: as root, os.access said yes to /proc/x (an audit)."""
    where = path
    while not where.exists() and where != where.parent:
        where = where.parent
    if where.exists() and not where.is_dir():
        parser.error(f"{flag} {path}: expected a directory, found a file at {where}")
    if not os.access(where, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: expected a writable directory, {where} is not writable")
    try:  # made here, as the run would (not removed again: every rank checks at once)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        parser.error(f"{flag} {path}: expected a writable directory, found {err}")
    if flag == "--ckpt-dir":
        check_uncommitted(parser, path)


def check_uncommitted(parser: argparse.ArgumentParser, path: Path) -> None:
    """A step_N folder in --ckpt-dir that is not a committed checkpoint (a copy cut short, one
    made by hand) was refused by save_checkpoint at step N, after training up to it, and under
    torchrun's restarts again on every attempt, which resume from before it (an audit)."""
    stray = sorted(
        child.name
        for child in path.glob("step_*")
        if not is_temporary(child.name)
        and not (child / COMMIT).is_file()
        and (not child.is_dir() or any(child.iterdir()))
    )
    if stray:
        parser.error(
            f"--ckpt-dir {path}: expected each step_* in it to be a committed distamp checkpoint "
            f"(this run saves into step_NNNNNN folders), found {stray[:3]} without a {COMMIT} "
            "file (a copy cut short?): move or delete them, or use another --ckpt-dir"
        )


def _held_by_another_run(lock: Any, flag: str, folder: str) -> str:
    """The refusal for a lock file another process holds (closes it)."""
    lock.seek(0)
    other = lock.read().strip() or "another process"
    lock.close()
    return (
        f"{flag} {folder}: expected no other run using it, found {other} holding "
        f"{Path(folder) / RUN_LOCK} (two runs in one folder overwrite each other's "
        "checkpoints and metrics): wait for it, or use another folder"
    )


def run_dirs_in_use(args: argparse.Namespace) -> str:
    """Under --check-args of the one-node launch scripts (``DISTAMP_CHECK_RUN_LOCKS=1``): the
    refusal :func:`hold_run_dirs` would give, found before torchrun starts (the lock is tried and
    let go at once; the ranks' own lock stays the guard). Inside the ranks the refusal was
    torchrun's exit code 1 after a ChildFailedError, and elastic.sh restarted it as a crash until
    the other run ended and this one went on from its checkpoints (an audit). Not in
    multinode.sh: another node's rank 0 of the same job may hold it already."""
    for folder, flag in ((args.run_dir, "--run-dir"), (args.ckpt_dir, "--ckpt-dir")):
        path = Path(folder) / RUN_LOCK if folder is not None else None
        if path is None or not path.is_file():
            continue
        with open(path) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _held_by_another_run(lock, flag, folder)
            fcntl.flock(lock, fcntl.LOCK_UN)
    return ""


def check_run_dirs_free(args: argparse.Namespace) -> int:
    """--check-args' exit code for the run folders (see :func:`run_dirs_in_use`)."""
    refusal = run_dirs_in_use(args) if os.environ.get("DISTAMP_CHECK_RUN_LOCKS") == "1" else ""
    if refusal:
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        return 2
    return 0


def hold_run_dirs(args: argparse.Namespace, rank: int, device: torch.device) -> list[Any]:
    """Collective: rank 0 locks --ckpt-dir and --run-dir for the run (``flock``, released when
    the process ends, killed too); all ranks stop if another run holds one.

    Two runs pointed at one folder both ran to "done": each pruned the other's checkpoints
    (--keep), committed over the same step_N, and the second emptied metrics.jsonl while the
    first appended to it (an audit). Returns the open lock files (keep them)."""
    held: list[Any] = []
    refusal = ""
    if rank == 0:
        folders = {args.run_dir: "--run-dir", args.ckpt_dir: "--ckpt-dir"}  # one lock per path
        seen: set[Path] = set()
        for folder, flag in folders.items():
            if folder is None or Path(folder).resolve() in seen:
                continue
            seen.add(Path(folder).resolve())
            Path(folder).mkdir(parents=True, exist_ok=True)
            lock = open(Path(folder) / RUN_LOCK, "a+")  # held open for the run
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                refusal = _held_by_another_run(lock, flag, folder)
                break
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            lock.flush()
            held.append(lock)
    if dist.is_initialized():
        flag_tensor = torch.tensor([1 if refusal else 0], device=device)
        dist.all_reduce(flag_tensor)
        if flag_tensor.item() and not refusal:
            raise SystemExit(2)  # rank 0 says why
    if refusal:
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return held


def add_progress_arguments(
    parser: argparse.ArgumentParser, *, log_every: int, run_name: str
) -> argparse._ArgumentGroup:
    """--progress, --log-every, --metrics-every, --run-dir, --plot-every (see Progress)."""
    out = parser.add_argument_group("progress, metrics and pictures (rank 0)")
    out.add_argument(
        "--progress",
        choices=["auto", "bar", "lines"],
        default="auto",
        help="auto: a tqdm bar when stdout is a terminal, else plain lines every --log-every steps",
    )
    out.add_argument("--log-every", type=int, default=log_every, help="steps between plain lines")
    out.add_argument(
        "--metrics-every",
        type=int,
        default=1,
        help="steps between records in RUN_DIR/metrics.jsonl (and bar updates of the loss)",
    )
    out.add_argument(
        "--run-dir",
        default=None,
        help=f"folder of metrics.jsonl and metrics.png; 'none' writes neither "
        f"(default: runs/{run_name})",
    )
    out.add_argument(
        "--plot-every",
        type=int,
        default=0,
        help="steps between redraws of RUN_DIR/metrics.png (0: at the end only; needs matplotlib)",
    )
    return out


def check_progress_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, run_name: str
) -> None:
    """Refuse bad values; turn --run-dir into a Path (None for 'none')."""
    for name in ("log_every", "metrics_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.plot_every < 0:
        parser.error(f"--plot-every must be >= 0, got {args.plot_every}")
    run_dir = args.run_dir if args.run_dir is not None else f"runs/{run_name}"
    args.run_dir = None if run_dir == "none" else Path(run_dir)
    if args.run_dir is not None:
        check_ckpt_dir(parser, args.run_dir, "--run-dir")


def check_backend(backend: str) -> tuple[int, int]:
    """Refuse ``--backend nccl`` without a GPU for each of this node's ranks (LOCAL_WORLD_SIZE:
    torchrun's, or the launch scripts' rank count under --check-args, so that the refusal comes
    once, before any rank starts). Returns (GPUs, ranks on this node)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend == "nccl" and local_world > gpus:
        raise SystemExit(
            f"--backend nccl: expected a GPU per rank, found {gpus} GPU(s) for {local_world} "
            "rank(s) on this node (torchrun --nproc_per_node at most the GPU count, or --backend gloo)"
        )
    return gpus, local_world


def setup_distributed(backend: str = "auto") -> tuple[torch.device, str | None]:
    """Join the torchrun process group if there is one; return (device, backend or None).

    ``backend`` "auto" is NCCL when every rank of this node has a GPU of its own (by LOCAL_RANK),
    else gloo on the CPU (more ranks than GPUs is a CPU run, "backend gloo on cpu" in the first
    line, not a crash on a device that does not exist); "gloo" keeps the model on the CPU even
    where there are GPUs.
    """
    gpus, local_world = check_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = gpus > 0 and backend != "gloo" and local_world <= gpus
    if backend == "nccl" and not use_cuda:
        raise SystemExit("--backend nccl needs CUDA: this machine has no usable GPU")
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:  # plain `python train_gpt.py`: one process, no group
        return device, None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        leave_with_the_launcher()
    backend = "nccl" if use_cuda else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, device_id=device if use_cuda else None)
        return device, backend
    # A restarted attempt (torchrun --max-restarts) reuses the agent's store, where the dead
    # attempt's ranks left their addresses: a fresh key prefix per attempt keeps gloo from
    # connecting to them (seen with torch 2.13: "connectFullMesh failed ... Connection refused").
    # The count agrees between the ranks of one node only; launch/multinode.sh unshares the
    # store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and a fresh store needs no prefix.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"distamp-example/attempt{restart}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        device_id=device if use_cuda else None,
    )
    return device, backend


def leave_with_the_launcher(every_s: float = 1.0) -> None:
    """Exit (SIGTERM to this process) when torchrun's agent is gone. torchrun gives its workers
    no parent-death signal: an agent SIGKILLed (the OOM killer, a scheduler's kill -9) left both
    ranks training and saving into --ckpt-dir, and the relaunch's --resume auto raced them for
    it (an audit). A daemon thread polls the parent's pid: a reparented worker has lost it."""
    parent = os.getppid()
    # The launch scripts name the agent (DISTAMP_LAUNCHER_PID): an agent that died while this
    # rank imported torch left the init process as its parent already (an audit: both ranks
    # waited out the store's timeout).
    launcher = int(os.environ.get("DISTAMP_LAUNCHER_PID", parent))

    def watch() -> None:
        while os.getppid() == parent and not process_gone(launcher):
            time.sleep(every_s)
        print(f"rank {os.environ.get('RANK', '?')}: torchrun's agent is gone; exiting", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="leave-with-the-launcher", daemon=True).start()


def process_gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie (a killed agent its own parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]


def lr_lambda(total_steps: int) -> Callable[[int], float]:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, total_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def fp16_adam_eps(
    optimizer: torch.optim.Optimizer, opt_level: str, half_dtype: str, device: torch.device
) -> None:
    """O3 in fp16 has no FP32 masters: AdamW steps fp16 state, where its default eps (1e-8) is 0
    and a squared gradient that underflows divides by it (distamp.wrap warns about it): eps 1e-4
    there. Both examples (an audit: the FSDP one turned NaN from step 2 and still exited 0)."""
    if opt_level == "O3" and (
        half_dtype == "fp16" or (half_dtype == "auto" and device.type == "cuda")
    ):
        for group in optimizer.param_groups:
            group["eps"] = 1e-4


def continue_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, extra: dict, steps: int, announce: bool
) -> None:
    """After ``scheduler.load_state_dict``: the rate of the next step from this run's schedule
    (``lr_lambda(steps)``). The loaded optimizer and scheduler hold the saved run's last rate, so
    a resume with another --steps (elastic.sh's "go on past the demo's 40 steps") trained its
    first step at the old schedule's final rate and jumped onto the new cosine at the second,
    silently (an audit). With the same --steps the rate is the saved one, bit for bit."""
    scheduler.last_epoch -= 1
    scheduler.step()  # the rate for last_epoch, from this run's lambda (no optimizer step)
    saved = extra.get("steps")
    if announce and saved is not None and int(saved) != steps:
        print(
            f"note: --steps {steps} differs from the checkpoint's run ({saved}): the learning-rate "
            f"schedule goes on as the {steps}-step one (lr {scheduler.get_last_lr()[0]:.2e} at "
            f"step {int(extra['step']) + 1})",
            flush=True,
        )


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic units (x86 avx512_bf16/amx_bf16, Arm bf16).

    Read from /proc/cpuinfo, so every rank of a node decides the same; True where it cannot tell.
    """
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def job_has_bf16() -> bool:
    """:func:`cpu_has_bf16` agreed by every rank of the job (the MIN over the default process
    group, when there is one): a job over nodes of two CPU kinds picked O2 on some and O0 on
    others, and wrap refused it blaming opt_levels the user never chose (an audit)."""
    units = cpu_has_bf16()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1.0 if units else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        units = bool(flag.item())
    return units


def saved_precision(resume: str | None) -> tuple[str | None, str | None]:
    """(opt_level, half dtype of the cast weights: 'fp16'/'bf16', None at O0/O1) a checkpoint
    was saved with (None, None: no checkpoint, or one that says none)."""
    if resume is None:
        return None, None
    try:
        return precision_of(distamp.checkpoint.inspect(resume))
    except (OSError, ValueError, KeyError, AttributeError, distamp.checkpoint.CheckpointError):
        return None, None  # load_checkpoint names what is wrong with it


def precision_of(info: dict) -> tuple[str | None, str | None]:
    """:func:`saved_precision` of a checkpoint's ``distamp.checkpoint.inspect`` dict."""
    level = info["opt_level"]
    cast = info["properties"].get("cast_model_type")
    half = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}.get(str(cast))
    return (level if level in ("O0", "O1", "O2", "O3") else None), half


def _slow_half(
    device: torch.device,
    level: str,
    half: str,
    bf16_units: bool,
    advice: str = "--opt-level O0",
) -> str:
    """ "; ..." when ``level`` computes in a half dtype this CPU has no fast matmul for (fp16
    anywhere on a CPU, bf16 without bf16 units), else "" (an audit: an explicit --opt-level O2
    ran 2-3x slower than O0 at a tiny size, unsaid)."""
    if device.type == "cuda" or level == "O0" or (half != "fp16" and bf16_units):
        return ""
    name = "fp16" if half == "fp16" else "bf16"
    return f"; {name} matmul runs ~100x slower than FP32 on this CPU: {advice} trains in FP32"


def pick_opt_level(
    requested: str,
    device: torch.device,
    half_dtype: str,
    world_size: int = 1,
    *,
    fsdp: bool = False,
    comm_hook: bool = True,
    bf16_units: bool | None = None,
    resume_level: str | None = None,
    resume_half: str | None = None,
) -> tuple[str, str]:
    """(opt_level, why) for --opt-level auto: the fastest correct configuration for the machine
    (README, "distamp and its peers": measured side by side) at ``world_size`` DDP ranks, or
    under FSDP2 (``fsdp``: it shards the FP32 parameters and the optimizer state itself). ``why``
    says what goes on the wire: distamp's hooks, or DDP's own all-reduce (``comm_hook`` off).
    ``bf16_units``: the job's (:func:`job_has_bf16`; default: this CPU's). ``resume_level``: the
    opt_level of the checkpoint the run resumes from, which auto keeps (a requeue onto another
    CPU kind could not load it otherwise: load_checkpoint refuses another opt_level);
    ``resume_half``: its cast weights' dtype ('fp16'/'bf16'), which the run keeps."""
    if requested != "auto":  # the level asked for; said when 16-bit compute is slow here
        units = cpu_has_bf16() if bf16_units is None else bf16_units
        slow = _slow_half(device, requested, half_dtype, units)
        return requested, f" ({slow.removeprefix('; ')})" if slow else ""
    if resume_level is not None and device.type != "cuda":
        level, why = pick_opt_level(
            "auto",
            device,
            half_dtype,
            world_size,
            fsdp=fsdp,
            comm_hook=comm_hook,
            bf16_units=bf16_units,
        )
        half = resume_half or half_dtype
        if level == resume_level and half != "fp16":
            return level, why.replace("(auto: ", "(auto: as the checkpoint resumed from; ", 1)
        # The checkpoint's level, not this CPU's pick: its reasons were another machine's (an
        # audit: "this CPU has bf16 units" printed on a CPU without them).
        layout = ""
        if resume_level == "O0" and world_size > 1 and comm_hook and not fsdp:
            layout = (
                "; FP32 weights and optimizer state sharded across ranks, gradients "
                "reduce-scattered in bf16, updates gathered in bf16 while the next forward runs"
            )
        units = cpu_has_bf16() if bf16_units is None else bf16_units
        advice = "--resume none, or --opt-level O0 with another --ckpt-dir,"
        slow = _slow_half(device, resume_level, half, units, advice)
        return resume_level, f" (auto: the level of the checkpoint resumed from{layout}{slow})"
    if fsdp:
        zero = f"FSDP2 shards the FP32 parameters and AdamW state over {world_size} rank(s)"
    elif world_size > 1 and comm_hook:
        zero = (
            "across ranks FP32 masters sharded, gradients reduce-scattered into the shards, the "
            "updated weights gathered while the next forward runs"
        )
    elif world_size > 1:
        zero = "across ranks FP32 masters sharded, DDP's own all-reduce (--no-comm-hook)"
    else:
        zero = "one rank: FP32 masters, nothing to shard"
    if device.type == "cuda":
        return "O2", f" (auto: GPU: half compute; {zero})"
    if half_dtype == "fp16":
        slow = _slow_half(device, "O2", "fp16", True)
        return "O2", f" (auto: --half-dtype fp16 asked for; {zero}{slow})"
    if cpu_has_bf16() if bf16_units is None else bf16_units:
        return "O2", f" (auto: this CPU has bf16 units: bf16 compute; {zero})"
    no_units = (
        " (auto: this CPU has no bf16 units, where bf16 matmul runs ~100x slower than FP32: FP32 "
        "compute"
    )
    if world_size == 1 or fsdp:
        return "O0", f"{no_units}; {zero})" if fsdp else f"{no_units})"
    # On par with O0 + the bf16 all-reduce hook at 2 ranks, faster at 4 where the wire is the
    # bottleneck (the step is 1/N); within noise of it where the cores are (measured on a CPU
    # without bf16 units); 1/N of the optimizer state everywhere: README, W2/W3 with FP32 compute.
    if not comm_hook:
        return "O0", (
            f"{no_units}; FP32 weights and optimizer state sharded across ranks, DDP's own FP32 "
            "all-reduce (--no-comm-hook))"
        )
    return "O0", (
        f"{no_units}; FP32 weights and optimizer state sharded across ranks, gradients "
        "reduce-scattered in bf16, updates gathered in bf16 while the next forward runs)"
    )


def find_resume(args: argparse.Namespace) -> str | None:
    """The checkpoint to resume from, per --resume and --ckpt-dir (None: start fresh)."""
    if args.resume == "none":
        return None
    if args.resume != "auto":
        return str(args.resume)
    if args.ckpt_dir is None:
        return None
    return distamp.latest_checkpoint(args.ckpt_dir)  # the newest *complete* one


def save(
    args: argparse.Namespace,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    progress: Progress,
) -> None:
    """Collective: a sharded checkpoint of step ``step``; keep the newest ``--keep`` of them."""
    directory = args.ckpt_dir / f"step_{step:06d}"
    start = time.perf_counter()
    distamp.save_checkpoint(  # distamp
        directory,
        model,
        optimizer,
        extra={"step": step, "steps": args.steps, "scheduler": scheduler.state_dict()},
    )
    if progress.enabled:
        progress.print(f"saved {directory} in {time.perf_counter() - start:.2f} s")
    # Prune only this run's checkpoints (the ones it saved, and those of the run it resumed
    # from), never the one just written nor another run's in the same folder: audits found a
    # damaged newer one counted among the newest and the fresh save deleted, and a fresh run's
    # --keep deleting an earlier run's checkpoints.
    ours: list[Path] = args.run_checkpoints
    ours[:] = [p for p in ours if p.resolve() != directory.resolve()] + [directory]
    if progress.enabled and args.keep > 0:
        for old in ours[: -args.keep]:
            if old.is_dir():
                shutil.rmtree(old)
    if args.keep > 0:
        del ours[: -args.keep]


def inject_failure(step: int) -> None:
    """--fail-at-step: die like a crashed node, on the first attempt only."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    print(f"rank {os.environ.get('RANK', 0)}: injected failure at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# -- progress, metrics and the picture ------------------------------------------------------------


def format_eta(seconds: float) -> str:
    """``1h02m``, ``3m07s`` or ``42s``."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """What rank 0 shows and keeps of a run; on every other rank it does nothing.

    A tqdm bar (loss, loss scale, skipped steps, tokens/s, ETA) when stdout is a terminal, else a
    plain line every ``log_every`` steps (CI, log files); one JSON object per recorded step in
    ``run_dir/metrics.jsonl``; its picture ``run_dir/metrics.png`` (``distamp.plot``) at the end
    and every ``plot_every`` steps. A resumed run keeps the records before its first step and
    drops the later ones, which the checkpoint it resumed from does not know about.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        enabled: bool,
        first_step: int,
        tokens_per_step: int,
        line_width: int = 5,
    ) -> None:
        self.enabled = enabled
        self.total = args.steps
        self.log_every = args.log_every
        self.plot_every = args.plot_every if args.run_dir is not None else 0
        self.tokens_per_step = tokens_per_step
        self.line_width = line_width
        self.run_dir: Path | None = args.run_dir if enabled else None
        self.first_step = first_step
        self.start = time.perf_counter()
        self.skipped_since: list[int] = []
        self.plot_warned = False
        self.bar = None
        self.exits = contextlib.ExitStack()
        if not enabled:
            return
        mode = args.progress
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        if mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:
                print("no progress bar: tqdm is not installed (pip install tqdm)", flush=True)
            else:
                # A terminal that reports no size (a pty nobody sized) would get an empty bar.
                try:
                    sized = min(os.get_terminal_size(sys.stdout.fileno())) > 0
                except OSError:
                    sized = False
                self.bar = tqdm(
                    total=args.steps,
                    initial=first_step - 1,
                    unit="step",
                    file=sys.stdout,
                    dynamic_ncols=sized,
                    ncols=None if sized else 120,
                    nrows=None if sized else 24,
                    smoothing=0.1,
                )
                # distamp's own warnings (a skipped step) go above the bar, not through it.
                from tqdm.contrib.logging import logging_redirect_tqdm

                self.exits.enter_context(
                    logging_redirect_tqdm([logging.getLogger("distamp")], tqdm_class=tqdm)
                )
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            metrics = self.run_dir / "metrics.jsonl"
            kept = []
            if metrics.is_file() and first_step > 1:
                # A damaged line (cut by a killed rank, garbage) is dropped, not fatal: it made
                # every restart of an elastic job fail (an audit).
                for line in metrics.read_text(errors="replace").splitlines():
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        if json.loads(line)["step"] < first_step:
                            kept.append(line + "\n")
            metrics.write_text("".join(kept))

    def print(self, message: str) -> None:
        """A line on rank 0 that leaves the bar intact."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def step(self, step: int, skipped: bool) -> None:
        """Called after every optimizer step, on every rank."""
        if skipped:
            self.skipped_since.append(step)
        if self.bar is not None:
            self.bar.update(1)

    def record(
        self,
        step: int,
        *,
        loss: float,
        loss_scale: float,
        skipped: int,
        lr: float,
        step_s: float,
    ) -> None:
        """Called at the recorded steps, on every rank, with the loss averaged over the ranks."""
        if not self.enabled:
            return
        tokens_per_s = self.tokens_per_step / step_s
        row = {
            "step": step,
            "loss": loss,
            "loss_scale": loss_scale,
            "skipped": skipped,
            "skipped_steps": self.skipped_since,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_s": step_s,
            "time": time.time(),
        }
        self.skipped_since = []
        if self.run_dir is not None:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss {loss:.4f} | scale {loss_scale:g} | skipped {skipped} | "
                f"{tokens_per_s:.0f} tok/s",
                refresh=True,  # the bar was drawn by step() before: show this step's loss now
            )
        if self.plot_every and step % self.plot_every == 0 and step != self.total:
            self.plot()

    def line(
        self, step: int, *, loss: float, loss_scale: float, skipped: int, lr: float, step_s: float
    ) -> None:
        """The plain line of a --log-every step (not printed while there is a bar)."""
        if not self.enabled or self.bar is not None:
            return
        done = step - self.first_step + 1
        eta = (time.perf_counter() - self.start) / done * (self.total - step)
        print(
            f"step {step:{self.line_width}d} | loss {loss:.4f} | scale {loss_scale:g} | "
            f"skipped {skipped} | lr {lr:.2e} | {step_s * 1e3:7.1f} ms | "
            f"{self.tokens_per_step / step_s:8.0f} tok/s | eta {format_eta(eta)}",
            flush=True,
        )

    def plot(self) -> None:
        """Redraw run_dir/metrics.png; without matplotlib say how to get it, once, and go on."""
        if self.run_dir is None:
            return
        try:
            import distamp.plot

            distamp.plot.plot_run(self.run_dir)
        except ImportError as error:
            if not self.plot_warned:
                self.print(f"no plot: {error}")
                self.plot_warned = True

    def close(self) -> None:
        """End of training: close the bar, draw the picture."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.exits.close()
        if self.enabled and self.run_dir is not None:
            self.plot()
            if not self.plot_warned:
                print(
                    f"metrics: {self.run_dir / 'metrics.jsonl'} | picture: "
                    f"{self.run_dir / 'metrics.png'} (python -m distamp.plot {self.run_dir} "
                    "redraws it)",
                    flush=True,
                )


def main() -> int:
    args = parse_args()
    if args.check_args:
        try:
            check_backend(args.backend)
        except SystemExit as refused:  # exit 2 as argparse's refusals (it exited 1: an audit)
            print(f"train_gpt.py: error: {refused}", file=sys.stderr)
            return 2
        return check_run_dirs_free(args)
    device, backend = setup_distributed(args.backend)
    rank = dist.get_rank() if backend else 0
    args.locks = hold_run_dirs(args, rank, device)
    world_size = dist.get_world_size() if backend else 1
    threads = args.threads or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    is_main = rank == 0

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts them anyway)
    cfg = GPTConfig(block_size=args.seq_len, **SIZES[args.size])
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    asked = args.opt_level
    resume_from = find_resume(args)
    resume_level, resume_half = saved_precision(resume_from)
    args.opt_level, why = pick_opt_level(
        args.opt_level,
        device,
        args.half_dtype,
        world_size,
        comm_hook=args.comm_hook,
        bf16_units=job_has_bf16() if asked == "auto" else None,
        resume_level=resume_level,
        resume_half=resume_half,
    )
    if args.half_dtype == "auto" and resume_half is not None:
        # The checkpoint's cast weights decide (an audit: a run trained with --half-dtype fp16,
        # resumed with the defaults, built bf16 weights and every rank refused the checkpoint —
        # under --max-restarts, at every attempt).
        args.half_dtype = resume_half
    if args.shard_weights and args.opt_level in ("O2", "O3") and is_main:
        print(
            f"note: --shard-weights has nothing to do: --opt-level {asked} picked "
            f"{args.opt_level}, "
            + (
                "which has no FP32 weights"
                if args.opt_level == "O3"
                else "whose FP32 masters are sharded across ranks already"
                if world_size > 1
                else "whose FP32 masters have one rank to live on"
            ),
            flush=True,
        )
    fp16_adam_eps(optimizer, args.opt_level, args.half_dtype, device)
    # FP32 weights sharded: asked for, or auto's choice across ranks on a CPU without bf16 units.
    shard_fp32 = args.opt_level in ("O0", "O1") and (args.shard_weights or "sharded" in why)
    model, optimizer = distamp.wrap(  # distamp
        model,
        optimizer,
        opt_level=args.opt_level,
        half_dtype=args.half_dtype,
        shard_master_weights=True if shard_fp32 else None,
    )
    train_model: nn.Module = model
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    hook: object = None  # distamp's hook, which reduces the gradients in 16 bits
    if backend is not None:
        # The .grad are views into DDP's buckets: no copy into them and back every step.
        train_model = DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True
        )
        no_sync = train_model.no_sync
        # An explicit O0 is the FP32 baseline (FP32 on the wire); auto's O0 keeps a 16-bit wire.
        # auto's O2 shards the masters across ranks: the reduce-scatter path is its fastest wire
        # (README, W2/W3: the bytes of one all-reduce, the weight gather overlapped).
        auto_zero = "auto" in why and args.opt_level == "O2" and args.comm_hook and world_size > 1
        if shard_fp32 and args.comm_hook:
            hook = distamp.hooks.register(  # distamp: ZeRO's gradient path, 16-bit both ways
                train_model,
                optimizer,
                reduce_scatter=True,
                overlap_gather=True,
                gather_dtype=torch.bfloat16,
            )
        elif args.reduce_scatter or auto_zero:
            hook = distamp.hooks.register(  # distamp: ZeRO's gradient path
                train_model, optimizer, reduce_scatter=True, overlap_gather=True
            )
        elif args.comm_hook and (args.opt_level != "O0" or ("auto" in why and world_size > 1)):
            hook = distamp.hooks.register(train_model, optimizer)  # (auto's O0 alone: no wire)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps))
    tokens = load_stdlib_bytes(int(args.data_mb * 2**20))
    data = RandomWindows(tokens, args.seq_len, seed=args.seed + rank)
    tokens_per_step = world_size * args.grad_accum * args.batch_size * args.seq_len
    half = {
        "auto": torch.get_autocast_dtype(device.type),  # what distamp's "auto" picks too
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }[args.half_dtype]
    # O0 computes in FP32: its half dtype is only the wire's (the hook's choice), if anything's.
    half_name = str(half).removeprefix("torch.")
    wire = getattr(hook, "wire_dtype", None)
    precision = (
        f"half dtype {half_name}"
        if args.opt_level != "O0"
        else "FP32 compute, one rank: nothing reduced"
        if world_size == 1
        else f"FP32 compute, gradients reduced in {str(wire).removeprefix('torch.')}"
        if wire not in (None, torch.float32)
        else "FP32 compute and wire"
    )
    if is_main:
        print(
            f"GPT {args.size}: {n_params / 1e6:.2f}M params ({cfg.n_layer} layers, "
            f"{cfg.n_embd} wide, {cfg.n_head} heads) | data {tokens.numel() / 2**20:.1f} MB of "
            f"stdlib source | world size {world_size} | backend {backend or 'none'} on {device} | "
            f"{threads} threads/rank | opt_level {args.opt_level}{why} | {precision} | batch "
            f"{args.batch_size}x{args.seq_len} per rank"
            f" x {args.grad_accum} micro-batches per step",
            flush=True,
        )

    first_step = 1
    if resume_from is None and args.ckpt_dir is not None and is_main:
        earlier = distamp.checkpoint.list_checkpoints(args.ckpt_dir)
        if earlier:
            print(
                f"note: starting fresh (--resume {args.resume}) in --ckpt-dir {args.ckpt_dir}, "
                f"which holds {len(earlier)} checkpoint(s) of an earlier run up to step "
                f"{earlier[-1][0]}: --keep prunes only this run's, and a later --resume auto "
                "resumes the highest step in the folder",
                flush=True,
            )
    args.run_checkpoints = []  # what --keep may prune: see save()
    if resume_from is not None:
        extra = distamp.load_checkpoint(resume_from, model, optimizer)  # distamp: any world size
        scheduler.load_state_dict(extra["scheduler"])
        continue_schedule(scheduler, extra, args.steps, is_main)
        first_step = int(extra["step"]) + 1
        if args.ckpt_dir is not None:  # the run this one continues
            args.run_checkpoints = [
                Path(path)
                for saved, path in distamp.checkpoint.list_checkpoints(args.ckpt_dir)
                if saved <= int(extra["step"])
            ]
        if is_main:
            print(f"resumed from {resume_from} (step {extra['step']})", flush=True)
            restored = optimizer.param_groups[0]
            if (scheduler.base_lrs[0], restored["weight_decay"]) != (args.lr, args.weight_decay):
                # The checkpoint's schedule and hyperparameters win (an audit: silently).
                print(
                    f"note: --lr {args.lr:g} and --weight-decay {args.weight_decay:g} are not "
                    f"applied: the checkpoint's schedule (peak lr {scheduler.base_lrs[0]:g}) and "
                    f"weight decay ({restored['weight_decay']:g}) go on",
                    flush=True,
                )
            if first_step > args.steps:
                print(
                    f"nothing to do: the checkpoint is at step {extra['step']} of --steps "
                    f"{args.steps} (raise --steps, or pass --resume none to start over)",
                    flush=True,
                )

    progress = Progress(
        args, enabled=is_main, first_step=first_step, tokens_per_step=tokens_per_step
    )
    step_times: list[float] = []
    loss_sum = torch.zeros((), device=device)
    for step in range(first_step, args.steps + 1):
        if step == args.fail_at_step and rank == world_size - 1:
            inject_failure(step)
        start = time.perf_counter()
        loss_sum.zero_()
        for micro in range(args.grad_accum):
            x, y = data.batch(args.batch_size, device, step * args.grad_accum + micro)
            last = micro == args.grad_accum - 1
            # Under no_sync DDP only accumulates; the last backward all-reduces the whole sum.
            with contextlib.nullcontext() if last else no_sync():
                logits = train_model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                loss = loss / args.grad_accum
                with distamp.scale_loss(loss, optimizer) as scaled_loss:  # distamp
                    scaled_loss.backward()
            loss_sum += loss.detach()
        if args.clip > 0:
            distamp.clip_grad_norm_(optimizer, args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_lr = scheduler.get_last_lr()[0]  # the rate this step trained at (an audit: the
        scheduler.step()  # log showed the next step's)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - start)
        st = distamp.stats(optimizer)  # distamp: the same on every rank
        progress.step(step, st.last_step_skipped)

        record = step % args.metrics_every == 0 or step == args.steps
        line = step % args.log_every == 0 or step == args.steps
        if record or line:
            if backend is not None:  # every rank reaches this line at the same steps
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            values = dict(
                loss=loss_sum.item(),
                loss_scale=st.loss_scales[0],
                skipped=st.skipped_steps,
                lr=step_lr,
                step_s=step_times[-1],
            )
            if record:
                progress.record(step, **values)
            if line:
                progress.line(step, **values)
        if args.ckpt_dir is not None and (
            step == args.steps or (args.save_every and step % args.save_every == 0)
        ):
            save(args, step, model, optimizer, scheduler, progress)
    progress.close()

    timed = step_times[WARMUP_STEPS_EXCLUDED:] or step_times
    st = distamp.stats(optimizer)
    summary = {
        "opt_level": args.opt_level,
        "half_dtype": str(half).removeprefix("torch."),
        "size": args.size,
        "config": asdict(cfg),
        "params": n_params,
        "world_size": world_size,
        "backend": backend,
        "device": str(device),
        "threads_per_rank": threads,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "steps": args.steps,
        "timed_steps": len(timed),
        "first_step": first_step,
        "median_step_s": statistics.median(timed) if timed else None,
        "mean_step_s": statistics.fmean(timed) if timed else None,
        "tokens_per_s": tokens_per_step / statistics.median(timed) if timed else None,
        # None when no step ran (resumed at --steps) or the loss is not finite (JSON has no NaN).
        "final_loss": last if step_times and math.isfinite(last := loss_sum.item()) else None,
        "skipped_steps": st.skipped_steps,
        "loss_scale": st.loss_scales[0],
        "master_bytes": st.master_bytes,
        "optimizer_state_bytes": st.optimizer_state_bytes,
    }
    if is_main and timed:
        print(
            f"done: {args.steps} steps"
            + (
                f" ({len(step_times)} run here, after step {first_step - 1})"
                if first_step > 1
                else ""
            )
            + f" | final loss {loss_sum.item():.4f} | median step "
            f"{summary['median_step_s'] * 1e3:.1f} ms (mean {summary['mean_step_s'] * 1e3:.1f}, "
            + (
                f"first {WARMUP_STEPS_EXCLUDED} excluded"
                if len(step_times) > len(timed)
                else "all steps"
            )
            + f") | {summary['tokens_per_s']:.0f} tok/s | "
            f"skipped {st.skipped_steps} | loss scale {st.loss_scales[0]:g}",
            flush=True,
        )
    if is_main and args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    status = diverged(step_times, loss_sum, args.steps, st, is_main)
    if backend is not None:
        dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
        dist.destroy_process_group()
    return status


def diverged(
    step_times: list[float], loss: torch.Tensor, step: int, st: distamp.AmpStats, is_main: bool
) -> int:
    """The exit status of a finished run: 1 when its final loss (averaged over the ranks, so the
    same on every rank) is inf or NaN, so that a script, Slurm or CI sees a diverged run as failed
    (an audit: it exited 0); 0 otherwise, and when no step ran here."""
    if not step_times or math.isfinite(value := loss.item()):
        return 0
    if is_main:
        print(
            f"error: the run diverged: expected a finite loss after step {step}, found {value} "
            f"(averaged over the ranks; {st.skipped_steps} steps skipped, loss scale "
            f"{st.loss_scales[0]:g}). Lower --lr or set --clip.",
            file=sys.stderr,
            flush=True,
        )
    return 1


def leave_without_destructors(status: int = 0) -> None:
    """End a finished run without running gloo's C++ destructors at interpreter exit.

    gloo's worker threads can still hold finished work objects that own Python tensors; freeing
    them while the interpreter shuts down aborts the process ("terminate called without an active
    exception", SIGABRT: seen once in this project's CI, in the FSDP example's rank 1 after it had
    finished; pytorch/pytorch#179291) or hangs
    it (see benchmarks/compare.py, [Note: exit without destructors]). Everything the run writes
    (checkpoints, metrics, the summary) is closed by now, so leave with `status` (see diverged).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":
    leave_without_destructors(main())
