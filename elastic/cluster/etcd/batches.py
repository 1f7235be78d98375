"""The etcd client's batch writes: many keys put or deleted, many transactions sent together.

A mixin of ``EtcdClient`` (``client``), as ``txn.CompareAndSwap`` is: the client owns the
connection, its retries and single-key reads and writes; this owns splitting a batch into
transactions etcd accepts, halving them for an etcd whose ``--max-txn-ops`` is lower, and
telling which keys were not written because their lease is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import aetcd
import grpc

from elastic.cluster.etcd.channel import status_of

log = logging.getLogger(__name__)
T = TypeVar("T")

# Puts in one transaction: etcd refuses a transaction of more than --max-txn-ops (128 unless
# its operator lowered it: ``put_many`` then halves what it sends).
TXN_PUTS = 100


def _too_many_ops(exc: aetcd.ClientError) -> bool:
    """etcd refused a transaction for holding more operations than its ``--max-txn-ops``."""
    return status_of(exc) == grpc.StatusCode.INVALID_ARGUMENT \
        and "too many operations" in str(exc)


class BatchWrites:
    """Batch writes, for a class that runs operations with ``_call`` and sets ``urls`` and
    ``_txn_puts`` (keys per transaction, at first ``TXN_PUTS``)."""

    urls: str
    _txn_puts: int

    def _call(self, op: Callable[[aetcd.Client], Coroutine[Any, Any, T]], what: str,
              retry_for: timedelta | None = None) -> T:
        raise NotImplementedError

    def put_many(self, entries: Sequence[tuple[str, bytes | str, int]]) -> list[str]:
        """Writes many keys, each bound to its lease: up to ``TXN_PUTS`` to a transaction, the
        transactions sent together. A key whose lease is gone is not written. An etcd that
        takes fewer operations per transaction (``--max-txn-ops``) gets halves of a batch it
        refused, and that size from then on.

        Returns:
            The keys not written because their lease is gone.
        """
        encoded = [(k.encode(), v.encode() if isinstance(v, str) else v, lease)
                   for k, v, lease in entries]
        size = self._txn_puts
        batches = [encoded[i:i + size] for i in range(0, len(encoded), size)]

        async def lease_gone(write: Coroutine[Any, Any, Any]) -> bool:
            try:
                await write
            except aetcd.ClientError as exc:
                if status_of(exc) != grpc.StatusCode.NOT_FOUND:
                    raise
                return True
            return False

        async def write_batch(c: aetcd.Client, batch: list[tuple[bytes, bytes, int]]
                              ) -> list[tuple[bytes, bytes, int]]:
            """Writes ``batch`` in one transaction; returns it whole if a lease was gone."""
            gone = await lease_gone(c.transaction(compare=[], failure=[], success=[
                c.transactions.put(k, v, lease=lease) for k, v, lease in batch]))
            return batch if gone else []

        async def write_all(c: aetcd.Client) -> list[str]:
            refused = await asyncio.gather(*(self._in_halves(c, b, write_batch)
                                             for b in batches))
            # A batch holding a key whose lease is gone wrote nothing: its keys one by one.
            alone = [e for part in refused for e in part]
            gone = await asyncio.gather(*(lease_gone(c.put(k, v, lease=lease))
                                          for k, v, lease in alone))
            return [k.decode() for (k, _, _), g in zip(alone, gone) if g]

        return self._call(write_all, f"put {len(entries)} keys") if entries else []

    def delete_many(self, keys: Sequence[str]) -> None:
        """Deletes many keys: as many to a transaction as ``put_many`` puts (halved the same way
        for an etcd that refuses so many), the transactions sent together."""
        encoded = [k.encode() for k in keys]
        size = self._txn_puts

        async def delete_batch(c: aetcd.Client, batch: list[bytes]) -> list[bytes]:
            await c.transaction(compare=[], failure=[],
                                success=[c.transactions.delete(k) for k in batch])
            return []

        async def delete_all(c: aetcd.Client) -> None:
            await asyncio.gather(*(self._in_halves(c, encoded[i:i + size], delete_batch)
                                   for i in range(0, len(encoded), size)))

        if keys:
            self._call(delete_all, f"delete {len(keys)} keys")

    async def _in_halves(self, c: aetcd.Client, batch: list[Any],
                         send: Callable[[aetcd.Client, list[Any]], Coroutine[Any, Any, list[Any]]]
                         ) -> list[Any]:
        """``send(c, batch)``, one transaction; an etcd that takes fewer operations per
        transaction (``--max-txn-ops``) gets each half instead, and that size from then on.
        Returns what the sends returned, joined."""
        try:
            return await send(c, batch)
        except aetcd.ClientError as exc:
            if not _too_many_ops(exc) or len(batch) == 1:
                raise
            half = (len(batch) + 1) // 2
            self._fit_txn(half, exc)
            halves = await asyncio.gather(self._in_halves(c, batch[:half], send),
                                          self._in_halves(c, batch[half:], send))
            return [e for part in halves for e in part]

    def _fit_txn(self, size: int, exc: aetcd.ClientError) -> None:
        """Puts at most ``size`` keys in each transaction from now on (on the loop thread)."""
        if size >= self._txn_puts:
            return
        if self._txn_puts == TXN_PUTS:
            log.info("etcd at %s refused a transaction of %d puts (%s): its --max-txn-ops is "
                     "lower; writing fewer keys per transaction", self.urls, self._txn_puts, exc)
        self._txn_puts = size
