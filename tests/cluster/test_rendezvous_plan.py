"""Pure rendezvous logic: when a round closes and who gets which rank (no etcd, no clock)."""

from __future__ import annotations

import pytest

from elastic.cluster.plan import CloseRule, JoinRequest, Plan, assign_ranks, should_close

RULE = CloseRule(min_workers=1, max_workers=None, settle_s=0.5)

pytestmark = pytest.mark.unit


def req(member: str, version: int = 0, reason: str = "start", revision: int = 0) -> JoinRequest:
    return JoinRequest(member, version, reason, f"addr-{member}", 1000 + revision, revision)


def test_the_newest_commit_gets_rank_zero():
    plan = assign_ranks([req("a", 5), req("b", 7), req("c", 6)], [], 3, None)
    assert plan.ranks == ["b", "c", "a"]
    assert plan.master_addr == "addr-b" and plan.master_port == 1000


def test_equal_versions_keep_the_previous_order_then_arrival_order():
    plan = assign_ranks([req("new", 4, revision=1), req("c", 4, revision=9),
                         req("a", 4, revision=5)], ["c", "b", "a"], 2, None)
    assert plan.ranks == ["c", "a", "new"]


def test_members_beyond_max_workers_become_spares():
    plan = assign_ranks([req(m, 1, revision=i) for i, m in enumerate("abcde")], [], 1, 3)
    assert plan.ranks == ["a", "b", "c"] and plan.spares == ["d", "e"]
    assert plan.world_size == 3


def test_a_plan_survives_its_json_round_trip():
    plan = assign_ranks([req("a", 2), req("b", 1)], [], 4, 1)
    assert Plan.from_json(plan.to_json().encode()) == plan


def test_a_round_needs_min_workers_even_when_everyone_joined():
    rule = CloseRule(min_workers=3, max_workers=None, settle_s=0.5)
    assert not should_close([req("a"), req("b")], {"a", "b"}, False, 100.0, rule)


def test_a_first_round_waits_for_the_settle_window_so_staggered_starts_make_one_round():
    joins = [req("a"), req("b")]
    assert not should_close(joins, {"a", "b"}, False, 0.1, RULE)
    assert should_close(joins, {"a", "b"}, False, 0.6, RULE)


def test_a_first_round_closes_at_once_when_max_workers_joined():
    rule = CloseRule(min_workers=1, max_workers=2, settle_s=0.5)
    assert should_close([req("a"), req("b")], {"a", "b"}, False, 0.0, rule)


def test_a_reformation_closes_at_once_when_every_live_member_asked():
    joins = [req("a", reason="change"), req("b", reason="change")]
    assert should_close(joins, {"a", "b"}, True, 0.0, RULE)


def test_a_newcomer_waits_for_the_running_members_to_notice_it():
    assert not should_close([req("new")], {"a", "b", "new"}, True, 60.0, RULE)


def test_survivors_of_a_failure_close_without_the_dead_members_lease_after_the_settle():
    joins = [req("a", reason="failure"), req("b", reason="failure")]
    live = {"a", "b", "dead"}
    assert not should_close(joins, live, True, 0.2, RULE)
    assert should_close(joins, live, True, 0.6, RULE)


@pytest.mark.parametrize("spec", [dict(min_workers=0), dict(min_workers=3, max_workers=2)])
def test_rendezvous_config_rejects_contradictory_limits(spec):
    from elastic.cluster.rendezvous import RendezvousConfig
    with pytest.raises(ValueError, match="must be >="):
        RendezvousConfig(**spec)


def test_assigning_ranks_to_nobody_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        assign_ranks([], [], 1, None)
