"""How the members of a round finish together: each records that it returned from the training
function, then waits until every member of the round has returned too or gone, so that no
finisher breaks a peer still in its last collective.

A mixin of ``Rendezvous`` (``rendezvous``), kept apart so that each module stays one concept:
the rendezvous owns joining rounds; this owns leaving the last one. The coordinator says in the
round's news when all finished; a fenced member, which no coordinator can speak for, looks for
itself (one O(N) read). What the finished job leaves on etcd is ``finished_job``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from elastic.cluster.etcd.client import EtcdClient, KeyValue
from elastic.cluster.rounds.coordinator import Coordinator
from elastic.cluster.rounds.join_requests import JoinRequests
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.cluster.rounds.news import RoundNews
from elastic.cluster.rounds.plan import Plan, RendezvousConfig
from elastic.cluster.rounds.topology import Topology

log = logging.getLogger(__name__)


class RoundFinish:
    """Finishing, for ``Rendezvous``, which sets these attributes and reads the news and plans."""

    config: RendezvousConfig
    _client: EtcdClient
    _keys: JobKeys
    _membership: EtcdMembership
    _coordinator: Coordinator
    _requests: JoinRequests
    _changed: threading.Condition
    _epoch: int

    def _news_now(self) -> RoundNews:
        raise NotImplementedError

    def read_plan(self, n: int, stored: KeyValue | None = None) -> Plan | None:
        raise NotImplementedError

    def finish(self, topology: Topology, timeout: timedelta) -> None:
        """Records that this member returned from the training function, then waits until every
        member of the round has either returned too or gone (so that no finisher breaks a peer
        still in its last collective): the coordinator says so in the round's news.
        """
        n = topology.round
        self._coordinator.start()
        self._client.put(self._keys.done(n, self._membership.member_id), b"1")
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            with self._changed:
                epoch = self._epoch
            news = self._news_now()
            if news.round > n or (news.round == n and news.finished):
                return
            if self._membership.fenced.is_set() and not self._waited_for(topology):
                return  # with its lease gone it cannot coordinate: it looks for itself
            with self._changed:
                if self._epoch == epoch:
                    self._changed.wait(timeout=self.config.timeouts.wake.total_seconds())
        log.warning("the members of round %d did not all finish within %s", n, timeout)

    def _waited_for(self, topology: Topology) -> list[str]:
        """The members of the round that neither returned nor left, read from etcd (O(N): only
        for a fenced member, when every lease may be gone and no coordinator can speak)."""
        n = topology.round
        plan = self.read_plan(n)
        dones, _ = self._client.get_prefix(self._keys.dones(n))
        finished = {kv.key[len(self._keys.dones(n)):] for kv in dones}
        _, live = self._requests.read_round(n + 1)
        return [m for m in (plan.ranks if plan else []) if m not in finished and m in live]
