"""The round's store against a real etcd: rank 0 hosts a TCPStore, etcd carries its address."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.rounds.keys import JobKeys
from elastic.cluster.links import round_store
from elastic.cluster.links.round_store import RoundStore, StoreTimes

pytestmark = pytest.mark.timeout(120)
WAIT = timedelta(seconds=30)
TIMES = StoreTimes(WAIT, timedelta(seconds=1), timedelta(seconds=0.05))


def gloo_group(store: dist.Store, rank: int, world: int) -> dist.ProcessGroup:
    """A gloo group of its own (not the process's default group), so threads can each form one."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = WAIT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, options)


def test_sixteen_ranks_form_a_real_gloo_group_with_one_etcd_key_for_the_round(client):
    keys, world = JobKeys("round-store-16"), 16

    def rank_main(rank: int) -> float:
        store = RoundStore(client, keys.store_address(1), rank, "127.0.0.1", TIMES)
        store.connect()
        group = gloo_group(store, rank, world)
        tensor = torch.tensor([float(rank)])
        group.allreduce([tensor]).wait()
        return tensor.item()

    with ThreadPoolExecutor(world) as pool:
        sums = list(pool.map(rank_main, range(world), timeout=90))
    assert sums == [float(sum(range(world)))] * world
    kvs, _ = client.get_prefix(keys.round_prefix(1))
    assert [kv.key for kv in kvs] == [keys.store_address(1)]
    published = json.loads(kvs[0].value)
    assert published["addr"] == "127.0.0.1", "rank 0 must publish (and bind) its advertise address"


def connect_until_aborted(store: RoundStore) -> tuple[threading.Thread, threading.Event]:
    """Starts ``store.connect()`` on a thread; the event is set once it failed on the abort."""
    failed = threading.Event()

    def connect() -> None:
        try:
            store.connect()
        except RuntimeError as exc:
            assert "aborted: rank 0 died" in str(exc)
            failed.set()

    waiter = threading.Thread(target=connect, daemon=True)
    waiter.start()
    return waiter, failed


def counted_probes(monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """Released once after each probe the round store makes of rank 0's store."""
    probes, accepts = threading.Semaphore(0), round_store.accepts

    def probe(*args: object) -> bool:
        accepted = accepts(*args)
        probes.release()
        return accepted

    monkeypatch.setattr(round_store, "accepts", probe)
    return probes


def test_an_abort_releases_a_rank_waiting_for_rank_0_at_once(client):
    store = RoundStore(client, JobKeys("round-store-abort").store_address(1), 1, "127.0.0.1",
                       TIMES)
    waiter, failed = connect_until_aborted(store)
    store.abort("rank 0 died")
    assert failed.wait(10)
    waiter.join(10)


def test_an_abort_releases_a_rank_whose_rank_0_froze_while_it_connected_to_its_store(
        client, monkeypatch):
    """Rank 0 published its store, then froze: its kernel still accepts connections, and
    nothing answers them. torch's client waits for that answer without a bound, inside its
    constructor; an abort must end the rank's wait all the same."""
    key = JobKeys("round-store-frozen-host").store_address(1)
    with socket.create_server(("127.0.0.1", 0)) as frozen:  # listens, never accepts
        client.put(key, json.dumps({"addr": "127.0.0.1", "port": frozen.getsockname()[1]}))
        probes = counted_probes(monkeypatch)
        store = RoundStore(client, key, 1, "127.0.0.1", TIMES)
        waiter, failed = connect_until_aborted(store)
        try:
            assert probes.acquire(timeout=10), "the rank never probed rank 0's store"
            store.abort("rank 0 died")
            assert failed.wait(10), "the connect went on after the abort"
        finally:
            store.abort("the test ended")
            waiter.join(WAIT.total_seconds() + 5)


def test_a_rank_whose_rank_0_refuses_pauses_on_the_round_so_an_abort_ends_its_wait_at_once(
        client, monkeypatch):
    """torch's client retries a refused connection for as long as it is given, pausing longer
    and longer in between: given the store's whole timeout for one attempt, only the probe that
    pauses on the round lets an abort end the wait."""
    key = JobKeys("round-store-refused").store_address(1)
    with socket.socket() as closed:  # bound, never listening: every connection is refused
        closed.bind(("127.0.0.1", 0))
        client.put(key, json.dumps({"addr": "127.0.0.1", "port": closed.getsockname()[1]}))
        probes = counted_probes(monkeypatch)
        store = RoundStore(client, key, 1, "127.0.0.1", StoreTimes(WAIT, WAIT, TIMES.pause))
        waiter, failed = connect_until_aborted(store)
        try:
            probed = [probes.acquire(timeout=10) for _ in range(2)]
            assert all(probed), "it never probed twice"
            store.abort("rank 0 died")
            assert failed.wait(10), "the connect went on after the abort"
        finally:
            store.abort("the test ended")
            waiter.join(WAIT.total_seconds() + 5)


def test_a_malformed_store_address_is_an_error_naming_the_key(client):
    key = JobKeys("round-store-hostile").store_address(1)
    client.put(key, b'{"addr": "127.0.0.1; rm -rf /", "port": 1}')
    store = RoundStore(client, key, 1, "127.0.0.1", TIMES)
    with pytest.raises(RuntimeError, match="malformed"):
        store.connect()


class PublishesInTheGap(EtcdClient):
    """A client that runs ``before_watch`` (rank 0 publishing) just before its next watch is
    created: after the waiting rank read the key and found nothing. Its watches bring no events
    at all, as if etcd's resync (which would hand the new watch that publish) never came."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.before_watch = None

    def watch_range(self, keys, start_revision, callback, on_open=None):
        hook, self.before_watch = self.before_watch, None
        if hook is not None:
            hook()
        return super().watch_range(keys, start_revision, lambda events: None, on_open)


def test_an_address_published_between_a_ranks_read_and_its_watch_reaches_it_without_etcd_resync(
        etcd):
    """etcd hands a new watch the events older than its creation only at its next resync
    (every 100 ms); a rank must not wait for that to learn rank 0's address. Here the watch
    never brings the address: the rank learns it only by reading again once etcd created the
    watch, or not at all (``TIMES.wait`` passes and ``connect`` raises)."""
    client = PublishesInTheGap(etcd.url)
    try:
        for n in range(1, 4):
            key = JobKeys("round-store-gap").store_address(n)
            host = RoundStore(client, key, 0, "127.0.0.1", TIMES)
            client.before_watch = host.connect
            joiner = RoundStore(client, key, 1, "127.0.0.1", TIMES)
            joiner.connect()
            joiner.set("reached", b"rank 0's store")
            assert host.get("reached") == b"rank 0's store"
            joiner.close()
            host.close()
    finally:
        client.close()
