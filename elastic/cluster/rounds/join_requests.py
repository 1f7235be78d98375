"""The join requests of one round, read from etcd: which are admissible, and whether enough
arrived in time.

Owns reading a round's join requests with the live members' leases, refusing a request not
written under its member's lease (``SkippedRecords``, once each), and the two deadlines of a
waiting member (min_workers within ``rendezvous``; a round formed within ``admit``). Writes
nothing; ``Rendezvous`` asks, and the coordinator asks through it.
"""

from __future__ import annotations

from elastic.cluster.etcd.client import EtcdClient, KeyValue
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.rounds.plan import JoinRequest, RendezvousConfig
from elastic.cluster.rounds.records import SkippedRecords
from elastic.foundation.errors import RendezvousTimeoutError


class JoinRequests:
    """Reads and judges the join requests of a job's rounds.

    Args:
        client: the etcd client.
        keys: the job's keys.
        skipped: where malformed join requests are reported (once each).
        config: the job's limits (min_workers, the rendezvous and admit timeouts).
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, skipped: SkippedRecords,
                 config: RendezvousConfig) -> None:
        self._client = client
        self._keys = keys
        self._skipped = skipped
        self.config = config

    def read_round(self, n: int) -> tuple[list[JoinRequest], set[str]]:
        """The round's admissible join requests and the live members' ids.

        The joins are read first: a member registers before it joins, so the member key of a
        live joiner is in the later read.
        """
        joins, _ = self._client.get_prefix(self._keys.joins(n))
        members, _ = self._client.get_prefix(self._keys.members)
        leases = {kv.key[len(self._keys.members):]: kv.lease for kv in members}
        requests = [r for r in (self.admissible(n, kv, leases) for kv in joins) if r is not None]
        return requests, set(leases)

    def admissible(self, n: int, kv: KeyValue, leases: dict[str, int]) -> JoinRequest | None:
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

    def check_limits(self, n: int, started: float, enough_since: float,
                      now: float) -> float:
        """Raises when a deadline passed; returns when the round last had min_workers.

        Only past the rendezvous timeout does it read the round's join requests (one read per
        wake), so a waiting member reads no other member's records while rounds form in time.
        """
        timeout_s = self.config.timeouts.rendezvous.total_seconds()
        if now - enough_since > timeout_s:
            requests, _ = self.read_round(n)
            if len(requests) >= self.config.min_workers:
                return now
            raise RendezvousTimeoutError(
                f"Round {n}: only {len(requests)} of min_workers={self.config.min_workers} "
                f"worker(s) joined within {timeout_s:.0f} s. Start more workers, or lower "
                "--min-workers / ELASTIC_MIN_WORKERS.")
        if now - started > self.config.timeouts.admit.total_seconds():
            raise RendezvousTimeoutError(
                f"Round {n} did not form within {self.config.timeouts.admit}: the running members "
                "admit new workers only at state.commit() or state.check_membership().")
        return enough_since
