"""Every listener of a worker is on its advertise address, off loopback too (a network namespace
with its own veth pair; no traffic leaves it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import WORKERS

NS = f"elastic-bind-{os.getpid()}"
ADDR = "10.231.0.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace with lo and a veth pair (10.231.0.1 <-> 10.231.0.2) inside it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    try:
        _ip("netns", "add", NS)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a network namespace here: {exc.stderr.decode().strip()}")
    try:
        inside = ("-n", NS)
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
        _ip(*inside, "addr", "add", "10.231.0.1/24", "dev", "veth0")
        _ip(*inside, "addr", "add", f"{ADDR}/24", "dev", "veth1")
        _ip(*inside, "link", "set", "veth0", "up")
        _ip(*inside, "link", "set", "veth1", "up")
        yield NS
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=30)


@pytest.mark.timeout(150)
def test_every_listener_of_a_worker_is_on_its_advertise_address(namespace, tmp_path: Path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="1")
    run = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-m", "elastic", "run", "-n", "2",
         "--min-workers", "2",  # a slow second start must not leave a world of one to finish
         "--advertise-addr", ADDR, str(WORKERS / "listeners.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in (0, 1):
        listeners = json.loads((tmp_path / f"listeners-{rank}.json").read_text())
        assert listeners, f"rank {rank} listens nowhere: the probe is wrong"
        assert all(entry.startswith(f"{ADDR}:") for entry in listeners), (rank, listeners)
