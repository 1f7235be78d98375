"""An outsider on the training network, without etcd credentials, against a live job.

It knows what the network shows: rank 0's store host:port (here read from etcd by the test, as
a port scan would find it) and the agreement channel's port while a round forms. It must not
obtain the channel's secret, must not get a connection admitted to the channel, and a record it
writes into the round's store must not misdirect or stall the next formation. Real etcd, real
worker processes, gloo on loopback.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic.cluster.etcd.client import EtcdClient
from elastic.cluster.links.admission import CHALLENGE, HELLO, MAGIC, RoundAddress
from elastic.cluster.rounds.keys import JobKeys
from tests.scenarios.test_elastic_recovery import ARGS, check_outcome
from tests.support.harness import Job
from tests.support.polling import poll_until

HOLD = ["--hold-at", "8"]  # the first two hold at step 8 until the joiner is in
_OLD_KEY = "elastic/agreement"  # where the round's store once carried the channel's record
_WAIT = timedelta(seconds=10)


def _store_of(client: EtcdClient, keys: JobKeys, n: int) -> tuple[str, int] | None:
    kv = client.get(keys.store_address(n))
    if kv is None:
        return None
    address = json.loads(kv.value)
    return address["addr"], address["port"]


def _round_store(address: tuple[str, int]) -> dist.TCPStore:
    """The outsider's client of a round's store: the network is all it needs."""
    return dist.TCPStore(address[0], address[1], None, False, timeout=_WAIT,
                         wait_for_workers=False)


class _Impostor:
    """Listens where its planted record points, as a fake rank 0 with a secret of its own."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.record = RoundAddress.draw(*self.listener.getsockname()[:2]).to_json()
        self.callers: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            self.callers.append(f"{peer[0]}:{peer[1]}")
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


def _forged_hello(host: str, port: int, round_: int) -> bytes:
    """Knocks on rank 0's channel with a hello signed by a guessed secret; returns what rank 0
    answered after the hello (empty: it hung up)."""
    try:
        with socket.create_connection((host, port), timeout=_WAIT.total_seconds()) as sock:
            challenge = sock.recv(CHALLENGE.size, socket.MSG_WAITALL)
            if len(challenge) < CHALLENGE.size:
                return b""  # hung up before its challenge
            magic, _ = CHALLENGE.unpack(challenge)
            assert magic == MAGIC
            sock.sendall(HELLO.pack(MAGIC, round_, 1, secrets.token_bytes(16),
                                    secrets.token_bytes(32)))
            return sock.recv(64)
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
        return b""  # not let in, or hung up on, at any point of the exchange


def _plant_while_forming(client: EtcdClient, keys: JobKeys, n: int, impostor: _Impostor,
                         formed: threading.Event, knocks: list[bytes]) -> None:
    """The outsider during round ``n``'s formation: knocks on rank 0's channel as soon as it
    listens (before it hosts the round's store), then writes its record into the round's store
    again and again until the round formed."""
    try:
        _plant(client, keys, n, impostor, formed, knocks)
    except Exception as exc:  # noqa: BLE001 (handed back to the test)
        knocks.append(repr(exc).encode())


def _plant(client: EtcdClient, keys: JobKeys, n: int, impostor: _Impostor,
           formed: threading.Event, knocks: list[bytes]) -> None:
    assert poll_until(lambda: client.get(keys.channel(n)), 60), f"round {n} never formed"
    address = RoundAddress.from_json(client.get(keys.channel(n)).value)  # type: ignore[union-attr]
    knocks.append(_forged_hello(address.host, address.port, n))
    assert poll_until(lambda: _store_of(client, keys, n), 60), f"round {n} hosted no store"
    store = _round_store(_store_of(client, keys, n))  # type: ignore[arg-type]
    while not formed.is_set():
        store.set(_OLD_KEY, impostor.record)


@pytest.mark.timeout(300)
def test_an_outsider_on_the_network_can_neither_read_the_secret_nor_join_nor_misdirect(
        make_job, etcd):
    job: Job = make_job(ARGS + HOLD)
    job.start_together([0, 1])
    for index in (0, 1):
        job.wait_step(index, 8, 120)
    keys = JobKeys(job.env["ELASTIC_JOB_ID"])
    client = EtcdClient(etcd.url)
    impostor = _Impostor()
    try:
        n = int(client.get(keys.round).value)
        outsider = _round_store(_store_of(client, keys, n))  # type: ignore[arg-type]
        if outsider.check([_OLD_KEY]):
            pytest.fail(f"the round store hands the channel's record to anyone: "
                        f"{outsider.get(_OLD_KEY)!r}")
        formed, knocks = threading.Event(), []
        planter = threading.Thread(target=_plant_while_forming, daemon=True,
                                   args=(client, keys, n + 1, impostor, formed, knocks))
        planter.start()
        job.start(2)  # a joiner: the next round forms while the outsider writes
        job.wait_until(lambda: any(e["event"] == "group_formed" and e.get("round", 0) > n
                                   for e in job.events()), 120, "the next round to form")
        formed.set()
        planter.join(30)
        for index in (0, 1, 2):
            assert job.wait_exit(index) == 0, job.tails()
    finally:
        impostor.close()
        client.close()
    check_outcome(job, [0, 1, 2])
    assert not impostor.callers, f"a worker followed the planted record: {impostor.callers}"
    assert knocks and knocks[0] == b"", f"a forged hello was answered: {knocks}"
    rounds = sorted({e["round"] for e in job.events() if e["event"] == "group_formed"})
    assert rounds == [n, n + 1], f"the planted record cost re-formations: rounds {rounds}"
