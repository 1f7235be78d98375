"""The job's fencing epoch in a real etcd: claimed by compare-and-swap, never below the floor."""

from __future__ import annotations

import threading

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.fencing import claim_fencing_epoch
from elastic.cluster.rounds.keys import JobKeys
from elastic.foundation.errors import ElasticError, EtcdRecordError


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


class _RivalWriter(EtcdClient):
    """A real client of the same etcd whose every compare-and-swap loses: a stray writer puts
    the fence key just before it (what a foreign process writing the key does)."""

    def replace(self, key, value, mod_revision, **kwargs):  # type: ignore[override]
        self.put(key, "1")
        return super().replace(key, value, mod_revision, **kwargs)


def test_a_claim_that_loses_every_race_raises_a_contested_error_naming_the_fix(etcd):
    rival = _RivalWriter(etcd.url)
    try:
        with pytest.raises(ElasticError) as raised:
            claim_fencing_epoch(rival, JobKeys("fence-contested").fence, floor=5)
    finally:
        rival.close()
    assert type(raised.value).__name__ == "FencingContestedError"
    assert isinstance(raised.value, EtcdRecordError)  # callers catching that still catch it
    assert "--job-id" in str(raised.value)
