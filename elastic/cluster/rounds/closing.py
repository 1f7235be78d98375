"""How the coordinator closes a round and seats its members: when it may close (O(1) while a
live member has yet to ask), the weighing of the round's join requests (``verdict``), the one
compare-and-swap that closes it (``RoundCloser.close``), the seats of the plan's members, and
the seats deleted of members whose key went (their fence).

A mixin of ``Coordinator`` (``coordinator``), kept apart so that each module stays one concept:
the coordinator owns leading (the key, the watch, the leader's view of the job) and telling the
news; this owns closing the next round from that view. ``RoundCloser`` is what it asks of the
job's rendezvous.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from elastic.cluster.etcd.client import EtcdClient, KeyValue
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.news import RoundNews
from elastic.cluster.rounds.plan import CloseRule, JoinRequest, Plan, RendezvousConfig
from elastic.cluster.rounds.seat import seats_of
from elastic.cluster.rounds.verdict import CloseVerdict


class RoundCloser(Protocol):
    """What the coordinator asks of the job's rendezvous (``rendezvous.Rendezvous``): its
    limits and close rule, when a round may close, plan and join request reads, and the one
    compare-and-swap that closes a round."""

    config: RendezvousConfig
    rule: CloseRule
    verdict: CloseVerdict

    def read_plan(self, n: int, stored: KeyValue | None = None) -> Plan | None:
        """The plan of round ``n`` (None: none yet)."""

    def admissible(self, n: int, kv: KeyValue, leases: dict[str, int]) -> JoinRequest | None:
        """The join request in ``kv`` (None: malformed, or not under its member's lease)."""

    def close(self, n: int, round_revision: int, requests: list[JoinRequest],
              previous: Plan | None, cut: frozenset[str] = frozenset()) -> Plan | None:
        """Writes round ``n``'s plan by compare-and-swap (None: another closed it)."""


class RoundClosing:
    """Closing rounds, for ``Coordinator``, which keeps these attributes (the leader's view,
    guarded by ``_changed``) and writes the news (``_write_news``)."""

    _client: EtcdClient
    _keys: JobKeys
    _rendezvous: RoundCloser
    _changed: threading.Condition
    _members: dict[str, int]
    _joins: dict[int, dict[str, KeyValue]]
    _gones: dict[int, dict[str, KeyValue]]
    _checked: dict[tuple[str, int, int | None], JoinRequest | None]
    _unasked: set[str]
    _plan: Plan | None
    _plan_members: frozenset[str]
    _round: int
    _round_revision: int
    _closed: int
    _seated: int
    _seen: tuple[frozenset[str], frozenset[str]] | None
    _last_change: float
    _rejoin_since: tuple[int, float] | None

    _unseat: set[str]

    def _write_news(self, news: RoundNews) -> bool:
        raise NotImplementedError

    def _fence_gone(self) -> None:
        """Deletes the seat of each member whose key was deleted, in one request: a no-op
        where its lease ended or ``drop_member`` removed it (each deletes the seat too), the
        member's fence where the key was deleted by other means (``membership.py``)."""
        with self._changed:
            gone = sorted(self._unseat)
        if not gone:
            return
        self._client.delete_many([self._keys.seat(member) for member in gone])
        with self._changed:
            self._unseat.difference_update(gone)

    def _seat(self, plan: Plan) -> None:
        """Writes the seat of every member ``plan`` names (``seat.py``), bound to its lease:
        ``put_many``, about one transaction per hundred members. A member whose lease is gone
        gets none."""
        if self._seated == plan.round:
            return
        with self._changed:
            leases = dict(self._members)
        self._client.put_many([(self._keys.seat(member), seat.to_json(), leases[member])
                               for member, seat in seats_of(plan).items() if leases.get(member)])
        self._seated = plan.round

    def _close_next(self) -> None:
        """Closes round ``R + 1`` when its join requests allow (``verdict.CloseVerdict``)."""
        n = self._round + 1
        if n <= self._closed:
            return  # closed by this leader: its watch brings the new round next
        if self._cannot_close_yet(n):
            return
        with self._changed:
            leases = dict(self._members)
            joins = list(self._joins.get(n, {}).values())
            gone = list(self._gones.get(n, {}).values())
            revision = self._round_revision if self._round else 0
        start = len(self._keys.joins(n))  # where the member id begins in a join key
        requests = [r for r in (self._admissible(n, kv, kv.key[start:], leases) for kv in joins)
                    if r is not None]
        state = (frozenset(r.member_id for r in requests), frozenset(leases))
        now = time.monotonic()
        if state != self._seen:
            self._seen, self._last_change = state, now
        plan = self._plan
        # Members of the last round (under their ids, or re-registered after losing their
        # lease); in a first round, members that etcd forgot.
        returning = (bool(state[0] & set(plan.ranks))
                     or any(r.from_round == plan.round for r in requests)) if plan is not None \
            else any(r.from_round for r in requests)
        if returning and (self._rejoin_since is None or self._rejoin_since[0] != n):
            self._rejoin_since = (n, now)
        since = self._rejoin_since
        waited = now - since[1] if since is not None and since[0] == n else 0.0
        cut = self._rendezvous.verdict(n, requests, leases, plan, now - self._last_change,
                                       waited, gone) if requests else None
        if cut is None:
            return
        plan = self._rendezvous.close(n, revision, requests, self._plan, cut)
        if plan is not None:  # its members are told at once, not when the watch brings it
            self._closed = n
            self._seat(plan)
            self._write_news(RoundNews(n))
            if n > 2:
                self._client.delete_prefix(self._keys.round_prefix(n - 2))

    def _cannot_close_yet(self, n: int) -> bool:
        """True while round ``n`` waits for a live member that has not asked, so that the
        verdict could only say no and weighing it (O(N) each time) can wait until the last one
        asks; each step then costs O(1), and the whole round O(N).

        A first round closes only once every live member asked (``plan.should_close``). A
        re-formation waits for each live member of round ``n - 1`` within the rejoin timeout
        (``roll_call.may_close``), unless a report of an ended connection is to be weighed;
        the clock starts at the first request of round ``n - 1``'s members, which the full
        weighing notes."""
        with self._changed:
            if self._plan is None:
                return bool(self._unasked)
            if self._unasked.isdisjoint(self._plan_members) or self._gones.get(n):
                return False
        since = self._rejoin_since
        if since is None or since[0] != n:
            return False
        rejoin_s = self._rendezvous.config.timeouts.rejoin.total_seconds()
        return time.monotonic() - since[1] < rejoin_s

    def _admissible(self, n: int, kv: KeyValue, member: str,
                    leases: dict[str, int]) -> JoinRequest | None:
        """``Rendezvous.admissible``, once per version of a request and of its member's lease
        (a step sees every request of the round: parsing each again would cost O(N) each)."""
        checked = (kv.key, kv.mod_revision, leases.get(member))
        if checked not in self._checked:
            self._checked[checked] = self._rendezvous.admissible(n, kv, leases)
        return self._checked[checked]
