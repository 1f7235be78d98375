"""Carrying out a reshard plan: each rank assembles its new shard of every tensor from the
rows it holds and the rows live holders send it, point to point; no rank holds more than its
new shard plus what it held already. The pieces of some tensors may be left to land later
(``defer``): an optimizer's moments are not read before its next step, so they can travel
while that step's forward and backward run. Torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.sharded.buffers import ShardBuffers, carve, shapes_of
from elastic.state.sharded.commits import ShardCommit
from elastic.state.sharded.layout import Piece, Plan, TensorSpec, shard_range

# The deferred pieces' tags start here: apart from the buddy copies' (one per tensor), which
# follow them on the same group
LATER_TAGS = 1 << 24


def _rows(spec: TensorSpec, shards: int, shard: int) -> tuple[int, int]:
    return (0, spec.rows) if not spec.sharded else shard_range(spec.rows, shards, shard)


def assemble(plan: Plan, rank: int, commit: ShardCommit | None, specs: Mapping[str, TensorSpec],
             new_shards: int, new_shard: int, templates: Mapping[str, torch.Tensor],
             group: Any = None, buffers: ShardBuffers | None = None,
             into: dict[str, torch.Tensor] | None = None,
             defer: Callable[[str], bool] | None = None
             ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """This rank's new shard of every tensor, on host: in ``into`` when given, else in host
    memory from ``buffers``; and what lands the deferred pieces.

    Args:
        plan: the move, computed alike on every rank (``layout.plan_moves``).
        rank: this rank in the new round.
        commit: the chosen commit as this rank holds it (None: it holds nothing).
        specs: every tensor's rows and row bytes (the same in both layouts).
        new_shards, new_shard: the new layout and this rank's shard in it.
        templates: this rank's new local parts (shape and dtype), by flat name.
        group: a gloo group of the new round's ranks (its timeout bounds every wait).
        buffers: where the new shard's host memory comes from (default: new memory).
        into: host tensors shaped as ``templates`` to write the new shard into instead (the
            live objects' own, when they live on the CPU).
        defer: which tensors (by flat name, alike on every rank) land later; none by default.

    Returns:
        The new shard (its deferred tensors' rows not written yet) and a callable that lands
        them, blocking, on one thread at a time; every rank must call it, and ``commit``'s
        shards must stay as they are until it returned. It raises torch's ``DistError``
        family when a peer failed.
    """
    out = into
    if out is None:
        shapes = shapes_of(templates)
        out = buffers.take(shapes) if buffers is not None else carve(shapes, pinned=False)
    later = defer or (lambda _: False)
    now = [(tag, p) for tag, p in enumerate(plan.pieces) if not later(p.name)]
    rest = [(LATER_TAGS + tag, p) for tag, p in enumerate(plan.pieces) if later(p.name)]
    land = _Landing(rank, commit, specs, _rows_of(specs, new_shards, new_shard), out, group)
    land(now)

    def land_rest() -> None:
        if rest:  # alike on every rank: the plan is
            # once every rank landed its first pieces: the rest must not take the cores from
            # a rank still moving those (the pause lasts until the last one is done)
            dist.barrier(group=group)
            land(rest)

    return out, land_rest


def _rows_of(specs: Mapping[str, TensorSpec], shards: int, shard: int) -> dict[str, int]:
    """The first row of ``shard`` of every tensor (0 for one held whole)."""
    return {name: _rows(spec, shards, shard)[0] for name, spec in specs.items()}


class _Landing:
    """Lands pieces of one plan into one rank's new shard."""

    def __init__(self, rank: int, commit: ShardCommit | None, specs: Mapping[str, TensorSpec],
                 firsts: Mapping[str, int], out: dict[str, torch.Tensor], group: Any) -> None:
        self._rank = rank
        self._commit = commit
        self._specs = specs
        self._firsts = firsts
        self._out = out
        self._group = group

    def __call__(self, pieces: Sequence[tuple[int, Piece]]) -> None:
        """Posts every transfer of ``pieces`` first (a peer's receives then do not wait for
        this rank's own copies), copies the local ones, and waits for the transfers."""
        rank, group = self._rank, self._group
        works, local = [], []
        for tag, piece in pieces:
            spec = self._specs[piece.name]
            if piece.dst == rank:
                first = self._firsts[piece.name]
                target = self._out[piece.name]
                view = target[piece.start - first: piece.stop - first] if spec.sharded else target
                if piece.src == rank:
                    local.append((view, piece))
                elif view.numel():
                    works.append(dist.irecv(view, piece.src, group=group, tag=tag))
            elif piece.src == rank:
                assert self._commit is not None
                # live rows may be on a GPU
                rows = _held_rows(self._commit, spec, piece).contiguous().cpu()
                if rows.numel():
                    works.append(dist.isend(rows, piece.dst, group=group, tag=tag))
        for view, piece in local:
            assert self._commit is not None
            view.copy_(_held_rows(self._commit, self._specs[piece.name], piece))
        for work in works:
            work.wait()


def _held_rows(commit: ShardCommit, spec: TensorSpec, piece: Piece) -> torch.Tensor:
    """Rows ``[piece.start, piece.stop)`` of the whole tensor, from the held shard."""
    tensor = commit.held[piece.shard][piece.name]
    if not spec.sharded:
        return tensor
    first, _ = shard_range(spec.rows, commit.shards, piece.shard)
    return tensor[piece.start - first: piece.stop - first]
