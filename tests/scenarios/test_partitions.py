"""Partitions between machines: three worker hosts and an etcd host, made of network namespaces
joined by a bridge (``tests/support/netns_hosts.py``); a host is cut from etcd only, rank 0's
host from its peers only, then another host from everything, and healed each time.

What must hold: the majority goes on without the cut host within the lease TTL (the peer
timeout, for a cut from the peers only) plus a little; the cut host never trains again under
its old identity; after healing it comes back as a new member and the world is whole again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.launch.embedded_etcd import find_etcd_binary
from tests.support.cli import WORKERS, events, wait_until
from tests.support.harness import REPO, dump_stacks
from tests.support.netns_hosts import Hosts, skip_without_namespaces

pytestmark = pytest.mark.timeout(240)
TTL_S = 2.0
PEER_S = 2.5  # the default peer timeout
# README's Known limits: a released gloo collective can stay blocked until it times out (seen in
# about 1 of 10 runs of this test, on a survivor of any cut); README's advice, short collective
# timeouts, bounds that wait here to seconds instead of 30 minutes.
COLLECTIVE_S = 4.0
SHORT_COLLECTIVES = {"ELASTIC_COLLECTIVE_TIMEOUT": str(COLLECTIVE_S), "ELASTIC_FORM_TIMEOUT": "3",
                     "ELASTIC_SYNC_TIMEOUT": str(COLLECTIVE_S)}
HOSTS = ["etcd", "h1", "h2", "h3"]


class Job:
    """etcd on host ``etcd`` and one worker on each of h1..h3; every process in its own session,
    ended by pid."""

    def __init__(self, hosts: Hosts, tmp: Path) -> None:
        self.hosts, self.tmp, self.log_dir = hosts, tmp, tmp / "events"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        etcd_ip = hosts.addresses["etcd"]
        self.url = f"http://{etcd_ip}:2379"
        self._start("etcd", [find_etcd_binary(), "--name", "e", "--data-dir", str(tmp / "etcd"),
                             "--listen-client-urls", self.url, "--advertise-client-urls",
                             self.url, "--listen-peer-urls", f"http://{etcd_ip}:2380",
                             "--initial-advertise-peer-urls", f"http://{etcd_ip}:2380",
                             "--initial-cluster", f"e=http://{etcd_ip}:2380"], {})
        for host in ("h1", "h2", "h3"):
            self._start(host, [sys.executable, str(WORKERS / "elastic_worker.py"), "--steps",
                               "1000000", "--step-ms", "20"], {
                "PYTHONPATH": str(REPO), "ELASTIC_ETCD": self.url, "ELASTIC_JOB_ID": "part",
                "ELASTIC_ADVERTISE_ADDR": hosts.addresses[host], "GLOO_SOCKET_IFNAME": "eth0",
                "ELASTIC_LEASE_TTL": str(TTL_S), "ELASTIC_LOG_DIR": str(self.log_dir),
                "OMP_NUM_THREADS": "1", **SHORT_COLLECTIVES})

    def _start(self, host: str, argv: list[str], extra: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "ELASTIC_ETCD")}
        env.update(extra)
        log = open(self.tmp / f"{host}.log", "wb")
        self.procs[host] = subprocess.Popen(self.hosts.command(host, *argv), env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        log.close()

    def pid(self, host: str) -> int:
        return self.procs[host].pid  # `ip netns exec` execs the command: the same pid

    def resumed(self, host: str, since: float, world: int) -> list[dict]:
        return [e for e in events(self.log_dir) if e["event"] == "resumed"
                and e["pid"] == self.pid(host) and e["t"] > since and e["world_size"] == world]

    def member(self, host: str) -> str:
        joined = [e for e in events(self.log_dir) if e["pid"] == self.pid(host)
                  and e["event"] in ("joined", "reregistered")]
        return joined[-1]["member"]

    def logs(self) -> str:
        return "\n".join(f"--- {host}\n{(self.tmp / f'{host}.log').read_text()[-1500:]}"
                         for host in self.procs)

    def dump_stacks(self) -> None:
        dump_stacks(self.procs[host] for host in ("h1", "h2", "h3"))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    skip_without_namespaces()
    hosts = Hosts(HOSTS)
    try:
        running = Job(hosts, tmp_path)
        try:
            yield running
        finally:
            running.stop()
    finally:
        hosts.close()


def wait_for(job: Job, condition, timeout: float, what: str) -> None:
    try:
        wait_until(condition, timeout, what)
    except AssertionError as exc:
        job.dump_stacks()
        raise AssertionError(f"{exc}\n{job.logs()}") from None


def rank_zero(job: Job) -> str:
    """The host whose worker is rank 0 of the newest round it resumed in."""
    newest = {h: job.resumed(h, 0, 3)[-1] for h in ("h1", "h2", "h3")}
    return next(h for h, e in newest.items() if e["rank"] == 0)


def cut_and_heal(job: Job, host: str, etcd: bool, peers: bool) -> float:
    """Cuts ``host`` from etcd and/or from the other two, checks the majority and the cut host,
    heals, and waits for the whole world; returns the majority's recovery time."""
    others = [h for h in ("h1", "h2", "h3") if h != host]
    old_member = job.member(host)
    cut_at = time.time()
    for other in ["etcd"] * etcd + others * peers:
        job.hosts.cut(host, other)
    wait_for(job, lambda: all(job.resumed(h, cut_at, 2) for h in others), 30,
             f"{' and '.join(others)} to go on in a world of 2 without {host}")
    went_on = max(job.resumed(h, cut_at, 2)[0]["t"] for h in others) - cut_at
    # The gloo release race (Known limits): a survivor's send waited for its timeout.
    raced = any(e["event"] == "failure_detected" and "for send operation" in e.get("error", "")
                and e["t"] > cut_at for e in events(job.log_dir))
    healed_at = time.time()
    assert not [e for e in events(job.log_dir) if e["pid"] == job.pid(host)
                and e["t"] > cut_at and e["event"] == "resumed"], f"{host} trained while cut off"
    job.hosts.heal()
    wait_for(job, lambda: all(job.resumed(h, healed_at, 3) for h in ("h1", "h2", "h3")), 60,
             "the healed host to rejoin a world of 3")
    assert job.member(host) != old_member, f"{host} came back under its old identity"
    # Reported, not asserted: how soon the majority goes on is the soak benchmark's claim
    # (python -m benchmarks soak); the wait above is the hang guard.
    if raced:
        print(f"the gloo release race: a survivor's send waited ({COLLECTIVE_S:g} s)")
    return went_on


def test_a_host_cut_from_etcd_its_peers_or_everything_is_dropped_and_rejoins_when_healed(
        job: Job):
    wait_for(job, lambda: all(job.resumed(h, 0, 3) for h in ("h1", "h2", "h3")), 90,
             "a world of 3")
    from_etcd = cut_and_heal(job, "h1", etcd=True, peers=False)
    # rank 0 holds every agreement connection: its cut is the one that splits the job
    from_peers = cut_and_heal(job, rank_zero(job), etcd=False, peers=True)
    from_all = cut_and_heal(job, next(h for h in ("h1", "h2", "h3") if h != rank_zero(job)),
                            etcd=True, peers=True)
    print(f"the majority went on {from_etcd:.2f} s after a host was cut from etcd, "
          f"{from_peers:.2f} s after rank 0's host was cut from its peers (peer timeout "
          f"{PEER_S:g} s), {from_all:.2f} s after a host was cut from everything (lease TTL "
          f"{TTL_S:g} s)")
