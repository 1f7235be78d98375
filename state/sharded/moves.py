"""Carrying out a reshard plan: each rank assembles its new shard of every tensor from the
rows it holds and the rows live holders send it, point to point; no rank holds more than its
new shard plus what it held already. Torch only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from elastic.state.sharded.buffers import ShardBuffers, carve, shapes_of
from elastic.state.sharded.commits import ShardCommit
from elastic.state.sharded.layout import Piece, Plan, TensorSpec, shard_range


def _rows(spec: TensorSpec, shards: int, shard: int) -> tuple[int, int]:
    return (0, spec.rows) if not spec.sharded else shard_range(spec.rows, shards, shard)


def assemble(plan: Plan, rank: int, commit: ShardCommit | None, specs: Mapping[str, TensorSpec],
             new_shards: int, new_shard: int, templates: Mapping[str, torch.Tensor],
             group: Any = None, buffers: ShardBuffers | None = None,
             into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """This rank's new shard of every tensor, on host: in ``into`` when given, else in host
    memory from ``buffers``.

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
    """
    out = into
    if out is None:
        shapes = shapes_of(templates)
        out = buffers.take(shapes) if buffers is not None else carve(shapes, pinned=False)
    works, local = [], []
    for tag, piece in enumerate(plan.pieces):  # every transfer is posted first: a peer's
        spec = specs[piece.name]  # receives then do not wait for this rank's own copies
        if piece.dst == rank:
            first = _rows(spec, new_shards, new_shard)[0]
            target = out[piece.name]
            view = target[piece.start - first: piece.stop - first] if spec.sharded else target
            if piece.src == rank:
                local.append((view, piece))
            elif view.numel():
                works.append(dist.irecv(view, piece.src, group=group, tag=tag))
        elif piece.src == rank:
            assert commit is not None
            rows = _held_rows(commit, spec, piece).contiguous().cpu()  # live rows may be on a GPU
            if rows.numel():
                works.append(dist.isend(rows, piece.dst, group=group, tag=tag))
    for view, piece in local:
        assert commit is not None
        view.copy_(_held_rows(commit, specs[piece.name], piece))
    for work in works:
        work.wait()
    return out


def _held_rows(commit: ShardCommit, spec: TensorSpec, piece: Piece) -> torch.Tensor:
    """Rows ``[piece.start, piece.stop)`` of the whole tensor, from the held shard."""
    tensor = commit.held[piece.shard][piece.name]
    if not spec.sharded:
        return tensor
    first, _ = shard_range(spec.rows, commit.shards, piece.shard)
    return tensor[piece.start - first: piece.stop - first]
