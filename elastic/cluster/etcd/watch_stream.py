"""Watches on one etcd connection: a single Watch stream that every watch of the client shares,
each create naming its own watch id.

aetcd's watcher lets one create be in flight at a time: each waits for etcd's answer before
the next is sent, so a process that opens hundreds of watches opens them one round trip apart,
and a watch opened behind them (the coordinator's) hears nothing until they are done. etcd lets
the client choose each watch's id (``WatchCreateRequest.watch_id``, etcd 3.4 and later): here
every create carries the next id of its stream, any number are in flight together, and each
answer, event and cancellation finds its watch by that id, never by the order of arrival. A
stream error ends every watch on it (each is re-opened by its owner, ``watch``); the next
create opens a new stream.

Used by ``watch`` on the client's loop thread; it must not know about jobs.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aetcd
import aetcd.rpc
import grpc

from elastic.cluster.etcd.channel import client_error
from elastic.cluster.etcd.key_range import KeyRange

# What a watch's queue holds: one answer's events, or why the watch ended.
Item = list[Any] | aetcd.ClientError


class WatchRefused(aetcd.ClientError):
    """etcd cancelled a watch for a reason of its own (permission denied, for one)."""


class WatchStream:
    """The Watch call of one connection, shared by every watch opened on it."""

    def __init__(self, client: aetcd.Client) -> None:
        self.client = client
        self.broken = False
        self._ids = itertools.count(1)
        self._requests: asyncio.Queue[aetcd.rpc.WatchRequest | None] = asyncio.Queue()
        self._created: dict[int, asyncio.Future[int]] = {}
        # Creates not answered yet, in the order sent: etcd answers them in that order, and
        # names a create it refused before making the watch (permission denied) -1.
        self._unanswered: dict[int, None] = {}
        self._queues: dict[int, asyncio.Queue[Item]] = {}
        self._call = aetcd.rpc.WatchStub(client.channel).Watch(self._write(),
                                                               metadata=client.metadata)
        self._reader = asyncio.ensure_future(self._read())

    async def create(self, keys: KeyRange, start_revision: int,
                     timeout_s: float) -> "Watch":
        """Opens a watch of ``keys`` from ``start_revision`` (0: etcd's next revision).

        Raises:
            asyncio.TimeoutError: etcd did not answer within ``timeout_s`` (the create is
                cancelled; an answer that still comes is dropped).
            aetcd.ClientError: the stream broke (or was closed: another create gave up), or
                etcd refused the watch.
        """
        watch_id = next(self._ids)
        created: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._created[watch_id] = created
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[watch_id] = queue
        self._unanswered[watch_id] = None
        self._requests.put_nowait(aetcd.rpc.WatchRequest(
            create_request=aetcd.rpc.WatchCreateRequest(
                key=keys.start.encode(), range_end=keys.end.encode(),
                start_revision=start_revision, watch_id=watch_id)))
        try:
            done, _ = await asyncio.wait({created}, timeout=timeout_s)
        except asyncio.CancelledError:
            self.cancel(watch_id)
            raise
        if not done:
            self.cancel(watch_id)
            raise asyncio.TimeoutError
        try:
            revision = created.result()
        except aetcd.ClientError:
            self.cancel(watch_id)
            raise
        # An end that came already is in its queue.
        return Watch(self, watch_id, queue, start_revision or revision + 1)

    def cancel(self, watch_id: int) -> None:
        """Ends watch ``watch_id``: etcd is asked to cancel it, and its reader is told. A
        watch that ended already (cancelled, ended by etcd, or its stream broke) is left."""
        self._created.pop(watch_id, None)
        queue = self._queues.pop(watch_id, None)
        if queue is None:
            return
        queue.put_nowait(aetcd.ClientError("the watch was cancelled"))
        if not self.broken:
            self._requests.put_nowait(aetcd.rpc.WatchRequest(
                cancel_request=aetcd.rpc.WatchCancelRequest(watch_id=watch_id)))

    def close(self, error: aetcd.ClientError | None = None) -> None:
        """Ends the call; every watch on it fails with ``error`` (default: as transient)."""
        self._call.cancel()
        self._fail(error or aetcd.ConnectionFailedError("the watch stream was closed"))

    async def _write(self) -> Any:
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                self._answer(response)
        except grpc.aio.AioRpcError as exc:
            self._fail(client_error(exc))
        finally:
            self._fail(aetcd.ConnectionFailedError("the watch stream ended"))

    def _answer(self, response: Any) -> None:
        """Hands one of etcd's answers to the watch it names."""
        watch_id = response.watch_id
        if response.created:
            if watch_id not in self._unanswered:
                watch_id = next(iter(self._unanswered), watch_id)
            self._unanswered.pop(watch_id, None)
        queue = self._queues.get(watch_id)
        if queue is None:  # cancelled (its create gave up, and etcd is told so next)
            return
        created = self._created.pop(watch_id, None)
        if response.compact_revision:
            self._end(watch_id, aetcd.RevisionCompactedError(response.compact_revision),
                      created)
        elif response.canceled:
            self._end(watch_id, WatchRefused(response.cancel_reason or "no reason given"),
                      created)
        else:
            if created is not None and not created.done():
                created.set_result(response.header.revision)  # etcd's, as the watch began
            if response.events:
                queue.put_nowait(list(response.events))

    def _end(self, watch_id: int, error: aetcd.ClientError,
             created: asyncio.Future[None] | None) -> None:
        """Ends one watch with ``error``: its create fails, or its reader is told."""
        queue = self._queues.pop(watch_id)
        if created is not None and not created.done():
            created.set_exception(error)
        else:
            queue.put_nowait(error)

    def _fail(self, error: aetcd.ClientError) -> None:
        if not self.broken:
            self.broken = True
            self._requests.put_nowait(None)  # ends the writer, which gRPC runs as a task
        created, self._created = self._created, {}
        queues, self._queues = self._queues, {}
        self._unanswered = {}
        for future in created.values():
            if not future.done():
                future.set_exception(error)
        for queue in queues.values():
            queue.put_nowait(error)


class Watch:
    """One open watch: its events, one answer's worth at a time."""

    def __init__(self, stream: WatchStream, watch_id: int, queue: asyncio.Queue[Item],
                 start_revision: int) -> None:
        self._stream = stream
        self.watch_id = watch_id
        self._queue = queue
        self.start_revision = start_revision  # the first it brings (etcd's next, if asked 0)

    async def next(self) -> list[Any]:
        """The events of etcd's next answer for this watch (in revision order).

        Raises:
            aetcd.ClientError: the watch ended (cancelled, compacted, or its stream broke).
        """
        item = await self._queue.get()
        if isinstance(item, aetcd.ClientError):
            raise item
        return item

    def cancel(self) -> None:
        self._stream.cancel(self.watch_id)
