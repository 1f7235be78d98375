"""torchrun-compatible generations for plain DDP scripts (``elastic run --plain``).

The launchers of a job agree on generations with the same rendezvous as the workers, under the
job's launcher keys: one member per launcher, ``nproc`` workers each. A generation gives every
launcher a base rank; the launcher of rank 0 hosts the generation's TCPStore, bound to its
advertise address only (never every interface), and the workers connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``), so ``init_process_group(init_method="env://")`` works
unchanged. When a worker anywhere fails, or a launcher joins or dies, every launcher stops its
workers and a new generation forms; failures count against ``--max-restarts``.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from dataclasses import replace
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from elastic.foundation.errors import LeaveInterrupt, RendezvousClosedError
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.news import read_news
from elastic.cluster.rounds.records import SkippedRecords
from elastic.cluster.rounds.rendezvous import Rendezvous, RendezvousConfig
from elastic.cluster.rounds.topology import Topology
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.launch.launch_spec import LaunchSpec
from elastic.launch.stop_signal import StopSignal
from elastic.launch.death_lines import died
from elastic.launch.worker_procs import WorkerProcs

log = logging.getLogger(__name__)


class PlainHost(Protocol):
    """What plain mode uses of the launcher that runs it (``elastic.launch.launcher``)."""

    spec: LaunchSpec
    client: EtcdClient | None
    membership: EtcdMembership | None
    procs: WorkerProcs
    stop: StopSignal

    def is_etcd_lost(self) -> bool:
        """Whether the embedded etcd exited (nothing can go on without it)."""


class PlainGenerations:
    """Runs a launcher's workers through torchrun-style generations.

    Args:
        launcher: the connected launcher (its etcd client, membership, workers and signals).
    """

    def __init__(self, launcher: PlainHost) -> None:
        self.launcher = launcher
        self.spec = launcher.spec
        assert launcher.client is not None and launcher.membership is not None
        self.membership = launcher.membership
        self.keys = self.membership.keys
        nproc = self.spec.nproc
        config = RendezvousConfig(
            min_workers=math.ceil(self.spec.min_workers / nproc),
            max_workers=None if self.spec.max_workers is None
            else max(1, self.spec.max_workers // nproc),
            timeouts=replace(self.spec.timeouts, settle=self.spec.timeouts.node_settle))
        self._skipped = SkippedRecords()
        self.rendezvous = Rendezvous(launcher.client, self.membership, config, self._skipped)
        self.news = threading.Event()
        self._lock = threading.Lock()
        self._armed: Topology | None = None
        self.failure = "a worker failed"  # which one and how, once one has
        self.membership.add_listener(self._on_events)

    def run(self) -> int:
        """Forms generations until the workers finish, fail too often, or are stopped.

        Returns:
            0 when every worker of the last generation exited 0, else 1.
        """
        reason, failures = "start", 0
        while True:
            try:
                topology, listener = self._join(reason)
            except RendezvousClosedError as exc:
                print(f"elastic: {exc}", flush=True)
                return 0
            except LeaveInterrupt:
                print("elastic: stopped while the next generation was forming", flush=True)
                return self.launcher.stop.exit_status or 1
            if topology is None:
                reason = "spare"
                continue
            outcome = self._generation(topology, listener, failures)
            if outcome == "done":
                self.rendezvous.finish(topology, timeout=self.spec.timeouts.finish)
                return 0
            if outcome == "stopped":
                return self.launcher.stop.exit_status or 1
            if outcome == "failed":
                failures += 1
                if failures > self.spec.max_restarts:
                    print(f"elastic: {self.failure} and --max-restarts "
                          f"({self.spec.max_restarts}) is used up; giving up.", flush=True)
                    return 1
                if not self.spec.output.quiet:  # a line of the story: --quiet hides it
                    print(f"elastic: {self.failure}; restarting every worker (restart "
                          f"{failures} of {self.spec.max_restarts})", flush=True)
            reason = "failure" if outcome == "failed" else "change"

    def _join(self, reason: str) -> tuple[Topology | None, socket.socket]:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((self.spec.advertise_addr, 0))
        listener.listen(128)
        topology = None
        try:
            topology = self.rendezvous.join(reason, 0, listener.getsockname()[1],
                                            cancelled=self.launcher.stop.requested.is_set)
        finally:
            if topology is None:
                listener.close()
        return topology, listener

    def _generation(self, topology: Topology, listener: socket.socket, failures: int) -> str:
        store = None
        if topology.rank == 0:
            # The store takes over the socket (it closes the fd): bound to one address only.
            store = dist.TCPStore(topology.master_addr, topology.master_port, None, True,
                                  wait_for_workers=False, master_listen_fd=listener.detach())
        else:
            listener.close()
        procs = self.launcher.procs
        with self._lock:
            self._armed = topology
            self.news.clear()
        kv = self.launcher.client.get(self.keys.news)  # news written while this one formed
        if kv is not None:
            self._on_events([WatchEvent("put", kv.key, kv.value, kv.mod_revision)])
        try:
            for local_rank in range(self.spec.nproc):
                procs.start(local_rank, self._env(topology, local_rank, failures),
                            label=f"rank{topology.rank * self.spec.nproc + local_rank}")
            print(f"elastic: generation {topology.round}: world size "
                  f"{topology.world_size * self.spec.nproc}, ranks from "
                  f"{topology.rank * self.spec.nproc}", flush=True)
            return self._watch()
        finally:
            with self._lock:
                self._armed = None
            stopping, timeouts = self.launcher.stop, self.spec.timeouts
            procs.terminate(timedelta() if stopping.forced.is_set() else
                            timeouts.grace if stopping.requested.is_set()
                            else timeouts.restart_grace,
                            cut=stopping.forced)
            procs.exited()
            procs.forget_exited()
            del store

    def _watch(self) -> str:
        procs = self.launcher.procs
        while True:
            procs.changed.wait(timeout=self.spec.timeouts.wake.total_seconds())
            procs.changed.clear()
            if self.launcher.stop.requested.is_set() or self.launcher.is_etcd_lost():
                return "stopped"
            exited = procs.exited()
            failed = [w for w in exited if w.returncode]
            if failed:
                self.failure = died(failed[0].local_rank, socket.gethostname(), failed[0].pid,
                                    failed[0].returncode or 0)
                return "failed"
            if self.news.is_set():
                return "changed"
            if not procs.running():
                return "done"

    def _env(self, topology: Topology, local_rank: int, failures: int) -> dict[str, str]:
        nproc = self.spec.nproc
        env = self.spec.worker_env(local_rank)
        env.update({
            "RANK": str(topology.rank * nproc + local_rank),
            "WORLD_SIZE": str(topology.world_size * nproc),
            "GROUP_RANK": str(topology.rank), "GROUP_WORLD_SIZE": str(topology.world_size),
            "ROLE_RANK": str(topology.rank * nproc + local_rank),
            "ROLE_WORLD_SIZE": str(topology.world_size * nproc),
            "MASTER_ADDR": topology.master_addr, "MASTER_PORT": str(topology.master_port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(failures),
            "TORCHELASTIC_MAX_RESTARTS": str(self.spec.max_restarts),
            "TORCHELASTIC_RUN_ID": self.spec.job_id,
        })
        return env

    def _on_events(self, events: list[WatchEvent]) -> None:
        """The coordinator's news of this generation: a launcher asks to join the next one, or
        a launcher of this one is gone (``cluster/rounds/news.py``): restart."""
        with self._lock:
            armed = self._armed
        read = read_news(self.keys, events, self._skipped)
        if armed is None or read is None:
            return
        news = read[0]
        if news.round == armed.round and (news.pending or news.broken):
            log.info("generation %d changes: %s", armed.round, news.broken or news.pending)
            self.news.set()
            self.launcher.procs.changed.set()
