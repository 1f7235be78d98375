"""Pure rendezvous logic: when a round closes and who gets which rank (no etcd, no clock)."""

from __future__ import annotations

import pytest

from elastic.cluster.rounds.plan import (CloseRule, JoinRequest, Plan, RendezvousConfig,
                                         assign_ranks, should_close)
from elastic.cluster.rounds.records import RecordError

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


SHARDED = RendezvousConfig(sharded=True)


def on(host: str, member: str, version: int = 4, revision: int = 0) -> JoinRequest:
    return JoinRequest(member, version, "start", host, 1000 + revision, revision)


def test_in_a_sharded_job_on_one_host_a_newcomer_takes_the_place_of_the_member_it_replaces():
    plan = assign_ranks([on("h", "new", revision=1), on("h", "c", revision=9),
                         on("h", "a", revision=5)], ["c", "b", "a"], 2, None, config=SHARDED)
    assert plan.ranks == ["c", "new", "a"]
    assert plan.master_addr == "h" and plan.master_port == 1009


def test_in_a_sharded_job_across_hosts_newcomers_come_last_so_each_hosts_ranks_stay_together():
    requests = [on("h", "a"), on("h", "c", revision=1), on("other", "new", revision=2)]
    plan = assign_ranks(requests, ["a", "b", "c"], 2, None, config=SHARDED)
    assert plan.ranks == ["a", "c", "new"]


def test_a_replicated_job_appends_its_newcomers():
    requests = [on("h", "a"), on("h", "c", revision=1), on("h", "new", revision=2)]
    assert assign_ranks(requests, ["a", "b", "c"], 2, None).ranks == ["a", "c", "new"]


def test_members_beyond_max_workers_become_spares():
    plan = assign_ranks([req(m, 1, revision=i) for i, m in enumerate("abcde")], [], 1, 3)
    assert plan.ranks == ["a", "b", "c"] and plan.spares == ["d", "e"]
    assert plan.world_size == 3


def test_a_plan_survives_its_json_round_trip():
    plan = assign_ranks([req("a", 2), req("b", 1)], [], 4, 1)
    assert Plan.from_json(plan.to_json().encode(), 4) == plan


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


@pytest.mark.parametrize("spec", [dict(min_workers=0), dict(min_workers=3, max_workers=2)])
def test_rendezvous_config_rejects_contradictory_limits(spec):
    from elastic.cluster.rounds.rendezvous import RendezvousConfig
    with pytest.raises(ValueError, match="must be >="):
        RendezvousConfig(**spec)


def test_assigning_ranks_to_nobody_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        assign_ranks([], [], 1, None)


def test_a_join_request_survives_its_json_round_trip_with_the_revision_from_etcd():
    request = JoinRequest("a", 7, "failure", "10.0.0.1", 29500, revision=3)
    raw = request.to_json()
    assert "revision" not in raw
    assert JoinRequest.from_json(raw.encode(), 42, "a") == JoinRequest("a", 7, "failure", "10.0.0.1",
                                                                  29500, revision=42)


def test_a_plan_with_defaults_survives_its_json_round_trip():
    plan = Plan(round=1, ranks=["a"])
    assert Plan.from_json(plan.to_json().encode(), 1) == plan
    assert plan.spares == [] and plan.versions == {} and plan.world_size == 1


def test_a_round_closes_once_min_workers_joined_and_settled():
    rule = CloseRule(min_workers=2, max_workers=None, settle_s=0.5)
    assert not should_close([req("a")], {"a"}, False, 100.0, rule)
    assert should_close([req("a"), req("b")], {"a", "b"}, False, 0.5, rule)


def test_a_reformation_below_min_workers_does_not_close_even_after_a_failure():
    rule = CloseRule(min_workers=3, max_workers=None, settle_s=0.5)
    joins = [req("a", reason="failure"), req("b", reason="change")]
    assert not should_close(joins, {"a", "b"}, True, 100.0, rule)


def test_a_first_round_with_more_joiners_than_max_workers_closes_at_once():
    rule = CloseRule(min_workers=1, max_workers=2, settle_s=0.5)
    assert should_close([req("a"), req("b"), req("c")], {"a", "b", "c"}, False, 0.0, rule)


def test_a_full_first_round_still_waits_for_a_live_member_that_has_not_asked_yet():
    rule = CloseRule(min_workers=1, max_workers=2, settle_s=0.5)
    assert not should_close([req("a"), req("b")], {"a", "b", "c"}, False, 100.0, rule)


def test_the_settle_window_closes_exactly_at_its_length():
    joins = [req("a"), req("b")]
    assert not should_close(joins, {"a", "b"}, False, 0.4999, RULE)
    assert should_close(joins, {"a", "b"}, False, 0.5, RULE)


def test_changes_without_a_failure_wait_for_every_live_member_however_long():
    joins = [req("a", reason="change"), req("b", reason="change")]
    assert not should_close(joins, {"a", "b", "dead"}, True, 1e6, RULE)


def test_a_newer_version_outranks_the_previous_order():
    plan = assign_ranks([req("a", 3), req("b", 3), req("new", 4, revision=9)], ["a", "b"], 2,
                        None)
    assert plan.ranks == ["new", "a", "b"]
    assert plan.master_addr == "addr-new" and plan.master_port == 1009


def test_a_newer_version_is_never_cut_as_a_spare():
    plan = assign_ranks([req("a", 1), req("b", 1), req("new", 2, revision=5)], ["a", "b"], 2, 2)
    assert plan.ranks == ["new", "a"] and plan.spares == ["b"]


def test_spares_are_ordered_like_ranks_and_keep_their_versions():
    requests = [req("a", 5, revision=1), req("s2", 1, revision=3), req("s1", 1, revision=2),
                req("b", 5, revision=4)]
    plan = assign_ranks(requests, [], 1, 2)
    assert plan.ranks == ["a", "b"] and plan.spares == ["s1", "s2"]
    assert plan.versions == {"a": 5, "b": 5, "s1": 1, "s2": 1}


def test_no_max_workers_means_no_spares():
    plan = assign_ranks([req(m, revision=i) for i, m in enumerate("abcdefgh")], [], 1, None)
    assert plan.world_size == 8 and plan.spares == []


def test_newcomers_rank_after_the_previous_members_in_arrival_order_whatever_their_names():
    requests = [req("z-new", 1, revision=2), req("a-new", 1, revision=7), req("m", 1, revision=9)]
    plan = assign_ranks(requests, ["m"], 2, None)
    assert plan.ranks == ["m", "z-new", "a-new"]


def test_full_ties_fall_back_to_the_member_id_so_every_member_computes_the_same_plan():
    forward = [req("b", 1, revision=4), req("a", 1, revision=4), req("c", 1, revision=4)]
    assert assign_ranks(forward, [], 1, None).ranks == ["a", "b", "c"]
    assert assign_ranks(forward[::-1], [], 1, None).ranks == ["a", "b", "c"]


def test_the_plan_carries_its_round_number():
    assert assign_ranks([req("a")], [], 17, None).round == 17


def spare(member: str, version: int = 0, revision: int = 0) -> JoinRequest:
    return JoinRequest(member, version, "spare", "127.0.0.1", 1, revision, standby=True)


def test_a_warm_spare_stays_out_of_a_first_round_however_many_places_are_free():
    plan = assign_ranks([req("a", revision=1), req("b", revision=2), spare("s", revision=3)],
                        [], 1, None)
    assert plan.ranks == ["a", "b"] and plan.spares == ["s"]


def test_a_warm_spare_takes_the_place_of_a_member_that_is_gone_and_only_one_place():
    plan = assign_ranks([req("b", 5), spare("s", revision=3), spare("t", revision=4)],
                        ["a", "b"], 2, None)
    assert plan.ranks == ["b", "s"] and plan.spares == ["t"]


def test_a_warm_spare_in_the_previous_round_keeps_its_place():
    plan = assign_ranks([req("b", 5), spare("s", 5), req("new", revision=9)], ["b", "s"], 3, None)
    assert plan.ranks == ["b", "s", "new"] and plan.spares == []


def test_warm_spares_fill_up_to_min_workers_and_never_past_max_workers():
    assert assign_ranks([req("a"), spare("s", revision=1), spare("t", revision=2)], [], 1, None,
                        min_workers=2).ranks == ["a", "s"]
    assert assign_ranks([req("a"), spare("s")], ["a", "x", "y"], 2, 2).ranks == ["a", "s"]


def test_warm_spares_fill_a_shrunken_world_back_to_its_target_and_no_further():
    first = assign_ranks([req("a"), req("b", revision=1)], [], 1, None)
    assert first.target == 2 and first.is_full
    alone = assign_ranks([spare("s")], ["a", "b"], 2, None, target=first.target)
    assert alone.ranks == ["s"] and alone.target == 2 and not alone.is_full
    refilled = assign_ranks([req("s", 3), spare("t", revision=1), spare("u", revision=2)],
                            alone.ranks, 3, None, target=alone.target)
    assert refilled.ranks == ["s", "t"] and refilled.spares == ["u"] and refilled.is_full
    assert Plan.from_json(refilled.to_json().encode(), 3).target == 2


def test_a_target_never_exceeds_max_workers():
    plan = assign_ranks([req("a"), req("b", revision=1), req("c", revision=2)], [], 1, 2)
    assert plan.ranks == ["a", "b"] and plan.target == 2


def test_warm_spares_do_not_make_a_first_round_full():
    rule = CloseRule(min_workers=1, max_workers=2, settle_s=5.0)
    requests = [req("a"), spare("s", revision=1)]
    assert not should_close(requests, {"a", "s"}, False, 0.0, rule)
    assert should_close(requests + [req("b", revision=2)], {"a", "b", "s"}, False, 0.0, rule)


def test_a_join_request_that_says_standby_in_anything_but_a_boolean_is_refused():
    raw = b'{"member_id": "m", "version": 0, "reason": "spare", "addr": "127.0.0.1", ' \
          b'"port": 1, "standby": 1}'
    with pytest.raises(RecordError, match="standby is 1, not true or false"):
        JoinRequest.from_json(raw, 1, "m")
    assert JoinRequest.from_json(raw.replace(b"1}", b"true}"), 1, "m").standby


def test_the_round_a_process_was_last_in_travels_in_its_join_request():
    request = JoinRequest("a", 7, "start", "10.0.0.1", 29500, from_round=12, from_world=3)
    assert JoinRequest.from_json(request.to_json().encode(), 0, "a") == request
    older = b'{"member_id": "a", "version": 0, "reason": "start", "addr": "10.0.0.1", "port": 1}'
    assert JoinRequest.from_json(older, 0, "a").from_round == 0
    with pytest.raises(RecordError, match="from_world is -1"):
        JoinRequest.from_json(older.replace(b"}", b', "from_world": -1}'), 0, "a")


def node_req(member: str, node: str, workers: int, standby: bool = False) -> JoinRequest:
    return JoinRequest(member, 0, "start", f"addr-{member}", 1000, standby=standby, node=node,
                       node_workers=workers)


def test_a_first_round_waits_up_to_local_start_for_the_workers_its_launcher_started():
    rule = CloseRule(min_workers=1, max_workers=None, settle_s=0.5, local_start_s=30.0)
    one_of_two = [node_req("a", "launcher-1", 2)]
    assert not should_close(one_of_two, {"a"}, False, 5.0, rule)
    assert should_close(one_of_two, {"a"}, False, 30.0, rule), "bounded by local_start"
    both = one_of_two + [node_req("b", "launcher-1", 2)]
    assert should_close(both, {"a", "b"}, False, 0.6, rule)


def test_warm_spares_and_workers_started_by_hand_are_not_waited_for():
    rule = CloseRule(min_workers=1, max_workers=None, settle_s=0.5, local_start_s=30.0)
    joins = [node_req("a", "launcher-1", 1), node_req("s", "launcher-1", 1, standby=True),
             req("by-hand")]
    assert should_close(joins, {"a", "s", "by-hand"}, False, 0.6, rule)


def test_a_reformation_never_waits_for_a_launchers_missing_workers():
    rule = CloseRule(min_workers=1, max_workers=None, settle_s=0.5, local_start_s=30.0)
    joins = [JoinRequest("a", 0, "failure", "addr-a", 1000, node="l", node_workers=2)]
    assert should_close(joins, {"a"}, True, 0.0, rule)


def test_a_join_request_keeps_its_launcher_through_json():
    request = node_req("a", "launcher-1", 2)
    assert JoinRequest.from_json(request.to_json().encode(), 0, "a") == request
