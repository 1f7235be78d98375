"""What a launcher learns of its workers from etcd, and what it does not have to hear."""

from __future__ import annotations

import json
import threading

import pytest

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.launch.joined import JoinedWorkers

pytestmark = pytest.mark.timeout(60)
KEYS = JobKeys("joined-job")
HOST = "node-a"


class HeardClient(EtcdClient):
    """An etcd client that counts the watch events it delivers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heard = 0
        self.arrived = threading.Condition()

    def follow_prefix(self, prefix, callback, on_open=None):
        def counted(events):
            with self.arrived:
                self.heard += len(events)
                self.arrived.notify_all()
            callback(events)
        return super().follow_prefix(prefix, counted, on_open)


def member_record(pid: int, host: str = HOST) -> str:
    return json.dumps({"host": host, "pid": pid})


def test_a_launcher_hears_its_workers_registrations_and_none_of_the_rounds_traffic(etcd):
    client = HeardClient(etcd.url)
    joined = JoinedWorkers(client, KEYS, host=HOST)
    joined.start()
    try:
        for i in range(50):  # a round's worth of join requests of a large job
            client.put(KEYS.join(1, f"other-{i}"), "{}")
        client.put(KEYS.member("other-host-member"), member_record(11, host="node-b"))
        client.put(KEYS.member("mine"), member_record(42))
        with client.arrived:
            assert client.arrived.wait_for(lambda: joined.has_joined(42), 30)
        assert not joined.has_joined(11)
        assert client.heard <= 2
    finally:
        joined.stop()
        client.close()


def test_a_worker_that_wrote_its_done_mark_in_the_newest_round_has_finished(etcd):
    client = HeardClient(etcd.url)
    joined = JoinedWorkers(client, KEYS, host=HOST)
    joined.start()
    try:
        client.put(KEYS.member("done-member"), member_record(7))
        client.put(KEYS.member("busy-member"), member_record(8))
        client.put(KEYS.round, "3")
        client.put(KEYS.done(3, "done-member"), "1")
        client.put(KEYS.done(2, "busy-member"), "1")  # an older round: not the job's end
        with client.arrived:
            assert client.arrived.wait_for(
                lambda: joined.has_joined(7) and joined.has_joined(8), 30)
        assert joined.has_finished(7)
        assert not joined.has_finished(8)
        assert not joined.has_finished(9)  # never registered
    finally:
        joined.stop()
        client.close()
