"""``python -m distamp.checkpoint inspect DIR`` and ``python -m distamp.checkpoint consolidate DIR OUT``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .files import CheckpointError
from .offline import consolidate, inspect


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distamp.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="summarize a checkpoint directory")
    p_inspect.add_argument("directory", type=Path)
    p_inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    p_inspect.add_argument(
        "--verify",
        action="store_true",
        help="also hash every file against the manifest (without it: sizes only)",
    )
    p_cons = sub.add_parser(
        "consolidate", help="write one FP32 state dict that a plain, unwrapped model loads"
    )
    p_cons.add_argument("directory", type=Path)
    p_cons.add_argument("output", type=Path)
    p_cons.add_argument("--model-index", type=int, default=0, help="which model of a list")
    args = parser.parse_args(argv)
    if args.command == "consolidate" and (args.output.is_dir() or not args.output.name):
        parser.error(f"OUT {args.output}: expected a file path, found a directory")
    try:
        if args.command == "inspect":
            info = inspect(args.directory, verify=args.verify)
            if args.json:
                print(json.dumps({k: v for k, v in info.items()}, indent=2, default=str))
                return 1 if info["damaged"] else 0
            print(f"checkpoint   {info['directory']}")
            print(f"step         {info['step']}")
            print(f"world size   {info['world_size']}")
            print(
                f"opt_level    {info['opt_level']}  (half dtype {info['half_dtype']})"
                if info["opt_level"] != "disabled"
                else "opt_level    disabled (wrap(..., enabled=False): plain FP32)"
            )
            print(f"sharded      {info['sharding']}")
            print(f"parameters   {info['parameters']:,}")
            for i, o in enumerate(info["optimizers"]):
                print(
                    f"optimizer {i}  {o['class']}, {o['steps']} steps, {o['skipped_steps']} skipped"
                )
            print(f"loss scales  {', '.join(f'{s:g}' for s in info['loss_scales']) or '-'}")
            # (+ the COMMIT marker and distamp.pt, counted in the bytes, not listed; an audit
            # read "7 files" above 5 names)
            print(
                f"on disk      {_mb(info['bytes_on_disk'])} in {len(info['files']) + 2} files "
                "(these and the COMMIT marker, distamp.pt)"
            )
            for name, size in sorted(info["files"].items()):
                print(f"  {name:<24} {_mb(size)}")
            if info["damaged"]:
                print(
                    f"error: damaged since the commit: {', '.join(info['damaged'])} "
                    "(load_checkpoint and consolidate refuse it)",
                    file=sys.stderr,
                )
                return 1
            return 0
        state = consolidate(args.directory, model_index=args.model_index)
        # Written beside OUT and renamed over it: a failed write (a full disk, a file size
        # limit) left a truncated OUT.pt that torch.load could not read, over a good one (an
        # audit).
        partial = args.output.with_name(args.output.name + ".partial")
        try:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, partial)
            os.replace(partial, args.output)
        except (OSError, RuntimeError) as exc:  # a path under a file, read-only, disk full
            print(f"error: cannot write OUT.pt {args.output}: {exc}", file=sys.stderr)
            return 1
        finally:
            partial.unlink(missing_ok=True)
        count = sum(v.numel() for v in state.values() if v.is_floating_point())
        print(f"wrote {args.output}: {len(state)} entries, {count:,} FP32 values")
        return 0
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
