"""Hostile connections to the agreement channel's rank 0 while a round forms: one held open in
silence, one that sends garbage, one that replays a valid hello from another round. Each is
turned away, the round forms without waiting for any of them, and only the round's ranks vote. Real
loopback sockets; ranks are threads; the round's store is torch's ``HashStore``."""

from __future__ import annotations

import json
import socket
import struct
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic.cluster.links.admission import HELLO, MAX_PENDING, RoundAddress
from elastic.cluster.links.agreement_channel import AgreementChannel
from elastic.cluster.rounds.records import RecordError

pytestmark = pytest.mark.timeout(60)

_ADDR = "127.0.0.1"
_KEY = "elastic/agreement"
_FORM = timedelta(seconds=30)  # the backstop: a rank 0 that waited for an intruder fails on it
_WAIT = timedelta(seconds=10)


class _Round:
    """Rank 0 and rank 1 of one round, rank 0 connecting in a thread of its own."""

    def __init__(self, round_: int, store: dist.Store | None = None) -> None:
        self.round = round_
        self.store = store or dist.HashStore()
        self.channels = [AgreementChannel(r, 2, _FORM) for r in range(2)]
        self.errors: list[Exception] = []
        self.ended = threading.Event()  # rank 0's connect returned or raised
        self._rank0 = threading.Thread(target=self._connect_rank0, daemon=True)

    def _connect_rank0(self) -> None:
        try:
            self.channels[0].connect(self.store, _ADDR, self.round, _FORM)
        except Exception as exc:  # noqa: BLE001 (handed back to the test)
            self.errors.append(exc)
        finally:
            self.ended.set()

    def open(self) -> tuple[str, int]:
        """Starts rank 0; returns the address it published."""
        self._rank0.start()
        self.store.wait([_KEY], _WAIT)
        address = json.loads(self.store.get(_KEY))
        return address["host"], address["port"]

    def join_rank1(self, store: dist.Store | None = None) -> None:
        self.channels[1].connect(store or self.store, _ADDR, self.round, _FORM)
        self._rank0.join(_FORM.total_seconds())
        assert not self._rank0.is_alive() and not self.errors, self.errors

    def agree(self, rank1_pending: bool) -> list[tuple[bool, bool]]:
        results: list = [None, None]

        def run(rank: int) -> None:
            self.channels[rank].start(rank == 1 and rank1_pending, False)
            results[rank] = self.channels[rank].finish()

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(_WAIT.total_seconds())
        return results

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _is_closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (after the bytes it had sent), within a bounded wait."""
    sock.settimeout(_WAIT.total_seconds())
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_connection_held_open_in_silence_neither_delays_the_round_nor_votes():
    formed = _Round(11)
    try:
        host, port = formed.open()
        # More than rank 0 holds at once: the oldest are let go first, never the newest caller.
        silent = [socket.create_connection((host, port), timeout=10)
                  for _ in range(MAX_PENDING + 2)]
        # They stay open and silent until the round formed: a rank 0 that waited for any of
        # them to speak would wait until the backstop and fail.
        formed.join_rank1()
        for sock in silent:
            sock.sendall(b"\x01\x01")  # too late, and never read: it cannot vote
            assert _is_closed_by_peer(sock)
            sock.close()
        assert formed.agree(rank1_pending=False) == [(False, False)] * 2
    finally:
        formed.close()


def _turned_away_and_the_round_forms(round_: int, sent: bytes) -> None:
    """Connects to a forming round's rank 0, sends ``sent``, asserts the connection is closed
    while the round still waits for rank 1 (so for what it sent, not because the round
    completed), and that the round then forms with only its ranks voting."""
    formed = _Round(round_)
    try:
        host, port = formed.open()
        with socket.create_connection((host, port), timeout=10) as intruder:
            intruder.sendall(sent)
            assert _is_closed_by_peer(intruder)
            assert not formed.ended.is_set(), formed.errors
        formed.join_rank1()
        assert formed.agree(rank1_pending=True) == [(True, False)] * 2
    finally:
        formed.close()


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * HELLO.size,
                                     b"ELA2" + b"\xff" * (HELLO.size - 4)])
def test_a_connection_that_sends_garbage_is_turned_away_at_once(garbage):
    _turned_away_and_the_round_forms(12, garbage)


@pytest.mark.parametrize("forged", ["the hello of earlier releases", "a hello with a guessed mac"])
def test_a_stranger_who_knows_the_round_cannot_take_a_rank(forged):
    hello = struct.pack("!4sQI", b"ELAG", 13, 1) if forged == "the hello of earlier releases" \
        else HELLO.pack(b"ELA2", 13, 1, b"\x00" * 16, b"\x00" * 32)
    _turned_away_and_the_round_forms(13, hello)


class _RecordingStore:
    """The round's store as rank 1 sees it, with rank 0's address replaced by a relay's."""

    def __init__(self, store: dist.Store, relay: tuple[str, int]) -> None:
        self._store = store
        self._relay = relay

    def set(self, key: str, value: bytes | str) -> None:
        self._store.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._store.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        record = json.loads(self._store.get(key))
        record.update(host=self._relay[0], port=self._relay[1])
        return json.dumps(record).encode()


def _relay_recording(target: tuple[str, int], recorded: list[bytes]) -> tuple[str, int]:
    """A one-connection TCP relay to ``target`` that records what its client sends."""
    listener = socket.create_server((_ADDR, 0))

    def pipe(src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(4096):
                if record:
                    recorded.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def serve() -> None:
        client, _ = listener.accept()
        listener.close()
        upstream = socket.create_connection(target, timeout=10)
        threading.Thread(target=pipe, args=(upstream, client, False), daemon=True).start()
        pipe(client, upstream, True)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[:2]


def test_a_valid_hello_replayed_from_another_round_is_turned_away():
    first = _Round(20)
    recorded: list[bytes] = []
    try:
        relay = _relay_recording(first.open(), recorded)
        first.join_rank1(_RecordingStore(first.store, relay))
        assert first.agree(rank1_pending=False) == [(False, False)] * 2
    finally:
        first.close()
    hello = b"".join(recorded)[:HELLO.size]
    assert len(hello) == HELLO.size and struct.unpack_from("!Q", hello, 4)[0] == 20
    _turned_away_and_the_round_forms(21, hello)


@pytest.mark.parametrize("raw", [b'{"host": "127.0.0.1", "port": 1}',
                                 b'{"host": "127.0.0.1", "port": 1, "secret": "zz"}',
                                 b'{"host": "127.0.0.1", "port": 0, "secret": "' + b"ab" * 32
                                 + b'"}', b"\x80\x04K\x01."])
def test_a_malformed_address_record_is_a_record_error(raw):
    with pytest.raises(RecordError):
        RoundAddress.from_json(raw)
