"""Durable commits of an elastic job: rank 0 writes them, formation finds the newest one.

Owns the job's ``CheckpointStore``. Writes are asynchronous (the snapshot is taken before
``write`` returns; at most one is in flight); a failed write is reported (event, warning,
``last_error``) and training goes on with the previous checkpoint intact. The fencing generation
is the round number, so a member of an old round can never publish over a newer one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

from elastic.checkpoint import (CheckpointError, CheckpointNotFoundError, CheckpointRef,
                                CheckpointStore, check_compatible)
from elastic.checkpoint.backend import DEFAULT_RETRY_FOR
from elastic.events import EventLog

log = logging.getLogger(__name__)


class DurableCommits:
    """The checkpoint side of one worker.

    Args:
        url: any fsspec URL (local path, file://, s3://, memory://, ...).
        events: where writes and failures are recorded.
        keep: how many complete checkpoints to keep.
        retry_for: how long a failing storage operation is retried.

    Raises:
        CheckpointBackendError: the URL's scheme is unknown or its fsspec package is missing.
    """

    def __init__(self, url: str, events: EventLog | None = None, keep: int = 3,
                 retry_for: timedelta = DEFAULT_RETRY_FOR) -> None:
        self.store = CheckpointStore(url, keep=keep, retry_for=retry_for)
        self.url = url
        self.events = events
        self.last_error: CheckpointError | None = None
        self.written = 0
        self._published: Callable[[CheckpointRef], None] | None = None

    def on_published(self, callback: Callable[[CheckpointRef], None]) -> None:
        """Calls ``callback(ref)`` (on the writer thread) after each completed write."""
        self._published = callback

    def write(self, payload: Mapping[str, Any], version: int, metadata: dict[str, Any]) -> None:
        """Starts writing ``payload`` as checkpoint ``version``; returns once it is snapshotted."""
        started = time.monotonic()
        try:
            future = self.store.save_async(version, payload, metadata)
        except CheckpointError as exc:
            self._failed(version, exc)
            return
        blocked_s = time.monotonic() - started
        future.add_done_callback(lambda f: self._done(f, version, started, blocked_s))

    def _done(self, future: Future[CheckpointRef], version: int, started: float,
              blocked_s: float) -> None:
        exc = future.exception()
        if exc is not None:
            if isinstance(exc, CheckpointError):
                self._failed(version, exc)
                return
            raise exc
        ref = future.result()
        self.written += 1
        if self.events:
            self.events.emit("checkpoint_written", version=version, url=ref.url,
                             blocked_s=blocked_s, write_s=time.monotonic() - started)
        if self._published is not None:
            self._published(ref)

    def _failed(self, version: int, exc: CheckpointError) -> None:
        self.last_error = exc
        log.warning("durable commit of version %d failed (training goes on; the previous "
                    "checkpoint stays valid): %s", version, exc)
        if self.events:
            self.events.emit("checkpoint_failed", version=version, error=str(exc)[:300])

    def latest_version(self) -> int:
        """The version of the newest complete checkpoint, 0 when there is none."""
        ref = self.store.latest()
        return ref.step if ref else 0

    def load_latest(self, live: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Reads the newest checkpoint that verifies (older ones if newer are corrupt).

        Args:
            live: the committed payload of this worker, to check the loaded one against.

        Returns:
            The payload, or None when no valid checkpoint exists.

        Raises:
            CheckpointIncompatibleError: a model's keys or shapes differ from the live ones.
        """
        try:
            loaded = self.store.load()
        except CheckpointNotFoundError as exc:
            log.warning("no valid checkpoint to resume from: %s", exc)
            return None
        payload = loaded.state_dict
        _check_models(payload, live)
        if self.events:
            self.events.emit("checkpoint_loaded", version=loaded.ref.step, url=loaded.ref.url,
                             epoch=loaded.ref.epoch)
        return payload

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
