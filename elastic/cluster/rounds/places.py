"""Where the members of the last round sit when newcomers join a sharded job: in proportion.

Sharded state is laid out in rank order: with ``S`` shards, rank ``r`` holds shard ``r % S``,
the ``(r % S)``-th of ``S`` equal slices of every tensor (FSDP over every rank: ``S`` is the
world; HSDP: the shard degree, when the world is a multiple of it). When a round takes in
newcomers, each member of the last round is best put where its new slice overlaps its old one
most, the newcomers in the gaps: the reshard then moves little more than the newcomers'
slices. Appending the newcomers instead shifts the members' slices under FSDP (from 6 ranks to
8, three quarters of the state moved; in proportion, one third); under HSDP with the shard
degree kept, appending is already best, and the placement finds that.

Owns ``shard_count`` (how many ways a world is sharded) and ``in_proportion``. Pure arithmetic
on member ids; knows nothing of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# Above this many (stayers x (newcomers + 1)) choices, the newcomers are appended: the
# coordinator's time to order a round then grows past a second, for a world of thousands
# doubling at once.
_MOST_CHOICES = 1_000_000


def shard_count(world: int, shard_degree: int | None) -> int:
    """How many ways a world of ``world`` ranks shards its state: ``shard_degree`` (HSDP) when
    the world is a multiple of it, else every rank its own shard (FSDP)."""
    if shard_degree is None or world % shard_degree:
        return world
    return shard_degree


def in_proportion(order: Sequence[T], key: Sequence[str], previous: Sequence[str],
                  shard_degree: int | None = None) -> list[T]:
    """``order`` rearranged so that the members of ``previous`` keep their slices of the state.

    The first entry stays first (the source of the state). The others of ``previous`` go, in
    their old rank order, to the places whose slice overlaps their old slice most in all
    (``shard_count`` of each world; the earlier place on a tie); newcomers fill the other
    places in their order.

    Args:
        order: the new round's members, in the order that ranks them otherwise.
        key: each entry's member id.
        previous: the last round's member ids, by rank.
        shard_degree: the job's HSDP shard degree (None: FSDP over every rank).
    """
    was = {member: rank for rank, member in enumerate(previous)}
    rest = range(1, len(order))
    stay = sorted((i for i in rest if key[i] in was), key=lambda i: was[key[i]])
    new = [i for i in rest if key[i] not in was]
    if not stay or not new or len(stay) * (len(new) + 1) > _MOST_CHOICES:
        return list(order)
    old_shards = shard_count(len(previous), shard_degree)
    new_shards = shard_count(len(order), shard_degree)

    def overlap(at: int, place: int) -> int:  # in units of 1 / (old_shards * new_shards)
        low = was[key[stay[at]]] % old_shards * new_shards
        start = place % new_shards * old_shards
        return max(0, min(low + new_shards, start + old_shards) - max(low, start))

    # best[s][n]: the most overlap of stayers s.. when s stayers and n newcomers are placed,
    # in places 1 .. s + n; the stayer s would take place 1 + s + n
    best = [[0] * (len(new) + 1) for _ in range(len(stay) + 1)]
    for s in range(len(stay) - 1, -1, -1):
        for n in range(len(new), -1, -1):
            take = overlap(s, 1 + s + n) + best[s + 1][n]
            best[s][n] = take if n == len(new) else max(take, best[s][n + 1])
    placed, s, n = [order[0]], 0, 0
    while s < len(stay):
        if n == len(new) or overlap(s, 1 + s + n) + best[s + 1][n] >= best[s][n + 1]:
            placed.append(order[stay[s]])
            s += 1
        else:
            placed.append(order[new[n]])
            n += 1
    return placed + [order[i] for i in new[n:]]
