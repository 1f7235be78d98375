"""What the coordinator tells every member about the newest round, and a member's view of it.

The job's coordinator (``coordinator.py``) is the only member that reads everyone's records. It
writes one small record, ``control/news``: the newest round, whether a change is pending for it
(someone asks to join), whether it is broken (a member of it is gone, or reported a failure),
whether a member of it returned from the training function (``done``: the job is over for a
joiner), and whether every member of it has returned or gone (``finished``). Each member watches
only that record (and its own seat), so a change costs each member a few watch events and
reads, whatever the size of the job.

This module owns the record's format and ``NewsReader``, the member's side: what the news
means for the round it is in, read by its ``RoundTracker`` (``tracker.py``). It must not read
other members' records.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from elastic.cluster.rounds import records
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.records import MAX_ROUND, RecordError, SkippedRecords
from elastic.cluster.rounds.tracker import Change

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


def fetch_news(client: EtcdClient, keys: JobKeys, skipped: SkippedRecords) -> RoundNews | None:
    """The news record as etcd holds it now (None: none yet, or malformed).

    Raises:
        EtcdUnavailableError: etcd could not be reached.
    """
    kv = client.get(keys.news)
    return None if kv is None else skipped.read(kv.key, kv.mod_revision,
                                                lambda: RoundNews.from_json(kv.value))


def job_is_over(client: EtcdClient, keys: JobKeys, skipped: SkippedRecords) -> bool:
    """Whether the news, read from etcd now, says a member returned from the training function
    (False: no news, or malformed).

    Raises:
        EtcdUnavailableError: etcd could not be reached.
    """
    news = fetch_news(client, keys, skipped)
    return news is not None and news.done


class NewsReader:
    """A member's reading of its round, from the news record only, for a ``RoundTracker``.

    Args:
        keys: the job's key builder.
        skipped: where a malformed news record is reported (once each).
    """

    def __init__(self, keys: JobKeys, skipped: SkippedRecords | None = None) -> None:
        self._keys = keys
        self._skipped = skipped or SkippedRecords()
        # The newest news the watch brought, armed or not, and the event that brought it.
        self._latest: tuple[RoundNews, WatchEvent] | None = None
        self._fed = False  # the listener was called: by the registration's hand-over, or later
        self._at_start: tuple[tuple[RoundNews, WatchEvent] | None, bool] = (None, False)

    @property
    def told(self) -> int:
        """The round of the newest news the watch brought (0: none yet)."""
        latest = self._latest
        return 0 if latest is None else latest[0].round

    def start(self, round_: int, members: tuple[str, ...]) -> None:
        """See ``RoundReader``."""
        self._at_start = (self._latest, self._fed)

    def catch_up(self, round_: int, client: EtcdClient) -> list[WatchEvent]:
        """The news written while this member was forming: the newest the watch brought. The
        news of a round is written after its members' seats, so when the watch has brought
        only older news, it brings this round's later; only a reader that was not listening
        from its member's registration (which hands it the ``control/`` keys as they were)
        reads the record (one read)."""
        latest, fed = self._at_start
        if fed:
            return [latest[1]] if latest is not None and latest[0].round >= round_ else []
        kv = client.get(self._keys.news)
        return [] if kv is None else [WatchEvent("put", kv.key, kv.value, kv.mod_revision)]

    def observe(self, events: list[WatchEvent], round_: int | None) -> list[Change]:
        """See ``RoundReader``. News only adds to a round (pending, broken): an older copy, or
        the same one twice, does no harm."""
        self._fed = True
        read = read_news(self._keys, events, self._skipped)
        if read is None:
            return []
        news = read[0]
        if self._latest is None or news.round >= self._latest[0].round:
            self._latest = (news, next(e for e in reversed(events) if e.key == self._keys.news
                                       and e.kind == "put"))
        if round_ is None or news.round != round_:
            return []
        reason = news.broken or news.pending
        return [Change(reason, news.broken)] if reason else []
