"""Membership at scale against a real etcd: what a change costs each member, and the coordinator.

Members here are threads of this process, each a real member (its own lease, member key and
join requests) wired as ``Cluster`` wires them, without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.cluster.rounds.coordinator import Coordinator
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.worker_lease_file import heartbeat
from elastic.cluster.rounds.membership import EtcdMembership, NodeLease, drop_member
from elastic.cluster.rounds.news import NewsReader, RoundNews
from elastic.cluster.rounds.plan import JoinRequest
from elastic.cluster.rounds.records import RecordError
from elastic.cluster.rounds.rendezvous import Rendezvous, RendezvousConfig
from elastic.cluster.rounds.topology import Topology
from elastic.cluster.rounds.tracker import RoundTracker
from elastic.foundation.errors import (EtcdUnavailableError, FencedError, LeaveInterrupt,
                                       RendezvousClosedError)
from tests.support.polling import poll_until
from tests.support.limited_etcd import MAX_TXN_OPS
from elastic.foundation.timeouts import Timeouts

LEASE_10S = Timeouts.from_env({}, lease_ttl=timedelta(seconds=10))

pytestmark = pytest.mark.timeout(120)
TIMEOUTS = Timeouts()
WAIT_S = 30


class Member:
    """One member: membership, rendezvous and its news monitor; counts the events it hears."""

    def __init__(self, client: EtcdClient, job: str, version: int = 0,
                 node_lease: NodeLease | None = None,
                 config: RendezvousConfig = RendezvousConfig(timeouts=TIMEOUTS)) -> None:
        self.client = client
        self.version = version
        self.membership = EtcdMembership(client, JobKeys(job), "127.0.0.1", LEASE_10S,
                                         claim=JobKeys(job).coordinator, node_lease=node_lease)
        self.rendezvous = Rendezvous(client, self.membership, config)
        self.broken = threading.Event()
        self.monitor = RoundTracker(NewsReader(JobKeys(job)), lambda reason: self.broken.set())
        self.heard: Counter[str] = Counter()
        self.membership.add_listener(self._count)
        self.membership.add_listener(self.monitor.on_events)
        # As ``Cluster`` registers: the registration carries the first join request.
        self.membership.register(self.rendezvous.first_join("start", version, 29500))

    def _count(self, events: list[WatchEvent]) -> None:
        keys = self.membership.keys
        self.heard["events"] += len(events)
        self.heard["bytes"] += sum(len(e.value) for e in events)
        self.heard["news"] += sum(e.key == keys.news for e in events)
        self.heard["others"] += sum(not e.key.startswith(keys.control)
                                    and e.key not in (keys.member(self.id), keys.seat(self.id))
                                    for e in events)

    @property
    def id(self) -> str:
        return self.membership.member_id

    def form(self, reason: str) -> Topology:
        self.monitor.disarm()
        topology = self.rendezvous.join(reason, self.version, 29500)
        assert topology is not None
        self.monitor.arm(topology, self.client)
        return topology

    def leave(self) -> None:
        self.rendezvous.stop()
        self.membership.leave()


def form_all(members: list[Member], reason: str) -> list[Topology]:
    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(lambda m: m.form(reason), members, timeout=WAIT_S))



def verdicts_on(members: list[Member], round_: int) -> list[int]:
    """Counts, whichever member leads, how many requests each verdict on ``round_`` weighed."""
    weighed: list[int] = []
    for m in members:
        def counted(n, requests, *args, verdict=m.rendezvous.verdict):  # noqa: ANN001, ANN202
            if n == round_:
                weighed.append(len(requests))
            return verdict(n, requests, *args)
        m.rendezvous.verdict = counted
    return weighed

def test_a_change_costs_each_member_a_few_events_and_never_another_members_record(client):
    members = [Member(client, "scale-events", version=i) for i in range(24)]
    try:
        first = form_all(members, "start")
        assert {t.round for t in first} == {1} and {t.world_size for t in first} == {24}
        # A member's join returns with its seat, before the round's news: count the death's
        # events once every member heard the news of round 1.
        assert poll_until(lambda: all(m.heard["news"] for m in members), WAIT_S)
        before = {m.id: m.heard["events"] for m in members}
        heard = {m.id: m.heard["bytes"] for m in members}
        victim = next(m for m, t in zip(members, first) if t.rank == 23)
        client.revoke(victim.membership.lease)  # what its launcher does after a SIGKILL
        survivors = [m for m in members if m is not victim]
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        second = form_all(survivors, "failure")
        assert {t.round for t in second} == {2} and {t.world_size for t in second} == {23}
        assert max(m.heard["events"] - before[m.id] for m in survivors) <= 5
        assert sum(m.heard["others"] for m in members) == 0
        # Only rank 0 is handed every rank: the others hear less than the plan holds, whatever N.
        plan = members[0].rendezvous.read_plan(2)
        assert plan is not None and plan.world_size == 23
        rank0 = next(m for m, t in zip(survivors, second) if t.rank == 0)
        assert max(m.heard["bytes"] - heard[m.id] for m in survivors if m is not rank0) \
            < len(plan.to_json())
    finally:
        for m in members:
            m.leave()



def test_a_round_of_more_members_than_etcd_takes_operations_per_transaction_forms(
        small_txn_etcd):
    client = EtcdClient(small_txn_etcd.url)
    members = [Member(client, "scale-small-txn") for _ in range(3 * MAX_TXN_OPS)]
    try:
        formed = form_all(members, "start")
        assert sorted(t.rank for t in formed) == list(range(len(members)))
    finally:
        for m in members:
            m.leave()
        client.close()

def test_a_round_whose_closer_died_before_seating_its_members_is_seated_by_the_coordinator(
        client):
    keys = JobKeys("scale-unseated")
    config = RendezvousConfig(min_workers=3, timeouts=TIMEOUTS)  # the coordinator never closes
    members = [Member(client, keys.job_id, version=i, config=config) for i in range(2)]
    try:
        with ThreadPoolExecutor(len(members)) as pool:
            forming = [pool.submit(m.form, "start") for m in members]
            assert poll_until(lambda: len(client.get_prefix(keys.joins(1))[0]) == 2, WAIT_S)
            joins, _ = client.get_prefix(keys.joins(1))
            leases = {m.id: m.membership.lease for m in members}
            closer = members[0].rendezvous
            requests = [closer.admissible(1, kv, leases) for kv in joins]
            # A closer writes the plan and moves the round, then dies: no seat, no news.
            assert closer.close(1, 0, [r for r in requests if r is not None], None)
            formed = [f.result(timeout=WAIT_S) for f in forming]
        assert sorted((t.rank, t.member_id) for t in formed) == [(0, members[1].id),
                                                                 (1, members[0].id)]
        assert {t.lineage for t in formed} == {formed[0].lineage}
        def told() -> int:
            news = client.get(keys.news)
            return 0 if news is None else RoundNews.from_json(news.value).round

        assert poll_until(lambda: told() == 1, WAIT_S), "the news follows the seats"
    finally:
        for m in members:
            m.leave()


class CountingClient(EtcdClient):
    """An etcd client that keeps the description of every request it sends."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    def _call(self, op, what, retry_for=None):
        self.sent.append(what)
        return super()._call(op, what, retry_for)


def test_a_death_costs_each_survivor_one_write_and_no_read_and_the_plan_is_written_once(etcd):
    counting = CountingClient(etcd.url)
    members = [Member(counting, "scale-requests") for _ in range(12)]
    try:
        first = form_all(members, "start")
        victim = next(m for m, t in zip(members, first) if t.rank == 11)
        survivors = [m for m in members if m is not victim]
        # The coordinator follows round 1 after its members formed it: it reads round 2's
        # join requests as it arms round 1's monitor. Count from then on.
        assert poll_until(lambda: any(w.endswith("/rounds/00000002/join/*")
                                      for w in counting.sent), WAIT_S)
        counting.sent.clear()
        counting.revoke(victim.membership.lease)
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        form_all(survivors, "failure")
        sent = [w for w in counting.sent if w != "lease keepalive"]
        joins = [w for w in sent if w.startswith("put ") and "/join/" in w]
        reads = [w for w in sent if w.startswith("get ")]
        plans = [w for w in sent if w.startswith("create ") and w.endswith("/plan")]
        assert len(joins) == len(survivors)
        assert len(plans) == 1
        # The new plan reaches each survivor with its news; only the coordinator reads (the
        # news and the next round's join requests, as it follows the round it closed).
        assert len(reads) <= 3, reads
    finally:
        for m in members:
            m.leave()
        counting.close()


def test_a_coordinator_whose_watch_has_not_brought_its_own_news_back_writes_the_next_at_once(
        etcd, monkeypatch):
    """Two changes in a row (a newcomer, then a death) while the coordinator's ``control/``
    watch holds back the news it wrote: the second news goes out in one try, not retried
    against a revision that only that watch would correct; and once the watch brings the
    first news back late, the next round's news still goes out in one try."""
    held: list[tuple[Coordinator, WatchEvent]] = []
    lagging = threading.Event()
    hear = Coordinator._on_control

    def late_news(self, events):  # noqa: ANN001, ANN202
        if lagging.is_set():
            held.extend((self, e) for e in events if e.key == self._keys.news)
            events = [e for e in events if e.key != self._keys.news]
        hear(self, events)

    monkeypatch.setattr(Coordinator, "_on_control", late_news)
    counting = CountingClient(etcd.url)
    replace, written = counting.replace, []

    def counted(key, *args, **kwargs):  # noqa: ANN001, ANN202
        done = replace(key, *args, **kwargs)
        written.append(done.revision)
        return done

    monkeypatch.setattr(counting, "replace", counted)
    keys = JobKeys("scale-late-news")
    news = lambda: RoundNews.from_json(counting.get(keys.news).value)  # noqa: E731
    members = [Member(counting, "scale-late-news") for _ in range(3)]
    newcomer: Member | None = None
    joined: list[Topology] = []
    try:
        form_all(members, "start")
        # Registered once the job has a round: it asks for round 2 (one registered before
        # would be in round 1, its registration carrying its request).
        newcomer = Member(counting, "scale-late-news")
        joining = threading.Thread(target=lambda: joined.append(newcomer.form("start")),
                                   daemon=True)
        lagging.set()
        joining.start()
        assert poll_until(lambda: news().pending, WAIT_S), "the newcomer's news"
        written.clear()
        leader = counting.get(keys.coordinator).value.decode()
        victim = next(m for m in members if m.id != leader)
        counting.revoke(victim.membership.lease)
        assert poll_until(lambda: written and news().broken, WAIT_S), \
            "the death's news, while the watch lags"
        assert len(written) == 1 and written[0], f"the news took {len(written)} tries"
        lagging.clear()
        coordinator, first = held[0]
        hear(coordinator, [first])  # late: older than what the coordinator wrote since
        written.clear()
        form_all([m for m in members if m is not victim], "failure")
        joining.join(WAIT_S)
        assert not joining.is_alive() and [t.round for t in joined] == [2]
        # Its members hold their seats before the news: the news may still be on its way.
        assert poll_until(lambda: written and news().round == 2, WAIT_S), "round 2's news"
        assert all(written), f"refused news writes: {written}"
    finally:
        lagging.clear()
        for m in [*members, *([newcomer] if newcomer else [])]:
            m.leave()
        counting.close()


def test_the_coordinator_weighs_a_roll_call_once_its_last_awaited_member_asked_not_at_each_join(
        client):
    members = [Member(client, "scale-weighed") for _ in range(24)]
    weighed = verdicts_on(members, 2)
    try:
        first = form_all(members, "start")
        victim = next(m for m, t in zip(members, first) if t.rank == 23)
        survivors = [m for m in members if m is not victim]
        client.revoke(victim.membership.lease)
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        assert {t.world_size for t in form_all(survivors, "failure")} == {23}
        # The first request of round 1's members starts the rejoin clock; then nothing is
        # weighed (O(N) each time) until every live member of round 1 asked.
        assert weighed and weighed[-1] == 23
        assert len([w for w in weighed if w < 23]) <= 1, weighed
    finally:
        for m in members:
            m.leave()


def test_the_coordinator_weighs_a_first_round_once_every_registered_member_asked(client):
    members = [Member(client, "scale-weighed-first") for _ in range(24)]  # all registered
    weighed = verdicts_on(members, 1)
    try:
        assert {t.world_size for t in form_all(members, "start")} == {24}
        # A first round closes only once every live member asked: before, nothing to weigh.
        assert weighed and set(weighed) == {24}, weighed
    finally:
        for m in members:
            m.leave()

def test_a_first_round_costs_each_member_a_lease_and_a_registration_that_carries_its_join(etcd):
    counting = CountingClient(etcd.url)
    members: list[Member] = []
    try:
        members = [Member(counting, "scale-first") for _ in range(12)]
        assert all(m.membership.carried for m in members)
        assert {t.world_size for t in form_all(members, "start")} == {12}
        sent = [w for w in counting.sent if w != "lease keepalive"]
        assert sum(w == "lease grant" for w in sent) == len(members)
        assert sum(w.startswith("register ") for w in sent) == len(members)
        assert [w for w in sent if w.startswith("put ") and "/join/" in w] == [], sent
        # Registering took the coordinator key (the first member) or saw who holds it, and
        # told each member the news: nobody reads the key or races to create it, and only the
        # coordinator reads the news (once, as it follows the round it closed).
        assert [w for w in sent if w.endswith("/coordinator")] == [], sent
        assert sum(w.startswith("get ") and w.endswith("/news") for w in sent) <= 1, sent
        # The plan reaches each member with its news; the coordinator reads the job once as it
        # takes the lead, then the news and the next round's join requests as it follows.
        reads = [w for w in sent if w.startswith("get ")]
        assert len(reads) <= 4, reads
        assert sum(m.membership.claimed for m in members) == 1
    finally:
        for m in members:
            m.leave()
        counting.close()


def test_a_member_registering_once_the_job_has_a_round_carries_no_join_and_asks_by_a_write(
        client):
    keys = JobKeys("scale-late")
    members = [Member(client, "scale-late") for _ in range(2)]
    late = None
    try:
        form_all(members, "start")
        late = Member(client, "scale-late")
        assert not late.membership.carried
        assert client.get(keys.join(1, late.id)) is None
        left = threading.Event()
        with ThreadPoolExecutor(1) as pool:  # a newcomer: round 2 waits for the others
            asked = pool.submit(late.rendezvous.join, "start", 0, 29500, cancelled=left.is_set)
            assert poll_until(lambda: client.get(keys.join(2, late.id)) is not None, WAIT_S)
            left.set()
            with pytest.raises(LeaveInterrupt):
                asked.result(timeout=WAIT_S)
    finally:
        for m in [*members, *([late] if late else [])]:
            m.leave()


def test_a_first_join_asked_otherwise_than_the_registration_carried_is_written_again(client):
    member = Member(client, "scale-carried-other", version=0)
    try:
        assert member.membership.carried
        topology = member.rendezvous.join("start", 7, 29500)  # a commit since registering
        assert topology is not None and topology.round == 1
        plan = member.rendezvous.read_plan(1)
        assert plan is not None and plan.versions == {member.id: 7}
    finally:
        member.leave()


def test_the_newest_holder_is_rank_0_of_a_round_closed_by_the_coordinator(client):
    members = [Member(client, "scale-newest", version=v) for v in (3, 9, 5)]
    try:
        topologies = form_all(members, "start")
        assert topologies[1].rank == 0 and topologies[1].master_port == 29500
        assert len({t.store_prefix for t in topologies}) == 1
    finally:
        for m in members:
            m.leave()


def test_when_the_coordinators_lease_ends_another_member_takes_over_and_the_round_re_forms(
        client):
    members = [Member(client, "scale-takeover") for _ in range(4)]
    try:
        form_all(members, "start")
        leader_id = client.get(JobKeys("scale-takeover").coordinator).value.decode()
        leader = next(m for m in members if m.id == leader_id)
        client.revoke(leader.membership.lease)
        survivors = [m for m in members if m is not leader]
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        topologies = form_all(survivors, "failure")
        assert {t.round for t in topologies} == {2} and {t.world_size for t in topologies} == {3}
        new_leader = client.get(JobKeys("scale-takeover").coordinator).value.decode()
        assert new_leader in {m.id for m in survivors}
    finally:
        for m in members:
            m.leave()


def test_a_death_a_survivor_sees_only_after_it_asked_is_reported_without_waiting_for_the_wake(
        client):
    """Seen in the recovery benchmark (1.1 s instead of 0.1 s): a SIGKILLed worker's agreement
    connection ended a moment after rank 0 asked for the next round (the dead worker's heartbeat
    process still held a copy), and rank 0 looked at its connections again only at its wake."""
    slow_wake = RendezvousConfig(timeouts=replace(TIMEOUTS, wake=timedelta(seconds=60)))
    rank0, other, dead = [Member(client, "scale-late-end", version=v, config=slow_wake)
                          for v in (2, 1, 0)]  # the newest commit is rank 0; rank0 leads
    looks = []

    def lost_after_two_looks(n: int) -> dict[str, str]:  # as the channel's peers_lost tells
        looks.append(n)
        return {dead.id: "ended"} if len(looks) > 2 else {}

    try:
        assert [t.rank for t in form_all([rank0, other, dead], "start")] == [0, 1, 2]
        dead.rendezvous.stop()  # its lease lives on (no launcher revokes it): only rank0 knows
        heard = rank0.heard["news"]
        with ThreadPoolExecutor(2) as pool:
            others = pool.submit(other.rendezvous.join, "failure", 1, 29500)
            assert poll_until(lambda: rank0.heard["news"] > heard, WAIT_S), "its ask is told"
            ours = pool.submit(rank0.rendezvous.join, "failure", 2, 29500,
                               gone=lost_after_two_looks)
            topologies = [ours.result(timeout=WAIT_S), others.result(timeout=WAIT_S)]
        assert [(t.round, t.world_size) for t in topologies] == [(2, 2), (2, 2)]
        assert len(looks) >= 3, "reported at a look after the end"
    finally:
        for m in (rank0, other):
            m.leave()
        dead.membership.leave()


def test_a_newcomer_makes_the_round_pending_without_breaking_it(client):
    members = [Member(client, "scale-newcomer") for _ in range(3)]
    newcomer = None
    try:
        form_all(members, "start")
        newcomer = Member(client, "scale-newcomer")
        joining = threading.Thread(target=newcomer.form, args=("start",), daemon=True)
        joining.start()
        assert all(m.monitor.pending.wait(WAIT_S) for m in members)
        assert not any(m.broken.is_set() for m in members)
        assert newcomer.id in members[0].monitor.reason
        form_all(members, "change")
        joining.join(WAIT_S)
        assert newcomer.rendezvous.latest_round() == 2
    finally:
        for m in members + ([newcomer] if newcomer else []):
            m.leave()


def test_a_member_whose_first_seat_came_before_it_asked_takes_that_seat(client):
    # Seen in the rollback matrix under load: the registration carries the request for round
    # 1; the round closed and the seat came by watch before the member called ``join``, which
    # then asked for round 2, and round 1's group waited out the 20 s form timeout for it.
    keys = JobKeys("scale-seated-early")
    first = Member(client, "scale-seated-early")
    late = Member(client, "scale-seated-early")  # round 1 closes a settle window later
    told = threading.Event()
    late.membership.add_listener(lambda events: told.set() if any(
        e.key == keys.seat(late.id) for e in events) else None)
    left = threading.Event()
    pool = ThreadPoolExecutor(2)
    try:
        formed = pool.submit(first.form, "start")  # its coordinator closes round 1
        assert told.wait(WAIT_S)  # after the rendezvous' own listener heard it
        asked = pool.submit(late.rendezvous.join, "start", 0, 29500, cancelled=left.is_set)
        topology = asked.result(timeout=10)
        assert topology is not None and topology.round == 1
        assert formed.result(timeout=WAIT_S).round == 1
    finally:
        left.set()
        pool.shutdown(wait=True)
        for m in (first, late):
            m.leave()


def test_a_member_whose_seat_watch_opened_after_its_first_seat_was_written_takes_that_seat(
        client):
    # Seen in the rollback matrix on CI: the seat's watch opens from etcd's revision of the
    # moment it opens, the ``control/`` watch from the registration's. Round 1 closed in
    # between: the news came, the seat never did; the member asked for round 2 (as a spare,
    # round 1 being full) and round 1's group waited out the 20 s form timeout for it.
    config = RendezvousConfig(max_workers=2, timeouts=TIMEOUTS)
    first = Member(client, "scale-seat-missed", config=config)
    late = Member(client, "scale-seat-missed", config=config)
    late.membership._cancel_watches.pop(0)()  # the seat's watch: as if it opened too late
    left = threading.Event()
    pool = ThreadPoolExecutor(2)
    try:
        formed = pool.submit(first.form, "start")
        assert poll_until(lambda: late.heard["news"], WAIT_S)  # round 1's news, by watch
        asked = pool.submit(late.rendezvous.join, "start", 0, 29500, cancelled=left.is_set)
        topology = asked.result(timeout=10)
        assert topology is not None and (topology.round, topology.world_size) == (1, 2)
        assert formed.result(timeout=WAIT_S).round == 1
    finally:
        left.set()
        pool.shutdown(wait=True)
        for m in (first, late):
            m.leave()


def test_a_newcomer_to_a_world_at_max_workers_asks_as_a_spare_and_takes_a_dead_members_place(
        client):
    # The rollback matrix's spurious re-formation (issue 39): of workers started together, the
    # first round closes once max_workers asked; one registering just after asked as a
    # newcomer ("start"), news to the running world, which re-formed at its next commit into
    # the same world with the newcomer a spare. A spare's request ("spare") is not news.
    config = RendezvousConfig(max_workers=2, timeouts=TIMEOUTS)
    keys = JobKeys("scale-full")
    members = [Member(client, "scale-full", config=config) for _ in range(2)]
    newcomer = None
    left, told = threading.Event(), threading.Event()
    pool = ThreadPoolExecutor(1)
    try:
        form_all(members, "start")
        newcomer = Member(client, "scale-full", config=config)
        joining = pool.submit(newcomer.rendezvous.join, "start", 0, 29500, cancelled=left.is_set,
                              on_spare=told.set)
        assert told.wait(WAIT_S)  # a spare at once, with no round formed to say so
        asked = JoinRequest.from_json(client.get(keys.join(2, newcomer.id)).value, 0,
                                      newcomer.id)
        assert asked.reason == "spare"
        client.revoke(members[1].membership.lease)
        assert members[0].broken.wait(WAIT_S)
        topology = members[0].form("failure")
        taken = joining.result(timeout=WAIT_S)
        assert (topology.round, taken.round, taken.world_size) == (2, 2, 2)
    finally:
        left.set()
        pool.shutdown(wait=True)
        for m in members + ([newcomer] if newcomer else []):
            m.leave()


def test_a_member_whose_wait_failed_after_it_asked_takes_the_seat_of_that_round_on_retry(
        client):
    # A member of round 1 asks for round 2; its wait fails (etcd unreachable for a moment) and
    # the run loop forms again. Round 2 closed with it meanwhile and its news came, its seat
    # not (the seat's watch opening again after the outage): it asked for round 3, and round
    # 2's group waited out the 20 s form timeout for it.
    job = "scale-retry-seat"
    first, second = Member(client, job), Member(client, job)
    left = threading.Event()
    pool = ThreadPoolExecutor(2)
    try:
        form_all([first, second], "start")
        second.membership._cancel_watches.pop(0)()  # the seat's watch, not open again yet
        asked: list[int] = []

        def gone(n: int) -> dict[str, str]:  # fails once its request is written
            asked.append(n)
            if len(asked) == 2:
                raise EtcdUnavailableError("etcd unreachable for a moment")
            return {}

        with pytest.raises(EtcdUnavailableError):
            second.rendezvous.join("change", 0, 29500, gone=gone)
        assert (first.form("change").round, asked) == (2, [2, 2])
        assert poll_until(lambda: second.rendezvous._news_now().round == 2, WAIT_S)
        retried = pool.submit(second.rendezvous.join, "change", 0, 29500, cancelled=left.is_set)
        topology = retried.result(timeout=10)
        assert topology is not None and (topology.round, topology.world_size) == (2, 2)
    finally:
        left.set()
        pool.shutdown(wait=True)
        for m in (first, second):
            m.leave()


@pytest.mark.parametrize("standby", [False, True], ids=["newcomer-at-max", "warm-spare"])
def test_a_spare_beside_a_healthy_round_outwaits_every_rendezvous_deadline(client, standby):
    # A spare's request is not news: no round forms for it while the world trains on. Its
    # rendezvous and admit deadlines counted anyway, and it died of RendezvousTimeoutError (at
    # 300 s and 1800 s by default), its launcher spending a restart on it each time.
    timeouts = Timeouts.from_env({}, rendezvous=timedelta(seconds=2), admit=timedelta(seconds=3))
    config = RendezvousConfig(min_workers=2, max_workers=2, timeouts=timeouts)
    job = f"scale-spare-outwaits-{standby}"
    members = [Member(client, job, config=config) for _ in range(2)]
    spare = None
    left = threading.Event()
    pool = ThreadPoolExecutor(1)
    try:
        form_all(members, "start")
        spare = Member(client, job, config=replace(config, standby=standby))
        asked = pool.submit(spare.rendezvous.join, "start", 0, 29500, cancelled=left.is_set)
        with pytest.raises(FutureTimeout):  # neither a seat nor an error past both deadlines
            asked.result(timeout=5)
        client.revoke(members[1].membership.lease)
        assert members[0].broken.wait(WAIT_S)
        assert members[0].form("failure").world_size == 2
        taken = asked.result(timeout=WAIT_S)
        assert taken is not None and (taken.round, taken.world_size) == (2, 2)
    finally:
        left.set()
        pool.shutdown(wait=True)
        for m in members + ([spare] if spare else []):
            m.leave()


def test_a_spare_asking_again_below_max_workers_is_news_and_takes_the_free_place(client):
    # A member left out as a spare asks again as "spare", which is not news. When the world
    # fell below max_workers without taking it (its request came after that round closed),
    # a "spare" request would wait for a re-formation that nobody starts.
    config = RendezvousConfig(max_workers=2, timeouts=TIMEOUTS)
    keys = JobKeys("scale-spare-again")
    running = Member(client, "scale-spare-again", config=config)
    spare = None
    left = threading.Event()
    pool = ThreadPoolExecutor(1)
    try:
        form_all([running], "start")  # a world of 1: a place is free
        spare = Member(client, "scale-spare-again", config=config)
        joining = pool.submit(spare.rendezvous.join, "spare", 0, 29500, cancelled=left.is_set)
        assert poll_until(lambda: client.get(keys.join(2, spare.id)), timeout_s=WAIT_S)
        asked = JoinRequest.from_json(client.get(keys.join(2, spare.id)).value, 0, spare.id)
        assert asked.reason == "start"
        assert running.monitor.pending.wait(WAIT_S), "the running member was not told of it"
        topology = running.form("change")
        taken = joining.result(timeout=WAIT_S)
        assert (topology.round, taken.round, taken.world_size) == (2, 2, 2)
    finally:
        left.set()
        pool.shutdown(wait=True)
        for m in [running] + ([spare] if spare else []):
            m.leave()


def test_a_member_joining_after_the_job_finished_is_told_so(client):
    members = [Member(client, "scale-finished") for _ in range(2)]
    late = None
    try:
        topologies = form_all(members, "start")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda mt: mt[0].rendezvous.finish(mt[1], timedelta(seconds=WAIT_S)),
                          zip(members, topologies), timeout=WAIT_S))
        late = Member(client, "scale-finished")
        with pytest.raises(RendezvousClosedError):
            late.form("start")
    finally:
        for m in members + ([late] if late else []):
            m.leave()


def test_members_whose_leases_all_ended_finish_without_waiting_for_a_coordinator(client):
    members = [Member(client, "scale-all-fenced") for _ in range(2)]
    try:
        topologies = form_all(members, "start")
        for m in members:  # an etcd frozen past every lease: nobody can coordinate any more
            client.revoke(m.membership.lease)
        assert all(m.membership.fenced.wait(WAIT_S) for m in members)
        # finish may wait an hour for a coordinator: one that did would hang the test until the
        # map's bound (a hang guard) fails it.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda mt: mt[0].rendezvous.finish(mt[1], timedelta(hours=1)),
                          zip(members, topologies), timeout=90))
    finally:
        for m in members:
            m.leave()


@pytest.mark.parametrize("raw", [b"[]", b'{"round": -1}', b'{"round": 1, "broken": 7}',
                                 b'{"round": 1, "done": "yes"}', b'{"round": 1, "extra": 1}'])
def test_a_malformed_news_record_is_refused(raw):
    with pytest.raises(RecordError):
        RoundNews.from_json(raw)


class HearingClient(EtcdClient):
    """An etcd client that keeps the (key, revision) of every event its watches deliver, and
    the (first key, start revision) of every watch it opens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heard: list[tuple[str, int]] = []
        self.opened: list[tuple[str, int]] = []
        self._heard_lock = threading.Lock()

    def watch_range(self, keys, start_revision, callback, on_open=None):
        with self._heard_lock:
            self.opened.append((keys.start, start_revision))

        def heard(events):
            with self._heard_lock:
                self.heard.extend((e.key, e.revision) for e in events)
            callback(events)
        return super().watch_range(keys, start_revision, heard, on_open)


def test_no_event_reaches_a_member_twice_and_a_death_costs_five_events_per_member_at_most(etcd):
    clients = [HearingClient(etcd.url) for _ in range(6)]
    members: list[Member] = []
    try:
        members = [Member(c, "scale-once") for c in clients]
        first = form_all(members, "start")
        # The last rank that does not coordinate (a coordinator's death also costs a takeover).
        victim = max((m for m in members if not m.membership.claimed),
                     key=lambda m: first[members.index(m)].rank)
        survivors = [m for m in members if m is not victim]
        leader = next(m for m in survivors if m.membership.claimed)
        # Its members formed round 1 by their own seats; count once the coordinator's watch
        # brought it the round counter of round 1 too, and every member's the round's news
        # (which comes after the seats): else a late one would be counted as the death's.
        keys = JobKeys("scale-once")
        assert poll_until(lambda: any(k == keys.round for k, _ in leader.client.heard), WAIT_S)
        assert poll_until(lambda: all(any(k == keys.news for k, _ in m.client.heard)
                                      for m in survivors), WAIT_S)
        before = {id(m): len(m.client.heard) for m in survivors}
        clients[0].revoke(victim.membership.lease)
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        form_all(survivors, "failure")
        for m in members:
            twice = [k for k, n in Counter(m.client.heard).items() if n > 1]
            assert twice == [], f"member {m.id} heard these by two watches: {twice}"
        heard = {m.id: len(m.client.heard) - before[id(m)] for m in survivors}
        # Each survivor: the broken news, the new round's news and its plan's copy. The
        # coordinator also hears the death, the survivors' join requests and the new round.
        assert all(n <= 3 for member, n in heard.items() if member != leader.id), heard
        assert sum(heard.values()) <= 5 * len(survivors), heard
    finally:
        for m in members:
            m.leave()
        for c in clients:
            c.close()


def test_a_member_watches_the_control_keys_and_its_seat_and_the_seat_from_etcds_next_revision(
        etcd):
    """Two watches per member: a watch that starts in the past is etcd's slow path (caught up
    in batches, from its history), so only ``control/`` starts at the registration; the seat,
    written with the member key, carries its end too."""
    client = HearingClient(etcd.url)
    keys = JobKeys("scale-two-watches")
    members: list[Member] = []
    try:
        members = [Member(client, "scale-two-watches") for _ in range(4)]
        form_all(members, "start")
        with client._heard_lock:  # noqa: SLF001
            opened = Counter(start for start, _ in client.opened)
            seats = sorted(start for start, revision in client.opened
                           if revision == 0 and start.startswith(keys.seats))
            # The empty seat written with the member key reaches nobody: each hears round 1's.
            heard = Counter(key for key, _ in client.heard if key.startswith(keys.seats))
        assert heard and all(n == 1 for n in heard.values()), heard
        assert opened[keys.control] == len(members), client.opened
        assert seats == sorted(keys.seat(m.id) for m in members), client.opened
        assert sum(opened.values()) == 2 * len(members) + 1, "and the coordinator's watch"
        victim = next(m for m in members if not m.membership.claimed)
        client.revoke(victim.membership.lease)
        assert victim.membership.fenced.wait(WAIT_S)
    finally:
        for m in members:
            m.leave()
        client.close()


def test_a_member_whose_key_is_deleted_by_hand_is_fenced_and_the_others_form_without_it(
        client):
    keys = JobKeys("scale-key-deleted")
    members = [Member(client, "scale-key-deleted") for _ in range(4)]
    try:
        form_all(members, "start")
        victim = next(m for m in members if not m.membership.claimed)
        assert client.delete(keys.member(victim.id))  # its lease lives on
        assert victim.membership.fenced.wait(WAIT_S), "the coordinator deletes its seat"
        assert client.get(keys.seat(victim.id)) is None
        assert client.refresh(victim.membership.lease) > 0
        survivors = [m for m in members if m is not victim]
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        second = form_all(survivors, "failure")
        assert {t.round for t in second} == {2} and {t.world_size for t in second} == {3}
    finally:
        for m in members:
            m.leave()


def test_a_member_whose_key_is_deleted_while_no_coordinator_watches_is_fenced_when_left_out(
        client):
    """The coordinator deletes the seat of a member whose key it saw deleted; one deleted while
    none leads keeps its seat, and finds its key gone when a round closes without it."""
    keys = JobKeys("scale-key-unwatched")
    members = [Member(client, "scale-key-unwatched") for _ in range(3)]
    try:
        form_all(members, "start")
        leader = next(m for m in members if m.membership.claimed)
        victim, survivor = [m for m in members if m is not leader]
        leader.rendezvous.stop()  # its coordinator stops watching
        assert client.delete(keys.member(victim.id))
        leader.membership.leave()  # then the coordinator key goes with its lease
        assert all(m.broken.wait(WAIT_S) for m in (victim, survivor))
        with ThreadPoolExecutor(2) as pool:
            left_out = pool.submit(victim.form, "failure")
            second = survivor.form("failure")
            with pytest.raises(FencedError):
                left_out.result(timeout=WAIT_S)
        assert (second.round, second.world_size) == (2, 1)
        assert victim.membership.fenced.is_set()
    finally:
        for m in members:
            m.leave()


def test_a_coordinator_whose_key_is_deleted_under_it_steps_down_and_one_member_leads_again(
        client):
    keys = JobKeys("scale-key-lost")
    members = [Member(client, "scale-key-lost") for _ in range(4)]
    leading = lambda: [m for m in members  # noqa: E731
                       if m.rendezvous._coordinator.is_leading]  # noqa: SLF001
    try:
        first = form_all(members, "start")
        assert client.delete(keys.coordinator)  # an operator's mistake, or a restored etcd
        assert poll_until(lambda: client.get(keys.coordinator) is not None, WAIT_S)
        holder = client.get(keys.coordinator).value.decode()
        assert poll_until(lambda: [m.id for m in leading()] == [holder], WAIT_S), \
            [m.id for m in leading()]
        victim = next(m for m, t in zip(members, first) if t.rank == 3)
        client.revoke(victim.membership.lease)
        survivors = [m for m in members if m is not victim]
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        topologies = form_all(survivors, "failure")
        assert {t.round for t in topologies} == {2} and {t.world_size for t in topologies} == {3}
    finally:
        for m in members:
            m.leave()


def test_the_membership_benchmark_forms_thirty_members_and_reforms_them_after_a_death(tmp_path):
    """``benchmarks/bench_membership.py`` at a small size, so that it does not rot between the
    runs its figures come from: both phases finish, within the per-member targets, and every
    member process ends when told to. Thirty, not ten: the coordinator's own events (one per
    join) and a change's few fixed ones are spread over the members, and over nine survivors
    they alone came to 4.9-7.1 events each."""
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "membership.json"
    ran = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_membership.py"),
                          "--sizes", "30", "--procs", "2", "--limit", "30", "--declared-size",
                          "--timeline", "--out", str(out)], capture_output=True, text=True,
                         timeout=90, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    phases = json.loads(out.read_text())["results"][0]["phases"]
    assert [(p["phase"], p["finished"], p["fenced"]) for p in phases] == [
        ("first_round", True, 0), ("one_death", True, 0)]
    # A member's lease and its registration (which carries its join) are its writes; the
    # coordinator's plan, seats and news add a tenth of one each, its reads about as much. A
    # member reads its seat once if its seat's watch, opened after it registered, opened after
    # the seat was written (the last to register, on a busy machine: up to 0.9 per member
    # here); never more, and never the plan.
    first = phases[0]["per_member"]
    assert 2 <= first["client_write"] < 2.5 and first["client_read"] < 1.5, first
    death = phases[1]["per_member"]
    assert death["client_write"] <= 3 and death["etcd_watch_events"] <= 5, death
    line = phases[0]["timeline"]
    assert line["registered_100%"] <= line["plan"] and line["joined_100%"] <= line["plan"] \
        <= line["seated_100%"] <= line["news"], line
    line = phases[1]["timeline"]
    assert line["broken_news"] is not None and line["joined_100%"] <= line["plan"] \
        <= line["seated_100%"] <= line["news"], line


def test_the_keepalive_benchmark_renews_on_one_stream_and_its_anchor_on_one_per_renewal(
        tmp_path):
    """``benchmarks/bench_keepalive.py`` at its smallest, so that it does not rot."""
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "keepalive.json"
    ran = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_keepalive.py"),
                          "--clients", "3", "--seconds", "1", "--rounds", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=90, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    results = {r["how"]: r for r in json.loads(out.read_text())["results"]}
    assert results["one stream"]["streams_opened_per_renewal"] == 0, results
    assert results["stream per renewal"]["streams_opened_per_renewal"] > 0.9, results
    assert all(r["renewals_per_s"] > 0 for r in results.values()), results


class Node:
    """What a launcher with ``--node-lease`` holds: one lease for its workers, and the
    heartbeats of each member they reported."""

    def __init__(self, client: EtcdClient) -> None:
        self.lease = client.grant(timedelta(seconds=10))
        self.beats: Counter[str] = Counter()

    def share(self) -> NodeLease:
        reported: list[str] = []
        return NodeLease(self.lease, reported.append, lambda: self.beats.update(reported))


def test_workers_sharing_their_nodes_lease_grant_and_renew_nothing_and_a_dropped_one_is_fenced(
        etcd):
    counting = CountingClient(etcd.url)
    keys = JobKeys("scale-node-lease")
    node = Node(counting)
    members = [Member(counting, "scale-node-lease", node_lease=node.share()) for _ in range(4)]
    try:
        first = form_all(members, "start")
        assert {t.world_size for t in first} == {4}
        assert {counting.get(keys.member(m.id)).lease for m in members} == {node.lease}
        assert counting.get(keys.coordinator).lease == node.lease
        assert poll_until(lambda: all(node.beats[m.id] >= 2 for m in members), WAIT_S), \
            node.beats  # a heartbeat at registration, then one per keepalive interval
        assert [w for w in counting.sent if w.startswith(("lease grant", "lease keepalive"))] \
            == ["lease grant"], "only the node's own grant: no member granted or renewed"
        # The coordinator dies: its launcher removes it, and the coordinator key with it.
        victim = next(m for m in members if m.rendezvous._coordinator.is_leading)  # noqa: SLF001
        assert victim.membership.confirm_lease(), "its member key is there, under the node's lease"
        assert drop_member(counting, keys, victim.id, node.lease)
        assert victim.membership.fenced.wait(WAIT_S), "the dropped member was not fenced"
        assert not victim.membership.confirm_lease()
        survivors = [m for m in members if m is not victim]
        assert all(m.broken.wait(WAIT_S) for m in survivors)
        second = form_all(survivors, "failure")
        assert {t.round for t in second} == {2} and {t.world_size for t in second} == {3}
        rank0 = next(t for t in second if t.rank == 0)
        assert sorted(rank0.members) == sorted(m.id for m in survivors)
        assert counting.get(keys.coordinator).value.decode() in {m.id for m in survivors}
        assert not drop_member(counting, keys, victim.id, node.lease), "removed twice"
    finally:
        for m in members:
            m.leave()
        counting.revoke(node.lease)
        counting.close()


def test_a_worker_leaving_under_its_nodes_lease_removes_its_own_keys_and_no_others(client):
    keys = JobKeys("scale-node-leave")
    node = Node(client)
    members = [Member(client, "scale-node-leave", node_lease=node.share()) for _ in range(3)]
    try:
        form_all(members, "start")
        leaving = next(m for m in members if m.rendezvous._coordinator.is_leading)  # noqa: SLF001
        leaving.leave()
        assert client.get(keys.member(leaving.id)) is None
        assert client.get(keys.coordinator) is None or \
            client.get(keys.coordinator).value.decode() != leaving.id
        assert all(client.get(keys.member(m.id)) is not None for m in members if m is not leaving)
        assert client.refresh(node.lease) > 0, "leaving revoked the node's lease"
    finally:
        for m in members:
            m.leave()
        client.revoke(node.lease)


def test_a_worker_whose_nodes_lease_is_gone_registers_under_a_lease_of_its_own_and_a_new_id(
        client):
    """Under a new id: a lost reply may have registered the id it drew first under the node's
    lease, and that registration's end deletes the seat of that id."""
    keys = JobKeys("scale-node-gone")
    node = Node(client)
    client.revoke(node.lease)  # its launcher ended before the worker registered
    reported: list[str] = []
    member = Member(client, "scale-node-gone",
                    node_lease=NodeLease(node.lease, reported.append, lambda: None))
    try:
        kv = client.get(keys.member(member.id))
        assert kv is not None and kv.lease not in (0, node.lease)
        assert member.membership.node_lease is None
        assert reported and member.id not in reported, "it registered again under its first id"
        assert member.form("start").world_size == 1
    finally:
        member.leave()


def test_a_drop_that_finds_the_member_key_gone_still_deletes_its_seat_and_fences_it(client):
    """An earlier ``drop_member`` deleted the key, and its seat delete was lost (etcd went away
    between the two): the launcher's next try must delete the seat, the member's fence, even
    while no coordinator watches (which would delete it too)."""
    keys = JobKeys("scale-drop-again")
    node = Node(client)
    members = [Member(client, "scale-drop-again", node_lease=node.share()) for _ in range(3)]
    try:
        form_all(members, "start")
        leader = next(m for m in members if m.membership.claimed)
        victim = next(m for m in members if m is not leader)
        leader.rendezvous.stop()  # its coordinator stops watching
        assert client.delete(keys.member(victim.id))  # the earlier try's first delete
        assert not drop_member(client, keys, victim.id, node.lease), "the key was gone already"
        assert client.get(keys.seat(victim.id)) is None
        assert victim.membership.fenced.wait(WAIT_S), "the member was not fenced"
    finally:
        for m in members:
            m.leave()
        client.revoke(node.lease)


def test_a_heartbeat_that_cannot_reach_its_launchers_file_stops_in_one_warning(
        client, tmp_path, caplog):
    node = Node(client)
    gone = str(tmp_path / "launcher-ended" / "lease-file")  # its directory does not exist
    member = Member(client, "scale-node-beat", node_lease=NodeLease(
        node.lease, lambda m: None, lambda: heartbeat(gone)))
    try:
        keepalive = member.membership._keepalive  # noqa: SLF001
        keepalive.join(WAIT_S)
        assert not keepalive.is_alive(), "the heartbeat thread went on"
        assert [r.getMessage() for r in caplog.records if "heartbeats" in r.getMessage()] == [
            f"member {member.id} stops its heartbeats ([Errno 2] No such file or directory: "
            f"'{gone}'): its launcher ended, and the node's lease ends with it"]
        assert not member.membership.fenced.is_set()
        assert member.form("start").world_size == 1
    finally:
        member.leave()
        client.revoke(node.lease)
