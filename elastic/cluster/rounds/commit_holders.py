"""Whether another live member holds a member's newest commit: what a stuck member's restart
in place must never throw away.

A member that restarts in place comes back as a new member with none of its state, so it may
do so only when another live member has asked to join a round after the stuck member's own,
with the same commit version or a newer one (a join request carries its member's newest
commit version, and is bound to its lease). Requests of the stuck member's round or earlier
say nothing: their members may be stuck in the same step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.cluster.etcd.client import EtcdClient
    from elastic.cluster.rounds.keys import JobKeys
    from elastic.cluster.rounds.rendezvous import Rendezvous


def other_holder(client: "EtcdClient", keys: "JobKeys", rendezvous: "Rendezvous", me: str,
                 since_round: int, version: int) -> str | None:
    """A live member other than ``me`` that asked to join a round after ``since_round`` with
    commit ``version`` or a newer one (None: there is none).

    Raises:
        EtcdUnavailableError: etcd could not be reached.
        EtcdRecordError: the round counter is not a round number.
    """
    newest = max(rendezvous.latest_round(), since_round)
    members, _ = client.get_prefix(keys.members)
    leases = {kv.key[len(keys.members):]: kv.lease for kv in members}
    for n in range(since_round + 1, newest + 2):
        joins, _ = client.get_prefix(keys.joins(n))
        for kv in joins:
            request = rendezvous.admissible(n, kv, leases)
            if request is not None and request.member_id != me and request.version >= version:
                return request.member_id
    return None
