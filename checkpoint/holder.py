"""Which job holds a checkpoint URL: the record ``holder.json`` under it, with a heartbeat.

A job claims its URL at start and renews the claim while it runs; a second job (another job id)
finds a fresh claim and is refused with the holder's name, while a claim whose heartbeat is
older than ``stale_after`` (its job died without releasing it) is taken over. The first claim on
a URL is a conditional create (``Storage.create_bytes``), so two jobs starting at once cannot
both get it. This module reads and writes the record; it never starts a thread (the caller
renews) and knows nothing of checkpoints or fencing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

from elastic.checkpoint.backend import Storage
from elastic.checkpoint.errors import CheckpointHeldError

logger = logging.getLogger(__name__)
HOLDER_NAME = "holder.json"


@dataclass(frozen=True)
class Holder:
    """The record of the job that holds a URL.

    Attributes:
        job_id: the holding job.
        host: the machine of the process that wrote the record last.
        pid: that process.
        heartbeat: when it wrote it, seconds since the Unix epoch (its clock).
    """

    job_id: str
    host: str
    pid: int
    heartbeat: float

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder | None:
        """The record in ``data``; None when it is not one (a torn or foreign file)."""
        try:
            doc = json.loads(data)
            return cls(str(doc["job_id"]), str(doc["host"]), int(doc["pid"]),
                       float(doc["heartbeat"]))
        except (ValueError, KeyError, TypeError):
            return None


class UrlClaim:
    """One process's claim on a checkpoint URL for its job.

    Args:
        storage: the checkpoint root.
        job_id: the claiming job.
        stale_after: how old a heartbeat may be before its claim counts as abandoned.
        clock: seconds since the Unix epoch (``time.time``; tests pass their own).
    """

    def __init__(self, storage: Storage, job_id: str, stale_after: timedelta,
                 clock: Callable[[], float] = time.time) -> None:
        if stale_after <= timedelta(0):
            raise ValueError(f"stale_after ({stale_after}) must be positive.")
        self._storage = storage
        self._job_id = job_id
        self._stale_after = stale_after
        self._clock = clock
        self._path = storage.join(HOLDER_NAME)
        self._me = (socket.gethostname(), os.getpid())

    def acquire(self) -> None:
        """Claims the URL for this job, unless another job holds it with a fresh heartbeat.

        Raises:
            CheckpointHeldError: another job's claim is fresh (its name and age in the text).
            OSError: the storage failed (after the retries of transient errors).
        """
        for _ in range(2):  # a second round only after a lost race to create the record
            current = self.holder()
            if current is not None:
                self._refuse_if_held(current)
                if current.job_id != self._job_id:
                    logger.warning("taking over checkpoint URL %s from job %r, whose last "
                                   "heartbeat is %.0f s old", self._url, current.job_id,
                                   self._clock() - current.heartbeat)
                self._storage.write_bytes(self._path, self._record().to_json())
                return
            try:
                self._storage.create_bytes(self._path, self._record().to_json())
                return
            except FileExistsError:
                continue  # another job created it first: read what it wrote
        self._refuse_if_held(self.holder())

    def renew(self) -> bool:
        """Writes a fresh heartbeat, unless another job holds the URL now.

        Returns:
            False when another job took the URL over (this job's heartbeat was stale).

        Raises:
            OSError: the storage failed (after the retries of transient errors).
        """
        current = self.holder()
        if current is not None and current.job_id != self._job_id:
            return False
        self._storage.write_bytes(self._path, self._record().to_json())
        return True

    def release(self) -> None:
        """Removes the record if this process wrote it last (another node of the job renews
        its own).

        Raises:
            OSError: the storage failed (after the retries of transient errors).
        """
        current = self.holder()
        if current is not None and (current.host, current.pid) == self._me:
            self._storage.remove(self._path)

    def holder(self) -> Holder | None:
        """The record under the URL (None: none, or not a record)."""
        try:
            return Holder.from_json(self._storage.read_bytes(self._path))
        except FileNotFoundError:
            return None

    def _refuse_if_held(self, current: Holder | None) -> None:
        if current is None or current.job_id == self._job_id:
            return
        age_s = self._clock() - current.heartbeat
        if age_s > self._stale_after.total_seconds():
            return
        raise CheckpointHeldError(
            f"checkpoint URL {self._url} is in use by job {current.job_id!r} (host "
            f"{current.host}, pid {current.pid}, heartbeat {max(age_s, 0):.0f} s ago). Stop "
            f"that job, resume it with --job-id {current.job_id}, give this job its own URL, "
            f"or, if that job is dead, wait until its claim is {self._stale_after} old "
            "(ELASTIC_CHECKPOINT_CLAIM).", holder=current)

    def _record(self) -> Holder:
        return Holder(self._job_id, self._me[0], self._me[1], self._clock())

    @property
    def _url(self) -> str:
        return self._storage.url_of(self._storage.root)
