"""The release watchdog's verdict on a worker whose training thread stays inside a released
step: restart in place, or wait.

A restart in place (``restart_in_place``) brings the worker back as a new member with none of
its state, so it may replace the process only when another live member holds the worker's
newest commit (``commit_holders``; never known for sharded state, whose members hold only
their own shards and their buddies' copies), or when the job is over (a member returned from
training: no commit is needed any more, and the fresh run is told the job finished); otherwise
the worker stays, says so once per release (``stuck_holding``), and is asked again after every
further grace (``ReleaseWatchdog``): the step may yet end, and leaving would lose the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastic.foundation.errors import EtcdAccessError, EtcdRecordError, EtcdUnavailableError, FencedError
from elastic.foundation.events import EventLog
from elastic.cluster.links.restart_in_place import restart_in_place
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)


class StuckVerdict:
    """Decides, when called with the release's reason, whether the stuck worker restarts in
    place (the call never returns then) or waits (returns True: ask again after a grace).

    Args:
        events: where ``restarting_in_place`` and ``stuck_holding`` are recorded.
        timeouts: the worker's table (the grace, the lease TTL, the shutdown bound).
        newest: the version of the worker's newest commit.
        holder: a live member other than this one that holds the given commit version or a
            newer one (None: none); may raise the etcd errors. None for sharded state: a
            member at that version holds only its own shards and its buddies' copies, so it
            may lack this worker's (a dead rank's buddy holds the only copy of its shard).
        over: whether the job is over (a member returned from training); may raise the etcd
            errors.
        leave: leaves the job, so that nobody waits for this member; may raise the etcd
            errors and ``FencedError``.
    """

    def __init__(self, events: EventLog, timeouts: Timeouts, newest: Callable[[], int],
                 holder: Callable[[int], str | None] | None, over: Callable[[], bool],
                 leave: Callable[[], None]) -> None:
        self._events = events
        self._timeouts = timeouts
        self._newest = newest
        self._holder = holder
        self._over = over
        self._leave = leave
        self._told = False  # said once per release that it waits as the holder

    def reset(self) -> None:
        """The training thread dropped the round: a later release is told anew."""
        self._told = False

    def __call__(self, reason: str) -> bool:
        version = self._newest()
        try:
            holder = self._holder(version) if self._holder is not None else None
            over = holder is None and self._over()
        except (EtcdUnavailableError, EtcdAccessError, EtcdRecordError) as exc:
            log.warning("could not learn whether another member holds commit %d (%s)", version,
                        exc)
            holder, over = None, False
        if holder is not None or over:
            self._restart(reason, holder or "")
        if not self._told:
            self._told = True
            log.warning("the training thread is still inside its step %s after the round was "
                        "released (%s), and no other live member is known to hold its commit "
                        "(version %d): it stays, as a restart in place would lose that commit; "
                        "the others wait for it (up to ELASTIC_REJOIN_TIMEOUT)",
                        self._timeouts.release, reason, version)
            self._events.emit("stuck_holding", reason=reason, version=version)
        return True

    def _restart(self, reason: str, holder: str) -> None:
        """Leaves the job and replaces the process with a fresh run of its command, which gets
        the commit back from ``holder`` (or, when it is "", is told that the job is over)."""
        grace = self._timeouts.release
        why = f"{holder} holds its commit" if holder else "the job is over"
        log.error("the training thread is still inside its step %s after the round was "
                  "released (%s): a collective that the release did not wake, or a step with "
                  "no collective longer than ELASTIC_RELEASE_GRACE; leaving the job and "
                  "restarting this worker in place (%s)", grace, reason, why)
        self._events.emit("restarting_in_place", reason=reason, holder=holder,
                          grace_s=grace.total_seconds())
        try:
            self._leave()
        except (EtcdUnavailableError, EtcdAccessError, FencedError) as exc:
            log.warning("could not leave the job before restarting (%s); the lease expires "
                        "in %s", exc, self._timeouts.lease_ttl)
        restart_in_place(self._timeouts.shutdown)
