"""Watches the job for changes that concern the formed round; never runs collectives.

- ``pending`` is set when the world should change at the next commit: a newcomer asked to join,
  or a member of the round left.
- ``on_broken`` is called (at most once per round) when the round's group cannot go on: a member
  of the round lost its key without finishing (died, frozen, cut off) or its agreement
  connection ended (``on_peer_gone``: it died), or a survivor reported a failure. The runner releases the group then, so that nobody waits for a collective timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.plan import JoinRequest
from elastic.cluster.rounds.records import SkippedRecords
from elastic.cluster.rounds.topology import Topology

log = logging.getLogger(__name__)


class ChangeMonitor:
    """Tracks one formed round against the job's watch events.

    Args:
        keys: the job's key builder.
        member_id: this member (its own events are not news).
        on_broken: called with a reason when the round's group must be released.
        skipped: where malformed join requests are reported (once each).
    """

    def __init__(self, keys: JobKeys, member_id: str, on_broken: Callable[[str], None],
                 skipped: SkippedRecords | None = None) -> None:
        self._keys = keys
        self._skipped = skipped or SkippedRecords()
        self.member_id = member_id
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self.pending = threading.Event()
        self.reason = ""
        self._round: int | None = None
        self._members: frozenset[str] = frozenset()
        self._done: set[str] = set()
        self._gone: set[str] = set()  # members whose key was deleted since the last arm()
        self._broken = False

    def arm(self, topology: Topology, client: EtcdClient) -> None:
        """Starts tracking a newly formed round.

        Events that came while disarmed were not acted on, so it acts on them now: a member of
        the round whose key was deleted since the last arm (one that died between the plan and
        now would otherwise go unnoticed until the form timeout), and the next round's joins
        (read from etcd).
        """
        with self._lock:
            self._round = topology.round
            self._members = frozenset(topology.members)
            self._done = set()
            self._broken = False
            self.pending.clear()
            self.reason = ""
            gone, self._gone = sorted(self._gone & self._members), set()
        missed = [WatchEvent("delete", self._keys.member(m), b"", 0) for m in gone]
        joins, _ = client.get_prefix(self._keys.joins(topology.round + 1))
        missed += [WatchEvent("put", kv.key, kv.value, kv.mod_revision) for kv in joins]
        self.on_events(missed)

    def disarm(self) -> None:
        """Stops tracking (during a re-formation nothing may release the group being formed)."""
        with self._lock:
            self._round = None

    def on_events(self, events: list[WatchEvent]) -> None:
        """Listener for the membership watch (runs on the etcd thread)."""
        broken = None
        with self._lock:
            self._gone.update(e.key[len(self._keys.members):] for e in events
                              if e.kind == "delete" and e.key.startswith(self._keys.members))
            if self._round is None:
                return
            for event in events:
                broken = self._consider(event) or broken
            if broken and not self._broken:
                self._broken = True
            else:
                broken = None
        if broken:
            self._on_broken(broken)

    def on_peer_gone(self, member: str) -> None:
        """A member's agreement connection ended (its process is gone, or the link to it went
        silent; ``AgreementChannel.watch``): acted on as the deletion of its key, which comes
        only at its lease TTL when no launcher revokes it."""
        self.on_events([WatchEvent("delete", self._keys.member(member), b"", 0)])

    def _consider(self, event: WatchEvent) -> str | None:
        assert self._round is not None
        n = self._keys.round_of(event.key)
        if n is not None and event.kind == "put":
            if event.key.startswith(self._keys.dones(self._round)):
                self._done.add(event.key.rsplit("/", 1)[1])
            elif n > self._round and event.key.startswith(self._keys.joins(n)):
                member = event.key[len(self._keys.joins(n)):]
                request = self._skipped.read(event.key, event.revision, lambda: (
                    JoinRequest.from_json(event.value, event.revision, member)))
                return None if request is None else self._on_join(request)
            return None
        if event.kind == "delete" and event.key.startswith(self._keys.members):
            member = event.key[len(self._keys.members):]
            if member in self._members and member != self.member_id \
                    and member not in self._done:
                self._flag(f"member {member} left the round")
                return f"member {member} of round {self._round} is gone"
        return None

    def _on_join(self, request: JoinRequest) -> str | None:
        if request.member_id == self.member_id or request.reason == "spare":
            return None
        self._flag(f"member {request.member_id} asks to join ({request.reason})")
        if request.reason == "failure":
            return f"member {request.member_id} reported a failure of round {self._round}"
        return None

    def _flag(self, reason: str) -> None:
        if not self.pending.is_set():
            self.reason = reason
            log.info("membership change pending: %s", reason)
        self.pending.set()
