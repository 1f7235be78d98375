"""A member's place in a formed round, told to that member alone: its seat.

The coordinator closes a round with one plan (every member's rank, ``plan.py``), then writes
each member of the plan its seat under ``assigned/{member}``, bound to that member's lease: its
rank, the world size, where rank 0 hosts the round, and the round's lineage. A member watches
only its own seat, so a change moves O(1) bytes to each member and O(N) in all, where handing
every member the whole plan moved N ids to each of N members. Rank 0's seat also lists every
rank: rank 0 is the one member that talks to all the others.

A member left out of a round that has closed (it asked too late, or it is a spare or cut off)
learns it from its seat, or, when it has none of that round, from the round's plan, read once.

The seat key exists from the member's registration on, written empty (``UNSEATED``) beside its
member key and bound to the same lease; its deletion fences the member (``membership.py``), so
one watch tells a member both its seat and its end. This module owns the record's format and how
a plan becomes seats. No I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from elastic.cluster.rounds import records
from elastic.cluster.rounds.plan import Plan
from elastic.cluster.rounds.records import MAX_ROUND, RecordError

UNSEATED = b""  # a registered member's seat before the first round that names it
PLACES = frozenset({"rank", "spare", "cut"})
_FIELDS = {"round": True, "place": True, "rank": False, "world_size": False,
           "master_addr": False, "master_port": False, "rank0": False, "lineage": False,
           "ranks": False}
_MAX_LINEAGE = 2**63 - 1


def lineage(round_: int, ranks: list[str] | tuple[str, ...]) -> int:
    """A positive int64 naming round ``round_`` with these ranks among the rounds of any etcd
    (a member id belongs to one registration): the same on every member of the round."""
    digest = hashlib.blake2b(f"{round_} {' '.join(ranks)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1


@dataclass(frozen=True)
class Seat:
    """Where one member sits in round ``round``.

    ``place`` is "rank" (in the round, with ``rank`` and the fields after it), "spare" (left out
    by ``max_workers``, or a warm spare not needed: ask again) or "cut" (the round went on
    without it, its connections to the others down). ``ranks`` lists every rank, for rank 0
    only.
    """

    round: int
    place: str
    rank: int = -1
    world_size: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    rank0: str = ""
    lineage: int = 0
    ranks: tuple[str, ...] = ()

    def to_json(self) -> str:
        if self.place != "rank":
            return json.dumps({"round": self.round, "place": self.place})
        data = {"round": self.round, "place": self.place, "rank": self.rank,
                "world_size": self.world_size, "master_addr": self.master_addr,
                "master_port": self.master_port, "rank0": self.rank0, "lineage": self.lineage}
        if self.ranks:
            data["ranks"] = list(self.ranks)
        return json.dumps(data)

    @staticmethod
    def from_json(raw: bytes) -> "Seat":
        """Reads a seat.

        Raises:
            RecordError: a field is missing, unknown, of the wrong type or out of range.
        """
        data = records.load_object(raw, _FIELDS)
        round_ = records.integer("round", data["round"], 1, MAX_ROUND)
        place = records.one_of("place", data["place"], PLACES)
        if place != "rank":
            return Seat(round=round_, place=place)
        for name in ("rank", "world_size", "rank0", "lineage"):
            if name not in data:
                raise RecordError(f"a seat with a rank has no {name}")
        world = records.integer("world_size", data["world_size"], 1, 10**7)
        rank = records.integer("rank", data["rank"], 0, world - 1)
        ranks = tuple(records.member_ids("an entry of ranks", data.get("ranks", [])))
        if ranks and len(ranks) != world:
            raise RecordError(f"ranks lists {len(ranks)} members for a world of {world}")
        return Seat(round=round_, place=place, rank=rank, world_size=world,
                    master_addr=records.address("master_addr",
                                                data.get("master_addr", "127.0.0.1")),
                    master_port=records.integer("master_port", data.get("master_port", 0), 0,
                                                65535),
                    rank0=records.member_id("rank0", data["rank0"]),
                    lineage=records.integer("lineage", data["lineage"], 1, _MAX_LINEAGE),
                    ranks=ranks)


def seat_in(plan: Plan, member: str) -> Seat | None:
    """``member``'s seat in ``plan`` (None: the plan does not name it)."""
    return seats_of(plan, [member]).get(member)


def seats_of(plan: Plan, members: list[str] | None = None) -> dict[str, Seat]:
    """The seats of ``members`` (default: every member the plan names) in ``plan``."""
    wanted = None if members is None else set(members)

    def named(ids: list[str]) -> list[str]:
        return ids if wanted is None else [m for m in ids if m in wanted]

    seats = {m: Seat(round=plan.round, place="spare") for m in named(plan.spares)}
    seats.update({m: Seat(round=plan.round, place="cut") for m in named(plan.cut)})
    line = lineage(plan.round, plan.ranks)
    for rank, member in enumerate(plan.ranks):
        if wanted is None or member in wanted:
            seats[member] = Seat(round=plan.round, place="rank", rank=rank,
                                 world_size=plan.world_size, master_addr=plan.master_addr,
                                 master_port=plan.master_port, rank0=plan.ranks[0],
                                 lineage=line, ranks=tuple(plan.ranks) if rank == 0 else ())
    return seats
