"""Lease renewals on one etcd connection: a single LeaseKeepAlive stream that every lease of the
client shares, as etcd's own Go client does.

aetcd opens a new gRPC stream for every renewal: stream set-up costs etcd and the client more
than the renewal itself, and a job renews each worker's lease several times per TTL. Here one
stream per connection carries every renewal; replies are matched to requests by lease id, in
order (etcd answers each request once, in the order received). A renewal not answered within
the RPC timeout closes the stream (it is suspect), so does a stream error; the renewals waiting
on it fail as transient errors and the next renewal opens a new stream.

Used by ``client`` (which sets gRPC's environment before anything imports it) on its loop
thread; it must not know about jobs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import aetcd
import aetcd.rpc
import grpc

from elastic.cluster.etcd.channel import client_error


class KeepAlives:
    """The lease renewals of one client, on one stream per connection."""

    def __init__(self) -> None:
        self._stream: _Stream | None = None

    async def renew(self, client: aetcd.Client, leases: list[int],
                    timeout_s: float) -> dict[int, int]:
        """Renews each of ``leases`` once on ``client``'s stream, the requests sent together;
        returns each one's remaining TTL in seconds (0 when etcd no longer has it).

        Raises:
            aetcd.ConnectionTimeoutError: a reply did not come within ``timeout_s`` (the stream
                is closed).
            aetcd.ClientError: the stream broke (mapped from its gRPC status); the renewals
                share it, so one's error is every one's.
        """
        stream = self._stream
        if stream is None or stream.client is not client or stream.broken:
            if stream is not None:
                stream.close()
            stream = self._stream = _Stream(client)
        replies = [stream.ask(lease) for lease in leases]
        try:
            _, pending = await asyncio.wait(replies, timeout=timeout_s)
        except asyncio.CancelledError:
            for reply in replies:
                reply.cancel()  # its answer, when it comes, is dropped
            raise
        if pending:
            for reply in replies:
                reply.cancel()
            stream.close()
            raise aetcd.ConnectionTimeoutError(
                f"no lease keepalive reply within {timeout_s:g} s; the stream is re-opened")
        for reply in replies:
            if reply.cancelled():
                raise aetcd.ConnectionFailedError("a lease renewal was cancelled")
            if (error := reply.exception()) is not None:
                raise error
        return {lease: reply.result() for lease, reply in zip(leases, replies)}

    def close(self) -> None:
        """Closes the stream; renewals waiting on it fail."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None


class _Stream:
    """One LeaseKeepAlive call: requests written from a queue, replies read by a task."""

    def __init__(self, client: aetcd.Client) -> None:
        self.client = client
        self.broken = False
        self._requests: asyncio.Queue[int | None] = asyncio.Queue()  # None: no more
        self._waiting: dict[int, deque[asyncio.Future[int]]] = {}
        self._call = client.leasestub.LeaseKeepAlive(self._write(), metadata=client.metadata)
        self._reader = asyncio.ensure_future(self._read())

    def ask(self, lease: int) -> asyncio.Future[int]:
        """Sends one renewal of ``lease``; the future gets its remaining TTL."""
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(lease, deque()).append(reply)
        self._requests.put_nowait(lease)
        return reply

    async def _write(self) -> AsyncIterator[aetcd.rpc.LeaseKeepAliveRequest]:
        while (lease := await self._requests.get()) is not None:
            yield aetcd.rpc.LeaseKeepAliveRequest(ID=lease)

    async def _read(self) -> None:
        try:
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                waiting = self._waiting.get(reply.ID)
                if not waiting:
                    continue  # not asked on this stream: nobody waits for it
                future = waiting.popleft()
                if not waiting:
                    del self._waiting[reply.ID]
                if not future.done():  # done: its caller gave up waiting
                    future.set_result(max(0, int(reply.TTL)))
        except grpc.aio.AioRpcError as exc:
            self._fail(client_error(exc))
        finally:
            self._fail(aetcd.ConnectionFailedError("the lease keepalive stream ended"))

    def close(self) -> None:
        """Cancels the call; every renewal still waiting fails as transient."""
        self._call.cancel()
        self._fail(aetcd.ConnectionFailedError("the lease keepalive stream was closed"))

    def _fail(self, error: aetcd.ClientError) -> None:
        if not self.broken:
            self.broken = True
            self._requests.put_nowait(None)  # ends the writer, which gRPC runs as a task
        waiting, self._waiting = self._waiting, {}
        for futures in waiting.values():
            for future in futures:
                if not future.done():
                    future.set_exception(error)
