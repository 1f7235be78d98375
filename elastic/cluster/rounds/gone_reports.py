"""The reports of the last round's connections that ended, kept in etcd.

A member of round ``n - 1`` that saw a connection of that round end writes one report per
member it lost, under its own lease (``rounds/{n}/gone/{member}/{reporter}``: ``ended``,
``silent`` or ``frozen``, ``roll_call.Evidence``); the coordinator's watch brings them to the roll call of
round ``n``. A report that could not come from such a member is skipped with one warning.
"""

from __future__ import annotations

import logging

from elastic.cluster.etcd.client import EtcdClient, KeyValue
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.records import SkippedRecords
from elastic.cluster.rounds.roll_call import Evidence

log = logging.getLogger(__name__)
_TOLD = {"ended": "gone (its connection ended)",
         "silent": "unreachable (its connection went silent)",
         "frozen": "frozen (its heartbeats stopped while its machine answered)"}


class GoneReports:
    """Writes and reads the reports of one job.

    Args:
        client: the etcd client.
        keys: the job's key builder.
        skipped: where reports that cannot count are told (once each).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, skipped: SkippedRecords) -> None:
        self._client = client
        self._keys = keys
        self._skipped = skipped

    def write(self, n: int, reporter: str, lease: int, members: dict[str, str],
              reported: set[str]) -> list[str]:
        """Reports the members of round ``n - 1`` that ``reporter`` lost, each with how
        (``ended``, ``silent`` or ``frozen``), except those in ``reported`` (which it extends).

        Returns:
            The members newly reported dead or frozen (not waited for).
        """
        dead = []
        for member, how in members.items():
            if member in reported:
                continue
            report = Evidence.of(member, reporter, lease, how)
            self._client.put(self._keys.gone(n, member, reporter), report.to_value(), lease=lease)
            reported.add(member)
            log.info("member %s of round %d is %s", member, n - 1, _TOLD[report.to_value()])
            if not report.silent:
                dead.append(member)
        return dead

    def read(self, n: int, previous: list[str], leases: dict[str, int],
             kvs: list[KeyValue]) -> list[Evidence]:
        """The credible reports about round ``n - 1`` (``previous``: its members, rank 0
        first; ``leases``: every registered member's lease) among ``kvs``, the keys under
        ``rounds/{n}/gone/`` as the coordinator's watch holds them."""
        reports = []
        for kv in kvs:
            report = Evidence.read(kv.key[len(self._keys.gones(n)):], kv.value, kv.lease)
            if report is not None and report.is_credible(previous, leases):
                reports.append(report)
            else:
                self._skipped.skip(kv.key, kv.mod_revision, "it is not a report (ended, "
                                   "silent or frozen) by a member of the previous round about its rank 0 "
                                   "or by its rank 0")
        return reports
