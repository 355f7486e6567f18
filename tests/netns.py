"""Hosts for launch tests: network namespaces joined by a veth pair, each with its own address.

Only the namespaces this module creates hold the addresses (10.X.Y.0/24, X and Y drawn at random),
so nothing outside them is touched. Everything running inside is killed and the namespaces are
deleted when the ``hosts`` context ends, passed or failed; namespaces a killed test run left
behind are removed by the next one (their names carry the creating pid).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "distamp-t"


@dataclass(frozen=True)
class Host:
    netns: str
    """The namespace's name (``ip netns exec NAME ...``)."""
    iface: str
    """Its end of the veth pair."""
    addr: str
    """Its IPv4 address on that interface."""

    @property
    def nsenter(self) -> list[str]:
        """A command prefix that enters only this host's network namespace (``ip netns exec``
        also mounts a fresh /sys, without the cgroup filesystem that slurmd needs)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}"]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _remove(name: str) -> None:
    """Kill what runs in namespace ``name`` (only the tests start processes there), delete it."""
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", name, check=False)  # its end of the veth pair goes with it


def _remove_stale() -> None:
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\w+-[ab]", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _remove(name)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair; skips the test where they cannot be created."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); this test runs as a user")
    subprocess.run(["bash", str(ROOT / "scripts" / "system-deps.sh"), "iproute2"], check=False)
    if shutil.which("ip") is None:
        pytest.skip("no 'ip' command: iproute2 is not installed and could not be installed")
    _remove_stale()
    tag = secrets.token_hex(3)
    subnet = f"10.{random.randrange(256)}.{random.randrange(256)}"
    a, b = (
        Host(f"{PREFIX}-{os.getpid()}-{tag}-{side}", f"dv{tag}{side}", f"{subnet}.{n}")
        for n, side in ((1, "a"), (2, "b"))
    )
    created: list[str] = []
    try:
        for host in (a, b):
            made = ip("netns", "add", host.netns, check=False)
            if made.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
            created.append(host.netns)
        ip("link", "add", a.iface, "type", "veth", "peer", "name", b.iface)
        for host in (a, b):
            ip("link", "set", host.iface, "netns", host.netns)
            ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.iface)
            ip("-n", host.netns, "link", "set", "lo", "up")
            ip("-n", host.netns, "link", "set", host.iface, "up")
        yield a, b
    finally:
        for name in created:
            _remove(name)
        ip("link", "del", a.iface, check=False)  # if it never reached its namespace
