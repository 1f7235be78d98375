"""Prometheus metrics of one node's launcher (``elastic run --metrics-port P``).

The launcher serves the standard text format with ``prometheus_client`` on its advertised
address. What it knows itself (its workers' deaths by cause, its waiting spares) it is told
(``NodeFacts``); what the workers know (rounds, world size, recovery times, steps, durable
checkpoints, etcd errors) is read at each scrape from the event files of this launcher's own
workers (``events-{host}-{pid}.jsonl``), from where the last scrape stopped. Owns the metric
names and their meaning; never writes to a worker's file.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

from elastic.launch.parent_death import OwnedDirs

EVENTS_PREFIX = "elastic-events-"  # the private event directory of a launcher without --log-dir

RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WRITE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True)
class NodeFacts:
    """What the launcher tells the metrics about itself.

    Attributes:
        host: this node's name (the prefix of its workers' event files).
        pids: the pids of every worker this launcher started.
        failures: its workers' abnormal exits by cause (``SIGKILL``, ``exit 1``, ...).
        spares: its warm spares waiting for a place.
    """

    host: str
    pids: Callable[[], set[int]]
    failures: Callable[[], Mapping[str, int]]
    spares: Callable[[], int]


class Histogram:
    """Cumulative bucket counts and a sum, as Prometheus histograms are exposed."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total)


class WorkerEvents:
    """What this node's workers' events say so far: read on, file by file, at each scrape."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        self.world: tuple[float, int] | None = None  # (time, world size) of the newest formation
        self.round = 0
        self.reformations: Counter[str] = Counter()
        self.recovery = Histogram(RECOVERY_BUCKETS)
        self._rounds_seen: set[tuple[int, str]] = set()
        self.step: int | None = None
        self.samples: int | None = None
        self.commit_blocked = Histogram(WRITE_BUCKETS)
        self.durable_write = Histogram(WRITE_BUCKETS)
        self.durable: tuple[float, int] | None = None  # (time, bytes) of the newest checkpoint
        self.etcd_errors = 0

    def read(self, files: list[Path]) -> None:
        """Takes in every whole line added to ``files`` since the last read."""
        for path in files:
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            whole = data[:data.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                try:
                    self.take(json.loads(line))
                except ValueError:
                    continue  # a torn line of a killed worker

    def take(self, e: Mapping[str, Any]) -> None:
        """One event record."""
        event, t = e.get("event"), float(e.get("t", 0.0))
        if event == "resumed" and isinstance(e.get("world_size"), int):
            if self.world is None or t >= self.world[0]:
                self.world = (t, e["world_size"])
            rnd, reason = int(e.get("round", 0)), str(e.get("reason", "start"))
            self.round = max(self.round, rnd)
            # Once per round and reason, whichever local worker says it first: in one round a
            # survivor re-forms ("change", "failure") while a newcomer starts ("start").
            if (rnd, reason) not in self._rounds_seen:
                self._rounds_seen.add((rnd, reason))
                self.reformations[reason] += 1
                if reason in ("failure", "change"):
                    self.recovery.observe(float(e.get("recovery_s", 0.0)))
        elif event == "progress":
            if isinstance(e.get("step"), int):
                self.step = max(self.step or 0, e["step"])
            if isinstance(e.get("samples"), int):
                self.samples = max(self.samples or 0, e["samples"])
        elif event == "checkpoint_written":
            self.commit_blocked.observe(float(e.get("blocked_s", 0.0)))
            self.durable_write.observe(float(e.get("write_s", 0.0)))
            if self.durable is None or t >= self.durable[0]:
                self.durable = (t, int(e.get("bytes", 0)))
        elif event == "etcd_unreachable":
            self.etcd_errors += 1


class LauncherCollector:
    """A ``prometheus_client`` collector: reads the workers' new events, then reports.

    Args:
        facts: what the launcher knows itself.
        event_dir: the directory its workers write their event files to.
    """

    def __init__(self, facts: NodeFacts, event_dir: str) -> None:
        self.facts = facts
        self.event_dir = Path(event_dir)
        self.seen = WorkerEvents()

    def _files(self) -> list[Path]:
        return [self.event_dir / f"events-{self.facts.host}-{pid}.jsonl"
                for pid in sorted(self.facts.pids())]

    def collect(self) -> Iterator[Metric]:
        seen = self.seen
        seen.read([p for p in self._files() if p.exists()])
        yield _gauge("elastic_world_size", "Workers in the newest round this node's workers "
                     "formed.", seen.world[1] if seen.world else 0)
        yield _gauge("elastic_round", "The newest round this node's workers formed.", seen.round)
        formations = CounterMetricFamily("elastic_formations", "Rounds this node's workers "
                                         "formed, by the reason they joined them (start, "
                                         "failure, change, spare).",
                                         labels=["reason"])
        for reason, count in sorted(seen.reformations.items()):
            formations.add_metric([reason], count)
        yield formations
        failures = CounterMetricFamily("elastic_worker_failures", "This node's workers that "
                                       "exited abnormally, by cause.", labels=["cause"])
        for cause, count in sorted(self.facts.failures().items()):
            failures.add_metric([cause], count)
        yield failures
        yield seen.recovery.family("elastic_recovery_seconds", "From a failure or a join "
                                   "noticed to training again, per round.")
        yield _gauge("elastic_steps", "Steps done (rank 0's registered step; on its node).",
                     seen.step or 0)
        yield _gauge("elastic_samples", "Samples of the current epoch handed out (rank 0's "
                     "ElasticSampler; on its node).", seen.samples or 0)
        yield seen.commit_blocked.family("elastic_commit_blocked_seconds", "How long a durable "
                                         "commit held the training thread (the snapshot).")
        yield seen.durable_write.family("elastic_durable_checkpoint_seconds", "How long a "
                                        "durable checkpoint took to be written.")
        age = time.time() - seen.durable[0] if seen.durable else float("nan")
        yield _gauge("elastic_durable_checkpoint_age_seconds", "Seconds since the newest "
                     "durable checkpoint was written (NaN: none yet).", age)
        yield _gauge("elastic_durable_checkpoint_bytes", "Size of the newest durable "
                     "checkpoint.", seen.durable[1] if seen.durable else 0)
        errors = CounterMetricFamily("elastic_etcd_errors", "Times a worker of this node "
                                     "found etcd unreachable.")
        errors.add_metric([], seen.etcd_errors)
        yield errors
        yield _gauge("elastic_spares", "Warm spares of this node waiting for a place.",
                     self.facts.spares())


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class NodeMetrics:
    """The launcher's side: what it counts, where its workers write events, and the server.

    Args:
        port: the port to serve on.
        addr: the address to serve on (the launcher's advertised address).
        log_dir: the workers' ``--log-dir``; None: a private directory of this launcher's,
            removed at ``stop`` (and by the next launcher if this one was killed).
        spares: how many of its warm spares wait for a place.
        stop_timeout: how long ``stop`` waits for the server's thread.
    """

    def __init__(self, port: int, addr: str, log_dir: str | None, spares: Callable[[], int],
                 stop_timeout: timedelta) -> None:
        self.port, self.addr = port, addr
        self._private = None if log_dir else OwnedDirs.make(EVENTS_PREFIX)
        self.event_dir = log_dir or str(self._private)
        self.pids: set[int] = set()
        self.failures: Counter[str] = Counter()
        self._spares = spares
        self._stop_timeout_s = stop_timeout.total_seconds()
        self._server: tuple[Any, threading.Thread] | None = None

    def worker_env(self) -> dict[str, str]:
        """What a worker needs so that its events reach the metrics."""
        return {"ELASTIC_LOG_DIR": self.event_dir}

    def failed(self, returncode: int) -> None:
        """Counts a worker's abnormal exit by its cause."""
        cause = _signal_name(returncode) or (
            f"signal {-returncode}" if returncode < 0 else f"exit {returncode}")
        self.failures[cause] += 1

    def start(self) -> None:
        """Serves the metrics from a daemon thread.

        Raises:
            OSError: the port is taken or the address is not this machine's.
        """
        registry = CollectorRegistry(auto_describe=False)
        facts = NodeFacts(socket.gethostname(), lambda: set(self.pids),
                          lambda: dict(self.failures), self._spares)
        registry.register(LauncherCollector(facts, self.event_dir))
        self._server = start_http_server(self.port, addr=self.addr, registry=registry)

    def stop(self) -> None:
        """Stops serving and removes the private event directory."""
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(timeout=self._stop_timeout_s)
            self._server = None
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)


def _signal_name(returncode: int) -> str | None:
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return None
