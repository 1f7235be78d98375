"""Where the rows of sharded tensors live, and the fewest moves from one layout to another.

Pure arithmetic, no torch: FSDP2 shards every parameter (and so its optimizer state) on dim 0
with ``torch.chunk`` semantics, so shard ``i`` of ``S`` holds rows ``[i * c, (i + 1) * c)``
clipped to the tensor, with ``c = ceil(rows / S)``: the last shards are short or empty. A
tensor that is not sharded (Adam's ``step``, a 0-dim value) is whole on every holder.

Owns: the ranges (``shard_range``), who holds which shard of the last commit (``buddy_ranks``,
``holders_of``) and the transfer plan for a move from ``S_old`` to ``S_new`` shards
(``plan_moves``): each rank of the new world fetches only the rows of its new shard that it does
not hold, each from one live holder, the load spread over the holders. Must not touch tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.state.errors import StateError


class ShardLostError(StateError):
    """Some shard of the last commit has no live holder: it cannot be rebuilt from memory."""


def shard_range(rows: int, shards: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``index`` of ``shards`` (``torch.chunk`` on dim 0).

    Raises:
        ValueError: ``shards`` < 1, ``index`` outside ``[0, shards)`` or ``rows`` < 0.
    """
    if shards < 1 or not 0 <= index < shards or rows < 0:
        raise ValueError(f"shard {index} of {shards} of {rows} rows does not exist.")
    chunk = -(-rows // shards)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


@dataclass(frozen=True)
class TensorSpec:
    """One registered tensor: its dim-0 length and bytes per row; ``sharded`` False for a
    tensor held whole by every holder (then ``rows`` is 1 and ``row_bytes`` its size)."""

    rows: int
    row_bytes: int
    sharded: bool = True


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of tensor ``name`` (indices of the whole tensor), taken from old
    shard ``shard`` held by rank ``src`` and needed by rank ``dst`` (``src == dst``: a local
    copy, nothing sent)."""

    name: str
    start: int
    stop: int
    shard: int
    src: int
    dst: int

    @property
    def moves(self) -> bool:
        return self.src != self.dst


@dataclass(frozen=True)
class Plan:
    """The pieces of a move, in one order every rank computes alike, and its byte counts:
    ``moved`` (sent between ranks), ``minimum`` (what the new ranks lack of their new shards,
    the least any plan for this layout sends) and ``lost`` (the old shards whose owner is gone:
    the dead ranks' shards once; less may move when buddies hold them already, more when the
    layout's rows shift)."""

    pieces: tuple[Piece, ...]
    moved: int
    minimum: int
    lost: int

    def to(self, dst: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == dst]

    def sent_by(self, src: int) -> list[Piece]:
        return [p for p in self.pieces if p.src == src and p.moves]


def buddy_ranks(rank: int, world: int, copies: int, nodes: Sequence[int] = ()) -> list[int]:
    """The ranks that keep a copy of ``rank``'s shards, distinct and not ``rank``.

    On one node (``nodes`` empty, one node id per rank, or all alike): the next ``copies``
    ranks of the ring (``rank + 1``, ...). When the job spans nodes, ranks on another node
    first (all of them before any on ``rank``'s own), spread so that no rank holds more copies
    than some placement must put on one: see ``_cross_node``.

    Raises:
        ValueError: ``copies`` < 0, or ``nodes`` not one id per rank.
    """
    if copies < 0:
        raise ValueError(f"buddies ({copies}) must be >= 0.")
    if nodes and len(nodes) != world:
        raise ValueError(f"{len(nodes)} node ids for a world of {world}.")
    if len(set(nodes)) < 2:
        return [(rank + step) % world for step in range(1, world)][:copies]
    return list(_cross_node(world, copies, tuple(nodes))[rank])


@functools.lru_cache(maxsize=4)
def _cross_node(world: int, copies: int, nodes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every rank's buddies when the job spans nodes; a pure function, alike on every rank.

    Node ``n`` of ``m_n`` ranks places ``m_n * min(copies, world - m_n)`` copies on other
    nodes, at most ``m_n`` on any one rank (one per rank of ``n``). The best any placement
    can do: for every set ``P`` of nodes, of ``|P|`` ranks in all, each rank of a node ``n``
    has ``world - |P|`` ranks outside ``P`` (``- m_n`` more when ``n`` is not in ``P``) for
    its copies, so the rest land on ``P``, and some rank of ``P`` holds the ceiling of their
    sum over ``|P|``; the most copies on one rank is at least the largest of these ceilings
    (and ``copies``). ``_spread`` places them under the least cap that can be met (a
    max-flow, the cap on each rank's copies raised one at a time), which the tests find equal
    to that ceiling on thousands of random layouts.
    Node ``n``'s ``k``-th copy, in the order of ``_elsewhere`` (each target's copies in a run
    of at most ``m_n``), goes to its ``k % m_n``-th rank: every rank's buddies are distinct.
    Nodes of 5 and 1 ranks put five copies on the lone rank, as any placement must. Copies
    beyond the ranks elsewhere go to ranks of the same node, in ring order.
    """
    first = {node: nodes.index(node) for node in set(nodes)}
    order = sorted(range(world), key=lambda r: (first[nodes[r]], r))  # grouped by node
    groups = {node: [r for r in order if nodes[r] == node] for node in sorted(first,
                                                                              key=first.get)}
    targets = {node: _elsewhere(order, nodes, node) for node in groups}
    spread = _spread(targets, {node: len(g) * min(copies, world - len(g))
                               for node, g in groups.items()},
                     {node: len(g) for node, g in groups.items()}, world)
    chosen: list[list[int]] = [[] for _ in range(world)]
    for node, givers in groups.items():
        entries = [t for t in targets[node] for _ in range(spread[node].get(t, 0))]
        for k, t in enumerate(entries):
            chosen[givers[k % len(givers)]].append(t)
    for r in range(world):
        ring = [(r + step) % world for step in range(1, world)]
        chosen[r] += [t for t in ring if nodes[t] == nodes[r]][: copies - len(chosen[r])]
    return tuple(tuple(c) for c in chosen)


def _elsewhere(order: list[int], nodes: Sequence[int], node: int) -> list[int]:
    """The ranks not on ``node``, in ``order`` from the one after ``node``'s last rank."""
    last = max(at for at, r in enumerate(order) if nodes[r] == node)
    ring = order[last + 1:] + order[: last + 1]
    return [r for r in ring if nodes[r] != node]


def _spread(targets: Mapping[int, list[int]], need: Mapping[int, int],
            most: Mapping[int, int], world: int) -> dict[int, dict[int, int]]:
    """How many copies each node puts on each rank of ``targets[node]`` (``need[node]`` in
    all, ``most[node]`` on one rank at most), no rank getting more than it must: augmenting
    paths under a cap on each rank's copies, the cap raised by one when none is left."""
    sent: dict[int, dict[int, int]] = {node: {} for node in targets}
    left, load, cap = dict(need), [0] * world, 0
    while any(left.values()):
        cap += 1
        while (path := _augmenting(targets, sent, left, most, load, cap)) is not None:
            left[path[0][0]] -= 1
            for at, (node, rank) in enumerate(path):
                sent[node][rank] = sent[node].get(rank, 0) + 1
                if at + 1 < len(path):  # the next node gives up its copy on ``rank``
                    nxt = path[at + 1][0]
                    sent[nxt][rank] -= 1
            load[path[-1][1]] += 1
    return sent


def _augmenting(targets: Mapping[int, list[int]], sent: Mapping[int, dict[int, int]],
                left: Mapping[int, int], most: Mapping[int, int], load: list[int],
                cap: int) -> list[tuple[int, int]] | None:
    """A shortest chain ``(node, rank), ...``: the first node places one more copy on its rank,
    each next node moves its copy from the previous rank to its own, and the last rank has
    room under ``cap``; None when there is none (breadth first, in a fixed order)."""
    came: dict[int, tuple[int, int] | None] = {}  # node -> (node, rank) it came from
    seen: set[int] = set()
    frontier = [node for node in targets if left[node] > 0]
    for node in frontier:
        came[node] = None
    while frontier:
        reached = []
        for node in frontier:
            for rank in targets[node]:
                if rank in seen or sent[node].get(rank, 0) >= most[node]:
                    continue
                seen.add(rank)
                if load[rank] < cap:
                    return _chain(came, node, rank)
                for other in targets:
                    if other not in came and sent[other].get(rank, 0) > 0:
                        came[other] = (node, rank)
                        reached.append(other)
        frontier = reached
    return None


def _chain(came: Mapping[int, tuple[int, int] | None], node: int,
           rank: int) -> list[tuple[int, int]]:
    path = [(node, rank)]
    while (back := came[path[-1][0]]) is not None:
        path.append(back)
    return path[::-1]


def holders_of(world: int, shards: int, copies: int, nodes: Sequence[int] = ()) -> list[set[int]]:
    """For each shard of a world of ``world`` ranks sharded ``shards`` ways (``world`` a
    multiple of ``shards``; rank ``r`` owns shard ``r % shards``), the ranks that hold it:
    its owners (every replica in HSDP) and, with a single replica, ``copies`` buddies each."""
    if shards < 1 or world % shards:
        raise ValueError(f"a world of {world} cannot be sharded {shards} ways.")
    held: list[set[int]] = [set() for _ in range(shards)]
    for rank in range(world):
        held[rank % shards].add(rank)
        if world == shards:  # pure FSDP: the buddies are the copies
            for buddy in buddy_ranks(rank, world, copies, nodes):
                held[rank].add(buddy)
    return held


def plan_moves(specs: Mapping[str, TensorSpec], old_shards: int, holders: Sequence[set[int]],
               new_shard_of: Sequence[int], new_shards: int,
               owners_alive: Sequence[bool] | None = None,
               own_of: Sequence[int | None] = ()) -> Plan:
    """The pieces every new rank needs to hold its new shard of every tensor.

    Args:
        specs: every tensor, by name.
        old_shards: how many ways the last commit was sharded.
        holders: for each old shard, the new ranks that hold it (at the chosen version).
        new_shard_of: for each new rank, the shard it holds in the new layout.
        new_shards: how many ways the new layout shards.
        owners_alive: for each old shard, whether a rank that trained on it lives (for
            ``lost``); default: all.
        own_of: for each new rank, the old shard it trained on (None or missing: none); an
            unsharded tensor (a module's buffer, its rank's own) stays that shard's copy.

    Raises:
        ShardLostError: a shard with rows in it has no holder.
    """
    if len(holders) != old_shards:
        raise ValueError(f"{len(holders)} holder sets for {old_shards} shards.")
    load = [0] * len(new_shard_of)
    pieces: list[Piece] = []
    lost = 0
    for name in sorted(specs):
        spec = specs[name]
        lost += _lost_bytes(spec, old_shards, owners_alive)
        for dst, new_shard in enumerate(new_shard_of):
            if not spec.sharded:  # from dst itself, or one holder
                own = own_of[dst] if dst < len(own_of) else None
                pieces.append(_whole(name, spec, holders, dst, load, own))
                continue
            want = shard_range(spec.rows, new_shards, new_shard)
            for shard in range(old_shards):
                have = shard_range(spec.rows, old_shards, shard)
                start, stop = max(want[0], have[0]), min(want[1], have[1])
                if start >= stop:
                    continue
                src = _pick(holders[shard], dst, load, name, shard)
                if src != dst:
                    load[src] += (stop - start) * spec.row_bytes
                pieces.append(Piece(name, start, stop, shard, src, dst))
    moved = sum((p.stop - p.start) * specs[p.name].row_bytes for p in pieces if p.moves)
    return Plan(tuple(pieces), moved, _lacking(specs, old_shards, holders, new_shard_of,
                                               new_shards), lost)


def _lacking(specs: Mapping[str, TensorSpec], old_shards: int, holders: Sequence[set[int]],
             new_shard_of: Sequence[int], new_shards: int) -> int:
    """Bytes of their new shards that the new ranks do not hold themselves."""
    total = 0
    for spec in specs.values():
        for dst, new_shard in enumerate(new_shard_of):
            mine = [shard for shard, held in enumerate(holders) if dst in held]
            if not spec.sharded:
                total += 0 if mine else spec.row_bytes
                continue
            want = shard_range(spec.rows, new_shards, new_shard)
            have = set()
            for shard in mine:
                have.update(range(*shard_range(spec.rows, old_shards, shard)))
            total += sum(row not in have for row in range(*want)) * spec.row_bytes
    return total


def _whole(name: str, spec: TensorSpec, holders: Sequence[set[int]], dst: int,
           load: list[int], own: int | None) -> Piece:
    """The piece of an unsharded tensor for ``dst``: its copy of the shard it trained on
    (``own``; each rank's buffers are its own), else of any shard it holds, else a holder's."""
    mine = [shard for shard, held in enumerate(holders) if dst in held]
    if mine:
        return Piece(name, 0, spec.rows, own if own in mine else mine[0], dst, dst)
    everyone = set().union(*holders)
    src = _pick(everyone, dst, load, name, 0)
    load[src] += spec.row_bytes
    return Piece(name, 0, spec.rows, min(s for s, held in enumerate(holders) if src in held),
                 src, dst)


def _pick(candidates: set[int], dst: int, load: list[int], name: str, shard: int) -> int:
    """The holder that sends: ``dst`` itself when it holds the shard, else the least loaded
    (lowest rank on a tie)."""
    if dst in candidates:
        return dst
    if not candidates:
        raise ShardLostError(f"no live rank holds shard {shard} of {name!r}: every holder of "
                             "it is gone, so the last commit cannot be rebuilt from memory.")
    return min(candidates, key=lambda r: (load[r], r))


def _lost_bytes(spec: TensorSpec, old_shards: int, owners_alive: Sequence[bool] | None) -> int:
    if owners_alive is None or not spec.sharded:
        return 0
    total = 0
    for shard, alive in enumerate(owners_alive):
        if not alive:
            start, stop = shard_range(spec.rows, old_shards, shard)
            total += (stop - start) * spec.row_bytes
    return total
