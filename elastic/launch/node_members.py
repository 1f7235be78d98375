"""What a launcher does for the workers that share its lease (``elastic run --node-lease``).

Such a worker cannot lose its registration by the end of a lease of its own, so its launcher
ends it: it deletes the worker's member key (``drop_member``, with the coordinator key if the
worker held it) when the worker exits, and when the worker's heartbeats (its lease file,
touched once per keepalive interval: ``elastic.cluster.worker_lease_file``) stop for a lease TTL.
Knows the lease files and etcd; nothing of restarts or of what the launcher prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import timedelta

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import drop_member
from elastic.foundation.errors import EtcdUnavailableError
from elastic.launch.launcher_lease_files import LeaseFiles

log = logging.getLogger(__name__)


class NodeMembers:
    """Removes the members that this node's workers registered under the launcher's lease.

    Args:
        client: the launcher's etcd client.
        keys: the job's keys.
        leases: the workers' lease files (where each reports its members and heartbeats).
        lease: the launcher's lease now (the one its workers were given).
        lease_ttl: how long a worker may send no heartbeat before it is removed.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, leases: LeaseFiles,
                 lease: Callable[[], int], lease_ttl: timedelta) -> None:
        self._client = client
        self._keys = keys
        self._leases = leases
        self._lease = lease
        self._ttl_s = lease_ttl.total_seconds()

    def drop(self, pid: int) -> list[str]:
        """Removes the members worker ``pid`` registered under the launcher's lease that are
        still there: what the end of their own lease would do.

        Returns:
            The members removed now.

        Raises:
            EtcdUnavailableError: etcd did not answer.
        """
        lease = self._lease()
        return [m for m in self._leases.node_members(pid)
                if drop_member(self._client, self._keys, m, lease)]

    def forget_finished(self, pid: int) -> None:
        """Worker ``pid`` exited 0: it left the job, or (a script that exits without leaving)
        its members must go now, since the launcher's lease outlives it."""
        try:
            self.drop(pid)
        except EtcdUnavailableError as exc:
            log.warning("could not remove the members of finished worker pid=%d (%s)", pid, exc)

    def drop_silent(self, pids: Iterable[int]) -> list[tuple[int, float, list[str]]]:
        """Removes the members of the live workers ``pids`` whose heartbeats stopped for a
        lease TTL (a stopped or hung process), as their own lease would have expired; once each.

        Returns:
            (pid, seconds without a heartbeat, members removed now) for each worker removed.
        """
        removed = []
        for pid in pids:
            silent_s = self._leases.silent_s(pid)
            if silent_s is None or silent_s <= self._ttl_s:
                continue
            try:
                dropped = self.drop(pid)
            except EtcdUnavailableError as exc:
                log.warning("could not remove the silent worker pid=%d (%s)", pid, exc)
                continue
            self._leases.mark_dropped(pid)
            removed.append((pid, silent_s, dropped))
        return removed
