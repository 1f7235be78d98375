"""Watches on one etcd connection: each re-opened after errors from the last revision it saw.

Every watch of a client is on the connection's one Watch stream (``watch_stream``), its
create naming its own id, so creates do not wait for each other. A create that is not answered
within the RPC timeout (etcd is frozen, or the connection is half dead) drops the whole
connection: every watch on it is re-opened, from the last revision it saw, on a fresh one. A
watch that re-opens on an etcd whose revision went back (it lost its data) starts from that
etcd's beginning. An open watch costs the loop one task (its ``forever``): its ``Stop`` and a
dropped connection end it directly, with nothing else waiting on it.

Used by ``client`` (which sets gRPC's environment before anything imports it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aetcd

from elastic.cluster.etcd.channel import TRANSIENT, cancelled_by_caller
from elastic.cluster.etcd.values import WatchEvent, deliver
from elastic.cluster.etcd.watch_stream import Watch, WatchRefused, WatchStream
from elastic.cluster.etcd.key_range import KeyRange
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)
T = TypeVar("T")


class Watches:
    """Opens and keeps the watches of one client.

    Args:
        connected: the client's current connection (connecting on first use).
        drop: forgets a connection (the next ``connected()`` makes a fresh one) and closes it.
        fail_over: moves to the next endpoint after a transient error (None: one endpoint),
            unless the client moved since the endpoint ``where`` told as the attempt started.
        where: the endpoint requests go to now.
        timeouts: the RPC timeout (one create) and the pauses between re-opens.
    """

    def __init__(self, connected: Callable[[], Awaitable[aetcd.Client]],
                 drop: Callable[[aetcd.Client], Awaitable[None]],
                 fail_over: Callable[[int], Awaitable[None]] | None,
                 where: Callable[[], int], timeouts: Timeouts) -> None:
        self._connected = connected
        self._drop = drop
        self._fail_over = fail_over
        self._where = where
        self._timeouts = timeouts
        self._stream: WatchStream | None = None

    async def forever(self, keys: KeyRange, revision: int,
                      callback: Callable[[list[WatchEvent]], None],
                      stopped: Stop,
                      on_open: Callable[[], None] | None = None) -> None:
        """Delivers events until ``stopped``; never ends on its own: a broken watch is
        re-opened from the last revision seen, a key that is not UTF-8 is skipped, and a
        callback's exception is logged and the next event delivered. ``on_open`` (which must
        not block) is called each time etcd has created the watch."""
        first_s = self._timeouts.backoff.total_seconds()
        max_s = self._timeouts.backoff_max.total_seconds()
        backoff_s = first_s
        opens = 0
        refused = False  # told the user once
        while not stopped.is_set():
            seen = self._where()  # the endpoint this attempt (open, then events) is on
            try:
                opens += 1
                watch, revision = await self._open(keys, revision, opens > 1)
                stopped.hold(watch)
                try:
                    if on_open is not None:
                        on_open()
                    while True:
                        events = await watch.next()
                        revision = events[-1].kv.mod_revision + 1
                        backoff_s = first_s
                        deliver(events, callback)
                finally:
                    stopped.hold(None)
                    watch.cancel()  # left some other way than by its end: none stays open
            except WatchRefused as exc:
                if stopped.is_set():
                    return
                (log.debug if refused else log.warning)(
                    "etcd refused the watch on %s (%s): give this etcd user read access to the "
                    "job's prefixes (docs/security.md); retrying", keys, exc)
                refused = True
            except aetcd.ClientError as exc:
                if stopped.is_set():
                    return
                log.debug("watch on %s broke (%r); re-watching from revision %d", keys, exc,
                          revision)
                if isinstance(exc, aetcd.RevisionCompactedError):
                    revision = exc.compacted_revision
                if isinstance(exc, TRANSIENT) and self._fail_over is not None:
                    await self._fail_over(seen)
            except asyncio.CancelledError:
                if cancelled_by_caller():
                    raise
                if stopped.is_set():
                    return
                log.debug("watch on %s: its connection was closed under it; re-watching from "
                          "revision %d", keys, revision)
            except Exception as exc:  # noqa: BLE001 (the watch must outlive any surprise)
                if stopped.is_set():
                    return
                log.warning("watch on %s failed unexpectedly (%s: %s); re-watching from "
                            "revision %d", keys, type(exc).__name__, exc, revision)
            try:
                await asyncio.wait_for(stopped.wait(), backoff_s)
            except asyncio.TimeoutError:
                backoff_s = min(max_s, backoff_s * 2)

    async def _open(self, keys: KeyRange, revision: int,
                    reopened: bool) -> tuple[Watch, int]:
        """Creates one watch; returns it and the revision it starts from (``revision``, unless
        etcd lost its data: ``_start``; etcd's next when that is 0, so that a watch re-opened
        after a break misses nothing).

        Raises:
            aetcd.ConnectionTimeoutError: not created within the RPC timeout. The connection
                is dropped, and with it every watch on it (each re-opens on the next): its late
                answer must reach no other create.
        """
        timeout_s = self._timeouts.etcd_rpc.total_seconds()
        client = await self._connected()
        if reopened:
            revision = await self._start(client, keys, revision)
        stream = self._stream
        if stream is None or stream.client is not client or stream.broken:
            if stream is not None:  # its connection was replaced: not a failure of the new one
                stream.close(aetcd.ClientError("its connection was replaced"))
            stream = self._stream = WatchStream(client)
        try:
            watch = await stream.create(keys, revision, timeout_s)
        except asyncio.TimeoutError:
            if not stream.broken:  # the first create to give up drops the connection
                # Its other watches re-open on the next connection, as after a cancel: only
                # the create that gave up counts as the endpoint's failure (``_fail_over``).
                stream.close(aetcd.ClientError("the connection was dropped"))
                await self._drop(client)
            raise aetcd.ConnectionTimeoutError(
                f"the watch on {keys} was not created within {timeout_s:g} s; "
                "reconnecting") from None
        return watch, watch.start_revision  # re-opened from there if nothing came

    async def _start(self, client: aetcd.Client, keys: KeyRange, revision: int) -> int:
        """Where a watch re-opens: ``revision``, or 1 when etcd's own revision went back below
        the last one the watch saw (etcd lost its data: a fresh one at the same URL), so that it
        replays the fresh etcd's keys instead of waiting for a revision it may never reach.

        Raises:
            aetcd.ConnectionTimeoutError: etcd did not answer within the RPC timeout.
        """
        timeout_s = self._timeouts.etcd_rpc.total_seconds()
        try:
            # Any read tells etcd's revision: this one returns key names only, of the keys
            # that start with the range's first key.
            read = await within(client.get_prefix(keys.start.encode(), keys_only=True),
                                timeout_s)
        except asyncio.TimeoutError:
            raise aetcd.ConnectionTimeoutError(f"no reply within {timeout_s:g} s") from None
        if read.header.revision >= revision - 1:
            return revision
        log.warning("etcd's revision went back from %d to %d (it lost its data): the watch on "
                    "%s starts again from the beginning", revision - 1, read.header.revision,
                    keys)
        return 1


async def within(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``coro``'s result within ``timeout_s``, else ``asyncio.TimeoutError`` at once: the
    attempt is cancelled but not awaited (aetcd can hold a lock that its own cancellation
    waits for)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        task.add_done_callback(_quiet)
        raise asyncio.TimeoutError
    return task.result()


def _quiet(task: asyncio.Future) -> None:
    """Reads an abandoned task's outcome, so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


class Stop:
    """Ends one ``Watches.forever``: ``set`` (on the loop thread) ends the watch it holds open
    at once, so that no task per watch has to wait for it."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._watch: Watch | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()

    def set(self) -> None:
        self._event.set()
        if self._watch is not None:
            self._watch.cancel()

    def hold(self, watch: Watch | None) -> None:
        """The watch ``set`` ends (None: none open); one that opened after ``set`` ends now."""
        self._watch = watch
        if watch is not None and self.is_set():
            watch.cancel()
