"""The N -> M reshard of a formation: this rank's new shard of the chosen commit, built from the
rows it holds and the rows live holders send it, loaded into the objects ``parallelize`` built.

Owns checking first that every rank built the committed model: a worker whose ``parallelize``
built another one (other code, other arguments) would post sends and receives of other sizes,
which gloo answers by aborting a survivor's process, and the job would lose the commit. The
ranks compare a digest of their tensors' names and shapes with the commit's; the ranks that
differ leave the job with one line that names the first differing tensor, and the others
re-form without them.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic.foundation.errors import ElasticError, PeerFailureError
from elastic.foundation.events import EventLog, Stopwatch
from elastic.state.sharded.commits import Choice, ShardCommits
from elastic.state.sharded.layout import TensorSpec, plan_moves
from elastic.state.sharded.moves import assemble
from elastic.state.sharded.optimizer_state import make_state
from elastic.state.sharded.shards import (flat_tensors, load_local, local_part,
                                          sharded_state_dict, spec_of)


class ShardedModelError(ElasticError):
    """This worker's ``parallelize`` built a model other than the one the job committed."""


def reshard(choice: Choice, commits: ShardCommits, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, rank: int, world: int, shards: int, group: Any,
            events: EventLog, lap: Callable[[str], None]) -> dict[str, torch.Tensor]:
    """Moves the chosen commit's missing rows to this rank and loads its new shard into
    ``model`` and ``optimizer``; returns that shard (host tensors by flat name, not shared
    with the live objects). ``lap(name)`` closes each part's time.

    Raises:
        ShardedModelError: this rank built another model than the commit's.
        PeerFailureError: another rank did; the job re-forms without it.
    """
    with Stopwatch() as moving:
        # the commit overwrites it all: no zero-gradient step first, and nothing written
        make_state(optimizer, filled=False)
        model_sd, optim_sd = sharded_state_dict(model, optimizer)
        flat = flat_tensors(model_sd, optim_sd)
        lap("state_dict_s")
        specs = {name: spec_of(value) for name, value in flat.items()}
        held = commits.find((choice.version, choice.world, choice.shards))
        check_models(specs, held.specs if held is not None else None, rank, world, group)
        plan = plan_moves(specs, choice.shards, [set(h) for h in choice.holders],
                          [r % shards for r in range(world)], shards,
                          owners_alive=choice.owners_alive)
        local = assemble(plan, rank, held, specs, shards, rank % shards,
                         {n: local_part(v) for n, v in flat.items()}, group, commits.buffers)
        lap("moves_s")
        load_local(model, optimizer, model_sd, optim_sd, local)
        lap("load_s")
    events.emit("resharded", version=choice.version, from_world=choice.world, to_world=world,
                bytes_moved=plan.moved, bytes_minimum=plan.minimum, bytes_lost=plan.lost,
                reshard_s=moving.seconds, copy_free=held is not None and held.frozen)
    return local


def check_models(specs: Mapping[str, TensorSpec], committed: Mapping[str, TensorSpec] | None,
                 rank: int, world: int, group: Any) -> None:
    """Agrees that every rank's tensors (``specs``) are the commit's (``committed``, on the
    ranks that hold it; None elsewhere): one all-gather of two digests, and a second
    collective only when some rank differs.

    Raises:
        ShardedModelError: this rank's tensors differ from the commit's.
        PeerFailureError: another rank's do; it leaves, and the job re-forms without it.
    """
    mine = torch.tensor([_digest(specs), _digest(committed) if committed is not None else -1],
                        dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    told = Counter(int(row[1]) for row in rows if int(row[1]) >= 0)
    if not told:
        return  # nobody holds the commit: the moves find out
    want = told.most_common(1)[0][0]
    wrong = [r for r, row in enumerate(rows) if int(row[0]) != want]
    if not wrong:
        return
    source = next(r for r, row in enumerate(rows) if int(row[1]) == want)
    text = _broadcast_text(_describe(committed) if rank == source else "", source, group)
    if rank in wrong:
        raise ShardedModelError(
            f"this worker's parallelize(mesh) built another model than the one the job "
            f"committed ({_difference(specs, _parse(text))}): start every worker of the job "
            f"with the same code and arguments, and build the same model at any world size.")
    raise PeerFailureError(f"rank(s) {wrong} built another model than the committed one and "
                           f"leave the job: re-forming without them")


def _describe(specs: Mapping[str, TensorSpec] | None) -> str:
    """One line per tensor, ``name rows row_bytes sharded``, by name."""
    return "\n".join(f"{name} {spec.rows} {spec.row_bytes} {int(spec.sharded)}"
                     for name, spec in sorted((specs or {}).items()))


def _digest(specs: Mapping[str, TensorSpec]) -> int:
    return zlib.crc32(_describe(specs).encode())


def _parse(text: str) -> dict[str, TensorSpec]:
    specs = {}
    for line in text.splitlines():
        name, rows, row_bytes, sharded = line.rsplit(" ", 3)
        specs[name] = TensorSpec(int(rows), int(row_bytes), sharded == "1")
    return specs


def _broadcast_text(text: str, source: int, group: Any) -> str:
    """``text`` of rank ``source``, on every rank: its length, then its UTF-8 bytes (no
    pickle: what a peer sends is only ever parsed as text)."""
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=source)
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(data, group=group, group_src=source)
    return bytes(data.tolist()).decode(errors="replace")


def _difference(mine: Mapping[str, TensorSpec], committed: Mapping[str, TensorSpec]) -> str:
    """The first tensor, by name, whose shape differs, in words."""
    for name in sorted(set(mine) | set(committed)):
        here, there = mine.get(name), committed.get(name)
        if here is None:
            return f"{name} is in the commit, not in this model"
        if there is None:
            return f"{name} is in this model, not in the commit"
        if here != there:
            return (f"{name} has {here.rows} rows of {here.row_bytes} bytes here, "
                    f"{there.rows} of {there.row_bytes} in the commit")
    return "the same tensors, described alike"
