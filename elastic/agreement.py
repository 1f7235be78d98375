"""One membership agreement of the workers: do they go on, or re-form at this commit?

Owns the two-integer MAX all-reduce that ``ElasticState.commit`` and ``check_membership`` run
(is a join or leave pending anywhere; is this worker leaving) and what its result means. Started
asynchronously, so that the caller can copy its snapshot while the all-reduce travels.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from elastic.cluster import Cluster
from elastic.errors import LeaveInterrupt, MembershipChangedInterrupt, PeerFailureError

__all__ = ["MembershipAgreement"]


class MembershipAgreement:
    """One membership agreement: a MAX all-reduce of (join/leave pending, this worker leaves).

    Begun by ``start`` with ``async_op``; ``finish`` waits for it and acts on the result. A
    failure to start is kept and raised by ``finish``, so a caller that snapshots in between
    still holds the newest commit when the peer failure surfaces.
    """

    def __init__(self, cluster: Cluster, leave_requested: threading.Event, flags: torch.Tensor,
                 work: Any, error: RuntimeError | None) -> None:
        self._cluster = cluster
        self._leave_requested = leave_requested
        self._flags = flags
        self._work = work
        self._error = error

    @classmethod
    def start(cls, cluster: Cluster, leave_requested: threading.Event) -> "MembershipAgreement":
        """Reads this worker's flags and starts the all-reduce over the cluster's group."""
        flags = torch.tensor([int(cluster.monitor.pending.is_set()),
                              int(leave_requested.is_set())], dtype=torch.int32)
        if cluster.group.backend == "nccl":
            flags = flags.cuda()
        try:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        except RuntimeError as exc:
            return cls(cluster, leave_requested, flags, None, exc)
        return cls(cluster, leave_requested, flags, work, None)

    def finish(self) -> None:
        """Waits for the all-reduce and raises what the job must do now, if anything.

        Raises:
            MembershipChangedInterrupt: the world changes now.
            LeaveInterrupt: this worker was asked to leave and the others know it.
            PeerFailureError: a peer failed during the agreement.
        """
        try:
            if self._error is not None:
                raise self._error
            self._work.wait(timeout=self._cluster.group.timeout)
        except RuntimeError as exc:
            raise PeerFailureError(f"membership agreement failed: {exc}") from exc
        pending, leaving = (int(v) for v in self._flags.cpu().tolist())
        if leaving and self._leave_requested.is_set():
            raise LeaveInterrupt("this worker leaves the job")
        if pending or leaving:
            raise MembershipChangedInterrupt(self._cluster.monitor.reason or "a member leaves")
