"""The one tracker of a formed round: ``RoundTracker``, whichever records it reads.

A worker tracks its round from the news record (``news.NewsReader``); the job's coordinator
tracks it from every member's records (``record_reader.RecordReader``). Both keep one contract,
owned here:

- ``pending`` is set when the world should change at the next commit, with the first
  ``reason`` given;
- ``on_broken`` is called at most once per round, when the round's group cannot go on (the
  runner releases the group then, so that nobody waits for a collective timeout);
- ``arm`` starts tracking a newly formed round and acts on what came while disarmed;
  ``disarm`` stops it (nothing may release a group being formed); ``if_armed`` runs an action
  only while a round is tracked;
- ``on_peer_gone``: a member's agreement connection ended; the round is broken now.

A reader turns watch events into changes of the tracked round; it never calls back, and never
runs collectives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elastic.cluster.etcd.client import EtcdClient, WatchEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    """What one event means for the tracked round."""

    pending: str  # why the world should change at the next commit
    broken: str = ""  # why the round's group cannot go on ("": it can)


class FormedRound(Protocol):
    """What a tracker reads of a formed round (a ``Topology`` has it)."""

    round: int
    members: tuple[str, ...]


class RoundReader(Protocol):
    """Reads the watch for a ``RoundTracker``: ``observe`` and ``start`` run under the
    tracker's lock, ``catch_up`` outside it (it may read etcd)."""

    def observe(self, events: list[WatchEvent], round_: int | None) -> list[Change]:
        """Notes ``events`` (always) and returns what they change of round ``round_`` (None:
        no round is tracked, nothing changes)."""

    def start(self, round_: int, members: tuple[str, ...]) -> None:
        """Round ``round_`` of ``members`` is tracked from now on."""

    def catch_up(self, round_: int, client: EtcdClient) -> list[WatchEvent]:
        """What came while no round was tracked, as events to observe now."""


class RoundTracker:
    """Tracks one formed round at a time.

    Args:
        reader: what the tracker reads the watch with.
        on_broken: called with a reason when the round's group must be released.
    """

    def __init__(self, reader: RoundReader, on_broken: Callable[[str], None]) -> None:
        self.reader = reader
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self.pending = threading.Event()
        self.reason = ""
        self._round: int | None = None
        self._broken = False

    def arm(self, formed: FormedRound, client: EtcdClient) -> None:
        """Starts tracking a newly formed round, and acts on what came while disarmed."""
        with self._lock:
            self._round = formed.round
            self._broken = False
            self.pending.clear()
            self.reason = ""
            self.reader.start(formed.round, tuple(formed.members))
        self.on_events(self.reader.catch_up(formed.round, client))

    def disarm(self) -> None:
        """Stops tracking (during a re-formation nothing may release the group being formed)."""
        with self._lock:
            self._round = None

    def if_armed(self, action: Callable[[], None]) -> None:
        """Runs ``action`` if a formed round is tracked (not while forming, nor once finished),
        under the lock that ``disarm`` takes: it runs before a re-formation starts, or not at
        all."""
        with self._lock:
            if self._round is not None:
                action()

    def on_events(self, events: list[WatchEvent]) -> None:
        """Listener for the membership watch (runs on the etcd thread)."""
        broken = None
        with self._lock:
            for change in self.reader.observe(events, self._round):
                if change.pending and not self.pending.is_set():
                    self.reason = change.pending
                    log.info("membership change pending: %s", change.pending)
                    self.pending.set()
                broken = change.broken or broken
            if broken and not self._broken:
                self._broken = True
            else:
                broken = None
        if broken:
            self._on_broken(broken)

    def on_peer_gone(self, member: str, how: str = "ended") -> bool:
        """A member was lost on its agreement connection (``how``: its process is gone, the
        link went silent, or it stopped beating; ``AgreementChannel.watch``): the round is
        broken now, without waiting for its lease or the news. Returns whether that broke it
        (not when it was broken already, or no round is armed)."""
        with self._lock:
            if self._round is None or self._broken:
                return False
            self._broken = True
            if not self.pending.is_set():
                self.reason = f"member {member} is gone"
                self.pending.set()
            n = self._round
        seen = {"silent": "its connection went silent", "frozen": "its heartbeats stopped"}
        self._on_broken(f"member {member} of round {n} is gone "
                        f"({seen.get(how, 'its connection ended')})")
        return True
