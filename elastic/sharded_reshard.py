"""The N -> M reshard of a formation: this rank's new shard of the chosen commit, built from the
rows it holds and the rows live holders send it, loaded into the objects ``parallelize`` built,
once every rank is found to have built the committed model (``sharded_models``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic.foundation.events import EventLog, Stopwatch
from elastic.sharded_models import check_models
from elastic.state.sharded.commits import Choice, ShardCommits
from elastic.state.sharded.layout import plan_moves
from elastic.state.sharded.moves import assemble
from elastic.state.sharded.optimizer_state import make_state
from elastic.state.sharded.shards import (flat_tensors, load_local, local_part,
                                          sharded_state_dict, spec_of)


@dataclass(frozen=True)
class Seat:
    """Where this rank sits in the new round: its rank, the world, the shards of the layout,
    and the round's gloo group for the moves."""

    rank: int
    world: int
    shards: int
    group: Any


def reshard(choice: Choice, commits: ShardCommits, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, seat: Seat, events: EventLog,
            lap: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Moves the chosen commit's missing rows to this rank and loads its new shard into
    ``model`` and ``optimizer``; returns that shard (host tensors by flat name, not shared
    with the live objects). ``lap(name)`` closes each part's time.

    Raises:
        ShardedModelError: this rank built another model than the commit's.
        PeerFailureError: another rank did; the job re-forms without it.
    """
    rank, world, shards = seat.rank, seat.world, seat.shards
    with Stopwatch() as moving:
        # the commit overwrites it all: no zero-gradient step first, and nothing written
        make_state(optimizer, filled=False)
        model_sd, optim_sd = sharded_state_dict(model, optimizer)
        flat = flat_tensors(model_sd, optim_sd)
        lap("state_dict_s")
        specs = {name: spec_of(value) for name, value in flat.items()}
        held = commits.find((choice.version, choice.world, choice.shards))
        check_models(specs, held.specs if held is not None else None, rank, world, seat.group)
        lap("check_s")
        plan = plan_moves(specs, choice.shards, [set(h) for h in choice.holders],
                          [r % shards for r in range(world)], shards,
                          owners_alive=choice.owners_alive)
        local = assemble(plan, rank, held, specs, shards, rank % shards,
                         {n: local_part(v) for n, v in flat.items()}, seat.group,
                         commits.buffers)
        lap("moves_s")
        load_local(model, optimizer, model_sd, optim_sd, local)
        lap("load_s")
    events.emit("resharded", version=choice.version, from_world=choice.world, to_world=world,
                bytes_moved=plan.moved, bytes_minimum=plan.minimum, bytes_lost=plan.lost,
                reshard_s=moving.seconds, copy_free=held is not None and held.frozen)
    return local
