"""The N -> M reshard of a formation: this rank's new shard of the chosen commit, built from the
rows it holds and the rows live holders send it, loaded into the objects ``parallelize`` built,
once every rank is found to have built the committed model (``sharded_models``). Objects on the
CPU receive their shard in place, and the optimizer's moments may land after the formation
(``Resharded.rest``), while the first step's forward and backward run; on a GPU the shard
lands in host memory first, whole, and is loaded from there (that host copy then serves as
the formation's commit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic.foundation.events import EventLog, Stopwatch
from elastic.sharded_models import check_models
from elastic.state.sharded.commits import Choice, ShardCommits
from elastic.state.sharded.layout import TensorSpec, plan_moves
from elastic.state.sharded.moves import assemble
from elastic.state.sharded.optimizer_state import make_state
from elastic.state.sharded.shards import (OPTIM, flat_tensors, hold_every_tensor,
                                          load_local, local_part, sharded_state_dict, spec_of)


@dataclass(frozen=True)
class Seat:
    """Where this rank sits in the new round: its rank, the world, the shards of the layout,
    and the round's gloo group for the moves."""

    rank: int
    world: int
    shards: int
    group: Any


@dataclass(frozen=True)
class Resharded:
    """This rank's new shard: ``flat``, the objects' state by flat name (DTensors and plain
    tensors); ``host_copy``, the shard in host memory apart from the objects (not shared with
    them), or None when it was written into the objects in place and nowhere else; ``rest``
    lands the pieces left for later (the optimizer's moments, in place only): every rank
    calls it, on one thread, before the optimizer's next step and before the shard is read
    or copied (it raises torch's ``DistError`` family when a peer failed)."""

    flat: dict[str, torch.Tensor]
    host_copy: dict[str, torch.Tensor] | None
    rest: Callable[[], None]


def reshard(choice: Choice, commits: ShardCommits, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, seat: Seat, events: EventLog,
            lap: Callable[[str], None]) -> Resharded:
    """Moves the chosen commit's missing rows to this rank and loads its new shard into
    ``model`` and ``optimizer``: in place when their local parts live on the CPU and are
    theirs, else through host memory. ``lap(name)`` closes each part's time.

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
                          owners_alive=choice.owners_alive, own_of=choice.own)
        parts = {n: local_part(v).detach() for n, v in flat.items()}
        in_place = (all(p.device.type == "cpu" for p in parts.values())
                    and hold_every_tensor(parts, model, optimizer))
        later = _moments(specs)  # alike on every rank, whichever way each one lands them
        local, rest = assemble(plan, rank, held, specs, shards, rank % shards, parts,
                               seat.group, commits.buffers, into=parts if in_place else None,
                               defer=later.__contains__)
        if not in_place:  # loaded from host memory: whole first
            rest()
            rest = _landed
        lap("moves_s")
        if not in_place:
            load_local(model, optimizer, model_sd, optim_sd, local)
            lap("load_s")
    events.emit("resharded", version=choice.version, from_world=choice.world, to_world=world,
                bytes_moved=plan.moved, bytes_minimum=plan.minimum, bytes_lost=plan.lost,
                bytes_deferred=sum((p.stop - p.start) * specs[p.name].row_bytes
                                   for p in plan.pieces
                                   if in_place and p.moves and p.name in later),
                reshard_s=moving.seconds, copy_free=held is not None and held.frozen,
                in_place=in_place)
    return Resharded(flat, None if in_place else local, rest)


def _landed() -> None:
    """Nothing left to land."""


def _moments(specs: dict[str, TensorSpec]) -> frozenset[str]:
    """The optimizer's sharded state tensors (Adam's moments): read first by its next step."""
    return frozenset(n for n, spec in specs.items() if n.startswith(OPTIM) and spec.sharded)
