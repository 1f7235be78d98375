"""One worker's membership in a job: an etcd lease kept alive, and a job watch.

Owns the member key (bound to the lease), its lease's renewals (on the client's renewal thread,
``lease_renewals``, shared with the process's other members), and the member's two watches: the
job's ``control/`` keys (the coordinator and its news) and its own seat (``seat.py``), fanned
out to listeners. It never watches other members' records: a change costs each member O(1)
events. The registration writes the seat empty, beside the member key and under the same lease,
so the seat goes with the member key: with the lease, by ``drop_member``, or by the
coordinator when the member key was deleted by other means (a member that a round left out
also reads its member key, ``Rendezvous._seat_of``). A member whose lease is gone, or
whose seat was deleted, is *fenced*: ``fenced`` is set, listeners hear of it, and this identity
is never used again (a new ``EtcdMembership`` registers as a new member). No torch here.

A member may instead share its node's lease (``NodeLease``: ``elastic run --node-lease``), which
its launcher keeps alive for every worker of the node: it then grants nothing and renews
nothing, and a thread of its own only tells the launcher that it is alive (a heartbeat). What
the end of its own lease would have done, the launcher does (``drop_member``): when the worker
dies, or sends no heartbeat for a lease TTL, it deletes the member key, its seat and the
coordinator key if this member held it; every record the member wrote under the shared lease
(join requests, reports) is honoured only while its member key is there.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from elastic.foundation.errors import (EtcdAccessError, EtcdRecordError, EtcdUnavailableError,
                                       FencedError)
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.etcd.txn import Carried, Registration
from elastic.cluster.etcd.lease_renewals import Outcome
from elastic.cluster.rounds.keys import JobKeys
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)

Listener = Callable[[list[WatchEvent]], None]


@dataclass(frozen=True)
class NodeLease:
    """A lease that the worker's launcher keeps alive for the workers of its node.

    Attributes:
        lease: the lease id.
        on_member: called with the member id before its key is written under the lease (the
            worker reports it to its launcher, which deletes that key when the worker dies).
        heartbeat: called every keepalive interval while this member lives (the launcher
            removes a member whose heartbeats stop for a lease TTL, as a lease would expire).
    """

    lease: int
    on_member: Callable[[str], None]
    heartbeat: Callable[[], None]


def drop_member(client: EtcdClient, keys: JobKeys, member_id: str, lease: int) -> bool:
    """Deletes member ``member_id``'s key if it is still bound to ``lease`` (and then its
    seat, which fences the member), and the coordinator key if that member holds it under the
    same lease: what the end of the member's own lease would delete, for a member that shares
    ``lease`` with others (``NodeLease``). The deletes of the member and coordinator keys are
    conditional on the revision read, so a key re-written since is left alone.

    Returns:
        Whether the member key was deleted now.
    """
    dropped = False
    kv = client.get(keys.member(member_id))
    if kv is not None and kv.lease == lease:
        dropped = client.delete_if(kv.key, kv.mod_revision)
    if dropped or kv is None:  # gone already: by an earlier attempt, whose seat delete failed
        client.delete(keys.seat(member_id))
    held = client.get(keys.coordinator)
    if held is not None and held.lease == lease and held.value == member_id.encode():
        client.delete_if(held.key, held.mod_revision)
    return dropped


_SERIAL = itertools.count()  # the identities this process made
_MAX_DRAWS = 3  # ids drawn for one registration before giving up


def new_member_id() -> str:
    """A member id unique across hosts, processes and re-registrations: a serial number makes
    those of one process differ, the random part those of a process whose pid was reused."""
    return f"{socket.gethostname()}-{os.getpid()}-{next(_SERIAL)}-{uuid.uuid4().hex[:6]}"


class EtcdMembership:
    """Registers this process as a member of a job and keeps it registered.

    Args:
        client: the etcd client.
        keys: the job's key builder.
        advertise_addr: the address peers use to reach this worker.
        timeouts: the job's table: ``lease_ttl`` (a frozen or cut-off member is dropped this
            long after its last keepalive) and ``keepalive`` (how often the lease is renewed;
            the table checks it is under half the TTL).
        on_lease: called with every lease granted, before a key is bound to it (the worker
            reports it to its launcher: ``elastic.cluster.worker_lease_file``).
        claim: a key that registering takes, bound to the lease with this member's id as its
            value, when nobody holds it (a worker: the job's coordinator key); ``claimed``
            says whether it did.
        node_lease: the node's lease, to register under instead of a lease of its own (when
            that lease is gone already, registering grants one of its own after all).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, advertise_addr: str,
                 timeouts: Timeouts, on_lease: Callable[[int], None] | None = None,
                 claim: str | None = None, node_lease: NodeLease | None = None) -> None:
        self._client = client
        self.keys = keys
        self.member_id = new_member_id()
        self.advertise_addr = advertise_addr
        self.lease_ttl = timeouts.lease_ttl
        self.keepalive = timeouts.keepalive
        self.lease = 0
        self.is_registered = False  # set once the lease, member key, seat and watch exist
        self._on_lease = on_lease
        self._claim = claim
        self.node_lease = node_lease  # None once registered under a lease of its own
        self.claimed = False
        self.carried = False  # whether the registration wrote the key it was asked to carry
        self.fenced = threading.Event()
        self._stop = threading.Event()
        self._listeners: list[Listener] = []
        self._fence_listeners: list[Callable[[], None]] = []
        self._keepalive: threading.Thread | None = None  # the heartbeat under a node's lease
        self._stop_renewals: Callable[[], None] | None = None
        self._fencing: threading.Thread | None = None  # a fence found by a renewal
        self._unreachable_since: float | None = None
        self._cancel_watches: list[Callable[[], None]] = []

    def add_listener(self, listener: Listener) -> None:
        """Calls ``listener`` with every change of the job's ``control/`` keys and of this
        member's seat (on the etcd thread)."""
        self._listeners.append(listener)

    def on_fenced(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once if this member's lease is lost."""
        self._fence_listeners.append(callback)

    def register(self, carry: Callable[[str], Carried] | None = None) -> int:
        """Grants the lease, writes the member key and its empty seat (taking the claimed key if
        it is free), hands the listeners the job's ``control/`` keys as they are then, and starts
        keepalive and watch: one request besides the lease's.

        Args:
            carry: the key to write in the same request, given the member id (a worker's
                first join request); ``carried`` then says whether it was written.

        Returns:
            The etcd revision of the registration; the ``control/`` watch starts right after
            it.
        """
        registered = self._lease_and_member_key(carry)
        self.claimed, self.carried = registered.claimed, registered.carried
        if self.node_lease is None:
            self._stop_renewals = self._client.renewals.add(self.lease, self.keepalive,
                                                            self._renewed)
        # As puts, before the watch can deliver anything newer (as ``follow_prefix`` does).
        self._dispatch([WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease,
                                   kv.create_revision) for kv in registered.read])
        # The seat's watch starts from etcd's next revision, not the registration's: a watch
        # that starts in the past is etcd's slow path (caught up apart from the others, in
        # batches; the ``control/`` watch is one), and it would bring the empty seat written
        # with the member key. It is created first, to be open before the news of the
        # member's round can come. A seat is written only once the round of the member's join
        # request closed: one the watch still misses, the member reads when the news of its
        # round comes; a seat deleted before the watch opened, it finds gone then
        # (``Rendezvous._seat_of``), or its renewals find the lease gone.
        self._cancel_watches = [
            self._client.watch_prefix(self.keys.seat(self.member_id), 0, self._dispatch),
            self._client.watch_prefix(self.keys.control, registered.revision + 1,
                                      self._dispatch)]
        self.is_registered = True
        if self.node_lease is not None:
            self._keepalive = threading.Thread(target=self._heartbeat, name="elastic-heartbeat",
                                               daemon=True)
            self._keepalive.start()
        return registered.revision

    def _lease_and_member_key(self, carry: Callable[[str], Carried] | None) -> Registration:
        """Writes the member key under the node's lease, else under a lease granted now."""
        if self.node_lease is not None:
            self.lease = self.node_lease.lease
            self.node_lease.on_member(self.member_id)
            try:
                return self._put_and_claim(carry)
            except FencedError:
                # Under a new id: a lost reply may have registered the old one before the
                # lease ended, and its deletion fences that id (the coordinator's ``_unseat``).
                taken, self.member_id = self.member_id, new_member_id()
                log.warning("the node's lease %x is gone (its launcher ended?); %s registers "
                            "as %s under a lease of its own", self.node_lease.lease, taken,
                            self.member_id)
                self.node_lease = None
        self.lease = self._client.grant(self.lease_ttl)
        if self._on_lease is not None:
            self._on_lease(self.lease)
        return self._put_and_claim(carry)

    def _put_and_claim(self, carry: Callable[[str], Carried] | None) -> Registration:
        """Writes the member key (see ``register``), under a new id while the one drawn is
        another member's (``_MAX_DRAWS`` at most: ids of one process never repeat)."""
        for _ in range(_MAX_DRAWS):
            registered = self._put_and_claim_once(
                None if carry is None else carry(self.member_id))
            if not registered.taken:
                return registered
            taken, self.member_id = self.member_id, new_member_id()
            log.warning("member id %s is another member's; registering as %s", taken,
                        self.member_id)
            if self.node_lease is not None:
                self.node_lease.on_member(self.member_id)
        raise EtcdRecordError(f"{_MAX_DRAWS} member ids drawn in a row were already registered "
                              f"under {self.keys.members}: something other than this job's "
                              "workers writes there; stop it, or run with another job id.")

    def _put_and_claim_once(self, carry: Carried | None) -> Registration:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "addr": self.advertise_addr,
                "lease": self.lease, "since": time.time()}
        return self._client.put_and_claim(
            self.keys.member(self.member_id), json.dumps(info), self.lease,
            None if self._claim is None else (self._claim, self.member_id),
            read=self.keys.control, carry=carry, beside=self.keys.seat(self.member_id))

    def _heartbeat(self) -> None:
        """Under the node's lease: tells the launcher this member is alive until ``leave()`` or
        fencing (the deletion of its seat, which its watch brings)."""
        assert self.node_lease is not None
        interval_s = self.keepalive.total_seconds()
        while not self.fenced.is_set():
            try:
                self.node_lease.heartbeat()
            except OSError as exc:  # its launcher removed the lease files: it ended
                log.warning("member %s stops its heartbeats (%s): its launcher ended, and the "
                            "node's lease ends with it", self.member_id, exc)
                return
            if self._stop.wait(interval_s):
                return

    def _dispatch(self, events: list[WatchEvent]) -> None:
        if not self.fenced.is_set() and any(
                e.kind == "delete" and e.key == self.keys.seat(self.member_id) for e in events):
            if not self._stop.is_set():
                self.fence("its seat was deleted (with its member key, or its lease)")
        for listener in self._listeners:
            listener(events)

    def _renewed(self, outcome: Outcome) -> bool:
        """One renewal of the lease (on the client's renewal thread); False ends its renewals.
        An unreachable etcd fences nobody: training with the world unchanged never needs etcd,
        and etcd keeps leases across its restarts; the member is fenced only when etcd answers
        that the lease is gone, or refuses it."""
        if self._stop.is_set():
            return False  # our own leave() revokes it
        if isinstance(outcome, EtcdAccessError):  # credentials or permissions withdrawn
            self._fence_apart(f"etcd refuses its keepalive: {outcome}")
            return False
        if isinstance(outcome, EtcdUnavailableError):
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
                log.warning("etcd is unreachable (%s); training goes on, and the lease of %s "
                            "is renewed once it answers", outcome, self.member_id)
            return True
        if outcome <= 0:
            self._fence_apart("its lease expired (the process was frozen or cut off)")
            return False
        if self._unreachable_since is not None:
            log.warning("etcd answers again after %.0f s; the lease of %s is alive",
                        time.monotonic() - self._unreachable_since, self.member_id)
            self._unreachable_since = None
        return True

    def _fence_apart(self, why: str) -> None:
        """Fences on a thread of its own (``leave()`` waits for it): the listeners may take
        their time, and the renewal thread renews the other members' leases meanwhile."""
        def fence_unless_left() -> None:
            if not self._stop.is_set():
                self.fence(why)

        self._fencing = threading.Thread(target=fence_unless_left, name="elastic-fence",
                                         daemon=True)
        self._fencing.start()

    def fence(self, why: str) -> None:
        """Marks this identity as fenced for good (once) and tells the listeners."""
        if self.fenced.is_set():
            return
        log.warning("member %s is fenced: %s", self.member_id, why)
        self.fenced.set()
        for callback in self._fence_listeners:
            callback()

    def confirm_lease(self) -> bool:
        """Renews the lease once, now: False when it is gone (and this member is fenced then),
        True when it is alive or etcd cannot be reached to say."""
        if self.fenced.is_set():
            return False
        try:
            if self.node_lease is not None:  # the node's lease lives on: is the key still ours?
                kv = self._client.get(self.keys.member(self.member_id))
                if kv is None or kv.lease != self.lease:
                    self.fence("its member key is gone (found while confirming it)")
                    return False
                return True
            remaining = self._client.refresh(self.lease, retry_for=self.keepalive)
        except EtcdUnavailableError as exc:
            log.warning("could not confirm the lease of %s (%s)", self.member_id, exc)
            return True
        if remaining <= 0:
            self.fence("its lease expired (found while confirming it)")
            return False
        return True

    @property
    def has_left(self) -> bool:
        """Whether ``leave()`` was called (this identity is done with the job)."""
        return self._stop.is_set()

    def check_not_fenced(self) -> None:
        """Raises:
            FencedError: the lease is gone; this identity must not act any more.
        """
        if self.fenced.is_set():
            raise FencedError(
                f"member {self.member_id} lost its lease; it re-registers as a new member.")

    def leave(self) -> None:
        """Stops keepalive and watch and revokes the lease (deleting every key bound to it);
        under the node's lease, deletes this member's keys instead (``drop_member``)."""
        self._stop.set()
        cancels, self._cancel_watches = self._cancel_watches, []
        for cancel in cancels:
            cancel()
        if self._stop_renewals is not None:
            self._stop_renewals()  # then no renewal starts a fence any more
        for thread in (self._keepalive, self._fencing):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=self._client_timeout_s())
        if self.lease and not self.fenced.is_set():
            try:
                if self.node_lease is not None:
                    drop_member(self._client, self.keys, self.member_id, self.lease)
                else:
                    self._client.revoke(self.lease)
            except EtcdUnavailableError as exc:
                if self.node_lease is not None:
                    log.warning("could not remove member %s (%s); its launcher removes it when "
                                "this worker exits", self.member_id, exc)
                else:
                    log.warning("could not revoke lease of %s (%s); it expires in %s",
                                self.member_id, exc, self.lease_ttl)

    def _client_timeout_s(self) -> float:
        """Bounds the wait for the heartbeat thread (under a node's lease), which wakes every
        keepalive interval, and for a fence in progress."""
        return (2 * self.lease_ttl + self.keepalive).total_seconds()
