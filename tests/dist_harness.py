"""Run a function on N real gloo ranks (spawned processes, file:// rendezvous) and collect results."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0
GRACE_AFTER_DEATH_S = 10.0


SHARD_BLOCK_ENV = "DISTAMP_TEST_SHARD_BLOCK"
"""Environment variable the spawned ranks read: elements per block of sharded masters."""


_CONTEXT = mp.get_context("forkserver")
# [Note: ranks forked from a server that imported torch] Every rank used to be spawned: a fresh
# interpreter importing torch and distamp, ~2-3 s of two busy cores per rank, for several hundred
# multi-rank tests. A fork server imports them once (per pytest worker); each rank is forked
# from it. What spawn gave for free is passed explicitly: the test's environment (a fork server
# keeps the one it started with; tests set variables with monkeypatch), and sys.path
# (multiprocessing hands it over for forkserver as for spawn). Nothing runs in the server but
# imports: no threads, no process group, so forking it is safe.
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "distamp", "tests.dist_harness"])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    out_dir: str,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    block = os.environ.get(SHARD_BLOCK_ENV)
    if block:
        # Smaller blocks of sharded masters, so that tiny test models have several rounds of
        # them (see [Note: block-cyclic shards] in distamp/masters/layout.py); set by ``small_blocks``.
        import distamp.masters.sharded

        distamp.masters.sharded.BLOCK = int(block)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            result = fn(rank, world_size, *args)
            # gloo aborts a rank that tears down while a peer still runs; a rank whose peer
            # failed must not wait for it forever.
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=60))
            except RuntimeError:
                pass
            torch.save({"ok": True, "result": result}, result_path)
        finally:
            dist.destroy_process_group()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise
    # See benchmarks/compare.py, [Note: exit without destructors]: gloo's process group can
    # deadlock in its destructor at exit; the result is saved, so leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (spawned processes import it). A rank that raises makes
    this raise with that rank's traceback; a hang is killed after ``timeout`` seconds, and the
    surviving ranks are killed ``GRACE_AFTER_DEATH_S`` after one rank died by a signal.
    """
    with tempfile.TemporaryDirectory(prefix="distamp-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        environ = dict(os.environ)
        procs = [
            _CONTEXT.Process(
                target=_entry, args=(fn, rank, world_size, init_file, tmp, args, environ)
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        # Like torchrun: once a rank dies by a signal (killed, crashed), the others cannot finish
        # their collectives; stop them after a grace period instead of waiting for the timeout.
        deadline = time.monotonic() + timeout
        died_at: float | None = None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if died_at is None and any(p.exitcode is not None and p.exitcode < 0 for p in procs):
                died_at = time.monotonic()
            if died_at is not None and time.monotonic() > died_at + GRACE_AFTER_DEATH_S:
                break
            time.sleep(0.05)
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        outcomes = []
        errors = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
                outcomes.append(None)
                continue
            outcome = torch.load(path, weights_only=False)
            if not outcome["ok"]:
                errors.append(f"rank {rank} raised:\n{outcome['error']}")
            outcomes.append(outcome.get("result"))
        if hung:
            errors.insert(0, f"ranks {hung} did not finish within {timeout:.0f}s (killed)")
        if errors:
            raise AssertionError("\n".join(errors))
        return outcomes
