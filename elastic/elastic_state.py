"""``ElasticState``: the user's training state, joined to the job and run through re-formations.

Owns the public face of the run loop: the named objects (held by a ``TrainState``, which owns
committing and moving them), the topology properties, ``on_reset`` callbacks and ``run``. The
collective ``commit`` and ``commit_step`` are ``elastic.collective_commit``'s; the loop itself
lives in ``elastic.recovery``; the cluster in ``elastic.cluster``.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from elastic.checkpoint import CheckpointError
from elastic.cluster.cluster import Cluster
from elastic.cluster.rounds.topology import Topology
from elastic.collective_commit import CollectiveCommit
from elastic.console_story import ConsoleStory
from elastic.durable import DurableCommits
from elastic.error_causes import drop_causes
from elastic.foundation.errors import CheckpointUnusableError, ElasticError
from elastic.foundation.events import EventLog
from elastic.loop_helpers import BatchInHand, batches, ddp, print_main
from elastic.outcome import RunOutcome
from elastic.recovery import RunLoop
from elastic.sharded import Parallelize, ShardedRuntime
from elastic.sharded_durable import ShardedDurable
from elastic.foundation.settings import WorkerSettings
from elastic.setup_check import before_joining, checkpoint_url, one_line_on_setup_error
from elastic.foundation.signals import LeaveRequest, relay_signals
from elastic.step_collectives import StepCollectives
from elastic.state import TrainState

log = logging.getLogger(__name__)


class ElasticState(CollectiveCommit):
    """Training state that survives workers leaving and joining.

    Registered objects read as attributes (``state.model``) and plain values also write as
    attributes (``state.epoch += 1``), exactly as on a ``TrainState``, which holds them.

    Args:
        checkpoint: an fsspec URL for durable commits (default ``ELASTIC_CHECKPOINT``).
        min_workers: fewest workers to train with (default ``ELASTIC_MIN_WORKERS`` or 1).
        max_workers: most workers to train with; extra ones wait as spares.
        etcd: comma-separated etcd client URLs (default ``ELASTIC_ETCD``).
        job_id: the job's name in etcd (default ``ELASTIC_JOB_ID``).
        parallelize: for sharded state (FSDP2 / HSDP), ``parallelize(mesh)`` builds the model
            and optimizer of a round on its ``DeviceMesh`` and returns them by name
            (``{"model": ..., "optimizer": ...}``, read as ``state.model``); called at every
            formation (see ``elastic.sharded`` and docs/sharded.md).
        shard_degree: None for FSDP over every rank, S for HSDP ("replicate", "shard").
        buddies: extra host copies of each rank's shards under FSDP (default 1).
        **objects: Stateful objects and plain values, as for ``TrainState``.
    """

    def __init__(self, checkpoint: str | None = None, *, min_workers: int | None = None,
                 max_workers: int | None = None, etcd: str | None = None,
                 job_id: str | None = None, parallelize: Parallelize | None = None,
                 shard_degree: int | None = None, buddies: int = 1, **objects: Any) -> None:
        self._settings = WorkerSettings.resolve(etcd=etcd, job_id=job_id,
                                                min_workers=min_workers,
                                                max_workers=max_workers, checkpoint=checkpoint)
        self._checkpoint_in_script = checkpoint
        self._train = TrainState.stored_in(self.__dict__)  # registered names are attributes
        self._cluster: Cluster | None = None
        self._callbacks: list[Callable[[ElasticState], None]] = []
        self._leave_requested = LeaveRequest()
        self._generation = 0
        with one_line_on_setup_error(self._settings):  # as a bad URL found at run() is
            self._durable = self._open_durable()
        self._warned_not_durable = False
        self._progress_at: float | None = None
        self._progress_every_s = self._settings.timeouts.progress.total_seconds()
        self._step_collectives = StepCollectives()
        self._batch_in_hand = BatchInHand()  # batches()' unrecorded batch (commit_step)
        timeouts = self._settings.timeouts
        self._sharded = ShardedRuntime(parallelize, shard_degree, buddies, timeouts.collective,
                                       timeouts.peer) if parallelize else None
        if self._sharded is not None and self._durable is not None:
            durable = self._durable
            durable.sharded = True  # every rank writes its shards; formation loads them
            shards = ShardedDurable(durable, lambda: durable.events, self._commit_metadata)
            self._sharded.durable_writer, self._sharded.durable_loader = shards.write, shards.load
        for name, obj in objects.items():
            self.register(name, obj)

    def _open_durable(self) -> DurableCommits | None:
        """The durable commits at the job's checkpoint URL (None without one).

        Raises:
            CheckpointUnusableError: no installed backend serves the URL's scheme.
        """
        url = self._settings.checkpoint
        if not url:
            return None
        try:
            return DurableCommits(url, retry_for=self._settings.timeouts.storage_retry,
                                  job_id=self._settings.job_id)
        except CheckpointError as exc:
            _, source = checkpoint_url(self._checkpoint_in_script, self._settings)
            raise CheckpointUnusableError(f"{source}: {exc}") from exc

    # -- the registered objects, held by the TrainState --------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: registered objects sit in __dict__.
        sharded = self.__dict__.get("_sharded")
        if sharded is not None and name in sharded.objects:
            return sharded.objects[name]
        raise AttributeError(f"ElasticState has no attribute or registered object {name!r}.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:
            setattr(self._train, name, value)  # registered plain values only; it says why not

    def register(self, name: str, obj: Any) -> None:
        """Adds a named Stateful object or plain value (see ``TrainState.register``).

        Raises:
            ValueError: the name is invalid, already registered, or an ElasticState attribute.
            TypeError: ``obj`` is neither Stateful nor a plain value.
        """
        if hasattr(type(self), name):
            raise ValueError(f"name {name!r} clashes with ElasticState.{name}; choose another name.")
        self._train.register(name, obj)

    @property
    def train_state(self) -> TrainState:
        """The ``TrainState`` that holds, commits and moves the registered objects."""
        return self._train

    @property
    def names(self) -> tuple[str, ...]:
        """Names of all registered objects (see ``TrainState.names``)."""
        return self._train.names

    @property
    def restoring(self) -> bool:
        """True while ``parallelize`` builds the objects of a formation that then fills them
        from the last commit (in memory) or a durable sharded checkpoint: initialising their
        parameters is wasted work then. Buffers outside the model's state dict
        (``persistent=False``) are not filled: they still need their values."""
        return self._sharded is not None and self._sharded.restoring

    @property
    def version(self) -> int:
        """Version of the current commit; 0 before the first commit."""
        return self._train.version

    @property
    def has_commit(self) -> bool:
        """Whether a commit exists to restore or broadcast."""
        return self._train.has_commit

    def restore(self) -> None:
        """Rolls the live objects back to the last commit (see ``TrainState.restore``)."""
        self._batch_in_hand.drop()
        self._train.restore()

    def sync(self, src_rank: int, timeout: timedelta | None = None) -> None:
        """Makes every rank's commit the one of ``src_rank`` (see ``TrainState.sync``); when it
        raises, call ``restore()`` before using the model again (``unsettled``)."""
        self._train.sync(src_rank, timeout=timeout)

    def committed(self) -> dict[str, Any]:
        """The current commit as a payload (see ``TrainState.committed``)."""
        return self._train.committed()

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
        """The GPU index of this worker: ``LOCAL_RANK``, or for an NCCL worker started by hand
        without it, the GPU it claimed (``elastic.cluster.links.device``)."""
        device = self._cluster.device if self._cluster else None
        return device.index if device is not None else self._settings.local_rank

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

    # -- loop helpers (elastic.loop_helpers) ------------------------------------------------
    def batches(self, loader: Iterable[Any], *, commit_every: int | None = None,
                checkpoint_at_end: bool = False) -> Iterator[Any]:
        """``loader``'s batches with the loop's bookkeeping done: the sampler's epoch, each
        batch recorded, ``commit()`` every ``commit_every`` batches, ``commit(durable=True)``
        after the last with ``checkpoint_at_end`` (see ``loop_helpers.batches``)."""
        return batches(loader, self.commit, self._train.value_of("epoch"), commit_every,
                       checkpoint_at_end, self._batch_in_hand)

    def ddp(self, module: Any, **kwargs: Any) -> Any:
        """``DistributedDataParallel(module, **kwargs)`` for this round (on the module's GPU
        when it has one); build it inside the training function, which every round re-enters.
        When every rank already holds the same parameters and buffers of the module, as after
        a formation (compared by a digest in one small all-gather: collective), DDP's own
        broadcast of them is skipped (``init_sync=False``, unless given)."""
        return ddp(module, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        print_main(self.is_main, *args, **kwargs)

    def on_reset(self, callback: Callable[["ElasticState"], None]) -> None:
        """Calls ``callback(state)`` after every re-formation (e.g. to scale the LR)."""
        self._callbacks.append(callback)

    def track_collective(self, work: Any) -> None:
        """Has the next agreement wait for ``work``, an asynchronous collective of this step
        (what ``async_op=True`` returns, or a communication hook's ``Future``): one that failed
        fails the vote, and the step is rolled back. DDP's own all-reduce needs no tracking (see
        ``elastic.step_collectives``)."""
        self._step_collectives.track(work)

    def request_leave(self) -> None:
        """Asks this worker to leave at its next commit (what SIGTERM/SIGINT do)."""
        self._leave_requested.set()

    # -- running ----------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Joins the job and calls ``fn(state, *args, **kwargs)`` until it returns.

        Returns:
            What ``fn`` returned, or None on a worker that left (SIGTERM) or that found the
            job already finished.

        Raises:
            RendezvousTimeoutError: fewer than min_workers for longer than the timeout.
            EtcdUnavailableError: etcd could not be reached.
            Exception: whatever ``fn`` raised that is not a peer failure.
            NothingTrainedError: ``fn`` returned without a commit after resuming a finished
                job from its checkpoint (unless ``ELASTIC_RESUME_FINISHED=1``).
            DurableCommitsFailedError: not one durable commit of this worker was written.
            UnfinishedWriteError: the last durable write did not finish in ``final_write``.
            SystemExit: before joining, a setup mistake (two checkpoint URLs, or one that
                cannot be written): one line, exit status 1 (``elastic.setup_check``).
        """
        before_joining(self._checkpoint_in_script, self._settings)
        worker = f"{os.uname().nodename}-{os.getpid()}"
        events = EventLog(self._settings.log_dir, worker)
        events.listen(ConsoleStory(self._settings.console))
        # Before registering: a SIGTERM that lands as this worker joins asks it to leave.
        restore_signals = self._install_signal_handlers()
        try:
            if self._sharded is not None:
                self._sharded.prepare()  # its one-time imports, while it registers
            if not self._train.has_commit:
                self._train.commit()  # the initial state is the first rollback point
            # Its version known, the registration carries the first join request.
            sharded = self._sharded
            self._cluster = Cluster(self._settings, events, self._train.version,
                                    lambda: self._train.version, replicated=sharded is None,
                                    shard_degree=sharded.shard_degree if sharded else None)
        except BaseException as exc:
            restore_signals()
            if isinstance(exc, ElasticError):  # every frame below is the package's
                raise drop_causes(exc, events, self._settings.debug, keep_frames=False)
            raise
        if self._durable is not None:
            self._durable.events = events
            self._durable.on_published(self._cluster.publish_checkpoint)
        if self._sharded is not None:
            # its imports are frozen with the rest; a first round may have closed with this
            # worker in it, and the others give up forming its group after ``form``
            timeouts = self._settings.timeouts
            self._sharded.wait_prepared(min(timeouts.local_start, timeouts.form / 2))
        gc.freeze()  # keeps the full collections after a failure cheap
        loop = RunLoop(self._cluster, self._train, self._durable, self._leave_requested,
                       self._on_formed, self._settings.timeouts.sync, self._sharded)
        outcome, returned = RunOutcome(self._settings.resume_finished), []

        def call() -> Any:
            assert self._cluster is not None and self._cluster.topology is not None
            outcome.called(self._train.version, self._cluster.topology.round)
            result = fn(self, *args, **kwargs)
            returned.append(True)
            return result

        final_write = self._settings.timeouts.final_write
        try:
            outcome.initial_version = self._train.version
            with one_line_on_setup_error(self._settings):  # a mistake found at a formation
                result = loop.run(call)
        except ElasticError as exc:
            drop_causes(exc, events, self._settings.debug)
            raise
        finally:
            restore_signals()
            unfinished = self._durable.finish(final_write) if self._durable else None
            self._cluster.close()
            self._cluster = None
            if self._train.unsettled:  # a transfer cut off half-way, its group now gone
                self._train.restore()
        if unfinished is not None:
            raise unfinished
        if returned:
            outcome.check(self._train.version, self._durable)
        return result

    def _on_formed(self, topology: Topology) -> None:
        """After every formation: count it and run the user's ``on_reset`` callbacks."""
        self._generation += 1
        self._step_collectives.forget()  # the last round's, rolled back with it
        self._batch_in_hand.drop()  # so is the batch a loop held
        log.debug("formed round %d as rank %d of %d (generation %d)", topology.round,
                  topology.rank, topology.world_size, self._generation)
        for callback in self._callbacks:
            callback(self)

    def _install_signal_handlers(self) -> Callable[[], None]:
        def on_signal(signum: signal.Signals) -> None:  # on the relay thread: may take locks
            log.info("signal %s: leaving at the next commit", signum.name)
            self._leave_requested.set()

        return relay_signals((signal.SIGTERM, signal.SIGINT), on_signal, "elastic-signals",
                             join_timeout=self._settings.timeouts.shutdown,
                             mark=self._leave_requested)
