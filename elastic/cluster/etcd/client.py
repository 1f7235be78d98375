"""The one module that knows the etcd client library (aetcd, asyncio).

It owns an event loop in one background thread and offers a small synchronous API: keys and
values are ``str``/``bytes``, leases are ints, watches call back from the loop thread. Transient
errors are retried with tenacity against a deadline, then become ``EtcdUnavailableError`` naming
the URLs. It must not know about jobs, rounds or torch.

The connection itself (TLS, the user's token) is built in ``channel``. A token etcd no
longer accepts is fetched again; a refusal (bad certificate, wrong password, no permission) is
not retried: it becomes ``EtcdAccessError``, one sentence with the fix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

# gRPC's fork handlers only log "Other threads are currently calling into gRPC, skipping fork()
# handlers" at every DataLoader worker fork (our loop thread is always in gRPC); forked children
# never use this client. Set before grpc is imported; an explicit user setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC logs every failed TLS handshake at INFO on stderr; the refusal is reported as
# EtcdAccessError, one line, instead.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import aetcd  # noqa: E402
import aetcd.exceptions  # noqa: E402
import grpc  # noqa: E402
import tenacity  # noqa: E402

from elastic.cluster.etcd.channel import (TRANSIENT, Client, EtcdBusy, busy, cancelled_by_caller,
                                          grpc_options, parse_endpoints, refusal, status_of,
                                          uses_tls)
from elastic.cluster.etcd.batches import TXN_PUTS, BatchWrites  # noqa: E402
from elastic.cluster.etcd.keepalive import KeepAlives  # noqa: E402
from elastic.cluster.etcd.txn import CompareAndSwap  # noqa: E402
from elastic.cluster.etcd.values import KeyValue, WatchEvent, kv_of, utf8_keys  # noqa: E402
from elastic.cluster.etcd.key_range import KeyRange  # noqa: E402
from elastic.cluster.etcd.lease_calls import LeaseCalls  # noqa: E402
from elastic.cluster.etcd.lease_renewals import LeaseRenewals  # noqa: E402
from elastic.cluster.etcd.watch import Stop, Watches, within  # noqa: E402
from elastic.cluster.etcd.tls import (channel_credentials, plaintext_problem,  # noqa: E402
                                      tls_problem)
from elastic.foundation.errors import (EtcdAccessError, EtcdUnavailableError,  # noqa: E402
                                       FencedError)
from elastic.foundation.settings import EtcdSecurity  # noqa: E402
from elastic.foundation.timeouts import Timeouts  # noqa: E402

log = logging.getLogger(__name__)
T = TypeVar("T")

# Retried after fetching a new token: etcd expired or forgot the one we hold.
_RETRIED = (*TRANSIENT, aetcd.exceptions.UnauthenticatedError)
class EtcdClient(CompareAndSwap, BatchWrites, LeaseCalls):
    """A synchronous etcd v3 client over aetcd, with bounded retries and endpoint fail-over.

    Args:
        urls: comma-separated client URLs of the etcd cluster.
        timeouts: the job's table: one RPC's deadline (``etcd_rpc``), the retry deadline
            (``etcd_retry``), the pauses between retries and reconnections, pings, and how long
            closing waits (default: ``Timeouts()``).
        retry_for: how long an operation retries transient errors before giving up, when not
            ``timeouts.etcd_retry`` (a launcher gives up sooner: ``timeouts.connect``).
        security: TLS files and etcd user (default: none; ``https://`` URLs still use TLS,
            verified against the system's CA store).

    Raises:
        ValueError: malformed URLs, or TLS files for ``http://`` URLs.
    """

    def __init__(self, urls: str, *, timeouts: Timeouts | None = None,
                 retry_for: timedelta | None = None,
                 security: EtcdSecurity | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        self.urls = urls
        self._endpoints = parse_endpoints(urls)
        self.security = security or EtcdSecurity()
        self.security.validate()
        self._credentials = (channel_credentials(self.security)
                             if uses_tls(urls, self.security) else None)
        self._retry_for = retry_for or self.timeouts.etcd_retry
        self._rpc_timeout_s = self.timeouts.etcd_rpc.total_seconds()
        # Beyond one RPC's deadline: how long a caller waits for the loop thread's reply.
        self._shutdown_s = self.timeouts.shutdown.total_seconds()
        self._endpoint_index = 0
        self._txn_puts = TXN_PUTS  # keys per transaction of put_many (an etcd may take fewer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="elastic-etcd",
                                        daemon=True)
        self._thread.start()
        self._client: aetcd.Client | None = None
        self._connecting: asyncio.Lock | None = None  # made on the loop thread, on first use
        self._closed = False
        self._probed_plaintext = False
        self._keepalives = KeepAlives()  # every lease's renewals, on one stream
        self.renewals = LeaseRenewals(self.refresh_many)  # periodic renewals, on one thread
        self._watches = Watches(self._connected, self._drop,
                                self._fail_over if len(self._endpoints) > 1 else None,
                                self._where, self.timeouts)

    # -- plumbing ---------------------------------------------------------------------------
    def _submit(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the loop thread and waits for it, within one RPC's deadline.

        Raises:
            aetcd.ConnectionTimeoutError: no reply in time (the attempt is cancelled), so that
                a stuck loop is retried and mapped like any other transient error.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=self._rpc_timeout_s + self._shutdown_s)
        except TimeoutError as exc:
            future.cancel()
            raise aetcd.ConnectionTimeoutError(f"no reply within {self._rpc_timeout_s:g} s "
                                               "(+ the client thread's hand-over)") from exc

    async def _connected(self) -> aetcd.Client:
        if self._client is not None:  # connected: no lock to take on every call
            return self._client
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connection (and one token) for every caller
            if self._client is None:
                client = Client(*self._endpoint(), credentials=self._credentials,
                                security=self.security, timeout=self._rpc_timeout_s,
                                options=grpc_options(self.timeouts))
                await client.connect()
                self._client = client
            return self._client

    def _endpoint(self) -> tuple[str, int]:
        return self._endpoints[self._endpoint_index % len(self._endpoints)]

    async def _reconnect(self) -> None:
        """Drops the current connection; the next call connects (and authenticates) again."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _drop(self, client: aetcd.Client) -> None:
        """Forgets ``client`` (the next call connects again) and closes it, within the close
        timeout (a connection in trouble may never finish closing)."""
        if self._client is client:
            self._client = None
        try:
            await within(client.close(), self._shutdown_s)
        except (asyncio.TimeoutError, aetcd.ClientError) as exc:
            log.debug("closing a dropped etcd connection: %r", exc)

    def _where(self) -> int:
        """Which endpoint requests go to now (its index, counting every move): a request
        notes it as it starts, and hands it to ``_fail_over`` if it fails."""
        return self._endpoint_index

    async def _fail_over(self, seen: int) -> None:
        """Drops the current connection and moves to the next endpoint, unless the client
        moved since ``seen`` (``_where`` as the failed request started): requests that fail
        together on one endpoint move the client once, not once each."""
        if self._endpoint_index != seen:
            return
        self._endpoint_index += 1
        await self._reconnect()

    def _call(self, op: Callable[[aetcd.Client], Coroutine[Any, Any, T]], what: str,
              retry_for: timedelta | None = None) -> T:
        """Runs one idempotent operation with bounded retries of transient errors (for
        ``retry_for``, default the client's retry deadline)."""
        retry_for = retry_for or self._retry_for
        if self._closed:
            raise EtcdUnavailableError(f"The etcd client for {self.urls} is closed.")

        async def attempt() -> T:
            seen = self._where()
            try:
                return await op(await self._connected())
            except asyncio.CancelledError:
                if cancelled_by_caller():
                    raise
                # gRPC cancels the calls of a connection that another request closed (it
                # failed over, or authenticates again): this one is asked again, and moves
                # nothing (raised here, it skips the fail-over below).
                raise aetcd.ConnectionFailedError(
                    "the connection was closed under the request") from None
            except aetcd.exceptions.UnauthenticatedError:
                await self._reconnect()  # the token expired: authenticate again
                raise
            except TRANSIENT:
                if len(self._endpoints) > 1:
                    await self._fail_over(seen)
                raise
            except aetcd.ClientError as exc:
                overloaded = busy(exc)
                if overloaded is None:
                    raise
                raise overloaded from exc  # asked again, on the same endpoint

        def once() -> T:
            if self._closed:  # closed while retrying: its loop answers nobody now
                raise EtcdUnavailableError(f"The etcd client for {self.urls} is closed.")
            try:
                return self._submit(attempt())
            except EtcdBusy:
                raise  # it answered: nothing to probe
            except TRANSIENT:
                self._check_tls()
                raise
            except aetcd.ClientError as exc:
                refused = refusal(exc, what, self.urls, self.security)
                if refused is None:
                    raise
                raise refused from exc

        def with_retries() -> T:
            started = time.monotonic()
            try:
                return once()  # the common case: no retry machinery to build
            except _RETRIED:
                pass
            backoff_s = self.timeouts.backoff.total_seconds()
            retrying = tenacity.Retrying(
                stop=tenacity.stop_after_delay(
                    max(0.0, retry_for.total_seconds() - (time.monotonic() - started))),
                retry=tenacity.retry_if_exception_type(_RETRIED),
                wait=tenacity.wait_exponential_jitter(
                    multiplier=backoff_s, max=self.timeouts.backoff_max.total_seconds(),
                    jitter=backoff_s),
                before_sleep=tenacity.before_sleep_log(log, logging.DEBUG),
                reraise=True,
            )
            return retrying(once)

        try:
            return with_retries()
        except aetcd.exceptions.UnauthenticatedError as exc:
            raise EtcdAccessError(
                f"etcd at {self.urls} kept refusing the auth token of user "
                f"{self.security.user!r} for {what} ({exc}): check that authentication is "
                "enabled as expected and that the user still exists.") from exc
        except EtcdBusy as exc:
            raise EtcdUnavailableError(
                f"etcd at {self.urls} was too busy to take {what} for "
                f"{retry_for.total_seconds():g} s ({exc}): its applied writes lag its commits. "
                "Give etcd faster disks and more CPU, or spread the jobs over more etcd "
                "clusters (docs/multi-node.md, \"How large a job one etcd carries\").") from exc
        except TRANSIENT as exc:
            raise EtcdUnavailableError(
                f"etcd at {self.urls} did not answer {what} for "
                f"{retry_for.total_seconds():g} s ({type(exc).__name__}: {exc}). "
                "Check that etcd runs and that --etcd / ELASTIC_ETCD names its client URL."
            ) from exc
        except aetcd.ClientError as exc:
            if status_of(exc) == grpc.StatusCode.NOT_FOUND:  # etcd's only NOT_FOUND: a lease
                raise FencedError(f"{what}: the lease is gone ({exc}); its owner must "
                                  "register again as a new member.") from exc
            raise

    def _check_tls(self) -> None:
        """After a failed connection: raises if TLS is the reason (a certificate refused, or a
        plaintext URL at a server that speaks TLS only).

        Raises:
            EtcdAccessError: the server or this client's certificate was refused.
        """
        if self._credentials is None:
            if not self._probed_plaintext:  # once: a server that is down is probed quickly
                self._probed_plaintext = True
                problem = plaintext_problem(*self._endpoint(), self._rpc_timeout_s)
                if problem is not None:
                    raise EtcdAccessError(problem)
            return
        problem = tls_problem(*self._endpoint(), self.security, self._rpc_timeout_s)
        if problem is not None:
            raise EtcdAccessError(problem)

    # -- key-value ----------------------------------------------------------------------------
    def put(self, key: str | bytes, value: bytes | str, lease: int | None = None) -> int:
        """Writes a key; returns the revision of the write."""
        data = value.encode() if isinstance(value, str) else value
        raw = key.encode() if isinstance(key, str) else key
        result = self._call(lambda c: c.put(raw, data, lease=lease), f"put {key!r}")
        return result.header.revision

    def get(self, key: str) -> KeyValue | None:
        """Reads one key, or None when it does not exist."""
        got = self._call(lambda c: c.get(key.encode()), f"get {key}")
        return None if got is None else kv_of(got)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Reads every key under ``prefix``; returns them (sorted by key) and the revision read."""
        return self.get_range(KeyRange.prefix(prefix))

    def get_range(self, keys: KeyRange) -> tuple[list[KeyValue], int]:
        """Reads every key in ``keys``; returns them (sorted by key) and the revision read."""
        result = self._call(lambda c: c.get_range(keys.start.encode(), keys.end.encode(),
                                                  sort_order="ascend"), f"get {keys}")
        return utf8_keys(result.kvs), result.header.revision

    def delete(self, key: str) -> bool:
        """Deletes one key; returns whether it existed."""
        result = self._call(lambda c: c.delete(key.encode()), f"delete {key}")
        return result is not None

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under ``prefix``."""
        self._call(lambda c: c.delete_prefix(prefix.encode()), f"delete {prefix}*")

    # -- watches ------------------------------------------------------------------------------
    def follow_prefix(self, prefix: str, callback: Callable[[list[WatchEvent]], None],
                      on_open: Callable[[], None] | None = None) -> Callable[[], None]:
        """``follow_range`` of every key under ``prefix``."""
        return self.follow_range(KeyRange.prefix(prefix), callback, on_open)

    def follow_range(self, keys: KeyRange, callback: Callable[[list[WatchEvent]], None],
                     on_open: Callable[[], None] | None = None) -> Callable[[], None]:
        """Hands ``callback`` every key in ``keys`` now (as puts, on this thread), then every
        later change by watch, with nothing missed in between. Returns the watch's cancel.

        A change made between the read and the watch's creation reaches the watch only at
        etcd's next resync of new watches (every 100 ms); a caller that cannot wait that long
        reads again once ``on_open`` tells that the watch exists (see ``watch_range``).
        """
        kvs, revision = self.get_range(keys)
        callback([WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease,
                             kv.create_revision) for kv in kvs])
        return self.watch_range(keys, revision + 1, callback, on_open)

    def watch_prefix(self, prefix: str, start_revision: int,
                     callback: Callable[[list[WatchEvent]], None]) -> Callable[[], None]:
        """``watch_range`` of every key under ``prefix``."""
        return self.watch_range(KeyRange.prefix(prefix), start_revision, callback)

    def watch_range(self, keys: KeyRange, start_revision: int,
                    callback: Callable[[list[WatchEvent]], None],
                    on_open: Callable[[], None] | None = None) -> Callable[[], None]:
        """Watches ``keys`` from ``start_revision``; re-watches after errors from the last seen.

        ``callback`` and ``on_open`` (called each time etcd has created the watch) run on the
        client's loop thread and must not block. Returns a function that cancels the watch.
        """
        stopped = Stop()
        task = asyncio.run_coroutine_threadsafe(
            self._watches.forever(keys, start_revision, callback, stopped, on_open), self._loop)

        def cancel() -> None:
            self._loop.call_soon_threadsafe(stopped.set)
            try:
                task.result(timeout=self._shutdown_s)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()

        return cancel

    def close(self) -> None:
        """Closes the connection and stops the loop thread."""
        if self._closed:
            return
        self._closed = True
        self.renewals.close()

        async def shutdown() -> None:
            self._keepalives.close()
            if self._client is not None:
                await self._client.close()
                self._client = None

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(
                timeout=self._shutdown_s)
        except (TimeoutError, aetcd.ClientError) as exc:
            log.debug("etcd client close: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self._shutdown_s)
