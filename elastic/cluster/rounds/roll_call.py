"""When a re-formation may close: every member of the previous round accounted for. No I/O.

A round ``n`` after round ``n - 1`` closes as soon as each member of round ``n - 1`` is
accounted for, and never merely because a window passed while one of them was still inside a
long step (that would make a minority round):

- it asked to join round ``n``;
- its lease is gone (it left, was revoked by its launcher, or stopped renewing: a member on a
  machine that vanished is dropped at its lease TTL);
- it is dead by direct evidence (``dead``): its kernel ended its agreement connection to rank 0
  of round ``n - 1`` (reported by rank 0), or rank 0's connection (reported by any member,
  while rank 0 has not asked itself), ``Evidence``;
- it is frozen by direct evidence: its process stopped sending heartbeats on such a connection
  while its kernel still acknowledged them (``Timeouts.frozen``). It is left out like a dead
  one, but nothing kills it: once it runs again it asks to join like any newcomer.

A live member of round ``n - 1`` that has done none of these is waited for, up to the rejoin
timeout (``Timeouts.rejoin``) counted from the first request of a member of round ``n - 1``.
So is one that lost its lease without leaving: etcd revoked every lease at once (a stalled
leader that wakes after a quorum loss does), and the members re-register as new ones, each
naming round ``n - 1`` and how many of it may live (``heirs_short``). Until that many asked,
the first of them would otherwise close a round alone and the others follow one by one.
The settle window applies only to unknown joiners: live members outside round ``n - 1`` that
have not asked yet.

A connection can also end with both of its members alive: the network between them went silent
(``Timeouts.peer``; ``Evidence.silent``). Such a report kills nobody: the member is waited for
until it asks (or its lease goes). Every member that was not rank 0 checks, before it asks,
that rank 0's machine answers, and reports it silent when not; so once everyone asked, the
reports show the whole split. ``cut_off`` names the side that is left out, so that exactly one
side goes on: the side of rank 0 of round ``n - 1`` against the members whose link to it went
down (the only connections are to rank 0), the larger going on, rank 0's on a tie; the
losing side is left out whole.

A first round has no round ``n - 1`` in etcd, but it may have one in its members' memory: when
etcd lost its data (a fresh etcd at the same URL) every member re-registers and asks for round 1
again, each naming the round it was last in and how many of that round's members may live (its
world less those it saw die). Such a round waits, up to the rejoin timeout, until that many of
each old round asked (the fewest any of them named: ``returning_short``), so that members whose
etcd client reconnects late make one round, not a round and then a re-formation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from elastic.cluster.rounds.plan import CloseRule, JoinRequest


@dataclass(frozen=True)
class Evidence:
    """A report that ``member`` of round ``n - 1`` died, written by ``reporter`` under its lease.

    Attributes:
        member: the member reported dead.
        reporter: who saw its connection end.
        lease: the lease the report was written under.
        silent: the connection ended because the network acknowledged nothing for the peer
            timeout, not because the peer's kernel ended it: the member may be alive and cut
            off, and the other links cut with its are reported shortly after.
        frozen: the connection is up and the member's kernel answers, but its process sent no
            heartbeat for the frozen timeout (stopped, or hung holding the GIL).
    """

    member: str
    reporter: str
    lease: int
    silent: bool = False
    frozen: bool = False

    def to_value(self) -> str:
        """The report's etcd value (its key names the member and the reporter)."""
        return "silent" if self.silent else "frozen" if self.frozen else "ended"

    @classmethod
    def of(cls, member: str, reporter: str, lease: int, how: str) -> Evidence:
        """The report that ``reporter`` lost ``member`` ``how`` (``ended``, ``silent`` or
        ``frozen``)."""
        return cls(member, reporter, lease, silent=how == "silent", frozen=how == "frozen")

    @classmethod
    def read(cls, name: str, value: bytes, lease: int) -> Evidence | None:
        """The report stored under ``{member}/{reporter}`` (``name``) with ``value``; None
        when the value is not ``ended``, ``silent`` or ``frozen``."""
        member, _, reporter = name.partition("/")
        if value not in (b"ended", b"silent", b"frozen"):
            return None
        return cls.of(member, reporter, lease, value.decode())

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
        short: how many members of round ``n - 1`` that re-registered have yet to ask
            (``heirs_short``).
    """

    previous: list[str]
    dead: frozenset[str]
    waited_s: float
    rejoin_s: float
    short: int = 0

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
    if (roll.missing(joined, live) or roll.short) and roll.waited_s < roll.rejoin_s:
        return False
    unknown = live - joined - set(roll.previous) - roll.dead
    full = rule.max_workers is not None and len(joined) >= rule.max_workers
    return not unknown or full or quiet_s >= rule.settle_s


def dead(previous: list[str], joined: set[str], reports: list[Evidence]) -> frozenset[str]:
    """The members of round ``n - 1`` not waited for by evidence (``RollCall.dead``): those
    whose connection the peer's kernel ended, or whose process stopped beating while its kernel
    answered, as a credible report says; rank 0 only while it has not asked itself. A report of
    a silent link kills nobody: that member may be alive and cut off, and is waited for like
    any live member.

    Args:
        previous: the members of round ``n - 1``, rank 0 first.
        joined: the members that asked to join round ``n``.
        reports: the credible reports of round ``n - 1``'s connections that ended.
    """
    if not previous:
        return frozenset()
    return frozenset(report.member for report in reports if not report.silent
                     and (report.member != previous[0] or previous[0] not in joined))


def cut_off(previous: list[str], joined: set[str], reports: list[Evidence]) -> frozenset[str]:
    """The members of round ``n - 1`` left out of round ``n`` because the job is split: links
    to rank 0 went silent while the members on both ends were alive to ask.

    Args:
        previous: the members of round ``n - 1``, rank 0 first.
        joined: the members that asked to join round ``n``.
        reports: the credible reports of round ``n - 1``'s connections that ended.

    Returns:
        Rank 0 and the members still linked to it when more of those that asked lost their
        link to it than kept it; else those that lost it (none when rank 0 did not ask).
    """
    if not previous or previous[0] not in joined:
        return frozenset()
    rank0 = previous[0]
    apart = {m for report in reports if report.silent
             for m in (report.member, report.reporter) if m != rank0 and m in joined}
    if not apart:
        return frozenset()
    together = {m for m in previous if m in joined} - apart
    return frozenset(together) if len(apart) > len(together) else frozenset(apart)


def returning_short(requests: list[JoinRequest]) -> int:
    """How many members of the rounds that this first round's requesters were last in have not
    asked yet (0 for fresh processes: they were in none).

    Args:
        requests: the first round's join requests (``from_round``, ``from_world``).
    """
    worlds: dict[int, int] = {}
    asked: Counter[int] = Counter()
    for r in requests:
        if r.from_round:
            worlds[r.from_round] = min(worlds.get(r.from_round, r.from_world), r.from_world)
            asked[r.from_round] += 1
    return sum(max(0, world - asked[n]) for n, world in worlds.items())


def heirs_short(previous: list[str], previous_round: int, requests: list[JoinRequest]) -> int:
    """How many members of round ``n - 1`` have not asked for round ``n`` yet, by the word of
    those that lost their lease and re-registered under a new id (their requests name round
    ``n - 1`` and how many of it may live: ``returning_short``); 0 when none did (the members
    of round ``n - 1`` are then accounted for by their own ids and leases: ``RollCall``).

    Args:
        previous: the members of round ``n - 1``.
        previous_round: its number.
        requests: round ``n``'s join requests.
    """
    returning = [r for r in requests if r.from_round == previous_round]
    members = set(previous)
    if all(r.member_id in members for r in returning):
        return 0
    return returning_short(returning)
