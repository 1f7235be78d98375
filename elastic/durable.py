"""Durable commits of an elastic job: rank 0 writes them, formation finds the newest one.

Owns the job's ``CheckpointStore``. Writes are asynchronous (the snapshot is taken before
``write`` returns; at most one is in flight); a failed write is reported (event, warning,
``last_error``) and training goes on with the previous checkpoint intact.

Fencing: every manifest carries a generation, and the store refuses a writer older than the
newest generation it holds. The generation is ``epoch * ROUNDS_PER_EPOCH + round``. Round numbers
only grow inside one etcd; the *fencing epoch* is claimed in etcd once per job and etcd (one
above every epoch the checkpoint URL holds), so a resume on a fresh etcd, a new job id or an etcd
that lost its data still writes a higher generation than everything before it. Right before a
manifest is written the writer confirms its lease with etcd, so a rank 0 frozen past its lease
never publishes after the job moved on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, TypeVar

import torch

from elastic.checkpoint import (CheckpointError, CheckpointFencedError, CheckpointNotFoundError,
                                CheckpointRef, CheckpointStorageError, CheckpointStore,
                                check_compatible)
from elastic.checkpoint.manifest import DCP_FORMAT
from elastic.checkpoint.reading import LoadedCheckpoint, newest_readable, read_sharded_payload
from elastic.foundation.daemon_call import DaemonCall
from elastic.foundation.errors import (EtcdUnavailableError, FencingContestedError,
                                       UnfinishedWriteError)
from elastic.foundation.events import EventLog
from elastic.foundation.timeouts import Timeouts

log = logging.getLogger(__name__)
T = TypeVar("T")

ROUNDS_PER_EPOCH = 1 << 32


def fencing_generation(epoch: int, round_: int) -> int:
    """The fencing token of ``round_`` in fencing epoch ``epoch``."""
    return epoch * ROUNDS_PER_EPOCH + round_


def next_epoch(refs: list[CheckpointRef]) -> int:
    """One above the newest fencing epoch among ``refs`` (1 when none has one)."""
    return 1 + max((r.generation // ROUNDS_PER_EPOCH for r in refs if r.generation is not None),
                   default=0)


class DurableCommits:
    """The checkpoint side of one worker.

    Args:
        url: any fsspec URL (local path, file://, s3://, memory://, ...).
        events: where writes and failures are recorded.
        keep: how many complete checkpoints to keep.
        retry_for: how long a failing storage operation is retried (the job's
            ``Timeouts.storage_retry``).
        job_id: recorded in every manifest, to name this job to another one that is fenced.

    Raises:
        CheckpointBackendError: the URL's scheme is unknown or its fsspec package is missing.
    """

    def __init__(self, url: str, events: EventLog | None = None, keep: int = 3,
                 retry_for: timedelta = Timeouts().storage_retry,
                 job_id: str | None = None) -> None:
        self.store = CheckpointStore(url, keep=keep, retry_for=retry_for)
        self._hung_after = retry_for  # a write still running this long after the next is due
        self.url = url
        self.job_id = job_id
        self.events = events
        self.last_error: Exception | None = None
        self.sharded = False  # a sharded job's checkpoints: every rank's shards (DCP)
        self.written = 0
        self._published: Callable[[CheckpointRef], None] | None = None
        self.generation: int | None = None
        self._round = 0
        self._claim_epoch: Callable[[int], int] | None = None
        self._confirm_lease: Callable[[], bool] | None = None
        self._caller: threading.Thread | None = None  # the storage call of ``_answered``

    def arm(self, round_: int, claim_epoch: Callable[[int], int],
            confirm_lease: Callable[[], bool], floor: int | None) -> None:
        """Takes the fencing token of a newly formed round, on the rank that writes.

        Args:
            round_: the round's number.
            claim_epoch: returns the job's fencing epoch, claiming the given floor if none.
            confirm_lease: asks etcd whether the lease of the identity that formed this round
                is still alive (not a later identity's: ``Cluster.lease_confirmer``).
            floor: ``next_epoch`` of the store, when it was just listed; None claims it at
                the first write instead.
        """
        self._round = round_
        self._claim_epoch = claim_epoch
        self._confirm_lease = confirm_lease
        self.generation = None
        if floor is None:
            return
        try:
            self.generation = fencing_generation(claim_epoch(floor), round_)
        except FencingContestedError as exc:  # claimed again at the first write, which fails
            log.warning("round %d: %s", round_, exc)

    def _token(self) -> int | None:
        """The round's fencing generation (claimed now if the formation could not list the
        store); None outside a job (never armed), where there is nobody to fence."""
        if self._claim_epoch is None:
            return None
        if self.generation is None:
            floor = next_epoch(self._answered(self.store.list, "listing"))
            self.generation = fencing_generation(self._claim_epoch(floor), self._round)
        return self.generation

    def publish_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """``metadata`` with this round's fencing generation and the job id added (a sharded
        write calls it on every rank; only the writing rank is armed with a generation).

        Raises:
            CheckpointError: the store could not be listed to claim the generation.
            EtcdUnavailableError: the fencing epoch could not be claimed.
            FencingContestedError: something other than the job's members writes its key.
        """
        token = self._token()
        if token is not None:
            metadata = {**metadata, "generation": token}
        if self.job_id is not None:
            metadata = {**metadata, "job_id": self.job_id}
        return metadata

    def before_publish(self) -> None:
        """Refuses to publish once this member's lease is gone (``CheckpointFencedError``)."""
        self._before_publish()

    def record_failure(self, version: int, exc: Exception) -> None:
        """Records a write that did not land (as a failed background write is recorded)."""
        self._failed(version, exc)

    def _before_publish(self) -> None:
        """Refuses to publish once this member's lease is gone (a frozen rank 0 woke up)."""
        if self._confirm_lease is not None and not self._confirm_lease():
            raise CheckpointFencedError(
                "this member's lease expired before its checkpoint was published: it is no "
                "longer rank 0 of the job, so the checkpoint was discarded.")

    def on_published(self, callback: Callable[[CheckpointRef], None]) -> None:
        """Calls ``callback(ref)`` (on the writer thread) after each completed write."""
        self._published = callback

    def write(self, payload: Mapping[str, Any], version: int, metadata: dict[str, Any]) -> None:
        """Starts writing ``payload`` as checkpoint ``version``; returns once it is snapshotted.

        At most one write is in flight: this waits for the previous one, but for no longer than
        one storage call may retry (``retry_for``); a write still running then is taken as hung,
        and this commit is skipped and recorded, so that hung storage never holds the job up.
        """
        if not self.store.wait(self._hung_after):
            log.warning("durable commit of version %d skipped: the previous write has been "
                        "running for over %s; check the checkpoint storage, or raise "
                        "ELASTIC_STORAGE_RETRY if its writes are this slow", version,
                        self._hung_after)
            if self.events:
                self.events.emit("checkpoint_skipped", version=version)
            return
        started = time.monotonic()
        try:
            metadata = self.publish_metadata(metadata)
            future = self.store.save_async(version, payload, metadata, self._before_publish)
        except (CheckpointError, EtcdUnavailableError, FencingContestedError) as exc:
            self._failed(version, exc)
            return
        blocked_s = time.monotonic() - started
        future.add_done_callback(lambda f: self._done(f, version, started, blocked_s))

    def _done(self, future: Future[CheckpointRef], version: int, started: float,
              blocked_s: float) -> None:
        exc = future.exception()
        if exc is not None:  # of any type: a writer-thread error must never go unrecorded
            self._failed(version, exc)
            return
        ref = future.result()
        self.written += 1
        if self.events:
            self.events.emit("checkpoint_written", version=version, url=ref.url,
                             blocked_s=blocked_s, write_s=time.monotonic() - started,
                             bytes=sum(entry.size for entry in ref.manifest.files.values()))
        if self._published is not None:
            self._published(ref)

    def _failed(self, version: int, exc: Exception) -> None:
        """Records a write that did not land. A fenced one is no failure of the storage when a
        newer rank 0 of this job took over (it is not ``last_error``, which says nothing was
        saved); it is one when another job, or another claim of this job's fencing epoch,
        wrote to the URL while this worker is still current (``_overtaken``)."""
        fenced = isinstance(exc, CheckpointFencedError)
        if fenced and self._overtaken(exc):
            self._overtaken_by(version, exc)
            return
        if not fenced:
            self.last_error = exc
        log.warning("durable commit of version %d %s (training goes on; the previous "
                    "checkpoint stays valid): %s: %s", version,
                    "was discarded" if fenced else "failed", type(exc).__name__, exc)
        if self.events:
            self.events.emit("checkpoint_failed", version=version, fenced=fenced, stale=False,
                             error=str(exc)[:300])

    def _overtaken(self, exc: CheckpointFencedError) -> bool:
        """Whether the store refused this worker's write for a checkpoint of another job or
        another fencing epoch while this worker's lease is alive: two writers on one URL."""
        newer = exc.newer
        if not isinstance(newer, CheckpointRef) or newer.generation is None:
            return False
        if self.generation is None or (self._confirm_lease and not self._confirm_lease()):
            return False
        other_job = newer.metadata.get("job_id")
        return (newer.generation // ROUNDS_PER_EPOCH != self.generation // ROUNDS_PER_EPOCH
                or (other_job is not None and self.job_id is not None
                    and other_job != self.job_id))

    def _overtaken_by(self, version: int, exc: CheckpointFencedError) -> None:
        """Records a write refused for another writer's newer checkpoint: a failure, loudly."""
        newer = exc.newer
        assert isinstance(newer, CheckpointRef)
        other_job = newer.metadata.get("job_id")
        self.last_error = exc
        log.warning("durable commit of version %d was refused: job %r wrote generation %s to "
                    "%s while this worker (job %r, generation %s) is still current, so nothing "
                    "of this job is saved there. Two jobs write to one checkpoint URL: stop "
                    "one, or give each its own URL.", version, other_job, newer.generation,
                    self.url, self.job_id, self.generation)
        if self.events:
            self.events.emit("checkpoint_failed", version=version, fenced=True, stale=True,
                             level="error", newer_job=other_job,
                             newer_generation=newer.generation, error=str(exc)[:300])

    def survey(self) -> tuple[int, int]:
        """Lists the store once: the newest complete checkpoint's version (0: none) and the
        fencing epoch a fresh etcd must claim (``next_epoch``).

        Raises:
            CheckpointError: the storage failed while listing, or did not answer within
                twice its retry time (``_answered``).
        """
        refs = self._answered(self.store.list, "listing")
        return (refs[-1].step if refs else 0), next_epoch(refs)

    def load_latest(self, live: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Reads the newest checkpoint that verifies (older ones, with a warning, if newer are
        corrupt; a newer one whose read fails is not skipped: it may be intact).

        Args:
            live: the committed payload of this worker, to check the loaded one against.

        Returns:
            The payload, or None when no valid checkpoint exists.

        Raises:
            CheckpointIncompatibleError: a model's keys or shapes differ from the live ones.
            CheckpointError: the storage failed while listing, or while reading the newest
                checkpoint that is not corrupt, or did not answer in time (``_answered``).
        """
        try:
            loaded = self._answered(self._newest, "loading the newest checkpoint of")
        except CheckpointNotFoundError as exc:
            log.warning("no valid checkpoint to resume from: %s", exc)
            return None
        payload = loaded.state_dict
        _check_models(payload, live)
        if self.events:
            self.events.emit("checkpoint_loaded", version=loaded.ref.step, url=loaded.ref.url,
                             epoch=loaded.ref.epoch)
        return payload

    def _newest(self) -> LoadedCheckpoint:
        """The newest checkpoint that reads; of a sharded job, only its small state (every
        rank loads the shards into the new formation afterwards)."""
        if not self.sharded:
            return self.store.load()
        scan = self.store.scan()
        refs = [r for r in scan.valid if r.manifest.payload_format == DCP_FORMAT]
        return newest_readable(refs, lambda ref: read_sharded_payload(self.store.storage, ref),
                               self.store.skipped_newer(scan), self.url)

    def _answered(self, call: Callable[[], T], what: str) -> T:
        """``call()``'s result, for no longer than twice the time one storage call may retry:
        a storage that never answers (a black-holed endpoint, a hung mount) costs that long
        and a ``CheckpointStorageError``, never the whole job waiting on its rank 0. The call
        runs on a daemon thread, left to end on its own when it does not answer; while it has
        not, no other is started (one thread at most, however many rounds form meanwhile).
        """
        if self._caller is not None and self._caller.is_alive():
            raise CheckpointStorageError(
                f"{what} {self.url} was not tried: the storage has not answered an earlier call "
                "yet. Check that it is reachable from this machine, or raise "
                "ELASTIC_STORAGE_RETRY if it is this slow.")
        caller = DaemonCall(call, "checkpoint-call")
        self._caller = caller.thread
        deadline = self._hung_after * 2
        try:
            return caller.result(deadline.total_seconds())
        except TimeoutError:
            raise CheckpointStorageError(
                f"{what} {self.url} did not answer within {deadline}. Check that the storage "
                "is reachable from this machine, or raise ELASTIC_STORAGE_RETRY if it is this "
                "slow.") from None

    def finish(self, timeout: timedelta) -> UnfinishedWriteError | None:
        """Waits for the in-flight write for up to ``timeout``; closes the store if it ended.

        Returns:
            None, or (the write still running at the deadline, abandoned: its thread is a
            daemon, so it never holds the process at exit) the error for ``run()`` to raise.
        """
        if self.store.wait(timeout):
            self.store.close()
            return None
        log.error("the last checkpoint write to %s did not finish within %s", self.url, timeout)
        if self.events:
            self.events.emit("checkpoint_unfinished", url=self.url,
                             waited_s=timeout.total_seconds())
        return UnfinishedWriteError(
            f"the last checkpoint write did not finish within {timeout} (storage {self.url}); "
            "the checkpoint before it is intact. Check the storage, or raise "
            "ELASTIC_FINAL_WRITE_TIMEOUT if its writes are this slow.")

    def close(self) -> None:
        """Waits for the in-flight write and closes the store."""
        self.store.wait()
        self.store.close()


def _check_models(payload: Mapping[str, Any], live: Mapping[str, Any]) -> None:
    """Checks keys and tensor shapes of every object whose state is a flat tensor dict (models).

    Optimizer states legitimately differ in shape before their first step, so they are left to
    their own ``load_state_dict``.
    """
    loaded_objects = payload.get("objects", {})
    for name, state in live.get("objects", {}).items():
        if _is_tensor_dict(state) and name in loaded_objects:
            try:
                check_compatible(loaded_objects[name], state)
            except CheckpointError as exc:
                raise type(exc)(f"object {name!r}: {exc}") from exc


def _is_tensor_dict(state: Any) -> bool:
    return isinstance(state, Mapping) and bool(state) and all(
        isinstance(v, torch.Tensor) for v in state.values())
