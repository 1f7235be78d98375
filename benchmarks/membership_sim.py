"""The simulated members of ``bench_membership``: real members (their own lease or their node's,
member key, join requests and seat watch, the classes a worker uses) as threads of a child
process, and an etcd client that counts its requests.

Owns ``worker_main`` (one child process's members, driven by the parent over a pipe),
``SimMember``, ``SimNode`` (``elastic run --node-lease`` for K of them) and ``CountingClient``
(also used by ``bench_round_store``). Forms no process group.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.worker_lease_file import heartbeat
from elastic.cluster.rounds.membership import EtcdMembership, NodeLease
from elastic.cluster.rounds.news import NewsReader
from elastic.cluster.rounds.rendezvous import Rendezvous, RendezvousConfig
from elastic.cluster.rounds.topology import Topology
from elastic.cluster.rounds.tracker import RoundTracker
from elastic.foundation.errors import FencedError
from elastic.foundation.timeouts import Timeouts

JOB = "bench-membership"
_WRITES = ("put", "create", "replace", "register", "delete", "lease grant", "lease revoke")


class CountingClient(EtcdClient):
    """An ``EtcdClient`` that counts its requests by kind and the watch events it delivers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _call(self, op, what, retry_for=None):  # type: ignore[no-untyped-def]
        if what != "lease keepalive":  # counted per lease, below
            with self._count_lock:
                self.counts["write" if what.startswith(_WRITES) else "read"] += 1
        return super()._call(op, what, retry_for)

    def refresh_many(self, leases, retry_for=None):  # type: ignore[no-untyped-def]
        with self._count_lock:
            self.counts["keepalive"] += len(leases)
            self.counts["keepalive_batches"] += 1
        return super().refresh_many(leases, retry_for)

    def watch_range(self, keys, start_revision, callback,  # type: ignore[no-untyped-def]
                    on_open=None):
        def counted(events):  # type: ignore[no-untyped-def]
            with self._count_lock:
                self.counts["watch_events"] += len(events)
            callback(events)

        with self._count_lock:
            self.counts["watches"] += 1
        return super().watch_range(keys, start_revision, counted, on_open)


class SimNode:
    """The launcher's part of ``elastic run --node-lease`` for K simulated members: one lease,
    granted when the first of them registers, renewed until ``stop``."""

    def __init__(self, client: EtcdClient, timeouts: Timeouts, stop: threading.Event,
                 heartbeats: Path) -> None:
        self._client, self._timeouts, self._stop = client, timeouts, stop
        self._heartbeats = heartbeats
        self._lock = threading.Lock()
        self._shared = itertools.count()  # names each member's heartbeat file
        self.lease = 0

    def share(self) -> NodeLease:
        """The node's lease for one member (granting it first, once)."""
        with self._lock:
            if not self.lease:
                self.lease = self._client.grant(self._timeouts.lease_ttl)
                # As the launcher's own membership renews it: on its client's renewal thread.
                self._client.renewals.add(self.lease, self._timeouts.keepalive,
                                          lambda outcome: not self._stop.is_set())
        path = str(self._heartbeats / f"{self.lease:x}-{next(self._shared)}")
        return NodeLease(self.lease, lambda member: None, lambda: heartbeat(path))


PORT = 29500  # the master port every simulated member offers (no group is formed)


class SimMember:
    """The etcd half of one worker (``Cluster`` without torch): membership, rendezvous and the
    change monitor, wired as ``Cluster._register`` and ``Cluster.form`` wire them."""

    def __init__(self, client: EtcdClient, timeouts: Timeouts,
                 max_workers: int | None = None, node: SimNode | None = None) -> None:
        keys = JobKeys(JOB)
        self.client = client
        self.node = node
        self.membership = EtcdMembership(client, keys, "127.0.0.1", timeouts,
                                         claim=keys.coordinator)
        self.registered = threading.Event()
        self.rendezvous = Rendezvous(client, self.membership,
                                     RendezvousConfig(min_workers=max(1, (max_workers or 0) - 1),
                                                      max_workers=max_workers, timeouts=timeouts))
        self.broken = threading.Event()
        self.monitor = RoundTracker(NewsReader(keys), lambda reason: self.broken.set())
        self.membership.add_listener(self.monitor.on_events)
        self.topology: Topology | None = None

    def register(self) -> None:
        if self.node is not None:
            self.membership.node_lease = self.node.share()
        # As a worker's registration does (``Cluster``): it carries the first join request.
        self.membership.register(self.rendezvous.first_join("start", 0, PORT))
        self.registered.set()

    def form(self, reason: str) -> Topology:
        self.monitor.disarm()
        self.broken.clear()
        topology = None
        while topology is None:
            topology = self.rendezvous.join(reason, 0, PORT)
            reason = "spare"
        self.monitor.arm(topology, self.client)
        self.topology = topology
        return topology


def _member_thread(member: SimMember, go: threading.Event, stop: threading.Event,
                   times: dict[int, float], victim: threading.Event, limit_s: float) -> None:
    if not go.wait(limit_s):
        return
    try:
        member.register()
        topology = member.form("start")
        times[topology.round] = time.time()
        while not stop.is_set():
            # Woken by its round breaking, or by ``stop`` (which sets ``broken`` too): a member
            # that polled here would load the machine as no real worker does.
            if not member.broken.wait(limit_s) or stop.is_set():
                continue
            if victim.is_set():
                return
            topology = member.form("failure")
            times[topology.round] = time.time()
    except FencedError:
        times[0] = time.time()  # its lease expired: the process starved its keepalive thread


def threads_cpu_s() -> dict[str, float]:
    """This process's CPU time (user + system, from ``/proc``) by kind of thread: the members'
    own threads, each named thread of the etcd client and the coordinator, and the threads that
    Python did not start (gRPC's). A thread that ended took its time with it."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    cpu: Counter[str] = Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{task}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # after the name: state is field 3
        name = names.get(int(task), "native")
        kind = "member" if name.endswith("(_member_thread)") else name
        cpu[kind] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return dict(cpu)


def wait_for(condition: Callable[[], bool], limit_s: float, stop: threading.Event) -> None:
    """Until ``condition()`` holds, at most ``limit_s``: the parent's look at the member
    threads' own records, every 50 ms (the members themselves do not poll)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not condition():
        stop.wait(0.05)


def worker_main(conn: Any, url: str, count: int, limit_s: float, lease_ttl_s: float,
                max_workers: int | None, per_node: int = 1, connections: int = 1,
                heartbeats: str = "") -> None:
    """One process of members, driven by the parent over ``conn``; its members share
    ``connections`` etcd clients (a node's members share its node's, and write their heartbeats
    under ``heartbeats``, a directory the parent owns)."""
    timeouts = Timeouts.from_env({}, lease_ttl=timedelta(seconds=lease_ttl_s)) if lease_ttl_s \
        else Timeouts()
    clients = [CountingClient(url, timeouts=timeouts) for _ in range(connections)]
    go, stop = threading.Event(), threading.Event()
    assert heartbeats or per_node == 1, "members sharing a node's lease need a heartbeat folder"
    nodes = [SimNode(clients[node % connections], timeouts, stop, Path(heartbeats))
             if per_node > 1 else None for node in range(-(-count // per_node))]
    members = [SimMember(clients[(i // per_node) % connections], timeouts, max_workers,
                         nodes[i // per_node]) for i in range(count)]
    times: list[dict[int, float]] = [{} for _ in members]
    victims = [threading.Event() for _ in members]
    threads = [threading.Thread(target=_member_thread, args=(m, go, stop, t, v, limit_s),
                                daemon=True) for m, t, v in zip(members, times, victims)]
    for thread in threads:
        thread.start()
    conn.send("ready")
    while True:
        command, arg = conn.recv()
        if command == "go":  # arg: reply only once every member of this process registered
            go.set()
            if arg:
                for member in members:
                    member.registered.wait(limit_s)
            conn.send(None)
        elif command == "await":  # arg: the round every member (but victims) must hold
            wait_for(lambda: all(arg in t for t, v in zip(times, victims) if not v.is_set()),
                     limit_s, stop)
            conn.send({"times": [t.get(arg) for t, v in zip(times, victims) if not v.is_set()],
                       # Its thread raised, or it was fenced while it waited for news
                       # (the victim of a death is fenced by design: not counted).
                       "fenced": sum(0 in t or (m.membership.fenced.is_set() and not v.is_set())
                                     for t, m, v in zip(times, members, victims)),
                       "plans": [(m.membership.member_id, m.topology.rank if m.topology else -1)
                                 for m in members]})
        elif command == "told":  # arg: the round whose news every member (but victims) heard
            wait_for(lambda: all(m.monitor.reader.told >= arg
                                 for m, v in zip(members, victims) if not v.is_set()),
                     limit_s, stop)
            conn.send(None)
        elif command == "counts":
            counts: Counter[str] = Counter()
            for client in clients:
                counts.update(client.counts)
            conn.send({"counts": dict(counts), "cpu": threads_cpu_s()})
        elif command == "victim":  # arg: member id; replies its lease
            lease = 0
            for member, victim in zip(members, victims):
                if member.membership.member_id == arg:
                    victim.set()
                    lease = member.membership.lease
            conn.send(lease)
        elif command == "stop":
            stop.set()
            for member in members:
                member.broken.set()
            for thread in threads:
                thread.join(timeout=5)
            conn.send(None)
            return
