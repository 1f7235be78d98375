"""The etcd client's lease calls: grant, renew (one or many at once) and revoke a lease.

A mixin of ``EtcdClient`` (``client``), as ``txn.CompareAndSwap`` is: the client owns the
connection and its retries; this owns the lease RPCs and what their answers mean (a lease etcd
no longer knows is gone, not an error). Periodic renewals are ``lease_renewals``'; the one
keepalive stream they share is ``keepalive``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import aetcd
import grpc

from elastic.cluster.etcd.channel import status_of
from elastic.cluster.etcd.keepalive import KeepAlives
from elastic.foundation.errors import EtcdUnavailableError

T = TypeVar("T")


class LeaseCalls:
    """Lease calls, for a class that runs operations with ``_call`` and sets ``urls``,
    ``_keepalives`` and ``_rpc_timeout_s``."""

    urls: str
    _keepalives: KeepAlives
    _rpc_timeout_s: float

    def _call(self, op: Callable[[aetcd.Client], Coroutine[Any, Any, T]], what: str,
              retry_for: timedelta | None = None) -> T:
        raise NotImplementedError

    def grant(self, ttl: timedelta) -> int:
        """Grants a lease of ``ttl`` (whole seconds, at least 1); returns its id."""
        seconds = max(1, round(ttl.total_seconds()))
        lease = self._call(lambda c: c.lease(seconds), "lease grant")
        return lease.id

    def refresh(self, lease: int, retry_for: timedelta | None = None) -> int:
        """Keeps a lease alive once; returns its remaining TTL in seconds, <= 0 when it is gone.

        Args:
            lease: the lease id.
            retry_for: how long to retry transient errors (default: the client's deadline).
        """
        return self.refresh_many([lease], retry_for)[lease]

    def refresh_many(self, leases: Sequence[int],
                     retry_for: timedelta | None = None) -> dict[int, int]:
        """Keeps several leases alive once, their renewals sent together; returns each one's
        remaining TTL in seconds (``refresh``). A transient error retries them all.

        Raises:
            EtcdUnavailableError: no answer within ``retry_for``, or an error no other rule
                maps (a renewal is then as if unanswered).
            EtcdAccessError: etcd refuses this client.
        """
        if not leases:
            return {}

        async def renew_all(c: aetcd.Client) -> dict[int, int]:
            return await self._keepalives.renew(c, list(leases), self._rpc_timeout_s)

        try:
            return self._call(renew_all, "lease keepalive", retry_for)
        except aetcd.ClientError as exc:
            raise EtcdUnavailableError(f"etcd at {self.urls} answered a lease keepalive with "
                                       f"{type(exc).__name__}: {exc}") from exc

    def revoke(self, lease: int) -> bool:
        """Revokes a lease, deleting every key bound to it.

        Returns:
            False when the lease did not exist (any more).
        """
        async def revoke(c: aetcd.Client) -> bool:
            try:
                await c.revoke_lease(lease)
            except aetcd.ClientError as exc:
                if status_of(exc) == grpc.StatusCode.NOT_FOUND:
                    return False
                raise
            return True

        return self._call(revoke, "lease revoke")
