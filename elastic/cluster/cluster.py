"""One worker's connection to the job: etcd client, membership, rendezvous, round tracker and group.

``form()`` is the cluster half of a re-formation: stop watching the old round, release and
destroy its group, agree on the next round (waiting as a spare if left out), and form the new
group on a fresh store that the round's rank 0 hosts (its address in etcd: ``round_store.py``).
It knows nothing of the training state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from elastic.cluster.links.agreement_channel import ENDED, FROZEN, SILENT, AgreementChannel
from elastic.cluster.links.channel_book import ChannelBook
from elastic.cluster.links.ports import answers, free_port
from elastic.cluster.links.pulse_process import PulseProcess
from elastic.foundation.errors import (CutOffError, EtcdAccessError, EtcdRecordError,
                                       EtcdUnavailableError, FencedError, PeerFailureError)
from elastic.cluster.etcd.client import EtcdClient, parse_endpoints
from elastic.foundation.events import EventLog, Stopwatch
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.worker_lease_file import (append_committed, append_lease, append_member,
                                               heartbeat)
from elastic.cluster.rounds.membership import EtcdMembership, NodeLease
from elastic.cluster.links.device import claim_device, default_lock_dir
from elastic.cluster.rounds.news import NewsReader, job_is_over
from elastic.cluster.links.process_group import ProcessGroup, cuda_device_count, resolve_backend
from elastic.cluster.rounds.records import SkippedRecords
from elastic.cluster.rounds.rendezvous import Rendezvous, RendezvousConfig
from elastic.cluster.rounds.topology import Topology
from elastic.cluster.rounds.tracker import RoundTracker
from elastic.cluster.links.release_watchdog import ReleaseWatchdog
from elastic.cluster.links.round_links import RoundLinks
from elastic.cluster.links.round_store import RoundStore, StoreTimes
from elastic.foundation.settings import WorkerSettings
from elastic.cluster.rounds.commit_holders import other_holder
from elastic.cluster.links.reconnection import await_peers
from elastic.cluster.rounds.finished_job import clear_finished_job
from elastic.cluster.links.stuck_verdict import StuckVerdict
from elastic.cluster.fencing import claim_fencing_epoch

log = logging.getLogger(__name__)


class Cluster:
    """The cluster side of one worker process.

    Args:
        settings: the worker's settings (etcd and job id must be set).
        events: where events are recorded.
        version: the version of the worker's newest commit, when known: its registration
            then carries its first join request (``Rendezvous.first_join``).
        newest: the version of the worker's newest commit, asked when its training thread
            stays inside a released step (a restart in place must not lose it).
        replicated: False for sharded state: a stuck worker never restarts in place then,
            and newcomers take ranks in proportion (``rounds.places``).
        shard_degree: sharded state's HSDP shard degree (None: FSDP over every rank).
    """

    def __init__(self, settings: WorkerSettings, events: EventLog,
                 version: int | None = None,
                 newest: Callable[[], int] = lambda: 0, replicated: bool = True,
                 shard_degree: int | None = None) -> None:
        if not settings.etcd or not settings.job_id:
            raise ValueError(
                "ElasticState.run() needs an etcd and a job id: launch with `elastic run`, or "
                "set ELASTIC_ETCD and ELASTIC_JOB_ID (or pass etcd= and job_id=).")
        self.settings = settings
        self.events = events
        self.keys = JobKeys(settings.job_id)
        timeouts = settings.timeouts
        self.client = EtcdClient(settings.etcd, timeouts=timeouts,
                                 security=settings.etcd_security)
        etcd_ports = frozenset(port for _, port in parse_endpoints(settings.etcd))
        backend = resolve_backend(settings.backend)
        self.device = claim_device(os.environ, cuda_device_count(), default_lock_dir()) \
            if backend == "nccl" else None
        self.group = ProcessGroup(backend, timeout=timeouts.collective,
                                  skip_ports=etcd_ports, form_timeout=timeouts.form,
                                  free_timeout=timeouts.free_group,
                                  advertise_addr=settings.advertise_addr,
                                  device_index=self.device.index if self.device else None)
        self.config = RendezvousConfig(min_workers=settings.min_workers,
                                       max_workers=settings.max_workers, timeouts=timeouts,
                                       standby=settings.standby, node=settings.launcher or "",
                                       node_workers=settings.launcher_workers,
                                       sharded=not replicated, shard_degree=shard_degree)
        self.topology: Topology | None = None
        self._last: Topology | None = None  # the round of the retired channel
        self._probed = 0  # the round whose rank 0 this worker last checked it could reach
        self.links = RoundLinks(self.group, AgreementChannel(0, 1, self.group.timeout))
        self.pulse = PulseProcess(timeouts.heartbeat.total_seconds())
        self.pulse.start()  # up and beating long before the first round forms
        self.skipped = SkippedRecords()  # malformed records read from etcd, warned once each
        holder = self._other_holder if replicated else None  # sharded: see StuckVerdict
        self._verdict = StuckVerdict(events, timeouts, newest, holder,
                                     lambda: job_is_over(self.client, self.keys, self.skipped),
                                     self._leave_to_restart)
        self.stuck = ReleaseWatchdog(timeouts.release, self._verdict)
        self._said_committed = False
        self._used_node_lease = False
        self.membership: EtcdMembership
        self.rendezvous: Rendezvous
        self.tracker: RoundTracker
        self._port: int | None = None  # the port the registration's join request offers
        self._register(version)

    def _register(self, version: int | None = None) -> None:
        timeouts = self.settings.timeouts
        lease_file = self.settings.lease_file
        self.membership = EtcdMembership(
            self.client, self.keys, self.settings.advertise_addr, timeouts,
            on_lease=None if lease_file is None else lambda lease: append_lease(lease_file, lease),
            claim=self.keys.coordinator, node_lease=self._node_lease())
        self.rendezvous = Rendezvous(self.client, self.membership, self.config, self.skipped)
        self.tracker = RoundTracker(NewsReader(self.keys, self.skipped), self._on_broken)
        self.membership.add_listener(self.tracker.on_events)
        self.membership.on_fenced(lambda: self._release_for_peers("this member was fenced"))
        carry = None
        if version is not None:
            self._port = free_port()
            carry = self.rendezvous.first_join("start", version, self._port, self._came_from())
        self.membership.register(carry)
        self.events.bind(member=self.membership.member_id)
        self.events.emit("joined", lease_ttl_s=self.settings.timeouts.lease_ttl.total_seconds(),
                         started_from=self.settings.started_from)

    def _node_lease(self) -> NodeLease | None:
        """The node's lease, for this process's first identity only (``--node-lease``): a
        member fenced while its launcher lives registers again under a lease of its own, which
        its launcher revokes when it dies, as without the option."""
        lease, lease_file = self.settings.node_lease, self.settings.lease_file
        if lease is None or lease_file is None or self._used_node_lease:
            return None
        self._used_node_lease = True
        return NodeLease(lease, lambda member: append_member(lease_file, member),
                         lambda: heartbeat(lease_file))

    def _on_broken(self, reason: str) -> None:
        self.events.emit("failure_detected", reason=reason, source="watch")
        self._release_for_peers(reason)

    def _release_for_peers(self, reason: str) -> None:
        """Releases the round because the others go on without it (a member is gone, or this
        one was fenced); the training thread must now drop the round within the release
        grace."""
        self.tracker.if_armed(lambda: self.stuck.arm(reason))  # before the drop can come
        self.release(reason)

    def _other_holder(self, version: int) -> str | None:
        """A live member other than this one that asked to join a round after this one's with
        commit ``version`` or newer (``commit_holders``; None: none, or no round)."""
        topology = self.topology
        return None if topology is None else other_holder(
            self.client, self.keys, self.rendezvous, self.member_id, topology.round, version)

    def _leave_to_restart(self) -> None:
        self.rendezvous.stop()
        self.membership.leave()

    def release(self, reason: str) -> None:
        """Unblocks every collective and agreement of the round now; safe from any thread."""
        self.links.release(reason)

    @property
    def channel(self) -> AgreementChannel:
        """The agreement channel of the current round."""
        return self.links.channel  # type: ignore[return-value]

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
        self.rendezvous.stop()
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
        self.tracker.disarm()
        self.release(f"re-forming ({reason})")
        dropped = self._drop_group()
        try:
            topology, reason, waited = self._join_next(reason, version, cancelled)
        finally:
            dropped()  # before the next round's links open
        self.events.bind(round=topology.round, rank=topology.rank,
                         world_size=topology.world_size)
        self.events.emit("round_formed", reason=reason, rendezvous_s=waited)
        with Stopwatch() as formed:
            timeouts = self.settings.timeouts
            store = RoundStore(self.client, self.keys.store_address(topology.round),
                               topology.rank, self.settings.advertise_addr,
                               StoreTimes(timeouts.store, timeouts.wake, timeouts.poll))
            self.links.open(store, AgreementChannel(topology.rank, topology.world_size,
                                                    self.group.timeout, timeouts.peer,
                                                    timeouts.peer_probe))
            self.topology = topology
            self.tracker.arm(topology, self.client)  # a member dying now aborts the forming
            self._connect(topology, store)
        self.events.emit("group_formed", backend=self.group.backend, form_s=formed.seconds)
        return topology

    def _join_next(self, reason: str, version: int,
                   cancelled: Callable[[], bool]) -> tuple[Topology, str, float]:
        """Asks for rounds until one takes this member; returns its topology, the reason it
        last asked with and the seconds that took (``form`` says what it raises)."""
        while True:
            if self.is_fenced or not self.membership.is_registered:
                self.renew_identity()
                reason = "start"
            with Stopwatch() as waited:
                try:
                    port, self._port = self._port or free_port(), None
                    topology = self.rendezvous.join(
                        reason, version, port, cancelled, self._members_gone, self._came_from(),
                        on_spare=lambda: self.events.emit(
                            "spare", waited_s=time.monotonic() - waited.started))
                except FencedError as exc:
                    self.membership.fence(str(exc))  # a write found the lease gone
                    continue
                except CutOffError as exc:
                    self.events.emit("cut_off", reason=str(exc))
                    log.warning("%s; it comes back as a new member once it reaches them", exc)
                    self.renew_identity()
                    await_peers(self.client, self.keys, self.rendezvous.latest_round,
                                self.settings.timeouts, cancelled)
                    reason = "start"
                    continue
            if topology is not None:
                return topology, reason, waited.seconds
            self.events.emit("spare", waited_s=waited.seconds)
            reason = "spare"

    def _connect(self, topology: Topology, store: RoundStore) -> None:
        """Connects the round's store, then forms its group and agreement channel.

        Raises:
            PeerFailureError: a member of the round died, froze or was released while the
                others connected (torch raises a ``RuntimeError`` or ``DistError`` then).
        """
        book = ChannelBook(self.client, self.keys.channel(topology.round))
        try:
            if topology.rank == 0:  # published before the store: whoever finds it finds this
                self.channel.open(book, self.settings.advertise_addr)
            store.connect()
            self.group.form(store, topology.rank, topology.world_size)
            self.channel.connect(book, self.settings.advertise_addr, topology.round,
                                 self.group.form_timeout)
            timeouts = self.settings.timeouts
            self.channel.watch(lambda rank, how: self._peer_lost(topology.member(rank), how),
                               timeouts.heartbeat, timeouts.frozen, self.pulse)
        except RuntimeError as exc:  # torch's DistError family derives from RuntimeError
            raise PeerFailureError(f"forming the group of round {topology.round} failed: "
                                   f"{exc}") from exc

    def _peer_lost(self, member: str, how: str) -> None:
        """The channel's watch lost ``member`` (``AgreementChannel.peers_lost`` says how): the
        round is broken, and the event says which detector saw it (none for a round that ended
        or was broken already)."""
        if self.tracker.on_peer_gone(member, how):
            self.events.emit("peer_lost", peer=member, how=how)

    def _members_gone(self, n: int) -> dict[str, str]:
        """The members of round ``n - 1`` this worker lost on its agreement connections, when it
        was in that round (else none), each with how (``AgreementChannel.peers_lost``): a link
        that went silent (the member may be alive and cut off), one its kernel ended (dead), or
        a member whose kernel answers but whose process stopped beating (frozen).

        A worker that was not rank 0 also checks once that rank 0's machine answers on the
        port its connection ends at (rank 0's channel listener; its own link may not have gone
        silent yet: a failure report woke it first), so that a split is seen whole once
        everyone asked.
        """
        last = self._last
        if last is None or last.round != n - 1 or last.member_id != self.member_id:
            return {}  # not in that round, or only under an identity it dropped since
        lost = {last.member(rank): how for rank, how in self.channel.peers_lost().items()}
        rank0 = last.rank0
        address = self.channel.peer_address(0) if last.rank != 0 else None
        if address is not None and rank0 not in lost and self._probed != n:
            self._probed = n
            if not answers(*address, self.settings.timeouts.peer.total_seconds()):
                lost[rank0] = SILENT
        return lost

    def _came_from(self) -> tuple[int, int]:
        """The round this process was last in and how many of its members may still live
        ((0, 0): none): its world less those whose kernel ended their connection to this one
        or that froze. Told in its join requests: after etcd lost its data or every lease, the
        next round waits for that many (``roll_call.returning_short``, ``heirs_short``)."""
        last = self._last
        if last is None:
            return 0, 0
        dead = sum(how in (ENDED, FROZEN) for how in self.channel.peers_lost().values())
        return last.round, last.world_size - dead

    def _drop_group(self) -> Callable[[], None]:
        """Lets go of the round (the training thread is out of its step): its group is destroyed
        while this member asks for the next round; returns what waits for that.

        Raises (the returned function):
            PeerFailureError: destroying the group failed or took longer than the form timeout.
        """
        self.stuck.disarm()
        self._verdict.reset()
        if self.topology is not None:
            self._last = self.topology
        self.topology = None
        dropping = self.links.drop_meanwhile(self.settings.timeouts.form)

        def dropped() -> None:
            try:
                dropping()
            except (RuntimeError, TimeoutError) as exc:
                raise PeerFailureError(f"letting go of the last round failed: {exc}") from exc

        return dropped

    def lease_confirmer(self) -> Callable[[], bool]:
        """What asks etcd, when called, whether the lease of this member's identity *now* is
        alive (False once it is gone; True while etcd cannot be reached, when only the fencing
        generation can refuse a writer). Bound now: a write armed under this identity is never
        confirmed by the lease of the identity it registers as after it was fenced."""
        return self.membership.confirm_lease

    def fencing_epoch(self, floor: int) -> int:
        """The job's fencing epoch, at least ``floor`` (``fencing.claim_fencing_epoch``).

        Raises:
            EtcdUnavailableError: etcd stayed unreachable past the retry deadline.
            FencingContestedError: something other than the job's members writes the key.
        """
        return claim_fencing_epoch(self.client, self.keys.fence, floor)

    def note_committed(self) -> None:
        """Tells the launcher, once, that this worker committed (it made progress)."""
        if self.settings.lease_file is not None and not self._said_committed:
            self._said_committed = True
            append_committed(self.settings.lease_file)

    def publish_checkpoint(self, ref: Any) -> None:
        """Records the newest durable checkpoint in etcd (for ``elastic status``)."""
        record = {"version": ref.step, "url": ref.url, "epoch": ref.epoch, "t": time.time(),
                  "member": self.member_id}
        try:
            self.client.put(self.keys.commit, json.dumps(record))
        except (EtcdUnavailableError, EtcdAccessError) as exc:  # unreachable, or full
            log.warning("could not record checkpoint %s in etcd: %s", ref.url, exc)

    def finish(self) -> None:
        """Says this member returned from the training function and waits for the others."""
        if self.topology is not None:
            self.tracker.disarm()
            self.rendezvous.finish(self.topology, timeout=self.settings.timeouts.finish)

    def close(self) -> None:
        """Destroys the group, leaves the job (revoking the lease) and closes the client."""
        self.tracker.disarm()
        self.links.close()
        self.pulse.close()
        self.stuck.disarm()
        self.topology = None
        done = self.rendezvous.is_job_done()
        self.rendezvous.stop()
        self.membership.leave()
        self.events.emit("left")
        if done:
            self._clear_job()
        self.client.close()

    def _clear_job(self) -> None:
        """Deletes the finished job's keys but those that say it finished, which a lease
        ends (``finished_job``)."""
        try:
            clear_finished_job(self.client, self.keys, self.settings.timeouts.finished_marker)
        except (EtcdUnavailableError, EtcdAccessError, EtcdRecordError) as exc:
            log.warning("could not delete the finished job's keys under %s (%s); delete them "
                        "with `etcdctl del --prefix %s`", self.keys.prefix, exc, self.keys.prefix)
