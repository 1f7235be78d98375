"""When a re-formation may close: every member of the previous round accounted for. No I/O.

A round ``n`` after round ``n - 1`` closes as soon as each member of round ``n - 1`` is
accounted for, and never merely because a window passed while one of them was still inside a
long step (that would make a minority round):

- it asked to join round ``n``;
- its lease is gone (it left, was revoked by its launcher, or stopped renewing: a member on a
  machine that vanished is dropped at its lease TTL);
- it is dead by direct evidence: its agreement connection to rank 0 of round ``n - 1`` ended
  (reported by rank 0), or rank 0's connection ended (reported by any member), ``Evidence``.

A live member of round ``n - 1`` that has done none of these is waited for, up to the rejoin
timeout (``Timeouts.rejoin``) counted from the first request of a member of round ``n - 1``.
The settle window applies only to unknown joiners: live members outside round ``n - 1`` that
have not asked yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.cluster.plan import CloseRule, JoinRequest


@dataclass(frozen=True)
class Evidence:
    """A report that ``member`` of round ``n - 1`` died, written by ``reporter`` under its lease.

    Attributes:
        member: the member reported dead.
        reporter: who saw its connection end.
        lease: the lease the report was written under.
    """

    member: str
    reporter: str
    lease: int

    def is_credible(self, previous: list[str], leases: dict[str, int]) -> bool:
        """Whether the report may count: both are members of the previous round (``previous``,
        rank 0 first), one of them is its rank 0 (the only connections are to rank 0), and it
        was written under the reporter's own live lease (``leases``: member -> lease)."""
        return (self.member != self.reporter and self.member in previous
                and self.reporter in previous and previous[0] in (self.member, self.reporter)
                and self.lease != 0 and leases.get(self.reporter) == self.lease)


@dataclass(frozen=True)
class RollCall:
    """What is known of round ``n - 1``'s members while round ``n`` waits to close.

    Attributes:
        previous: the members of round ``n - 1``, by rank.
        dead: those dead by credible evidence.
        waited_s: seconds since the first join request of a member of round ``n - 1``.
        rejoin_s: how long a live member of round ``n - 1`` is waited for.
    """

    previous: list[str]
    dead: frozenset[str]
    waited_s: float
    rejoin_s: float

    def missing(self, joined: set[str], live: set[str]) -> list[str]:
        """Live members of round ``n - 1`` that neither asked to join nor are dead by evidence."""
        return [m for m in self.previous if m in live and m not in joined and m not in self.dead]


def may_close(requests: list[JoinRequest], live: set[str], roll: RollCall, quiet_s: float,
              rule: CloseRule) -> bool:
    """Whether the re-formation with these join requests may close now.

    Args:
        requests: the round's join requests.
        live: the ids of every registered (lease-holding) member.
        roll: what is known of the previous round's members.
        quiet_s: seconds since the requests or the live set last changed.
        rule: the job's limits.
    """
    joined = {r.member_id for r in requests}
    if len(joined) < rule.min_workers:
        return False
    if roll.missing(joined, live) and roll.waited_s < roll.rejoin_s:
        return False
    unknown = live - joined - set(roll.previous) - roll.dead
    full = rule.max_workers is not None and len(joined) >= rule.max_workers
    return not unknown or full or quiet_s >= rule.settle_s
