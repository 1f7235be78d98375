"""Where the last round's members sit when newcomers join a sharded job (no etcd, no clock)."""

from __future__ import annotations

import pytest

from elastic.cluster.rounds.places import in_proportion, shard_count
from elastic.state.sharded.layout import TensorSpec, plan_moves

pytestmark = pytest.mark.unit


def placed(order: str, previous: str, shard_degree: int | None = None) -> str:
    return "".join(in_proportion(list(order), list(order), list(previous), shard_degree))


def test_newcomers_fill_the_gaps_so_members_keep_their_places_in_proportion():
    assert placed("abcdefXY", "abcdef") == "abXcdeYf"
    assert placed("abcX", "abc") == "abXc"


def test_a_newcomer_takes_the_place_of_the_member_it_replaces():
    assert placed("abcefghX", "abcdefgh") == "abcXefgh"
    assert placed("bcdX", "abcd") == "bXcd"  # the first is gone: its successor is first


def test_the_first_stays_first_even_from_another_place():
    assert placed("dabcX", "abcd")[0] == "d"


def test_members_are_placed_in_their_old_rank_order_whatever_order_they_came_in():
    assert placed("bdacX", "abcd") == "baXcd"


def test_without_newcomers_or_a_last_round_the_order_stands():
    assert placed("abcd", "abcdef") == "abcd"
    assert placed("abcd", "") == "abcd"
    assert placed("XY", "abc") == "XY"


def test_hsdp_keeping_its_shard_degree_keeps_every_member_on_its_shard():
    assert placed("abcdXY", "abcd", shard_degree=2) == "abcdXY"  # 2x2 -> 3x2: appended
    assert placed("abdX", "abcd", shard_degree=2) == "abXd"  # a replacement on shard 0
    assert placed("abcX", "abc", shard_degree=2) == "abXc"  # FSDP over 3 -> 2x2


def test_a_world_is_sharded_by_the_degree_it_is_a_multiple_of_else_by_every_rank():
    assert [shard_count(w, 2) for w in (2, 3, 4, 6)] == [2, 3, 2, 2]
    assert shard_count(5, None) == 5


def test_entries_other_than_ids_are_rearranged_by_their_keys():
    assert in_proportion([10, 11, 12], ["a", "b", "X"], ["a", "b"]) == [10, 12, 11]


def _moved(order: str, previous: str) -> float:
    """The share of an FSDP-sharded tensor that moves from ``previous``'s layout to ``order``'s."""
    where = {member: rank for rank, member in enumerate(order)}
    holders = [{where[m]} if m in where else set() for m in previous]
    rows = 8 * 7 * 6 * 5
    plan = plan_moves({"w": TensorSpec(rows, 1)}, len(previous), holders,
                      list(range(len(order))), len(order))
    return plan.moved / rows


def test_a_join_from_six_ranks_to_eight_moves_a_third_of_the_state_not_three_quarters():
    assert _moved("abcdefXY", "abcdef") == pytest.approx(3 / 4)
    assert _moved(placed("abcdefXY", "abcdef"), "abcdef") == pytest.approx(1 / 3)
    assert _moved(placed("abcdefgX", "abcdefg"), "abcdefg") == pytest.approx(2 / 7)
