"""The layout math of sharded state: torch.chunk ranges, buddies, holders and transfer plans."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

from elastic.state.sharded.layout import (Plan, ShardLostError, TensorSpec, buddy_ranks,
                                          holders_of, plan_moves, shard_range)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 13, 16])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5, 8])
def test_shard_ranges_are_the_rows_torch_chunk_gives_each_rank_with_empty_tails(rows, shards):
    pieces = torch.arange(rows).chunk(shards) if rows else ()
    for index in range(shards):
        start, stop = shard_range(rows, shards, index)
        expected = pieces[index].tolist() if index < len(pieces) else []
        assert list(range(start, stop)) == expected


def test_a_shard_that_does_not_exist_is_refused_with_its_numbers():
    with pytest.raises(ValueError, match="shard 4 of 4"):
        shard_range(7, 4, 4)


def test_buddies_follow_the_ring_and_prefer_another_node():
    assert buddy_ranks(3, 4, 1) == [0]
    assert buddy_ranks(0, 4, 2) == [1, 2]
    # ranks 0,1 on node 10 and 2,3 on node 11: rank 0's first copy goes to node 11
    assert buddy_ranks(0, 4, 2, nodes=[10, 10, 11, 11]) == [2, 3]
    assert buddy_ranks(2, 4, 1, nodes=[10, 10, 11, 11]) == [0]


@pytest.mark.parametrize(("nodes", "copies", "most"), [
    ([0, 0, 0, 1, 1, 1, 1], 1, 2),  # node 1's four copies on node 0's three ranks
    ([0, 0, 0, 1, 1, 1, 1], 2, 3),  # eight on three
    ([0, 0, 0, 0, 0, 1], 1, 5),  # rank 5 is the only rank on another node for five ranks
    ([0, 0, 1, 1, 2], 1, 1),
    ([0, 0, 1, 1, 2], 2, 2),
    ([0, 1, 0, 1, 2, 2, 2, 2], 1, 1),  # nodes need not be contiguous
])
def test_buddies_on_uneven_nodes_sit_on_another_node_and_no_rank_holds_more_than_it_must(
        nodes, copies, most):
    world = len(nodes)
    for rank in range(world):
        buddies = buddy_ranks(rank, world, copies, nodes)
        elsewhere = sum(node != nodes[rank] for node in nodes)
        assert len(set(buddies)) == copies and rank not in buddies
        assert all(nodes[b] != nodes[rank] for b in buddies[:elsewhere])
    holders = holders_of(world, world, copies, nodes)
    assert [len(held) for held in holders] == [copies + 1] * world
    copies_held = [sum(rank in held for held in holders) - 1 for rank in range(world)]
    assert max(copies_held) == most


def _least_most_held(nodes: list[int], copies: int) -> int:
    """The ceiling no placement beats: for each set of nodes, the copies that cannot land
    outside it, over its ranks (layout.py's ``_cross_node``)."""
    world, sizes = len(nodes), Counter(nodes)
    least = copies
    for count in range(1, len(sizes) + 1):
        for group in itertools.combinations(sizes, count):
            ranks = sum(sizes[n] for n in group)
            outside = {n: world - ranks - (0 if n in group else m) for n, m in sizes.items()}
            forced = sum(m * max(0, min(copies, world - m) - outside[n])
                         for n, m in sizes.items())
            least = max(least, -(-forced // ranks))
    return least


def test_on_random_uneven_nodes_no_rank_holds_more_copies_than_any_placement_must():
    rng = random.Random(43)
    for _ in range(400):
        world, copies = rng.randint(2, 12), rng.randint(1, 3)
        nodes = [rng.randrange(rng.randint(2, 4)) for _ in range(world)]
        if len(set(nodes)) < 2 or any(copies > world - nodes.count(n) for n in nodes):
            continue
        holders = holders_of(world, world, copies, nodes)
        most = max(sum(rank in held for held in holders) - 1 for rank in range(world))
        assert most == _least_most_held(nodes, copies), (nodes, copies)


def test_fsdp_shards_are_held_by_their_owner_and_buddies_and_hsdp_shards_by_replicas():
    assert holders_of(4, 4, 1) == [{0, 1}, {1, 2}, {2, 3}, {3, 0}]
    assert holders_of(4, 2, 1) == [{0, 2}, {1, 3}]  # HSDP 2x2: no extra copies


def _specs() -> dict[str, TensorSpec]:
    return {"a": TensorSpec(7, 8), "b": TensorSpec(13, 24), "step": TensorSpec(1, 8, False)}


def _survivors(holders: list[set[int]], alive: list[int]) -> list[set[int]]:
    """Renumbers old ranks to new ranks (the survivors in order) and drops the dead."""
    new = {old: i for i, old in enumerate(alive)}
    return [{new[r] for r in held if r in new} for held in holders]


def _check_complete(plan: Plan, specs: dict[str, TensorSpec], new_shards: int) -> None:
    for dst in range(new_shards):
        for name, spec in specs.items():
            rows = sorted(r for p in plan.to(dst) if p.name == name for r in range(p.start, p.stop))
            want = (0, spec.rows) if not spec.sharded else shard_range(spec.rows, new_shards, dst)
            assert rows == list(range(*want)), (name, dst)


def test_four_to_three_after_a_kill_moves_only_what_each_survivor_lacks():
    specs = _specs()
    holders = _survivors(holders_of(4, 4, 1), alive=[0, 1, 3])  # rank 2 died
    plan = plan_moves(specs, 4, holders, [0, 1, 2], 3, owners_alive=[True, True, False, True])
    _check_complete(plan, specs, 3)
    # the dead rank's shard comes from its buddy (old rank 3, now 2), once
    rows = {name: shard_range(spec.rows, 4, 2) for name, spec in specs.items() if spec.sharded}
    assert plan.lost == sum((stop - start) * specs[name].row_bytes
                            for name, (start, stop) in rows.items())
    assert all(p.src == p.dst for p in plan.pieces if p.name == "step")
    lacking = 0
    for p in plan.pieces:
        if p.src != p.dst:
            assert p.dst not in holders[p.shard]
            lacking += (p.stop - p.start) * specs[p.name].row_bytes
    assert plan.moved == lacking == plan.minimum > 0


def test_a_joiner_fetches_its_whole_shard_and_the_whole_unsharded_tensors():
    specs = _specs()
    holders = holders_of(3, 3, 1)  # the three of the last round keep their numbers
    plan = plan_moves(specs, 3, holders, [0, 1, 2, 3], 4)
    _check_complete(plan, specs, 4)
    joined = [p for p in plan.to(3)]
    assert joined and all(p.moves for p in joined)
    assert any(p.name == "step" for p in joined)


def test_the_sends_are_spread_over_the_holders():
    specs = {"w": TensorSpec(64, 8)}
    holders = [{0, 1}, {0, 1}]
    plan = plan_moves(specs, 2, holders, [0, 1, 2, 3], 4)
    senders = {p.src for p in plan.pieces if p.moves}
    assert senders == {0, 1}


def test_two_kills_that_leave_a_holder_of_every_shard_recover_and_lose_their_bytes_once():
    specs = _specs()
    holders = _survivors(holders_of(4, 4, 1), alive=[0, 2])  # 1 and 3 died: 0 holds 3, 2 holds 1
    plan = plan_moves(specs, 4, holders, [0, 1], 2, owners_alive=[True, False, True, False])
    _check_complete(plan, specs, 2)
    assert plan.moved == plan.minimum < plan.lost  # the buddies hold part of it already


def test_a_shard_whose_holders_all_died_is_named_in_a_typed_error():
    holders = _survivors(holders_of(4, 4, 1), alive=[0, 3])  # 1 and 2 died: shard 1 is gone
    with pytest.raises(ShardLostError, match="shard 1 of 'a'"):
        plan_moves(_specs(), 4, holders, [0, 1], 2)


def test_hsdp_losing_a_replica_rank_takes_its_shard_from_the_other_replica():
    specs = _specs()
    holders = _survivors(holders_of(4, 2, 1), alive=[0, 1, 2])  # rank 3 (shard 1) died
    plan = plan_moves(specs, 2, holders, [0, 1, 2], 3)  # carries on as FSDP over 3
    _check_complete(plan, specs, 3)
    assert {p.src for p in plan.pieces if p.moves and p.shard == 1} == {1}
