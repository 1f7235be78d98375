"""Rounds agreed on etcd: join requests, a roll call of the last round, one plan per round by CAS.

A member reports the members of round ``R`` (the newest planned) whose agreement connection it
saw end (``gone_reports``), asks to be in round ``R + 1`` with its newest commit version, and
waits for its seat in round ``R + 1`` (``seat.py``, by the watch of its own seat key). The job's
coordinator (``coordinator.py``, elected at registration or later by compare-and-swap) closes
the round once the rules allow (``verdict``) by one compare-and-swap that creates
``rounds/{n}/plan`` and moves ``round`` to ``n``: one plan per round. It then writes each member
of the plan its seat, then the round's news (``control/news``). A member that the news of the
round reaches without a seat of that round reads its seat, then the round's plan, once each:
it asked too late, or the watch brought the news first. A worker's registration may carry its
first join request (``first_join``), written with its member key while the job has no round.
Waiting wakes on the watch and at the wake cap (every heartbeat for a member of round ``R``,
which looks at its connections again), never on a polling sleep; it reads no one else's records."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from elastic.foundation.errors import (CutOffError, EtcdAccessError, EtcdRecordError,
                                       EtcdUnavailableError, LeaveInterrupt,
                                       RendezvousClosedError)
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.cluster.etcd.client import KeyValue
from elastic.cluster.etcd.txn import Carried
from elastic.cluster.rounds.plan import CloseRule, JoinRequest, Plan, RendezvousConfig, assign_ranks
from elastic.cluster.rounds import records
from elastic.cluster.rounds.gone_reports import GoneReports
from elastic.cluster.rounds.join_requests import JoinRequests
from elastic.cluster.rounds.verdict import CloseVerdict
from elastic.cluster.rounds.coordinator import Coordinator
from elastic.cluster.rounds.news import RoundNews, fetch_news, read_news
from elastic.cluster.rounds.records import RecordError, SkippedRecords
from elastic.cluster.rounds.round_finish import RoundFinish
from elastic.cluster.rounds.seat import UNSEATED, Seat, seat_in
from elastic.cluster.rounds.topology import Topology

log = logging.getLogger(__name__)

FIRST_ROUND = 1  # a job's first round: the one a registration's join request asks for


class Rendezvous(RoundFinish):
    """Joins rounds of one job.

    Args:
        client: the etcd client.
        membership: this member's registration (its watch wakes the waiting).
        config: the job's limits.
        skipped: where malformed join requests are reported (once each).
    """

    def __init__(self, client: EtcdClient, membership: EtcdMembership,
                 config: RendezvousConfig, skipped: SkippedRecords | None = None) -> None:
        self._client = client
        self._skipped = skipped or SkippedRecords()
        self._membership = membership
        self._keys: JobKeys = membership.keys
        self.config = config
        self.rule = CloseRule(config.min_workers, config.max_workers,
                              config.timeouts.settle.total_seconds(),
                              min(config.timeouts.local_start,
                                  config.timeouts.rendezvous / 2).total_seconds())
        self._changed = threading.Condition()
        self._epoch = 0
        self.standby = config.standby  # a warm spare until a round takes it
        self._news: RoundNews | None = None  # the newest news seen (by watch or one read)
        self._seat: Seat | None = None  # this member's newest seat, as the watch brought it
        self._last_round = 0  # the last round this member was in
        self._asked = 0  # the last round this member wrote a join request for (join)
        # The join request of round 1 that its registration was asked to carry (stored form).
        self._carried: str | None = None
        membership.add_listener(self._on_events)
        # Listening before the registration: it hands over the ``control/`` keys as they were.
        self._hears_registration = not membership.is_registered
        self._gone = GoneReports(client, self._keys, self._skipped)
        self._requests = JoinRequests(client, self._keys, self._skipped, config)
        self.verdict = CloseVerdict(self.rule, config.timeouts.rejoin, self._gone)
        self._coordinator = Coordinator(client, membership, self, self._skipped)

    def _on_events(self, events: list[WatchEvent]) -> None:
        read = read_news(self._keys, events, self._skipped)
        seat = self._read_seat(events)
        with self._changed:
            if read is not None:
                self._news = read[0]  # the watch delivers in order: the last is the newest
            if seat is not None and (self._seat is None or seat.round >= self._seat.round):
                self._seat = seat
            self._epoch += 1
            self._changed.notify_all()

    def _read_seat(self, events: list[WatchEvent]) -> Seat | None:
        """This member's newest seat among ``events`` (None: none, or malformed)."""
        key = self._keys.seat(self._membership.member_id)
        for event in reversed(events):
            if event.key == key and event.kind == "put" and event.value != UNSEATED:
                return self._skipped.read(key, event.revision,
                                          lambda e=event: Seat.from_json(e.value))
        return None

    def stop(self) -> None:
        """Stops this member's coordinator (before its membership leaves)."""
        self._coordinator.stop()

    def _news_now(self) -> RoundNews:
        """The newest news: what the registration handed over (none: round 0) and the watch
        brought since; read once from etcd only by a rendezvous made after it registered."""
        with self._changed:
            if self._news is None and self._hears_registration \
                    and self._membership.is_registered:
                self._news = RoundNews(0)  # the registration found no news
            if self._news is not None:
                return self._news
        news = fetch_news(self._client, self._keys, self._skipped)
        with self._changed:
            if self._news is None:
                self._news = news or RoundNews(0)
            return self._news

    def is_job_done(self) -> bool:
        """Whether the newest news says a member returned from training (the job is over)."""
        return self._news_now().done

    def latest_round(self) -> int:
        """The number of the newest planned round (0: none yet).

        Raises:
            EtcdRecordError: the round counter is not a round number.
        """
        return self._read_round_key()[0]

    def _read_round_key(self) -> tuple[int, int]:
        """The newest planned round and the ``round`` key's mod revision (0, 0: none yet).

        Raises:
            EtcdRecordError: the round counter is not a round number.
        """
        kv = self._client.get(self._keys.round)
        if kv is None:
            return 0, 0
        return records.round_number(self._keys.round, kv.value), kv.mod_revision

    def read_plan(self, n: int, stored: KeyValue | None = None) -> Plan | None:
        """The plan of round ``n``, or None when there is none yet: ``stored`` (the round's
        own key, as a watch of it brought it), else read.

        Raises:
            EtcdRecordError: the stored plan is malformed.
        """
        kv = stored or (self._client.get(self._keys.plan(n)) if n > 0 else None)
        if kv is None:
            return None
        try:
            return Plan.from_json(kv.value, n)
        except RecordError as exc:
            raise records.corrupt(kv.key, str(exc)) from None

    def join(self, reason: str, version: int, port: int,
             cancelled: Callable[[], bool] = lambda: False,
             gone: Callable[[int], dict[str, str]] = lambda n: {},
             came_from: tuple[int, int] = (0, 0),
             on_spare: Callable[[], None] = lambda: None) -> Topology | None:
        """Asks to be in the next round and waits until it forms.

        Args:
            reason: why it joins (``plan.REASONS``).
            version: its newest commit version.
            port: the port it offers as the round's master port.
            cancelled: turns true when it must stop waiting (SIGTERM).
            gone: the members of round ``n - 1`` this member lost, each with how (``ended``,
                ``silent``: they may be cut off, ``frozen``), asked while waiting for round
                ``n`` (reported in etcd, so that nobody waits for their leases).
            came_from: the round this process was last in and its world size (0, 0: none).
            on_spare: called when a new member asks as a spare (the world is full): no round
                forms to tell it so.

        Returns:
            This member's topology, or None when it was left out as a spare (call again).

        Raises:
            RendezvousTimeoutError: fewer than min_workers for longer than the timeout, or
                never admitted by the running members.
            FencedError: this member's lease was lost while waiting.
            CutOffError: the round went on without this member, whose connections to the
                others went down (it must come back as a new member).
            LeaveInterrupt: ``cancelled()`` turned true (SIGTERM) while waiting.
        """
        started = time.monotonic()
        self._coordinator.start()
        while True:
            self._membership.check_not_fenced()
            n = self._newest_told() + 1
            early = self._early_seat(n - 1)
            if early is not None:
                self._check_not_cut(early)
                if early.place == "rank" and early.round == n - 1:
                    return self._take(early)
            if self._last_round and n - 1 > self._last_round:  # it went on: without this one?
                went_on = self.read_plan(self._last_round + 1)
                me = self._membership.member_id
                self._check_not_cut(None if went_on is None else seat_in(went_on, me))
            waits = self._waits(reason)
            request = self._request(self._membership.member_id, reason, version, port,
                                    came_from, waits).to_json()
            reported: set[str] = set()  # before asking: a split is seen whole when all asked
            self._report_gone(n, gone(n), reported)
            carried, self._carried = self._carried, None
            if n != FIRST_ROUND or carried != request or not self._membership.carried:
                self._client.put(self._keys.join(n, self._membership.member_id), request,
                                 lease=self._membership.lease)
            self._asked = n
            if waits and reason != "spare":
                on_spare()
            seat = self._wait_for_seat(n, started, cancelled, gone, reported, waits)
            if seat is None:
                log.info("round %d closed without %s (or was overtaken); asking for the next",
                         n, self._membership.member_id)
                continue
            self._check_not_cut(seat)
            if seat.place == "spare":
                return None
            return self._take(seat)

    def _take(self, seat: Seat) -> Topology:
        """This member's place in the round of ``seat``."""
        self.standby = False
        self._last_round = seat.round
        return Topology.of(seat, self._membership.member_id, self._keys.store(seat.round))

    def _early_seat(self, newest: int) -> Seat | None:
        """This member's seat in a round after its last one that came before ``join`` asked
        for the next (``join`` takes a rank in round ``newest``, and stops at a cut): the
        registration carried the request of round 1 and under load the round closed and the
        watch brought the seat first, or a wait for round ``newest`` failed (etcd unreachable)
        after its request was written and the round closed before the retry. Its round waits
        for it (asking for the next one instead left that round's group waiting out the form
        timeout). When ``newest`` is the round it asked for and the watch brought no seat of
        it (the seat's watch opened, or opened again, after the seat was written; the news
        came by the ``control/`` watch), the seat is read."""
        with self._changed:
            seat = self._seat
        asked = self._asked or (FIRST_ROUND if self._membership.carried else 0)
        if newest == asked > self._last_round and (seat is None or seat.round < newest):
            seat = self._seat_of(newest)
        if seat is None or seat.round <= self._last_round:
            return None
        return seat

    def _request(self, member_id: str, reason: str, version: int, port: int,
                 came_from: tuple[int, int], waits: bool) -> JoinRequest:
        # A member that ``waits`` asks as a spare: the running members do not re-form for it
        # (``record_reader``), and it takes a place at their next re-formation that has one.
        # A spare asking again that finds a free place asks as news ("start").
        asked = "spare" if waits else "start" if reason == "spare" else reason
        return JoinRequest(member_id, version, asked,
                           self._membership.advertise_addr, port, standby=self.standby,
                           from_round=came_from[0], from_world=came_from[1],
                           node=self.config.node, node_workers=self.config.node_workers)

    def _waits(self, reason: str) -> bool:
        """Whether this member asks as a spare, not as news for the running members to re-form
        at their next commit: a warm spare while the newest round's world is at its target
        (also when none formed yet, or its plan cannot be read), and a new process ("start")
        while that world is at ``max_workers``, where a re-formation would only name it a
        spare; so does a spare asking again. A member of the round ("change", "failure")
        never waits."""
        limit = self.config.max_workers
        if not self.standby and (reason not in ("start", "spare") or limit is None):
            return False
        newest = self._newest_told()
        try:
            plan = self.read_plan(newest) if newest else None
        except (EtcdUnavailableError, EtcdAccessError, EtcdRecordError):
            plan = None
        if self.standby:
            return plan is None or plan.is_full
        return plan is not None and limit is not None and plan.world_size >= limit

    def first_join(self, reason: str, version: int, port: int,
                   came_from: tuple[int, int] = (0, 0)) -> Callable[[str], Carried]:
        """The join request of round 1 for this member's registration to carry (given its
        member id): written with the member key while the job has no round yet, so that a
        job's first round costs each member one write fewer. ``join`` then writes it only if
        the registration did not, or if it asks with other arguments or for another round."""
        def carry(member_id: str) -> Carried:
            request = self._request(member_id, reason, version, port, came_from,
                                    self.standby).to_json()
            self._carried = request
            return Carried(self._keys.join(FIRST_ROUND, member_id), request, self._keys.round)

        return carry

    def _newest_told(self) -> int:
        """The newest round this member knows closed: by its news, or by its seat (which the
        watch may bring before the news of its round)."""
        with self._changed:
            seated = 0 if self._seat is None else self._seat.round
        return max(self._news_now().round, seated)

    def _check_not_cut(self, seat: Seat | None) -> None:
        """Raises ``CutOffError`` when ``seat`` says that its round went on without this
        member, cut off (also when its lease outlived the cut: it must not write as itself
        again)."""
        if seat is not None and seat.place == "cut":
            raise CutOffError(f"round {seat.round} went on without "
                              f"{self._membership.member_id}: the network between it and the "
                              "other members went down")

    def _wait_for_seat(self, n: int, started: float, cancelled: Callable[[], bool],
                       gone: Callable[[int], dict[str, str]],
                       reported: set[str], spare: bool = False) -> Seat | None:
        """Waits for this member's seat in round ``n``; None when round ``n`` closed without
        it, or was overtaken (the news is of a later round and no plan of ``n`` is left). A
        ``spare`` (asked as one) waits while round ``n - 1`` trains unbroken, as long as it
        does: no round forms for a spare then, and the deadlines count from its break."""
        enough_since = started  # when the round last had min_workers (checked past the timeout)
        # A member of round n - 1 looks at its connections again every heartbeat: one to a dead
        # member can end a moment after it asked (the dead one's heartbeat process held a copy).
        timeouts = self.config.timeouts
        look = timeouts.heartbeat if 0 < self._last_round == n - 1 else timeouts.wake
        while True:
            with self._changed:
                epoch, seat = self._epoch, self._seat
            if seat is not None and seat.round == n:
                return seat
            self._membership.check_not_fenced()
            if cancelled():
                raise LeaveInterrupt(f"asked to leave while waiting for round {n}")
            news = self._news_now()
            if news.round >= n:  # told after the seats: this member has none, or not heard it
                return self._seat_of(n)
            if news.round == n - 1 and news.done:
                raise RendezvousClosedError(f"The job finished in round {n - 1}; nothing to join.")
            self._report_gone(n, gone(n), reported)
            if spare and news.round == n - 1 and not news.broken:
                started = enough_since = time.monotonic()
            enough_since = self._requests.check_limits(n, started, enough_since, time.monotonic())
            with self._changed:
                if self._epoch == epoch:
                    self._changed.wait(timeout=look.total_seconds())

    def _report_gone(self, n: int, members: dict[str, str], reported: set[str]) -> None:
        """Reports the members of round ``n - 1`` this member lost (``GoneReports``), and
        frees the coordinator key if a dead one held it."""
        dead = self._gone.write(n, self._membership.member_id, self._membership.lease, members,
                                reported)
        if dead:
            self._coordinator.forget_dead(dead)

    def admissible(self, n: int, kv: KeyValue, leases: dict[str, int]) -> JoinRequest | None:
        """``JoinRequests.admissible`` (what the coordinator asks)."""
        return self._requests.admissible(n, kv, leases)

    def close(self, n: int, round_revision: int, requests: list[JoinRequest],
              previous: Plan | None, cut: frozenset[str] = frozenset()) -> Plan | None:
        """Writes round ``n``'s plan and moves ``round`` to ``n``: only if no plan of ``n``
        exists and ``round`` is still what the closer read (``n - 1``), so that ``round`` only
        moves forward, even for a closer that was delayed past later rounds. The members in
        ``cut`` are left out and named in the plan (``verdict``). Returns the plan written
        (None: none); the coordinator then seats its members, tells the round's news and
        deletes the keys of round ``n - 2``."""
        plan = assign_ranks([r for r in requests if r.member_id not in cut],
                            previous.ranks if previous else [], n,
                            self.config.max_workers, self.config.min_workers,
                            previous.target if previous else 0, self.config)
        plan = replace(plan, cut=sorted(cut))
        stored = plan.to_json()
        if self._client.create(self._keys.plan(n), stored, also={self._keys.round: str(n)},
                               unchanged=(self._keys.round, round_revision)):
            log.info("round %d formed by %s: world %d", n, self._membership.member_id,
                     plan.world_size)
            return plan
        return None

    def _seat_of(self, n: int) -> Seat | None:
        """This member's seat in round ``n``, read: its seat key, else the round's plan (None:
        the plan does not name it, or is gone).

        Raises:
            FencedError: this member's seat or, when the round went on without it, its member
                key is gone (deleted before the seat's watch opened, or while no coordinator
                watched): it is fenced now.
        """
        me = self._membership.member_id
        kv = self._client.get(self._keys.seat(me))
        if kv is None:
            self._fence_if_registered("its seat is gone (found while reading it)")
        seat = None if kv is None or kv.value == UNSEATED else self._skipped.read(
            kv.key, kv.mod_revision, lambda: Seat.from_json(kv.value))
        if seat is not None and seat.round == n:
            return seat
        plan = self.read_plan(n)
        mine = None if plan is None else seat_in(plan, me)
        if mine is None and self._client.get(self._keys.member(me)) is None:
            self._fence_if_registered("its member key is gone (found as a round closed "
                                      "without it)")
        return mine

    def _fence_if_registered(self, why: str) -> None:
        """Fences this member for ``why`` unless it has not registered yet or has left.

        Raises:
            FencedError: it was fenced (now or before).
        """
        if self._membership.is_registered and not self._membership.has_left:
            self._membership.fence(why)
            self._membership.check_not_fenced()
