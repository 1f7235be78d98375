"""One membership agreement of the workers: do they go on, or re-form at this commit?

Owns the exchange of two flags per rank that ``ElasticState.commit`` and ``check_membership``
run (is a join or leave pending anywhere; is this worker leaving) and what its result means. The
flags travel over the round's ``AgreementChannel``; ``start`` hands them over at once, so that
the caller can copy its snapshot while they travel.
"""

from __future__ import annotations

import threading

from elastic.cluster.cluster import Cluster
from elastic.foundation.errors import LeaveInterrupt, MembershipChangedInterrupt, PeerFailureError

__all__ = ["MembershipAgreement"]


class MembershipAgreement:
    """One membership agreement: the maximum over all ranks of (change pending, leaving).

    Begun by ``start``; ``finish`` waits for it and acts on the result. A failure to start is
    kept and raised by ``finish``, so a caller that snapshots in between still holds the newest
    commit when the peer failure surfaces.
    """

    def __init__(self, cluster: Cluster, leave_requested: threading.Event,
                 error: PeerFailureError | None, saw_change: bool = False) -> None:
        self._cluster = cluster
        self._leave_requested = leave_requested
        self._error = error
        self._flags: tuple[bool, bool] | None = None
        self.saw_change = saw_change  # this worker voted that a join or leave is pending

    @classmethod
    def start(cls, cluster: Cluster, leave_requested: threading.Event) -> "MembershipAgreement":
        """Reads this worker's flags and hands them to the round's channel."""
        pending = cluster.tracker.pending.is_set()
        try:
            cluster.channel.start(pending, leave_requested.is_set())
        except PeerFailureError as exc:
            return cls(cluster, leave_requested, exc)
        return cls(cluster, leave_requested, None, pending)

    def wait(self) -> None:
        """Waits for the agreement without acting on it: once it returns, every rank took part.

        Raises:
            PeerFailureError: a peer failed before or during the agreement.
        """
        if self._error is not None:
            raise self._error
        if self._flags is None:
            try:
                self._flags = self._cluster.channel.finish()
            except PeerFailureError as exc:
                self._error = exc  # a later wait raises it again, without the channel
                raise

    def is_reached(self) -> bool:
        """Waits for the agreement; whether every rank took part (False: a peer failed, which
        ``finish`` raises)."""
        try:
            self.wait()
        except PeerFailureError:
            return False
        return True

    def is_change_without_leavers(self) -> bool:
        """Waits for the agreement; whether the job re-forms now with no rank leaving by
        request (a join, or a member lost, which the re-formation treats as a failure). False
        when a peer failed during the agreement (``finish`` raises that)."""
        if not self.is_reached():
            return False
        assert self._flags is not None
        pending, leaving = self._flags
        return pending and not leaving

    def finish(self) -> None:
        """Waits for the agreement and raises what the job must do now, if anything.

        Raises:
            MembershipChangedInterrupt: the world changes now.
            LeaveInterrupt: this worker was asked to leave and the others know it.
            PeerFailureError: a peer failed during the agreement.
        """
        self.wait()
        assert self._flags is not None
        pending, leaving = self._flags
        if leaving and self._leave_requested.is_set():
            raise LeaveInterrupt("this worker leaves the job")
        if pending or leaving:
            raise MembershipChangedInterrupt(self._cluster.tracker.reason or "a member leaves")
