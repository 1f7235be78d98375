"""Recycled host memory of sharded commits: which dropped shards come back for reuse (never a
kept commit's, one with an exchange in flight or failed, or a live commit's), how many, and
how one slab is carved into a shard's tensors."""

from __future__ import annotations

import pytest
import torch

from elastic.state.sharded.buffers import ALIGN, HostShard, ShardBuffers, carve, shapes_of
from elastic.state.sharded.commits import ShardCommit, ShardCommits
from elastic.state.sharded.layout import TensorSpec

SHAPES = {"w": ((3, 5), torch.float64), "b": ((3,), torch.float32), "step": ((), torch.int64),
          "empty": ((0, 5), torch.float64), "mask": ((7,), torch.bool)}
SPECS = {"w": TensorSpec(6, 40)}


def _commit(commits: ShardCommits, version: int, shards: tuple[int, ...] = (0, 1)
            ) -> ShardCommit:
    commit = ShardCommit(version, 2, 2, 0, SPECS, {"version": version, "objects": {}})
    for shard in shards:
        commit.held[shard] = commits.buffers.take(SHAPES)
    return commit


@pytest.mark.unit
def test_a_slab_is_carved_into_aligned_views_that_hold_each_tensor_apart():
    shard = carve(SHAPES, pinned=False)
    assert shapes_of(shard) == SHAPES
    for value, tensor in enumerate(shard.values()):
        assert tensor.data_ptr() % ALIGN == 0 and tensor.is_contiguous()
        tensor.fill_(value + 1)
    assert [int(t.reshape(-1)[0]) for t in shard.values() if t.numel()] == [1, 2, 3, True]
    assert shard.slab.untyped_storage().data_ptr() == shard["w"].untyped_storage().data_ptr()


@pytest.mark.unit
def test_the_shards_of_a_dropped_commit_come_back_and_a_kept_commits_never():
    commits = ShardCommits(max_held=2)
    first, second = _commit(commits, 1), _commit(commits, 2)
    commits.add(first)
    commits.add(second)
    assert commits.buffers.free == 0
    third = _commit(commits, 3)  # the first is still kept: new memory
    assert not {id(s) for s in third.held.values()} & {id(s) for s in first.held.values()}
    commits.add(third)  # drops the first
    fourth = _commit(commits, 4)
    assert sorted(map(id, fourth.held.values())) == sorted(map(id, first.held.values()))
    assert commits.buffers.carved == 6


@pytest.mark.unit
def test_a_rank_that_holds_more_shards_than_max_held_gets_them_all_back_for_reuse():
    # uneven nodes make some rank the buddy of many: its commits hold six shards, not two
    commits = ShardCommits(max_held=2)
    for version in (1, 2, 3):
        commits.add(_commit(commits, version, tuple(range(6))))
    assert commits.buffers.free == 6
    _commit(commits, 4, tuple(range(6)))
    assert commits.buffers.carved == 18


@pytest.mark.unit
def test_a_commit_whose_exchange_is_in_flight_or_failed_is_never_reused():
    commits = ShardCommits(max_held=2)
    failed, landed = _commit(commits, 1, (0,)), _commit(commits, 2, (0,))
    for commit in (failed, landed):
        commits.add(commit)
        commits.sending(commit)
    # the first exchange failed (never recorded); the second landed its buddy's shard
    commits.add_copies(landed, {1: commits.buffers.take(SHAPES)})
    commits.add(_commit(commits, 3, (0,)))
    commits.add(_commit(commits, 4, (0,)))
    assert commits.buffers.free == 2  # the landed commit's own shard and received copy


@pytest.mark.unit
def test_a_live_commits_tensors_are_never_taken_for_reuse():
    commits = ShardCommits(max_held=1)
    live = ShardCommit(1, 2, 2, 0, SPECS, {}, {0: {"w": torch.zeros(3, 5)}}, live=True)
    commits.add(live)
    commits.add(_commit(commits, 2, (0,)))  # a live commit goes as soon as it is not newest
    assert commits.buffers.free == 0


@pytest.mark.unit
def test_the_pool_keeps_one_commits_worth_and_lets_the_oldest_go():
    buffers = ShardBuffers(limit=2)
    shards = [buffers.take(SHAPES) for _ in range(3)]
    other = buffers.take({"w": ((2, 5), torch.float64)})
    for shard in (*shards, other, {"w": torch.zeros(2)}):
        buffers.give(shard)
    assert buffers.free == 2
    assert buffers.take({"w": ((2, 5), torch.float64)}) is other
    assert buffers.take(SHAPES) is shards[2]
    assert isinstance(buffers.take(SHAPES), HostShard) and buffers.carved == 5


@pytest.mark.unit
def test_a_new_layouts_shard_is_carved_from_the_smallest_free_slab_that_holds_it():
    # a reshard's new shard: its shapes match no free shard, but two freed slabs of the old
    # layout are large enough, and one is too small
    buffers = ShardBuffers(limit=3)
    small = carve({"w": ((1, 5), torch.float64)}, pinned=False)
    large = carve({"w": ((40, 5), torch.float64)}, pinned=False)
    fitting = carve({"w": ((9, 5), torch.float64)}, pinned=False)
    for shard in (small, large, fitting):
        buffers.give(shard)
    new = {"w": ((8, 5), torch.float64), "b": ((3,), torch.float32)}
    shard = buffers.take(new)
    assert shapes_of(shard) == new and buffers.carved == 0
    assert shard.slab.data_ptr() == fitting.slab.data_ptr()
    assert shard["b"].data_ptr() % ALIGN == 0
    buffers.give(shard)  # it comes back under its own layout
    assert buffers.take(new) is shard
    assert buffers.take({"w": ((60, 5), torch.float64)}).slab.data_ptr() not in {
        small.slab.data_ptr(), large.slab.data_ptr()} and buffers.carved == 1
