"""The coordinator's reading of its round: every member's records, for a ``RoundTracker``.

- a change is pending when a newcomer asked to join the next round, or a member of the round
  left;
- the round is broken when a member of it lost its key without finishing (died, frozen, cut
  off), or a survivor reported a failure.

Only the job's coordinator reads these records (``coordinator.py``); a worker reads the news
record instead (``news.NewsReader``). Never runs collectives.
"""

from __future__ import annotations

from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.plan import JoinRequest
from elastic.cluster.rounds.records import SkippedRecords
from elastic.cluster.rounds.tracker import Change


class RecordReader:
    """Reads member keys, join requests and done marks for a ``RoundTracker``.

    Args:
        keys: the job's key builder.
        member_id: this member (its own events are not news; "" for none).
        skipped: where malformed join requests are reported (once each).
    """

    def __init__(self, keys: JobKeys, member_id: str,
                 skipped: SkippedRecords | None = None) -> None:
        self._keys = keys
        self._skipped = skipped or SkippedRecords()
        self.member_id = member_id
        self._round = 0
        self._members: frozenset[str] = frozenset()
        self._done: set[str] = set()
        self._gone: set[str] = set()  # members whose key was deleted since the last start
        self._missed: list[str] = []  # members of the round gone before it was tracked

    def start(self, round_: int, members: tuple[str, ...]) -> None:
        """See ``RoundReader``."""
        self._round = round_
        self._members = frozenset(members)
        self._done = set()
        self._missed, self._gone = sorted(self._gone & self._members), set()

    def catch_up(self, round_: int, client: EtcdClient) -> list[WatchEvent]:
        """A member of the round whose key was deleted since the last start (one that died
        between the plan and now would otherwise go unnoticed until the form timeout), and the
        next round's joins (read from etcd)."""
        missed = [WatchEvent("delete", self._keys.member(m), b"", 0) for m in self._missed]
        joins, _ = client.get_prefix(self._keys.joins(round_ + 1))
        return missed + [WatchEvent("put", kv.key, kv.value, kv.mod_revision) for kv in joins]

    def observe(self, events: list[WatchEvent], round_: int | None) -> list[Change]:
        """See ``RoundReader``."""
        self._gone.update(e.key[len(self._keys.members):] for e in events
                          if e.kind == "delete" and e.key.startswith(self._keys.members))
        if round_ is None:
            return []
        changes = [self._consider(event) for event in events]
        return [change for change in changes if change is not None]

    def _consider(self, event: WatchEvent) -> Change | None:
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
                return Change(f"member {member} left the round",
                              f"member {member} of round {self._round} is gone")
        return None

    def _on_join(self, request: JoinRequest) -> Change | None:
        if request.member_id == self.member_id or request.reason == "spare":
            return None
        broken = f"member {request.member_id} reported a failure of round {self._round}" \
            if request.reason == "failure" else ""
        return Change(f"member {request.member_id} asks to join ({request.reason})", broken)
