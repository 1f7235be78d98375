"""What membership and rendezvous cost etcd as the job grows: N simulated members, one etcd.

Usage: ``.venv/bin/python benchmarks/bench_membership.py [--sizes 10,100,300,1000] [--procs 4]
[--declared-size] [--coordinator-apart] [--workers-per-node K] [--connections K] [--idle S]
[--timeline] [--label after] [--limit 120] [--out benchmarks/results/membership-DATE.json]``.

For each N, a fresh etcd is started on 127.0.0.1 (its own process, so that its CPU time and
``/metrics`` belong to that N alone), and ``--procs`` processes each run N / procs members as
threads; the job's coordinator is whichever registers first. With ``--coordinator-apart`` the
first member registers alone in a process of its own, and so becomes the coordinator, before
the others start: as in a real job, where the coordinator is one worker process, its watch does
not compete for one interpreter with hundreds of other members' threads (measured slower here,
not faster). With ``--workers-per-node K`` the members of each process form nodes of K that
share one lease, as ``elastic run --node-lease`` does: the node's lease is granted when its
first member registers and renewed as its launcher renews it (on the client's renewal thread);
each member reports its id and sends heartbeats (a file touched per keepalive interval, from a
thread of its own), and the death removes the victim's keys (``drop_member``, what its launcher
does) instead of revoking a lease of its own.

The members of one process share one etcd client unless ``--connections K`` spreads them over
K clients (K connections, K loop threads): a real worker process has one member and a connection
of its own, while here 250 members' requests, watch creates and renewals go through one.

Every member is a real one: its own lease (or its node's), renewed as a worker's is (by its
client's renewal thread, ``elastic.cluster.etcd.lease_renewals``, which here batches the renewals of
the process's members), its own member key, its own join requests, the same classes a worker uses (``SimMember`` below mirrors
the etcd half of ``elastic.cluster.cluster.Cluster``); the members of one process share one
etcd client (one gRPC connection). No torch collectives are run.

Measured, per N:

- first round: from the moment every member is told to join to the moment the last one holds
  the plan of round 1 (its seat; the phase's counts go on until every member has heard the
  round's news, which comes after the seats);
- one death: the lease of one member (rank N-1) is revoked, as its launcher does after a
  SIGKILL; from the revoke to the moment the last survivor holds the next plan;
- per member and per change (each phase above is one change): etcd requests and writes, and
  watch events delivered, counted in the client (keepalives are counted apart, they are
  periodic, not per change), and etcd's own counts from its ``/metrics`` (gRPC requests handled
  and watch events sent);
- etcd's CPU time (user + system from ``/proc/PID/stat``) per phase, and the member
  processes' own, by kind of thread (the members', the etcd client's loop, the lease renewals',
  the coordinator's, gRPC's);
- the revisions and database bytes a phase adds to etcd's history (per member: what a change
  costs the ``--quota-backend-bytes`` of an etcd that does not compact);
- with ``--idle S``: lease renewals per member and second over S seconds after the death, while
  nothing changes (what a job costs etcd when it only trains).
- with ``--timeline``, per phase: when the member keys (first round), join requests, plan,
  seats and news were written (10, 50 and 100 % of each kind), from the keys' revisions and
  etcd's revision sampled every 10 ms by the parent (to within a sample, which comes later when
  etcd is slow to answer); when half of the members and the last held their seat; and, in a
  death, when the parent heard the news that the round broke.

A phase that does not finish within ``--limit`` seconds is recorded as not finished, with the
counts reached by then.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from elastic.cluster.etcd.client import EtcdClient  # noqa: E402
from elastic.cluster.rounds.keys import JobKeys  # noqa: E402
from elastic.cluster.worker_lease_file import heartbeat  # noqa: E402
from elastic.cluster.rounds.membership import EtcdMembership, NodeLease, drop_member  # noqa: E402
from elastic.cluster.rounds.news import NewsReader, RoundNews  # noqa: E402
from elastic.cluster.rounds.rendezvous import Rendezvous, RendezvousConfig  # noqa: E402
from elastic.cluster.rounds.topology import Topology  # noqa: E402
from elastic.cluster.rounds.tracker import RoundTracker  # noqa: E402
from elastic.foundation.errors import FencedError  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402
from elastic.foundation.timeouts import Timeouts  # noqa: E402

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


def etcd_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def etcd_metrics(url: str) -> dict[str, float]:
    """etcd's own counts: gRPC requests handled (all, and the KV writes), lease keepalive
    streams opened and renewals received, watch events, the bytes it sent to clients, its
    revision, and the bytes its database holds (its history: what fills
    ``--quota-backend-bytes`` until compacted)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            value = float(line.rsplit(" ", 1)[1])
            out["requests"] += value
            if 'grpc_method="Put"' in line or 'grpc_method="Txn"' in line \
                    or 'grpc_method="DeleteRange"' in line:
                out["kv_writes"] += value
            if 'grpc_method="LeaseKeepAlive"' in line:
                out["keepalive_streams"] += value
        elif line.startswith("grpc_server_started_total{") \
                and 'grpc_method="LeaseKeepAlive"' in line:
            out["keepalive_streams_opened"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("grpc_server_msg_received_total{") \
                and 'grpc_method="LeaseKeepAlive"' in line:
            out["keepalives"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_network_client_grpc_sent_bytes_total "):
            out["sent_bytes"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_debugging_mvcc_events_total "):
            out["watch_events"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_debugging_mvcc_watcher_total "):
            out["watchers"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_debugging_mvcc_current_revision "):
            out["revisions"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_mvcc_db_total_size_in_use_in_bytes "):
            out["history_bytes"] = float(line.rsplit(" ", 1)[1])
    return dict(out)


class RevisionClock:
    """Samples etcd's revision against the wall clock from a thread of its own, so that the
    revisions of keys read afterwards can be told as times: one read of an empty range every
    ``every_s`` (a few hundred requests a phase, against the members' thousands)."""

    def __init__(self, client: EtcdClient, every_s: float = 0.01) -> None:
        self._client, self._every_s = client, every_s
        self._stop = threading.Event()
        self.samples: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._sample, name="bench-clock", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._every_s):
            _, revision = self._client.get_prefix("/bench-clock/")
            self.samples.append((time.time(), revision))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def time_of(self, revision: int) -> float | None:
        """When ``revision`` was first seen (None: never, while sampling)."""
        return next((t for t, r in self.samples if r >= revision), None)


def timeline(clock: RevisionClock, kvs: list[Any], started: float, held: list[float],
             n: int = 1, broken_at: float | None = None) -> dict[str, float | None]:
    """Round ``n``'s milestones, in seconds after ``started``: when 10, 50 and 100 % of the
    member keys (round 1 only), join requests and seats were written (to within the clock's
    step), the plan and the news, and when half of the members and the last held their seat;
    with ``broken_at``, when the news that round ``n - 1`` broke was heard."""
    keys = JobKeys(JOB)

    def at(revision: int | None) -> float | None:
        t = None if revision is None else clock.time_of(revision)
        return None if t is None else round(t - started, 3)

    def spread(name: str, revisions: list[int]) -> dict[str, float | None]:
        revisions = sorted(revisions)
        if not revisions:
            return {}
        return {f"{name}_{pct}%": at(revisions[max(0, -(-len(revisions) * pct // 100) - 1)])
                for pct in (10, 50, 100)}

    by_key = {kv.key: kv for kv in kvs}
    plan = by_key.get(keys.plan(n))
    out: dict[str, float | None] = {}
    if n == 1:
        out.update(spread("registered", [kv.create_revision for kv in kvs
                                         if kv.key.startswith(keys.members)]))
    if broken_at is not None:
        out["broken_news"] = round(broken_at - started, 3)
    out.update(spread("joined", [kv.create_revision for kv in kvs
                                 if kv.key.startswith(keys.joins(n))]))
    out["plan"] = at(plan.create_revision if plan else None)
    out.update(spread("seated", [kv.mod_revision for kv in kvs if kv.key.startswith(keys.seats)
                                 and plan is not None and kv.mod_revision > plan.mod_revision]))
    news = by_key.get(keys.news)
    out["news"] = at(news.mod_revision if news else None)
    held = sorted(held)
    out["held_50%"] = round(held[len(held) // 2] - started, 3)
    out["held_100%"] = round(held[-1] - started, 3)
    return out


class BrokenNews:
    """When the parent first hears, by a watch of the news key, that a round broke."""

    def __init__(self, client: EtcdClient) -> None:
        self.at: float | None = None
        self._heard = threading.Event()
        _, revision = client.get_prefix(JobKeys(JOB).news)  # from here: a late create misses none
        self._cancel = client.watch_prefix(JobKeys(JOB).news, revision + 1, self._on_events)

    def _on_events(self, events: list[Any]) -> None:
        if self.at is None and any(e.kind == "put" and RoundNews.from_json(e.value).broken
                                   for e in events):
            self.at = time.time()
            self._heard.set()

    def stop(self, limit_s: float) -> None:
        """Stops watching once the news of the break was heard (at most ``limit_s``): a small
        job can re-form before this watch, which etcd may still be catching up, brings it."""
        self._heard.wait(limit_s)
        self._cancel()


def cpu_between(start: dict[str, Any], end: dict[str, Any]) -> dict[str, float]:
    """The member processes' CPU seconds by kind of thread between two snapshots."""
    return {k: round(v - start["cpu"].get(k, 0), 2) for k, v in sorted(end["cpu"].items())}


class Run:
    """One N: an etcd, the member processes, and the snapshots between phases."""

    def __init__(self, n: int, procs: int, limit_s: float, lease_ttl_s: float,
                 max_workers: int | None = None, coordinator_apart: bool = False,
                 per_node: int = 1, idle_s: float = 0.0, connections: int = 1,
                 timeline: bool = False) -> None:
        self.n, self.limit_s, self.per_node, self.idle_s = n, limit_s, per_node, idle_s
        self.timeline = timeline
        self.coordinator_apart = coordinator_apart and n > 1
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.heartbeats = ""
        self.etcd = EmbeddedEtcd(niceness=0, go_max_procs=None).start()
        try:
            self.admin = EtcdClient(self.etcd.url)
        except BaseException:
            self.etcd.stop()
            raise
        try:
            self._start(procs, limit_s, lease_ttl_s, max_workers, connections)
        except BaseException:  # what started so far, stopped (``close``), then the error
            self.close()
            raise

    def _start(self, procs: int, limit_s: float, lease_ttl_s: float, max_workers: int | None,
               connections: int) -> None:
        """Starts the member processes and waits until each is ready (``heartbeats`` is removed
        by ``close`` once they are gone, however they ended)."""
        if self.per_node > 1:
            self.heartbeats = tempfile.mkdtemp(prefix="bench-heartbeats-")
        ctx = mp.get_context("spawn")
        rest = self.n - 1 if self.coordinator_apart else self.n
        sizes = [rest // procs + (1 if i < rest % procs else 0) for i in range(procs)]
        if self.coordinator_apart:
            sizes.insert(0, 1)
        for size in (s for s in sizes if s):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, daemon=True,
                               args=(child, self.etcd.url, size, limit_s, lease_ttl_s, max_workers,
                                     self.per_node, min(connections, size), self.heartbeats))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(120):
                raise RuntimeError("a member process did not start within 120 s")
            conn.recv()

    def ask(self, command: str, arg: Any = None, timeout_s: float = 60,
            conns: list[Any] | None = None) -> list[Any]:
        conns = self.conns if conns is None else conns
        for conn in conns:
            conn.send((command, arg))
        replies = []
        for conn in conns:
            if not conn.poll(timeout_s):
                raise RuntimeError(f"a member process did not answer {command} in {timeout_s} s")
            replies.append(conn.recv())
        return replies

    def snapshot(self) -> dict[str, Any]:
        client: Counter[str] = Counter()
        cpu: Counter[str] = Counter()
        for reply in self.ask("counts"):
            client.update(reply["counts"])
            cpu.update(reply["cpu"])
        return {"client": dict(client), "cpu": dict(cpu), "etcd": etcd_metrics(self.etcd.url),
                "etcd_cpu_s": etcd_cpu_s(self.etcd.process.pid), "t": time.time()}

    def phase(self, name: str, start: dict[str, Any], end: dict[str, Any], started: float,
              replies: list[dict[str, Any]], members: int) -> dict[str, Any]:
        times = [t for reply in replies for t in reply["times"]]
        finished = bool(times) and all(t is not None for t in times)
        per = {f"client_{k}": round((end["client"].get(k, 0) - start["client"].get(k, 0))
                                    / members, 2) for k in end["client"]}
        per.update({f"etcd_{k}": round((v - start["etcd"].get(k, 0)) / members, 2)
                    for k, v in end["etcd"].items() if k != "watchers"})
        return {"phase": name, "finished": finished,
                "fenced": sum(reply["fenced"] for reply in replies),
                "seconds": round(max(times) - started, 3) if finished else None,
                "holding": sum(t is not None for t in times), "of": len(times),
                "etcd_cpu_s": round(end["etcd_cpu_s"] - start["etcd_cpu_s"], 3),
                "members_cpu_s": cpu_between(start, end),
                "per_member": per}

    def measure(self) -> dict[str, Any]:
        before = self.snapshot()
        clock = RevisionClock(self.admin) if self.timeline else None
        started = time.time()
        if self.coordinator_apart:  # the coordinator's registration first, then the others'
            self.ask("go", True, conns=self.conns[:1])
            self.ask("go", conns=self.conns[1:])
        else:
            self.ask("go")
        replies = self.ask("await", 1, timeout_s=self.limit_s + 60)
        # A member holds its round by its seat, which comes before the round's news: the news
        # is part of the first round's cost, not of the death's.
        if all(t is not None for reply in replies for t in reply["times"]):
            self.ask("told", 1, timeout_s=self.limit_s + 60)
        after = self.snapshot()
        first = self.phase("first_round", before, after, started, replies, self.n)
        if clock is not None:
            self.add_timeline(first, clock, started, replies, 1)
        result = {"n": self.n, "phases": [first]}
        if not first["finished"]:
            return result
        plans = dict(p for reply in replies for p in reply["plans"])
        victim = max(plans, key=plans.get)  # the member of the highest rank
        lease = max(self.ask("victim", victim))
        before = self.snapshot()
        if self.timeline:
            clock, broken = RevisionClock(self.admin), BrokenNews(self.admin)
        started = time.time()
        if self.per_node > 1:  # what its launcher does when it dies: the node's lease lives on
            drop_member(self.admin, JobKeys(JOB), victim, lease)
        else:  # what its launcher does when it dies: revoke its own lease
            self.admin.revoke(lease)
        replies = self.ask("await", 2, timeout_s=self.limit_s + 60)
        after = self.snapshot()
        death = self.phase("one_death", before, after, started, replies, self.n - 1)
        if self.timeline:
            broken.stop(self.limit_s)
            self.add_timeline(death, clock, started, replies, 2, broken.at)
        result["phases"].append(death)
        if self.idle_s:
            result["idle"] = self.idle(self.n - 1)
        return result

    def add_timeline(self, phase: dict[str, Any], clock: RevisionClock, started: float,
                     replies: list[dict[str, Any]], n: int,
                     broken_at: float | None = None) -> None:
        """Stops ``clock`` and, if the phase finished, adds round ``n``'s ``timeline`` to it."""
        clock.stop()
        if phase["finished"]:
            kvs, _ = self.admin.get_prefix(JobKeys(JOB).prefix)
            phase["timeline"] = timeline(clock, kvs, started,
                                         [t for reply in replies for t in reply["times"]],
                                         n, broken_at)

    def idle(self, members: int) -> dict[str, Any]:
        """Lease renewals per member and second while nothing changes, over ``idle_s``."""
        before = self.snapshot()
        threading.Event().wait(self.idle_s)  # the window measured, not a synchronisation
        after = self.snapshot()
        seconds = after["t"] - before["t"]
        rate = lambda end, start: round((end - start) / members / seconds, 3)  # noqa: E731
        return {"seconds": round(seconds, 2),
                "keepalives_per_member_s": rate(after["client"].get("keepalive", 0),
                                                before["client"].get("keepalive", 0)),
                "etcd_keepalives_per_member_s": rate(after["etcd"].get("keepalives", 0),
                                                     before["etcd"].get("keepalives", 0)),
                "keepalive_batches_per_s": round(
                    (after["client"].get("keepalive_batches", 0)
                     - before["client"].get("keepalive_batches", 0)) / seconds, 2),
                "etcd_cpu_s": round(after["etcd_cpu_s"] - before["etcd_cpu_s"], 3),
                "members_cpu_s": cpu_between(before, after)}

    def close(self) -> None:
        try:
            self.ask("stop", timeout_s=30)
        except (RuntimeError, OSError, EOFError):
            pass  # a stuck process is terminated below
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()  # our own child, by its handle
                proc.join(timeout=10)
        self.admin.close()
        self.etcd.stop()
        if self.heartbeats:
            shutil.rmtree(self.heartbeats, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="10,100,300,1000")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--limit", type=float, default=120.0,
                        help="seconds a phase may take before it is recorded as not finished")
    parser.add_argument("--lease-ttl", type=float, default=0.0,
                        help="the members' lease TTL in seconds (0: the default, 3 s; the "
                             "keepalive interval is a quarter of it)")
    parser.add_argument("--declared-size", action="store_true",
                        help="each job declares its size (max_workers = N and min_workers = "
                             "N - 1, as `elastic run --min-workers N-1 --max-workers N`): the "
                             "first round closes as soon as all N joined, without the settle "
                             "window for further joiners, and never with fewer than N - 1 (etcd "
                             "slow for a settle window while 1,000 register could otherwise "
                             "close it with the few registered by then)")
    parser.add_argument("--coordinator-apart", action="store_true",
                        help="the coordinator is a member alone in a process of its own, "
                             "registered before the others (default: whichever member of the "
                             "--procs processes registers first)")
    parser.add_argument("--workers-per-node", type=int, default=1, metavar="K",
                        help="members share one lease per K of them, as `elastic run "
                             "--node-lease` with K workers per node (default 1: a lease each)")
    parser.add_argument("--idle", type=float, default=0.0, metavar="S",
                        help="after the death, count lease renewals for S seconds of nothing "
                             "happening (default 0: not measured)")
    parser.add_argument("--connections", type=int, default=1, metavar="K",
                        help="etcd clients per member process, the members spread over them "
                             "(default 1: all of a process's members on one connection, whose "
                             "one watch stream sends their watch creates one at a time; a "
                             "real worker process has a connection of its own)")
    parser.add_argument("--timeline", action="store_true",
                        help="record when each phase's member keys (first round), joins, plan, "
                             "seats and news were written, from etcd's revisions sampled every "
                             "10 ms, and when a death's news of the break was heard")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.workers_per_node < 1:
        parser.error(f"--workers-per-node must be at least 1 (got {args.workers_per_node})")
    if args.connections < 1:
        parser.error(f"--connections must be at least 1 (got {args.connections})")
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        run = Run(n, min(args.procs, n), args.limit, args.lease_ttl,
                  n if args.declared_size else None, args.coordinator_apart,
                  args.workers_per_node, args.idle, args.connections, args.timeline)
        try:
            result = run.measure()
        finally:
            run.close()
            # The stopped etcd's files (its preallocated WAL) are deleted: flush that to disk
            # now, so that the next N's etcd does not pay for it in its own writes.
            os.sync()
        print(json.dumps(result), flush=True)
        results.append(result)
    record = {"label": args.label, "cores": os.cpu_count(), "procs": args.procs,
              "date": time.strftime("%Y-%m-%d"),
              "lease_ttl_s": args.lease_ttl or 3.0, "settle_s": 0.5,
              "max_workers": "N" if args.declared_size else None,
              "min_workers": "N - 1" if args.declared_size else 1,
              "coordinator": "apart" if args.coordinator_apart else "packed",
              "workers_per_node": args.workers_per_node, "connections": args.connections,
              "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
