"""The picture of a training run: loss and loss scale over steps, skipped steps marked.

Reads the ``metrics.jsonl`` a run writes (one JSON object per recorded step: ``step``, ``loss``,
``loss_scale``, ``skipped``, ``skipped_steps``, ``tokens_per_s``, ``time``, ...) and draws
``metrics.png`` next to it. matplotlib is optional (``pip install 'distamp[plot]'``); without it
:func:`plot_run` raises an ``ImportError`` that says how to install it.

    python -m distamp.plot runs/gpt-tiny                 # redraws runs/gpt-tiny/metrics.png
    python -m distamp.plot runs/gpt-tiny -o loss.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
PICTURE = "metrics.png"
INSTALL_HINT = "pip install matplotlib (or pip install 'distamp[plot]')"


@dataclass(frozen=True, kw_only=True)
class Run:
    """The recorded steps of one run, in step order."""

    name: str
    """The run folder's name."""
    steps: list[int]
    """Recorded steps."""
    losses: list[float]
    """Loss at each recorded step, averaged over the ranks."""
    loss_scales: list[float]
    """Loss scale after each recorded step."""
    skipped_steps: list[int]
    """Every step whose optimizer step was skipped (inf/NaN gradients)."""
    tokens_per_s: list[float]
    """Throughput of each recorded step, all ranks together."""


def read_run(run_dir: str | Path) -> Run:
    """The records of ``run_dir/metrics.jsonl``; a later record of a step replaces an earlier one.

    A line that does not parse (a run killed while writing it) is left out.
    """
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: expected the metrics of a training run")
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            float(row["loss"]), float(row["loss_scale"])
            if "tokens_per_s" in row:
                float(row["tokens_per_s"])
            [int(s) for s in row.get("skipped_steps", [])]
            rows[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):
            continue
    ordered = [rows[step] for step in sorted(rows)]
    skipped: set[int] = set()
    for row in ordered:
        skipped.update(int(s) for s in row.get("skipped_steps", []))
    return Run(
        name=Path(run_dir).resolve().name,
        steps=[int(row["step"]) for row in ordered],
        losses=[float(row["loss"]) for row in ordered],
        loss_scales=[float(row["loss_scale"]) for row in ordered],
        skipped_steps=sorted(skipped),
        tokens_per_s=[float(row.get("tokens_per_s", math.nan)) for row in ordered],
    )


def running_mean(values: list[float], window: int) -> list[float]:
    """Means of each ``window`` consecutive values (``len(values) - window + 1`` of them), of the
    finite values in each window (NaN where it holds none): a running total kept one NaN loss
    (a skipped step's) for good and the smoothed curve vanished for the rest of the run (an
    audit)."""
    finite = [v if math.isfinite(v) else 0.0 for v in values]
    counts = [1 if math.isfinite(v) else 0 for v in values]
    total, count = sum(finite[:window]), sum(counts[:window])
    means = [total / count if count else math.nan]
    for i in range(window, len(values)):
        total += finite[i] - finite[i - window]
        count += counts[i] - counts[i - window]
        means.append(total / count if count else math.nan)
    return means


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/metrics.png``); its path.

    Raises ``ImportError`` with the install command when matplotlib is missing.
    """
    run = read_run(run_dir)  # first: a run dir without metrics says so, matplotlib or not
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(f"matplotlib is not installed: {INSTALL_HINT}") from error
    target = Path(out) if out is not None else Path(run_dir) / PICTURE

    # The object API (Figure + Agg canvas), not pyplot: no global figure state, no GUI backend.
    fig = Figure(figsize=(8, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, scale_ax = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    marker = "o" if len(run.steps) <= 40 else None
    window = len(run.steps) // 20
    if window >= 3:  # noisy per-step losses: the raw curve light, a running mean over it
        loss_ax.plot(run.steps, run.losses, color="tab:blue", alpha=0.35, lw=0.8, label="loss")
        loss_ax.plot(
            run.steps[window - 1 :],
            running_mean(run.losses, window),
            color="tab:blue",
            lw=1.8,
            label=f"mean of the last {window} records",
        )
    else:
        loss_ax.plot(run.steps, run.losses, color="tab:blue", marker=marker, markersize=3, lw=1.2)
    loss_ax.set_ylabel("loss (mean over ranks)")
    loss_ax.grid(alpha=0.3)
    scale_ax.step(run.steps, run.loss_scales, where="post", color="tab:green", lw=1.2)
    if run.loss_scales and min(run.loss_scales) > 0:
        scale_ax.set_yscale("log", base=2)
    scale_ax.set_ylabel("loss scale")
    scale_ax.set_xlabel("optimizer step")
    scale_ax.grid(alpha=0.3)
    for i, step in enumerate(run.skipped_steps):
        label = f"skipped step ({len(run.skipped_steps)} in all)" if i == 0 else None
        for ax in (loss_ax, scale_ax):
            ax.axvline(step, color="tab:red", alpha=0.5, lw=1, ls="--", label=label)
            label = None
    if run.skipped_steps or window >= 3:
        loss_ax.legend(loc="upper right", fontsize=9)
    title = run.name
    if run.steps:
        rate = [r for r in run.tokens_per_s if math.isfinite(r)]
        title += f": step {run.steps[-1]}, loss {run.losses[-1]:.4f}"
        title += f", {len(run.skipped_steps)} skipped"
        if rate:
            title += f", median {sorted(rate)[len(rate) // 2]:,.0f} tokens/s"
    loss_ax.set_title(title, fontsize=10)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    # The format from the target's own suffix (the temporary name's made every file a PNG).
    try:
        fig.savefig(partial, format=target.suffix.lstrip(".").lower() or "png")
        partial.replace(target)  # a viewer never sees half a file
    finally:
        partial.unlink(missing_ok=True)  # a failed save or rename leaves nothing behind
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m distamp.plot RUN_DIR [-o OUT]``."""
    parser = argparse.ArgumentParser(
        prog="python -m distamp.plot", description="Redraw a run's loss and loss-scale picture."
    )
    parser.add_argument(
        "run_dir", type=Path, help=f"folder holding {METRICS} (runs/NAME), or that file"
    )
    parser.add_argument(
        "-o", "--out", type=Path, default=None, help=f"image to write (default: RUN_DIR/{PICTURE})"
    )
    args = parser.parse_args(argv)
    # The metrics file itself names its run (an audit: "metrics.jsonl/metrics.jsonl does not
    # exist").
    if args.run_dir.is_file() and args.run_dir.name == METRICS:
        args.run_dir = args.run_dir.parent
    if args.out is not None and args.out.is_dir():
        parser.error(f"-o {args.out}: expected an image file, found a directory")
    try:
        if not read_run(args.run_dir).steps:  # (an audit: a blank picture and exit 0)
            raise ValueError(
                f"{Path(args.run_dir) / METRICS}: no records (expected JSON lines with step, "
                "loss and loss_scale, as the example writes them)"
            )
        path = plot_run(args.run_dir, args.out)
    except (ImportError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    run = read_run(args.run_dir)
    print(f"{path}: {len(run.steps)} recorded steps, {len(run.skipped_steps)} skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
