"""CheckpointStore: durable, fenced, retained checkpoints under one fsspec URL.

Owns the layout ``{url}/{step:012d}/`` (the payload, in a file of the writer's own, first;
``manifest.json`` last), which directories count as checkpoints (a valid manifest, all its files
there; written by it or by each rank), retention, torn-write cleanup, fencing, and
``save_async``'s one background writer. It knows nothing about process groups, etcd or training
objects.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, NoReturn

from elastic.checkpoint.backend import DEFAULT_RETRY_FOR, Storage, resolve_filesystem
from elastic.checkpoint.errors import (CheckpointError, CheckpointFencedError,
                                       CheckpointRaceError, CheckpointWriteError)
from elastic.checkpoint.fence import check_fence, check_fence_after, race_lost
from elastic.checkpoint.listing import CheckpointRef, Scan, scan_checkpoints
from elastic.checkpoint.manifest import (MANIFEST_NAME, PAYLOAD_FORMAT, FileEntry, Manifest,
                                        checked_metadata, step_dir_name)
from elastic.checkpoint.payload import HostStaging, new_payload_name, to_host, write_payload
from elastic.checkpoint.reading import LoadedCheckpoint, newest_readable, read_checkpoint
from elastic.checkpoint.retention import Retention

logger = logging.getLogger(__name__)
#: Storage failures that a write translates into CheckpointWriteError.
_WRITE_FAILURES = (OSError, RuntimeError, ValueError)


class CheckpointStore:
    """Saves and loads checkpoints under one fsspec URL.

    Args:
        url: Local path or fsspec URL of the checkpoint root (``s3://bucket/run-7`` ...).
        keep: How many complete checkpoints to keep (older ones are deleted once a newer one is
            complete); ``None`` keeps all.
        storage_options: Passed to the fsspec filesystem (credentials, ``endpoint_url`` ...).
        retry_for: How long one storage call retries transient errors (a dropped connection, a
            timeout) before its error is raised; ``backend.DEFAULT_RETRY_FOR`` (60 s) unless
            given.

    Raises:
        ValueError: ``keep`` is not a positive int or None, or ``retry_for`` is not positive.
        CheckpointBackendError: The URL's scheme is unknown or its package is not installed.
    """

    def __init__(self, url: str, keep: int | None = 3,
                 storage_options: Mapping[str, Any] | None = None,
                 retry_for: timedelta = DEFAULT_RETRY_FOR) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep ({keep!r}) must be an int >= 1, or None to keep all.")
        self._storage_options = dict(storage_options or {})
        fs, root = resolve_filesystem(url, self._storage_options)
        self._storage = Storage(fs, root, retry_for)
        self._url = url
        self._keep = keep
        self._retention = Retention(self._storage, keep, url)
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None  # the in-flight save_async
        self._writing_step: int | None = None
        self._staging = HostStaging()
        self._closed = False

    @property
    def url(self) -> str:
        """The checkpoint root URL as given."""
        return self._url

    def __repr__(self) -> str:
        return f"CheckpointStore(url={self._url!r}, keep={self._keep})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info: object) -> None:  # closes: waits for the write in flight
        self.close()

    # -- writing -----------------------------------------------------------------------------

    def save(self, step: int, state_dict: Any, metadata: Mapping[str, Any] | None = None,
             before_publish: Callable[[], None] | None = None) -> CheckpointRef:
        """Writes a checkpoint and returns once it is complete (payload, then manifest).

        Waits for an in-flight ``save_async`` first. CPU tensors are written in place, so do not
        modify them until this returns.

        Args:
            step: Optimizer step; names the directory. Must not already hold a checkpoint.
            state_dict: Nested dicts/lists/tuples of tensors and plain values.
            metadata: JSON-able values; ``epoch``, ``world_size`` and ``generation`` (ints) are
                also recorded as manifest fields, ``generation`` fences older writers.
            before_publish: called right before the manifest is written (after the payload);
                it raises ``CheckpointFencedError`` when this writer may no longer publish.

        Returns:
            The new checkpoint.

        Raises:
            ValueError: Bad step or metadata. TypeError: a value that cannot be saved.
            CheckpointError: ``step`` already has a checkpoint, or the store is closed.
            CheckpointFencedError: A newer generation has already published.
            CheckpointRaceError: Another writer published ``step`` first (a conditional
                create lost; its checkpoint is left as it is).
            CheckpointWriteError: The storage failed; earlier checkpoints are untouched.
        """
        meta = checked_metadata(step, metadata)
        with self._lock:
            self._check_open()
            self._wait_in_flight(None)
            payload = to_host(state_dict)
            return self._write(step, payload, meta, before_publish)

    def save_async(self, step: int, state_dict: Any, metadata: Mapping[str, Any] | None = None,
                   before_publish: Callable[[], None] | None = None) -> Future[CheckpointRef]:
        """Snapshots ``state_dict`` to host memory now and writes it in the background.

        At most one write is in flight: this first waits for the previous one. When it returns,
        the caller may modify its tensors freely.

        Args:
            step: As for :meth:`save`.
            state_dict: As for :meth:`save`.
            metadata: As for :meth:`save`.
            before_publish: As for :meth:`save`; called on the writer thread.

        Returns:
            A future resolving to the new checkpoint, or raising what :meth:`save` raises.

        Raises:
            ValueError: Bad step or metadata. TypeError: a value that cannot be saved.
            CheckpointError: The store is closed.
        """
        meta = checked_metadata(step, metadata)
        with self._lock:
            self._check_open()
            self._wait_in_flight(None)
            snapshot = self._staging.snapshot(state_dict)
            future: Future[CheckpointRef] = Future()
            # A daemon thread: a write that hangs (a stuck mount) never holds the process at
            # exit; whoever waits for it bounds the wait (``wait(timeout)``).
            self._writer = threading.Thread(
                target=self._write_into, name="checkpoint-writer", daemon=True,
                args=(future, step, snapshot, meta, before_publish))
            self._writer.start()
            return future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the in-flight asynchronous write, if any, for up to ``timeout`` (``None``:
        until it is done). Returns True if nothing is in flight any more."""
        self._wait_in_flight(None if timeout is None else timeout.total_seconds())
        writer = self._writer
        return writer is None or not writer.is_alive()

    def close(self) -> None:
        """Waits for the in-flight write and frees staging memory.

        Reading (``list``, ``latest``, ``load``) still works afterwards; saving does not.
        """
        with self._lock:
            self._closed = True
            self._wait_in_flight(None)
            self._staging.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed; create a new store to save again.")

    def _wait_in_flight(self, timeout_s: float | None) -> None:
        """Joins the writer thread: once it ended, its future's callbacks have run too."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout_s)

    def _write_into(self, future: Future[CheckpointRef], *args: Any) -> None:
        """Runs ``_write(*args)`` on the writer thread and settles ``future`` with its end."""
        future.set_running_or_notify_cancel()
        try:
            future.set_result(self._write(*args))
        except Exception as exc:  # noqa: BLE001 (handed to whoever holds the future)
            future.set_exception(exc)

    def _write(self, step: int, payload: Any, meta: dict[str, Any],
               before_publish: Callable[[], None] | None) -> CheckpointRef:
        step_dir = self._claim(step, meta)
        own = new_payload_name()  # never the file of another writer of this step
        self._writing_step = step
        try:
            try:
                files = {own: write_payload(self._storage, f"{step_dir}/{own}", payload)}
            except _WRITE_FAILURES as exc:
                self._failed_write(step, meta, exc, own)
            manifest = self._publish(step, files, meta, PAYLOAD_FORMAT, before_publish, own)
        finally:
            self._writing_step = None
        return self._published(step, manifest)

    # -- files written by others (every rank's shards of a sharded checkpoint) ---------------

    def open_step(self, step: int, metadata: Mapping[str, Any] | None = None) -> str:
        """Readies ``step``'s directory for files others write there (every rank's shards);
        :meth:`publish_files` then makes it a checkpoint. Returns the directory's URL.

        Raises:
            ValueError: bad step or metadata (as for :meth:`save`).
            CheckpointError: the step has a checkpoint, the store is closed, listing failed.
            CheckpointFencedError: a newer generation than ``metadata``'s has published.
        """
        meta = checked_metadata(step, metadata)
        with self._lock:
            self._check_open()
            self._claim(step, meta)
            return self._dir_url(step)

    def publish_files(self, step: int, files: Mapping[str, FileEntry],
                      metadata: Mapping[str, Any] | None, payload_format: str,
                      before_publish: Callable[[], None] | None = None) -> CheckpointRef:
        """Writes the manifest of the files already in ``step``'s directory (relative name to
        size and sha256, encoded as ``payload_format``), then applies retention; on failure the
        files are removed. ``metadata`` and ``before_publish`` are as for :meth:`save`.

        Raises:
            CheckpointFencedError: a newer generation published meanwhile.
            CheckpointRaceError: another writer published ``step`` first.
            CheckpointWriteError: the storage failed.
        """
        meta = checked_metadata(step, metadata)
        with self._lock:
            self._check_open()
            manifest = self._publish(step, dict(files), meta, payload_format, before_publish,
                                     own=None)
            return self._published(step, manifest)

    def discard_step(self, step: int) -> None:
        """Removes ``step``'s files unless they are a published checkpoint."""
        with self._lock:
            self._discard_unpublished(step)

    def _discard_unpublished(self, step: int) -> None:
        """Removes ``step``'s directory unless it holds a published checkpoint (another
        writer's, when this one lost a race or was fenced)."""
        if all(ref.step != step for ref in self._scan().valid):
            self._storage.discard(self._storage.join(step_dir_name(step)))

    storage = property(lambda self: self._storage, doc="The root and its retried I/O.")
    storage_options = property(lambda self: self._storage_options,
                               doc="The fsspec options given (for writers opening the URL).")

    def _claim(self, step: int, meta: dict[str, Any]) -> str:
        """The step's directory, checked free and unfenced; a torn write's manifest removed (files
        with no manifest may be another writer's in progress: retention removes leftovers)."""
        scan = self._scan()
        if any(ref.step == step for ref in scan.valid):
            raise CheckpointError(
                f"step {step} already has a checkpoint at {self._dir_url(step)}; checkpoints are "
                f"never overwritten: save under a new step, or delete that directory first.")
        check_fence(scan, meta.get("generation"), step, self._url)
        step_dir = self._storage.join(step_dir_name(step))
        if step in scan.bad_manifests:
            self._storage.discard(f"{step_dir}/{MANIFEST_NAME}")  # a torn write's
        return step_dir

    def _published(self, step: int, manifest: Manifest) -> CheckpointRef:
        logger.info("checkpoint step %d written to %s", step, self._dir_url(step))
        try:
            self._retention.apply(self._scan(), self._writing_step)
        except CheckpointError as exc:  # published already; retention retries on the next save
            logger.warning("retention after step %d failed: %s", step, exc)
        return CheckpointRef(step, self._dir_url(step), manifest)

    def _publish(self, step: int, files: dict[str, FileEntry], meta: dict[str, Any],
                 payload_format: str, before_publish: Callable[[], None] | None,
                 own: str | None) -> Manifest:
        step_dir = self._storage.join(step_dir_name(step))
        try:
            manifest = Manifest(step=step, epoch=meta.get("epoch"),
                                world_size=meta.get("world_size"),
                                generation=meta.get("generation"), metadata=meta,
                                files=files, payload_format=payload_format)
            if manifest.generation is not None:  # re-check: a newer one may have published
                check_fence(self._scan(), manifest.generation, step, self._url)
            if before_publish is not None:
                before_publish()
            self._create_manifest(step, f"{step_dir}/{MANIFEST_NAME}", manifest)
            self._storage.sync_dir(step_dir)
            self._storage.sync_dir(self._storage.root)
            return manifest
        except CheckpointRaceError:
            if own is not None:  # the winner's checkpoint stays as it is; this file is ours
                self._storage.discard(f"{step_dir}/{own}")
            raise
        except CheckpointFencedError:
            self._clean_up(step, own)
            raise
        except _WRITE_FAILURES as exc:
            self._failed_write(step, meta, exc, own)

    def _create_manifest(self, step: int, path: str, manifest: Manifest) -> None:
        """Creates the manifest, never over one that is there (``Storage.create_bytes``);
        ``CheckpointRaceError`` when another writer published ``step`` first."""
        try:
            self._storage.create_bytes(path, manifest.to_json())
        except FileExistsError as exc:
            raise race_lost(step, manifest.generation, self._dir_url(step),
                            self._published_at(step)) from exc

    def _published_at(self, step: int) -> CheckpointRef | None:
        """The complete checkpoint of ``step`` (None: none, or the storage cannot be listed)."""
        try:
            return next((r for r in self._scan().valid if r.step == step), None)
        except CheckpointError:  # the race's error says who won when it can
            return None

    def _failed_write(self, step: int, meta: dict[str, Any], exc: Exception,
                      own: str | None) -> NoReturn:
        self._clean_up(step, own)
        check_fence_after(self._scan, exc, meta.get("generation"), step, self._url)
        raise CheckpointWriteError(
            f"writing checkpoint step {step} to {self._dir_url(step)} failed: {exc!r}. "
            f"Earlier checkpoints are intact; training can go on and save again.") from exc

    def _clean_up(self, step: int, own: str | None) -> None:
        """Removes an unpublished write's payload ``own`` (None: every rank's, the directory,
        unless a newer writer published the step meanwhile)."""
        if own is None:
            try:
                self._discard_unpublished(step)
            except CheckpointError as exc:  # unlisted, nothing is removed: retention will
                logger.warning("left step %d's unpublished files in place: %s", step, exc)
            return
        step_dir = self._storage.join(step_dir_name(step))
        self._storage.discard(f"{step_dir}/{own}")
        self._storage.remove_empty_dir(step_dir)

    # -- reading -----------------------------------------------------------------------------

    def list(self) -> list[CheckpointRef]:
        """Returns the complete checkpoints, oldest first by (generation, step).

        A checkpoint is complete when its manifest is valid and every file it lists exists with
        the recorded size; checksums are verified by :meth:`load`.

        Raises:
            CheckpointError: The storage failed while listing.
        """
        return self._scan().valid

    def latest(self) -> CheckpointRef | None:
        """Returns the newest complete checkpoint, or None if there is none.

        Raises:
            CheckpointError: The storage failed while listing.
        """
        valid = self._scan().valid
        return valid[-1] if valid else None

    def load(self, ref: CheckpointRef | None = None) -> LoadedCheckpoint:
        """Reads a checkpoint, verifying its checksums; never runs code from the file.

        Args:
            ref: The checkpoint to read. ``None`` reads the newest one that verifies, skipping
                (with a warning) newer ones that are torn or corrupt; a newer one that the
                storage fails to read stops the load (it may be intact).

        Returns:
            The checkpoint's state dict (tensors on the CPU) and metadata.

        Raises:
            CheckpointNotFoundError: ``ref`` is None and no checkpoint exists that verifies.
            CheckpointCorruptError: ``ref`` was given and does not verify or decode.
            CheckpointUnsafeError: ``ref`` was given and its payload would run code.
            CheckpointReadError: the storage failed while reading ``ref``, or (``ref`` None)
                while reading the newest checkpoint that did not turn out corrupt.
            CheckpointError: The storage failed while listing.
        """
        if ref is not None:
            return self._read(ref)
        scan = self._scan()
        return newest_readable(scan.valid, self._read, self.skipped_newer(scan), self._url)

    def scan(self) -> Scan:
        """Lists the root once (complete checkpoints, and why others are not); raises
        ``CheckpointError`` when the storage fails while listing."""
        return self._scan()

    def skipped_newer(self, scan: Scan) -> list[str]:
        """Logs and returns why the directories newer than every checkpoint in ``scan`` are not
        checkpoints (this store's own write in progress aside)."""
        skipped = [f"{self._dir_url(s)}: {why}" for s, why in sorted(scan.invalid.items())
                   if s != self._writing_step
                   and (not scan.valid or s > max(r.step for r in scan.valid))]
        for reason in skipped:
            logger.warning("skipping checkpoint %s", reason)
        return skipped

    def _read(self, ref: CheckpointRef) -> LoadedCheckpoint:
        return read_checkpoint(self._storage, ref)

    def _dir_url(self, step: int) -> str:
        return self._storage.url_of(self._storage.join(step_dir_name(step)))

    def _scan(self) -> Scan:
        try:
            return scan_checkpoints(self._storage)
        except OSError as exc:
            raise CheckpointError(
                f"listing checkpoints under {self._url} failed: {exc!r}. Check that the storage "
                f"is reachable and the credentials allow listing and reading.") from exc
