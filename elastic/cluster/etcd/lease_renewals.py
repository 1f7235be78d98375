"""The lease renewals of one etcd client's members, from one thread.

Each member asks for its lease to be renewed every keepalive interval (``add``) and is handed
each renewal's outcome. One thread per client renews every lease that is due, together with
those due within a quarter of their interval, as one batch (``EtcdClient.refresh_many``: the
renewals go out at once on the client's keepalive stream). A process of one member renews as a
thread of its own would; a process of hundreds wakes a few times per interval instead of
hundreds. The thread runs only while some lease is to be renewed.

Outcomes are handed over on that thread, under this object's lock, so a handler returns at once
and never calls ``add`` or a removal (a member hands its fencing to a thread of its own); it
says whether the lease is to be renewed again. It must not know about jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from elastic.foundation.errors import ElasticError, EtcdAccessError, EtcdUnavailableError

log = logging.getLogger(__name__)

# A renewal's outcome: the lease's remaining TTL in seconds (<= 0: gone), or why etcd gave none.
Outcome = int | EtcdAccessError | EtcdUnavailableError
Handler = Callable[[Outcome], bool]  # False: renew no more
RefreshMany = Callable[[Sequence[int], timedelta], dict[int, int]]

_EARLY = 0.25  # a lease due within this share of its interval is renewed with the batch


@dataclass(eq=False)
class _Renewal:
    lease: int
    interval_s: float
    handler: Handler
    due: float
    active: bool = True


class LeaseRenewals:
    """Renews leases of one client periodically, in batches, from one thread.

    Args:
        refresh_many: renews the given leases once, retrying transient errors for the given
            time; returns each one's remaining TTL (``EtcdClient.refresh_many``).
    """

    def __init__(self, refresh_many: RefreshMany) -> None:
        self._refresh_many = refresh_many
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._renewals: list[_Renewal] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, lease: int, interval: timedelta, handler: Handler) -> Callable[[], None]:
        """Renews ``lease`` every ``interval`` (the first time one interval from now) and hands
        ``handler`` each outcome, until it returns False or the returned function is called
        (once that returns, ``handler`` is handed nothing more).

        Raises:
            EtcdUnavailableError: the client is closed.
        """
        interval_s = interval.total_seconds()
        renewal = _Renewal(lease, interval_s, handler, time.monotonic() + interval_s)
        with self._lock:
            if self._closed:
                raise EtcdUnavailableError("the etcd client is closed, so it renews no lease; "
                                           "register with a client that is open.")
            self._renewals.append(renewal)
            if self._thread is None:
                self._start()
            self._changed.notify()

        def remove() -> None:
            with self._lock:
                self._drop(renewal)
                self._changed.notify()

        return remove

    def close(self) -> None:
        """Stops renewing every lease (the thread ends after a batch in flight, whose outcomes
        nobody is handed)."""
        with self._lock:
            self._closed = True
            for renewal in list(self._renewals):
                self._drop(renewal)
            self._changed.notify()

    def _start(self) -> None:
        """Starts the renewal thread (called under the lock)."""
        self._thread = threading.Thread(target=self._run, name="elastic-keepalive", daemon=True)
        self._thread.start()

    def _drop(self, renewal: _Renewal) -> None:
        renewal.active = False
        if renewal in self._renewals:
            self._renewals.remove(renewal)

    def _run(self) -> None:
        ended = False
        try:
            while (due := self._next_due()) is not None:
                self._renew(due)
            ended = True
        finally:
            if not ended:  # a bug, whose traceback threading prints: the others go on
                with self._lock:
                    self._thread = None
                    if self._renewals and not self._closed:
                        self._start()

    def _next_due(self) -> list[_Renewal] | None:
        """Waits for the earliest renewal's time; returns those due by then (None: no lease is
        left to renew, and this thread ends). Each is next due one interval after its batch
        returns (``_renew``), as a renewal loop of its own would be."""
        with self._lock:
            while self._renewals:
                now = time.monotonic()
                first = min(r.due for r in self._renewals)
                if first <= now:
                    due = [r for r in self._renewals if r.due <= now + _EARLY * r.interval_s]
                    for renewal in due:  # until the batch ends (if it never does: a bug)
                        renewal.due = now + renewal.interval_s
                    return due
                self._changed.wait(first - now)  # bounded: the earliest renewal's time
            self._thread = None
            return None

    def _renew(self, due: list[_Renewal]) -> None:
        leases = sorted({r.lease for r in due})
        retry_for = timedelta(seconds=min(r.interval_s for r in due))
        outcomes: dict[int, Outcome]
        try:
            outcomes = dict(self._refresh_many(leases, retry_for))
        except (EtcdAccessError, EtcdUnavailableError) as exc:
            outcomes = dict.fromkeys(leases, exc)
        except ElasticError as exc:  # none other is expected of a renewal: as if unanswered
            outcomes = dict.fromkeys(leases, EtcdUnavailableError(f"lease renewal: {exc}"))
        renewed_at = time.monotonic()
        with self._lock:
            for renewal in due:
                if not renewal.active:
                    continue
                renewal.due = renewed_at + renewal.interval_s
                if not renewal.handler(outcomes[renewal.lease]):
                    self._drop(renewal)
