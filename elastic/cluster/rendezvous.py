"""Rounds agreed on etcd: join requests, a roll call of the last round, one plan per round by CAS.

A member asks to be in round ``R + 1`` (R = the newest planned round) with its newest commit
version, and reports the members of round ``R`` it saw die (their agreement connection ended:
``rounds/{n}/gone/``). Any waiting member may close the round once the rules allow
(``plan.should_close`` for a first round; ``roll_call.may_close`` for a re-formation: every
member of round ``R`` accounted for); the close is a compare-and-swap that creates
``rounds/{n}/plan`` and moves ``round`` to ``n`` in one transaction, so exactly one plan exists
per round. Waiting wakes on watch events, and on the settle deadline, never on a polling sleep.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from elastic.errors import LeaveInterrupt, RendezvousClosedError, RendezvousTimeoutError
from elastic.timeouts import Timeouts
from elastic.cluster.etcd_client import EtcdClient, WatchEvent
from elastic.cluster.keys import JobKeys
from elastic.cluster.membership import EtcdMembership
from elastic.cluster.etcd_client import KeyValue
from elastic.cluster.plan import CloseRule, JoinRequest, Plan, assign_ranks, should_close
from elastic.cluster import records
from elastic.cluster.roll_call import Evidence, RollCall, may_close
from elastic.cluster.records import RecordError, SkippedRecords

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RendezvousConfig:
    """Limits of a job's rounds; the waits come from the job's ``Timeouts``."""

    min_workers: int = 1
    max_workers: int | None = None
    timeouts: Timeouts = Timeouts()
    standby: bool = False  # this member is a warm spare (``elastic run --spares``)

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers ({self.min_workers}) must be >= 1.")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) must be >= min_workers "
                             f"({self.min_workers}).")


@dataclass(frozen=True)
class Topology:
    """This member's place in a formed round."""

    round: int
    rank: int
    world_size: int
    members: tuple[str, ...]
    master_addr: str
    master_port: int
    store_prefix: str
    versions: dict[str, int]


class Rendezvous:
    """Joins rounds of one job.

    Args:
        client: the etcd client.
        membership: this member's registration (its watch wakes the waiting).
        config: the job's limits.
        skipped: where malformed join requests are reported (once each).
    """

    def __init__(self, client: EtcdClient, membership: EtcdMembership,
                 config: RendezvousConfig, skipped: SkippedRecords | None = None) -> None:
        self._client = client
        self._skipped = skipped or SkippedRecords()
        self._membership = membership
        self._keys: JobKeys = membership.keys
        self.config = config
        self._rule = CloseRule(config.min_workers, config.max_workers,
                               config.timeouts.settle.total_seconds())
        self._changed = threading.Condition()
        self._epoch = 0
        self.standby = config.standby  # a warm spare until a round takes it
        membership.add_listener(self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._changed:
            self._epoch += 1
            self._changed.notify_all()

    def latest_round(self) -> int:
        """The number of the newest planned round (0: none yet).

        Raises:
            EtcdRecordError: the round counter is not a round number.
        """
        return self._read_round_key()[0]

    def _read_round_key(self) -> tuple[int, int]:
        """The newest planned round and the ``round`` key's mod revision (0, 0: none yet).

        Raises:
            EtcdRecordError: the round counter is not a round number.
        """
        kv = self._client.get(self._keys.round)
        if kv is None:
            return 0, 0
        return records.round_number(self._keys.round, kv.value), kv.mod_revision

    def read_plan(self, n: int) -> Plan | None:
        """The plan of round ``n``, or None when there is none yet.

        Raises:
            EtcdRecordError: the stored plan is malformed.
        """
        kv = self._client.get(self._keys.plan(n)) if n > 0 else None
        if kv is None:
            return None
        try:
            return Plan.from_json(kv.value, n)
        except RecordError as exc:
            raise records.corrupt(kv.key, str(exc)) from None

    def join(self, reason: str, version: int, port: int,
             cancelled: Callable[[], bool] = lambda: False,
             gone: Callable[[int], list[str]] = lambda n: []) -> Topology | None:
        """Asks to be in the next round and waits until it forms.

        Args:
            reason: why it joins (``plan.REASONS``).
            version: its newest commit version.
            port: the port it offers as the round's master port.
            cancelled: turns true when it must stop waiting (SIGTERM).
            gone: the members of round ``n - 1`` this member saw die, asked while waiting for
                round ``n`` (reported in etcd, so that nobody waits for their leases).

        Returns:
            This member's topology, or None when it was left out as a spare (call again).

        Raises:
            RendezvousTimeoutError: fewer than min_workers for longer than the timeout, or
                never admitted by the running members.
            FencedError: this member's lease was lost while waiting.
            LeaveInterrupt: ``cancelled()`` turned true (SIGTERM) while waiting.
        """
        started = time.monotonic()
        while True:
            self._membership.check_not_fenced()
            latest, revision = self._read_round_key()
            n = latest + 1
            # A warm spare's joins never ask the running members to re-form.
            request = JoinRequest(self._membership.member_id, version,
                                  "spare" if self.standby else reason,
                                  self._membership.advertise_addr, port, standby=self.standby)
            self._client.put(self._keys.join(n, self._membership.member_id), request.to_json(),
                             lease=self._membership.lease)
            plan = self._wait_for_plan(n, revision, started, cancelled, gone)
            if plan is None:
                log.info("round %d was overtaken by later rounds; asking for the newest", n)
                continue
            if self._membership.member_id in plan.ranks:
                self.standby = False
                return self._topology(plan)
            if self._membership.member_id in plan.spares:
                return None
            log.info("round %d closed without %s; asking for the next", n,
                     self._membership.member_id)

    def _wait_for_plan(self, n: int, round_revision: int, started: float,
                       cancelled: Callable[[], bool],
                       gone: Callable[[int], list[str]]) -> Plan | None:
        """Waits for round ``n``'s plan, closing the round when the rules allow; None when
        ``round`` moved past ``n - 1`` without a plan of ``n`` left to read."""
        previous = self.read_plan(n - 1)
        seen: tuple[frozenset[str], frozenset[str]] | None = None
        last_change = time.monotonic()
        short_since: float | None = None
        reported: set[str] = set()
        rejoin_since: float | None = None  # the first request of a member of round n - 1
        while True:
            with self._changed:
                epoch = self._epoch
            self._membership.check_not_fenced()
            if cancelled():
                raise LeaveInterrupt(f"asked to leave while waiting for round {n}")
            plan = self.read_plan(n)
            if plan is not None:
                return plan
            if self._has_done(n - 1, previous):
                raise RendezvousClosedError(f"The job finished in round {n - 1}; nothing to join.")
            self._report_gone(n, gone(n), reported)
            requests, live = self._read_round(n)
            now = time.monotonic()
            state = (frozenset(r.member_id for r in requests), frozenset(live))
            if state != seen:
                seen, last_change = state, now
            short_since = self._check_limits(requests, n, started, short_since, now)
            if previous is not None and rejoin_since is None \
                    and state[0] & set(previous.ranks):
                rejoin_since = now
            if self._may_close(n, requests, live, previous, now - last_change,
                               0.0 if rejoin_since is None else now - rejoin_since):
                if not self._close(n, round_revision, requests, previous) \
                        and self.read_plan(n) is None:
                    return None
                continue
            # Watch events wake the wait; else the settle deadline (when it is ahead), else the
            # wake cap (the rendezvous and admit deadlines are checked then).
            wake_s = self.config.timeouts.wake.total_seconds()
            settle_left = self._rule.settle_s - (now - last_change)
            with self._changed:
                if self._epoch == epoch:
                    self._changed.wait(timeout=min(settle_left, wake_s) if settle_left > 0
                                       else wake_s)

    def _may_close(self, n: int, requests: list[JoinRequest], live: set[str],
                   previous: Plan | None, quiet_s: float, waited_s: float) -> bool:
        """The rules for round ``n``: a first round's (``plan.should_close``), or a
        re-formation's (``roll_call.may_close``, with the credible reports of deaths)."""
        if previous is None:
            return should_close(requests, live, False, quiet_s, self._rule)
        rejoin_s = self.config.timeouts.rejoin.total_seconds()
        roll = RollCall(previous.ranks, frozenset(), waited_s, rejoin_s)
        if roll.missing({r.member_id for r in requests}, live):  # only then read the reports
            roll = RollCall(previous.ranks, self._dead(n, previous), waited_s, rejoin_s)
        if may_close(requests, live, roll, quiet_s, self._rule):
            missing = roll.missing({r.member_id for r in requests}, live)
            if missing:
                log.warning("round %d closes without %s: live members of round %d that did not "
                            "ask to join within %s (ELASTIC_REJOIN_TIMEOUT)", n, missing, n - 1,
                            self.config.timeouts.rejoin)
            return True
        return False

    def _report_gone(self, n: int, members: list[str], reported: set[str]) -> None:
        """Records, under this member's lease, the members of round ``n - 1`` it saw die."""
        for member in members:
            if member not in reported:
                self._client.put(self._keys.gone(n, member), self._membership.member_id,
                                 lease=self._membership.lease)
                reported.add(member)
                log.info("member %s of round %d is gone (its connection ended)", member, n - 1)

    def _dead(self, n: int, previous: Plan) -> frozenset[str]:
        """The members of round ``n - 1`` dead by credible reports (others are skipped)."""
        kvs, _ = self._client.get_prefix(self._keys.gones(n))
        members, _ = self._client.get_prefix(self._keys.members)
        leases = {kv.key[len(self._keys.members):]: kv.lease for kv in members}
        dead = set()
        for kv in kvs:
            report = Evidence(kv.key[len(self._keys.gones(n)):],
                              kv.value.decode("utf-8", errors="replace"), kv.lease)
            if report.is_credible(previous.ranks, leases):
                dead.add(report.member)
            else:
                self._skipped.skip(kv.key, kv.mod_revision, "it is not a report by a member of "
                                   "the previous round about its rank 0 or by its rank 0")
        return frozenset(dead)

    def _has_done(self, n: int, plan: Plan | None) -> bool:
        """Whether a member of round ``n`` returned from the training function (the job is
        finished); a done key of anyone outside the round's plan is ignored."""
        if n < 1 or plan is None:
            return False
        kvs, _ = self._client.get_prefix(self._keys.dones(n))
        done = {kv.key[len(self._keys.dones(n)):] for kv in kvs}
        return bool(done & set(plan.ranks))

    def _read_round(self, n: int) -> tuple[list[JoinRequest], set[str]]:
        """The round's admissible join requests and the live members' ids.

        The joins are read first: a member registers before it joins, so the member key of a
        live joiner is in the later read.
        """
        joins, _ = self._client.get_prefix(self._keys.joins(n))
        members, _ = self._client.get_prefix(self._keys.members)
        leases = {kv.key[len(self._keys.members):]: kv.lease for kv in members}
        requests = [r for r in (self._admissible(n, kv, leases) for kv in joins) if r is not None]
        return requests, set(leases)

    def _admissible(self, n: int, kv: KeyValue, leases: dict[str, int]) -> JoinRequest | None:
        """The join request in ``kv``, or None (skipped with a warning) when it is malformed or
        was not written under its member's lease."""
        member = kv.key[len(self._keys.joins(n)):]
        request = self._skipped.read(kv.key, kv.mod_revision, lambda: JoinRequest.from_json(
            kv.value, kv.create_revision, member))
        if request is None:
            return None
        if leases.get(member) != kv.lease or not kv.lease:
            self._skipped.skip(kv.key, kv.mod_revision, "it was not written under the lease of a "
                                                        "registered member of that id")
            return None
        return request

    def _check_limits(self, requests: list[JoinRequest], n: int, started: float,
                      short_since: float | None, now: float) -> float | None:
        if len(requests) >= self.config.min_workers:
            short_since = None
        elif short_since is None:
            short_since = now
        timeout_s = self.config.timeouts.rendezvous.total_seconds()
        if short_since is not None and now - short_since > timeout_s:
            raise RendezvousTimeoutError(
                f"Round {n}: only {len(requests)} of min_workers={self.config.min_workers} "
                f"worker(s) joined within {timeout_s:.0f} s. Start more workers, or lower "
                "--min-workers / ELASTIC_MIN_WORKERS.")
        if now - started > self.config.timeouts.admit.total_seconds():
            raise RendezvousTimeoutError(
                f"Round {n} did not form within {self.config.timeouts.admit}: the running members "
                "admit new workers only at state.commit() or state.check_membership().")
        return short_since

    def _close(self, n: int, round_revision: int, requests: list[JoinRequest],
               previous: Plan | None) -> bool:
        """Writes round ``n``'s plan and moves ``round`` to ``n``: only if no plan of ``n``
        exists and ``round`` is still what this member read (``n - 1``), so that ``round`` only
        moves forward, even for a member that was delayed past later rounds."""
        plan = assign_ranks(requests, previous.ranks if previous else [], n,
                            self.config.max_workers, self.config.min_workers)
        if self._client.create(self._keys.plan(n), plan.to_json(),
                               also={self._keys.round: str(n)},
                               unchanged=(self._keys.round, round_revision)):
            log.info("round %d formed by %s: world %d", n, self._membership.member_id,
                     plan.world_size)
            if n > 2:
                self._client.delete_prefix(self._keys.round_prefix(n - 2))
            return True
        return False

    def _topology(self, plan: Plan) -> Topology:
        me = self._membership.member_id
        return Topology(round=plan.round, rank=plan.ranks.index(me), world_size=plan.world_size,
                        members=tuple(plan.ranks), master_addr=plan.master_addr,
                        master_port=plan.master_port,
                        store_prefix=self._keys.store(plan.round), versions=dict(plan.versions))

    def finish(self, topology: Topology, timeout: timedelta) -> None:
        """Records that this member returned from the training function, then waits until every
        member of the round has either returned too or gone (so that no finisher breaks a peer
        still in its last collective).
        """
        n = topology.round
        self._client.put(self._keys.done(n, self._membership.member_id), b"1")
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            with self._changed:
                epoch = self._epoch
            dones, _ = self._client.get_prefix(self._keys.dones(n))
            finished = {kv.key[len(self._keys.dones(n)):] for kv in dones}
            _, live = self._read_round(n + 1)
            waiting = [m for m in topology.members if m not in finished and m in live]
            if not waiting:
                return
            with self._changed:
                if self._epoch == epoch:
                    self._changed.wait(timeout=self.config.timeouts.wake.total_seconds())
        log.warning("members %s did not finish within %s", waiting, timeout)
