"""Sharded commits in host memory: what a rank reports, which commit a formation rebuilds, and
the buddy copies and the reshard moves over a real gloo group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from elastic.state.sharded.buffers import carve, shapes_of
from elastic.state.sharded.commits import (Holding, ShardCommit, ShardCommits, choose,
                                           read_report)
from elastic.state.sharded.copies import BuddyExchange
from elastic.state.sharded.layout import (ShardLostError, TensorSpec, holders_of, plan_moves,
                                          shard_range)
from elastic.state.sharded.moves import assemble
from tests.support.gloo_group import run_in_group


SPECS = {"a": TensorSpec(7, 16), "b": TensorSpec(13, 8), "step": TensorSpec(1, 4, False)}


def _whole(name: str) -> torch.Tensor:
    if name == "step":
        return torch.tensor(5.0)
    rows = SPECS[name].rows
    cols = SPECS[name].row_bytes // 8
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)


def _shard(name: str, shards: int, index: int) -> torch.Tensor:
    if not SPECS[name].sharded:
        return _whole(name)
    start, stop = shard_range(SPECS[name].rows, shards, index)
    return _whole(name)[start:stop].clone()


def _commit(version: int, world: int, own: int, held: tuple[int, ...] = ()) -> ShardCommit:
    commit = ShardCommit(version, world, world, own, SPECS, {"version": version, "objects": {}})
    for shard in (own, *held):
        commit.held[shard] = {n: _shard(n, world, shard) for n in SPECS}
    return commit


@pytest.mark.unit
def test_a_report_row_reads_back_as_the_commits_and_shards_a_rank_holds():
    commits = ShardCommits(max_held=2)
    commits.add(_commit(3, 4, 1, (0,)))
    commits.add(_commit(4, 4, 1))
    assert read_report(commits.report().tolist()) == [
        Holding(3, 4, 4, 1, frozenset({0, 1})), Holding(4, 4, 4, 1, frozenset({1}))]


@pytest.mark.unit
def test_a_rank_that_holds_more_shards_than_max_held_reports_every_one_of_them():
    # rank 5, alone on its node, is the buddy of all five ranks of node 0: node 0 dies, and
    # rank 5 must still report (and so rebuild) every shard it holds
    nodes = [0, 0, 0, 0, 0, 1]
    held = [s for s, ranks in enumerate(holders_of(6, 6, 1, nodes)) if 5 in ranks]
    assert held == [0, 1, 2, 3, 4, 5]
    commits = ShardCommits(max_held=2)
    commits.add(_commit(7, 6, 5, tuple(held[:5])))
    row = commits.report()
    assert read_report(commits.report(width=len(row) + 9).tolist()) == read_report(row.tolist())
    choice = choose([read_report(row.tolist())])
    assert choice is not None and choice.holders == (frozenset({0}),) * 6


@pytest.mark.unit
def test_a_same_layout_formation_commit_borrows_every_shard_the_rank_held():
    # rank 5, alone on its node, holds all six shards of version 5; a spare takes a dead rank's
    # place and version 5 is committed again in the same layout: until its copies land, node 0
    # dying must still find every shard on rank 5
    commits = ShardCommits(max_held=2)
    commits.add(_commit(5, 6, 5, (0, 1, 2, 3, 4)))
    commits.rebuilding((5, 6, 6))
    commits.add(_commit(5, 6, 5))
    choice = choose([read_report(commits.report().tolist())])
    assert choice is not None and choice.holders == (frozenset({0}),) * 6


@pytest.mark.unit
def test_a_new_commit_drops_the_oldest_and_any_rolled_back_future():
    commits = ShardCommits(max_held=2)
    for version in (1, 2, 3):
        commits.add(_commit(version, 2, 0))
    assert [h.version for h in read_report(commits.report().tolist())] == [2, 3]
    commits.add(_commit(3, 2, 0))  # after a rollback to 2, version 3 again
    assert [h.version for h in read_report(commits.report().tolist())] == [2, 3]
    commits.add(_commit(2, 2, 0))  # a rollback to 1 and version 2 again
    assert [h.version for h in read_report(commits.report().tolist())] == [2]


@pytest.mark.unit
def test_a_formation_commit_in_a_new_layout_keeps_the_old_layout_of_its_version_until_the_next():
    # version 3 at 4 ranks, resharded to 3 ranks: its copies at 3 travel after the formation,
    # and until they land the layout at 4 is what a second failure can rebuild from
    commits = ShardCommits(max_held=2)
    commits.add(_commit(2, 4, 1, (0,)))
    commits.add(_commit(3, 4, 1, (0,)))
    commits.add(_commit(3, 3, 1))
    assert [(h.version, h.world, h.held) for h in read_report(commits.report().tolist())] == [
        (3, 4, frozenset({0, 1})), (3, 3, frozenset({1}))]
    commits.add(_commit(4, 3, 1))  # the next commit: the old layout goes
    assert [(h.version, h.world) for h in read_report(commits.report().tolist())] == [
        (3, 3), (4, 3)]


@pytest.mark.unit
def test_two_formations_in_a_row_keep_the_commit_they_rebuilt_until_a_new_layout_holds_it():
    # eight ranks (buddy: the next rank) hold version 5 with its copies landed, version 4 whole.
    # Old rank 7 dies, then old rank 2 while that formation's copies travel, then old rank 5
    # while the second one's travel: version 5 at 8 still has a live holder of every shard
    ranks = {}
    for rank in range(8):
        commits = ShardCommits(max_held=2)
        four = _commit(4, 8, rank, ((rank - 1) % 8,))
        commits.add(four)
        commits.add(_commit(5, 8, rank, ((rank - 1) % 8,)))
        four.whole = True  # confirmed at version 5's agreement
        ranks[rank] = commits
    for alive in ([0, 1, 2, 3, 4, 5, 6], [0, 1, 3, 4, 5, 6]):
        choice = choose([read_report(ranks[old].report().tolist()) for old in alive])
        assert (choice.version, choice.world) == (5, 8)
        for new, old in enumerate(alive):
            ranks[old].rebuilding((choice.version, choice.world, choice.shards))
            ranks[old].add(_commit(5, len(alive), new))  # its copies never land
    alive = [0, 1, 3, 4, 6]
    choice = choose([read_report(ranks[old].report().tolist()) for old in alive])
    assert (choice.version, choice.world) == (5, 8)
    # the first formation's layout, found lacking, went: three commits, not four
    assert [(h.version, h.world) for h in read_report(ranks[0].report().tolist())] == [
        (4, 8), (5, 8), (5, 6)]


@pytest.mark.unit
def test_a_formation_commit_in_the_same_layout_borrows_the_copies_held_until_it_is_whole():
    # version 3 at 4 ranks rebuilt at 4 (a replacement took a dead rank's place): the same key,
    # and shard s of one key is the same bytes whoever holds it, so the copies stay
    commits = ShardCommits(max_held=2)
    commits.add(_commit(2, 4, 1, (0,)))
    commits.add(_commit(3, 4, 1, (0,)))  # old rank 1: its shard and its buddy's
    commits.add(_commit(3, 4, 2))  # now rank 2: its new shard, its copies not yet landed
    assert [(h.version, h.own, h.held) for h in read_report(commits.report().tolist())] == [
        (2, 1, frozenset({0, 1})), (3, 2, frozenset({0, 1, 2}))]
    three = commits.find((3, 4, 4))
    assert all(torch.equal(three.held[s][n], _shard(n, 4, s)) for s in (0, 1, 2) for n in SPECS)
    commits.add_copies(three, {1: {n: _shard(n, 4, 1) for n in SPECS}})  # its buddy's copy
    commits.confirm(three)  # whole: the borrowed shard goes, memory is back to one commit's
    assert sorted(three.held) == [1, 2]


@pytest.mark.unit
def test_a_second_kill_before_a_same_layout_formation_commit_travels_rebuilds_it_from_memory():
    # four ranks (buddy: the next rank) hold version 5 and its copies; rank 2 dies, a spare
    # takes its place (new rank 3; old rank 3 is now rank 2) and version 5 is rebuilt at 4
    ranks = [ShardCommits(max_held=2) for _ in range(4)]
    for rank, commits in enumerate(ranks):
        commits.add(_commit(5, 4, rank, ((rank - 1) % 4,)))
    survivors = {0: ranks[0], 1: ranks[1], 2: ranks[3]}  # new rank -> what it held before
    spare = ShardCommits(max_held=2)
    for rank, commits in {**survivors, 3: spare}.items():
        commits.rebuilding((5, 4, 4))
        commits.add(_commit(5, 4, rank))  # the formation's commit: its copies travel
    # new rank 0 dies before the formation's copies landed: its new shard 0 is still held by
    # new rank 1 (its old copy), and shard 3 by new rank 2 (its old own) besides the spare
    alive = [survivors[1], survivors[2], spare]
    choice = choose([read_report(c.report().tolist()) for c in alive])
    assert (choice.version, choice.world) == (5, 4)
    assert choice.holders == (frozenset({0}), frozenset({0}), frozenset({1}),
                              frozenset({1, 2}))


@pytest.mark.unit
def test_a_kill_while_a_join_formation_commit_travels_rebuilds_the_last_whole_commit():
    # three ranks (buddy: the next rank); version 5 was copied to every buddy, and the agreement
    # of version 6 (which every rank reaches only once it waited for those copies) made it whole
    ranks = [ShardCommits(max_held=2) for _ in range(3)]
    for rank, commits in enumerate(ranks):
        five = _commit(5, 3, rank, ((rank - 1) % 3,))
        commits.add(five)
        commits.add(_commit(6, 3, rank))  # version 6 agreed on a join: its copies never went
        five.whole = True  # what that agreement confirms (ShardedRuntime.confirm_copies)
    # the formation at 4 rebuilds version 6 from its owners and commits it in the new layout,
    # its copies travelling while training goes on; a joiner (new rank 3) holds only that
    for rank, commits in enumerate(ranks):
        commits.rebuilding((6, 3, 3))
        commits.add(_commit(6, 4, rank))
    joiner = ShardCommits(max_held=2)
    joiner.add(_commit(6, 4, 3))
    # old rank 1 dies before its copies of version 6 at 4 landed: one kill, version 5 is whole
    alive = [ranks[0], ranks[2], joiner]
    choice = choose([read_report(c.report().tolist()) for c in alive])
    assert (choice.version, choice.world) == (5, 3)
    assert choice.holders == (frozenset({0}), frozenset({1}), frozenset({0, 1}))


@pytest.mark.unit
def test_a_formation_commit_counts_a_shard_only_once_its_own_copy_landed_off_the_step():
    # three ranks hold version 6 whole (buddy: the next rank); a join reshards it in place to
    # four, and each formation commit holds no shard until its thread copied the live one
    ranks = [ShardCommits(max_held=2) for _ in range(3)]
    for rank, commits in enumerate(ranks):
        six = _commit(6, 3, rank, ((rank - 1) % 3,))
        six.whole = True
        commits.add(six)
    ranks.append(ShardCommits(max_held=2))  # the joiner
    for rank, commits in enumerate(ranks):
        commits.add(ShardCommit(6, 4, 4, rank, SPECS, {"version": 6, "objects": {}}))
    first = ranks[1].find((6, 4, 4))
    ranks[1].hold(first, {1: {n: _shard(n, 4, 1) for n in SPECS}})
    # a failure now (none of the others copied): the old layout's copies are rebuilt
    choice = choose([read_report(c.report().tolist()) for c in ranks])
    assert (choice.version, choice.world) == (6, 3)
    for rank, commits in enumerate(ranks):
        if rank != 1:
            commits.hold(commits.find((6, 4, 4)), {rank: {n: _shard(n, 4, rank) for n in SPECS}})
    choice = choose([read_report(c.report().tolist()) for c in ranks])
    assert (choice.version, choice.world) == (6, 4)
    assert choice.holders == tuple(frozenset({rank}) for rank in range(4))


@pytest.mark.unit
def test_a_whole_commit_stays_until_a_newer_one_is_confirmed_whole_then_goes():
    commits = ShardCommits(max_held=2)
    three = _commit(3, 2, 0, (1,))
    commits.add(three)
    commits.confirm(three)
    four, five = _commit(4, 2, 0, (1,)), _commit(5, 2, 0)
    commits.add(four)
    commits.add(five)  # four's copies landed here, but not yet known to have landed everywhere
    assert [h.version for h in read_report(commits.report().tolist())] == [3, 4, 5]
    commits.confirm(four)
    assert [h.version for h in read_report(commits.report().tolist())] == [4, 5]


@pytest.mark.unit
def test_a_live_commit_is_kept_only_while_it_is_the_newest():
    commits = ShardCommits(max_held=2)
    commits.add(_commit(1, 2, 0))
    for version in (2, 3):
        live = _commit(version, 2, 0)
        live.live = True
        commits.add(live)
    assert [h.version for h in read_report(commits.report().tolist())] == [1, 3]
    commits.add(_commit(4, 2, 0))  # a snapshot commit: the live tensors have moved on
    assert [h.version for h in read_report(commits.report().tolist())] == [1, 4]


@pytest.mark.unit
def test_a_live_commit_frozen_at_a_formation_outlives_the_new_layouts_commit_and_is_never_reused():
    # a join's commit is the live shards; the re-formation drops the objects (freeze), rebuilds
    # it at 3 ranks, and the old layout stays what a second failure can rebuild from
    commits = ShardCommits(max_held=2)
    two = _commit(2, 2, 0, (1,))
    commits.add(two)
    commits.confirm(two)
    live = _commit(3, 2, 0)
    live.held[0] = carve(shapes_of(live.held[0]), pinned=False)  # as recyclable as can be
    live.live = True
    commits.add(live)
    commits.freeze()
    commits.add(_commit(3, 3, 0))
    assert [(h.version, h.world) for h in read_report(commits.report().tolist())] == [
        (2, 2), (3, 2), (3, 3)]
    model_memory = {id(t) for t in live.held[0].values()}
    commits.add(_commit(4, 3, 0))  # the frozen commit goes now, and its tensors with it
    assert [(h.version, h.world) for h in read_report(commits.report().tolist())] == [
        (2, 2), (3, 3), (4, 3)]
    offered = commits.buffers.take(shapes_of(live.held[0]))
    assert model_memory.isdisjoint(id(t) for t in offered.values())


@pytest.mark.unit
def test_the_newest_commit_held_whole_is_chosen_and_a_partly_copied_one_is_passed_over():
    # version 5's buddy copies had not landed when old rank 2 died; version 4's had
    ranks = [[Holding(4, 3, 3, 0, frozenset({0, 2})), Holding(5, 3, 3, 0, frozenset({0}))],
             [Holding(4, 3, 3, 1, frozenset({1, 0})), Holding(5, 3, 3, 1, frozenset({1}))]]
    choice = choose(ranks)
    assert (choice.version, choice.holders) == (4, (frozenset({0, 1}), frozenset({1}),
                                                   frozenset({0})))
    assert choice.owners_alive == (True, True, False)


@pytest.mark.unit
def test_no_holdings_mean_a_fresh_start_and_a_gap_in_every_commit_is_a_lost_shard():
    assert choose([[], []]) is None
    with pytest.raises(ShardLostError, match="version 5"):
        choose([[Holding(5, 3, 3, 0, frozenset({0}))]])


def _exchange_then_reshard(rank: int, world: int) -> dict[str, list]:
    """Commits shard ``rank`` of 3, exchanges buddy copies (1 each, 64 bytes in flight), then
    rebuilds the same layout as if rank 1 were a joiner that holds nothing: its shard comes
    from its buddy, rank 2, and the unsharded ``step`` from a holder."""
    import torch.distributed as dist

    commits = ShardCommits(max_held=2)
    commit = _commit(7, world, rank)
    commits.add(commit)
    exchange = BuddyExchange(dist.group.WORLD, rank, world, 1, [0] * world, max_in_flight=64)
    exchange.start(commit, commits)
    exchange.wait(timedelta(seconds=60))
    copies_right = all(torch.equal(commit.held[s][n], _shard(n, world, s))
                       for s in commit.held for n in SPECS)
    holders = [owners - {1} for owners in holders_of(world, world, 1)]
    plan = plan_moves(SPECS, world, holders, [0, 1, 2], 3)
    templates = {n: _shard(n, world, rank) for n in SPECS}
    got, _ = assemble(plan, rank, None if rank == 1 else commit, SPECS, 3, rank,
                   {n: torch.empty_like(t) for n, t in templates.items()})
    return {"held": sorted(commit.held), "copies_right": copies_right,
            "rebuilt": all(torch.equal(got[n], templates[n]) for n in SPECS),
            "sent": [p.src for p in plan.sent_by(rank)]}


def _reshard_in_two(rank: int, world: int) -> dict[str, bool]:
    """Reshards 3 -> 3 with rank 1 holding nothing (its rows come from the others), tensor
    ``b`` deferred: what each rank's new shard holds before and after the rest lands."""
    holders = [{0}, {2}, {2}]  # rank 2 holds its buddy rank 1's shard
    plan = plan_moves(SPECS, world, holders, [0, 1, 2], 3)
    commit = None if rank == 1 else _commit(7, world, rank, (1,) if rank == 2 else ())
    into = {n: torch.full_like(_shard(n, world, rank), float("nan")) for n in SPECS}
    got, rest = assemble(plan, rank, commit, SPECS, 3, rank, into, into=into,
                         defer={"b"}.__contains__)
    first = {n: torch.equal(got[n], _shard(n, world, rank)) for n in SPECS}
    untouched = bool(torch.isnan(got["b"]).all())
    rest()
    return {"first": first, "b_untouched": untouched,
            "after": all(torch.equal(got[n], _shard(n, world, rank)) for n in SPECS)}


def test_deferred_tensors_land_only_when_the_rest_is_landed_and_then_whole(tmp_path):
    results = run_in_group(_reshard_in_two, 3, tmp_path)
    for rank in range(3):
        assert results[rank] == {"first": {"a": True, "b": False, "step": True},
                                 "b_untouched": True, "after": True}


def test_buddy_copies_land_on_the_next_rank_and_a_holderless_rank_is_rebuilt_from_them(
        tmp_path):
    results = run_in_group(_exchange_then_reshard, 3, tmp_path)
    assert [results[r]["held"] for r in range(3)] == [[0, 2], [0, 1], [1, 2]]
    assert all(results[r]["copies_right"] and results[r]["rebuilt"] for r in range(3))
    assert results[1]["sent"] == []  # the joiner sends nothing
