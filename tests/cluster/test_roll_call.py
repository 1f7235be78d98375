"""When a re-formation may close: every member of the last round accounted for (no I/O)."""

from __future__ import annotations

import pytest

from elastic.cluster.rounds.plan import CloseRule, JoinRequest
from elastic.cluster.rounds.roll_call import (Evidence, RollCall, cut_off, dead, heirs_short,
                                              may_close, returning_short)

pytestmark = pytest.mark.unit

RULE = CloseRule(min_workers=1, max_workers=None, settle_s=0.5)
PREVIOUS = ["a", "b", "c"]  # round n - 1, rank 0 first


def req(member: str, reason: str = "failure") -> JoinRequest:
    return JoinRequest(member, 0, reason, f"addr-{member}", 1000)


def roll(dead: set[str] = frozenset(), waited_s: float = 0.0) -> RollCall:
    return RollCall(PREVIOUS, frozenset(dead), waited_s, rejoin_s=120.0)


def test_a_live_member_inside_a_long_step_is_waited_for_however_long_the_quiet():
    joins = [req("a"), req("b")]
    assert not may_close(joins, {"a", "b", "c"}, roll(waited_s=60.0), 60.0, RULE)


def test_a_live_member_that_never_rejoins_is_left_out_after_the_rejoin_timeout():
    joins = [req("a"), req("b")]
    assert may_close(joins, {"a", "b", "c"}, roll(waited_s=120.0), 0.0, RULE)


def test_a_member_dead_by_evidence_is_not_waited_for_although_its_lease_lives():
    joins = [req("a"), req("b")]
    assert may_close(joins, {"a", "b", "c"}, roll(dead={"c"}), 0.0, RULE)


def test_a_member_whose_lease_is_gone_is_not_waited_for():
    assert may_close([req("a"), req("b")], {"a", "b"}, roll(), 0.0, RULE)


def test_an_unknown_joiner_that_registered_but_has_not_asked_gets_the_settle_window():
    joins = [req("a"), req("b"), req("c")]
    live = {"a", "b", "c", "new"}
    assert not may_close(joins, live, roll(), 0.2, RULE)
    assert may_close(joins, live, roll(), 0.5, RULE)


def test_a_newcomer_alone_never_closes_a_round_without_the_running_members():
    assert not may_close([req("new", "start")], {"a", "b", "c", "new"}, roll(), 600.0, RULE)


def test_a_reformation_below_min_workers_waits_even_when_everyone_is_accounted_for():
    rule = CloseRule(min_workers=3, max_workers=None, settle_s=0.5)
    assert not may_close([req("a"), req("b")], {"a", "b"}, roll(dead={"c"}), 100.0, rule)


LEASES = {"a": 11, "b": 12, "c": 13}


@pytest.mark.parametrize("report, credible", [
    (Evidence("c", "a", 11), True),  # rank 0 saw rank 2's connection end
    (Evidence("a", "b", 12), True),  # rank 1 saw rank 0's connection end
    (Evidence("c", "b", 12), False),  # rank 1 holds no connection to rank 2
    (Evidence("c", "a", 12), False),  # not written under the reporter's lease
    (Evidence("c", "a", 0), False),  # written without a lease
    (Evidence("z", "a", 11), False),  # not a member of the last round
    (Evidence("c", "z", 11), False),  # reported by a stranger
    (Evidence("a", "a", 11), False),  # nobody reports itself dead
])
def test_only_reports_that_a_connection_to_rank_zero_ended_count(report, credible):
    assert report.is_credible(PREVIOUS, LEASES) is credible


def link(member: str, reporter: str) -> Evidence:
    return Evidence(member, reporter, LEASES[reporter])


def silent(member: str, reporter: str) -> Evidence:
    return Evidence(member, reporter, LEASES[reporter], silent=True)


def frozen(member: str, reporter: str) -> Evidence:
    return Evidence(member, reporter, LEASES[reporter], frozen=True)


@pytest.mark.parametrize("joined, reports, cut", [
    # rank 0 (a) cut from everyone: both others lost it, it lost both: it is left out
    ({"a", "b", "c"}, [silent("b", "a"), silent("c", "a"), silent("a", "b"), silent("a", "c")],
     {"a"}),
    # rank 2 (c) cut from everyone: only its link (to rank 0) went silent
    ({"a", "b", "c"}, [silent("c", "a"), silent("a", "c")], {"c"}),
    # one end's report is enough
    ({"a", "b", "c"}, [silent("a", "c")], {"c"}),
    # two workers split: rank 0's side goes on
    ({"a", "b"}, [silent("b", "a"), silent("a", "b")], {"b"}),
    # c went silent but did not ask (its lease decides): not a split
    ({"a", "b"}, [silent("c", "a")], set()),
    # rank 0 did not ask: not a split
    ({"b", "c"}, [silent("a", "b"), silent("a", "c")], set()),
    # ends by a kernel are deaths, never a split: a dead rank 0 that had asked wins nothing
    ({"a", "b"}, [link("a", "b")], set()),
    ({"a", "b", "c"}, [link("c", "a")], set()),
    # a frozen member is no side of a split
    ({"a", "b"}, [frozen("c", "a")], set()),
    # nothing went down
    ({"a", "b", "c"}, [], set()),
])
def test_a_split_job_leaves_out_the_smaller_side_of_rank_zero_and_the_rest(joined, reports, cut):
    assert cut_off(PREVIOUS, joined, reports) == frozenset(cut)


@pytest.mark.parametrize("joined, reports, gone", [
    # a member that stopped beating while its kernel answered is not waited for
    ({"a", "b"}, [frozen("c", "a")], {"c"}),
    ({"b", "c"}, [frozen("a", "b")], {"a"}),
    # a frozen rank 0 that runs again and asks is alive
    ({"a", "b", "c"}, [frozen("a", "b")], set()),
    # rank 0 killed: one end by its kernel is enough
    ({"b", "c"}, [link("a", "b"), link("a", "c")], {"a"}),
    ({"b"}, [link("a", "b")], {"a"}),
    # rank 0 saw c's connection end: c is dead whether or not it asked
    ({"a", "b"}, [link("c", "a")], {"c"}),
    ({"a", "b", "c"}, [link("c", "a"), link("a", "c")], {"c"}),
    # rank 0 asked: it is alive, whatever the others saw
    ({"a", "b", "c"}, [link("a", "b"), link("a", "c")], set()),
    # silent links kill nobody: the member may be alive on the other side of a cut
    ({"b", "c"}, [silent("a", "b"), silent("a", "c")], set()),
    ({"a", "b"}, [silent("c", "a")], set()),
])
def test_only_an_end_by_the_peers_kernel_is_a_death_and_rank_zero_only_before_it_asks(
        joined, reports, gone):
    assert dead(PREVIOUS, joined, reports) == frozenset(gone)


def test_a_split_leaves_out_rank_zero_with_everyone_still_linked_to_it():
    previous = ["a", "b", "c", "d", "e"]
    leases = dict(zip(previous, range(11, 16)))
    lost = [Evidence("a", m, leases[m], silent=True) for m in ("c", "d", "e")]
    assert cut_off(previous, set(previous), lost) == frozenset({"a", "b"})


@pytest.mark.parametrize("value, how", [(b"ended", "ended"), (b"silent", "silent"),
                                        (b"frozen", "frozen"), (b"dead", None), (b"", None)])
def test_a_stored_report_is_read_only_when_it_says_ended_silent_or_frozen(value, how):
    report = Evidence.read("c/a", value, 11)
    assert (None if report is None else report.to_value()) == how
    if report is not None:
        assert (report.member, report.reporter) == ("c", "a")


def back(member: str, from_round: int, from_world: int) -> JoinRequest:
    """A request of a process that was in ``from_round`` before etcd forgot it."""
    return JoinRequest(member, 3, "start", f"addr-{member}", 1000, from_round=from_round,
                       from_world=from_world)


@pytest.mark.parametrize("requests, short", [
    ([req("a", "start"), req("b", "start")], 0),  # fresh processes: they were in no round
    ([back("a", 7, 3)], 2),  # the first of a world of 3 whose etcd lost its data
    ([back("a", 7, 3), back("b", 7, 3)], 1),
    ([back("a", 7, 3), back("b", 7, 3), back("c", 7, 3)], 0),
    ([back("a", 7, 3), back("b", 7, 2)], 0),  # b saw the third die: the fewest named counts
    ([back("a", 7, 3), back("b", 8, 2)], 3),  # two old rounds, each waited for
    ([back("a", 7, 2), req("new", "start")], 1),  # a newcomer is not of the old world
])
def test_a_first_round_after_etcd_lost_its_data_waits_for_the_old_world_to_ask(requests, short):
    assert returning_short(requests) == short


@pytest.mark.parametrize("requests, short", [
    ([req("a"), req("b")], 0),  # no request names round 7: members asking under their own ids
    ([back("a", 7, 3), back("b", 7, 3)], 0),  # the last round's members, under their own ids
    ([back("x", 7, 3)], 2),  # the first of a world of 3 whose every lease etcd revoked
    ([back("x", 7, 3), back("y", 7, 3)], 1),
    ([back("x", 7, 3), back("y", 7, 3), back("z", 7, 3)], 0),
    ([back("x", 7, 3), back("b", 7, 3)], 1),  # b kept its lease; x lost its own
    ([back("x", 7, 2), back("y", 7, 3)], 0),  # x saw the third die (or freeze)
    ([back("x", 6, 3), req("new", "start")], 0),  # from an older round: a newcomer here
])
def test_members_that_lost_their_lease_count_the_last_round_that_has_yet_to_ask(requests,
                                                                               short):
    assert heirs_short(PREVIOUS, 7, requests) == short


def test_a_member_that_lost_its_lease_does_not_close_a_round_alone_before_the_rejoin_timeout():
    # Every lease was revoked (a stalled etcd leader woke): "a", "b", "c" are gone, and the
    # first of them to register again must not make a world of one.
    first = [back("x", 7, 3)]
    waiting = RollCall(PREVIOUS, frozenset(), 1.0, 120.0, heirs_short(PREVIOUS, 7, first))
    assert not may_close(first, {"x"}, waiting, 60.0, RULE)
    late = RollCall(PREVIOUS, frozenset(), 120.0, 120.0, heirs_short(PREVIOUS, 7, first))
    assert may_close(first, {"x"}, late, 0.0, RULE)
    everyone = [back("x", 7, 3), back("y", 7, 3), back("z", 7, 3)]
    assert may_close(everyone, {"x", "y", "z"},
                     RollCall(PREVIOUS, frozenset(), 1.0, 120.0,
                              heirs_short(PREVIOUS, 7, everyone)), 0.0, RULE)
