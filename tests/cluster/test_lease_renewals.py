"""A client's lease renewals (``LeaseRenewals``) against a real etcd: outcomes by lease, removal,
and the member's fencing when a renewal finds its lease gone."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.etcd.lease_renewals import Outcome
from elastic.cluster.rounds.membership import EtcdMembership
from elastic.foundation.timeouts import Timeouts

LEASE_3S = Timeouts.from_env({}, lease_ttl=timedelta(seconds=3), keepalive=timedelta(seconds=0.2))

WAIT_S = 30
INTERVAL = timedelta(seconds=0.1)


class Outcomes:
    """What a lease's handler was handed; it asks for no more renewals once handed 0 (its
    lease gone)."""

    def __init__(self) -> None:
        self.seen: list[Outcome] = []
        self.changed = threading.Condition()

    def __call__(self, outcome: Outcome) -> bool:
        with self.changed:
            self.seen.append(outcome)
            self.changed.notify_all()
        return outcome != 0

    def wait_for(self, count: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.seen) >= count, timeout=WAIT_S)


def test_a_revoked_lease_is_handed_zero_once_and_the_other_leases_of_its_client_go_on(client):
    kept, revoked = client.grant(timedelta(seconds=30)), client.grant(timedelta(seconds=30))
    kept_outcomes, revoked_outcomes = Outcomes(), Outcomes()
    remove = client.renewals.add(kept, INTERVAL, kept_outcomes)
    client.renewals.add(revoked, INTERVAL, revoked_outcomes)
    try:
        assert revoked_outcomes.wait_for(1) and revoked_outcomes.seen[0] > 0
        client.revoke(revoked)
        with revoked_outcomes.changed:
            assert revoked_outcomes.changed.wait_for(lambda: 0 in revoked_outcomes.seen,
                                                     timeout=WAIT_S)
        handed = len(kept_outcomes.seen)
        assert kept_outcomes.wait_for(handed + 5), "the other lease was not renewed on"
        assert revoked_outcomes.seen[-1] == 0 and revoked_outcomes.seen.count(0) == 1
        assert all(isinstance(o, int) and 0 < o <= 30 for o in kept_outcomes.seen)
    finally:
        remove()
        client.revoke(kept)


def test_a_removed_lease_is_handed_nothing_once_its_removal_returned(client):
    removed, other = client.grant(timedelta(seconds=30)), client.grant(timedelta(seconds=30))
    removed_outcomes, other_outcomes = Outcomes(), Outcomes()
    remove = client.renewals.add(removed, INTERVAL, removed_outcomes)
    remove_other = client.renewals.add(other, INTERVAL, other_outcomes)
    try:
        assert removed_outcomes.wait_for(2)
        remove()
        handed = len(removed_outcomes.seen)
        assert other_outcomes.wait_for(len(other_outcomes.seen) + 5)
        assert len(removed_outcomes.seen) == handed
    finally:
        remove_other()
        client.revoke(removed)
        client.revoke(other)


def test_a_member_whose_lease_is_gone_while_its_key_lives_on_is_fenced_by_its_renewal(client):
    keys = JobKeys("renewal-fence")
    member = EtcdMembership(client, keys, "127.0.0.1", LEASE_3S)
    other = EtcdMembership(client, keys, "127.0.0.1", LEASE_3S)
    fenced = threading.Event()
    member.on_fenced(fenced.set)
    member.register()
    other.register()
    elsewhere = client.grant(timedelta(seconds=30))
    try:
        # The key moves to another lease, so revoking the member's own deletes nothing that its
        # watch could see: only the renewal finds that the lease is gone.
        client.put(keys.member(member.member_id), json.dumps({"moved": True}), lease=elsewhere)
        client.revoke(member.lease)
        assert fenced.wait(WAIT_S), "the renewal that found the lease gone fenced nobody"
        assert client.refresh(other.lease) > 0 and not other.fenced.is_set()
    finally:
        member.leave()
        other.leave()
        client.revoke(elsewhere)
