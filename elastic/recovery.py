"""The run loop: call the training function, and between calls re-form the group and resync.

Owns one recovery, in order: the training function raised (a peer failure, or a commit that
agreed on a change); the cluster says which it was (``Cluster.is_peer_failure``: by type and by
the group's own state, never by message); after a failure the state rolls back to its last
commit; the cluster forms the next round; the newest holder of state is found and its commit
sent to the ranks that lack it (``elastic.state.sync``, ``elastic.state.feed``); ``on_formed``
runs; the function is called again. Anything else the function raises is the user's and leaves
``run`` on that rank.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastic.checkpoint import CheckpointError, CheckpointIncompatibleError
from elastic.cluster.cluster import Cluster
from elastic.cluster.rounds.topology import Topology
from elastic.cluster.links.restart_in_place import round_environment
from elastic.durable import DurableCommits
from elastic.foundation.errors import (CheckpointResumeError, EtcdUnavailableError, FencedError,
                                       LeaveInterrupt, MembershipChangedInterrupt,
                                       PeerFailureError, RendezvousClosedError)
from elastic.foundation.events import EventLog, Stopwatch
from elastic.state import ElasticSampler, StateError, TrainState
from elastic.state.errors import PayloadFormatError
from elastic.state.sync import DURABLE_UNREADABLE, Source, newest_source
from elastic.sharded import ShardedRuntime
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)

__all__ = ["RunLoop"]

MAX_REFORMATIONS = 10_000  # a bound on a crash loop, not a timeout


class _Left:
    """The function's outcome when this worker left the job (SIGTERM, or the job finished)."""


class _Retry:
    """The function's outcome when the group must re-form before it is called again."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class EtcdOutage:
    """How long etcd has been unreachable to this worker when it needed etcd, against the
    outage budget (``Timeouts.etcd_outage``): one log line when it starts, one when it ends.

    Args:
        timeouts: the table (the budget, and the pause between two attempts).
        events: where the outage is recorded.
        interrupted: ends a pause early (a request to leave).
    """

    def __init__(self, timeouts: Timeouts, events: EventLog,
                 interrupted: threading.Event) -> None:
        self._budget = timeouts.etcd_outage
        self._pause_s = timeouts.backoff_max.total_seconds()
        self._events = events
        self._since: float | None = None
        self._interrupted = interrupted

    def note(self, exc: EtcdUnavailableError, doing: str) -> None:
        """Records a failed attempt and pauses before the next one.

        Raises:
            EtcdUnavailableError: etcd has been unreachable for longer than the budget.
        """
        now = time.monotonic()
        if self._since is None:
            self._since = now
            log.warning("etcd is unreachable while %s; waiting for it for up to %.0f s "
                        "(--etcd-outage)", doing, self._budget.total_seconds())
            self._events.emit("etcd_unreachable", doing=doing, error=str(exc)[:300])
        elif now - self._since > self._budget.total_seconds():
            raise EtcdUnavailableError(
                f"etcd stayed unreachable for {now - self._since:.0f} s while {doing}, longer "
                f"than the outage budget ({self._budget.total_seconds():.0f} s). Bring etcd "
                "back (the job resumes from its last durable commit), or raise --etcd-outage."
            ) from exc
        self._interrupted.wait(self._pause_s)

    def over(self) -> None:
        """Records that etcd answered again."""
        if self._since is not None:
            waited_s = time.monotonic() - self._since
            log.warning("etcd answers again after %.0f s", waited_s)
            self._events.emit("etcd_reachable", waited_s=waited_s)
            self._since = None


class RunLoop:
    """Calls a training function until it returns, re-forming the group between calls.

    Args:
        cluster: this worker's cluster (registered, no group yet).
        train: the committed state; it holds a commit before ``run`` is called.
        durable: the job's durable commits, or None without a checkpoint URL.
        leave_requested: set when this worker should leave at its next commit.
        on_formed: called with the topology after every formation, once the state is synced.
        sync_timeout: bound on each message of the state sent after forming.
        sharded: the sharded objects and their commits, rebuilt at every formation, or None.
    """

    def __init__(self, cluster: Cluster, train: TrainState, durable: DurableCommits | None,
                 leave_requested: threading.Event, on_formed: Callable[[Topology], None],
                 sync_timeout: timedelta, sharded: ShardedRuntime | None = None) -> None:
        self._cluster = cluster
        self._sharded = sharded
        self._train = train
        self._durable = durable
        self._leave_requested = leave_requested
        self._on_formed = on_formed
        self._sync_timeout = sync_timeout
        self._lineage = 0  # the round whose members held this worker's state when it formed
        self._initial_version = train.version  # a commit no newer than this is no progress
        self._outage = EtcdOutage(cluster.settings.timeouts, cluster.events, leave_requested)
        self._live_step: int | None = None  # the step a failure interrupted (for the story)

    def run(self, call: Callable[[], Any]) -> Any:
        """Forms, calls ``call()``, and on a change or a peer failure forms again.

        Returns:
            What ``call`` returned, or None on a worker that left or found the job finished.

        Raises:
            RendezvousTimeoutError: fewer than min_workers for longer than the timeout.
            EtcdUnavailableError: etcd could not be reached.
            PeerFailureError: the group re-formed ``MAX_REFORMATIONS`` times.
            CheckpointResumeError: a resume could not read the checkpoint URL.
            Exception: whatever ``call`` raised that is not a peer failure.
        """
        events = self._cluster.events
        reason = "start"
        for _ in range(MAX_REFORMATIONS):
            if self._leave_requested.is_set():
                events.emit("leaving", version=self._train.version)
                return None
            with Stopwatch() as recovery:
                formed = self._form(reason)
            if isinstance(formed, _Left):
                return None
            if isinstance(formed, _Retry):
                reason = formed.reason
                continue
            events.emit("resumed", reason=reason, recovery_s=recovery.seconds,
                        version=self._train.version, **self._steps())
            outcome = self._call(call)
            if isinstance(outcome, _Left):
                events.emit("leaving", version=self._train.version)
                return None
            if isinstance(outcome, _Retry):
                reason = outcome.reason
                continue
            self._finish()
            events.emit("finished", version=self._train.version)
            return outcome
        raise PeerFailureError(
            f"gave up after {MAX_REFORMATIONS} re-formations: some worker keeps failing. Look "
            "for a crash loop in the workers' logs or the 'error' events of --log-dir.")

    def _step(self) -> int | None:
        step = self._train.value_of("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def _steps(self) -> dict[str, int]:
        """The registered ``step`` after a formation, and how many steps the last failure
        rolled back (for the console's story; empty without a ``step``)."""
        step, live, self._live_step = self._step(), self._live_step, None
        if step is None:
            return {}
        return {"step": step, **({"rolled_back": live - step} if live is not None else {})}

    def _form(self, reason: str) -> _Left | _Retry | None:
        """One formation; a _Retry when a peer failed while forming or etcd could not be
        reached (within the outage budget), _Left when done."""
        events = self._cluster.events
        try:
            self._reform(reason)
            self._outage.over()
        except EtcdUnavailableError as exc:
            self._outage.note(exc, f"forming the round after a {reason}")
            return _Retry(reason)
        except RendezvousClosedError as exc:
            events.emit("job_finished", why=str(exc))
            return _Left()
        except LeaveInterrupt:
            events.emit("leaving", version=self._train.version)
            return _Left()
        except (PeerFailureError, FencedError) as exc:
            events.emit("failure_detected", source="formation", error=repr(exc)[:300])
            return _Retry("failure")
        return None

    def _finish(self) -> None:
        """Says this member is done and waits for the others, through an etcd outage; the
        sharded state's copies in flight end first."""
        if self._sharded is not None:
            self._sharded.wait_copies()
        while True:
            try:
                self._cluster.finish()
                return
            except EtcdUnavailableError as exc:
                self._outage.note(exc, "recording that this worker finished")

    def _call(self, call: Callable[[], Any]) -> Any:
        """Calls the function once; a _Retry or _Left says what the loop does next."""
        events = self._cluster.events
        try:
            return call()
        except MembershipChangedInterrupt as exc:
            events.emit("membership_changed", why=str(exc), version=self._train.version)
            return _Retry("change")
        except LeaveInterrupt:
            return _Left()
        except Exception as exc:  # the user's code: a peer failure, or the user's own failure
            if not self._cluster.is_peer_failure(exc):
                events.emit("error", error=repr(exc)[:500])
                raise
            events.emit("failure_detected", source="collective", error=repr(exc)[:300])
        self._live_step = self._step()
        self._train.restore()  # outside the handler: the traceback (and the old DDP) are freed
        gc.collect()
        return _Retry("failure")

    def _reform(self, reason: str) -> None:
        """Forms the next round and makes every rank hold the newest commit.

        Raises:
            PeerFailureError: a peer failed while forming or while the state moved.
        """
        cluster = self._cluster
        if self._sharded is not None:
            self._sharded.settle()  # its copies travel on a group the formation destroys
        topology = cluster.form(reason, self._train.version, self._leave_requested.is_set)
        os.environ.update(round_environment(topology))
        # A warm spare that took a place is a member now: restarted in place, it comes back as
        # one, not as a spare that only fills a world below its target.
        os.environ.pop("ELASTIC_STANDBY", None)
        with Stopwatch() as synced:
            try:
                if self._sharded is not None:
                    self._sharded.choose(topology, self._train, cluster.group)
                src, moved, from_durable = self._sync_newest(topology)
                if self._sharded is not None:
                    self._sharded.rebuild(topology, self._train, cluster.events, cluster.group,
                                          from_durable)
            except PayloadFormatError as exc:  # the source is broken or hostile: none of it ran
                raise PeerFailureError(f"refused the state sent in round {topology.round}: "
                                       f"{exc}") from exc
            except (RuntimeError, StateError) as exc:
                if not cluster.is_peer_failure(exc):
                    raise
                raise PeerFailureError(f"moving the newest state in round {topology.round} "
                                       f"failed: {exc}") from exc
        for sampler in self._train.stateful_objects().values():
            if isinstance(sampler, ElasticSampler):
                sampler.set_topology(topology.rank, topology.world_size)
        cluster.events.emit("state_synced", src_rank=src, version=self._train.version,
                            moved=moved > 0, bytes=moved, sync_s=synced.seconds)
        self._on_formed(topology)

    def _sync_newest(self, topology: Topology) -> tuple[int, int, bool]:
        """Finds the newest holder (a durable checkpoint newer than every commit is read by
        rank 0 first) and sends its commit to the ranks that lack that very commit; the others
        (the survivors of a round, holding the same commit) take no part and only roll back.
        Returns the source rank, the bytes of state this rank sent or received, and whether
        the state came from a durable checkpoint.

        Raises:
            CheckpointResumeError: rank 0 could not read the checkpoint URL and no rank holds
                a commit beyond the initial state (a resume): starting over is not chosen
                silently.
        """
        on_rank0 = topology.rank == 0 and self._durable is not None
        found = self._read_durable(topology) if on_rank0 else _Found(0)
        source = newest_source(self._train.version, found.version, lineage=self._lineage)
        if source.durable_unreadable:
            self._check_resumable(source, found.error)
        if source.from_durable and on_rank0:
            assert found.payload is not None
            self._train.load_committed(found.payload)
        moved = self._train.sync(source.rank, timeout=self._sync_timeout,
                                 receivers=source.receivers)
        self._lineage = topology.lineage
        return source.rank, moved, source.from_durable

    def _read_durable(self, topology: Topology) -> _Found:
        """On rank 0: lists the checkpoint URL once, takes the round's fencing token (claimed
        at the first durable write instead when the listing failed), and reads the newest
        checkpoint when it is newer than this rank's commit."""
        durable, cluster = self._durable, self._cluster
        assert durable is not None
        try:
            version, floor = durable.survey()
        except CheckpointError as exc:
            durable.arm(topology.round, cluster.fencing_epoch, cluster.lease_confirmer(), None)
            return _Found(DURABLE_UNREADABLE, error=exc)
        durable.arm(topology.round, cluster.fencing_epoch, cluster.lease_confirmer(), floor)
        if version <= self._train.version:
            return _Found(version)
        try:
            payload = durable.load_latest(self._train.committed())
        except CheckpointIncompatibleError:
            raise
        except CheckpointError as exc:
            return _Found(DURABLE_UNREADABLE, error=exc)
        return _Found(0) if payload is None else _Found(int(payload["version"]), payload)

    def _check_resumable(self, source: Source, error: CheckpointError | None) -> None:
        """Rank 0 could not read the checkpoint URL: going on from the commits in memory costs
        a warning (on rank 0); at a resume (no rank holds a commit beyond the initial state,
        nor state synced in an earlier round of this job), every rank stops."""
        assert self._durable is not None
        url = self._durable.url
        if source.version > self._initial_version or source.synced_before:
            if error is not None:
                log.warning("could not read %s while forming (%s); going on from the commits "
                            "in memory (version %d)", url, _one_line(error), source.version)
            return
        why = f"({_one_line(error)})" if error is not None else "on rank 0"
        self._cluster.events.emit("resume_refused", url=url, error=why[:300])
        raise CheckpointResumeError(
            f"could not read the checkpoints under {url} to resume from them {why}; the job "
            "stopped rather than start from scratch while that URL may hold checkpoints. Make "
            "the storage readable and start the job again, or give a fresh checkpoint URL to "
            "start over.")


@dataclass(frozen=True)
class _Found:
    """What rank 0 found at the checkpoint URL while forming: the version it offers
    (``DURABLE_UNREADABLE`` with the error when the storage could not be read), and its
    payload when it was read."""

    version: int
    payload: Mapping[str, Any] | None = None
    error: CheckpointError | None = None


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
