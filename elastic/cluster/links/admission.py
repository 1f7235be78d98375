"""Who may join a round's agreement channel: a per-round secret, a challenge, a hello, a welcome.

Rank 0 draws a secret for its round and publishes it with its address in etcd
(``rounds/{n}/store/channel``, readable only by whoever can read the job's prefix; never in the
round's TCPStore, which is unauthenticated). Rank 0
challenges every connection with a fresh nonce; a rank answers with an HMAC of the round, its
rank and both nonces under the secret, and rank 0 answers that with an HMAC of its own, so the
rank knows it reached rank 0 of its round. A hello from another round or a replayed one (the
nonces differ), garbage, and silence are all turned away without holding the round up: rank 0
reads every connection without blocking, and closes the unproven ones once the round is
complete. No torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from elastic.cluster.rounds import records
from elastic.cluster.rounds.records import RecordError

log = logging.getLogger(__name__)

MAGIC = b"ELA2"
CHALLENGE = struct.Struct("!4s16s")  # magic, rank 0's nonce
HELLO = struct.Struct("!4sQI16s32s")  # magic, round, rank, the rank's nonce, its HMAC
WELCOME_BYTES = 32  # rank 0's HMAC
MAX_PENDING = 64  # unproven connections held at once; the oldest goes first
_SECRET_BYTES = 32


class AddressBook(Protocol):
    """Where rank 0 publishes the channel's record (address and secret) and the others find it:
    a place that only the round's members can read and write (``ChannelBook``)."""

    def publish(self, record: str) -> None: ...

    def find(self, timeout: timedelta) -> bytes: ...


@dataclass(frozen=True)
class RoundAddress:
    """Where rank 0 of a round listens, and the round's secret (the record in etcd)."""

    host: str
    port: int
    secret: bytes

    @staticmethod
    def draw(host: str, port: int) -> "RoundAddress":
        """A fresh secret for a round whose rank 0 listens on ``host:port``."""
        return RoundAddress(host, port, secrets.token_bytes(_SECRET_BYTES))

    def to_json(self) -> str:
        return json.dumps({"host": self.host, "port": self.port, "secret": self.secret.hex()})

    @staticmethod
    def from_json(raw: bytes) -> "RoundAddress":
        """Reads the record rank 0 published.

        Raises:
            RecordError: a field is missing, unknown, of the wrong type or out of range.
        """
        data = records.load_object(raw, {"host": True, "port": True, "secret": True})
        secret = data["secret"]
        if type(secret) is not str or len(secret) != 2 * _SECRET_BYTES:
            raise RecordError(f"the secret is not {_SECRET_BYTES} bytes in hex")
        try:
            key = bytes.fromhex(secret)
        except ValueError:
            raise RecordError("the secret is not hex") from None
        return RoundAddress(records.address("host", data["host"]),
                            records.integer("port", data["port"], 1, 65535), key)


def _mac(secret: bytes, label: bytes, round_: int, rank: int, nonces: bytes) -> bytes:
    message = label + struct.pack("!QI", round_, rank) + nonces
    return hmac.new(secret, message, hashlib.sha256).digest()


def introduce(sock: socket.socket, address: RoundAddress, round_: int, rank: int) -> None:
    """A rank's side of the handshake on a connected socket (its timeout bounds each read).

    Raises:
        ConnectionError: the peer is not rank 0 of this round (or closed the connection).
        OSError: the connection failed or timed out.
    """
    magic, theirs = CHALLENGE.unpack(_read(sock, CHALLENGE.size))
    if magic != MAGIC:
        raise ConnectionError(f"{address.host}:{address.port} is not an agreement channel")
    mine = secrets.token_bytes(16)
    nonces = theirs + mine
    mac = _mac(address.secret, b"hello", round_, rank, nonces)
    sock.sendall(HELLO.pack(MAGIC, round_, rank, mine, mac))
    welcome = _read(sock, WELCOME_BYTES)
    if not hmac.compare_digest(welcome, _mac(address.secret, b"welcome", round_, rank, nonces)):
        raise ConnectionError(f"{address.host}:{address.port} did not prove that it is rank 0 "
                              f"of round {round_}")


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection was closed during the handshake")
        data += chunk
    return data


class _Caller:
    """One connection rank 0 has not admitted yet."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.nonce = secrets.token_bytes(16)
        self.received = b""


class Admission:
    """Rank 0's door: admits the ranks of one round, each once, and nobody else.

    Args:
        listener: the listening socket (non-blocking use; closed by the caller).
        address: the published address and secret.
        round_: the round.
        world_size: the round's size (ranks 1 .. world_size - 1 are awaited).
    """

    def __init__(self, listener: socket.socket, address: RoundAddress, round_: int,
                 world_size: int) -> None:
        self._listener = listener
        self._address = address
        self._round = round_
        self._world_size = world_size
        self._lock = threading.Lock()  # guards _aborted; the rest is the running thread's
        self._aborted: str | None = None
        self._callers: dict[socket.socket, _Caller] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self.admitted: dict[int, socket.socket] = {}

    def run(self, deadline: float) -> dict[int, socket.socket]:
        """Admits every other rank of the round; returns their sockets by rank.

        Raises:
            TimeoutError: a rank was not admitted by ``deadline`` (``time.monotonic()``).
            OSError: the admission was aborted, or the listener failed.
        """
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while len(self.admitted) < self._world_size - 1:
                self._check_aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self._world_size)) - set(self.admitted))
                    raise TimeoutError(f"ranks {missing} did not join the agreement channel")
                for key, _ in selector.select(left):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    elif key.fileobj in self._callers:  # not turned away earlier in this batch
                        self._hear(selector, self._callers[key.fileobj])  # type: ignore[index]
            return dict(self.admitted)
        finally:
            selector.close()
            self._close_callers()
            if len(self.admitted) < self._world_size - 1:  # failed: nobody keeps these
                for sock in self.admitted.values():
                    sock.close()

    def abort(self, reason: str) -> None:
        """Ends ``run`` at once (from any thread); idempotent."""
        with self._lock:
            if self._aborted is None:
                self._aborted = reason
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass  # closed: the run has ended

    def close(self) -> None:
        """Closes the wake-up pair (after ``run``)."""
        self._close_callers()
        self._wake_r.close()
        self._wake_w.close()

    def _check_aborted(self) -> None:
        with self._lock:
            if self._aborted is not None:
                raise OSError(f"the admission was aborted: {self._aborted}")

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        caller = _Caller(sock)
        try:
            sock.send(CHALLENGE.pack(MAGIC, caller.nonce))  # fits an empty send buffer
        except OSError:
            sock.close()
            return
        if len(self._callers) >= MAX_PENDING:
            oldest = next(iter(self._callers.values()))
            self._turn_away(selector, oldest, "too many unproven connections are held open")
        self._callers[sock] = caller
        selector.register(sock, selectors.EVENT_READ)

    def _hear(self, selector: selectors.BaseSelector, caller: _Caller) -> None:
        try:
            chunk = caller.sock.recv(HELLO.size - len(caller.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._turn_away(selector, caller, f"the connection failed ({exc})")
            return
        caller.received += chunk
        if not chunk:
            self._turn_away(selector, caller, "it closed before its hello")
        elif not caller.received.startswith(MAGIC[:len(caller.received)]):
            self._turn_away(selector, caller, "it sent something other than a hello")
        elif len(caller.received) == HELLO.size:
            self._vet(selector, caller)

    def _vet(self, selector: selectors.BaseSelector, caller: _Caller) -> None:
        _, round_, rank, theirs, mac = HELLO.unpack(caller.received)
        nonces = caller.nonce + theirs
        expected = _mac(self._address.secret, b"hello", round_, rank, nonces)
        if not hmac.compare_digest(mac, expected) or round_ != self._round:
            self._turn_away(selector, caller, f"its hello (round {round_}, rank {rank}) is not "
                                              f"signed with round {self._round}'s secret")
            return
        if not 0 < rank < self._world_size or rank in self.admitted:
            self._turn_away(selector, caller, f"rank {rank} is not awaited")
            return
        welcome = _mac(self._address.secret, b"welcome", round_, rank, nonces)
        try:
            if caller.sock.send(welcome) != len(welcome):
                raise BlockingIOError("the welcome did not fit the send buffer")
        except OSError as exc:
            self._turn_away(selector, caller, f"the welcome failed ({exc})")
            return
        selector.unregister(caller.sock)
        del self._callers[caller.sock]
        caller.sock.setblocking(True)
        self.admitted[rank] = caller.sock

    def _turn_away(self, selector: selectors.BaseSelector, caller: _Caller, why: str) -> None:
        log.warning("agreement channel of round %d: turned away a connection from %s: %s",
                    self._round, _peer(caller.sock), why)
        try:
            selector.unregister(caller.sock)
        except (KeyError, ValueError):
            pass  # not registered yet
        self._callers.pop(caller.sock, None)
        caller.sock.close()

    def _close_callers(self) -> None:
        callers, self._callers = list(self._callers.values()), {}
        for caller in callers:
            caller.sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed connection"
