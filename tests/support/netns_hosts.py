"""Test "hosts" made of network namespaces on one machine, for partition tests.

One namespace holds a bridge (the switch); every host namespace is joined to it by a veth pair
and gets one address in 10.233.0.0/24. Nothing is added to the machine's own namespace, so no
traffic can leave the namespaces this makes; ``close`` deletes them all (the veths go with
them). Links are cut with blackhole routes on both ends and healed by deleting them.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

SUBNET = "10.233.0"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def skip_without_namespaces() -> None:
    """Skips the calling test, saying why, where namespaces cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")


class Hosts:
    """Namespaces ``name -> address`` behind one bridge.

    Args:
        names: the hosts to make, in order; the first gets ``SUBNET.1``, the next ``.2``, ...
    """

    def __init__(self, names: list[str]) -> None:
        tag = os.getpid()
        self.switch = f"el-sw-{tag}"
        self.namespaces = {name: f"el-{name}-{tag}" for name in names}
        self.addresses = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self._cuts: set[tuple[str, str]] = set()
        self._made: list[str] = []
        try:
            self._build()
        except subprocess.CalledProcessError as exc:
            self.close()
            pytest.skip(f"cannot make network namespaces here: {exc.stderr.decode().strip()}")

    def _build(self) -> None:
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.namespaces.items()):
            ip("netns", "add", ns)
            self._made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
            port = f"port{i}"
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
               "netns", self.switch)
            ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", self.switch, "link", "set", port, "master", "br0")
            ip("-n", self.switch, "link", "set", port, "up")

    def command(self, name: str, *argv: str) -> list[str]:
        """``argv`` run inside host ``name``."""
        return ["ip", "netns", "exec", self.namespaces[name], *argv]

    def cut(self, a: str, b: str) -> None:
        """Drops every packet between hosts ``a`` and ``b`` (both ways)."""
        ip("-n", self.namespaces[a], "route", "add", "blackhole", f"{self.addresses[b]}/32")
        ip("-n", self.namespaces[b], "route", "add", "blackhole", f"{self.addresses[a]}/32")
        self._cuts.add((a, b))

    def heal(self) -> None:
        """Removes every cut."""
        for a, b in self._cuts:
            ip("-n", self.namespaces[a], "route", "del", "blackhole", f"{self.addresses[b]}/32")
            ip("-n", self.namespaces[b], "route", "del", "blackhole", f"{self.addresses[a]}/32")
        self._cuts.clear()

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
