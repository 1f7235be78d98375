"""This member's place in a formed round: ``Topology``, read from its seat.

Made by the rendezvous (``rendezvous.py``) when a member is seated, and read by everything that
works with a formed round: the round tracker, the run loop, plain mode. It sits apart from the
rendezvous so that those can name it without importing the rendezvous.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.cluster.rounds.seat import Seat


@dataclass(frozen=True)
class Topology:
    """This member's place in a formed round, from its seat (``seat.py``).

    ``lineage`` names the round among the rounds of any etcd, the same on each of its members.
    ``members`` lists every rank on rank 0 only: the other ranks talk to rank 0 alone.
    """

    round: int
    rank: int
    world_size: int
    member_id: str
    rank0: str
    master_addr: str
    master_port: int
    store_prefix: str
    lineage: int
    members: tuple[str, ...] = ()

    @staticmethod
    def of(seat: Seat, member_id: str, store_prefix: str) -> "Topology":
        return Topology(round=seat.round, rank=seat.rank, world_size=seat.world_size,
                        member_id=member_id, rank0=seat.rank0, master_addr=seat.master_addr,
                        master_port=seat.master_port, store_prefix=store_prefix,
                        lineage=seat.lineage, members=seat.ranks)

    def member(self, rank: int) -> str:
        """The id of the member with ``rank``: any rank on rank 0; elsewhere this member's own
        and rank 0's, the only ranks it talks to.

        Raises:
            ValueError: another rank, asked of a member that is not rank 0.
        """
        if self.members:
            return self.members[rank]
        if rank == self.rank:
            return self.member_id
        if rank == 0:
            return self.rank0
        raise ValueError(f"rank {self.rank} of round {self.round} does not know who has rank "
                         f"{rank}: only rank 0 does")
