"""The job's fencing epoch in a real etcd: claimed by compare-and-swap, never below the floor."""

from __future__ import annotations

import threading

from elastic.cluster.fencing import claim_fencing_epoch
from elastic.cluster.rounds.keys import JobKeys


def test_an_epoch_below_the_floor_the_checkpoint_url_requires_is_raised_to_the_floor(client):
    key = JobKeys("fence-below").fence
    client.put(key, "2")  # a persistent etcd: a job of the same id claimed it long ago
    assert claim_fencing_epoch(client, key, floor=5) == 5
    assert client.get(key).value == b"5"


def test_an_epoch_at_or_above_the_floor_is_kept(client):
    key = JobKeys("fence-above").fence
    assert claim_fencing_epoch(client, key, floor=3) == 3  # created
    assert claim_fencing_epoch(client, key, floor=2) == 3
    client.put(key, "9")
    assert claim_fencing_epoch(client, key, floor=4) == 9


def test_members_claiming_different_floors_at_once_all_end_on_the_highest(client):
    key = JobKeys("fence-race").fence
    client.put(key, "1")
    start, claimed = threading.Barrier(4), {}

    def claim(floor: int) -> None:
        start.wait(10)
        claimed[floor] = claim_fencing_epoch(client, key, floor)

    threads = [threading.Thread(target=claim, args=(floor,)) for floor in (2, 3, 4, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert client.get(key).value == b"5"
    assert all(claimed[floor] >= floor for floor in claimed) and len(claimed) == 4
