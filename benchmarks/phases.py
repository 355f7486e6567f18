"""Where a training step's time goes, and how busy the link is meanwhile (``compare.py --phases``).

Marks are taken by hooks on the model and the optimizer, not by editing the step functions, so
every configuration is measured the same way: the step starts (its batch is made), the model's
forward starts (a forward pre-hook: DDP's or FSDP's own pre-forward work comes before it) and ends
(a forward hook), the optimizer's step starts and ends (torch's step pre/post hooks), and the step
ends. The phases between the marks:

- ``forward``: the model's forward, with every wait inside it (an all-gather overlapped with it);
- ``backward``: loss, backward and everything until ``step()`` is called (DDP waits there for
  every bucket's reduction; distamp's ``scale_loss`` checks and unscales on exit);
- ``step``: ``optimizer.step()``;
- ``other``: the batch, DDP's pre-forward work, ``zero_grad``.

On an emulated cluster (``--nodes``) a thread samples this rank's byte counters of its link
(``/proc/self/net/dev``, the interface gloo is bound to) every millisecond; each phase's bytes sent
divided by what the link could have sent in that time says how busy the wire was in it. A
configuration whose optimizer has no torch step hooks (DeepSpeed's) has no ``step`` phase: its
step (and its ``zero_grad``) is counted in ``backward``; the table prints "-" for it, not 0.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

PHASES = ("other", "forward", "backward", "step")
"""In the order they run within a step; each runs from its mark to the next one."""


def _sent_bytes(iface: str) -> int:
    """Bytes this network namespace has sent through ``iface`` (``/proc/self/net/dev``)."""
    for line in Path("/proc/self/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == iface:
            return int(fields.split()[8])  # receive: 8 fields, then transmit bytes
    raise ValueError(f"phases: expected interface {iface!r} in /proc/self/net/dev, not found")


class Phases:
    """Marks per step (see the module docstring) and, with ``iface``, the link's bytes sent."""

    def __init__(self, model: nn.Module, optimizer: Any, iface: str | None) -> None:
        self.steps: list[list[tuple[str, float]]] = []
        self._marks: list[tuple[str, float]] = []
        self._flushed_at: float | None = None
        model.register_forward_pre_hook(lambda *_: self.mark("forward"))
        model.register_forward_hook(lambda *_: self.mark("backward"))
        self.phases = PHASES
        """The phases measured: without step hooks, ``step`` is not (it is counted in backward)."""
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.register_step_pre_hook(lambda *_: self.mark("step"))
            optimizer.register_step_post_hook(lambda *_: self.mark("other"))
        else:
            self.phases = tuple(p for p in PHASES if p != "step")
        self.iface = iface
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if iface is not None:
            _sent_bytes(iface)  # fails here, not in the thread, when the interface is not there
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        assert self.iface is not None
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), _sent_bytes(self.iface)))
            time.sleep(0.001)

    def mark(self, phase: str) -> None:
        self._marks.append((phase, time.perf_counter()))

    def begin(self) -> None:
        """A step starts (before its batch is made)."""
        self._marks = [("other", time.perf_counter())]

    def end(self) -> None:
        """The step ended (after it returned)."""
        self.steps.append([*self._marks, ("end", time.perf_counter())])

    def flushed(self) -> None:
        """The work the last timed step deferred (an all-gather in flight) is done: "MB sent/step"
        counts the bytes from the first timed step's start to here. Counted per window, the
        overlapped rows lost one gather per run: the warm-up's went out before the first window
        (in the barrier), the last step's after the last (an audit)."""
        self._flushed_at = time.perf_counter()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sent_at(self, t: float) -> float:
        """Bytes sent by time ``t``, interpolated between the samples around it."""
        s = self.samples
        lo, hi = 0, len(s) - 1
        if t <= s[0][0]:
            return s[0][1]
        if t >= s[-1][0]:
            return s[-1][1]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if s[mid][0] <= t else (lo, mid)
        (t0, b0), (t1, b1) = s[lo], s[hi]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0)

    def summary(self, link_bits: float | None) -> dict[str, Any]:
        """Per phase measured: median seconds per step and, with a link, the link's busy fraction
        in it (bytes sent / (line rate x the phase's time), over all timed steps) and MB sent/step.
        A phase not measured (``step`` without step hooks) has no entries."""
        seconds: dict[str, list[float]] = {p: [] for p in PHASES}
        sent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        for marks in self.steps:
            per = dict.fromkeys(PHASES, 0.0)
            sent_step = dict.fromkeys(PHASES, 0.0)
            for (phase, t0), (_, t1) in itertools.pairwise(marks):
                per[phase] += t1 - t0
                if self.samples:
                    sent_step[phase] += self._sent_at(t1) - self._sent_at(t0)
            for p in PHASES:
                seconds[p].append(per[p])
                sent[p] += sent_step[p]
        out: dict[str, Any] = {
            p: statistics.median(v) if v else 0.0 for p, v in seconds.items() if p in self.phases
        }
        n = len(self.steps)
        if self.samples and link_bits and n:
            for p in self.phases:
                total_s = sum(seconds[p])
                out[f"{p}_busy"] = sent[p] * 8 / (link_bits * total_s) if total_s else 0.0
            total = (
                self._sent_at(self._flushed_at) - self._sent_at(self.steps[0][0][1])
                if self._flushed_at is not None
                else sum(sent.values())
            )
            out["sent_mb"] = total / n / 1e6
            whole = sum(sum(v) for v in seconds.values())
            out["busy"] = sum(sent.values()) * 8 / (link_bits * whole) if whole else 0.0
        return out


def markdown(rows: list[tuple[str, dict[str, Any]]], link: str | None) -> str:
    """The phases table: one row per configuration (rank 0's medians); "-" where a phase was not
    measured separately, said in a footnote."""
    head = ["configuration", *(f"{p} ms" for p in PHASES)]
    if link:
        head += [f"link busy in {p}" for p in PHASES] + ["link busy, whole step", "MB sent/step"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for config, s in rows:
        cells = [f"{s[p] * 1e3:.0f}" if p in s else "-" for p in PHASES]
        if link:
            cells += [f"{s[f'{p}_busy']:.0%}" if f"{p}_busy" in s else "-" for p in PHASES]
            cells += [f"{s['busy']:.0%}" if "busy" in s else "-"]
            cells += [f"{s['sent_mb']:.1f}" if "sent_mb" in s else "-"]
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    if any(p not in s for _, s in rows for p in PHASES):
        lines += [
            "",
            '"-": not measured separately: an optimizer without torch step hooks (DeepSpeed\'s) has '
            "its step counted in backward.",
        ]
    return "\n".join(lines) + "\n"
