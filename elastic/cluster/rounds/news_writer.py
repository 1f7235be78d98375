"""The coordinator's writes of ``control/news``, and what they are guarded by.

The news record is written by compare-and-swap on its revision as the leader last saw or wrote
it, and only while the coordinator key that made it leader is still its own (a leader whose
lease just ended, and that does not know yet, must not write over its successor's news). Both
revisions come from the member's ``control/`` watch, which may bring the leader's own write back
late, and from the writes themselves: a refused write reads in the same transaction what
moved, so that it never retries against a revision that only the watch would correct.

``NewsWriter`` owns that state for one member (``Coordinator`` uses it); it decides nothing
about rounds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from elastic.cluster.etcd.client import EtcdClient, KeyValue, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import RoundNews


class NewsWriter:
    """Writes the news record for a member that leads, and follows who holds the lead.

    Args:
        client: the etcd client.
        keys: the job's keys.
        member_id: this member's id now (it changes when the member registers again).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, member_id: Callable[[], str]) -> None:
        self._client = client
        self._keys = keys
        self._member_id = member_id
        self._lock = threading.Lock()
        self._revision = 0  # the news record's mod revision as last seen or written
        self._holder: str | None = None  # who holds the coordinator key, as last seen
        self._holder_revision = 0  # its mod revision (0: not seen yet)
        self._holder_known = False
        self._lost = False  # the coordinator key went from under this member while it led

    def on_control(self, events: list[WatchEvent]) -> bool:
        """Notes what the ``control/`` watch brought (in revision order); True when the
        coordinator key was deleted (its holder's lease ended: the lead is free)."""
        keys, me = self._keys, self._member_id()
        freed = False
        with self._lock:
            for e in events:
                if e.key == keys.news and e.kind == "put":
                    # A late event of this leader's own write never takes the revision back.
                    self._revision = max(self._revision, e.revision)
                elif e.key == keys.coordinator:
                    if e.kind == "delete":
                        self._lost = self._lost or self._holder == me
                        freed = True
                    self._holder = e.value.decode("utf-8", errors="replace") \
                        if e.kind == "put" else None
                    self._holder_revision = e.revision if e.kind == "put" else 0
                    self._holder_known = True
        return freed

    def holder(self) -> tuple[bool, str | None]:
        """Whether the watch told who holds the coordinator key yet, and who (None: free)."""
        with self._lock:
            return self._holder_known, self._holder

    def took(self, kv: KeyValue | None) -> bool:
        """Notes the coordinator key as read right after this member created it (the guard of
        its writes before the watch brings the key back); whether it is still this member's."""
        with self._lock:
            self._note_holder(kv)
            return self._holder == self._member_id()

    def lead(self) -> None:
        """This member starts leading: its key is its own."""
        with self._lock:
            self._lost = False

    @property
    def lost(self) -> bool:
        """Whether the coordinator key went from under this member since it started leading."""
        with self._lock:
            return self._lost

    def saw(self, kv: KeyValue) -> None:
        """The news record as read."""
        with self._lock:
            self._revision = kv.mod_revision

    def write(self, news: RoundNews) -> bool:
        """Writes ``news``; False when it was refused twice or the lead is lost. A refused write
        learns what moved from the same transaction and tries once more:

        - the record (another wrote it, or a lost reply hid this leader's own write): against
          the record's revision now;
        - the coordinator key: as its new holder, or not at all once it is another's.
        """
        me = self._member_id()
        for _ in range(2):
            with self._lock:
                if self._lost:
                    return False
                revision = self._revision
                held = (self._keys.coordinator, self._holder_revision) \
                    if self._holder == me and self._holder_revision else None
            done = self._client.replace(self._keys.news, news.to_json(), revision, held=held)
            with self._lock:
                if done.revision:
                    self._revision = max(self._revision, done.revision)
                    return True
                self._revision = done.found.mod_revision if done.found is not None else 0
                if held is not None and (done.guard is None
                                         or done.guard.mod_revision != held[1]):
                    self._note_holder(done.guard)
        return False

    def _note_holder(self, kv: KeyValue | None) -> None:
        """The coordinator key as read (called under the lock); the lead is lost once the key
        is absent or another's."""
        holder = kv.value.decode("utf-8", errors="replace") if kv is not None else None
        self._lost = self._lost or holder != self._member_id()
        self._holder, self._holder_known = holder, True
        self._holder_revision = kv.mod_revision if kv is not None else 0
