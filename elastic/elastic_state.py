"""``ElasticState``: a TrainState that runs a training function through re-formations.

The only module that joins every layer: the cluster (``elastic.cluster.cluster``), the state
(``state.TrainState``) and, through the state, durable checkpoints. One recovery: the user's
function raises (a collective failed, or a commit agreed on a change), the state rolls back to
its last commit if needed, the cluster forms the next round, the newest commit is broadcast from
its holder, ``on_reset`` callbacks run, and the function is called again.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.agreement import MembershipAgreement
from elastic.cluster.cluster import Cluster
from elastic.durable import DurableCommits
from elastic.errors import (FencedError, LeaveInterrupt, MembershipChangedInterrupt,
                            PeerFailureError, RendezvousClosedError)
from elastic.events import EventLog, Stopwatch
from elastic.settings import WorkerSettings
from elastic.signals import relay_signals
from elastic.state import ElasticSampler, StateError, TrainState

log = logging.getLogger(__name__)

_MAX_REFORMATIONS = 10_000
_PROGRESS_EVERY_S = 0.5
_COMM_ERROR_HINTS = ("connection", "gloo", "nccl", "timed out", "timeout", "peer", "socket",
                     "broken pipe", "closed", "distbackenderror", "process group", "aborted")


class ElasticState(TrainState):
    """Training state that survives workers leaving and joining.

    Args:
        checkpoint: an fsspec URL for durable commits (default ``ELASTIC_CHECKPOINT``).
        min_workers: fewest workers to train with (default ``ELASTIC_MIN_WORKERS`` or 1).
        max_workers: most workers to train with; extra ones wait as spares.
        etcd: comma-separated etcd client URLs (default ``ELASTIC_ETCD``).
        job_id: the job's name in etcd (default ``ELASTIC_JOB_ID``).
        **objects: Stateful objects and plain values, as for ``TrainState``.
    """

    def __init__(self, checkpoint: str | None = None, *, min_workers: int | None = None,
                 max_workers: int | None = None, etcd: str | None = None,
                 job_id: str | None = None, **objects: Any) -> None:
        self._settings = WorkerSettings.resolve(etcd=etcd, job_id=job_id,
                                                min_workers=min_workers,
                                                max_workers=max_workers, checkpoint=checkpoint)
        self._cluster: Cluster | None = None
        self._callbacks: list[Callable[[ElasticState], None]] = []
        self._leave_requested = threading.Event()
        self._generation = 0
        self._durable = DurableCommits(self._settings.checkpoint) if self._settings.checkpoint \
            else None
        self._warned_not_durable = False
        self._progress_at = -_PROGRESS_EVERY_S
        super().__init__(**objects)

    # -- topology ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        topology = self._cluster.topology if self._cluster else None
        return topology.rank if topology else 0

    @property
    def world_size(self) -> int:
        topology = self._cluster.topology if self._cluster else None
        return topology.world_size if topology else 1

    @property
    def local_rank(self) -> int:
        return self._settings.local_rank

    @property
    def generation(self) -> int:
        """How many times the group was formed in this process (1 after the first round)."""
        return self._generation

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def member_id(self) -> str | None:
        return self._cluster.member_id if self._cluster else None

    def on_reset(self, callback: Callable[["ElasticState"], None]) -> None:
        """Calls ``callback(state)`` after every re-formation (e.g. to scale the LR)."""
        self._callbacks.append(callback)

    def request_leave(self) -> None:
        """Asks this worker to leave at its next commit (what SIGTERM/SIGINT do)."""
        self._leave_requested.set()

    # -- collective agreement --------------------------------------------------------------
    def commit(self, durable: bool = False) -> int:  # noqa: D417 (see TrainState.commit)
        """Snapshots every object in host memory and agrees with all ranks on membership.

        Collective: every rank calls it at the same point. The agreement (two flags per rank,
        gathered by rank 0 over the round's ``AgreementChannel``) is started first and travels
        while the snapshot is copied. If a join or
        leave is pending, the commit is kept and ``MembershipChangedInterrupt`` hands over to
        the run loop, which re-forms the group and calls the training function again (no work
        is lost).

        Raises:
            MembershipChangedInterrupt: the world changes now (caught by ``run``).
            PeerFailureError: a peer failed during the agreement (caught by ``run``).
        """
        if self._cluster is not None:
            self._cluster.membership.check_not_fenced()
        agreement = self._start_agreement()
        version = super().commit()
        if durable:
            self._commit_durably(version)
        self._report_progress(version)
        if agreement is not None:
            agreement.finish()
        return version

    def _report_progress(self, version: int) -> None:
        """Rank 0 records a ``progress`` event (with ``step`` when registered) twice a second
        at most, for ``elastic report``'s steps/s."""
        cluster = self._cluster
        now = time.monotonic()
        if cluster is None or self.rank != 0 or now - self._progress_at < _PROGRESS_EVERY_S:
            return
        self._progress_at = now
        step = self._value("step")
        fields = {"step": step} if isinstance(step, int) and not isinstance(step, bool) else {}
        cluster.events.emit("progress", version=version, **fields)

    def check_membership(self) -> None:
        """The membership agreement of ``commit()`` without a snapshot.

        Raises:
            MembershipChangedInterrupt: the world changes now.
            LeaveInterrupt: this worker was asked to leave and the others know it.
            PeerFailureError: a peer failed during the agreement.
        """
        agreement = self._start_agreement()
        if agreement is not None:
            agreement.finish()

    def _start_agreement(self) -> "MembershipAgreement | None":
        """Starts the membership agreement; None when not in a formed group."""
        cluster = self._cluster
        if cluster is None or cluster.topology is None:
            return None
        return MembershipAgreement.start(cluster, self._leave_requested)

    @property
    def checkpoint_error(self) -> Exception | None:
        """The last failed durable write, if any (training goes on; the previous one is valid)."""
        return self._durable.last_error if self._durable else None

    def _commit_durably(self, version: int) -> None:
        """Has rank 0 write the commit to the checkpoint URL in the background."""
        if self._durable is None:
            if not self._warned_not_durable:
                log.warning("commit(durable=True) without a checkpoint URL: the commit stays in "
                            "memory. Pass ElasticState(checkpoint=URL), --checkpoint or "
                            "ELASTIC_CHECKPOINT to make it durable.")
                self._warned_not_durable = True
            return
        if self.rank != 0:
            return
        topology = self._cluster.topology if self._cluster else None
        epoch = self._value("epoch")
        metadata = {"world_size": self.world_size, "generation": topology.round if topology else 0,
                    "member": self.member_id or ""}
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            metadata["epoch"] = epoch
        self._durable.write(self.committed(), version, metadata)

    # -- the run loop ----------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Joins the job and calls ``fn(state, *args, **kwargs)`` until it returns.

        Returns:
            What ``fn`` returned, or None on a worker that left (SIGTERM) or that found the
            job already finished.

        Raises:
            RendezvousTimeoutError: fewer than min_workers for longer than the timeout.
            EtcdUnavailableError: etcd could not be reached.
            Exception: whatever ``fn`` raised that is not a peer failure.
        """
        worker = f"{os.uname().nodename}-{os.getpid()}"
        events = EventLog(self._settings.log_dir, worker)
        self._cluster = Cluster(self._settings, events)
        if self._durable is not None:
            self._durable.events = events
            self._durable.on_published(self._cluster.publish_checkpoint)
        restore_signals = self._install_signal_handlers()
        gc.freeze()  # keeps the full collections after a failure cheap
        try:
            if not self.has_commit:
                super().commit()  # the initial state is the first rollback point
            return self._loop(self._cluster, fn, args, kwargs)
        finally:
            restore_signals()
            if self._durable is not None:
                self._durable.store.wait()
            self._cluster.close()
            self._cluster = None

    def _loop(self, cluster: Cluster, fn: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        reason = "start"
        for _ in range(_MAX_REFORMATIONS):
            if self._leave_requested.is_set():
                cluster.events.emit("leaving", version=self.version)
                return None
            with Stopwatch() as recovery:
                try:
                    self._reform(cluster, reason)
                except RendezvousClosedError as exc:
                    cluster.events.emit("job_finished", why=str(exc))
                    return None
                except LeaveInterrupt:
                    cluster.events.emit("leaving", version=self.version)
                    return None
                except (RuntimeError, PeerFailureError, StateError) as exc:
                    if not self._is_peer_failure(cluster, exc):
                        raise
                    cluster.events.emit("failure_detected", source="formation",
                                        error=repr(exc)[:300])
                    reason = "failure"
                    continue
            cluster.events.emit("resumed", reason=reason, recovery_s=recovery.seconds,
                                version=self.version)
            outcome = self._call(cluster, fn, args, kwargs)
            if outcome is _LEFT:
                cluster.events.emit("leaving", version=self.version)
                return None
            if isinstance(outcome, _Retry):
                reason = outcome.reason
                continue
            cluster.finish()
            cluster.events.emit("finished", version=self.version)
            return outcome
        raise PeerFailureError(
            f"gave up after {_MAX_REFORMATIONS} re-formations: some worker keeps failing. Look "
            "for a crash loop in the workers' logs or the 'error' events of --log-dir.")

    def _call(self, cluster: Cluster, fn: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except MembershipChangedInterrupt as exc:
            cluster.events.emit("membership_changed", why=str(exc), version=self.version)
            return _Retry("change")
        except LeaveInterrupt:
            return _LEFT
        except Exception as exc:  # user code: decide between a peer failure and a bug
            if not self._is_peer_failure(cluster, exc):
                cluster.events.emit("error", error=repr(exc)[:500])
                raise
            cluster.events.emit("failure_detected", source="collective", error=repr(exc)[:300])
        self.restore()  # outside the handler: the traceback (and the old DDP) are freed
        gc.collect()
        return _Retry("failure")

    @staticmethod
    def _is_peer_failure(cluster: Cluster, exc: Exception) -> bool:
        if isinstance(exc, (PeerFailureError, FencedError)):
            return True
        if cluster.group.is_released or cluster.is_fenced:
            return True
        if isinstance(exc, StateError) and isinstance(exc.__cause__, RuntimeError):
            exc = exc.__cause__  # a broadcast of the state sync failed
        text = f"{type(exc).__name__} {exc}".lower()
        return isinstance(exc, RuntimeError) and any(h in text for h in _COMM_ERROR_HINTS)

    def _reform(self, cluster: Cluster, reason: str) -> None:
        topology = cluster.form(reason, self.version, self._leave_requested.is_set)
        self._generation += 1
        os.environ.update(RANK=str(topology.rank), WORLD_SIZE=str(topology.world_size),
                          LOCAL_RANK=str(self.local_rank), MASTER_ADDR=topology.master_addr,
                          MASTER_PORT=str(topology.master_port))
        with Stopwatch() as synced:
            src = self._newest_rank()
            self.sync(src, timeout=timedelta(minutes=5))
        for sampler in self._samplers():
            sampler.set_topology(topology.rank, topology.world_size)
        cluster.events.emit("state_synced", src_rank=src, version=self.version,
                            sync_s=synced.seconds, generation=self._generation)
        for callback in self._callbacks:
            callback(self)

    def _newest_rank(self) -> int:
        """All-gathers commit versions (and rank 0's newest checkpoint); returns the source.

        The newest in-memory commit wins, the lowest rank among equals; a durable checkpoint
        newer than every in-memory commit (a job started again, or a rank 0 that wrote one and
        died) is read once, by rank 0, which then becomes the source.
        """
        rank = dist.get_rank()
        durable = self._durable.latest_version() if self._durable and rank == 0 else 0
        mine = torch.tensor([self.version, durable], dtype=torch.int64)
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
        if self._cluster is not None and self._cluster.group.backend == "nccl":
            mine, gathered = mine.cuda(), [g.cuda() for g in gathered]
        dist.all_gather(gathered, mine)
        versions = [int(g[0].item()) for g in gathered]
        newest_durable = int(gathered[0][1].item())
        if newest_durable <= max(versions):
            return versions.index(max(versions))
        if rank == 0 and self._durable is not None:
            payload = self._durable.load_latest(self.committed())
            if payload is not None:
                self.load_committed(payload)
        return 0

    def _samplers(self) -> list[ElasticSampler]:
        return [obj for obj in self._stateful.values() if isinstance(obj, ElasticSampler)]

    def _install_signal_handlers(self) -> Callable[[], None]:
        def on_signal(signum: signal.Signals) -> None:  # on the relay thread: may take locks
            log.info("signal %s: leaving at the next commit", signum.name)
            self._leave_requested.set()

        return relay_signals((signal.SIGTERM, signal.SIGINT), on_signal, "elastic-signals")


class _Retry:
    def __init__(self, reason: str) -> None:
        self.reason = reason


_LEFT = object()
