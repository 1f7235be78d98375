"""When a crashed worker's replacement starts: once the survivors re-formed without it.

A cold replacement is a new Python process that imports torch and builds the model, seconds of
CPU (one forked from the warm-start template skips the imports, and is held a shorter while). Started at once, it competes for the node's cores with the survivors while they
re-form, the moment when every millisecond is training lost (and, with an embedded etcd that
yields the cores to training, it starves etcd too). So a worker that died in the job's newest
round is replaced ``connect`` after the job has a newer round (the survivors formed it without
the dead worker, and connect its group and move the state meanwhile), or ``wait`` after the
death, whichever comes first: the survivors may be too
few to form a round alone (``--min-workers``), or wait for a member inside a long step. A worker
that was alone in its round, or is in no current round (it died before joining, or the others
went on without it already), is replaced at once. The rounds come from the job's news
(``control/``): one watch, O(1) per change for the launcher; at a death it reads the newest
round's plan once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from elastic.foundation.errors import EtcdAccessError, EtcdUnavailableError
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import read_news
from elastic.cluster.rounds.plan import Plan
from elastic.cluster.rounds.records import RecordError, SkippedRecords


@dataclass(frozen=True)
class Replacement:
    """A worker slot to start again: ``standby`` for a warm spare."""

    local_rank: int
    standby: bool


@dataclass
class _Held:
    replacement: Replacement
    died_in: int  # the round the worker died in
    starts_at: float  # time.monotonic(): its wait runs out, or its survivors had time to connect
    why: str  # what ``starts_at`` comes from
    formed: bool = False  # a round after ``died_in`` was seen


class Replacements:
    """The replacements this launcher holds back until the survivors re-formed.

    Args:
        client: the launcher's etcd client.
        keys: the job's keys (the workers' job, not the launchers').
        wake: set when a held replacement may start (the launcher's loop waits on it).
        wait: the longest a replacement is held back.
        connect: how long after the survivors' round formed it is still held back, while they
            connect its group and move the newest state.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, wake: threading.Event,
                 wait: timedelta, connect: timedelta) -> None:
        self._client, self._keys, self._wake = client, keys, wake
        self._wait_s, self._connect_s = wait.total_seconds(), connect.total_seconds()
        self._lock = threading.Lock()
        self._round = 0  # the newest round, from the news
        self._held: list[_Held] = []
        self._skipped = SkippedRecords()
        self._cancel: Callable[[], None] | None = None

    def hold_after_forming(self, connect: timedelta) -> None:
        """Holds later replacements ``connect`` after their survivors' round formed (a warm
        start needs less than the ``connect`` given at construction)."""
        with self._lock:
            self._connect_s = connect.total_seconds()

    def start(self) -> None:
        """Reads the job's ``control/`` keys and follows them."""
        self._cancel = self._client.follow_prefix(self._keys.control, self._on_events)

    def stop(self) -> None:
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()

    def hold(self, replacement: Replacement, members: list[str]) -> bool:
        """Holds ``replacement`` back while the survivors of the round its worker (known in etcd
        as ``members``) died in re-form; False when it should start now."""
        with self._lock:
            newest = self._round
        try:
            kv = self._client.get(self._keys.plan(newest)) if newest else None
            plan = None if kv is None else Plan.from_json(kv.value, newest)
        except (RecordError, EtcdUnavailableError, EtcdAccessError):
            plan = None  # malformed, or etcd does not answer: do not wait
        if plan is None or plan.world_size < 2 or not set(members) & set(plan.ranks):
            return False
        with self._lock:
            self._held.append(_Held(replacement, plan.round, time.monotonic() + self._wait_s,
                                    f"the others did not re-form within {self._wait_s:g} s"))
        return True

    @property
    def holding(self) -> bool:
        with self._lock:
            return bool(self._held)

    def due(self) -> list[tuple[Replacement, str]]:
        """The held replacements that start now, each with why: their round was followed by
        another, or their wait ran out. They are no longer held."""
        now = time.monotonic()
        with self._lock:
            ready = [h for h in self._held if h.starts_at <= now]
            self._held = [h for h in self._held if h.starts_at > now]
        return [(h.replacement, h.why) for h in ready]

    def wait_s(self, longest: float) -> float:
        """How long the launcher's loop may sleep: ``longest``, or less when a wait runs out."""
        now = time.monotonic()
        with self._lock:
            return max(0.0, min([longest, *(h.starts_at - now for h in self._held)]))

    def _on_events(self, events: list[WatchEvent]) -> None:
        read = read_news(self._keys, events, self._skipped)
        connected = time.monotonic() + self._connect_s
        formed = False
        with self._lock:
            if read is not None:
                self._round = read[0].round
            for held in self._held:
                if not held.formed and self._round > held.died_in:
                    held.formed = formed = True
                    if connected < held.starts_at:
                        held.starts_at = connected
                        held.why = f"the others formed round {self._round}"
        if formed:
            self._wake.set()  # the launcher's loop now sleeps until the connect time is up
