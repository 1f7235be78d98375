"""A round's torch.distributed store: a TCPStore hosted by the round's rank 0, found through etcd.

Forming a group of N ranks writes O(N) keys (each rank its address) and reads O(N) keys per rank
(gloo's full mesh); kept in etcd, every write would also reach every rank's watch (O(N^2)
events), and every ``add`` would be a compare-and-swap race between all ranks. Here rank 0 of
the round hosts a ``TCPStore`` on a socket bound to its advertise address only (never every
interface), and etcd carries one key per round: that store's address, written once by rank 0,
read once (by watch) by every other rank. A stale worker of an old round cannot reach the new
store: its address is published only under the new round's keys, once it listens.

This module owns that store and its life: ``connect`` (host or join), ``abort`` (any thread:
every blocked and later wait fails at once, so a group still forming is released), ``close``;
and ``reach``, a probe that a round's rank 0 can be reached from this machine. It must not
decide when to abort (``RoundLinks`` does).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from elastic.cluster.rounds import records
from elastic.cluster.etcd.client import EtcdClient, WatchEvent
from elastic.cluster.links.ports import accepts, answers
from elastic.cluster.rounds.records import RecordError

_ADDRESS_FIELDS = {"addr": True, "port": True}
T = TypeVar("T")


def reach(client: EtcdClient, address_key: str, timeout: timedelta) -> None:
    """Connects to the round's store published at ``address_key`` and hangs up at once (the
    store serves no one it has not heard from); returns at once when nothing valid is published
    there (no round is running: nothing to reach).

    Raises:
        OSError: the store's machine does not answer within ``timeout``.
    """
    kv = client.get(address_key)
    if kv is None:
        return
    try:
        data = records.load_object(kv.value, _ADDRESS_FIELDS)
        address = (records.address("addr", data["addr"]),
                   records.integer("port", data["port"], 1, 65535))
    except RecordError:
        return  # not a store's address: the round's own members will find that out
    if not answers(*address, timeout.total_seconds()):
        raise OSError(f"{address[0]}:{address[1]} does not answer within {timeout}")


@dataclass(frozen=True)
class StoreTimes:
    """How long a round's store waits.

    Args:
        wait: how long ``connect``, ``get`` and ``wait`` block.
        attempt: how long one probe of rank 0's store, and one try of torch's client to connect
            to it, may take.
        pause: how long to wait before probing again a store that refused (the round's abort
            ends the wait).
    """

    wait: timedelta
    attempt: timedelta
    pause: timedelta


class RoundStore(dist.Store):
    """A ``dist.Store`` over the round's TCPStore; rank 0 hosts it.

    Args:
        client: the etcd client (used for the address key only).
        address_key: the etcd key of the store's address in this round.
        rank: this worker's rank in the round (0 hosts).
        advertise_addr: the address rank 0 binds and publishes.
        times: how long it waits for what (``StoreTimes``).
    """

    def __init__(self, client: EtcdClient, address_key: str, rank: int, advertise_addr: str,
                 times: StoreTimes) -> None:
        super().__init__()
        self._client = client
        self._key = address_key
        self._rank = rank
        self._advertise_addr = advertise_addr
        self._times = times
        self._inner: dist.TCPStore | None = None
        self._aborted: str | None = None
        self._changed = threading.Condition()
        self._published: bytes | None = None
        self._opens = 0  # how many times etcd created this rank's watch of the address
        self._cancel_watch: Callable[[], None] | None = None

    # -- life ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Hosts the store (rank 0) or connects to it (the others).

        Raises:
            RuntimeError: aborted, or rank 0's address did not appear within the timeout
                (torch reports store failures as plain errors, and the run loop treats a
                ``RuntimeError`` while forming as a peer failure).
        """
        if self._rank == 0:
            self._host()
        else:
            self._join(*self._await_address())

    def _join(self, addr: str, port: int) -> None:
        """Connects to rank 0's store once a probe finds it accepting; a probe that is refused
        pauses ``pause`` on the round's condition, which an abort ends at once.

        torch's client cannot be interrupted: it retries a refused or reset connection inside
        its constructor, pausing longer and longer, and it waits without a bound for the answer
        of a rank 0 that accepts but never answers (frozen, or hung). So the constructor runs on
        a helper thread (``_abortable``), which an abort or the deadline leaves behind.
        """
        deadline = time.monotonic() + self._times.wait.total_seconds()
        failure = "nothing accepted the connection"
        while (left := deadline - time.monotonic()) > 0:
            self._check_aborted()
            attempt = min(self._times.attempt, timedelta(seconds=left))
            if not accepts(addr, port, attempt.total_seconds()):
                self._pause_unless_aborted(min(self._times.pause, attempt))
                continue
            try:
                built = self._abortable(
                    lambda attempt=attempt: dist.TCPStore(addr, port, None, False,
                                                          timeout=attempt,
                                                          wait_for_workers=False),
                    "elastic-store-connect", deadline,
                    f"{addr}:{port} accepted the connection but never answered")
            except RuntimeError as exc:  # torch's DistNetworkError and DistStoreError, or
                failure = str(exc)  # aborted (raised again at the top) or late (the loop ends)
                continue
            built.set_timeout(self._times.wait)
            self._inner = built
            self._check_aborted()
            return
        raise RuntimeError(f"rank 0's store at {addr}:{port} did not answer within "
                           f"{self._times.wait.total_seconds():.1f} s ({failure}): check that "
                           f"this machine reaches rank 0's --advertise-addr on any port, or "
                           f"raise ELASTIC_STORE_TIMEOUT")

    def _pause_unless_aborted(self, pause: timedelta) -> None:
        with self._changed:
            if self._aborted is None:
                self._changed.wait(pause.total_seconds())

    def _abortable(self, call: Callable[[], T], name: str, deadline: float, late: str) -> T:
        """``call()``, a blocking call into torch's store (which has no abort of its own), on a
        helper thread named ``name``, while this thread waits on the condition that ``abort``
        notifies; an abort or the ``deadline`` leaves the helper behind, to end on its own.

        Raises:
            RuntimeError: aborted; ``late`` once ``deadline`` passed; or ``call``'s own error.
        """
        outcome: list[tuple[T | None, RuntimeError | None]] = []

        def run() -> None:
            try:
                done: tuple[T | None, RuntimeError | None] = (call(), None)
            except RuntimeError as exc:  # torch's timeout and connection errors
                done = (None, exc)
            with self._changed:
                outcome.append(done)
                self._changed.notify_all()

        threading.Thread(target=run, name=name, daemon=True).start()
        with self._changed:
            while not outcome:
                self._check_aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(late)
                self._changed.wait(left)
        value, error = outcome[0]
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def _host(self) -> None:
        listener = socket.socket(socket.AF_INET6 if ":" in self._advertise_addr
                                 else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((self._advertise_addr, 0))
            listener.listen(1024)
            port = listener.getsockname()[1]
            # The store takes the socket over (and closes it): bound to one address only.
            self._inner = dist.TCPStore(self._advertise_addr, port, None, True,
                                        timeout=self._times.wait, wait_for_workers=False,
                                        master_listen_fd=listener.detach())
        finally:
            listener.close()
        self._client.put(self._key, json.dumps({"addr": self._advertise_addr, "port": port}))

    def _await_address(self) -> tuple[str, int]:
        """Rank 0's published address: one read, then a watch on that key alone, and one more
        read once etcd created the watch (an address published between the first read and
        the watch's creation would reach the watch only at etcd's next resync, 100 ms)."""
        self._cancel_watch = self._client.follow_prefix(self._key, self._on_events,
                                                        self._on_open)
        limit = self._times.wait.total_seconds()
        deadline = time.monotonic() + limit
        read_at = 0  # the watch's creations that a read followed
        try:
            while (raw := self._wait_published(deadline, read_at)) is None:
                with self._changed:
                    read_at = self._opens
                kv = self._client.get(self._key)
                if kv is not None:
                    self._on_events([WatchEvent("put", kv.key, kv.value, kv.mod_revision)])
        finally:
            self._stop_watch()
        try:
            data = records.load_object(raw, _ADDRESS_FIELDS)
            return (records.address("addr", data["addr"]),
                    records.integer("port", data["port"], 1, 65535))
        except RecordError as exc:
            raise RuntimeError(f"the round's store address at {self._key} is malformed "
                               f"({exc}); something other than this job wrote it") from None

    def _wait_published(self, deadline: float, read_at: int) -> bytes | None:
        """The address once published; None as soon as etcd created the watch again since
        the last read (``read_at``), so that the caller reads once more.

        Raises:
            RuntimeError: aborted, or nothing was published by ``deadline``.
        """
        with self._changed:
            while self._published is None and self._opens == read_at:
                self._check_aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"rank 0 did not publish the round's store at "
                                       f"{self._key} within "
                                       f"{self._times.wait.total_seconds():.1f} s; if rank 0 "
                                       f"is slow to get there, raise ELASTIC_STORE_TIMEOUT")
                self._changed.wait(left)
            return self._published

    def _on_open(self) -> None:
        with self._changed:
            self._opens += 1
            self._changed.notify_all()

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._changed:
            for event in events:
                if event.key == self._key and event.kind == "put":
                    self._published = event.value
            self._changed.notify_all()

    def _stop_watch(self) -> None:
        cancel, self._cancel_watch = self._cancel_watch, None
        if cancel is not None:
            cancel()

    def abort(self, reason: str) -> None:
        """Makes every blocked and later ``connect``/``wait``/``get`` fail at once."""
        with self._changed:
            self._aborted = reason
            self._changed.notify_all()

    def close(self) -> None:
        """Drops this worker's end of the store (rank 0's server goes with its last user)."""
        self._stop_watch()
        self._inner = None

    def _check_aborted(self) -> None:
        if self._aborted is not None:
            raise RuntimeError(f"the round's store was aborted: {self._aborted}")

    def _store(self) -> dist.TCPStore:
        self._check_aborted()
        if self._inner is None:
            raise RuntimeError("the round's store is not connected (call connect() first)")
        return self._inner

    # -- dist.Store ---------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._store().get(key)

    def add(self, key: str, amount: int) -> int:
        return self._store().add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._store().compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._store().check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Waits for ``keys``; an ``abort`` from another thread ends the wait at once.

        A missing key is awaited by a helper thread blocked in the TCPStore (which has no
        abort of its own), while this thread waits on a condition that ``abort`` notifies.
        """
        store = self._store()
        if store.check(keys):
            return
        limit = timeout or self._times.wait
        self._abortable(lambda: store.wait(keys, limit), "elastic-store-wait",
                        time.monotonic() + limit.total_seconds() + 1,
                        f"timed out after {limit} waiting for store keys {keys}")

    def delete_key(self, key: str) -> bool:
        return self._store().delete_key(key)

    def num_keys(self) -> int:
        return self._store().num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._times = replace(self._times, wait=timeout)
        if self._inner is not None:
            self._inner.set_timeout(timeout)
