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
the process's members), its own member key, its own join requests, the same classes a worker uses (``membership_sim.SimMember`` mirrors
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
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from elastic.cluster.etcd.client import EtcdClient  # noqa: E402
from elastic.cluster.rounds.keys import JobKeys  # noqa: E402
from elastic.cluster.rounds.membership import drop_member  # noqa: E402
from elastic.launch.embedded_etcd import EmbeddedEtcd  # noqa: E402

from benchmarks.etcd_observation import (BrokenNews, RevisionClock, etcd_cpu_s,  # noqa: E402
                                        etcd_metrics, timeline)
from benchmarks.membership_sim import JOB, worker_main  # noqa: E402


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
