"""One worker's connection to the job: etcd client, membership, rendezvous, monitor and group.

``form()`` is the cluster half of a re-formation: stop watching the old round, release and
destroy its group, agree on the next round (waiting as a spare if left out), and form the new
group on a fresh etcd-backed store. It knows nothing of the training state.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from elastic.cluster.agreement_channel import AgreementChannel
from elastic.cluster.ports import free_port
from elastic.errors import EtcdUnavailableError, FencedError, PeerFailureError
from elastic.cluster.etcd_client import EtcdClient, parse_endpoints
from elastic.cluster.etcd_store import EtcdStore
from elastic.events import EventLog, Stopwatch
from elastic.cluster.keys import JobKeys
from elastic.cluster.membership import EtcdMembership
from elastic.cluster.monitor import ChangeMonitor
from elastic.cluster.process_group import ProcessGroup, resolve_backend
from elastic.cluster.records import SkippedRecords
from elastic.cluster.rendezvous import Rendezvous, RendezvousConfig, Topology
from elastic.settings import WorkerSettings

log = logging.getLogger(__name__)


class Cluster:
    """The cluster side of one worker process.

    Args:
        settings: the worker's settings (etcd and job id must be set).
        events: where events are recorded.
    """

    def __init__(self, settings: WorkerSettings, events: EventLog) -> None:
        if not settings.etcd or not settings.job_id:
            raise ValueError(
                "ElasticState.run() needs an etcd and a job id: launch with `elastic run`, or "
                "set ELASTIC_ETCD and ELASTIC_JOB_ID (or pass etcd= and job_id=).")
        self.settings = settings
        self.events = events
        self.keys = JobKeys(settings.job_id)
        timeouts = settings.timeouts
        self.client = EtcdClient(settings.etcd, timeouts=timeouts)
        etcd_ports = frozenset(port for _, port in parse_endpoints(settings.etcd))
        self.group = ProcessGroup(resolve_backend(settings.backend), timeout=timeouts.collective,
                                  skip_ports=etcd_ports, form_timeout=timeouts.form)
        self.config = RendezvousConfig(min_workers=settings.min_workers,
                                       max_workers=settings.max_workers, timeouts=timeouts)
        self.topology: Topology | None = None
        self.channel = AgreementChannel(0, 1, self.group.timeout)  # replaced at every round
        self._store: EtcdStore | None = None
        self.skipped = SkippedRecords()  # malformed records read from etcd, warned once each
        self.membership: EtcdMembership
        self.rendezvous: Rendezvous
        self.monitor: ChangeMonitor
        self._register()

    def _register(self) -> None:
        timeouts = self.settings.timeouts
        self.membership = EtcdMembership(self.client, self.keys, self.settings.advertise_addr,
                                         timeouts.lease_ttl, timeouts.keepalive)
        self.rendezvous = Rendezvous(self.client, self.membership, self.config, self.skipped)
        self.monitor = ChangeMonitor(self.keys, self.membership.member_id, self._on_broken,
                                     self.skipped)
        self.membership.add_listener(self.monitor.on_events)
        self.membership.on_fenced(lambda: self.release("this member was fenced"))
        self.membership.register()
        self.events.bind(member=self.membership.member_id)
        self.events.emit("joined", lease_ttl_s=self.settings.timeouts.lease_ttl.total_seconds())

    def _on_broken(self, reason: str) -> None:
        self.events.emit("failure_detected", reason=reason, source="watch")
        self.release(reason)

    def release(self, reason: str) -> None:
        """Unblocks every collective and agreement of the round now; safe from any thread.

        The channel and the store first: releasing them only shuts sockets down and wakes
        waiters, while releasing an NCCL group aborts communicators and can take a while.
        """
        self.channel.release(reason)
        store = self._store
        if store is not None:
            store.abort(reason)  # a group still forming stops waiting for the member
        self.group.release(reason)

    @property
    def member_id(self) -> str:
        return self.membership.member_id

    @property
    def is_fenced(self) -> bool:
        return self.membership.fenced.is_set()

    def is_peer_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` means a re-formation (a peer failed, or this member was fenced) rather
        than a failure of the caller's own code. Decided by type and by what this worker knows:
        its fencing, and its group's release and transport (``ProcessGroup.is_peer_failure``)."""
        return self.is_fenced or self.group.is_peer_failure(exc)

    def renew_identity(self) -> None:
        """After fencing: drops the old identity for good and registers as a new member."""
        old = self.membership.member_id
        self.membership.leave()
        self._register()
        self.events.emit("reregistered", previous_member=old)

    def form(self, reason: str, version: int,
             cancelled: Callable[[], bool] = lambda: False) -> Topology:
        """Leaves the current round and forms the next one with this member in it.

        Raises:
            RendezvousTimeoutError: too few workers for too long.
            LeaveInterrupt: ``cancelled()`` turned true while waiting for a round.
            EtcdUnavailableError: etcd stayed unreachable past the retry deadline.
        """
        self.monitor.disarm()
        self.release(f"re-forming ({reason})")
        self._drop_group()
        while True:
            if self.is_fenced:
                self.renew_identity()
                reason = "start"
            with Stopwatch() as waited:
                try:
                    topology = self.rendezvous.join(reason, version, free_port(), cancelled)
                except FencedError:
                    continue
            if topology is not None:
                break
            self.events.emit("spare", waited_s=waited.seconds)
            reason = "spare"
        self.events.bind(round=topology.round, rank=topology.rank,
                         world_size=topology.world_size)
        self.events.emit("round_formed", reason=reason, rendezvous_s=waited.seconds)
        with Stopwatch() as formed:
            self._store = EtcdStore(self.client, topology.store_prefix,
                                    self.settings.timeouts.store)
            self.topology = topology
            self.channel = AgreementChannel(topology.rank, topology.world_size, self.group.timeout)
            self.monitor.arm(topology, self.client)  # a member dying now aborts the forming
            self._connect(topology)
        self.events.emit("group_formed", backend=self.group.backend, form_s=formed.seconds)
        return topology

    def _connect(self, topology: Topology) -> None:
        """Forms the round's group and agreement channel.

        Raises:
            PeerFailureError: a member of the round died, froze or was released while the
                others connected (torch raises a ``RuntimeError`` or ``DistError`` then).
        """
        try:
            self.group.form(self._store, topology.rank, topology.world_size)
            self.channel.connect(self._store, self.settings.advertise_addr, topology.round,
                                 self.group.form_timeout)
        except RuntimeError as exc:  # torch's DistError family derives from RuntimeError
            raise PeerFailureError(f"forming the group of round {topology.round} failed: "
                                   f"{exc}") from exc

    def _drop_group(self) -> None:
        self.channel.close()
        self.group.destroy()
        self.topology = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def publish_checkpoint(self, ref: Any) -> None:
        """Records the newest durable checkpoint in etcd (for ``elastic status``)."""
        record = {"version": ref.step, "url": ref.url, "epoch": ref.epoch, "t": time.time(),
                  "member": self.member_id}
        try:
            self.client.put(self.keys.commit, json.dumps(record))
        except EtcdUnavailableError as exc:
            log.warning("could not record checkpoint %s in etcd: %s", ref.url, exc)

    def finish(self) -> None:
        """Says this member returned from the training function and waits for the others."""
        if self.topology is not None:
            self.monitor.disarm()
            self.rendezvous.finish(self.topology, timeout=self.settings.timeouts.finish)

    def close(self) -> None:
        """Destroys the group, leaves the job (revoking the lease) and closes the client."""
        self.monitor.disarm()
        self._drop_group()
        self.membership.leave()
        self.events.emit("left")
        self.client.close()
