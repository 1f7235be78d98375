"""Members that lost their leases all at once, against a real etcd: they register again as new
members, and their next round waits for all of them instead of closing with the first.

etcd revokes every lease when a leader that stalled through a quorum loss wakes (etcd issue
15247, ``tests/scenarios/test_etcd_members.py``); here the leases are revoked by hand, and the
members register again one after the other, in a known order.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic.cluster.rounds.keys import JobKeys
from tests.cluster.test_scale_protocol import WAIT_S, Member, form_all
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(120)


def watch_verdicts(member: Member, round_: int, seen: list[tuple[int, bool]]) -> None:
    """Records, should ``member`` lead, each verdict on ``round_``: how many requests it weighed
    and whether the round could close."""
    verdict = member.rendezvous.verdict

    def recorded(n, requests, *args):  # noqa: ANN001, ANN202
        cut = verdict(n, requests, *args)
        if n == round_:
            seen.append((len(requests), cut is not None))
        return cut

    member.rendezvous.verdict = recorded


def test_members_that_all_lost_their_leases_re_form_once_together_not_the_first_alone(client):
    job = "lost-leases"
    old = [Member(client, job) for _ in range(3)]
    heirs: list[Member] = []
    verdicts: list[tuple[int, bool]] = []
    done = threading.Event()  # ends the joins still waiting when the test ends
    pool = ThreadPoolExecutor(3)
    try:
        [first_round] = {t.round for t in form_all(old, "start")}
        for member in old:
            client.revoke(member.membership.lease)
        asked = []
        for i in range(1, 4):  # each registers again once the round was weighed without it
            heir = Member(client, job)
            heirs.append(heir)
            watch_verdicts(heir, first_round + 1, verdicts)
            asked.append(pool.submit(heir.rendezvous.join, "start", 0, 29500, done.is_set,
                                     came_from=(first_round, 3)))
            assert poll_until(lambda n=i: any(k == n for k, _ in verdicts), WAIT_S), verdicts
            closes = [could for k, could in verdicts if k == i]
            assert closes[-1] == (i == 3), f"round {first_round + 1} could close with {i} of " \
                f"the 3 members that lost their leases: {verdicts}"
        topologies = [a.result(timeout=WAIT_S) for a in asked]
        assert {(t.round, t.world_size) for t in topologies} == {(first_round + 1, 3)}
    finally:
        done.set()
        pool.shutdown(wait=True)
        for member in old + heirs:
            member.leave()
