"""The one member of a job that reads everyone's records: it closes rounds and tells the news.

Every member runs a ``Coordinator``; the one whose member lease holds ``control/coordinator``
(taken by the first member's registration, or later by compare-and-swap) leads, the others
wait for that key to go (its lease ended) and then try to take it. The leader watches the job's
keys after ``control/`` (``JobKeys.coordinated``: members and rounds; ``control/`` it hears by its
own member's watch, so no key reaches it twice), keeps the members, join requests and done marks
in memory (O(1) work per event), and:

- closes round ``R + 1`` when the rules allow and seats every member the new plan names,
  then writes the round's news: a member's seat is there before the news of its round
  (``closing.py``: ``verdict.CloseVerdict``, ``Rendezvous.close``, ``seat.py``);
- tracks the formed round with a ``RoundTracker`` reading every member's records (who is
  news, who breaks the round) and writes what it finds into ``control/news``: pending,
  broken, done, finished.

So each change costs the leader O(N) and every other member O(1): they watch only
``control/`` and their own seat. A member whose key is deleted loses its seat too, which fences
it (``membership.py``). A leader taking over reads the job once and acts on what it finds (a
round closed but not yet told, a member of the round gone, joins already waiting).
It never runs collectives and never raises into the training: its etcd errors are logged and
retried at the next wake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from elastic.foundation.errors import (EtcdAccessError, EtcdRecordError, EtcdUnavailableError,
                                       FencedError)
from elastic.cluster.etcd.client import EtcdClient, KeyValue, WatchEvent
from elastic.cluster.rounds.closing import RoundCloser, RoundClosing
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.cluster.rounds.news import RoundNews
from elastic.cluster.rounds.news_writer import NewsWriter
from elastic.cluster.rounds import records
from elastic.cluster.rounds.plan import JoinRequest, Plan
from elastic.cluster.rounds.record_reader import RecordReader
from elastic.cluster.rounds.records import RecordError, SkippedRecords
from elastic.cluster.rounds.tracker import RoundTracker

log = logging.getLogger(__name__)


class Coordinator(RoundClosing):
    """Leads the job's rounds while this member holds the coordinator key.

    Args:
        client: the etcd client.
        membership: this member (its lease binds the coordinator key).
        rendezvous: the job's rendezvous (its close rule, plan reads and closing CAS).
        skipped: where malformed records are reported (once each).
    """

    def __init__(self, client: EtcdClient, membership: EtcdMembership, rendezvous: RoundCloser,
                 skipped: SkippedRecords) -> None:
        self._client = client
        self._membership = membership
        self._keys = membership.keys
        self._rendezvous = rendezvous
        self._skipped = skipped
        self._changed = threading.Condition()
        self._dirty = True
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._cancel_watch: Callable[[], None] | None = None
        self.is_leading = False
        # The leader's view of the job, fed by its watch (guarded by _changed).
        self._members: dict[str, int] = {}
        self._joins: dict[int, dict[str, KeyValue]] = {}
        self._dones: dict[int, set[str]] = {}
        self._gones: dict[int, dict[str, KeyValue]] = {}
        self._plans: dict[int, KeyValue] = {}  # rounds' plans as the watch brought them
        self._closed = 0  # the newest round this leader closed (its watch may not show it yet)
        self._round = 0
        self._latest = 0  # the ``round`` counter as last seen (by the snapshot or the watch)
        self._round_revision = 0
        # Join requests already checked: (key, mod revision, its member's lease) -> request.
        self._checked: dict[tuple[str, int, int | None], JoinRequest | None] = {}
        self._plan: Plan | None = None
        self._plan_members: frozenset[str] = frozenset()  # the tracked plan's ranks
        # The live members that have not asked to join the next round yet (kept by the watch):
        # while one is left, the next round cannot close (``_cannot_close_yet``).
        self._unasked: set[str] = set()
        # Members whose key was deleted: their seats go too (a member's seat is its fence line).
        self._unseat: set[str] = set()
        self._news = RoundNews(0)
        self._told = True  # the news of the tracked round is written (its members are seated)
        self._seated = 0  # the newest round whose members this leader seated
        self._broken = ""
        self._tracker: RoundTracker | None = None
        self._seen: tuple[frozenset[str], frozenset[str]] | None = None
        # (round, when a member of the round before it first asked to join it)
        self._rejoin_since: tuple[int, float] | None = None
        self._last_change = time.monotonic()
        # The news record's writes, and who holds the coordinator key, as this member's
        # ``control/`` watch tells (its registration hands it the keys as they were).
        self._writer = NewsWriter(client, self._keys, lambda: membership.member_id)
        membership.add_listener(self._on_control)

    # -- life -------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the coordinator's thread (once; after the member registered)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastic-coordinator",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops leading and the thread (the key goes with this member's lease)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._wake_s() * 5)
        self._drop_watch()

    def forget_dead(self, members: list[str]) -> None:
        """Frees the coordinator key when its holder is among ``members`` (dead or frozen by
        direct evidence: its connection ended, or its heartbeats stopped), so that a live member
        leads now, not at the holder's lease TTL. Safe if the evidence were wrong: rounds close by compare-and-swap whoever
        leads, and a holder whose key went steps down."""
        kv = self._client.get(self._keys.coordinator)
        if kv is None or kv.value.decode("utf-8", errors="replace") not in members:
            return
        if self._client.delete_if(self._keys.coordinator, kv.mod_revision):
            log.info("the coordinator %s is gone (its connection ended or it froze); taking over",
                     kv.value.decode("utf-8", errors="replace"))
        self._poke()

    def _on_control(self, events: list[WatchEvent]) -> None:
        """Membership listener (``control/``): ``NewsWriter.on_control``; the coordinator
        key's delete (its holder's lease ended) wakes the thread to claim it."""
        if self._writer.on_control(events):
            self._poke()

    def _poke(self) -> None:
        with self._changed:
            self._dirty = True
            self._changed.notify_all()

    def _wake_s(self) -> float:
        return self._rendezvous.config.timeouts.wake.total_seconds()

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                if not self._dirty:
                    self._changed.wait(self._wait_s())
                self._dirty = False
                if self._stopped:
                    return
            try:
                if self._membership.fenced.is_set() or self._membership.has_left:
                    self._step_down("this member was fenced or left")
                    return
                if not self.is_leading:
                    self._claim()
                elif self._coordinator_gone():
                    self._step_down("the coordinator key is gone")
                else:
                    self._step()
            except (EtcdUnavailableError, EtcdAccessError, EtcdRecordError, FencedError) as exc:
                log.warning("the coordinator's step failed (%s); retrying at the next wake",
                            exc)

    def _wait_s(self) -> float:
        """Until the settle deadline of a round that could close, else the wake cap; a member
        that does not lead only wakes for the coordinator key's delete."""
        if not self.is_leading:
            return self._wake_s() * 30
        settle_left = self._rendezvous.rule.settle_s - (time.monotonic() - self._last_change)
        return min(settle_left, self._wake_s()) if settle_left > 0 else self._wake_s()

    # -- taking the lead ----------------------------------------------------------------------
    def _claim(self) -> None:
        """Becomes the leader if this member's registration took the coordinator key, or if
        the key is free (as the watch tells, else as read: the common case of a key held costs
        no write)."""
        me = self._membership.member_id
        known, holder = self._writer.holder()
        if not known:
            kv = self._client.get(self._keys.coordinator)
            holder = None if kv is None else kv.value.decode("utf-8", errors="replace")
        if holder is not None and holder != me:
            return
        if holder is None:
            if not self._client.create(self._keys.coordinator, me, lease=self._membership.lease):
                return
            if not self._writer.took(self._client.get(self._keys.coordinator)):
                return  # gone at once (its lease ended): the watch tells the rest
        log.info("member %s coordinates the job's rounds", self._membership.member_id)
        self._take_over()

    def _take_over(self) -> None:
        """Reads the job once, then follows it by watch from that revision."""
        with self._changed:
            self.is_leading = True
            self._members, self._joins, self._dones, self._gones = {}, {}, {}, {}
            self._plans, self._plan_members, self._unasked = {}, frozenset(), set()
            self._unseat = set()
            self._rejoin_since = None
            self._round, self._latest, self._plan, self._tracker = 0, 0, None, None
            self._closed = 0
            self._broken, self._seen = "", None
        self._writer.lead()
        self._cancel_watch = self._client.follow_range(self._keys.coordinated, self._on_job_events)
        self._step()

    def _coordinator_gone(self) -> bool:
        return self._writer.lost

    def _step_down(self, why: str) -> None:
        if self.is_leading:
            log.info("member %s stops coordinating: %s", self._membership.member_id, why)
        self.is_leading = False
        self._drop_watch()

    def _drop_watch(self) -> None:
        cancel, self._cancel_watch = self._cancel_watch, None
        if cancel is not None:
            cancel()

    # -- the leader's view ----------------------------------------------------------------------
    def _on_job_events(self, events: list[WatchEvent]) -> None:
        """The leader's watch (etcd thread): note the events, tell the tracker, wake up."""
        with self._changed:
            self._note(events)
        tracker = self._tracker
        if tracker is not None:
            tracker.on_events(events)
        self._poke()

    def _note(self, events: list[WatchEvent]) -> None:
        """Keeps members, joins, dones and the round counter (called under ``_changed``)."""
        keys = self._keys
        for e in events:
            if e.key.startswith(keys.members):
                member = e.key[len(keys.members):]
                if e.kind == "put":
                    self._members[member] = e.lease
                    if member not in self._joins.get(self._round + 1, {}):
                        self._unasked.add(member)
                else:
                    self._members.pop(member, None)
                    self._unasked.discard(member)
                    self._unseat.add(member)
            elif e.key == keys.round and e.kind == "put":
                self._round_revision = e.revision
                self._latest = records.round_number(e.key, e.value)
            elif (n := keys.round_of(e.key)) is not None:
                self._note_round_key(n, e)

    def _note_round_key(self, n: int, e: WatchEvent) -> None:
        keys = self._keys
        if e.key.startswith(keys.joins(n)):
            member = e.key[len(keys.joins(n)):]
            joins = self._joins.setdefault(n, {})
            if e.kind == "put":
                joins[member] = KeyValue(e.key, e.value, e.revision, e.create_revision, e.lease)
            else:
                joins.pop(member, None)
            if n == self._round + 1:
                self._note_asked(n, member, e)
        elif e.key == keys.plan(n) and e.kind == "put":
            self._plans[n] = KeyValue(e.key, e.value, e.revision, e.create_revision, e.lease)
        elif e.key.startswith(keys.dones(n)) and e.kind == "put":
            self._dones.setdefault(n, set()).add(e.key[len(keys.dones(n)):])
        elif e.key.startswith(keys.gones(n)):
            gones = self._gones.setdefault(n, {})
            if e.kind == "put":
                gones[e.key] = KeyValue(e.key, e.value, e.revision, e.create_revision, e.lease)
            else:
                gones.pop(e.key, None)

    def _note_asked(self, n: int, member: str, e: WatchEvent) -> None:
        """Keeps who has yet to ask for round ``n``, the next one (called under ``_changed``);
        in a first round, also starts the rejoin clock at the first request of a member that
        was in a round before (as ``_close_next`` would, without its O(N) weighing)."""
        if e.kind == "put":
            self._unasked.discard(member)
            since = self._rejoin_since
            if self._plan is None and (since is None or since[0] != n):
                try:
                    asked = JoinRequest.from_json(e.value, e.revision, member)
                except RecordError:
                    return  # skipped (and reported) when the round is weighed
                if asked.from_round:
                    self._rejoin_since = (n, time.monotonic())
        elif member in self._members:
            self._unasked.add(member)

    # -- one step ------------------------------------------------------------------------------
    def _step(self) -> None:
        """Catches up with the newest round, tells its news, closes the next round when the
        rules allow, and then fences the members whose key went."""
        self._follow_round()
        self._tell()
        self._close_next()
        self._fence_gone()

    def _follow_round(self) -> None:
        """Arms the round tracker when the ``round`` counter moved past the round it tracks."""
        with self._changed:
            latest = self._latest
        if latest == self._round and (latest == 0 or self._tracker is not None):
            return
        with self._changed:
            seen = self._plans.get(latest)
        plan = self._rendezvous.read_plan(latest, seen)
        news_kv = self._client.get(self._keys.news)
        with self._changed:
            self._round, self._plan, self._broken = latest, plan, ""
            self._joins = {n: j for n, j in self._joins.items() if n > latest}
            self._plans = {n: p for n, p in self._plans.items() if n > latest}
            self._gones = {n: g for n, g in self._gones.items() if n > latest}
            self._checked = {k: r for k, r in self._checked.items()
                             if (self._keys.round_of(k[0]) or 0) > latest}
            self._dones = {n: d for n, d in self._dones.items() if n >= latest}
            self._news, self._told = self._read_news(news_kv, latest)
            live = set(self._members)
            asked = self._joins.get(latest + 1, {})
            self._unasked = {m for m in live if m not in asked}
            self._plan_members = frozenset(plan.ranks) if plan is not None else frozenset()
        if plan is None:
            self._tracker = None
            return
        tracker = RoundTracker(RecordReader(self._keys, "", self._skipped), self._on_broken)
        # Members of the round already gone are news of this round; the tracker acts on them
        # (and on the next round's joins, which it reads) when armed.
        tracker.on_events([WatchEvent("delete", self._keys.member(m), b"", 0)
                           for m in plan.ranks if m not in live])
        self._tracker = tracker
        tracker.arm(_Round(latest, tuple(plan.ranks)), self._client)
        with self._changed:
            done = set(self._dones.get(latest, ()))
        tracker.on_events([WatchEvent("put", self._keys.done(latest, m), b"1", 0) for m in done])

    def _read_news(self, kv: KeyValue | None, latest: int) -> tuple[RoundNews, bool]:
        """The stored news of round ``latest``, and True; else the news to tell, and False
        (the round was closed, but its members were not told yet)."""
        if kv is not None:
            self._writer.saw(kv)
            news = self._skipped.read(kv.key, kv.mod_revision,
                                      lambda: RoundNews.from_json(kv.value))
            if news is not None and news.round == latest:
                return news, True
        return RoundNews(latest), False

    def _on_broken(self, reason: str) -> None:
        """The tracker's verdict (any thread): told at the next step."""
        with self._changed:
            self._broken = reason
            self._dirty = True
            self._changed.notify_all()

    def _tell(self) -> None:
        """Writes the news of the tracked round when it changed (one write per change); a new
        round's news only once every member it names has its seat."""
        tracker, plan = self._tracker, self._plan
        if tracker is None or plan is None:
            return
        if not self._told:
            self._seat(plan)
        with self._changed:
            done_set = self._dones.get(self._round, set())
            # O(1) until a member is done (every step of a roll call comes here).
            done = bool(done_set) and not done_set.isdisjoint(plan.ranks)
            finished = done and all(m in done_set or m not in self._members
                                    for m in plan.ranks)
            news = replace(self._news, broken=self._news.broken or self._broken,
                           pending=self._news.pending or (tracker.reason
                                                          if tracker.pending.is_set() else ""),
                           done=done, finished=finished)
            if news == self._news and self._told:
                return
        if self._write_news(news):
            self._news, self._told = news, True

    def _write_news(self, news: RoundNews) -> bool:
        """``NewsWriter.write``; when it is refused, a step again soon (it read what moved)."""
        if self._writer.write(news):
            return True
        self._poke()
        return False


class _Round:
    """The part of a topology a ``RoundTracker`` reads: the round and its members."""

    def __init__(self, round_: int, members: tuple[str, ...]) -> None:
        self.round = round_
        self.members = members
