"""Whether a round may close now, and without whom: the first-round and re-formation rules put
together for the coordinator. No I/O of its own (the gone reports it weighs are the ones the
coordinator's watch holds).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from elastic.cluster.etcd.values import KeyValue
from elastic.cluster.rounds.gone_reports import GoneReports
from elastic.cluster.rounds.plan import CloseRule, JoinRequest, Plan, should_close
from elastic.cluster.rounds.roll_call import (RollCall, cut_off, dead, heirs_short, may_close,
                                              returning_short)

log = logging.getLogger(__name__)


class CloseVerdict:
    """The rules of closing round ``n``.

    Args:
        rule: the job's limits and settle window.
        rejoin: how long a member of the previous round (or of a round etcd forgot) is waited
            for.
        gone: reads the credible reports among a round's ``gone/`` keys.
    """

    def __init__(self, rule: CloseRule, rejoin: timedelta, gone: GoneReports) -> None:
        self.rule = rule
        self._rejoin = rejoin
        self._gone = gone

    def __call__(self, n: int, requests: list[JoinRequest], live: dict[str, int],
                 previous: Plan | None, quiet_s: float, waited_s: float,
                 gone: list[KeyValue]) -> frozenset[str] | None:
        """Whether round ``n`` may close now (asked by the coordinator), and without whom.

        The rules are a first round's (``plan.should_close``, and the old world of members
        that etcd forgot: ``roll_call.returning_short``) or a re-formation's
        (``roll_call.may_close``, with the credible reports of connections that ended); when the
        reports show the job split, the losing side is left out (``roll_call.cut_off``).

        Args:
            live: every registered member's lease, by member id.
            waited_s: seconds since the first request of a member of round ``n - 1``, under
                its id or a new one (for a first round: of a member that was in a round
                before).
            gone: the keys under ``rounds/{n}/gone/`` as the caller's watch holds them.

        Returns:
            None while the round may not close; else the members to name cut off in it: the
            losing side of a split, and the live members dead by evidence (usually none).
        """
        members = set(live)
        rejoin = self._rejoin
        if previous is None:
            if not should_close(requests, members, False, quiet_s, self.rule):
                return None
            short = returning_short(requests)
            if short and waited_s < rejoin.total_seconds():
                return None
            if short:
                log.warning("round %d closes without %d member(s) of the rounds its members were "
                            "in before etcd lost them: none asked within %s "
                            "(ELASTIC_REJOIN_TIMEOUT)", n, short, rejoin)
            return frozenset()
        joined = {r.member_id for r in requests}
        reports = self._gone.read(n, previous.ranks, live, gone)
        roll = RollCall(previous.ranks, dead(previous.ranks, joined, reports), waited_s,
                        rejoin.total_seconds(), heirs_short(previous.ranks, previous.round,
                                                           requests))
        if not may_close(requests, members, roll, quiet_s, self.rule):
            return None
        if roll.short:
            log.warning("round %d closes without %d member(s) of round %d that lost their "
                        "lease: none asked again within %s (ELASTIC_REJOIN_TIMEOUT)", n,
                        roll.short, n - 1, rejoin)
        cut = cut_off(previous.ranks, joined, reports)
        if len(joined - cut) < self.rule.min_workers:
            cut = frozenset()  # neither side can go on alone: try the whole world again
        missing = roll.missing(joined, members)
        if missing:
            log.warning("round %d closes without %s: live members of round %d that did not "
                        "ask to join within %s (ELASTIC_REJOIN_TIMEOUT)", n, missing, n - 1, rejoin)
        if cut:
            log.warning("round %d goes on without %s: the network between them and the rest "
                        "of round %d went down (ELASTIC_PEER_TIMEOUT)", n, sorted(cut), n - 1)
        return cut | (roll.dead & members) - joined  # alive, if at all, only cut off
