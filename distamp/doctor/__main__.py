"""``python -m distamp.doctor [--seconds S]``: what this machine can do for mixed precision."""

from __future__ import annotations

import argparse
import json
import math
import sys

from . import machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distamp.doctor",
        description="What this machine can do for mixed precision: devices, backends, matmul "
        "speed per dtype, which dtypes gloo reduces, and the configuration to use.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="time to spend measuring matmuls, about (each dtype runs at least a warm-up and two "
        "products, so at least ~1 s where fp16 is slow) (default: 1.0)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the facts as JSON instead of the summary"
    )
    args = parser.parse_args(argv)
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= 600):
        parser.error(f"--seconds: expected a number of seconds in (0, 600], got {args.seconds}")
    facts = machine(args.seconds)
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    print(f"torch        {facts['torch']}")
    print(f"devices      {', '.join(facts['devices'])}")
    print(
        "backends     "
        + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in facts["backends"].items())
    )
    print(
        "cpu matmul   (one thread) "
        + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in facts["matmul_gflops"].items())
    )
    if facts["gpu_matmul_gflops"]:
        print(
            "cuda:0       "
            + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in facts["gpu_matmul_gflops"].items())
        )
    if facts["gloo_reduces"]:
        print(
            "gloo reduces "
            + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in facts["gloo_reduces"].items())
        )
    for line in facts["advice"]:
        print(f"advice       {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
