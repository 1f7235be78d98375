"""A ``torch.distributed.Store`` kept in etcd, one fresh key prefix per round.

Why not TCPStore: its server listens on every interface and lives in one worker, the single host
whose death takes the store with it. Keys here live under ``rounds/{n}/store/``, so a stale worker
of an old round can never read or write the new round's keys. One watch per store keeps a local
cache of the prefix; ``get``/``wait`` block on a condition fed by that watch, never on sleeps.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from elastic.cluster.etcd_client import EtcdClient, WatchEvent

_ADD_ATTEMPTS = 1000


class EtcdStore(dist.Store):
    """A torch.distributed store backed by an etcd key prefix.

    Args:
        client: the etcd client.
        prefix: the key prefix of this store (ends with "/").
        timeout: how long ``get``/``wait`` block for a missing key.
    """

    def __init__(self, client: EtcdClient, prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._timeout = timeout
        self._values: dict[str, bytes] = {}
        self._aborted: str | None = None
        self._changed = threading.Condition()
        kvs, revision = client.get_prefix(prefix)
        for kv in kvs:
            self._values[kv.key[len(prefix):]] = kv.value
        self._cancel_watch = client.watch_prefix(prefix, revision + 1, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._changed:
            for event in events:
                name = event.key[len(self._prefix):]
                if event.kind == "put":
                    self._values[name] = event.value
                else:
                    self._values.pop(name, None)
            self._changed.notify_all()

    def close(self) -> None:
        """Stops the watch (the keys are deleted with the round)."""
        self._cancel_watch()

    def abort(self, reason: str) -> None:
        """Makes every blocked and later ``wait``/``get`` fail at once (the round is broken)."""
        with self._changed:
            self._aborted = reason
            self._changed.notify_all()

    # -- dist.Store -------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._client.put(self._prefix + key, data)
        with self._changed:
            self._values[key] = data
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._changed:
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        for _ in range(_ADD_ATTEMPTS):
            current = self._client.get(self._prefix + key)
            value = (int(current.value) if current else 0) + amount
            if self._client.replace(self._prefix + key, str(value),
                                    current.mod_revision if current else 0):
                with self._changed:
                    self._values[key] = str(value).encode()
                    self._changed.notify_all()
                return value
        raise RuntimeError(f"EtcdStore.add({key!r}) lost {_ADD_ATTEMPTS} races in a row; etcd is "
                           "overloaded or too many workers share this round's store.")

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        expected_b = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired_b = desired.encode() if isinstance(desired, str) else bytes(desired)
        for _ in range(_ADD_ATTEMPTS):
            current = self._client.get(self._prefix + key)
            if current is None and expected_b:
                return expected_b
            if current is not None and current.value != expected_b:
                return current.value
            if self._client.replace(self._prefix + key, desired_b,
                                    current.mod_revision if current else 0):
                return desired_b
        raise RuntimeError(f"EtcdStore.compare_set({key!r}) lost {_ADD_ATTEMPTS} races in a row; "
                           "etcd is overloaded or too many workers share this round's store.")

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        with self._changed:
            while not all(k in self._values for k in keys):
                if self._aborted is not None:
                    raise RuntimeError(f"store {self._prefix} aborted: {self._aborted}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self._values]
                    raise RuntimeError(  # torch expects a plain error from Store.wait
                        f"Timed out after {limit:.1f} s waiting for store keys {missing} "
                        f"under {self._prefix}.")
                self._changed.wait(left)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            self._values.pop(key, None)
        return self._client.delete(self._prefix + key)

    def num_keys(self) -> int:
        with self._changed:
            return len(self._values)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
