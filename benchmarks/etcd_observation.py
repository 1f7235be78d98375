"""What ``bench_membership`` reads off etcd: its CPU time and ``/metrics`` counts, a clock
that tells revisions as times, the milestones of a round from the revisions of its keys, and
when the news of a broken round was heard.

Owns only observing (one read of an empty range per clock tick, one watch of the news key);
the members and the phases are ``membership_sim``'s and ``bench_membership``'s.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import RoundNews

from benchmarks.membership_sim import JOB


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
