"""The round tracker on fake watch events, reading every member's records (the coordinator's
side) or the news record (a worker's): what is news, what breaks a round (no etcd)."""

from __future__ import annotations

import pytest

from elastic.cluster.etcd.client import KeyValue, WatchEvent
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import NewsReader, RoundNews
from elastic.cluster.rounds.plan import JoinRequest
from elastic.cluster.rounds.record_reader import RecordReader
from elastic.cluster.rounds.topology import Topology
from elastic.cluster.rounds.seat import lineage
from elastic.cluster.rounds.tracker import RoundTracker

pytestmark = pytest.mark.unit

KEYS = JobKeys("job")
ME = "m0"
ROUND = 3


class FakeClient:
    """Stands in for the etcd client's reads: a fixed key -> value map (a monitor only reads)."""

    def __init__(self, values: dict[str, bytes] | None = None) -> None:
        self.values = dict(values or {})
        self.reads: list[str] = []

    def _kv(self, key: str, revision: int) -> KeyValue:
        return KeyValue(key, self.values[key], revision, revision, 0)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        self.reads.append(prefix)
        keys = sorted(k for k in self.values if k.startswith(prefix))
        return [self._kv(k, i + 1) for i, k in enumerate(keys)], len(self.values)

    def get(self, key: str) -> KeyValue | None:
        self.reads.append(key)
        return self._kv(key, 1) if key in self.values else None


def topology(round_: int = ROUND, members: tuple[str, ...] = (ME, "m1", "m2")) -> Topology:
    return Topology(round=round_, rank=members.index(ME), world_size=len(members),
                    member_id=ME, rank0=members[0], master_addr="127.0.0.1", master_port=1234,
                    store_prefix=KEYS.store(round_), lineage=lineage(round_, members),
                    members=members)


def join_value(member: str, reason: str = "start") -> bytes:
    return JoinRequest(member, 0, reason, "127.0.0.1", 4000).to_json().encode()


def join(member: str, reason: str = "start", round_: int = ROUND + 1) -> WatchEvent:
    return WatchEvent("put", KEYS.join(round_, member), join_value(member, reason), 10)


def gone(member: str) -> WatchEvent:
    return WatchEvent("delete", KEYS.member(member), b"", 11)


def done(member: str, round_: int = ROUND) -> WatchEvent:
    return WatchEvent("put", KEYS.done(round_, member), b"1", 12)


def live_client(members: tuple[str, ...] = (ME, "m1", "m2")) -> FakeClient:
    return FakeClient({KEYS.member(m): b"{}" for m in members})


@pytest.fixture
def broken() -> list[str]:
    return []


@pytest.fixture
def monitor(broken: list[str]) -> RoundTracker:
    m = RoundTracker(RecordReader(KEYS, ME), broken.append)
    m.arm(topology(), live_client())
    return m


def test_a_join_request_for_the_next_round_sets_pending_with_a_reason(monitor, broken):
    monitor.on_events([join("new")])
    assert monitor.pending.is_set()
    assert "new" in monitor.reason and "start" in monitor.reason
    assert broken == []


def test_a_join_request_for_a_later_round_is_news_too(monitor):
    monitor.on_events([join("new", round_=ROUND + 2)])
    assert monitor.pending.is_set()


def test_a_join_request_for_the_current_round_is_not_news(monitor, broken):
    monitor.on_events([join("late", round_=ROUND)])
    assert not monitor.pending.is_set() and broken == []


def test_this_members_own_join_request_is_not_news(monitor, broken):
    monitor.on_events([join(ME, "change"), join(ME, "failure")])
    assert not monitor.pending.is_set() and monitor.reason == "" and broken == []


def test_a_spare_asking_again_is_not_news(monitor, broken):
    monitor.on_events([join("spare-1", "spare")])
    assert not monitor.pending.is_set() and broken == []


def test_the_first_reason_is_kept_while_a_change_is_pending(monitor):
    monitor.on_events([join("first")])
    monitor.on_events([join("second")])
    assert "first" in monitor.reason and "second" not in monitor.reason


def test_a_member_of_the_round_losing_its_key_breaks_the_round_once_naming_it(monitor, broken):
    monitor.on_events([gone("m1")])
    assert len(broken) == 1 and "m1" in broken[0] and str(ROUND) in broken[0]
    assert monitor.pending.is_set() and "m1" in monitor.reason


def test_a_member_that_posted_done_then_leaves_is_not_a_failure(monitor, broken):
    monitor.on_events([done("m1")])
    monitor.on_events([gone("m1")])
    assert broken == [] and not monitor.pending.is_set()


def test_done_and_leaving_in_one_batch_is_not_a_failure_either(monitor, broken):
    monitor.on_events([done("m1"), gone("m1")])
    assert broken == [] and not monitor.pending.is_set()


def test_a_done_of_another_round_does_not_excuse_a_member_leaving(monitor, broken):
    monitor.on_events([done("m1", round_=ROUND - 1), gone("m1")])
    assert len(broken) == 1 and "m1" in broken[0]


def test_a_member_outside_the_round_leaving_is_ignored(monitor, broken):
    monitor.on_events([gone("stranger")])
    assert broken == [] and not monitor.pending.is_set()


def test_this_member_losing_its_own_key_is_not_reported_by_the_monitor(monitor, broken):
    monitor.on_events([gone(ME)])
    assert broken == [] and not monitor.pending.is_set()


def test_a_join_request_losing_its_key_is_not_a_member_leaving(monitor, broken):
    monitor.on_events([WatchEvent("delete", KEYS.join(ROUND, "m1"), b"", 13)])
    assert broken == [] and not monitor.pending.is_set()


def test_a_member_of_another_job_leaving_is_ignored(monitor, broken):
    other = JobKeys("job").launchers()  # the sibling prefix of the job's launchers
    monitor.on_events([WatchEvent("delete", other.member("m1"), b"", 13)])
    assert broken == [] and not monitor.pending.is_set()


def test_a_failure_join_breaks_the_round_and_sets_pending(monitor, broken):
    monitor.on_events([join("m2", "failure")])
    assert len(broken) == 1 and "m2" in broken[0] and "failure" in broken[0]
    assert monitor.pending.is_set() and "failure" in monitor.reason


def test_a_change_join_sets_pending_without_breaking_the_round(monitor, broken):
    monitor.on_events([join("m2", "change")])
    assert monitor.pending.is_set() and broken == []


def test_the_round_is_broken_at_most_once(monitor, broken):
    monitor.on_events([gone("m1"), gone("m2")])
    monitor.on_events([join("m2", "failure")])
    monitor.on_events([gone("m2")])
    assert len(broken) == 1


def test_re_arming_for_a_new_round_allows_one_more_break(monitor, broken):
    monitor.on_events([gone("m1")])
    monitor.arm(topology(ROUND + 1, (ME, "m2")), live_client((ME, "m2")))
    assert not monitor.pending.is_set() and monitor.reason == ""
    monitor.on_events([gone("m2")])
    monitor.on_events([gone("m2")])
    assert len(broken) == 2 and "m2" in broken[1] and str(ROUND + 1) in broken[1]


def test_re_arming_forgets_the_old_rounds_members_and_dones(monitor, broken):
    monitor.on_events([done("m1")])
    monitor.arm(topology(ROUND + 1, (ME, "m2")), live_client((ME, "m2")))
    monitor.on_events([gone("m1")])
    assert broken == [] and not monitor.pending.is_set()


def test_a_disarmed_monitor_ignores_everything(monitor, broken):
    monitor.disarm()
    monitor.on_events([join("new"), join("m2", "failure"), gone("m1")])
    assert broken == [] and not monitor.pending.is_set() and monitor.reason == ""


def test_joins_that_arrived_while_forming_are_picked_up_at_arm(broken):
    client = live_client()
    client.values.update({KEYS.join(ROUND + 1, "early"): join_value("early"),
                          KEYS.join(ROUND, "m1"): join_value("m1")})
    monitor = RoundTracker(RecordReader(KEYS, ME), broken.append)
    monitor.arm(topology(), client)
    assert KEYS.joins(ROUND + 1) in client.reads
    assert monitor.pending.is_set() and "early" in monitor.reason and broken == []


def test_a_failure_join_that_arrived_while_forming_breaks_the_round_at_arm(broken):
    client = live_client()
    client.values[KEYS.join(ROUND + 1, "m2")] = join_value("m2", "failure")
    monitor = RoundTracker(RecordReader(KEYS, ME), broken.append)
    monitor.arm(topology(), client)
    assert len(broken) == 1 and "m2" in broken[0]


def test_only_own_and_spare_joins_while_forming_leave_the_round_quiet(broken):
    client = live_client()
    client.values.update({KEYS.join(ROUND + 1, ME): join_value(ME, "change"),
                          KEYS.join(ROUND + 1, "s"): join_value("s", "spare")})
    monitor = RoundTracker(RecordReader(KEYS, ME), broken.append)
    monitor.arm(topology(), client)
    assert not monitor.pending.is_set() and broken == []


@pytest.mark.timeout(5)
def test_on_broken_may_call_back_into_the_monitor_without_deadlock():
    calls: list[str] = []

    def on_broken(reason: str) -> None:
        calls.append(reason)
        monitor.disarm()

    monitor = RoundTracker(RecordReader(KEYS, ME), on_broken)
    monitor.arm(topology(), live_client())
    monitor.on_events([gone("m1")])
    assert len(calls) == 1


def test_a_member_of_the_round_gone_before_arm_breaks_the_round_at_arm(broken):
    monitor = RoundTracker(RecordReader(KEYS, ME), broken.append)
    monitor.disarm()
    monitor.on_events([gone("m1")])  # dropped: nothing is armed during the forming
    monitor.arm(topology(), live_client((ME, "m2")))
    assert len(broken) == 1 and "m1" in broken[0]


def test_a_member_whose_connection_ended_breaks_the_round_before_its_lease_runs_out(monitor,
                                                                                    broken):
    monitor.on_peer_gone("m2")
    assert len(broken) == 1 and "m2" in broken[0]
    monitor.on_events([gone("m2")])  # its lease runs out later: the round broke once
    assert len(broken) == 1


# -- a worker's side: the same tracker reading the news record only ----------------------------

def news(round_: int = ROUND, revision: int = 20, **fields: object) -> WatchEvent:
    return WatchEvent("put", KEYS.news, RoundNews(round_, **fields).to_json().encode(), revision)


@pytest.fixture
def worker(broken: list[str]) -> RoundTracker:
    tracker = RoundTracker(NewsReader(KEYS), broken.append)
    tracker.on_events([])  # its registration handed it the control/ keys: no news yet
    tracker.arm(topology(), FakeClient())
    return tracker


def test_news_of_a_pending_change_sets_pending_and_breaks_nothing(worker, broken):
    worker.on_events([news(pending="member new asks to join (start)")])
    assert worker.pending.is_set() and "new" in worker.reason and broken == []


def test_news_of_a_broken_round_breaks_it_once_however_often_it_comes(worker, broken):
    worker.on_events([news(broken="member m1 of round 3 is gone")])
    worker.on_events([news(broken="member m1 of round 3 is gone", revision=21)])
    assert broken == ["member m1 of round 3 is gone"] and "m1" in worker.reason


def test_news_of_another_round_is_not_news_of_this_one(worker, broken):
    worker.on_events([news(ROUND - 1, broken="member m1 of round 2 is gone")])
    assert not worker.pending.is_set() and broken == []


def test_news_that_came_while_forming_is_acted_on_at_arm_without_a_read(broken):
    tracker = RoundTracker(NewsReader(KEYS), broken.append)
    tracker.on_events([news(broken="member m2 of round 3 is gone")])  # before the round formed
    client = FakeClient()
    tracker.arm(topology(), client)
    assert broken == ["member m2 of round 3 is gone"] and client.reads == []
    assert tracker.reader.told == ROUND


def test_a_reader_that_never_heard_the_watch_reads_the_news_once_at_arm(broken):
    client = FakeClient({KEYS.news: RoundNews(ROUND, pending="member n asks to join (start)")
                         .to_json().encode()})
    tracker = RoundTracker(NewsReader(KEYS), broken.append)
    tracker.arm(topology(), client)
    assert client.reads == [KEYS.news] and tracker.pending.is_set() and broken == []


def test_a_worker_whose_peer_connection_ended_breaks_the_round_before_the_news(worker, broken):
    worker.on_peer_gone("m2")
    worker.on_events([news(broken="member m2 of round 3 is gone")])
    assert len(broken) == 1 and "connection ended" in broken[0]
