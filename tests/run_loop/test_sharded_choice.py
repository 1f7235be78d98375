"""Which sharded commit a formation rebuilds, agreed over a real gloo group of two ranks: the
newest one held whole (the small state rolled back with it, on a joiner too), or a typed error
that names what to do when some shard has no live holder; and leaving a released round while a
buddy copy that the release did not wake is still in flight."""

from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.cluster.links.process_group import ProcessGroup
from elastic.cluster.rounds.topology import Topology
from elastic.sharded import ShardedRuntime, ShardedStateLostError
from elastic.state import TrainState
from elastic.state.sharded.commits import ShardCommit
from elastic.state.sharded.copies import BuddyExchange
from elastic.state.sharded.layout import TensorSpec
from elastic.state.sync import newest_source
from tests.support.gloo_group import run_in_group

TIMEOUT = timedelta(seconds=30)
RELEASED_WAIT = timedelta(seconds=2)


def _parallelize(mesh):
    raise AssertionError("choose() builds nothing")


def _commit(train: TrainState, world: int, own: int, held: tuple[int, ...]) -> ShardCommit:
    commit = ShardCommit(train.version, world, world, own, {"w": TensorSpec(4, 8)},
                         {"version": train.version, "objects": dict(train.committed()["objects"])})
    for shard in held:
        commit.held[shard] = {"w": torch.zeros(2, 1, dtype=torch.float64)}
    return commit


def _choose(rank: int, world: int, missing: bool) -> dict:
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, RELEASED_WAIT)
    train = TrainState(step=0)
    # two commits of a 3-rank FSDP round whose rank 2 died: it had sent its shard of the first
    # to its buddy, rank 0, but not its shard of the second
    for step in (4, 5):
        train.step = step
        train.commit()
        held = (0, 2) if rank == 0 and step == 4 and not missing else (rank,)
        runtime._commits.add(_commit(train, 3, rank, held))
    topology, group = _round(rank, world)
    try:
        runtime.choose(topology, train, group)
    except ShardedStateLostError as exc:
        return {"error": str(exc)}
    train.restore()
    return {"version": train.version, "step": train.step}


def _choose_many_held_with_a_joiner(rank: int, world: int) -> dict:
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, RELEASED_WAIT)
    train = TrainState(step=4)
    train.commit()
    if rank == 0:  # the buddy of every rank of a lost node: it holds all six shards
        runtime._commits.add(_commit(train, 6, 5, (0, 1, 2, 3, 4, 5)))
    topology, group = _round(rank, world)  # rank 1 joins holding nothing: a shorter report
    runtime.choose(topology, train, group)
    choice = runtime._choice
    return {"version": choice.version, "holders": [sorted(h) for h in choice.holders]}


def _round(rank: int, world: int) -> tuple[Topology, ProcessGroup]:
    topology = Topology(round=2, rank=rank, world_size=world, member_id=f"m{rank}", rank0="m0",
                        master_addr="127.0.0.1", master_port=0, store_prefix="", lineage=2)
    return topology, ProcessGroup("gloo", TIMEOUT, frozenset(), timedelta(seconds=10))


def _choose_with_a_joiner(rank: int, world: int) -> dict:
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, RELEASED_WAIT)
    train = TrainState(step=4)
    train.commit()
    if rank == 0:  # held whole: the last commit whose copies every rank had
        runtime._commits.add(_commit(train, 1, 0, (0,)))
    else:  # a joiner, synced to a newer version whose shards a kill took before they were copied
        train.step = 5
        train.commit()
    topology, group = _round(rank, world)
    runtime.choose(topology, train, group)
    source = newest_source(train.version, lineage=topology.lineage)
    train.sync(source.rank, receivers=source.receivers)
    return {"source": source.rank, "version": train.version, "step": train.step}


def _chosen_at_step_0(rank: int, world: int) -> tuple[ShardedRuntime, TrainState,
                                                      ProcessGroup]:
    """A runtime that chose in a round of ``world`` after one commit at step 0 (none held)."""
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, RELEASED_WAIT)
    train = TrainState(step=0)
    train.commit()
    topology, group = _round(rank, world)
    runtime.choose(topology, train, group)
    return runtime, train, group


def _settle_with_a_copy_in_flight(rank: int, world: int) -> float:
    runtime, train, group = _chosen_at_step_0(rank, world)
    # a group the release does not shut down: what gloo's race leaves (a send queued when its
    # connection closed stays in waitSend); rank 1 never posts its side of the exchange
    stuck = dist.new_group(backend="gloo", timeout=TIMEOUT)
    releasing = threading.Timer(1.0, group.release, ("a peer failed",))
    releasing.daemon = True
    if rank == 0:
        runtime._exchange = BuddyExchange(stuck, 0, world, 1, [])
        runtime._exchange.start(_commit(train, world, 0, (0,)), runtime._commits)
        releasing.start()  # the watch releases the round while the copies are waited for
    started = time.monotonic()
    runtime.settle()
    settled_s = time.monotonic() - started
    dist.barrier()  # rank 1 keeps the stuck group open until rank 0 settled
    return settled_s


def _side_group_freed_by_the_destroy(rank: int, world: int) -> bool:
    runtime, _, group = _chosen_at_step_0(rank, world)
    side = weakref.ref(runtime._group)
    runtime.settle()
    group.release("the round ends")
    group.destroy()  # frees every group torch holds on a thread of its own, and waits for it
    return side() is None


def test_leaving_a_round_lets_the_destroy_free_its_side_group_off_the_training_thread(tmp_path):
    # a reference kept until the next choose() would free it there, on the training thread,
    # where a copy the release did not wake blocks its destructor until the group's timeout
    assert run_in_group(_side_group_freed_by_the_destroy, 2, tmp_path) == {0: True, 1: True}


def test_a_formation_rebuilds_the_newest_commit_held_whole_and_rolls_the_step_back_with_it(
        tmp_path):
    results = run_in_group(_choose, 2, tmp_path, False)
    assert results == {0: {"version": 1, "step": 4}, 1: {"version": 1, "step": 4}}


def test_a_shard_with_no_live_holder_stops_with_a_line_that_names_the_missing_loader(tmp_path):
    results = run_in_group(_choose, 2, tmp_path, True)
    for result in results.values():
        assert "no live rank holds every shard" in result["error"]
        assert "durable sharded checkpoint" in result["error"]


def test_a_joiner_newer_than_the_commit_rebuilt_takes_the_small_state_of_a_holder(tmp_path):
    results = run_in_group(_choose_with_a_joiner, 2, tmp_path)
    assert results == {0: {"source": 0, "version": 1, "step": 4},
                       1: {"source": 0, "version": 1, "step": 4}}


def test_a_rank_holding_every_shard_and_a_joiner_holding_none_agree_on_the_commit(tmp_path):
    results = run_in_group(_choose_many_held_with_a_joiner, 2, tmp_path)
    assert results[0] == results[1] == {"version": 1, "holders": [[0]] * 6}


def test_leaving_a_released_round_waits_for_an_unwoken_buddy_copy_only_briefly(tmp_path):
    # past the release grace the watchdog restarts a worker in place, and its shards go with it
    results = run_in_group(_settle_with_a_copy_in_flight, 2, tmp_path)
    assert results[0] < 1 + 2 * RELEASED_WAIT.total_seconds() + 5 < TIMEOUT.total_seconds()
