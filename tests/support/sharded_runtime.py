"""Driving a ``ShardedRuntime`` by hand on a gloo group, as the run loop does: a formation, and
the sharded side of ``commit()``."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from elastic.cluster.links.process_group import ProcessGroup
from elastic.cluster.rounds.topology import Topology
from elastic.foundation.events import EventLog
from elastic.sharded import ShardedRuntime
from elastic.state import TrainState

TIMEOUT = timedelta(seconds=30)


def round_of(rank: int, world: int, number: int) -> tuple[Topology, ProcessGroup]:
    """Round ``number``'s topology for ``rank`` and a process group for it."""
    topology = Topology(round=number, rank=rank, world_size=world, member_id=f"m{rank}",
                        rank0="m0", master_addr="127.0.0.1", master_port=0, store_prefix="",
                        lineage=number)
    return topology, ProcessGroup("gloo", TIMEOUT, frozenset(), timedelta(seconds=10))


def form(runtime: ShardedRuntime, train: TrainState, rank: int, world: int,
         number: int) -> None:
    """Round ``number``'s formation: the commit chosen, the objects rebuilt."""
    topology, group = round_of(rank, world, number)
    runtime.choose(topology, train, group)
    runtime.rebuild(topology, train, EventLog(None, f"rank{rank}"), group)


def commit_shards(runtime: ShardedRuntime, train: TrainState) -> None:
    """What ``commit()`` does: wait for the last copies, agree (a barrier: every rank waited
    for its copies before it), confirm them, take this one and send it."""
    runtime.before_commit()
    train.step += 1
    train.commit()

    def agreed() -> bool:
        dist.barrier()
        runtime.confirm_copies()
        return True

    runtime.commit(train, send_copies=agreed)


def hold_back_copies(runtime: ShardedRuntime) -> threading.Event:
    """Holds every host copy the runtime takes (a formation's own copy on its thread, too)
    until the returned event is set."""
    go = threading.Event()
    buffers = runtime._commits.buffers
    take = buffers.take

    def held_back(*args, **kwargs):
        go.wait(TIMEOUT.total_seconds())
        return take(*args, **kwargs)

    buffers.take = held_back  # type: ignore[method-assign]
    return go
