"""What the coordinator tells every member about the newest round, and a member's view of it.

The job's coordinator (``coordinator.py``) is the only member that reads everyone's records. It
writes one small record, ``control/news``: the newest round, whether a change is pending for it
(someone asks to join), whether it is broken (a member of it is gone, or reported a failure),
whether a member of it returned from the training function (``done``: the job is over for a
joiner), and whether every member of it has returned or gone (``finished``). Each member watches
only that record (and its own seat), so a change costs each member a few watch events and
reads, whatever the size of the job.

This module owns the record's format and ``NewsMonitor``, the member's side: ``pending`` and
``on_broken`` for the round it is in. It must not read other members' records.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from elastic.cluster.rounds import records
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.records import MAX_ROUND, RecordError, SkippedRecords
from elastic.cluster.rounds.topology import Topology

log = logging.getLogger(__name__)

_FIELDS = {"round": True, "pending": False, "broken": False, "done": False, "finished": False}
_MAX_REASON = 500


@dataclass(frozen=True)
class RoundNews:
    """The coordinator's word on round ``round`` (the newest with a plan; 0: none yet)."""

    round: int
    pending: str = ""
    broken: str = ""
    done: bool = False
    finished: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes) -> "RoundNews":
        """Reads a news record.

        Raises:
            RecordError: a field is missing, unknown, of the wrong type or out of range.
        """
        data = records.load_object(raw, _FIELDS)
        texts = {name: data.get(name, "") for name in ("pending", "broken")}
        flags = {name: data.get(name, False) for name in ("done", "finished")}
        for name, text in texts.items():
            if type(text) is not str or len(text) > _MAX_REASON:
                raise RecordError(f"{name} is not a text of at most {_MAX_REASON} characters")
        for name, flag in flags.items():
            if type(flag) is not bool:
                raise RecordError(f"{name} is not true or false")
        return RoundNews(round=records.integer("round", data["round"], 0, MAX_ROUND),
                         **texts, **flags)


def read_news(keys: JobKeys, events: list[WatchEvent],
              skipped: SkippedRecords) -> tuple[RoundNews, int] | None:
    """The newest news record among ``events`` and its revision (None: none, or malformed)."""
    for event in reversed(events):
        if event.key == keys.news and event.kind == "put":
            news = skipped.read(event.key, event.revision,
                                lambda e=event: RoundNews.from_json(e.value))
            return None if news is None else (news, event.revision)
    return None


class NewsMonitor:
    """A member's view of its round, fed by the news record only.

    - ``pending`` is set when the world should change at the next commit (a newcomer asked to
      join, or a member of the round left).
    - ``on_broken`` is called (at most once per round) when the round's group cannot go on.

    Args:
        keys: the job's key builder.
        on_broken: called with a reason when the round's group must be released.
        skipped: where a malformed news record is reported (once each).
    """

    def __init__(self, keys: JobKeys, on_broken: Callable[[str], None],
                 skipped: SkippedRecords | None = None) -> None:
        self._keys = keys
        self._on_broken = on_broken
        self._skipped = skipped or SkippedRecords()
        self._lock = threading.Lock()
        self.pending = threading.Event()
        self.reason = ""
        self._round: int | None = None
        self._broken = False
        self._latest: RoundNews | None = None  # the newest news the watch brought, armed or not
        self._fed = False  # the listener was called: by the registration's hand-over, or later

    def arm(self, topology: "Topology", client: EtcdClient) -> None:
        """Starts tracking a newly formed round and acts on the news written while this member
        was forming: the newest the watch brought. The news of a round is written after its
        members' seats, so when the watch has brought only older news, it brings this round's
        later; only a monitor that was not listening from its member's registration (which
        hands it the ``control/`` keys as they were) reads the record (one read)."""
        with self._lock:
            self._round = topology.round
            self._broken = False
            self.pending.clear()
            self.reason = ""
            latest, fed = self._latest, self._fed
        if fed:
            if latest is not None and latest.round >= topology.round:
                self._apply(latest)
            return
        kv = client.get(self._keys.news)
        if kv is not None:
            self.on_events([WatchEvent("put", kv.key, kv.value, kv.mod_revision)])

    @property
    def told(self) -> int:
        """The round of the newest news the watch brought (0: none yet)."""
        with self._lock:
            return 0 if self._latest is None else self._latest.round

    def if_armed(self, action: Callable[[], None]) -> None:
        """Runs ``action`` if a formed round is tracked (not while forming, nor once finished),
        under the lock that ``disarm`` takes: it runs before a re-formation starts, or not at
        all."""
        with self._lock:
            if self._round is not None:
                action()

    def disarm(self) -> None:
        """Stops tracking (during a re-formation nothing may release the group being formed)."""
        with self._lock:
            self._round = None

    def on_peer_gone(self, member: str) -> None:
        """A member's agreement connection ended (its process is gone, or the link went silent;
        ``AgreementChannel.watch``): the round is broken now, without waiting for its lease or
        the news."""
        with self._lock:
            if self._round is None or self._broken:
                return
            self._broken = True
            if not self.pending.is_set():
                self.reason = f"member {member} is gone"
                self.pending.set()
            n = self._round
        self._on_broken(f"member {member} of round {n} is gone (its connection ended)")

    def on_events(self, events: list[WatchEvent]) -> None:
        """Listener for the membership watch (runs on the etcd thread)."""
        read = read_news(self._keys, events, self._skipped)
        with self._lock:
            self._fed = True
        if read is None:
            return
        with self._lock:
            if self._latest is None or read[0].round >= self._latest.round:
                self._latest = read[0]
        self._apply(read[0])

    def _apply(self, news: RoundNews) -> None:
        """Acts on ``news`` if it is of the tracked round. News only adds to a round (pending,
        broken): an older copy, or the same one twice, does no harm."""
        broken = None
        with self._lock:
            if self._round is None or news.round != self._round:
                return
            reason = news.broken or news.pending
            if reason and not self.pending.is_set():
                self.reason = reason
                log.info("membership change pending: %s", reason)
                self.pending.set()
            if news.broken and not self._broken:
                self._broken = True
                broken = news.broken
        if broken:
            self._on_broken(broken)

