"""That every rank of a sharded job built the job's model, checked before anything moves.

Owns the check and its verdict: a worker whose ``parallelize`` built another model (other code,
other arguments) would post sends and receives, or FSDP collectives, of other sizes, which gloo
answers by aborting a survivor's process, and the job would lose its commit. So at every
formation the ranks compare a digest of their model's tensors (names, dim-0 lengths and bytes
per row) with the commit's, or, where no rank holds one (a start, a durable load), with each
other's. The ranks that differ from the job's model leave with one line that names the first
differing tensor (a mistake in the setup: not restarted), and the others re-form without them.
Optimizer entries are left out: those of a reshard are made by a guess (``make_state``), which
is no fault of the user's model.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from elastic.foundation.errors import PeerFailureError, SetupError
from elastic.state.feed import feed_payload
from elastic.state.sharded.layout import TensorSpec
from elastic.state.sharded.shards import MODEL, flat_tensors, spec_of

_FIX = ("start every worker of the job with the same code and arguments, and build the same "
        "model at any world size.")


class ShardedModelError(SetupError):
    """This worker's ``parallelize`` built another model than the job's (the committed one, or
    at a start the one most ranks built), or no model is built by more ranks than another."""


class Verdict(NamedTuple):
    """What the gathered digests say: the job's model digest, the ranks that built another,
    the rank that describes the job's model, whether that is the commit's (else the most
    ranks'), and whether no model is built by more ranks than another (a tie)."""

    want: int
    wrong: list[int]
    source: int
    committed: bool
    tie: bool


def check_built(model: torch.nn.Module, rank: int, world: int, group: Any) -> None:
    """``check_models`` for a formation with no commit to reshard: the model's tensors only
    (the optimizer's state is not made, so torch takes no zero-gradient step for it)."""
    specs = {name: spec_of(value)
             for name, value in flat_tensors(get_model_state_dict(model), {}).items()}
    check_models(specs, None, rank, world, group)


def check_models(specs: Mapping[str, TensorSpec], committed: Mapping[str, TensorSpec] | None,
                 rank: int, world: int, group: Any) -> None:
    """Agrees that every rank's model tensors (from ``specs``) are the commit's (``committed``
    on the ranks that hold it, None elsewhere) or, where no rank holds a commit, those most
    ranks built: one all-gather of two digests; only when some rank differs, the job's model
    described by one rank (``feed_payload``: data, never code, its size bounded).

    Raises:
        ShardedModelError: this rank's model differs from the job's (every rank's on a tie).
        PeerFailureError: another rank's does, and it leaves; or a peer sent a malformed
            description (``PayloadFormatError`` when it is not a payload at all).
    """
    mine = torch.tensor([_digest(specs), _digest(committed) if committed is not None else -1],
                        dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    verdict = decide([(int(row[0]), int(row[1])) for row in rows])
    if not verdict.wrong:
        return
    job = _model_only(committed if verdict.committed else specs)
    told = {name: [spec.rows, spec.row_bytes, int(spec.sharded)] for name, spec in job.items()}
    fed = feed_payload(told if rank == verdict.source else None, verdict.source, group=group)
    theirs = _difference(specs, _read(fed.payload))
    # every rank holds the description before one leaves or reports the round broken: else a
    # rank still receiving it (the one that must leave) re-forms instead, one round more
    dist.barrier(group=group)
    if verdict.tie:
        groups = {digest: [r for r, row in enumerate(rows) if int(row[0]) == digest]
                  for digest in {int(row[0]) for row in rows}}
        raise ShardedModelError(f"the ranks' parallelize(mesh) built different models, as many "
                                f"ranks each (ranks {sorted(groups.values())}; against rank "
                                f"{verdict.source}'s: {theirs}): {_FIX}")
    if rank in verdict.wrong:
        whose = "the one the job committed" if verdict.committed else "most of the job's ranks"
        raise ShardedModelError(f"this worker's parallelize(mesh) built another model than "
                                f"{whose} ({theirs}): {_FIX}")
    raise PeerFailureError(f"rank(s) {verdict.wrong} built another model than the job's and "
                           f"leave it: re-forming without them")


def decide(rows: Sequence[tuple[int, int]]) -> Verdict:
    """The verdict on each rank's (model digest, commit digest or -1)."""
    committed = any(held >= 0 for _, held in rows)
    column = [held if committed else built for built, held in rows]
    counts = Counter(d for d in column if d >= 0).most_common(2)
    want = counts[0][0]
    wrong = [r for r, (built, _) in enumerate(rows) if built != want]
    source = column.index(want)
    tie = not committed and len(counts) > 1 and counts[0][1] == counts[1][1]
    return Verdict(want, wrong, source, committed, tie)


def _model_only(specs: Mapping[str, TensorSpec] | None) -> dict[str, TensorSpec]:
    return {name: spec for name, spec in (specs or {}).items() if name.startswith(MODEL)}


def _describe(specs: Mapping[str, TensorSpec] | None) -> str:
    """One line per model tensor, ``name rows row_bytes sharded``, by name: what the digest
    is taken of."""
    return "\n".join(f"{name} {spec.rows} {spec.row_bytes} {int(spec.sharded)}"
                     for name, spec in sorted(_model_only(specs).items()))


def _digest(specs: Mapping[str, TensorSpec]) -> int:
    return zlib.crc32(_describe(specs).encode())


def _read(told: Any) -> dict[str, TensorSpec]:
    """The job's model as the source described it (``{name: [rows, row_bytes, sharded]}``).

    Raises:
        PeerFailureError: it is not such a description (the peer that sent it is broken).
    """
    try:
        return {str(name): TensorSpec(int(rows), int(row_bytes), bool(sharded))
                for name, (rows, row_bytes, sharded) in told.items()}
    except (AttributeError, TypeError, ValueError):
        raise PeerFailureError("a peer described the job's model in a malformed form: "
                               "re-forming without trusting it") from None


def _difference(mine: Mapping[str, TensorSpec], theirs: Mapping[str, TensorSpec]) -> str:
    """The first model tensor, by name, whose shape differs from ``theirs``, in words."""
    mine, theirs = _model_only(mine), _model_only(theirs)
    for name in sorted(set(mine) | set(theirs)):
        here, there = mine.get(name), theirs.get(name)
        if here is None:
            return f"{name} is in the job's model, not in this one"
        if there is None:
            return f"{name} is in this model, not in the job's"
        if here != there:
            return (f"{name} has {here.rows} rows of {here.row_bytes} bytes here, "
                    f"{there.rows} of {there.row_bytes} in the job's model")
    return "the same tensors, described alike"
